"""tot.generate: greedy decoding gives eager torch's greedy tokens, with the HF KV cache and without; top-k is seeded."""

import importlib
import logging

import jax
import numpy as np
import pytest
import torch
import transformers
from transformers.cache_utils import StaticLayer

import torch_on_tpu as tot
from tests import helpers as h

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)


@pytest.fixture(scope="module")
def llama():
  torch.manual_seed(0)
  ref = h.hf(device="cpu")
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8))
  jm_state = jm.state_dict()
  ref.load_state_dict(dict(jm_state))
  return jm, ref


def test_greedy_matches_eager_torch(llama):
  jm, ref = llama
  prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
  ids = prompt
  for _ in range(6):
    logits = ref(ids, use_cache=False).logits[:, -1]
    ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
  got = tot.generate(jm, prompt, max_new_tokens=6)
  assert got.dtype == torch.int64 and torch.equal(got, ids)
  assert torch.equal(tot.generate(jm, prompt[0], max_new_tokens=6), ids[0])  # one unbatched prompt


def test_top_k_samples_among_the_k_likeliest_reproducibly(llama):
  jm, _ = llama
  prompt = torch.tensor([[1, 2, 3]])
  first = tot.generate(jm, prompt, max_new_tokens=8, top_k=5, seed=3)
  assert torch.equal(first, tot.generate(jm, prompt, max_new_tokens=8, top_k=5, seed=3))
  assert torch.equal(tot.generate(jm, prompt, max_new_tokens=8, top_k=1, seed=9), tot.generate(jm, prompt, max_new_tokens=8))
  with pytest.raises(tot.TorchOnTpuError, match="max_new_tokens must be a positive integer"):
    tot.generate(jm, prompt, max_new_tokens=0)


# ---- the KV cache (HF models) ---------------------------------------------------------

gen = importlib.import_module("torch_on_tpu.training.generation")


def test_a_call_of_a_shape_already_seen_compiles_nothing(llama, monkeypatch):
  jm, _ = llama
  prompt = torch.tensor([[4, 5, 6, 7]])
  first = tot.generate(jm, prompt, max_new_tokens=3)
  compiled = gen._compiled
  calls = []
  monkeypatch.setattr(gen, "_compiled", lambda *a, **k: calls.append(a) or compiled(*a, **k))
  again = tot.generate(jm, prompt + 1, max_new_tokens=3)  # same shapes, other tokens: the same program
  assert calls == [] and torch.equal(again[:, :4], prompt + 1)
  assert torch.equal(tot.generate(jm, prompt, max_new_tokens=3), first)
  tot.generate(jm, prompt, max_new_tokens=4)  # another length: one compile
  assert len(calls) == 1
PROMPT = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))


def built(builder):
  torch.manual_seed(0)
  jm = tot.ShardedModule(builder(), mesh=tot.make_mesh(fsdp=8))
  return jm, h.reference(jm, builder)


def programs(jm, new, top_k=None, cache=True):
  """(tokens, each step's logits) from the compiled program, cached or full forward."""
  length = PROMPT.shape[1]
  tokens = gen._token_buffer(PROMPT, new)
  key = jax.random.key(0)
  ids, logits = gen._compiled(jm, None, length, new, top_k, cache, tokens, key, keep_logits=True)(
    jm.params, jm.buffers, tokens, key
  )
  return torch.from_numpy(np.array(ids)).long(), np.asarray(logits)


def eager_greedy(ref, new):
  """Eager torch's greedy tokens and, at each step, the logits it read."""
  ids, steps = PROMPT, []
  with torch.no_grad():
    for _ in range(new):
      logits = ref(ids, use_cache=False).logits[:, -1]
      steps.append(logits.numpy())
      ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
  return ids, np.stack(steps)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_cached_greedy_equals_the_full_forward_and_hf_generate(arch):
  jm, ref = built(lambda device="meta": h.hf(arch, device=device))
  new = 6
  cached, cached_logits = programs(jm, new, cache=True)
  full, full_logits = programs(jm, new, cache=False)
  want, want_logits = eager_greedy(ref, new)
  hf_ids = ref.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=new, do_sample=False)
  assert torch.equal(cached, want) and torch.equal(full, want) and torch.equal(hf_ids, want)
  for step in range(new):  # fp32: the cache changes only the order of the sums
    assert h.rel(cached_logits[step], want_logits[step]) <= 1e-5, step
    assert h.rel(cached_logits[step], full_logits[step]) <= 1e-5, step


