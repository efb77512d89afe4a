"""The flags every recipe takes, each with its default, its `--help` text, the values it accepts and
the library argument it sets (`flag`), and the start-up checks that run on them before any model:
each flag's own values, then the checks across flags (`@startup_check`), once without devices and
once with the run's mesh. From here a flag goes to `recipe.run`, where it acts."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable

DTYPES = ("float32", "bfloat16", "bfloat16-all")
# Flags that change what the saved state is (its layout, dtypes, model): a resume must keep them.
STATE_FLAGS = ("model", "model_impl", "config", "dtype", "adam_states", "lora_rank", "lora_targets", "mtp_layers")
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


def _remat_policy(name, flags) -> None:
  """--remat is auto, a policy's name, or a policy naming what each layer keeps (`remat.Named`)."""
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.lowering import remat as remat_lib

  if name != "auto" and name not in remat_lib.NAMES and ":" not in name:
    raise TorchOnTpuError(
      f"{name!r} is not one of auto, {', '.join(remat_lib.NAMES)}, nor what each layer keeps by module name "
      f"(save:<globs> and/or offload:<globs> joined by '+', e.g. offload:input,attention.wo); pick one of those."
    )
  if name != "auto":
    remat_lib.check(name)


def _lr_decays() -> tuple[str, ...]:
  from torch_on_tpu.training.lr_schedule import DECAYS

  return DECAYS


def _float8_recipes() -> tuple[str, ...]:
  from torch_on_tpu.lowering.float8 import RECIPES

  return RECIPES


def _existing_data(spec, flags) -> None:
  """--data names files that exist (listed; of JSONL or Parquet the first record is read, for --data_field;
  chat data must name some)."""
  if flags.data_format == "chat":
    from torch_on_tpu.io.data import chat

    chat.conversations(spec, field=flags.data_field)
  elif spec is not None:
    from torch_on_tpu.io.data import sources

    sources.source(spec, field=flags.data_field or "text")


def existing_path(path, flags) -> None:
  from torch_on_tpu.errors import TorchOnTpuError

  if path is not None and not os.path.exists(path):
    raise TorchOnTpuError(f"{path!r} does not exist; pass an existing file or directory.")


GROUP_SETTINGS = ("pattern", "lr", "beta1", "beta2", "eps", "weight_decay")


def _param_groups(spec, flags) -> None:
  """--param_groups is a JSON list of groups, each a regex and some of AdamW's settings."""
  import json
  import re

  from torch_on_tpu.errors import TorchOnTpuError

  if spec is None:
    return
  try:
    groups = json.loads(spec)
    for group in groups:
      re.compile(group["pattern"])
  except (ValueError, TypeError, KeyError, re.error) as e:
    raise TorchOnTpuError(f"{spec!r} is not a JSON list of groups each with a regex \"pattern\" ({type(e).__name__}: {e}).") from None
  odd = sorted({k for group in groups for k in group} - set(GROUP_SETTINGS))
  if odd:
    raise TorchOnTpuError(f"a group sets {odd[0]!r}, which is none of {', '.join(GROUP_SETTINGS)}; drop it.")


FRESH_PARTS = ("optimizer", "data", "step")


def _fresh_parts(spec, flags) -> None:
  from torch_on_tpu.errors import TorchOnTpuError

  odd = [p for p in spec.split(",") if p and p not in FRESH_PARTS]
  if odd:
    raise TorchOnTpuError(f"{odd[0]!r} is not a part of the saved state; name some of {', '.join(FRESH_PARTS)}, comma-separated.")


def _target_name(name, flags) -> None:
  """--target names a TPU slice libtpu's compile-only client knows."""
  if name is not None:
    from torch_on_tpu.parallel import targets

    targets.parse(name)


