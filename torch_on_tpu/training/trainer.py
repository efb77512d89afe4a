"""The training loop: feed batches to a compiled step, watch it, stop it safely.

    step = tot.make_train_step(model, loss_fn, optax.adamw(3e-4))
    summary = tot.Trainer(step, batches, steps=1000, log_dir="runs/demo").run()

Read `Trainer.run` top to bottom: it is the whole loop. Each step dispatches the
compiled program and only then reads the *previous* step's metrics, so the
host never stalls the device between steps; it reads the current step at once
when something depends on it (a checkpoint, an eval, a stop, the last step).

With `eval_data`, a fresh run (step 0) is evaluated before its first step,
then every `eval_every` steps and at the last step.

Process 0 alone prints and writes logs: a progress bar (loss, learning rate,
tokens/s, MFU, step time), `metrics.jsonl` and TensorBoard scalars, an optional `jax.profiler`
trace of steps N..M (every K steps, as torchtitan's profiler) under `log_dir/profile`, and at the end `training.png` and
a one-line summary.

No non-finite state is saved: the step reports `nonfinite` when its loss,
gradient norm or updated state holds a NaN or Inf, and the Trainer reads it
before every save. A step built with `skip_nonfinite=True` has already kept
the old state when the loss or gradient norm was not finite (counted as
`skipped`); the run stops after `max_skips` skipped steps in a row, or at once
when an update made the state non-finite from finite gradients (a learning rate
or optimizer setting, which skipping would only repeat). Without it, the first
non-finite step stops the run. Every stop is a `TorchOnTpuError` naming the
step and the newest saved step.

Token ids are checked where they enter: a host batch whose `input_ids` (or
`labels`, -100 aside) fall outside the model's embedding rows raises, naming
the id and its position; under jit an out-of-range id would be clamped or
turned into NaN instead of torch's IndexError.

Checkpointing is duck-typed (`torch_on_tpu.io.checkpoint.Checkpointer` fits):

    checkpointer.should_save(step) -> bool                 # asked after every step
    checkpointer.save(step, state, *, data, config, force)  # state: a TrainState dict
    checkpointer.wait()                                    # optional: finish async saves

`data` is the data iterator's `state()` (None if it has none), `config` the
Trainer's `run_config`. `save` must copy what it needs before returning: the
next step donates the arrays of `state`. `stop_requested(step) -> bool` (e.g.
`PreemptionGuard.should_stop`) is asked after every step; when it says yes the
loop saves with `force=True` and returns with `summary["preempted"]`.
"""

from __future__ import annotations

import math
import pathlib
import statistics
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from tqdm.auto import tqdm

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.runtime import fingerprint, health
from torch_on_tpu.training import metrics as metrics_lib
from torch_on_tpu.training.step import TrainStep


