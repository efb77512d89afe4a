"""Chat data: answer-only labels, whole-sample packing, resume, the exact token-mean loss, torchtitan's SFT config."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from recipes import runner, titan_config
from tests import helpers as h
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import data
from torch_on_tpu.io.data import chat


def _write(path, n=60, long_every=0):
  with open(path, "w") as f:
    for i in range(n):
      answer = f"{2 * i}" + " and so on" * (40 if long_every and i % long_every == 0 else i % 5)
      f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}, {"role": "assistant", "content": answer}]}) + "\n")
  return str(path)


@pytest.fixture
def corpus(tmp_path):
  path = _write(tmp_path / "chat.jsonl", long_every=7)
  tok = data.build_tokenizer(None, vocab_size=300, corpus=chat.conversations(path).texts(), cache_dir=tmp_path)
  return path, tok


def _batches(path, tok, **kwargs):
  kwargs = {"seqlen": 48, "global_batch_size": 4, "data_format": "chat", "with_positions": True, "with_segment_ids": True, "prefetch": 0, **kwargs}
  return data.batches(path, tok, **kwargs)


def test_plain_template_trains_the_answer_and_its_eos_only(corpus):
  _, tok = corpus
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "more"}, {"role": "assistant", "content": "bye"}]
  ids, answer = chat.encode(tok, messages)
  assert tok.decode(ids) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello<|endoftext|><|user|>\nmore\n<|assistant|>\nbye<|endoftext|>"
  assert tok.decode(ids[answer]) == "hello<|endoftext|>bye<|endoftext|>"  # every assistant turn, nothing else


def test_rows_hold_whole_samples_with_labels_on_answers_and_padding_ignored(corpus):
  path, tok = corpus
  it = _batches(path, tok)
  for batch in itertools.islice(it, 6):
    for r in range(4):
      x, y, pos, seg = (batch[k][r] for k in ("input_ids", "labels", "positions", "segment_ids"))
      for s in range(seg.max() + 1):
        where = np.flatnonzero(seg == s)
        assert (pos[where] == np.arange(len(where))).all()  # positions restart at every sample (and at the padding)
        text = tok.decode(x[where])
        if text.startswith("<|user|>"):  # a whole sample: its prompt, then exactly its answer and EOS trained
          assert text.count("<|user|>") == 1 and text.endswith(tok.decode(y[where][y[where] != -100])[:-len("<|endoftext|>")])
          answer = text.split("<|assistant|>\n")[1]
          assert tok.decode(y[where][y[where] != -100]) == answer + "<|endoftext|>"
          assert (y[where][: len(where) - len(tok.encode_batch([answer])[0]) - 1] == -100).all()
        else:  # the padding: EOS with no label
          assert s == seg.max() and (x[where] == tok.eos_id).all() and (y[where] == -100).all()
  assert it.stats.too_long > 0 and "longer than seqlen=48" in it.stats.line()


def test_state_resumes_exactly_and_shards_split_the_same_batches(corpus, tmp_path):
  _, tok = corpus
  (tmp_path / "two").mkdir()
  _write(tmp_path / "two" / "a.jsonl", long_every=7)
  _write(tmp_path / "two" / "b.jsonl", n=30)
  path = str(tmp_path / "two")
  it = _batches(path, tok, num_shards=2)
  first = next(it)
  saved = it.state()
  rest = list(itertools.islice(it, 20))  # past an epoch: the stream goes on into the next
  again = _batches(path, tok, num_shards=2, state=saved)
  for a, b in zip(rest, itertools.islice(again, 20)):
    assert all((a[k] == b[k]).all() for k in a)
  halves = [_batches(path, tok, num_shards=2, process_index=p, process_count=2) for p in range(2)]
  both = {k: np.concatenate([next(x)[k] for x in halves]) if k == "input_ids" else None for k in ("input_ids",)}
  assert (both["input_ids"] == first["input_ids"]).all()


def test_role_field_pairs_json_files_and_a_chat_template(tmp_path):
  path = tmp_path / "qa.json"
  path.write_text(json.dumps([{"question": f"q{i}?", "answer": f"a{i}"} for i in range(20)]))
  conv = chat.conversations(str(path), field="user:question,assistant:answer")
  assert json.loads(conv.read(0)[0]) == [{"role": "user", "content": "q0?"}, {"role": "assistant", "content": "a0"}]
  with pytest.raises(TorchOnTpuError, match=r"has no field 'messages' \(a record has fields \['answer', 'question'\]\)"):
    chat.conversations(str(path))
  from transformers import PreTrainedTokenizerFast

  bpe = data.build_tokenizer(None, vocab_size=280, corpus=conv.texts(), cache_dir=tmp_path)
  hf = PreTrainedTokenizerFast(tokenizer_object=bpe.backend, eos_token="<|endoftext|>")
  hf.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% if m.role == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
  hf.save_pretrained(str(tmp_path / "tok"))
  tok = data.build_tokenizer(str(tmp_path / "tok"))
  assert tok.chat is not None
  ids, answer = chat.encode(tok, [{"role": "user", "content": "q1?"}, {"role": "assistant", "content": "a1"}])
  assert tok.decode(ids) == "[user] q1?[assistant] a1<|endoftext|>"  # transformers trims the newline after a block
  assert tok.decode(ids[answer]) == "a1<|endoftext|>"


LR, STEPS, V = 1e-2, 3, 300


class TinyLM(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Embedding(V, 16)
    self.head = torch.nn.Linear(16, V)

  def forward(self, x):
    return self.head(torch.tanh(self.embed(x)))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_answer_loss_is_the_global_token_mean_and_trains_as_eager_torch(corpus, grad_accum):
  """fp32 AdamW through make_train_step vs torch on the whole batch (torchtitan's loss: mean over the
  batch's answer tokens): losses and weights within 1e-5 relative, with --grad_accum's microbatches too."""
  path, tok = corpus
  batches = list(itertools.islice(_batches(path, tok, global_batch_size=8), STEPS))
  torch.manual_seed(0)
  ref = TinyLM()
  model = TinyLM()
  model.load_state_dict(ref.state_dict())
  opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
  want = []
  for b in batches:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ref(torch.tensor(b["input_ids"])).flatten(0, 1), torch.tensor(b["labels"]).long().flatten())
    loss.backward()
    opt.step()
    want.append(loss.item())
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(jax.devices()[:1], fsdp=1), sharding="replicated")
  step = tot.make_train_step(jm, runner.answer_loss, optax.adamw(LR, weight_decay=0.0), grad_accum=grad_accum)
  got = [float(step(torch.tensor(b["input_ids"]), runner.answer_labels(jnp.asarray(b["labels"])))) for b in batches]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for name, p in ref.named_parameters():
    assert h.rel(tot.to_cpu(jm.params[name]), p.detach()) < 1e-5, name
  if grad_accum == 2:  # the plain mean of microbatch means is not that mean: why the chat run has its own loss
    b = batches[0]
    plain = tot.make_train_step(jm, runner._loss, optax.sgd(0.0), grad_accum=2)
    exact = tot.make_train_step(jm, runner.answer_loss, optax.sgd(0.0), grad_accum=2)
    assert abs(float(plain(torch.tensor(b["input_ids"]), jnp.asarray(b["labels"])))
               - float(exact(torch.tensor(b["input_ids"]), runner.answer_labels(jnp.asarray(b["labels"]))))) > 1e-4


def test_a_batch_without_answers_has_loss_zero_not_nan():
  logits = torch.randn(2, 3, V)
  labels = runner.answer_labels(jnp.full((2, 3), -100, jnp.int32))
  loss = runner.answer_loss(logits, {"labels": torch.tensor(np.asarray(labels["labels"])).long(),
                                     "answer_tokens": torch.tensor(np.asarray(labels["answer_tokens"]))})
  assert loss.item() == 0.0


def test_torchtitan_sft_debugmodel_maps_onto_chat_data():
  config = titan_config.parse(["--module", "llama3", "--config", "sft_debugmodel"])
  flags, notes = titan_config.to_flags(config, devices=2)
  assert (flags["data"], flags["data_format"], flags["data_field"]) == ("tests/assets/sft_test/data.json", "chat", "user:question,assistant:answer")
  assert any("ChatDataLoader" in n for n in notes)
  config.dataloader.sample_processor = lambda s: [{"role": "user", "content": s["q"] + s["c"]}]
  with pytest.raises(TorchOnTpuError, match=r"computes its messages from more than a record's fields"):
    titan_config.to_flags(config, devices=2)
