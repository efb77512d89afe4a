"""Named tensors into a model's shardings: each device's block read from its source (a safetensors
file, a torch state_dict) one array at a time, under the names the model's `state_dict` has."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Mapping

import jax
import numpy as np
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.lowering.host import torch_to_numpy
from torch_on_tpu.wrapper import state_entries

torchax = _compat.import_torchax()
from torchax.ops import mappings  # noqa: E402


class TensorSource:
  """A state_dict as a source: names, shapes, and a block of one tensor by index."""

  def __init__(self, state_dict: Mapping):
    self._tensors = {name: t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for name, t in state_dict.items()}

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._tensors[name].shape)

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    return torch_to_numpy(self._tensors[name].detach()[index])


def load(jm, sources, *, strict: bool, origin: str, fix: str) -> tuple[list[str], list[str]]:
  """Loads every name of `sources` (objects with `keys()`, `shape(name)` and `read(name, index)`)
  into `jm`'s params and buffers, straight into their shardings, cast to the dtypes `jm` holds;
  returns (missing, unexpected) names, as torch's `load_state_dict` does.

  A tied group (HF's `embed_tokens` / `lm_head`) needs one of its names; torchtitan's `wq`/`wk`/
  `wv` are fused into `wqkv` by the module's own load hook. Shapes that differ always raise, and
  with `strict` so do missing or unexpected names, before anything is read: "`origin` (plural:
  "the tensors of ...") do not match the model (what differs); `fix`". Without `strict`, an array some of whose names are missing keeps its values
  there (a hooked module missing any of its names keeps all of its own). Each array of `jm`
  loaded whole is released before its replacement is read (the old and the new model never
  coexist in memory); a read failing midway says `jm` is half-loaded.
  """
  entries = {e.name: e for e in state_entries.entries(jm)}
  where = {name: s for s in sources for name in s.keys()}
  found = {name: s.shape(name) for name, s in where.items()}
  names_of: dict[str, list[str]] = {}  # canonical name → its tied names
  for e in entries.values():
    if e.direct:
      names_of.setdefault(jm.canonical_name(e.name), []).append(e.name)
  wanted = {e.name: e.shape for e in entries.values() if not e.direct}
  for names in names_of.values():
    for n in [n for n in names if n in found] or names[:1]:
      wanted[n] = entries[n].shape
  problems = state_entries.mismatches(found, wanted) if strict else state_entries.mismatches(
    {n: s for n, s in found.items() if n in wanted}, {n: s for n, s in wanted.items() if n in found}
  )
  if problems:
    raise TorchOnTpuError(f"{origin[:1].upper()}{origin[1:]} do not match the model ({problems}); {fix}.")
  missing = [n for n in wanted if n not in found]
  unexpected = [n for n in found if n not in wanted]

  readers = {canonical: functools.partial(where[n].read, n) for canonical, names in names_of.items()
             for n in [next((n for n in names if n in found), None)] if n is not None}
  merged: dict = {}  # hooked modules' merged tensors, kept while one array is read
  abstract = state_entries.abstract_shapes(jm)
  for prefix, mod in jm.hooked_modules:
    own = [n for n in wanted if n.startswith(prefix + ".")]
    if all(n in found for n in own):
      readers.update(_hooked_readers(prefix, state_entries.meta_twin(prefix, mod, abstract), where, merged))
  shardings = {**jm.param_shardings, **jm.buffer_shardings}
  likes = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in {**jm.params, **jm.buffers}.items()}
  todo = [(k, o, stacked) for k, (o, stacked) in jm.stored_layout().items()
          if jm.is_persistent(o[0]) and any(n in readers for n in o)]  # non-persistent buffers: jm keeps its own
  for done, (key, originals, stacked) in enumerate(todo):
    held = jm.params if key in jm.params else jm.buffers
    kept = held[key]
    if all(n in readers for n in originals):
      held[key] = likes[key]  # released before its replacement is read: two copies never coexist
      _return_freed_memory()
      layer_readers = [readers[n] for n in originals]
    else:  # some layers of a stacked array are missing: those keep their values
      layer_readers = [readers.get(n) or _current(kept, i if stacked else None) for i, n in enumerate(originals)]
    try:
      held[key] = _read_array(layer_readers, stacked, likes[key], shardings[key])
    except Exception as e:
      raise TorchOnTpuError(
        f"Loading {origin} failed at '{originals[0]}' after {done} of {len(todo)} arrays were replaced "
        f"({first_line(e)}); the model is half-loaded: build it again."
      ) from e
    merged.clear()
  return missing, unexpected


def _current(array, layer):
  """A reader of `array`'s own values (one `layer` of a stacked array)."""
  return lambda index: np.asarray(jax.device_get((array if layer is None else array[layer])[index]))


def _hooked_readers(prefix, twin, where, merged: dict) -> dict:
  """Readers for a hooked module's tensors: its stored ones merged by its own
  load hook on its meta twin (torchtitan: `wq`/`wk`/`wv` → `wqkv`), into
  `merged` when first needed."""

  def load_merged():
    if prefix not in merged:
      own = {n[len(prefix) + 1 :]: as_torch(where[n].read(n)) for n in where if n.startswith(prefix + ".")}
      loaded = copy.deepcopy(twin)  # the twin stays meta; `merged` alone holds the data
      loaded.load_state_dict(own, strict=True, assign=True)
      tensors = [*loaded.named_parameters(), *loaded.named_buffers()]
      merged[prefix] = {f"{prefix}.{n}": t for n, t in tensors}
    return merged[prefix]

  names = [f"{prefix}.{n}" for n, _ in [*twin.named_parameters(), *twin.named_buffers()]]
  return {name: (lambda index, name=name: torch_to_numpy(load_merged()[name][index])) for name in names}


def as_torch(x: np.ndarray) -> torch.Tensor:
  """A numpy array (bfloat16 included) as a torch tensor of its own memory."""
  dtype = mappings.j2t_dtype(x.dtype)
  if x.size == 0:
    return torch.empty(x.shape, dtype=dtype)
  return torch.frombuffer(bytearray(x.tobytes()), dtype=dtype).reshape(x.shape)


def _read_array(readers, stacked: bool, like, sharding) -> jax.Array:
  """One stored array, each device's block read from its readers (and cast to
  `like.dtype`); a stacked array's block gathers that block of each layer."""

  def block(reader, index):
    return np.asarray(reader(index)).astype(like.dtype, copy=False)

  def read(index):
    if not stacked:
      return block(readers[0], index)
    layers = range(len(readers))[index[0]]
    return np.stack([block(readers[i], index[1:]) for i in layers])

  # Each block goes to its device before the next is read: one block at a time in host memory.
  blocks = sharding.addressable_devices_indices_map(tuple(like.shape))
  shards = [jax.device_put(read(index), device) for device, index in blocks.items()]
  return jax.make_array_from_single_device_arrays(tuple(like.shape), sharding, shards)


def _return_freed_memory() -> None:
  """Hands freed heap pages back to the OS (glibc's `malloc_trim`; elsewhere nothing).

  A replaced array's memory was allocated by the runtime's threads, and glibc
  keeps what they free in their own arenas, where the next array (allocated
  from other threads) does not reuse it: without this, an import over an
  initialised model held both in resident memory.
  """
  trim = getattr(_libc(), "malloc_trim", None)
  if trim is not None:
    trim(0)


@functools.cache
def _libc():
  import ctypes

  with contextlib.suppress(OSError):
    return ctypes.CDLL("libc.so.6")
  return None
