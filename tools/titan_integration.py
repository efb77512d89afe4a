"""torchtitan's own integration cases through `python -m recipes.torchtitan`, each judged.

    .venv/bin/python tools/titan_integration.py                      # the whole list (an hour on 2 CPU cores)
    .venv/bin/python tools/titan_integration.py --cases=default,2d_eager,ddp
    .venv/bin/python tools/titan_integration.py --suites=models --work=/tmp/titan

It prints a Markdown table, a row per run (trained, refused or failed, and why), then the counts.

`CASES` is our own table of the cases torchtitan's release/0.3 branch runs on its GPUs
(`tests/integration_tests/{features,models,h100}.py`): each a name, the GPU count and one or
more override lists on `--module llama3 --config llama3_debugmodel` (or the model's own `--module
--config`, which torchtitan takes as the last one written), run in order in one dump folder as
torchtitan runs them. Each run here is `python -m recipes.torchtitan <those> --cpu_devices=<ngpu>`
at a CPU's size: sequences of `SEQ` tokens, `BATCH` rows a step (a case's own batch settings
win) and 2 steps (4 where torchtitan's case trains on to 20 after a first run of 10).

A run is judged:

- **trained**: exit 0, every step it was due trained, each loss within `TOLERANCE` (relative) of a plain-FSDP
  run of the same batch (the same override lists without their `parallelism.*` settings, on as many
  devices, in a dump folder of its own), every override accounted for (a recipe flag, or a line of
  the run's output naming it) and what the overrides ask to be written written (`ARTIFACTS`);
- **refused**: a nonzero exit with one line on stderr (the sentence) and no traceback;
- **failed**: anything else: an override read past, a crash, a traceback, a wrong loss, a step
  not trained, a file not written.

torchtitan's CI also puts `--debug.spmd_typechecking` and `activation-checkpoint:none` around
most cases (a type check of its SPMD code, off its compiled paths); they change nothing computed
and are left out here. Cases torchtitan itself disables are in the table, marked so.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ("--module llama3 --config llama3_debugmodel",)
SEQ, BATCH, STEPS = 128, 8, 2
# Each loss within this share of the reference's. The runs compute in bf16 (torchtitan's default
# mixed precision), where two valid layouts sum in different orders: gpt-oss's losses over 5 steps
# spread 7.0e-4 between two valid eager references (docs/torchtitan.md); a wrong run is off by
# far more (a dropped expert or a mask read past: 1e-2 and up).
TOLERANCE = 1e-3
TIMEOUT = 1200  # seconds a run may take
DCG = "--training.disable_cuda_graphs"  # torchtitan's parser wants it first with expert or pipeline parallelism


@dataclasses.dataclass(frozen=True)
class Case:
  """One of torchtitan's integration cases: its runs' override lists, in order, in one dump folder."""

  name: str
  suite: str
  ngpu: int
  runs: tuple[tuple[str, ...], ...]
  disabled: bool = False  # torchtitan's own CI skips it
  trains: bool = True  # False: the run writes a checkpoint and trains nothing (a seed checkpoint)


def _case(name, suite, runs, ngpu=4, **kw) -> Case:
  return Case(name, suite, ngpu, tuple(tuple(r) for r in runs), **kw)


def _pp(degree, schedule=None, *more):
  return (DCG, f"--parallelism.pipeline_parallel_degree {degree}",
          *((f"--parallelism.pipeline_parallel_schedule {schedule}",) if schedule else ()), *more)


def _model(module, config):
  return f"--module {module} --config {config}"


TP2, CP2, DP2 = "--parallelism.tensor_parallel_degree 2", "--parallelism.context_parallel_degree 2", "--parallelism.data_parallel_shard_degree 2"
ENABLE = "--checkpoint.enable"
COMPILE = "--compile.enable"

CASES = [
  # features.py: llama3's debug model unless a case names its own
  _case("default", "features", [["--profiler.enable_profiling", "--metrics.enable_tensorboard",
                                  "--profiler.profile_freq 2", "--profiler.profiler_warmup 0"]]),  # a trace within 2 steps
  _case("1d_compile", "features", [[COMPILE]]),
  _case("1d_compile_sac_op", "features", [[COMPILE, "activation-checkpoint:selective"]]),
  _case("2d_eager", "features", [[TP2], [_model("llama3", "llama3_debugmodel_ce_loss"), TP2]]),
  _case("2d_eager_no_sp", "features", [[TP2, "--parallelism.no-enable-sequence-parallel"]]),
  _case("2d_compile", "features", [[COMPILE, TP2]]),
  _case("2d_asynctp_compile", "features", [[COMPILE, TP2, "--compile.enable_async_tensor_parallel"]], disabled=True),
  _case("full_checkpoint", "features", [[ENABLE], [ENABLE, "--training.steps 4"]]),
  _case("model_only_hf_checkpoint", "features", [
    [ENABLE, "--checkpoint.folder hf_checkpoint", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"],
    [ENABLE, "--checkpoint.initial_load_path {dump}/hf_checkpoint/step-2", "--checkpoint.initial_load_model_only",
     "--checkpoint.initial_load_in_hf"],
  ]),
  _case("last_save_model_only_bf16", "features", [[ENABLE, "--checkpoint.last_save_model_only", "--checkpoint.export_dtype bfloat16"]]),
  _case("pp_1f1b", "features", [_pp(2, "1F1B", "--parallelism.data_parallel_shard_degree 1")], ngpu=2),
  _case("pp_dp_1f1b", "features", [_pp(2, "1F1B", DP2), _pp(2, "1F1B", "--parallelism.pipeline_parallel_layers_per_stage 4", DP2)]),
  _case("pp_tp_gpipe", "features", [_pp(2, "GPipe", TP2)]),
  _case("pp_dp_tp", "features", [(ENABLE, *_pp(2, None, DP2, TP2)), ("--training.steps 4", ENABLE, *_pp(2, None, DP2, TP2))], ngpu=8),
  _case("3d_compile", "features", [_pp(2, None, DP2, TP2, COMPILE)], ngpu=8),
  _case("pp_looped_1f1b", "features", [_pp(4, "Interleaved1F1B"), _pp(4, "Interleaved1F1B", "--parallelism.pipeline_parallel_layers_per_stage 1")]),
  _case("pp_looped_zero_bubble", "features", [_pp(4, "InterleavedZeroBubble", "activation-checkpoint:full")], disabled=True),
  _case("pp_zbv", "features", [_pp(2, "ZBVZeroBubble", "activation-checkpoint:full")], ngpu=2, disabled=True),
  _case("pp_custom_csv", "features", [_pp(2, "PipelineScheduleMulti", "--parallelism.pipeline_parallel_schedule_csv ./tests/assets/custom_schedule.csv",
                                          "activation-checkpoint:full")], ngpu=2, disabled=True),
  _case("optimizer_bf16_states", "features", [["--optimizer.implementation fused_opt_states_bf16"]], ngpu=2),
  _case("ddp", "features", [["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4"]]),
  _case("hsdp", "features", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2"]]),
  _case("cp", "features", [["--parallelism.context_parallel_degree=4"]]),
  _case("hsdp+tp", "features", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2",
                                 "--parallelism.tensor_parallel_degree=2"]], ngpu=8),
  # release/0.3's tree keeps this config in torchtitan_recipes/tests.py; torchtitan 0.3.0's wheel in torchtitan_recipes.tests.features
  _case("fsdp+cp", "features", [[_model("torchtitan_recipes.tests.features", "llama3_debugmodel_fsdp2_cp2")]]),
  _case("hsdp+cp_without_dp_shard", "features", [["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2",
                                                  "--parallelism.context_parallel_degree=2"]]),
  _case("hsdp+cp_with_dp_shard", "features", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2",
                                               "--parallelism.context_parallel_degree=2"]], ngpu=8),
  _case("fsdp+tp+cp", "features", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                                    "--parallelism.context_parallel_degree=2"]], ngpu=8),
  _case("fsdp_reshard_always", "features", [["--parallelism.fsdp_reshard_after_forward always"]], ngpu=2),
  _case("optional_checkpoint", "features", [
    [ENABLE, "--training.steps 2"],  # saved on 4 data-parallel devices, loaded on 2 x tp 2
    [ENABLE, "--checkpoint.exclude_from_loading lr_scheduler,dataloader,optimizer", TP2, "--training.steps 4"],
  ]),
  _case("gradient_accumulation", "features", [["--training.local_batch_size 8", "--training.global_batch_size 32"]], ngpu=2),
  _case("validation_tp_cp_pp", "features", [[DCG, "--validator.enable", "--validator.dataloader.dataset c4_test",
                                             "--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2",
                                             "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule Interleaved1F1B"]], ngpu=8),
  _case("override_fused_swiglu", "features", [["--override.imports torchtitan.overrides.fused_swiglu.fused_swiglu", TP2]]),
  _case("override_fused_grouped_experts", "features", [[DCG, _model("deepseek_v3", "deepseek_v3_debugmodel"),
                                                        "--override.imports torchtitan.overrides.fused_swiglu.fused_swiglu,"
                                                        "torchtitan.overrides.fused_swiglu.fused_grouped_experts",
                                                        TP2, "--parallelism.expert_parallel_degree 4"]]),
  _case("fsdp+varlen_attn+per_op_sac", "features", [[DCG, _model("llama3", "llama3_debugmodel_varlen_attn"),
                                                     "--parallelism.data_parallel_shard_degree=4", "activation-checkpoint:selective"]]),
  _case("float8_emulate_lora", "features", [[DCG, _model("llama3", "llama3_debugmodel_float8_emulate_lora"), TP2,
                                             "--parallelism.pipeline_parallel_degree 2"]], ngpu=8),
  _case("torchcomms_3d_dp+cp+pp+compile", "features", [[DCG, "--comm.mode torchcomms", CP2, "--parallelism.pipeline_parallel_degree 2", COMPILE]],
        ngpu=8, disabled=True),
  _case("torchcomms_3d_dp+tp+pp+compile", "features", [[DCG, _model("llama3", "llama3_debugmodel_ce_loss"), "--comm.mode torchcomms", TP2,
                                                        "--parallelism.pipeline_parallel_degree 2", COMPILE]], ngpu=8, disabled=True),
  _case("sft", "features", [[_model("llama3", "sft_debugmodel")]], ngpu=2),
  _case("seed_checkpoint", "features", [[DCG, ENABLE, "--checkpoint.create_seed_checkpoint"]], ngpu=1, trains=False),
  # models.py
  _case("deepseek_v3_mtp_fsdp+ep+compile", "models", [[DCG, _model("deepseek_v3", "deepseek_v3_debugmodel_mtp"),
                                                       "--parallelism.data_parallel_shard_degree 4", "--parallelism.expert_parallel_degree 2", COMPILE,
                                                       "--override.imports torchtitan.overrides.helion_rope.helion_cos_sin_rope,"
                                                       "torchtitan.overrides.helion_rope.helion_complex_rope"]]),
  _case("deepseek_v3_pp+fsdp+tp+ep", "models", [[DCG, _model("deepseek_v3", "deepseek_v3_debugmodel"), "--parallelism.pipeline_parallel_degree 2",
                                                 "--parallelism.pipeline_parallel_schedule Interleaved1F1B", DP2, TP2,
                                                 "--parallelism.expert_parallel_degree 4"]], ngpu=8),
  _case("deepseek_v3_hsdp+ep", "models", [[DCG, _model("deepseek_v3", "deepseek_v3_debugmodel"), "--parallelism.data_parallel_replicate_degree 2",
                                           DP2, "--parallelism.expert_parallel_degree 2"]]),
  _case("deepseek_v3_fused_mla_swiglu_fsdp+ep", "models", [[DCG, _model("deepseek_v3", "deepseek_v3_debugmodel"),
                                                            "--override.imports torchtitan.overrides.fused_mla.fused_mla,"
                                                            "torchtitan.overrides.fused_swiglu.fused_swiglu",
                                                            "--parallelism.data_parallel_shard_degree 4", "--parallelism.expert_parallel_degree 2"]]),
  _case("qwen3_moe_fsdp+tp+ep_param_groups", "models", [[DCG, _model("qwen3", "qwen3_debugmodel_moe_param_groups"), DP2, TP2,
                                                         "--parallelism.expert_parallel_degree 4"]]),
  _case("qwen3_fsdp+tp+cp_no_sp", "models", [[_model("qwen3", "qwen3_debugmodel"), DP2, TP2, "--parallelism.no-enable-sequence-parallel", CP2],
                                             [_model("qwen3", "qwen3_debugmodel"), DP2, TP2, CP2]], ngpu=8),
  _case("qwen3_fused_qkv_fsdp+tp+cp_compile_helion_rope", "models", [[_model("qwen3", "qwen3_debugmodel"), DP2, TP2, CP2, COMPILE,
                                                                      "--override.imports torchtitan.overrides.helion_rope.helion_cos_sin_rope"]], ngpu=8),
  _case("qwen3_non_fused_qkv_fsdp+tp+cp", "models", [[_model("qwen3", "qwen3_debugmodel_non_fused_qkv"), DP2, TP2, CP2]], ngpu=8),
  _case("qwen3_5_moe_fsdp+tp+ep+pp", "models", [[DCG, _model("qwen3_5", "qwen35_debugmodel_moe"), DP2, "--parallelism.pipeline_parallel_degree 2",
                                                 TP2, "--parallelism.expert_parallel_degree 4"]], ngpu=8),
  _case("qwen3_5_fsdp+tp+varlen_attn+per_op_sac", "models", [[DCG, _model("qwen3_5", "qwen35_debugmodel_varlen_attn"), DP2, TP2,
                                                              "--comm.train_timeout_seconds 600", "activation-checkpoint:selective"]]),
  _case("gpt_oss_fsdp+tp+ep+compile", "models", [[DCG, _model("gpt_oss", "gpt_oss_debugmodel"), "--parallelism.data_parallel_shard_degree 4", TP2,
                                                  "--parallelism.expert_parallel_degree 4", COMPILE]], ngpu=8),
  _case("gpt_oss_pp+fsdp+cp+ep+sacop", "models", [[DCG, _model("gpt_oss", "gpt_oss_debugmodel_flex"), DP2, CP2,
                                                   "--parallelism.context_parallel_load_balancer ptrr",
                                                   "--parallelism.context_parallel_ptrr_mask_key basic_mask",
                                                   "--parallelism.pipeline_parallel_degree 2", "--parallelism.pipeline_parallel_schedule Interleaved1F1B",
                                                   "--parallelism.expert_parallel_degree 4", "activation-checkpoint:selective"]], ngpu=8),
  _case("gpt_oss_pp+fsdp+ep+sacop", "models", [[DCG, _model("gpt_oss", "gpt_oss_debugmodel"), "--training.global_batch_size 64",
                                                "--parallelism.data_parallel_shard_degree 4", "--parallelism.pipeline_parallel_degree 2",
                                                "--parallelism.pipeline_parallel_schedule Interleaved1F1B", "--parallelism.expert_parallel_degree 4",
                                                "activation-checkpoint:selective"]], ngpu=8),
  _case("kimi_k2_5_muon_fsdp+ep", "models", [[DCG, _model("kimi_k2_7", "kimi_k2_5_debugmodel"), "--parallelism.data_parallel_shard_degree 4",
                                              "--parallelism.expert_parallel_degree 2", "--training.steps 1"]]),
  _case("muse_glimmer_mm_fsdp+tp+sp", "models", [[DCG, _model("muse_glimmer", "muse_glimmer_debugmodel_mm"), DP2, TP2]]),
  # h100.py: torchtitan runs these on H100s only
  _case("2d_asynctp_compile", "h100", [[COMPILE, TP2, "--compile.enable_async_tensor_parallel"]]),
  _case("float8", "h100", [[_model("llama3", "llama3_debugmodel_float8")]]),
  _case("fsdp_symm_mem", "h100", [["--parallelism.spmd_backend full_dtensor", "--parallelism.enable-fsdp-symm-mem"]], ngpu=2),
  _case("fsdp+tp+cp+compile+float8", "h100", [[DCG, _model("llama3", "llama3_debugmodel_float8"), COMPILE, DP2, TP2,
                                               "--parallelism.pipeline_parallel_degree 2", "--compile.enable_async_tensor_parallel"]], ngpu=8),
  _case("hsdp+cp+compile+float8", "h100", [[_model("llama3", "llama3_debugmodel_float8"), COMPILE, DP2,
                                            "--parallelism.data_parallel_replicate_degree 2", CP2]], ngpu=8),
  _case("deepseek_v3_fsdp+hybridep+compile", "h100", [[_model("deepseek_v3", "deepseek_v3_debugmodel_hybridep"),
                                                       "--parallelism.data_parallel_shard_degree 4", "--parallelism.expert_parallel_degree 2",
                                                       COMPILE, "--compile.components model,loss"]]),
  _case("deepseek_v3_fsdp+cp+tp+minimal_async_ep", "h100", [[_model("deepseek_v3", "deepseek_v3_debugmodel_minimal_async_ep"), "--compile.no-enable",
                                                             DP2, CP2, TP2, "--parallelism.expert_parallel_degree 8", "activation-checkpoint:full"]], ngpu=8),
  _case("dist_gemm", "h100", [[_model("llama3", "llama3_debugmodel_dist_gemm"), TP2]]),
]


# What an override asks to be written, checked after a run that trained: (override, what, check(dump, args)).
def _traces(dump: Path, args: dict) -> bool:
  folder = dump / args.get("profiler.save_traces_folder", "profiling/traces")
  return any(folder.rglob("*.xplane.pb"))


def _tensorboard(dump: Path, args: dict) -> bool:
  return any((dump / "tensorboard").glob("events.out.tfevents.*"))


def _last_step(dump: Path, args: dict) -> Path | None:
  folder = dump / args.get("checkpoint.folder", "checkpoint")
  steps = sorted((int(p.name), p) for p in folder.glob("*") if p.name.isdigit()) if folder.is_dir() else []
  return steps[-1][1] if steps else None


def _model_only(dump: Path, args: dict) -> bool:
  step = _last_step(dump, args)
  return step is not None and "opt_state" not in (step / "state" / "_METADATA").read_text()


def _in_export_dtype(dump: Path, args: dict) -> bool:
  import logging

  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # orbax reads metadata through jax: no accelerator to start
  sys.path.insert(0, str(ROOT))
  from torch_on_tpu.runtime import libtpu

  libtpu.quiet_without_chips()  # nor libtpu's start-up questions on a machine without chips
  import orbax.checkpoint as ocp

  step = _last_step(dump, args)
  if step is None:
    return False
  logging.getLogger("absl").setLevel(logging.ERROR)  # its note on the step's metadata file, read from inside the step
  tree = ocp.PyTreeCheckpointer().metadata(step / "state").item_metadata.tree
  return {str(m.dtype) for m in tree["params"].values()} == {args["checkpoint.export_dtype"]}


def _hf(dump: Path, args: dict) -> bool:
  step = _last_step(dump, args)
  return step is not None and (step.parent / f"step-{step.name}" / "model.safetensors.index.json").is_file()


def _seed(dump: Path, args: dict) -> bool:
  return (dump / args.get("checkpoint.folder", "checkpoint") / "0").is_dir()


ARTIFACTS = [
  ("profiler.enable_profiling", "jax.profiler traces under torchtitan's profiling folder", _traces),
  ("metrics.enable_tensorboard", "TensorBoard events", _tensorboard),
  ("checkpoint.enable", "a checkpoint step", lambda dump, args: _last_step(dump, args) is not None or _seed(dump, args)),
  ("checkpoint.last_save_model_only", "a last step holding the model alone", _model_only),
  ("checkpoint.export_dtype", "a last step in the export dtype", _in_export_dtype),
  ("checkpoint.last_save_in_hf", "HF safetensors with their index at step-N", _hf),
  ("checkpoint.create_seed_checkpoint", "a step-0 checkpoint", _seed),
]


@dataclasses.dataclass
class Outcome:
  """How one run ended: the verdict, why, and its losses by step."""

  verdict: str  # trained, refused, failed
  reason: str
  losses: dict[int, float] = dataclasses.field(default_factory=dict)


def overrides_of(run: tuple[str, ...], dump: Path, *, reference: bool = False) -> list[str]:
  """A run's override words, `{dump}` filled in (its plain-FSDP reference's with `reference`)."""
  words = [w for text in run for w in shlex.split(text.format(dump=dump))]
  return _without_parallelism(words) if reference else words


def command(case: Case, run: tuple[str, ...], dump: Path, *, reference: bool = False) -> list[str]:
  """The recipe's command line for one run of `case` (its plain-FSDP reference's with `reference`)."""
  overrides = overrides_of(run, dump, reference=reference)
  sizes = _sizes(case, overrides_of(run, dump), reference)
  return [sys.executable, "-m", "recipes.torchtitan", *shlex.split(BASE[0]), f"--dump_folder={dump}",
          f"--training.seq_len={SEQ}", f"--training.steps={STEPS}", *sizes, *overrides, f"--cpu_devices={case.ngpu}"]


# What a reference leaves out: the parallelism and the batch sizes (it sets its own), and the options
# that change how torchtitan's PyTorch runs but nothing computed (compared so to a run without them).
# It keeps the case's activation checkpointing (the same math): its whole batch on every simulated
# device of one host needs the memory the case saves (gpt-oss at global batch 64 on 8 CPU devices
# without it: 2.9 GiB of XLA:CPU temporaries a device, past this 24 GiB machine's RAM).
PLAIN_LEAVES_OUT = ("parallelism.", "training.local_batch_size", "training.global_batch_size", "training.disable_cuda_graphs",
                    "compile.", "profiler.", "metrics.", "comm.", "debug.")


def _without_parallelism(overrides: list[str]) -> list[str]:
  """The overrides less `PLAIN_LEAVES_OUT`."""
  out, skip = [], False
  for word in overrides:
    if skip:
      skip = False
      continue
    name = word[2:].split("=")[0].replace("-", "_") if word.startswith("--") else ""
    if name.startswith(PLAIN_LEAVES_OUT):
      field = name.rpartition(".")[2]
      skip = "=" not in word and not field.startswith(("no_", "enable", "disable"))  # a switch takes no value
      continue
    out.append(word)
  return out


def _setting(overrides: list[str], name: str) -> str | None:
  """The last value `overrides` give `--name` (either spelling), None when not set."""
  value = None
  for i, word in enumerate(overrides):
    key, eq, text = word[2:].partition("=") if word.startswith("--") else ("", "", "")
    if key.replace("-", "_") == name:
      value = text if eq else overrides[i + 1] if i + 1 < len(overrides) else None
  return value


def _sizes(case: Case, overrides: list[str], reference: bool) -> list[str]:
  """Batch settings that give the case and its reference the same rows: BATCH rows a step (the
  case's own global batch where it sets one), each data-parallel rank its share of them."""
  batch = int(_setting(overrides, "training.global_batch_size") or 0) or (
    int(_setting(overrides, "training.local_batch_size") or 0) * _data_parallel(case, overrides) or BATCH)
  if reference:  # plain FSDP over every device, whatever degrees the config itself sets
    plain = [f"--parallelism.{name}_degree={1 if name != 'data_parallel_shard' else -1}" for name in _DEGREES]
    return [*plain, f"--training.local_batch_size={batch // case.ngpu}", f"--training.global_batch_size={batch}"]
  if _setting(overrides, "training.local_batch_size") is not None:
    return [f"--training.global_batch_size={batch}"]
  return [f"--training.local_batch_size={max(batch // _data_parallel(case, overrides), 1)}", f"--training.global_batch_size={batch}"]


_DEGREES = ("data_parallel_shard", "data_parallel_replicate", "tensor_parallel", "context_parallel", "pipeline_parallel", "expert_parallel")


def _data_parallel(case: Case, overrides: list[str]) -> int:
  degree = lambda name, default=1: int(_setting(overrides, f"parallelism.{name}") or default)  # noqa: E731
  shard = degree("data_parallel_shard_degree", -1)
  others = degree("tensor_parallel_degree") * degree("context_parallel_degree") * degree("pipeline_parallel_degree")
  replicate = degree("data_parallel_replicate_degree")
  return replicate * (shard if shard > 0 else max(case.ngpu // (others * replicate), 1))


def execute(argv: list[str], log: Path) -> tuple[int, str, str]:
  """Runs one command from the repository's root; (exit status, stdout, stderr), both kept in `log`."""
  env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
  try:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    status, out, err = done.returncode, done.stdout, done.stderr
  except subprocess.TimeoutExpired as e:
    status, out, err = -1, e.stdout or "", (e.stderr or "") + f"\n(timed out after {TIMEOUT} s)"
    out, err = out if isinstance(out, str) else out.decode(), err if isinstance(err, str) else err.decode()
  log.parent.mkdir(parents=True, exist_ok=True)
  log.write_text(f"$ {shlex.join(argv)}\n(exit {status})\n--- stdout\n{out}\n--- stderr\n{err}\n")
  return status, out, err


def _losses(dump: Path, after: int) -> dict[int, float]:
  path = dump / "metrics.jsonl"
  if not path.exists():
    return {}
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return {r["step"]: r["loss"] for r in records if "loss" in r and r["step"] > after}


def _start_step(out: str) -> int:
  resumed = re.search(r"^Resumed from step (\d+)", out, re.M)
  return int(resumed[1]) if resumed else 0


def judge(case: Case, overrides: list[str], dump: Path, status: int, out: str, err: str, *, reference: bool = False) -> Outcome:
  """The run's verdict before its losses are compared: refused, failed, or trained (with its losses);
  a reference's only by its exit, traceback and losses."""
  lines = [line for line in err.splitlines() if line.strip()]
  if "Traceback (most recent call last)" in out + err:
    return Outcome("failed", "a traceback: " + (lines[-1] if lines else "?"))
  if status != 0:
    if len(lines) == 1 and lines[0].startswith("error: "):
      return Outcome("refused", lines[0].removeprefix("error: "))
    return Outcome("failed", f"exit {status} with {len(lines)} lines on stderr: " + (lines[-1] if lines else "(none)"))
  unaccounted = [] if reference else read_past(overrides, out, case.ngpu)
  if unaccounted:
    return Outcome("failed", f"read past: {', '.join(unaccounted)}")
  args = {name: value for name, value in _dotted(overrides)}
  missing = [what for option, what, check in ARTIFACTS if option in args and args[option] != "False" and not check(dump, args)]
  if missing and not reference:
    return Outcome("failed", f"not written: {'; '.join(missing)}")
  losses = _losses(dump, _start_step(out))
  steps = int(_setting(overrides, "training.steps") or STEPS)
  due = steps - _start_step(out) if case.trains else 0
  if len(losses) != due:
    return Outcome("failed", f"trained {len(losses)} of the {due} steps due" + (": " + _nothing(out) if not losses else ""))
  return Outcome("trained", "" if case.trains else "its initial weights saved as step 0, as torchtitan's seed checkpoint", losses)


def _nothing(out: str) -> str:
  said = [line for line in out.splitlines() if line.startswith("Nothing to train")]
  return said[0] if said else "no losses logged"


def _dotted(overrides: list[str]):
  """(dotted field, value text) of each torchtitan override (`--a.b-c v`, `--a.no-b`, `activation-checkpoint:full`)."""
  for i, word in enumerate(overrides):
    if word.startswith("activation-checkpoint:"):
      yield "activation_checkpoint", word.split(":", 1)[1]
      continue
    if not word.startswith("--") or word[2:].split("=")[0] in ("module", "config"):
      continue
    key, eq, text = word[2:].partition("=")
    key = key.replace("-", "_")
    section, _, field = key.rpartition(".")
    if field.startswith("no_") and section:
      yield f"{section}.{field[3:]}", "False"
    elif eq:
      yield key, text
    else:
      value = overrides[i + 1] if i + 1 < len(overrides) and not overrides[i + 1].startswith("--") and ":" not in overrides[i + 1] else "True"
      yield key, value


def read_past(overrides: list[str], out: str, devices: int) -> list[str]:
  """The overrides the run neither turned into a recipe flag nor named in a line of its output."""
  sys.path.insert(0, str(ROOT))
  from recipes import titan_config

  config = titan_config.parse([*shlex.split(BASE[0]), *overrides])
  used: set[str] = set()
  titan_config.to_flags(config, devices, used=used)
  defaults = {path for path, value, default in titan_config.leaves(config) if repr(value) == repr(default)}
  return [name for name, _ in _dotted(overrides) if name not in used | defaults and name not in out]


def run_case(case: Case, work: Path, references: dict) -> list[Outcome]:
  """Every run of `case` in its dump folder, then (for the runs that trained) its reference's."""
  dump = work / "cases" / case.suite / case.name
  outcomes = []
  for i, run in enumerate(case.runs):
    status, out, err = execute(command(case, run, dump), work / "logs" / case.suite / f"{case.name}.{i}.log")
    outcomes.append(judge(case, overrides_of(run, dump), dump, status, out, err))
  if any(o.verdict == "trained" and o.losses for o in outcomes):
    reference = _reference(case, work, references)
    for outcome, expected in zip(outcomes, reference):
      if outcome.verdict != "trained" or not outcome.losses:
        continue
      if expected.verdict != "trained":
        outcome.verdict, outcome.reason = "failed", f"its plain-FSDP reference {expected.verdict}: {expected.reason}"
        continue
      gaps = {s: abs(v - expected.losses.get(s, float("nan"))) / abs(expected.losses.get(s, float("nan"))) for s, v in outcome.losses.items()}
      worst = max(gaps.values())
      if not worst <= TOLERANCE:
        outcome.verdict, outcome.reason = "failed", f"losses {_fmt(outcome.losses)} against the reference's {_fmt(expected.losses)}"
      else:
        outcome.reason = f"losses within {worst:.1e} (relative) of plain FSDP"
  return outcomes


def _reference(case: Case, work: Path, references: dict) -> list[Outcome]:
  """The plain-FSDP runs of the case's override lists, in one dump folder of their own (shared
  by every case whose reference is the same)."""
  key = hashlib.sha1(repr((case.ngpu, [command(case, r, Path("{dump}"), reference=True) for r in case.runs])).encode()).hexdigest()[:12]
  if key not in references:
    dump = work / "references" / key
    outcomes = []
    for i, run in enumerate(case.runs):
      status, out, err = execute(command(case, run, dump, reference=True), work / "logs" / f"reference-{key}.{i}.log")
      outcomes.append(judge(case, overrides_of(run, dump, reference=True), dump, status, out, err, reference=True))
    references[key] = outcomes
  return references[key]


def _fmt(losses: dict[int, float]) -> str:
  return "{" + ", ".join(f"{s}: {v:.5f}" for s, v in sorted(losses.items())) + "}"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cases", help="comma-separated case names (default: all)")
  p.add_argument("--suites", help="comma-separated: features, models, h100 (default: all)")
  p.add_argument("--work", default="runs/titan_integration", help="where the runs' dump folders and logs go (emptied first)")
  args = p.parse_args(argv)
  unknown = sorted(set(args.cases.split(",") if args.cases else ()) - {c.name for c in CASES})
  if unknown:
    p.error(f"no case named {unknown[0]}; the cases are {', '.join(c.name for c in CASES)}")
  return args


def main(argv=None) -> int:
  """Runs the chosen cases and prints a Markdown table, a row per run, then the counts (the table
  is the result: a failed run is a row, not the exit status)."""
  args = parse_args(argv)
  names = set(args.cases.split(",")) if args.cases else None
  suites = set(args.suites.split(",")) if args.suites else None
  chosen = [c for c in CASES if (names is None or c.name in names) and (suites is None or c.suite in suites)]
  work = Path(args.work).absolute()
  if work.exists():
    subprocess.run(["rm", "-rf", str(work)], check=True)
  references: dict = {}
  counts = {"trained": 0, "refused": 0, "failed": 0}
  print("| case | run | GPUs | verdict | why |\n|---|---|---|---|---|", flush=True)
  for case in chosen:
    for i, outcome in enumerate(run_case(case, work, references)):
      counts[outcome.verdict] += 1
      mark = " (disabled in torchtitan's CI)" if case.disabled else ""
      why = outcome.reason.replace("|", "\\|")
      print(f"| {case.suite}/{case.name}{mark} | {i + 1} | {case.ngpu} | {outcome.verdict} | {why} |", flush=True)
  print(f"\n| runs | trained | refused | failed |\n|---|---|---|---|\n| {sum(counts.values())} | {counts['trained']} | "
        f"{counts['refused']} | {counts['failed']} |\n\n(logs: {work / 'logs'})", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
