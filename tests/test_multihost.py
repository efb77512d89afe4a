"""Multi-host for real: several jax processes on loopback, started like pod hosts.

`tests/multihost_worker.py` trains a 2-layer torchtitan Llama 3 debugmodel
through the library (ShardedModule, make_train_step, Trainer, data.batches on
the built-in corpus, data.to_global, Checkpointer with the data state); the
tests compare 1 process x 8 CPU devices with 2 processes x 4 (the global
batches as the step sees them, and the losses), checkpoints across the two,
and what happens when a process dies. The
launcher's own behaviour is tested with tiny scripts that start in a moment.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import helpers as h
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.runtime import distributed, health, launch

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "multihost_worker.py"
LOSS_RTOL = 1e-6  # 2x4 vs 1x8 devices: same program, reductions split differently
KILL_DEADLINE_S = 60
# The subprocesses share the test session's persistent compilation cache.
CACHE_ENV = {
  "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "jax-tests"),
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def clean_env() -> dict:
  """The test session's environment without its device count or a run description."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("TOT_")}
  env.pop("XLA_FLAGS", None)
  return {**env, **CACHE_ENV}


def launch_worker(tmp: Path, name: str, nproc: int, *worker_args: str, timeout: int = 240) -> list[float]:
  """Runs the worker on `nproc` processes x `8 / nproc` devices; the per-step losses (`batches` reads the data)."""
  log_dir = tmp / name
  cmd = [sys.executable, "-m", "torch_on_tpu.launch", "--nproc", str(nproc), "--cpu_devices", str(8 // nproc)]
  cmd += [str(WORKER), "--log_dir", str(log_dir), *worker_args]
  out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return losses(log_dir)


def losses(log_dir: Path) -> list[float]:
  records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if "loss" in r]


def batches(tmp: Path, name: str) -> list[str]:
  """The digest of each step's global batch, gathered from the devices, as run `name` trained on it."""
  return (tmp / name / "batches.txt").read_text().split()


def max_rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape, (a, b)
  return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """10 steps on 1 process x 8 devices and on 2 x 4, each saving a checkpoint at step 5
  and exporting the trained model for transformers."""
  tmp = tmp_path_factory.mktemp("multihost")
  common = ("--steps", "10", "--save_every", "5")
  one = launch_worker(tmp, "one", 1, "--ckpt_dir", str(tmp / "ckpt_one"), "--export_dir", str(tmp / "hf_one"), *common, timeout=480)
  two = launch_worker(tmp, "two", 2, "--ckpt_dir", str(tmp / "ckpt_two"), "--export_dir", str(tmp / "hf_two"), *common, timeout=480)
  return tmp, one, two


def test_two_processes_match_one_process_step_for_step(runs):
  tmp, one, two = runs
  assert len(one) == len(two) == 10
  # Real data: each process reads its own shards, and its rows land where one process puts them.
  assert batches(tmp, "two") == batches(tmp, "one")
  assert len(set(batches(tmp, "one"))) == 10
  assert max_rel(two, one) < LOSS_RTOL, max_rel(two, one)
  print(f"2x4 vs 1x8 devices: max relative loss difference {max_rel(two, one):.2e}")
  assert one[0] != one[-1]  # it trains: the comparison is not of constants


def test_checkpoint_from_two_processes_resumes_in_one_and_back(runs):
  tmp, one, two = runs
  resume = ("--steps", "10", "--save_every", "5", "--resume_step", "5")
  one_from_two = launch_worker(tmp, "one_from_two", 1, "--ckpt_dir", str(tmp / "ckpt_two"), *resume)
  two_from_one = launch_worker(tmp, "two_from_one", 2, "--ckpt_dir", str(tmp / "ckpt_one"), *resume)
  assert max_rel(one_from_two, two[5:]) < LOSS_RTOL and max_rel(two_from_one, one[5:]) < LOSS_RTOL
  # The data state saved by either process count continues the same batches on the other.
  assert batches(tmp, "one_from_two") == batches(tmp, "two")[5:]
  assert batches(tmp, "two_from_one") == batches(tmp, "one")[5:]
  print(f"resumed 2->1: {max_rel(one_from_two, two[5:]):.2e}, 1->2: {max_rel(two_from_one, one[5:]):.2e}")


def test_two_processes_export_a_directory_transformers_loads(runs):
  import transformers
  from safetensors.numpy import load_file

  tmp, _, _ = runs
  for name in ("hf_one", "hf_two"):
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / name)
    logits = model(torch.arange(2 * 16).reshape(2, 16)).logits.detach().numpy()
    want = np.load(tmp / f"{name}.logits.npy")
    assert h.rel(logits, want) < 1e-5, (name, h.rel(logits, want))  # fp32 on CPU: ‖Δ‖/‖ref‖
    assert transformers.AutoTokenizer.from_pretrained(tmp / name).eos_token == "<|endoftext|>"
  # the same trained weights, whether 1 or 2 processes held their shards
  one, two = load_file(tmp / "hf_one" / "model.safetensors"), load_file(tmp / "hf_two" / "model.safetensors")
  assert one.keys() == two.keys() and all(h.rel(two[k], one[k]) < 1e-5 for k in one)


