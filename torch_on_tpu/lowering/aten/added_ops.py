"""ATen ops torchax has no (working) lowering for, written from jax's pieces.

Each has a static output shape, so it can run inside a compiled program:
`ldexp`, `nonzero_static` (torchax's pads after an `argwhere` of data-dependent
size), `narrow` with a tensor start, `combinations`, `cov` (torch's Python
checks read values), `max_unpool2d/3d` (torchax's loops over the values on the
host), `index_reduce`, `adaptive_max_pool2d/3d`, `segment_reduce`,
`householder_product` / `ormqr` (reflector by reflector: jax has no gradient
for its own), `linalg_lu` / `lu_unpack` (torchax's slice with traced bounds),
`gaussian_nll_loss` (its value check made by the program), `rrelu_with_noise`,
antialiased bilinear resizing, and the gradient of a
dilated max pool (torch's: at the max indices; jax has none). Indices they read are
range-checked like torch (`device_checks`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import device_checks

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torchax.ops import mappings  # noqa: E402


def _float(x):
  return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


def _ldexp(x, other):
  """torch.ldexp: x · 2^other, in x's floating dtype (float32 for integers)."""
  x = _float(x)
  return x * jnp.exp2(other.astype(x.dtype))


def _nonzero_static(x, *, size, fill_value=-1):
  if x.size == 0:  # jnp.argwhere fills with zeros there, torch with fill_value
    return jnp.full((size, x.ndim), fill_value, jnp.int32)
  return jnp.argwhere(x, size=size, fill_value=fill_value).astype(jnp.int32)


def _repeat_interleave_sized(prior):
  """`x.repeat_interleave(repeats, dim, output_size=n)`: with the output size given, tensor
  repeats need no host read (torchax's lowering takes no `output_size`)."""

  def lowered(x, repeats, dim=None, *, output_size=None):
    if output_size is None or isinstance(repeats, int):
      return prior(x.reshape(-1) if dim is None else x, repeats, 0 if dim is None else dim)
    x, dim = (x.reshape(-1), 0) if dim is None else (x, dim)
    repeats = jnp.broadcast_to(repeats, (x.shape[dim],))
    _check_output_size(repeats, output_size)
    return jnp.repeat(x, repeats, axis=dim, total_repeat_length=output_size)

  return lowered


def _check_output_size(repeats, output_size):
  """torch raises where `output_size` is not the repeats' sum (jnp.repeat would cut or pad)."""
  device_checks.all_true(
    jnp.sum(repeats) == output_size,
    f"repeat_interleave was given output_size={output_size}, which is not the sum of its repeats; "
    f"pass the sum (or leave output_size out).",
  )


def _repeat_interleave_indices(prior):
  """`torch.repeat_interleave(repeats, output_size=n)`: index i repeated repeats[i] times."""

  def lowered(repeats, *, output_size=None):
    if output_size is None:
      return prior(repeats)
    _check_output_size(repeats, output_size)
    return jnp.repeat(jnp.arange(repeats.shape[0]), repeats, total_repeat_length=output_size)

  return lowered


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
    # rows no index hits keep x: a divisor of 1 there, not 0, or where's gradient is 0/0 = NaN
    divisor = jnp.where(hit, counts + (1 if include_self else 0), 1)
    out = jnp.where(hit, total / divisor, moved)
    if jnp.issubdtype(x.dtype, jnp.integer):
      out = jnp.floor_divide(total, divisor).astype(x.dtype)
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
  if lengths is None and offsets is not None and offsets.ndim == 1:
    lengths = jnp.diff(offsets)
  elif lengths is not None and lengths.ndim == 1:
    offsets = jnp.concatenate([jnp.zeros(1, lengths.dtype), jnp.cumsum(lengths)])
  if lengths is None or lengths.ndim != 1:
    raise TorchOnTpuError(
      "segment_reduce is lowered for 1-D lengths or offsets only; reduce each row of a batch separately."
    )
  count = lengths.shape[0]
  moved = jnp.moveaxis(data, axis, 0)
  # row r is in segment k where offsets[k] <= r < offsets[k+1]; rows outside [offsets[0],
  # offsets[-1]) are in none (torch skips them): id `count`, which the segment ops drop
  rows = jnp.arange(moved.shape[0])
  segment = jnp.searchsorted(offsets[1:], rows, side="right")
  segment = jnp.where((rows >= offsets[0]) & (rows < offsets[-1]), segment, count)
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
  if reduce == "mean":  # an empty segment divides by 1 (then takes `empty`): 0/0 would NaN the gradient
    out = out / jnp.maximum(shaped, 1).astype(out.dtype)
  empty = {"sum": 0.0, "prod": 1.0, "max": -jnp.inf, "min": jnp.inf, "mean": jnp.nan}[reduce]
  out = jnp.where(shaped == 0, jnp.asarray(empty if initial is None else initial, out.dtype), out)
  return jnp.moveaxis(out.astype(data.dtype), 0, axis)


