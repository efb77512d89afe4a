"""Storage faults, named as storage faults in one sentence: which path, why, how much space
is free there, what is still safe, and what to do.

A full disk reaches us in many shapes: an `OSError` with errno 28 from a plain
write, tensorstore's `RESOURCE_EXHAUSTED ... [os_error_code='28']` (the same
status an accelerator out-of-memory has), a jax warning about its compilation
cache, and a flood of tracebacks from the threads of an orbax save that failed
(orbax's logged ones, and asyncio's "Event loop is closed" from tensorstore
callbacks that arrive after the save's event loop closed). `storage_error`
reads the errno out of whatever was raised; `writing` turns a fault inside a
block into one sentence; `quiet_thread_tracebacks` drops the threads'
tracebacks, since the same error is raised to the caller, who reports it once;
`watch_compile_cache` reports a compilation cache that cannot be written once,
and goes on without it.

`kept()` is what every fault sentence says is safe: the newest complete step
of the checkpoint directory the run saves to (`note_checkpoints`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from pathlib import Path

from torch_on_tpu.errors import TorchOnTpuError

logger = logging.getLogger(__name__)

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)|\(os error (\d+)\)")  # tensorstore's, Rust's (tokenizers)
_FREE_SPACE = "free space there or {elsewhere}"
_FAULTS = {
  errno.ENOSPC: ("the filesystem is full", _FREE_SPACE),
  errno.EDQUOT: ("the disk quota is used up", _FREE_SPACE),
  errno.EACCES: ("permission to write there was denied", "make the directory writable by this user"),
  errno.EPERM: ("permission to write there was denied", "make the directory writable by this user"),
  errno.EROFS: ("the filesystem is read-only", "remount it read-write or {elsewhere}"),
  errno.ENOENT: ("the directory vanished", "check the mount and that nothing deletes it during the run"),
}
LARGER_DISK = "point it at a larger disk"


def error_code(e: BaseException) -> int | None:
  """The storage errno carried by `e` or its causes (an OSError, or the text of
  tensorstore's and jax's errors); a context the raiser suppressed (`from None`) is not read."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _FAULTS:
      return e.errno
    for match in _OS_ERROR_CODE.finditer(str(e)):
      code = int(next(g for g in match.groups() if g))
      if code in _FAULTS:
        return code
    e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
  return None


def storage_error(
  e: BaseException, what: str, path, outcome: str | None = None, elsewhere: str = LARGER_DISK
) -> str | None:
  """One sentence for a storage fault (None when `e` is not one): what failed where,
  why, the free space, `outcome` (what is still safe; default `kept()`), and what to do
  (`elsewhere`: how to write somewhere else, e.g. "pass another --log_dir")."""
  code = error_code(e)
  if code is None:
    return None
  why, fix = _FAULTS[code]
  outcome = kept() if outcome is None else outcome
  return f"Could not write {what} to {path}: {why} ({free_space(path)}); {outcome}; {fix.format(elsewhere=elsewhere)}."


@contextlib.contextmanager
def writing(what: str, path, elsewhere: str = LARGER_DISK, outcome: str | None = None):
  """A storage fault inside the block → `TorchOnTpuError` with one sentence naming
  `what` and `path` (and `outcome`, default `kept()`); any other error passes unchanged."""
  try:
    yield
  except TorchOnTpuError:
    raise
  except Exception as e:
    message = storage_error(e, what, path, outcome, elsewhere=elsewhere)
    if message is None:
      raise
    raise TorchOnTpuError(message) from None


@contextlib.contextmanager
def cache_write(what: str, path, partial=None, elsewhere: str = LARGER_DISK):
  """A cache that cannot be written is no reason to stop: a storage fault inside the
  block is logged once as one sentence, `partial` (a half-written file) removed, and the
  caller goes on without the cache; any other error passes unchanged."""
  try:
    yield
  except Exception as e:
    message = storage_error(e, what, path, "the run goes on without caching it", elsewhere=elsewhere)
    if message is None:
      raise
    if message not in _cache_reported:
      _cache_reported.add(message)
      logger.warning(message)
  finally:
    if partial is not None:
      with contextlib.suppress(OSError):
        Path(partial).unlink()


