"""torchtitan's Qwen3 as HF's Qwen3 (dense) or Qwen3-MoE, through torchtitan's adapter."""

from __future__ import annotations

from torch_on_tpu.models.torchtitan.export.adapter import hf_via_adapter, no_expert_bias, refuse_hf


def _qwen3_hf_config(config):
  """HF's Qwen3 (dense) or Qwen3-MoE config for torchtitan's Qwen3; refuses what HF cannot express."""
  import transformers

  first = config.layers[0]
  attention, rope = first.attention, first.attention.rope  # heads on the attention: its q/k/v fused or not
  moes = [layer.moe for layer in config.layers if layer.moe is not None]
  problem = None
  if rope.scaling != "none":
    problem = f"its RoPE scaling is '{rope.scaling}'"
  elif moes and len(moes) != len(config.layers):
    problem = "it mixes dense and MoE layers"
  elif moes and (moes[0].shared_experts is not None or moes[0].router.score_func != "softmax" or moes[0].router.route_scale != 1.0):
    problem = "its MoE router or shared experts differ from HF Qwen3-MoE's"
  refuse_hf(problem, "Qwen3", "Qwen3")
  common = dict(
    vocab_size=config.vocab_size, hidden_size=config.dim, num_hidden_layers=len(config.layers),
    num_attention_heads=attention.n_heads, num_key_value_heads=attention.n_kv_heads, head_dim=attention.head_dim,
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
  return hf, no_expert_bias(len(config.layers)) if moe.load_balance_coeff is not None else None


def hf_form(module):
  return hf_via_adapter(module, _qwen3_hf_config)
