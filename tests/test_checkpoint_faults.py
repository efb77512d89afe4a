"""Fault injection on checkpoints: damaged files of each kind, a full disk, a
read-only filesystem, a vanished directory. Nothing saved complete is lost, no
bad state is loaded, and each fault is one sentence (tools/fault_table.py runs
the long version)."""

import contextlib
import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from torch_on_tpu.core import storage
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import checkpoint, integrity


def state(value, n=64):
  return {"w": jnp.full((n,), float(value)), "b": jnp.arange(4.0) + value}


def target():
  return {"w": jnp.zeros(64), "b": jnp.zeros(4)}


def saved_steps(directory, steps=(1, 2)):
  with checkpoint.Checkpointer(directory) as ckpt:
    for s in steps:
      ckpt.save(s, state(s), data={"pos": s}, config={"lr": 0.1}, force=True)
  return directory


def array_file(step_dir):
  return sorted((step_dir / "state" / "ocdbt.process_0" / "d").iterdir())[0]


def flip(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def truncate(path):
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
  "array file flipped": (lambda d: flip(array_file(d)), "does not match its checksum"),
  "array file truncated": (lambda d: truncate(array_file(d)), "bytes where"),
  "array file missing": (lambda d: array_file(d).unlink(), "is missing"),
  "ocdbt manifest flipped": (lambda d: flip(d / "state" / "manifest.ocdbt"), "state/manifest.ocdbt does not match"),
  "pytree metadata truncated": (lambda d: truncate(d / "state" / "_METADATA"), "state/_METADATA has"),
  "data json bad": (lambda d: (d / "data" / "metadata").write_text("{not json"), "data/metadata has"),
  "checksums bad json": (lambda d: (d / integrity.MANIFEST).write_text("{"), "checksums.json is unreadable"),
  # Without checksums (a step saved before they existed) the reader's own errors are caught.
  "no checksums, state dir gone": (
    lambda d: ((d / integrity.MANIFEST).unlink(), shutil.rmtree(d / "state")),
    "its metadata is unreadable",
  ),
  "no checksums, data json bad": (
    lambda d: ((d / integrity.MANIFEST).unlink(), (d / "data" / "metadata").write_text("{")),
    "reading it failed: JSONDecodeError",
  ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_newest_step_is_named_and_the_previous_one_restored(tmp_path, kind, caplog):
  directory = saved_steps(tmp_path / "ckpt")
  damage, phrase = DAMAGE[kind]
  damage(directory / "2")
  with checkpoint.Checkpointer(directory) as ckpt:
    with pytest.raises(TorchOnTpuError, match=rf"checkpoint at .*/2 is damaged \(.*{phrase}.*\); restore another step") as err:
      ckpt.restore(target(), step=2)
    assert "\n" not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="torch_on_tpu.io.checkpoint"):
      restored = ckpt.restore(target())
  assert restored.step == 1 and restored.data == {"pos": 1}
  np.testing.assert_array_equal(restored.state["w"], np.full(64, 1.0))
  assert f"{directory / '2'} is damaged" in caplog.text and "trying the previous step" in caplog.text
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2.damaged"]  # set aside, not deleted


def test_every_step_damaged_raises_instead_of_starting_afresh(tmp_path):
  directory = saved_steps(tmp_path / "ckpt")
  for s in ("1", "2"):
    flip(array_file(directory / s))
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    with pytest.raises(TorchOnTpuError, match=r"Every checkpoint in .* is damaged \(step 2: .*; step 1: .*\)"):
      ckpt.restore(target())
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # read-only: nothing renamed


def test_a_mismatched_target_is_not_mistaken_for_damage(tmp_path):
  directory = saved_steps(tmp_path / "ckpt")
  with checkpoint.Checkpointer(directory) as ckpt:
    with pytest.raises(TorchOnTpuError, match="does not match the state to restore"):
      ckpt.restore({"w": jnp.zeros(8)})
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


# ---- storage faults, on a small tmpfs ------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path, size="400k"):
  path.mkdir()
  try:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, capture_output=True)
  except (OSError, subprocess.CalledProcessError) as e:
    pytest.skip(f"mounting a tmpfs needs root: {e}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], check=False)


def big_state(seed=0):
  """About 800 kB of incompressible floats: more than the tmpfs holds."""
  return {"w": jnp.asarray(np.random.default_rng(seed).standard_normal(200_000).astype(np.float32))}


def assert_one_sentence_and_no_traceback(message, capfd):
  assert "\n" not in message and message.endswith(".")
  assert "Traceback" not in "".join(capfd.readouterr())


def test_a_full_disk_is_named_with_the_free_space_and_the_last_step_survives(tmp_path, capfd):
  with tmpfs(tmp_path / "disk") as disk:
    ckpt = checkpoint.Checkpointer(disk / "ckpt")
    ckpt.save(1, {"w": jnp.ones(1000)}, force=True)
    ckpt.save(2, big_state(), force=True)  # asynchronous: the fault comes at the next wait
    with pytest.raises(TorchOnTpuError) as err:
      ckpt.wait()
    message = str(err.value)
    assert message.startswith(f"Could not write checkpoint step 2 to {disk / 'ckpt'}: the filesystem is full (")
    assert "MiB free of 0.4 MiB" in message and "step 1 is the newest complete checkpoint" in message
    assert "device memory" not in message and "RESOURCE_EXHAUSTED" not in message
    ckpt.close()  # reported once: closing after it is quiet
    assert_one_sentence_and_no_traceback(message, capfd)
    with checkpoint.Checkpointer(disk / "ckpt") as reader:
      restored = reader.restore({"w": jnp.zeros(1000)})
    assert restored.step == 1
    np.testing.assert_array_equal(restored.state["w"], np.ones(1000))


def _waiting_threads(before: set, seconds: float = 10.0) -> list[str]:
  """Non-daemon threads started since `before` that are still alive after `seconds` (one that
  is merely finishing its shutdown, as an asyncio executor's may be, gets that long)."""
  deadline = time.monotonic() + seconds
  while True:
    extra = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread() and t not in before]
    if not extra or time.monotonic() > deadline:
      return [t.name for t in extra]
    time.sleep(0.05)


