"""transformers calls a CUDA package's kernel (flash-linear-attention, causal-conv1d, mamba-ssm)
instead of its own torch code wherever the package is installed (a GPU user's machine), and
logs that the slow torch path runs where none is. Under the bridge those models run
transformers' torch code either way: HF Qwen3-Next matches eager torch running that same code,
and a packed-sequence call, which the torch code cannot keep apart, is refused."""

import copy
import importlib
import logging
import sys
import types

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
  torch.manual_seed(0)  # the same weights whatever ran before: a routing near-tie would move the MoE's gradients
  return hf.build_causal_lm(config, device="cpu").eval()


FLA_ON_CPU = "0 active drivers ([]). There should only be one."  # what fla's Triton says on a CPU tensor


@pytest.fixture
def fla_installed(monkeypatch):
  """Qwen3-Next's modeling as transformers binds it where flash-linear-attention is installed:
  its gated delta rules call the package's kernels (stand-ins failing as fla's Triton fails)."""
  from transformers.integrations import hub_kernels

  def kernel(*args, **kwargs):
    raise RuntimeError(FLA_ON_CPU)

  fla = types.ModuleType("fla")
  fla.chunk_gated_delta_rule = fla.fused_recurrent_gated_delta_rule = kernel
  monkeypatch.setitem(sys.modules, "fla", fla)
  modeling = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
  for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
    attr = "torch_" + name.replace("fused_", "")
    bound = hub_kernels.use_kernel_func_from_hub_with_fallback(name, "fla")(getattr(modeling, attr).__wrapped__)
    monkeypatch.setattr(modeling, attr, bound)
  return modeling


def test_qwen3_next_linear_attention_runs_transformers_torch_code_and_matches_eager(fla_installed):
  ref = qwen3_next()
  q = torch.randn(1, 8, 2, 16)
  with pytest.raises(RuntimeError, match="active drivers"):  # eager torch calls the package's kernel
    fla_installed.torch_chunk_gated_delta_rule(q, q, q, g=-torch.rand(1, 8, 2), beta=torch.rand(1, 8, 2))
  tokens, labels = h.random_batch(256, batch=8, seq=16)
  with hf.torch_reference_kernels(ref):  # eager torch on the same torch code (fla's kernels need CUDA)
    ref_logits, ref_loss, ref_grads = h.torch_loss_and_grads(ref, tokens, labels, {"use_cache": False})
  with pytest.raises(RuntimeError, match="active drivers"):  # the package's kernel is put back after it
    fla_installed.torch_chunk_gated_delta_rule(q, q, q, g=-torch.rand(1, 8, 2), beta=torch.rand(1, 8, 2))

  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), scan=True)
  assert h.rel(tot.to_cpu(jm(tokens).logits), ref_logits) < 1e-5
  loss, grads = h.jax_loss_and_grads(jm, tokens, labels, {"use_cache": False})
  assert h.rel(loss, ref_loss) < 1e-6
  grads = h.per_layer(jm, grads)
  worst = max((h.rel(grads[n], g), n) for n, g in ref_grads.items())
  assert worst[0] < 1e-4, worst  # fp32, ‖Δ‖/‖ref‖


@pytest.mark.parametrize("installed", [True, False], ids=["fla_installed", "torch_code"])
def test_a_packed_sequence_call_to_a_kernel_package_function_is_refused(installed, request):
  modeling = request.getfixturevalue("fla_installed") if installed else sys.modules[type(qwen3_next()).__module__]
  model = qwen3_next()
  q = torch.randn(1, 8, 2, 16)
  with hf.torch_reference_kernels(model), pytest.raises(tot.TorchOnTpuError, match="packed sequences"):
    modeling.torch_chunk_gated_delta_rule(q, q, q, g=-torch.rand(1, 8, 2), beta=torch.rand(1, 8, 2),
                                          cu_seqlens=torch.tensor([0, 3, 8]))


def test_no_fallback_message_while_the_bridge_traces(capfd):
  """Where no kernel package is installed, transformers' wrapper logs that its slow torch path
  runs and to install the package: advice for a CUDA user, not for the bridge's trace."""
  model = qwen3_next()
  modeling = sys.modules[type(model).__module__]
  assert hf._kernel_or_torch(modeling.torch_chunk_gated_delta_rule)  # transformers' wrapper, its torch code inside
  logging.Logger.warning_once.cache_clear()  # transformers says each message once per process
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  jm(torch.randint(0, 256, (8, 8)), use_cache=False)
  out, err = capfd.readouterr()
  assert "falling back" not in out + err and "flash-linear-attention" not in out + err, out + err
