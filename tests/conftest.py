"""Test session setup: 8 simulated CPU devices, set before jax is imported."""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Many tests build the same tiny models: a persistent compilation cache turns
# their repeated XLA compiles (seconds each on CPU) into cache hits.
jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(__file__).parent.parent / ".cache" / "jax-tests"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import torch_on_tpu  # noqa: E402,F401  (applies the torchax shim before any test imports torchax)


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "accelerator: needs a real GPU or TPU; skipped where jax only sees the CPU"
  )


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != "cpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU or TPU; jax sees only the CPU here")
  for item in items:
    if "accelerator" in item.keywords:
      item.add_marker(skip)
