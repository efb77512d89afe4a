"""The data pipeline: sources, tokenizers, packing, shards and processes, resumable state, global arrays."""

import json
import random

import numpy as np
import pytest
from jax.sharding import PartitionSpec

import torch_on_tpu as tot
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import data
from torch_on_tpu.io.data import tokenizer as tokenizer_lib

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega tensor shard mesh token".split()
N_DOCS = 120


def _docs():
  rng = random.Random(0)
  words = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))  # noqa: E731
  return [f"doc{i:04d} {words()}" for i in range(N_DOCS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The same documents as JSONL, one text file each, a text file of lines, Parquet and a HF dataset."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq

  root = tmp_path_factory.mktemp("corpus")
  docs = _docs()
  with open(root / "docs.jsonl", "w") as f:
    for i, d in enumerate(docs):
      f.write(json.dumps({"id": i, "text": d}) + "\n")
  (root / "files").mkdir()
  for i, d in enumerate(docs):
    (root / "files" / f"{i:04d}.txt").write_text(d)
  (root / "lines.txt").write_text("\n".join(docs) + "\n")
  pq.write_table(pa.table({"text": docs}), root / "docs.parquet", row_group_size=50)
  datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "hf"))
  return root


@pytest.fixture(scope="module")
def src(corpus):
  """JSONL in ~40 small blocks, so shuffling, slicing and resuming cross many boundaries."""
  return data.JsonLines([corpus / "docs.jsonl"], block_bytes=512)


@pytest.fixture(scope="module")
def tok(src, tmp_path_factory):
  return data.build_tokenizer(None, corpus=src, vocab_size=300, cache_dir=tmp_path_factory.mktemp("cache"))


def _all_docs(source):
  return [d for b in range(len(source)) for d in source.read(b)]


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# ---- sources and tokenizers ----------------------------------------------------------------


@pytest.mark.parametrize(
  "spec, kwargs, kind",
  [
    ("docs.jsonl", {}, data.JsonLines),
    ("files/*.txt", {}, data.TextFiles),
    ("files", {}, data.TextFiles),
    ("lines.txt", {"lines": True}, data.TextFiles),
    ("docs.parquet", {}, data.Parquet),
    ("hf", {}, data.HFDataset),
  ],
)
def test_every_source_kind_reads_every_document_once(corpus, spec, kwargs, kind):
  source = data.source(str(corpus / spec), **kwargs)
  assert isinstance(source, kind)
  assert sorted(_all_docs(source)) == sorted(_docs())


def test_line_ranges_split_lines_exactly(corpus):
  """Byte ranges cut lines mid-way; each line still lands in exactly one block."""
  for block_bytes in (7, 100, 333, 10**6):
    source = data.TextFiles([corpus / "lines.txt"], lines=True, block_bytes=block_bytes)
    assert _all_docs(source) == _docs()


def test_tokenizer_file_and_pretrained_directory_match_the_bpe(tok, tmp_path):
  from transformers import PreTrainedTokenizerFast

  text = ["doc0001 alpha beta", "gamma  omega\ntensor"]
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  from_file = data.build_tokenizer(str(tmp_path / "tokenizer.json"))
  hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=data.EOS_TOKEN)
  hf.save_pretrained(tmp_path / "hf")
  from_dir = data.build_tokenizer(str(tmp_path / "hf"))
  for other in (from_file, from_dir):
    assert other.eos_id == tok.eos_id == tok.backend.token_to_id(data.EOS_TOKEN)
    assert other.vocab_size == tok.vocab_size == 300
    assert other.encode_batch(text) == tok.encode_batch(text)
  assert tok.decode(tok.encode_batch(text)[1]) == text[1]


def test_bpe_cache_trains_once_per_corpus_and_size(src, tmp_path, monkeypatch):
  trained = []
  real = tokenizer_lib._train_bpe
  monkeypatch.setattr(tokenizer_lib, "_train_bpe", lambda *a: trained.append(a) or real(*a))
  first = data.build_tokenizer(None, corpus=src, vocab_size=280, cache_dir=tmp_path)
  (cached,) = (tmp_path / "tokenizers").glob("bpe-280-*.json")
  mtime = cached.stat().st_mtime_ns
  second = data.build_tokenizer(None, corpus=src, vocab_size=280, cache_dir=tmp_path)
  assert len(trained) == 1
  assert cached.stat().st_mtime_ns == mtime
  assert second.backend.to_str() == first.backend.to_str()
  data.build_tokenizer(None, corpus=src, vocab_size=290, cache_dir=tmp_path)
  assert len(trained) == 2
  # Training is deterministic, so hosts that each train their own get the same tokenizer.
  elsewhere = data.build_tokenizer(None, corpus=src, vocab_size=280, cache_dir=tmp_path / "other")
  assert elsewhere.backend.to_str() == first.backend.to_str()