def test_killed_process_makes_the_others_fail_fast(tmp_path):
  """No launcher: the survivors must notice by themselves, as on a pod."""
  port = launch.free_port()
  procs, logs = [], [tmp_path / f"p{i}.txt" for i in range(2)]
  for index, log in enumerate(logs):
    env = launch.process_env(clean_env(), index, 2, port, cpu_devices=4)
    cmd = [sys.executable, str(WORKER), "--log_dir", str(tmp_path / "log"), "--steps", "50", "--die_at", "2"]
    with open(log, "w") as out:
      procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
  survivor, victim = procs
  try:
    victim.wait(timeout=240)
    killed_at = time.monotonic()
    survivor.wait(timeout=KILL_DEADLINE_S + 30)
    waited = time.monotonic() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  out = logs[0].read_text()
  assert victim.returncode == -9
  assert survivor.returncode == health.EXIT_PEER_FAILED, out[-2000:]
  assert waited < KILL_DEADLINE_S, f"the survivor took {waited:.0f} s to stop"
  said = [line for line in out.splitlines() if line.startswith("error: ")]
  assert len(said) == 1 and re.match(r"error: Process 1 \(host \S+, pid \d+\) stopped responding while running step 2", said[0]), out[-2000:]
  assert "Traceback" not in out and "0x7f" not in out
  print(f"survivor stopped {waited:.1f} s after the kill")


# ---- the launcher --------------------------------------------------------------------------


def script(tmp_path: Path, body: str) -> Path:
  path = tmp_path / "target.py"
  path.write_text(textwrap.dedent(body))
  return path


def run_launcher(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "torch_on_tpu.launch", *args]
  done = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, timeout=timeout)
  done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()  # a progress bar's \r kept as it is
  return done


