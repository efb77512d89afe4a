"""torchax's op table as the bridge changes it: per-trace overrides, and a generation counter.

`bridge_overrides` installs the bridge's own lowerings (attention kernels, the
CPU linear, the train step's cross-entropy) for one trace; `generation()`
changes whenever a user override (`ops.override_op`) is installed or removed,
and compiled programs are keyed on it. Low in the import graph: it imports
only `_compat`, so the lowerings, the losses and the attention routing can use
it without reaching the user-facing `ops` (which starts the platform).
"""

from __future__ import annotations

import contextlib
import threading

from torch_on_tpu.core import _compat

_generation = 0  # see generation()
_lock = threading.Lock()


def generation() -> int:
  """Changes whenever an override is installed or removed."""
  return _generation


def changed():
  """Records that a user override was installed or removed."""
  global _generation
  with _lock:
    _generation += 1


@contextlib.contextmanager
def bridge_overrides(overrides: dict, *, env=None, is_jax_function: bool = False):
  """Installs the bridge's own lowerings (attention kernels) for one trace.

  Unlike `override_op` this does not change `generation()`: the bridge installs
  the same overrides on every trace, so they are part of what a compiled
  program is keyed on already (the module's settings), not a user change.
  """
  env = env or _compat.torchax_env()
  previous = {t: _compat.registered_op(env, t) for t in overrides}
  for target, impl in overrides.items():
    _compat.set_op(env, target, _compat.make_operator(target, impl, jax_function=is_jax_function, user=True))
  try:
    yield
  finally:
    for target, op in previous.items():
      _compat.set_op(env, target, op)
