"""torchtitan's Llama 3: built from torchtitan's own config registry, and its FSDP+TP map.

    model = build_llama3("debugmodel")            # on meta, exactly torchtitan's config
    jm = tot.JittableModule(model, mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")

torchtitan 0.3.0 uses FlexAttention for language models. `attention="sdpa"`
swaps each layer's inner attention for torchtitan's own
`ScaledDotProductAttention` (plain causal attention, no document masking):
the config change torchtitan itself makes for models that use SDPA.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models._maps import present_rules

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
