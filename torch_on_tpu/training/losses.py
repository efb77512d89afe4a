"""Cross-entropy over a large vocabulary without a full fp32 copy of the logits.

torchax lowers `F.cross_entropy` as torch decomposes it: an fp32
`log_softmax` of the whole [tokens, vocab] logits, kept for the backward, and
an fp32 gradient of the same size. At vocab 128k and 8k tokens that is GiBs of
temporaries. Here the loss is a `jax.custom_vjp` that walks the vocabulary in
chunks: the forward keeps a running max and sum of exponentials (fp32 whatever
the logits' dtype) plus the target logit, and saves only the logits and one
logsumexp per row; the backward recomputes each chunk's softmax and writes the
gradient into a buffer of the logits' own dtype; off the CPU by default in one
fused pass, written over the logits (`_gradient_chunk`) in the shape the model made them.

Where the logits are the model's last `F.linear` (a bias-free output head: torchtitan's
and HF's `lm_head`) reshaped at most, the loss reads that linear's input and weight
instead (`head_cross_entropy`): each chunk's logits are computed, rounded to the compute dtype
as the linear would round them, and dropped, in the forward and again in the backward, so
neither the [tokens, vocab] logits nor their gradient exist; the logits the model returned go
unread and XLA drops them.

`cross_entropy` is what the train step installs for `F.cross_entropy`; a call
it cannot express exactly (class weights, probability targets, logits that are
not 2-D, the legacy `size_average`/`reduce`) goes to torchax's own lowering.

`Upcasts` keeps the step's fp32 view of bf16 outputs from costing memory: the
loss function sees fp32 tensors, but when `F.cross_entropy` gets one that is a
reshape or slice of such an up-cast, the kernel reads the bf16 tensor it came
from. That is exact (the kernel casts each chunk to fp32, and its bf16 gradient
is the fp32 one rounded once, as the cast's own gradient would be), and the
fp32 copy of the logits and its fp32 gradient are never built.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.overrides import TorchFunctionMode

from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import device_checks, op_table, target_device

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from torchax.interop import jax_view, torch_view  # noqa: E402

CHUNK_BYTES = 32 << 20  # one chunk's fp32 block: the loop's scratch, whatever the vocabulary
# The fused head's chunk: each one re-reads the head's input (and in the backward adds to its
# fp32 gradient), so wider chunks move fewer bytes; 128k columns at 8192 tokens are 16 chunks.
HEAD_CHUNK_BYTES = 256 << 20
MAX_CHUNK, MIN_CHUNK = 8192, 1024  # columns per chunk


def installed(model, upcasts: "Upcasts | None" = None):
  """While active (the train step's trace), `F.cross_entropy` runs `cross_entropy`, its rows
  over `model`'s data axes, reading the low-precision source of `upcasts`' tensors."""
  return op_table.bridge_overrides(
    {torch.nn.functional.cross_entropy: functools.partial(cross_entropy, model, upcasts or Upcasts())}
  )


# Ops whose result is a rearrangement of their first argument's elements: applied to an
# up-cast or to its source, they give the same values in fp32 and in the source dtype.
_REARRANGING = frozenset({
  torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.flatten,
  torch.Tensor.contiguous, torch.Tensor.float, torch.Tensor.__getitem__,
})


class _Wide(torchax.tensor.Tensor):
  """An fp32 tensor that is an up-cast of `low` (rearranged alike). A subclass because
  torchax's `Tensor.flatten` is plain Python that no torch function mode sees."""

  low: torch.Tensor
  head: "tuple | None" = None  # (x, weight): its rows are F.linear(x, weight)'s, flattened
  whole: "torch.Tensor | None" = None  # the model's own output whose leading dims these rows are

  def flatten(self, start_dim=0, end_dim=-1):
    out = super().flatten(start_dim, end_dim)
    if not _unchanged(self):
      return out
    return _wide(out, self.low.flatten(start_dim, end_dim), *_kept_rows(self, out))


def _wide(t, low, head=None, whole=None) -> _Wide:
  wide = _Wide(jax_view(t), _compat.tensor_env(t))
  wide.low = low
  wide.head = head
  wide.whole = whole
  wide.made = jax_view(wide)
  return wide


def _unchanged(t) -> bool:
  """Whether `t` still holds the values it was made with: an in-place op (`logits.div_(T)`)
  keeps the tensor and swaps its array, and its source or head no longer describes it."""
  return isinstance(t, _Wide) and jax_view(t) is t.made


def _kept_rows(source: _Wide, out) -> tuple:
  """(head, whole) of `source` where `out` has its elements in the same order with the same
  last dim (a reshape, a flatten of the leading dims, a slice that keeps everything): the same
  rows; (None, None) otherwise."""
  same = out.ndim >= 1 and out.shape[-1] == source.shape[-1] and out.numel() == source.numel()
  return (source.head, source.whole) if same else (None, None)


def plain_head(module) -> bool:
  """A bias-free `nn.Linear` computing `F.linear` as is (a subclass too, where it keeps
  `nn.Linear`'s forward: torchtitan's `Linear`): a head whose logits the loss can recompute."""
  return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward and module.bias is None


class LastLinear:
  """While active (the model's forward), remembers the last `plain_head` call: where the
  model's output is that call's result, it is the output head the loss can fuse with. A
  module hook, as the forward re-enters torchax's env above any torch function mode."""

  def __init__(self):
    self.out = self.array = self.x = self.weight = self._handle = None

  def _seen(self, module, args, out):
    if plain_head(module) and args and isinstance(out, torch.Tensor):
      self.out, self.array, self.x, self.weight = out, jax_view(out), args[0], module.weight

  def __enter__(self):
    self._handle = torch.nn.modules.module.register_module_forward_hook(self._seen)
    return self

  def __exit__(self, *exc):
    self._handle.remove()

  def head_of(self, t) -> "tuple | None":
    # the same tensor, not changed in place since (`out *= scale` keeps it, with new values)
    return (self.x, self.weight) if t is not None and t is self.out and jax_view(t) is self.array else None


class Upcasts(TorchFunctionMode):
  """The loss function's fp32 view of the model's low-precision outputs.

  `to_fp32(outputs)` casts floating tensors below fp32 up, each remembering its
  source; while the mode is active, reshapes, views and basic slicing of them keep
  that link (the same op applied to the source), which `source(t)` returns.
  Sources nothing reads are dropped when jax traces the step."""

  def to_fp32(self, outputs, last_linear: LastLinear | None = None):
    """`outputs` with low-precision floats up-cast; the output that is `last_linear`'s result
    (in fp32 too) remembers that linear's input and weight (`head`)."""
    def up(t):
      head = last_linear.head_of(t) if last_linear is not None and isinstance(t, torch.Tensor) else None
      if isinstance(t, torch.Tensor) and t.is_floating_point() and torch.finfo(t.dtype).bits < 32:
        return _wide(t.float(), t, head, t)
      return t if head is None else _wide(t, t, head, t)

    return _compat.torch_pytree.tree_map(up, outputs)

  @staticmethod
  def source(t):
    return t.low if _unchanged(t) else None

  @staticmethod
  def head(t):
    return t.head if _unchanged(t) else None

  @staticmethod
  def whole(t):
    """The model's output `t`'s rows were flattened from, in its own shape and dtype (or None)."""
    return t.whole if _unchanged(t) else None

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    if (
      func in _REARRANGING and _unchanged(args[0]) and isinstance(out, torch.Tensor)
      and out.dtype == torch.float32 and _by_position(args[1:], kwargs)
    ):
      low = args[0].low
      return _wide(out, low if func is torch.Tensor.float else func(low, *args[1:], **kwargs), *_kept_rows(args[0], out))
    return out


def _by_position(args, kwargs) -> bool:
  """Shapes, dims, slices: no dtype (a bit view) and no tensor index (a gather whose
  gradient sums duplicates, which would round differently in bf16)."""
  leaves = _compat.torch_pytree.tree_leaves((args, kwargs))
  return all(isinstance(x, (int, slice, type(None), type(Ellipsis), torch.Size)) for x in leaves)


def cross_entropy(
  model,
  upcasts,
  input,
  target,
  weight=None,
  size_average=None,
  ignore_index=-100,
  reduce=None,
  reduction="mean",
  label_smoothing=0.0,
):
  """`torch.nn.functional.cross_entropy` (torch tensors in and out), chunked when it can be exact.

  The rows are pinned to the data axes (and `cp`: rows are flattened batch ×
  sequence positions) where they divide them: a loop over vocabulary slices of
  logits sharded any other way (over the vocabulary, say) would gather them
  whole on every device."""
  exact = (
    weight is None
    and size_average is None
    and reduce is None
    and reduction in ("mean", "sum", "none")
    and input.ndim == 2
    and target.ndim == 1
    and not target.is_floating_point()
    and input.is_floating_point()
  )
  if not exact:
    return _compat.torch_cross_entropy(
      input, target, weight, size_average, reduce, reduction, ignore_index, label_smoothing
    )
  rows = input.shape[0]
  classes = input.shape[1]
  if target.shape[0] != rows:  # torch's own words; a traced loop over unequal rows would fail inside jax
    raise ValueError(f"Expected input batch_size ({rows}) to match target batch_size ({target.shape[0]}).")
  device_checks.index_in_range(
    jax_view(target), classes, what=f"cross_entropy as a target (logits of {classes} classes)", allowed=int(ignore_index)
  )
  fused = _fused_head(model, upcasts.head(input), rows, classes)
  if fused is not None:
    x, weight, mesh, axes = fused
    loss = head_cross_entropy(
      x, weight, jax_view(target), mesh=mesh, row_axes=axes, ignore_index=int(ignore_index), reduction=reduction,
      label_smoothing=float(label_smoothing),
    )
    return torch_view(loss)
  # The model's own [batch, seq, vocab] where these rows are its leading dims flattened: the
  # gradient then comes out in the shape of the matmul that made the logits, which XLA:TPU
  # needs to write it over them (with [rows, vocab] it did only where batch was one a chip).
  logits = upcasts.whole(input) if upcasts.whole(input) is not None else upcasts.source(input)
  loss = chunked_cross_entropy(
    jax_view(input if logits is None else logits), jax_view(target), ignore_index=int(ignore_index), reduction=reduction,
    label_smoothing=float(label_smoothing),
    sharding=_rows_sharding(model, rows),
  )
  return torch_view(loss)


def _fused_head(model, head, rows: int, classes: int):
  """(x [rows, d], weight [classes, d], mesh, row axes) where the loss can read the head's
  linear instead of its logits: its rows are the loss's rows, its rows and its weight's
  vocabulary split over the same data axes (no pipeline stages: their head runs per stage)."""
  if head is None or model.pipeline is not None:
    return None
  x, weight = (jax_view(t) for t in head)
  sharding = model.token_sharding(rows)
  if weight.shape[0] != classes or x.size != rows * weight.shape[1] or sharding is None:
    return None
  axes = sharding.spec[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  if classes % math.prod(sharding.mesh.shape[a] for a in axes):
    return None
  return x.reshape(rows, weight.shape[1]), weight, sharding.mesh, axes


def _rows_sharding(model, rows: int):
  """The loss rows over the data axes (and `pp` with pipeline stages, where the head
  runs) and `cp`, or None where they do not divide."""
  if model.pipeline is not None and model.pipeline.output_sharding(2, rows) is not None:
    return model.pipeline.output_sharding(2, rows)
  return model.token_sharding(rows)


def chunked_cross_entropy(logits, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk=None, sharding=None):
  """torch's cross-entropy of `logits` [N, V] (or [..., V], its leading dims the N rows) against
  class ids `targets` [N], in fp32; `sharding` (of the [N, V] rows over the data axes) is kept
  through the loops. The gradient has the logits' own shape."""
  valid = targets != ignore_index
  targets = jnp.where(valid, targets, 0).astype(jnp.int32)
  rows = _row_losses(logits, targets, valid, label_smoothing, chunk, sharding)
  if reduction == "none":
    return rows
  total = rows.sum()
  return total / valid.sum().astype(jnp.float32) if reduction == "mean" else total


def _starts(rows: int, vocab: int, chunk: int | None) -> tuple[int, int]:
  """(chunk width, number of chunks): chunk i covers `min(i * width, vocab - width)` on, so
  the last one overlaps its neighbour rather than being narrower (one loop body, no copy).

  By default a chunk is as wide as keeps its fp32 block within `CHUNK_BYTES` (a
  multiple of 128 columns, from `MIN_CHUNK` to `MAX_CHUNK`); a vocabulary that
  fits is one chunk, no loop."""
  if chunk is None:
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, CHUNK_BYTES // (4 * max(rows, 1)) // 128 * 128))
  width = min(chunk, vocab)
  return width, -(-vocab // width)


def _gradient_chunk(chunk: int | None, vocab: int) -> int | None:
  """The columns the backward's loop takes at once: as asked; by default on CPU `_starts`'s
  width, elsewhere the whole row. XLA:TPU and XLA:GPU fuse the row's gradient without an
  fp32 copy and write it into the logits' own buffer, which nothing reads after it; the loop's
  fresh buffer held both at once (8192 tokens a chip at a 128k vocabulary: 2 GiB). The
  forward's loop stays: read whole, Llama 3 1B at batch 4 × 8192 kept both buffers again (its temporaries
  4.29 → 6.23 GiB on v5p-8; Llama 3.1 8B on v6e-8 at batch 8 × 8192: 11.24 → 9.61 either way)."""
  if chunk is not None or target_device.device().platform == "cpu":
    return chunk
  return vocab


def _logsumexp(logits, chunk):
  """Each row's logsumexp in fp32: a running max and sum of exponentials over the chunks."""
  n, vocab = logits.shape
  width, count = _starts(n, vocab, chunk)

  def update(i, carry):
    m, s = carry
    start = jnp.minimum(i * width, vocab - width)
    block = _columns(logits, start, width).astype(jnp.float32)
    new = (start + jnp.arange(width) >= i * width)[None, :]  # the last chunk's overlap was counted
    new_m = jnp.maximum(m, jnp.where(new, block, -jnp.inf).max(axis=1))
    s = s * jnp.exp(m - new_m) + jnp.where(new, jnp.exp(block - new_m[:, None]), 0.0).sum(axis=1)
    return new_m, s

  carry = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
  m, s = jax.lax.fori_loop(0, count, update, carry) if count > 1 else update(0, carry)
  return m + jnp.log(s)


def _bits(x, dtype=None):
  """On the CPU, a 16-bit float array as its bit pattern (and back, given `dtype`): XLA CPU
  runs bf16 slices and updates in fp32, and for a slice of the loop-invariant logits hoists
  that cast out of the chunk loop, building the fp32 copy chunking avoids. Elsewhere `x` as
  it is: on TPU the bitcast would cost a second copy of the logits and keep the gradient's
  chunk updates from running in place (each chunk rewrote the whole [tokens, vocab] buffer)."""
  if target_device.device().platform != "cpu":
    return x
  if dtype is not None:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating) else x


def _columns(logits, start, width):
  """Columns `start` to `start + width` of `logits`, sliced as bits (see `_bits`)."""
  return _bits(jax.lax.dynamic_slice_in_dim(_bits(logits), start, width, axis=1), logits.dtype)


def _pin(x, sharding):
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _row_losses(logits, targets, valid, smoothing, chunk, sharding):
  """Each row's loss (0 where ignored): (1-ε)(lse - x_target) + ε(lse - mean x)."""
  return _row_losses_fwd(logits, targets, valid, smoothing, chunk, sharding)[0]


def _row_losses_fwd(logits, targets, valid, smoothing, chunk, sharding):
  flat = _pin(logits.reshape(targets.shape[0], logits.shape[-1]), sharding)
  lse = _logsumexp(flat, chunk)
  picked = jnp.take_along_axis(flat, targets[:, None], axis=1)[:, 0].astype(jnp.float32)
  rows = (1.0 - smoothing) * (lse - picked)
  if smoothing:
    rows = rows + smoothing * (lse - flat.sum(axis=1, dtype=jnp.float32) / flat.shape[1])
  return jnp.where(valid, rows, 0.0), (logits, targets, valid, lse)


def _row_losses_bwd(smoothing, chunk, sharding, residuals, grad):
  """d logits = g (softmax - (1-ε) onehot - ε/V), chunk by chunk, in the logits' dtype.

  The overlapping last chunk rewrites its neighbour's columns with the same values; one chunk
  is the gradient itself, with no buffer to write it into (XLA then writes it over the logits),
  computed in the logits' own shape: XLA:TPU writes over a buffer only what has its shape."""
  logits, targets, valid, lse = residuals
  vocab = logits.shape[-1]
  n = targets.shape[0]
  width, count = _starts(n, vocab, _gradient_chunk(chunk, vocab))
  g = jnp.where(valid, grad, 0.0)

  def block_grads(block, start, lse, targets, g):
    """The gradient of `block` (columns `start` on, any leading dims: those of `lse`, `targets`, `g`)."""
    columns = start + jnp.arange(block.shape[-1])
    softmax = jnp.exp(block.astype(jnp.float32) - lse[..., None])
    target = jnp.where(columns == targets[..., None], 1.0 - smoothing, 0.0)
    return (g[..., None] * (softmax - target - smoothing / vocab)).astype(block.dtype)

  if count == 1:  # in the logits' own split too: pinned to the rows', a vocabulary split over `tp` was gathered
    lead = logits.shape[:-1]
    return block_grads(logits, 0, lse.reshape(lead), targets.reshape(lead), g.reshape(lead)), None, None
  flat = _pin(logits.reshape(n, vocab), sharding)

  def body(i, out):
    start = jnp.minimum(i * width, vocab - width)
    grads = block_grads(_columns(flat, start, width), start, lse, targets, g)
    return _bits(jax.lax.dynamic_update_slice_in_dim(_bits(out), _bits(grads), start, axis=1), out.dtype)

  out = jax.lax.fori_loop(0, count, body, _pin(jnp.empty_like(flat), sharding))
  # pinned after the loop too: a buffer left to take the split the head's backward wants
  # (its vocabulary over `tp`) was gathered whole for every chunk's update at a moving column
  # (Llama 3 1B, fsdp=4 × tp=2 on v6e-8: 63 GiB of all-gather per chip per step)
  return _pin(out, sharding).reshape(logits.shape), None, None


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


def head_cross_entropy(x, weight, targets, *, mesh, row_axes, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk=None):
  """torch's cross-entropy of `F.linear(x, weight)` ([N, d] × [V, d], rounded to their dtype as
  the linear rounds them) against class ids `targets` [N], without the logits.

  Per device (a `shard_map` over `row_axes`): its rows, and the weight gathered whole from its
  vocabulary split, so the weight's gradient leaves as a reduce-scatter."""
  valid = targets != ignore_index
  targets = jnp.where(valid, targets, 0).astype(jnp.int32)
  rows_spec, weight_spec = P(row_axes, None), P(row_axes, None)

  def local(x, weight, targets, valid):
    whole = jax.lax.all_gather(weight, row_axes, axis=0, tiled=True)
    return _head_rows(x, whole, targets, valid, float(label_smoothing), chunk)

  rows = device_checks.shard_map(
    local, mesh=mesh, in_specs=(rows_spec, weight_spec, P(row_axes), P(row_axes)), out_specs=P(row_axes), check_vma=False
  )(x, weight, targets, valid)
  if reduction == "none":
    return rows
  total = rows.sum()
  return total / valid.sum().astype(jnp.float32) if reduction == "mean" else total


def _head_block(x, weight, i, width):
  """Chunk `i` of the logits (its first column and its fp32 values, rounded to the linear's dtype)."""
  start = jnp.minimum(i * width, weight.shape[0] - width)
  rows = jax.lax.dynamic_slice_in_dim(weight, start, width, axis=0)
  dtype = jnp.result_type(x, weight)
  block = jnp.einsum("nd,vd->nv", x, rows, preferred_element_type=jnp.float32).astype(dtype).astype(jnp.float32)
  return start, rows, block


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_rows(x, weight, targets, valid, smoothing, chunk):
  """Each local row's loss (0 where ignored): (1-ε)(lse - x_target) + ε(lse - mean x)."""
  return _head_rows_fwd(x, weight, targets, valid, smoothing, chunk)[0]


def head_chunk(rows: int, vocab: int) -> int:
  """The fused head's chunk width for `rows` rows per device (the memory plan counts it)."""
  return _head_starts(rows, vocab, None)[0]


def _head_starts(rows: int, vocab: int, chunk: int | None) -> tuple[int, int]:
  if chunk is None:
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, HEAD_CHUNK_BYTES // (4 * max(rows, 1)) // 128 * 128))
  return _starts(rows, vocab, chunk)


def _head_rows_fwd(x, weight, targets, valid, smoothing, chunk):
  n, vocab = x.shape[0], weight.shape[0]
  width, count = _head_starts(n, vocab, chunk)

  def update(i, carry):
    m, s, picked, total = carry
    start, _, block = _head_block(x, weight, i, width)
    columns = start + jnp.arange(width)
    new = (columns >= i * width)[None, :]  # the last chunk's overlap was counted
    new_m = jnp.maximum(m, jnp.where(new, block, -jnp.inf).max(axis=1))
    s = s * jnp.exp(m - new_m) + jnp.where(new, jnp.exp(block - new_m[:, None]), 0.0).sum(axis=1)
    picked = picked + jnp.where(new & (columns[None, :] == targets[:, None]), block, 0.0).sum(axis=1)
    total = total + jnp.where(new, block, 0.0).sum(axis=1) if smoothing else total
    return new_m, s, picked, total

  zeros = jnp.zeros((n,), jnp.float32)
  carry = (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
  m, s, picked, total = jax.lax.fori_loop(0, count, update, carry) if count > 1 else update(0, carry)
  lse = m + jnp.log(s)
  rows = (1.0 - smoothing) * (lse - picked)
  if smoothing:
    rows = rows + smoothing * (lse - total / vocab)
  return jnp.where(valid, rows, 0.0), (x, weight, targets, valid, lse)


def _head_rows_bwd(smoothing, chunk, residuals, grad):
  """Chunk by chunk: d logits = g (softmax - (1-ε) onehot - ε/V) rounded to the linear's dtype
  (the cast its up-cast's gradient makes), then the linear's backward: d x accumulated in fp32
  over the chunks and rounded once, each chunk's rows of d weight one matmul rounded once."""
  x, weight, targets, valid, lse = residuals
  n, vocab = x.shape[0], weight.shape[0]
  width, count = _head_starts(n, vocab, chunk)
  dtype = jnp.result_type(x, weight)
  g = jnp.where(valid, grad, 0.0)[:, None]

  def body(i, carry):
    dx, dweight = carry
    start, rows, block = _head_block(x, weight, i, width)
    columns = start + jnp.arange(width)[None, :]
    softmax = jnp.exp(block - lse[:, None])
    target = jnp.where(columns == targets[:, None], 1.0 - smoothing, 0.0)
    grads = (g * (softmax - target - smoothing / vocab)).astype(dtype)
    new = columns >= i * width  # the overlapping last chunk adds only its own columns to d x
    dx = dx + jnp.einsum("nv,vd->nd", jnp.where(new, grads, 0), rows, preferred_element_type=jnp.float32)
    part = jnp.einsum("nv,nd->vd", grads, x, preferred_element_type=jnp.float32).astype(weight.dtype)
    return dx, jax.lax.dynamic_update_slice_in_dim(dweight, part, start, axis=0)

  carry = (jnp.zeros(x.shape, jnp.float32), jnp.zeros(weight.shape, weight.dtype))
  dx, dweight = jax.lax.fori_loop(0, count, body, carry) if count > 1 else body(0, carry)
  return dx.astype(x.dtype), dweight, None, None


_head_rows.defvjp(_head_rows_fwd, _head_rows_bwd)
