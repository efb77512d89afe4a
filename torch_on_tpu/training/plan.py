"""Memory planning: will this run fit on these devices, before anything compiles?

    shape = plan.decoder_shape(meta_model)                  # before wrapping it
    step = tot.make_train_step(tot.ShardedModule(meta_model, mesh=mesh, abstract=True), ...)
    memory = plan.plan_memory(step, shape, global_batch_size=8, seqlen=8192, remat="offload_dots")
    print(memory)                                           # the per-device table
    memory.check()                                          # TorchOnTpuError with a concrete fix

Compiling a large model takes minutes and an out-of-memory error arrives only
after that, as a long XLA trace. The plan is arithmetic on shapes and
shardings, so it answers in milliseconds, and when the run does not fit it
says what would make it fit.

Per device, it counts:

* params, gradients and optimizer state exactly, from each array's shard shape
  under its sharding (gradients only for trained params; with `grad_accum > 1`
  the fp32 accumulator and one microbatch's gradients);
* activations saved for the backward pass, an estimate per decoder layer and
  per token of the microbatch on the device (hidden size d, MLP size f, q
  heads h, kv heads hk, head dim dh, column-parallel tensors divided by `tp`):

  | remat policy | kept per layer (elements per token) |
  |---|---|
  | `none` | every intermediate: 6·d + (3·h·dh + 3·hk·dh + 4·f)/tp (norms, RoPE, SwiGLU products); on TPU in bf16, as its compiler keeps them: (h·dh' + h·dh + hk·dh' + hk·dh + 4·f)/tp + 3·d, 6·d in fp32 (the RMSNorms' work, the residual sums) and the attention statistics below |
  | `dots_saveable`, `dots_with_no_batch_dims_saveable` | the layer input d plus `dots`, the matmul outputs: q and k as attention reads them (torchtitan's rotated ones: its RoPE is a matmul to the policies), v, w1's and w3's, (h·dh' + hk·dh' + hk·dh + 2·f)/tp, and wo's d (w2's feeds only the next layer's input); dh' is the head dim padded to 128 lanes on TPU (dh elsewhere) |
  | `dots_and_attention` (a scan's default) | the same plus the attention kernel's output h·dh/tp (on TPU also its log-sum-exp, fp32 per head) |
  | `offload_dots` | the layer input d on the device; `dots` go to host memory |
  | `full` | the layer input d |
  | `offload_inputs` | nothing on the device; the layer input d goes to host memory |

* with a `cp` axis (context parallelism), the tokens of a device are its share
  of the batch's rows times its 1/cp of their sequence, and one layer's backward
  also holds the K/V attention gathers across `cp` (the whole sequence's K and V,
  or two ring blocks);
* the params cast to the compute dtype when it is narrower than theirs (bf16
  compute over fp32 master weights);
* with host offload, the transfers' buffers on the device: three layers' worth of what a
  layer sends to host memory, four with `offload_dots` (`STAGED_LAYERS`);
* the backward pass at its busiest, the largest of: the loss head's (the
  output head's weight gathered whole from its fsdp shards, vocab × d/tp in the
  compute dtype, with the logits kept for it and their gradient, tokens × vocab/tp in the compute
  dtype each: the chunked cross-entropy builds no fp32 copy, and off the CPU writes the gradient
  over the logits, one buffer for both), just after it
  (that weight, the logits' gradient and the params' gradients) and the layers' (the
  gradients, one layer's `none` figure, its recomputed intermediates, and that
  layer's weights gathered whole from their fsdp shards in the compute dtype,
  their gradient as large);
* on the CPU with a compute dtype below fp32, what XLA CPU adds by running
  those matmuls in fp32: an fp32 copy of the logits' gradient, and in a
  scanned stack the saved residuals widened to fp32 (each converted whole
  ahead of the backward loop, its bf16 original then freed). Other backends
  compute in bf16 and have neither.

With pipeline stages (a `pp` mesh axis, `torch_on_tpu.parallel.pipeline`), the layers'
activations are those of the schedule: each tick keeps its stage's input (the
stage is recomputed in the backward), `(V·M + S − 1)/M` times the tokens on the
device, plus stage 0's inbox and its gradient (the tokens twice); the backward
at its busiest recomputes one block of layers on one microbatch (keeping what
the layer policy keeps of each, widened to fp32 on the CPU); the head and its
logits see the tokens split over `pp` as well. When nothing else fits, the
suggestion tries pipeline stages on the same devices before asking for more.

The device's memory is `memory_stats()['bytes_limit']` (TPU, GPU); on the CPU
it is the host's RAM shared by its (simulated) devices; on a compile-only TPU
target (`parallel.targets`), the HBM its compiler budgets. A plan fits when it
needs at most `USABLE` of that: XLA needs room of its own for fusion
temporaries and collectives.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import psutil
import torch

from torch_on_tpu import models
from torch_on_tpu.attention import context
from torch_on_tpu.core.sizes import human_bytes
from torch_on_tpu.errors import TorchOnTpuError, arg, named
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.models import DecoderShape
from torch_on_tpu.parallel import expert_parallel
from torch_on_tpu.parallel import mesh as mesh_lib
from torch_on_tpu.parallel import targets
from torch_on_tpu.training import losses
from torch_on_tpu.wrapper import scan as scan_lib

USABLE = 0.9  # fraction of device memory a plan may use
# Layers' worth of host transfers on the device at once, fitted to the TPU compiler: three (the one
# written, the one in flight, the one prefetched); four where every matmul output goes
# (`offload_dots`: Llama 3 1B and 8B at 8 × 8192 on v5p-8 and v6e-8 allocate 2.4–4.9 layers'
# transfers beyond `full`'s temporaries, CHANGELOG.md).
STAGED_LAYERS, STAGED_LAYERS_DOTS = 3, 4


def decoder_shape(module) -> DecoderShape:
  """The decoder's shape, as the model's family reads it (`Family.decoder_shape`); meta is fine."""
  shape = models.family_of(module).decoder_shape(module)
  if shape is None:
    raise TorchOnTpuError(
      f"Cannot read the decoder shape of {type(module).__name__}; pass a plan.DecoderShape(...) "
      f"with its layers, dims and heads."
    )
  return shape


def device_memory(device: jax.Device | None = None) -> tuple[int | None, str]:
  """(bytes one device may hold, where that number comes from)."""
  device = device or jax.local_devices()[0]
  target = targets.target_of([device])
  if target is not None:  # a compile-only TPU device: its HBM as the TPU compiler budgets it
    return target.hbm_bytes, f"{target.name} HBM as the TPU compiler budgets it"
  if device.platform == "cpu":
    count = len(jax.local_devices(backend="cpu"))
    total = psutil.virtual_memory().total
    return total // count, f"host RAM {human_bytes(total)} / {count} CPU devices"
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # some backends do not implement memory_stats
    limit = None
  if limit is None:
    return None, f"{device.device_kind} does not report its memory"
  return int(limit), f"{device.device_kind} bytes_limit"


@dataclasses.dataclass
class MemoryPlan:
  """Per-device bytes of one training step; `str()` is the table, `check()` the verdict."""

  params: int
  grads: int
  backward_grads: int  # the gradients as the backward pass holds them (in the compute dtype)
  optimizer: int
  compute_params: int  # the params cast to the compute dtype, for the forward and backward
  saved_activations: int
  layer_backward: int
  logits: int  # kept for the loss head's backward
  head_weight: int  # the output head's weight gathered whole for the loss head (0 unsharded)
  logits_grad: int
  cpu_upcasts: int  # what XLA CPU adds widening a scan's bf16 residuals to fp32 (0 elsewhere)
  host_offloaded: int
  # On the device while layers go to host memory and come back: `STAGED_LAYERS` of what a layer offloads.
  host_staging: int
  # With index checks (device_checks) the update is a branch that skips it on a bad index;
  # XLA holds a copy of the trained params across that branch instead of updating in place.
  update_branch: int
  device_bytes: int | None
  device_note: str
  description: str
  suggestion: str = ""
  fused_head: bool = False  # the loss reads the output head's linear: no logits (losses.head_cross_entropy)
  logits_in_place: bool = False  # the loss's gradient written over the logits (off the CPU)
  _context: tuple = dataclasses.field(default=(), repr=False)  # what `suggest` re-plans from

  @property
  def backward_peak(self) -> int:
    """The busiest moment of the backward pass: the loss head's (logits and their
    gradient), just after it (that gradient and the params' gradients) or the
    layers' (the gradients and one layer's recomputed intermediates)."""
    return max(
      self.head_weight + self._head_phase,
      self.head_weight + self.logits_grad + self.backward_grads,
      self.backward_grads + self.layer_backward,
    )

  @property
  def _head_phase(self) -> int:
    """The loss head's backward: the logits and their gradient, or one where it is written over them."""
    return max(self.logits, self.logits_grad) if self.logits_in_place else self.logits + self.logits_grad

  @property
  def total(self) -> int:
    return (
      self.params + self.optimizer + self.compute_params + self.saved_activations + self.cpu_upcasts
      + self.update_branch + self.host_staging + self.backward_peak
    )

  @property
  def activations(self) -> int:
    """Everything but params, gradients and optimizer state."""
    return self.total - self.params - self.grads - self.optimizer

  @property
  def fits(self) -> bool | None:
    return None if self.device_bytes is None else self.total <= USABLE * self.device_bytes

  def __str__(self) -> str:
    rows = [
      ("params", self.params),
      ("optimizer state", self.optimizer),
      ("params in the compute dtype", self.compute_params),
      ("activations saved for backward", self.saved_activations),
      ("+ widened to fp32 (XLA CPU)", self.cpu_upcasts),
      ("params kept across the checked update", self.update_branch),
      ("buffers of the host transfers", self.host_staging),
      ("backward peak, the largest of:", self.backward_peak),
      ("  head fused with the loss" if self.fused_head
       else "  head, logits' gradient over them" if self.logits_in_place else "  head, logits + their gradient",
       self.head_weight + self._head_phase),
      ("  head's backward, gradients" if self.fused_head else "  head, logits' gradient, gradients",
       self.head_weight + self.logits_grad + self.backward_grads),
      ("  gradients + one layer's backward", self.backward_grads + self.layer_backward),
      ("total", self.total),
    ]
    lines = [f"Memory plan per device ({self.description}):"]
    lines += [f"  {label:<36}{human_bytes(n):>12}" for label, n in rows if n or label == "total"]
    if self.host_offloaded:
      lines.append(f"  {'offloaded to host memory':<36}{human_bytes(self.host_offloaded):>12}")
    if self.device_bytes is None:
      lines.append(f"  device memory unknown ({self.device_note}): not checked")
    else:
      verdict = "fits" if self.fits else "does NOT fit"
      lines.append(
        f"  device memory {human_bytes(self.device_bytes)} ({self.device_note}); "
        f"{int(USABLE * 100)}% usable: {verdict}"
      )
    return "\n".join(lines)

  def message(self) -> str:
    """One sentence: what the plan needs, what the device has, and what to change."""
    return (
      f"The step needs about {human_bytes(self.total)} per device but {self.device_note} gives "
      f"{human_bytes(self.device_bytes or 0)} ({int(USABLE * 100)}% usable); {self.suggestion}."
    )

  def suggest(self, limit: float) -> str:
    """The first change that brings the plan under `limit` bytes per device."""
    return _suggest(*self._context, self, limit)

  def check(self) -> None:
    """Raises `TorchOnTpuError` with `message()` when the plan does not fit."""
    if self.fits is False:
      raise TorchOnTpuError(self.message())


