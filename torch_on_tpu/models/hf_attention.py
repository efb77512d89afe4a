"""HF transformers' SDPA attention on the bridge's kernels (splash on TPU), through transformers' own
extension points: while a model is traced, the "sdpa" entries of `AttentionMaskInterface` and
`AttentionInterface` are ours (`routed`).

transformers builds an SDPA mask as a dense (B, 1, L, S) boolean tensor under jit, which splash
cannot take. Our mask builder reads the pattern the model asked for instead — causal or
bidirectional, a sliding window, Llama 4's chunks, the padding of `attention_mask` — from the mask
functions transformers composes (`and_masks` of its named overlays), and returns transformers' own
dense mask as a `PatternedMask`: a tensor wherever the model's code reads it (Falcon hands it to
`F.scaled_dot_product_attention` itself, adds ALiBi to it), which carries that pattern as segment ids
(`HFMasks`) to our attention interface, where every kernel takes it. A mask it does not recognise (an
`or_masks` overlay for image tokens, packed sequences, a bidirectional window, a decode step against
a cache), or one the model's code changed, runs its SDPA call on the XLA kernel, as before.

Exactness: a query row whose visible keys are all padding is all-False in transformers' mask, for
which torch's SDPA returns zeros. Here such a row attends the padding it can see (so the kernel has
something to normalise) and its output is then zeroed: torch's values and gradients."""

from __future__ import annotations

import contextlib
import inspect

import torch

from torch_on_tpu.core import _compat

torchax = _compat.import_torchax()
from torchax.interop import jax_view  # noqa: E402


class HFMasks:
  """An SDPA mask as segment ids: query i may see key j when `q_ids[i] == kv_ids[j]` (padding and
  chunks), `j <= i` if `causal`, `j > i - window` if `window`; rows where `keep` is False (no key
  to see) give zeros. `q_ids`/`kv_ids`/`keep` (B, L) are None when only the static pattern applies."""

  def __init__(self, q_ids, kv_ids, keep, *, causal: bool, window: int | None):
    self.q_ids, self.kv_ids, self.keep = q_ids, kv_ids, keep
    self.causal, self.window = causal, window

  def __repr__(self) -> str:
    parts = ["causal" if self.causal else "bidirectional"]
    if self.window is not None:
      parts.append(f"window {self.window}")
    if self.q_ids is not None:
      parts.append(f"segments {tuple(self.q_ids.shape)}")
    return f"HFMasks({', '.join(parts)})"


class PatternedMask(torchax.tensor.Tensor):
  """transformers' own dense SDPA mask, which knows the pattern it was built from (`pattern`, an
  `HFMasks`). A subclass, so the model's own code reads the tensor transformers made; a torch op
  on it makes a plain tensor, and an in-place one (`_unchanged`) drops the pattern."""

  pattern: HFMasks
  dense: torch.Tensor  # transformers' tensor, whose array it holds until an in-place op


def _patterned(dense, pattern: HFMasks) -> PatternedMask:
  mask = PatternedMask(jax_view(dense), _compat.tensor_env(dense))
  mask.pattern, mask.dense = pattern, dense
  return mask


def _unchanged(mask) -> bool:
  return isinstance(mask, PatternedMask) and jax_view(mask) is jax_view(mask.dense)


def _flatten(mask: PatternedMask):
  """Leaves that stay the same objects (a scanned stack checks each layer gets the same arguments)."""
  if not _unchanged(mask):
    return [torchax.tensor.Tensor(jax_view(mask), _compat.tensor_env(mask)), None, None, None], None
  p = mask.pattern
  return [mask.dense, p.q_ids, p.kv_ids, p.keep], (p.causal, p.window)


def _unflatten(children, static):
  """The torch side (a scanned stack's or a pipeline stage's layer arguments) gets the mask back
  with its pattern; the jax side of a mask (what torchax hands an op on it) is its dense array."""
  dense, *ids = children
  if static is None or not isinstance(dense, torch.Tensor):
    return dense
  return _patterned(dense, HFMasks(*ids, causal=static[0], window=static[1]))


_compat.torch_pytree.register_pytree_node(  # it crosses the pipeline's stages as a layer argument
  PatternedMask, _flatten, _unflatten, serialized_type_name="torch_on_tpu.models.hf_attention.PatternedMask",
)


def read_pattern(mask_function) -> dict | None:
  """{causal, window, chunk: (size, left_padding) | None, documents, positions} of a transformers mask
  function built from its named pieces (`and_masks` of causal/bidirectional, `sliding_window_overlay`,
  `chunked_overlay`; packed sequences' document ids and the positions it remaps indices to); None for
  anything else."""
  from transformers import masking_utils as mu

  parts = _intersected(mask_function)
  if parts is None:
    return None
  causal = window = chunk = documents = positions = None
  for part in list(parts):
    name = part.__qualname__
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
      documents = inspect.getclosurevars(part).nonlocals["packed_sequence_mask"]
      parts.remove(part)
    elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
      found = inspect.getclosurevars(part).nonlocals
      positions = found["position_ids"]  # within a document positions run as indices do, but chunks count positions
      inner = _intersected(found["mask_function"])
      if inner is None:
        return None
      parts.remove(part)
      parts.extend(inner)
  if (documents is None) != (positions is None):
    return None
  for part in parts:
    if part is mu.causal_mask_function:
      causal = True
    elif part is mu.bidirectional_mask_function:
      causal = bool(causal)
    elif part.__qualname__ == "sliding_window_overlay.<locals>.inner_mask":
      window = inspect.getclosurevars(part).nonlocals["sliding_window"]
    elif part.__qualname__ == "chunked_overlay.<locals>.inner_mask":
      found = inspect.getclosurevars(part).nonlocals
      chunk = (found["chunk_size"], found["left_padding"])
    else:
      return None
  if causal is None or (not causal and (window is not None or chunk is not None)):
    return None
  return {"causal": causal, "window": window, "chunk": chunk, "documents": documents, "positions": positions}


