"""Exports: a trained model as a directory transformers (and peft) load, or as plain safetensors.

    export.export(jm, "runs/a/export", tokenizer="runs/a/tokenizer")  # AutoModelForCausalLM.from_pretrained
    export.export(lora_jm, "out/merged", mode="merged")               # adapters folded in: W + scaling·B·A
    export.export(lora_jm, "out/adapter", mode="adapter")             # PeftModel.from_pretrained(base, dir)
    export.export_safetensors(jm, "out/weights")                      # the model's own state_dict names

Weights are only useful once something else loads them: an HF model directory
is `config.json` and the tokenizer files beside the weights, and torchtitan's
Llama 3 is written as HF's `LlamaForCausalLM` (names and RoPE layout converted
by `models/torchtitan.py`). Tensors stream to disk one at a time, in row
chunks of at most 64 MiB cut from their device shards, so host memory never
holds the model; in a multi-process run every process takes part, a tensor
sharded across processes is gathered alone (bounded by one tensor), and
process 0 writes. The directory appears complete or not at all: it is written
under a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from torch_on_tpu import models
from torch_on_tpu.core import storage
from torch_on_tpu.errors import TorchOnTpuError, arg
from torch_on_tpu.io import data
from torch_on_tpu.models.family import FromSeveral
from torch_on_tpu.training import lora
from torch_on_tpu.wrapper import state_entries

MODES = ("full", "merged", "adapter")
_CHUNK_BYTES = 64 * 2**20  # host memory one exported array chunk may take
_ADAPTER = "default"  # the adapter name lora.wrap gives peft


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One tensor to write: its name in the files, shape, dtype, and its (global) array, made when written."""

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  array: Callable[[], jax.Array]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def export(
  jm,
  directory: str | os.PathLike,
  *,
  mode: str = "full",
  tokenizer=None,
  max_shard_bytes: int = 4 * 2**30,
  overwrite: bool = False,
  dtype: str | None = None,
  index: bool = False,
) -> Path:
  """Writes `jm` as a directory that transformers (or, for adapters, peft) loads.

  `mode` "full": an HF causal LM under its own names, or torchtitan's Llama 3
  as HF Llama, with `config.json`; "merged": a LoRA model (`lora.wrap`) with
  each adapter folded into its base weight, under the base model's names;
  "adapter": the adapters alone, as peft's `adapter_model.safetensors` and
  `adapter_config.json`. `tokenizer` (a `data.Tokenizer`, a tokenizer.json or
  a tokenizer directory) is saved beside them. An existing non-empty
  `directory` is replaced only with `overwrite=True`. `dtype` ("bfloat16", ...) casts the
  floating tensors (torchtitan's export_dtype); `index=True` writes the safetensors index even
  for one file (torchtitan finds an HF checkpoint step by it).
  """
  if mode not in MODES:
    raise TorchOnTpuError(f"Unknown export mode '{mode}'; use one of {', '.join(MODES)}.")
  peft_model = _peft_model(jm)
  if mode == "full" and peft_model is not None:
    raise TorchOnTpuError(
      "This model has LoRA adapters; export it with mode='merged' (one plain model) or mode='adapter' (peft)."
    )
  if mode != "full" and peft_model is None:
    raise TorchOnTpuError(f"Export mode '{mode}' needs a LoRA model (lora.wrap) but this one has no adapters; use mode='full'.")
  if tokenizer is not None:
    tokenizer = data.build_tokenizer(tokenizer)  # a missing one is refused before anything is written
  if mode == "adapter":
    tensors = _adapters(_state_tensors(jm))
    write_config = peft_model.peft_config[_ADAPTER].save_pretrained
    stem, max_shard_bytes = "adapter_model", None  # peft reads one file
  else:
    tensors, model = _state_tensors(jm), jm.module
    if mode == "merged":
      tensors, model = _merged(tensors, peft_model), peft_model.get_base_model()
    tensors, config = _as_hf(model, tensors)
    write_config, stem = config.save_pretrained, "model"
  if dtype is not None:
    tensors = _cast(tensors, dtype)

  def extras(tmp: Path) -> None:
    write_config(tmp)
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)

  return _write_dir(directory, tensors, stem, max_shard_bytes, overwrite, extras, index=index)


