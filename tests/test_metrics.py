"""FLOPs per token (both conventions), the peak FLOP/s table, the cached CPU peak, MFU."""

import types

import pytest
import torch
import transformers

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.hf import build_causal_lm
from torch_on_tpu.models.torchtitan import build_llama3, llama3_config
from torch_on_tpu.training import metrics


def test_llama3_flops_match_torchtitans_own_count():
  from torchtitan.models.utils import get_dense_model_nparams_and_flops

  model = build_llama3("debugmodel", attention="sdpa", max_seq_len=512)
  ours = metrics.flops_per_token(model, seqlen=512)
  n_params, theirs = get_dense_model_nparams_and_flops(model, 6, 16, 2 * 16, 512)
  assert ours.torchtitan == theirs and ours.n_params == n_params
  assert ours.torchtitan - ours.causal == 6 * 6 * 16 * 16 * 512
  assert ours.n_matmul_params == n_params - 2048 * 256  # the input embedding does no matmul
  assert metrics.flops_per_token_from_config(llama3_config("debugmodel", attention="sdpa"), 512) == ours


@pytest.mark.parametrize("tied", [False, True])
def test_hf_flops_count_a_tied_embedding_as_the_output_projection(tied):
  config = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=tied,
  )
  model = build_causal_lm(config)
  n = sum(p.numel() for p in model.parameters())
  got = metrics.flops_per_token(model, seqlen=128)
  attention = 12 * 2 * 4 * 16 * 128
  assert got.n_matmul_params == (n if tied else n - 256 * 64)
  assert got.torchtitan == 6 * got.n_matmul_params + attention
  assert got.causal == 6 * got.n_matmul_params + attention / 2
  assert metrics.flops_per_token_from_config(config, 128) == got


def test_flops_of_an_unknown_model_ask_for_explicit_numbers():
  with pytest.raises(TorchOnTpuError, match="dense_flops_per_token"):
    metrics.flops_per_token(torch.nn.Linear(3, 3), seqlen=8)


@pytest.mark.parametrize(
  "kind, peak",
  [
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5", 459e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU7x", 1153.5e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("Some New Chip", None),
  ],
)
def test_peak_table_by_device_kind(kind, peak):
  device = types.SimpleNamespace(platform="gpu" if "NVIDIA" in kind else "tpu", device_kind=kind)
  assert metrics.peak_flops_per_device(device) == peak
  assert metrics.peak_flops_for_kind(kind) == peak  # also torch's names: torch.cuda.get_device_name()


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  first = metrics.cpu_matmul_peak(size=256, repeats=2)
  assert first > 1e8  # any real CPU does more than 0.1 GFLOP/s
  assert (tmp_path / "torch_on_tpu" / "cpu_matmul_peak.json").exists()

  def must_not_measure(**kwargs):
    raise AssertionError("measured again")

  monkeypatch.setattr(metrics, "measure_matmul_flops", must_not_measure)
  assert metrics.cpu_matmul_peak(size=256, repeats=2) == first
  # A peak measured under load is low: a refresh keeps the best measurement.
  monkeypatch.setattr(metrics, "measure_matmul_flops", lambda **kwargs: 7.0)
  assert metrics.cpu_matmul_peak(size=256, refresh=True) == first
  monkeypatch.setattr(metrics, "measure_matmul_flops", lambda **kwargs: 10 * first)
  assert metrics.cpu_matmul_peak(size=256, refresh=True) == 10 * first
  assert metrics.cpu_matmul_peak(size=256) == 10 * first
  monkeypatch.setattr(metrics, "cpu_matmul_peak", lambda refresh=False: 8e9)
  # The 8 simulated devices share the host's cores: each gets an eighth.
  assert metrics.peak_flops_per_device() == 1e9
  assert metrics.peak_flops() == 8e9


def test_mfu_is_achieved_over_peak():
  assert metrics.mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
  assert metrics.mfu(1000.0, 6e9, None) is None
