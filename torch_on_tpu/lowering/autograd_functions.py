"""Every `torch.autograd.Function` on jax-backed tensors runs with its own backward, as a `jax.custom_vjp`.

Under torchax, jax differentiates what a Function's *forward* computed; its
`backward` would never be called. For Functions whose backward is not the
derivative of their forward on purpose (straight-through estimators, gradient
reversal or clipping, torchao's float8 linear, memory-saving backwards) that is
a silently different gradient. `install()` (run by `runtime.setup()`) routes
`torch.autograd.Function.apply` once, for every subclass:

- no jax-backed tensor among the arguments: torch's own `apply`, untouched;
- torch's grad mode off (`torch.no_grad()`, or a Function applied inside
  another's forward or backward): torch's own `apply`, its outputs cut from
  jax's gradient as torch leaves them out of its graph;
- `torch.utils.checkpoint`'s reentrant Function: its function, differentiated
  by jax (its backward recomputes the forward under torch's autograd, which
  jax-backed tensors do not record; the gradient is the same);
- anything else: a `jax.custom_vjp` that calls the Function's forward and its
  backward as torch's autograd calls them (context, saved tensors and
  attributes, `needs_input_grad` from what jax differentiates, materialized or
  None gradients, non-differentiable and integer outputs, `mark_dirty`).

What cannot run that way is refused in one sentence naming the class.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.overrides
import torch.utils.checkpoint

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.custom_derivatives import SymbolicZero  # noqa: E402
from torchax.interop import torch_view  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402
from torchax.view import View  # noqa: E402

tree_flatten, tree_unflatten = _compat.torch_pytree.tree_flatten, _compat.torch_pytree.tree_unflatten


def install() -> None:
  """From now on a Function applied to jax-backed tensors runs its own backward (idempotent)."""
  _compat.route_function_apply(_apply)


def _is_jax_backed(x) -> bool:
  return isinstance(x, (TorchaxTensor, View))


def _as_array(x):
  return (x.torch() if isinstance(x, View) else x).jax()


def _apply(cls, torch_apply, *args, **kwargs):
  """`cls.apply(*args, **kwargs)` under the bridge (see the module docstring)."""
  leaves = tree_flatten((args, kwargs))[0]
  if not any(_is_jax_backed(x) for x in leaves):
    _refuse_wrapped_jax_tensors(cls, leaves)
    return torch_apply(*args, **kwargs)
  if not torch.is_grad_enabled():
    out = torch_apply(*args, **kwargs)
    return _compat.torch_pytree.tree_map(
      lambda x: torch_view(jax.lax.stop_gradient(_as_array(x))) if _is_jax_backed(x) else x, out
    )
  if cls is torch.utils.checkpoint.CheckpointFunction:
    run_function, _preserve_rng_state, *inputs = args
    return run_function(*inputs)  # one run: the recompute would draw the same random numbers
  return _FunctionCall(cls, args, kwargs).run()


def _refuse_wrapped_jax_tensors(cls, leaves) -> None:
  """A tensor subclass wrapping jax-backed tensors (a float8 tensor) as an argument, outside
  another Function's forward: neither torch's autograd nor a custom_vjp would see its gradient."""
  if not torch.is_grad_enabled():
    return
  for x in leaves:
    if isinstance(x, torch.Tensor) and hasattr(x, "__tensor_flatten__"):
      names, _ = x.__tensor_flatten__()
      if any(_is_jax_backed(getattr(x, n)) for n in names):
        raise TorchOnTpuError(
          f"{cls.__qualname__}.apply got a {type(x).__name__} that wraps jax-backed tensors; the bridge runs a "
          f"Function with its own backward on plain tensors only, so apply it to the tensors before wrapping."
        )


# Attributes of `_Context` that are the bridge's bookkeeping, not the Function's own state.
_BOOKKEEPING = ("needs_input_grad", "materialize_grads", "to_save", "dirty", "non_differentiable", "saved_for_forward")


class _Context:
  """What a Function's forward (or `setup_context`) and backward see as `ctx`."""

  def __init__(self, needs_input_grad: tuple[bool, ...]):
    self.needs_input_grad = needs_input_grad
    self.materialize_grads = True
    self.to_save: tuple = ()
    self.dirty: tuple = ()
    self.non_differentiable: tuple = ()
    self.saved_for_forward: tuple = ()

  def save_for_backward(self, *tensors):
    self.to_save = tensors

  def save_for_forward(self, *tensors):
    self.saved_for_forward = tensors  # forward-mode AD only: jax's reverse mode never reads them

  @property
  def saved_tensors(self) -> tuple:
    return self.to_save

  def set_materialize_grads(self, value: bool):
    self.materialize_grads = value

  def mark_non_differentiable(self, *tensors):
    self.non_differentiable = tensors

  def mark_dirty(self, *tensors):
    self.dirty = tensors

  def own_state(self) -> dict:
    return {k: v for k, v in vars(self).items() if k not in _BOOKKEEPING}


