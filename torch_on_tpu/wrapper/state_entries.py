"""A model's `state_dict` as entries (name, shape, dtype, and whether a module's own array holds it),
without reading a value: what the safetensors import checks against and the export streams."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping

import numpy as np
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.wrapper import module_state

torchax = _compat.import_torchax()
from torchax.ops import mappings  # noqa: E402

logger = logging.getLogger(__name__)


INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Entry:
  """One `state_dict` name: shape and dtype, and whether it is a module's own array."""

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  direct: bool  # False: produced by a module's state_dict hook (torchtitan's wq/wk/wv)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def abstract_shapes(jm) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Every original tensor name (ties by their canonical name) → (shape, dtype)."""
  arrays = {**jm.params, **jm.buffers}
  out = {}
  for key, (originals, stacked) in jm.stored_layout().items():
    shape = arrays[key].shape[1:] if stacked else arrays[key].shape
    for original in originals:
      out[original] = (tuple(shape), np.dtype(arrays[key].dtype))
  return out


def meta_twin(prefix: str, mod: torch.nn.Module, abstract) -> torch.nn.Module:
  """A copy of a hooked module whose tensors are meta ones of its own original
  shapes and current dtypes, to run its state_dict hooks on (nothing allocated)."""
  twin = copy.deepcopy(mod)
  params = {name for name, _ in twin.named_parameters()}
  for name, _ in [*twin.named_parameters(), *twin.named_buffers()]:
    shape, dtype = abstract[f"{prefix}.{name}"]
    meta = torch.empty(shape, dtype=mappings.j2t_dtype(dtype), device="meta")
    is_param = name in params
    module_state.set_tensor(twin, name, torch.nn.Parameter(meta, requires_grad=False) if is_param else meta, is_param=is_param)
  return twin


def entries(jm) -> list[Entry]:
  """Every `state_dict` name of the model with its shape and dtype, nothing read.

  Names under a module whose state_dict hooks rename or reshape (torchtitan's
  fused `wqkv` saved as `wq`/`wk`/`wv`) take their shapes from running those
  hooks on a meta copy of the module.
  """
  abstract = abstract_shapes(jm)
  hooked = {}
  for prefix, mod in jm.hooked_modules:
    twin = meta_twin(prefix, mod, abstract)
    for name, t in twin.state_dict(prefix=prefix + ".", keep_vars=True).items():
      hooked[name] = Entry(name, tuple(t.shape), np.dtype(mappings.t2j_dtype(t.dtype)), False)
  out = []
  for name in jm.state_dict():
    if name in hooked:
      out.append(hooked[name])
    else:
      out.append(Entry(name, *abstract[jm.canonical_name(name)], True))
  return out


SAFETENSORS_DTYPES = {  # numpy dtype name → safetensors' code
  "float64": "F64",
  "float32": "F32",
  "float16": "F16",
  "bfloat16": "BF16",
  "int64": "I64",
  "int32": "I32",
  "int16": "I16",
  "int8": "I8",
  "uint8": "U8",
  "bool": "BOOL",
}

SHOWN = 5  # mismatches listed by name in an error; the rest are counted


def mismatches(found: Mapping, wanted: Mapping, *, allow_unexpected: bool = False) -> str:
  """'' when `found` has every name of `wanted` with its shape; else a summary."""
  missing = [n for n in wanted if n not in found]
  unexpected = [] if allow_unexpected else [n for n in found if n not in wanted]
  shapes = [
    f"{n} is {tuple(found[n])} but {tuple(wanted[n])} is expected"
    for n in wanted
    if n in found and tuple(found[n]) != tuple(wanted[n])
  ]
  parts = []
  for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
    if items:
      shown = ", ".join(items[:SHOWN])
      if len(items) > SHOWN:
        shown += f" and {len(items) - SHOWN} more"
      parts.append(f"{len(items)} {label}: {shown}")
  return "; ".join(parts)