def test_launcher_prefixes_output_and_describes_each_process(tmp_path):
  target = script(
    tmp_path,
    """
    import os, sys
    keys = ("TOT_COORDINATOR", "TOT_NUM_PROCESSES", "TOT_PROCESS_ID", "XLA_FLAGS", "JAX_PLATFORMS")
    sys.stdout.write(" ".join(os.environ[k] for k in keys) + f" {sys.argv[1:]}\\n")  # one write: a line in pieces may be cut
    print("second line", file=sys.stderr)
    print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", file=sys.stderr)
    sys.stderr.write("\\r 50%|#    | 1/2")  # a progress bar's redraw, then tqdm.write clearing it for a line
    sys.stderr.write("\\r          \\rstep 1: eval loss 1.0\\n\\r100%|#####| 2/2\\n")
    """,
  )
  out = run_launcher("--nproc", "2", "--cpu_devices", "3", str(target), "--model=x", "-m", "y")
  assert out.returncode == 0, out.stderr
  assert "Gloo" not in out.stdout
  shown = [line.split("\r")[-1] for line in out.stdout.splitlines()]  # what a terminal shows of each line
  for i in range(2):
    assert shown.count(f"[p{i}] second line") == shown.count(f"[p{i}] step 1: eval loss 1.0") == 1
    assert shown.count(f"[p{i}] 100%|#####| 2/2") == 1 and f"\r[p{i}]  50%|#    | 1/2" in out.stdout
  lines = out.stdout.splitlines()
  described = sorted(line for line in lines if "TOT" not in line and "127.0.0.1" in line)
  assert len(described) == 2
  for i, line in enumerate(described):
    assert re.fullmatch(
      rf"\[p{i}\] 127\.0\.0\.1:\d+ 2 {i} --xla_cpu_experimental_ynn_fusion_type= "  # torch_on_tpu's defaults
      rf"--xla_force_host_platform_device_count=3 cpu \['--model=x', '-m', 'y'\]",
      line,
    ), line


def test_launcher_relays_a_progress_bar_as_it_is_drawn_not_at_its_line_end():
  read, write = os.pipe()
  out = io.StringIO()
  console = launch._Console(out)
  relay = threading.Thread(target=console.relay, args=(0, os.fdopen(read, "rb")), daemon=True)
  relay.start()
  os.write(write, "\r 10%|█         | 1/10".encode())  # no newline: a bar waiting for its next redraw
  deadline = time.monotonic() + 10
  while "[p0]  10%|█" not in out.getvalue() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert out.getvalue() == "\r[p0]  10%|█         | 1/10"
  console._write(1, "[p1] a line\n")  # another process writes: the bar's line is ended first
  os.write(write, "\r 15%|█▌        | 1/10[Gl".encode())  # gloo's notice after the open bar, in pieces
  os.write(write, b"oo] Rank 0 is connected to 1 peer ranks.\n")
  os.write(write, "\r 20%|██        | 2/10\n".encode())
  os.close(write)
  relay.join(timeout=10)
  assert out.getvalue() == (
    "\r[p0]  10%|█         | 1/10\n[p1] a line\n\r[p0]  15%|█▌        | 1/10\r[p0]  20%|██        | 2/10\n"
  )


def test_a_line_cut_by_another_process_continues_on_a_prefixed_line_of_its_own():
  """A process's line arriving in two reads, another's output between them (CI saw the launcher's
  own description of a process split so)."""
  out = io.StringIO()
  console = launch._Console(out)
  console._write(0, "[p0] 127.0.0.1:1 2 0 cpu")
  console._write(1, "[p1] a line\n")
  console._write(0, " ['--model=x']")
  console._write(0, "\n")
  console._write(1, "[p1] half")
  console._write(0, "[p0] next\n")
  console._write(1, "\n")  # its line was ended already
  assert out.getvalue() == "[p0] 127.0.0.1:1 2 0 cpu\n[p1] a line\n[p0]  ['--model=x']\n[p1] half\n[p0] next\n"


def test_launcher_stops_the_others_and_fails_when_one_process_fails(tmp_path):
  target = script(
    tmp_path,
    """
    import os, signal, time
    if os.environ["TOT_PROCESS_ID"] == "1":
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    """,
  )
  start = time.monotonic()
  out = run_launcher("--nproc", "3", "--grace", "2", str(target))
  assert time.monotonic() - start < 30  # not the 120 s the others would sleep
  assert out.returncode == 128 + 9
  assert "launch: process 1 was killed by SIGKILL; stopped the other 2; exit 137." in out.stderr

  target.write_text("import os, sys\nsys.exit(3 if os.environ['TOT_PROCESS_ID'] == '0' else 0)\n")
  out = run_launcher("--nproc", "2", str(target))
  assert out.returncode == 3
  assert "launch: process 0 exited with code 3" in out.stderr


