"""torchtitan's Llama 3: built from torchtitan's own config registry, and its FSDP+TP map.

    model = build_llama3("debugmodel")            # on meta, exactly torchtitan's config
    jm = tot.JittableModule(model, mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")

torchtitan 0.3.0 uses FlexAttention for language models. `attention="sdpa"`
swaps each layer's inner attention for torchtitan's own
`ScaledDotProductAttention` (plain causal attention, no document masking):
the config change torchtitan itself makes for models that use SDPA.

The default flex config runs as configured: pass `flex_masks(positions)` where
torchtitan's trainer passes `model.get_attention_masks(positions)` (a BlockMask
built by a compiled function, which cannot run under jax):

    logits = jm(tokens, positions=positions, attention_masks=flex_masks(positions))

While JittableModule's attention kernels are active, FlexAttention's compiled
call is routed to them (document-causal from the positions, or plain causal
for `flex_masks()`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import jax
import torch
from torch.nn.attention.flex_attention import BlockMask

from torch_on_tpu import _compat, extras
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models._maps import present_rules
from torch_on_tpu.models.family import DecoderShape, Family

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
  """Stands in for torchtitan's BlockMask: causal attention, within documents when
  `segment_ids` (B, L) are given (equal ids = same document).

  A BlockMask subclass so FlexAttention's type check passes; it carries only the
  document ids, a leaf of both torch and jax pytrees, so it travels through
  `JittableModule` calls and train steps into `jax.jit` like any input.
  """

  def __init__(self, segment_ids: torch.Tensor | None = None):  # BlockMask.__init__ not called: no block state
    self.segment_ids = segment_ids

  def __repr__(self) -> str:
    if self.segment_ids is None:
      return "FlexMasks(causal)"
    return f"FlexMasks(document-causal, segment_ids {tuple(self.segment_ids.shape)})"


_compat.torch_pytree.register_pytree_node(
  FlexMasks,
  lambda m: ([m.segment_ids], None),
  lambda children, _: FlexMasks(children[0]),
  serialized_type_name="torch_on_tpu.models.torchtitan.FlexMasks",
)
jax.tree_util.register_pytree_node(
  FlexMasks, lambda m: ([m.segment_ids], None), lambda _, children: FlexMasks(children[0])
)


def flex_masks(positions: torch.Tensor | None = None) -> FlexMasks:
  """The `attention_masks` argument for a flex-attention torchtitan model.

  Like torchtitan's `get_attention_masks(positions)`: causal within documents,
  a document starting wherever `positions` (B, L) is 0 (each row must start a
  document, as torchtitan's loader guarantees). No positions: plain causal.
  """
  if positions is None:
    return FlexMasks()
  starts = (positions == 0).to(torch.int32)
  return FlexMasks(torch.cumsum(starts, dim=1, dtype=torch.int32))


@contextlib.contextmanager
def flex_routed_to(attend):
  """While active, torchtitan's FlexAttention calls `attend(q, k, v, segment_ids=,
  scale=, enable_gqa=)` instead of its `torch.compile`d flex_attention."""
  from torchtitan.models.common.attention import FlexAttention

  original = FlexAttention.__dict__["_compiled_flex_attn"]

  def routed(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
             return_aux=None, kernel_options=None):
    if score_mod is not None:
      raise TorchOnTpuError(
        "torchtitan FlexAttention got a score_mod, which the bridge's attention kernels do "
        "not express; use a model config without score_mod or attention=None."
      )
    if not isinstance(block_mask, FlexMasks):
      raise TorchOnTpuError(
        f"torchtitan FlexAttention got attention_masks of type {type(block_mask).__name__}; "
        f"pass attention_masks=torch_on_tpu.models.torchtitan.flex_masks(positions) instead."
      )
    if return_aux is not None and (return_aux.lse or return_aux.max_scores):
      raise TorchOnTpuError(
        "torchtitan FlexAttention asked for the log-sum-exp (an out_transform), which the "
        "bridge's attention kernels do not return; use a config without out_transform."
      )
    out = attend(q, k, v, segment_ids=block_mask.segment_ids, scale=scale, enable_gqa=enable_gqa)
    return out, None

  FlexAttention._compiled_flex_attn = routed
  try:
    yield
  finally:
    FlexAttention._compiled_flex_attn = original


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

  def model_inputs(self, module, batch):
    ids, positions, segments = batch["input_ids"], batch.get("positions"), batch.get("segment_ids")
    if positions is None:
      return ids
    if segments is not None and _uses_flex_attention(module):
      # Document-causal, where torchtitan's trainer passes get_attention_masks(positions).
      return ids, positions, FlexMasks(segments)
    return ids, positions

  def decode_cache(self, module, max_len):
    return None, "torchtitan's Llama 3 has no KV cache"

  def attention_routes(self, attend):
    # Any model built from torchtitan's attention modules (not only its top-level classes).
    if "torchtitan.models.common.attention" not in sys.modules:
      return []
    return [flex_routed_to(attend)]


def _uses_flex_attention(module: torch.nn.Module) -> bool:
  from torchtitan.models.common.attention import FlexAttention

  return any(isinstance(m, FlexAttention) for m in module.modules())
