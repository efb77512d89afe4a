"""Index checks the compiled program makes, raised as torch raises them.

torch raises `IndexError` for an embedding id past the table, a gather or
`index_select` index past its dimension, a cross-entropy target past the
classes. A jax gather clamps or fills instead, so one bad token id would
poison a training run silently (NaN in the updated weights). Here the
lowerings that read by index call `index_in_range`. While a `ShardedModule`
forward or a train step's loss is traced inside `collecting()`, each call adds
two scalars to the program: whether an index is out of range, and the first
such value. The program returns them (`Checks`); the step keeps its old state
where one is set (`failed`; the selects fuse into the update), and the host
raises one sentence naming the op, the bad value and the valid range, when a
result is read (`.item()`, `float()`, `.cpu()`, `tot.to_cpu`) or, for a
train step, before the next step is dispatched.

Checks made inside a `shard_map` region (`shard_map` here: MoE experts per data shard,
attention) leave it as outputs, combined over the devices: failed on any, the value of the
first failing device. Index reads inside a `StackedLayers` layer (scanned, looped or
rematerialised) or under `remat.checkpoint` are not checked (`not_collected`,
`unchecked`): their values live in that transform's own trace. Outside the bridge's traces a concrete
index is checked at once, and a traced one (a user's own `jax.jit`) is not.
(`jax.experimental.checkify` would carry checks through those transforms, but
in jax 0.10 it breaks custom-VJP residuals when differentiated and error
shapes across `shard_map`.)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from torch_on_tpu.errors import TorchOnTpuError

_COLLECTOR = contextvars.ContextVar("device_checks", default=None)

# The attribute a returned torch tensor carries while its program's checks are unread.
PENDING_ATTRIBUTE = "_tot_pending_check"


class IndexOutOfRangeError(TorchOnTpuError, IndexError):
  """An index past its dimension, found by the compiled program (an IndexError, as torch's)."""


class InvalidValueError(TorchOnTpuError):
  """A value torch rejects with a ValueError (a negative variance), found by the compiled program."""


def _message(what: str, value, low: int, high: int) -> str:
  return (
    f"an index given to {what} is {value}, outside the valid range [{low}, {high}); "
    f"torch raises IndexError here, so fix the indices (token ids against the vocabulary, "
    f"targets against the classes)."
  )


class Collector:
  """The checks one trace adds: per check a failure flag, the first bad value, a message."""

  def __init__(self):
    self.flags, self.values, self.messages = [], [], []  # messages: (text with {value}, error type)

  def checks(self) -> "Checks":
    """The program's outputs for these checks (empty arrays when there are none)."""
    if not self.flags:
      return Checks(jnp.zeros((0,), bool), jnp.zeros((0,), jnp.int32))
    return Checks(jnp.stack(self.flags), jnp.stack(self.values).astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Checks:
  """Arrays a program returns: `flags[i]` check i failed, `values[i]` its first bad index."""

  flags: jax.Array
  values: jax.Array

  def failed(self) -> jax.Array:
    return jnp.any(self.flags)

  def first_of(self) -> "Checks":
    """Checks stacked over microbatches → per check: failed in any, the first bad value."""
    first = jnp.argmax(self.flags, axis=0)
    return Checks(jnp.any(self.flags, axis=0), jnp.take_along_axis(self.values, first[None], axis=0)[0])


@contextlib.contextmanager
def collecting(enabled: bool = True):
  """While active, `index_in_range` on traced indices adds a check to the `Collector` yielded
  (which stays empty when not `enabled`: the program makes no checks)."""
  collector = Collector()
  token = _COLLECTOR.set(collector if enabled else None)
  try:
    yield collector
  finally:
    _COLLECTOR.reset(token)


@contextlib.contextmanager
def not_collected():
  """While active, nothing is collected (code traced by a transform of its own: a layer of a
  stack, which may be scanned, rematerialised or traced to compare layers)."""
  token = _COLLECTOR.set(None)
  try:
    yield
  finally:
    _COLLECTOR.reset(token)


def unchecked(fn):
  """`fn` run without collecting (the body of a transform: its values cannot leave it)."""

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with not_collected():
      return fn(*args, **kwargs)

  return run


def shard_map(fn, *, mesh, in_specs, out_specs, **kwargs):
  """`jax.shard_map` whose body's checks join the caller's collector: each device's checks come
  out combined over the mesh (a device-local value cannot leave the region by itself)."""
  outer = _COLLECTOR.get()
  if outer is None:
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)
  axes = tuple(mesh.axis_names)
  inner = []

  def body(*args):
    with collecting() as collector:
      out = fn(*args)
    inner[:] = [collector]
    checks = collector.checks()
    device = jax.lax.axis_index(axes)
    first = jax.lax.pmin(jnp.where(checks.flags, device, mesh.size), axes)
    value = jax.lax.psum(jnp.where(device == first, checks.values, 0), axes)
    return out, Checks(first < mesh.size, value)

  mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(out_specs, Checks(P(), P())), **kwargs)

  def run(*args):
    out, checks = mapped(*args)
    outer.flags.extend(checks.flags)
    outer.values.extend(checks.values)
    outer.messages.extend(inner[0].messages)
    return out

  return run


