"""`torch.autograd.Function`s that run with their own backward, as `jax.custom_vjp`s.

Under torchax, jax differentiates what a Function's *forward* computed; its
`backward` is never called. For most Functions that is the same gradient, but
not for those whose backward is a different computation on purpose: torchao's
float8 linear casts the incoming gradient to float8 with its own scales and
runs the two backward matmuls in float8; differentiating its forward instead
would push the gradient through the fp8 rounding of the inputs (a silently
different, lossy gradient).

A Function class passed to `run_with_own_backward` runs as a `jax.custom_vjp`
when it is applied to jax-backed tensors: the forward with a fresh context
object, the tensors it saves (with `save_for_backward` or as attributes)
carried as residuals, and its own `backward` for the cotangents. On torch
tensors its `apply` is torch's own, and no other class is touched.
"""

from __future__ import annotations

import contextlib
import warnings
import torch

from torch_on_tpu import _compat
from torch_on_tpu.errors import TorchOnTpuError

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torchax.interop import torch_view  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402
from torchax.view import View  # noqa: E402

def run_with_own_backward(cls) -> None:
  """From now on `cls.apply` on jax-backed tensors runs `cls.backward` for the gradient (idempotent)."""
  _compat.route_apply(cls, _apply)


def _is_jax_backed(x) -> bool:
  return isinstance(x, (TorchaxTensor, View))


def _apply(cls, torch_apply, *args, **kwargs):
  """`cls.apply`: a custom_vjp on jax-backed tensors, torch's own `apply` on anything else."""
  if not any(_is_jax_backed(a) for a in (*args, *kwargs.values())):
    return torch_apply(*args, **kwargs)
  if kwargs:
    raise TorchOnTpuError(
      f"{cls.__qualname__}.apply got keyword arguments ({', '.join(kwargs)}); the bridge runs it with its own "
      f"backward only from positional arguments, so pass them positionally."
    )
  return _custom_vjp_call(cls, args)


class _Context:
  """What a Function's forward and backward see as `ctx`."""

  def __init__(self, needs_input_grad: tuple[bool, ...]):
    self.needs_input_grad = needs_input_grad
    self.materialize_grads = True
    self.to_save: tuple = ()

  def save_for_backward(self, *tensors):
    self.to_save = tensors

  @property
  def saved_tensors(self) -> tuple:
    return self.to_save

  def set_materialize_grads(self, value: bool):
    self.materialize_grads = value

  def mark_non_differentiable(self, *tensors):
    pass  # their cotangents are whatever jax passes: zeros

  def mark_dirty(self, *tensors):
    raise TorchOnTpuError(
      "A torch.autograd.Function that modifies its inputs in place (ctx.mark_dirty) cannot run as a "
      "jax custom_vjp; return new tensors from its forward instead."
    )


@contextlib.contextmanager
def _computing(env):
  """Context for a Function's forward or backward: inside torchax's modes, and quiet
  about float64 (torchao computes its scales in float64 from float32 amaxes; jax
  without x64 divides in float32, which for float32 operands rounds the same)."""
  with _compat.torchax_modes(env), warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")
    yield


def _as_array(x):
  return (x.torch() if isinstance(x, View) else x).jax()


def _custom_vjp_call(cls, args: tuple):
  env = _compat.torchax_env()
  positions = [i for i, a in enumerate(args) if _is_jax_backed(a)]
  arrays = [_as_array(args[i]) for i in positions]
  differentiable = tuple(
    i in positions and jnp.issubdtype(_as_array(args[i]).dtype, jnp.inexact) for i in range(len(args))
  )
  layout = {}  # how the forward's context was filled: which attributes are tensors (residuals)

  def call_args(xs):
    full = list(args)
    for i, x in zip(positions, xs):
      full[i] = torch_view(x)
    return full

  def forward(*xs):
    ctx = _Context(differentiable)
    with _computing(env):
      out = cls.forward(ctx, *call_args(xs))
    saved = list(ctx.to_save)
    attrs = {k: v for k, v in vars(ctx).items() if k != "to_save" and isinstance(v, torch.Tensor)}
    static = {k: v for k, v in vars(ctx).items() if k != "to_save" and k not in attrs}
    layout.update(n_saved=len(saved), attr_names=list(attrs), static=static)
    residuals = tuple(None if t is None else _as_array(t) for t in (*saved, *attrs.values()))
    return jax.tree_util.tree_map(_as_array, out, is_leaf=_is_jax_backed), residuals

  def backward(residuals, cotangent):
    ctx = _Context(differentiable)
    vars(ctx).update(layout["static"])
    tensors = [None if r is None else torch_view(r) for r in residuals]
    ctx.to_save = tuple(tensors[: layout["n_saved"]])
    for k, t in zip(layout["attr_names"], tensors[layout["n_saved"]:]):
      setattr(ctx, k, t)
    grads_out = jax.tree_util.tree_map(torch_view, cotangent)
    grads_out = grads_out if isinstance(grads_out, tuple) else (grads_out,)
    with _computing(env):
      grads = cls.backward(ctx, *grads_out)
    grads = grads if isinstance(grads, tuple) else (grads,)
    out = []
    for i, x in zip(positions, arrays):
      g = grads[i] if i < len(grads) else None
      if not differentiable[i]:
        out.append(jnp.zeros(x.shape, jax.dtypes.float0))
      elif g is None:
        out.append(jnp.zeros(x.shape, x.dtype))
      else:
        out.append(_as_array(g).astype(x.dtype).reshape(x.shape))
    return tuple(out)

  @jax.custom_vjp
  def function(*xs):
    return forward(*xs)[0]

  function.defvjp(forward, backward)
  return jax.tree_util.tree_map(torch_view, function(*arrays))

