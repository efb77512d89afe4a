"""Faults of a multi-process run, injected into the llama3 recipe under
`python -m torch_on_tpu.launch` (2 processes x 2 simulated CPU devices): a process that
hangs (SIGSTOP), one killed mid-step (SIGKILL), a checkpoint disk that fills at a later
save (tmpfs), a flag that differs on one process, no coordinator. Each must end the whole
run with one sentence naming the faulty process and what it was doing, a documented exit
code, the newest complete checkpoint named and restorable, and no traceback or C++ stack.
tools/fault_table.py tries each many times; this is one try of each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import torch_on_tpu as tot
from tests.test_checkpoint_faults import tmpfs
from tests.test_multihost import clean_env
from torch_on_tpu.core import storage
from torch_on_tpu.io import checkpoint
from torch_on_tpu.runtime import fingerprint, health, launch

ROOT = Path(__file__).parent.parent
HEARTBEAT_S = 10  # TOT_HEARTBEAT_TIMEOUT for these runs (default 20)
RECIPE = ["--eval_every=0", "--seqlen=32", "--global_batch_size=8", "--save_every=2"]


class Run:
  """One launch of the recipe (2 processes x 2 devices), watched through its status directory."""

  def __init__(self, tmp: Path, name: str, *flags: str, env: dict | None = None, script=None):
    self.dir = tmp / name
    self.status = self.dir / "status"
    self.status.mkdir(parents=True)
    self.env = {**clean_env(), "TOT_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), health.ENV_STATUS_DIR: str(self.status), **(env or {})}
    target = [str(script)] if script else ["-m", "recipes.llama3"]
    cmd = [sys.executable, "-m", "torch_on_tpu.launch", "--nproc", "2", "--cpu_devices", "2", *target, *RECIPE, *flags]
    self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  def activity(self, index: int) -> dict:
    try:
      return json.loads((self.status / f"p{index}.json").read_text())
    except (OSError, ValueError):
      return {}

  def signal_at_step(self, index: int, step: int, sig: int, timeout: float = 300) -> tuple[float, int]:
    """Sends `sig` to process `index` once it runs step `step` or a later one (a resumed run's
    steps can pass between two looks); the time sent and the step it was running."""
    deadline = time.monotonic() + timeout
    while True:
      seen = re.match(r"running step (\d+)", self.activity(index).get("activity", ""))
      if seen and int(seen.group(1)) >= step:
        break
      assert self.proc.poll() is None and time.monotonic() < deadline, self.finish()
      time.sleep(0.005)
    os.kill(self.activity(index)["pid"], sig)
    return time.monotonic(), int(seen.group(1))

  def finish(self, timeout: float = 420) -> tuple[int, str, str]:
    out, err = self.proc.communicate(timeout=timeout)
    return self.proc.returncode, out, err


def assert_clean(out: str, err: str) -> str:
  """No traceback, no C++ stack address; the launcher's one line (its last line)."""
  text = out + err
  assert "Traceback" not in text and not re.search(r"@\s+0x[0-9a-f]{6,}", text), text[-4000:]
  return err.strip().splitlines()[-1]


def restorable(directory: Path) -> int:
  """The step `Checkpointer.restore` reads back from `directory` (its newest good one), every array finite."""
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    saved = ckpt._manager.item_metadata(ckpt.latest_step())["state"].tree
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)
    restored = ckpt.restore(checkpoint.abstract_state(target, mesh=tot.make_mesh(fsdp=-1)))
  arrays = [np.asarray(x) for x in jax.tree.leaves(restored.state)]
  assert all(np.isfinite(x).all() for x in arrays if np.issubdtype(x.dtype, np.floating))
  return restored.step