def _profile_format(spec, flags) -> None:
  from torch_on_tpu.errors import TorchOnTpuError

  try:
    profile_steps(spec)
  except ValueError:
    raise TorchOnTpuError(f"{spec!r} is not FIRST,LAST (or FIRST,LAST,EVERY) step numbers; write e.g. --profile=10,12.") from None


@dataclasses.dataclass
class Flags:
  """Flags both recipes take (the recipes add their model flags)."""

  seqlen: int = flag(128, "tokens per sequence", minimum=1)
  global_batch_size: int = flag(8, "sequences per optimizer step, over all devices", minimum=1)
  steps: int = flag(100, "optimizer steps to train to (0: save the initial weights as checkpoint step 0 and train nothing, torchtitan's seed checkpoint)", minimum=0)
  lr: float = flag(3e-3, "peak learning rate (AdamW)")
  warmup_steps: int = flag(10, "linear warmup steps (update k takes lr·(k+1)/warmup_steps)", minimum=0)
  lr_decay: str = flag("cosine", "the decay to lr·--min_lr_factor after the peak: cosine, linear or sqrt (torchtitan's decay_type)", choices=_lr_decays)
  decay_ratio: float | None = flag(None, "the share of --steps the decay takes, at the end; the lr holds its peak from warmup until then (default: it decays from the end of warmup)", minimum=0)
  min_lr_factor: float = flag(0.1, "the decay's floor, as a fraction of --lr", minimum=0)
  beta1: float = flag(0.9, "AdamW's β1", minimum=0)
  beta2: float = flag(0.95, "AdamW's β2", minimum=0)
  eps: float = flag(1e-8, "AdamW's ε", minimum=0)
  weight_decay: float = flag(0.1, "AdamW weight decay", minimum=0)
  param_groups: str | None = flag(None, "AdamW settings by parameter name (torchtitan's optimizer.param_groups): a JSON list of {\"pattern\": a regex, and any of lr, beta1, beta2, eps, weight_decay}; a parameter takes the first group whose pattern its name matches (re.search), the others --lr etc.; every group's lr follows the one schedule (default: one group)", check=_param_groups)
  clip_norm: float = flag(1.0, "gradient clipping by global norm (0: off)", minimum=0)
  max_skips: int = flag(5, "skip a step whose loss or gradient is NaN/Inf (state kept); stop after this many in a row (0: stop at the first)", minimum=0)
  fsdp: int = flag(-1, "data-parallel devices sharding the parameters (-1: all that --tp, --cp and --pp leave; --ep borrows from them)", minimum=-1)
  tp: int = flag(1, "devices on the tensor-parallel mesh axis", minimum=1)
  pp: int = flag(1, "pipeline stages: devices on the pp mesh axis (the outermost), which splits the scanned layers into stages", minimum=1)
  microbatches: int | None = flag(None, "pipeline microbatches per pass (default with --pp: the largest divisor of the batch per pass up to 4·pp)", minimum=1)
  virtual_stages: int = flag(1, "pipeline: blocks of layers per stage, visited round-robin (circular schedule; the bubble shrinks by this factor)", minimum=1)
  cp: int = flag(1, "devices on the context-parallel mesh axis: each sequence split into cp pieces (long context; params shard over fsdp and cp)", minimum=1)
  ep: int = flag(1, "expert parallelism, as torchtitan's expert_parallel_degree: MoE experts split this many ways over devices borrowed from fsdp x cp x tp (a multiple of cp x tp), each token's rows sent to its experts' devices", minimum=1)
  scan: bool | None = flag(None, "run the layer stack as one lax.scan (compile time flat in depth); default: a scan, except on GPU, where the layer loop is faster (default_scan)")
  unroll: int = flag(1, "layers per scan iteration", minimum=1)
  remat: str = flag("auto", "per-layer remat: auto (the least recomputation the memory plan says fits, printed after the plan: the stack's default (scanned: dots_and_attention; loop: none), then dots_with_no_batch_dims_saveable, full, offload_inputs; with --target and --dry_run the TPU compiler has the last word), none, full, dots_saveable, dots_with_no_batch_dims_saveable, dots_and_attention, offload_dots, offload_inputs (full, the layer inputs in host memory), or what each layer keeps by module name: save:<globs> and/or offload:<globs> joined by + (e.g. offload:input,attention.wo; `input` and `attention` name the layer's input and the attention kernel's outputs)", check=_remat_policy)
  fuse_head: bool = flag(False, "the loss reads the output head's input and weight chunk by chunk: no [tokens, vocab] logits or their gradient are kept, for one more pass of the head's matmul in the backward (Llama 3 1B on v5p-8 at 8192 tokens a chip: 6.3 → 3.5 GiB of temporaries, +5% FLOPs)")
  collective_matmul: bool = flag(False, "on TPU, let the compiler run sharded matmuls as collective matmuls (windowed einsums passing blocks round the ring) instead of whole all-gathers and reduce-scatters; off, FSDP moves its ideal bytes (torch_on_tpu.runtime.xla_flags.COLLECTIVE_MATMUL)")
  attention: str = flag("auto", "attention kernel: auto (splash on TPU, cuDNN on GPU, blocked XLA on CPU), xla, splash, cudnn, none (torchax's own SDPA lowering)", choices=ATTENTION)
  dtype: str = flag("float32", "float32; bfloat16 (bf16 compute, fp32 master weights and Adam); bfloat16-all", choices=DTYPES)
  adam_states: str | None = flag(None, "the dtype AdamW's moments are stored in: float32, or bfloat16 (torchtitan's optimizer.implementation=fused_opt_states_bf16): half the optimizer state's memory; either way computed in fp32 from the stored values and rounded to nearest on store, as torch's fused AdamW does on fp32 weights with bf16 states (default: the weights' dtype; fp32 weights: optax's AdamW as is)", choices=("float32", "bfloat16"))
  float8: str | None = flag(None, "float8 matmuls (torchao's Float8Linear, torchtitan's filter): rowwise, tensorwise or rowwise_with_gw_hp; weights and checkpoints stay in --dtype (default: off)", choices=_float8_recipes)
  float8_skip: str = flag("lm_head", "with --float8: comma-separated names of linears kept in high precision (linears with a dim not a multiple of 16 always are)")
  grad_accum: int = flag(1, "microbatches per step (activations shrink by this factor)", minimum=1)
  data: str | None = flag(None, "text/JSONL/Parquet files, a glob, a directory or a datasets dir (default: built-in corpus)", check=_existing_data)
  data_field: str | None = flag(
    None, "the JSONL/JSON/Parquet/datasets field holding the text (default text); with --data_format=chat the conversation's: "
    "a list of {role, content} messages (default messages), or role:field pairs making one turn of columns "
    "(user:question,assistant:answer)", argument="field",
  )
  data_format: str = flag(
    "text", "text: documents packed into a continuous stream, every token trained; chat: conversations (JSON/JSONL/Parquet/"
    "datasets records) rendered with the tokenizer's chat template (else a plain <|role|> one), whole samples per row "
    "(longer ones dropped, said with the count), the loss the mean over the assistant answers' tokens of the global batch",
    choices=("text", "chat"),
  )
  weights: str | None = flag(None, "pretrained weights to start from: safetensors (a file or directory) under the model's own state_dict names, an HF checkpoint directory of the architecture (torchtitan models read it through their family's state_dict_adapter), a torch.distributed.checkpoint step such as torchtitan's checkpoint/step-N, or a step of this recipe's own checkpoints such as runs/a/ckpt/4 (either's directory: its latest step) (default: the model's init)", check=existing_path)
  tokenizer: str | None = flag(None, "tokenizer.json or HF tokenizer dir (default: byte-level BPE trained on the data)", check=existing_path)
  ckpt_dir: str | None = flag(None, "checkpoint directory (default: runs/<run>/ckpt)")
  save_every: int = flag(50, "save a checkpoint every N steps (and at the end); 0: no checkpoint is saved or resumed (torchtitan's checkpoint.enable=False)", minimum=0)
  last_save: str = flag("full", "what the last step's checkpoint holds: full (the training state, to resume), model (the weights alone, in --last_save_dtype: torchtitan's last_save_model_only), hf (model, and the weights as an HF directory at <ckpt_dir>/step-N: torchtitan's last_save_in_hf)", choices=("full", "model", "hf"))
  last_save_dtype: str | None = flag(None, "with --last_save=model or hf: the weights' dtype there, float32, bfloat16 or float16 (torchtitan's export_dtype; default: as trained)", choices=("float32", "bfloat16", "float16"))
  keep_checkpoints: int = flag(3, "the newest checkpoints kept in --ckpt_dir, older ones deleted (0: keep all)", minimum=0)
  resume: bool = flag(True, "continue from the newest good checkpoint in --ckpt_dir; False: set its checkpoints aside as <step>.replaced (nothing deleted) and start afresh")
  resume_step: int | None = flag(None, "resume from this saved step instead of the newest (newer steps are set aside as <step>.superseded)", minimum=0)
  resume_fresh: str = flag("", "comma-separated parts of the saved state a resume starts afresh instead of restoring: optimizer (Adam's moments and the schedule's position), data (the data order from its start), step (the step count from 0); torchtitan's checkpoint.exclude_from_loading", check=_fresh_parts)
  eval_every: int = flag(25, "eval loss on held-out data every N steps (0: never)", minimum=0)
  eval_batches: int = flag(4, "held-out batches per eval", minimum=1)
  profile: str | None = flag(None, "steps to trace with jax.profiler, 'FIRST,LAST' (into --profile_dir), or 'FIRST,LAST,EVERY': those steps and the same ones every EVERY steps after, each into <profile_dir>/iteration_<LAST>", check=_profile_format)
  profile_dir: str | None = flag(None, "where --profile's traces go (default: <log_dir>/profile)")
  log_dir: str | None = flag(None, "metrics.jsonl, TensorBoard and training.png (default: runs/<run>)")
  wandb_project: str | None = flag(None, "also log every metric to this Weights & Biases project, the run's config beside them (default: off; WANDB_MODE=offline keeps it on disk under --log_dir for `wandb sync`)")
  wandb_run: str | None = flag(None, "the Weights & Biases run's name (default: the name of --log_dir)")
  cpu_devices: int | None = flag(None, "simulate N CPU devices (sets XLA_FLAGS before jax starts)", minimum=1)
  target: str | None = flag(None, "compile for this TPU slice without having it (v6e-8, v5p-1024, 2xv6e-256: torch_on_tpu.parallel.targets), with --dry_run: the TPU compiler's memory per chip against its HBM", check=_target_name)
  dry_run: bool = flag(False, "plan memory and compile on abstract params, print both, allocate nothing, exit")
  memory_gib: float | None = flag(None, "plan against this much memory per device (default: the device's own)", minimum=0)
  seed: int = flag(0, "init, data order and dropout seed")
  sample: str | None = flag(None, "after training, print a greedy completion of this prompt from the final weights")
  compile_cache: str | None = flag(None, "jax's persistent compilation cache, so a relaunch skips the compile (default: $XDG_CACHE_HOME/torch_on_tpu/jax; off or none: no cache)")


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
  from torch_on_tpu import errors

  with errors.spoken_as_flags({**flag_spelling(type(flags)), **errors.spoken()}):  # flags are named as the command line wrote them
    if mesh is None:
      for field in dataclasses.fields(flags):
        _check_value(field, flags, errors.TorchOnTpuError, read_files)
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
def _target_only_compiles(flags: Flags, mesh) -> None:
  """A compile-only target runs nothing: it comes with --dry_run, and chooses the devices itself."""
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.target is not None and not flags.dry_run:
    raise TorchOnTpuError(
      f"--target={flags.target} compiles for a TPU slice this machine does not have and runs nothing; add --dry_run, "
      f"or drop --target on that slice itself."
    )
  if flags.target is not None and flags.cpu_devices is not None:
    raise TorchOnTpuError(f"--target={flags.target} and --cpu_devices={flags.cpu_devices} both choose the devices; drop --cpu_devices.")


