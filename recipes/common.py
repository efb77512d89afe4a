"""What both recipes share: flags → start-up checks → resolved config → mesh, model, plan,
data, step, checkpoints, the Trainer.

`run(flags, recipe_for)` is the whole recipe, top to bottom. Nothing here imports
jax at module level: `--cpu_devices` must set `XLA_FLAGS`, and a TPU run its
`LIBTPU_INIT_ARGS`, before jax starts a backend (`setup_platform`).

A recipe is a `Recipe`: a name for its run directory and a builder of the
torch model on meta (called once for the plan and once for the run; twice
more for LoRA). The CLI's `--help` comes from the flags dataclass: each
field's default and help text (`cli`). A flag says what values it takes
(`flag(choices=, minimum=, check=)`) and which library argument it sets when
the names differ (`flag(argument=)`): the first drives the start-up checks
(`check_flags`, with the `@startup_check`s across flags), the second how errors
name it (`flag_spelling`, for `errors.spoken_as_flags`). A new flag needs no
other code for either.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import importlib.util
import inspect
import json
import math
import os
import shutil
import sys
import typing
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
STATE_FLAGS = ("model", "model_impl", "config", "dtype", "lora_rank", "lora_targets", "mtp_layers")
ATTENTION = ("auto", "xla", "splash", "cudnn", "none")


def flag(default, help: str, *, choices=None, minimum=None, check=None, argument: str | None = None):
  """A recipe flag: its default and `--help` text, the values it takes, and the call argument it sets.

  What it takes is checked at start-up, before any device or model (`check_flags`):
  `choices` (a tuple, or a function returning one, e.g. names another module defines),
  `minimum` (for numbers; None always passes) and `check` (`(value, flags) → None`, raising
  `TorchOnTpuError` with a sentence about the value; the flag's name is put in front), for
  what needs a look at the machine (files).
  `argument`: the library call argument this flag sets when its name differs (`--data_field`
  sets `field=`), so that errors from the library name the flag (`errors.spoken_as_flags`).
  """
  metadata = {"help": help, "choices": choices, "minimum": minimum, "check": check, "argument": argument}
  return dataclasses.field(default=default, metadata=metadata)


def _remat_names() -> tuple[str, ...]:
  from torch_on_tpu import remat as remat_lib

  return ("auto", *remat_lib.NAMES)


def _float8_recipes() -> tuple[str, ...]:
  from torch_on_tpu.float8 import RECIPES

  return RECIPES


def _existing_data(spec, flags) -> None:
  """--data names files that exist (listed; of JSONL or Parquet the first record is read, for --data_field)."""
  if spec is not None:
    from torch_on_tpu.data import sources

    sources.source(spec, field=flags.data_field)


def existing_path(path, flags) -> None:
  from torch_on_tpu.errors import TorchOnTpuError

  if path is not None and not os.path.exists(path):
    raise TorchOnTpuError(f"{path!r} does not exist; pass an existing file or directory.")


def _profile_format(spec, flags) -> None:
  from torch_on_tpu.errors import TorchOnTpuError

  try:
    _profile_steps(spec)
  except ValueError:
    raise TorchOnTpuError(f"{spec!r} is not FIRST,LAST step numbers; write e.g. --profile=10,12.") from None


@dataclasses.dataclass
class Flags:
  """Flags both recipes take (the recipes add their model flags)."""

  seqlen: int = flag(128, "tokens per sequence", minimum=1)
  global_batch_size: int = flag(8, "sequences per optimizer step, over all devices", minimum=1)
  steps: int = flag(100, "optimizer steps to train to", minimum=1)
  lr: float = flag(3e-3, "peak learning rate of the warmup-cosine schedule (AdamW)")
  warmup_steps: int = flag(10, "linear warmup steps; then cosine decay to lr/10 at --steps", minimum=0)
  weight_decay: float = flag(0.1, "AdamW weight decay", minimum=0)
  clip_norm: float = flag(1.0, "gradient clipping by global norm (0: off)", minimum=0)
  max_skips: int = flag(5, "skip a step whose loss, gradient or update is NaN/Inf (state kept); stop after this many in a row (0: stop at the first)", minimum=0)
  fsdp: int = flag(-1, "devices on the fsdp mesh axis (-1: all that --tp leaves)", minimum=-1)
  tp: int = flag(1, "devices on the tensor-parallel mesh axis", minimum=1)
  pp: int = flag(1, "pipeline stages: devices on the pp mesh axis (the outermost), which splits the scanned layers into stages", minimum=1)
  microbatches: int | None = flag(None, "pipeline microbatches per pass (default with --pp: the largest divisor of the batch per pass up to 4·pp)", minimum=1)
  virtual_stages: int = flag(1, "pipeline: blocks of layers per stage, visited round-robin (circular schedule; the bubble shrinks by this factor)", minimum=1)
  cp: int = flag(1, "devices on the context-parallel mesh axis: each sequence split into cp pieces (long context; params shard over fsdp and cp)", minimum=1)
  ep: int = flag(1, "devices on the expert-parallel mesh axis (MoE experts sharded over it, the batch too; not with --tp)", minimum=1)
  scan: bool = flag(True, "run the layer stack as one lax.scan (compile time flat in depth)")
  unroll: int = flag(1, "layers per scan iteration", minimum=1)
  remat: str = flag("auto", "per-layer remat: auto (scanned: dots_and_attention; loop: none), none, full, dots_saveable, dots_with_no_batch_dims_saveable, dots_and_attention, offload_dots", choices=_remat_names)
  attention: str = flag("auto", "attention kernel: auto (splash on TPU, cuDNN on GPU, blocked XLA on CPU), xla, splash, cudnn, none (torchax's own SDPA lowering)", choices=ATTENTION)
  dtype: str = flag("float32", "float32; bfloat16 (bf16 compute, fp32 master weights and Adam); bfloat16-all", choices=DTYPES)
  float8: str | None = flag(None, "float8 matmuls (torchao's Float8Linear, torchtitan's filter): rowwise, tensorwise or rowwise_with_gw_hp; weights and checkpoints stay in --dtype (default: off)", choices=_float8_recipes)
  float8_skip: str = flag("lm_head", "with --float8: comma-separated names of linears kept in high precision (linears with a dim not a multiple of 16 always are)")
  grad_accum: int = flag(1, "microbatches per step (activations shrink by this factor)", minimum=1)
  data: str | None = flag(None, "text/JSONL/Parquet files, a glob, a directory or a datasets dir (default: built-in corpus)", check=_existing_data)
  data_field: str = flag("text", "the JSONL/Parquet/datasets field holding the text", argument="field")
  tokenizer: str | None = flag(None, "tokenizer.json or HF tokenizer dir (default: byte-level BPE trained on the data)", check=existing_path)
  ckpt_dir: str | None = flag(None, "checkpoint directory (default: runs/<run>/ckpt)")
  save_every: int = flag(50, "save a checkpoint every N steps (and at the end)", minimum=1)
  resume: bool = flag(True, "continue from the newest good checkpoint in --ckpt_dir; False: set its checkpoints aside as <step>.replaced (nothing deleted) and start afresh")
  resume_step: int | None = flag(None, "resume from this saved step instead of the newest (newer steps are set aside as <step>.superseded)", minimum=0)
  eval_every: int = flag(25, "eval loss on held-out data every N steps (0: never)", minimum=0)
  eval_batches: int = flag(4, "held-out batches per eval", minimum=1)
  profile: str | None = flag(None, "steps to trace with jax.profiler, 'FIRST,LAST' (into <log_dir>/profile)", check=_profile_format)
  log_dir: str | None = flag(None, "metrics.jsonl, TensorBoard and training.png (default: runs/<run>)")
  cpu_devices: int | None = flag(None, "simulate N CPU devices (sets XLA_FLAGS before jax starts)", minimum=1)
  dry_run: bool = flag(False, "plan memory and compile on abstract params, print both, allocate nothing, exit")
  memory_gib: float | None = flag(None, "plan against this much memory per device (default: the device's own)", minimum=0)
  seed: int = flag(0, "init, data order and dropout seed")
  sample: str | None = flag(None, "after training, print a greedy completion of this prompt from the final weights")
  compile_cache: str | None = flag(None, "jax's persistent compilation cache, so a relaunch skips the compile (default: $XDG_CACHE_HOME/torch_on_tpu/jax; off or none: no cache)")


@dataclasses.dataclass
class Recipe:
  """What differs between the recipes."""

  name: str  # the run directory under runs/
  build: Callable  # () → a fresh torch model on meta
  family: str  # "titan" or "hf": how the model is called
  weights: str | None = None  # safetensors to start from
  lora: dict | None = None  # lora.wrap keyword arguments (rank, alpha, targets)
  convert_model: str | None = None  # how tools/convert.py names the model (--model=... / --hf_config=...)
  loss: Callable | None = None  # the train step's loss_fn(outputs, labels); None: mean cross-entropy of the logits
  labels: Callable | None = None  # data batch → the labels `loss` reads; None: batch["labels"]


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
      from torch_on_tpu import health
      from torch_on_tpu.errors import TorchOnTpuError

      if isinstance(e, TorchOnTpuError):  # one sentence, not a traceback
        health.failed(str(e))  # the other processes stop at once, naming this one
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(getattr(e, "exit_code", health.EXIT_ERROR)) from None
      raise

  main.__signature__ = inspect.Signature(
    [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in fields]
  )
  args = "\n".join(f"    {f.name}: {f.metadata['help']}" for f in fields)
  main.__doc__ = f"{summary}\n\n  Args:\n{args}\n"
  main.flags_cls = flags_cls
  return main


def _no_output(result):
  """For fire's `serialize`: the recipe prints its own summary."""
  return None


def fire_main(main: Callable, argv: list[str] | None = None) -> None:
  """Checks the command line, then hands it to fire (which runs `main` and serves --help).

  fire alone reports a flag it could not use only after the run, and guesses
  each value's type from its text (`--scan=false` is the string "false"), so
  every flag is checked against `main`'s flags first and passed on as a
  Python literal of the flag's type. A mistake exits with status 2 and one
  sentence, before anything is built.
  """
  from torch_on_tpu import extras

  fire = extras.require("fire", "The recipes' command line")

  argv = sys.argv[1:] if argv is None else argv
  try:
    command = parse_argv(argv, main.flags_cls)
  except FlagError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  fire.Fire(main, command=command, serialize=_no_output)


class FlagError(ValueError):
  """A command-line mistake: one sentence for the user."""


_HELP = ("-h", "--help", "--helpfull")
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def parse_argv(argv: list[str], flags_cls) -> list[str]:
  """The command line checked against `flags_cls`'s fields → `--name=<literal>` args for fire.

  Takes `--name=value`, `--name value`, `--flag` / `--noflag` for booleans
  (true/false, 1/0, yes/no in any case), `-` for `_` in names, and `None` for
  optional flags. `--help` and fire's own flags after a bare `--` pass through.
  """
  if any(a in _HELP for a in argv):
    return list(argv)
  if "--" in argv:
    cut = argv.index("--")
    return parse_argv(argv[:cut], flags_cls) + argv[cut:]
  types = typing.get_type_hints(flags_cls)
  names = [f.name for f in dataclasses.fields(flags_cls)]
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    i += 1
    if not arg.startswith("--"):
      raise FlagError(f"Unexpected argument {arg!r}; the recipe takes only --name=value flags (see --help).")
    name, has_value, value = arg[2:].partition("=")
    name = name.replace("-", "_")
    if name not in types and name.startswith("no") and _kind(types.get(name[2:])) is bool and not has_value:
      name, has_value, value = name[2:], True, "false"
    if name not in types:
      near = difflib.get_close_matches(name, names, n=1)
      hint = f"did you mean --{near[0]}?" if near else "see --help for the flags."
      raise FlagError(f"Unknown flag --{name}; {hint}")
    kind = _kind(types[name])
    if not has_value:
      if kind is bool and (i == len(argv) or argv[i].lower() not in (*_TRUE, *_FALSE)):
        value = "true"
      elif i < len(argv) and not argv[i].startswith("--"):
        value, i = argv[i], i + 1
      else:
        raise FlagError(f"--{name} needs a value: write --{name}=VALUE.")
    out.append(f"--{name}={_literal(name, value, kind, _optional(types[name]))!r}")
  return out


def _kind(hint) -> type | None:
  """`int`, `float`, `bool` or `str` of a field's type (`int | None` → int)."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return args[0] if args else hint


def _optional(hint) -> bool:
  return type(None) in typing.get_args(hint)


def _literal(name: str, text: str, kind: type, optional: bool):
  """A flag's text as a value of its type, or a FlagError naming what to write."""
  if optional and text == "None":
    return None
  if kind is bool:
    if text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise FlagError(f"--{name}={text} is not a boolean; write --{name}=true or --{name}=false.")
  if kind is int:
    try:
      return int(text)
    except ValueError:
      raise FlagError(f"--{name}={text} is not an integer; give a whole number, e.g. --{name}=8.") from None
  if kind is float:
    try:
      return float(text)
    except ValueError:
      raise FlagError(f"--{name}={text} is not a number; give one like --{name}=0.001.") from None
  return text


# ---- before jax -------------------------------------------------------------------------


def setup_platform(cpu_devices: int | None) -> None:
  """Sets XLA_FLAGS for `--cpu_devices`, LIBTPU_INIT_ARGS on a TPU host; before jax starts.

  XLA reads its flags when jax starts its backend, so this runs before anything
  uses jax; in a process where the backend already started (tests) it only
  checks that the devices are the ones asked for.
  """
  from torch_on_tpu import _compat, xla_flags

  if _compat.backend_started():
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
    xla_flags.simulate_cpu_devices(cpu_devices, cpu_only=True)
  elif _on_tpu_host() and "LIBTPU_INIT_ARGS" not in os.environ:
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(TPU_FLAGS)


def _on_tpu_host() -> bool:
  """libtpu is installed, TPU chips are visible, and jax is not forced elsewhere."""
  if os.environ.get("JAX_PLATFORMS", "tpu") and "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
    return False
  if importlib.util.find_spec("libtpu") is None:
    return False
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


# MULTI-HOST: the single call site. Starts the platform, which joins the processes
# of a multi-host run (TOT_* variables or a cluster jax detects; see
# torch_on_tpu.runtime) after setup_platform and before any device use.
def _initialize_distributed() -> None:
  from torch_on_tpu import runtime

  runtime.setup()


# ---- the run ---------------------------------------------------------------------------


def resolve(flags: Flags, recipe: Recipe) -> dict:
  """The flags with every default filled in: what is printed and saved with checkpoints."""
  config = dataclasses.asdict(flags)
  config["log_dir"] = flags.log_dir or os.path.join("runs", recipe.name)
  config["ckpt_dir"] = flags.ckpt_dir or os.path.join(config["log_dir"], "ckpt")
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  default_cache = os.path.join(cache_home, "torch_on_tpu", "jax")
  no_cache = flags.compile_cache is not None and str(flags.compile_cache).lower() in ("off", "none")
  config["compile_cache"] = None if no_cache else flags.compile_cache or default_cache
  if flags.pp > 1 and flags.microbatches is None:
    config["microbatches"] = default_microbatches(flags)
  return config


def default_microbatches(flags: Flags) -> int:
  """The largest divisor of the rows one pipeline pass gets, from pp up to 4·pp (the bubble
  (pp−1)/(V·M+pp−1) is then at most a fifth for V = 1); pp when none divides."""
  rows = flags.global_batch_size // max(flags.grad_accum, 1)
  fits = [m for m in range(flags.pp, 4 * flags.pp + 1) if rows % m == 0]
  return max(fits) if fits else flags.pp


def run(flags: Flags, recipe_for: Callable[[Flags], Recipe]) -> dict:
  """Trains (or with `dry_run` plans and compiles) the recipe `recipe_for(flags)`; returns a summary dict.

  In this order, so that a mistyped or impossible flag stops the run within seconds: the
  flags' own checks, the platform, the mesh and the checks that need its devices
  (`check_flags`), and only then the recipe's model. Throughout, errors from the library
  name the flags that set their arguments (`errors.spoken_as_flags`).
  """
  from torch_on_tpu import errors

  with errors.spoken_as_flags(flag_spelling(type(flags))):
    setup_platform(flags.cpu_devices)
    check_flags(flags)
    _initialize_distributed()

    import jax

    import torch_on_tpu as tot
    from torch_on_tpu import fingerprint, storage

    mesh = tot.make_mesh(**mesh_axes(flags))
    check_flags(flags, mesh)
    recipe = recipe_for(flags)
    config = resolve(flags, recipe)
    storage.note_checkpoints(config["ckpt_dir"])  # what a fault from here on names as kept
    fingerprint.check_same(config=config)  # every process with the same flags, before anything is built
    main = jax.process_index() == 0
    latest = None if flags.dry_run else _latest_checkpoint(flags, config)
    if latest is not None and latest >= flags.steps and flags.resume_step is None:
      if main:
        then = "sampling from it" if flags.sample is not None else "raise --steps to train further or pass another --ckpt_dir"
        print(f"Nothing to train: {config['ckpt_dir']} already holds step {latest} of --steps={flags.steps}; {then}.", flush=True)
      if flags.sample is None:
        return {"finished": True, "steps": 0, "last_step": latest, "ckpt_dir": config["ckpt_dir"], "log_dir": config["log_dir"]}
    config["compile_cache"] = _use_compile_cache(config["compile_cache"])
    if main:
      print("Run config:\n" + json.dumps(config, indent=1), flush=True)
    return _run(flags, recipe, config, mesh, main)


def _latest_checkpoint(flags: Flags, config: dict) -> int | None:
  """The newest step in --ckpt_dir the run would resume from, read before anything is
  built (a finished run has nothing to do); None for a fresh start (--resume=False
  sets the old steps aside later, deleting nothing)."""
  if not flags.resume or not os.path.isdir(config["ckpt_dir"]):
    return None
  from torch_on_tpu import checkpoint

  with checkpoint.Checkpointer(config["ckpt_dir"]) as ckpt:  # read_only would log a warning
    return ckpt.latest_step()


def _use_compile_cache(directory: str | None) -> str | None:
  """Points jax's persistent compilation cache at `directory` unless this process
  already chose one (a test session, the user's JAX_COMPILATION_CACHE_DIR); returns
  the directory in use."""
  import jax

  from torch_on_tpu import storage

  if directory and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", directory)
  if jax.config.jax_compilation_cache_dir:
    storage.watch_compile_cache(jax.config.jax_compilation_cache_dir)  # a full disk there: one sentence
  return jax.config.jax_compilation_cache_dir


def _run(flags: Flags, recipe: Recipe, config: dict, mesh, main: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import torch_on_tpu as tot
  from torch_on_tpu import checkpoint, data, health, lora, plan
  from torch_on_tpu import remat as remat_lib
  from torch_on_tpu.trainer import default_split

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
    jm = _model(flags, recipe, mesh, abstract, config.get("microbatches"))
    return tot.make_train_step(
      jm,
      recipe.loss or _loss,
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
    remat=remat_lib.layer_policy(_remat(flags), scanned=flags.scan), device_bytes=memory_bytes,
  )
  if main:
    print(memory, flush=True)
    print(_parameter_count(abstract_step), flush=True)
    if abstract_step.model.pipeline is not None:
      print(f"Pipeline {abstract_step.model.pipeline.schedule}", flush=True)
  spec = jax.ShapeDtypeStruct((flags.global_batch_size, flags.seqlen), jnp.int32)
  documents = ("positions", "segment_ids") if recipe.family == "titan" else ()  # what data.batches yields
  abstract_batch = {key: spec for key in ("input_ids", "labels", *documents)}
  family_model = abstract_step.model  # how this family's model is called (structure only, no arrays)
  def split(batch):
    inputs, labels = default_split(family_model, batch)
    return inputs, labels if recipe.labels is None else recipe.labels(batch)

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
  health.doing("building the model")
  step = make_step(abstract=False)
  source = data.source(flags.data, field=flags.data_field)
  tokenizer = data.build_tokenizer(flags.tokenizer, vocab_size=min(data.DEFAULT_VOCAB_SIZE, shape.vocab), corpus=source)
  data.check_model_fit(tokenizer.vocab_size, shape.vocab, flags.seqlen)
  tokenizer_dir = os.path.join(config["log_dir"], "tokenizer")
  if main:
    _keep_tokenizer(tokenizer, tokenizer_dir)
  titan = recipe.family == "titan"
  process_index, process_count = data.process_rows(mesh)  # pipeline stages read the same rows
  data_kwargs = dict(
    seqlen=flags.seqlen, global_batch_size=flags.global_batch_size, seed=flags.seed,
    with_positions=titan, with_segment_ids=titan, field=flags.data_field,
    process_index=process_index, process_count=process_count,
  )
  ckpt = checkpoint.Checkpointer(config["ckpt_dir"], save_every=flags.save_every, model=step.model)
  try:
    restored = _resume(ckpt, step, flags, config, main)
  except BaseException:
    ckpt.close()
    raise
  first_step = step.step_count
  if first_step >= flags.steps:  # a finished run relaunched with --sample: nothing to compile or train
    ckpt.close()
    summary = {"steps": first_step, "preempted": False, "records": []}
  else:
    summary = _train(step, flags, config, ckpt, restored, source, tokenizer, data_kwargs, split, abstract_batch, memory, mesh, main)
  summary.update(
    ckpt_dir=config["ckpt_dir"], log_dir=config["log_dir"], tokenizer_dir=tokenizer_dir, plan=memory, train_step=step,
    last_checkpoint=os.path.join(config["ckpt_dir"], str(summary["steps"])),
  )
  if flags.sample is not None:
    summary["sample"] = _sample(step, tokenizer, split, flags, recipe)  # every process runs the program
    if main:
      print(f"Sample: {flags.sample!r} → {summary['sample']!r}", flush=True)
  if main:
    print(where_things_are(summary, recipe), flush=True)
  return summary


def _train(step, flags: Flags, config: dict, ckpt, restored, source, tokenizer, data_kwargs, split, abstract_batch, memory, mesh, main) -> dict:
  """3. Compile ahead (the report comes before the first step), then the Trainer; its summary."""
  import torch_on_tpu as tot
  from torch_on_tpu import checkpoint, data, health

  try:
    evals = _eval_batches(flags, source, tokenizer, data_kwargs, main)
    train = data.batches(source, tokenizer, state=restored.data if restored else None, **data_kwargs)
  except BaseException:
    ckpt.close()
    raise
  to_global = lambda batch: data.to_global(batch, mesh)  # noqa: E731 (each process's rows → global arrays)
  report = None
  first_step = step.step_count
  try:
    health.doing("compiling the train step")
    report = step.compile(*split(abstract_batch))
    if main:
      print(f"Compiled step: {report}", flush=True)
    with checkpoint.PreemptionGuard() as guard:
      trainer = tot.Trainer(
        step,
        train,
        steps=flags.steps,
        log_dir=config["log_dir"],
        split_batch=split,
        to_global=to_global,
        eval_data=evals,
        eval_every=flags.eval_every if evals else 0,
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
  start_eval = [r["eval_loss"] for r in trainer.records if r["step"] == first_step and "eval_loss" in r]
  summary.update(
    start={"step": first_step, "eval_loss": start_eval[0] if start_eval else None},
    first_loss=losses[0] if losses else None, records=trainer.records, compile=report,
  )
  return summary


def _eval_batches(flags: Flags, source, tokenizer, data_kwargs: dict, main: bool) -> list | None:
  """The held-out batches every eval reads; None when --eval_every=0, or when the data is too
  small to hold any document out (then the run goes on without eval, and says so)."""
  from torch_on_tpu import data

  if not flags.eval_every:
    return None
  try:
    return data.eval_batches(source, tokenizer, num_batches=flags.eval_batches, **data_kwargs)
  except data.EmptySplit:
    if main:
      print(
        f"No eval: {source.name} is too small to hold out any document for eval (a small hashed share of "
        f"the documents is held out); training on all of it without eval (--eval_every=0 skips this look).",
        flush=True,
      )
    return None


def _parameter_count(step) -> str:
  """peft's line, for every run: what trains of what the model holds."""
  sizes = {name: math.prod(array.shape) for name, array in step.model.params.items()}
  trainable, total = sum(sizes[n] for n in step.trainable), sum(sizes.values())
  return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"


SAMPLE_TOKENS = 32  # what --sample adds to the prompt (fewer if --seqlen leaves less room)


def _sample(step, tokenizer, split: Callable, flags: Flags, recipe: Recipe) -> str:
  """A greedy completion of `--sample` from the step's current weights."""
  import jax.numpy as jnp
  import torch

  import torch_on_tpu as tot

  ids = tokenizer.encode_batch([flags.sample])[0][-(flags.seqlen // 2):] or [0]
  new = min(SAMPLE_TOKENS, flags.seqlen - len(ids))

  def inputs(tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    batch = {"input_ids": tokens, "labels": tokens, "positions": positions, "segment_ids": jnp.zeros_like(tokens)}
    return split(batch)[0]

  # HF models: generate's own call (input_ids), which can use the model's KV cache
  inputs_fn = None if recipe.family == "hf" else inputs
  out = tot.generate(step.model, torch.tensor([ids]), new, inputs_fn=inputs_fn)
  return tokenizer.decode(out[0, len(ids):].tolist())


def where_things_are(summary: dict, recipe: Recipe) -> str:
  """The end of a run: where its logs, last checkpoint and plot are, and how to export it."""
  lines = [
    f"Run directory: {summary['log_dir']} (metrics.jsonl, TensorBoard)",
    f"Last checkpoint: {summary['last_checkpoint']}",
  ]
  if summary.get("plot"):
    lines.append(f"Plot: {summary['plot']}")
  if recipe.convert_model:
    out = os.path.join(summary["log_dir"], "export")
    lines.append(
      f"Export for transformers: python tools/convert.py to_hf {summary['ckpt_dir']} {out} "
      f"{recipe.convert_model} --tokenizer={summary['tokenizer_dir']} --step={summary['steps']}"
    )
    if recipe.lora:
      lines.append("(LoRA: the adapters are merged into the base weights; --mode=adapter writes a peft adapter instead)")
  return "\n".join(lines)


def _keep_tokenizer(tokenizer, directory: str) -> None:
  """Saves the run's tokenizer into its run directory (a run is self-contained), whole or not at all."""
  from torch_on_tpu import storage

  tmp = f"{directory}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    with storage.writing("the run's tokenizer", directory, elsewhere="pass another --log_dir"):
      tokenizer.save_pretrained(tmp)
      shutil.rmtree(directory, ignore_errors=True)
      os.replace(tmp, directory)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


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


# ---- start-up checks: no model, no data read ---------------------------------------------

STARTUP_CHECKS: list[Callable] = []  # (flags, mesh | None) → None, raising TorchOnTpuError


def startup_check(fn: Callable) -> Callable:
  """Registers a check across flags, run at start-up by `check_flags`: `fn(flags, mesh)` is
  called once without devices (mesh None) and once with the run's mesh; it checks what it
  can and raises one sentence naming the flags."""
  STARTUP_CHECKS.append(fn)
  return fn


def check_flags(flags: Flags, mesh=None, *, read_files: bool = True) -> None:
  """Every flag's own values (its `flag(choices=, minimum=, check=)`), then the checks across
  flags (`STARTUP_CHECKS`); with `mesh`, the checks that need the devices. Runs before the
  model is built, so a mistyped or impossible flag stops the run within seconds of start.
  `read_files=False` skips the `check=`s, which look at files (a command for another machine)."""
  from torch_on_tpu.errors import TorchOnTpuError

  if mesh is None:
    for field in dataclasses.fields(flags):
      _check_value(field, flags, TorchOnTpuError, read_files)
  for check in STARTUP_CHECKS:
    check(flags, mesh)


def _check_value(field, flags: Flags, error, read_files: bool) -> None:
  meta, name, value = field.metadata, field.name, getattr(flags, field.name)
  choices = meta.get("choices")
  choices = choices() if callable(choices) else choices
  if choices and value is not None and value not in choices:  # None: an optional flag left off
    by_case = {str(c).lower(): str(c) for c in choices}
    near = difflib.get_close_matches(str(value).lower(), list(by_case), n=1)
    fix = f"did you mean --{name}={by_case[near[0]]}?" if near else "pick one of those."
    raise error(f"--{name}={value!r} is not one of {', '.join(map(str, choices))}; {fix}")
  minimum = meta.get("minimum")
  if minimum is not None and value is not None and value < minimum:
    raise error(f"--{name}={value} is below its minimum of {minimum}; give {minimum} or more.")
  if read_files and meta.get("check") is not None:
    try:
      meta["check"](value, flags)
    except error as e:
      raise error(f"--{name}: {e}") from None


def flag_spelling(flags_cls) -> dict[str, str]:
  """call argument → the flag that sets it, for `errors.spoken_as_flags`: every flag sets the
  call argument of its own name, and the one its `flag(argument=)` names."""
  spelling = {}
  for field in dataclasses.fields(flags_cls):
    spelling[field.name] = field.name
    if field.metadata.get("argument"):
      spelling[field.metadata["argument"]] = field.name
  return spelling


@startup_check
def _resume_step_needs_resume(flags: Flags, mesh) -> None:
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.resume_step is not None and not flags.resume:
    raise TorchOnTpuError("--resume_step needs --resume=True; drop one of the two.")


@startup_check
def _experts_over_one_axis(flags: Flags, mesh) -> None:
  """The presets shard experts over ep or over tp, never both."""
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.ep > 1 and flags.tp > 1:
    raise TorchOnTpuError(f"--ep={flags.ep} with --tp={flags.tp}: the presets shard experts over ep or tp, not both; drop one.")


@startup_check
def _batch_splits(flags: Flags, mesh) -> None:
  """The global batch splits into --grad_accum microbatches, and over the data devices."""
  from torch_on_tpu import mesh as mesh_lib
  from torch_on_tpu.errors import TorchOnTpuError

  batch = flags.global_batch_size
  if mesh is None:
    if batch % flags.grad_accum:
      raise TorchOnTpuError(
        f"--global_batch_size={batch} does not divide into --grad_accum={flags.grad_accum} "
        f"microbatches; make the batch a multiple of {flags.grad_accum}."
      )
    return
  axes = mesh_lib.data_axes(mesh)
  ways = mesh_lib.batch_ways(mesh, axes)
  if batch % ways:
    over = " × ".join(f"{a}={mesh.shape[a]}" for a in axes)
    raise TorchOnTpuError(
      f"--global_batch_size={batch} does not split over the {ways} data devices ({over}); "
      f"use a multiple of {ways}, e.g. --global_batch_size={ways * -(-batch // ways)}."
    )


@startup_check
def _pipeline_splits(flags: Flags, mesh) -> None:
  """--microbatches and --virtual_stages come with --pp; the microbatches divide one pass's rows."""
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.pp == 1 and (flags.microbatches is not None or flags.virtual_stages != 1):
    raise TorchOnTpuError("--microbatches and --virtual_stages set up pipeline stages; give --pp=N (N > 1) too, or drop them.")
  if flags.pp > 1 and flags.cp > 1:
    raise TorchOnTpuError(
      f"--pp={flags.pp} and --cp={flags.cp} do not compose yet (a stage's attention would need the cp ring inside "
      f"the pipeline's loop); use --cp=1 with those devices on --fsdp, or --pp=1."
    )
  rows = flags.global_batch_size // flags.grad_accum
  if flags.microbatches is not None and rows % flags.microbatches:
    raise TorchOnTpuError(
      f"--microbatches={flags.microbatches} does not divide the {rows} rows of one pipeline pass "
      f"(--global_batch_size / --grad_accum); use a divisor of {rows}."
    )


@startup_check
def _sequence_splits(flags: Flags, mesh) -> None:
  """The sequence cuts into 2·cp equal chunks (context parallelism's causal balance)."""
  from torch_on_tpu.errors import TorchOnTpuError

  if mesh is None and flags.seqlen % (2 * flags.cp):
    raise TorchOnTpuError(
      f"--seqlen={flags.seqlen} does not split into 2*cp={2 * flags.cp} equal chunks (causal load balance); "
      f"make --seqlen a multiple of {2 * flags.cp} or pick another --cp."
    )


def mesh_axes(flags: Flags) -> dict:
  """The recipe's mesh: pp outermost (stages across slices), fsdp, then cp, tp, and ep
  innermost; pp, cp and ep only when asked for (a run without them keeps its mesh)."""
  pp = {"pp": flags.pp} if flags.pp > 1 else {}
  cp = {"cp": flags.cp} if flags.cp > 1 else {}
  ep = {"ep": flags.ep} if flags.ep > 1 else {}
  return {**pp, "fsdp": flags.fsdp, **cp, "tp": flags.tp, **ep}


def float8_converted(target, flags: Flags):
  """`target` (a torchtitan model config or a built model) with `--float8` applied; as is without it."""
  if flags.float8 is None:
    return target
  from torch_on_tpu import float8

  return float8.convert(target, flags.float8, skip=tuple(n for n in flags.float8_skip.split(",") if n))


def _remat(flags: Flags) -> str | None:
  """--remat as ShardedModule takes it: None lets the layer stack pick (`remat.layer_policy`)."""
  return None if flags.remat == "auto" else flags.remat


def _model(flags: Flags, recipe: Recipe, mesh, abstract: bool, microbatches: int | None = None):
  """The ShardedModule: the recipe's model (with imported weights, with LoRA adapters)."""
  import torch_on_tpu as tot
  from torch_on_tpu import checkpoint, lora

  sharding = "fsdp_tp" if flags.tp > 1 else "ep" if flags.ep > 1 else "fsdp"
  attention = None if flags.attention == "none" else flags.attention
  layers = dict(scan=flags.scan, unroll=flags.unroll, remat=_remat(flags))
  if flags.pp > 1:
    layers.update(microbatches=microbatches, virtual_stages=flags.virtual_stages)
  common = dict(mesh=mesh, sharding=sharding, seed=flags.seed, attention=attention)
  if not recipe.lora:
    jm = tot.ShardedModule(recipe.build(), abstract=abstract, **common, **layers)
    if recipe.weights and not abstract:
      checkpoint.import_safetensors(jm, recipe.weights)
    return jm
  base = tot.ShardedModule(recipe.build(), abstract=abstract, **common)
  if recipe.weights and not abstract:
    checkpoint.import_safetensors(base, recipe.weights)
  return lora.wrap(base, recipe.build(), seed=flags.seed, **recipe.lora, **layers)


def _loss(outputs, labels):
  import torch

  logits = outputs.logits if hasattr(outputs, "logits") else outputs
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _profile_steps(spec) -> tuple[int, int] | None:
  """`--profile`: 'FIRST,LAST', or one step N (traces N to N+2)."""
  if spec is None:
    return None
  steps = [int(x) for x in (spec if isinstance(spec, (tuple, list)) else str(spec).split(","))]
  if len(steps) not in (1, 2):
    raise ValueError(spec)
  return (steps[0], steps[0] + 2) if len(steps) == 1 else (steps[0], steps[1])


def _run_error_message(error, memory, report, config: dict) -> str | None:
  """One sentence for a storage fault that reached the recipe untranslated (the writers
  the run knows name their own path) or a device out-of-memory; None for anything else.
  A full disk is RESOURCE_EXHAUSTED too, so the errno is asked first."""
  from torch_on_tpu import storage
  from torch_on_tpu.errors import TorchOnTpuError, first_line

  if isinstance(error, TorchOnTpuError):
    return None  # already one sentence
  if storage.error_code(error) is not None:
    filename = getattr(error, "filename", None)
    if filename:
      return storage.storage_error(error, "a file of the run", Path(filename))
    return (
      f"Could not write a file of the run ({first_line(error)}; the log directory {config['log_dir']} has "
      f"{storage.free_space(config['log_dir'])}, the checkpoint directory {config['ckpt_dir']} has "
      f"{storage.free_space(config['ckpt_dir'])}); {storage.kept()}; free space there."
    )
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
