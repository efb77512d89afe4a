"""`python -m recipes.torchtitan --module llama3 --config llama3_8b --training.steps=3`: a torchtitan
user's own command. torchtitan's `ConfigManager` parses it (its `config_registry` function, then its
dotted overrides, with tyro: no parser of ours), and the `Trainer.Config` it returns becomes this
recipe's flags (`to_flags`), so both ways of asking resolve to the one printed run config.

Every field is accounted for. A field we honour becomes a flag. A field that changes nothing
computed here (logging cadence, profiler, torch.compile, NCCL timeouts, data-loader workers, how
FSDP or the pipeline schedule its work: the gradients are the same) is read past; `SAME_MATH` lists
them. Any other field set to something other than its default is refused by name in one sentence,
as is a model that differs from its registry flavor (the bridge trains the registry's models as they
are; `--float8` for float8). This recipe's own flags may follow and win (`--cpu_devices=8`, `--dry_run`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import shlex
import sys

from torch_on_tpu.errors import TorchOnTpuError

# Fields read past: what they set changes how torchtitan's PyTorch runs, not what is computed.
SAME_MATH = (
  "profiler.", "metrics.log_freq", "metrics.enable_tensorboard", "metrics.disable_color_printing", "metrics.save_tb_folder",
  "metrics.save_for_all_ranks", "compile.", "comm.", "training.gc_freq", "training.gc_debug", "training.disable_cuda_graphs",
  "dataloader.num_workers", "dataloader.persistent_workers", "dataloader.pin_memory", "dataloader.prefetch_factor",
  "dataloader.infinite", "parallelism.fsdp_reshard_after_forward", "parallelism.enable_fsdp_symm_mem",
  "parallelism.enable_sequence_parallel", "parallelism.spmd_backend", "parallelism.pipeline_parallel_schedule",
  "parallelism.pipeline_parallel_schedule_csv", "parallelism.module_fqns_per_model_part",
  "parallelism.pipeline_parallel_first_stage_less_layers", "parallelism.pipeline_parallel_last_stage_less_layers",
  "parallelism.pipeline_parallel_layers_per_stage", "parallelism.context_parallel_load_balancer",
  "checkpoint.async_mode", "checkpoint.last_save_model_only", "checkpoint.last_save_in_hf", "checkpoint.export_dtype",
  "checkpoint.enable_first_step_checkpoint", "activation_checkpoint", "validator.dataloader.", "debug.deterministic",
  "debug.deterministic_warn_only", "debug.detect_anomaly", "debug.spmd_typechecking", "debug.print_config",
  "debug.save_config_file", "debug.enable_structured_logging", "optimizer.implementation",
)
_REMAT = {"FullAC": "full", "SelectiveAC": "auto", "MemoryBudgetAC": "auto"}  # torchtitan's AC → --remat (else none)
# Model parts whose variants compute the same thing and differ in how they communicate (DeepEP's
# dispatch, async-TP's all-gather fused into the QKV GEMM): the bridge shards by its own maps anyway.
_SAME_MATH_PARTS = ("TokenDispatcher", "FusedQKVLinear")
_ADAMW_KWARGS = {"lr", "betas", "eps", "weight_decay", "fused", "foreach", "capturable", "differentiable", "maximize", "amsgrad"}


def wanted(argv: list[str]) -> bool:
  """The command names a torchtitan config (`--module`, `--config`: neither is a flag of this recipe)."""
  return any(a in ("--module", "--config") or a.startswith(("--module=", "--config=")) for a in argv)


def split_argv(argv: list[str], flags_cls) -> tuple[list[str], list[str]]:
  """(torchtitan's arguments, this recipe's flags): an argument whose name is one of `flags_cls`'s
  fields (or its `--no` form) is ours, with the values after it; the rest is torchtitan's."""
  ours_names = {f.name for f in dataclasses.fields(flags_cls)}
  titan, ours, target = [], [], None
  for arg in argv:
    if arg.startswith("--"):
      name = arg[2:].partition("=")[0].replace("-", "_")
      target = ours if name in ours_names or (name.startswith("no") and name[2:] in ours_names) else titan
    (target if target is not None else titan).append(arg)
  return titan, ours


