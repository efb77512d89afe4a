"""`python -m recipes.torchtitan --module llama3 --config llama3_8b --training.steps=3`: a torchtitan
user's own command. torchtitan's `ConfigManager` parses it (its `config_registry` function, then its
dotted overrides, with tyro: no parser of ours), and the `Trainer.Config` it returns becomes this
recipe's flags (`to_flags`), so both ways of asking resolve to the one printed run config.

Every field is accounted for. A field we honour becomes a flag. A field that changes nothing
computed here (logging cadence, torch.compile, NCCL timeouts, data-loader workers, how FSDP or the
pipeline schedule its work: the gradients are the same) is read past and said in a line
(`READ_PAST`). Any other field set to something other than its default is refused by name in one
sentence, as is a model that differs from its registry flavor (the bridge trains the registry's
models as they are; `--float8` for float8). `--override.imports` run as torchtitan's trainer runs
them. An older torchtitan's spelling, a config the registry lacks, and a refusal about a setting
the user wrote as a torchtitan field are each said in torchtitan 0.3.0's terms. This recipe's own
flags may follow and win (`--cpu_devices=8`, `--dry_run`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import io
import json
import logging
import os
import re
import shlex
import sys

from recipes.cli import python_command
from torch_on_tpu.errors import TorchOnTpuError

# Fields read past, each with why: what they set changes how torchtitan's PyTorch runs, not what is
# computed here. Every one a config sets is said in a line (`_read_past`), none silently; a field
# that tunes a parallelism (or the validator) is said only when the run has it (`_RELEVANT`).
READ_PAST = {
  "the step is always one compiled XLA program here (torch.compile's settings do not apply)": ("compile.",),
  "every step is logged, by process 0, into metrics.jsonl and TensorBoard under the dump folder": (
    "metrics.log_freq", "metrics.disable_color_printing", "metrics.save_for_all_ranks", "metrics.save_tb_folder",
  ),
  "the collectives are XLA's (NCCL's timeouts, traces and backends do not apply)": ("comm.",),
  "CUDA-side settings with no counterpart on XLA (garbage-collector cadence, CUDA graphs)": (
    "training.gc_freq", "training.gc_debug", "training.disable_cuda_graphs",
  ),
  "the recipe's loader packs and prefetches in a thread of its own": (
    "dataloader.num_workers", "dataloader.persistent_workers", "dataloader.pin_memory", "dataloader.prefetch_factor", "dataloader.infinite",
  ),
  "XLA's partitioner places the FSDP and tensor-parallel collectives (the same gradients)": (
    "parallelism.fsdp_reshard_after_forward", "parallelism.enable_fsdp_symm_mem", "parallelism.enable_sequence_parallel",
    "parallelism.spmd_backend",
  ),
  "the recipe splits the layers into equal blocks over the pipeline stages (any rest runs after them) and runs its own schedule (the same gradients)": (
    "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_schedule_csv", "parallelism.module_fqns_per_model_part",
    "parallelism.pipeline_parallel_first_stage_less_layers", "parallelism.pipeline_parallel_last_stage_less_layers",
    "parallelism.pipeline_parallel_layers_per_stage",
  ),
  "context parallelism balances causal attention by its own zig-zag split": (
    "parallelism.context_parallel_load_balancer", "parallelism.context_parallel_ptrr_mask_key",
  ),
  "checkpoints are saved asynchronously, every --save_every steps and at the last": ("checkpoint.async_mode", "checkpoint.enable_first_step_checkpoint"),
  "torch's activation-checkpointing details: the recipe's --remat chooses what each layer keeps": ("activation_checkpoint.",),
  "the held-out batches come from the training data (--data)": ("validator.dataloader.",),
  "torch's debugging aids: XLA's programs are deterministic, and the run config is printed and saved with every checkpoint": (
    "debug.deterministic", "debug.deterministic_warn_only", "debug.detect_anomaly", "debug.spmd_typechecking", "debug.print_config",
    "debug.save_config_file", "debug.enable_structured_logging",
  ),
  "torch's optimizer kernels (for-loop, foreach, fused) compute the same AdamW update": ("optimizer.implementation",),
  "torch.profiler's schedule: jax.profiler traces the active steps of each cycle, without warmup": (
    "profiler.profiler_warmup", "profiler.profiler_repeat", "profiler.profiler_skip_first", "profiler.profiler_skip_first_wait",
    "profiler.trace_post_processor",
  ),
  "CUDA's memory snapshots: the memory plan and the compiled step's report give the memory here": (
    "profiler.enable_memory_snapshot", "profiler.memory_snapshot_freq", "profiler.save_memory_snapshot_folder",
    "profiler.memory_snapshot_max_entries",
  ),
}
SAME_MATH = tuple(prefix for prefixes in READ_PAST.values() for prefix in prefixes)
# The degree (or switch) a tuning field matters with: said only when it is above 1 (or on).
_RELEVANT = {
  "parallelism.pipeline_parallel_": "parallelism.pipeline_parallel_degree", "parallelism.module_fqns_per_model_part": "parallelism.pipeline_parallel_degree",
  "parallelism.context_parallel_": "parallelism.context_parallel_degree", "parallelism.enable_sequence_parallel": "parallelism.tensor_parallel_degree",
  "validator.dataloader.": "validator.enable",
}
_REMAT = {"FullAC": "full", "SelectiveAC": "auto", "MemoryBudgetAC": "auto"}  # torchtitan's AC → --remat (else none)
# Model parts whose variants compute the same thing and differ in how they communicate (DeepEP's
# dispatch, async-TP's all-gather fused into the QKV GEMM): the bridge shards by its own maps anyway.
_SAME_MATH_PARTS = ("TokenDispatcher", "FusedQKVLinear")
# Module configs the same computation as the registry's other one: async-TP's row-parallel output
# projection (`tp_gemm_backend="dist_gemm"`) is a stock rowwise linear whose TP reduce-scatter torch
# fuses into its GEMM; the bridge's tp is XLA's collectives either way.
_SAME_MATH_PAIRS = {("RowParallelLinear", "Linear"), ("AllGatherFusedFeedForward", "FeedForward")}
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
  """torchtitan's `Trainer.Config` for `--module/--config` and its overrides, by its own ConfigManager,
  with the `--override.imports` it names applied as torchtitan's trainer applies them; a config
  torchtitan cannot build on this machine, an older torchtitan's spelling or a config name not in
  the registry is one sentence."""
  from torch_on_tpu.core import extras
  from torch_on_tpu.errors import first_line

  extras.require("torchtitan", "torchtitan's configs")
  from torchtitan.config.manager import ConfigManager

  module, name = _chosen(args, "--module"), _chosen(args, "--config")
  names = f"--module {module} --config {name}"
  _check_spellings(args)
  registry = _registry(module) if module else None
  if registry is not None and name and not callable(getattr(registry, name, None)):
    raise _no_such_config(module, name, registry)
  titan_log = logging.getLogger()  # torchtitan's logger is the root one
  level = titan_log.level
  titan_log.setLevel(logging.ERROR)  # its warnings on what it finds missing: said in our own lines
  program = sys.argv[0]
  sys.argv[0] = f"{python_command()} -m recipes.torchtitan {names}"  # what tyro's help and errors tell one to run
  said = io.StringIO()
  args, symm_mem = _symm_mem_switch(args)
  try:
    with contextlib.redirect_stderr(said):
      try:
        config = ConfigManager().parse_args(list(args))
      except ValueError as e:
        if _FLOAT8_GPU_CHECK not in str(e):
          raise
        with _float8_runs_here():  # built as on a GPU with float8 matmuls; `_model` maps it or refuses it
          config = ConfigManager().parse_args(list(args))
  except SystemExit:
    refused = _value_error(said.getvalue())
    if refused is None:  # tyro's own answer (an unknown option and the nearest ones, --help): as it printed it
      sys.stderr.write(said.getvalue())
      raise
    raise TorchOnTpuError(f"torchtitan refuses this config ({names}): {refused}") from None
  except ModuleNotFoundError as e:
    raise _not_installed(e, f"config ({names})", module or "<family>") from None
  except (ValueError, TypeError, ImportError, AttributeError) as e:
    gpu_only = "only supported on" in str(e) and re.search(r"MXFP8|NVFP4", str(e))  # torchao's check for a GPU
    hint = "; the bridge's float8 is torchao's rowwise or tensorwise recipe (--float8)" if gpu_only else ""
    raise TorchOnTpuError(f"torchtitan could not build its config ({names}) here: {first_line(e)}{hint}.") from None
  finally:
    titan_log.setLevel(level)
    sys.argv[0] = program
  if symm_mem:
    config.parallelism.enable_fsdp_symm_mem = True  # as asked; read past below (READ_PAST: the same gradients)
  _apply_overrides(config)
  return config


def _registry(module: str):
  """The module torchtitan's ConfigManager takes `module`'s configs from (a shorthand's
  `config_registry`, else `<module>.config_registry` or `<module>` itself); one sentence when there
  is none here, or when it needs a package not installed (torchtitan's own says only "Cannot import")."""
  from torchtitan.experiments import _supported_experiments
  from torchtitan.models import _supported_models

  if module in _supported_models | _supported_experiments:
    places = [f"{prefix}.{module}.config_registry" for prefix in ("torchtitan.models", "torchtitan.experiments", "torchtitan.experiments.rl.examples")]
  else:
    places = [f"{module}.config_registry", module]
  for place in places:
    try:
      return importlib.import_module(place)
    except ModuleNotFoundError as e:
      if e.name is None or not (place == e.name or place.startswith(e.name + ".")):  # a package it imports is missing
        raise _not_installed(e, f"{module} configs", module) from None
  raise TorchOnTpuError(
    f"--module {module} is neither one of torchtitan's models ({', '.join(sorted(_supported_models))}) nor a module "
    f"importable here; name one of those, or put its folder on PYTHONPATH."
  )


def _value_error(said: str) -> str | None:
  """The message of the "Value error" panel tyro draws for a check torchtitan's config makes as it
  is built (`--training.disable_cuda_graphs` with pipeline stages, a GPU an option needs), on one line."""
  lines = [line.strip("│╭╮╰╯ ") for line in said.splitlines()]
  if not any(line.startswith("─ Value error") for line in lines):
    return None
  start = next(i for i, line in enumerate(lines) if line.startswith("─ Value error")) + 1
  end = next((i for i in range(start, len(lines)) if set(lines[i]) <= {"─"}), len(lines))
  return " ".join(line for line in lines[start:end] if line)


def _chosen(args: list[str], option: str) -> str:
  """The value of the last `--module` (or `--config`) in `args`: the one torchtitan's ConfigManager takes."""
  value = ""
  for i, arg in enumerate(args):
    if arg == option and i + 1 < len(args):
      value = args[i + 1]
    elif arg.startswith(option + "="):
      value = arg.split("=", 1)[1]
  return value


# torchtitan 0.2's spellings (its JobConfig, which older docs and scripts use) → 0.3.0's, and this
# recipe's flag ({v}: the value given; None: no counterpart). A section's entry ends with a dot.
OLD_SPELLINGS = {
  "job.dump_folder": ("--dump_folder={v}", "--log_dir={v}"),
  "job.config_file": ("--module <family> --config <config_registry function>", "--model=<family>:<flavor>"),
  "job.print_config": ("--debug.print_config", None),
  "profiling.": ("--profiler.", "--profile=FIRST,LAST"),
  "model.name": ("--module {v}", "--model={v}:<flavor>"),
  "model.flavor": ("--config <its config_registry function>", "--model=<family>:{v}"),
  "model.hf_assets_path": ("--hf_assets_path={v}", "--tokenizer={v}"),
  "model.tokenizer_path": ("--hf_assets_path=<its folder>", "--tokenizer={v}"),
  "model.converters": ("a config whose model converts (--config llama3_debugmodel_float8)", "--float8=rowwise"),
  "optimizer.name": ("--optimizer.param-groups.0.optimizer-name={v}", None),
  "optimizer.lr": ("--optimizer.param-groups.0.optimizer-kwargs.lr={v}", "--lr={v}"),
  "optimizer.eps": ("--optimizer.param-groups.0.optimizer-kwargs.eps={v}", "--eps={v}"),
  "optimizer.weight_decay": ("--optimizer.param-groups.0.optimizer-kwargs.weight-decay={v}", "--weight_decay={v}"),
  "optimizer.beta1": ("--optimizer.param-groups.0.optimizer-kwargs.betas <beta1> <beta2>", "--beta1={v}"),
  "optimizer.beta2": ("--optimizer.param-groups.0.optimizer-kwargs.betas <beta1> <beta2>", "--beta2={v}"),
  "training.dataset": ("--dataloader.dataset={v}", "--data=<files>"),
  "training.dataset_path": ("--dataloader.dataset_path={v}", "--data={v}"),
  "training.seed": ("--debug.seed={v}", "--seed={v}"),
  "training.deterministic": ("--debug.deterministic", None),
  "training.batch_size": ("--training.local_batch_size={v}", "--global_batch_size"),
  "activation_checkpoint.mode": ("the subcommand activation-checkpoint:{v}, written last", "--remat (full; auto for selective; none)"),
  "activation_checkpoint.selective_ac_option": ("the subcommand activation-checkpoint:selective, written last", "--remat=auto"),
  "parallelism.disable_loss_parallel": (None, None),
  "parallelism.enable_async_tensor_parallel": ("--compile.enable_async_tensor_parallel", None),
  "experimental.custom_import": ("--override.imports <module>.<function>", None),
  "validation.": ("--validator.", "--eval_every"),
  "float8.": ("a config whose model converts (--config llama3_debugmodel_float8)", "--float8=rowwise"),
  "quantize.": ("a config whose model converts (--config llama3_debugmodel_float8)", "--float8=rowwise"),
}


def _check_spellings(args: list[str]) -> None:
  """An option spelled as torchtitan 0.2 spelled it: one sentence naming 0.3.0's spelling and this recipe's flag."""
  for i, arg in enumerate(args):
    if not arg.startswith("--"):
      continue
    written, eq, value = arg[2:].partition("=")
    name = written.replace("-", "_")
    old = next((o for o in OLD_SPELLINGS if name == o or (o.endswith(".") and name.startswith(o))), None)
    if old is None:
      continue
    if not eq:
      value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
    new, ours = (
      (text.replace("{v}", value) if value is not None else text.replace("={v}", "").replace("{v}", "<value>")) if text else text
      for text in OLD_SPELLINGS[old]
    )
    if new is not None and new.endswith("."):
      new += written.removeprefix(old.rstrip(".")).lstrip(".") + (f"={value}" if value is not None else "")
    then = f"torchtitan 0.3.0 writes {new}" if new else "torchtitan 0.3.0 has no such option"
    recipe = f" (this recipe's flag: {ours})" if ours else ""
    raise TorchOnTpuError(f"--{written} is how torchtitan 0.2 spelled it; {then}{recipe}.")


def _no_such_config(module: str, name: str, registry) -> TorchOnTpuError:
  """A `--config` the registry lacks: its nearest configs and every config it has (not its helpers)."""
  configs = config_functions(registry)
  near = _nearest(name, configs)
  guess = f"did you mean {' or '.join(near)}? " if near else ""
  elsewhere = _submodules_with(registry, name)
  if elsewhere:
    guess = f"it is in --module {' and '.join(elsewhere)}; "
  held = f"its configs: {', '.join(configs)}" if configs else "it holds no config functions"
  return TorchOnTpuError(f"torchtitan's {module} registry has no config {name!r}; {guess}{held}.")


def _submodules_with(package, name: str) -> list[str]:
  """The modules of `package` (a package's registry) defining config `name`."""
  import pkgutil

  found = []
  for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
    try:
      module = importlib.import_module(f"{package.__name__}.{info.name}")
    except Exception:  # noqa: BLE001 (a module that does not import here holds nothing to suggest)
      continue
    if callable(getattr(module, name, None)):
      found.append(module.__name__)
  return found


def _nearest(name: str, configs: list[str]) -> list[str]:
  """The configs holding all of `name`'s words in any order (a word matches one it begins, or that
  begins it: `debug` and `debugmodel`), fewest other words first (`qwen3_debugmodel_moe` →
  qwen3_moe_debug); else the closest spellings (`llama3_debugmodle` → llama3_debugmodel)."""
  import difflib

  words = name.split("_")
  holding = [c for c in configs if all(any(w.startswith(o) or o.startswith(w) for o in c.split("_")) for w in words)]
  if holding:
    return sorted(holding, key=lambda c: (len(c.split("_")), c))[:3]
  return difflib.get_close_matches(name, configs, n=3, cutoff=0.8)


def config_functions(registry) -> list[str]:
  """The functions of a `config_registry` module that build a `Trainer.Config` (not its imported helpers)."""
  import inspect

  return sorted(
    name for name, fn in inspect.getmembers(registry, inspect.isfunction)
    if fn.__module__ == registry.__name__ and not name.startswith("_")
    and all(p.default is not p.empty for p in inspect.signature(fn).parameters.values())
  )


# torchtitan's own `--override.imports` that swap in CUDA kernels for the same computation: the
# bridge computes it with XLA, so they are said and not applied (what they replace, and how).
CUDA_KERNELS = {
  "torchtitan.overrides.fused_swiglu.fused_swiglu": "SwiGLU's gate and up projections as one weight, SiLU-and-mul in a Triton kernel",
  "torchtitan.overrides.fused_swiglu.fused_grouped_experts": "the routed experts' gate and up projections as one weight, SiLU-and-mul in a Triton kernel",
  "torchtitan.overrides.fused_mla.fused_mla": "MLA's q/kv RoPE assembly in Triton kernels",
  "torchtitan.overrides.helion_rope.helion_cos_sin_rope": "cos/sin RoPE in a Helion kernel",
  "torchtitan.overrides.helion_rope.helion_complex_rope": "complex RoPE in a Helion kernel",
  "torchtitan.overrides.moe_token_dispatcher.deepep_override": "DeepEP's CUDA-graph dispatch for inference",
  "torchtitan.overrides.moe_token_dispatcher.hybridep_override": "HybridEP's CUDA-graph dispatch for inference",
}


def _apply_overrides(config) -> None:
  """`--override.imports` as torchtitan's trainer applies them: each module imported (a user's own
  code hooks in so), each named `@override` applied to the config; torchtitan's own CUDA-kernel
  swaps (`CUDA_KERNELS`) are left out, said by `to_flags`. A module that does not import is one sentence."""
  from torchtitan.config.override import OverrideConfig, apply_overrides

  from torch_on_tpu.errors import first_line

  entries = [e for e in config.override.imports if (e if isinstance(e, str) else e[0]) not in CUDA_KERNELS]
  if not entries:
    return
  try:
    apply_overrides(OverrideConfig(imports=entries), config)
  except ImportError as e:
    cause = e.__cause__ if isinstance(e.__cause__, ModuleNotFoundError) else e
    missing = f" (it needs {cause.name}, not installed here: run where it is, or drop it)" if isinstance(cause, ModuleNotFoundError) else ""
    raise TorchOnTpuError(f"torchtitan's override.imports could not import its module{missing}: {first_line(e)}.") from None
  except Exception as e:  # noqa: BLE001 (an override's own code, whatever it raises: named in one sentence)
    raise TorchOnTpuError(f"torchtitan's override.imports could not be applied: {first_line(e)}.") from None


def _symm_mem_switch(args: list[str]) -> tuple[list[str], bool]:
  """torchtitan's `--parallelism.enable-fsdp-symm-mem` taken out of `args` where no CUDA GPU is (its
  config check refuses it there; FSDP's collectives over CUDA symmetric memory compute the same
  gradients as XLA's), and whether it was on."""
  import torch

  if torch.cuda.is_available():
    return list(args), False
  kept, on = [], False
  for word in args:
    key, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
    key = key.replace("-", "_")
    if key in ("parallelism.enable_fsdp_symm_mem", "parallelism.no_enable_fsdp_symm_mem"):
      on = key.startswith("parallelism.enable") and (not eq or value.lower() in ("true", "1"))
      continue
    kept.append(word)
  return kept, on


# torchtitan's float8 converter refuses to build without an NVIDIA GPU of SM89 or later (or an MI300).
_FLOAT8_GPU_CHECK = "Failed to swap to Float8Linear because float8 is only supported on NVIDIA SM89"


@contextlib.contextmanager
def _float8_runs_here():
  """While torchtitan builds a float8 config, its converter's check of the machine says yes: the
  bridge computes those float8 matmuls itself (XLA's float8 dots: on TPU, and on CPU for tests), so
  the float8 linears it makes are what `--float8` gives (`_float8_flags`: mapped only if the same)."""
  from torchtitan.components.quantization import float8 as titan_float8

  check = titan_float8.has_cuda_capability
  titan_float8.has_cuda_capability = lambda major, minor: True
  try:
    yield
  finally:
    titan_float8.has_cuda_capability = check


def _not_installed(error: ModuleNotFoundError, what: str, family: str = "<family>") -> TorchOnTpuError:
  if error.name == "torchvision":  # only torchtitan's multimodal data loader imports it
    return TorchOnTpuError(
      f"The multimodal data loader of torchtitan's {what} (images beside the text) imports torchvision, and the recipe "
      f"trains language models on text or chat data only; train the family's text model with --model={family}:<flavor>."
    )
  return TorchOnTpuError(
    f"Package {error.name!r}, which torchtitan's {what} import, is not installed here; install it for this torch "
    f"(pip install {error.name}) or choose a config that does not need it."
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


def to_flags(config, devices: int, used: set[str] | None = None) -> tuple[dict, list[str]]:
  """This recipe's flags for torchtitan's `config` on `devices` devices, and the lines to say
  (a test asset absent here, a field read differently); a field we do not honour is refused.
  `used` (a set) is filled with the fields that became flags."""
  values = dict((path, value) for path, value, _ in leaves(config))
  used = set() if used is None else used

  def take(path):
    used.add(path)
    return values[path]

  flags, notes = {}, []
  family, flavor, mtp, model_flags, variants = _model(config)
  flags.update(model=f"{family}:{flavor}", mtp_layers=mtp, **model_flags)
  if variants:
    notes.append(
      f"torchtitan's model builds {', '.join(variants)}: how torch's CUDA kernels communicate, the same computation "
      f"as {family}:{flavor}'s own modules, whose collectives XLA places here."
    )
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
  used.add("activation_checkpoint")
  every, enabled, batches = take("validator.freq"), take("validator.enable"), take("validator.steps")
  flags["eval_every"] = every if enabled else 0
  if enabled and batches > 0:
    flags["eval_batches"] = batches
  seed = take("debug.seed")
  if seed is not None:
    flags["seed"] = seed
  if take("metrics.enable_wandb"):
    flags["wandb_project"] = os.environ.get("WANDB_PROJECT", "torchtitan")  # torchtitan's own choice
  flags.update(_observability(take, flags["log_dir"], notes))
  take("override.imports")  # applied by `parse`; torchtitan's CUDA kernels said below
  notes.extend(_read_past(config, used))
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


def _model(config) -> tuple[str, str, int, dict, list[str]]:
  """(family, flavor, MTP layers, model flags, the same-math variants it holds) of the config's model spec, which must be the registry's
  flavor as is, or as the registry builds it with another attention backend (`--attn_backend`), or with
  float8 linears that `--float8` and `--float8_skip` make as torchtitan's converter did."""
  from torch_on_tpu.models.torchtitan import LANGUAGE_FAMILIES

  spec = config.model_spec
  if spec is None or spec.name not in LANGUAGE_FAMILIES:
    raise TorchOnTpuError(
      f"torchtitan's model {getattr(spec, 'name', None)!r} is not one of the language-model families the recipe trains "
      f"({', '.join(LANGUAGE_FAMILIES)})."
    )
  mtp = len(getattr(spec.model, "mtp_layers", None) or ())
  registry = importlib.import_module(f"torchtitan.models.{spec.name}")
  mtp_kwargs = {"num_mtp_layers": mtp} if mtp else {}
  reference = registry.model_registry(spec.flavor, **mtp_kwargs).model
  variants: list[str] = []
  differences = list(_differences(spec.model, reference, "model_spec.model", variants))
  backend = {}
  if differences and _attention_backend_differs(differences):
    for name in ATTENTION_BACKENDS:
      other = registry.model_registry(spec.flavor, attn_backend=name, **mtp_kwargs).model
      if not list(_differences(spec.model, other, "model_spec.model")):
        backend, reference, differences = {"attn_backend": name}, other, []
        break
  lora = _lora_flags(spec, reference) if differences else {}
  float8 = _float8_flags(spec.model, reference, differences) if differences and not lora else {}
  # The difference named: the first that no float8 linear explains (float8 experts, say), else the first.
  unexplained = [d for d in differences if type(d[1]).__qualname__ != "Float8Linear.Config"] or differences
  for path, ours, theirs in unexplained if not (float8 or lora) else ():
    raise TorchOnTpuError(
      f"torchtitan's config changes {spec.name}:{spec.flavor}'s model at {path} ({_short(ours)} instead of "
      f"{_short(theirs)}); the recipe trains the registry's flavors as they are (float8: --float8=rowwise)."
    )
  return spec.name, spec.flavor, mtp, {**backend, **float8, **lora}, sorted(set(variants))


# torchtitan's attention backends (`model_registry(..., attn_backend=)`), each run by the bridge's kernels.
ATTENTION_BACKENDS = ("flex", "varlen", "sdpa")


def _attention_backend_differs(differences) -> bool:
  """Whether every difference is an attention module of another kind (a config built with another `attn_backend`)."""
  return all(path.endswith("inner_attention") and type(ours) is not type(theirs) for path, ours, theirs in differences)


def _float8_flags(model, reference, differences) -> dict:
  """--float8/--float8_skip when every difference is a linear torchtitan's float8 converter made, and
  the same flags convert the registry's model to exactly this one; {} otherwise."""
  made = [(path, ours) for path, ours, theirs in differences
          if type(ours).__qualname__ == "Float8Linear.Config" and type(theirs).__qualname__ == "Linear.Config"]
  if len(made) != len(differences):
    return {}
  flags, again = _float8_again(made, reference)
  return flags if flags and not list(_differences(model, again, "")) else {}


def _float8_again(made, reference):
  """(--float8/--float8_skip, the registry's model converted with them) for the float8 linears `made`
  ((path, config) pairs); ({}, None) when no recipe of the bridge holds their torchao config."""
  from torch_on_tpu.lowering import float8

  torchao = made[0][1]._torchao_config
  emulate = getattr(torchao, "emulate", False)
  recipe = next((r for r in float8.RECIPES if float8.torchao_config(r, emulate=emulate) == torchao), None)
  converted = {path.removeprefix("model_spec.model.") for path, _ in made}
  linears = [(fqn, c) for fqn, c in _linears(reference) if float8.converts(fqn, c.in_features, c.out_features, skip=())]
  flags = {"float8": recipe, "float8_skip": ",".join(_module_path(fqn) for fqn, _ in linears if fqn not in converted)}
  if recipe is None or any(torchao != m._torchao_config for _, m in made):
    return {}, None
  return flags, float8.convert(copy.deepcopy(reference), recipe, skip=tuple(n for n in flags["float8_skip"].split(",") if n), emulate=emulate)


def _lora_flags(spec, reference) -> dict:
  """--lora_rank/--lora_alpha/--lora_targets (and --float8/--float8_skip) when the model is what torchtitan's
  LoRAConverter (after an optional float8 converter) makes of the registry's: the same converters with
  these settings give exactly this model, and peft's adapters on those module names go on the same
  linears; {} for a model with no LoRA linear; refused in one sentence for one these flags cannot make."""
  import torch
  from torchtitan.components.lora import LoRAConverter

  configs = list(_configs(spec.model, "model_spec.model"))
  adapted = [(path, c) for path, c in configs if type(c).__qualname__.endswith("LoRALinear.Config")]
  if not adapted:
    return {}
  where = f"torchtitan's config puts LoRA adapters on {spec.name}:{spec.flavor}'s model"
  settings = {(c.rank, c.alpha) for _, c in adapted}
  if len(settings) != 1:
    raise TorchOnTpuError(f"{where} with {len(settings)} different ranks or alphas; --lora_rank and --lora_alpha set one for every adapter, so give them one.")
  (rank, alpha), = settings
  targets = sorted({re.sub(r"\[\d+\]$", "", path).rsplit(".", 1)[-1] for path, _ in adapted})
  made = [(path, c) for path, c in configs if "Float8Linear.Config" in [k.__qualname__ for k in type(c).__mro__]]
  float8, base = _float8_again(made, reference) if made else ({}, copy.deepcopy(reference))
  again = LoRAConverter(LoRAConverter.Config(rank=rank, alpha=alpha, target_modules=targets)).convert(copy.deepcopy(base)) if base else None
  differs = next(iter(_differences(spec.model, again, "model_spec.model")), None) if again is not None else ("its float8 linears",)
  if differs:
    raise TorchOnTpuError(
      f"{where}, but converting the registry's model with LoRAConverter(rank={rank}, alpha={alpha}, target_modules={targets})"
      f"{' after float8' if made else ''} does not give it (at {differs[0]}); the recipe's --lora_rank, --lora_alpha and "
      f"--lora_targets make only that, so convert the registry's model with those converters alone."
    )
  with torch.device("meta"):
    ours, plain = spec.model.build(), base.build()
  lora_modules = {name for name, m in ours.named_modules() if type(m).__name__.startswith("LoRA")}
  names = sorted({name.rsplit(".", 1)[-1] for name in lora_modules})
  peft_picks = {name for name, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in names}
  if peft_picks != lora_modules:
    raise TorchOnTpuError(
      f"{where} on {len(lora_modules)} linears, and --lora_targets={','.join(names)} would put them on {len(peft_picks)} "
      f"({sorted(peft_picks ^ lora_modules)[0]} differs); the recipe names adapted modules by their last name only, so target modules whose names say which."
    )
  return {"lora_rank": rank, "lora_alpha": float(alpha), "lora_targets": ",".join(names), **float8}


def _configs(config, path: str):
  """(dotted path, config) of every config dataclass in a torchtitan model config, the root first."""
  if dataclasses.is_dataclass(config):
    yield path, config
    for field in dataclasses.fields(config):
      yield from _configs(getattr(config, field.name), f"{path}.{field.name}")
  elif isinstance(config, (list, tuple)):
    for i, item in enumerate(config):
      yield from _configs(item, f"{path}[{i}]")


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


def _differences(a, b, path, variants: list | None = None):
  """(path, a's, b's) where two model configs differ; functions compared by name and arguments. Parts
  of the same math in another class (`_same_math_part`) are compared by their fields, their class
  names added to `variants`."""
  if dataclasses.is_dataclass(a) and type(a) is type(b):
    for field in dataclasses.fields(a):
      yield from _differences(getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}", variants)
  elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b)):
      yield from _differences(x, y, f"{path}[{i}]", variants)
  elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
    for key in a:
      yield from _differences(a[key], b[key], f"{path}[{key!r}]", variants)
  elif _same_math_part(a, b):
    if variants is not None:
      variants.append(type(a).__qualname__.split(".")[0])
    common = {f.name for f in dataclasses.fields(a)} & {f.name for f in dataclasses.fields(b)}
    for name in sorted(common):
      yield from _differences(getattr(a, name), getattr(b, name), f"{path}.{name}", variants)
  elif not _same(a, b) and _short(a, 10**6) != _short(b, 10**6):
    yield path, a, b