def test_cached_top_k_is_seeded_and_draws_as_the_full_forward(llama):
  jm, _ = llama
  first = tot.generate(jm, PROMPT, max_new_tokens=8, top_k=5, seed=3)
  assert torch.equal(first, tot.generate(jm, PROMPT, max_new_tokens=8, top_k=5, seed=3, cache=True))
  assert torch.equal(first, tot.generate(jm, PROMPT, max_new_tokens=8, top_k=5, seed=3, cache=False))
  assert not torch.equal(first, tot.generate(jm, PROMPT, max_new_tokens=8, top_k=5, seed=4))
  assert torch.equal(programs(jm, 8, top_k=1)[0], programs(jm, 8)[0])


def test_the_cached_program_runs_one_token_per_step(llama):
  """Prefill (5 tokens) + one token in the loop, against a 30-token forward per step."""
  jm, _ = llama
  length, new = PROMPT.shape[1], 25
  tokens = gen._token_buffer(PROMPT, new)
  flops = {
    cache: gen._compiled(jm, None, length, new, None, cache, tokens, jax.random.key(0)).cost_analysis()["flops"]
    for cache in (True, False)
  }
  assert flops[True] < 0.3 * flops[False], flops  # about (5 + 1) / 30


def sliding_mistral(device="meta"):
  config = transformers.MistralConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False, sliding_window=3,
  )
  config._attn_implementation = "sdpa"
  return h.build_causal_lm(config, device=device).eval()


def test_a_cache_that_cannot_be_carried_falls_back_with_why(caplog):
  jm, ref = built(sliding_mistral)
  want, _ = eager_greedy(ref, 4)
  with caplog.at_level(logging.INFO, logger="torch_on_tpu.training.generation"):
    assert torch.equal(tot.generate(jm, PROMPT, max_new_tokens=4), want)
  assert "without the model's KV cache: its static cache has StaticSlidingWindowLayer layers" in caplog.text
  with pytest.raises(tot.TorchOnTpuError, match=r"generate\(cache=True\) cannot use this model's KV cache"):
    tot.generate(jm, PROMPT, max_new_tokens=4, cache=True)


def test_python_state_a_decode_step_changes_is_refused_not_replayed(llama, monkeypatch, caplog):
  """A cache layer counting steps in a Python int would replay the traced count on every step."""
  jm, _ = llama
  update = StaticLayer.update

  def counting(self, *args, **kwargs):
    self.steps = getattr(self, "steps", 0) + 1
    return update(self, *args, **kwargs)

  monkeypatch.setattr(StaticLayer, "update", counting)
  with caplog.at_level(logging.INFO, logger="torch_on_tpu.training.generation"):
    got = tot.generate(jm, PROMPT, max_new_tokens=3)
  assert "a decode step changes the cache's Python state (steps)" in caplog.text
  monkeypatch.undo()
  assert torch.equal(got, tot.generate(jm, PROMPT, max_new_tokens=3, cache=False))


def test_cache_settings_are_checked(llama):
  jm, _ = llama
  with pytest.raises(tot.TorchOnTpuError, match="cache must be None \\(auto\\), True or False"):
    tot.generate(jm, PROMPT, max_new_tokens=2, cache="yes")
  with pytest.raises(tot.TorchOnTpuError, match="a custom inputs_fn is given the whole token buffer"):
    tot.generate(jm, PROMPT, max_new_tokens=2, cache=True, inputs_fn=lambda ids: {"input_ids": ids, "use_cache": False})
  scanned = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8), scan=True)
  assert "its layers are stacked" in gen._decode_cache(scanned, None, 8)[1]
  plain = tot.ShardedModule(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)), mesh=tot.make_mesh(fsdp=8))
  with pytest.raises(tot.TorchOnTpuError, match="the model has no KV cache the bridge can carry"):
    tot.generate(plain, PROMPT % 16, max_new_tokens=2, cache=True)