def parse(args: list[str]):
  """torchtitan's `Trainer.Config` for `--module/--config` and its overrides, by its own ConfigManager;
  a config torchtitan cannot build on this machine is one sentence."""
  from torch_on_tpu.core import extras
  from torch_on_tpu.errors import first_line

  extras.require("torchtitan", "torchtitan's configs")
  from torchtitan.config.manager import ConfigManager

  names = " ".join(a for a in args if not a.startswith("--") or a.startswith(("--module", "--config")))
  module = next((a.split("=", 1)[1] if "=" in a else b for a, b in zip(args, [*args[1:], ""]) if a.split("=")[0] == "--module"), "")
  try:  # torchtitan's ConfigManager says only "Cannot import"; the missing package is the sentence
    importlib.import_module(f"torchtitan.models.{module}.config_registry")
  except ModuleNotFoundError as e:
    if not e.name.startswith("torchtitan"):
      raise _not_installed(e, f"{module} configs") from None
  titan_log = logging.getLogger()  # torchtitan's logger is the root one
  level = titan_log.level
  titan_log.setLevel(logging.ERROR)  # its warnings on what it finds missing: said in our own lines
  program = sys.argv[0]
  sys.argv[0] = f"python -m recipes.torchtitan {names}"  # what tyro's help and errors tell one to run
  try:
    return ConfigManager().parse_args(list(args))
  except ModuleNotFoundError as e:
    raise _not_installed(e, f"config ({names})") from None
  except (ValueError, TypeError, ImportError, AttributeError) as e:
    gpu_only = "only supported on" in str(e) and re.search(r"float8|MXFP8|NVFP4", str(e))  # torchao's check for a GPU
    hint = "; float8 here is --float8=rowwise on its base config" if gpu_only else ""
    raise TorchOnTpuError(f"torchtitan could not build its config ({names}) here: {first_line(e)}{hint}.") from None
  finally:
    titan_log.setLevel(level)
    sys.argv[0] = program


def _not_installed(error: ModuleNotFoundError, what: str) -> TorchOnTpuError:
  return TorchOnTpuError(
    f"torchtitan's {what} imports {error.name!r} (its multimodal data loaders), which torch_on_tpu does not install; "
    f"install the build for this torch, e.g. pip install {error.name} --index-url https://download.pytorch.org/whl/cpu."
  )


def leaves(config, prefix: str = ""):
  """(dotted path, value, default) of every field under `config`, model_spec and loss aside."""
  for field in dataclasses.fields(config):
    path, value = f"{prefix}{field.name}", getattr(config, field.name)
    if path in ("model_spec", "loss"):
      continue
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      yield from leaves(value, path + ".")
      continue
    if field.default is not dataclasses.MISSING:
      default = field.default
    elif field.default_factory is not dataclasses.MISSING:
      default = field.default_factory()
    else:
      default = dataclasses.MISSING
    yield path, value, default


