"""torchax's index reads (`index_select`, `gather`, advanced indexing) with torch's range check.

Each wraps torchax's own lowering: the indices are checked with
`device_checks.index_in_range` (a check of the compiled program inside the
bridge's traces, at once when concrete), then torchax's lowering runs as
before. The embedding and cross-entropy lowerings check their ids themselves.
"""

from __future__ import annotations

import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import device_checks

torchax = _compat.import_torchax()
import jax.numpy as jnp  # noqa: E402


def _index_select(original):
  def lowered(x, dim, index):
    size = x.shape[dim] if x.ndim else 1
    device_checks.index_in_range(index, size, what=f"index_select (dimension {dim} of size {size})")
    return original(x, dim, index)

  return lowered


def _gather(original):
  def lowered(x, dim, index, *args, **kwargs):
    size = x.shape[dim] if x.ndim else 1
    device_checks.index_in_range(index, size, what=f"gather (dimension {dim} of size {size})")
    return original(x, dim, index, *args, **kwargs)

  return lowered


def _index(original):
  def lowered(x, indices):
    for axis, index in enumerate(indices):
      if index is not None and axis < x.ndim and jnp.issubdtype(index.dtype, jnp.integer):
        device_checks.index_in_range(
          index, x.shape[axis], what=f"tensor indexing (dimension {axis} of size {x.shape[axis]})", negative_ok=True
        )
    return original(x, indices)

  return lowered


def register(env) -> None:
  aten = torch.ops.aten
  for packet, wrap in ((aten.index_select, _index_select), (aten.gather, _gather), (aten.index.Tensor, _index), (aten.index, _index)):
    original = _compat.registered_op(env, packet)
    if original is None:
      continue
    _compat.set_op(env, packet, _compat.make_operator(packet, wrap(original.func), jax_function=True))