def _intersected(fn) -> list | None:
  """The mask functions `fn` intersects (`and_masks`, nested), or [fn]; None if not a function."""
  if not callable(fn) or not hasattr(fn, "__qualname__"):
    return None
  if fn.__qualname__ != "and_masks.<locals>.and_mask":
    return [fn]
  parts = []
  for inner in inspect.getclosurevars(fn).nonlocals["mask_functions"]:
    more = _intersected(inner)
    if more is None:
      return None
    parts.extend(more)
  return parts


def build_masks(length: int, padding, *, causal: bool, window: int | None, chunk, documents=None, positions=None) -> HFMasks:
  """`HFMasks` for sequences of `length`: `padding` (B, L) the 2-D attention_mask (1: a token) or None;
  `documents` (B, L) packed sequences' ids, whose `positions` restart at each (no padding then)."""
  chunk_ids = None
  if chunk is not None:
    size, left = chunk
    at = torch.arange(length)[None, :] if positions is None else positions
    chunk_ids = (at - left[:, None]) // size
  if padding is None:
    ids = _runs(documents, chunk_ids)
    return HFMasks(ids, ids, None, causal=causal, window=window)
  if documents is not None:
    raise ValueError("packed sequences come without padding (transformers looks for them only without an attention_mask)")
  positions = torch.arange(length)
  real = padding.to(torch.bool)
  counts = torch.nn.functional.pad(real.to(torch.int32).cumsum(1), (1, 0))  # counts[:, i]: real keys before i
  if causal:
    low = positions[None, :].expand_as(real)
    low = torch.zeros_like(low) if window is None else (low - window + 1).clamp(min=0)
    if chunk is not None:
      low = torch.maximum(low, (chunk_ids * chunk[0] + chunk[1][:, None]).clamp(min=0))
    seen = counts[:, 1:] - torch.gather(counts, 1, low)
  else:
    seen = counts[:, -1:].expand_as(real)
  keep = seen > 0
  kv_ids = real.to(torch.int32)
  q_ids = keep.to(torch.int32)
  if chunk_ids is not None:
    kv_ids, q_ids = kv_ids + 2 * chunk_ids, q_ids + 2 * chunk_ids
  return HFMasks(q_ids, kv_ids, keep, causal=causal, window=window)


def _runs(*ids) -> torch.Tensor | None:
  """One id per run of tokens over which none of `ids` (B, L; None: absent) changes."""
  ids = [i for i in ids if i is not None]
  if not ids:
    return None
  change = torch.zeros(ids[0].shape, dtype=torch.bool)
  for i in ids:
    change = change | torch.nn.functional.pad(i[:, 1:] != i[:, :-1], (1, 0))
  return change.to(torch.int32).cumsum(1)


def _mask_builder(original):
  def sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    from transformers import masking_utils as mu

    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    # a cache's offsets can be traced tensors (transformers' StaticLayer): those steps keep its mask
    same = all(isinstance(o, int) and o == 0 for o in (q_offset, kv_offset)) and q_length == kv_length
    padded = attention_mask is not None and (attention_mask.ndim != 2 or attention_mask.shape[-1] != kv_length)
    pattern = read_pattern(mask_function) if same and not padded else None
    recognised = pattern is not None and (pattern["documents"] is None or attention_mask is None)
    if recognised:  # the model's code reads a mask where transformers would have relied on `is_causal`
      kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    dense = original(
      batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
      mask_function=mask_function, attention_mask=attention_mask, **kwargs,
    )
    return _patterned(dense, build_masks(kv_length, attention_mask, **pattern)) if recognised else dense

  return sdpa_mask


def _attention(original, attend):
  def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    plain = dropout == 0 and query.shape[2] == key.shape[2] and not any(
      kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap")
    )
    if not (plain and _unchanged(attention_mask)):  # transformers' SDPA as it is, on its own dense mask
      return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    masks = attention_mask.pattern
    ids = None if masks.q_ids is None else (masks.q_ids, masks.kv_ids)
    out = attend(
      query, key, value, segment_ids=ids, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
      causal=masks.causal, window=masks.window,
    )
    if masks.keep is not None:
      out = out * masks.keep[:, None, :, None].to(out.dtype)
    return out.transpose(1, 2).contiguous(), None

  return sdpa_attention_forward


@contextlib.contextmanager
def routed(attend):
  """While active, HF models configured for "sdpa" build `PatternedMask`s and run `attend` (the bridge's
  kernel, `routing.Attention.flex`) wherever their mask is one it takes."""
  from transformers.masking_utils import AttentionMaskInterface
  from transformers.modeling_utils import AttentionInterface

  masks, functions = AttentionMaskInterface._global_mapping, AttentionInterface._global_mapping
  before = masks["sdpa"], functions["sdpa"]
  masks["sdpa"], functions["sdpa"] = _mask_builder(before[0]), _attention(before[1], attend)
  try:
    yield
  finally:
    masks["sdpa"], functions["sdpa"] = before