@startup_check
def _experts_split(flags: Flags, mesh) -> None:
  """--ep borrows whole cp x tp groups from the fsdp devices, as torchtitan's expert_parallel_degree does."""
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.ep == 1:
    return
  group = flags.cp * flags.tp
  if flags.ep % group:
    raise TorchOnTpuError(
      f"--ep={flags.ep} with --cp={flags.cp} --tp={flags.tp}: the experts split over devices borrowed from fsdp x cp x tp, "
      f"whole cp x tp groups of {group}; use a multiple of {group}."
    )
  if flags.fsdp != -1 and flags.fsdp % (flags.ep // group):
    raise TorchOnTpuError(
      f"--ep={flags.ep} borrows {flags.ep // group} of the --fsdp={flags.fsdp} data-parallel devices (with cp x tp = {group}), "
      f"which does not divide them; use an --ep that does, or --fsdp=-1."
    )


@startup_check
def _batch_splits(flags: Flags, mesh) -> None:
  """The global batch splits into --grad_accum microbatches, and over the data devices."""
  from torch_on_tpu.errors import TorchOnTpuError, arg
  from torch_on_tpu.parallel import mesh as mesh_lib

  batch = flags.global_batch_size
  if mesh is None:
    if batch % flags.grad_accum:
      raise TorchOnTpuError(
        f"{arg('global_batch_size', batch)} does not divide into {arg('grad_accum', flags.grad_accum)} "
        f"microbatches; make the batch a multiple of {flags.grad_accum}."
      )
    return
  axes = mesh_lib.data_axes(mesh)
  ways = mesh_lib.batch_ways(mesh, axes)
  if batch % ways:
    over = " × ".join(f"{a}={mesh.shape[a]}" for a in axes)
    raise TorchOnTpuError(
      f"{arg('global_batch_size', batch)} does not split over the {ways} data devices ({over}); "
      f"use a multiple of {ways}, e.g. {arg('global_batch_size', ways * -(-batch // ways))}."
    )


@startup_check
def _pipeline_splits(flags: Flags, mesh) -> None:
  """--microbatches and --virtual_stages come with --pp; the microbatches divide one pass's rows."""
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.pp == 1 and (flags.microbatches is not None or flags.virtual_stages != 1):
    raise TorchOnTpuError("--microbatches and --virtual_stages set up pipeline stages; give --pp=N (N > 1) too, or drop them.")
  rows = flags.global_batch_size // flags.grad_accum
  if flags.microbatches is not None and rows % flags.microbatches:
    raise TorchOnTpuError(
      f"--microbatches={flags.microbatches} does not divide the {rows} rows of one pipeline pass "
      f"(--global_batch_size / --grad_accum); use a divisor of {rows}."
    )


@startup_check
def _sequence_splits(flags: Flags, mesh) -> None:
  """The sequence cuts into 2·cp equal chunks (context parallelism's causal balance)."""
  from torch_on_tpu.errors import TorchOnTpuError, arg, named

  if mesh is None and flags.seqlen % (2 * flags.cp):
    raise TorchOnTpuError(
      f"{arg('seqlen', flags.seqlen)} does not split into 2*cp={2 * flags.cp} equal chunks (causal load balance); "
      f"make {named('seqlen')} a multiple of {2 * flags.cp} or pick another {named('cp')}."
    )


def mesh_axes(flags: Flags) -> dict:
  """The recipe's mesh: pp outermost (stages across slices), fsdp, then ep, cp and tp innermost;
  pp, ep and cp only when asked for (a run without them keeps its mesh). --ep takes its devices
  from fsdp x cp x tp as torchtitan does: the mesh's `ep` axis is ep / (cp x tp) of the fsdp
  devices, and the experts split over ep x cp x tp (`mesh.expert_axes`)."""
  pp = {"pp": flags.pp} if flags.pp > 1 else {}
  cp = {"cp": flags.cp} if flags.cp > 1 else {}
  borrowed = flags.ep // (flags.cp * flags.tp) if flags.ep > 1 else None
  ep = {"ep": borrowed} if borrowed else {}
  fsdp = flags.fsdp if flags.fsdp == -1 or not borrowed else flags.fsdp // borrowed
  return {**pp, "fsdp": fsdp, **ep, **cp, "tp": flags.tp}


def float8_converted(target, flags: Flags):
  """`target` (a torchtitan model config or a built model) with `--float8` applied; as is without it."""
  if flags.float8 is None:
    return target
  from torch_on_tpu.lowering import float8

  return float8.convert(target, flags.float8, skip=tuple(n for n in flags.float8_skip.split(",") if n))


@dataclasses.dataclass
class LoraFlags(Flags):
  """The LoRA flags, for the recipes that fine-tune with peft's adapters (recipes.hf, recipes.torchtitan)."""

  lora_rank: int = flag(0, "LoRA rank (0: train every parameter)", minimum=0)
  lora_alpha: float | None = flag(None, "LoRA alpha: the adapters' output is scaled by alpha / rank (default: 2 x rank)")
  lora_targets: str = flag(
    "all-linear", "modules that get adapters: peft's 'all-linear' (every linear but the output head) or comma-separated "
    "module names (the last part of a name, e.g. wq,wo)", argument="targets",
  )


def lora_settings(flags: Flags) -> dict | None:
  """`--lora_*` as `Recipe.lora` (lora.wrap's keyword arguments); None without --lora_rank."""
  if not getattr(flags, "lora_rank", 0):
    return None
  from torch_on_tpu.training.lora import parse_targets

  return dict(rank=flags.lora_rank, alpha=flags.lora_alpha, targets=parse_targets(flags.lora_targets))


def default_scan(platform: str, *, pipeline: bool = False) -> bool:
  """--scan's default on `platform` (a jax device's): the layer loop on GPU, a scan elsewhere and
  wherever the stack is split into pipeline stages (which need the scan).

  On a GPU the scan copies each layer's weights out of the stacked arrays and its saved
  activations into them (XLA runs these as memcpy: 10 ms of a 173 ms step), which the loop does
  not: Llama 3 1B at 8192 × 1 on an H200, 0.173 s/step scanned, 0.163 s as a loop, torch.compile
  0.163 s (`tools/bench_gpu.py`, README). On TPU and CPU the scan keeps compile time flat in depth
  and its memory is what MaxText's recipes are measured with."""
  return pipeline or platform != "gpu"


def layer_remat(flags: Flags) -> str | None:
  """--remat as ShardedModule takes it: None lets the layer stack pick (`remat.layer_policy`); the
  runner replaces auto by the policy the plan picks (`plan.auto_remat`) before the model is built."""
  return None if flags.remat == "auto" else flags.remat


def profile_steps(spec) -> tuple[int, int, int | None] | None:
  """`--profile`: 'FIRST,LAST' or 'FIRST,LAST,EVERY', or one step N (traces N to N+2) → (first, last, every or None)."""
  if spec is None:
    return None
  steps = [int(x) for x in (spec if isinstance(spec, (tuple, list)) else str(spec).split(","))]
  if len(steps) not in (1, 2, 3) or (len(steps) == 3 and steps[2] < steps[1] - steps[0] + 1):
    raise ValueError(spec)
  first, last = (steps[0], steps[0] + 2) if len(steps) == 1 else steps[:2]
  return first, last, steps[2] if len(steps) == 3 else None
