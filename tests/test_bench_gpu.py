"""tools/bench_gpu.py: runs end to end on CPU (tiny model), the runners agree, bad input is named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers as h

SCRIPT = Path(__file__).parent.parent / "tools" / "bench_gpu.py"


def test_ours_and_pytorch_start_from_the_same_weights_and_fill_the_table(tmp_path):
  out = tmp_path / "bench.json"
  run = subprocess.run(
    [
      sys.executable, str(SCRIPT), "--model=debugmodel", "--layers=2", "--shapes=64x2",
      "--steps=1", "--warmup=1", "--runners=eager,torch_on_tpu", f"--json={out}",
    ],
    capture_output=True, text=True, timeout=600,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["runner"] for r in rows] == ["torch_on_tpu", "eager"]  # ours first: it writes the weights
  ours, eager = rows
  assert not any("error" in r for r in rows)
  # Same initial weights and batch: the first losses agree to bf16 rounding (both compute in bf16).
  assert abs(ours["first_loss"] - eager["first_loss"]) / eager["first_loss"] < 1e-2
  assert ours["first_loss"] > 7.0  # ≈ ln(vocab 2048) = 7.6 at init: a real forward, not a placeholder
  for r in rows:
    assert r["tokens_per_s"] == pytest.approx(128 / r["step_s"])
    assert r["flops_torchtitan"] > r["flops_causal"] > 0 and r["peak_flops"] > 0
  assert "| 64x2  | torch_on_tpu |" in run.stdout and "MFU (titan)" in run.stdout


def test_missing_torch_names_get_placeholders_so_torchtitan_imports():
  """The GPU image's torch 2.11 lacks FSDP's DataParallelMeshDims, which torchtitan 0.3.0 imports."""
  code = (
    "import sys; sys.path.insert(0, 'tools')\n"
    "import torch.distributed.fsdp as fsdp\n"
    "import bench_gpu\n"
    "del fsdp.DataParallelMeshDims\n"
    "filled = bench_gpu.torchtitan_on_older_torch()\n"
    "assert filled == ['torch.distributed.fsdp.DataParallelMeshDims'], filled\n"
    "config = bench_gpu.llama3_config('debugmodel', layers=2, seqlen=64)\n"
    "assert len(config.layers) == 2 and config.layers[0].attention.rope.max_seq_len == 64\n"
  )
  run = subprocess.run([sys.executable, "-c", code], cwd=SCRIPT.parent.parent, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]


def test_nothing_is_filled_in_on_a_torch_that_has_everything():
  bench = h.load_module(SCRIPT)
  assert bench.torchtitan_on_older_torch() == []


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--shapes=8192"], "is not SEQxBATCH"),
    (["--shapes=0x4"], "is not SEQxBATCH"),
    (["--runners=jax"], "--runners names jax"),
    (["--steps=0"], "at least 1"),
  ],
)
def test_bad_flags_are_named(argv, message, capsys):
  bench = h.load_module(SCRIPT)
  with pytest.raises(SystemExit) as exit_info:
    bench.parse_args(argv)
  assert exit_info.value.code != 0
  assert message in capsys.readouterr().err


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--model=9B"], "is not a torchtitan Llama 3 flavor"),
    (["--model=debugmodel", "--layers=7"], "has 6 layers; pick 1..6"),
    (["--model=debugmodel", "--shapes=300000x1"], "exceeds Llama 3 debugmodel's 131072 positions"),
    (["--remat=bogus"], "is not a remat policy"),
    (["--attention=flash"], "is not a kernel"),
    (["--json=/nonexistent-dir/bench.json"], "its directory does not exist"),
    (["--json=/tmp"], "is a directory; name a file in it"),
  ],
)
def test_flags_the_workers_would_fail_on_stop_the_driver_first(argv, message, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # main() pins its own jax to the CPU; keep the test's env as it was
  bench = h.load_module(SCRIPT)
  with pytest.raises(SystemExit) as exit_info:
    bench.main(argv)
  assert message in str(exit_info.value.code)


def test_a_run_past_its_timeout_is_stopped_and_reported(tmp_path):
  out = tmp_path / "bench.json"
  run = subprocess.run(
    [sys.executable, str(SCRIPT), "--model=debugmodel", "--shapes=64x1", "--runners=eager", "--timeout=2", f"--json={out}"],
    capture_output=True, text=True, timeout=300,
  )
  assert run.returncode == 1
  (row,) = json.loads(out.read_text())["rows"]
  assert row["error"] == "stopped after 2 s"
  assert "stopped after 2 s" in run.stdout


def test_pytorch_rows_get_their_mfu_without_our_runner(tmp_path):
  """FLOPs and peak come from the driver, so a failed or skipped runner leaves the others' MFU."""
  out = tmp_path / "bench.json"
  run = subprocess.run(
    [sys.executable, str(SCRIPT), "--model=debugmodel", "--layers=2", "--shapes=64x1", "--steps=1", "--warmup=1",
     "--runners=eager", f"--json={out}"],
    capture_output=True, text=True, timeout=300,
  )
  assert run.returncode == 0, run.stdout[-3000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert row["flops_torchtitan"] > row["flops_causal"] > 0 and row["peak_flops"] > 0


@pytest.mark.parametrize(
  "lines, reason",
  [
    # jax appends a note after the exception's line: the cell shows the exception, not the note.
    (
      ["Traceback (most recent call last):", '  File "x.py", line 3', "ValueError: batch 3 does not divide 8",
       "--------------------", "For simplicity, JAX has removed its internal frames from the traceback."],
      "ValueError: batch 3 does not divide 8",
    ),
    (["  torch_on_tpu.errors.TorchOnTpuError: no GPU found"], "torch_on_tpu.errors.TorchOnTpuError: no GPU found"),
    (["compiling", "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB"],
     "out of memory"),
    (["step 1", "torch.OutOfMemoryError: CUDA out of memory."], "out of memory"),
    (["loading weights", "Killed", ""], "Killed"),  # no exception line: the last line printed
    (["", "  "], "exit -9"),
  ],
)
def test_a_worker_without_a_result_is_given_a_one_cell_reason(lines, reason):
  bench = h.load_module(SCRIPT)
  assert bench.failure_reason(lines, -9) == reason


def test_the_reason_is_cut_to_one_table_cell():
  bench = h.load_module(SCRIPT)
  assert len(bench.failure_reason(["RuntimeError: " + "x" * 500], 1)) == 200
