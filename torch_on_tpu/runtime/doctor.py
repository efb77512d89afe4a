"""`python -m torch_on_tpu.doctor`: what this machine's stack is, and what is wrong with it.

Prints versions, the platform and its devices, the XLA flags in effect (with
torch_on_tpu's defaults, `torch_on_tpu/runtime/xla_flags.py`), and which attention
kernels can run here. Exits non-zero with one line per problem, naming what
to install, when the stack cannot work (missing package, a torch that is not
the pinned one, torchax that does not import).
"""

from __future__ import annotations

import importlib
import os
import platform
import sys

from torch_on_tpu.core.stack import OPTIONAL_PACKAGES, versions
from torch_on_tpu.errors import TorchOnTpuError

PINNED_TORCH = "2.13.0"
INSTALL_HINT = "bash tools/setup_env.sh (or pip install -c constraints.txt -e '.[cpu,all]')"


def problems(found: dict[str, str | None]) -> list[str]:
  out = []
  for name, version in found.items():
    if version is None and name not in OPTIONAL_PACKAGES:
      out.append(f"{name} is not installed; run {INSTALL_HINT}.")
  torch_version = found.get("torch")
  if torch_version and not torch_version.startswith(PINNED_TORCH):
    out.append(
      f"torch {torch_version} is installed but the stack is pinned to {PINNED_TORCH}; "
      f"run pip install torch=={PINNED_TORCH} (CPU wheel) or {INSTALL_HINT}."
    )
  if sys.version_info[:2] != (3, 11):
    out.append(f"Python {platform.python_version()} is not the pinned 3.11; create the venv with python3.11.")
  return out


def import_problem() -> str | None:
  """Why torch_on_tpu cannot start (torchax through its shim, our lowerings), or None."""
  try:
    from torch_on_tpu import runtime

    runtime.setup()
    importlib.import_module("torch_on_tpu.wrapper.module")
  except TorchOnTpuError as e:  # the start-up's own sentence (a bad XLA_FLAGS value)
    return str(e)
  except Exception as e:  # noqa: BLE001 - any import failure is the diagnosis
    return f"torch_on_tpu cannot import torchax ({type(e).__name__}: {e}); run {INSTALL_HINT}."
  return None


def devices() -> dict:
  import jax

  devs = jax.devices()
  info = {
    "platform": devs[0].platform,
    "device_count": len(devs),
    "process_count": jax.process_count(),
    "device_kind": devs[0].device_kind,
    "memory_per_device": None,
  }
  stats = getattr(devs[0], "memory_stats", lambda: None)()
  if stats and stats.get("bytes_limit"):
    info["memory_per_device"] = f"{stats['bytes_limit'] / 2**30:.1f} GiB"
  return info


def attention_paths(platform_name: str) -> dict[str, str]:
  paths = {"xla": "available (blocked XLA attention, every platform)"}
  try:
    importlib.import_module("jax.experimental.pallas.ops.tpu.splash_attention")
    paths["splash"] = (
      "available (TPU)" if platform_name == "tpu" else "importable; runs on TPU (CPU tests use interpret mode)"
    )
  except Exception as e:  # noqa: BLE001
    paths["splash"] = f"unavailable ({type(e).__name__})"
  paths["cudnn"] = "available (GPU)" if platform_name == "gpu" else "needs an NVIDIA GPU"
  return paths


def main() -> int:
  found = versions()
  issues = problems(found)
  width = max(len(k) for k in found)
  print("torch_on_tpu doctor")
  for name, version in found.items():
    missing = "not installed (optional: see extras.py)" if name in OPTIONAL_PACKAGES else "MISSING"
    print(f"  {name:<{width}}  {version or missing}")
  if not issues:
    problem = import_problem()
    if problem:
      issues.append(problem)
  if not issues:
    info = devices()
    print(f"  {'platform':<{width}}  {info['platform']} ({info['device_kind']})")
    print(f"  {'devices':<{width}}  {info['device_count']} (processes: {info['process_count']})")
    print(f"  {'memory':<{width}}  {info['memory_per_device'] or 'not reported by this platform'}")
    print(f"  {'XLA_FLAGS':<{width}}  {os.environ.get('XLA_FLAGS', '')}")
    if "PJRT_NPROC" in os.environ:  # XLA:CPU's thread pool, sized for simulated devices
      print(f"  {'PJRT_NPROC':<{width}}  {os.environ['PJRT_NPROC']}")
    print("  attention kernels:")
    for name, state in attention_paths(info["platform"]).items():
      print(f"    {name:<7} {state}")
  if issues:
    print("\nProblems:", file=sys.stderr)
    for issue in issues:
      print(f"  - {issue}", file=sys.stderr)
    return 1
  print("\nOK: the stack works on this machine.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