def test_default_corpus_and_its_bpe(tmp_path):
  corpus = data.default_corpus()
  assert len(corpus.paths) > 300
  assert all("site-packages" not in p.parts and "test" not in p.parts for p in corpus.paths)
  assert corpus.paths == sorted(corpus.paths)
  tok = data.build_tokenizer(None, vocab_size=512, sample_bytes=300_000, cache_dir=tmp_path)
  assert tok.vocab_size == 512
  snippet = "def f(x):\n    return x + 1  # ok\n"
  assert tok.decode(tok.encode_batch([snippet])[0]) == snippet
  train, val, every = (
    list(data.Stream(corpus, tok, split=s, shuffle=False).epoch_documents(0)) for s in ("train", "val", "all")
  )
  assert 0 < len(val) < len(train) / 10
  assert not set(train) & set(val)
  assert sorted(train + val) == sorted(every)


# ---- order, slices, packing --------------------------------------------------------------------


def test_epochs_reshuffle_deterministically(src, tok):
  def order(seed, epoch):
    return list(data.Stream(src, tok, split="all", seed=seed).epoch_documents(epoch))

  assert order(0, 0) == order(0, 0)
  assert order(0, 0) != order(0, 1)
  assert order(0, 0) != order(1, 0)
  assert sorted(order(0, 0)) == sorted(order(0, 1)) == sorted(_docs())


class _Recording(data.JsonLines):
  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.reads = set()

  def read(self, block):
    self.reads.add(block)
    return super().read(block)


def _min_epoch(it):
  return min(p[0] for p in it.state()["shards"] if p is not None)


@pytest.mark.parametrize("split", ["train", "all"])
def test_shards_are_disjoint_and_processes_read_only_their_own(corpus, tok, split):
  whole = data.Stream(data.JsonLines([corpus / "docs.jsonl"], block_bytes=512), tok, split=split)
  for epoch in (0, 1):
    everything = list(whole.epoch_documents(epoch))
    mine = [
      list(data.Stream(whole.source, tok, split=split, shard_index=s, shard_count=2).epoch_documents(epoch))
      for s in (0, 1)
    ]
    assert mine[0] and mine[1]
    assert not set(mine[0]) & set(mine[1])
    assert sorted(mine[0] + mine[1]) == sorted(everything)
  # Over several epochs of batches, no process opens a block another one reads.
  sources = [_Recording([corpus / "docs.jsonl"], block_bytes=512) for _ in (0, 1)]
  for p, source in enumerate(sources):
    it = data.batches(
      source, tok, seqlen=16, global_batch_size=4, split=split, process_index=p, process_count=2, prefetch=0
    )
    assert it.state()["num_shards"] == 4
    while _min_epoch(it) < 2:
      next(it)
  assert sources[0].reads and sources[1].reads
  assert not sources[0].reads & sources[1].reads
  assert sources[0].reads | sources[1].reads == set(range(len(whole.source)))


@pytest.mark.parametrize("num_shards", [1, 2])
def test_packing_preserves_every_token_and_eos(src, tok, num_shards):
  """Each shard's rows of the global batch are its own stream, cut in order."""
  seqlen, rows, n = 16, 4, 150
  it = data.batches(
    src, tok, seqlen=seqlen, global_batch_size=rows, split="all", with_positions=True, with_segment_ids=True,
    num_shards=num_shards, prefetch=0,
  )
  got = _take(it, n)
  assert _min_epoch(it) >= 1, "the check should cross an epoch boundary"
  per_shard = rows // num_shards
  for shard in range(num_shards):
    stream = data.Stream(src, tok, split="all", shard_index=shard, shard_count=num_shards)
    docs = [d for e in (0, 1, 2, 3, 4) for d in stream.epoch_documents(e)]
    expected = np.concatenate([np.array(ids + [tok.eos_id]) for ids in tok.encode_batch(docs)])
    total = n * per_shard * seqlen
    mine = slice(shard * per_shard, (shard + 1) * per_shard)
    inputs = np.concatenate([b["input_ids"][mine].reshape(-1) for b in got])
    labels = np.concatenate([b["labels"][mine].reshape(-1) for b in got])
    np.testing.assert_array_equal(inputs, expected[:total])
    np.testing.assert_array_equal(labels, expected[1 : total + 1])
  for b in got:
    assert b["input_ids"].dtype == np.int32 and b["input_ids"].shape == (rows, seqlen)
    pos, ids = b["positions"], b["input_ids"]
    after_eos = np.concatenate([np.ones((rows, 1), bool), ids[:, :-1] == tok.eos_id], axis=1)
    np.testing.assert_array_equal(pos == 0, after_eos)
    np.testing.assert_array_equal(pos[:, 1:][~after_eos[:, 1:]], pos[:, :-1][~after_eos[:, 1:]] + 1)
    np.testing.assert_array_equal(b["segment_ids"], np.cumsum(after_eos, axis=1) - 1)