def test_a_preempted_launch_whose_processes_save_and_exit_0_exits_0(tmp_path):
  """SIGTERM to the launcher reaches every process; each "saves" (1 s, longer
  than the old 10 s grace would matter for a real state) and exits 0, or not."""
  target = script(
    tmp_path,
    """
    import os, signal, sys, time
    def stop(signum, frame):
      time.sleep(1)  # the preemption save
      code = int(os.environ.get("FAIL_ON_STOP", "-1") == os.environ["TOT_PROCESS_ID"])
      print("saved step 7" if not code else "error: could not write checkpoint step 7", flush=True)
      sys.exit(code)
    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    time.sleep(120)
    """,
  )
  assert launch.parse_args([str(target)]).grace == launch.DEFAULT_GRACE_SECONDS >= 60
  for fail_on_stop, code, message in (
    (None, 0, "launch: got SIGTERM; all 2 processes stopped cleanly (exit 0)."),
    ("1", 1, "launch: got SIGTERM; process 1 exited with code 1 (its last line: 'error: could not write checkpoint step 7')."),
  ):
    env = {**clean_env(), **({"FAIL_ON_STOP": fail_on_stop} if fail_on_stop else {})}
    proc = subprocess.Popen(
      [sys.executable, "-m", "torch_on_tpu.launch", "--nproc", "2", str(target)],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ready = set()
    while len(ready) < 2:
      line = proc.stdout.readline()
      assert line, proc.stderr.read()
      if line.endswith("ready\n"):
        ready.add(line[:4])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.strip() == message


def test_launcher_rejects_bad_arguments(capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  for args, message in [
    (("--nproc", "0", "x.py"), "--nproc must be at least 1"),
    (("--nproc", "2"), "nothing to launch"),
    (("missing_script.py",), "script 'missing_script.py' does not exist"),
    (("-m", "no_such_module_here"), "module 'no_such_module_here' is not importable"),
    (("--cpu_devices", "0", "-m", "torch_on_tpu"), "--cpu_devices must be at least 1"),
  ]:
    assert launch.main(list(args)) == 2
    assert message in capsys.readouterr().err, args


def test_process_env_appends_the_device_count_to_existing_xla_flags():
  base = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"}
  env = launch.process_env(base, 1, 2, 1234, cpu_devices=4)
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4"
  assert (env["TOT_COORDINATOR"], env["TOT_NUM_PROCESSES"], env["TOT_PROCESS_ID"]) == ("127.0.0.1:1234", "2", "1")
  assert "JAX_PLATFORMS" not in launch.process_env({}, 0, 1, 1, cpu_devices=None)


# ---- initialize_distributed ------------------------------------------------------------------


def test_initialize_distributed_is_a_no_op_for_one_unconfigured_process(monkeypatch):
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.delenv(distributed.JAX_ENV_COORDINATOR, raising=False)
  assert distributed.initialize_distributed() is False
  assert distributed.initialize_distributed() is False  # again: still nothing to join
  assert distributed.initialize_distributed("127.0.0.1:1", 1, 0) is False  # one process: nothing to join


def test_initialize_distributed_names_what_is_missing_or_wrong(monkeypatch):
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  monkeypatch.delenv(distributed.ENV_NUM_PROCESSES, raising=False)
  monkeypatch.delenv(distributed.ENV_PROCESS_ID, raising=False)
  with pytest.raises(TorchOnTpuError, match="TOT_NUM_PROCESSES, TOT_PROCESS_ID is not set"):
    distributed.initialize_distributed()
  with pytest.raises(TorchOnTpuError, match="Process id 2 is outside 0..1"):
    distributed.initialize_distributed(num_processes=2, process_id=2)
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(TorchOnTpuError, match="TOT_NUM_PROCESSES='two' is not an integer"):
    distributed.initialize_distributed()
  # This session's jax backend is running: joining now is impossible, and says why.
  with pytest.raises(TorchOnTpuError, match="can no longer join"):
    distributed.initialize_distributed("127.0.0.1:1234", 2, 0)
