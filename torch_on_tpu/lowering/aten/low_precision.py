"""bf16 / fp16: rounded where torch rounds.

torch computes these ops on bf16/fp16 tensors in fp32 and rounds once, in the forward kernel
and in its backward kernel (`silu_backward`, `_softmax_backward_data`, ...), which reads the
input or the rounded output as torch saves it. torchax computes them in the low precision
itself (its `silu` is `x * sigmoid(x)` in bf16: two roundings, 40% of outputs one unit off)
and jax differentiates that. Here a low-precision input runs torch's formulas in fp32, rounded
once each way; any other dtype runs the lowering that was registered before.
`tools/bf16_sweep.py` measures every common op against torch eager (docs/precision.md).

Registered after every other group (`lowerings.register`), so each wraps the
fp32 lowering that group left and wins only for low-precision inputs.
"""

from __future__ import annotations

import functools
import math

import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import remat as remat_lib

_compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

_LOW_PRECISION = (jnp.bfloat16, jnp.float16)
_SQRT1_2 = 0.7071067811865476
_GELU_PDF = 0.3989422804014327  # 1/sqrt(2π): torch's M_2_SQRTPI * M_SQRT1_2 * 0.5
_GELU_TANH_BETA = 0.7978845608028654  # sqrt(2/π)
_GELU_TANH_KAPPA = 0.044715


def _rounded_once(forward, backward, saves: str):
  """`op(x, static)`: `forward(x32, *static)` rounded once to x's dtype; its gradient
  `backward(g32, saved32, *static)` rounded once, `saved` being the input or the rounded
  output (`saves`), as torch's backward kernel reads it."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
  def op(x, static):
    return forward(x.astype(jnp.float32), *static).astype(x.dtype)

  def op_fwd(x, static):
    out = op(x, static)
    return out, x if saves == "input" else out

  def op_bwd(static, saved, g):
    return (backward(g.astype(jnp.float32), saved.astype(jnp.float32), *static).astype(g.dtype),)

  op.defvjp(op_fwd, op_bwd)
  return op


def _sigmoid32(x):
  return 1 / (1 + jnp.exp(-x))


def _silu_backward(g, x):
  s = _sigmoid32(x)
  return g * s * (1 + x * (1 - s))


def _gelu(x, approximate):
  if approximate == "tanh":
    return 0.5 * x * (1 + jnp.tanh(_GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x * x * x)))
  return x * 0.5 * (1 + jax.lax.erf(x * _SQRT1_2))


def _gelu_backward(g, x, approximate):
  if approximate == "tanh":
    inner = jnp.tanh(_GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x * x * x))
    right = 0.5 * x * (1 - inner * inner) * _GELU_TANH_BETA * (1 + 3 * _GELU_TANH_KAPPA * x * x)
    return g * (0.5 * (1 + inner) + right)
  cdf = 0.5 * (1 + jax.lax.erf(x * _SQRT1_2))
  return g * (cdf + x * jnp.exp(-0.5 * x * x) * _GELU_PDF)


def _softmax32(x, dim):
  e = jnp.exp(x - jnp.max(x, axis=dim, keepdims=True))
  return e / jnp.sum(e, axis=dim, keepdims=True)


_ROUNDED_ONCE = {
  "silu": _rounded_once(lambda x: x / (1 + jnp.exp(-x)), _silu_backward, "input"),
  "sigmoid": _rounded_once(_sigmoid32, lambda g, y: g * (1 - y) * y, "output"),
  "tanh": _rounded_once(jnp.tanh, lambda g, y: g * (1 - y * y), "output"),
  "gelu": _rounded_once(_gelu, _gelu_backward, "input"),
  "leaky_relu": _rounded_once(
    lambda x, slope: jnp.where(x > 0, x, x * slope), lambda g, x, slope: jnp.where(x > 0, g, g * slope), "input"
  ),
  "softmax": _rounded_once(_softmax32, lambda g, y, dim: (g - jnp.sum(g * y, axis=dim, keepdims=True)) * y, "output"),
}


def _low_precision(x) -> bool:
  return isinstance(x, jax.Array) and x.dtype in _LOW_PRECISION


def accumulator(*operands):
  """The dtype a matmul of `operands` accumulates in before its one rounding: fp32 for
  bf16/fp16, else their own."""
  dtype = jnp.result_type(*operands)
  return jnp.float32 if dtype in _LOW_PRECISION else dtype


def _linear32(x, weight, bias=None):
  """`F.linear` of low-precision inputs as torch computes it: without a bias, jax's own dot (XLA
  accumulates a bf16 dot in fp32 and rounds once, as cuBLAS does); with one, torch's addmm: the
  bias joins the fp32 accumulator and the sum is rounded once (jax's `dot + bias` would round the
  product, then the sum), with torch's backward (`_matmul_rounded_once`)."""
  if bias is None or x.dtype != weight.dtype or bias.dtype != x.dtype:
    out = jnp.einsum("...a,ba->...b", x, weight, preferred_element_type=jnp.float32 if bias is not None else None)
    return out if bias is None else (out + bias.astype(jnp.float32)).astype(jnp.result_type(x, weight))
  return _matmul_rounded_once(x, weight.T, bias, 1.0, 1.0)


