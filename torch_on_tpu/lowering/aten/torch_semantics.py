"""Ops torchax lowers unlike torch: here they compute what eager torch computes.

Each was found by `tools/op_sweep.py` (PyTorch's op_db through the public API)
returning a different answer without an error:

- special functions: `polygamma` / `digamma`'s gradient (jax's Hurwitz zeta is
  wrong for negative arguments: torch's trigamma reflection and Cephes zeta are
  written out), `i0`'s gradient (`i1`), `special_log_ndtr` (torch's formula
  differentiated through both branches of a `where` gave NaN), `elu` / `celu` /
  `selu` (their gradient is torch's `exp`, not `expm1 + 1`), `nextafter`'s
  gradient (torch's: 1 and 0), `det` of an empty matrix;
- norms: `linalg_vector_norm` returns a floating count for `ord=0` and has
  torch's gradient where the norm (or an entry) is zero; `pdist` / `cdist`
  go through it, so equal rows get torch's zero gradient, not NaN;
- `_safe_softmax` (fully masked rows are 0, and so is their gradient);
- linear algebra: `eigh` / `eigvalsh` / `pinv(hermitian=True)` read one
  triangle (`UPLO`) on every backend, `pinv` honours `atol`,
  `cholesky_inverse(upper=True)` inverts UᴴU, `lstsq` with the `gels` driver
  solves through QR (the accuracy torch's LAPACK call has);
- `as_strided_scatter` gets the gradient of a strided write; it and `as_strided`
  refuse positions past the tensor's own elements (torch reads the storage a
  view lives in, or raises; torchax clamped the index); `as_strided` on a
  tensor the program was given as a view (`base[5:15]`), or a slice the model
  took, reads by that view's storage offset and strides (`STORAGE`, `_held`),
  or refuses what lies outside it;
- `sum(..., dtype=)` sums in that dtype (torchax ignored it: a bf16 sum asked
  for fp32, as CUDA's autocast asks, came back bf16);
- `native_layer_norm` / batch norm: the saved mean and inverse deviation
  outputs carry no gradient (torch's autograd ignores them).
- `aten.__and__` / `__or__` / `__xor__` (the `&` / `|` / `^` a decomposition
  run at the dispatcher reaches) are bitwise, as `bitwise_and` & co. are:
  torchax lowered them as logical ops, so `int8 & 1` came back a bool
  (`grid_sampler_3d`'s reflection padding flipped every other reflection).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import numpy as np
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torchax.interop import jax_view, torch_view  # noqa: E402
from torchax.ops import mappings  # noqa: E402
from torchax.view import View  # noqa: E402

# ---- special functions --------------------------------------------------------------------


def _trigamma(x):
  """torch's `calc_trigamma`: reflection below 1/2, six recurrence steps, an asymptotic tail."""
  reflect = x < 0.5
  sin_pi_x = jnp.sin(jnp.pi * x)
  result = jnp.where(reflect, -(jnp.pi**2) / (sin_pi_x * sin_pi_x), 0.0)
  x = jnp.where(reflect, 1 - x, x)
  for _ in range(6):
    result = result + 1 / (x * x)
    x = x + 1
  ixx = 1 / (x * x)
  result = result + (1 + 1 / (2 * x) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / x
  return jnp.where(reflect, -result, result)


_ZETA_A = (
  12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
  -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
  1.8152105401943546773e17, -7.1661652561756670113e18,
)


def _zeta(x: float, q):
  """torch's (Cephes) Hurwitz zeta ζ(x, q) for an integer order x > 1, any q (poles: inf)."""
  eps = jnp.finfo(q.dtype).eps / 2
  s = q**-x

  def cond(carry):
    i, a, _, _, done = carry
    return jnp.any(~done)

  def body(carry):
    i, a, b, s, done = carry
    a_next = a + 1
    b_next = a_next**-x
    s_next = s + b_next
    converged = (-eps * s_next < b_next) & (b_next < eps * s_next)
    keep = done
    a = jnp.where(keep, a, a_next)
    b = jnp.where(keep, b, b_next)
    s = jnp.where(keep, s, s_next)
    early = ~keep & converged
    i = jnp.where(keep, i, i + 1)
    done = keep | early | ((i >= 9) & (a > 9.0))
    return i, a, b, s, done

  start = (jnp.zeros(q.shape, jnp.int32), q, jnp.zeros_like(q), s, jnp.zeros(q.shape, bool))
  i, a, b, s_loop, _ = jax.lax.while_loop(cond, body, start)
  converged = (-eps * s_loop < b) & (b < eps * s_loop) & (i > 0)
  w = a
  s = s_loop + b * w / (x - 1) - 0.5 * b
  a_coef = jnp.ones_like(q)
  k = 0.0
  tail_done = jnp.zeros(q.shape, bool)
  for coef in _ZETA_A:
    a_coef = a_coef * (x + k)
    b = b / w
    t = a_coef * b / coef
    s = jnp.where(tail_done, s, s + t)
    tail_done = tail_done | (jnp.abs(t / s) < eps)
    k += 1
    a_coef = a_coef * (x + k)
    b = b / w
    k += 1
  result = jnp.where(converged, s_loop, s)
  pole = (q <= 0) & (q == jnp.floor(q))
  return jnp.where(pole, jnp.inf, result)


def _polygamma_value(n: int, x):
  if n == 0:
    return jax.scipy.special.digamma(x)
  if n == 1:
    return _trigamma(x)
  sign = 1.0 if n % 2 else -1.0
  return sign * math.exp(math.lgamma(n + 1.0)) * _zeta(float(n + 1), x)


@jax.custom_jvp
def _digamma(x):
  return jnp.where(x == 0, -jnp.inf, jax.scipy.special.digamma(x))


@_digamma.defjvp
def _digamma_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _digamma(x), _trigamma(x) * t


def _polygamma_fn(n: int):
  @jax.custom_jvp
  def polygamma(x):
    return _digamma(x) if n == 0 else _polygamma_value(n, x)

  @polygamma.defjvp
  def polygamma_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return polygamma(x), _polygamma_fn(n + 1)(x) * t

  return polygamma


def _polygamma(n, x):
  """aten.polygamma(int n, Tensor self)."""
  x = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.floating) else x
  return _polygamma_fn(int(n))(x)


