"""torch_on_tpu: train unmodified PyTorch models on TPU, GPU and CPU through JAX.

Importing the package is quiet: public names load on first access and the
platform (XLA flags, a multi-process join, torchax's lowerings) starts on first
use or at `tot.setup()` (see `torch_on_tpu.runtime`). The one thing the import
does is to put a finder on `sys.meta_path` that lets a later `import torchax`
succeed on this stack (see `torch_on_tpu.torchax_import`).
"""

from __future__ import annotations

import importlib
import warnings

from torch_on_tpu import torchax_import

torchax_import.install()

__version__ = "0.1.0"

# Public name → the module that defines it, imported on first access.
_EXPORTS = {
  "ShardedModule": "module",
  "ScannedModule": "scan",  # deprecated: StackedLayers
  "StackedLayers": "scan",
  "TorchOnTpuError": "errors",
  "TrainState": "train",
  "TrainStep": "train",
  "Trainer": "trainer",
  "generate": "generation",
  "initialize_distributed": "distributed",
  "make_mesh": "mesh",
  "make_train_step": "train",
  "override_op": "ops",
  "setup": "runtime",
  "to_cpu": "host",
}

# Former public name → its new name (a DeprecationWarning, then the new object).
_RENAMED = {"JittableModule": "ShardedModule"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _RENAMED:
    warnings.warn(
      f"tot.{name} is now tot.{_RENAMED[name]} (torchax has a JittableModule of its own, with another "
      f"signature); the old name will go.",
      DeprecationWarning,
      stacklevel=2,
    )
    return __getattr__(_RENAMED[name])
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  else:
    try:  # a submodule used as an attribute: `tot.checkpoint.Checkpointer`
      value = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{__name__}.{name}":
        raise
      raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
  globals()[name] = value
  return value


def __dir__():
  return sorted({*globals(), *_EXPORTS})
