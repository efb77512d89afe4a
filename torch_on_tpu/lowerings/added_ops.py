"""ATen ops torchax has no (working) lowering for, written from jax's pieces.

Each has a static output shape, so it can run inside a compiled program:
`ldexp`, `nonzero_static` (torchax's pads after an `argwhere` of data-dependent
size), `narrow` with a tensor start, `combinations`, `cov` (torch's Python
checks read values), `max_unpool2d/3d` (torchax's loops over the values on the
host), `index_reduce`, `adaptive_max_pool2d/3d` and `segment_reduce`. Indices
they read are range-checked like torch (`device_checks`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from torch_on_tpu import _compat, device_checks
from torch_on_tpu.errors import TorchOnTpuError

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def _float(x):
  return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


def _ldexp(x, other):
  """torch.ldexp: x · 2^other, in x's floating dtype (float32 for integers)."""
  x = _float(x)
  return x * jnp.exp2(other.astype(x.dtype))


def _nonzero_static(x, *, size, fill_value=-1):
  return jnp.argwhere(x, size=size, fill_value=fill_value).astype(jnp.int32)


def _narrow(x, dim, start, length):
  """torch.narrow with an int or tensor start (a negative start counts from the end)."""
  size = x.shape[dim]
  if isinstance(start, int):
    start = start + size if start < 0 else start
    return jax.lax.slice_in_dim(x, start, start + length, axis=dim)
  start = jnp.where(start < 0, start + size, start).astype(jnp.int32)
  device_checks.index_in_range(start, size - length + 1, what=f"narrow as its start (length {length} of {size})")
  return jax.lax.dynamic_slice_in_dim(x, start, length, axis=dim)


def _combinations(x, r=2, with_replacement=False):
  """torch.combinations of a 1-D tensor: the r-element combinations as rows, in order."""
  pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
  rows = list(pick(range(x.shape[0]), r))
  if r == 0 or not rows:
    return jnp.zeros((0,) if r == 0 else (0, r), x.dtype)
  return x[np.asarray(rows)]


def _cov(x, *, correction=1, fweights=None, aweights=None):
  """torch.cov: rows are variables, columns observations; weights as torch combines them."""
  x = _float(x)
  observations = x if x.ndim == 2 else x.reshape(1, -1)
  n = observations.shape[1]
  weights = None
  if fweights is not None:
    weights = fweights.astype(x.dtype)
  if aweights is not None:
    weights = aweights.astype(x.dtype) if weights is None else weights * aweights
  if weights is None:
    total = jnp.asarray(n, x.dtype)
    average = observations.mean(axis=1)
    norm = total - correction
  else:
    total = weights.sum()
    average = (observations * weights).sum(axis=1) / total
    if correction == 0:
      norm = total
    elif aweights is None:
      norm = total - correction
    else:
      norm = total - correction * (weights * aweights).sum() / total
  norm = jnp.maximum(norm, 0)
  centred = observations - average[:, None]
  weighted = centred if weights is None else centred * weights
  c = centred @ jnp.conj(weighted.T) / norm
  return jnp.squeeze(c)  # as torch: a 1-D input or one variable gives a scalar


def _max_unpool(x, indices, output_size, stride=None, padding=None):
  """max_unpool2d/3d: each value written at its flat index within its (batch, channel) plane."""
  spatial = tuple(int(s) for s in output_size)
  lead = x.shape[: x.ndim - len(spatial)]
  plane = math.prod(spatial)
  device_checks.index_in_range(indices, plane, what=f"max_unpool (an output plane of {plane} values)")
  values = x.reshape(-1, math.prod(x.shape[len(lead):]))
  flat = indices.reshape(values.shape).astype(jnp.int32)
  return _unpool(plane)(values, flat).reshape(*lead, *spatial)


def _unpool(plane):
  """Rows of values written at their flat indices; the gradient reads the output's gradient
  at every index, repeated ones too (torch's), where a scatter's would credit only the write
  that landed."""

  @jax.custom_vjp
  def unpool(values, flat):
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], plane), values.dtype).at[rows, flat].set(values)

  def fwd(values, flat):
    return unpool(values, flat), flat

  def bwd(flat, grad):
    return jnp.take_along_axis(grad, flat, axis=1), None

  unpool.defvjp(fwd, bwd)
  return unpool


