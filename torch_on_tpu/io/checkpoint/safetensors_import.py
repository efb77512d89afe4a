"""Pretrained weights in: a safetensors file or directory read straight into the model's
shardings, each device's rows with positioned reads, one tensor at a time."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
from pathlib import Path

import jax
import numpy as np

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io.checkpoint import dcp_import, training_state
from torch_on_tpu.wrapper import state_entries, state_loading

torchax = _compat.import_torchax()

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
  with contextlib.ExitStack() as stack:
    handles = [stack.enter_context(_SafetensorsFile(f)) for f in files]
    state_loading.load(
      jm, handles, strict=True, origin=f"the safetensors weights at {path}",
      fix="load weights saved from this model architecture and size",
    )


def import_pretrained(jm, path: str | os.PathLike) -> None:
  """Pretrained weights into `jm`: a torch.distributed.checkpoint (torchtitan's `checkpoint/step-N`,
  or its `checkpoint` directory: the latest step) by its model tensors (`dcp_import`); a run's own
  training checkpoint (`ckpt/4`, or `ckpt`: its newest step) by its params and buffers; safetensors
  under the model's own state_dict names are read by block (`import_safetensors`); an HF checkpoint
  of the architecture (names the model does not have: an HF `lm_head.weight` alone may coincide
  with torchtitan's) is converted by the model's family (torchtitan's `state_dict_adapter.from_hf`,
  whole in host memory first), then loaded as `load_state_dict(strict=True)` loads."""
  dcp = dcp_import.checkpoint_directory(Path(path))
  if dcp is not None:
    dcp_import.import_dcp(jm, dcp)
    return
  orbax = training_state.step_directory(Path(path))
  if orbax is not None:
    training_state.import_weights(jm, *orbax)
    return
  files = _safetensors_files(Path(path), also=" (nor a torch.distributed.checkpoint step or a run's training checkpoint step)")
  own = set(jm.state_dict())
  with contextlib.ExitStack() as stack:
    handles = [stack.enter_context(_SafetensorsFile(f)) for f in files]
    if all(name in own for h in handles for name in h.keys()):
      state_loading.load(
        jm, handles, strict=True, origin=f"the safetensors weights at {path}",
        fix="load weights saved from this model architecture and size",
      )
      return
    tensors = {name: state_loading.as_torch(h.read(name)) for h in handles for name in h.keys()}
  converted = jm.family.from_hf(jm.module, tensors)
  del tensors
  state_loading.load(
    jm, [state_loading.TensorSource(converted)], strict=True, origin=f"the weights at {path}, converted from HF's names",
    fix="load an HF checkpoint of this architecture and size, or weights under the model's own state_dict names",
  )


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


def _safetensors_files(path: Path, also: str = "") -> list[Path]:
  """The safetensors files `path` names; `also`: the other formats the caller looked for, said when none is there."""
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
      f"No safetensors weights at {path}{also}; give a .safetensors file or a directory holding "
      f"them (with {state_entries.INDEX_FILE} when sharded){also and ', or such a checkpoint'}."
    )
  return files
