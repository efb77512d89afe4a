"""torchtitan's Qwen3.5 as HF's Qwen3.5 (dense) or Qwen3.5-MoE with its vision encoder, through
torchtitan's adapter with the experts written per expert."""

from __future__ import annotations

import re

from torch_on_tpu.models.torchtitan.export.adapter import hf_via_adapter, no_expert_bias, refuse_hf


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
  refuse_hf(problem, "Qwen3.5", "Qwen3.5")
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
  return hf, no_expert_bias(len(config.layers), "Qwen3.5-MoE") if moes and moes[0].load_balance_coeff is not None else None


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


def hf_form(module):
  return hf_via_adapter(module, _qwen3_5_hf_config, fix=_Qwen3_5ExpertsPerExpert)
