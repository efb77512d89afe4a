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

"""

from __future__ import annotations

import contextlib

from torch_on_tpu import runtime
from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import op_table


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