def to_flags(config, devices: int) -> tuple[dict, list[str]]:
  """This recipe's flags for torchtitan's `config` on `devices` devices, and the lines to say
  (a test asset absent here, a field read differently); a field we do not honour is refused."""
  values = dict((path, value) for path, value, _ in leaves(config))
  used: set[str] = set()

  def take(path):
    used.add(path)
    return values[path]

  flags, notes = {}, []
  family, flavor, mtp, float8 = _model(config)
  flags.update(model=f"{family}:{flavor}", mtp_layers=mtp, **float8)
  flags.update(_loss(config, mtp))
  flags.update(_parallelism(take, devices, notes))
  flags.update(seqlen=take("training.seq_len"), steps=take("training.steps"), clip_norm=take("training.max_norm"))
  param, everything = take("training.mixed_precision_param"), take("training.dtype")
  flags["dtype"] = "bfloat16-all" if everything == "bfloat16" else "bfloat16" if param == "bfloat16" else "float32"
  flags.update(_optimizer(take))
  flags.update(
    warmup_steps=take("lr_scheduler.warmup_steps"), decay_ratio=take("lr_scheduler.decay_ratio"),
    lr_decay=take("lr_scheduler.decay_type"), min_lr_factor=take("lr_scheduler.min_lr_factor"),
  )
  flags.update(_files(config, take, notes))
  flags["remat"] = _REMAT.get(type(config.activation_checkpoint).__qualname__.split(".")[0], "none")
  every, enabled, batches = take("validator.freq"), take("validator.enable"), take("validator.steps")
  flags["eval_every"] = every if enabled else 0
  if enabled and batches > 0:
    flags["eval_batches"] = batches
  seed = take("debug.seed")
  if seed is not None:
    flags["seed"] = seed
  if take("metrics.enable_wandb"):
    flags["wandb_project"] = os.environ.get("WANDB_PROJECT", "torchtitan")  # torchtitan's own choice
  for path, value, default in leaves(config):
    if path in used or path.startswith(SAME_MATH) or default is dataclasses.MISSING or _same(value, default):
      continue
    raise TorchOnTpuError(
      f"torchtitan's {path}={value!r} has no counterpart in torch_on_tpu's recipe; drop it (its default is {default!r})."
    )
  return flags, notes


def _same(a, b) -> bool:
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001 (arrays and the like: compared by their text)
    return repr(a) == repr(b)


def _model(config) -> tuple[str, str, int, dict]:
  """(family, flavor, MTP layers, float8 flags) of the config's model spec, which must be the registry's
  flavor as is, or with float8 linears that `--float8` and `--float8_skip` make as torchtitan's converter did."""
  from torch_on_tpu.models.torchtitan import LANGUAGE_FAMILIES

  spec = config.model_spec
  if spec is None or spec.name not in LANGUAGE_FAMILIES:
    raise TorchOnTpuError(
      f"torchtitan's model {getattr(spec, 'name', None)!r} is not one of the language-model families the recipe trains "
      f"({', '.join(LANGUAGE_FAMILIES)})."
    )
  mtp = len(getattr(spec.model, "mtp_layers", None) or ())
  registry = importlib.import_module(f"torchtitan.models.{spec.name}")
  reference = registry.model_registry(spec.flavor, **({"num_mtp_layers": mtp} if mtp else {})).model
  differences = list(_differences(spec.model, reference, "model_spec.model"))
  float8 = _float8_flags(spec.model, reference, differences) if differences else {}
  for path, ours, theirs in differences if not float8 else ():
    raise TorchOnTpuError(
      f"torchtitan's config changes {spec.name}:{spec.flavor}'s model at {path} ({_short(ours)} instead of "
      f"{_short(theirs)}); the recipe trains the registry's flavors as they are (float8: --float8=rowwise)."
    )
  return spec.name, spec.flavor, mtp, float8


def _float8_flags(model, reference, differences) -> dict:
  """--float8/--float8_skip when every difference is a linear torchtitan's float8 converter made, and
  the same flags convert the registry's model to exactly this one; {} otherwise."""
  from torch_on_tpu.lowering import float8

  made = [(path, ours) for path, ours, theirs in differences
          if type(ours).__qualname__ == "Float8Linear.Config" and type(theirs).__qualname__ == "Linear.Config"]
  if len(made) != len(differences):
    return {}
  torchao = made[0][1]._torchao_config
  emulate = getattr(torchao, "emulate", False)
  recipe = next((r for r in float8.RECIPES if float8.torchao_config(r, emulate=emulate) == torchao), None)
  converted = {path.removeprefix("model_spec.model.") for path, _ in made}
  linears = [(fqn, c) for fqn, c in _linears(reference) if float8.converts(fqn, c.in_features, c.out_features, skip=())]
  flags = {"float8": recipe, "float8_skip": ",".join(_module_path(fqn) for fqn, _ in linears if fqn not in converted)}
  if recipe is None or any(torchao != m._torchao_config for _, m in made):
    return {}
  again = float8.convert(reference, recipe, skip=tuple(n for n in flags["float8_skip"].split(",") if n), emulate=emulate)
  return flags if not list(_differences(model, again, "")) else {}