def test_a_read_only_filesystem_is_named_and_save_fails_in_the_caller(tmp_path, capfd):
  before = set(threading.enumerate())  # other tests of this worker may leave idle executor threads
  with tmpfs(tmp_path / "disk", size="4m") as disk:
    ckpt = checkpoint.Checkpointer(disk / "ckpt")
    ckpt.save(1, state(1), force=True)
    ckpt.wait()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
      with pytest.raises(TorchOnTpuError, match=r"step 2 to .*: the filesystem is read-only .*; step 1 is the newest") as err:
        ckpt.save(2, state(2), force=True)
    finally:
      subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    ckpt.close()
    # no save thread left waiting, which would keep the process from exiting
    assert _waiting_threads(before) == []
    assert_one_sentence_and_no_traceback(str(err.value), capfd)
    assert checkpoint.Checkpointer(disk / "ckpt", read_only=True).restore(target()).step == 1


def test_storage_errors_are_told_apart_from_device_memory():
  full = ValueError("RESOURCE_EXHAUSTED: Failed to write 518455 bytes: No space left on device [os_error_code='28']")
  assert storage.error_code(full) == 28
  assert storage.error_code(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")) is None
  denied = PermissionError(13, "Permission denied")
  wrapped = ValueError("commit failed")
  wrapped.__cause__ = denied
  message = storage.storage_error(wrapped, "checkpoint step 3", Path("/nonexistent/ckpt"), "step 2 is intact")
  assert message.startswith("Could not write checkpoint step 3 to /nonexistent/ckpt: permission to write there was denied (")
  assert "free of" in message and message.endswith("make the directory writable by this user.")
  assert storage.storage_error(ValueError("shape mismatch"), "x", Path("/"), "y") is None


def test_a_directory_that_vanishes_during_the_run_is_named_not_silently_recreated(tmp_path):
  directory = tmp_path / "ckpt"
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, state(1), force=True)
    ckpt.wait()
    shutil.rmtree(directory)
    with pytest.raises(TorchOnTpuError) as err:
      ckpt.save(2, state(2), force=True)
  message = str(err.value)
  assert "the directory vanished during the run (it held steps [1]" in message and str(directory) in message
  assert "\n" not in message and not directory.exists()