def vanished(directory: Path, step: int, held: list[int]) -> str:
  """One sentence for a checkpoint directory deleted (or unmounted) under a running job."""
  return (
    f"Could not write checkpoint step {step} to {directory}: the directory vanished during the run "
    f"(it held steps {sorted(held)}; {free_space(directory)}); check the mount and that nothing "
    f"deletes it, then resume from a copy or start afresh."
  )


def free_space(path: Path) -> str:
  """'1.2 GiB free of 100 GiB on /mnt' for the filesystem holding `path` (or its nearest existing parent)."""
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


# ---- what a fault leaves safe ------------------------------------------------------------------

_checkpoints: Path | None = None


def note_checkpoints(directory) -> None:
  """The checkpoint directory this process saves to: the one `kept()` reports on."""
  global _checkpoints
  _checkpoints = Path(directory).absolute()


def checkpoint_directory() -> Path | None:
  """The directory `note_checkpoints` named (None before a run names one)."""
  return _checkpoints


def newest_complete_step(directory) -> int | None:
  """The newest step in a checkpoint directory that was completely written (orbax
  renames a step into its number only once every file of it is there)."""
  try:
    steps = [int(p.name) for p in Path(directory).iterdir() if p.name.isdigit()]
  except OSError:
    return None
  return max(steps, default=None)


def kept(directory=None) -> str:
  """What a fault leaves safe in `directory` (default: the one `note_checkpoints` named):
  'step 20 is the newest complete checkpoint in /ckpt (a relaunch resumes from it)'."""
  directory = _checkpoints if directory is None else Path(directory).absolute()
  if directory is None:
    return "no checkpoint directory was in use"
  step = newest_complete_step(directory)
  if step is None:
    return f"{directory} holds no complete checkpoint yet"
  return f"step {step} is the newest complete checkpoint in {directory} (a relaunch resumes from it)"


# ---- tracebacks from the threads of a failed save ----------------------------------------------


_background_fault = None  # called with a storage fault orbax's save thread just logged


def on_background_fault(handler) -> None:
  """`handler(error)` runs (in orbax's thread) when a background save fails on a storage
  fault: on several processes the others wait for this one in the save's barrier, so
  its caller cannot learn of it in time; None removes it."""
  global _background_fault
  _background_fault = handler


# What orbax logs on every read-only open (tools/convert.py reading a run's checkpoints).
_READ_ONLY_NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True, setting")


