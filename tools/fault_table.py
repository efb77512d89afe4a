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
exit 0 end to end). `tests/test_checkpoint_faults.py` and friends run the
short version of each.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
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
  from torch_on_tpu import checkpoint
  from torch_on_tpu.errors import TorchOnTpuError

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
  from torch_on_tpu import checkpoint
  from torch_on_tpu.errors import TorchOnTpuError

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
  import numpy as np

  from torch_on_tpu import checkpoint

  import jax

  ocp = checkpoint.ocp
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kills", type=int, default=20, help="SIGKILL trials")
  parser.add_argument("--flips", type=int, default=20, help="random bit flips in the newest step")
  parser.add_argument("--storage_trials", type=int, default=5)
  parser.add_argument("--only", default="sigkill,damage,storage,nan,launcher")
  args = parser.parse_args(argv)
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
    shutil.rmtree(tmp / "cache", ignore_errors=True)
  print("| fault | times tried | outcome |\n|---|---|---|")
  for fault, tried, outcome in rows:
    print(f"| {fault} | {tried} | {outcome} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