@jax.custom_jvp
def _i0(x):
  return jax.scipy.special.i0(x)


@_i0.defjvp
def _i0_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _i0(x), jax.scipy.special.i1(x) * t


def _special_i0(x):
  return _i0(x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32))


def _log_ndtr(x):
  return jax.scipy.special.log_ndtr(x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32))


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
  """torch's elu: `x·scale` above 0, `alpha·scale·expm1(x·input_scale)` at or below."""
  return _elu_fn(float(alpha), float(scale), float(input_scale))(x)


def _elu_fn(alpha, scale, input_scale):
  """Computed in fp32 (at least) and rounded once each way, as torch's kernels compute a
  bf16/fp16 elu and its backward."""

  @jax.custom_jvp
  def elu(x):
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return jnp.where(x32 > 0, x32 * scale, alpha * scale * jnp.expm1(x32 * input_scale)).astype(x.dtype)

  @elu.defjvp
  def elu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    slope = jnp.where(x32 > 0, scale, alpha * scale * input_scale * jnp.exp(jnp.minimum(x32, 0) * input_scale))
    return elu(x), (slope * t.astype(slope.dtype)).astype(t.dtype)

  return elu


def _celu(x, alpha=1.0):
  return _elu(x, alpha, 1.0, 1.0 / float(alpha))


@jax.custom_jvp
def _nextafter(x, other):
  return jnp.nextafter(x, other)


@_nextafter.defjvp
def _nextafter_jvp(primals, tangents):
  """torch's gradient: 1 with respect to `self`, 0 with respect to `other`."""
  out = _nextafter(*primals)
  return out, jnp.broadcast_to(tangents[0], out.shape).astype(out.dtype)


