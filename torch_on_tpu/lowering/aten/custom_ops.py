"""Custom ops of any `torch.library` namespace (torchtitan's
`deterministic_scatter_add`, a user's own) traced through the bridge.

torchax intercepts only a few namespaces and would run any other op's eager
kernel on jax-backed tensors. Routed here instead: an override of the op if
there is one (`tot.override_op`), else torch's registered decomposition, else
the op's composite implementation (the torch code of a
`torch.library.custom_op`), traced op by op. An op with only device kernels is
refused at trace time, naming the op and `override_op`.
"""

from __future__ import annotations

import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError


def register(env) -> None:
  """Ops outside torchax's namespaces go through `_run_custom_op` in `env` (see the module docstring)."""
  _compat.route_other_namespaces(env, _run_custom_op)


def _run_custom_op(mode, op, types, args, kwargs):
  env = mode.env
  tensors = [t for t in _compat.torch_pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
  if not any(_compat.is_jax_backed(t) for t in tensors):
    return op(*args, **kwargs)  # plain torch tensors: the op's own kernel, as torch runs it
  if _compat.registered_op(env, op) or _compat.registered_op(env, op.overloadpacket):
    return env.dispatch(op, types, args, kwargs)
  decomposition = _compat.decomposition(op)
  with mode:  # the pieces of a decomposition dispatch through torchax again
    if decomposition is not None:
      return decomposition(*args, **kwargs)
    if _compat.has_kernel(op, "CompositeImplicitAutograd"):
      return op.decompose(*args, **kwargs)
    if _compat.has_kernel(op, "CompositeExplicitAutograd"):
      return _compat.run_kernel(op, "CompositeExplicitAutograd", args, kwargs)
  raise TorchOnTpuError(
    f"The custom op {op.name()} has only device kernels (no decomposition or composite "
    f"implementation the bridge can trace); give it a lowering with "
    f"tot.override_op(torch.ops.{op.namespace}.{op.__name__}, impl) where "
    f"impl computes it in torch ops."
  )
