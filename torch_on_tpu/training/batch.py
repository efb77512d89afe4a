"""A step's batch as the compiled program sees it: `(inputs, labels)` split into array leaves and a
hashable static part (structure, flags, the leaves' names as the user wrote them), and the phrase
naming what changed when a new batch makes the step recompile."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding

ARRAY_TYPES = (jax.Array, np.ndarray, torch.Tensor, jax.ShapeDtypeStruct)


@dataclasses.dataclass(frozen=True)
class Static:
  """The non-array part of a batch: its structure, flag values and leaf names."""

  treedef: Any
  is_array: tuple
  statics: tuple
  names: tuple


def merge_batch(leaves, static: Static):
  it = iter(leaves)
  flat = [next(it) if a else s for a, s in zip(static.is_array, static.statics)]
  return jax.tree_util.tree_unflatten(static.treedef, flat)


def path_name(path) -> str:
  """`(inputs, labels)` paths as the user wrote them: `inputs['input_ids']`, `labels`."""
  root = ("inputs", "labels")[path[0].idx]
  return root + "".join(
    f"[{k.key!r}]" if isinstance(k, jax.tree_util.DictKey) else f"[{key_name(k)}]" for k in path[1:]
  )


def key_name(key) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def leaf_signature(x):
  return (tuple(x.shape), jnp.dtype(x.dtype), x.sharding)


def signature_change(old, new) -> str:
  """One phrase naming what differs between two step signatures."""
  old_static, old_leaves, old_gen, old_autocast = old
  new_static, new_leaves, new_gen, new_autocast = new
  if old_gen != new_gen:
    return "op overrides changed (tot.override_op)"
  if old_autocast != new_autocast:
    return f"the torch.autocast region around the step changed: {old_autocast} → {new_autocast}"
  if old_static.names != new_static.names or old_static.treedef != new_static.treedef:
    return f"the batch structure changed from {list(old_static.names)} to {list(new_static.names)}"
  if old_static.statics != new_static.statics:
    return f"a static flag changed: {old_static.statics} → {new_static.statics}"
  for name, (os_, od, osh), (ns, nd, nsh) in zip(new_static.names, old_leaves, new_leaves):
    if os_ != ns:
      return f"{name} shape {os_} → {ns}"
    if od != nd:
      return f"{name} dtype {od} → {nd}"
    if osh != nsh:
      return f"{name} sharding {_spec(osh)} → {_spec(nsh)}"
  return "the arguments changed"


def _spec(sharding) -> str:
  return str(tuple(sharding.spec)) if hasattr(sharding, "spec") else str(sharding)


def on_mesh(x: jax.Array, mesh) -> bool:
  sharding = x.sharding
  return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
  )
