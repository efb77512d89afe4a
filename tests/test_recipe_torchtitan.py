"""`python -m recipes.torchtitan --model=<family>:<flavor>`: any torchtitan registry entry through
the same recipe (flags, data, checkpoints, plan, MFU, export) as Llama 3; 2-step smoke runs."""

import gc
import json
from pathlib import Path

import jax
import pytest
import safetensors.torch
import torch
import transformers

import torch_on_tpu as tot
from recipes import torchtitan as titan_recipe
from tests import helpers as h

TINY = dict(seqlen=32, global_batch_size=8, lr=1e-2, warmup_steps=1, steps=2, eval_every=0, save_every=2)


@pytest.fixture(autouse=True)
def _a_whole_recipe_each():
  """Each test runs whole recipes: nothing compiled before it is reused, and Qwen3.5's step alone
  peaks near 10 GB on CPU, so the worker's earlier programs and arrays go first (two workers share
  24 GiB; one was killed for memory with them kept)."""
  gc.collect()
  jax.clear_caches()
  yield
  gc.collect()
  jax.clear_caches()


def flags(tmp_path, model, **kw):
  return titan_recipe.TorchtitanFlags(model=model, log_dir=str(tmp_path / model.replace(":", "-")), **{**TINY, **kw})


def test_qwen3_trains_saves_reports_mfu_and_exports_what_transformers_loads(tmp_path, capsys):
  summary = titan_recipe.run(flags(tmp_path, "qwen3:debugmodel"))
  assert summary["steps"] == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in summary["records"] if "loss" in r)
  assert any("mfu" in r for r in summary["records"])  # FLOPs per token read from the family's shape
  convert = h.load_module("tools/convert.py")
  out = tmp_path / "hf"
  capsys.readouterr()
  assert convert.main(["to_hf", summary["ckpt_dir"], str(out), "--model", "qwen3:debugmodel"]) == 0
  said = capsys.readouterr().out  # said, not left to fail later, with the run's own tokenizer to add
  assert f"no tokenizer written: AutoTokenizer.from_pretrained('{out}') needs one; the run's own is {summary['tokenizer_dir']}" in said
  assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  assert model.config.num_hidden_layers == 8
  # and back: a run starting from that HF checkpoint (--weights, read by torchtitan's own
  # Qwen3StateDictAdapter.from_hf) holds the trained weights exactly (lr=0: the step moves nothing)
  again = titan_recipe.run(flags(tmp_path / "again", "qwen3:debugmodel", weights=str(out), lr=0.0, steps=1, save_every=1))
  trained, started = summary["train_step"].model.state_dict(), again["train_step"].model.state_dict()
  assert sorted(started) == sorted(trained)
  assert all(torch.equal(started[k], trained[k]) for k in trained), [k for k in trained if not torch.equal(started[k], trained[k])][:3]


def test_an_moe_family_trains_two_steps_expert_parallel_with_multi_token_prediction(tmp_path):
  """DeepSeek-V3 with an MTP layer (`--mtp_layers=1`), its experts over ep=8: trained with
  torchtitan's MTPLoss (the recipe's loss, checked against torchtitan's own on a packed batch),
  MFU counting the MTP layer."""
  from torchtitan.models.deepseek_v3.mtp import MTPLoss

  run_flags = flags(tmp_path, "deepseek_v3:debugmodel", ep=8, mtp_layers=1, mtp_scale=0.5)
  summary = titan_recipe.run(run_flags)
  assert summary["steps"] == 2
  losses = [r["loss"] for r in summary["records"] if "loss" in r]
  assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
  assert any("mfu" in r for r in summary["records"])
  recipe = titan_recipe.recipe(run_flags)
  tokens, labels, positions = h.titan_parity().packed_batch(batch=2, seq=16)
  outputs = [torch.randn(2, 16, 256), torch.randn(2, 16, 256)]
  batch = {"input_ids": tokens, "labels": labels, "positions": positions}
  want, _ = MTPLoss(MTPLoss.Config(mtp_scale=0.5))(outputs, labels, labels.numel(), positions=positions)
  assert torch.allclose(recipe.loss(outputs, recipe.labels(batch)), want)
  # The export carries the expert bias load balancing trained (torchtitan initialises it to
  # zero and balances only `layers`, not the MTP layer).
  convert = h.load_module("tools/convert.py")
  out = tmp_path / "safetensors"
  assert convert.main(["to_safetensors", summary["ckpt_dir"], str(out), "--model", "deepseek_v3:debugmodel"]) == 0
  exported = {}
  for file in out.glob("*.safetensors"):
    exported.update(safetensors.torch.load_file(file))
  trained = [v for k, v in exported.items() if k.endswith("expert_bias_E") and k.startswith("layers.")]
  untouched = [v for k, v in exported.items() if k.endswith("expert_bias_E") and not k.startswith("layers.")]
  assert trained and untouched, sorted(exported)
  assert all(torch.isfinite(b).all() and b.abs().sum() > 0 for b in trained)
  assert all((b == 0).all() for b in untouched)


