"""What both recipes share: flags → resolved config → mesh, model, plan, data, step,
checkpoints, the Trainer.

`run(flags, recipe)` is the whole recipe, top to bottom. Nothing here imports
jax at module level: `--cpu_devices` must set `XLA_FLAGS`, and a TPU run its
`LIBTPU_INIT_ARGS`, before jax starts a backend (`setup_platform`).

A recipe is a `Recipe`: a name for its run directory and a builder of the
torch model on meta (called once for the plan and once for the run; twice
more for LoRA). The CLI's `--help` comes from the flags dataclass: each
field's default and help text (`cli`).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

# Flags for FSDP on TPU (v5e/v5p/v6e) set when the recipe runs on a TPU and
# LIBTPU_INIT_ARGS is unset: run FSDP's all-gathers and reduce-scatters as
# asynchronous collectives fused with, and scheduled under, the layers' matmuls
# (the latency-hiding scheduler), so the step does not wait on the interconnect.
TPU_FLAGS = (
  "--xla_tpu_enable_latency_hiding_scheduler=true",
  "--xla_tpu_enable_async_collective_fusion=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
  "--xla_tpu_overlap_compute_collective_tc=true",
  "--xla_enable_async_all_gather=true",
  "--xla_enable_async_reduce_scatter=true",
)
DTYPES = ("float32", "bfloat16", "bfloat16-all")
# Flags that change what the saved state is (its layout, dtypes, model): a resume must keep them.
STATE_FLAGS = ("model", "model_impl", "config", "scan", "dtype", "lora_rank", "lora_targets")
ATTENTION = ("auto", "xla", "splash", "cudnn", "none")


def flag(default, help: str):
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class Flags:
  """Flags both recipes take (the recipes add their model flags)."""

  seqlen: int = flag(128, "tokens per sequence")
  global_batch_size: int = flag(8, "sequences per optimizer step, over all devices")
  steps: int = flag(100, "optimizer steps to train to")
  lr: float = flag(3e-3, "peak learning rate of the warmup-cosine schedule (AdamW)")
  warmup_steps: int = flag(10, "linear warmup steps; then cosine decay to lr/10 at --steps")
  weight_decay: float = flag(0.1, "AdamW weight decay")
  clip_norm: float = flag(1.0, "gradient clipping by global norm (0: off)")
  max_skips: int = flag(5, "skip a step whose loss, gradient or update is NaN/Inf (state kept); stop after this many in a row (0: stop at the first)")
  fsdp: int = flag(-1, "devices on the fsdp mesh axis (-1: all that --tp leaves)")
  tp: int = flag(1, "devices on the tensor-parallel mesh axis")
  scan: bool = flag(True, "run the layer stack as one lax.scan (compile time flat in depth)")
  unroll: int = flag(1, "layers per scan iteration")
  remat: str = flag("none", "per-layer remat: none, full, dots_saveable, dots_with_no_batch_dims_saveable, offload_dots")
  attention: str = flag("auto", "attention kernel: auto (splash on TPU, cuDNN on GPU, blocked XLA on CPU), xla, splash, cudnn, none")
  dtype: str = flag("float32", "float32; bfloat16 (bf16 compute, fp32 master weights and Adam); bfloat16-all")
  grad_accum: int = flag(1, "microbatches per step (activations shrink by this factor)")
  data: str | None = flag(None, "text/JSONL/Parquet files, a glob, a directory or a datasets dir (default: built-in corpus)")
  data_field: str = flag("text", "the JSONL/Parquet/datasets field holding the text")
  tokenizer: str | None = flag(None, "tokenizer.json or HF tokenizer dir (default: byte-level BPE trained on the data)")
  ckpt_dir: str | None = flag(None, "checkpoint directory (default: runs/<run>/ckpt)")
  save_every: int = flag(50, "save a checkpoint every N steps (and at the end)")
  resume: bool = flag(True, "continue from the newest good checkpoint in --ckpt_dir; False: set its checkpoints aside as <step>.replaced (nothing deleted) and start afresh")
  resume_step: int | None = flag(None, "resume from this saved step instead of the newest (newer steps are set aside as <step>.superseded)")
  eval_every: int = flag(25, "eval loss on held-out data every N steps (0: never)")
  eval_batches: int = flag(4, "held-out batches per eval")
  profile: str | None = flag(None, "steps to trace with jax.profiler, 'FIRST,LAST' (into <log_dir>/profile)")
  log_dir: str | None = flag(None, "metrics.jsonl, TensorBoard and training.png (default: runs/<run>)")
  cpu_devices: int | None = flag(None, "simulate N CPU devices (sets XLA_FLAGS before jax starts)")
  dry_run: bool = flag(False, "plan memory and compile on abstract params, print both, allocate nothing, exit")
  memory_gib: float | None = flag(None, "plan against this much memory per device (default: the device's own)")
  seed: int = flag(0, "init, data order and dropout seed")


@dataclasses.dataclass
class Recipe:
  """What differs between the recipes."""

  name: str  # the run directory under runs/
  build: Callable  # () → a fresh torch model on meta
  family: str  # "titan" or "hf": how the model is called
  weights: str | None = None  # safetensors to start from
  lora: dict | None = None  # lora.wrap keyword arguments (rank, alpha, targets)


# ---- the command line -------------------------------------------------------------------


def cli(flags_cls, run_fn: Callable, summary: str) -> Callable:
  """A function for `fire.Fire` whose signature and docstring are `flags_cls`'s fields."""
  shared = {f.name for f in dataclasses.fields(Flags)}
  fields = sorted(dataclasses.fields(flags_cls), key=lambda f: f.name in shared)  # model flags first

  def main(**kwargs):
    unknown = sorted(set(kwargs) - {f.name for f in fields})
    if unknown:
      raise SystemExit(f"Unknown flag --{unknown[0]}; see --help for the flags.")
    try:
      run_fn(flags_cls(**kwargs))
    except Exception as e:
      from torch_on_tpu.errors import TorchOnTpuError  # not earlier: it starts jax

      if isinstance(e, TorchOnTpuError):  # one sentence, not a traceback
        raise SystemExit(f"error: {e}") from None
      raise

  main.__signature__ = inspect.Signature(
    [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in fields]
  )
  args = "\n".join(f"    {f.name}: {f.metadata['help']}" for f in fields)
  main.__doc__ = f"{summary}\n\n  Args:\n{args}\n"
  return main


