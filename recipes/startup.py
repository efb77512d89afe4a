"""Before jax starts: XLA flags for `--cpu_devices`, the TPU's collective flags on a TPU host, and the
one call that starts the platform (and joins a multi-host run). Nothing here imports jax at module
level: XLA reads its flags when jax starts its backend."""

from __future__ import annotations

import importlib.util
import os

# Flags for FSDP on TPU (v5e/v5p/v6e) set when the recipe runs on a TPU and
# LIBTPU_INIT_ARGS is unset: run FSDP's all-gathers and reduce-scatters as
# asynchronous collectives fused with, and scheduled under, the layers' matmuls
# (the latency-hiding scheduler), so the step does not wait on the interconnect.
TPU_FLAGS = (
  "--xla_tpu_enable_latency_hiding_scheduler=true",
  "--xla_tpu_enable_async_collective_fusion=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
  "--xla_tpu_overlap_compute_collective_tc=true",
  "--xla_enable_async_all_gather=true",
  "--xla_enable_async_reduce_scatter=true",
)


def setup_platform(cpu_devices: int | None) -> None:
  """Sets XLA_FLAGS for `--cpu_devices`, LIBTPU_INIT_ARGS on a TPU host; before jax starts.

  XLA reads its flags when jax starts its backend, so this runs before anything
  uses jax; in a process where the backend already started (tests) it only
  checks that the devices are the ones asked for.
  """
  from torch_on_tpu.core import _compat
  from torch_on_tpu.runtime import xla_flags

  if _compat.backend_started():
    if cpu_devices is not None:
      import jax

      from torch_on_tpu.errors import TorchOnTpuError

      have = jax.devices()
      if have[0].platform != "cpu" or len(have) != cpu_devices:
        raise TorchOnTpuError(
          f"--cpu_devices={cpu_devices} but jax already started with {len(have)} {have[0].platform} "
          f"devices in this process; run the recipe in a fresh process."
        )
    return
  if cpu_devices is not None:
    xla_flags.simulate_cpu_devices(cpu_devices, cpu_only=True)
  elif _on_tpu_host() and "LIBTPU_INIT_ARGS" not in os.environ:
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(TPU_FLAGS)


def _on_tpu_host() -> bool:
  """libtpu is installed, TPU chips are visible, and jax is not forced elsewhere."""
  if os.environ.get("JAX_PLATFORMS", "tpu") and "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
    return False
  if importlib.util.find_spec("libtpu") is None:
    return False
  from torch_on_tpu.runtime import libtpu

  return libtpu.tpu_chips_visible()


# MULTI-HOST: the single call site. Starts the platform, which joins the processes
# of a multi-host run (TOT_* variables or a cluster jax detects; see
# torch_on_tpu.runtime) after setup_platform and before any device use.
def initialize_distributed() -> None:
  from torch_on_tpu import runtime

  runtime.setup()
