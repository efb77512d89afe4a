"""The gradient as torch's autograd gives it: which parameters the loss reaches (torch's `.grad is
None` for the others, so the optimizer leaves them alone), which parameters train (`trainable=`),
and whether everything came out finite."""

from __future__ import annotations

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.parallel import sharding as sharding_lib
from torch_on_tpu.training.batch import key_name


def value_and_grad(fn, reached: dict):
  """`jax.value_and_grad(fn, has_aux=True)` over its first argument (a dict of params) that
  also records, into `reached`, which params the loss depends on: a gradient output of the
  backward program that does not depend on its cotangent input is a structural zero (the
  param is unused, or used only through a detach), torch's `.grad is None`."""

  def call(params, *rest):
    loss, vjp_fn, aux = jax.vjp(lambda p: fn(p, *rest), params, has_aux=True)
    (grads,) = vjp_fn(jnp.ones_like(loss))
    names = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, _), depends in zip(names, _outputs_depend_on_input(vjp_fn, loss)):
      reached[key_name(path[0])] = reached.get(key_name(path[0]), False) or depends
    return (loss, aux), grads

  return call


def _outputs_depend_on_input(fn, example) -> list[bool]:
  """For each output leaf of `fn(example)`: whether it depends on the input (conservative:
  an equation with a dependent input makes all its outputs dependent)."""
  jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(example.shape, example.dtype)).jaxpr
  dependent = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex.Var) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  return [isinstance(v, jex.Var) and v in dependent for v in jaxpr.outvars]


def all_finite(tree) -> jax.Array:
  """True when no floating leaf of `tree` holds a NaN or Inf.

  Computed once for all the leaves that read it: XLA's simplifier turns a reduction over the
  leaves' flags into a chain of scalar ops, cheap enough that every leaf's `where(finite, new,
  old)` fusion would take its own copy of the chain (quadratic in the leaf count: Qwen3.5's
  debugmodel, 520 leaves, compiled to 367k HLO instructions). The chain here ends in a square
  root, an op XLA never copies into several fusions; the root of a count is 0 only when it is.
  """
  counts = [jnp.sum(~jnp.isfinite(x), dtype=jnp.float32) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.sqrt(sum(counts)) == 0 if counts else jnp.asarray(True)


def trainable_names(params: dict, trainable) -> frozenset:
  """The param names `trainable` (None, glob patterns or a predicate) selects; one must match."""
  if trainable is None:
    return frozenset(params)
  if callable(trainable):
    chosen = frozenset(k for k in params if trainable(k))
  else:
    patterns = [trainable] if isinstance(trainable, str) else list(trainable)
    compiled = [sharding_lib.compile_pattern(p) for p in patterns]
    chosen = frozenset(k for k in params if any(rx.match(k) for rx in compiled))
  if not chosen:
    raise TorchOnTpuError(
      f"trainable={trainable!r} selects none of the model's {len(params)} params (e.g. "
      f"'{next(iter(params), '')}'); use glob patterns over those names ('*' is one name component, '**' any)."
    )
  return chosen
