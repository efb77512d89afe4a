"""libtpu on a machine without TPU chips: installed so that programs compile for TPU slices
(`parallel.targets`), and kept quiet and shareable there.

Without chips, libtpu's start-up looks for the accelerator and the workers it runs on, finds
none, and says so on every process that starts a jax backend or a compile-only client ("could
not determine TPU accelerator type", "Failed to find host bounds", a worker-hostname error);
and it takes a lockfile, so a second process loading it at once fails. With no chips there is
nothing to look up or guard: `quiet_without_chips` answers libtpu's questions and lets several
processes load it (pytest's workers, the launcher's processes), each setting only what the user
left unset. On a TPU host it does nothing.
"""

from __future__ import annotations

import glob
import os

# What libtpu asks the environment when it starts, answered for a machine without chips: a
# TPU type it accepts (compile-only clients name their own slice), this host as the only worker,
# no metadata server to ask, and no lockfile between processes.
_WITHOUT_CHIPS = {
  "TPU_ACCELERATOR_TYPE": "v6e-8",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_SKIP_MDS_QUERY": "1",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def tpu_chips_visible() -> bool:
  """TPU chips are attached to this machine (their device files exist)."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_without_chips(environ=os.environ) -> None:
  """On a machine without TPU chips, the environment libtpu starts quietly and shared in
  (a user's own value kept); before jax starts its backend or a compile-only client."""
  if tpu_chips_visible():
    return
  for name, value in _WITHOUT_CHIPS.items():
    environ.setdefault(name, value)