def _reflectors_applied(a, tau, c, *, adjoint=False, from_right=False):
  """Q·c (or Qᴴ·c, c·Q, c·Qᴴ) for Q = H₁⋯H_k, H_i = I - τᵢ vᵢvᵢᴴ, vᵢ below a's diagonal with
  a unit on it: LAPACK's compact form, applied reflector by reflector (differentiable)."""
  m = a.shape[-2]
  k = tau.shape[-1]
  rows = jnp.arange(m)
  reflectors = []
  for i in range(k):
    v = jnp.where(rows[:, None] > i, a[..., :, i : i + 1], 0) + (rows[:, None] == i).astype(a.dtype)
    reflectors.append((v, tau[..., i][..., None, None]))
  # Q·c applies H_k first; Qᴴ·c applies H₁ᴴ first; c·Q applies H₁ first; c·Qᴴ applies H_kᴴ first
  order = reflectors if adjoint != from_right else reflectors[::-1]
  for v, t in order:
    t = jnp.conj(t) if adjoint else t
    if from_right:
      c = c - (c @ v) * t @ jnp.conj(jnp.swapaxes(v, -1, -2))
    else:
      c = c - v * t @ (jnp.conj(jnp.swapaxes(v, -1, -2)) @ c)
  return c


def _householder_product(a, tau):
  """torch.linalg.householder_product: the first n columns of Q (jax has no gradient for its own)."""
  m, n = a.shape[-2:]
  eye = jnp.broadcast_to(jnp.eye(m, n, dtype=a.dtype), (*a.shape[:-2], m, n))
  return _reflectors_applied(a, tau, eye)


def _ormqr(a, tau, other, left=True, transpose=False):
  """torch.ormqr: `other` multiplied by Q (or Qᴴ) of a QR factorisation in compact form."""
  return _reflectors_applied(a, tau, other, adjoint=transpose, from_right=not left)


def _permutation_matrix(perm, m, dtype):
  """P with A = P·L·U from a permutation with A[perm] = L·U."""
  return jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=dtype), -1, -2)


def _lu_parts(lu, k):
  m, n = lu.shape[-2:]
  lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
  upper = jnp.triu(lu[..., :k, :])
  return lower, upper


def _linalg_lu(a, *, pivot=True):
  """torch.linalg.lu: (P, L, U) with A = P·L·U, for any m × n."""
  if not pivot:
    raise TorchOnTpuError("linalg.lu(pivot=False) is not lowered; use pivot=True (the default).")
  m, n = a.shape[-2:]
  lu, _, perm = jax.lax.linalg.lu(a)
  lower, upper = _lu_parts(lu, min(m, n))
  return _permutation_matrix(perm, m, a.dtype), lower, upper


def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
  """torch.lu_unpack: LAPACK's 1-based row swaps → P; the factors → L, U."""
  m, n = lu.shape[-2:]
  k = min(m, n)
  lower, upper = _lu_parts(lu, k) if unpack_data else (jnp.zeros((0,), lu.dtype),) * 2
  if not unpack_pivots:
    return jnp.zeros((0,), lu.dtype), lower, upper
  perm = jnp.broadcast_to(jnp.arange(m), (*lu.shape[:-2], m))
  swaps = pivots.astype(jnp.int32) - 1
  for i in range(pivots.shape[-1]):
    j = swaps[..., i : i + 1]
    at_i = perm[..., i : i + 1]
    at_j = jnp.take_along_axis(perm, j, axis=-1)
    perm = jnp.where(jnp.arange(m) == i, at_j, perm)
    perm = jnp.where(jnp.arange(m) == j, at_i, perm)
  return _permutation_matrix(perm, m, lu.dtype), lower, upper