def _linears(config, path: str = ""):
  """(dotted path, config) of every Linear.Config in a torchtitan model config."""
  if type(config).__qualname__ == "Linear.Config":
    yield path.removeprefix("."), config
  elif dataclasses.is_dataclass(config):
    for field in dataclasses.fields(config):
      yield from _linears(getattr(config, field.name), f"{path}.{field.name}")
  elif isinstance(config, (list, tuple)):
    for i, item in enumerate(config):
      yield from _linears(item, f"{path}[{i}]")


def _module_path(fqn: str) -> str:
  """A config path (`layers[0].attention.wo`) as the built module's name (`layers.0.attention.wo`)."""
  return re.sub(r"\[(\d+)\]", r".\1", fqn)


def _differences(a, b, path):
  """(path, a's, b's) where two model configs differ; functions compared by name and arguments."""
  if dataclasses.is_dataclass(a) and type(a) is type(b):
    for field in dataclasses.fields(a):
      yield from _differences(getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}")
  elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b)):
      yield from _differences(x, y, f"{path}[{i}]")
  elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
    for key in a:
      yield from _differences(a[key], b[key], f"{path}[{key!r}]")
  elif _same_math_part(a, b):
    common = {f.name for f in dataclasses.fields(a)} & {f.name for f in dataclasses.fields(b)}
    for name in sorted(common):
      yield from _differences(getattr(a, name), getattr(b, name), f"{path}.{name}")
  elif not _same(a, b) and _short(a, 10**6) != _short(b, 10**6):
    yield path, a, b


def _same_math_part(a, b) -> bool:
  names = type(a).__qualname__.split(".")[0], type(b).__qualname__.split(".")[0]
  return dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and any(all(n.endswith(s) for n in names) for s in _SAME_MATH_PARTS)


def _short(value, limit: int = 60) -> str:
  """`repr` without memory addresses (fresh closures of the same function compare by this)."""
  text = re.sub(r" at 0x[0-9a-f]+", "", repr(value))
  return text if len(text) <= limit else text[: limit - 1] + "…"


def _loss(config, mtp: int) -> dict:
  loss = config.loss
  kind = type(loss).__qualname__.split(".")[0]
  inner = type(getattr(loss, "loss_fn", None)).__qualname__.split(".")[0]
  if kind == "MTPLoss" and mtp:
    return {"mtp_scale": loss.mtp_scale}
  if kind == "CrossEntropyLoss" or (kind == "ChunkedLossWrapper" and inner == "CrossEntropyLoss"):
    return {}
  raise TorchOnTpuError(
    f"torchtitan's loss {kind}{f'({inner})' if kind == 'ChunkedLossWrapper' else ''} has no counterpart in the recipe, "
    f"which trains with cross-entropy (and MTPLoss with multi-token prediction)."
  )