def test_multi_token_prediction_is_refused_where_torchtitan_has_none(tmp_path):
  with pytest.raises(tot.TorchOnTpuError, match="--mtp_layers: torchtitan's kimi_k2_7 has no multi-token prediction.*--mtp_layers=0"):
    titan_recipe.run(flags(tmp_path, "kimi_k2_7:debugmodel", mtp_layers=1))
  with pytest.raises(tot.TorchOnTpuError, match="--mtp_layers: multi-token prediction with --pp=2 --cp=1: torchtitan runs it with neither"):
    titan_recipe.run(flags(tmp_path, "deepseek_v3:debugmodel", mtp_layers=1, pp=2))


@pytest.mark.parametrize("model", ["kimi_k2_7:debugmodel", "qwen3_5:debugmodel", "muse_glimmer:debugmodel"])
def test_every_other_language_family_trains_two_steps_in_bf16(model, tmp_path):
  """Each family's whole debug flavor, in the precision users train in (bf16 compute, fp32 master
  weights and AdamW state): test_bf16_training's bf16 check for these families, and gpt-oss's
  below (qwen3's MoE flavor: there and in the deepseek_v3 test above)."""
  summary = titan_recipe.run(flags(tmp_path, model, dtype="bfloat16"))
  losses = [r["loss"] for r in summary["records"] if "loss" in r]
  assert summary["steps"] == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), model
  steps = [r for r in summary["records"] if "grad_norm" in r]
  assert len(steps) == 2 and all(0 < r["grad_norm"] < float("inf") and r["learning_rate"] > 0 and not r.get("skipped") for r in steps), steps


def test_gpt_oss_trains_in_torchtitans_precision_and_its_fp32_forward_is_refused_as_torch_refuses_it(tmp_path, capsys):
  """gpt-oss's experts return bf16 into an fp32 scatter-add: torch raises there, so torchtitan
  trains it with bf16 compute (`--dtype=bfloat16`); in fp32 the bridge says so in one sentence
  instead of casting silently. Trained, its expert bias is nonzero, which HF's GptOss cannot hold:
  the run prints why and the export command that works (its state_dict), not one that fails."""
  summary = titan_recipe.run(flags(tmp_path, "gpt_oss:debugmodel", dtype="bfloat16"))
  losses = [r["loss"] for r in summary["records"] if "loss" in r]
  assert summary["steps"] == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
  printed = capsys.readouterr().out.splitlines()
  assert "expert_bias_E is nonzero" in summary["export_refusal"] and "GptOss" in summary["export_refusal"]
  assert f"No export for transformers: {summary['export_refusal']}" in printed
  (command,) = [x for x in printed if x.startswith("Export its state_dict")]
  assert command.split(": ", 1)[1].startswith(".venv/bin/python tools/convert.py to_safetensors ")
  convert = h.load_module("tools/convert.py")
  assert convert.main(command.split(": ", 1)[1].split()[2:]) == 0  # the printed command, pasted
  assert list((Path(summary["log_dir"]) / "export").glob("*.safetensors"))
  with pytest.raises(tot.TorchOnTpuError, match="scatter_add: self is torch.float32 but src is torch.bfloat16.*--dtype"):
    titan_recipe.run(flags(tmp_path / "fp32", "gpt_oss:debugmodel"))


def test_unknown_families_and_flavors_are_one_sentence(tmp_path):
  with pytest.raises(tot.TorchOnTpuError, match="not <family>:<flavor>"):
    titan_recipe.run(flags(tmp_path, "gpt9:xl"))
  with pytest.raises(tot.TorchOnTpuError, match="no flavor 'huge'.*debugmodel_moe"):
    titan_recipe.run(flags(tmp_path, "qwen3:huge"))
  with pytest.raises(tot.TorchOnTpuError, match="exceeds qwen3:debugmodel's maximum of 4096"):
    titan_recipe.run(flags(tmp_path, "qwen3:debugmodel", seqlen=8192))
