"""A torchtitan method replaced by the bridge's while a model runs, torchtitan's own put back after."""

from __future__ import annotations

import contextlib
import sys

from torch_on_tpu.core import _compat

torchax = _compat.import_torchax()


@contextlib.contextmanager
def method(module_name: str, class_name: str, name: str, make):
  """While active, `class_name.name` of torchtitan's `module_name` is `make(original)`; nothing
  where that torchtitan module is not imported or has no such class."""
  cls = getattr(sys.modules.get(module_name), class_name, None)
  if cls is None:
    yield
    return
  original = cls.__dict__[name]
  setattr(cls, name, make(original))
  try:
    yield
  finally:
    setattr(cls, name, original)


def traced(t) -> bool:
  """A tensor of the traced jax world (torchax's), not an eager torch one."""
  return isinstance(t, (torchax.tensor.Tensor, torchax.tensor.View))