def _addmm32(bias, mat1, mat2, *, beta=1.0, alpha=1.0):
  """`addmm` of low-precision inputs: beta·bias + alpha·mat1@mat2 in fp32, rounded once."""
  if not (mat1.dtype == mat2.dtype == bias.dtype):
    out = alpha * jnp.matmul(mat1, mat2, preferred_element_type=jnp.float32) + beta * bias.astype(jnp.float32)
    return out.astype(jnp.result_type(mat1, mat2))
  return _matmul_rounded_once(mat1, mat2, bias, float(alpha), float(beta))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul_rounded_once(x, w, bias, alpha, beta):
  """alpha·(x @ w) + beta·bias with x [..., k], w [k, n], bias [n] of one low-precision dtype,
  summed in fp32 and rounded once (torch's addmm, cuBLAS's bias epilogue). Its backward is
  torch's too: each gradient a low-precision matmul accumulated in fp32 and rounded once, so
  the backward's GEMMs stay bf16 × bf16 (jax differentiating the fp32 accumulator would feed
  them an fp32 cotangent and run them in fp32)."""
  out = alpha * jnp.matmul(x, w, preferred_element_type=jnp.float32) + beta * bias.astype(jnp.float32)
  return checkpoint_name(out.astype(x.dtype), remat_lib.MATMUL_NAME)  # a dot to the remat policies


def _matmul_rounded_once_fwd(x, w, bias, alpha, beta):
  return _matmul_rounded_once(x, w, bias, alpha, beta), (x, w)


def _matmul_rounded_once_bwd(alpha, beta, saved, g):
  """torch's addmm backward: grad·wᵀ and xᵀ·grad (each rounded, then times alpha, rounded
  again), the bias's gradient beta·grad summed over rows in fp32 and rounded."""
  x, w = saved
  rows = math.prod(x.shape[:-1])
  rounded = lambda value: value.astype(x.dtype)  # noqa: E731
  scaled = lambda value, by: value if by == 1.0 else rounded(by * value.astype(jnp.float32))  # noqa: E731
  dx = scaled(rounded(jnp.matmul(g, w.T, preferred_element_type=jnp.float32)), alpha)
  dw = scaled(rounded(jnp.matmul(x.reshape(rows, -1).T, g.reshape(rows, -1), preferred_element_type=jnp.float32)), alpha)
  dbias = rounded(scaled(g, beta).astype(jnp.float32).reshape(rows, -1).sum(0))
  return dx, dw, dbias


_matmul_rounded_once.defvjp(_matmul_rounded_once_fwd, _matmul_rounded_once_bwd)


