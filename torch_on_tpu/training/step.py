"""`make_train_step`: forward, backward and optimizer update as one compiled program.

    step = tot.make_train_step(model, loss_fn, optax.adamw(3e-4))
    loss = step(tokens, labels)        # model.params and step.opt_state are updated

Why not torchax's own `make_train_step`: it is not jitted as a whole and ignores
its remat policy. Here the whole step is one `jax.jit` with explicit in/out
shardings (params and optimizer state keep the parameter sharding, scalars are
replicated, the batch is split over the data axes) and donated state, so the
Python loop only feeds batches.

Conventions:

* `inputs` is what the model is called with: a tensor (`model(x)`), a tuple or
  list (`model(*inputs)`), or a dict (`model(**inputs)`), e.g.
  `(tokens, positions)` for torchtitan's Llama 3, `{"input_ids": ids}` for HF.
  Leaves may be torch tensors, numpy arrays or jax arrays (host ones are placed
  on the mesh with the batch dim over the data axes); other leaves (`False`,
  `None`, strings) are static flags. `labels` is any pytree of arrays.
* `loss_fn(outputs, labels)` is plain torch code returning a scalar tensor. It
  sees the model's floating outputs in fp32 (cast up if the model computes in
  bf16), and the step returns that loss in fp32. `F.cross_entropy` inside it
  runs `losses.cross_entropy` (vocabulary-chunked, no fp32 log-softmax of the
  whole logits), which reads bf16 logits directly when the loss passes it the
  fp32 view of them (reshaped or sliced): no fp32 copy of the logits is built.
* `grad_accum=k` splits the batch dim of every input and label into k
  microbatches (row i goes to microbatch i mod k, which keeps each microbatch
  spread over all data shards), runs them in a `lax.scan` inside the same
  program and averages loss and gradients: the full-batch gradient whenever
  `loss_fn` is a mean over equal-sized microbatches. With pipeline stages (a
  `pp` mesh axis) each of the k pieces is cut again into the pipeline's
  microbatches and runs one whole pipeline pass, fill and drain included: for
  the bubble, raise the pipeline's microbatches rather than k.
* Mixed precision: `compute_dtype=jnp.bfloat16` casts floating params to bf16
  inside the step (forward and backward in bf16) while master weights,
  gradients and optimizer state stay fp32; `master_dtype=jnp.bfloat16` stores
  the params (and so the optimizer state) in bf16 too ("all bf16"; compute then
  defaults to bf16). Gradient accumulation sums in fp32 either way.
* `clip_norm` scales gradients by `min(1, clip_norm / (norm + 1e-6))`, exactly
  `torch.nn.utils.clip_grad_norm_`.
* Randomness (dropout): step n runs with `fold_in(rng, n)` as torchax's PRNG key
  (and microbatch i of it with a further `fold_in(..., i)`), so every step draws
  fresh masks and a run is reproducible from `seed`.
* `trainable=` (glob patterns over parameter names, as in sharding maps, or a
  predicate `name → bool`) trains a subset, e.g. LoRA adapters: the other
  params get no gradient and no optimizer state, are neither donated nor
  written, and keep their values bit for bit.
* Metrics (`step.metrics`, jax scalars): `loss`, `grad_norm` (before clipping)
  and `learning_rate`, read from the optimizer state when the optimizer carries
  it (`optax.inject_hyperparams`) or else computed from `learning_rate=` (a
  float or an optax schedule evaluated at the step count); `nonfinite` is 1
  when the loss, the gradient norm or the updated params or optimizer state
  hold a NaN or Inf.
* `skip_nonfinite=True` keeps the old params and optimizer state whenever the
  loss or the gradient norm holds a NaN or Inf (decided inside the compiled
  step before the update, so a bad batch never reaches the state, nor a
  checkpoint); `skipped` counts it. An update that is not finite from finite
  gradients is applied and reported by `nonfinite` with `skipped` 0. Without
  it the step applies every update like torch does and `nonfinite` tells the
  caller (the `Trainer` stops before saving such a state).

State for checkpoints: `step.state` is a `TrainState`, a plain dict
`{"params", "buffers", "opt_state", "rng", "step"}` of arrays; assigning
`step.state = restored` puts one back (in this run's shardings, checked for
the same names and shapes); `step.abstract_state()` gives the restore target.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError, arg
from torch_on_tpu.lowering import aten, device_checks, op_table, refusals, target_device
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.parallel import targets
from torch_on_tpu.training import batch as batch_lib
from torch_on_tpu.training import compile_report, gradients, losses
from torch_on_tpu.wrapper.module import ShardedModule

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402
from torchax.ops import mappings  # noqa: E402

logger = logging.getLogger(__name__)


class TrainState(TypedDict):
  """Everything a resumed run needs besides the data position: a plain dict pytree.

  `params` is the ShardedModule's params dict; `buffers` its buffers dict
  (running statistics and counters a forward wrote: a resume must continue
  from them, not from their initial values); `rng` a raw uint32 key
  (`jax.random.PRNGKey`) that step n folds n into; `step` the number of
  completed steps (an int32 scalar array, so every leaf is an array).
  """

  params: dict
  buffers: dict
  opt_state: Any
  rng: jax.Array
  step: jax.Array


def make_train_step(
  model: ShardedModule,
  loss_fn: Callable,
  optimizer: optax.GradientTransformation,
  *,
  forward_remat: str | None = None,
  grad_accum: int = 1,
  clip_norm: float | None = None,
  compute_dtype=None,
  master_dtype=None,
  donate: bool = True,
  seed: int = 0,
  learning_rate: float | Callable | None = None,
  trainable: str | Sequence[str] | Callable[[str], bool] | None = None,
  skip_nonfinite: bool = False,
  check_indices: bool = True,
  fuse_head: bool = False,
  remat: str | None = None,
) -> "TrainStep":
  """The compiled training step for `model` (see the module docstring for conventions).

  Args:
    model: a `ShardedModule` (abstract ones can only `compile`).
    loss_fn: `loss_fn(outputs, labels)` → scalar torch tensor.
    optimizer: any optax `GradientTransformation` (schedules included).
    forward_remat: a policy name from `torch_on_tpu.lowering.remat.NAMES` for the whole
      forward as one `jax.checkpoint` (per-layer remat is `ShardedModule(remat=)`).
    grad_accum: microbatches per step.
    clip_norm: max global gradient norm, or None.
    compute_dtype: dtype of the forward/backward (e.g. `jnp.bfloat16`).
    master_dtype: dtype the params (and optimizer state) are stored in.
    donate: reuse the memory of the old params and optimizer state.
    seed: seeds the per-step PRNG keys (dropout).
    learning_rate: only for the `learning_rate` metric when the optimizer
      state does not carry it: a float or a schedule `step → lr`.
    trainable: the params to train (glob patterns or a predicate over
      `model.params` names); None trains all of them.
    skip_nonfinite: keep the state unchanged on a step whose loss or gradient
      norm is not finite (metric `skipped`).
    check_indices: check embedding ids, gather / index_select indices and
      cross-entropy targets inside the step, as torch does (`device_checks`: a
      bad one leaves the state unchanged and raises); False leaves them
      unchecked (an out-of-range id then reads a clamped or NaN row).
    fuse_head: where the model's output is a bias-free linear's (its output head) and the
      loss takes `F.cross_entropy` of it, the loss reads that linear's input and weight,
      chunk by chunk (`losses.head_cross_entropy`): neither the [tokens, vocab] logits nor
      their gradient are kept, for one more pass of the head's matmul in the backward. The
      default keeps the logits.
    remat: the former name of `forward_remat` (deprecated).
  """
  if remat is not None:
    warnings.warn(
      "make_train_step(remat=) is now forward_remat= (the per-layer policy is ShardedModule(remat=)); "
      "the old name will go.",
      DeprecationWarning,
      stacklevel=2,
    )
    if forward_remat is not None:
      raise TorchOnTpuError("Pass forward_remat= only (remat= is its former name), not both.")
    forward_remat = remat
  return TrainStep(
    model,
    loss_fn,
    optimizer,
    forward_remat=forward_remat,
    grad_accum=grad_accum,
    clip_norm=clip_norm,
    compute_dtype=compute_dtype,
    master_dtype=master_dtype,
    donate=donate,
    seed=seed,
    learning_rate=learning_rate,
    trainable=trainable,
    skip_nonfinite=skip_nonfinite,
    check_indices=check_indices,
    fuse_head=fuse_head,
  )


class TrainStep:
  """Callable train step holding the optimizer state; built by `make_train_step`."""

  def __init__(
    self,
    model,
    loss_fn,
    optimizer,
    *,
    forward_remat,
    grad_accum,
    clip_norm,
    compute_dtype,
    master_dtype,
    donate,
    seed,
    learning_rate,
    trainable=None,
    skip_nonfinite=False,
    check_indices=True,
    fuse_head=False,
  ):
    if not isinstance(model, ShardedModule):
      raise TorchOnTpuError(
        f"make_train_step needs a ShardedModule, got {type(model).__name__}; wrap the "
        f"model with tot.ShardedModule(model, mesh=...) first."
      )
    if not callable(loss_fn):
      raise TorchOnTpuError("make_train_step's loss_fn must be callable as loss_fn(outputs, labels).")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
      raise TorchOnTpuError(
        f"make_train_step's optimizer must be an optax GradientTransformation (with init and "
        f"update), got {type(optimizer).__name__}."
      )
    if not isinstance(grad_accum, int) or grad_accum < 1:
      raise TorchOnTpuError(f"grad_accum must be a positive integer, got {grad_accum!r}.")
    if clip_norm is not None and not clip_norm > 0:
      raise TorchOnTpuError(f"clip_norm must be positive or None, got {clip_norm!r}.")
    if forward_remat is not None:
      remat_lib.check(forward_remat)  # an unknown name fails here, not at the first step
      if remat_lib.named(forward_remat) is not None:
        raise TorchOnTpuError(
          f"forward_remat={forward_remat!r} names a layer's modules, which only a layer stack's remat reads; pass it "
          f"as ShardedModule(remat={forward_remat!r}), or one of {', '.join(remat_lib.NAMES)} here."
        )
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.forward_remat = forward_remat
    self.grad_accum = grad_accum
    self.clip_norm = clip_norm
    self.master_dtype = _float_dtype(master_dtype, "master_dtype")
    self.compute_dtype = _float_dtype(compute_dtype, "compute_dtype") or self.master_dtype
    self.donate = donate
    self.learning_rate = learning_rate
    self.skip_nonfinite = skip_nonfinite
    self.check_indices = check_indices
    self.fuse_head = fuse_head
    self._replicated = NamedSharding(model.mesh, PartitionSpec())
    self._abstract = any(isinstance(v, jax.ShapeDtypeStruct) for v in model.params.values())
    if self.master_dtype is not None:
      self._cast_params(self.master_dtype)
    self.trainable = gradients.trainable_names(model.params, trainable)

    param_shardings, _ = self._split(model.param_shardings)
    trained, _ = self._split(model.params)
    abstract_opt = jax.eval_shape(optimizer.init, batch_lib.abstract(trained))
    self.opt_state_shardings = optax.tree_map_params(
      optimizer,
      lambda leaf, sharding: sharding if leaf.ndim else self._replicated,
      abstract_opt,
      param_shardings,
      transform_non_params=lambda _: self._replicated,
    )
    if self._abstract:
      self.opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_opt,
        self.opt_state_shardings,
      )
    else:
      self.opt_state = jax.jit(optimizer.init, out_shardings=self.opt_state_shardings)(trained)
    if self._abstract:  # nothing is transferred for a step that only compiles (a compile-only target has no memory)
      self.rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self._replicated)
    else:
      self.rng = jax.device_put(jax.random.PRNGKey(seed), self._replicated)
    self.step_count = 0
    self.metrics: dict[str, jax.Array] = {}
    self.last_compile: compile_report.CompileReport | None = None
    self.compile_seconds = 0.0  # all compilations of this step so far
    self._executables: dict = {}  # signature → compiled step
    self._reports: dict = {}  # signature → its CompileReport
    self._signature = None  # the signature the last step ran with
    self._eval_fns: dict = {}
    self._gradient_fns: dict = {}
    self._pending: device_checks.Pending | None = None  # the last step's index checks, unread
    self._check_messages: dict = {}  # a program's signature → its index checks' messages
    self._traced_messages: list | None = None  # (message, error type) per check, set while the loss is traced
    self._reached: dict[str, bool] = {}  # param name → the loss reaches it (set while tracing)

  # ---- running ----------------------------------------------------------------------

  def __call__(self, inputs, labels) -> torch.Tensor:
    """One optimizer step on a global batch; returns the loss as a torch scalar
    tensor (fp32, on device, like the forward's outputs: `.item()` or `float()`
    waits for it; `step.metrics` holds it as a jax array)."""
    if self._abstract:
      raise TorchOnTpuError(
        "This train step's model is abstract (ShardedModule(..., abstract=True)); it can "
        "only .compile(); build the model without abstract=True to train."
      )
    self._raise_failed_check()  # the previous step's, before another update is applied
    leaves, static = self._split_batch(self._place((inputs, labels)))
    compiled = self._executable(leaves, static)
    trained, frozen = self._split(self.model.params)
    loss, trained, opt_state, metrics, changed, checks = compiled(
      trained, frozen, self.model.buffers, self.opt_state, leaves, self.rng, np.int32(self.step_count)
    )
    self.model.params.update(trained)
    self.model.buffers.update(changed)
    self.opt_state = opt_state
    self.metrics = metrics
    self.step_count += 1
    loss = torch_view(loss)
    messages = self._check_messages[self._signature]
    if messages:
      self._pending = device_checks.Pending(
        checks, messages, prefix=f"step {self.step_count - 1} was not applied: ", on_failure=self._undo_step_count
      )
      device_checks.attach([loss], self._pending)
    return loss

  def _raise_failed_check(self) -> None:
    """Raises a failed index check of the last step (whose update the program did not apply)."""
    pending, self._pending = self._pending, None
    if pending is not None:
      pending.raise_if_failed()

  def _undo_step_count(self) -> None:
    self.step_count -= 1

  def _raise_now(self, key, checks) -> None:
    """Raises a failed index check of an eval / gradients program (whose messages were
    recorded if this call traced it)."""
    if self._traced_messages is not None:
      self._check_messages[key] = self._traced_messages
    messages = self._check_messages.get(key)
    if messages:
      device_checks.Pending(checks, messages).raise_if_failed()

  def compile(self, inputs, labels) -> compile_report.CompileReport:
    """Lowers and compiles the step for these inputs ahead of time.

    Leaves may be real arrays or `jax.ShapeDtypeStruct`s (with or without a
    sharding); nothing is transferred or allocated.
    """
    leaves, static = self._split_batch(self._abstract_batch((inputs, labels)))
    self._executable(leaves, static)
    return self._reports[self._signature]

  def evaluate(self, inputs, labels) -> torch.Tensor:
    """The loss on a batch with the current params (a torch scalar tensor, as `__call__`): no gradients, no update."""
    leaves, static = self._split_batch(self._place((inputs, labels)))
    fn = self._eval_fns.get(static)
    if fn is None:
      fn = self._eval_fns[static] = jax.jit(
        functools.partial(self._eval_flat, static),
        out_shardings=(self._replicated, self._replicated),
        compiler_options=self.model.compile_options,
      )
    self._traced_messages = None
    with refusals.translated():
      loss, checks = fn(self.model.params, self.model.buffers, leaves)
    self._raise_now(("eval", static, tuple(map(batch_lib.leaf_signature, leaves))), checks)
    return torch_view(loss)

  def gradients(self, inputs, labels) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss and the gradients the next step would apply (before clipping), keyed
    and sharded like the trained params; nothing is updated. Computed by the same
    program pieces as the step, so they are what to compare with torch's autograd."""
    leaves, static = self._split_batch(self._place((inputs, labels)))
    fn = self._gradient_fns.get(static)
    if fn is None:
      trained_shardings, _ = self._split(self.model.param_shardings)
      fn = self._gradient_fns[static] = jax.jit(
        functools.partial(self._gradients_flat, static),
        out_shardings=(self._replicated, trained_shardings, self._replicated),
        compiler_options=self.model.compile_options,
      )
    trained, frozen = self._split(self.model.params)
    self._traced_messages = None
    with refusals.translated():
      loss, grads, checks = fn(trained, frozen, self.model.buffers, leaves, self.rng, np.int32(self.step_count))
    self._raise_now(("gradients", static, tuple(map(batch_lib.leaf_signature, leaves))), checks)
    return loss, grads

  def _gradients_flat(self, static, params, frozen, buffers, leaves, rng, step):
    inputs, labels = batch_lib.merge_batch(leaves, static)
    (loss, _, checks), grads = self._loss_and_grads(params, frozen, buffers, inputs, labels, jax.random.fold_in(rng, step))
    return loss, grads, checks

  def _eval_flat(self, static, params, buffers, leaves):
    inputs, labels = batch_lib.merge_batch(leaves, static)
    module = self.model.module
    was_training = module.training
    module.eval()  # traced once: dropout and friends off in this program
    try:
      with device_checks.collecting(self.check_indices) as collector:
        loss, _ = self._loss(params, buffers, inputs, labels, jax.random.PRNGKey(0))
      self._traced_messages = collector.messages
      return loss, collector.checks()
    finally:
      module.train(was_training)

  # ---- the pure step ----------------------------------------------------------------

  def pure(self, params, buffers, opt_state, inputs, labels, rng=None):
    """`(params, buffers, opt_state, inputs, labels[, rng]) → (loss, params, buffers, opt_state, metrics)`.

    For callers who hold the state themselves; trace it under their own
    `jax.jit`. `inputs`/`labels` are jax arrays (pytrees as in `__call__`);
    `rng` is this step's PRNG key (default: a fixed key). The buffers come
    back with the forward's updates (BatchNorm's running statistics).
    """
    rng = jax.random.PRNGKey(0) if rng is None else rng
    trained, frozen = self._split(params)
    loss, trained, opt_state, metrics, changed, _ = self._update(trained, frozen, buffers, opt_state, inputs, labels, rng)
    return loss, {**params, **trained}, {**buffers, **changed}, opt_state, metrics

  def _update(self, params, frozen, buffers, opt_state, inputs, labels, rng):
    """`pure` on the trained params alone; `frozen` only feeds the forward; returns
    the buffers the forward changed rather than all of them."""
    self._reached.clear()  # filled again by this trace's gradient
    (loss, changed, checks), grads = self._loss_and_grads(params, frozen, buffers, inputs, labels, rng)
    # The model's own state update before the optimizer step (torchtitan's MoE load balancing).
    changed = {**changed, **self.model.optimizer_pre_step({**buffers, **changed})}
    grad_norm = optax.global_norm(grads)
    if self.clip_norm is not None:
      scale = jnp.minimum(1.0, self.clip_norm / (grad_norm + 1e-6))
      grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    def optimizer_step(operands):
      grads, opt_state, params = operands
      updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      new_params, new_opt_state = self._untouched_where_unreached(new_params, new_opt_state, params, opt_state)
      # Keep every dtype as it came in: a promoted leaf would change the signature.
      new_params = jax.tree.map(lambda new, old: new.astype(old.dtype), new_params, params)
      new_opt_state = jax.tree.map(lambda new, old: jnp.asarray(new).astype(old.dtype), new_opt_state, opt_state)
      return new_params, new_opt_state

    operands = (grads, opt_state, params)
    checked = checks.flags.shape[0] > 0
    # Whether to update is known before the update (a NaN or Inf loss or gradient norm, a failed
    # index check), so keeping the old state is a `where` inside the optimizer's own fusions: a
    # predicate read from the new state would need a second pass over all of it (8B on v6e-8:
    # 22 GB of HBM a step). An update that comes out non-finite from finite gradients (an
    # optimizer or learning rate gone wrong, not a bad batch) is applied and reported
    # (`nonfinite`); the Trainer stops before saving it.
    sound = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    apply = ~checks.failed() & sound if self.skip_nonfinite else ~checks.failed()
    if self.skip_nonfinite:
      new_params, new_opt_state = optimizer_step(operands)
      keep = lambda new, old: jnp.where(apply, new, old)  # noqa: E731
      new_params = jax.tree.map(keep, new_params, params)
      new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    elif checked:
      # A failed index check (device_checks) skips the update: a branch, so the state is
      # not read again by a select after the optimizer's own loops.
      new_params, new_opt_state = jax.lax.cond(checks.failed(), lambda ops: (ops[2], ops[1]), optimizer_step, operands)
    else:
      new_params, new_opt_state = optimizer_step(operands)
    finite = sound & gradients.all_finite((new_params, new_opt_state))
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if self.skip_nonfinite:
      metrics["skipped"] = (~sound).astype(jnp.int32)
    if self.skip_nonfinite or checked:
      changed = {k: jnp.where(apply, v, buffers[k]) for k, v in changed.items()}  # running stats too
    lr = self._learning_rate(new_opt_state, opt_state)
    if lr is not None:
      metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return loss, new_params, new_opt_state, metrics, changed, checks

  def _untouched_where_unreached(self, new_params, new_opt_state, params, opt_state):
    """torch.optim skips a parameter whose `.grad` is None: one the loss does not reach
    (known while tracing, `gradients.value_and_grad`) keeps its value and its optimizer state (no
    weight decay, no moment decay); shared state such as optax's step count still advances."""
    unreached = {k for k in params if not self._reached.get(k, True)}
    if not unreached:
      return new_params, new_opt_state
    update = {k: k not in unreached for k in params}
    state_mask = optax.tree_map_params(
      self.optimizer, lambda _, m: m, new_opt_state, update, transform_non_params=lambda _: True
    )
    new_opt_state = jax.tree.map(lambda new, old, m: new if m else old, new_opt_state, opt_state, state_mask)
    return {k: params[k] if k in unreached else v for k, v in new_params.items()}, new_opt_state

  def _flat_step(self, static, params, frozen, buffers, opt_state, leaves, rng, step):
    inputs, labels = batch_lib.merge_batch(leaves, static)
    return self._update(params, frozen, buffers, opt_state, inputs, labels, jax.random.fold_in(rng, step))

  def _split(self, tree: dict) -> tuple[dict, dict]:
    """A dict keyed like `model.params` → (trained entries, frozen entries)."""
    trained = {k: v for k, v in tree.items() if k in self.trainable}
    return trained, {k: v for k, v in tree.items() if k not in self.trainable}

  def _loss_and_grads(self, params, frozen, buffers, inputs, labels, rng):
    with target_device.compiling_for(self.model.mesh.devices.flat[0]):  # the forward remat's policy
      return self._loss_and_grads_for_target(params, frozen, buffers, inputs, labels, rng)

  def _loss_and_grads_for_target(self, params, frozen, buffers, inputs, labels, rng):
    def loss_fn(params, frozen, buffers, inputs, labels, rng):
      with device_checks.collecting(self.check_indices) as collector:  # index checks come out with the loss
        loss, changed = self._loss({**frozen, **params}, buffers, inputs, labels, rng)
      self._traced_messages = collector.messages
      return loss, (changed, collector.checks())

    value_and_grad = gradients.value_and_grad(remat_lib.checkpoint(loss_fn, self.forward_remat), self._reached)
    if self.grad_accum == 1:
      (loss, (changed, checks)), grads = value_and_grad(params, frozen, buffers, inputs, labels, rng)
      return (loss, changed, checks), grads

    leaves, static = self._split_batch((inputs, labels))
    micro = [self._microbatches(x, i, static) for i, x in enumerate(leaves)]
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, self._split(self.model.param_shardings)[0])

    changed_names = set()

    def accumulate(carry, xs):
      # Microbatches run one after another, as k torch forwards would: each
      # sees the buffers (running statistics) the previous one left.
      index, micro_leaves = xs
      mi, ml = batch_lib.merge_batch(micro_leaves, static)
      loss_sum, grad_sum, now = carry
      (loss, (changed, checks)), grads = value_and_grad(params, frozen, now, mi, ml, jax.random.fold_in(rng, index))
      changed_names.update(changed)
      grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
      return (loss_sum + loss, grad_sum, {**now, **changed}), checks

    init = (jnp.zeros((), jnp.float32), zeros, dict(buffers))
    (loss_sum, grad_sum, final), per_micro = jax.lax.scan(accumulate, init, (jnp.arange(self.grad_accum), micro))
    checks = per_micro.first_of()  # a check failed in any microbatch, its first bad value
    grads = jax.tree.map(lambda g, p: (g / self.grad_accum).astype(p.dtype), grad_sum, params)
    return (loss_sum / self.grad_accum, {n: final[n] for n in changed_names}, checks), grads

  def _microbatches(self, x, index, static):
    """(B, ...) → (k, B/k, ...), microbatch i holding rows i, i+k, i+2k, ..."""
    k = self.grad_accum
    if x.ndim == 0 or x.shape[0] % k:
      name = static.names[index]
      raise TorchOnTpuError(
        f"{arg('grad_accum', k)} needs every input and label to have a batch dim divisible by {k}; "
        f"{name} has shape {tuple(x.shape)}."
      )
    micro = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    spec = self.model.batch_sharding(x.ndim, x.shape[0] // k).spec
    return jax.lax.with_sharding_constraint(micro, NamedSharding(self.model.mesh, PartitionSpec(None, *spec)))

  def _loss(self, params, buffers, inputs, labels, rng):
    if self.compute_dtype is not None:
      params = {k: _cast_floating(v, self.compute_dtype) for k, v in params.items()}
    if self.model.pipeline is not None:
      labels = self.model.pipeline.spread(labels)
    env = torchax.default_env()
    upcasts, last_linear = losses.Upcasts(), losses.LastLinear() if self.fuse_head else None
    with env, env.override_property(prng=rng), losses.installed(self.model, upcasts):
      with last_linear or contextlib.nullcontext():  # the output head, where the model ends in one: the loss reads its input and weight
        outputs, changed = call_model(self.model, params, buffers, inputs)
      with upcasts, aten.made_on_device():  # the loss sees fp32 outputs; the chunked head reads their bf16 source
        loss = self.loss_fn(upcasts.to_fp32(outputs, last_linear), _torch_tree(labels))
    if not isinstance(loss, torch.Tensor):
      raise TorchOnTpuError(
        f"loss_fn must return a scalar torch tensor; it returned {type(loss).__name__}."
      )
    loss = jax_view(loss)
    if loss.shape != ():
      raise TorchOnTpuError(
        f"loss_fn must return a scalar; it returned shape {tuple(loss.shape)}; reduce it "
        f"(e.g. .mean())."
      )
    return loss.astype(jnp.float32), changed

  def _learning_rate(self, new_opt_state, opt_state):
    """The lr this step used: from `inject_hyperparams` state, else `learning_rate=`."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(new_opt_state)[0]:
      if len(path) >= 2 and batch_lib.key_name(path[-1]) == "learning_rate" and batch_lib.key_name(path[-2]) == "hyperparams":
        return leaf
    if callable(self.learning_rate):
      return self.learning_rate(_opt_count(opt_state))
    return self.learning_rate

  # ---- compilation ------------------------------------------------------------------

  def _executable(self, leaves, static):
    signature = (static, tuple(batch_lib.leaf_signature(x) for x in leaves), op_table.generation(), aten.autocast_state())
    compiled = self._executables.get(signature)
    if compiled is None:
      if self._signature is not None:
        logger.warning(
          "Train step recompiles: %s.", batch_lib.signature_change(self._signature, signature)
        )
      self._traced_messages = None
      with refusals.translated():  # an op that cannot be compiled: one sentence naming it
        compiled = self._executables[signature] = self._compile(leaves, static)
      self._check_messages[signature] = self._traced_messages or []
      self._reports[signature] = self.last_compile
    self._signature = signature
    return compiled

  def _compile(self, leaves, static):
    model = self.model
    trained_shardings, frozen_shardings = self._split(model.param_shardings)
    trained, frozen = self._split(batch_lib.abstract(model.params))
    jitted = jax.jit(
      functools.partial(self._flat_step, static),
      in_shardings=(
        trained_shardings,
        frozen_shardings,
        model.buffer_shardings,
        self.opt_state_shardings,
        [x.sharding for x in leaves],
        self._replicated,
        self._replicated,
      ),
      # Changed buffers: constrained to their own shardings inside the step.
      out_shardings=(self._replicated, trained_shardings, self.opt_state_shardings, self._replicated, None, self._replicated),
      donate_argnums=(0, 3) if self.donate else (),
    )
    start = time.perf_counter()
    compile_only = targets.target_of(model.mesh.devices.flat) is not None
    with compile_report.quiet_donation_warnings(), _compat.without_persistent_cache() if compile_only else contextlib.nullcontext():
      compiled = jitted.lower(
        trained,
        frozen,
        batch_lib.abstract(model.buffers),
        batch_lib.abstract(self.opt_state),
        leaves,
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self._replicated),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated),
      ).compile(compiler_options=self.model.compile_options)
    self.last_compile = compile_report.report(compiled, time.perf_counter() - start)
    if model.pipeline is not None:
      self.last_compile.pipeline = f"pipeline {model.pipeline.schedule}" + (
        f", run {self.grad_accum} times (grad_accum)" if self.grad_accum > 1 else ""
      )
    self.last_compile.attention_splits = model.attention_splits()
    self.compile_seconds += self.last_compile.seconds
    logger.info("Train step %s", self.last_compile)
    return compiled

  # ---- batches ----------------------------------------------------------------------

  def _place(self, batch):
    """Host leaves → global arrays on the mesh; jax arrays on the mesh stay as they are."""

    def place(path, x):
      if isinstance(x, (torch.Tensor, np.ndarray)) or (isinstance(x, jax.Array) and not batch_lib.on_mesh(x, self.model.mesh)):
        self._check_splits(path, x.shape)
      if isinstance(x, torch.Tensor):
        return self.model.place(x)
      if isinstance(x, np.ndarray):
        return self.model.place(torch.from_numpy(np.ascontiguousarray(x)))
      if isinstance(x, jax.Array) and not batch_lib.on_mesh(x, self.model.mesh):
        return jax.device_put(x, self.model.batch_sharding(x.ndim, *x.shape[:2]))
      return x

    return jax.tree_util.tree_map_with_path(place, batch)

  def _check_splits(self, path, shape) -> None:
    """A leaf the step places must split over the data devices (not be replicated on each)."""
    ways = self.model.batch_ways
    if len(shape) and shape[0] % ways:
      raise TorchOnTpuError(
        f"{batch_lib.path_name(path)} has {shape[0]} rows, which do not split over the {ways} data devices "
        f"({', '.join(self.model.data_axes)}); make the global batch a multiple of {ways} (an input "
        f"that is not per example, like bag offsets, can be put on the mesh replicated first)."
      )

  def _abstract_batch(self, batch):
    """Any leaves → `ShapeDtypeStruct`s with the sharding `_place` would give them."""

    def abstract(path, x):
      if not isinstance(x, batch_lib.ARRAY_TYPES):
        return x
      if isinstance(x, torch.Tensor):
        dtype = mappings.t2j_dtype(x.dtype)
      else:
        dtype = x.dtype
      shape = tuple(x.shape)
      sharding = getattr(x, "sharding", None)
      if sharding is None or (isinstance(x, jax.Array) and not batch_lib.on_mesh(x, self.model.mesh)):
        self._check_splits(path, shape)
        sharding = self.model.batch_sharding(len(shape), *shape[:2])
      return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype), sharding=sharding)

    return jax.tree_util.tree_map_with_path(abstract, batch)

  def _split_batch(self, batch):
    """(inputs, labels) → (array leaves, hashable static part: structure, flags, leaf names)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    is_array = tuple(isinstance(x, batch_lib.ARRAY_TYPES) for _, x in flat)
    statics = tuple(None if a else x for (_, x), a in zip(flat, is_array))
    names = tuple(batch_lib.path_name(p) for (p, _), a in zip(flat, is_array) if a)
    static = batch_lib.Static(treedef, is_array, statics, names)
    try:
      hash(static)
    except TypeError as e:
      raise TorchOnTpuError(
        f"A non-array input to the train step is unhashable ({e}); pass arrays for data and "
        f"hashable Python values (bools, ints, strings) for flags."
      ) from None
    return [x for (_, x), a in zip(flat, is_array) if a], static

  # ---- state ------------------------------------------------------------------------

  @property
  def state(self) -> TrainState:
    self._raise_failed_check()
    return TrainState(
      params=dict(self.model.params),
      buffers=dict(self.model.buffers),
      opt_state=self.opt_state,
      rng=self.rng,
      step=jax.device_put(np.int32(self.step_count), self._replicated),
    )

  @state.setter
  def state(self, state: TrainState) -> None:
    target = self.abstract_state()
    for part in ("params", "buffers", "opt_state"):
      _check_same_layout(part, state[part], target[part])
    put = lambda x, t: x if getattr(x, "sharding", None) == t.sharding else jax.device_put(x, t.sharding)  # noqa: E731
    self.model.params.update(jax.tree.map(put, dict(state["params"]), target["params"]))
    self.model.buffers.update(jax.tree.map(put, dict(state["buffers"]), target["buffers"]))
    self.opt_state = jax.tree.map(put, state["opt_state"], target["opt_state"])
    self.rng = put(jnp.asarray(state["rng"], jnp.uint32), target["rng"])
    self.step_count = int(state["step"])

  def abstract_state(self) -> TrainState:
    """Shapes, dtypes and shardings of `state`: the target to restore a checkpoint into."""
    shardings = {**self.model.param_shardings, **self.model.buffer_shardings}
    placed = lambda arrays: {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in arrays.items()}  # noqa: E731
    return TrainState(
      params=placed(self.model.params),
      buffers=placed(self.model.buffers),
      opt_state=jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        batch_lib.abstract(self.opt_state),
        self.opt_state_shardings,
      ),
      rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self._replicated),
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated),
    )

  def _cast_params(self, dtype):
    params = self.model.params
    if self._abstract:
      cast = {k: jax.ShapeDtypeStruct(v.shape, dtype if jnp.issubdtype(v.dtype, jnp.floating) else v.dtype, sharding=v.sharding) for k, v in params.items()}
    else:
      shardings = self.model.param_shardings
      cast = jax.jit(
        lambda p: {k: _cast_floating(v, dtype) for k, v in p.items()},
        out_shardings=shardings,
        donate_argnums=0,
      )(params)
    params.update(cast)


