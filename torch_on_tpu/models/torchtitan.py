"""torchtitan's models, every family its registries build: configs, inputs, shape, sharding, export.

    config = registry_config("qwen3:debugmodel_moe", max_seq_len=2048)   # torchtitan's own
    with torch.device("meta"):
      model = config.build()
    jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
    logits = jm(**jm.family.model_inputs(model, {"input_ids": tokens, "positions": positions}))

`TorchtitanFamily` answers for all of them by rules read from torchtitan's own
code (docs/torchtitan.md): the model is called by name (`tokens=`,
`positions=`, `attention_masks=`) with the masks its own `get_attention_masks`
chooses, built as the bridge's stand-ins (`FlexMasks`, `VarlenMasks`: the
compiled BlockMask builder cannot run beside jax); while ShardedModule's
attention kernels are active, flex and varlen attention run them. The TP and
EP maps come from each family's own sharding plan; MoE load balancing is the
family's `optimizer_pre_step`; Qwen3.5's linear attention runs the bridge's
kernels; export goes through each family's `state_dict_adapter`.

`build_llama3(flavor, attention="sdpa")` keeps Llama 3's builder: "sdpa" swaps
each layer's inner attention for torchtitan's own `ScaledDotProductAttention`
(plain causal attention, no document masking), the config change torchtitan
itself makes for models that use SDPA.

Called by hand, pass `attention_masks(model, positions)` where torchtitan's trainer
passes `model.get_attention_masks(positions)`:

    logits = jm(tokens, positions=positions, attention_masks=attention_masks(model, positions))

FlexAttention and VarlenAttention then run the bridge's kernels with the mask they
were given: causal, documents, sliding windows (muse_glimmer, gpt-oss, whose layers
pick theirs from a dict) and gpt-oss's attention sinks; what they cannot express is
refused in one sentence. `flex_masks(positions)` is the document-causal mask alone
(Llama 3, Qwen 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import re
import sys
import weakref

import jax
import jax.numpy as jnp
import torch
from torch.nn.attention.flex_attention import BlockMask

from torch_on_tpu import _compat, extras
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.family import DecoderShape, Family, FromSeveral, HFForm

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

logger = logging.getLogger(__name__)

FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")


def is_torchtitan(module) -> bool:
  """A torchtitan module (or config: its classes live in the same modules)."""
  return type(module).__module__.startswith("torchtitan.")


def parallel_plan(module: torch.nn.Module, *, ep: bool = False) -> dict[str, dict[str, int]]:
  """How torchtitan itself shards `module`: parameter name → {mesh axis: the dim it
  shards} for its TP (and, with `ep`, EP) axes, read from the model's own
  `torchtitan.models.<name>.sharding.set_*_sharding_config` (sequence parallelism
  off) applied to a copy of its config and built on meta. {} when the model's package
  has no such plan."""
  import copy
  import importlib

  package = type(module).__module__.rsplit(".", 1)[0]
  try:
    plans = importlib.import_module(package + ".sharding")
  except ImportError:
    return {}
  setters = [
    fn for name, fn in vars(plans).items()
    if name.startswith("set_") and name.endswith("_sharding_config") and getattr(fn, "__module__", None) == plans.__name__
    and next(iter(inspect.signature(fn).parameters)) == "config"
  ]
  config = getattr(module, "config", None)
  if len(setters) != 1 or config is None:
    return {}
  config = copy.deepcopy(config)
  accepted = inspect.signature(setters[0]).parameters
  setters[0](config, **{k: v for k, v in dict(enable_sp=False, enable_ep=ep).items() if k in accepted})
  with torch.device("meta"):
    built = config.build()
  plan = {}
  for prefix, sub in built.named_modules():
    sharding_config = getattr(sub, "_sharding_config", None)  # torchtitan's Module keeps its config's
    for name, layout in (sharding_config.state_shardings if sharding_config else {}).items():
      dims = {axis.value: placement.dim for axis, placement in layout.axis_types.items() if hasattr(placement, "dim")}
      dims = {axis: dims[axis] for axis in ("tp", "ep") if axis in dims}
      if dims:
        plan[f"{prefix}.{name}" if prefix else name] = dims
  return plan


def fsdp_tp_map(module: torch.nn.Module) -> dict | None:
  """torchtitan's own TP plan as a sharding map: each parameter's TP dim over `tp`,
  its first other dim longer than 1 over `fsdp` (1-D parameters replicated; a depthwise
  conv's `(channels, 1, kernel)` takes fsdp on its kernel dim)."""
  if not is_torchtitan(module):
    return None
  plan = parallel_plan(module)
  if not plan:
    return None
  table = {}
  for name, param in module.named_parameters():
    tp = plan.get(name, {}).get("tp")
    spec = [None] * param.ndim
    if tp is not None:
      spec[tp % param.ndim] = "tp"
    free = [d for d in range(param.ndim) if spec[d] is None and param.shape[d] > 1]
    if param.ndim >= 2 and free:
      spec[free[0]] = "fsdp"
    table[name] = tuple(spec)
  return table


# The language-model families torchtitan 0.3.0 registers (flux, a diffusion model, takes no tokens).
LANGUAGE_FAMILIES = ("llama3", "qwen3", "deepseek_v3", "kimi_k2_7", "qwen3_5", "gpt_oss", "muse_glimmer")


def registry_config(spec: str, *, max_seq_len: int | None = None, mtp_layers: int = 0):
  """torchtitan's own config for `"<family>:<flavor>"` (`torchtitan.models.<family>.model_registry`),
  with RoPE tables sized to `max_seq_len` as torchtitan's trainer sizes them for its sequence length;
  `mtp_layers` > 0 builds that many multi-token-prediction layers (`num_mtp_layers`, DeepSeek-V3's)."""
  import importlib

  from torch_on_tpu import errors

  extras.require("torchtitan", "torchtitan's models")
  family, _, flavor = spec.partition(":")
  if family not in LANGUAGE_FAMILIES or not flavor:
    raise TorchOnTpuError(f"'{spec}' is not <family>:<flavor> of torchtitan; families: {', '.join(LANGUAGE_FAMILIES)}.")
  registry = importlib.import_module(f"torchtitan.models.{family}")
  flavors = sorted({n for k, v in vars(registry).items() if k.endswith("_configs") and isinstance(v, dict) for n in v})
  if flavor not in flavors:
    raise TorchOnTpuError(f"torchtitan's {family} has no flavor '{flavor}'; choose one of {', '.join(flavors)}.")
  mtp = {}
  if mtp_layers:
    if "num_mtp_layers" not in inspect.signature(registry.model_registry).parameters:
      raise TorchOnTpuError(
        f"torchtitan's {family} has no multi-token prediction (its model_registry takes no num_mtp_layers); "
        f"leave {errors.arg('mtp_layers', 0)}."
      )
    mtp = {"num_mtp_layers": mtp_layers}
  config = registry.model_registry(flavor, **mtp).model
  for layer in [*config.layers, *getattr(config, "mtp_layers", ())] if max_seq_len is not None else ():
    attention = getattr(layer, "attention", None) or getattr(layer, "attn", None)
    rope = getattr(attention, "rope", None)
    if rope is None:
      continue
    if max_seq_len > rope.max_seq_len:
      raise TorchOnTpuError(
        f"seqlen {max_seq_len} exceeds {spec}'s maximum of {rope.max_seq_len} positions; use a shorter --seqlen."
      )
    attention.rope = dataclasses.replace(rope, max_seq_len=max_seq_len)
  return config


def llama3_config(flavor: str = "debugmodel", *, attention: str = "flex", max_seq_len: int | None = None):
  """torchtitan's `Llama3Model.Config` for a flavor, from its own registry.

  `max_seq_len` sizes the RoPE cache the way torchtitan's trainer does for
  the training sequence length (otherwise every layer holds 131072 positions).
  """
  extras.require("torchtitan", "torchtitan's Llama 3")
  from torchtitan.models.common.attention import ScaledDotProductAttention
  from torchtitan.models.llama3 import model_registry

  if flavor not in FLAVORS:
    raise TorchOnTpuError(f"Unknown Llama 3 flavor '{flavor}'; choose one of {', '.join(FLAVORS)}.")
  if attention not in ("flex", "sdpa"):
    raise TorchOnTpuError(f"torchtitan attention must be 'flex' or 'sdpa', got '{attention}'.")
  config = model_registry(flavor).model
  for layer in config.layers:
    if attention == "sdpa":
      layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if max_seq_len is not None:
      if max_seq_len > layer.attention.rope.max_seq_len:
        raise TorchOnTpuError(
          f"seqlen {max_seq_len} exceeds Llama 3 {flavor}'s maximum of "
          f"{layer.attention.rope.max_seq_len} positions; use a shorter --seqlen."
        )
      layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len)
  return config


def build_llama3(flavor: str = "debugmodel", *, attention: str = "flex", max_seq_len: int | None = None, device="meta"):
  """torchtitan's Llama 3 model, built on `device` (meta by default: no memory)."""
  config = llama3_config(flavor, attention=attention, max_seq_len=max_seq_len)
  with torch.device(device):
    return config.build()


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


def _flatten_masks(m):
  return [m.segment_ids], (m.causal, m.window)


def _unflatten_masks(children, static):
  return FlexMasks(children[0], causal=static[0], window=static[1])

  __str__ = __repr__  # BlockMask's own reads its block state


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


def _with_documents(layout, documents):
  """The masks of `layout` (what `attention_masks` returned for a stand-in batch) over the
  batch's document ids `documents` (B, L)."""
  if isinstance(layout, dict):
    return {key: _with_documents(m, documents) for key, m in layout.items()}
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