def index_in_range(indices, size: int, *, what: str, negative_ok: bool = False, allowed=None) -> None:
  """Checks integer `indices` (a jax array) against a dimension of `size`: [0, size), or
  [-size, size) with `negative_ok`; `allowed` is one more value that passes (an ignore index)."""
  if indices is None or not jnp.issubdtype(indices.dtype, jnp.integer) or indices.size == 0:
    return
  low = -size if negative_ok else 0
  if not isinstance(indices, jax.core.Tracer):
    values = np.asarray(indices)
    bad = (values < low) | (values >= size)
    if allowed is not None:
      bad &= values != allowed
    if bad.any():
      message = _message(what, int(values[bad].flat[0]), low, size)
      raise IndexOutOfRangeError(message[0].upper() + message[1:])
    return
  collector = _COLLECTOR.get()
  if collector is None:
    return
  bad = (indices < low) | (indices >= size)
  if allowed is not None:
    bad &= indices != allowed
  flat = bad.reshape(-1)
  collector.flags.append(jnp.any(flat))
  collector.values.append(indices.reshape(-1)[jnp.argmax(flat)])
  collector.messages.append((_message(what, "{value}", low, size), IndexOutOfRangeError))


def all_true(ok, message: str) -> None:
  """Checks a condition on values (`ok`, a boolean array, all True) as `index_in_range` checks
  indices; `message` is the sentence raised (as `InvalidValueError`) when one is False."""
  if not isinstance(ok, jax.core.Tracer):
    if not np.asarray(ok).all():
      raise InvalidValueError(message)
    return
  collector = _COLLECTOR.get()
  if collector is None:
    return
  collector.flags.append(~jnp.all(ok))
  collector.values.append(jnp.zeros((), jnp.int32))
  collector.messages.append((message, InvalidValueError))


def keep_if_ok(checks: Checks, new, old):
  """`new` where every check passed, else `old` (a tree of arrays)."""
  bad = checks.failed()
  return jax.tree.map(lambda n, o: jnp.where(bad, o, n), new, old)


class Pending:
  """A program's check results with their messages, raised once, when read. `prefix`
  starts the sentence; `on_failure` runs before the raise (the train step's bookkeeping)."""

  def __init__(self, checks: Checks, messages: list[tuple[str, type]], prefix: str = "", on_failure=None):
    self.checks = checks
    self.messages = messages
    self.prefix = prefix
    self.on_failure = on_failure
    self.done = False

  def raise_if_failed(self) -> None:
    if self.done:
      return
    self.done = True
    flags = np.asarray(self.checks.flags)
    if not flags.any():
      return
    first = int(np.argmax(flags))
    if self.on_failure is not None:
      self.on_failure()
    template, error = self.messages[first]
    text = self.prefix + template.format(value=int(np.asarray(self.checks.values)[first]))
    raise error(text[0].upper() + text[1:])


def attach(tensors, pending: Pending) -> None:
  """Marks returned torch tensors: reading one raises `pending`'s error first."""
  for t in tensors:
    setattr(t, PENDING_ATTRIBUTE, pending)


def raise_pending(tensor) -> None:
  """Raises the error of the program that made `tensor`, if a check of it failed."""
  pending = getattr(tensor, PENDING_ATTRIBUTE, None)
  if pending is not None:
    pending.raise_if_failed()