def _cast(tensors: list[_Tensor], dtype: str) -> list[_Tensor]:
  """The floating tensors in `dtype`, cast on their devices as each is written."""
  to = np.dtype(jnp.dtype(dtype))
  return [
    dataclasses.replace(t, dtype=to, array=lambda t=t: t.array().astype(to)) if jnp.issubdtype(t.dtype, jnp.floating) else t
    for t in tensors
  ]


def export_safetensors(
  jm,
  directory: str | os.PathLike,
  *,
  max_shard_bytes: int = 4 * 2**30,
  overwrite: bool = False,
) -> Path:
  """Writes the model's `state_dict`, under its own names, to a safetensors directory.

  The files load into the plain torch model with `load_state_dict(strict=True)`
  (an HF model's `config.json` is written too). Files are split at
  `max_shard_bytes` with an HF `model.safetensors.index.json`.
  """
  config = getattr(jm.module, "config", None)
  write_config = config.save_pretrained if callable(getattr(config, "save_pretrained", None)) else None
  return _write_dir(directory, _state_tensors(jm), "model", max_shard_bytes, overwrite, write_config)


def hf_refusal(jm) -> str | None:
  """The sentence `export` would refuse `jm` with now (its form, or trained values HF's form cannot
  hold, such as a nonzero expert bias), or None: a run prints the export command that works."""
  try:
    peft_model = _peft_model(jm)
    tensors, model = _state_tensors(jm), jm.module
    if peft_model is not None:
      tensors, model = _merged(tensors, peft_model), peft_model.get_base_model()
    _as_hf(model, tensors)
  except TorchOnTpuError as e:
    return str(e)
  return None


def lora_mergeable(jm) -> None:
  """Raises the sentence `export(mode="merged")` would give for `jm`'s adapters, before any training."""
  _peft_model(jm)


def _peft_model(jm):
  """`jm`'s peft model when it carries LoRA adapters (lora.wrap), else None."""
  model = jm.module
  if not hasattr(model, "peft_config"):
    return None
  form = models.family_of(model.get_base_model()).hf_form(model.get_base_model())
  if form is None or form.rename is not None:
    raise TorchOnTpuError(
      "LoRA export covers models whose HF form keeps their names (HF causal LMs); merge these adapters "
      "into the base weights yourself."
    )
  return model


def _state_tensors(jm) -> list[_Tensor]:
  """The model's `state_dict`, entry by entry, nothing read yet."""
  state_dict = jm.state_dict()
  out = []
  for e in state_entries.entries(jm):
    get = functools.partial(jm.array_for if e.direct else state_dict.array, e.name)
    out.append(_Tensor(e.name, e.shape, e.dtype, get))
  return out


def _merged(tensors: list[_Tensor], peft_model) -> list[_Tensor]:
  """peft names → the base model's, each adapted weight W + scaling·B·A (peft's own merge)."""
  config = peft_model.peft_config[_ADAPTER]
  if config.use_dora or config.rank_pattern or config.alpha_pattern:
    raise TorchOnTpuError("Only LoRA adapters of one rank and alpha merge (not DoRA or per-module patterns); export mode='adapter'.")
  scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)  # peft's LoraLayer.scaling
  merge = functools.partial(_merge, float(scaling), bool(config.fan_in_fan_out))
  by_name = {t.name: t for t in tensors}
  out = []
  for t in tensors:
    if lora.is_adapter(t.name):
      continue
    if "lora_" in t.name:  # embedding adapters: not a Linear's B·A
      raise TorchOnTpuError(f"Cannot merge '{t.name}': only peft LoRA adapters on Linear layers merge; export mode='adapter'.")
    name = t.name
    if name.endswith(".base_layer.weight"):
      path = name.removesuffix(".base_layer.weight")
      a, b = by_name[f"{path}.lora_A.{_ADAPTER}.weight"], by_name[f"{path}.lora_B.{_ADAPTER}.weight"]
      t = dataclasses.replace(t, array=lambda t=t, a=a, b=b: merge(t.array(), a.array(), b.array()))
    out.append(dataclasses.replace(t, name=lora.base_name(name)))
  return out