@contextlib.contextmanager
def _computing(env, key):
  """A Function's forward or backward as torch's autograd runs them: grad mode off, inside
  torchax's modes, random ops drawing from `key` (a key made inside a custom_vjp must not
  leak into torchax's global state), and quiet about float64 (torchao computes its scales in
  float64 from float32 amaxes; jax without x64 divides in float32, which for float32 operands
  rounds the same)."""
  with _compat.torchax_modes(env), env.override_property(prng=key), torch.no_grad(), warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")
    yield


class _ReadsOnlyItsArguments(torch.overrides.TorchFunctionMode):
  """While a forward is differentiated: an op on a tensor jax is differentiating that did not
  come in through apply's arguments (jax would fail later, on a leaked tracer) is refused."""

  def __init__(self, refusal):
    super().__init__()
    self.refusal = refusal

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    for x in tree_flatten((args, kwargs))[0]:
      if _is_jax_backed(x) and _compat.is_differentiated(_as_array(x)):
        raise self.refusal()
    return func(*args, **kwargs)


def _sum_to(grad, shape, cls, index):
  """torch's `sum_to`: a gradient of a broadcast shape is summed back to the input's."""
  if grad.shape == shape:
    return grad
  lead = grad.ndim - len(shape)
  if lead < 0 or any(s != 1 and s != g for s, g in zip(shape, grad.shape[lead:])):
    raise TorchOnTpuError(
      f"{cls.__qualname__}.backward returned a gradient of shape {tuple(grad.shape)} for input {index} of shape "
      f"{tuple(shape)}; return one of the input's shape (torch raises here too)."
    )
  axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and grad.shape[lead + i] != 1)
  return grad.sum(axis=axes, keepdims=False).reshape(shape) if axes else grad