def _no_output(result):
  """For fire's `serialize`: the recipe prints its own summary."""
  return None


def fire_main(main: Callable) -> None:
  import fire

  fire.Fire(main, serialize=_no_output)


# ---- before jax -------------------------------------------------------------------------


def setup_platform(cpu_devices: int | None) -> None:
  """Sets XLA_FLAGS for `--cpu_devices`, LIBTPU_INIT_ARGS on a TPU host; before jax starts.

  Importing torch_on_tpu starts jax's backends (torchax makes a PRNG key), so
  this runs before that; in a process where they already started (tests) it
  only checks that the devices are the ones asked for.
  """
  if _backends_started():
    if cpu_devices is not None:
      import jax

      from torch_on_tpu.errors import TorchOnTpuError

      have = jax.devices()
      if have[0].platform != "cpu" or len(have) != cpu_devices:
        raise TorchOnTpuError(
          f"--cpu_devices={cpu_devices} but jax already started with {len(have)} {have[0].platform} "
          f"devices in this process; run the recipe in a fresh process."
        )
    return
  if cpu_devices is not None:
    option = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(option)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{option}={cpu_devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
  elif _on_tpu_host() and "LIBTPU_INIT_ARGS" not in os.environ:
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(TPU_FLAGS)


def _backends_started() -> bool:
  bridge = sys.modules.get("jax._src.xla_bridge")  # jax has no public way to ask
  return bridge is not None and bridge.backends_are_initialized()


def _on_tpu_host() -> bool:
  """libtpu is installed, TPU chips are visible, and jax is not forced elsewhere."""
  if os.environ.get("JAX_PLATFORMS", "tpu") and "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
    return False
  if importlib.util.find_spec("libtpu") is None:
    return False
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


# MULTI-HOST: the single call site. Joins the processes of a multi-host run
# (TOT_* variables or a cluster jax detects; see torch_on_tpu.distributed)
# after setup_platform and before any device use; one process: a no-op.
def _initialize_distributed() -> None:
  from torch_on_tpu.distributed import initialize_distributed

  initialize_distributed()


# ---- the run ---------------------------------------------------------------------------


def resolve(flags: Flags, recipe: Recipe) -> dict:
  """The flags with every default filled in: what is printed and saved with checkpoints."""
  config = dataclasses.asdict(flags)
  config["log_dir"] = flags.log_dir or os.path.join("runs", recipe.name)
  config["ckpt_dir"] = flags.ckpt_dir or os.path.join(config["log_dir"], "ckpt")
  return config


def run(flags: Flags, recipe: Recipe) -> dict:
  """Trains (or with `dry_run` plans and compiles) one recipe; returns a summary dict."""
  setup_platform(flags.cpu_devices)
  _initialize_distributed()

  import jax

  from torch_on_tpu.errors import TorchOnTpuError

  _check_flags(flags, TorchOnTpuError)
  config = resolve(flags, recipe)
  main = jax.process_index() == 0
  if main:
    print("Run config:\n" + json.dumps(config, indent=1), flush=True)
  return _run(flags, recipe, config, main)


def _run(flags: Flags, recipe: Recipe, config: dict, main: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import torch_on_tpu as tot
  from torch_on_tpu import checkpoint, data, lora, plan

  mesh = tot.make_mesh(fsdp=flags.fsdp, tp=flags.tp)
  if main:
    devices = mesh.devices.flat[0]
    print(f"Mesh {dict(mesh.shape)} over {mesh.size} {devices.platform} devices ({devices.device_kind})", flush=True)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, flags.lr, max(flags.warmup_steps, 0), max(flags.steps, flags.warmup_steps + 1), end_value=flags.lr / 10
  )
  optimizer = optax.inject_hyperparams(optax.adamw)(
    learning_rate=schedule, b1=0.9, b2=0.95, weight_decay=flags.weight_decay
  )
  compute_dtype = None if flags.dtype == "float32" else jnp.bfloat16
  master_dtype = jnp.bfloat16 if flags.dtype == "bfloat16-all" else None

  def make_step(abstract: bool):
    jm = _model(flags, recipe, mesh, abstract)
    return tot.make_train_step(
      jm,
      _loss,
      optimizer,
      grad_accum=flags.grad_accum,
      clip_norm=flags.clip_norm or None,
      compute_dtype=compute_dtype,
      master_dtype=master_dtype,
      seed=flags.seed,
      trainable=lora.TRAINABLE if recipe.lora else None,
      skip_nonfinite=flags.max_skips > 0,
    )

  # 1. Plan on abstract params: nothing allocated, so a run that cannot fit fails here.
  shape = plan.decoder_shape(recipe.build())
  abstract_step = make_step(abstract=True)
  memory_bytes = flags.memory_gib * 2**30 if flags.memory_gib else None
  memory = plan.plan_memory(
    abstract_step, shape, global_batch_size=flags.global_batch_size, seqlen=flags.seqlen,
    remat=flags.remat, device_bytes=memory_bytes,
  )
  if main:
    print(memory, flush=True)
  spec = jax.ShapeDtypeStruct((flags.global_batch_size, flags.seqlen), jnp.int32)
  abstract_batch = {"input_ids": spec, "labels": spec, "positions": spec, "segment_ids": spec}
  split = _splitter(recipe, flags)
  if flags.dry_run:
    if main and memory.fits is False:
      print(f"Would not fit: {memory.message()}", flush=True)
    report = abstract_step.compile(*split(abstract_batch))
    if main:
      print(f"Compiled step: {report}", flush=True)
      if report.peak_bytes is not None:
        print(f"Compiled peak per device: {report.peak_bytes / 2**30:.2f} GiB (plan: {memory.total / 2**30:.2f} GiB)")
    return {"plan": memory, "compile": report}
  memory.check()
  del abstract_step

  # 2. The real model, data and checkpoints.
  step = make_step(abstract=False)
  source = data.source(flags.data, field=flags.data_field)
  tokenizer = data.build_tokenizer(flags.tokenizer, vocab_size=min(data.DEFAULT_VOCAB_SIZE, shape.vocab), corpus=source)
  data.check_model_fit(tokenizer.vocab_size, shape.vocab, flags.seqlen)
  titan = recipe.family == "titan"
  data_kwargs = dict(
    seqlen=flags.seqlen, global_batch_size=flags.global_batch_size, seed=flags.seed,
    with_positions=titan, with_segment_ids=titan, field=flags.data_field,
  )
  ckpt = checkpoint.Checkpointer(config["ckpt_dir"], save_every=flags.save_every)
  try:
    restored = _resume(ckpt, step, flags, config, main)
  except BaseException:
    ckpt.close()
    raise
  train = data.batches(source, tokenizer, state=restored.data if restored else None, **data_kwargs)
  evals = (
    data.eval_batches(source, tokenizer, num_batches=flags.eval_batches, **data_kwargs)
    if flags.eval_every and flags.eval_batches else None
  )
  to_global = lambda batch: data.to_global(batch, mesh)  # noqa: E731 (each process's rows → global arrays)

  # 3. Compile ahead (the report comes before the first step), then train.
  report = step.compile(*split(abstract_batch))
  if main:
    print(f"Compiled step: {report}", flush=True)
  start = {"step": step.step_count}
  if evals:
    start["eval_loss"] = _eval_loss(step, evals, split, to_global)
    if main:
      print(f"step {step.step_count}: eval loss {start['eval_loss']:.4f}", flush=True)
  try:
    with checkpoint.PreemptionGuard() as guard:
      trainer = tot.Trainer(
        step,
        train,
        steps=flags.steps,
        log_dir=config["log_dir"],
        split_batch=split,
        to_global=to_global,
        eval_data=evals,
        eval_every=flags.eval_every,
        eval_batches=flags.eval_batches,
        profile_steps=_profile_steps(flags.profile),
        checkpointer=ckpt,
        stop_requested=guard.should_stop,
        max_skips=max(flags.max_skips, 1),
        run_config=config,
      )
      summary = trainer.run()
  except Exception as e:  # noqa: BLE001 (storage faults and device OOM are translated; the rest re-raises)
    message = _run_error_message(e, memory, report, config)
    if message is None:
      raise
    raise tot.TorchOnTpuError(message) from None
  finally:
    train.close()
    ckpt.close()
  losses = [r["loss"] for r in trainer.records if "loss" in r]
  summary.update(
    start=start, first_loss=losses[0] if losses else None, records=trainer.records,
    ckpt_dir=config["ckpt_dir"], log_dir=config["log_dir"], plan=memory, compile=report, train_step=step,
  )
  return summary


def _resume(ckpt, step, flags: Flags, config: dict, main: bool):
  """Restores the checkpoint to continue from into `step` (None: a fresh run), or refuses in one sentence."""
  from torch_on_tpu.errors import TorchOnTpuError

  saved = ckpt.all_steps()
  if not saved:
    if flags.resume_step is not None:
      raise TorchOnTpuError(f"--resume_step={flags.resume_step} but {config['ckpt_dir']} holds no checkpoint.")
    return None
  if not flags.resume:
    ckpt.set_aside(saved, "replaced")
    if main:
      print(f"--resume=False: set aside steps {saved} of {config['ckpt_dir']} as <step>.replaced; starting afresh", flush=True)
    return None
  _check_same_state(ckpt.saved_config(flags.resume_step), config, ckpt.directory)
  restored = ckpt.restore(step.abstract_state(), step=flags.resume_step)
  _check_same_state(restored.config, config, ckpt.directory / str(restored.step))  # after a fallback
  newer = [s for s in ckpt.all_steps() if s > restored.step]
  ckpt.set_aside(newer, "superseded")
  step.state = restored.state
  if main:
    aside = f"; set aside the newer steps {newer} as <step>.superseded" if newer else ""
    print(f"Resumed from step {restored.step} of {config['ckpt_dir']}{aside}", flush=True)
  return restored


def _check_same_state(saved: dict | None, config: dict, where) -> None:
  """Refuses a resume whose flags change what the saved state is, naming the flag and its saved value."""
  from torch_on_tpu.errors import TorchOnTpuError

  for name in STATE_FLAGS:
    if saved and name in saved and name in config and saved[name] != config[name]:
      raise TorchOnTpuError(
        f"The checkpoint at {where} was saved with --{name}={saved[name]} but this run has "
        f"--{name}={config[name]}; resume with --{name}={saved[name]}, or start afresh with "
        f"--resume=False or another --ckpt_dir."
      )


def _check_flags(flags: Flags, error) -> None:
  if flags.dtype not in DTYPES:
    raise error(f"--dtype={flags.dtype!r} is not one of {', '.join(DTYPES)}; pick one of those.")
  if flags.attention not in ATTENTION:
    raise error(f"--attention={flags.attention!r} is not one of {', '.join(ATTENTION)}; pick one of those.")
  if flags.max_skips < 0:
    raise error(f"--max_skips={flags.max_skips} is negative; give 0 (stop at the first NaN/Inf step) or more.")
  if flags.resume_step is not None and not flags.resume:
    raise error("--resume_step needs --resume=True; drop one of the two.")
  if flags.global_batch_size % flags.grad_accum:
    raise error(
      f"--global_batch_size={flags.global_batch_size} does not divide into --grad_accum={flags.grad_accum} "
      f"microbatches; make the batch a multiple of grad_accum."
    )


def _model(flags: Flags, recipe: Recipe, mesh, abstract: bool):
  """The JittableModule: the recipe's model (with imported weights, with LoRA adapters)."""
  import torch_on_tpu as tot
  from torch_on_tpu import checkpoint, lora

  sharding = "fsdp_tp" if flags.tp > 1 else "fsdp"
  attention = None if flags.attention == "none" else flags.attention
  layers = dict(scan=flags.scan, unroll=flags.unroll, remat=None if flags.remat == "none" else flags.remat)
  common = dict(mesh=mesh, sharding=sharding, seed=flags.seed, attention=attention)
  if not recipe.lora:
    jm = tot.JittableModule(recipe.build(), abstract=abstract, **common, **layers)
    if recipe.weights and not abstract:
      checkpoint.import_safetensors(jm, recipe.weights)
    return jm
  base = tot.JittableModule(recipe.build(), abstract=abstract, **common)
  if recipe.weights and not abstract:
    checkpoint.import_safetensors(base, recipe.weights)
  return lora.wrap(base, recipe.build(), seed=flags.seed, **recipe.lora, **layers)


def _loss(outputs, labels):
  import torch

  logits = outputs.logits if hasattr(outputs, "logits") else outputs
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _splitter(recipe: Recipe, flags: Flags) -> Callable:
  """`batch → (inputs, labels)` the way this recipe's model is called."""
  if recipe.family == "hf":
    return lambda b: ({"input_ids": b["input_ids"], "use_cache": False}, b["labels"])
  if flags.attention == "none":  # torchtitan built with SDPA: plain causal attention
    return lambda b: ((b["input_ids"], b["positions"]), b["labels"])
  from torch_on_tpu.models.torchtitan import FlexMasks

  # torchtitan's flex attention, document-causal: where its trainer passes
  # get_attention_masks(positions), we pass the documents' ids.
  return lambda b: ((b["input_ids"], b["positions"], FlexMasks(b["segment_ids"])), b["labels"])


def _eval_loss(step, batches, split, to_global) -> float:
  losses = [float(step.evaluate(*split(to_global(b)))) for b in batches]
  return sum(losses) / len(losses)


def _profile_steps(spec) -> tuple[int, int] | None:
  if spec is None:
    return None
  if isinstance(spec, int):
    return (spec, spec + 2)
  first, last = (int(x) for x in (spec if isinstance(spec, (tuple, list)) else str(spec).split(",")))
  return (first, last)


def _run_error_message(error, memory, report, config: dict) -> str | None:
  """One sentence for a storage fault (e.g. metrics.jsonl on a full disk) or a device
  out-of-memory that reached the recipe; None for anything else. A full disk is
  RESOURCE_EXHAUSTED too, so the errno is asked first."""
  from torch_on_tpu import storage

  where = Path(getattr(error, "filename", None) or config["log_dir"])
  stored = storage.storage_error(error, "the run's files", where, "the checkpoints saved before are complete")
  if stored is not None:
    return stored
  if "RESOURCE_EXHAUSTED" in str(error):
    return _oom_message(error, memory, report)
  return None


def _oom_message(error, memory, report) -> str:
  first = str(error).strip().splitlines()[0][:200]
  compiled = f", compiled peak {report.peak_bytes / 2**30:.2f} GiB" if report and report.peak_bytes else ""
  return (
    f"The step ran out of device memory ({first}); the plan was {memory.total / 2**30:.2f} GiB per device"
    f"{compiled}; {memory.suggest(0.75 * memory.total)}."
  )
