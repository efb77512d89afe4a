"""HF transformers causal LMs: building from a local config, and the FSDP+TP map
for the Llama family's parameter names (Llama, Mistral, Qwen2/3, Gemma, Phi-3...)."""

from __future__ import annotations

import torch

from torch_on_tpu.models._maps import present_rules

_FSDP_TP = {
  "**.embed_tokens.weight": ("tp", "fsdp"),
  "**.q_proj.weight": ("tp", "fsdp"),
  "**.k_proj.weight": ("tp", "fsdp"),
  "**.v_proj.weight": ("tp", "fsdp"),
  "**.qkv_proj.weight": ("tp", "fsdp"),
  "**.q_proj.bias": ("tp",),
  "**.k_proj.bias": ("tp",),
  "**.v_proj.bias": ("tp",),
  "**.o_proj.weight": ("fsdp", "tp"),
  "**.o_proj.bias": (None,),
  "**.gate_proj.weight": ("tp", "fsdp"),
  "**.up_proj.weight": ("tp", "fsdp"),
  "**.gate_up_proj.weight": ("tp", "fsdp"),
  "**.down_proj.weight": ("fsdp", "tp"),
  "**.down_proj.bias": (None,),
  "**norm.weight": (None,),
  "**norm.bias": (None,),
  "lm_head.weight": ("tp", "fsdp"),
}


# A scanned (or layer-remat) stack runs the layers as one step and cannot carry a
# KV cache; HF models default to building one, so they run without it unless the
# caller passes `use_cache=True` (which the scan then refuses with a clear error).
CALL_DEFAULTS_WITH_LAYER_STACK = {"use_cache": False}


def is_hf(module: torch.nn.Module) -> bool:
  try:
    from transformers import PreTrainedModel
  except ImportError:
    return False
  return isinstance(module, PreTrainedModel)


def fsdp_tp_map(module: torch.nn.Module) -> dict | None:
  """The Llama-family map, or None for an HF model without those projection names."""
  if not is_hf(module):
    return None
  rules = present_rules(module, _FSDP_TP)
  if not any("tp" in spec for spec in rules.values()):
    return None
  return rules


def build_causal_lm(config, *, device="meta") -> torch.nn.Module:
  """`AutoModelForCausalLM.from_config` on `device` (meta: nothing allocated)."""
  from transformers import AutoModelForCausalLM

  with torch.device(device):
    return AutoModelForCausalLM.from_config(config)
