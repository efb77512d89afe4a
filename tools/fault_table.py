"""Fault injection, the long version: run each fault many times, print "fault, times tried, outcome".

    python tools/fault_table.py                  # every fault, 20 SIGKILLs
    python tools/fault_table.py --kills 5 --only sigkill,damage

Faults: SIGKILL at random moments of a training process (many land inside a
save), then a relaunch to the end, whose losses must equal an uninterrupted
run's bit for bit; byte flips, truncation and removal of each file kind of
the newest checkpoint (the previous step must be restored, the damage named);
a full disk and a read-only filesystem while saving (tmpfs, needs root); NaN
from a huge learning rate through the llama3 recipe (no non-finite state
saved); SIGTERM to the launcher running 2 processes of the recipe (each saves,
exit 0 end to end). Under the launcher (2 processes x 2 devices of the llama3
recipe, `TOT_HEARTBEAT_TIMEOUT=10`): the checkpoint disk full at the first and at a
later save, the log directory full, the compilation cache full (tmpfs, root); one
process SIGSTOPped at random points and SIGKILLed mid-step or mid-save (a relaunch of
every fifth must resume and finish); a flag that differs on one process; no
coordinator. `tests/test_checkpoint_faults.py`, `tests/test_storage_faults.py` and
`tests/test_process_faults.py` run the short version of each.

    python tools/fault_table.py --only disks,processes --stops 20 --process_kills 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "ckpt_worker.py"
STEPS, SAVE_EVERY = 12, 3


def _env(cache: Path, **extra) -> dict:
  env = dict(os.environ)
  env.update(
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    PYTHONPATH=str(ROOT),
    **extra,
  )
  return env


def _worker(tmp: Path, ckpt: Path, log: Path, *extra: str) -> subprocess.Popen:
  cmd = [sys.executable, str(WORKER), "--dir", str(ckpt), "--log", str(log), "--steps", str(STEPS)]
  cmd += ["--save_every", str(SAVE_EVERY), *extra]
  return subprocess.Popen(cmd, env=_env(tmp / "cache"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(log: Path) -> dict:
  if not log.exists():
    return {}
  return dict(line.split() for line in log.read_text().splitlines() if len(line.split()) == 2)


def sigkill(tmp: Path, trials: int) -> str:
  ref = tmp / "reference"
  out, _ = _worker(tmp, ref / "ckpt", ref / "log").communicate()
  reference = _losses(ref / "log")
  assert len(reference) == STEPS, out
  good, mid_save, problems = 0, 0, []
  for trial in range(trials):
    run = tmp / f"kill{trial}"
    proc = _worker(tmp, run / "ckpt", run / "log", "--step_sleep", "0.05")
    target = random.randrange(1, STEPS)
    while len(_losses(run / "log")) < target and proc.poll() is None:
      time.sleep(0.01)
    time.sleep(random.uniform(0, 0.15))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    mid_save += bool(list((run / "ckpt").glob("*.orbax-checkpoint-tmp*")))
    relaunch = _worker(tmp, run / "ckpt", run / "log2")
    text, _ = relaunch.communicate()
    logged = {**_losses(run / "log"), **_losses(run / "log2")}
    differ = [s for s in logged if logged[s] != reference.get(s)]
    if relaunch.returncode == 0 and not differ and len(logged) == STEPS and "Traceback" not in text:
      good += 1
    else:
      problems.append(f"trial {trial}: exit {relaunch.returncode}, steps {differ} differ")
  outcome = f"{good}/{trials} relaunches finished with every loss bitwise equal to an uninterrupted run"
  outcome += f"; {mid_save} kills landed inside a save (its partial step ignored)"
  return outcome + ("; FAILED: " + "; ".join(problems) if problems else "")


def damage(tmp: Path, flips: int) -> list[tuple[str, int, str]]:
  sys.path.insert(0, str(ROOT))
  import numpy as np

  from tests import test_checkpoint_faults as faults
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.io import checkpoint

  def trial(name, hurt, phrase):
    """(named in one sentence, previous step restored) after `hurt` damaged step 2."""
    directory = faults.saved_steps(tmp / name)
    hurt(directory / "2")
    named = False
    with checkpoint.Checkpointer(directory) as ckpt:
      try:
        ckpt.restore(faults.target(), step=2)
      except TorchOnTpuError as e:
        named = phrase in str(e) and "\n" not in str(e)
      back = ckpt.restore(faults.target())
    return named, back.step == 1 and bool(np.all(np.asarray(back.state["w"]) == 1.0))

  kinds = [trial(f"kind-{i}", hurt, phrase) for i, (hurt, phrase) in enumerate(faults.DAMAGE.values())]

  def random_flip(step_dir):
    files = sorted(p for p in step_dir.glob("*/**/*") if p.is_file() and p.stat().st_size)
    path = random.choice(files)
    data = bytearray(path.read_bytes())
    data[random.randrange(len(data))] ^= 1 << random.randrange(8)
    path.write_bytes(bytes(data))

  flipped = [trial(f"flip-{i}", random_flip, "does not match its checksum") for i in range(flips)]

  def outcome(results):
    return (
      f"{sum(n for n, _ in results)}/{len(results)} named in one sentence with the step and file; "
      f"{sum(r for _, r in results)}/{len(results)} restored the previous step"
    )

  return [
    (f"each file kind of the newest step damaged ({', '.join(faults.DAMAGE)})", len(kinds), outcome(kinds)),
    ("one random bit flipped in a random file of the newest step", flips, outcome(flipped)),
  ]


def storage_faults(tmp: Path, trials: int) -> list[tuple[str, int, str]]:
  sys.path.insert(0, str(ROOT))
  from tests import test_checkpoint_faults as faults
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.io import checkpoint

  rows = []
  for fault in ("full", "read-only"):
    named = kept = 0
    for trial in range(trials):
      disk = tmp / f"{fault}-{trial}"
      disk.mkdir()
      if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)], capture_output=True).returncode:
        return rows + [("disk full / read-only while saving", 0, "not tried: mounting a tmpfs needs root")]
      try:
        ckpt = checkpoint.Checkpointer(disk / "ckpt")
        ckpt.save(1, faults.state(1), force=True)
        ckpt.wait()
        if fault == "read-only":
          subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        try:
          ckpt.save(2, faults.big_state(trial) if fault == "full" else faults.state(2), force=True)
          ckpt.wait()
        except TorchOnTpuError as e:
          named += "Could not write checkpoint step 2" in str(e) and "step 1 is the newest" in str(e)
        ckpt.close()
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        with checkpoint.Checkpointer(disk / "ckpt", read_only=True) as reader:
          kept += reader.restore(faults.target()).step == 1
      finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    rows.append((
      f"disk {fault} while saving", trials,
      f"{named}/{trials} one sentence with the path and free space (not device OOM); "
      f"{kept}/{trials} kept step 1 restorable",
    ))
  return rows


def nan_lr(tmp: Path, lr: str, expected: str) -> str:
  run = tmp / f"nan-{lr}"
  cmd = [sys.executable, "-m", "recipes.llama3", f"--lr={lr}", "--steps=8", "--save_every=2", "--eval_every=0",
         "--seqlen=32", "--global_batch_size=8", f"--log_dir={run}", "--cpu_devices=8"]
  done = subprocess.run(cmd, cwd=ROOT, env=_env(tmp / "cache"), capture_output=True, text=True)
  sys.path.insert(0, str(ROOT))
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from torch_on_tpu.io import checkpoint

  finite = True
  with checkpoint.Checkpointer(run / "ckpt", read_only=True) as ckpt:
    steps = ckpt.all_steps()
    for step in steps:  # every saved array, read back as numpy
      tree = ckpt._manager.item_metadata(step)["state"].tree
      as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      state = ocp.PyTreeCheckpointer().restore(
        run / "ckpt" / str(step) / "state", args=ocp.args.PyTreeRestore(restore_args=as_numpy)
      )
      finite &= all(np.isfinite(x).all() for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.floating))
  last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
  sentence = expected in last and "Traceback" not in done.stderr
  return (
    f"exit {done.returncode}; saved steps {steps}, {'all finite' if finite else 'NON-FINITE'}; "
    f"{'one sentence' if sentence else 'UNEXPECTED'}: {last[:160]}"
  )


def launcher_sigterm(tmp: Path) -> str:
  log_dir = tmp / "launch"
  cmd = [sys.executable, "-m", "torch_on_tpu.launch", "--nproc", "2", "--cpu_devices", "4", "-m", "recipes.llama3",
         "--steps=400", "--save_every=1000", "--eval_every=0", "--seqlen=32", "--global_batch_size=8",
         f"--log_dir={log_dir}"]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp / "cache"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = log_dir / "metrics.jsonl"
  deadline = time.time() + 400
  while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=600)
  saved = sorted(int(p.name) for p in (log_dir / "ckpt").iterdir() if p.name.isdigit()) if (log_dir / "ckpt").exists() else []
  return f"launcher exit {proc.returncode}; saved steps {saved}; {err.strip().splitlines()[-1][:160] if err.strip() else ''}"


# ---- faults of a multi-process run: the llama3 recipe under the launcher, 2 processes x 2 devices ----

HEARTBEAT_S = 10
MP_STEPS, MP_SAVE_EVERY = 12, 3
KEEP: Path | None = None  # --keep
_CXX_FRAME = re.compile(r"@\s+0x[0-9a-f]{6,}")


class _Launch:
  """One launch of the recipe, watched through the status directory the launcher shares."""

  def __init__(self, tmp: Path, name: str, *flags: str, env: dict | None = None, script: str | None = None):
    self.dir = tmp / name
    self.status = self.dir / "status"
    self.status.mkdir(parents=True)
    environment = {**_env(tmp / "cache", TOT_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S), TOT_STATUS_DIR=str(self.status)), **(env or {})}
    environment.pop("XLA_FLAGS", None)
    target = [script] if script else ["-m", "recipes.llama3"]
    log_dir = [] if any(f.startswith("--log_dir=") for f in flags) else [f"--log_dir={self.dir / 'run'}"]
    cmd = [sys.executable, "-m", "torch_on_tpu.launch", "--nproc", "2", "--cpu_devices", "2", *target,
           f"--steps={MP_STEPS}", f"--save_every={MP_SAVE_EVERY}", "--eval_every=0", "--seqlen=32",
           "--global_batch_size=8", *log_dir, *flags]
    self.started = time.monotonic()
    self.proc = subprocess.Popen(cmd, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  def activity(self, index: int) -> dict:
    try:
      return json.loads((self.status / f"p{index}.json").read_text())
    except (OSError, ValueError):
      return {}

  def signal_when(self, index: int, prefix: str, sig: int, delay: float) -> float | None:
    """`sig` to process `index` `delay` s after it says it is doing `prefix`... (for "running step
    N": that step or a later one, which can pass between two looks); when sent (None: it never did)."""
    while not _reached(self.activity(index).get("activity", ""), prefix):
      if self.proc.poll() is not None or time.monotonic() - self.started > 900:
        return None
      time.sleep(0.005)
    time.sleep(delay)
    os.kill(self.activity(index)["pid"], sig)
    return time.monotonic()

  def finish(self) -> dict:
    out, err = self.proc.communicate(timeout=1200)
    if KEEP is not None:  # every launch's output, to read what a surprising row did
      (KEEP / f"{self.dir.name}.out").write_text(out)
      (KEEP / f"{self.dir.name}.err").write_text(err)
    text = out + err
    return {
      "code": self.proc.returncode, "line": err.strip().splitlines()[-1] if err.strip() else "",
      "tracebacks": text.count("Traceback") + len(_CXX_FRAME.findall(text)), "ended": time.monotonic(), "out": out,
      "jax_aborts": text.count("Terminating process because the JAX distributed service"),
    }


def _reached(activity: str, prefix: str) -> bool:
  running, wanted = re.match(r"running step (\d+)", activity), re.match(r"running step (\d+)$", prefix)
  if running and wanted:
    return int(running.group(1)) >= int(wanted.group(1))
  return activity.startswith(prefix)


def _kept(line: str) -> str:
  found = re.search(r"step (\d+) is the newest complete checkpoint", line)
  return f"step {found.group(1)}" if found else ("none yet" if "no complete checkpoint" in line else "not named")


def _summary(results: list[dict], noticed: list[float]) -> str:
  codes = sorted({r["code"] for r in results}, key=str)  # an exit status, or "finished before the signal"
  tracebacks = sum(r["tracebacks"] for r in results)
  aborts = sum(r.get("jax_aborts", 0) for r in results)
  timing = f"noticed and stopped in {statistics.median(noticed):.1f} s median, {max(noticed):.1f} s max; " if noticed else ""
  return f"{timing}exit {codes}; {tracebacks} tracebacks or C++ frames; {aborts} processes ended by jax (process 0 died)"


def process_faults(tmp: Path, stops: int, kills: int) -> list[tuple[str, int, str]]:
  """Hung and killed processes at random points, then a relaunch of every fifth; the kinds of
  processes that differ or cannot join."""
  rows = []
  for sig, tries, label in ((signal.SIGSTOP, stops, "SIGSTOP of one process at a random point"),
                            (signal.SIGKILL, kills, "SIGKILL of one process mid-step or mid-save")):
    results, noticed, named, resumed, relaunched, mid_save = [], [], 0, 0, 0, 0
    for trial in range(tries):
      victim = random.randrange(2)
      saving = sig == signal.SIGKILL and trial % 2 == 1
      step = random.choice(range(MP_SAVE_EVERY, MP_STEPS, MP_SAVE_EVERY)) if saving else random.randrange(2, MP_STEPS)
      prefix = f"saving checkpoint step {step}" if saving else f"running step {step}"
      run = _Launch(tmp, f"{sig.name}-{trial}")
      sent = run.signal_when(victim, prefix, sig, random.uniform(0, 0.3))
      result = run.finish()
      if sent is None:
        results.append({**result, "code": "finished before the signal"})
        continue
      noticed.append(result["ended"] - sent)
      results.append(result)
      mid_save += saving
      how = "stopped responding" if sig == signal.SIGSTOP else "was killed by SIGKILL"
      named += bool(re.match(rf"launch: process {victim} \(host \S+, pid \d+\) {how} while (running step|saving checkpoint)", result["line"]))
      if trial % 5 == 0:  # a relaunch resumes from the newest complete checkpoint and finishes
        relaunched += 1
        again = _Launch(tmp, f"{sig.name}-{trial}-relaunch", f"--log_dir={run.dir / 'run'}").finish()
        kept = _kept(result["line"])
        resumed += again["code"] == 0 and (kept == "none yet" or f"Resumed from {kept} " in again["out"])
    example = next((r["line"] for r in results if isinstance(r["code"], int)), "")
    rows.append((label, tries, (
      f"{named}/{tries} named the process, what it was doing and the kept checkpoint; {_summary(results, noticed)}; "
      f"{mid_save} landed in a save; {resumed}/{relaunched} relaunches resumed and finished; e.g. `{example[:260]}`"
    )))

  differ = _Launch(tmp, "differ", script="tests/fault_recipe.py", env={"TOT_TEST_EXTRA_FLAG": "1:--lr=0.001"}).finish()
  rows.append(("`--lr` differs on one process", 1, f"{_summary([differ], [])}; `{differ['line'][:300]}`"))
  address = f"127.0.0.1:{_free_port()}"
  env = _env(tmp / "cache", TOT_COORDINATOR=address, TOT_NUM_PROCESSES="2", TOT_PROCESS_ID="1", TOT_INIT_TIMEOUT="10")
  start = time.monotonic()
  alone = subprocess.run([sys.executable, "-m", "recipes.llama3", "--steps=1", "--cpu_devices=2", f"--log_dir={tmp / 'alone'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  line = alone.stderr.strip().splitlines()[-1]
  rows.append(("no coordinator at start (`TOT_INIT_TIMEOUT=10`)", 1,
               f"exit {alone.returncode} after {time.monotonic() - start:.0f} s (imports included); `{line[:300]}`"))
  return rows


def disk_faults(tmp: Path) -> list[tuple[str, int, str]]:
  """A checkpoint disk full at the first save and at a later one, a full log directory, a
  full compilation cache: each on a tmpfs, under the launcher."""
  rows = []
  sys.path.insert(0, str(ROOT))
  from torch_on_tpu.core import storage

  rows = []
  cases = (
    ("checkpoint disk full at the first save (30 MB tmpfs; a step is ~71 MB)", "30m", "--ckpt_dir={disk}/ckpt"),
    ("checkpoint disk full at a later save (100 MB tmpfs: step 3 fits, step 6 does not)", "100m", "--ckpt_dir={disk}/ckpt"),
    ("log directory full (150 kB tmpfs), checkpoints elsewhere", "150k", "--log_dir={disk}/run --ckpt_dir={elsewhere}"),
    ("compilation cache full (30 kB tmpfs)", "30k", "--compile_cache={disk}/jax"),
  )
  for label, size, flags in cases:
    disk, elsewhere = tmp / f"disk-{size}", tmp / f"disk-{size}-ckpt"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True).returncode:
      return rows + [("disks full under the launcher", 0, "not tried: mounting a tmpfs needs root")]
    try:
      env = {"JAX_COMPILATION_CACHE_DIR": ""} if "compile_cache" in flags else None
      run = _Launch(tmp, f"disk-{size}-run", *flags.format(disk=disk, elsewhere=elsewhere).split(), env=env)
      result = run.finish()
      said = result["line"] if result["code"] else next(
        (x for x in result["out"].splitlines() if "compiled programs" in x), "(nothing said)")
      ckpt = disk / "ckpt" if "--ckpt_dir={disk}" in flags else elsewhere if "elsewhere" in flags else run.dir / "run" / "ckpt"
      rows.append((label, 1, f"{_summary([result], [])}; newest complete step on disk: {storage.newest_complete_step(ckpt)}; `{said[:320]}`"))
    finally:
      subprocess.run(["umount", "-l", str(disk)], check=False)
  return rows


def _free_port() -> int:
  sys.path.insert(0, str(ROOT))
  from torch_on_tpu.runtime import launch

  return launch.free_port()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=20, help="SIGKILL trials")
  parser.add_argument("--flips", type=int, default=20, help="random bit flips in the newest step")
  parser.add_argument("--storage_trials", type=int, default=5)
  parser.add_argument("--stops", type=int, default=20, help="SIGSTOP trials of a multi-process run")
  parser.add_argument("--process_kills", type=int, default=20, help="SIGKILL trials of a multi-process run")
  parser.add_argument("--only", default="sigkill,damage,storage,nan,launcher,disks,processes")
  parser.add_argument("--keep", default=None, help="a directory to keep each multi-process launch's output in")
  args = parser.parse_args(argv)
  global KEEP
  if args.keep:
    KEEP = Path(args.keep)
    KEEP.mkdir(parents=True, exist_ok=True)
  only = set(args.only.split(","))
  rows = []
  with tempfile.TemporaryDirectory() as name:
    tmp = Path(name)
    if "damage" in only:
      rows += damage(tmp, args.flips)
    if "storage" in only:
      rows += storage_faults(tmp, args.storage_trials)
    if "nan" in only:
      rows.append(("--lr=1e39, past float32 (llama3 recipe)", 1, nan_lr(tmp, "1e39", "holds NaN or Inf before step 1")))
      rows.append(("--lr=1e30, the update overflows (llama3 recipe)", 1, nan_lr(tmp, "1e30", "were skipped, 5 in a row")))
    if "sigkill" in only:
      rows.append(("SIGKILL at a random moment, then relaunch", args.kills, sigkill(tmp, args.kills)))
    if "launcher" in only:
      rows.append(("SIGTERM to the launcher, 2 processes of the llama3 recipe", 1, launcher_sigterm(tmp)))
    if "disks" in only:
      rows += disk_faults(tmp)
    if "processes" in only:
      rows += process_faults(tmp, args.stops, args.process_kills)
    shutil.rmtree(tmp / "cache", ignore_errors=True)
  print("| fault | times tried | outcome |\n|---|---|---|")
  for fault, tried, outcome in rows:
    print(f"| {fault} | {tried} | {outcome} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
