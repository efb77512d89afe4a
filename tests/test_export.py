"""`export.export`: train a few steps, export, load in transformers / peft, same logits
(fp32 on CPU, ‖Δ‖/‖ref‖ ≤ 1e-5); the tokenizer beside the weights; bad input in one sentence
with nothing written. (A failure mid-write leaving nothing: test_checkpoint.py's
test_export_is_atomic, the same writer.)"""

import numpy as np
import optax
import pytest
import tokenizers
import torch
import transformers

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import data, export
from torch_on_tpu.training import lora

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

TOL = 1e-5


def ce(out, labels):
  return torch.nn.functional.cross_entropy(h.logits_of(out).flatten(0, 1), labels.flatten())


def trained(jm, steps=3, trainable=None, **kwargs):
  """`jm` after a few optimizer steps (so no weight is at its init)."""
  step = tot.make_train_step(jm, ce, optax.adamw(1e-2), trainable=trainable)
  for seed in range(steps):
    tokens, labels = h.random_batch(h.vocab_of(jm.module), seed=seed)
    step(({"input_ids": tokens.numpy(), **kwargs} if kwargs else tokens.numpy()), labels.numpy())
  return jm


def ours(jm, tokens, **kwargs):
  return np.asarray(h.logits_of(jm(tokens, **kwargs)).jax())


def loaded(directory, tokens):
  model = transformers.AutoModelForCausalLM.from_pretrained(directory)
  model.eval()
  return model(tokens).logits.detach().numpy()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
  backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=300, special_tokens=[data.EOS_TOKEN], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
  )
  backend.train_from_iterator(["def export(jm, directory):\n  return directory\n"] * 50, trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  backend.save(str(path))
  return path


@pytest.fixture(scope="module")
def hf_pair():
  """A tiny HF Llama trained a few steps, and a LoRA model on it whose adapters trained."""
  base = trained(tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", seed=1), use_cache=False)
  adapted = trained(lora.wrap(base, h.hf(), rank=4), trainable=lora.TRAINABLE, use_cache=False)
  return base, adapted


def test_full_hf_export_loads_in_transformers_with_its_tokenizer(tmp_path, hf_pair, tokenizer_file):
  base, _ = hf_pair
  out = export.export(base, tmp_path / "hf", tokenizer=tokenizer_file)
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
  tokens, _ = h.random_batch(256)
  assert h.rel(loaded(out, tokens), ours(base, tokens, use_cache=False)) < TOL
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  text = "def export(jm):\n  return jm"
  assert hf_tokenizer(text)["input_ids"] == data.build_tokenizer(str(tokenizer_file)).encode_batch([text])[0]
  assert hf_tokenizer.eos_token == data.EOS_TOKEN


@pytest.mark.parametrize("scan", [False, True])
def test_torchtitan_llama3_exports_as_hf_llama(tmp_path, scan):
  jm = trained(tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", scan=scan, seed=2), steps=1)
  out = export.export(jm, tmp_path / "titan", max_shard_bytes=3_000_000)
  assert (out / "model.safetensors.index.json").is_file()
  config = transformers.AutoConfig.from_pretrained(out)
  assert config.architectures == ["LlamaForCausalLM"] and config.rope_parameters["rope_type"] == "llama3"
  tokens, _ = h.random_batch(2048)
  # q/k rows permuted for HF's rotate_half RoPE: without it the logits would differ at every position but 0
  assert h.rel(loaded(out, tokens), ours(jm, tokens)) < TOL


def test_lora_merged_and_adapter_exports_load_with_the_same_logits(tmp_path, hf_pair, tokenizer_file):
  import peft

  base, adapted = hf_pair
  tokens, _ = h.random_batch(256)
  want = ours(adapted, tokens, use_cache=False)
  assert h.rel(want, ours(base, tokens, use_cache=False)) > 1e-3  # the adapters changed the model

  merged = export.export(adapted, tmp_path / "merged", mode="merged", tokenizer=tokenizer_file)
  assert (merged / "tokenizer.json").is_file()
  assert h.rel(loaded(merged, tokens), want) < TOL

  adapter = export.export(adapted, tmp_path / "adapter", mode="adapter")
  assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
  export.export(base, tmp_path / "base")
  model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), adapter)
  model.eval()
  assert h.rel(model(tokens).logits.detach().numpy(), want) < TOL


def test_bad_exports_are_refused_in_one_sentence_and_write_nothing(tmp_path, hf_pair, tokenizer_file):
  base, adapted = hf_pair
  cases = [
    (dict(jm=base, mode="fp8"), "Unknown export mode 'fp8'; use one of full, merged, adapter."),
    (dict(jm=base, mode="adapter"), "needs a LoRA model"),
    (dict(jm=adapted, mode="full"), "has LoRA adapters; export it with mode='merged'"),
    (dict(jm=base, tokenizer=str(tmp_path / "nope.json")), "does not exist"),
  ]
  for kwargs, message in cases:
    with pytest.raises(TorchOnTpuError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
      export.export(directory=tmp_path / "out", **kwargs)
    assert str(info.value).count(". ") == 0, info.value
  user_module = tot.ShardedModule(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=tot.make_mesh(fsdp=-1))
  with pytest.raises(TorchOnTpuError, match="not Sequential; use export_safetensors"):
    export.export(user_module, tmp_path / "out")
  assert list(tmp_path.iterdir()) == []

  (tmp_path / "out").mkdir()  # an empty directory is a fine target
  export.export(base, tmp_path / "out")
  before = (tmp_path / "out" / "model.safetensors").read_bytes()
  with pytest.raises(TorchOnTpuError, match="already exists and is not empty; pick a new path or pass overwrite=True"):
    export.export(adapted, tmp_path / "out", mode="merged")
  assert (tmp_path / "out" / "model.safetensors").read_bytes() == before

