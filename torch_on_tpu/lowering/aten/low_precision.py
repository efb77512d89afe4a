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

import torch

from torch_on_tpu.core import _compat

_compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

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
  """`F.linear` of low-precision inputs as torch's addmm computes it: the bias joins the fp32
  accumulator and the sum is rounded once (jax's `dot + bias` rounds the product, then the sum)."""
  out = jnp.einsum("...a,ba->...b", x, weight, preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  return out.astype(jnp.result_type(x, weight))


def _addmm32(bias, mat1, mat2, *, beta=1.0, alpha=1.0):
  """`addmm` of low-precision inputs: beta·bias + alpha·mat1@mat2 in fp32, rounded once."""
  out = alpha * jnp.matmul(mat1, mat2, preferred_element_type=jnp.float32) + beta * bias.astype(jnp.float32)
  return out.astype(jnp.result_type(mat1, mat2))


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


def _rounded_like_torch(prior, rounded):
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


def register(env) -> None:
  """Installs the bf16/fp16 lowerings over the registered ones (each keeps the prior one for other dtypes)."""
  for packet, rounded in _low_precision_lowerings().items():
    overloads = packet.overloads() if hasattr(packet, "overloads") else ()
    for target in (packet, *(getattr(packet, name) for name in overloads)):
      prior = _compat.registered_op(env, target)
      if prior is None or not prior.is_jax_function or prior.is_user_defined:
        continue  # nothing to keep for other dtypes, or a user's override_op
      _compat.set_op(env, target, _compat.make_operator(target, _rounded_like_torch(prior.func, rounded), jax_function=True))