def _merge(scaling: float, transposed: bool, w: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  def fold(w, a, b):
    delta = jnp.matmul(b.astype(jnp.float32), a.astype(jnp.float32), precision="highest")
    return (w.astype(jnp.float32) + scaling * (delta.T if transposed else delta)).astype(w.dtype)

  return jax.jit(fold, out_shardings=w.sharding)(w, a, b)


def _adapters(tensors: list[_Tensor]) -> list[_Tensor]:
  """The adapters under the names peft saves (the adapter's own name left out)."""
  out = []
  for t in tensors:
    if lora.is_adapter(t.name):
      name = t.name.replace(f".lora_A.{_ADAPTER}.", ".lora_A.").replace(f".lora_B.{_ADAPTER}.", ".lora_B.")
      out.append(dataclasses.replace(t, name=name))
  return out


def _as_hf(model, tensors: list[_Tensor]):
  """(tensors under HF names, the HF config): the model family's HF form (`Family.hf_form`)."""
  form = models.family_of(model).hf_form(model)
  if form is None:
    raise TorchOnTpuError(
      f"export writes HF directories for models with an HF form (HF causal LMs; torchtitan's Llama 3, Qwen3 and Qwen3.5 dense and MoE, "
      f"gpt-oss, DeepSeek-V3, Kimi and Muse Glimmer, with their vision encoders), not "
      f"{type(model).__name__}; use export_safetensors for its state_dict."
    )
  if form.check is not None:
    arrays = {t.name: t.array for t in tensors}
    form.check(lambda name: arrays[name]())
  if form.rename is None:
    return tensors, form.config
  by_name = {t.name: t for t in tensors}
  out = []
  for t in tensors:
    renamed = form.rename(t.name)
    for name, transform in renamed if isinstance(renamed, list) else [renamed]:
      if transform is None:
        out.append(dataclasses.replace(t, name=name))
        continue
      if isinstance(transform, FromSeveral):
        sources = [by_name[s] for s in transform.sources]
        made = jax.eval_shape(transform.make, *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in sources))
        array = lambda sources=sources, make=transform.make: make(*(s.array() for s in sources))  # noqa: E731
      else:
        made = jax.eval_shape(transform, jax.ShapeDtypeStruct(t.shape, t.dtype))
        array = lambda t=t, transform=transform: transform(t.array())  # noqa: E731
      out.append(_Tensor(name, tuple(made.shape), np.dtype(made.dtype), array))
  return out, form.config


# ---- the writer ------------------------------------------------------------------------------


def _write_dir(directory, tensors: list[_Tensor], stem: str, max_shard_bytes, overwrite, extras, index: bool = False) -> Path:
  """`tensors` as safetensors files named after `stem` (split at `max_shard_bytes`, None: one
  file; with `index` an index file all the same) plus what `extras(tmp)` writes, appearing at
  `directory` all at once."""
  directory = Path(directory).absolute()
  for t in tensors:
    if t.dtype.name not in state_entries.SAFETENSORS_DTYPES:
      raise TorchOnTpuError(
        f"State '{t.name}' has dtype {t.dtype.name}, which safetensors cannot store; "
        f"cast it to a float or integer dtype before exporting."
      )
  _check_target(directory, overwrite)
  shards = _split(tensors, max_shard_bytes or math.inf)
  names = (
    [f"{stem}.safetensors"]
    if len(shards) == 1
    else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  writer = jax.process_index() == 0
  tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
  try:
    unchanged = f"{directory} is as it was (an export appears whole or not at all)"
    with storage.writing("the export", directory, elsewhere="export to a larger disk", outcome=unchanged):
      if writer:
        tmp.mkdir(parents=True)
      for file_name, shard in zip(names, shards):
        _write_safetensors(tmp / file_name if writer else None, shard)
      if writer:
        if len(shards) > 1 or index:
          listing = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: f for f, shard in zip(names, shards) for t in shard},
          }
          (tmp / f"{stem}.safetensors.index.json").write_text(json.dumps(listing, indent=2))
        if extras is not None:
          extras(tmp)
        _replace_dir(tmp, directory)
  finally:
    if writer and tmp.exists():
      shutil.rmtree(tmp)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("torch_on_tpu.io.export")  # every process returns once it is there
  return directory


