"""The `attention_masks` torchtitan's trainer passes (`model.get_attention_masks(positions)`), as the
bridge's stand-ins: `FlexMasks` where torchtitan builds a flex BlockMask (causal, sliding window,
documents), `VarlenMasks` where it builds varlen document offsets. torchtitan's own code chooses
them; only its builders that cannot run beside jax are swapped. Models whose layers pick their
mask by key are checked to get the dict."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref

import jax
import torch
from torch.nn.attention.flex_attention import BlockMask

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError


class FlexMasks(BlockMask):
  """Stands in for torchtitan's BlockMask: the mask it means, as the attention kernels
  take it. Causal (or not); within documents when `segment_ids` (B, L) are given
  (equal ids = same document); a sliding `window` W lets a query see only the W
  latest keys, itself included (torchtitan's `get_sliding_window_mask_mod`).

  A BlockMask subclass so FlexAttention's type check passes; the document ids are a
  leaf of both torch and jax pytrees (`causal` and `window` their static part), so it
  travels through `ShardedModule` calls and train steps into `jax.jit` like any input.
  """

  def __init__(self, segment_ids: torch.Tensor | None = None, *, causal: bool = True, window: int | None = None):
    # BlockMask.__init__ not called: no block state.
    self.segment_ids = segment_ids
    self.causal = causal
    self.window = window

  def __repr__(self) -> str:
    parts = ["causal" if self.causal else "full"]
    if self.window is not None:
      parts.append(f"window {self.window}")
    if self.segment_ids is not None:
      parts.append(f"documents {tuple(self.segment_ids.shape)}")
    return f"FlexMasks({', '.join(parts)})"

  __str__ = __repr__  # BlockMask's own reads its block state, which a FlexMasks has none of


def _flatten_masks(m):
  return [m.segment_ids], (m.causal, m.window)


def _unflatten_masks(children, static):
  return FlexMasks(children[0], causal=static[0], window=static[1])


_compat.torch_pytree.register_pytree_node(
  FlexMasks,
  _flatten_masks,
  lambda children, static: _unflatten_masks(children, static),
  serialized_type_name="torch_on_tpu.models.torchtitan.FlexMasks",
)
jax.tree_util.register_pytree_node(FlexMasks, _flatten_masks, lambda static, children: _unflatten_masks(children, static))


def flex_masks(positions: torch.Tensor | None = None) -> FlexMasks:
  """The `attention_masks` argument for a flex-attention torchtitan model.

  Like torchtitan's `get_attention_masks(positions)`: causal within documents,
  a document starting wherever `positions` (B, L) is 0 (each row must start a
  document, as torchtitan's loader guarantees). No positions: plain causal.
  For a model whose layers take several masks (sliding windows: muse_glimmer,
  gpt-oss), use `attention_masks(model, positions)`.
  """
  if positions is None:
    return FlexMasks()
  return FlexMasks(document_ids(positions).to(torch.int32))


class VarlenMasks:
  """Stands in for torchtitan's `VarlenMetadata` (its varlen attention's cumulative
  document offsets): causal attention within documents given by `segment_ids` (B, L).
  Made a `VarlenMetadata` subclass on first use (`varlen_masks`), so torchtitan's
  isinstance checks pass while it carries only the document ids."""


_varlen_type = None


def varlen_masks(segment_ids) -> "VarlenMasks":
  """The `attention_masks` a varlen-attention torchtitan model gets from the bridge."""
  global _varlen_type
  if _varlen_type is None:
    from torchtitan.models.common.attention import VarlenMetadata

    class _VarlenMasks(VarlenMasks, VarlenMetadata):
      __slots__ = ()

      causal, window = True, None  # document-causal; a varlen layer holds its own window

      @property
      def segment_ids(self):
        return self.cu_seq_q

      def __repr__(self) -> str:
        return f"VarlenMasks(document-causal, segment_ids {tuple(self.segment_ids.shape)})"

    # cu_seq_q_host (): torchtitan's Qwen3.5 demands host offsets; the bridge's kernels read the ids.
    rebuild = lambda ids: _VarlenMasks(ids, ids, int(ids.shape[1]), int(ids.shape[1]), ())  # noqa: E731
    _compat.torch_pytree.register_pytree_node(
      _VarlenMasks, lambda m: ([m.segment_ids], None), lambda children, _: rebuild(children[0]),
      serialized_type_name="torch_on_tpu.models.torchtitan.VarlenMasks",
    )
    jax.tree_util.register_pytree_node(_VarlenMasks, lambda m: ([m.segment_ids], None), lambda _, c: rebuild(c[0]))
    _varlen_type = (_VarlenMasks, rebuild)
  return _varlen_type[1](segment_ids)


def document_ids(positions):
  """Document ids (B, L) from torchtitan's positions: a document starts wherever a
  position is 0 (torch, numpy or jax arrays)."""
  return (positions == 0).cumsum(1)


def attention_masks(model: torch.nn.Module, positions: torch.Tensor):
  """What torchtitan's trainer passes as `attention_masks`, `model.get_attention_masks(positions)`,
  with a `FlexMasks` wherever torchtitan builds a flex BlockMask (a single mask, or a
  dict of them keyed by the layers' windows) and a `VarlenMasks` wherever it builds
  varlen document offsets (varlen attention, Qwen3.5's linear attention).

  torchtitan's own code runs and chooses the masks; only the builders that cannot run
  beside jax are swapped: the `torch.compile`d block-mask builder for one that reads the
  mask functions torchtitan combined (causal, sliding window, documents; a mask function
  outside those is refused in one sentence), and the document-offset builder (which reads
  the positions on the host) for one keeping the document ids of `positions`.
  """
  from torchtitan.models.common import attention

  if not callable(getattr(model, "get_attention_masks", None)):
    if _uses(model, attention.VarlenAttention):  # torchtitan's layers in a model of one's own
      return varlen_masks(document_ids(positions).to(torch.int32))
    raise TorchOnTpuError(
      f"{type(model).__name__} has no get_attention_masks to choose its masks; pass "
      f"torch_on_tpu.models.torchtitan.flex_masks(positions) or a FlexMasks of your own."
    )
  original = attention.__dict__["_compiled_create_block_mask"]
  attention._compiled_create_block_mask = _describe_block_mask
  try:
    with _varlen_metadata_as_documents():
      return model.get_attention_masks(positions)
  finally:
    attention._compiled_create_block_mask = original


@contextlib.contextmanager
def _varlen_metadata_as_documents():
  """torchtitan's `create_varlen_metadata_for_document`, in every torchtitan module that
  imported it (the decoder, Qwen3.5), replaced by `varlen_masks` of the positions' documents."""
  from torchtitan.models.common import attention

  builder = attention.create_varlen_metadata_for_document
  swapped = [
    mod for name, mod in list(sys.modules.items())
    if name.startswith("torchtitan.") and mod is not None and vars(mod).get("create_varlen_metadata_for_document") is builder
  ]
  for mod in swapped:
    mod.create_varlen_metadata_for_document = lambda positions, **_: varlen_masks(document_ids(positions).to(torch.int32))
  try:
    yield
  finally:
    for mod in swapped:
      mod.create_varlen_metadata_for_document = builder


def with_documents(layout, documents):
  """The masks of `layout` (what `attention_masks` returned for a stand-in batch) over the
  batch's document ids `documents` (B, L)."""
  if isinstance(layout, dict):
    return {key: with_documents(m, documents) for key, m in layout.items()}
  if isinstance(layout, FlexMasks):
    return FlexMasks(documents, causal=layout.causal, window=layout.window)
  if isinstance(layout, VarlenMasks):
    return varlen_masks(documents)
  return layout  # None: a consumer without masks


def _describe_block_mask(mask_mod, B=None, H=None, Q_LEN=None, KV_LEN=None, device=None, **_block_layout):  # noqa: N803 (create_block_mask's names)
  """`create_block_mask`'s signature: the FlexMasks meaning what `mask_mod` means."""
  kinds = _mask_mod_kinds()
  causal, window, segment_ids, packed = False, None, None, False
  for mod in _and_terms(mask_mod, kinds["and"]):
    kind = kinds.get(mod.__code__) if hasattr(mod, "__code__") else None
    cells = dict(zip(mod.__code__.co_freevars, (c.cell_contents for c in mod.__closure__ or ()))) if kind else {}
    if kind == "causal":
      causal = True
    elif kind == "window":  # (kv <= q) & (q - kv < window_size)
      causal = True
      size = int(cells["window_size"])
      window = size if window is None else min(window, size)
    elif kind in ("document", "packed_document"):
      # The per-token value each mask compares is constant within a document and differs between them.
      ids = cells.get("doc_ids", cells.get("doc_end_by_token"))
      ids = cells["document_id"][None] if ids is None else ids
      if segment_ids is not None:
        raise TorchOnTpuError("torchtitan combined two document masks in one flex mask; the bridge takes one.")
      segment_ids, packed = ids.to(torch.int32), packed or kind == "packed_document"
    elif kind != "noop":
      name = getattr(mod, "__name__", type(mod).__name__)
      raise TorchOnTpuError(
        f"torchtitan built a flex attention mask from '{name}', which the bridge's attention kernels do "
        f"not express (they take causal, sliding-window and document masks); use a model config without it."
      )
  if packed and not causal:
    raise TorchOnTpuError(
      "torchtitan's packed-document mask means same-document attention only together with its causal "
      "mask, and this flex mask has none; use get_document_mask_mod for non-causal documents."
    )
  return FlexMasks(segment_ids, causal=causal, window=window)


def _and_terms(mask_mod, and_code):
  """The mask functions `and_masks` combined (nested ones flattened), or `[mask_mod]`."""
  if getattr(mask_mod, "__code__", None) is not and_code:
    return [mask_mod]
  (mods,) = (c.cell_contents for c in mask_mod.__closure__)
  return [term for mod in mods for term in _and_terms(mod, and_code)]


@functools.cache
def _mask_mod_kinds() -> dict:
  """The code of each mask function torchtitan composes → what it means."""
  from torch.nn.attention import flex_attention as flex
  from torchtitan.models.common import attention

  one, two = torch.zeros(1, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)
  return {
    "and": flex.and_masks(flex.noop_mask).__code__,
    flex.noop_mask.__code__: "noop",
    attention.get_causal_mask_mod().__code__: "causal",
    attention.get_sliding_window_mask_mod(1).__code__: "window",
    attention.get_document_mask_mod(one).__code__: "document",
    attention.get_efficient_causal_mask_mod_for_packed_document(one).__code__: "packed_document",
    attention.get_efficient_causal_mask_mod_for_packed_document(two).__code__: "packed_document",
  }


# Models whose forward checks that it got its masks by key (weakly held: a model can go).
_checked_masks: weakref.WeakSet = weakref.WeakSet()


def guard_keyed_masks(module: torch.nn.Module) -> None:
  """A model whose layers pick their masks by key refuses, from now on, a single FlexMasks."""
  if _takes_keyed_masks(module) and module not in _checked_masks:
    _checked_masks.add(module)
    module.register_forward_pre_hook(_require_keyed_masks, with_kwargs=True)


def _takes_keyed_masks(module: torch.nn.Module) -> bool:
  """Whether the model's layers pick their flex masks from a dict (by window: muse_glimmer, gpt-oss)."""
  from torchtitan.models.common.attention import FlexAttention

  if not (callable(getattr(module, "get_attention_masks", None)) and _uses(module, FlexAttention)):
    return False
  return isinstance(attention_masks(module, torch.zeros(1, 1, dtype=torch.long)), dict)


def _require_keyed_masks(module, args, kwargs):
  """Forward pre-hook: one FlexMasks where the layers choose theirs by key would give every
  layer the same mask (sliding windows silently dropped)."""
  bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
  if isinstance(bound.get("attention_masks"), FlexMasks):
    raise TorchOnTpuError(
      f"{type(module).__name__}'s layers take different attention masks (sliding windows), each picked by key "
      f"from a dict; pass attention_masks=torch_on_tpu.models.torchtitan.attention_masks(model, positions)."
    )


def _uses(module: torch.nn.Module, kind: type) -> bool:
  return any(isinstance(m, kind) for m in module.modules())


def uses_masked_attention(module: torch.nn.Module) -> bool:
  """FlexAttention or VarlenAttention: the backends that take `attention_masks`."""
  from torchtitan.models.common.attention import FlexAttention, VarlenAttention

  return _uses(module, FlexAttention) or _uses(module, VarlenAttention)