def plan_memory(
  step,
  shape: DecoderShape,
  *,
  global_batch_size: int,
  seqlen: int,
  remat: str | None = None,
  device_bytes: int | None = None,
) -> MemoryPlan:
  """The per-device plan for `step` (a `TrainStep`, abstract or not) on its mesh.

  `remat` is the per-layer policy the model runs with (`ShardedModule(remat=)`);
  `device_bytes` overrides the device's own memory (plan for another device).
  """
  plan = _estimate(step, shape, global_batch_size, seqlen, remat, step.grad_accum)
  plan._context = (step, shape, global_batch_size, seqlen, remat)
  if device_bytes is None:
    plan.device_bytes, plan.device_note = device_memory(step.model.mesh.devices.flat[0])
  else:
    plan.device_bytes, plan.device_note = int(device_bytes), "the given device memory"
  if plan.fits is False:
    plan.suggestion = plan.suggest(USABLE * plan.device_bytes)
  return plan


# What `auto_remat` tries after a stack's own default, least recomputation first: the projections
# kept (attention recomputed), the whole layer recomputed, then that with each layer's input in
# host memory (only where there is host memory apart from the device's).
AUTO_REMATS = ("dots_with_no_batch_dims_saveable", "full", "offload_inputs")


@dataclasses.dataclass
class RematChoice:
  """What `auto_remat` picked: the policy, its plan, and the plans of the policies it passed over."""

  policy: str
  plan: MemoryPlan
  passed: list[tuple[str, MemoryPlan]]

  def __str__(self) -> str:
    memory = self.plan
    if memory.device_bytes is None:
      where = f"device memory unknown ({memory.device_note})"
    else:
      verdict = "" if memory.fits else ", which does not fit either"
      where = f"of {human_bytes(memory.device_bytes)} ({int(USABLE * 100)}% usable){verdict}"
    others = ", ".join(f"{name} about {human_bytes(p.total)}" for name, p in self.passed)
    why = f"; {others} would not fit" if others else "; the least recomputation"
    return f"Remat auto → {self.policy}: about {human_bytes(memory.total)} per device {where}{why}"


