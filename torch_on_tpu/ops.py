"""Runtime op overrides from user scripts, applied when torch code is traced.

    @tot.override_op(torch.nn.functional.gelu)
    def gelu_tanh(x, approximate="none"):
        return torch.nn.functional.gelu(x, approximate="tanh")  # sees the original

    with tot.override_op(torch.ops.aten.silu.default, my_silu):
        logits = model(tokens)

The target is a torch function (`torch.nn.functional.gelu`) or an ATen op
(`torch.ops.aten.gelu.default`); the implementation is plain torch code that
receives torch tensors. As a decorator the override stays until `.remove()`;
as a context manager the previous definition returns on exit. Inside the
implementation the target resolves to what it was before the override, so an
override can wrap the original. Compiled functions are keyed on
`op_table.generation()`, so a changed override retraces instead of reusing a stale
program.

Custom ops (`torch.library`, any namespace: torchtitan's
`deterministic_scatter_add`, a user's own) run through the bridge too
(`route_custom_ops`): an override of the op if there is one, else torch's
registered decomposition, else the op's composite implementation (the torch
code of a `torch.library.custom_op`), traced op by op. An op with only device
kernels is refused at trace time, naming the op and `override_op`.
"""

from __future__ import annotations

import contextlib

import torch

from torch_on_tpu import _compat, op_table, runtime
from torch_on_tpu.errors import TorchOnTpuError


class override_op(contextlib.ContextDecorator):
  """Replaces the lowering of `target` with the torch function `impl`."""

  def __init__(self, target, impl=None, *, env=None):
    self.target = target
    self.impl = impl
    if env is None:
      runtime.setup()
    self.env = env or _compat.torchax_env()
    self._previous = None
    self._active = False
    if impl is not None:
      self._install()

  # Decorator form: @override_op(target) def impl(...)
  def __call__(self, impl):
    if self.impl is not None:
      return super().__call__(impl)
    self.impl = impl
    self._install()
    impl.remove = self.remove
    return impl

  def _install(self):
    if self._active:
      return
    self._previous = _compat.registered_op(self.env, self.target)
    previous = self._previous
    impl = self.impl
    env = self.env
    target = self.target

    def run_with_previous(*args, **kwargs):
      # While the override runs, the target means what it meant before.
      mine = _compat.registered_op(env, target)
      _compat.set_op(env, target, previous)
      try:
        return impl(*args, **kwargs)
      finally:
        _compat.set_op(env, target, mine)

    env.override_op_definition(target, run_with_previous)  # torchax's public hook
    self._active = True
    op_table.changed()

  def remove(self):
    if not self._active:
      return
    _compat.set_op(self.env, self.target, self._previous)
    self._active = False
    op_table.changed()

  def __enter__(self):
    self._install()
    return self

  def __exit__(self, *exc):
    self.remove()
    return False


def route_custom_ops(env) -> None:
  """Ops outside torchax's namespaces go through `_run_custom_op` in `env` (see the module docstring)."""
  _compat.route_other_namespaces(env, _run_custom_op)


def _run_custom_op(mode, op, types, args, kwargs):
  env = mode.env
  tensors = [t for t in _compat.torch_pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
  if not any(_is_jax_backed(t) for t in tensors):
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


def _is_jax_backed(tensor) -> bool:
  torchax = _compat.import_torchax()
  return isinstance(tensor, (torchax.tensor.Tensor, torchax.view.View))
