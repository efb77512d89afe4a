"""The packages the bridge runs on and the versions installed here: what `doctor`
reports and what `fingerprint` compares across the processes of a run."""

from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = ("torch", "torchax", "jax", "jaxlib", "optax", "orbax-checkpoint")
OPTIONAL_PACKAGES = ("torchtitan", "transformers", "peft", "tokenizers", "datasets", "tensorboard", "matplotlib", "fire")


def versions() -> dict[str, str | None]:
  """Each package's installed version (None: not installed), and Python's."""
  found = {"python": platform.python_version()}
  for name in (*PACKAGES, *OPTIONAL_PACKAGES):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found