def test_a_hung_process_then_a_killed_one_are_named_and_each_relaunch_resumes(tmp_path):
  """Two launches on one run directory: process 1 hangs (SIGSTOP) at step 5; the relaunch
  resumes from the newest complete checkpoint, and its process 1 is SIGKILLed mid-step."""
  log_dir = tmp_path / "run"
  run = Run(tmp_path, "hang", "--steps=12", f"--log_dir={log_dir}")
  stopped, hung_at = run.signal_at_step(1, 5, signal.SIGSTOP)
  code, out, err = run.finish()
  noticed = time.monotonic() - stopped
  line = assert_clean(out, err)
  assert code == health.EXIT_HUNG, (code, line)
  # the step it was seen running when stopped, or the next (what it published then may be a step on)
  said = re.match(r"launch: process 1 \(host \S+, pid \d+\) stopped responding while running step (\d+)", line)
  assert said and int(said.group(1)) in (hung_at, hung_at + 1), line
  assert "(process 0 noticed after" in line and line.endswith("exit 124.")
  kept = int(re.search(r"step (\d+) is the newest complete checkpoint in (\S+)", line).group(1))
  assert kept in range(2, hung_at, 2) and storage.newest_complete_step(log_dir / "ckpt") == kept
  survivor = json.loads((run.status / "p0.fault.json").read_text())["sentence"]  # also printed, after its progress bar
  assert survivor.startswith("Process 1 (host") and f"stopped responding while running step {said.group(1)}" in survivor
  assert "process 0 (host" in survivor and "stops too (exit 75)" in survivor
  assert noticed < HEARTBEAT_S + 10, noticed  # the bound docs/multihost.md gives
  print(f"hung process noticed and the run stopped in {noticed:.1f} s (heartbeat timeout {HEARTBEAT_S} s)")

  relaunch = Run(tmp_path, "kill", "--steps=12", f"--log_dir={log_dir}")
  killed, killed_at = relaunch.signal_at_step(1, kept + 3, signal.SIGKILL)
  code, out, err = relaunch.finish()
  stopped = time.monotonic() - killed
  line = assert_clean(out, err)
  assert f"[p0] Resumed from step {kept} of {log_dir / 'ckpt'}" in out
  assert code == 128 + signal.SIGKILL, line
  assert re.match(rf"launch: process 1 \(host \S+, pid \d+\) was killed by SIGKILL while running step {killed_at}", line), line
  newest = int(re.search(r"step (\d+) is the newest complete checkpoint", line).group(1))
  assert newest >= kept and restorable(log_dir / "ckpt") == newest
  assert stopped < launch.FAILURE_GRACE_SECONDS + 10, stopped
  print(f"killed process named; run stopped {stopped:.1f} s after the kill")


def test_a_checkpoint_disk_that_fills_at_a_later_save_names_it_and_keeps_the_earlier_step(tmp_path):
  with tmpfs(tmp_path / "disk", size="100m") as disk:  # a step of this state is ~71 MB: step 2 fits, step 4 does not
    run = Run(tmp_path, "full", "--steps=6", f"--ckpt_dir={disk / 'ckpt'}", f"--log_dir={tmp_path / 'full'}")
    code, out, err = run.finish()
    line = assert_clean(out, err)
    assert code == 1, line
    sentence = f"Could not write checkpoint step 4 to {disk / 'ckpt'}: the filesystem is full ("
    assert sentence in line and "MiB free of 100.0 MiB" in line, line
    assert f"step 2 is the newest complete checkpoint in {disk / 'ckpt'}" in line
    assert restorable(disk / "ckpt") == 2


def test_processes_that_differ_in_one_flag_are_refused_at_start(tmp_path):
  run = Run(tmp_path, "differ", "--steps=2", f"--log_dir={tmp_path / 'differ'}", script=ROOT / "tests" / "fault_recipe.py", env={"TOT_TEST_EXTRA_FLAG": "1:--lr=0.001"})
  code, out, err = run.finish()
  line = assert_clean(out, err)
  assert code == health.EXIT_MISMATCH, line
  assert re.search(r"Process 1 \(host \S+, pid \d+\) differs from process 0 \(host \S+, pid \d+\) in its config: "
                   r"--lr=0.001 there, --lr=0.003 on process 0", line), line
  assert not (tmp_path / "differ" / "ckpt").exists()  # refused before anything was built