def _rrelu_with_noise(x, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None, *, env=None):
  """torch's rrelu: negative inputs scaled by a slope drawn from U(lower, upper) in training
  (from the step's key), by their mean in eval."""
  if not training:
    return jnp.where(x >= 0, x, x * ((lower + upper) / 2))
  slope = jax.random.uniform(env.get_and_rotate_prng_key(generator), x.shape, x.dtype, lower, upper)
  return jnp.where(x >= 0, x, x * slope)


def _upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
  """Antialiased bilinear resize (torch's `antialias=True`): jax's triangle kernel, widened
  when shrinking, at torch's scales (the given factors, else output / input)."""
  if align_corners:
    raise TorchOnTpuError("interpolate(antialias=True, align_corners=True) is not lowered; use align_corners=False.")
  out_h, out_w = (int(s) for s in output_size)
  scale = jnp.asarray([scales_h or out_h / x.shape[-2], scales_w or out_w / x.shape[-1]], jnp.float32)
  return jax.image.scale_and_translate(
    x, (*x.shape[:-2], out_h, out_w), (x.ndim - 2, x.ndim - 1), scale, jnp.zeros(2, jnp.float32), "linear", antialias=True
  ).astype(x.dtype)


def _upsample_bilinear2d_aa_any(x, output_size, align_corners, *scales, scale_factors=None, scales_h=None, scales_w=None):
  """Both overloads: `(output_size, align_corners, scales_h, scales_w)` and `.vec`'s
  `(output_size or None, align_corners, scale_factors)`."""
  if scale_factors is not None or (scales_h, scales_w) != (None, None):
    scales = (scale_factors,) if scale_factors is not None else (scales_h, scales_w)
  if len(scales) == 1 and (scales[0] is None or isinstance(scales[0], (list, tuple))):
    factors = scales[0]
    if output_size is None:
      output_size = [int(math.floor(n * f)) for n, f in zip(x.shape[-2:], factors)]
    scales = tuple(factors) if factors else ()
  return _upsample_bilinear2d_aa(x, output_size, align_corners, *scales)