# ---- process-count independence ---------------------------------------------------------------


def _processes(src, tok, count, state=None, **kwargs):
  """`count` simulated processes' iterators of one run."""
  kwargs = {"seqlen": 16, "global_batch_size": 8, "seed": 3, "with_positions": True, "prefetch": 0, **kwargs}
  return [data.batches(src, tok, process_index=p, process_count=count, state=state, **kwargs) for p in range(count)]


def _global(its, n):
  """The next `n` global batches: every process's rows, in process order."""
  steps = [_take(it, n) for it in its]
  return [{k: np.concatenate([s[i][k] for s in steps]) for k in steps[0][i]} for i in range(n)]


@pytest.mark.parametrize("num_shards", [None, 2])
def test_global_batch_is_the_same_for_any_process_count(src, tok, num_shards):
  """8 shards (the default: 4 or 2 whole shards per process) and 2 (processes share one, keeping their rows)."""
  one, two, four = (_processes(src, tok, count, num_shards=num_shards) for count in (1, 2, 4))
  expected = _global(one, 12)
  assert one[0].state()["num_shards"] == (num_shards or 8)
  _assert_same_batches(_global(two, 12), expected)
  _assert_same_batches(_global(four, 12), expected)
  assert data.merge_states([it.state() for it in four]) == one[0].state()
  assert four[0].state()["shards"][-1] is None  # a simulated process holds only its own shards


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2), (4, 2)])
def test_state_restores_on_another_process_count(src, tok, saved_on, resumed_on):
  before = _processes(src, tok, saved_on)
  _take(before[0], 7)
  for it in before[1:]:
    _take(it, 7)
  saved = json.loads(json.dumps(data.merge_states([it.state() for it in before])))
  expected = _global(before, 10)
  resumed = _processes(src, tok, resumed_on, state=saved)
  _assert_same_batches(_global(resumed, 10), expected)
  assert data.merge_states([it.state() for it in resumed]) == data.merge_states([it.state() for it in before])


# ---- state and prefetch ---------------------------------------------------------------------


def _epoch_change(src, tok):
  it = data.batches(src, tok, seqlen=16, global_batch_size=4, num_shards=1, prefetch=0)
  for i in range(1000):
    next(it)
    if _min_epoch(it) == 1:
      return i + 1
  raise AssertionError("no epoch boundary within 1000 batches")


@pytest.mark.parametrize("prefetch", [0, 3])
def test_restored_state_gives_the_same_next_10_batches(src, tok, prefetch):
  def make(state=None):
    return data.batches(
      src, tok, seqlen=16, global_batch_size=4, seed=3, with_positions=True, num_shards=1, state=state,
      prefetch=prefetch,
    )

  boundary = _epoch_change(src, tok)
  for skip in (0, 7, boundary - 4):
    it = make()
    _take(it, skip)
    saved = json.loads(json.dumps(it.state()))
    expected = _take(it, 10)
    resumed = make(saved)
    _assert_same_batches(_take(resumed, 10), expected)
    assert resumed.state() == it.state()
    it.close()
    resumed.close()


def test_state_under_prefetch_counts_only_consumed_batches(src, tok):
  eager = data.batches(src, tok, seqlen=16, global_batch_size=4, prefetch=0)
  ahead = data.batches(src, tok, seqlen=16, global_batch_size=4, prefetch=8)
  for _ in range(12):
    _assert_same_batches([next(ahead)], [next(eager)])
    assert ahead.state() == eager.state()
  ahead.close()