def test_no_coordinator_at_start_is_one_sentence_with_the_address_and_the_timeout(tmp_path):
  address = f"127.0.0.1:{launch.free_port()}"
  env = {**clean_env(), "TOT_COORDINATOR": address, "TOT_NUM_PROCESSES": "2", "TOT_PROCESS_ID": "1", "TOT_INIT_TIMEOUT": "4"}
  start = time.monotonic()
  done = subprocess.run(
    [sys.executable, "-m", "recipes.llama3", "--steps=1", "--cpu_devices=2", f"--log_dir={tmp_path}"],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
  )
  assert done.returncode == health.EXIT_NO_COORDINATOR, done.stderr[-2000:]
  line = assert_clean(done.stdout, done.stderr)
  assert line == (
    f"error: Process 1 could not join the run: nothing answers at the coordinator's address {address} within 4 s "
    f"(TOT_INIT_TIMEOUT); start process 0 (it holds the coordinator), or check the address, the port and the firewall."
  )
  assert time.monotonic() - start < 60


# ---- the pieces, without processes ------------------------------------------------------------


def test_the_launcher_blames_the_faulty_process_not_the_one_that_stopped_because_of_it(tmp_path):
  status = launch._Status(str(tmp_path))

  def verdict(writer: int, faulty: int, how: str):
    (tmp_path / f"p{writer}.fault.json").write_text(json.dumps({"faulty": faulty, "how": how, "sentence": "s.", "silent": 10}))

  assert launch._blame([None, None], set(), status) is None
  assert launch._blame([None, 1], set(), status) == (1, 1)  # an error of its own
  assert launch._blame([-9, -6], {1}, status) == (0, -9)  # process 0 killed; jax ended process 1 for it
  verdict(0, 1, "unresponsive")
  assert launch._blame([health.EXIT_PEER_FAILED, None], set(), status) == (1, None)  # hung: still running
  (tmp_path / "p0.fault.json").unlink()
  assert launch._blame([None, -6], {1}, status) is None  # jax ended process 1: it lost process 0, which may be leaving
  assert launch._blame([None, -6], {1}, status, waited=60) == (0, None)  # ... or hangs
  verdict(0, 1, "differs")
  verdict(1, 1, "differs")
  assert launch._blame([3, None], set(), status) is None  # it is leaving by itself
  assert launch._blame([3, 3], set(), status) == (1, 3)
  (tmp_path / "p1.json").write_text(json.dumps({"host": "h", "pid": 7, "activity": "running step 5"}))
  assert status.describe(1, 3, {}) == "process 1 (host h, pid 7) exited with code 3: s"
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (tmp_path / "p1.json").write_text(json.dumps({"host": "h", "pid": 7, "activity": "running step 5", "checkpoints": str(ckpt)}))
  assert status.kept(1) == f"{ckpt} holds no complete checkpoint yet"
  (tmp_path / "p1.fault.json").write_text(json.dumps({"faulty": 1, "how": "failed", "sentence": f"Disk full; {ckpt} holds no complete checkpoint yet."}))
  assert status.kept(1) is None  # the process's own sentence said it: not said twice
  (tmp_path / "p1.json").write_text(json.dumps({"host": "h", "pid": 7, "activity": "running step 5"}))
  (tmp_path / "p0.fault.json").write_text(json.dumps({"faulty": 1, "how": "unresponsive", "silent": 10}))
  (tmp_path / "p1.fault.json").unlink()
  assert status.describe(1, None, {}) == (
    "process 1 (host h, pid 7) stopped responding while running step 5 (process 0 noticed after 10 s without a sign of it)"
  )
  # what process 0 saw it doing (published a step on from the launcher's file) is what both say
  (tmp_path / "p0.fault.json").write_text(json.dumps({"faulty": 1, "how": "unresponsive", "silent": 10, "activity": "running step 6"}))
  assert status.describe(1, None, {}).startswith("process 1 (host h, pid 7) stopped responding while running step 6 (process 0")