def _dilated_max_pool(original):
  """max_pool2d/3d_with_indices whose gradient jax lacks when dilated: torch's backward, the
  output's gradient added at each window's max index."""

  def lowered(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    dilations = dilation if isinstance(dilation, (list, tuple)) else [dilation]
    if all(d == 1 for d in dilations):
      return original(x, kernel_size, stride, padding, dilation, ceil_mode)
    y, indices = original(jax.lax.stop_gradient(x), kernel_size, stride, padding, dilation, ceil_mode)
    return _gradient_at_indices(len(kernel_size))(x, y, indices), indices

  return lowered


def _gradient_at_indices(spatial: int):
  @jax.custom_vjp
  def pooled(x, y, indices):
    return y

  def fwd(x, y, indices):
    return y, (x.shape, indices)

  def bwd(residuals, grad):
    shape, indices = residuals
    plane = math.prod(shape[-spatial:])
    flat = grad.reshape(-1, math.prod(grad.shape[-spatial:]))
    rows = jnp.arange(flat.shape[0])[:, None]
    dx = jnp.zeros((flat.shape[0], plane), grad.dtype).at[rows, indices.reshape(flat.shape)].add(flat)
    return dx.reshape(shape), None, None

  pooled.defvjp(fwd, bwd)
  return pooled


def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
  """F.gaussian_nll_loss without its Python check on values (`torch.any(var < 0)`): the
  program checks it (`device_checks.all_true`), and var is clamped at eps with the gradient
  of the unclamped var, as torch's no-grad clamp leaves it."""
  if not hasattr(var, "shape"):
    if var < 0:
      raise TorchOnTpuError("gaussian_nll_loss got a negative var; torch raises ValueError: var has negative entry/entries.")
    var = jnp.full_like(input, var)
  else:
    device_checks.all_true(
      var >= 0, "F.gaussian_nll_loss's var has a negative entry; torch raises ValueError here, so pass variances >= 0."
    )
  if var.shape != input.shape:
    if input.shape[:-1] == var.shape:
      var = var[..., None]
    elif not (input.ndim == var.ndim and sum(y for x, y in zip(input.shape, var.shape) if x != y) == 1):
      raise TorchOnTpuError(f"gaussian_nll_loss's var has shape {var.shape}, which does not fit input {input.shape}.")
  var = var + jax.lax.stop_gradient(jnp.maximum(var, eps) - var)
  loss = 0.5 * (jnp.log(var) + (input - target) ** 2 / var)
  if full:
    loss = loss + 0.5 * math.log(2 * math.pi)
  return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
  """torch's searchsorted: `side` (or `right`), a `sorter`, and an N-d sorted sequence searched
  row by row (torchax's lowering took none of them and searched 1-d only)."""
  side = side or ("right" if right else "left")
  values = jnp.asarray(values)
  if values.size == 0 or sorted_sequence.size == 0:  # nothing to search, or every value lands at 0
    return jnp.zeros(values.shape, jnp.int32 if out_int32 else mappings.t2j_dtype(torch.int64))
  if sorter is not None:
    sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
  if sorted_sequence.ndim <= 1:
    out = jnp.searchsorted(sorted_sequence, values, side=side)
  else:
    rows = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
    out = jax.vmap(lambda row, v: jnp.searchsorted(row, v, side=side))(rows, values.reshape(rows.shape[0], -1))
    out = out.reshape(values.shape)
  return out.astype(jnp.int32 if out_int32 else mappings.t2j_dtype(torch.int64))


def register(env) -> None:
  aten = torch.ops.aten

  def jax_op(packet, fn):
    _compat.set_op(env, packet, _compat.make_operator(packet, fn, jax_function=True))

  jax_op(aten.ldexp.Tensor, _ldexp)
  jax_op(aten.nonzero_static, _nonzero_static)
  sized = _repeat_interleave_sized(_compat.registered_op(env, aten.repeat_interleave.self_Tensor).func)
  indices = _repeat_interleave_indices(_compat.registered_op(env, aten.repeat_interleave.Tensor).func)
  for overload in (aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor):
    jax_op(overload, sized)
  method = _compat.registered_op(env, torch.Tensor.repeat_interleave).func  # cut or padded to any output_size
  jax_op(torch.Tensor.repeat_interleave, lambda x, repeats, dim=None, *, output_size=None: (
    method(x, repeats, dim) if output_size is None else sized(x, repeats, dim, output_size=output_size)
  ))
  jax_op(aten.repeat_interleave.Tensor, indices)
  for overload in (aten.searchsorted.Tensor, aten.searchsorted.Scalar):
    jax_op(overload, _searchsorted)
  # composite in torch (decomposed before dispatch, into value reads): lowered as functions
  for function, fn in ((torch.nn.functional.gaussian_nll_loss, _gaussian_nll_loss), (torch.narrow, _narrow), (torch.Tensor.narrow, _narrow), (torch.combinations, _combinations), (torch.cov, _cov), (torch.Tensor.cov, _cov)):
    jax_op(function, fn)
  jax_op(aten.max_unpool2d, _max_unpool)
  jax_op(aten.max_unpool3d, _max_unpool)
  jax_op(aten.index_reduce, _index_reduce)
  jax_op(aten.adaptive_max_pool2d, _adaptive_max_pool)
  jax_op(aten.adaptive_max_pool3d, _adaptive_max_pool)
  jax_op(aten.segment_reduce, _segment_reduce)
  jax_op(aten.linalg_householder_product, _householder_product)
  jax_op(aten.ormqr, _ormqr)
  jax_op(aten.linalg_lu, _linalg_lu)
  jax_op(aten.lu_unpack, _lu_unpack)
  for packet in (aten._upsample_bilinear2d_aa, aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa.vec):
    jax_op(packet, _upsample_bilinear2d_aa_any)
  for packet in (aten.max_pool2d_with_indices, aten.max_pool3d_with_indices):
    original = _compat.registered_op(env, packet)
    jax_op(packet, _dilated_max_pool(original.func))
  packet = aten.rrelu_with_noise
  _compat.set_op(env, packet, _compat.make_operator(packet, _rrelu_with_noise, jax_function=True, needs_env=True))