def _sinks_of(out_transform):
  """The per-head sink logits an `out_transform` applies (gpt-oss's), or a refusal."""
  if out_transform is None:
    return None
  from torchtitan.models.gpt_oss.model import Attention as GptOssAttention

  if getattr(out_transform, "__func__", None) is GptOssAttention._apply_sinks:
    # out * sigmoid(lse - sink): the sink is one more logit in each row's softmax, with no value.
    return out_transform.__self__.sinks
  name = getattr(out_transform, "__qualname__", type(out_transform).__name__)
  raise TorchOnTpuError(
    f"torchtitan attention got out_transform '{name}' over the log-sum-exp, which the bridge's attention "
    f"kernels express only as gpt-oss's attention sinks; use a config without it."
  )


@functools.cache
def _say_varlen_lse_gradient() -> None:
  """Once per process, where the bridge's gradient differs from torchtitan's on CUDA on purpose
  (a warning: recipes show no info lines, and a user comparing runs needs to know)."""
  logger.warning(
    "torchtitan's varlen attention with an out_transform (gpt-oss's sinks): the bridge differentiates "
    "the log-sum-exp it rescales by, as torchtitan's flex backend does; torch's varlen_attn backward "
    "on CUDA drops that gradient, so trained attention weights differ from a torchtitan GPU run on "
    "varlen (docs/torchtitan.md, 'Against torchtitan on a GPU')."
  )


@contextlib.contextmanager
def varlen_routed_to(attend):
  """While active, torchtitan's VarlenAttention runs `attend` on a `VarlenMasks` or `FlexMasks` (documents):
  its own `window_size` (left, right) as causal/window, its bf16 inputs as it casts them,
  an out_transform as `_sinks_of` reads it."""
  from torchtitan.models.common.attention import VarlenAttention

  original = VarlenAttention.__dict__["forward"]

  def routed(self, q, k, v, *, attention_masks, scale=None, out_transform=None, **kwargs):
    if not isinstance(attention_masks, (FlexMasks, VarlenMasks)):
      raise TorchOnTpuError(
        f"torchtitan VarlenAttention got attention_masks of type {type(attention_masks).__name__}; pass "
        f"attention_masks=torch_on_tpu.models.torchtitan.attention_masks(model, positions) instead."
      )
    left, right = self.window_size
    if right not in (0, -1) or (right == -1 and left != -1):
      raise TorchOnTpuError(
        f"torchtitan VarlenAttention has window_size {self.window_size}; the bridge's kernels take "
        f"(-1, 0) causal, (W - 1, 0) a causal sliding window, or (-1, -1) full attention."
      )
    if out_transform is not None:
      _say_varlen_lse_gradient()
    window = attention_masks.window if left < 0 else left + 1
    if attention_masks.window is not None and left >= 0:
      window = min(window, attention_masks.window)
    # varlen_attn takes bf16 only: torchtitan casts q, k, v, and the output back.
    q16, k16, v16 = (t.to(torch.bfloat16).transpose(1, 2) for t in (q, k, v))
    out = attend(
      q16, k16, v16, segment_ids=attention_masks.segment_ids, causal=right == 0 and attention_masks.causal,
      window=window, sinks=_sinks_of(out_transform), scale=scale, enable_gqa=kwargs.get("enable_gqa", False),
    )
    return out.transpose(1, 2).to(q.dtype)

  VarlenAttention.forward = routed
  try:
    yield
  finally:
    VarlenAttention.forward = original


@contextlib.contextmanager
def flex_routed_to(attend):
  """While active, torchtitan's FlexAttention runs `attend(q, k, v, segment_ids=, causal=,
  window=, sinks=, scale=, enable_gqa=)` (q, k, v as (B, N, L, H)) instead of its
  `torch.compile`d flex_attention, for a `FlexMasks` mask."""
  from torchtitan.models.common.attention import FlexAttention

  original = FlexAttention.__dict__["forward"]

  def routed(self, q, k, v, *, attention_masks, score_mod=None, scale=None, enable_gqa=False,
             out_transform=None, **kwargs):
    if score_mod is not None:
      raise TorchOnTpuError(
        "torchtitan FlexAttention got a score_mod, which the bridge's attention kernels do "
        "not express; use a model config without score_mod or attention=None."
      )
    if not isinstance(attention_masks, FlexMasks):
      raise TorchOnTpuError(
        f"torchtitan FlexAttention got attention_masks of type {type(attention_masks).__name__}; pass "
        f"attention_masks=torch_on_tpu.models.torchtitan.attention_masks(model, positions) instead."
      )
    out = attend(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
      segment_ids=attention_masks.segment_ids, causal=attention_masks.causal, window=attention_masks.window,
      sinks=_sinks_of(out_transform), scale=scale, enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2)

  FlexAttention.forward = routed
  try:
    yield
  finally:
    FlexAttention.forward = original


class TorchtitanFamily(Family):
  """torchtitan's decoders (Llama 3 and those built like it)."""

  name = "torchtitan"

  def claims(self, module):
    return is_torchtitan(module)

  def init_fn(self, module):
    if callable(getattr(module, "init_states", None)):
      return lambda m: m.init_states(buffer_device=torch.device("jax"))
    return None

  def decoder_shape(self, module):
    """Read from the module's structure, for every torchtitan decoder: its attention
    modules (those holding an `inner_attention`; MLA's scores and values counted at
    their own head dims), the widest per-token FFN (a MoE layer's `top_k` routed experts
    plus its shared ones) and the routed-expert parameters a token does not touch. A
    multi-token-prediction layer counts as a layer (its block runs per token like the others)
    and each depth applies the lm_head once more (`predictions`)."""
    layers = getattr(module, "layers", None)
    if layers is None or not len(layers) or not hasattr(module, "tok_embeddings"):
      return None
    blocks = list(layers.values() if hasattr(layers, "values") else layers)
    blocks += list(module.mtp_layers) if mtp_depths(module) else []
    attentions = [m for b in blocks for m in b.modules() if hasattr(m, "inner_attention") and hasattr(m, "n_heads")]
    if not attentions:
      return None
    attention = attentions[0]
    if hasattr(attention, "qk_head_dim"):  # MLA: q·k over qk_head_dim, p·v over v_head_dim, per head
      head_dim, kv_heads = (attention.qk_head_dim + attention.v_head_dim) // 2, attention.n_heads
    else:
      head_dim, kv_heads = attention.head_dim, attention.n_kv_heads or attention.n_heads
    moes = [m for b in blocks for m in b.modules() if _is_moe(m)]
    # the token table itself, also where it is wrapped (Muse Glimmer's EmbeddingWithNorm)
    embedding = next(m for m in module.tok_embeddings.modules() if isinstance(m, torch.nn.Embedding))
    return DecoderShape(
      layers=len(blocks),
      dim=embedding.embedding_dim,
      ffn_dim=max(_ffn_width(b) for b in blocks),
      heads=attention.n_heads,
      kv_heads=kv_heads,
      head_dim=head_dim,
      vocab=embedding.num_embeddings,
      attention_layers=len(attentions),
      inactive_params=sum(_inactive_expert_params(m) for m in moes),
      predictions=1 + mtp_depths(module),
    )

  def sharding_map(self, module, preset):
    return fsdp_tp_map(module) if preset == "fsdp_tp" else None

  def optimizer_pre_step(self, module):
    """torchtitan's auxiliary-loss-free MoE load balancing, the step pre-hook its trainer
    registers for every MoE model (`register_moe_load_balancing_hook`, the only
    `post_optimizer_build_fn` of torchtitan 0.3.0's registries): per MoE layer with a
    `load_balance_coeff`, `expert_bias_E += δ - mean(δ)` with `δ = coeff ·
    sign(mean(n) - n)` for the token counts `n = tokens_per_expert_E` the forwards
    accumulated (over the global batch, as torchtitan's all-reduce makes them), then
    the counts reset. Only the blocks of `layers`, those torchtitan's hook walks: a
    multi-token-prediction layer's MoE (DeepSeek-V3's `mtp_layers`) keeps its bias, and its
    counts grow, as in torchtitan."""
    layers = [
      (prefix, m.load_balance_coeff) for prefix, m in module.named_modules()
      if prefix.startswith("layers.") and _is_moe(m) and getattr(m, "load_balance_coeff", None) is not None
    ]
    if not layers:
      return None

    def update(read):
      out = {}
      for prefix, coeff in layers:
        counts = read(f"{prefix}.tokens_per_expert_E").astype(jnp.float32)
        delta = coeff * jnp.sign(counts.mean() - counts)
        bias = read(f"{prefix}.expert_bias_E")
        out[f"{prefix}.expert_bias_E"] = (bias + (delta - delta.mean())).astype(bias.dtype)
        out[f"{prefix}.tokens_per_expert_E"] = jnp.zeros_like(read(f"{prefix}.tokens_per_expert_E"))
      return out

    return update

  def expert_parameters(self, module):
    """The routed-expert weights torchtitan's EP plan shards on their expert dim."""
    plan = parallel_plan(module, ep=True) if is_torchtitan(module) else {}
    experts = [name for name, dims in plan.items() if dims.get("ep") == 0]
    return experts or None

  def prepare(self, module):
    if _takes_keyed_masks(module) and module not in _checked_masks:
      _checked_masks.add(module)
      module.register_forward_pre_hook(_require_keyed_masks, with_kwargs=True)

  def model_inputs(self, module, batch):
    ids, positions, segments = batch["input_ids"], batch.get("positions"), batch.get("segment_ids")
    if positions is None:
      return ids
    inputs = {"tokens": ids, "positions": positions}  # by name: every torchtitan decoder takes them so
    if _uses_masked_attention(module):
      # What torchtitan's trainer passes, get_attention_masks(positions), with the loader's document ids
      # (the batch's arrays may be traced or span hosts: torchtitan's mask code runs on a stand-in).
      documents = document_ids(positions).to(torch.int32) if segments is None else segments
      layout = attention_masks(module, torch.zeros(1, 1, dtype=torch.long))
      inputs["attention_masks"] = _with_documents(layout, documents)
    if "special_tokens" in inspect.signature(module.forward).parameters:
      # A multimodal decoder called with text only (Qwen3.5 reads the ids even then): no
      # pixels, and placeholder ids no token has.
      inputs["special_tokens"] = {"image_id": -1, "video_id": -1}
    return inputs

  def decode_cache(self, module, max_len):
    return None, "torchtitan's decoders have no KV cache"

  def hf_form(self, module):
    """Llama 3 as HF Llama (its q/k rows permuted for HF's RoPE), gpt-oss as HF GptOss
    (`hf_gpt_oss`); the other families through torchtitan's own `state_dict_adapter`
    (`hf_via_adapter`)."""
    if type(module).__module__ == "torchtitan.models.gpt_oss.model":
      return hf_gpt_oss(module)
    if type(module).__module__ in ("torchtitan.models.deepseek_v3.model", "torchtitan.models.kimi_k2_7.model"):
      return hf_deepseek(module)
    if type(module).__module__ != "torchtitan.models.llama3.model":
      return hf_via_adapter(module)
    config, to_hf = hf_llama(module)

    def rename(name):
      hf_name, heads = to_hf(name)
      return hf_name, None if heads is None else (lambda w: hf_rotary_rows(w, heads))

    return HFForm(config, rename)

  @contextlib.contextmanager
  def running(self, module):
    """torchtitan's SPMD type annotations off while the model runs: the bridge runs it
    as single-device code and shards it from outside (its "partial_dtensor" backend,
    which annotates nothing on plain tensors); Qwen3.5's linear-attention kernels
    (flash-linear-attention's Triton, which cannot run under jax) routed to the bridge's."""
    from torchtitan.distributed import utils as titan_distributed

    before = titan_distributed.get_spmd_backend()
    titan_distributed.set_spmd_backend("partial_dtensor")
    try:
      with _linear_attention_routed():
        yield
    finally:
      titan_distributed.set_spmd_backend(before)

  def attention_routes(self, attend):
    # Any model built from torchtitan's attention modules (not only its top-level classes).
    if "torchtitan.models.common.attention" not in sys.modules:
      return []
    return [flex_routed_to(attend), varlen_routed_to(attend)]


