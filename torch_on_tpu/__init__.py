"""torch_on_tpu: train unmodified PyTorch models on TPU, GPU and CPU through JAX.

Importing the package is quiet: public names load on first access and the
platform (XLA flags, a multi-process join, torchax's lowerings) starts on first
use or at `tot.setup()` (see `torch_on_tpu.runtime`). The import puts three
finders on `sys.meta_path`: one lets a later `import torchax` succeed on this stack
(`core.torchax_import`), one lets torchtitan's Qwen3.5 import without
flash-linear-attention (`core.fla_standins`), and one keeps the module paths from
before the package's layout working (`core.old_paths`); and it silences our dependencies' messages that
tell a user nothing, each by its module and text (`core.dependency_noise`).
"""

from __future__ import annotations

import importlib
import warnings

from torch_on_tpu.core import dependency_noise, fla_standins, old_paths, torchax_import

torchax_import.install()
fla_standins.install()
old_paths.install()
dependency_noise.silence()

__version__ = "0.1.0"

# Public name → the module that defines it, imported on first access.
_EXPORTS = {
  "ShardedModule": "wrapper.module",
  "ScannedModule": "wrapper.scan",  # deprecated: StackedLayers
  "StackedLayers": "wrapper.scan",
  "TorchOnTpuError": "errors",
  "TrainState": "training.step",
  "TrainStep": "training.step",
  "Trainer": "training.trainer",
  "generate": "training.generation",
  "initialize_distributed": "runtime.distributed",
  "make_mesh": "parallel.mesh",
  "make_train_step": "training.step",
  "override_op": "wrapper.ops",
  "setup": "runtime",
  "to_cpu": "lowering.host",
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
