"""Test session setup: 8 simulated CPU devices, set before jax is imported."""


from torch_on_tpu.runtime import xla_flags  # noqa: E402  (imports nothing heavy: set before jax starts)

xla_flags.simulate_cpu_devices(8, replace=False)

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Many tests build the same tiny models: a persistent compilation cache turns
# their repeated XLA compiles (seconds each on CPU) into cache hits.
jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(__file__).parent.parent / ".cache" / "jax-tests"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import torch_on_tpu  # noqa: E402

torch_on_tpu.setup()  # the platform starts before any test imports torchax or uses jax


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "accelerator: needs a real GPU or TPU; skipped where jax only sees the CPU"
  )
  config.addinivalue_line(
    "markers", "compile_bound: XLA:CPU compiles this module's programs with LLVM at -O0 (conftest's _quick_cpu_codegen)"
  )


@pytest.fixture(autouse=True)
def _quick_cpu_codegen(request, monkeypatch):
  """Modules marked `compile_bound` are mostly XLA:CPU compiling (77% of test_moe and
  test_bf16_training with an empty cache, at -O2): their programs compile with LLVM at -O0, 30-40%
  faster (olmoe's parity test: 37.5 -> 26.4 s of compiling). Not suite-wide: tests that run many
  steps lose more than they gain (the 64-expert recipe run: 491 s instead of 107; test_recipe_torchtitan
  254 -> 310 s, test_pipeline and test_context_parallel even, 2026-12-02). Code generation only:
  XLA:CPU has no fast math at any level, and the whole suite passed at -O0 (2026-11-29)."""
  if request.node.get_closest_marker("compile_bound"):
    default = xla_flags.compile_options
    quick = {"xla_backend_optimization_level": 0}
    monkeypatch.setattr(xla_flags, "compile_options", lambda platform: {**default(platform), **(quick if platform == "cpu" else {})})


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != "cpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU or TPU; jax sees only the CPU here")
  for item in items:
    if "accelerator" in item.keywords:
      item.add_marker(skip)