def _linalg_det(a, original):
  """det of an empty matrix is 1 (torchax's lowering indexes past its end)."""
  if a.shape[-1] == 0:
    return jnp.ones(a.shape[:-2], a.dtype)
  return original(a)


# ---- norms --------------------------------------------------------------------------------


def _reduced_axes(ndim, dim):
  if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
    return tuple(range(ndim))
  dims = (dim,) if isinstance(dim, int) else tuple(dim)
  return tuple(sorted(d % max(ndim, 1) for d in dims)) if ndim else ()


def _norm_value(x, ord, axes, keepdim):
  a = jnp.abs(x)
  if ord == 0:
    return jnp.sum((x != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
  if ord == math.inf:
    return jnp.max(a, axis=axes, keepdims=keepdim, initial=0.0 if a.size == 0 else None)
  if ord == -math.inf:
    return jnp.min(a, axis=axes, keepdims=keepdim)
  if ord == 1:
    return jnp.sum(a, axis=axes, keepdims=keepdim)
  if ord == 2:
    return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
  return jnp.sum(a**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


def _vector_norm_fn(ord, axes, keepdim):
  @jax.custom_jvp
  def norm(x):
    return _norm_value(x, ord, axes, keepdim)

  @norm.defjvp
  def norm_jvp(primals, tangents):
    """torch's `norm_backward`, as a JVP: Σ ∂‖x‖/∂xᵢ · tᵢ with torch's values where the
    norm or an entry is zero (0 there, never NaN) and the ∞-norm's gradient split over ties."""
    (x,), (t,) = primals, tangents
    result = norm(x)
    r = result if keepdim else jnp.expand_dims(result, axes)
    if ord == 0:
      scale = jnp.zeros_like(x)
    elif ord == 1:
      scale = jnp.sign(x)
    elif ord == 2:
      scale = jnp.where(r == 0, 0.0, x / jnp.where(r == 0, 1.0, r))
    elif ord in (math.inf, -math.inf):
      mask = (jnp.abs(x) == r) | jnp.isnan(x)
      scale = jnp.sign(x) * mask / jnp.sum(mask, axis=axes, keepdims=True)
    elif ord < 1:
      powered = jnp.where(x == 0, 0.0, jnp.abs(jnp.where(x == 0, 1.0, x)) ** (ord - 1))
      scale = jnp.sign(x) * powered * r ** (1 - ord)
    elif ord < 2:
      scale = jnp.where(r == 0, 0.0, jnp.sign(x) * jnp.abs(x) ** (ord - 1) / jnp.where(r == 0, 1.0, r) ** (ord - 1))
    else:
      scale = jnp.where(r == 0, 0.0, x * jnp.abs(x) ** (ord - 2) / jnp.where(r == 0, 1.0, r) ** (ord - 1))
    return result, jnp.sum(scale * t, axis=axes, keepdims=keepdim).astype(result.dtype)

  return norm


def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
  """torch.linalg.vector_norm: a floating result (a count for ord=0), torch's gradient."""
  if dtype is not None:
    x = x.astype(mappings.t2j_dtype(dtype))
  elif not jnp.issubdtype(x.dtype, jnp.inexact):
    x = x.astype(jnp.float32)
  ord = float(ord)
  if jnp.iscomplexobj(x):
    x = jnp.abs(x)
  return _vector_norm_fn(ord, _reduced_axes(x.ndim, dim), bool(keepdim))(x)


def _cdist(x1, x2, p=2.0, compute_mode=None):
  return vector_norm(x1[..., :, None, :] - x2[..., None, :, :], p, dim=-1)


def _pdist(x, p=2.0):
  rows, cols = np.triu_indices(x.shape[0], k=1)
  return vector_norm(x[rows] - x[cols], p, dim=-1)


def _safe_softmax(x, dim, dtype=None):
  """softmax, with 0 for rows that are all -inf (and a 0 gradient there, not NaN)."""
  if dtype is not None:
    x = x.astype(mappings.t2j_dtype(dtype))
  masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
  out = jax.nn.softmax(jnp.where(masked, 0.0, x), axis=dim)
  return jnp.where(masked, 0.0, out)


# ---- linear algebra -----------------------------------------------------------------------


def _hermitian_from(a, uplo):
  """The Hermitian matrix torch's LAPACK call sees: one triangle of `a`, mirrored."""
  lower = uplo.upper() == "L"
  strict = jnp.tril(a, -1) if lower else jnp.triu(a, 1)
  diag = jnp.real(jnp.diagonal(a, axis1=-2, axis2=-1)).astype(a.dtype)
  off = strict + jnp.conj(jnp.swapaxes(strict, -1, -2))
  return off + diag[..., None] * jnp.eye(a.shape[-1], dtype=a.dtype)


def _eigh(a, UPLO="L", compute_v=True):
  w, v = jnp.linalg.eigh(_hermitian_from(a, UPLO), symmetrize_input=False)
  return w, v


def _pinv(a, atol=None, rtol=None, hermitian=False):
  """torch.linalg.pinv: singular values at or below max(atol, rtol·σ_max) are dropped
  (rtol defaults to eps·max(m, n) when neither is given, to 0 when only atol is); its
  gradient is torch's closed form (`pinv_backward`), not the SVD's, which is undefined
  where singular values repeat or vanish."""
  m, n = a.shape[-2:]
  if rtol is None:
    rtol = jnp.finfo(a.dtype).eps * max(m, n) if atol is None else 0.0
  atol = 0.0 if atol is None else atol
  return _pinv_with_torch_gradient(bool(hermitian))(a, jnp.asarray(atol, a.dtype), jnp.asarray(rtol, a.dtype))


def _pinv_value(a, atol, rtol, hermitian):
  if a.size == 0:
    return jnp.zeros((*a.shape[:-2], a.shape[-1], a.shape[-2]), a.dtype)
  if hermitian:
    w, v = jnp.linalg.eigh(_hermitian_from(a, "L"), symmetrize_input=False)
    magnitude = jnp.abs(w)
    cutoff = jnp.maximum(atol, rtol * jnp.max(magnitude, axis=-1, keepdims=True))
    inverse = jnp.where(magnitude > cutoff, 1 / jnp.where(magnitude > cutoff, w, 1), 0)
    return (v * inverse[..., None, :]) @ _mh(v)
  u, s, vh = jnp.linalg.svd(a, full_matrices=False)
  cutoff = jnp.maximum(atol, rtol * jnp.max(s, axis=-1, keepdims=True))
  inverse = jnp.where(s > cutoff, 1 / jnp.where(s > cutoff, s, 1), 0).astype(a.dtype)
  return (_mh(vh) * inverse[..., None, :]) @ _mh(u)


def _mh(x):
  return jnp.conj(jnp.swapaxes(x, -1, -2))


def _pinv_with_torch_gradient(hermitian):
  @jax.custom_vjp
  def pinv(a, atol, rtol):
    return _pinv_value(a, atol, rtol, hermitian)

  def fwd(a, atol, rtol):
    p = pinv(a, atol, rtol)
    return p, (a, p, atol, rtol)

  def bwd(residuals, grad):
    a, p, atol, rtol = residuals
    m, n = a.shape[-2:]
    ph, gh = _mh(p), _mh(grad)
    if m <= n:
      k = gh @ p
      k_ph = k @ ph
      ga = -_mh(p @ k) + k_ph - (a @ p) @ k_ph + (ph @ p) @ (gh - k @ a)
    else:
      k = p @ gh
      ph_k = ph @ k
      ga = -_mh(k @ p) + ph_k - ph_k @ p @ a + (gh - a @ k) @ p @ ph
    return ga, jnp.zeros_like(atol), jnp.zeros_like(rtol)

  pinv.defvjp(fwd, bwd)
  return pinv


def _cholesky_inverse(factor, upper=False):
  """(LLᴴ)⁻¹ from its Cholesky factor: L, or U with upper=True (A = UᴴU)."""
  factor_h = jnp.conj(jnp.swapaxes(factor, -1, -2))
  return jnp.linalg.inv(factor_h @ factor if upper else factor @ factor_h)


def _lstsq(a, b, rcond=None, driver=None, *, original=None):
  """torch.linalg.lstsq: the `gels` driver (full rank assumed, as LAPACK's) solves through
  QR; the rank-revealing drivers keep torchax's SVD solution, with torch's gradient: that of
  pinv(A)·B (the SVD's own is inaccurate where singular values are close), the residuals'
  through it, none through the singular values."""
  m, n = a.shape[-2:]
  vector = b.ndim == a.ndim - 1
  rhs = b[..., None] if vector else b
  if driver != "gels":
    x, residuals, rank, singular_values = original(a, b, rcond=rcond, driver=driver or "gelsy")
    through_pinv = _pinv(a) @ rhs
    x = jax.lax.stop_gradient(x if not vector else x[..., None]) + through_pinv - jax.lax.stop_gradient(through_pinv)
    if residuals.size:
      residuals = jnp.sum(jnp.abs(rhs - a @ x) ** 2, axis=-2)
    # torch's singular values carry no gradient
    return x[..., 0] if vector else x, residuals, rank, jax.lax.stop_gradient(singular_values)
  if m >= n:
    q, r = jnp.linalg.qr(a)
    x = jax.scipy.linalg.solve_triangular(r, jnp.conj(jnp.swapaxes(q, -1, -2)) @ rhs, lower=False)
  else:  # the minimum-norm solution: Aᴴ = QR, x = Q·R⁻ᴴ·b
    q, r = jnp.linalg.qr(jnp.conj(jnp.swapaxes(a, -1, -2)))
    x = q @ jax.scipy.linalg.solve_triangular(jnp.conj(jnp.swapaxes(r, -1, -2)), rhs, lower=True)
  x = x[..., 0] if vector else x
  empty = jnp.zeros((0,), a.dtype)
  residuals = empty
  if m > n:
    residuals = jnp.sum(jnp.abs(rhs - a @ (x[..., None] if vector else x)) ** 2, axis=-2)
  return x, residuals, jnp.zeros((0,), jnp.int32), empty


# The attribute a tensor the program was given carries when torch holds it as a view (a slice with a
# storage offset, a transposed tensor): (storage offset, strides), what `as_strided` reads by.
STORAGE = "_tot_storage"


def storage_layout(tensor: torch.Tensor) -> tuple | None:
  """(storage offset, strides) of a host tensor that is not its own storage read from its start in
  order (a view: `base[5:15]`, `x.t()`), else None."""
  if tensor.storage_offset() == 0 and tensor.is_contiguous():
    return None
  return tensor.storage_offset(), tuple(tensor.stride())


def mark_storage(tensor, layout: tuple | None):
  """`tensor` (traced, holding a host tensor's values) read by `as_strided` as the host tensor's
  storage is (`storage_layout`)."""
  if layout is not None:
    setattr(tensor, STORAGE, layout)
  return tensor


_reads = contextvars.ContextVar("storage_reads", default=None)


@contextlib.contextmanager
def storage_reads():
  """While active, collects the ids of the marked tensors (`mark_storage`) whose layout `as_strided`
  read: only a program that read one depends on it (a slice's storage offset differs call to call)."""
  token = _reads.set(set())
  try:
    yield _reads.get()
  finally:
    _reads.reset(token)


def _strided_index(op: str, held: np.ndarray, size, stride, storage_offset) -> np.ndarray:
  """The elements (flat, in order) of a tensor whose elements sit at storage positions `held`
  (`_held`) that `op` (as_strided, as_strided_scatter) reads. One sentence where a position is none
  of the tensor's: torch then reads the rest of the storage the tensor is a view of (or raises),
  which the program does not hold."""
  held = held.reshape(-1)
  offset = (int(held[0]) if held.size else 0) if storage_offset is None else storage_offset
  index = _positions(size, stride, offset)
  order = np.argsort(held, kind="stable")  # an expanded view holds a position more than once: its first element
  at = np.clip(np.searchsorted(held[order], index), 0, max(held.size - 1, 0))
  inside = held[order][at] == index if held.size else np.zeros(index.shape, bool)
  if not inside.all():
    outside = int(index[~inside].reshape(-1)[0])
    raise TorchOnTpuError(
      f"torch.{op} with size {tuple(size)}, stride {tuple(stride)} and storage_offset {offset} reads storage position "
      f"{outside}, which is not one of the {held.size} elements of the tensor it is called on (a view there, or past its "
      f"end): torch would read the storage that tensor is a view of, which the program does not hold; call it on the "
      f"base tensor, or .clone() the view and stay within it."
    )
  return order[at].reshape(-1)


def _positions(size, stride, offset) -> np.ndarray:
  """Storage positions of a strided tensor, in its elements' order."""
  index = np.full(tuple(size), offset, np.int64)
  for axis, (length, step) in enumerate(zip(size, stride)):
    shape = [1] * len(size)
    shape[axis] = length
    index = index + (np.arange(length) * step).reshape(shape)
  return index


def _held(x) -> np.ndarray:
  """Storage positions of `x`'s elements, in order: a slice the model took (torchax's `View`) by
  its slicing of the tensor it is a view of; a tensor the program was given as a view by its layout
  (`STORAGE`); any other tensor from 0 in order, as torch holds the result of an op that is not a
  view."""
  if isinstance(x, View):
    return np.asarray(x.view_info.transform_tensor(_held(x.parent)))
  layout = getattr(x, STORAGE, None)
  if layout is None:
    return np.arange(math.prod(x.shape)).reshape(tuple(x.shape))
  if _reads.get() is not None:
    _reads.get().add(id(x))
  return _positions(tuple(x.shape), layout[1], layout[0])


def _as_strided(x, size, stride, storage_offset=None):
  """torch's strided read of `x`'s storage (`_held`, `_strided_index`), on torch tensors: a view
  op, so a slice arrives as torchax's `View` of the tensor it slices."""
  array = jax_view(x.torch() if isinstance(x, View) else x)
  index = jnp.asarray(_strided_index("as_strided", _held(x), size, stride, storage_offset))
  return torch_view(jnp.ravel(array)[index].reshape(tuple(size)))


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
  """`x` (its storage, read contiguously) with `src` written at the strided positions.

  torch's gradient with respect to `x` is not the derivative of this (it passes
  the written slice's gradient to `x`, where the derivative is zero), so a
  gradient with respect to `x` is refused; `src`'s is the strided read.
  """
  index = _strided_index("as_strided_scatter", np.arange(x.size), size, stride, storage_offset)
  return _strided_write(jnp.asarray(index))(x, src.astype(x.dtype))


def _strided_write(index):
  @jax.custom_vjp
  def write(x, src):
    return jnp.ravel(x).at[index].set(jnp.ravel(src)).reshape(x.shape)

  def fwd(x, src):
    return write(x.value, src.value), (x.perturbed, src.value.shape)

  def bwd(residuals, grad):
    x_perturbed, src_shape = residuals
    if x_perturbed:
      raise TorchOnTpuError(
        "torch.as_strided_scatter's gradient with respect to its input is not the derivative of "
        "what it computes (torch passes the written slice's gradient to the input), so it is not "
        "reproduced; detach the input, or write with index_copy or a slice assignment instead."
      )
    if isinstance(grad, jax.custom_derivatives.SymbolicZero):
      return None, None
    return None, jnp.ravel(grad)[index].reshape(src_shape)

  write.defvjp(fwd, bwd, symbolic_zeros=True)
  return write


# ---- registration -------------------------------------------------------------------------


def _stats_without_gradient(original):
  """A norm lowering whose saved-statistics outputs (all but the first) carry no gradient."""

  def lowered(*args, **kwargs):
    out, *stats = original(*args, **kwargs)
    return (out, *(None if s is None else jax.lax.stop_gradient(s) for s in stats))

  return lowered


def _max_pool_backward_from_indices(spatial_dims):
  """`max_pool{2,3}d_with_indices_backward`: each output gradient added at the input position
  its index names (flat within its plane, as torch's indices are); torchax's approximation
  re-derives the windows and misses dilation."""

  def lowered(grad_output, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    planes = math.prod(x.shape[:-spatial_dims])
    positions = math.prod(x.shape[-spatial_dims:])
    grads = grad_output.reshape(planes, -1)
    rows = jnp.arange(planes)[:, None]
    out = jnp.zeros((planes, positions), grad_output.dtype).at[rows, indices.reshape(planes, -1)].add(grads)
    return out.reshape(x.shape)

  return lowered


def _svd(a, full_matrices=True, **kwargs):
  """torch.linalg.svd. With `full_matrices`, torch's gradient ignores the vectors past the k-th
  (its docs say so); jax defines none: the first k come from the reduced, differentiable SVD,
  the rest (an orthonormal basis of the complement) carry no gradient."""
  if not full_matrices or min(a.shape[-2:]) == max(a.shape[-2:]):
    return jnp.linalg.svd(a, full_matrices=bool(full_matrices))
  u, s, vh = jnp.linalg.svd(a, full_matrices=False)
  full_u, _, full_vh = jnp.linalg.svd(jax.lax.stop_gradient(a), full_matrices=True)
  k = s.shape[-1]
  return jnp.concatenate([u, full_u[..., k:]], axis=-1), s, jnp.concatenate([vh, full_vh[..., k:, :]], axis=-2)


def _torch_svd(a, some=True, compute_uv=True):
  """torch.svd: (U, S, V) of `_svd`; without `compute_uv`, U and V zero-filled [..., m, m] and
  [..., n, n] as torch's docs say."""
  if not compute_uv:
    m, n = a.shape[-2:]
    batch = a.shape[:-2]
    return jnp.zeros((*batch, m, m), a.dtype), jnp.linalg.svd(a, compute_uv=False), jnp.zeros((*batch, n, n), a.dtype)
  u, s, vh = _svd(a, full_matrices=not some)
  return u, s, _mh(vh)


def _group_norm_of_empty(original):
  """torchax's `native_group_norm`, with torch's statistics for an empty input: [N, group], the
  mean 0 and the inverse deviation NaN (torchax hands back the input three times)."""

  def lowered(x, weight, bias, n, c, hxw, group, eps):
    if x.size:
      return original(x, weight, bias, n, c, hxw, group, eps)
    return x, jnp.zeros((n, group), x.dtype), jnp.full((n, group), jnp.nan, x.dtype)

  return lowered


def _sum_in_dtype(original):
  """torchax's sum, after converting to the `dtype=` it was given (torch's meaning)."""

  def lowered(x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
      x = x.astype(mappings.t2j_dtype(dtype))
    return original(x, dim, keepdim)

  return lowered


def _same_dtype_as_self(name, original):
  """A scatter lowering that refuses a `src` of another dtype than `self`, as torch does
  (jnp's scatter would cast it silently)."""

  def lowered(*args, **kwargs):
    src = args[3] if len(args) > 3 else kwargs.get("src")
    if hasattr(src, "dtype") and src.dtype != args[0].dtype:
      raise TorchOnTpuError(
        f"{name}: self is {mappings.j2t_dtype(args[0].dtype)} but src is {mappings.j2t_dtype(src.dtype)}; "
        f"torch refuses scatters between dtypes: cast src to self's dtype, or compute the model in src's "
        f"(a train step's compute_dtype, a recipe's --dtype)."
      )
    return original(*args, **kwargs)

  return lowered


def _index_add(x, dim, index, source, *, alpha=1):
  """torch's index_add, with its refusal of a `source` of another dtype than `self` (torch's
  decomposition, which torchax ran, cast it silently)."""
  if source.dtype != x.dtype:
    raise TorchOnTpuError(
      f"index_add: self is {mappings.j2t_dtype(x.dtype)} but source is {mappings.j2t_dtype(source.dtype)}; "
      f"torch refuses index_add between dtypes: cast source to self's dtype, or compute the model in "
      f"source's (a train step's compute_dtype, a recipe's --dtype)."
    )
  if x.ndim == 0:
    return x + (source * alpha).reshape(())
  dim = dim % x.ndim
  return x.at[(slice(None),) * dim + (index,)].add(source if alpha == 1 else source * alpha)


def register(env) -> None:
  aten = torch.ops.aten

  def jax_op(packet, fn):
    _compat.set_op(env, packet, _compat.make_operator(packet, fn, jax_function=True))

  jax_op(aten.polygamma, _polygamma)
  jax_op(aten.special_polygamma, _polygamma)
  jax_op(aten.digamma, _digamma)
  jax_op(aten.i0, _special_i0)
  jax_op(aten.special_i0, _special_i0)
  jax_op(aten.special_log_ndtr, _log_ndtr)
  jax_op(aten.elu, _elu)
  jax_op(aten.celu, _celu)
  jax_op(aten.linalg_vector_norm, vector_norm)
  jax_op(aten._pdist_forward, _pdist)
  jax_op(aten._cdist_forward, _cdist)
  jax_op(torch.cdist, _cdist)  # torchax's own `torch.cdist` raises |Δ| to the power p, also for p = ∞
  jax_op(aten._safe_softmax.default, _safe_softmax)
  jax_op(aten._linalg_eigh, _eigh)
  jax_op(aten.linalg_pinv.atol_rtol_tensor, _pinv)
  jax_op(aten.cholesky_inverse, _cholesky_inverse)
  previous_lstsq = _compat.registered_op(env, aten.linalg_lstsq)
  jax_op(aten.linalg_lstsq, lambda *a, **k: _lstsq(*a, original=previous_lstsq.func, **k))
  jax_op(aten.as_strided_scatter, _as_strided_scatter)
  for packet in (aten.as_strided, aten.as_strided_copy):
    _compat.set_op(env, packet, _compat.make_operator(packet, _as_strided, jax_function=False, view_op=True))
  jax_op(aten.nextafter, _nextafter)
  det = _compat.registered_op(env, torch.linalg.det)
  if det is not None:
    jax_op(torch.linalg.det, lambda a: _linalg_det(a, det.func))
  jax_op(aten.sum, _sum_in_dtype(_compat.registered_op(env, aten.sum).func))
  layer_norm = _compat.registered_op(env, aten.native_layer_norm)
  jax_op(aten.native_layer_norm, _stats_without_gradient(layer_norm.func))
  group_norm = _compat.registered_op(env, aten.native_group_norm)
  jax_op(aten.native_group_norm, _group_norm_of_empty(group_norm.func))
  jax_op(aten.index_add, _index_add)
  jax_op(aten._linalg_svd, _svd)
  jax_op(torch.linalg.svd, _svd)
  jax_op(torch.svd, _torch_svd)
  jax_op(aten.max_pool2d_with_indices_backward, _max_pool_backward_from_indices(2))
  jax_op(aten.max_pool3d_with_indices_backward, _max_pool_backward_from_indices(3))
  for dunder, bitwise in ((aten.__and__, aten.bitwise_and), (aten.__or__, aten.bitwise_or), (aten.__xor__, aten.bitwise_xor)):
    jax_op(dunder, _compat.registered_op(env, bitwise).func)
  for packet in (aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_, aten.scatter_reduce, aten.scatter_reduce_):
    for target in (packet, *(getattr(packet, name) for name in packet.overloads())):
      prior = _compat.registered_op(env, target)
      if prior is not None and prior.is_jax_function:
        jax_op(target, _same_dtype_as_self(packet.__name__.split(".")[-1], prior.func))