# ---- helpers ---------------------------------------------------------------------------


def _check_same_layout(what: str, tree, target) -> None:
  got = jax.tree_util.tree_flatten_with_path(tree)
  want = jax.tree_util.tree_flatten_with_path(target)
  if got[1] != want[1]:
    raise TorchOnTpuError(
      f"The train state's {what} has a different structure than this train step's "
      f"({len(got[0])} vs {len(want[0])} arrays); restore state saved from the same model and optimizer."
    )
  for (path, x), (_, t) in zip(got[0], want[0]):
    if tuple(x.shape) != tuple(t.shape) or jnp.dtype(x.dtype) != jnp.dtype(t.dtype):
      raise TorchOnTpuError(
        f"The train state's {what}{jax.tree_util.keystr(path)} is {jnp.dtype(x.dtype)}{list(x.shape)} "
        f"but this train step expects {jnp.dtype(t.dtype)}{list(t.shape)}; restore state saved "
        f"from the same model and optimizer."
      )


def _opt_count(opt_state):
  """The optimizer's step counter (the first `count` leaf): the step the update is for."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if path and batch_lib.key_name(path[-1]) == "count":
      return leaf
  raise TorchOnTpuError(
    "learning_rate= is a schedule but the optimizer state has no step count to evaluate it "
    "at; pass a float, or wrap the optimizer in optax.inject_hyperparams."
  )


def _float_dtype(dtype, what):
  if dtype is None:
    return None
  if isinstance(dtype, torch.dtype):
    dtype = mappings.t2j_dtype(dtype)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TorchOnTpuError(f"{what} must be a floating dtype (e.g. jnp.bfloat16), got {dtype}.")
  return dtype


def _cast_floating(x, dtype):
  return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x


def _torch_tree(tree):
  return jax.tree.map(lambda x: torch_view(x) if isinstance(x, jax.Array) else x, tree)


def call_model(model: ShardedModule, params, buffers, inputs):
  """`(outputs, changed buffers)` of the model called on `inputs` (see the module docstring)."""
  viewed = _torch_tree(inputs)
  if isinstance(viewed, dict):
    return model.functional_call_with_buffers(params, buffers, **viewed)
  if isinstance(viewed, (tuple, list)):
    return model.functional_call_with_buffers(params, buffers, *viewed)
  return model.functional_call_with_buffers(params, buffers, viewed)




