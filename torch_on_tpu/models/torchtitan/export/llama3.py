"""torchtitan's Llama 3 as HF's Llama: our table of names, q/k rows permuted for HF's RoPE."""

from __future__ import annotations

import dataclasses

import jax
import torch

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.family import HFForm
from torch_on_tpu.models.torchtitan.export.adapter import refuse_hf

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
  refuse_hf(problem, "model", "Llama")
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


def hf_form(module: torch.nn.Module) -> HFForm:
  """Llama 3 as HF Llama, its q/k rows permuted for HF's RoPE."""
  config, to_hf = hf_llama(module)

  def rename(name):
    hf_name, heads = to_hf(name)
    return hf_name, None if heads is None else (lambda w: hf_rotary_rows(w, heads))

  return HFForm(config, rename)
