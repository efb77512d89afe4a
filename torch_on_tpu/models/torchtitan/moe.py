"""torchtitan's MoE layers: what a token passes through (for FLOPs and the decoder shape), and the
auxiliary-loss-free load balancing its trainer hooks before each optimizer step."""

from __future__ import annotations

import jax.numpy as jnp


def is_moe(module) -> bool:
  return hasattr(module, "router") and hasattr(module, "routed_experts")


def _routed(moe):
  """(routed expert params, experts, experts per token) of a torchtitan MoE layer."""
  experts = moe.routed_experts.inner_experts
  return sum(p.numel() for p in experts.parameters()), moe.router.num_experts, moe.router.top_k


def inactive_expert_params(moe) -> int:
  params, experts, top_k = _routed(moe)
  return params * (experts - top_k) // experts


def ffn_width(block) -> int:
  """Hidden units a token passes through in one block's FFN or MoE."""
  width = 0
  for m in block.modules():
    if is_moe(m):
      params, experts, top_k = _routed(m)
      width += params // experts // (3 * m.router.gate.in_features) * top_k  # gate, up, down: 3 dim-by-hidden
      if m.shared_experts is not None:
        width += m.shared_experts.w1.out_features
      return width
  ff = getattr(block, "feed_forward", None)
  return ff.w1.out_features if ff is not None and hasattr(ff, "w1") else 0


def load_balancing(module):
  """torchtitan's auxiliary-loss-free MoE load balancing, the family's `optimizer_pre_step`: the
  step pre-hook torchtitan's trainer registers for every MoE model (`register_moe_load_balancing_hook`, the only
  `post_optimizer_build_fn` of torchtitan 0.3.0's registries): per MoE layer with a
  `load_balance_coeff`, `expert_bias_E += δ - mean(δ)` with `δ = coeff ·
  sign(mean(n) - n)` for the token counts `n = tokens_per_expert_E` the forwards
  accumulated (over the global batch, as torchtitan's all-reduce makes them), then
  the counts reset. Only the blocks of `layers`, those torchtitan's hook walks: a
  multi-token-prediction layer's MoE (DeepSeek-V3's `mtp_layers`) keeps its bias, and its
  counts grow, as in torchtitan."""
  layers = [
    (prefix, m.load_balance_coeff) for prefix, m in module.named_modules()
    if prefix.startswith("layers.") and is_moe(m) and getattr(m, "load_balance_coeff", None) is not None
  ]
  if not layers:
    return None

  def update(read):
    out = {}
    for prefix, coeff in layers:
      counts = read(f"{prefix}.tokens_per_expert_E").astype(jnp.float32)
      delta = coeff * jnp.sign(counts.mean() - counts)
      bias = read(f"{prefix}.expert_bias_E")
      out[f"{prefix}.expert_bias_E"] = (bias + (delta - delta.mean())).astype(bias.dtype)
      out[f"{prefix}.tokens_per_expert_E"] = jnp.zeros_like(read(f"{prefix}.tokens_per_expert_E"))
    return out

  return update