class Trainer:
  """Runs a `TrainStep` over a data iterator.

  Args:
    train_step: from `make_train_step`; training resumes at its `step_count`.
    data: yields batches: dicts with `input_ids`, `labels` (and optionally
      `positions`) of numpy/torch/jax arrays, or whatever `split_batch` takes.
      If it has `state()` (a resumable data iterator), that goes into checkpoints.
    steps: the step number to stop at.
    log_dir: where process 0 writes logs; None writes none.
    split_batch: `batch → (inputs, labels)` for the step; the default passes
      `input_ids` (and `positions`) the way torchtitan's and HF's models take them.
    to_global: `batch → batch` of global jax arrays (multi-host data); by default
      the step places host arrays itself, which assumes every process holds the
      whole global batch.
    eval_data: a re-iterable (list, or a callable returning a fresh iterator)
      of validation batches; `eval_every` steps, `eval_batches` of them are averaged.
    profile_steps: `(first, last)` steps to trace with `jax.profiler` into
      `profile_dir` (default `log_dir/profile`; open it in TensorBoard's profile tab or Perfetto).
    profile_every: the same window again every this many steps (torchtitan's `profile_freq`),
      each window's trace into `profile_dir/iteration_<its last step>` as torchtitan names them.
    checkpointer, stop_requested: see the module docstring.
    max_skips: consecutive steps skipped for a non-finite loss or gradient
      (`skip_nonfinite=True`) after which the run stops; one bad batch is
      survived, a diverged run is not.
    run_config: a JSON-able dict saved with every checkpoint.
    flops_per_token: for MFU; inferred for torchtitan/HF models, else MFU is not shown.
    peak_flops: FLOP/s of all devices together; default: the datasheet peak of a known
      accelerator (`metrics.peak_flops_for_kind`). On CPU no MFU is shown unless it is given:
      a CPU has no peak a user could read an MFU against.
    progress: show the progress bar.
    wandb: `wandb.init`'s `project` (and `name`, `config`): every logged metric also goes to
      that Weights & Biases run, under `log_dir/wandb` (the same run when a run resumes); or a
      run `metrics.start_wandb` started (the recipes start it before compiling).
  """

  def __init__(
    self,
    train_step: TrainStep,
    data: Iterable,
    *,
    steps: int,
    log_dir=None,
    split_batch: Callable | None = None,
    to_global: Callable | None = None,
    eval_data=None,
    eval_every: int = 0,
    eval_batches: int = 8,
    profile_steps: tuple[int, int] | None = None,
    profile_every: int | None = None,
    profile_dir=None,
    checkpointer=None,
    stop_requested: Callable[[int], bool] | None = None,
    max_skips: int = 5,
    run_config: dict | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    progress: bool = True,
    wandb=None,
  ):
    if max_skips < 1:
      raise TorchOnTpuError(f"max_skips must be at least 1, got {max_skips}.")
    if profile_steps is not None and log_dir is None and profile_dir is None:
      raise TorchOnTpuError("profile_steps needs a log_dir or profile_dir to write the trace into; pass one.")
    self.train_step = train_step
    self.data = data
    self.steps = steps
    self.log_dir = log_dir
    self.split_batch = split_batch or (lambda batch: default_split(train_step.model, batch))
    self.to_global = to_global or (lambda batch: batch)
    self.eval_data = eval_data
    self.eval_every = eval_every
    self.eval_batches = eval_batches
    self.profile_steps = profile_steps
    self.profile_every = profile_every
    self.profile_dir = pathlib.Path(profile_dir) if profile_dir is not None else pathlib.Path(log_dir or ".") / "profile"
    self.checkpointer = checkpointer
    self.stop_requested = stop_requested or (lambda step: False)
    self.max_skips = max_skips
    self.run_config = run_config
    self.flops_per_token = flops_per_token
    self.peak_flops = peak_flops
    self.progress = progress
    self.wandb = wandb
    self.is_main = jax.process_index() == 0
    self._vocab = _embedding_rows(getattr(train_step.model, "module", None))
    self.records: list[dict] = []  # what was logged, also on processes that write nothing

  def run(self) -> dict:
    """Trains until `steps` (or the data ends, or a stop is requested); returns a summary."""
    step = first_step = self.train_step.step_count
    fingerprint.check_same(config=self.run_config, data=getattr(self.data, "settings", None))
    self._check_start_finite(step)
    self._log = metrics_lib.RunLog(self.log_dir, start_step=step, wandb=self.wandb) if self.is_main and self.log_dir else None
    self._bar = tqdm(
      total=self.steps, initial=step, disable=not (self.is_main and self.progress), dynamic_ncols=True
    )
    self._clock = _StepClock(self.train_step)
    self._saved_step = first_step  # a resumed run's first state is already saved
    self._skips = 0  # skipped steps in a row
    data = iter(self.data)
    pending = None  # (step, metrics, labels) dispatched but not read yet
    preempted = False
    evaluating = self.eval_data is not None and bool(self.eval_every)
    tracing = False
    try:
      if evaluating and step == 0:
        self._evaluate(step)  # where the curves start
      while step < self.steps:
        batch = next(data, None)
        if batch is None:
          break
        if self._profiling_starts(step + 1):
          jax.profiler.start_trace(str(self._trace_dir(step + 1)))
          tracing = True
        _check_token_ids(batch, self._vocab, step + 1)
        health.doing(f"running step {step + 1}")
        inputs, labels = self.split_batch(self.to_global(batch))
        self.train_step(inputs, labels)
        step += 1
        if pending is not None:
          self._record(*pending)  # the previous step; this one runs meanwhile
        pending = (step, self.train_step.metrics, labels)

        save_due = self.checkpointer is not None and self.checkpointer.should_save(step)
        eval_due = evaluating and (step % self.eval_every == 0 or step == self.steps)
        profile_ends = self._profiling_ends(step)
        stop = self.stop_requested(step)
        if save_due or eval_due or profile_ends or stop or step == self.steps:
          self._record(*pending)  # raises on a non-finite state, so one is never saved
          pending = None
        if profile_ends and tracing:
          jax.profiler.stop_trace()
          tracing = False
        if eval_due:
          self._evaluate(step)
        if save_due or stop:
          self._save(step, force=stop)
        if stop:
          preempted = True
          break
      if pending is not None:
        self._record(*pending)
      self._save(step, force=True)
    finally:
      if tracing:  # the run ended inside a traced window: what was traced is kept
        jax.profiler.stop_trace()
      self._bar.close()
      if self.checkpointer is not None and hasattr(self.checkpointer, "wait"):
        self.checkpointer.wait()
      if self._log is not None:
        self._log.close()
    return self._summary(step, preempted)

  # ---- bookkeeping --------------------------------------------------------------------

  def _record(self, step, metrics, labels) -> None:
    """Reads a finished step's metrics (waiting for it), checks they are finite, logs."""
    values = {k: float(v) for k, v in metrics.items()}  # waits for that step
    seconds = self._clock.lap()
    self._check_finite(step, values)
    shape = max(jax.tree.leaves(labels), key=jnp.ndim).shape  # the token labels [rows, seqlen], beside any per-row leaf
    values["step_time"] = seconds
    values["tokens_per_second"] = math.prod(shape) / seconds
    values["mfu"] = self._mfu(values["tokens_per_second"], shape[-1])
    self._write(step, values)
    self._bar.update(step - self._bar.n)
    postfix = {"loss": f"{values['loss']:.4f}"}
    if "learning_rate" in values:
      postfix["lr"] = f"{values['learning_rate']:.2e}"
    postfix["tok/s"] = f"{values['tokens_per_second']:,.0f}"
    if values["mfu"] is not None:
      postfix["mfu"] = f"{100 * values['mfu']:.1f}%"
    postfix["step"] = f"{seconds:.3f}s"
    self._bar.set_postfix(postfix, refresh=False)

  def _check_start_finite(self, step: int) -> None:
    """A state that is non-finite before any step (e.g. an lr that overflows float32 in the
    optimizer state) would be kept by every skip and saved: refuse it up front."""
    state = self.train_step.state
    leaves = [
      (path, x)
      for path, x in jax.tree_util.tree_flatten_with_path({"params": state["params"], "opt_state": state["opt_state"]})[0]
      if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    finite = _all_finite_each([x for _, x in leaves])
    bad = [jax.tree_util.keystr(path, simple=True, separator="/") for (path, _), ok in zip(leaves, finite) if not ok]
    if bad:
      raise TorchOnTpuError(
        f"The training state holds NaN or Inf before step {step + 1} ({len(bad)} arrays, e.g. {bad[0]}); "
        f"nothing was trained or saved; check the learning rate and other hyperparameters are finite in "
        f"float32 (below 3.4e38), and the weights or checkpoint it starts from."
      )

  def _check_finite(self, step, values) -> None:
    """Counts skipped steps; raises on a non-finite state or too many skips in a row."""
    fix = "lower the learning rate, set clip_norm, or check the data"
    saved = (
      f"the newest saved step is {self._saved_step}"
      if self.checkpointer is not None and self._saved_step
      else "no checkpoint was saved by this run"
    )
    if "skipped" in values:
      self._skips = self._skips + 1 if values["skipped"] else 0
      if self._skips >= self.max_skips:
        raise TorchOnTpuError(
          f"Steps {step - self._skips + 1} to {step} all had a non-finite loss or gradient norm "
          f"(loss {values['loss']}) and were skipped, {self.max_skips} in a row (max_skips); "
          f"stopped with the state of step {step - self._skips}, {saved}; {fix}."
        )
      if values.get("nonfinite", 0) and not values["skipped"]:
        raise TorchOnTpuError(
          f"Step {step}'s update made the training state non-finite from a finite loss ({values['loss']}) "
          f"and gradient norm ({values.get('grad_norm')}), which skipping cannot mend; stopped without "
          f"saving it, {saved}; check the learning rate and the optimizer's hyperparameters (eps > 0)."
        )
    elif values.get("nonfinite", 0) or not math.isfinite(values["loss"]):
      raise TorchOnTpuError(
        f"Step {step} made the training state non-finite (loss {values['loss']}, gradient norm "
        f"{values.get('grad_norm')}); stopped without saving it, {saved}; {fix}, or build the "
        f"step with skip_nonfinite=True."
      )

  def _write(self, step, values) -> None:
    self.records.append({"step": step, **values})
    if self._log is not None:
      self._log.log(step, values)

  def _mfu(self, tokens_per_second, seqlen):
    if self.flops_per_token is None:
      try:
        self.flops_per_token = metrics_lib.flops_per_token(self.train_step.model, seqlen).torchtitan
      except TorchOnTpuError:
        self.flops_per_token = 0.0  # not a model we can count: no MFU
    if self.peak_flops is None:
      devices = list(self.train_step.model.mesh.devices.flat)
      self.peak_flops = 0.0 if devices[0].platform == "cpu" else metrics_lib.peak_flops(devices) or 0.0
    if not self.flops_per_token or not self.peak_flops:
      return None
    return metrics_lib.mfu(tokens_per_second, self.flops_per_token, self.peak_flops)

  def _evaluate(self, step: int) -> None:
    health.doing(f"evaluating at step {step}")
    batches = self.eval_data() if callable(self.eval_data) else iter(self.eval_data)
    losses = [
      self.train_step.evaluate(*self.split_batch(self.to_global(batch)))
      for _, batch in zip(range(self.eval_batches), batches)
    ]
    if losses:
      eval_loss = float(np.mean([float(x) for x in losses]))
      self._write(step, {"eval_loss": eval_loss})
      if self.is_main and self.progress:
        tqdm.write(f"step {step}: eval loss {eval_loss:.4f}")
    self._clock.pause()  # evaluation time is not step time

  def _save(self, step: int, *, force: bool) -> None:
    if self.checkpointer is None or step == self._saved_step:
      return
    data_state = self.data.state() if hasattr(self.data, "state") else None
    self.checkpointer.save(step, self.train_step.state, data=data_state, config=self.run_config, force=force)
    self._saved_step = step
    self._clock.pause()  # the blocking part of a save is not step time

  def _profiling_starts(self, step: int) -> bool:
    return self._profiled(step, 0)

  def _profiling_ends(self, step: int) -> bool:
    return self._profiled(step, 1)

  def _profiled(self, step: int, end: int) -> bool:
    """Whether `step` is the first (`end` 0) or last (1) of a profiled window."""
    if not self.profile_steps or not self.is_main:
      return False
    mark = self.profile_steps[end]
    if self.profile_every:
      return step >= mark and (step - mark) % self.profile_every == 0
    return step == mark

  def _trace_dir(self, first: int) -> pathlib.Path:
    """Where the window starting at `first` is traced: `profile_dir`, or with `profile_every` its
    `iteration_<last step>` folder."""
    if not self.profile_every:
      return self.profile_dir
    return self.profile_dir / f"iteration_{first + self.profile_steps[1] - self.profile_steps[0]}"

  def _summary(self, step: int, preempted: bool) -> dict:
    train = [r for r in self.records if "loss" in r]
    steady = train[1:] or train  # a run's first step waits for its compilation
    evals = [r for r in self.records if "eval_loss" in r]
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    summary = {
      "steps": step,
      "preempted": preempted,
      "final_loss": train[-1]["loss"] if train else None,
      # the eval of the last step only: a preempted run's last eval is older (in `last_eval`)
      "final_eval_loss": evals[-1]["eval_loss"] if evals and evals[-1]["step"] == step else None,
      "last_eval": {"step": evals[-1]["step"], "loss": evals[-1]["eval_loss"]} if evals else None,
      "median_step_time": statistics.median(r["step_time"] for r in steady) if steady else None,
      "median_tokens_per_second": (
        statistics.median(r["tokens_per_second"] for r in steady) if steady else None
      ),
      "median_mfu": statistics.median(mfus) if mfus else None,
      "compile_seconds": self.train_step.compile_seconds,  # ahead-of-time compiles included
    }
    if self.is_main:
      if self._log is not None and train and self._log.can_plot:
        summary["plot"] = str(self._log.plot())
      print(summary_line(summary), flush=True)
    return summary


class _StepClock:
  """Wall time per step, without the host time spent compiling, evaluating or saving."""

  def __init__(self, train_step: TrainStep):
    self._train_step = train_step
    self._compiled = train_step.compile_seconds
    self._last = time.perf_counter()

  def lap(self) -> float:
    """Seconds since the last lap or pause, less compilations that happened meanwhile."""
    now = time.perf_counter()
    compiled = self._train_step.compile_seconds
    seconds = now - self._last - (compiled - self._compiled)
    self._last, self._compiled = now, compiled
    return max(seconds, 1e-9)

  def pause(self) -> None:
    self._last = time.perf_counter()
    self._compiled = self._train_step.compile_seconds


def summary_line(summary: dict) -> str:
  parts = [f"{'preempted after' if summary['preempted'] else 'trained'} {summary['steps']} steps"]
  if summary["final_loss"] is not None:
    parts.append(f"final loss {summary['final_loss']:.4f}")
  if summary.get("final_eval_loss") is not None:
    parts.append(f"eval loss {summary['final_eval_loss']:.4f}")
  elif summary.get("last_eval"):
    parts.append(f"last eval loss {summary['last_eval']['loss']:.4f} (step {summary['last_eval']['step']})")
  if summary["median_tokens_per_second"] is not None:
    parts.append(f"{summary['median_tokens_per_second']:,.0f} tok/s")
    parts.append(f"step {summary['median_step_time']:.3f} s")
  if summary["median_mfu"] is not None:
    parts.append(f"MFU {100 * summary['median_mfu']:.1f}%")
  parts.append(f"compile {summary['compile_seconds']:.1f} s")
  return ", ".join(parts)


@jax.jit
def _all_finite_each(arrays: list) -> list:
  return [jnp.isfinite(x).all() for x in arrays]


def _embedding_rows(module) -> int | None:
  """The vocabulary size the model's first embedding takes (None: no embedding)."""
  if not isinstance(module, torch.nn.Module):
    return None
  return next((m.num_embeddings for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)


def _check_token_ids(batch, vocab: int | None, step: int) -> None:
  """Host token ids outside `[0, vocab)` (labels may also be -100, ignored) raise, naming one."""
  if vocab is None or not isinstance(batch, dict):
    return
  for key in ("input_ids", "labels"):
    ids = batch.get(key)
    if ids is None or isinstance(ids, jax.Array) or not hasattr(ids, "shape"):
      continue  # global arrays on the mesh are not read back
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= vocab)
    if key == "labels":
      bad &= ids != -100
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise TorchOnTpuError(
        f"The batch for step {step} holds token id {int(ids[where])} at {key}{list(where)}, outside the "
        f"model's vocabulary of {vocab}; check that the tokenizer and the data match the model."
      )


def default_split(model, batch):
  """`{input_ids, labels[, positions, segment_ids]}` → (inputs, labels), inputs as the
  model's family calls it (`Family.model_inputs`)."""
  if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
    raise TorchOnTpuError(
      "The default Trainer batch is a dict with 'input_ids' and 'labels'; pass "
      "split_batch=lambda batch: (inputs, labels) for other layouts."
    )
  return model.family.model_inputs(model.module, batch), batch["labels"]