class _FunctionCall:
  """One `cls.apply(*args, **kwargs)` as a `jax.custom_vjp` over the jax-backed tensors in its arguments.

  Tensors passed directly as arguments get gradients from the backward (keyword arguments
  are passed on as positional ones, as torch's `apply` does); tensors nested in lists or
  dicts are inputs torch's autograd does not track (zero gradient). Likewise only the forward's direct outputs get cotangents; tensors
  nested in its outputs are cut from the gradient.
  """

  def __init__(self, cls, args: tuple, kwargs: dict):
    self.cls = cls
    self.setup_context_style = cls.setup_context is not torch.autograd.Function.setup_context
    if self.setup_context_style:  # as torch does: arguments bound to forward's signature, defaults applied
      import inspect

      bound = inspect.signature(cls.forward).bind(*args, **kwargs)
      bound.apply_defaults()
      args, kwargs = bound.args, bound.kwargs
    args = (*args, *kwargs.values())  # torch's apply passes keyword arguments on as positional ones
    self.n_args = len(args)
    self.leaves, self.spec = tree_flatten(args)
    self.inputs = [i for i, x in enumerate(self.leaves) if _is_jax_backed(x)]
    self.arrays = [_as_array(self.leaves[i]) for i in self.inputs]
    top_level = {id(a): i for i, a in enumerate(args) if _is_jax_backed(a)}
    self.arg_of_input = [top_level.get(id(self.leaves[i])) for i in self.inputs]  # positional index or None
    self.env = _compat.torchax_env()
    self.layout: dict = {}  # how the last forward's outputs and context were filled

  def differentiable(self, k: int) -> bool:
    return self.arg_of_input[k] is not None and jnp.issubdtype(self.arrays[k].dtype, jnp.inexact)

  def needs_input_grad(self, perturbed) -> tuple[bool, ...]:
    needs = [False] * self.n_args
    for k, arg in enumerate(self.arg_of_input):
      if arg is not None:
        needs[arg] = self.differentiable(k) and perturbed[k]
    return tuple(needs)

  # ---- the forward -----------------------------------------------------------------------

  def forward(self, key, xs, needs_input_grad, guard=contextlib.nullcontext()):
    """The Function's forward on views of `xs`, its random ops drawing from `key`:
    (output arrays, residual arrays)."""
    cls = self.cls
    ctx = _Context(needs_input_grad)
    views = [torch_view(x) for x in xs]
    leaves = list(self.leaves)
    for i, v in zip(self.inputs, views):
      leaves[i] = v
    args = tree_unflatten(leaves, self.spec)
    with _computing(self.env, key), guard:
      if self.setup_context_style:
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
      else:
        out = cls.forward(ctx, *args)
    dirty = {id(t) for t in ctx.dirty}
    for k, (v, x) in enumerate(zip(views, xs)):
      if _as_array(v) is not x and id(v) not in dirty:
        raise TorchOnTpuError(
          f"{cls.__qualname__}.forward modifies an input in place without ctx.mark_dirty; mark it dirty "
          f"(ctx.mark_dirty) or return a new tensor."
        )
    single = not isinstance(out, tuple)
    items = (out,) if single else out
    out_leaves, out_spec = tree_flatten(items)
    top_level = {id(t): n for n, t in enumerate(items) if _is_jax_backed(t)}
    outputs = [j for j, t in enumerate(out_leaves) if _is_jax_backed(t)]
    non_differentiable = {id(t) for t in ctx.non_differentiable}
    input_of_view = {id(v): k for k, v in enumerate(views)}
    self.layout.update(
      single=single, n_items=len(items), out_spec=out_spec, outputs=outputs,
      static_out=[None if _is_jax_backed(t) else t for t in out_leaves],
      item_of_output=[top_level.get(id(out_leaves[j])) for j in outputs],
      # cut from the gradient: nested, marked non-differentiable, or not floating point
      cut=[
        id(out_leaves[j]) not in top_level or id(out_leaves[j]) in non_differentiable
        or not jnp.issubdtype(_as_array(out_leaves[j]).dtype, jnp.inexact)
        for j in outputs
      ],
      dirty_input=[input_of_view.get(id(out_leaves[j])) if id(out_leaves[j]) in dirty else None for j in outputs],
      out_avals=[jax.ShapeDtypeStruct(t.shape, _as_array(t).dtype) for t in (out_leaves[j] for j in outputs)],
      materialize=ctx.materialize_grads, needs_input_grad=ctx.needs_input_grad,
    )
    state_leaves, state_spec = tree_flatten((tuple(ctx.to_save), ctx.own_state()))
    residual_at = [j for j, t in enumerate(state_leaves) if _is_jax_backed(t) or isinstance(t, jax.Array)]
    self.layout.update(
      state_spec=state_spec, residual_at=residual_at,
      static_state=[None if j in residual_at else t for j, t in enumerate(state_leaves)],
    )
    out_arrays = tuple(_as_array(out_leaves[j]) for j in outputs)
    residuals = tuple(t if isinstance(t, jax.Array) else _as_array(t) for t in (state_leaves[j] for j in residual_at))
    return out_arrays, residuals

  # ---- the backward ----------------------------------------------------------------------

  def backward(self, residuals, cotangents):
    layout, cls = self.layout, self.cls
    *residuals, key = residuals
    zeros_in = tuple(
      jnp.zeros(x.shape, x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jax.dtypes.float0)
      for x in (key, *self.arrays)
    )
    received = [
      not (cut or isinstance(ct, SymbolicZero) or ct.dtype == jax.dtypes.float0)
      for cut, ct in zip(layout["cut"], cotangents)
    ]
    if not any(received):
      return zeros_in  # no output reached the loss: torch's autograd never calls this backward
    ctx = _Context(layout["needs_input_grad"])
    ctx.materialize_grads = layout["materialize"]
    state = list(layout["static_state"])
    for j, r in zip(layout["residual_at"], residuals):
      state[j] = torch_view(r)
    ctx.to_save, own = tree_unflatten(state, layout["state_spec"])
    vars(ctx).update(own)
    grads_out = [None] * layout["n_items"]
    for item, got, ct, aval in zip(layout["item_of_output"], received, cotangents, layout["out_avals"]):
      if item is None:
        continue
      if got:
        grads_out[item] = torch_view(ct)
      elif layout["materialize"]:
        grads_out[item] = torch_view(jnp.zeros(aval.shape, aval.dtype))
    with _computing(self.env, jax.random.fold_in(key, 1)):
      grads = cls.backward(ctx, *grads_out)
    grads = grads if isinstance(grads, tuple) else (grads,)
    if len(grads) < self.n_args or any(g is not None for g in grads[self.n_args:]):
      raise TorchOnTpuError(
        f"{cls.__qualname__}.backward returned {len(grads)} gradients for {self.n_args} inputs; return one "
        f"per input of forward, None where there is none (torch raises here too)."
      )
    out = list(zeros_in)
    for k, x in enumerate(self.arrays):
      g = grads[self.arg_of_input[k]] if self.arg_of_input[k] is not None else None
      if g is not None and self.differentiable(k):
        out[1 + k] = _sum_to(_as_array(g), x.shape, cls, self.arg_of_input[k]).astype(x.dtype)
    return tuple(out)

  # ---- the call --------------------------------------------------------------------------

  def run(self):
    guess = tuple(self.differentiable(k) for k in range(len(self.arrays)))  # the primal alone: no gradient asked

    @jax.custom_vjp
    def function(key, *xs):
      return self.forward(key, xs, self.needs_input_grad(guess))[0]

    def fwd(key, *primals):
      xs = [p.value for p in primals]
      guard = _ReadsOnlyItsArguments(self._closure_refusal)
      out, residuals = self.forward(key.value, xs, self.needs_input_grad([p.perturbed for p in primals]), guard)
      return out, (*residuals, key.value)

    function.defvjp(fwd, self.backward, symbolic_zeros=True)
    return self._outputs(function(self.env.get_and_rotate_prng_key(), *self.arrays))

  def _closure_refusal(self):
    return TorchOnTpuError(
      f"{self.cls.__qualname__}.forward computes with a jax-backed tensor that is not among its arguments "
      f"(a module's parameter?); pass every tensor it uses as an argument of apply."
    )

  def _outputs(self, out_arrays):
    layout = self.layout
    out_leaves = list(layout["static_out"])
    for j, a, cut, dirty in zip(layout["outputs"], out_arrays, layout["cut"], layout["dirty_input"]):
      if cut:
        a = jax.lax.stop_gradient(a)
      if dirty is not None:  # the caller's tensor holds the new value, and is what apply returns
        original = self.leaves[self.inputs[dirty]]
        with _compat.torchax_modes(self.env):
          original.copy_(torch_view(a))
        out_leaves[j] = original
      else:
        out_leaves[j] = torch_view(a)
    items = tree_unflatten(out_leaves, layout["out_spec"])
    return items[0] if layout["single"] else tuple(items)
