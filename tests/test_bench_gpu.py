"""tools/bench_gpu.py: runs end to end on CPU (tiny model), the runners agree, bad input is named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers as h

SCRIPT = Path(__file__).parent.parent / "tools" / "bench_gpu.py"


def test_smoke_runs_every_runner_at_both_shapes_from_the_same_weights_with_profiles(tmp_path):
  out = tmp_path / "bench.json"
  run = subprocess.run(
    [sys.executable, str(SCRIPT), "--smoke", "--profile", f"--trace_dir={tmp_path / 'traces'}", f"--json={out}"],
    capture_output=True, text=True, timeout=900, env=h.env_without_libtpu_answers(),  # as a user starts it
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["shape"], r["runner"]) for r in rows] == [
    (shape, runner) for shape in ("64x2", "32x4") for runner in ("torch_on_tpu", "compile", "eager")
  ]  # ours first at each shape: it writes the weights
  assert not any("error" in r for r in rows)
  for shape in ("64x2", "32x4"):
    ours, compiled, eager = (r for r in rows if r["shape"] == shape)
    # Same initial weights and batch: the first losses agree to bf16 rounding (all compute in bf16).
    for other in (compiled, eager):
      assert abs(ours["first_loss"] - other["first_loss"]) / other["first_loss"] < 1e-2
    assert ours["first_loss"] > 7.0  # ≈ ln(vocab 2048) = 7.6 at init: a real forward, not a placeholder
  for r in rows:
    assert r["tokens_per_s"] == pytest.approx(128 / r["step_s"])
    assert r["flops_torchtitan"] > r["flops_causal"] > 0 and r["peak_flops"] > 0
    assert 0 < r["init_s"] < r["first_step_total_s"]
    assert r["first_step_total_s"] >= r["init_s"] + (r["compile_s"] or 0) + r["first_step_s"] - 1e-6
    assert Path(r["trace"]).stat().st_size > 0 and set(r["kernel_s"]) == {"gemm", "attention", "other"}
  assert "| 64x2  | torch_on_tpu |" in run.stdout and "to first step s" in run.stdout
  assert "ours: scan, remat auto" in run.stdout  # the recipe's defaults
  assert "GPU kernel time per step by class" in run.stdout and "no GPU kernels" in run.stdout  # CPU
  assert not h.libtpu_start_up_lines(run.stdout + run.stderr)  # where no TPU is, the workers start libtpu quietly too


@pytest.mark.parametrize(
  "name, cls",
  [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "gemm"),
    ("triton_gemm_dot_1", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"),
    ("loop_add_fusion", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
  ],
)
def test_kernel_names_fall_in_their_class(name, cls):
  assert h.load_module(SCRIPT).kernel_class(name) == cls


def test_kernel_time_is_read_from_torch_and_jax_traces():
  bench = h.load_module(SCRIPT)
  torch_trace = {"traceEvents": [
    {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64", "dur": 3000},
    {"ph": "X", "cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel", "dur": 2000},
    {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "dur": 500},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000},  # host side: not a kernel
  ]}
  assert bench.kernel_seconds(torch_trace) == pytest.approx({"gemm": 0.003, "attention": 0.002, "other": 0.0005})
  jax_trace = {"traceEvents": [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
    {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 7, "name": "sm90_xmma_gemm_bf16", "dur": 4000},
    {"ph": "X", "pid": 1, "tid": 7, "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "dur": 1000},
    {"ph": "X", "pid": 1, "tid": 7, "name": "loop_multiply_fusion", "dur": 250},
    {"ph": "X", "pid": 1, "tid": 8, "name": "dot.3", "dur": 4000},  # the op line repeats the kernels: not counted
    {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(step)", "dur": 9000},
  ]}
  assert bench.kernel_seconds(jax_trace) == pytest.approx({"gemm": 0.004, "attention": 0.001, "other": 0.00025})
  jax_trace["traceEvents"].append({"ph": "X", "pid": 1, "tid": 7, "name": "loop_multiply_fusion", "dur": 250})
  assert bench.top_kernels(jax_trace, 2) == [["sm90_xmma_gemm_bf16", 0.004, 1], ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 0.001, 1]]
  assert bench.top_kernels(jax_trace, 3)[2] == ["loop_multiply_fusion", pytest.approx(0.0005), 2]


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
    (["--float8=mxfp8"], "float8 recipe 'mxfp8' is not one the bridge runs"),
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
