"""transformers calls a CUDA package's kernel (flash-linear-attention, causal-conv1d, mamba-ssm)
instead of its own torch code wherever the package is installed, and flash-linear-attention is
(torchtitan's Qwen3.5 needs it). Under the bridge those models run transformers' torch code:
HF Qwen3-Next matches eager torch running that same code, and a packed-sequence call, which
the torch code cannot keep apart, is refused."""

import copy
import sys

import pytest
import torch
import transformers

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.models import hf

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False)


def qwen3_next():
  config = transformers.Qwen3NextConfig(
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"], **SMALL,
  )
  config._attn_implementation = "sdpa"
  return hf.build_causal_lm(config, device="cpu").eval()


def test_qwen3_next_linear_attention_runs_transformers_torch_code_and_matches_eager():
  ref = qwen3_next()
  modeling = sys.modules[type(ref).__module__]
  assert hf._calls_kernel_package(modeling.torch_chunk_gated_delta_rule)  # fla is installed: transformers would call it
  tokens, labels = h.random_batch(256, batch=8, seq=16)
  with hf.torch_reference_kernels(ref):  # eager torch on the same torch code (fla's kernels need CUDA)
    ref_logits, ref_loss, ref_grads = h.torch_loss_and_grads(ref, tokens, labels, {"use_cache": False})
  assert hf._calls_kernel_package(modeling.torch_chunk_gated_delta_rule)  # put back after the context

  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), scan=True)
  assert h.rel(tot.to_cpu(jm(tokens).logits), ref_logits) < 1e-5
  loss, grads = h.jax_loss_and_grads(jm, tokens, labels, {"use_cache": False})
  assert h.rel(loss, ref_loss) < 1e-6
  grads = h.per_layer(jm, grads)
  worst = max((h.rel(grads[n], g), n) for n, g in ref_grads.items())
  assert worst[0] < 1e-4, worst  # fp32, ‖Δ‖/‖ref‖


def test_a_packed_sequence_call_to_a_kernel_package_function_is_refused():
  model = qwen3_next()
  modeling = sys.modules[type(model).__module__]
  q = torch.randn(1, 8, 2, 16)
  with hf.torch_reference_kernels(model), pytest.raises(tot.TorchOnTpuError, match="packed sequences"):
    modeling.torch_chunk_gated_delta_rule(q, q, q, g=-torch.rand(1, 8, 2), beta=torch.rand(1, 8, 2),
                                          cu_seqlens=torch.tensor([0, 3, 8]))