def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
  """torch.index_reduce: rows `index[i]` of `x` along `dim` reduced with `source`'s row i."""
  if x.ndim == 0:
    return _index_reduce(x.reshape(1), 0, index.reshape(-1), source.reshape(-1), reduce, include_self=include_self).reshape(())
  device_checks.index_in_range(index, x.shape[dim], what=f"index_reduce (dimension {dim} of size {x.shape[dim]})")
  moved = jnp.moveaxis(x, dim, 0)
  src = jnp.moveaxis(source, dim, 0).astype(x.dtype)
  hit = jnp.zeros(moved.shape[0], bool).at[index].set(True).reshape(-1, *([1] * (moved.ndim - 1)))
  if reduce == "mean":
    counts = jnp.zeros(moved.shape[0], x.dtype).at[index].add(1).reshape(hit.shape)
    total = jnp.where(hit & ~include_self, 0, moved).at[index].add(src)
    out = jnp.where(hit, total / (counts + (1 if include_self else 0)), moved)
    if jnp.issubdtype(x.dtype, jnp.integer):
      out = jnp.floor_divide(total, counts + (1 if include_self else 0)).astype(x.dtype)
      out = jnp.where(hit, out, moved)
  elif reduce == "prod":
    out = jnp.where(hit & ~include_self, 1, moved).at[index].multiply(src)
  elif reduce in ("amax", "amin"):
    identity = -jnp.inf if reduce == "amax" else jnp.inf
    if jnp.issubdtype(x.dtype, jnp.integer):
      info = jnp.iinfo(x.dtype)
      identity = info.min if reduce == "amax" else info.max
    base = jnp.where(hit & ~include_self, identity, moved)
    out = base.at[index].max(src) if reduce == "amax" else base.at[index].min(src)
  else:
    raise TorchOnTpuError(f"index_reduce got reduce={reduce!r}; torch takes 'prod', 'mean', 'amax' or 'amin'.")
  return jnp.moveaxis(out.astype(x.dtype), 0, dim)


def _adaptive_max_pool(x, output_size):
  """adaptive_max_pool2d/3d: (values, flat indices within each plane), torch's windows
  [floor(i·L/o), ceil((i+1)·L/o)) per spatial dim, the first maximum's index."""
  spatial = len(output_size)
  sizes = x.shape[-spatial:]
  windows = [
    [(i * length // out, -(-(i + 1) * length // out)) for i in range(out)]
    for length, out in zip(sizes, output_size)
  ]
  strides = [math.prod(sizes[k + 1:]) for k in range(spatial)]
  values, indices = [], []
  for cell in itertools.product(*windows):
    block = x[(..., *(slice(lo, hi) for lo, hi in cell))]
    shape = [hi - lo for lo, hi in cell]
    flat = block.reshape(*block.shape[:-spatial], -1)
    best = jnp.argmax(flat, axis=-1)
    values.append(jnp.take_along_axis(flat, best[..., None], axis=-1)[..., 0])
    index = 0
    rest = best
    for k in range(spatial):
      inner = math.prod(shape[k + 1:])
      index = index + (cell[k][0] + rest // inner) * strides[k]
      rest = rest % inner
    indices.append(index)
  lead = x.shape[:-spatial]
  out_shape = (*lead, *output_size)
  return jnp.stack(values, -1).reshape(out_shape), jnp.stack(indices, -1).reshape(out_shape).astype(jnp.int32)


def _segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
  """torch.segment_reduce over 1-D `lengths` or `offsets` along `axis`; an empty segment
  gives `initial` (or torch's: 0 for sum, 1 for prod, NaN for mean, ∓inf for max / min)."""
  if lengths is None and offsets is not None:
    lengths = jnp.diff(offsets)
  if lengths is None or lengths.ndim != 1:
    raise TorchOnTpuError(
      "segment_reduce is lowered for 1-D lengths or offsets only; reduce each row of a batch separately."
    )
  count = lengths.shape[0]
  moved = jnp.moveaxis(data, axis, 0)
  segment = jnp.repeat(jnp.arange(count), lengths, total_repeat_length=moved.shape[0])
  reducer = {
    "sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum, "max": jax.ops.segment_max,
    "min": jax.ops.segment_min, "prod": jax.ops.segment_prod,
  }[reduce]
  out = reducer(moved, segment, num_segments=count)
  shaped = lengths.reshape(-1, *([1] * (moved.ndim - 1)))
  if initial is not None:  # torch starts each segment's accumulator at `initial`
    start = jnp.asarray(initial, out.dtype)
    out = {
      "sum": lambda: out + start, "mean": lambda: out + start, "prod": lambda: out * start,
      "max": lambda: jnp.maximum(out, start), "min": lambda: jnp.minimum(out, start),
    }[reduce]()
  if reduce == "mean":
    out = out / shaped.astype(out.dtype)
  empty = {"sum": 0.0, "prod": 1.0, "max": -jnp.inf, "min": jnp.inf, "mean": jnp.nan}[reduce]
  out = jnp.where(shaped == 0, jnp.asarray(empty if initial is None else initial, out.dtype), out)
  return jnp.moveaxis(out.astype(data.dtype), 0, axis)


def register(env) -> None:
  aten = torch.ops.aten

  def jax_op(packet, fn):
    _compat.set_op(env, packet, _compat.make_operator(packet, fn, jax_function=True))

  jax_op(aten.ldexp.Tensor, _ldexp)
  jax_op(aten.nonzero_static, _nonzero_static)
  # composite in torch (decomposed before dispatch, into value reads): lowered as functions
  for function, fn in ((torch.narrow, _narrow), (torch.Tensor.narrow, _narrow), (torch.combinations, _combinations), (torch.cov, _cov), (torch.Tensor.cov, _cov)):
    jax_op(function, fn)
  jax_op(aten.max_unpool2d, _max_unpool)
  jax_op(aten.max_unpool3d, _max_unpool)
  jax_op(aten.index_reduce, _index_reduce)
  jax_op(aten.adaptive_max_pool2d, _adaptive_max_pool)
  jax_op(aten.adaptive_max_pool3d, _adaptive_max_pool)
  jax_op(aten.segment_reduce, _segment_reduce)
