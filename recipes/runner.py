"""A recipe run, top to bottom: flags → start-up checks → resolved config → mesh, model, plan, data,
step, checkpoints, the Trainer (`run`).

A recipe is a `Recipe`: a name for its run directory and a builder of the torch model on meta
(called once for the plan and once for the run; twice more for LoRA). The flags and their checks
are `recipes.flags`'s, the command line `recipes.cli`'s, what must happen before jax starts
`recipes.startup`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from recipes.cli import python_command
from recipes.flags import STATE_FLAGS, Flags, check_flags, default_scan, flag_spelling, layer_remat, mesh_axes, profile_steps
from recipes.startup import initialize_distributed, setup_platform
from torch_on_tpu.errors import TorchOnTpuError, arg


@dataclasses.dataclass
class Recipe:
  """What differs between the recipes."""

  name: str  # the run directory under runs/
  build: Callable  # () → a fresh torch model on meta
  family: str  # "titan" or "hf": how the model is called
  weights: str | None = None  # pretrained weights to start from (`checkpoint.import_pretrained`)
  lora: dict | None = None  # lora.wrap keyword arguments (rank, alpha, targets)
  convert_model: str | None = None  # how tools/convert.py names the model (--model=... / --hf_config=...)
  loss: Callable | None = None  # the train step's loss_fn(outputs, labels); None: mean cross-entropy of the logits
  labels: Callable | None = None  # data batch → the labels `loss` reads; None: batch["labels"]


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

  with errors.spoken_as_flags({**flag_spelling(type(flags)), **errors.spoken()}):  # a torchtitan config's own names win
    setup_platform(flags.cpu_devices)
    check_flags(flags)
    initialize_distributed()
    from torch_on_tpu.runtime import xla_flags

    xla_flags.COLLECTIVE_MATMUL = flags.collective_matmul  # read by every program's compile options

    import jax

    import torch_on_tpu as tot
    from torch_on_tpu.core import storage
    from torch_on_tpu.runtime import fingerprint

    mesh = tot.make_mesh(target=flags.target, **mesh_axes(flags))
    if flags.scan is None:
      flags = dataclasses.replace(flags, scan=default_scan(mesh.devices.flat[0].platform, pipeline=flags.pp > 1))
    check_flags(flags, mesh)
    recipe = recipe_for(flags)
    config = resolve(flags, recipe)
    storage.note_checkpoints(config["ckpt_dir"])  # what a fault from here on names as kept
    fingerprint.check_same(config=config)  # every process with the same flags, before anything is built
    main = jax.process_index() == 0
    latest = None if flags.dry_run else _latest_checkpoint(flags, config)
    if latest is not None and latest >= flags.steps and flags.resume_step is None:
      if main:
        then = "sampling from it" if flags.sample is not None else f"raise {errors.named('steps')} to train further or pass another {errors.named('ckpt_dir')}"
        print(f"Nothing to train: {config['ckpt_dir']} already holds step {latest} of {errors.arg('steps', flags.steps)}; {then}.", flush=True)
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
  if not flags.resume or not flags.save_every or not os.path.isdir(config["ckpt_dir"]):
    return None
  from torch_on_tpu.io import checkpoint

  with checkpoint.Checkpointer(config["ckpt_dir"]) as ckpt:  # read_only would log a warning
    return ckpt.latest_step()


def _use_compile_cache(directory: str | None) -> str | None:
  """Points jax's persistent compilation cache at `directory` unless this process
  already chose one (a test session, the user's JAX_COMPILATION_CACHE_DIR); returns
  the directory in use."""
  import jax

  from torch_on_tpu.core import storage

  if directory and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", directory)
  if jax.config.jax_compilation_cache_dir:
    storage.watch_compile_cache(jax.config.jax_compilation_cache_dir)  # a full disk there: one sentence
  return jax.config.jax_compilation_cache_dir


def _run(flags: Flags, recipe: Recipe, config: dict, mesh, main: bool) -> dict:
  import jax
  import jax.numpy as jnp

  import torch_on_tpu as tot
  from torch_on_tpu.io import data
  from torch_on_tpu.lowering import remat as remat_lib
  from torch_on_tpu.runtime import health
  from torch_on_tpu.training import lora, plan
  from torch_on_tpu.training.trainer import default_split

  if main:
    devices = mesh.devices.flat[0]
    print(f"Mesh {dict(mesh.shape)} over {mesh.size} {devices.platform} devices ({devices.device_kind})", flush=True)
  wandb_run = None
  if main and flags.wandb_project and not flags.dry_run:  # before the model and its compile: a missing login is said now
    from torch_on_tpu.training import metrics

    name = flags.wandb_run or os.path.basename(os.path.normpath(config["log_dir"]))
    wandb_run = metrics.start_wandb(config["log_dir"], flags.wandb_project, name=name, config=config)
  compute_dtype = None if flags.dtype == "float32" else jnp.bfloat16
  master_dtype = jnp.bfloat16 if flags.dtype == "bfloat16-all" else None

  chat = flags.data_format == "chat"
  if chat and recipe.loss is not None and flags.grad_accum > 1:
    raise TorchOnTpuError(
      f"{arg('grad_accum', flags.grad_accum)} with chat data averages this recipe's own loss over microbatches holding "
      f"unequal numbers of answer tokens, which is not the batch's token mean; use {arg('grad_accum', 1)}."
    )

  def make_step(abstract: bool):
    jm = _model(flags, recipe, mesh, abstract, config.get("microbatches"))
    return tot.make_train_step(
      jm,
      recipe.loss or (answer_loss if chat else _loss),
      _optimizer(flags, jm, lora=bool(recipe.lora)),
      grad_accum=flags.grad_accum,
      clip_norm=flags.clip_norm or None,
      compute_dtype=compute_dtype,
      master_dtype=master_dtype,
      seed=flags.seed,
      trainable=lora.TRAINABLE if recipe.lora else None,
      skip_nonfinite=flags.max_skips > 0,
      fuse_head=flags.fuse_head,
    )

  # 1. Plan on abstract params: nothing allocated, so a run that cannot fit fails here.
  shape = plan.decoder_shape(recipe.build())
  abstract_step = make_step(abstract=True)
  memory_bytes = flags.memory_gib * 2**30 if flags.memory_gib else None
  sizes = dict(global_batch_size=flags.global_batch_size, seqlen=flags.seqlen, device_bytes=memory_bytes)
  default = remat_lib.layer_policy(layer_remat(flags), scanned=flags.scan)
  auto = flags.remat == "auto"
  if auto:  # the least recomputation the plan says fits; the run goes on with it as if it had been asked for
    choice = plan.auto_remat(abstract_step, shape, first=default, **sizes)
    memory = choice.plan
    flags = dataclasses.replace(flags, remat=choice.policy)
    if choice.policy != default:
      abstract_step = make_step(abstract=True)
  else:
    memory = plan.plan_memory(abstract_step, shape, remat=default, **sizes)
  if main:
    print(memory, flush=True)
    if auto:
      print(choice, flush=True)
    print(_parameter_count(abstract_step), flush=True)
    if abstract_step.model.pipeline is not None:
      print(f"Pipeline {abstract_step.model.pipeline.schedule}", flush=True)
  spec = jax.ShapeDtypeStruct((flags.global_batch_size, flags.seqlen), jnp.int32)
  documents = ("positions", "segment_ids") if recipe.family == "titan" else ()  # what data.batches yields
  abstract_batch = {key: spec for key in ("input_ids", "labels", *documents)}
  family_model = abstract_step.model  # how this family's model is called (structure only, no arrays)
  def split(batch):
    inputs, labels = default_split(family_model, batch)
    if recipe.labels is not None:
      return inputs, recipe.labels(batch)
    return inputs, answer_labels(labels) if chat and recipe.loss is None else labels

  if flags.dry_run:
    if main and memory.fits is False:
      print(f"Would not fit: {memory.message()}", flush=True)
    candidates = plan.auto_candidates(default, mesh)
    later = candidates[candidates.index(flags.remat) + 1:] if auto else []  # what auto would try next
    while True:  # on a compile-only target with remat auto, the TPU compiler has the last word
      try:
        report = _compile_for(abstract_step, split(abstract_batch), flags, memory, main)
        refusal = None if flags.target is None or report.fits(memory.device_bytes) else _does_not_fit(report, memory, flags.target)
      except TorchOnTpuError as e:
        if flags.target is None:
          raise
        report, refusal = None, str(e)
      if refusal is None or not later:
        break
      if main:
        print(f"Remat auto: {refusal.removesuffix('.')}; trying {later[0]}", flush=True)
      flags = dataclasses.replace(flags, remat=later.pop(0))
      abstract_step = make_step(abstract=True)
      memory = plan.plan_memory(abstract_step, shape, remat=flags.remat, **sizes)
    if report is None:
      raise TorchOnTpuError(refusal)
    if main:
      print(f"Compiled step: {report}", flush=True)
      if report.peak_bytes is not None and flags.target is None:  # on a target, its verdict below says it
        print(f"Compiled peak per device: {report.peak_bytes / 2**30:.2f} GiB (plan: {memory.total / 2**30:.2f} GiB)")
      if flags.target is not None:
        print(target_verdict(report, memory, flags.target), flush=True)
    if refusal is not None:
      raise TorchOnTpuError(refusal)
    return {"plan": memory, "compile": report, "remat": flags.remat}
  memory.check()
  del abstract_step

  # 2. The real model, data and checkpoints.
  health.doing("building the model")
  step = make_step(abstract=False)
  if chat:
    source = data.chat.conversations(flags.data, field=flags.data_field)
  else:
    source = data.source(flags.data, field=flags.data_field or "text")
  corpus = source.texts() if chat else source  # a tokenizer trained here learns the chat template's text too
  tokenizer = data.build_tokenizer(flags.tokenizer, vocab_size=min(data.DEFAULT_VOCAB_SIZE, shape.vocab), corpus=corpus)
  data.check_model_fit(tokenizer.vocab_size, shape.vocab, flags.seqlen)
  tokenizer_dir = os.path.join(config["log_dir"], "tokenizer")
  if main:
    _keep_tokenizer(tokenizer, tokenizer_dir)
  titan = recipe.family == "titan"
  process_index, process_count = data.process_rows(mesh)  # pipeline stages read the same rows
  data_kwargs = dict(
    seqlen=flags.seqlen, global_batch_size=flags.global_batch_size, seed=flags.seed,
    with_positions=titan, with_segment_ids=titan, field=flags.data_field, data_format=flags.data_format,
    process_index=process_index, process_count=process_count,
  )
  if flags.last_save == "hf":
    _check_hf_form(step.model, recipe)
  ckpt = _checkpointer(flags, config, step.model)
  try:
    restored = _resume(ckpt, step, flags, config, main)
  except BaseException:
    ckpt.close()
    raise
  first_step = step.step_count
  if first_step >= flags.steps:  # a finished run relaunched with --sample (or a seed checkpoint): nothing to compile or train
    if flags.steps == 0 and not ckpt.all_steps():
      ckpt.save(0, step.state, config=config, force=True)
    ckpt.close()
    summary = {"steps": first_step, "preempted": False, "records": []}
  else:
    summary = _train(step, flags, config, ckpt, restored, source, tokenizer, data_kwargs, split, abstract_batch, memory, mesh, main, wandb_run)
  summary.update(
    ckpt_dir=config["ckpt_dir"], log_dir=config["log_dir"], tokenizer_dir=tokenizer_dir, plan=memory, train_step=step,
    last_checkpoint=os.path.join(config["ckpt_dir"], str(summary["steps"])) if flags.save_every else None,
    wandb_offline=wandb_run.settings.sync_dir if wandb_run is not None and wandb_run.offline else None,
  )
  if flags.last_save == "hf" and flags.save_every and summary["steps"] == flags.steps and not summary["preempted"]:
    summary["hf_checkpoint"] = _save_hf(step.model, recipe, flags, config)
  if flags.sample is not None:
    summary["sample"] = _sample(step, tokenizer, split, flags, recipe)  # every process runs the program
    if main:
      print(f"Sample: {flags.sample!r} → {summary['sample']!r}", flush=True)
  if recipe.convert_model:  # on every process: the check may read sharded arrays
    from torch_on_tpu.io import export

    summary["export_refusal"] = export.hf_refusal(step.model)
  if main:
    print(where_things_are(summary, recipe), flush=True)
  return summary


def _train(step, flags: Flags, config: dict, ckpt, restored, source, tokenizer, data_kwargs, split, abstract_batch, memory, mesh, main,
           wandb_run) -> dict:
  """3. Compile ahead (the report comes before the first step), then the Trainer; its summary."""
  import torch_on_tpu as tot
  from torch_on_tpu.io import checkpoint, data
  from torch_on_tpu.runtime import health

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
        **_profiling(flags),
        checkpointer=_LastStep(ckpt, flags) if flags.last_save != "full" else ckpt,
        stop_requested=guard.should_stop,
        max_skips=max(flags.max_skips, 1),
        run_config=config,
        wandb=wandb_run,
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
  dropped = train.stats.line() if train.stats is not None else None
  if main and dropped:
    print(dropped, flush=True)
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
  from torch_on_tpu.io import data

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
  lines = [f"Run directory: {summary['log_dir']} (metrics.jsonl, TensorBoard)"]
  lines.append(f"Last checkpoint: {summary['last_checkpoint']}" if summary["last_checkpoint"] else "No checkpoint saved (--save_every=0)")
  if summary.get("preempted") and summary["last_checkpoint"]:
    lines.append(f"Stopped at step {summary['steps']} by a signal: the same command resumes from it.")
  if summary.get("hf_checkpoint"):
    lines.append(f"HF checkpoint of the last step: {summary['hf_checkpoint']}")
  if summary.get("plot"):
    lines.append(f"Plot: {summary['plot']}")
  if summary.get("wandb_offline"):
    lines.append(f"Weights & Biases run, offline: {summary['wandb_offline']}; upload it with: {python_command()} -m wandb sync {summary['wandb_offline']}")
  exportable = recipe.convert_model and summary["last_checkpoint"]
  if exportable and summary.get("export_refusal"):
    out = os.path.join(summary["log_dir"], "export")
    lines.append(f"No export for transformers: {summary['export_refusal']}")
    lines.append(
      f"Export its state_dict (torch's own names): {python_command()} tools/convert.py to_safetensors {summary['ckpt_dir']} {out} "
      f"{recipe.convert_model} --step={summary['steps']}"
    )
  elif exportable:
    out = os.path.join(summary["log_dir"], "export")
    lines.append(
      f"Export for transformers: {python_command()} tools/convert.py to_hf {summary['ckpt_dir']} {out} "
      f"{recipe.convert_model} --tokenizer={summary['tokenizer_dir']} --step={summary['steps']}"
    )
    if recipe.lora:
      lines.append("(LoRA: the adapters are merged into the base weights; --mode=adapter writes a peft adapter instead)")
  return "\n".join(lines)


def _keep_tokenizer(tokenizer, directory: str) -> None:
  """Saves the run's tokenizer into its run directory (a run is self-contained), whole or not at all."""
  from torch_on_tpu.core import storage

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
  """Restores the checkpoint to continue from into `step` (None: a fresh run), or refuses in one
  sentence; the parts --resume_fresh names start afresh."""
  from torch_on_tpu.errors import TorchOnTpuError, arg, named

  saved = ckpt.all_steps()
  if not saved:
    if flags.resume_step is not None:
      raise TorchOnTpuError(f"{arg('resume_step', flags.resume_step)} but {config['ckpt_dir']} holds no checkpoint.")
    return None
  if not flags.resume:
    ckpt.set_aside(saved, "replaced")
    if main:
      print(f"--resume=False: set aside steps {saved} of {config['ckpt_dir']} as <step>.replaced; starting afresh", flush=True)
    return None
  fresh = {part for part in flags.resume_fresh.split(",") if part}
  saved_config = ckpt.saved_config(flags.resume_step)
  _check_same_state(saved_config, config, ckpt.directory)
  if (saved_config or {}).get(HOLDS) == "model":
    where = ckpt.directory / str(flags.resume_step if flags.resume_step is not None else ckpt.latest_step())
    raise TorchOnTpuError(
      f"The checkpoint at {where} holds the model's weights alone (its run's last step: --last_save=model, torchtitan's "
      f"checkpoint.last_save_model_only), no training state to resume; start a new run from them with "
      f"{arg('weights', str(where))} and another {named('ckpt_dir')}."
    )
  target = step.abstract_state()
  dropped = {"optimizer": "opt_state", "step": "step"}
  partial = {k: v for k, v in target.items() if k not in {dropped[p] for p in fresh if p in dropped}}
  try:
    restored = ckpt.restore(partial, step=flags.resume_step, partial=len(partial) < len(target))
  except TorchOnTpuError as e:
    listed = str(e).partition(" (")[2]
    if "does not match the state to restore" in str(e) and set(re.findall(r"(?<![\w/])(\w+)/", listed)) == {"opt_state"}:
      raise TorchOnTpuError(  # the weights match: an optimizer of another layout (another AdamW setting, an older version)
        f"{str(e).split(' (')[0]}: its optimizer state has another layout than this run's AdamW; keep its weights and "
        f"data position and start the optimizer afresh with {arg('resume_fresh', 'optimizer')}."
      ) from None
    raise
  _check_same_state(restored.config, config, ckpt.directory / str(restored.step))  # after a fallback
  newer = [s for s in ckpt.all_steps() if s > restored.step]
  ckpt.set_aside(newer, "superseded")
  step.state = {**step.state, **restored.state}
  if "data" in fresh:
    restored = dataclasses.replace(restored, data=None)
  if main:
    aside = f"; set aside the newer steps {newer} as <step>.superseded" if newer else ""
    afresh = f" ({', '.join(sorted(fresh))} afresh)" if fresh else ""
    print(f"Resumed from step {restored.step} of {config['ckpt_dir']}{afresh}{aside}", flush=True)
  return restored


def _check_same_state(saved: dict | None, config: dict, where) -> None:
  """Refuses a resume whose settings change what the saved state is, naming every one that differs
  and its saved value."""
  from torch_on_tpu.errors import TorchOnTpuError, arg, named

  differ = [name for name in STATE_FLAGS if saved and name in saved and name in config and saved[name] != config[name]]
  if differ:
    both = "; ".join(f"{arg(name, saved[name])} there, {arg(name, config[name])} here" for name in differ)
    raise TorchOnTpuError(
      f"The checkpoint at {where} was saved by a run of other settings ({both}); resume it with the saved ones, "
      f"or start afresh with --resume=False or another {named('ckpt_dir')}."
    )


HOLDS = "checkpoint_holds"  # the run config's entry a model-only last step carries


class _NoCheckpoints:
  """--save_every=0 (torchtitan's checkpoint.enable=False): nothing is resumed or saved."""

  def __init__(self, directory: str):
    self.directory = Path(directory)

  def all_steps(self) -> list[int]:
    return []

  def latest_step(self) -> None:
    return None

  def should_save(self, step: int) -> bool:
    return False

  def save(self, *args, **kwargs) -> bool:
    return False

  def wait(self) -> None:
    pass

  def close(self) -> None:
    pass


def _checkpointer(flags: Flags, config: dict, model):
  from torch_on_tpu.io import checkpoint

  if not flags.save_every:
    return _NoCheckpoints(config["ckpt_dir"])
  return checkpoint.Checkpointer(config["ckpt_dir"], save_every=flags.save_every, keep=flags.keep_checkpoints or None, model=model)


class _LastStep:
  """The run's Checkpointer, whose last step holds the model's weights alone (--last_save model or
  hf), in --last_save_dtype: torchtitan's last_save_model_only and export_dtype."""

  def __init__(self, ckpt, flags: Flags):
    self._ckpt, self._last, self._dtype = ckpt, flags.steps, flags.last_save_dtype

  def __getattr__(self, name):
    return getattr(self._ckpt, name)

  def save(self, step: int, state, *, data=None, config=None, force: bool = False) -> bool:
    if step != self._last:
      return self._ckpt.save(step, state, data=data, config=config, force=force)
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(self._dtype) if self._dtype else None
    cast = lambda x: x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    weights = {"params": jax.tree.map(cast, dict(state["params"])), "buffers": dict(state["buffers"])}
    return self._ckpt.save(step, weights, data=data, config={**(config or {}), HOLDS: "model"}, force=force)


def _check_hf_form(model, recipe: Recipe) -> None:
  """--last_save=hf needs a model transformers has a form for: said before training, not after."""
  from torch_on_tpu import models
  from torch_on_tpu.errors import TorchOnTpuError

  module = model.module.get_base_model() if recipe.lora else model.module
  if models.family_of(module).hf_form(module) is None:
    raise TorchOnTpuError(
      f"--last_save=hf (torchtitan's checkpoint.last_save_in_hf) writes the last step as an HF directory, and "
      f"{type(module).__name__} has no HF form here; save it as the model alone (--last_save=model) instead."
    )
  if recipe.lora:
    from torch_on_tpu.io import export

    try:
      export.lora_mergeable(model)
    except TorchOnTpuError as e:
      raise TorchOnTpuError(f"--last_save=hf (torchtitan's checkpoint.last_save_in_hf) merges the adapters into an HF directory: {e}") from None


def _save_hf(model, recipe: Recipe, flags: Flags, config: dict) -> str:
  """The last step's weights as an HF directory at <ckpt_dir>/step-N (torchtitan's last_save_in_hf),
  with an index file, as torchtitan finds an HF step by it."""
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.io import export

  out = os.path.join(config["ckpt_dir"], f"step-{flags.steps}")
  try:
    export.export(model, out, mode="merged" if recipe.lora else "full", dtype=flags.last_save_dtype, index=True, overwrite=True)
  except TorchOnTpuError as e:
    raise TorchOnTpuError(
      f"The last step's weights are saved at {os.path.join(config['ckpt_dir'], str(flags.steps))}, but not as an HF directory: {e}"
    ) from None
  return out


def _profiling(flags: Flags) -> dict:
  """The Trainer's profiling arguments from --profile and --profile_dir."""
  window = profile_steps(flags.profile)
  if window is None:
    return {}
  first, last, every = window
  return dict(profile_steps=(first, last), profile_every=every, profile_dir=flags.profile_dir)


def _compile_for(step, batch, flags: Flags, memory, main: bool):
  """The compiled step's report; on a compile-only target, the TPU compiler's out-of-memory
  refusal (its temporaries alone exceed HBM) said in one sentence with what to change."""
  where = f"the TPU compiler for {flags.target}" if flags.target else "XLA"
  try:
    with _elapsed(f"Compiling the step with {where} (remat {flags.remat})", loud=main):
      return step.compile(*batch)
  except Exception as e:  # noqa: BLE001 (the compiler's RESOURCE_EXHAUSTED; the rest re-raises)
    if flags.target is None or "RESOURCE_EXHAUSTED" not in str(e):
      raise
    needed = re.search(r"temporaries \(([\d.]+)([KMGT]?)\)", str(e))
    if needed:  # the program's peak: these temporaries over the params and optimizer state it takes in
      temps = float(needed[1]) * 1024 ** " KMGT".index(needed[2] or " ")
      limit = memory.total * memory.device_bytes / (temps + memory.params + memory.optimizer) * 0.95
    raise TorchOnTpuError(
      f"The step does not fit {flags.target}: the TPU compiler needs {f'{needed[1]} {needed[2]}iB' if needed else 'more'} of "
      f"temporaries per chip against {memory.device_bytes / 2**30:.2f} GiB of HBM; "
      f"{memory.suggest(limit if needed else 0.75 * memory.total)}."
    ) from None


@contextlib.contextmanager
def _elapsed(what: str, loud: bool, every: float = 30.0):
  """Says `what` is under way, then the elapsed time every `every` seconds until it ends: a
  pod-sized compile takes minutes, which silence would make look hung."""
  if not loud:
    yield
    return
  print(f"{what} ...", flush=True)
  done, start = threading.Event(), time.monotonic()

  def tick():
    while not done.wait(every):
      print(f"  still compiling: {time.monotonic() - start:.0f} s", flush=True)

  ticker = threading.Thread(target=tick, daemon=True, name="compile-ticker")
  ticker.start()
  try:
    yield
  finally:
    done.set()
    ticker.join()


def target_verdict(report, memory, target: str) -> str:
  """Per chip of `target`, what the TPU compiler's program holds against the chip's HBM, the
  plan beside it, and the bytes its collectives move."""
  from torch_on_tpu.core.sizes import human_bytes

  hbm = memory.device_bytes
  verdict = "fits" if report.fits(hbm) else "does NOT fit"
  lines = [
    f"TPU compiler, per chip of {target} ({human_bytes(hbm)} HBM): arguments {human_bytes(report.argument_bytes)} + "
    f"temporaries {human_bytes(report.temp_bytes)} = {human_bytes(report.peak_bytes)} ({report.peak_bytes / hbm:.1%}: {verdict}); "
    + (f"the compiler's peak {human_bytes(report.compiler_peak_bytes)}{' (host memory included)' if report.host_offloaded_bytes else ''}; "
       if report.compiler_peak_bytes else "")
    + f"host offloaded {human_bytes(report.host_offloaded_bytes)}; plan {human_bytes(memory.total)}",
    f"Collectives per chip per step (loops counted): {report.collective_bytes or 'none'}",
  ]
  return "\n".join(lines)


def _does_not_fit(report, memory, target: str) -> str:
  return (
    f"The step does not fit {target}: the TPU compiler's program holds {report.peak_bytes / 2**30:.2f} GiB per chip "
    f"(arguments {report.argument_bytes / 2**30:.2f} + temporaries {report.temp_bytes / 2**30:.2f}) against "
    f"{memory.device_bytes / 2**30:.2f} GiB of HBM; {memory.suggest(memory.total * memory.device_bytes / report.peak_bytes * 0.95)}."
  )


def _model(flags: Flags, recipe: Recipe, mesh, abstract: bool, microbatches: int | None = None):
  """The ShardedModule: the recipe's model (with imported weights, with LoRA adapters)."""
  import torch_on_tpu as tot
  from torch_on_tpu.io import checkpoint
  from torch_on_tpu.training import lora

  sharding = "fsdp_tp" if flags.tp > 1 else "ep" if flags.ep > 1 else "fsdp"
  attention = None if flags.attention == "none" else flags.attention
  layers = dict(scan=flags.scan, unroll=flags.unroll, remat=layer_remat(flags))
  if flags.pp > 1:
    layers.update(microbatches=microbatches, virtual_stages=flags.virtual_stages)
  common = dict(mesh=mesh, sharding=sharding, seed=flags.seed, attention=attention)
  if not recipe.lora:
    jm = tot.ShardedModule(recipe.build(), abstract=abstract, **common, **layers)
    if recipe.weights and not abstract:
      checkpoint.import_pretrained(jm, recipe.weights)
    return jm
  base = tot.ShardedModule(recipe.build(), abstract=abstract, **common, **(layers if flags.pp > 1 else {}))  # stages need the scan
  if recipe.weights and not abstract:
    checkpoint.import_pretrained(base, recipe.weights)
  return lora.wrap(base, recipe.build(), seed=flags.seed, **recipe.lora, **layers)


def _optimizer(flags: Flags, jm, lora: bool):
  """AdamW on torchtitan's schedule. With --param_groups each parameter takes its group's lr and
  weight decay (the first pattern its original name matches), each lr scaled by the one schedule as
  torchtitan's scheduler scales every group's: one Adam, then per-parameter decay and step size
  (optax's AdamW update, u + wd·p then −lr·u, with wd and lr by parameter)."""
  import jax.numpy as jnp
  import optax

  from torch_on_tpu.errors import TorchOnTpuError, named
  from torch_on_tpu.training import lr_schedule, optimizers

  schedule = lambda lr: lr_schedule.warmup_stable_decay(  # noqa: E731
    lr, flags.steps, warmup_steps=flags.warmup_steps, decay_ratio=flags.decay_ratio, decay=flags.lr_decay, min_lr_factor=flags.min_lr_factor,
  )
  # --adam_states (bf16 weights: bf16): the moments stored in that dtype and computed in fp32, the hyperparameters too
  # (inject_hyperparams would cast them to bf16 weights' dtype: β2=0.999 becomes 1, 0.95 becomes 0.949); fp32
  # weights without it: optax's AdamW as ever (older checkpoints' tree)
  state_dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(flags.adam_states) or (
    jnp.bfloat16 if flags.dtype == "bfloat16-all" else None)
  wide = dict(hyperparam_dtype=jnp.float32) if state_dtype else {}
  if not flags.param_groups:
    settings = dict(learning_rate=schedule(flags.lr), b1=flags.beta1, b2=flags.beta2, eps=flags.eps, weight_decay=flags.weight_decay)
    if not state_dtype:
      return optax.inject_hyperparams(optax.adamw)(**settings)
    return optax.inject_hyperparams(optimizers.adamw, static_args=("state_dtype",), **wide)(**settings, state_dtype=state_dtype)
  if lora:
    raise TorchOnTpuError(f"{named('param_groups')} with LoRA: the adapters alone train, with one AdamW; drop one of the two.")
  base = dict(lr=flags.lr, beta1=flags.beta1, beta2=flags.beta2, eps=flags.eps, weight_decay=flags.weight_decay)
  groups = [{**base, **group} for group in json.loads(flags.param_groups)]
  odd = [g["pattern"] for g in groups if (g["beta1"], g["beta2"], g["eps"]) != (flags.beta1, flags.beta2, flags.eps)]
  if odd:
    raise TorchOnTpuError(
      f"{named('param_groups')}: the group {odd[0]!r} has its own betas or eps; the groups here differ in lr and "
      f"weight_decay only (one Adam for all), so give every group --beta1, --beta2 and --eps's values."
    )
  patterns = [re.compile(g["pattern"]) for g in groups]
  layout = jm.stored_layout()

  def group_of(key: str) -> dict:
    names = layout[key][0] if key in layout else [key]  # a scan-stacked array: its layers' own names
    found = {next((i for i, p in enumerate(patterns) if p.search(name)), len(groups)) for name in names}
    if len(found) > 1:
      raise TorchOnTpuError(
        f"{named('param_groups')} puts the layers {key} stacks in different groups ({names[0]}, …); "
        f"give every layer's parameter the same group, or pass --scan=false."
      )
    return found.pop()

  chosen = {key: group_of(key) for key in jm.params}
  unmatched = [p.pattern for i, p in enumerate(patterns) if i not in chosen.values()]
  if unmatched:
    raise TorchOnTpuError(f"{named('param_groups')}: the pattern {unmatched[0]!r} matches no parameter of the model; fix or drop it.")
  setting = lambda key, name: ([*groups, base][chosen[key]])[name]  # noqa: E731
  decay = optax.stateless(lambda u, p: {k: v + setting(k, "weight_decay") * p[k].astype(v.dtype) for k, v in u.items()})  # in the update's precision
  step_size = optax.stateless(lambda u, p: {k: v * (setting(k, "lr") / flags.lr) for k, v in u.items()})
  return optax.chain(
    optimizers.scale_by_adam(b1=flags.beta1, b2=flags.beta2, eps=flags.eps, state_dtype=state_dtype), decay,
    optax.inject_hyperparams(optax.scale_by_learning_rate, **wide)(learning_rate=schedule(flags.lr)), step_size,
  )


def _loss(outputs, labels):
  import torch

  logits = outputs.logits if hasattr(outputs, "logits") else outputs
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def answer_labels(labels):
  """Chat data's labels for `answer_loss`: the labels, and per row the global batch's answer tokens
  over its rows (N/B), so that a microbatch of b rows knows it stands for b·N/B of the N tokens."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  rows = labels.shape[0]
  if isinstance(labels, jax.ShapeDtypeStruct):
    return {"labels": labels, "answer_tokens": jax.ShapeDtypeStruct((rows,), jnp.float32)}
  share = lambda y: jnp.broadcast_to(jnp.sum(y != -100) / rows, (rows,)).astype(jnp.float32)  # noqa: E731
  sharding = getattr(labels, "sharding", None)
  if isinstance(sharding, NamedSharding):  # the rows' share laid out as the rows are
    spec = PartitionSpec(sharding.spec[0] if len(sharding.spec) else None)
    return {"labels": labels, "answer_tokens": jax.jit(share, out_shardings=NamedSharding(sharding.mesh, spec))(labels)}
  return {"labels": labels, "answer_tokens": share(jnp.asarray(labels))}


def answer_loss(outputs, labels):
  """Chat data's loss: the answer tokens' summed cross-entropy over the answer tokens its rows stand
  for. That is the global batch's token mean (torchtitan's), exactly, for the whole batch and for
  --grad_accum's microbatches alike (the step averages k microbatch losses, each then k·s_i/N); a
  batch without answer tokens has loss 0 and no gradient, not NaN (the loader never makes one)."""
  import torch

  logits = outputs.logits if hasattr(outputs, "logits") else outputs
  total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels["labels"].flatten(), reduction="sum")
  share = labels["answer_tokens"].sum()
  return total / torch.where(share > 0, share, torch.ones_like(share))


def _run_error_message(error, memory, report, config: dict) -> str | None:
  """One sentence for a storage fault that reached the recipe untranslated (the writers
  the run knows name their own path) or a device out-of-memory; None for anything else.
  A full disk is RESOURCE_EXHAUSTED too, so the errno is asked first."""
  from torch_on_tpu.core import storage
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
