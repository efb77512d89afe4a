"""torchtitan's gpt-oss as HF's GptOss, by our own table of names."""

from __future__ import annotations

import re

import jax.numpy as jnp
import torch

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.family import HFForm
from torch_on_tpu.models.torchtitan.export.adapter import as_built, no_expert_bias, refuse_hf

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
  refuse_hf(problem, "gpt-oss", "GptOss")
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
  buffers = {name for name, _ in as_built(module).named_buffers()}

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

  check = no_expert_bias(len(config.layers), "GptOss") if moes[0].load_balance_coeff is not None else None
  return HFForm(hf, rename, check)


hf_form = hf_gpt_oss
