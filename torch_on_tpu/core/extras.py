"""Optional dependencies: which pip extra brings which library, and the error when one is missing.

The core (wrap a model, shard it, compile a step, checkpoint) needs only torch,
torchax, jax, optax and orbax. Model families, data sources, logging and the
recipes' CLI pull heavier libraries; each is imported where the feature runs,
through `require`, so a missing one is one sentence naming the extra to
install instead of an ImportError from deep inside a call.
"""

from __future__ import annotations

import importlib

from torch_on_tpu.errors import TorchOnTpuError

# The import name → the extra that installs it (setup.py's extras_require).
EXTRA_OF = {
  "torchtitan": "torchtitan",
  "torchao": "float8",
  "transformers": "hf",
  "peft": "hf",
  "tokenizers": "data",
  "datasets": "data",
  "pyarrow": "data",
  "matplotlib": "logging",
  "tensorboard": "logging",
  "wandb": "logging",
  "fire": "recipes",
  "libtpu": "targets",
}


def require(module: str, feature: str):
  """`importlib.import_module(module)`, or one sentence saying which extra `feature` needs."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    top = module.split(".")[0]
    if e.name is not None and e.name.split(".")[0] != top:
      raise  # the library is there but one of its own dependencies is broken
    extra = EXTRA_OF.get(top, "all")
    raise TorchOnTpuError(
      f"{feature} needs {top}, which is not installed; install it with "
      f"pip install 'torch_on_tpu[{extra}]' (or '.[{extra}]' from a checkout)."
    ) from None
