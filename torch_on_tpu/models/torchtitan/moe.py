"""torchtitan's MoE layers: what a token passes through (for FLOPs and the decoder shape), their
routed experts run where they live (tokens sent to them under expert parallelism), and the
auxiliary-loss-free load balancing its trainer hooks before each optimizer step."""

from __future__ import annotations

import contextlib
import sys

import jax.numpy as jnp
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.parallel import expert_parallel

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


def routed_shape(moes) -> dict:
  """`DecoderShape`'s MoE fields for these torchtitan MoE layers (none: {})."""
  if not moes:
    return {}
  inner = moes[0].routed_experts.inner_experts
  return dict(moe_layers=len(moes), experts=moes[0].router.num_experts, top_k=moes[0].router.top_k,
              expert_ffn=_down_projection(inner).shape[-1])


def _down_projection(experts):
  """The experts' [E, D, F] down projection: torchtitan's `w2_EDF`, gpt-oss's `mlp2_weight_EDF`."""
  return experts.w2_EDF if hasattr(experts, "w2_EDF") else experts.mlp2_weight_EDF


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
def dispatched_locally():
  """While active, torchtitan's expert-parallel token dispatchers (all-to-all, DeepEP, HybridEP,
  MinimalAsyncEP: each a transport of the same routing over NCCL or CUDA kernels) sort and combine
  as its local dispatcher does; the bridge moves the rows itself (`experts_where_they_live`),
  dropless, whatever transport the config names."""
  dispatcher = sys.modules.get("torchtitan.models.common.token_dispatcher")
  if dispatcher is None:
    yield
    return
  local = dispatcher.LocalTokenDispatcher
  classes, stack = [], list(local.__subclasses__())
  while stack:
    cls = stack.pop()
    classes.append(cls)
    stack.extend(cls.__subclasses__())
  own = {cls: {k: cls.__dict__[k] for k in ("dispatch", "combine") if k in cls.__dict__} for cls in classes}
  for cls in classes:
    cls.dispatch = lambda self, *args: local.dispatch(self, *args)  # looked up per call: combine_by_rows swaps combine
    cls.combine = lambda self, *args: local.combine(self, *args)
  try:
    yield
  finally:
    for cls in classes:
      for k in ("dispatch", "combine"):
        if k in own[cls]:
          setattr(cls, k, own[cls][k])
        else:
          delattr(cls, k)


@contextlib.contextmanager
def experts_where_they_live(mesh, data_axes):
  """While active, torchtitan's routed experts (dispatch, grouped matmuls, combine) run in a
  `shard_map` region (`expert_parallel.Layout`), as torchtitan's `local_map` region runs them on
  each rank: every device sorts its own tokens with torchtitan's dispatch and adds the results up
  with its combine. Under expert parallelism the sorted rows go to the devices holding their
  experts and back (`expert_parallel.exchange`) around torchtitan's own grouped experts; without
  it, each device runs every expert, gathered whole. Traced as one program instead, the dispatch's
  sort over the batch-sharded tokens makes the partitioner replicate it: every token of the global
  batch times top-k on every device (26 TiB per chip for DeepSeek-V3 671B on v5p-1024). Each
  token's output depends on its own routing only, so the result is the same."""
  titan_moe = sys.modules.get("torchtitan.models.common.moe")
  region = expert_parallel.layout(mesh, data_axes)
  if titan_moe is None or region is None:
    yield
    return
  routed = titan_moe.RoutedExperts
  original = routed.forward

  def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
    if not region.fits(*x_BLD.shape[:2]):
      return original(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
    names, weights = zip(*((n, jax_view(p)) for n, p in self.named_parameters()))
    experts = num_local_tokens_per_expert_E.shape[0]
    top_k = topk_expert_ids_BLK.shape[-1]
    count_dtype = jax_view(num_local_tokens_per_expert_E).dtype
    env = torchax.default_env()
    inner = self.inner_experts

    def local(key, x, scores, ids, *weights):
      counts = jnp.zeros(experts, count_dtype).at[ids.reshape(-1)].add(1)  # this device's tokens per expert
      grouped = type(inner).forward

      def run_local(rows, sizes, _ids):
        return jax_view(grouped(inner, torch_view(rows), torch_view(sizes)))

      def experts_forward(rows_RD, counts_E):  # torchtitan's sorted rows, sent to their experts and back
        return torch_view(expert_parallel.exchange(jax_view(rows_RD), jax_view(counts_E), run_local, axes=region.group, top_k=top_k))

      # a key of its own for the env's random draws inside, which must not leak out of the shard_map
      with _compat.reparametrized(self, dict(zip(names, map(torch_view, weights)))), env.override_property(prng=key), \
          _instance_forward(inner, experts_forward):
        out = original(self, torch_view(x), torch_view(scores), torch_view(ids), torch_view(counts))
      return jax_view(out)

    out = region.run(
      local, [jax_view(x_BLD), jax_view(topk_scores_BLK), jax_view(topk_expert_ids_BLK)], list(weights),
      extra=(env.get_and_rotate_prng_key(),),
    )
    return torch_view(out)

  routed.forward = forward
  try:
    yield
  finally:
    routed.forward = original


@contextlib.contextmanager
def _instance_forward(module, forward):
  """`module` calls `forward` instead of its class's while active."""
  module.forward = forward
  try:
    yield
  finally:
    del module.forward


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