def _check_target(directory: Path, overwrite: bool) -> None:
  """Refuses an existing non-empty target without `overwrite`, on every process as process 0 sees it."""
  taken = not overwrite and directory.exists() and (not directory.is_dir() or any(directory.iterdir()))
  if jax.process_count() > 1:
    taken = bool(multihost_utils.broadcast_one_to_all(np.int32(taken)))
  if taken:
    raise TorchOnTpuError(
      f"Export directory {directory} already exists and is not empty; pick a new path or pass {arg('overwrite', True)}."
    )


def _split(tensors: list[_Tensor], max_bytes) -> list[list[_Tensor]]:
  shards: list[list[_Tensor]] = [[]]
  size = 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  return shards


def _write_safetensors(path: Path | None, tensors: list[_Tensor]) -> None:
  """One safetensors file (header, then each tensor's bytes in order); with `path`
  None this process only takes part in the gathers."""
  header = {"__metadata__": {"format": "pt"}}
  offset = 0
  for t in tensors:
    header[t.name] = {"dtype": state_entries.SAFETENSORS_DTYPES[t.dtype.name], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") if path is not None else contextlib.nullcontext() as f:
    if f is not None:
      f.write(struct.pack("<Q", len(blob)))
      f.write(blob)
    for t in tensors:
      written = 0
      for chunk in _host_chunks(t.array()):
        if chunk.dtype != t.dtype:
          raise TorchOnTpuError(
            f"State '{t.name}' is {chunk.dtype} but was planned as {t.dtype}; "
            f"cast parameters through the module, not the params dict."
          )
        if f is not None:
          f.write(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        written += chunk.nbytes
      if written != t.nbytes:
        raise TorchOnTpuError(
          f"Exporting '{t.name}' produced {written} bytes where {t.nbytes} were planned; "
          f"the model changed during export."
        )


def _host_chunks(arr: jax.Array):
  """Host copies of `arr` in row-major order: row blocks from this process's shards, or the
  whole array gathered from every process when it spans several (each process calls this)."""
  if not arr.is_fully_addressable:
    yield np.asarray(multihost_utils.process_allgather(arr, tiled=True))
  else:
    yield from _array_chunks(arr)


def _array_chunks(arr: jax.Array):
  """Host copies of consecutive row blocks of `arr` (row-major order), at most
  `_CHUNK_BYTES` each, cut from the device shards that hold them.

  Slicing the global array instead would make XLA gather a dim-sharded array
  onto every device first; here each slice is taken on one device.
  """
  if arr.ndim == 0:
    yield np.asarray(arr)
    return
  blocks: dict[tuple[int, int], dict] = {}  # dim-0 range → {rest of the index: shard}
  for shard in arr.addressable_shards:
    index = [sl.indices(n)[:2] for sl, n in zip(shard.index, arr.shape)]
    blocks.setdefault(index[0], {}).setdefault(tuple(index[1:]), shard.data)
  row_bytes = arr.nbytes // max(arr.shape[0], 1)
  per_chunk = max(1, _CHUNK_BYTES // max(row_bytes, 1))
  for (start, stop), pieces in sorted(blocks.items()):
    for lo in range(start, stop, per_chunk):
      count = min(per_chunk, stop - lo)
      out = np.empty((count, *arr.shape[1:]), dtype=arr.dtype)
      for rest, piece in pieces.items():
        out[(slice(None), *(slice(a, b) for a, b in rest))] = np.asarray(_rows(piece, lo - start, count))
      yield out


@functools.partial(jax.jit, static_argnums=2)
def _rows(arr, start, count):
  return jax.lax.dynamic_slice_in_dim(arr, start, count, axis=0)


def _replace_dir(tmp: Path, directory: Path) -> None:
  """Moves the finished export into place; an old one is removed only afterwards."""
  old = None
  if directory.exists():
    old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    directory.rename(old)
  directory.parent.mkdir(parents=True, exist_ok=True)
  tmp.rename(directory)
  if old is not None and old.is_dir():
    shutil.rmtree(old)
  elif old is not None:
    old.unlink()
