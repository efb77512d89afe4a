"""Optional dependencies: which pip extra brings which library, and the error when one is missing.

The core (wrap a model, shard it, compile a step, checkpoint) needs only torch,
torchax, jax, optax and orbax. Model families, data sources, logging and the
recipes' CLI pull heavier libraries; each is imported where the feature runs,
through `require`, so a missing one is one sentence naming the extra to
install instead of an ImportError from deep inside a call.
"""

from __future__ import annotations

import importlib
import importlib.util

from torch_on_tpu.errors import TorchOnTpuError

def _shadowing(top: str) -> str | None:
  """The path of a plain module (a user's `torchtitan.py`) that `import top` finds instead of the
  package, None otherwise."""
  import sys

  found = sys.modules.get(top)
  if found is None:
    try:
      spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
      return None
    origin, package = (spec.origin, spec.submodule_search_locations) if spec else (None, None)
  else:
    origin, package = getattr(found, "__file__", None), getattr(found, "__path__", None)
  return origin if origin and package is None and origin.endswith(".py") else None


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
    shadow = _shadowing(top)
    if shadow is not None:
      raise TorchOnTpuError(
        f"{feature} needs the {top} package, but `import {top}` finds {shadow}, a file of that name; rename it "
        f"(or run from another directory)."
      ) from None
    extra = EXTRA_OF.get(top, "all")
    raise TorchOnTpuError(
      f"{feature} needs {top}, which is not installed; install it with "
      f"pip install 'torch_on_tpu[{extra}]' (or '.[{extra}]' from a checkout)."
    ) from None