# ---- multi-token prediction (DeepSeek-V3's MTPDecoder) ---------------------------------------

MTP_SCALE = 0.3  # torchtitan's MTPLoss.Config.mtp_scale


def mtp_depths(model) -> int:
  """How many tokens past the next one a torchtitan model (or its config) predicts
  (DeepSeek-V3 built with `num_mtp_layers`): its forward then returns a list, the main logits
  and one per depth. 0 for every other model."""
  return len(getattr(model, "mtp_layers", None) or ()) if is_torchtitan(model) else 0


def mtp_loss(outputs, labels, positions, *, scale: float = MTP_SCALE):
  """torchtitan's own `MTPLoss` of a multi-token-prediction model's outputs: the main
  cross-entropy plus `scale` × the mean over depths of the cross-entropy against the labels
  rolled by the depth within each packed document (`roll_mtp_sequence`, from `positions`),
  normalised as torchtitan's trainer normalises it, by the count of valid main labels (with
  `grad_accum`, per microbatch: the step's mean of them is torchtitan's whole-batch division
  where the microbatches hold as many valid labels, as the recipe's packed rows, with none
  ignored, do). A train step's `loss_fn` reads `labels` and `positions` from its labels pytree:

      loss_fn = lambda outputs, y: mtp_loss(outputs, y["labels"], y["positions"])
      step(inputs, {"labels": labels, "positions": positions})
  """
  from torchtitan.components.loss import IGNORE_INDEX
  from torchtitan.models.deepseek_v3.mtp import MTPLoss

  loss, _ = MTPLoss(MTPLoss.Config(mtp_scale=scale))(
    list(outputs), labels, (labels != IGNORE_INDEX).sum(), positions=positions
  )
  return loss


def _is_moe(module) -> bool:
  return hasattr(module, "router") and hasattr(module, "routed_experts")


def _routed(moe):
  """(routed expert params, experts, experts per token) of a torchtitan MoE layer."""
  experts = moe.routed_experts.inner_experts
  return sum(p.numel() for p in experts.parameters()), moe.router.num_experts, moe.router.top_k


def _inactive_expert_params(moe) -> int:
  params, experts, top_k = _routed(moe)
  return params * (experts - top_k) // experts


def _ffn_width(block) -> int:
  """Hidden units a token passes through in one block's FFN or MoE."""
  width = 0
  for m in block.modules():
    if _is_moe(m):
      params, experts, top_k = _routed(m)
      width += params // experts // (3 * m.router.gate.in_features) * top_k  # gate, up, down: 3 dim-by-hidden
      if m.shared_experts is not None:
        width += m.shared_experts.w1.out_features
      return width
  ff = getattr(block, "feed_forward", None)
  return ff.w1.out_features if ff is not None and hasattr(ff, "w1") else 0


# ---- Qwen3.5's linear attention (Gated DeltaNet) ---------------------------------------------


@contextlib.contextmanager
def _linear_attention_routed():
  """While active, torchtitan's Gated DeltaNet (Qwen3.5) runs its document-resetting causal
  conv and its gated delta rule as the bridge's (`_causal_conv_by_document`,
  `_gated_delta_rule`) instead of flash-linear-attention's Triton kernels, which run
  only on CUDA torch tensors."""
  qwen3_5 = sys.modules.get("torchtitan.models.qwen3_5.model")
  if qwen3_5 is None:
    yield
    return
  conv, kernel = qwen3_5._causal_conv1d_varlen, qwen3_5.GatedDeltaKernel.forward

  def routed_kernel(self, q, k, v, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None):
    if q.shape[2] != v.shape[2]:  # value heads share key heads, as torchtitan's forward expands them
      q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    documents = None if cu_seqlens is None else jax_view(_flat_documents(cu_seqlens))
    return torch_view(_gated_delta_rule(*(jax_view(t) for t in (q, k, v, g, beta)), documents))

  qwen3_5._causal_conv1d_varlen = lambda x, weight, ids, _host: _causal_conv_by_document(x, weight, _flat_documents(ids))
  qwen3_5.GatedDeltaKernel.forward = routed_kernel
  try:
    yield
  finally:
    qwen3_5._causal_conv1d_varlen, qwen3_5.GatedDeltaKernel.forward = conv, kernel


def _flat_documents(segment_ids: torch.Tensor) -> torch.Tensor:
  """(B, L) document ids → (B·L,) ids unique across rows (the folded layout Gated DeltaNet runs)."""
  rows, length = segment_ids.shape
  offsets = torch.arange(rows, dtype=segment_ids.dtype, device=segment_ids.device)[:, None] * (length + 1)
  return (segment_ids + offsets).reshape(-1)