class _DropThreadTracebacks(logging.Filter):
  """Orbax's own logged failures (a storage fault among them is handed to
  `on_background_fault`'s handler) and its notices on every read-only open, and
  asyncio's "exception was never retrieved" for the write futures of a save that failed
  on a storage fault (collected after its loop closed)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if "orbax" in record.pathname:
      if record.exc_info and _background_fault is not None and error_code(record.exc_info[1]) is not None:
        _background_fault(record.exc_info[1])
      return not (record.exc_info or record.getMessage().startswith(_READ_ONLY_NOTICES))
    return not (record.exc_info and record.name == "asyncio" and error_code(record.exc_info[1]) is not None)


_FILTER = _DropThreadTracebacks()


def _late_tensorstore_callback(unraisable) -> bool:
  """asyncio's RuntimeError from a tensorstore write finishing after the failed save's
  event loop was closed (reported through `sys.unraisablehook`, one per pending write)."""
  value = unraisable.exc_value
  return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def _unraisable_hook(previous):
  def hook(unraisable):
    if not _late_tensorstore_callback(unraisable):
      previous(unraisable)

  hook.quiets_late_tensorstore_callbacks = True
  return hook


def _thread_hook(previous):
  def hook(args):
    writer_thread = type(args.thread).__name__ == "_AsyncWriterThread"  # TensorBoard's
    if not (writer_thread and error_code(args.exc_value) is not None):
      previous(args)

  hook.quiets_writer_threads = True
  return hook


def quiet_thread_tracebacks() -> None:
  """Orbax logs every background-save failure with a traceback (absl's logger), each
  tensorstore write still pending when a save failed prints asyncio's "Event loop is
  closed", and TensorBoard's writer thread dies with its own traceback; each of these
  errors is also raised to the caller (save/wait/close, `RunLog.log`), who says it once,
  so the threads' copies are dropped; so are orbax's warnings on every read-only open,
  which say only that it is read-only."""
  for name in ("absl", "asyncio"):
    if _FILTER not in logging.getLogger(name).filters:
      logging.getLogger(name).addFilter(_FILTER)
  if not getattr(sys.unraisablehook, "quiets_late_tensorstore_callbacks", False):
    sys.unraisablehook = _unraisable_hook(sys.unraisablehook)
  if not getattr(threading.excepthook, "quiets_writer_threads", False):
    threading.excepthook = _thread_hook(threading.excepthook)


# ---- jax's persistent compilation cache --------------------------------------------------------

_CACHE_WRITE_FAILED = "Error writing persistent compilation cache entry"
_CACHE_READ_FAILED = "Error reading persistent compilation cache entry"
_cache_dir: Path | None = None
_cache_reported: set[str] = set()


def watch_compile_cache(directory) -> None:
  """Reports a compilation cache at `directory` that cannot be written (or holds an entry
  a full disk cut short) in one sentence, once, instead of jax's warning per program;
  the run goes on compiling what it cannot cache. The entry a failed write cut short is
  removed (jax would warn about it at every later start)."""
  global _cache_dir
  _cache_dir = Path(directory).absolute()
  if not getattr(warnings.showwarning, "watches_compile_cache", False):
    warnings.showwarning = _show_warning(warnings.showwarning)
    # every occurrence reaches `show` (each cuts an entry short), which says it once
    warnings.filterwarnings("always", message=f"({_CACHE_WRITE_FAILED}|{_CACHE_READ_FAILED})")


def _show_warning(previous):
  def show(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    if _cache_dir is None or not text.startswith((_CACHE_WRITE_FAILED, _CACHE_READ_FAILED)):
      return previous(message, category, filename, lineno, file, line)
    reason = text.split(": ", 1)[-1]  # "OSError: [Errno 28] No space left on device"
    if text.startswith(_CACHE_WRITE_FAILED):
      _remove_cut_entries(_cache_dir, text.split("'")[1] if text.count("'") >= 2 else None)
      code = re.search(r"\[Errno (\d+)\]", reason)
      sentence = storage_error(
        OSError(int(code.group(1)) if code else 0, reason), "compiled programs", _cache_dir,
        "the run goes on, compiling what it cannot cache", elsewhere="pass --compile_cache=off",
      ) or f"Could not write compiled programs to {_cache_dir} ({reason}); the run goes on without caching them."
    else:
      sentence = (
        f"An entry of the compilation cache at {_cache_dir} is damaged ({reason}), e.g. cut short by "
        f"a full disk; the program was compiled again."
      )
    kind = text[: len(_CACHE_WRITE_FAILED)]
    if kind not in _cache_reported:
      _cache_reported.add(kind)
      logger.warning(sentence)

  show.watches_compile_cache = True
  return show


def _remove_cut_entries(directory: Path, program: str | None) -> None:
  """Removes what a failed cache write left: empty entries, and the newest entry of
  `program` (the one cut short), which jax would otherwise try to read at every start."""
  with contextlib.suppress(OSError):
    entries = [p for p in directory.iterdir() if p.is_file()]
    cut = [p for p in entries if program and p.name.startswith(f"{program}-")]
    doomed = {p for p in entries if p.stat().st_size == 0}
    if cut:
      doomed.add(max(cut, key=lambda p: p.stat().st_mtime))
    for entry in doomed:
      entry.unlink(missing_ok=True)