def _parallelism(take, devices: int, notes: list[str]) -> dict:
  """torchtitan's degrees as the recipe's mesh axes, and its batch: local_batch_size per data-parallel
  rank, accumulated up to global_batch_size. torchtitan's ep borrows from its data-parallel ranks;
  here ep is its own axis, which also splits the batch, so fsdp is what remains of them."""
  replicate, shard = take("parallelism.data_parallel_replicate_degree"), take("parallelism.data_parallel_shard_degree")
  tp, cp, pp = take("parallelism.tensor_parallel_degree"), take("parallelism.context_parallel_degree"), take("parallelism.pipeline_parallel_degree")
  ep = take("parallelism.expert_parallel_degree")
  others = tp * cp * pp * replicate
  if shard == -1:
    shard = devices // others if devices % others == 0 else 0
  dp = replicate * shard
  if dp * tp * cp * pp != devices:
    cpu = " (on CPU, --cpu_devices=N simulates N devices)" if _on_cpu() else ""
    raise TorchOnTpuError(
      f"torchtitan's parallelism degrees (data_parallel_replicate {replicate} × data_parallel_shard "
      f"{take('parallelism.data_parallel_shard_degree')} × context {cp} × tensor {tp} × pipeline {pp}) do not "
      f"multiply to the {devices} devices here; set --parallelism.* to fit{cpu}."
    )
  if dp % ep:
    raise TorchOnTpuError(
      f"torchtitan's expert_parallel_degree={ep} does not divide its {dp} data-parallel ranks, which the recipe's "
      f"ep axis is taken from; pick a divisor of {dp}."
    )
  if replicate > 1:
    notes.append(
      f"torchtitan's data_parallel_replicate_degree={replicate}: its replicas are folded into fsdp here "
      f"(the same gradients; the parameters shard over all {dp} data-parallel devices)."
    )
  local, batch = take("training.local_batch_size"), take("training.global_batch_size")
  per_pass = local * dp
  batch = per_pass if batch < 0 else batch
  if batch % per_pass:
    raise TorchOnTpuError(
      f"torchtitan's training.global_batch_size={batch} is not a multiple of local_batch_size {local} × {dp} "
      f"data-parallel ranks; set it to a multiple of {per_pass}."
    )
  flags = dict(fsdp=dp // ep, tp=tp, cp=cp, pp=pp, ep=ep, global_batch_size=batch, grad_accum=batch // per_pass)
  microbatch = take("parallelism.pipeline_parallel_microbatch_size")
  if pp > 1 and local % microbatch == 0:
    flags["microbatches"] = local // microbatch
  return flags


def _on_cpu() -> bool:
  import jax

  return jax.devices()[0].platform == "cpu"


def _optimizer(take) -> dict:
  """AdamW (or Adam without weight decay, the same update) for every parameter, as the recipe trains."""
  groups = take("optimizer.param_groups")
  kinds = {(g.optimizer_name, repr(sorted(g.optimizer_kwargs.items()))) for g in groups}
  if len(kinds) != 1:
    raise TorchOnTpuError(
      f"torchtitan's optimizer.param_groups give {len(kinds)} different optimizers or settings "
      f"({', '.join(g.pattern for g in groups)}); the recipe trains every parameter with one AdamW."
    )
  group = groups[0]
  kwargs = dict(group.optimizer_kwargs)
  decay = kwargs.get("weight_decay", 0.01 if group.optimizer_name == "AdamW" else 0.0)
  if group.optimizer_name not in ("AdamW", "Adam") or (group.optimizer_name == "Adam" and decay):
    raise TorchOnTpuError(
      f"torchtitan's optimizer {group.optimizer_name}{' with weight_decay' if group.optimizer_name == 'Adam' else ''} "
      f"has no counterpart in the recipe, which trains with AdamW; use AdamW."
    )
  odd = sorted(set(kwargs) - _ADAMW_KWARGS) + [k for k in ("maximize", "amsgrad") if kwargs.get(k)]
  if odd:
    raise TorchOnTpuError(f"torchtitan's optimizer argument {odd[0]}={kwargs[odd[0]]!r} has no counterpart in the recipe's AdamW; drop it.")
  if take("optimizer.implementation") == "fused_opt_states_bf16":
    raise TorchOnTpuError(
      "torchtitan's optimizer.implementation=fused_opt_states_bf16 keeps Adam's moments in bf16, which the recipe does "
      "only with all state in bf16 (--dtype=bfloat16-all); drop it."
    )
  beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
  return dict(lr=kwargs["lr"], beta1=beta1, beta2=beta2, eps=kwargs.get("eps", 1e-8), weight_decay=decay)


def _files(config, take, notes: list[str]) -> dict:
  """Where the run reads and writes: torchtitan's dump folder, checkpoint folder and cadence,
  initial weights, tokenizer and data; its repository's test assets, absent here, said in a line."""
  dump = take("dump_folder")
  flags = {"log_dir": dump}
  enabled, interval = take("checkpoint.enable"), take("checkpoint.interval")
  flags["ckpt_dir"] = os.path.join(dump, take("checkpoint.folder"))
  flags["save_every"] = interval if enabled else take("training.steps")
  if not enabled:
    notes.append(f"torchtitan's checkpoint.enable=False: the recipe still saves the last step (into {flags['ckpt_dir']}), for its export.")
  flags["keep_checkpoints"] = max(take("checkpoint.keep_latest_k"), 0)
  if take("checkpoint.load_step") >= 0:
    flags["resume_step"] = take("checkpoint.load_step")
  assets = take("hf_assets_path")
  weights, in_hf, model_only = take("checkpoint.initial_load_path"), take("checkpoint.initial_load_in_hf"), take("checkpoint.initial_load_model_only")
  if weights is None and in_hf:
    weights = assets  # torchtitan reads HF weights from its assets folder then
  if weights is not None:
    if not model_only:
      raise TorchOnTpuError(
        "torchtitan's checkpoint.initial_load_model_only=False: the recipe starts from a checkpoint's model weights "
        "only; resume a run of its own by its --ckpt_dir instead."
      )
    flags["weights"] = weights
  used_assets = os.path.isfile(os.path.join(assets, "tokenizer.json"))
  if used_assets:
    flags["tokenizer"] = assets
  else:
    notes.append(
      f"torchtitan's hf_assets_path {assets!r} holds no tokenizer.json here (torchtitan's repository test assets are not "
      f"in its package): the tokenizer is the recipe's own, trained on the data."
    )
  loader = type(config.dataloader).__qualname__.split(".")[0]
  if loader != "HuggingFaceTextDataLoader":
    raise TorchOnTpuError(f"torchtitan's dataloader {loader} has no counterpart in the recipe, which trains on packed text; use a text dataset.")
  path, name = take("dataloader.dataset_path"), take("dataloader.dataset")
  if path is not None:
    flags["data"] = path
  else:
    notes.append(
      f"torchtitan's dataset {name!r} is a download by name (or its repository's test data): the recipe trains on its "
      f"built-in corpus; --dataloader.dataset_path (or --data) names files to train on."
    )
  return flags


def command_line(flags: dict, module: str = "recipes.torchtitan") -> str:
  """The same run as this recipe's flags, to paste."""
  parts = [f"--{name}={shlex.quote(str(value))}" for name, value in flags.items() if value is not None]
  return f"python -m {module} " + " ".join(parts)


def devices_for(ours: dict) -> int:
  """The devices the run will have: a compile-only --target's, or the platform's (started here,
  after --cpu_devices is set, as the recipe starts it)."""
  from recipes.startup import initialize_distributed, setup_platform

  if ours.get("target"):
    from torch_on_tpu.parallel import targets

    target = targets.parse(ours["target"])
    return target.chips * target.generation.devices_per_chip
  setup_platform(ours.get("cpu_devices"))
  initialize_distributed()
  import jax

  return jax.device_count()


def main(argv: list[str], recipe_main) -> None:
  """Runs `recipe_main` (a `cli.cli` function) on torchtitan's config in `argv` and this recipe's flags
  after it; says the lines of `to_flags` and the same run as flags first. A mistake: one sentence, status 2."""
  import ast

  from recipes import cli
  from recipes.flags import check_flags

  titan, ours_argv = split_argv(argv, recipe_main.flags_cls)
  try:
    ours = dict(arg[2:].split("=", 1) for arg in cli.parse_argv(ours_argv, recipe_main.flags_cls))
    ours = {name: ast.literal_eval(text) for name, text in ours.items()}
    config = parse(titan)
    flags, notes = to_flags(config, devices_for(ours))
    flags.update(ours)
    check_flags(recipe_main.flags_cls(**flags), read_files=False)  # the command printed below must be one that runs
  except (cli.FlagError, TorchOnTpuError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None
  for line in notes:
    print(line, flush=True)
  print(f"The same run in this recipe's flags: {command_line(flags)}", flush=True)
  recipe_main(**flags)
