"""Index checks the compiled program makes, raised as torch raises them.

torch raises `IndexError` for an embedding id past the table, a gather or
`index_select` index past its dimension, a cross-entropy target past the
classes. A jax gather clamps or fills instead, so one bad token id would
poison a training run silently (NaN in the updated weights). Here the
lowerings that read by index call `index_in_range`; while a `ShardedModule`
forward or a train step is traced (`checking()`), that is a
`jax.experimental.checkify` check, carried through scans, remat and custom
gradients, and the program also returns whether any failed. The step then
keeps its old state (`keep_if_ok`: the update is not applied) and the error is
raised in one sentence, naming the op, the bad value and the valid range:
when a result is read (`.item()`, `float()`, `.cpu()`, `tot.to_cpu`) or, for a
train step, before the next step is dispatched.

Outside those traces a concrete index is checked at once, and a traced one
(a user's own `jax.jit`) is left unchecked, as before.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from torch_on_tpu import _compat
from torch_on_tpu.errors import TorchOnTpuError

_CHECKING = contextvars.ContextVar("device_checks", default=False)

# The attribute a returned torch tensor carries while its program's checks are unread.
PENDING_ATTRIBUTE = "_tot_pending_check"


@contextlib.contextmanager
def checking():
  """While active, `index_in_range` on traced indices becomes a check of the program."""
  token = _CHECKING.set(True)
  try:
    yield
  finally:
    _CHECKING.reset(token)


def checked(fn):
  """`fn` returning `(error, its output)`; run it (traced) inside `checking()`."""
  return checkify.checkify(fn, errors=checkify.user_checks)


class IndexOutOfRangeError(TorchOnTpuError, IndexError):
  """An index past its dimension, found by the compiled program (an IndexError, as torch's)."""


def _message(what: str, value, low: int, high: int) -> str:
  return (
    f"an index given to {what} is {value}, outside the valid range [{low}, {high}); "
    f"torch raises IndexError here, so fix the indices (token ids against the vocabulary, "
    f"targets against the classes)."
  )


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
  if not _CHECKING.get():
    return
  bad = (indices < low) | (indices >= size)
  if allowed is not None:
    bad &= indices != allowed
  flat = bad.reshape(-1)
  first = indices.reshape(-1)[jnp.argmax(flat)]
  checkify.check(~jnp.any(flat), _message(what, "{value}", low, size), value=first)


def failed(error) -> jax.Array:
  """A boolean scalar of the program: some check failed."""
  return _compat.check_failed(error)


def keep_if_ok(error, new, old):
  """`new` where every check passed, else `old` (a tree of arrays; fused into their producers)."""
  bad = failed(error)
  return jax.tree.map(lambda n, o: jnp.where(bad, o, n), new, old)


class Pending:
  """A program's check results, raised once, when read. `prefix` starts the sentence
  (default: none); `on_failure` runs before the raise (the train step's bookkeeping)."""

  def __init__(self, error, prefix: str = "", on_failure=None):
    self.error = error
    self.prefix = prefix
    self.on_failure = on_failure
    self.done = False

  def raise_if_failed(self) -> None:
    if self.done:
      return
    message = _compat.check_message(self.error)
    self.done = True
    if message:
      if self.on_failure is not None:
        self.on_failure()
      text = self.prefix + message
      raise IndexOutOfRangeError(text[0].upper() + text[1:])


def attach(tensors, pending: Pending) -> None:
  """Marks returned torch tensors: reading one raises `pending`'s error first."""
  for t in tensors:
    try:
      setattr(t, PENDING_ATTRIBUTE, pending)
    except AttributeError:  # a tensor type that takes no attributes: it is checked elsewhere
      pass


def raise_pending(tensor) -> None:
  """Raises the error of the program that made `tensor`, if a check of it failed."""
  pending = getattr(tensor, PENDING_ATTRIBUTE, None)
  if pending is not None:
    pending.raise_if_failed()