def test_eval_batches_are_fixed_held_out_and_the_same_for_any_process_count(src, tok):
  kwargs = dict(seqlen=16, global_batch_size=4, num_batches=30, val_fraction=0.2)
  first, again = data.eval_batches(src, tok, **kwargs), data.eval_batches(src, tok, **kwargs)
  _assert_same_batches(first, again)
  halves = [data.eval_batches(src, tok, process_index=p, process_count=2, **kwargs) for p in (0, 1)]
  _assert_same_batches([{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*halves)], first)
  held_out = set(data.Stream(src, tok, split="val", val_fraction=0.2).epoch_documents(0))
  text = tok.decode(np.concatenate([b["input_ids"].reshape(-1) for b in first]))
  seen = {d for d in _docs() if d in text}
  assert seen and seen <= held_out


# ---- errors, each one sentence naming the culprit ------------------------------------------


def _error(fn, *args, **kwargs) -> str:
  with pytest.raises(TorchOnTpuError) as e:
    fn(*args, **kwargs)
  message = str(e.value)
  assert message.count(". ") == 0 and "\n" not in message, message
  return message


def test_missing_paths_name_the_path(tmp_path, tok):
  missing = str(tmp_path / "nope.jsonl")
  assert missing in _error(data.batches, missing, tok, seqlen=16, global_batch_size=4)
  pattern = str(tmp_path / "*.parquet")
  assert pattern in _error(data.source, pattern)
  assert "nope.json" in _error(data.build_tokenizer, str(tmp_path / "nope.json"))


def test_empty_corpus_is_an_error(tmp_path, tok):
  (tmp_path / "empty.jsonl").write_text("")
  message = _error(data.batches, str(tmp_path / "empty.jsonl"), tok, seqlen=16, global_batch_size=4)
  assert "empty.jsonl" in message and "no documents" in message
  (tmp_path / "blank.jsonl").write_text('{"text": ""}\n' * 5)
  message = _error(data.batches, str(tmp_path / "blank.jsonl"), tok, seqlen=16, global_batch_size=4)
  assert "blank.jsonl" in message and "no train tokens" in message


