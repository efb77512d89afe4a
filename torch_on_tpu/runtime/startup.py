"""Platform start-up, once per process: on first use, or by calling `tot.setup()`.

`import torch_on_tpu` changes nothing: no environment variable, no patch, no
backend. What the bridge needs from the process happens here, in the only
order that works, because jax reads XLA_FLAGS and joins other processes only
before its backend starts, and torchax's environment starts it (it makes a
PRNG key):

1. our default XLA flags are added to `XLA_FLAGS` (`xla_flags.DEFAULTS`; a flag
   the user set is kept);
2. a multi-process run described by the environment (`TOT_*`, a TPU pod,
   Slurm) is joined (`distributed.initialize_distributed`);
3. torchvision, if installed, is imported outside any torchax trace (its first
   import calls one of its own ops);
4. torchax's environment is created and our lowerings are registered into it
   (`aten.register`), which also gives jax-backed tensors torch's `.cpu()`,
   `.item()`, `float()` and `int()`, and routes ops of other `torch.library`
   namespaces through the bridge (`aten.custom_ops`);
5. `torch.autograd.Function.apply` is routed so that a Function applied to
   jax-backed tensors runs its own backward (`autograd_functions.install`).

`make_mesh`, `ShardedModule`, `make_train_step`, `override_op` and `generate`
call `setup()` themselves; call it first only to control when the cost is paid
or to join a multi-process run before other jax code runs.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_started = False


def setup() -> None:
  """Starts the platform for torch_on_tpu (idempotent, thread-safe); see the module docstring."""
  global _started
  if _started:
    return
  with _lock:
    if _started:
      return
    from torch_on_tpu.core import _compat
    from torch_on_tpu.lowering import aten, autograd_functions
    from torch_on_tpu.runtime import distributed, xla_flags

    xla_flags.apply_defaults()
    distributed.initialize_distributed()
    _compat.import_torchvision_outside_torchax()
    aten.register(_compat.torchax_env())
    autograd_functions.install()
    _started = True


def started() -> bool:
  """True once `setup()` has run in this process."""
  return _started
