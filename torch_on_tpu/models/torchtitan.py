"""torchtitan's Llama 3: built from torchtitan's own config registry, and its FSDP+TP map.

    model = build_llama3("debugmodel")            # on meta, exactly torchtitan's config
    jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")

torchtitan 0.3.0 uses FlexAttention for language models. `attention="sdpa"`
swaps each layer's inner attention for torchtitan's own
`ScaledDotProductAttention` (plain causal attention, no document masking):
the config change torchtitan itself makes for models that use SDPA.

The default flex config runs as configured: pass `attention_masks(model, positions)`
where torchtitan's trainer passes `model.get_attention_masks(positions)` (torchtitan's
own code choosing its masks, with `FlexMasks` in place of the BlockMasks it builds by a
compiled function, which cannot run beside jax):

    logits = jm(tokens, positions=positions, attention_masks=attention_masks(model, positions))

While ShardedModule's attention kernels are active, FlexAttention runs them with
the mask it was given: causal, documents, sliding windows (muse_glimmer, gpt-oss,
whose layers pick theirs from a dict) and gpt-oss's attention sinks; what they
cannot express is refused in one sentence. `flex_masks(positions)` is the
document-causal mask alone (Llama 3, Qwen 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import weakref

import jax
import torch
from torch.nn.attention.flex_attention import BlockMask

from torch_on_tpu import _compat, extras
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models._maps import present_rules
from torch_on_tpu.models.family import DecoderShape, Family, HFForm

FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")

# torch Linear weights are (out_features, in_features): column-parallel layers
# shard dim 0 over tp, row-parallel ones dim 1; the other dim goes to fsdp.
_FSDP_TP = {
  "tok_embeddings.weight": ("tp", "fsdp"),
  "layers.*.attention.qkv_linear.wqkv.weight": ("tp", "fsdp"),
  "layers.*.attention.qkv_linear.wq.weight": ("tp", "fsdp"),
  "layers.*.attention.qkv_linear.wk.weight": ("tp", "fsdp"),
  "layers.*.attention.qkv_linear.wv.weight": ("tp", "fsdp"),
  "layers.*.attention.wo.weight": ("fsdp", "tp"),
  "layers.*.attention.q_norm.weight": (None,),
  "layers.*.attention.k_norm.weight": (None,),
  "layers.*.feed_forward.w1.weight": ("tp", "fsdp"),
  "layers.*.feed_forward.w3.weight": ("tp", "fsdp"),
  "layers.*.feed_forward.w2.weight": ("fsdp", "tp"),
  "layers.*.attention_norm.weight": (None,),
  "layers.*.ffn_norm.weight": (None,),
  "norm.weight": (None,),
  "lm_head.weight": ("tp", "fsdp"),
}


def is_torchtitan(module: torch.nn.Module) -> bool:
  return type(module).__module__.startswith("torchtitan.")


def fsdp_tp_map(module: torch.nn.Module) -> dict | None:
  if not is_torchtitan(module):
    return None
  return present_rules(module, _FSDP_TP)


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
  starts = (positions == 0).to(torch.int32)
  return FlexMasks(torch.cumsum(starts, dim=1, dtype=torch.int32))


def attention_masks(model: torch.nn.Module, positions: torch.Tensor):
  """What torchtitan's trainer passes as `attention_masks`, `model.get_attention_masks(positions)`,
  with a `FlexMasks` wherever torchtitan builds a flex BlockMask (a single mask, or a
  dict of them keyed by the layers' windows).

  torchtitan's own code runs and chooses the masks; only the block-mask builder (a
  `torch.compile`d function, which cannot run beside jax) is swapped for one that
  reads the mask functions torchtitan combined (causal, sliding window, documents).
  A mask function outside those is refused in one sentence. A model on varlen
  attention gets the documents of `positions` (its layers hold their windows).
  """
  from torchtitan.models.common import attention

  if _uses(model, attention.VarlenAttention):
    return flex_masks(positions)

  original = attention.__dict__["_compiled_create_block_mask"]
  attention._compiled_create_block_mask = _describe_block_mask
  try:
    return model.get_attention_masks(positions)
  finally:
    attention._compiled_create_block_mask = original


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


@contextlib.contextmanager
def varlen_routed_to(attend):
  """While active, torchtitan's VarlenAttention runs `attend` on a `FlexMasks` (documents):
  its own `window_size` (left, right) as causal/window, its bf16 inputs as it casts them,
  an out_transform as `_sinks_of` reads it."""
  from torchtitan.models.common.attention import VarlenAttention

  original = VarlenAttention.__dict__["forward"]

  def routed(self, q, k, v, *, attention_masks, scale=None, out_transform=None, **kwargs):
    if not isinstance(attention_masks, FlexMasks):
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
    layers = getattr(module, "layers", None)
    if layers is None or not len(layers) or not hasattr(module, "tok_embeddings"):
      return None
    first = next(iter(layers.values() if hasattr(layers, "values") else layers))
    attention = first.attention
    return DecoderShape(
      layers=len(layers),
      dim=module.tok_embeddings.embedding_dim,
      ffn_dim=first.feed_forward.w1.out_features,
      heads=attention.n_heads,
      kv_heads=attention.n_kv_heads or attention.n_heads,
      head_dim=attention.head_dim,
      vocab=module.tok_embeddings.num_embeddings,
    )

  def sharding_map(self, module, preset):
    return fsdp_tp_map(module) if preset == "fsdp_tp" else None

  def prepare(self, module):
    if _takes_keyed_masks(module) and module not in _checked_masks:
      _checked_masks.add(module)
      module.register_forward_pre_hook(_require_keyed_masks, with_kwargs=True)

  def model_inputs(self, module, batch):
    ids, positions, segments = batch["input_ids"], batch.get("positions"), batch.get("segment_ids")
    if positions is None:
      return ids
    if segments is not None and _uses_masked_attention(module):
      # What torchtitan's trainer passes, get_attention_masks(positions), with the loader's document ids
      # (the batch's arrays may be traced or span hosts: torchtitan's mask code runs on a stand-in).
      layout = attention_masks(module, torch.zeros(1, 1, dtype=torch.long))
      with_documents = lambda m: FlexMasks(segments, causal=m.causal, window=m.window)  # noqa: E731
      masks = {k: with_documents(m) for k, m in layout.items()} if isinstance(layout, dict) else with_documents(layout)
      return ids, positions, masks
    return ids, positions

  def decode_cache(self, module, max_len):
    return None, "torchtitan's Llama 3 has no KV cache"

  def hf_form(self, module):
    config, to_hf = hf_llama(module)

    def rename(name):
      hf_name, heads = to_hf(name)
      return hf_name, None if heads is None else (lambda w: hf_rotary_rows(w, heads))

    return HFForm(config, rename)

  def attention_routes(self, attend):
    # Any model built from torchtitan's attention modules (not only its top-level classes).
    if "torchtitan.models.common.attention" not in sys.modules:
      return []
    return [flex_routed_to(attend), varlen_routed_to(attend)]


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
  if problem is not None:
    raise TorchOnTpuError(f"This torchtitan model cannot be written as HF Llama: {problem}; export_safetensors writes its own names.")
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