def test_unknown_field_names_field_file_and_fields_present(corpus, tmp_path):
  message = _error(data.source, str(corpus / "docs.jsonl"), field="content")
  assert "'content'" in message and "docs.jsonl" in message and "['id', 'text']" in message
  assert "'content'" in _error(data.source, str(corpus / "docs.parquet"), field="content")
  assert "'content'" in _error(data.source, str(corpus / "hf"), field="content")
  (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
  assert "int" in _error(data.source, str(tmp_path / "num.jsonl"))


def test_model_fit_errors():
  message = _error(data.check_model_fit, 32000, 2048, 256, 2048)
  assert "32000" in message and "2048" in message
  message = _error(data.check_model_fit, 2048, 2048, 512, 256)
  assert "seqlen 512" in message and "256" in message
  data.check_model_fit(2000, 2048, 256, 256)
  assert "vocab_size 200" in _error(data.build_tokenizer, None, vocab_size=200)


def test_batch_shard_and_state_mismatches(src, tok):
  message = _error(data.batches, src, tok, seqlen=16, global_batch_size=3, process_count=2, process_index=0)
  assert "global_batch_size=3 does not divide over 2 processes" in message
  message = _error(data.batches, src, tok, seqlen=16, global_batch_size=8, num_shards=3)
  assert "num_shards 3" in message and "global_batch_size 8" in message
  tiny = data.JsonLines([src.paths[0]])
  assert len(tiny) == 1
  assert "2 data shards" in _error(data.batches, tiny, tok, seqlen=16, global_batch_size=4, num_shards=2)
  assert data.default_num_shards(4, len(tiny)) == 1 and data.default_num_shards(12, 8) == 6
  saved = data.batches(src, tok, seqlen=16, global_batch_size=4, prefetch=0).state()
  message = _error(data.batches, src, tok, seqlen=32, global_batch_size=4, state=saved)
  assert "seqlen=16" in message and "seqlen=32" in message
  message = _error(data.batches, src, tok, seqlen=16, global_batch_size=4, num_shards=2, state=saved)
  assert "num_shards=4" in message
  old = {k: v for k, v in saved.items() if k != "shards"} | {"version": 1, "epoch": 0, "block": 0}
  assert "version=1" in _error(data.batches, src, tok, seqlen=16, global_batch_size=4, state=old)
  part = data.batches(src, tok, seqlen=16, global_batch_size=4, process_index=0, process_count=2).state()
  message = _error(data.batches, src, tok, seqlen=16, global_batch_size=4, state=part)
  assert "shard 2" in message and "merge_states" in message
  other = data.batches(src, tok, seqlen=16, global_batch_size=4, seed=1, process_index=1, process_count=2)
  assert "different data settings" in _error(data.merge_states, [part, other.state()])


def test_tokenizer_without_eos_asks_for_eos_token(tmp_path):
  from tokenizers import Tokenizer, models

  Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
  assert "eos_token=" in _error(data.build_tokenizer, str(tmp_path / "t.json"))
  assert data.build_tokenizer(str(tmp_path / "t.json"), eos_token="[UNK]").eos_id == 1


# ---- global arrays ------------------------------------------------------------------------------


@pytest.mark.parametrize("axes, spec", [({"fsdp": 8}, ("fsdp", None)), ({"fsdp": 4, "tp": 2}, ("fsdp", None))])
def test_to_global_shards_rows_over_the_data_axes(src, tok, axes, spec):
  mesh = tot.make_mesh(**axes)
  batch = next(data.batches(src, tok, seqlen=16, global_batch_size=8, with_positions=True, prefetch=0))
  arrays = data.to_global(batch, mesh)
  rows = 8 // axes["fsdp"]
  for name, arr in arrays.items():
    assert arr.sharding.spec == PartitionSpec(*spec)
    assert arr.shape == (8, 16)
    np.testing.assert_array_equal(np.asarray(arr), batch[name])
    for shard in arr.addressable_shards:
      assert shard.data.shape == (rows, 16)
      np.testing.assert_array_equal(np.asarray(shard.data), batch[name][shard.index])


def test_to_global_over_named_axes_and_errors(src, tok):
  mesh = tot.make_mesh(fsdp=4, tp=2)
  batch = next(data.batches(src, tok, seqlen=16, global_batch_size=8, prefetch=0))
  arr = data.to_global(batch, mesh, axes=("fsdp", "tp"))["input_ids"]
  assert arr.sharding.spec == PartitionSpec(("fsdp", "tp"), None)
  assert {s.data.shape for s in arr.addressable_shards} == {(1, 16)}
  assert "'dp'" in _error(data.to_global, batch, mesh, axes=("dp",))
  short = {k: v[:6] for k, v in batch.items()}
  assert "6 rows" in _error(data.to_global, short, mesh)


def test_no_prefetch_thread_outlives_close(src, tok):
  import threading

  def running():  # other tests' iterators may be collected (and their threads end) meanwhile
    return {t for t in threading.enumerate() if t.name == "tot-data" and t.is_alive()}

  before = running()
  it = data.batches(src, tok, seqlen=16, global_batch_size=4, prefetch=2)
  next(it)
  ours = running() - before
  assert ours  # the prefetch thread really ran
  it.close()
  assert not any(t.is_alive() for t in ours)


def test_packed_batches_feed_torchtitan_llama3_like_eager(src, tok):
  """int32 tokens and per-document positions go through the jitted model as in eager PyTorch."""
  import torch

  from torch_on_tpu.models.torchtitan import llama3_config

  batch = next(data.batches(src, tok, seqlen=32, global_batch_size=8, with_positions=True, prefetch=0))
  assert (batch["positions"] != np.arange(32)).any(), "the batch should hold a document boundary"
  config = llama3_config("debugmodel", attention="sdpa", max_seq_len=32)
  config.layers = config.layers[:1]  # one layer keeps the compile short
  data.check_model_fit(tok.vocab_size, config.vocab_size, 32, 32)
  with torch.device("meta"):
    jm = tot.ShardedModule(config.build(), mesh=tot.make_mesh(fsdp=-1))
  ids, pos = (torch.from_numpy(batch[k]) for k in ("input_ids", "positions"))
  out = tot.to_cpu(jm(ids, positions=pos))
  ref = config.build()
  ref.load_state_dict(jm.state_dict())
  with torch.no_grad():
    expected = ref(ids.long(), positions=pos.long())
    unpositioned = ref(ids.long())
  assert float((out - expected).norm() / expected.norm()) < 1e-5
  assert float((unpositioned - expected).norm() / expected.norm()) > 1e-5  # the positions did matter
