"""torchtitan's fused q/k/v projection as three projections over the fused weight's row blocks.

`FusedQKVLinear` runs one matmul into [B, L, n_kv, heads_per_kv + 2, head_dim] and splits the
query, key and value out of it. Traced for the TPU, each split is a strided copy of the fused
output (and in the backward, a concatenation of the three gradients into one buffer): on Llama 3.1
8B at 8192 tokens about 27 GB of the step's HBM traffic. Here the same weight's rows for q, k and
v each feed their own matmul, whose output is already the piece torchtitan returns: the same dot
products (one per output element, over the same inputs), the weight still one parameter under
its own name, only the small weight sliced instead of the activations.

Only where each chip's share of the input dimension fills the TPU's 128 lanes: narrower (the
debugmodel over 8 chips, 32 columns each), the TPU compiler all-reduces the three weight
gradients instead of reduce-scattering them (FSDP's collectives 30.2 → 32.2 MiB a step), where
it fuses the fused weight's into a reduce-scatter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.models.torchtitan import swapped


LANES = 128


def projected_apart(mesh=None):
  """While active, torchtitan's `FusedQKVLinear` projects q, k and v apart (the same values) where
  its `wqkv` is a plain linear whose forward hooks act on each output alike, and whose input
  dimension split over every device of `mesh` (at most as many shards as the sharding maps make)
  leaves each at least `LANES` columns; otherwise its own."""
  shards = 1 if mesh is None else mesh.size

  def make(original):
    def forward(self, x):
      if not swapped.traced(x) or not _plain(self.wqkv) or self.wqkv.in_features < shards * LANES:
        return original(self, x)
      return _apart(self, x)

    return forward

  return swapped.method("torchtitan.models.common.attention", "FusedQKVLinear", "forward", make)


def _plain(linear: torch.nn.Module) -> bool:
  """An `nn.Linear` computing `F.linear` (not float8's, not wrapped by an adapter) whose only hooks
  are forward hooks acting on each output tensor alike (`remat.PER_TENSOR_HOOK`: the remat
  policies' tags): no pre-hooks, no backward hooks, no global module hooks, which would see the
  fused call."""
  if not isinstance(linear, torch.nn.Linear) or type(linear).forward is not torch.nn.Linear.forward:
    return False
  module_hooks = torch.nn.modules.module
  others = (
    linear._forward_pre_hooks, linear._forward_hooks_with_kwargs, linear._backward_hooks, linear._backward_pre_hooks,
    module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks, module_hooks._global_backward_hooks,
    module_hooks._global_backward_pre_hooks,
  )
  if any(others):
    return False
  return all(getattr(hook, remat_lib.PER_TENSOR_HOOK, False) for hook in linear._forward_hooks.values())


def _apart(module, x):
  """q, k, v as torchtitan's forward returns them ([B, L, heads, head_dim] each), each from its
  own rows of `wqkv`: rows are ordered (kv head, q-per-kv + 2, head dim)."""
  linear, hpk, hd = module.wqkv, module.heads_per_kv, module.head_dim
  b, s = x.shape[0], x.shape[1]
  weight = linear.weight.view(-1, module.r_dim, hd, linear.in_features)
  bias = None if linear.bias is None else linear.bias.view(-1, module.r_dim, hd)
  pieces = []
  for rows in (slice(0, hpk), slice(hpk, hpk + 1), slice(hpk + 1, hpk + 2)):
    w = weight[:, rows].reshape(-1, linear.in_features)
    bb = None if bias is None else bias[:, rows].reshape(-1)
    pieces.append(F.linear(x, w, bb))
  # the per-tensor hooks (remat tags) on the pieces by head, as attention reads them: so offloaded,
  # Llama 3.1 8B's step on v6e-8 reads 530 → 472 GB of HBM (no relayout of what comes back)
  out = tuple(piece.view(b, s, -1, hd) for piece in pieces)
  for hook in linear._forward_hooks.values():
    changed = hook(linear, (x,), out)
    out = out if changed is None else changed  # None: unchanged, as torch reads a hook's result
  return out