def _same_math_part(a, b) -> bool:
  names = type(a).__qualname__.split(".")[0], type(b).__qualname__.split(".")[0]
  return dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and (
    any(all(n.endswith(s) for n in names) for s in _SAME_MATH_PARTS) or names in _SAME_MATH_PAIRS)


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
  rank, accumulated up to global_batch_size. ep borrows from dp_shard × cp × tp as torchtitan's does
  (the recipe's --ep means the same)."""
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
  if ep > 1 and (ep % (cp * tp) or shard * cp * tp % ep):
    raise TorchOnTpuError(
      f"torchtitan's expert_parallel_degree={ep} is not a multiple of context_parallel {cp} × tensor_parallel {tp} "
      f"dividing data_parallel_shard {shard} × {cp} × {tp}; the recipe's expert-parallel group borrows whole cp × tp "
      f"groups, so set --parallelism.expert_parallel_degree to such a multiple."
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
  flags = dict(fsdp=dp, tp=tp, cp=cp, pp=pp, ep=ep, global_batch_size=batch, grad_accum=batch // per_pass)
  microbatch = take("parallelism.pipeline_parallel_microbatch_size")
  if pp > 1 and local % microbatch == 0:
    flags["microbatches"] = local // microbatch
  return flags


def _on_cpu() -> bool:
  import jax

  return jax.devices()[0].platform == "cpu"


def _optimizer(take) -> dict:
  """AdamW (or Adam without weight decay, the same update); several param groups as --param_groups,
  each group's settings for the parameters its pattern matches first, the last group's as --lr etc."""
  groups = take("optimizer.param_groups")
  settings = [_adamw(group) for group in groups]
  flags = dict(settings[-1])
  if take("optimizer.implementation") == "fused_opt_states_bf16":  # its fused AdamW on bf16 moments (Adam/AdamW only, as _adamw's)
    flags["adam_states"] = "bfloat16"
  if len({repr(s) for s in settings}) > 1:
    flags["param_groups"] = json.dumps([{"pattern": g.pattern, **s} for g, s in zip(groups, settings)])
  return flags


def _adamw(group) -> dict:
  """One torchtitan param group's settings as the recipe's AdamW flags; another optimizer is one sentence."""
  kwargs = dict(group.optimizer_kwargs)
  decay = kwargs.get("weight_decay", 0.01 if group.optimizer_name == "AdamW" else 0.0)
  if group.optimizer_name not in ("AdamW", "Adam") or (group.optimizer_name == "Adam" and decay):
    raise TorchOnTpuError(
      f"torchtitan's optimizer {group.optimizer_name}{' with weight_decay' if group.optimizer_name == 'Adam' else ''} "
      f"(param group {group.pattern!r}) has no counterpart in the recipe, which trains with AdamW; use AdamW."
    )
  odd = sorted(set(kwargs) - _ADAMW_KWARGS) + [k for k in ("maximize", "amsgrad") if kwargs.get(k)]
  if odd:
    raise TorchOnTpuError(f"torchtitan's optimizer argument {odd[0]}={kwargs[odd[0]]!r} has no counterpart in the recipe's AdamW; drop it.")
  beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
  return dict(lr=kwargs["lr"], beta1=beta1, beta2=beta2, eps=kwargs.get("eps", 1e-8), weight_decay=decay)


def _files(config, take, notes: list[str]) -> dict:
  """Where the run reads and writes: torchtitan's dump folder, checkpoint folder and cadence,
  initial weights, tokenizer and data; its repository's test assets, absent here, said in a line."""
  dump = take("dump_folder")
  flags = {"log_dir": dump}
  flags.update(_checkpoints(take, dump, notes))
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
  if loader == "ChatDataLoader":
    return {**flags, **_chat_data(take, notes)}
  if loader == "MMDataLoader":
    raise TorchOnTpuError(
      "torchtitan's dataloader MMDataLoader feeds images beside the text (a multimodal model's training), and the recipe "
      "trains language models on text or chat data only; train the family's text model with "
      f"--model={getattr(config.model_spec, 'name', '<family>')}:<flavor>."
    )
  if loader != "HuggingFaceTextDataLoader":
    raise TorchOnTpuError(
      f"torchtitan's dataloader {loader} has no counterpart in the recipe, which trains on packed text or one chat dataset "
      f"(ChatDataLoader); use one of those."
    )
  path, name = take("dataloader.dataset_path"), take("dataloader.dataset")
  if path is not None:
    flags["data"] = path
  else:
    notes.append(
      f"torchtitan's dataset {name!r} is a download by name (or its repository's test data): the recipe trains on its "
      f"built-in corpus; --dataloader.dataset_path (or --data) names files to train on."
    )
  return flags


def _chat_data(take, notes: list[str]) -> dict:
  """torchtitan's ChatDataLoader → --data_format=chat: its local data (a "json" dataset's data_files, or a
  path), and its sample_processor as the --data_field that makes the same messages (found by calling it on
  a record whose every field reads as its own name)."""
  path, kwargs, processor = take("dataloader.dataset_path"), dict(take("dataloader.load_dataset_kwargs")), take("dataloader.sample_processor")
  if path != "json" and not os.path.exists(path):
    raise TorchOnTpuError(
      f"torchtitan's dataloader.dataset_path={path!r} is a download by name, which the recipe does not make; "
      f"point it at local files (or 'json' with load_dataset_kwargs data_files)."
    )
  if kwargs.pop("split", "train") != "train":
    raise TorchOnTpuError("torchtitan's dataloader.load_dataset_kwargs split other than 'train': the recipe trains on the files' records; drop it.")
  files = kwargs.pop("data_files", None) if path == "json" else None
  if kwargs:
    raise TorchOnTpuError(f"torchtitan's dataloader.load_dataset_kwargs {sorted(kwargs)[0]!r} has no counterpart in the recipe's chat data; drop it.")
  if isinstance(files, (list, tuple)) and len(files) == 1:
    files = files[0]
  if path == "json" and not isinstance(files, str):
    raise TorchOnTpuError(
      "torchtitan's dataloader.load_dataset_kwargs data_files: the recipe reads one file or glob of chat data; name one "
      "(data_files='conversations.json')."
    )
  data = files if path == "json" else path
  field = _chat_field(processor)
  notes.append(f"torchtitan's ChatDataLoader: chat data from {data!r}, its sample_processor read as --data_field={field}.")
  return {"data": data, "data_format": "chat", "data_field": field}


class _FieldNames(dict):
  """A record whose every field reads as a marker of its own name."""

  def __missing__(self, key):
    return f"\x00{key}\x00"


def _chat_field(processor) -> str:
  """The --data_field that gives `processor`'s messages: one field's list, or role:field pairs."""
  marker = re.compile("\x00([^\x00]+)\x00")
  try:
    messages = processor(_FieldNames())
  except Exception:  # noqa: BLE001 (one that computes on the values: said below)
    messages = None
  if isinstance(messages, str) and marker.fullmatch(messages):
    return marker.fullmatch(messages).group(1)
  pairs = [
    (m.get("role"), marker.fullmatch(m.get("content", ""))) for m in messages or () if isinstance(m, dict) and isinstance(m.get("content"), str)
  ]
  if not pairs or len(pairs) != len(messages) or any(not isinstance(role, str) or match is None for role, match in pairs):
    raise TorchOnTpuError(
      f"torchtitan's dataloader.sample_processor {getattr(processor, '__qualname__', processor)!r} computes its messages from "
      f"more than a record's fields; write the conversations into a 'messages' field of the data (--data_format=chat reads it)."
    )
  return ",".join(f"{role}:{match.group(1)}" for role, match in pairs)


# torchtitan's checkpoint.exclude_from_loading keys → what a resume starts afresh (--resume_fresh).
_EXCLUDED = {"optimizer": "optimizer", "lr_scheduler": "optimizer", "dataloader": "data", "train_state": "step"}


def _checkpoints(take, dump: str, notes: list[str]) -> dict:
  """torchtitan's checkpointing: with `checkpoint.enable` its folder, cadence, what the last step holds
  and what a resume restores; without it nothing is resumed or saved, as torchtitan does."""
  flags = {"ckpt_dir": os.path.join(dump, take("checkpoint.folder"))}
  enabled, interval = take("checkpoint.enable"), take("checkpoint.interval")
  model_only, in_hf, dtype = take("checkpoint.last_save_model_only"), take("checkpoint.last_save_in_hf"), take("checkpoint.export_dtype")
  excluded, seed, load_step = take("checkpoint.exclude_from_loading"), take("checkpoint.create_seed_checkpoint"), take("checkpoint.load_step")
  if take("checkpoint.initial_load_in_hf_quantized"):
    raise TorchOnTpuError(
      "torchtitan's checkpoint.initial_load_in_hf_quantized reads a quantized HF checkpoint (its dequantizing kernels are CUDA's); "
      "give the checkpoint in bf16 or fp32 safetensors."
    )
  if not enabled:
    notes.append(
      "torchtitan's checkpoint.enable=False: as in torchtitan, no checkpoint is resumed or saved "
      "(--checkpoint.enable keeps the last step, for a resume or an export)."
    )
    return {**flags, "save_every": 0}
  flags.update(save_every=interval, keep_checkpoints=max(take("checkpoint.keep_latest_k"), 0))
  flags["last_save"] = "hf" if in_hf else "model" if model_only else "full"
  if model_only:
    flags["last_save_dtype"] = dtype
  if load_step >= 0:
    flags["resume_step"] = load_step
  if excluded:
    unknown = sorted(set(excluded) - set(_EXCLUDED))
    if unknown or ("optimizer" in excluded) != ("lr_scheduler" in excluded):
      raise TorchOnTpuError(
        f"torchtitan's checkpoint.exclude_from_loading={','.join(excluded)}: the recipe restores or starts afresh "
        f"{', '.join(sorted(_EXCLUDED))}, with the optimizer and lr_scheduler together (the schedule's position is the "
        f"optimizer's step count); name both or neither."
      )
    flags["resume_fresh"] = ",".join(sorted({_EXCLUDED[k] for k in excluded}))
  if seed:
    flags["steps"] = 0  # torchtitan saves its initial weights as step 0 and trains nothing
  return flags


def _observability(take, dump: str, notes: list[str]) -> dict:
  """torchtitan's profiler as jax.profiler traces where torchtitan writes its own, and where its
  TensorBoard scalars are."""
  flags = {}
  every, active, folder = take("profiler.profile_freq"), take("profiler.profiler_active"), take("profiler.save_traces_folder")
  if take("profiler.enable_profiling"):
    first, folder = max(every - active + 1, 1), os.path.join(dump, folder)
    flags.update(profile=f"{first},{every},{every}", profile_dir=folder)
    notes.append(
      f"torchtitan's profiler.enable_profiling: jax.profiler traces steps {first}-{every} of every {every} into "
      f"{folder}/iteration_<step> (TensorBoard's profile tab or Perfetto opens them)."
    )
  if take("metrics.enable_tensorboard"):
    notes.append(f"torchtitan's metrics.enable_tensorboard: every run writes TensorBoard scalars, into {dump}/tensorboard beside metrics.jsonl.")
  return flags


def _read_past(config, used: set[str]) -> list[str]:
  """A line for each reason some fields the config sets are read past (`READ_PAST`), naming them."""
  switches = {path: value for path, value, _ in leaves(config) if path in _RELEVANT.values()}
  said = {}
  for path, value, default in leaves(config):
    if path in used or default is dataclasses.MISSING or _same(value, default) or not path.startswith(SAME_MATH):
      continue
    switch = next((d for prefix, d in _RELEVANT.items() if path.startswith(prefix)), None)
    if switch is not None and path != switch and not (switches.get(switch) is True or switches.get(switch, 1) > 1):
      continue
    reason = next(r for r, prefixes in READ_PAST.items() if path.startswith(prefixes))
    said.setdefault(reason, []).append(f"{path}={_short(value)}")
  kernels = [e if isinstance(e, str) else e[0] for e in config.override.imports]
  lines = [f"torchtitan's override.imports {k}: {CUDA_KERNELS[k]}, the same computation: computed here with XLA." for k in kernels if k in CUDA_KERNELS]
  return lines + [f"torchtitan's {', '.join(fields)}: read past, {reason}." for reason, fields in said.items()]


# The recipe's flags (and the call arguments they set) that take a torchtitan field's value as it is:
# a sentence about them names the field, as the user wrote it (`errors.spoken_as_flags`); --fsdp too
# where no replicas are folded into it (`main`).
SPELLING = {
  "tp": "parallelism.tensor_parallel_degree", "cp": "parallelism.context_parallel_degree",
  "pp": "parallelism.pipeline_parallel_degree", "ep": "parallelism.expert_parallel_degree",
  "seqlen": "training.seq_len", "steps": "training.steps", "global_batch_size": "training.global_batch_size",
  "clip_norm": "training.max_norm", "warmup_steps": "lr_scheduler.warmup_steps", "decay_ratio": "lr_scheduler.decay_ratio",
  "lr_decay": "lr_scheduler.decay_type", "min_lr_factor": "lr_scheduler.min_lr_factor",
  "seed": "debug.seed", "log_dir": "dump_folder", "weights": "checkpoint.initial_load_path", "resume_step": "checkpoint.load_step",
  "keep_checkpoints": "checkpoint.keep_latest_k", "ckpt_dir": "checkpoint.folder", "last_save_dtype": "checkpoint.export_dtype",
}


def command_line(flags: dict, module: str = "recipes.torchtitan") -> str:
  """The same run as this recipe's flags, to paste."""
  parts = [f"--{name}={shlex.quote(str(value))}" for name, value in flags.items() if value is not None]
  return f"{python_command()} -m {module} " + " ".join(parts)


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
  from recipes.flags import check_flags, flag_spelling
  from torch_on_tpu import errors

  titan, ours_argv = split_argv(argv, recipe_main.flags_cls)
  try:
    ours = dict(arg[2:].split("=", 1) for arg in cli.parse_argv(ours_argv, recipe_main.flags_cls))
    ours = {name: ast.literal_eval(text) for name, text in ours.items()}
    config = parse(titan)
    flags, notes = to_flags(config, devices_for(ours))
    flags.update(ours)
    titan_names = {**SPELLING, **({"fsdp": "parallelism.data_parallel_shard_degree"} if config.parallelism.data_parallel_replicate_degree == 1 else {})}
    spelling = {**flag_spelling(recipe_main.flags_cls), **{k: v for k, v in titan_names.items() if k not in ours}}
    with errors.spoken_as_flags(spelling):
      check_flags(recipe_main.flags_cls(**flags), read_files=False)  # the command printed below must be one that runs
  except (cli.FlagError, TorchOnTpuError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None
  for line in notes:
    print(line, flush=True)
  print(f"The same run in this recipe's flags: {command_line(flags)}", flush=True)
  with errors.spoken_as_flags(spelling):  # what goes wrong is said in the fields the user wrote
    recipe_main(**flags)