def auto_candidates(first: str, mesh) -> list[str]:
  """The policies `auto_remat` tries on `mesh`, in order: `first`, then `AUTO_REMATS`."""
  candidates = [first, *(name for name in AUTO_REMATS if name != first)]
  if not _can_offload(mesh):
    candidates.remove("offload_inputs")  # keeps what `full` keeps where nothing can leave the device
  return candidates


def auto_remat(step, shape: DecoderShape, *, global_batch_size: int, seqlen: int, first: str,
               device_bytes: int | None = None) -> RematChoice:
  """The per-layer remat policy with the least recomputation whose plan fits the device: `first`
  (the layer stack's own default, `remat.layer_policy(None, ...)`), then `AUTO_REMATS` in order;
  the last one tried when none fits (its plan then says what to change). Plans only: nothing is
  rebuilt or compiled, so the step may have been built with any policy."""
  passed = []
  for name in auto_candidates(first, step.model.mesh):
    memory = plan_memory(step, shape, global_batch_size=global_batch_size, seqlen=seqlen, remat=name,
                         device_bytes=device_bytes)
    if memory.fits is not False:
      break
    passed.append((name, memory))
  else:
    passed.pop()  # none fits: the last one, whose plan says what to change
  return RematChoice(name, memory, passed)


def _estimate(step, shape, global_batch_size, seqlen, remat, grad_accum, schedule=None, split=None) -> MemoryPlan:
  """The plan; `schedule` (a `pipeline.Schedule`) plans the model's own devices as if split
  into its stages (for the suggestion), else the model's own pipeline, if any; `split` =
  (data ways, cp ways) plans the same devices laid out otherwise."""
  model = step.model
  mesh = model.mesh
  params = _sharded_bytes(model.params, model.param_shardings)
  shardings = model.param_shardings
  trained = {k: v for k, v in model.params.items() if k in step.trainable}
  grads = _sharded_bytes(trained, {k: shardings[k] for k in trained})
  if grad_accum > 1:  # an fp32 sum next to one microbatch's gradients
    grads += _sharded_bytes(trained, {k: shardings[k] for k in trained}, itemsize=4)
  optimizer = _sharded_bytes(step.opt_state, step.opt_state_shardings)
  compute = np.dtype(step.compute_dtype or _float_dtype(model.params)).itemsize
  narrower = {k: v for k, v in model.params.items() if _is_float(v) and np.dtype(v.dtype).itemsize > compute}
  compute_params = _sharded_bytes(narrower, {k: shardings[k] for k in narrower}, itemsize=compute)
  # The backward makes the gradients of those compute-dtype copies, in that dtype; the params' own
  # dtype appears after it, once its activations are freed (the TPU compiler's scan: bf16 stacks).
  cast = {k: v for k, v in trained.items() if k in narrower}
  cast_shardings = {k: shardings[k] for k in cast}
  backward_grads = grads - _sharded_bytes(cast, cast_shardings) + _sharded_bytes(cast, cast_shardings, itemsize=compute)

  data_ways, cp = split or (math.prod(mesh.shape[a] for a in model.data_axes), mesh_lib.sequence_ways(mesh))
  if schedule is None and model.pipeline is not None:
    schedule = model.pipeline.schedule
  elif schedule is not None:
    data_ways //= schedule.stages  # the stages come out of the data axes
  rows = global_batch_size // grad_accum
  local_rows = rows / (data_ways if rows % data_ways == 0 else 1)
  cp = cp if seqlen % cp == 0 else 1
  tokens = local_rows * seqlen / cp
  tp = mesh.shape.get("tp", 1)
  # XLA CPU runs sub-fp32 matmuls in fp32: the input of the lm_head's backward dots is an
  # fp32 copy of the logits' gradient, and a scan's saved bf16 residuals are each converted
  # to fp32 whole ahead of the backward loop (the bf16 original then freed).
  cpu_upcast = mesh.devices.flat[0].platform == "cpu" and compute < 4
  scanned = any(f".{scan_lib.SCAN}.{scan_lib.LAYER}." in k for k in model.params)
  s = shape
  q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
  # The matmul outputs a policy keeping them keeps (read off the TPU compiler's scan residuals):
  # v, and q and k as attention reads them (torchtitan's rotated q and k: its RoPE is a matmul to
  # the policies, `rope.rotate`, and linear, so the projections before it are not kept; HF's q and
  # k, from which its elementwise RoPE is recomputed); w1's and w3's; wo's (the residual sum after
  # it is recomputed from it). w2's only feeds the next layer's input, kept as that layer's.
  # On TPU, q and k as attention reads them keep the head dim minor, padded to the chip's 128 lanes
  # (Llama 3 1B's 64-wide heads: twice their bytes, in the compiler's scan residuals and host transfers).
  on_tpu = mesh.devices.flat[0].platform == "tpu"
  lanes = -(-s.head_dim // 128) * 128 if on_tpu else s.head_dim
  q_read, k_read = s.heads * lanes, s.kv_heads * lanes
  dots = (q_read + k_read + kv + 2 * s.ffn_dim) / tp + s.dim
  everything = (3 * q + 3 * kv + 4 * s.ffn_dim) / tp + 6 * s.dim
  policy = remat or "none"
  # The attention kernel's residuals beyond its inputs: its output and its log-sum-exp (fp32 per head).
  stats = 4 * s.heads / tp / compute if on_tpu else 0
  attention_out = q / tp + stats
  if on_tpu and compute < 4:
    # A bf16 layer without remat on TPU keeps q, k (as attention reads them), v and the attention's
    # output and statistics, w1's and w3's outputs, SiLU's and their product; three hidden-size
    # tensors in bf16 and six in fp32 (the RMSNorms' work and the residual sums).
    everything_kept = (q_read + q + k_read + kv + 4 * s.ffn_dim) / tp + stats + 3 * s.dim + 6 * s.dim * 4 / compute
  else:
    everything_kept = everything
  spelled = remat_lib.named(policy)
  if spelled is not None:  # what it names, per token: the layer input, the attention kernel's, its modules' outputs
    widths = {"input": s.dim, "attention": attention_out}
    saved_width, offloaded_width = (
      sum(widths.get(g, 0) for g in globs) + _module_widths(model, spelled, tag, s.dim, tp)
      for globs, tag in ((spelled.save, remat_lib.SAVED_NAME), (spelled.offload, remat_lib.OFFLOADED_NAME))
    )
    kept = saved_width if _can_offload(mesh) else saved_width + offloaded_width
    offloaded = offloaded_width if _can_offload(mesh) else 0
  else:
    kept = {
      "none": everything_kept, "full": s.dim, "offload_dots": s.dim, "offload_inputs": 0,
      "dots_and_attention": s.dim + dots + attention_out,
    }.get(policy, s.dim + dots)
    offloaded = {"offload_dots": dots, "offload_inputs": s.dim}.get(policy, 0) if _can_offload(mesh) else 0
    if policy in ("offload_dots", "offload_inputs") and not offloaded:
      kept = s.dim + (dots if policy == "offload_dots" else 0)  # no host memory apart from the device's: kept in place
  per_token = compute * tokens
  kv_across = 0
  if cp > 1:  # attention's K/V across the sequence split, held during one layer
    strategy, _ = context.choose(
      model.context_parallel, heads=s.heads, kv_heads=s.kv_heads, ways=cp, plain=True
    )
    held = seqlen if strategy == "all_gather" else 2 * seqlen / cp
    kv_across = int(local_rows * held * 2 * s.kv_heads * s.head_dim / tp * compute)
  description = (
    f"mesh {dict(mesh.shape)}, {global_batch_size} x {seqlen} tokens"
    + (f" in {grad_accum} microbatches" if grad_accum > 1 else "")
    + (f", each sequence over cp={cp}" if cp > 1 else "")
    + f", remat {policy}, compute {_dtype_name(step, model)}"
  )
  saved = int(s.layers * kept * per_token)
  layer_backward = int(0 if policy == "none" else everything * per_token)
  head_tokens = tokens
  if schedule is not None:
    micro = per_token / schedule.microbatches
    block = s.layers // (schedule.stages * schedule.virtual_stages)
    saved = int((schedule.ticks / schedule.microbatches + 2) * s.dim * per_token)
    # layers past the equal blocks run after the stages, on the batch split over pp as well
    saved += int((s.layers - schedule.staged_layers(s.layers)) * kept * per_token / schedule.stages)
    layer_backward = int((block * kept + everything) * micro)
    if cpu_upcast:  # the stage's recomputed residuals, widened like a scan's
      layer_backward += int(block * kept * micro * (4 - compute) / compute)
    head_tokens = tokens / schedule.stages
    description += f", pipeline {schedule}"
  layer_backward += _moe_rows(model, s, tokens / (schedule.microbatches if schedule is not None else 1), compute)
  logits = int(head_tokens * s.vocab * s.predictions / tp * compute)  # multi-token prediction: a logits tensor per depth
  # The output head's weight gathered whole from its fsdp shards for the loss head's matmuls.
  head_weight = int(s.vocab * s.dim / tp * compute) if data_ways * cp > 1 else 0
  logits_grad = logits + (logits * 4 // compute if cpu_upcast else 0)
  fused_head = _head_fused(step, s, data_ways * cp, schedule)
  if fused_head:
    # the loss reads the head's linear (losses.head_cross_entropy): no logits are kept; its
    # backward holds the head's weight gathered whole (over the data axes, not only fsdp's),
    # that weight's gradient before it is reduce-scattered, the input's fp32 gradient and a
    # chunk of the logits in fp32 (its softmax and gradient beside it)
    width = losses.head_chunk(int(head_tokens), s.vocab)
    head_weight = int(s.vocab * s.dim * compute) if data_ways * cp > 1 else 0
    logits = 0
    logits_grad = int(s.vocab * s.dim * compute + head_tokens * s.dim * 4 + 3 * head_tokens * width * 4)
  return MemoryPlan(
    params=params,
    grads=grads,
    backward_grads=backward_grads,
    optimizer=optimizer,
    compute_params=compute_params,
    saved_activations=saved,
    layer_backward=layer_backward + kv_across + 2 * _layer_weights(model, s, compute, tp, data_ways * cp),
    logits=logits,
    head_weight=head_weight,
    logits_grad=logits_grad,
    fused_head=fused_head,
    logits_in_place=not fused_head and mesh.devices.flat[0].platform != "cpu",  # losses._gradient_chunk
    cpu_upcasts=saved * (4 - compute) // compute if cpu_upcast and scanned else 0,
    host_offloaded=int(s.layers * offloaded * per_token),
    host_staging=int((STAGED_LAYERS_DOTS if policy == "offload_dots" else STAGED_LAYERS) * offloaded * per_token),
    update_branch=_sharded_bytes(trained, {k: shardings[k] for k in trained})
    if step.check_indices and not step.skip_nonfinite else 0,
    device_bytes=None,
    device_note="",
    description=description,
  )


def _head_fused(step, s: DecoderShape, token_ways: int, schedule) -> bool:
  """Whether the step's loss will read the output head's linear instead of its logits (as
  `losses.cross_entropy` decides): a bias-free linear over the vocabulary that ends the model,
  one prediction per token, no pipeline stages, its vocabulary split as the tokens are."""
  model = step.model
  if not step.fuse_head or schedule is not None or model.pipeline is not None or s.predictions != 1 or s.vocab % token_ways:
    return False
  config = getattr(model.module, "config", None)
  if getattr(config, "final_logit_softcapping", None):  # the logits are not the linear's
    return False
  heads = [m for m in model.module.modules() if isinstance(m, torch.nn.Linear) and m.out_features == s.vocab]
  return bool(heads) and losses.plain_head(heads[-1])


def _suggest(step, shape, global_batch_size, seqlen, remat, plan, limit) -> str:
  """The first change under `limit`: remat, then grad_accum, then more devices."""
  policy = remat or "none"
  if policy not in ("full", "offload_dots", "offload_inputs"):
    alternative = _estimate(step, shape, global_batch_size, seqlen, "full", step.grad_accum)
    if alternative.total <= limit:
      return f"use {arg('remat', 'full')} (recompute each layer in the backward pass: about {human_bytes(alternative.total)})"
  mesh = step.model.mesh
  data_ways = math.prod(mesh.shape[a] for a in step.model.data_axes)
  best = "full" if policy == "none" else policy
  accum = step.grad_accum
  rows = global_batch_size // accum
  per_device = rows // data_ways if rows % data_ways == 0 else 0
  for k in (k for k in range(2, per_device + 1) if per_device % k == 0):  # each device's rows split evenly
    accum = step.grad_accum * k
    alternative = _estimate(step, shape, global_batch_size, seqlen, best, accum)
    if alternative.total <= limit:
      extra = "" if best == policy else f" with {arg('remat', best)}"
      return (
        f"use {arg('grad_accum', accum)}{extra} (or a global batch {k}x smaller: "
        f"about {human_bytes(alternative.total)})"
      )
  staged = _pipeline_suggestion(step, shape, global_batch_size, seqlen, limit)
  if staged:
    return staged
  split = _sequence_split(step, shape, global_batch_size, seqlen, best, policy, limit)
  if split:
    return split
  state = plan.params + plan.grads + plan.optimizer
  floor = _estimate(step, shape, global_batch_size, seqlen, best, accum).activations
  if limit > floor:
    factor = math.ceil(state / (limit - floor))
    fsdp = mesh.shape.get("fsdp", 1)
    return (
      f"shard the params over about {factor}x more devices on fsdp ({arg('fsdp', fsdp * factor)} or more: "
      f"{mesh.devices.size * factor} devices), since params, gradients and optimizer state alone take {human_bytes(state)}"
    )
  return (
    f"even one sequence per device with {arg('remat', best)} needs {human_bytes(floor)} of activations; "
    f"use a shorter {named('seqlen')} or shard activations with {named('tp')}"
  )


def _pipeline_suggestion(step, shape, global_batch_size, seqlen, limit) -> str | None:
  """Pipeline stages on the same devices (taken from `fsdp`) that bring the plan under
  `limit`: the fewest stages, with the most microbatches up to 4 per stage, each layer
  recomputed whole (a stage then keeps only its input per tick: far fewer saved
  activations than every layer's input when the stack is deep)."""
  from torch_on_tpu.parallel import pipeline as pipeline_lib

  model = step.model
  scanned = any(f".{scan_lib.SCAN}.{scan_lib.LAYER}." in k for k in model.params)
  if model.pipeline is not None or mesh_lib.sequence_ways(model.mesh) > 1 or not scanned:
    return None  # already staged, or over `cp` (the plan of both together is not calibrated), or no stack to split
  fsdp = model.mesh.shape.get("fsdp", 1)
  rows = global_batch_size // step.grad_accum
  for stages in range(2, fsdp + 1):
    if fsdp % stages or shape.layers % stages:
      continue
    micro = [m for m in range(stages, 4 * stages + 1) if rows % m == 0]
    if not micro:
      continue
    schedule = pipeline_lib.Schedule(stages, max(micro))
    alternative = _estimate(step, shape, global_batch_size, seqlen, "full", step.grad_accum, schedule)
    if alternative.total <= limit:
      return (
        f"use pipeline stages: pp={stages} with fsdp={fsdp // stages}, microbatches={schedule.microbatches} and "
        f"remat='full' (about {human_bytes(alternative.total)}; bubble {schedule.bubble_fraction:.0%})"
      )
  return None


def _sequence_split(step, shape, global_batch_size, seqlen, remat, policy, limit) -> str | None:
  """The smallest `cp` (devices taken from the data axes, with the grad_accum that
  leaves each device less than a sequence; `remat`, else 'full') under `limit`, as a
  suggestion; None if none."""
  mesh = step.model.mesh
  if step.model.pipeline is not None:
    return None  # the plan of pipeline stages with cp is not calibrated: one axis suggested at a time
  data_ways = math.prod(mesh.shape[a] for a in step.model.data_axes)
  cp_now = mesh_lib.sequence_ways(mesh)
  devices = data_ways * cp_now
  for candidate in dict.fromkeys((remat, "full")):
    cp = cp_now * 2
    while cp <= devices and devices % cp == 0 and seqlen % (2 * cp) == 0:
      data = devices // cp
      accum = step.grad_accum
      while accum <= global_batch_size:
        rows = global_batch_size // accum
        if global_batch_size % accum == 0 and rows % data == 0:
          alternative = _estimate(step, shape, global_batch_size, seqlen, candidate, accum, split=(data, cp))
          if alternative.total <= limit:
            extra = f" and {arg('grad_accum', accum)}" if accum != step.grad_accum else ""
            where = f"{arg('remat', candidate)}, " if candidate != policy else ""
            return (
              f"split each sequence over more devices: {arg('cp', cp)} with {data} data devices{extra} "
              f"({where}about {human_bytes(alternative.total)})"
            )
        accum *= 2
      cp *= 2
  return None


def _sharded_bytes(tree, shardings, itemsize: int | None = None) -> int:
  """Bytes one device holds of `tree`, whose leaves line up with those of `shardings`."""
  total = 0
  for x, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shard = sharding.shard_shape(tuple(x.shape)) if x.ndim else ()
    total += math.prod(shard) * (itemsize or np.dtype(x.dtype).itemsize)
  return total


def _is_float(x) -> bool:
  return np.issubdtype(np.dtype(x.dtype), np.floating) or np.dtype(x.dtype).name == "bfloat16"


def _float_dtype(params) -> np.dtype:
  for x in params.values():
    if _is_float(x):
      return np.dtype(x.dtype)
  return np.dtype(np.float32)


def _dtype_name(step, model) -> str:
  return np.dtype(step.compute_dtype or _float_dtype(model.params)).name


def _moe_rows(model, shape: DecoderShape, tokens: float, compute: int) -> int:
  """One MoE layer's token rows in flight in its backward: each token's top-k rows sorted by
  expert and combined back (N = tokens · top-k rows of the hidden size: four such buffers with
  their gradients), the experts' hidden activations (six of W rows: w1's, w3's, their product, and
  their gradients) and, under expert parallelism, the W rows of the receive buffer
  (`expert_parallel.receive_rows`) in ten buffers of the hidden size: what arrives, the experts'
  output and its mask, the collectives' copies in their own layout, their gradients (the ten
  fitted to the TPU compiler's peaks for Qwen3-30B-A3B on v5p-64 and DeepSeek-V3 on v5p-1024 at
  ep=8). Without expert parallelism W = N. 0 for a dense model."""
  s = shape
  if not s.moe_layers:
    return 0
  mesh = model.mesh
  group = mesh_lib.expert_axes(mesh)
  devices = mesh_lib.batch_ways(mesh, group)
  rows = int(tokens / (mesh.shape["tp"] if "tp" in group else 1) * s.top_k)
  window = expert_parallel.receive_rows(rows, s.top_k, s.experts // devices, devices) if devices > 1 else rows
  exchanged = 10 * window * s.dim if devices > 1 else 0
  return int((4 * rows * s.dim + 6 * window * s.expert_ffn + exchanged) * compute)


def _layer_weights(model, shape: DecoderShape, compute: int, tp: int, shards: int) -> int:
  """Bytes of one layer's weights gathered whole from their fsdp shards in the compute dtype
  (their gradient before its reduce-scatter is as large): from the scanned stack's arrays, else
  the decoder's attention and SwiGLU shapes. 0 where nothing is sharded."""
  if shards <= 1:
    return 0
  mesh = model.mesh
  group = mesh_lib.expert_axes(mesh)
  stacked = [(v, model.param_shardings[k].spec) for k, v in model.params.items()
             if f".{scan_lib.SCAN}.{scan_lib.LAYER}." in k and _is_float(v)]
  if stacked:
    # each gathered over its other axes, still split over tp and, for routed experts (their expert
    # dim stored over the expert-parallel group: `sharding.expert_spec`), over that group
    def split(spec) -> int:
      entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
      experts = group and len(entries) > 1 and entries[1] == group
      return math.prod(mesh.shape[a] for e in entries for a in e if a == "tp" or (experts and a in group))

    return int(sum(v.size // v.shape[0] // split(spec) for v, spec in stacked) * compute)
  s = shape
  attention = s.dim * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim)
  return int((attention + 3 * s.dim * s.ffn_dim) * compute / tp)


def _module_widths(model, policy: remat_lib.Named, tag: str, dim: int, tp: int) -> float:
  """Elements per token of the outputs of a scanned layer's modules that `policy` tags with `tag`
  (saved or offloaded): a module with a weight its output features (over `tp` where the weight's
  are split), any other the hidden size."""
  marker = f".{scan_lib.SCAN}.{scan_lib.LAYER}."
  weights = {}  # the layer's module paths → the stacked weight's name
  for name in model.params:
    if marker in name and name.endswith(".weight"):
      weights[name.split(marker, 1)[1].removesuffix(".weight")] = name
  paths = {p for name in model.params if marker in name for p in _parents(name.split(marker, 1)[1])}
  width = 0.0
  for path in sorted(p for p in paths if policy.tag(p) == tag):
    weight = weights.get(path)
    if weight is None:
      width += dim
      continue
    features = model.params[weight].shape[1]
    spec = model.param_shardings[weight].spec
    split = spec[1] if len(spec) > 1 else None
    width += features / tp if split == "tp" or (isinstance(split, tuple) and "tp" in split) else features
  return width


def _parents(name: str) -> list[str]:
  """The module paths a tensor's dotted name lies under: `a.b.weight` → `a`, `a.b`."""
  parts = name.split(".")[:-1]
  return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _can_offload(mesh) -> bool:
  return remat_lib.host_offload_supported(mesh.devices.flat[0])
