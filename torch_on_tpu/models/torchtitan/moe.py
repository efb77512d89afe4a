"""torchtitan's MoE layers: what a token passes through (for FLOPs and the decoder shape), their
routed experts run per data shard, and the auxiliary-loss-free load balancing its trainer hooks
before each optimizer step."""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from torch_on_tpu.core import _compat
from torch_on_tpu.parallel import mesh as mesh_lib

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


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


@contextlib.contextmanager
def experts_per_data_shard(mesh, data_axes):
  """While active, torchtitan's routed experts (dispatch, grouped matmuls, combine) run on each
  data shard's own tokens under `shard_map`, as torchtitan's `local_map` region runs them on each
  rank, with the expert weights gathered whole. Traced as one program instead, the dispatch's
  sort over the batch-sharded tokens makes the partitioner replicate it: every token of the
  global batch times top-k on every device (26 TiB per chip for DeepSeek-V3 671B on v5p-1024).
  Each token's output depends on its own routing only, so the result is the same. Meshes with
  other axes than the data axes (tp, cp, pp) keep the one-program dispatch."""
  titan_moe = sys.modules.get("torchtitan.models.common.moe")
  axes = tuple(a for a in data_axes if mesh is not None and mesh.shape[a] > 1)
  others = mesh is not None and any(size > 1 for a, size in mesh.shape.items() if a not in axes)
  if titan_moe is None or not axes or others:
    yield
    return
  routed = titan_moe.RoutedExperts
  original = routed.forward
  ways = mesh_lib.batch_ways(mesh, axes)
  spec = mesh_lib.batch_spec(axes, 1)

  def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
    if x_BLD.shape[0] % ways:
      return original(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
    names, weights = zip(*((n, jax_view(p)) for n, p in self.named_parameters()))
    experts = num_local_tokens_per_expert_E.shape[0]
    count_dtype = jax_view(num_local_tokens_per_expert_E).dtype
    # Each weight enters split as the preset stores it (gathered inside: its gradient leaves as a
    # reduce-scatter), else whole (its gradient an all-reduce).
    split = [_stored_split(w.shape, ways, experts_axis="ep" in axes) for w in weights]

    env = torchax.default_env()

    def local(key, x, scores, ids, *weights):
      counts = jnp.zeros(experts, count_dtype).at[ids.reshape(-1)].add(1)  # this shard's tokens per expert
      whole = [w if d is None else jax.lax.all_gather(w, axes, axis=d, tiled=True) for w, d in zip(weights, split)]
      # a key of its own for the env's random draws inside, which must not leak out of the shard_map
      with _compat.reparametrized(self, dict(zip(names, map(torch_view, whole)))), env.override_property(prng=key):
        out = original(self, torch_view(x), torch_view(scores), torch_view(ids), torch_view(counts))
      return jax_view(out)

    in_specs = (P(), *(P(*spec, None, None),) * 3, *(P() if d is None else P(*[None] * d, *spec) for d in split))
    out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(*spec, None, None), check_vma=False)(
      env.get_and_rotate_prng_key(), jax_view(x_BLD), jax_view(topk_scores_BLK), jax_view(topk_expert_ids_BLK), *weights
    )
    return torch_view(out)

  routed.forward = forward
  try:
    yield
  finally:
    routed.forward = original


def _stored_split(shape, ways: int, experts_axis: bool) -> int | None:
  """The dim of an expert weight the sharding presets split over the data axes: its experts
  under "ep", else the largest dim they divide (the "fsdp" preset's rule); None: no dim."""
  if experts_axis:
    return 0 if shape and shape[0] % ways == 0 else None
  candidates = [d for d, n in enumerate(shape) if n % ways == 0]
  return max(candidates, key=lambda d: (shape[d], -d)) if candidates else None


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
