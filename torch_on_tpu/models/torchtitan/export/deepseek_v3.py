"""torchtitan's DeepSeek-V3 as HF's DeepSeek-V2 or DeepSeek-V3, through torchtitan's adapter with the
changes HF's form needs (no expert bias for V2; latent norms at HF's eps; no multi-token-prediction
layers, which HF's DeepSeek does not have and its logits never read)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu.models.family import HFForm
from torch_on_tpu.models.torchtitan.export.adapter import hf_via_adapter, no_expert_bias, refuse_hf

# HF's DeepSeek latent norms (q_a_layernorm, kv_a_layernorm) take RMSNorm's default eps, not the config's.
_HF_LATENT_NORM_EPS = 1e-6


def _deepseek_hf_config(config):
  """HF's DeepSeek config for torchtitan's DeepSeek-V3 (and Kimi's text model, the same
  decoder): DeepSeek-V2's (transformers `deepseek_v2`) where it routes by softmax over all
  experts (torchtitan's debugmodel, 16B), DeepSeek-V3's (`deepseek_v3`) where it routes by
  sigmoid with the load-balancing bias, optionally group-limited (671B, Moonlight). Both are
  MLA with interleaved RoPE pairs (torchtitan's ComplexRoPE) and YaRN's softmax scale from
  `mscale_all_dim`; refuses in one sentence what neither can express."""
  import transformers
  from torchtitan.models.common.feed_forward import FeedForward
  from torchtitan.models.common.moe import GroupedExperts
  from torchtitan.models.common.rope import ComplexRoPE

  layers = config.layers
  attention = [layer.attention for layer in layers]
  first, rope = attention[0], attention[0].rope
  moes = [layer.moe for layer in layers if layer.moe is not None]
  dense = [layer.feed_forward for layer in layers if layer.moe is None]
  first_moe = len(dense)  # HF's first_k_dense_replace: dense layers first, MoE after
  moe = moes[0] if moes else None
  router = moe and moe.router
  norms = {layer.attention_norm.eps for layer in layers} | {layer.ffn_norm.eps for layer in layers} | {config.norm.eps}

  def mla(a):
    return (a.n_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.mscale,
            a.kv_norm.eps, a.q_norm.eps if a.q_lora_rank else None, dataclasses.replace(a.rope, max_seq_len=0))

  def routing(m):
    r = m.router
    return (m.num_experts, r.top_k, r.score_func, r.route_norm, r.route_scale, r.num_expert_groups, r.num_limited_groups,
            r.gate.bias, r._debug_force_load_balance, m.routed_experts.inner_experts.hidden_dim,
            m.shared_experts and m.shared_experts.w1.out_features, type(m.routed_experts.inner_experts))

  linears = [getattr(a, n) for a in attention for n in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo") if getattr(a, n) is not None]
  linears += [w for f in dense + [m.shared_experts for m in moes if m.shared_experts] for w in (f.w1, f.w2, f.w3)]
  problem = None
  if not moes:
    problem = "it has no MoE layers"
  elif any(layer.moe is None for layer in layers[first_moe:]):
    problem = "its dense layers do not all come before its MoE layers"
  elif any(mla(a) != mla(first) for a in attention) or any(routing(m) != routing(moe) for m in moes) \
      or len({f.w1.out_features for f in dense}) > 1:
    problem = "its layers differ in shape"
  elif any(type(f) is not FeedForward.Config for f in dense) or type(moe.routed_experts.inner_experts) is not GroupedExperts.Config:
    problem = "its feed-forward layers are not SwiGLU"
  elif any(linear.bias for linear in linears + [config.lm_head]) or router.gate.bias:
    problem = "its linear layers have biases"
  elif len(norms) > 1 or not all(n.elementwise_affine for layer in layers for n in (layer.attention_norm, layer.ffn_norm)):
    problem = "its RMSNorms differ in eps or affinity"
  elif min(first.kv_norm.eps, first.q_norm.eps if first.q_lora_rank else 1.0) <= 0:
    problem = "its latent RMSNorms have eps 0"
  elif not isinstance(rope, ComplexRoPE.Config) or rope.dim != first.qk_rope_head_dim:
    problem = f"its RoPE is {type(rope).__qualname__} over {rope.dim} of {first.qk_rope_head_dim} dims"
  elif rope.scaling not in ("none", "yarn") or (rope.scaling == "yarn" and not (rope.beta_fast and rope.beta_slow)):
    problem = f"its RoPE scaling is '{rope.scaling}'"
  elif moe.shared_experts is None or moe.shared_experts.w1.out_features % moe.routed_experts.inner_experts.hidden_dim:
    problem = "its shared experts are not whole multiples of a routed expert"
  elif router._debug_force_load_balance:
    problem = "it routes round-robin (_debug_force_load_balance)"
  elif router.score_func == "softmax" and (router.route_norm or router.num_expert_groups is not None):
    problem = ("it routes by softmax with normalised top-k weights, which HF DeepSeek-V2 does not normalise" if router.route_norm
               else "it routes by softmax with group-limited routing, which HF DeepSeek-V2 ranks by each group's best "
               "expert where torchtitan ranks by its best two")
  refuse_hf(problem, type(config).__qualname__.split(".")[0], "DeepSeek")  # DeepSeekV3Model, KimiK25Model
  yarn = rope.scaling == "yarn" and rope.rope_factor > 1.0
  rope_parameters = dict(rope_type="default", rope_theta=float(rope.theta))
  if yarn:  # torchtitan folds mscale into the softmax scale only; HF's cos/sin stay unscaled (attention_factor 1)
    rope_parameters = dict(
      rope_type="yarn", rope_theta=float(rope.theta), factor=float(rope.rope_factor), beta_fast=float(rope.beta_fast),
      beta_slow=float(rope.beta_slow), truncate=bool(rope.truncate), original_max_position_embeddings=rope.original_seq_len,
      mscale=float(first.mscale), mscale_all_dim=float(first.mscale), attention_factor=1.0,
    )
  experts = moe.routed_experts.inner_experts
  common = dict(
    vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=len(layers),
    num_attention_heads=first.n_heads, num_key_value_heads=first.n_heads, q_lora_rank=first.q_lora_rank or None,
    kv_lora_rank=first.kv_lora_rank, qk_nope_head_dim=first.qk_nope_head_dim, qk_rope_head_dim=first.qk_rope_head_dim,
    v_head_dim=first.v_head_dim, intermediate_size=dense[0].w1.out_features if dense else experts.hidden_dim,
    moe_intermediate_size=experts.hidden_dim, n_routed_experts=moe.num_experts, num_experts_per_tok=router.top_k,
    n_shared_experts=moe.shared_experts.w1.out_features // experts.hidden_dim, first_k_dense_replace=first_moe,
    routed_scaling_factor=float(router.route_scale), norm_topk_prob=bool(router.route_norm), rms_norm_eps=norms.pop(),
    max_position_embeddings=int(rope.original_seq_len * rope.rope_factor) if yarn else rope.max_seq_len,
    rope_parameters=rope_parameters, tie_word_embeddings=bool(config.enable_weight_tying), attention_bias=False,
  )
  if router.score_func == "softmax":
    hf = transformers.DeepseekV2Config(topk_method="greedy", architectures=["DeepseekV2ForCausalLM"], **common)
    check = no_expert_bias([i for i, layer in enumerate(layers) if layer.moe is not None], "DeepSeek-V2")
    return hf, check if moe.load_balance_coeff is not None else None
  hf = transformers.DeepseekV3Config(
    n_group=router.num_expert_groups or 1, topk_group=router.num_limited_groups or 1, rope_interleave=True,
    num_mtp_layers=0, architectures=["DeepseekV3ForCausalLM"], **common,
  )
  return hf, None  # its e_score_correction_bias is torchtitan's expert_bias_E


def hf_deepseek(module: torch.nn.Module, make_config=None) -> HFForm | None:
  """torchtitan's DeepSeek-V3 or Kimi as HF's DeepSeek-V2/V3 (`_deepseek_hf_config`; Kimi with its
  vision encoder as HF's Kimi-K2.5 around that text model, `_kimi_hf_config`),
  named by torchtitan's own adapter, with two changes HF's form needs: DeepSeek-V2 has no expert
  bias (not written; a nonzero one refused), and HF's latent norms run at eps 1e-6 where
  torchtitan's have their config's (1e-5 by default): the rows of `wkv_a` (its latent part) and
  `wq_a` that feed them are scaled by sqrt(1e-6 / eps), since RMSNorm(c·x, c²·eps) = RMSNorm(x, eps)."""
  form = hf_via_adapter(module, make_config or _deepseek_hf_config)
  if form is None:
    return None
  v2 = getattr(form.config, "text_config", form.config).model_type == "deepseek_v2"  # Kimi-K2.5's: its text model's
  first = module.config.layers[0].attention
  latent = {"wkv_a": (first.kv_norm.eps, first.kv_lora_rank), "wq_a": (first.q_norm.eps, None)}

  def rename(name):
    if (v2 and name.endswith(".moe.expert_bias_E")) or name.startswith("mtp_layers."):
      return []  # HF's DeepSeek has no expert bias in V2 and no multi-token prediction; the logits never read them
    pairs = form.rename(name)
    feeds = re.fullmatch(r"layers\.\d+\.attention\.(wkv_a|wq_a)\.weight", name)
    if feeds is None or latent[feeds.group(1)][0] == _HF_LATENT_NORM_EPS:
      return pairs
    eps, rows = latent[feeds.group(1)]
    scale = (_HF_LATENT_NORM_EPS / eps) ** 0.5
    ((hf_name, to_hf),) = pairs
    return [(hf_name, lambda w: _scale_rows(to_hf(w), scale, rows))]

  return HFForm(form.config, rename, form.check)


def _scale_rows(w: jax.Array, scale: float, rows: int | None) -> jax.Array:
  """`w`'s first `rows` rows (all of them for None) times `scale`, in `w`'s dtype."""
  rows = w.shape[0] if rows is None else rows
  return jnp.concatenate([w[:rows] * scale, w[rows:]]).astype(w.dtype)


hf_form = hf_deepseek