def _native_layer_norm32(x, normalized_shape, weight=None, bias=None, eps=1e-5):
  """`native_layer_norm` of a low-precision input as torch computes it: statistics and
  affine in fp32, each output rounded once (jax differentiates the fp32 form, so the
  gradients are fp32 too until the one rounding at the input's dtype)."""
  axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=axes, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), axis=axes, keepdims=True) + eps)
  out = (x32 - mean) * rstd
  if weight is not None:
    out = out * weight.astype(jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  return out.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


def _convolution_rounded_once(prior):
  """`convolution` / `conv2d` with a bias on low-precision inputs as torch's kernels compute it
  (oneDNN, cuDNN): the bias joins the fp32 accumulator and the sum is rounded once (the prior
  lowering adds the bias to the rounded convolution: two roundings). The forward convolves the
  bf16 values in fp32 (exact products, fp32 sums); the backward is torch's too: dX and dW
  convolutions of the bf16 tensors, each rounded once, the bias's gradient summed in fp32."""

  def lowering(x, weight, bias=None, *static):
    if bias is None or not (_low_precision(x) and x.dtype == weight.dtype == bias.dtype):
      return prior(x, weight, bias, *static)
    return _conv_with_bias(prior, _frozen(static))(x, weight, bias)

  return lowering


def _frozen(value):
  return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _conv_with_bias(prior, static):
  conv = lambda x, weight: prior(x, weight, None, *static)  # noqa: E731

  def channel_and_others(out, weight):  # the output's channel axis: before the spatial ones
    channel = out.ndim - (weight.ndim - 1)
    return channel, tuple(i for i in range(out.ndim) if i != channel)

  @jax.custom_vjp
  def op(x, weight, bias):
    out = conv(x.astype(jnp.float32), weight.astype(jnp.float32))
    channel, _ = channel_and_others(out, weight)
    shape = [1] * out.ndim
    shape[channel] = bias.shape[0]
    return (out + bias.astype(jnp.float32).reshape(shape)).astype(x.dtype)

  def op_fwd(x, weight, bias):
    return op(x, weight, bias), (x, weight)

  def op_bwd(saved, g):
    x, weight = saved
    _, vjp = jax.vjp(conv, x, weight)
    dx, dweight = vjp(g)
    _, others = channel_and_others(g, weight)
    return dx, dweight, g.astype(jnp.float32).sum(others).astype(g.dtype)

  op.defvjp(op_fwd, op_bwd)
  return op


def _group_norm_rounded_once(prior):
  """`native_group_norm` of a low-precision input as torch computes it: statistics and affine
  in fp32, each output rounded once; its backward is torch's kernel's, which reads the saved
  statistics as they were rounded (`_group_norm_low_precision`)."""

  def lowering(x, weight, bias, n, c, hxw, group, eps):
    if not _low_precision(x) or x.size == 0:
      return prior(x, weight, bias, n, c, hxw, group, eps)
    return _group_norm_low_precision(x, weight, bias, int(n), int(c), int(hxw), int(group), float(eps))

  return lowering


def _group_statistics(x32, n, group, eps):
  grouped = x32.reshape(n, group, -1)
  mean = jnp.mean(grouped, axis=-1)
  return mean, jax.lax.rsqrt(jnp.mean(jnp.square(grouped - mean[..., None]), axis=-1) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _group_norm_low_precision(x, weight, bias, n, c, hxw, group, eps):
  mean, rstd = _group_statistics(x.astype(jnp.float32), n, group, eps)
  out = ((x.astype(jnp.float32).reshape(n, group, -1) - mean[..., None]) * rstd[..., None]).reshape(n, c, -1)
  if weight is not None:
    out = out * weight.astype(jnp.float32)[:, None]
  if bias is not None:
    out = out + bias.astype(jnp.float32)[:, None]
  return out.reshape(x.shape).astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


def _group_norm_low_precision_fwd(x, weight, bias, n, c, hxw, group, eps):
  out, mean, rstd = _group_norm_low_precision(x, weight, bias, n, c, hxw, group, eps)
  return (out, mean, rstd), (x, weight, bias is not None, mean, rstd)


def _group_norm_low_precision_bwd(n, c, hxw, group, eps, saved, cotangents):
  """torch's `native_group_norm_backward` (its CPU kernel's formula, in fp32): from the input and
  the statistics rounded as saved; a gradient of the statistics themselves goes through their
  fp32 formula."""
  x, weight, has_bias, mean, rstd = saved
  dy, dmean, drstd = cotangents
  per_group = c // group
  x32 = x.astype(jnp.float32).reshape(n, c, -1)
  dy32 = dy.astype(jnp.float32).reshape(n, c, -1)
  mean, rstd = mean.astype(jnp.float32), rstd.astype(jnp.float32)
  gamma = jnp.ones((c,), jnp.float32) if weight is None else weight.astype(jnp.float32)
  ds, db = jnp.sum(dy32 * x32, axis=-1), jnp.sum(dy32, axis=-1)  # [n, c]
  ds_group = jnp.sum((ds * gamma).reshape(n, group, per_group), axis=-1)
  db_group = jnp.sum((db * gamma).reshape(n, group, per_group), axis=-1)
  scale = 1.0 / (per_group * x32.shape[-1])
  c2 = (db_group * mean - ds_group) * rstd * rstd * rstd * scale
  c3 = -c2 * mean - db_group * rstd * scale
  by_channel = lambda t: jnp.repeat(t, per_group, axis=1)  # noqa: E731  [n, group] → [n, c]
  dx = (by_channel(rstd) * gamma)[..., None] * dy32 + by_channel(c2)[..., None] * x32 + by_channel(c3)[..., None]
  _, statistics_vjp = jax.vjp(lambda v: _group_statistics(v, n, group, eps), x.astype(jnp.float32))
  dx = dx.reshape(x.shape) + statistics_vjp((dmean.astype(jnp.float32), drstd.astype(jnp.float32)))[0]
  dweight = None if weight is None else jnp.sum((ds - db * by_channel(mean)) * by_channel(rstd), axis=0).astype(weight.dtype)
  dbias = jnp.sum(db, axis=0).astype(dy.dtype) if has_bias else None
  return dx.astype(x.dtype), dweight, dbias


_group_norm_low_precision.defvjp(_group_norm_low_precision_fwd, _group_norm_low_precision_bwd)


def _rounded_like_torch(prior, *, rounded):
  """`rounded(x, *args)` for a bf16/fp16 first argument, else the lowering registered before."""

  def lowering(x, *args, **kwargs):
    if _low_precision(x):
      return rounded(x, *args, **kwargs)
    return prior(x, *args, **kwargs)

  return lowering


def _low_precision_lowerings() -> dict:
  """packet (or torch function) → jax function of (x, *op args): the ops `_ROUNDED_ONCE`
  covers, layer norm, and the matmuls with a bias."""
  aten = torch.ops.aten
  once = _ROUNDED_ONCE
  softmax = lambda x, dim, half_to_float=False: once["softmax"](x, (dim % x.ndim,))  # noqa: E731
  return {
    aten.silu: lambda x: once["silu"](x, ()),
    aten.sigmoid: lambda x: once["sigmoid"](x, ()),
    aten.tanh: lambda x: once["tanh"](x, ()),
    aten.gelu: lambda x, approximate="none": once["gelu"](x, (approximate,)),
    aten.leaky_relu: lambda x, negative_slope=0.01: once["leaky_relu"](x, (float(negative_slope),)),
    aten._softmax: softmax,
    aten.softmax: softmax,
    aten.native_layer_norm: _native_layer_norm32,
    aten.linear: _linear32,
    torch.nn.functional.linear: _linear32,
    aten.addmm: _addmm32,  # its first argument is the bias
  }


# packet → lowering built from the prior one (which it calls for other dtypes and forms).
_WRAPPING_THE_PRIOR = {
  torch.ops.aten.convolution: _convolution_rounded_once,
  torch.ops.aten.conv2d: _convolution_rounded_once,
  torch.ops.aten.native_group_norm: _group_norm_rounded_once,
}


def register(env) -> None:
  """Installs the bf16/fp16 lowerings over the registered ones (each keeps the prior one for other dtypes)."""
  wrappers = {packet: functools.partial(_rounded_like_torch, rounded=rounded) for packet, rounded in _low_precision_lowerings().items()}
  for packet, wrap in {**wrappers, **_WRAPPING_THE_PRIOR}.items():
    overloads = packet.overloads() if hasattr(packet, "overloads") else ()
    for target in (packet, *(getattr(packet, name) for name in overloads)):
      prior = _compat.registered_op(env, target)
      if prior is None or not prior.is_jax_function or prior.is_user_defined:
        continue  # nothing to keep for other dtypes, or a user's override_op
      _compat.set_op(env, target, _compat.make_operator(target, wrap(prior.func), jax_function=True))
