"""Storage faults while writing checkpoints, named as storage faults in one sentence.

A full disk reaches us from tensorstore as `RESOURCE_EXHAUSTED ... [os_error_code='28']`,
the same status an accelerator out-of-memory has, and from orbax's background
threads, each of which logs its own traceback. `storage_error` reads the errno
out of whatever was raised and says what happened to which path and how much
space is free; `quiet_orbax_logs` drops the threads' logged
tracebacks, since the same error is raised to the caller, who reports it once.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_FAULTS = {
  errno.ENOSPC: ("the filesystem is full", "free space there or point the checkpoints at a larger disk"),
  errno.EDQUOT: ("the disk quota is used up", "free space there or point the checkpoints at a larger disk"),
  errno.EACCES: ("permission to write there was denied", "make the directory writable by this user"),
  errno.EPERM: ("permission to write there was denied", "make the directory writable by this user"),
  errno.EROFS: ("the filesystem is read-only", "remount it read-write or point the checkpoints elsewhere"),
  errno.ENOENT: ("the directory vanished", "check the mount and that nothing deletes it during the run"),
}


def error_code(e: BaseException) -> int | None:
  """The storage errno carried by `e` or its causes (an OSError, or tensorstore's text)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _FAULTS:
      return e.errno
    match = _OS_ERROR_CODE.search(str(e))
    if match and int(match.group(1)) in _FAULTS:
      return int(match.group(1))
    e = e.__cause__ or e.__context__
  return None


def storage_error(e: BaseException, what: str, path: Path, outcome: str) -> str | None:
  """One sentence for a storage fault (None when `e` is not one): what failed
  where, why, the free space, `outcome` (what is still safe), and what to do."""
  code = error_code(e)
  if code is None:
    return None
  why, fix = _FAULTS[code]
  return f"Could not write {what} to {path}: {why} ({free_space(path)}); {outcome}; {fix}."


def vanished(directory: Path, step: int, held: list[int]) -> str:
  """One sentence for a checkpoint directory deleted (or unmounted) under a running job."""
  return (
    f"Could not write checkpoint step {step} to {directory}: the directory vanished during the run "
    f"(it held steps {sorted(held)}; {free_space(directory)}); check the mount and that nothing "
    f"deletes it, then resume from a copy or start afresh."
  )


def free_space(path: Path) -> str:
  """'1.2 GiB free of 100 GiB' for the filesystem holding `path` (or its nearest existing parent)."""
  path = Path(path).absolute()
  while not path.exists() and path != path.parent:
    path = path.parent
  try:
    usage = shutil.disk_usage(path)
  except OSError as e:
    return f"free space unknown: {os.strerror(e.errno or 0)}"
  return f"{_gib(usage.free)} free of {_gib(usage.total)} on {path}"


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _DropOrbaxNoise(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    if "orbax" not in record.pathname:
      return True
    return not (record.exc_info or record.getMessage().startswith(_READ_ONLY_NOTICES))


# What orbax logs on every read-only open (tools/convert.py reading a run's checkpoints).
_READ_ONLY_NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True, setting")
_FILTER = _DropOrbaxNoise()


def quiet_orbax_logs() -> None:
  """Orbax logs every background-save failure with a traceback (absl's logger);
  those errors are raised again to the caller of save/wait/close, so drop them; and
  its warnings on every read-only open, which say only that it is read-only."""
  absl_logger = logging.getLogger("absl")
  if _FILTER not in absl_logger.filters:
    absl_logger.addFilter(_FILTER)
