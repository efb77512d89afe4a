"""torchtitan's MoE layers: what a token passes through (for FLOPs and the decoder shape), their
routed experts run per data shard, and the auxiliary-loss-free load balancing its trainer hooks
before each optimizer step."""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.numpy as jnp
import torch
from jax.sharding import PartitionSpec as P

from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import device_checks
from torch_on_tpu.parallel import mesh as mesh_lib
from torch_on_tpu.parallel import sharding as sharding_lib

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
def combine_by_rows():
  """While active, torchtitan's dispatcher adds each expert output row into its token's row
  (`index_add` over the N = tokens x top-k sorted rows), where torchtitan scatters with an index
  expanded to every element. The same sums, but the expanded index is a real int32 tensor under
  jax (N x dim, 1.75 GiB per 8192 tokens of DeepSeek-V3) and its backward a gather by it, several
  such buffers per MoE layer."""
  dispatcher = sys.modules.get("torchtitan.models.common.token_dispatcher")
  if dispatcher is None:
    yield
    return
  local = dispatcher.LocalTokenDispatcher
  original = local.combine

  def combine(self, routed_output_RD, metadata, x_TD):
    if routed_output_RD.dtype != x_TD.dtype:  # torchtitan's own, which torch refuses as scatter_add
      return original(self, routed_output_RD, metadata, x_TD)
    scores = metadata.topk_scores_experts_sorted_N.reshape(-1, 1)
    weighted = (routed_output_RD.to(torch.float32) * scores).to(routed_output_RD.dtype)
    return torch.zeros_like(x_TD).index_add(0, metadata.token_indices_experts_sorted_N, weighted)

  local.combine = combine
  try:
    yield
  finally:
    local.combine = original


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
    # Each weight enters split as the preset stores it and is gathered inside: its gradient
    # leaves as a reduce-scatter (entered whole, it would be an all-reduce over every device).
    stored = [_stored_spec(w.shape, mesh, experts_axis="ep" in axes) for w in weights]

    env = torchax.default_env()

    def local(key, x, scores, ids, *weights):
      counts = jnp.zeros(experts, count_dtype).at[ids.reshape(-1)].add(1)  # this shard's tokens per expert
      whole = [_gathered(w, parts) for w, parts in zip(weights, stored)]
      # a key of its own for the env's random draws inside, which must not leak out of the shard_map
      with _compat.reparametrized(self, dict(zip(names, map(torch_view, whole)))), env.override_property(prng=key):
        out = original(self, torch_view(x), torch_view(scores), torch_view(ids), torch_view(counts))
      return jax_view(out)

    in_specs = (P(), *(P(*spec, None, None),) * 3, *(P(*w) for w in stored))
    out = device_checks.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(*spec, None, None), check_vma=False)(
      env.get_and_rotate_prng_key(), jax_view(x_BLD), jax_view(topk_scores_BLK), jax_view(topk_expert_ids_BLK), *weights
    )
    return torch_view(out)

  routed.forward = forward
  try:
    yield
  finally:
    routed.forward = original


def _stored_spec(shape, mesh, experts_axis: bool) -> tuple:
  """How the sharding presets store one layer's expert weight: the "ep" preset its experts over
  `ep` and the rest as "fsdp", else the "fsdp" preset's spec."""
  if experts_axis and shape and shape[0] % mesh.shape["ep"] == 0:
    return ("ep", *sharding_lib.fsdp_spec(shape[1:], mesh))
  return sharding_lib.fsdp_spec(shape, mesh)


def _gathered(weight, spec):
  """Inside the shard_map, `weight` whole from its pieces split as `spec`."""
  for dim, axes in enumerate(spec):
    if axes is not None:
      weight = jax.lax.all_gather(weight, axes, axis=dim, tiled=True)
  return weight


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
