"""The device a traced program is compiled for: the mesh's, which need not be jax's default
backend (a compile-only TPU target is traced on a CPU-only machine). What a lowering chooses by
platform (the grouped matmul's kernel, whether activations can go to host memory) asks `device()`;
`ShardedModule` and the train step set it while they trace (`compiling_for`)."""

from __future__ import annotations

import contextlib
import contextvars

import jax

_current: contextvars.ContextVar = contextvars.ContextVar("torch_on_tpu_target_device", default=None)


@contextlib.contextmanager
def compiling_for(device: jax.Device):
  """While active, traced code is compiled for `device` (a device of the program's mesh)."""
  token = _current.set(device)
  try:
    yield
  finally:
    _current.reset(token)


def device() -> jax.Device:
  """The device the program being traced is for; jax's first device outside any `compiling_for`."""
  return _current.get() or jax.devices()[0]