def _causal_conv_by_document(x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
  """flash-linear-attention's varlen `causal_conv1d` (depthwise, SiLU, restarted at each
  document): x (1, T, D), weight (D, 1, K), documents (T,)."""
  taps = weight.shape[-1]
  w = weight.reshape(weight.shape[0], taps)
  out = torch.zeros_like(x)
  for back in range(taps):  # tap `back` reads the token `back` steps earlier, in the same document
    earlier = torch.nn.functional.pad(x, (0, 0, back, 0))[:, : x.shape[1]]
    same = documents == torch.nn.functional.pad(documents, (back, 0), value=-1)[: x.shape[1]]
    out = out + earlier * same[None, :, None].to(x.dtype) * w[:, taps - 1 - back]
  return torch.nn.functional.silu(out)


def _gated_delta_rule(q, k, v, g, beta, documents=None):
  """flash-linear-attention's `chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`
  as a sequential scan (jax arrays; q, k (1, T, H, K), v (1, T, H, V), g, beta (1, T, H)):
  per head, the state S (K, V) decays by exp(g), is corrected toward v along k by beta,
  and is read by q scaled by K^-1/2; S restarts at each document of `documents` (T,)
  (one stream when None). fp32 inside, output in v's dtype."""
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  l2 = lambda x: (f32(x) / jnp.sqrt(jnp.sum(f32(x) ** 2, -1, keepdims=True) + 1e-6)).astype(x.dtype)  # noqa: E731
  scale = q.shape[-1] ** -0.5
  q, k = f32(l2(q))[0] * scale, f32(l2(k))[0]
  v, g, beta = f32(v)[0], f32(g)[0], f32(beta)[0]
  steps = q.shape[0]
  starts = jnp.zeros(steps, bool).at[0].set(True)
  if documents is not None:
    starts = starts.at[1:].set(documents[1:] != documents[:-1])

  def step(state, xs):
    q_t, k_t, v_t, g_t, beta_t, start = xs
    state = jnp.where(start, 0.0, state) * jnp.exp(g_t)[:, None, None]
    delta = (v_t - jnp.einsum("hkv,hk->hv", state, k_t)) * beta_t[:, None]
    state = state + k_t[:, :, None] * delta[:, None, :]
    return state, jnp.einsum("hk,hkv->hv", q_t, state)

  init = jnp.zeros((q.shape[1], q.shape[2], v.shape[2]), jnp.float32)
  _, out = jax.lax.scan(step, init, (q, k, v, g, beta, starts))
  return out[None].astype(v.dtype)


# ---- export through torchtitan's own state_dict adapters ------------------------------------


def hf_via_adapter(module: torch.nn.Module) -> HFForm | None:
  """The model as transformers writes it: names and layouts from the family's own
  `torchtitan.models.<name>.state_dict_adapter` (its `to_hf`, run on the device arrays entry by
  entry, or on the few entries it fuses into one HF tensor), the config from `_HF_CONFIGS`.
  None for a family without either."""
  import importlib

  family = type(module).__module__.split(".")[2] if is_torchtitan(module) else None
  make_config = _HF_CONFIGS.get(family)
  if make_config is None or getattr(module, "config", None) is None:
    return None
  adapters = importlib.import_module(f"torchtitan.models.{family}.state_dict_adapter")
  from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

  classes = [c for c in vars(adapters).values() if isinstance(c, type) and issubclass(c, BaseStateDictAdapter) and c.__module__ == adapters.__name__]
  if len(classes) != 1:
    return None
  adapter = _ADAPTER_FIXES.get(family, lambda a: a)(classes[0](module.config, None))
  config, check = make_config(module.config)
  built = _as_built(module)
  # tied aliases (lm_head of tied embeddings) aside; buffers written where the adapter names them
  # (DeepSeek-V3's expert bias), none required (RoPE tables; load-balancing state: `check`'s)
  aliases = {n for n, _ in built.named_parameters(remove_duplicate=False)} - {n for n, _ in built.named_parameters()}
  shapes = {name: value for name, value in built.state_dict().items() if name not in aliases}
  required = {name for name, _ in built.named_parameters()}
  made_at = {}  # an HF tensor is written where its first entry is
  for hf, parts in _adapter_sources(adapter, shapes, required, family).items():
    make = functools.partial(_hf_tensor, adapter, parts, hf)
    made_at.setdefault(parts[0], []).append((hf, make if len(parts) == 1 else FromSeveral(parts, make)))
  return HFForm(config, lambda name: made_at.get(name, []), check)


def _as_built(module: torch.nn.Module) -> torch.nn.Module:
  """The model as its config builds it, on meta: the state_dict names an export reads (a scanned
  model's own are its stacked layers'), shapes only."""
  with torch.device("meta"):
    return module.config.build()


def _adapter_sources(adapter, shapes: dict, required: set, family: str) -> dict[str, tuple[str, ...]]:
  """HF name → the state_dict entries the adapter's `to_hf` makes it of: alone where an entry
  converts by itself; the rest by layer (an adapter fuses a layer's q/k/v or its experts' w1/w3),
  each HF tensor narrowed to the entries it needs. Checked against one pass over the whole
  dict (names and shapes, on meta), so a grouping the adapter does not make is refused, and so
  is a `required` entry (a parameter) it gives no HF name."""

  def to_hf(names) -> dict:
    try:
      return adapter.to_hf({n: shapes[n] for n in names})
    except Exception:  # noqa: BLE001 (an adapter may index the partner of an entry it fuses: a part is missing)
      return {}

  whole = {hf: tuple(v.shape) for hf, v in adapter.to_hf(dict(shapes)).items()}
  sources, fused = {}, {}
  for name in shapes:
    alone = to_hf([name])
    sources.update({hf: (name,) for hf in alone})
    if not alone:
      fused.setdefault(re.match(r"(.*?\.\d+\.|)", name).group(1), []).append(name)
  for group in fused.values():
    for hf, value in to_hf(group).items():
      needed = list(group)
      for name in group:  # drop the entries this HF tensor is made without
        rest = [n for n in needed if n != name]
        made = to_hf(rest).get(hf)
        if made is not None and made.shape == value.shape:
          needed = rest
      sources[hf] = tuple(needed)
  used = {name for parts in sources.values() for name in parts}
  dropped = [name for name in shapes if name in required and name not in used]
  if dropped:
    raise TorchOnTpuError(
      f"torchtitan's {family} state_dict_adapter gives no HF name for parameter '{dropped[0]}' ({len(dropped)} "
      f"dropped in all), so its export would be incomplete; export_safetensors writes the model's own names."
    )
  ours = {hf: tuple(to_hf(parts)[hf].shape) for hf, parts in sources.items()}
  if ours != whole:
    differ = sorted(set(ours.items()) ^ set(whole.items()))[0][0]
    raise TorchOnTpuError(
      f"torchtitan's {family} state_dict_adapter makes '{differ}' differently from the whole state_dict than "
      f"from its parts, so the export cannot be written tensor by tensor; export_safetensors writes the model's own names."
    )
  return sources


def _hf_tensor(adapter, names: tuple[str, ...], hf_name: str, *arrays: jax.Array) -> jax.Array:
  """The adapter's `to_hf` on device arrays (through torchax's view of them)."""
  with torchax.default_env():
    return jax_view(adapter.to_hf({n: torch_view(a) for n, a in zip(names, arrays)})[hf_name])


def _refuse_hf(problem: str | None, ours: str, hf: str) -> None:
  """One sentence for a torchtitan model whose HF form would compute otherwise (`problem`: why)."""
  if problem is not None:
    raise TorchOnTpuError(f"This torchtitan {ours} cannot be written as HF {hf}: {problem}; export_safetensors writes its own names.")


def _qwen3_hf_config(config):
  """HF's Qwen3 (dense) or Qwen3-MoE config for torchtitan's Qwen3; refuses what HF cannot express."""
  import transformers

  first = config.layers[0]
  qkv, rope = first.attention.qkv_linear, first.attention.rope
  moes = [layer.moe for layer in config.layers if layer.moe is not None]
  problem = None
  if rope.scaling != "none":
    problem = f"its RoPE scaling is '{rope.scaling}'"
  elif moes and len(moes) != len(config.layers):
    problem = "it mixes dense and MoE layers"
  elif moes and (moes[0].shared_experts is not None or moes[0].router.score_func != "softmax" or moes[0].router.route_scale != 1.0):
    problem = "its MoE router or shared experts differ from HF Qwen3-MoE's"
  _refuse_hf(problem, "Qwen3", "Qwen3")
  common = dict(
    vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=len(config.layers),
    num_attention_heads=qkv.n_heads, num_key_value_heads=qkv.n_kv_heads, head_dim=qkv.head_dim,
    rms_norm_eps=config.norm.eps, max_position_embeddings=rope.max_seq_len,
    tie_word_embeddings=bool(config.enable_weight_tying), attention_bias=False,
    rope_parameters=dict(rope_type="default", rope_theta=float(rope.theta)),
  )
  if not moes:
    hf = transformers.Qwen3Config(intermediate_size=first.feed_forward.w1.out_features, architectures=["Qwen3ForCausalLM"], **common)
    return hf, None
  moe = moes[0]
  hf = transformers.Qwen3MoeConfig(
    intermediate_size=moe.routed_experts.inner_experts.hidden_dim, moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
    num_experts=moe.num_experts, num_experts_per_tok=moe.router.top_k, norm_topk_prob=bool(moe.router.route_norm),
    decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"], **common,
  )
  return hf, _no_expert_bias(len(config.layers)) if moe.load_balance_coeff is not None else None


def _no_expert_bias(layers, hf_name: str = "Qwen3-MoE"):
  """HF's `hf_name` routes without torchtitan's load-balancing bias: a trained (nonzero) one is refused
  (`layers`: how many, all MoE, or the MoE layers' numbers)."""

  def check(read):
    for i in range(layers) if isinstance(layers, int) else layers:
      bias = read(f"layers.{i}.moe.expert_bias_E")
      if bool(jnp.any(bias != 0)):
        raise TorchOnTpuError(
          f"layers.{i}.moe.expert_bias_E is nonzero (torchtitan's MoE load balancing moved it) and HF's "
          f"{hf_name} routes without an expert bias, so its logits would differ; export_safetensors writes "
          f"the model with it."
        )

  return check


def _qwen3_5_hf_config(config):
  """HF's Qwen3.5 (dense) or Qwen3.5-MoE config (language model and vision encoder) for
  torchtitan's Qwen3.5; refuses what HF cannot express."""
  import transformers

  attentions = [layer.attention for layer in config.layers if layer.attention is not None]
  deltas = [layer.delta_net for layer in config.layers if layer.delta_net is not None]
  moes = [layer.moe for layer in config.layers if layer.moe is not None]
  first, delta, vision = attentions[0], deltas[0], config.vision_encoder
  rope = first.rope
  problem = None
  if rope.scaling != "none":
    problem = f"its RoPE scaling is '{rope.scaling}'"
  elif first.wq.out_features != 2 * first.n_heads * first.head_dim:
    problem = "its attention has no output gate"  # HF's q_proj makes the query and the gate
  elif moes and len(moes) != len(config.layers):
    problem = "it mixes dense and MoE layers"
  elif moes and (moes[0].shared_experts is None or moes[0].router.score_func != "softmax" or not moes[0].router.route_norm
                 or moes[0].router.route_scale != 1.0 or moes[0].router.num_expert_groups):
    problem = "its MoE router or shared expert differs from HF Qwen3.5-MoE's"
  elif vision.block.mlp.act_fn.approximate != "tanh":
    problem = "its vision MLP's GELU is not the tanh approximation"
  elif len({(a.n_heads, a.n_kv_heads, a.head_dim, a.rotary_dim) for a in attentions}) > 1 or len(
    {(d.in_proj_q.out_features, d.in_proj_v.out_features, d.conv_kernel_size) for d in deltas}) > 1:
    problem = "its layers differ in size"
  _refuse_hf(problem, "Qwen3.5", "Qwen3.5")
  text = dict(
    vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=len(config.layers),
    num_attention_heads=first.n_heads, num_key_value_heads=first.n_kv_heads, head_dim=first.head_dim,
    rms_norm_eps=config.norm.eps, max_position_embeddings=rope.max_seq_len, tie_word_embeddings=bool(config.enable_weight_tying),
    rope_parameters=dict(rope_type="default", rope_theta=float(rope.theta), partial_rotary_factor=first.rotary_dim / first.head_dim,
                         mrope_section=list(rope.mrope_section), mrope_interleaved=True),
    layer_types=["full_attention" if layer.attention is not None else "linear_attention" for layer in config.layers],
    linear_conv_kernel_dim=delta.conv_kernel_size, linear_key_head_dim=delta.key_head_dim, linear_value_head_dim=delta.value_head_dim,
    linear_num_key_heads=delta.in_proj_q.out_features // delta.key_head_dim,
    linear_num_value_heads=delta.in_proj_v.out_features // delta.value_head_dim,
  )
  if moes:
    moe = moes[0]
    text.update(moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim, num_experts=moe.num_experts,
                num_experts_per_tok=moe.router.top_k, shared_expert_intermediate_size=moe.shared_experts.w1.out_features)
  else:
    text.update(intermediate_size=config.layers[0].feed_forward.w1.out_features)
  vision_config = dict(
    depth=vision.num_layers, hidden_size=vision.dim, hidden_act="gelu_pytorch_tanh", intermediate_size=vision.block.mlp.fc1.out_features,
    num_heads=vision.num_heads, in_channels=vision.in_channels, patch_size=vision.patch_size,
    spatial_merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size,
    out_hidden_size=vision.merger.fc2.out_features, num_position_embeddings=vision.num_position_embeddings,
  )
  make, architecture = (transformers.Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration") if moes else (
    transformers.Qwen3_5Config, "Qwen3_5ForConditionalGeneration")
  hf = make(text_config=text, vision_config=vision_config, tie_word_embeddings=bool(config.enable_weight_tying), architectures=[architecture])
  return hf, _no_expert_bias(len(config.layers), "Qwen3.5-MoE") if moes and moes[0].load_balance_coeff is not None else None


class _Qwen3_5ExpertsPerExpert:
  """torchtitan 0.3.0's Qwen3.5 adapter writes the experts fused as (experts, dim, 2·hidden), a
  layout transformers does not read; it reads Qwen3.5-MoE checkpoints' per-expert gate, up and
  down projections, which this writes (the rest is the adapter's)."""

  _PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

  def __init__(self, adapter):
    self.adapter = adapter

  def to_hf(self, state: dict) -> dict:
    out = self.adapter.to_hf({k: v for k, v in state.items() if ".inner_experts." not in k})
    for name, value in state.items():
      if m := re.fullmatch(r"layers\.(\d+)\.moe\.routed_experts\.inner_experts\.(w[123])_E[DF]{2}", name):
        prefix = f"model.language_model.layers.{m[1]}.mlp.experts"
        out.update({f"{prefix}.{e}.{self._PROJECTIONS[m[2]]}.weight": value[e] for e in range(value.shape[0])})
    return out


# torchtitan family → a wrapper of its state_dict_adapter where the adapter's `to_hf` is not what
# transformers reads
_ADAPTER_FIXES = {"qwen3_5": _Qwen3_5ExpertsPerExpert}

def _muse_glimmer_hf_config(config):
  """HF's MuseGlimmer config for torchtitan's Muse Glimmer; refuses what HF's computes
  differently. HF's model is its vision-language class (transformers loads it with
  `AutoModelForImageTextToText`): a vision flavor's tower, adapter and projection are written
  (`_muse_glimmer_hf_vision`); for a text flavor HF still builds a tower, here the smallest one
  (no layers), which the export leaves unwritten. torchtitan's model holds no image id (its
  caller passes one with each call, and replaces those tokens only when it passes pixels), while
  HF replaces its image and video ids by token 0 on every call: they are set to ids no token
  has, so HF's text logits are ours for every sequence."""
  import transformers
  from torchtitan.models.common.attention import FlexAttention, VarlenAttention
  from torchtitan.models.common.rope import ComplexRoPE

  layers = [(layer, layer.attention) for layer in config.layers]
  first = layers[0][1]
  heads, head_dim = first.n_heads, first.head_dim or config.dim // first.n_heads
  windows = {_muse_window(a) for _, a in layers} - {None}
  final, embedding, lm_head = config.norm, config.tok_embeddings.norm, config.lm_head
  pre_eps = {final.eps, embedding.eps, *(n.eps for layer, a in layers for n in (layer.attention_norm, layer.ffn_norm, a.qk_norm) if n)}
  post_eps = {n.eps for layer, _ in layers for n in (layer.post_attention_norm, layer.post_ffn_norm)}
  layer_gains = {_gain(n) for layer, _ in layers for n in (layer.attention_norm, layer.ffn_norm, layer.post_attention_norm, layer.post_ffn_norm)}
  problem = None
  if config.enable_weight_tying:
    problem = "its output is tied to its embedding"
  elif any(_muse_layer_shape(layer) != _muse_layer_shape(layers[0][0]) for layer, _ in layers):
    problem = "its layers differ in shape or query scale"
  elif not isinstance(first.rope, ComplexRoPE.Config) or first.rope.scaling != "none" or first.rope.dim != head_dim:
    problem = f"its RoPE is {type(first.rope).__qualname__} with scaling '{first.rope.scaling}' over {first.rope.dim} of {head_dim} dims"
  elif first.qk_norm is None or first.o_gate is None:
    problem = "it has no q/k norm or no output gate (HF's always applies both)"
  elif len(windows) > 1:
    problem = f"its layers use sliding windows of {len(windows)} sizes (HF has one)"
  elif {a.window_size for _, a in layers} != {None} and not isinstance(first.inner_attention, (FlexAttention.Config, VarlenAttention.Config)):
    problem = f"its windowed layers run {type(first.inner_attention).__qualname__.split('.')[0]}, which attends past their windows (HF's does not)"
  elif layer_gains != {1.0} or _gain(final) != 0.0 or {_gain(embedding), _gain(first.qk_norm)} != {None}:
    problem = "its norms are not HF's (1 + weight in the layers, weight at the end, none on the embedding and q/k)"
  elif len(pre_eps) > 1 or len(post_eps) > 1:
    problem = "its norms' epsilons are not HF's two (one before and one after each sub-layer)"
  elif getattr(lm_head, "output_soft_cap_temp", None) is None:
    problem = "its logits are not soft-capped (HF's always are)"
  _refuse_hf(problem, "Muse Glimmer", "MuseGlimmer")
  vision = _muse_glimmer_hf_vision(config, pre_eps)
  theta = float(first.rope.theta)
  text = transformers.MuseGlimmerTextConfig(
    vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=layers[0][0].feed_forward.w1.out_features,
    num_hidden_layers=len(layers), num_attention_heads=heads, num_key_value_heads=first.n_kv_heads or heads,
    head_dim=head_dim, hidden_activation="silu", max_position_embeddings=first.rope.max_seq_len,
    rms_norm_eps=pre_eps.pop(), post_norm_eps=post_eps.pop(), tie_word_embeddings=False, attention_bias=False,
    rope_parameters=dict(rope_type="default", rope_theta=theta),
    **({"sliding_window": windows.pop()} if windows else {}),  # HF's default where no layer slides
    layer_types=["sliding_attention" if _muse_window(a) else "full_attention" for _, a in layers],
    layer_rope_theta=[theta if a.use_rope else 0 for _, a in layers],  # HF reads only 0 (no RoPE) or not
    qk_scale_factor=float(first.scale_query_by), output_multiplier=float(lm_head.output_multiplier),
    final_logit_softcapping=float(lm_head.output_soft_cap_temp), bos_token_id=None, eos_token_id=None,
  )
  hf = transformers.MuseGlimmerConfig(
    text_config=text, **vision, image_token_id=config.vocab_size, video_token_id=config.vocab_size + 1,
    tie_word_embeddings=False, architectures=["MuseGlimmerForConditionalGeneration"],
  )
  return hf, None


def _muse_glimmer_hf_vision(config, text_eps: set) -> dict:
  """The vision part of HF's MuseGlimmer config (`vision_config`, the adapter's and projection's
  widths) for torchtitan's vision tower, adapter, projection and perception norm; the smallest
  tower for a text flavor. Refuses what HF's vision path computes differently."""
  import transformers
  from torchtitan.models.common.attention import FlexAttention
  from torchtitan.models.common.nn_modules import GELU

  enc, adapter, projection, norm = config.vision_encoder, config.vision_adapter, config.vision_projection, config.perception_emb_norm
  if enc is adapter is projection is norm is None:
    return dict(vision_config=transformers.MuseGlimmerVisionConfig(
      num_hidden_layers=0, hidden_size=1, num_attention_heads=1, intermediate_size=1, patch_size=1, patch_temporal=1,
      merge_size=1, pos_emb_height=1, pos_emb_width=1, max_position_embeddings=1,
    ), out_hidden_size=1, projector_hidden_size=1)
  block = enc and enc.block
  linears = block and (block.attn.wq, block.attn.wk, block.attn.wv, block.attn.proj, block.mlp.fc1, block.mlp.fc2)
  problem = None
  if None in (enc, adapter, projection, norm):
    problem = "its vision stack lacks an encoder, adapter, projection or perception norm (HF's has all four)"
  elif enc.pos_emb_grid_h != enc.pos_emb_grid_w:
    problem = f"its vision position grid (and window) is {enc.pos_emb_grid_h}x{enc.pos_emb_grid_w} patches, HF's is square"
  elif not isinstance(block.attn.inner_attention, FlexAttention.Config):
    problem = f"its vision attention runs {type(block.attn.inner_attention).__qualname__.split('.')[0]}, not the masks of its windows"
  elif not isinstance(block.mlp.act_fn, GELU.Config):
    problem = f"its vision MLP's activation is {type(block.mlp.act_fn).__qualname__.split('.')[0]}, HF's a GELU"
  elif enc.head_dim * enc.num_heads != enc.latent_dim or enc.rope_freq.head_dim != enc.head_dim:
    problem = "its vision heads do not split its width evenly"
  elif enc.conv1.in_features != 3 * enc.patch_temporal * enc.patch_size**2 or enc.conv1.bias:
    problem = "its patch embedding is not a bias-free linear map of 3-channel patches"
  elif not all(linear.bias for linear in linears) or adapter.c_fc.bias or adapter.c_proj.bias or projection.bias:
    problem = "its vision linear layers' biases differ from HF's (the tower's biased, the adapter's and projection's not)"
  elif {block.norm1.eps, block.norm2.eps} != {1e-5} or enc.ln_pre.eps != enc.ln_post.eps or not all(
      n.elementwise_affine for n in (block.norm1, block.norm2, enc.ln_pre, enc.ln_post)):
    problem = "its vision layer norms are not HF's (affine; eps 1e-5 in the layers, one eps before and after them)"
  elif norm.elementwise_affine or {norm.eps} != text_eps:
    problem = "its perception norm is not HF's (scaleless, the text norms' eps)"
  elif (adapter.c_fc.in_features, adapter.c_proj.in_features) != (enc.output_dim, adapter.c_proj.out_features) or \
      enc.output_dim != enc.latent_dim * enc.downsample_factor**2:
    problem = "its vision adapter's widths are not HF's (the merged patches in, one width through)"
  _refuse_hf(problem, "Muse Glimmer", "MuseGlimmer")
  every = enc.sparse_attention_factor  # torchtitan's _layer_uses_global_attention
  layer_types = ["full_attention" if i == enc.num_layers - 1 or (i + 1) % every == 0 else "window_attention"
                 for i in range(enc.num_layers)]
  vision_config = transformers.MuseGlimmerVisionConfig(
    num_hidden_layers=enc.num_layers, hidden_size=enc.latent_dim, num_attention_heads=enc.num_heads,
    intermediate_size=block.mlp.fc1.out_features, hidden_act={"none": "gelu", "tanh": "gelu_pytorch_tanh"}[block.mlp.act_fn.approximate],
    patch_size=enc.patch_size, patch_temporal=enc.patch_temporal, merge_size=enc.downsample_factor,
    pos_emb_height=enc.pos_emb_grid_h, pos_emb_width=enc.pos_emb_grid_w, max_position_embeddings=enc.pos_emb_grid_h * enc.pos_emb_grid_w,
    layer_norm_eps=enc.ln_pre.eps, layer_types=layer_types,
    rope_parameters=dict(rope_type="axial", rope_theta=float(enc.rope_freq.rope_theta)),
  )
  return dict(vision_config=vision_config, out_hidden_size=enc.output_dim, projector_hidden_size=adapter.c_proj.out_features,
              projector_hidden_act="gelu")  # torchtitan's adapter: F.gelu, exact


def _muse_window(attention) -> int | None:
  """The window a Muse Glimmer layer attends in: varlen's kernel argument (left, 0) where it runs
  varlen (what torchtitan computes with), its mask's key otherwise."""
  from torchtitan.models.common.attention import VarlenAttention

  inner = attention.inner_attention
  if isinstance(inner, VarlenAttention.Config):
    return inner.window_size[0] + 1 if inner.window_size[0] >= 0 else None
  return attention.window_size


def _muse_layer_shape(layer) -> tuple:
  a = layer.attention
  return (a.n_heads, a.n_kv_heads, a.head_dim, a.scale_query_by, layer.feed_forward.w1.out_features, dataclasses.replace(a.rope, max_seq_len=0))


def _gain(norm) -> float | None:
  """The constant an RMSNorm's weight is centred on (torchtitan's `RMSGainCenterNorm`), 0 for a
  plain learnable one, None for one without a weight."""
  if not norm.elementwise_affine:
    return None
  return getattr(norm, "gain_center", 0.0)



# gpt-oss's names: torchtitan's state_dict name (layer number as {}) → (HF name, transposed)
_GPT_OSS_NAMES = {
  "tok_embeddings.weight": ("model.embed_tokens.weight", False),
  "norm.weight": ("model.norm.weight", False),
  "lm_head.weight": ("lm_head.weight", False),
  **{f"layers.{{}}.attention.qkv_linear.w{x}.{p}": (f"model.layers.{{}}.self_attn.{x}_proj.{p}", False)
     for x in "qkv" for p in ("weight", "bias")},
  "layers.{}.attention.wo.weight": ("model.layers.{}.self_attn.o_proj.weight", False),
  "layers.{}.attention.wo.bias": ("model.layers.{}.self_attn.o_proj.bias", False),
  "layers.{}.attention.sinks": ("model.layers.{}.self_attn.sinks", False),
  "layers.{}.attention_norm.weight": ("model.layers.{}.input_layernorm.weight", False),
  "layers.{}.ffn_norm.weight": ("model.layers.{}.post_attention_layernorm.weight", False),
  "layers.{}.moe.router.gate.weight": ("model.layers.{}.mlp.router.weight", False),
  "layers.{}.moe.router.gate.bias": ("model.layers.{}.mlp.router.bias", False),
  # experts: torchtitan keeps (experts, out, in), HF (experts, in, out)
  "layers.{}.moe.routed_experts.inner_experts.mlp1_weight_EGD": ("model.layers.{}.mlp.experts.gate_up_proj", True),
  "layers.{}.moe.routed_experts.inner_experts.mlp1_bias_EG": ("model.layers.{}.mlp.experts.gate_up_proj_bias", False),
  "layers.{}.moe.routed_experts.inner_experts.mlp2_weight_EDF": ("model.layers.{}.mlp.experts.down_proj", True),
  "layers.{}.moe.routed_experts.inner_experts.mlp2_bias_ED": ("model.layers.{}.mlp.experts.down_proj_bias", False),
}


def hf_gpt_oss(module: torch.nn.Module) -> HFForm:
  """torchtitan's gpt-oss as HF's GptOss. Not through torchtitan's own adapter: in torchtitan
  0.3.0 it predates the model's expert names (`mlp1_weight` for `mlp1_weight_EGD`) and writes
  the names of the MXFP4 checkpoint (`gate_up_proj_blocks`), so it would drop every expert;
  these are HF's unquantized names, the experts transposed to HF's (experts, in, out)."""
  import transformers

  config = module.config
  attention = [layer.attention for layer in config.layers]
  moes = [layer.moe for layer in config.layers]
  first, router, experts = attention[0], moes[0].router, moes[0].routed_experts.inner_experts
  rope, windows = first.rope, {a.sliding_window_size for a in attention} - {None}
  problem = None
  if router.score_func != "softmax" or not router.route_norm or router.route_scale != 1.0:
    problem = "its router is not HF's (a softmax over the top-k logits)"
  elif len(windows) > 1:
    problem = f"its layers use sliding windows of {len(windows)} sizes (HF has one)"
  elif rope.scaling not in ("none", "yarn"):
    problem = f"its RoPE scaling is '{rope.scaling}'"
  elif config.enable_weight_tying:
    problem = "its embedding is tied to its output"
  _refuse_hf(problem, "gpt-oss", "GptOss")
  rope_parameters = dict(rope_type="default", rope_theta=float(rope.theta))
  max_positions = rope.max_seq_len  # the RoPE table's length; YaRN's stretched context below
  if rope.scaling == "yarn":
    max_positions = int(rope.original_seq_len * rope.rope_factor)
    rope_parameters = dict(
      rope_type="yarn", rope_theta=float(rope.theta), factor=float(rope.rope_factor), beta_fast=float(rope.beta_fast),
      beta_slow=float(rope.beta_slow), truncate=bool(rope.truncate), original_max_position_embeddings=rope.original_seq_len,
    )
  hf = transformers.GptOssConfig(
    vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=len(config.layers),
    num_attention_heads=first.n_heads, num_key_value_heads=first.n_kv_heads, head_dim=first.head_dim,
    intermediate_size=experts.hidden_dim, num_local_experts=moes[0].num_experts, num_experts_per_tok=router.top_k,
    rms_norm_eps=config.norm.eps, max_position_embeddings=max_positions,
    **({"sliding_window": windows.pop()} if windows else {}),  # HF's default where no layer slides
    layer_types=["sliding_attention" if a.sliding_window_size else "full_attention" for a in attention],
    rope_parameters=rope_parameters, swiglu_limit=float(experts.swiglu_limit), tie_word_embeddings=False,
    attention_bias=True, architectures=["GptOssForCausalLM"],
  )
  buffers = {name for name, _ in _as_built(module).named_buffers()}

  def rename(name):
    if name in buffers:
      return []  # RoPE tables and load-balancing state (the check refuses a moved expert bias)
    layer = re.match(r"layers\.(\d+)\.", name)
    key = name if layer is None else name.replace(layer.group(0), "layers.{}.", 1)
    if key not in _GPT_OSS_NAMES:
      raise TorchOnTpuError(f"torchtitan gpt-oss tensor '{name}' has no HF GptOss name; export_safetensors writes its own names.")
    hf_name, transposed = _GPT_OSS_NAMES[key]
    hf_name = hf_name if layer is None else hf_name.format(layer.group(1))
    return [(hf_name, (lambda w: jnp.swapaxes(w, -1, -2)) if transposed else None)]

  check = _no_expert_bias(len(config.layers), "GptOss") if moes[0].load_balance_coeff is not None else None
  return HFForm(hf, rename, check)


# HF's DeepSeek latent norms (q_a_layernorm, kv_a_layernorm) take RMSNorm's default eps, not the config's.
_HF_LATENT_NORM_EPS = 1e-6


def _deepseek_hf_config(config):
  """HF's DeepSeek config for torchtitan's DeepSeek-V3 (and Kimi's text model, the same
  decoder): DeepSeek-V2's (transformers `deepseek_v2`) where it routes by softmax over all
  experts (torchtitan's debugmodel, 16B), DeepSeek-V3's (`deepseek_v3`) where it routes by
  sigmoid with the load-balancing bias, optionally group-limited (671B, Moonlight). Both are
  MLA with interleaved RoPE pairs (torchtitan's ComplexRoPE) and YaRN's softmax scale from
  `mscale_all_dim`; refuses in one sentence what neither can express."""
  import transformers
  from torchtitan.models.common.feed_forward import FeedForward
  from torchtitan.models.common.moe import GroupedExperts
  from torchtitan.models.common.rope import ComplexRoPE

  layers = config.layers
  attention = [layer.attention for layer in layers]
  first, rope = attention[0], attention[0].rope
  moes = [layer.moe for layer in layers if layer.moe is not None]
  dense = [layer.feed_forward for layer in layers if layer.moe is None]
  first_moe = len(dense)  # HF's first_k_dense_replace: dense layers first, MoE after
  moe = moes[0] if moes else None
  router = moe and moe.router
  norms = {layer.attention_norm.eps for layer in layers} | {layer.ffn_norm.eps for layer in layers} | {config.norm.eps}

  def mla(a):
    return (a.n_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.mscale,
            a.kv_norm.eps, a.q_norm.eps if a.q_lora_rank else None, dataclasses.replace(a.rope, max_seq_len=0))

  def routing(m):
    r = m.router
    return (m.num_experts, r.top_k, r.score_func, r.route_norm, r.route_scale, r.num_expert_groups, r.num_limited_groups,
            r.gate.bias, r._debug_force_load_balance, m.routed_experts.inner_experts.hidden_dim,
            m.shared_experts and m.shared_experts.w1.out_features, type(m.routed_experts.inner_experts))

  linears = [getattr(a, n) for a in attention for n in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo") if getattr(a, n) is not None]
  linears += [w for f in dense + [m.shared_experts for m in moes if m.shared_experts] for w in (f.w1, f.w2, f.w3)]
  problem = None
  if config.mtp_layers:
    problem = f"it has {len(config.mtp_layers)} multi-token-prediction layers"
  elif not moes:
    problem = "it has no MoE layers"
  elif any(layer.moe is None for layer in layers[first_moe:]):
    problem = "its dense layers do not all come before its MoE layers"
  elif any(mla(a) != mla(first) for a in attention) or any(routing(m) != routing(moe) for m in moes) \
      or len({f.w1.out_features for f in dense}) > 1:
    problem = "its layers differ in shape"
  elif any(type(f) is not FeedForward.Config for f in dense) or type(moe.routed_experts.inner_experts) is not GroupedExperts.Config:
    problem = "its feed-forward layers are not SwiGLU"
  elif any(linear.bias for linear in linears + [config.lm_head]) or router.gate.bias:
    problem = "its linear layers have biases"
  elif len(norms) > 1 or not all(n.elementwise_affine for layer in layers for n in (layer.attention_norm, layer.ffn_norm)):
    problem = "its RMSNorms differ in eps or affinity"
  elif min(first.kv_norm.eps, first.q_norm.eps if first.q_lora_rank else 1.0) <= 0:
    problem = "its latent RMSNorms have eps 0"
  elif not isinstance(rope, ComplexRoPE.Config) or rope.dim != first.qk_rope_head_dim:
    problem = f"its RoPE is {type(rope).__qualname__} over {rope.dim} of {first.qk_rope_head_dim} dims"
  elif rope.scaling not in ("none", "yarn") or (rope.scaling == "yarn" and not (rope.beta_fast and rope.beta_slow)):
    problem = f"its RoPE scaling is '{rope.scaling}'"
  elif moe.shared_experts is None or moe.shared_experts.w1.out_features % moe.routed_experts.inner_experts.hidden_dim:
    problem = "its shared experts are not whole multiples of a routed expert"
  elif router._debug_force_load_balance:
    problem = "it routes round-robin (_debug_force_load_balance)"
  elif router.score_func == "softmax" and (router.route_norm or router.num_expert_groups is not None):
    problem = ("it routes by softmax with normalised top-k weights, which HF DeepSeek-V2 does not normalise" if router.route_norm
               else "it routes by softmax with group-limited routing, which HF DeepSeek-V2 ranks by each group's best "
               "expert where torchtitan ranks by its best two")
  _refuse_hf(problem, type(config).__qualname__.split(".")[0], "DeepSeek")  # DeepSeekV3Model, KimiK25Model
  yarn = rope.scaling == "yarn" and rope.rope_factor > 1.0
  rope_parameters = dict(rope_type="default", rope_theta=float(rope.theta))
  if yarn:  # torchtitan folds mscale into the softmax scale only; HF's cos/sin stay unscaled (attention_factor 1)
    rope_parameters = dict(
      rope_type="yarn", rope_theta=float(rope.theta), factor=float(rope.rope_factor), beta_fast=float(rope.beta_fast),
      beta_slow=float(rope.beta_slow), truncate=bool(rope.truncate), original_max_position_embeddings=rope.original_seq_len,
      mscale=float(first.mscale), mscale_all_dim=float(first.mscale), attention_factor=1.0,
    )
  experts = moe.routed_experts.inner_experts
  common = dict(
    vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=len(layers),
    num_attention_heads=first.n_heads, num_key_value_heads=first.n_heads, q_lora_rank=first.q_lora_rank or None,
    kv_lora_rank=first.kv_lora_rank, qk_nope_head_dim=first.qk_nope_head_dim, qk_rope_head_dim=first.qk_rope_head_dim,
    v_head_dim=first.v_head_dim, intermediate_size=dense[0].w1.out_features if dense else experts.hidden_dim,
    moe_intermediate_size=experts.hidden_dim, n_routed_experts=moe.num_experts, num_experts_per_tok=router.top_k,
    n_shared_experts=moe.shared_experts.w1.out_features // experts.hidden_dim, first_k_dense_replace=first_moe,
    routed_scaling_factor=float(router.route_scale), norm_topk_prob=bool(router.route_norm), rms_norm_eps=norms.pop(),
    max_position_embeddings=int(rope.original_seq_len * rope.rope_factor) if yarn else rope.max_seq_len,
    rope_parameters=rope_parameters, tie_word_embeddings=bool(config.enable_weight_tying), attention_bias=False,
  )
  if router.score_func == "softmax":
    hf = transformers.DeepseekV2Config(topk_method="greedy", architectures=["DeepseekV2ForCausalLM"], **common)
    check = _no_expert_bias([i for i, layer in enumerate(layers) if layer.moe is not None], "DeepSeek-V2")
    return hf, check if moe.load_balance_coeff is not None else None
  hf = transformers.DeepseekV3Config(
    n_group=router.num_expert_groups or 1, topk_group=router.num_limited_groups or 1, rope_interleave=True,
    num_mtp_layers=0, architectures=["DeepseekV3ForCausalLM"], **common,
  )
  return hf, None  # its e_score_correction_bias is torchtitan's expert_bias_E


def hf_deepseek(module: torch.nn.Module) -> HFForm | None:
  """torchtitan's DeepSeek-V3 or Kimi as HF's DeepSeek-V2/V3 (`_deepseek_hf_config`; Kimi with its
  vision encoder as HF's Kimi-K2.5 around that text model, `_kimi_hf_config`),
  named by torchtitan's own adapter, with two changes HF's form needs: DeepSeek-V2 has no expert
  bias (not written; a nonzero one refused), and HF's latent norms run at eps 1e-6 where
  torchtitan's have their config's (1e-5 by default): the rows of `wkv_a` (its latent part) and
  `wq_a` that feed them are scaled by sqrt(1e-6 / eps), since RMSNorm(c·x, c²·eps) = RMSNorm(x, eps)."""
  form = hf_via_adapter(module)
  if form is None:
    return None
  v2 = getattr(form.config, "text_config", form.config).model_type == "deepseek_v2"  # Kimi-K2.5's: its text model's
  first = module.config.layers[0].attention
  latent = {"wkv_a": (first.kv_norm.eps, first.kv_lora_rank), "wq_a": (first.q_norm.eps, None)}

  def rename(name):
    if v2 and name.endswith(".moe.expert_bias_E"):
      return []
    pairs = form.rename(name)
    feeds = re.fullmatch(r"layers\.\d+\.attention\.(wkv_a|wq_a)\.weight", name)
    if feeds is None or latent[feeds.group(1)][0] == _HF_LATENT_NORM_EPS:
      return pairs
    eps, rows = latent[feeds.group(1)]
    scale = (_HF_LATENT_NORM_EPS / eps) ** 0.5
    ((hf_name, to_hf),) = pairs
    return [(hf_name, lambda w: _scale_rows(to_hf(w), scale, rows))]

  return HFForm(form.config, rename, form.check)


def _scale_rows(w: jax.Array, scale: float, rows: int | None) -> jax.Array:
  """`w`'s first `rows` rows (all of them for None) times `scale`, in `w`'s dtype."""
  rows = w.shape[0] if rows is None else rows
  return jnp.concatenate([w[:rows] * scale, w[rows:]]).astype(w.dtype)


def _kimi_hf_config(config):
  """HF's config for torchtitan's Kimi K2.x: its text model's (`_deepseek_hf_config`) without a
  vision encoder; with one, HF's Kimi-K2.5 (`kimi_k25`): that text model, MoonViT (pre-norm
  LayerNorm blocks, tanh-GELU MLPs, 2D RoPE, a bicubically resampled position table) and the
  projector (LayerNorm per patch, exact-GELU MLP). Its image and video placeholder is the id one
  past the vocabulary: HF embeds placeholder ids as token 0, so no text token may be one (torchtitan
  takes the id with each call). Refuses in one sentence what HF's vision tower cannot express."""
  import transformers

  encoder = config.vision_encoder
  if encoder is None:
    return _deepseek_hf_config(config)
  text, check = _deepseek_hf_config(dataclasses.replace(config, vision_encoder=None))
  block, projector = encoder.block, encoder.projector
  norms = [block.norm1, block.norm2, encoder.final_norm, projector.pre_norm]
  linears = [encoder.patch_embed_proj, block.attn.wq, block.attn.wk, block.attn.wv, block.attn.proj, block.mlp.fc1, block.mlp.fc2,
             projector.linear_1, projector.linear_2]
  problem = None
  if encoder.in_channels != 3:
    problem = f"its vision encoder reads {encoder.in_channels} channels (HF's patch embedding reads 3)"
  elif encoder.init_pos_emb_height != encoder.init_pos_emb_width or encoder.interpolation_mode != "bicubic":
    problem = "its vision position table is not square or not resampled bicubically"
  elif any(n.eps != 1e-5 for n in norms[:3]) or not all(n.elementwise_affine for n in norms):
    problem = "its vision LayerNorms are not HF's (affine, eps 1e-5 in the encoder)"
  elif not all(linear.bias for linear in linears):
    problem = "its vision linear layers lack biases (HF's all have them)"
  elif block.mlp.act_fn.approximate != "tanh" or projector.act_fn.approximate != "none":
    problem = "its vision GELUs are not HF's (tanh's approximation in the encoder, exact in the projector)"
  elif encoder.rotary_pos_emb.head_dim * encoder.num_heads != encoder.dim:
    problem = "its vision RoPE does not span each head's whole width (HF's does)"
  elif projector.vt_hidden_size != encoder.dim or encoder.text_hidden_size != config.dim:
    problem = "its vision projector's sizes are not the encoder's and the text model's"
  _refuse_hf(problem, "Kimi", "Kimi-K2.5")
  vision = transformers.Kimi_K25VisionConfig(
    patch_size=encoder.patch_size, pos_emb_height=encoder.init_pos_emb_height, pos_emb_width=encoder.init_pos_emb_width,
    num_attention_heads=encoder.num_heads, num_hidden_layers=encoder.num_layers, hidden_size=encoder.dim,
    intermediate_size=block.mlp.fc1.out_features, hidden_act="gelu_pytorch_tanh", merge_kernel_size=list(encoder.merge_kernel_size),
    rope_parameters=dict(rope_type="axial", rope_theta=float(encoder.rotary_pos_emb.theta)),
  )
  text.architectures = None
  hf = transformers.Kimi_K25Config(
    text_config=text, vision_config=vision, projection_hidden_size=encoder.dim, projection_layer_norm_eps=projector.pre_norm.eps,
    image_token_id=config.vocab_size, video_token_id=config.vocab_size, tie_word_embeddings=text.tie_word_embeddings,
    architectures=["Kimi_K25ForConditionalGeneration"],
  )
  return hf, check


# torchtitan family → (its config → (the transformers config, a check of the values or None)).
_HF_CONFIGS = {"qwen3": _qwen3_hf_config, "qwen3_5": _qwen3_5_hf_config, "muse_glimmer": _muse_glimmer_hf_config,
               "deepseek_v3": _deepseek_hf_config, "kimi_k2_7": _kimi_hf_config}


# Models whose forward checks that it got its masks by key (weakly held: a model can go).
_checked_masks: weakref.WeakSet = weakref.WeakSet()


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


def _uses_masked_attention(module: torch.nn.Module) -> bool:
  """FlexAttention or VarlenAttention: the backends that take `attention_masks`."""
  from torchtitan.models.common.attention import FlexAttention, VarlenAttention

  return _uses(module, FlexAttention) or _uses(module, VarlenAttention)


# ---- as HF's Llama (export) ---------------------------------------------------------------

# torchtitan state_dict name → HF LlamaForCausalLM name; True: q/k rows to permute for HF's RoPE.
_TO_HF = (
  (r"tok_embeddings\.weight", r"model.embed_tokens.weight", False),
  (r"layers\.(\d+)\.attention\.qkv_linear\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight", True),
  (r"layers\.(\d+)\.attention\.qkv_linear\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight", True),
  (r"layers\.(\d+)\.attention\.qkv_linear\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight", False),
  (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight", False),
  (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight", False),
  (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight", False),
  (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight", False),
  (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight", False),
  (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight", False),
  (r"norm\.weight", r"model.norm.weight", False),
  (r"lm_head\.weight", r"lm_head.weight", False),
)


def hf_llama(module: torch.nn.Module):
  """(HF's `LlamaConfig` computing what torchtitan's Llama 3 `module` computes, and
  `name → (HF name, heads whose q/k rows to permute or None)` for its state_dict).

  Only the dense Llama 3 layout converts (no MoE, qk-norm, biases or YaRN);
  anything else is refused in one sentence rather than written wrong.
  """
  import re

  import transformers
  from torchtitan.models.common.rope import ComplexRoPE

  config = module.config
  first = config.layers[0]
  attn, ff, rope = first.attention, first.feed_forward, first.attention.rope
  problem = None
  if any(_layer_shape(layer) != _layer_shape(first) for layer in config.layers):
    problem = "its layers differ in shape"
  elif first.moe is not None or ff is None:
    problem = "it has MoE layers"
  elif attn.qk_norm is not None:
    problem = "it normalises q and k"
  elif any(getattr(linear, "bias", False) for linear in (*_linears(attn.qkv_linear), attn.wo, ff.w1, ff.w2, ff.w3, config.lm_head)):
    problem = "its linear layers have biases"
  elif not isinstance(rope, ComplexRoPE.Config) or (rope.scaling == "yarn" and rope.rope_factor > 1.0):
    problem = f"its RoPE is {type(rope).__qualname__} with scaling '{rope.scaling}'"
  _refuse_hf(problem, "model", "Llama")
  n_heads, n_kv = attn.qkv_linear.n_heads, attn.qkv_linear.n_kv_heads
  if rope.scaling == "llama":
    original = rope.original_max_position_embeddings
    rope_parameters = dict(
      rope_type="llama3", rope_theta=float(rope.theta), factor=float(rope.scaling_factor),
      low_freq_factor=float(rope.low_freq_factor), high_freq_factor=float(rope.high_freq_factor),
      original_max_position_embeddings=original,
    )
    max_positions = int(original * rope.scaling_factor)
  else:
    rope_parameters, max_positions = dict(rope_type="default", rope_theta=float(rope.theta)), rope.max_seq_len
  hf_config = transformers.LlamaConfig(
    vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=ff.w1.out_features,
    num_hidden_layers=len(config.layers), num_attention_heads=n_heads, num_key_value_heads=n_kv,
    head_dim=attn.qkv_linear.head_dim, rms_norm_eps=config.norm.eps, max_position_embeddings=max_positions,
    rope_parameters=rope_parameters, tie_word_embeddings=bool(config.enable_weight_tying),
    attention_bias=False, mlp_bias=False, architectures=["LlamaForCausalLM"],
  )
  rules = [(re.compile(pattern), hf, permute) for pattern, hf, permute in _TO_HF]

  def to_hf(name: str):
    for pattern, hf, permute in rules:
      if pattern.fullmatch(name):
        heads = (n_heads if ".wq." in name else n_kv) if permute else None
        return pattern.sub(hf, name), heads
    raise TorchOnTpuError(f"torchtitan's '{name}' has no HF Llama counterpart; export_safetensors writes its own names.")

  return hf_config, to_hf


def _linears(qkv) -> list:
  return [getattr(qkv, name) for name in ("wqkv", "wq", "wk", "wv") if hasattr(qkv, name)]


def _layer_shape(layer) -> tuple:
  attn, rope = layer.attention, layer.attention.rope
  q = attn.qkv_linear
  ff = layer.feed_forward
  return (q.n_heads, q.n_kv_heads, q.head_dim, ff and ff.w1.out_features, layer.moe is None, dataclasses.replace(rope, max_seq_len=0))


def hf_rotary_rows(w: jax.Array, heads: int) -> jax.Array:
  """wq/wk rows from torchtitan's RoPE order to HF's: torchtitan rotates adjacent pairs
  (x[2i], x[2i+1]) of each head, HF's `rotate_half` rotates (x[i], x[i + d/2]), so each
  head's rows go from pair-interleaved to halves."""
  rows, cols = w.shape
  return jax.jit(lambda w: w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))(w)