def test_a_difference_is_named_by_its_first_entry():
  assert fingerprint._difference("config", {"lr": 0.001, "seed": 0}, {"lr": 0.003, "seed": 0}) == (
    "--lr=0.001 there, --lr=0.003 on process 0"
  )
  ours, theirs = fingerprint.code(), fingerprint.code()
  assert "torch_on_tpu/training/trainer.py" in ours["files"] and ours["versions"]["jax"]
  theirs["files"]["torch_on_tpu/training/trainer.py"] = "0" * 16
  assert fingerprint._difference("code", theirs, ours) == "torch_on_tpu/training/trainer.py differs"
  theirs = {**ours, "versions": {**ours["versions"], "jax": "0.0.1"}}
  assert fingerprint._difference("code", theirs, ours) == f"jax 0.0.1 there, {ours['versions']['jax']} on process 0"
  assert fingerprint._difference("data", {"seed": 1}, {"seed": 0}) == "seed=1 there, seed=0 on process 0"
  fingerprint.check_same(config={"lr": 1.0})  # one process: nothing to compare


def test_the_fault_tables_trials_signal_at_or_after_their_step_and_count_runs_that_finished_first():
  from tests import helpers as h

  table = h.load_module(ROOT / "tools" / "fault_table.py")
  assert table._reached("running step 7 (writing checkpoint step 6 meanwhile)", "running step 5")
  assert not table._reached("running step 4", "running step 5")
  assert table._reached("saving checkpoint step 6", "saving checkpoint step 6")
  assert not table._reached("running step 9", "saving checkpoint step 6")  # a save is waited for as such
  summary = table._summary([{"code": 124, "tracebacks": 0}, {"code": "finished before the signal", "tracebacks": 0}], [2.0])
  assert "exit [124, 'finished before the signal']" in summary


class _Coordinator:
  """jax's coordination client as the watch uses it, each call taking a little time (as
  a call into the coordinator does, with Python's lock released)."""

  def __init__(self):
    self.store: dict[str, str] = {"torch_on_tpu/mark/done/0": "1"}

  def key_value_set(self, key, value, allow_overwrite=False):
    time.sleep(0.01)
    self.store[key] = value

  def key_value_dir_get(self, prefix):
    time.sleep(0.01)
    return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

  def key_value_try_get(self, key):
    return self.store[key]

  def get_live_nodes(self, everyone):
    time.sleep(0.01)
    return everyone


def test_a_clean_exit_ends_the_watching_threads_before_the_interpreter_does(tmp_path, monkeypatch):
  """A watching thread left inside a call to the coordinator while Python finalizes aborts
  the process that finished its work (SIGABRT, 'FATAL: exception not rethrown': seen in CI
  at exit of a 2-process run). Leaving joins them, and says it was leaving."""
  monkeypatch.setenv(health.ENV_STATUS_DIR, str(tmp_path))
  monkeypatch.setenv("TOT_PROCESS_ID", "1")
  watch = health._Watch(_Coordinator(), index=1, count=2, heartbeat_timeout=10.0)
  watch.start_threads()
  time.sleep(4 * health.POLL_SECONDS)
  assert len(watch.threads) == 3 and all(t.is_alive() for t in watch.threads)
  watch._at_exit()
  assert [t.name for t in watch.threads if t.is_alive()] == []
  assert watch.client.store["torch_on_tpu/mark/done/1"] == "1"
  assert json.loads((tmp_path / "p1.json").read_text())["activity"] == "leaving, its work done"
