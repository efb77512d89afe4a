"""Pretrained weights in: a safetensors file or directory read straight into the model's
shardings, each device's rows with positioned reads, one tensor at a time."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import struct
from pathlib import Path

import jax
import numpy as np
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.io.checkpoint import state_entries
from torch_on_tpu.lowering.host import torch_to_numpy

torchax = _compat.import_torchax()
from torchax.ops import mappings  # noqa: E402

logger = logging.getLogger(__name__)


def import_safetensors(jm, path: str | os.PathLike) -> None:
  """Loads safetensors weights (an HF model directory, its index, or one file)
  into `jm`'s params and buffers, straight into their shardings.

  Each process reads only the slices its devices hold (layers stacked by
  `scan=True` included). Names are the model's `state_dict` names (a tied
  weight may be stored once; torchtitan's `wq`/`wk`/`wv` are fused into `wqkv`
  by the module's own load hook, per layer). Values are cast to the dtypes `jm`
  holds. Different names or shapes raise before anything is read. Each of jm's
  arrays is released before its replacement is read (so the old and the new
  model never coexist in memory); a read failing midway says jm is half-loaded.
  """
  files = _safetensors_files(Path(path))
  entries = {e.name: e for e in state_entries.entries(jm)}
  with contextlib.ExitStack() as stack:
    handles = [stack.enter_context(_SafetensorsFile(f)) for f in files]
    where = {name: h for h in handles for name in h.keys()}
    found = {name: h.shape(name) for name, h in where.items()}
    # A tied group (HF's embed_tokens / lm_head) needs only one of its names stored.
    names_of: dict[str, list[str]] = {}
    for e in entries.values():
      if e.direct:
        names_of.setdefault(jm.canonical_name(e.name), []).append(e.name)
    wanted = {e.name: e.shape for e in entries.values() if not e.direct}
    for names in names_of.values():
      for n in [n for n in names if n in found] or names[:1]:
        wanted[n] = entries[n].shape
    problems = state_entries.mismatches(found, wanted)
    if problems:
      raise TorchOnTpuError(
        f"The safetensors weights at {path} do not match the model ({problems}); "
        f"load weights saved from this model architecture and size."
      )

    readers = {}
    for canonical, names in names_of.items():
      name = next(n for n in names if n in found)
      readers[canonical] = functools.partial(where[name].read, name)
    merged: dict = {}  # hooked modules' merged tensors, kept while one array is read
    abstract = state_entries.abstract_shapes(jm)
    for prefix, mod in jm.hooked_modules:
      readers.update(_hooked_readers(prefix, state_entries.meta_twin(prefix, mod, abstract), where, merged))
    shardings = {**jm.param_shardings, **jm.buffer_shardings}
    likes = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in {**jm.params, **jm.buffers}.items()}
    todo = [(k, o, stacked) for k, (o, stacked) in jm.stored_layout().items() if jm.is_persistent(o[0])]
    for done, (key, originals, stacked) in enumerate(todo):  # non-persistent buffers: jm keeps its own
      # jm's own array goes before its replacement is read: two copies of the model never coexist.
      held = jm.params if key in jm.params else jm.buffers
      held[key] = likes[key]
      _return_freed_memory()
      try:
        held[key] = _read_array([readers[o] for o in originals], stacked, likes[key], shardings[key])
      except Exception as e:
        raise TorchOnTpuError(
          f"Importing {path} failed at '{originals[0]}' after {done} of {len(todo)} arrays were "
          f"replaced ({first_line(e)}); the model is half-loaded: build it again."
        ) from e
      merged.clear()


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

  try:
    return ctypes.CDLL("libc.so.6")
  except OSError:
    return None


def _open_safetensors(path: Path):
  """`safe_open(path)`, with a truncated or malformed file named in one sentence."""
  from safetensors import SafetensorError, safe_open

  try:
    return safe_open(str(path), framework="pt")
  except (SafetensorError, OSError) as e:
    raise TorchOnTpuError(
      f"{path} is not a readable safetensors file ({str(e).strip()}); re-download or re-export it."
    ) from None


class _SafetensorsFile:
  """One safetensors file, each block read on its own with positioned reads.

  Not through a memory map: the pages of a mapped file that were read stay in
  the process's resident memory until it is unmapped, which for a whole-model
  import is a second copy of the model next to its arrays. Here a block's rows
  are read into a buffer that lives until its device array is made.
  """

  def __init__(self, path: Path):
    with _open_safetensors(path):  # checks the header and the file's size against it
      pass
    with open(path, "rb") as f:
      size = struct.unpack("<Q", f.read(8))[0]
      self._tensors = json.loads(f.read(size))
    self._tensors.pop("__metadata__", None)
    self._start = 8 + size
    self.path = path
    self._fd = os.open(path, os.O_RDONLY)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    os.close(self._fd)

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._tensors[name]["shape"])

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    """`index` (a tuple of slices) → that block of tensor `name`; only its rows are read."""
    info = self._tensors[name]
    dtype = _numpy_dtype(info["dtype"], name, self.path)
    shape = self.shape(name)
    if not shape:
      return self._pread(info["data_offsets"][0], dtype.itemsize).view(dtype).reshape(())
    index = (*index, *[slice(None)] * (len(shape) - len(index)))
    lo, hi, _ = index[0].indices(shape[0])
    row = math.prod(shape[1:]) * dtype.itemsize
    rows = self._pread(info["data_offsets"][0] + lo * row, max(hi - lo, 0) * row)
    block = rows.view(dtype).reshape(-1, *shape[1:])
    return block[(slice(None, None, index[0].step), *index[1:])]

  def _pread(self, offset: int, count: int) -> np.ndarray:
    out = np.empty(count, np.uint8)
    view, done = memoryview(out), 0
    while done < count:
      got = os.preadv(self._fd, [view[done:]], self._start + offset + done)
      if got == 0:
        raise TorchOnTpuError(
          f"{self.path} ended while reading it (it is shorter than its header says); re-download or re-export it."
        )
      done += got
    return out


def _numpy_dtype(code: str, name: str, path: Path) -> np.dtype:
  names = {v: k for k, v in state_entries.SAFETENSORS_DTYPES.items()} | {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
  if code not in names:
    raise TorchOnTpuError(
      f"Tensor '{name}' in {path} has safetensors dtype {code}, which cannot be imported; store it as "
      f"{', '.join(sorted(names))}."
    )
  return np.dtype(jax.numpy.dtype(names[code]))


def _hooked_readers(prefix, twin, where, merged: dict) -> dict:
  """Readers for a hooked module's tensors: its stored ones merged by its own
  load hook on its meta twin (torchtitan: `wq`/`wk`/`wv` → `wqkv`), into
  `merged` when first needed."""

  def load():
    if prefix not in merged:
      own = {n[len(prefix) + 1 :]: _as_torch(where[n].read(n)) for n in where if n.startswith(prefix + ".")}
      loaded = copy.deepcopy(twin)  # the twin stays meta; `merged` alone holds the data
      loaded.load_state_dict(own, strict=True, assign=True)
      tensors = [*loaded.named_parameters(), *loaded.named_buffers()]
      merged[prefix] = {f"{prefix}.{n}": t for n, t in tensors}
    return merged[prefix]

  names = [f"{prefix}.{n}" for n, _ in [*twin.named_parameters(), *twin.named_buffers()]]
  return {name: (lambda index, name=name: torch_to_numpy(load()[name][index])) for name in names}


def _as_torch(x: np.ndarray) -> torch.Tensor:
  dtype = mappings.j2t_dtype(x.dtype)
  if x.size == 0:
    return torch.empty(x.shape, dtype=dtype)
  return torch.frombuffer(bytearray(x.tobytes()), dtype=dtype).reshape(x.shape)


def _read_array(readers, stacked: bool, like, sharding) -> jax.Array:
  """One stored array, each device's block read from the files (and cast to
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


def _safetensors_files(path: Path) -> list[Path]:
  if path.is_file():
    return [path]
  index = path / state_entries.INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
      raise TorchOnTpuError(
        f"{index} is not a safetensors index ({type(e).__name__}: {e}); re-download or re-export it."
      ) from None
    return [path / f for f in sorted(set(weight_map.values()))]
  files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
  if not files:
    raise TorchOnTpuError(
      f"No safetensors weights at {path}; give a .safetensors file or a directory holding "
      f"them (with {state_entries.INDEX_FILE} when sharded)."
    )
  return files
