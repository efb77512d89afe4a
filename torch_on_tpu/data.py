"""Real training data: text → tokens → packed batches → per-process slices → global arrays.

    tok = data.build_tokenizer(None)                       # byte-level BPE on the default corpus
    train = data.batches(None, tok, seqlen=256, global_batch_size=16, with_positions=True)
    batch = next(train)                                    # this process's numpy rows
    arrays = data.to_global(batch, mesh)                   # global jax.Arrays, batch dim sharded
    saved = train.state()                                  # small JSON-able dict (all processes call it)
    train = data.batches(None, tok, seqlen=256, global_batch_size=16, state=saved)

Everything is local: a source is files on disk (text, JSONL, Parquet, a HF
`datasets` directory) or, with none given, the Python standard library's own
`.py` files, which every machine that runs this package has.

A source is cut into *blocks*, each one sequential read (a group of small files,
a byte range of a JSONL file, a run of Parquet/Arrow rows). Blocks are dealt
once, after a seeded shuffle, round-robin to a fixed number of *data shards*
that does not depend on the process count. Each epoch reorders a shard's blocks
and the documents within each block. A document hash splits every source into
train and a held-out validation set.

Each shard packs its documents, each followed by EOS, into one token stream
and cuts rows of `seqlen + 1` tokens every `seqlen` tokens: `input_ids` is a
row without its last token, `labels` without its first, so every token is an
input once and (after the first) a label once. A global batch is the same
number of rows from every shard, in shard order, so it is the same for any
process count; a process reads only the shards its rows come from. Because a
shard's stream is a pure function of the seed and the position `(epoch, block,
document, token offset)`, the shards' positions are the whole iterator state:
restoring it re-reads one block per shard and continues exactly, on any
process count.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import sys
import sysconfig
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_on_tpu import mesh as mesh_lib
from torch_on_tpu.errors import TorchOnTpuError

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 2048  # torchtitan's Llama 3 debugmodel vocabulary
EOS_TOKEN = "<|endoftext|>"
# Names tokenizers commonly give their end-of-document token, tried in order.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
BLOCK_BYTES = 256 * 1024
BLOCK_ROWS = 1024
STATE_VERSION = 2
CHUNK_CHARS = 32 * 1024  # text tokenized at a time, so a shard starts without tokenizing a whole block
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---- sources ------------------------------------------------------------------------


class Source:
  """A corpus as numbered blocks of documents; `read(i)` returns block i's texts.

  Blocks are the unit a process reads and an epoch shuffles; subclasses set
  `name` (for messages) and `fingerprint` (identifies the content for state
  checks and the tokenizer cache).
  """

  name: str
  fingerprint: str

  def __len__(self) -> int:
    raise NotImplementedError

  def read(self, block: int) -> list[str]:
    raise NotImplementedError


class TextFiles(Source):
  """Plain text files: one document per file, or per non-empty line with `lines=True`."""

  def __init__(
    self, paths: Sequence, *, lines: bool = False, block_bytes: int = BLOCK_BYTES, name: str | None = None
  ):
    self.paths = [Path(p) for p in paths]
    self.lines = lines
    self.name = name or _describe(self.paths)
    sizes = [p.stat().st_size for p in self.paths]
    if lines:
      self._blocks = _byte_ranges(sizes, block_bytes)
    else:
      self._blocks = _file_groups(sizes, block_bytes)
    self.fingerprint = _digest(["text", lines, block_bytes, [(p.name, s) for p, s in zip(self.paths, sizes)]])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    if self.lines:
      index, start, end = self._blocks[block]
      return [line.decode("utf-8", errors="replace") for line in _read_lines(self.paths[index], start, end)]
    return [self.paths[i].read_bytes().decode("utf-8", errors="replace") for i in self._blocks[block]]


class JsonLines(Source):
  """JSONL files, one JSON object per line; the document is the string in `field`."""

  def __init__(self, paths: Sequence, *, field: str = "text", block_bytes: int = BLOCK_BYTES):
    self.paths = [Path(p) for p in paths]
    self.field = field
    self.name = _describe(self.paths)
    sizes = [p.stat().st_size for p in self.paths]
    self._blocks = _byte_ranges(sizes, block_bytes)
    self.fingerprint = _digest(["jsonl", field, block_bytes, [(p.name, s) for p, s in zip(self.paths, sizes)]])
    if self._blocks:  # a wrong field name fails here, not minutes into training
      first = self._blocks[0]
      self._documents(first[0], _read_lines(self.paths[first[0]], first[1], first[2])[:1])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    index, start, end = self._blocks[block]
    return self._documents(index, _read_lines(self.paths[index], start, end))

  def _documents(self, index, lines):
    path = self.paths[index]
    docs = []
    for line in lines:
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise TorchOnTpuError(
          f"JSONL file '{path}' has a line that is not JSON ({e}); fix or remove it."
        ) from None
      if not isinstance(record, dict) or self.field not in record:
        present = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise TorchOnTpuError(
          f"JSONL file '{path}' has no field '{self.field}' (a record has fields {present}); "
          f"pass field= one of those."
        )
      docs.append(_as_text(record[self.field], self.field, path))
    return docs


class Parquet(Source):
  """Parquet files; the document is the string column `field`, read a row range at a time."""

  def __init__(self, paths: Sequence, *, field: str = "text", block_rows: int = BLOCK_ROWS):
    import pyarrow.parquet as pq

    self.paths = [Path(p) for p in paths]
    self.field = field
    self.name = _describe(self.paths)
    self._blocks = []
    for index, path in enumerate(self.paths):
      meta = pq.ParquetFile(path)
      columns = meta.schema_arrow.names
      if field not in columns:
        raise TorchOnTpuError(
          f"Parquet file '{path}' has no column '{field}' (it has {columns}); pass field= one of those."
        )
      for group in range(meta.num_row_groups):
        rows = meta.metadata.row_group(group).num_rows
        self._blocks += [(index, group, a, min(a + block_rows, rows)) for a in range(0, rows, block_rows)]
    self.fingerprint = _digest(["parquet", field, block_rows, [(p.name, p.stat().st_size) for p in self.paths]])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    import pyarrow.parquet as pq

    index, group, start, stop = self._blocks[block]
    table = pq.ParquetFile(self.paths[index]).read_row_group(group, columns=[self.field])
    values = table.column(0).slice(start, stop - start).to_pylist()
    return [_as_text(v, self.field, self.paths[index]) for v in values]


class HFDataset(Source):
  """A HF `datasets.Dataset` saved with `save_to_disk` (memory-mapped Arrow, read offline)."""

  def __init__(self, path, *, field: str = "text", block_rows: int = BLOCK_ROWS):
    import datasets

    self.path = Path(path)
    self.field = field
    self.name = str(path)
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
      raise TorchOnTpuError(
        f"'{path}' holds a DatasetDict with splits {list(ds)}; point at one split's directory "
        f"(e.g. '{Path(path) / next(iter(ds))}')."
      )
    if field not in ds.column_names:
      raise TorchOnTpuError(
        f"Dataset '{path}' has no column '{field}' (it has {ds.column_names}); pass field= one of those."
      )
    self._ds = ds.select_columns([field])
    self._blocks = [(a, min(a + block_rows, len(ds))) for a in range(0, len(ds), block_rows)]
    self.fingerprint = _digest(["hf", field, block_rows, ds._fingerprint, len(ds)])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    start, stop = self._blocks[block]
    return [_as_text(v, self.field, self.path) for v in self._ds[start:stop][self.field]]


def default_corpus() -> TextFiles:
  """The running interpreter's standard library `.py` files (no tests, no site-packages)."""
  paths = []
  for directory, subdirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
    subdirs[:] = [d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS]
    paths += [Path(directory, f) for f in files if f.endswith(".py")]
  paths.sort()
  version = ".".join(map(str, sys.version_info[:3]))
  return TextFiles(paths, name=f"python-stdlib-{version}")


def source(spec=None, *, field: str = "text", lines: bool = False) -> Source:
  """A `Source` from a spec: None (the default corpus), a path, a glob, or a list of them.

  A directory written by `datasets.save_to_disk` is a `HFDataset`; other
  directories stand for every file under them. `.jsonl`/`.ndjson` files are
  JSON lines and `.parquet` files Parquet (both read `field`); anything else is
  text (`lines=True`: a document per line).
  """
  if spec is None:
    return default_corpus()
  if isinstance(spec, Source):
    return spec
  specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
  paths: list[Path] = []
  for item in map(str, specs):
    if glob.has_magic(item):
      hits = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
      if not hits:
        raise TorchOnTpuError(f"Data glob '{item}' matches no files; check the pattern and the directory.")
      paths += hits
    elif not os.path.exists(item):
      raise TorchOnTpuError(f"Data path '{item}' does not exist; pass an existing file, directory or glob.")
    elif os.path.isdir(item):
      if any(os.path.exists(os.path.join(item, m)) for m in _HF_DATASET_MARKERS):
        if len(specs) > 1:
          raise TorchOnTpuError(f"Dataset directory '{item}' must be the only data path; pass it alone.")
        return HFDataset(item, field=field)
      hits = sorted(p for p in Path(item).rglob("*") if p.is_file() and not p.name.startswith("."))
      if not hits:
        raise TorchOnTpuError(f"Data directory '{item}' has no files; point at a directory with data files.")
      paths += hits
    else:
      paths.append(Path(item))
  kinds = {_kind(p) for p in paths}
  if len(kinds) > 1:
    raise TorchOnTpuError(f"Data paths mix file kinds {sorted(kinds)}; pass files of one kind.")
  kind = kinds.pop()
  if kind == "jsonl":
    return JsonLines(paths, field=field)
  if kind == "parquet":
    return Parquet(paths, field=field)
  return TextFiles(paths, lines=lines)


def _kind(path: Path) -> str:
  suffix = path.suffix.lower()
  return "jsonl" if suffix in _JSONL_SUFFIXES else "parquet" if suffix == ".parquet" else "text"


def _describe(paths: list[Path]) -> str:
  if len(paths) == 1:
    return str(paths[0])
  return f"{len(paths)} files under '{os.path.commonpath([str(p) for p in paths]) if paths else ''}'"


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _as_text(value, field, path) -> str:
  if value is None:
    return ""
  if not isinstance(value, str):
    raise TorchOnTpuError(
      f"Field '{field}' in '{path}' holds a {type(value).__name__}, not text; pass field= naming a text field."
    )
  return value


def _file_groups(sizes: list[int], block_bytes: int) -> list[list[int]]:
  """Consecutive files in groups of about `block_bytes` (a big file is a group alone)."""
  groups, current, total = [], [], 0
  for i, size in enumerate(sizes):
    if current and total + size > block_bytes:
      groups.append(current)
      current, total = [], 0
    current.append(i)
    total += size
  return groups + ([current] if current else [])


def _byte_ranges(sizes: list[int], block_bytes: int) -> list[tuple[int, int, int]]:
  return [
    (i, a, min(a + block_bytes, size)) for i, size in enumerate(sizes) for a in range(0, size, block_bytes)
  ]


def _read_lines(path: Path, start: int, end: int) -> list[bytes]:
  """The non-empty lines that *begin* in bytes [start, end): ranges split lines exactly."""
  with open(path, "rb") as f:
    if start:
      f.seek(start - 1)
      f.readline()  # the rest of a line that began before `start` belongs to the previous range
    position = f.tell()
    if position >= end:
      return []
    data = f.read(end - position)
    if not data.endswith(b"\n"):
      data += f.readline()
  return [line.rstrip(b"\r") for line in data.split(b"\n") if line.strip()]


def _in_validation(text: str, fraction: float) -> bool:
  """A stable, content-keyed split: the same document is held out on every machine."""
  digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2**64


# ---- tokenizers ---------------------------------------------------------------------


class Tokenizer:
  """A HF `tokenizers.Tokenizer` plus the EOS id that packing puts after each document."""

  def __init__(self, backend, eos_id: int, name: str):
    self.backend = backend
    self.eos_id = int(eos_id)
    self.name = name

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Token ids per text, without special tokens (packing adds EOS)."""
    return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

  def save_pretrained(self, directory) -> None:
    """Writes the files `transformers.AutoTokenizer.from_pretrained(directory)` loads:
    a tokenizer directory's own (its config and special tokens kept), else tokenizer.json with EOS named."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if Path(self.name).is_dir():
      hf = AutoTokenizer.from_pretrained(self.name, local_files_only=True)
    else:
      hf = PreTrainedTokenizerFast(tokenizer_object=self.backend, eos_token=self.backend.id_to_token(self.eos_id))
    hf.save_pretrained(str(directory))


def build_tokenizer(
  spec=None,
  *,
  vocab_size: int = DEFAULT_VOCAB_SIZE,
  cache_dir=None,
  corpus: Source | None = None,
  sample_bytes: int = 2_000_000,
  val_fraction: float = 0.02,
  eos_token: str | None = None,
) -> Tokenizer:
  """A tokenizer from `spec`, offline.

  `spec` is a `tokenizer.json` file, a HF tokenizer directory (read with
  `AutoTokenizer.from_pretrained(..., local_files_only=True)`), or None: a
  byte-level BPE of `vocab_size` trained on the train split of `corpus` (the
  default corpus if None) from about `sample_bytes` of text, cached in
  `cache_dir` (default `$TORCH_ON_TPU_CACHE` or `~/.cache/torch_on_tpu`) so it
  trains once per corpus and size. `eos_token` names the end-of-document token
  where the tokenizer does not say.
  """
  if isinstance(spec, Tokenizer):
    return spec
  if spec is None:
    if vocab_size <= 256:
      raise TorchOnTpuError(
        f"vocab_size {vocab_size} leaves no room for a byte-level BPE (256 byte tokens plus EOS); "
        f"use vocab_size >= 257."
      )
    return _cached_bpe(corpus or default_corpus(), vocab_size, cache_dir, sample_bytes, val_fraction)
  path = Path(spec)
  if not path.exists():
    raise TorchOnTpuError(
      f"Tokenizer path '{spec}' does not exist; pass a tokenizer.json, a tokenizer directory, or None."
    )
  if path.is_dir():
    return _pretrained(path, eos_token)
  import tokenizers

  backend = tokenizers.Tokenizer.from_file(str(path))
  return Tokenizer(backend, _eos_id(backend, eos_token, path), str(path))


def _pretrained(path: Path, eos_token: str | None) -> Tokenizer:
  from transformers import AutoTokenizer

  try:
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  except (OSError, ValueError) as e:
    raise TorchOnTpuError(
      f"Tokenizer directory '{path}' could not be loaded offline ({type(e).__name__}); point at a "
      f"directory written by save_pretrained that holds tokenizer.json."
    ) from None
  backend = getattr(hf, "backend_tokenizer", None)
  if backend is None:
    raise TorchOnTpuError(
      f"Tokenizer directory '{path}' has no fast tokenizer; save one with a tokenizer.json "
      f"(load it in transformers and call save_pretrained)."
    )
  if eos_token is None and hf.eos_token_id is not None:
    return Tokenizer(backend, hf.eos_token_id, str(path))
  return Tokenizer(backend, _eos_id(backend, eos_token, path), str(path))


def _eos_id(backend, eos_token: str | None, path) -> int:
  for token in (eos_token,) if eos_token else _EOS_CANDIDATES:
    token_id = backend.token_to_id(token)
    if token_id is not None:
      return token_id
  if eos_token:
    raise TorchOnTpuError(
      f"Tokenizer '{path}' has no token '{eos_token}'; pass eos_token= one of its special tokens."
    )
  raise TorchOnTpuError(
    f"Tokenizer '{path}' has none of the usual end-of-document tokens {list(_EOS_CANDIDATES)}; "
    f"pass eos_token= naming its EOS token."
  )


def _cached_bpe(corpus: Source, vocab_size, cache_dir, sample_bytes, val_fraction) -> Tokenizer:
  import tokenizers

  cache = Path(cache_dir or os.environ.get("TORCH_ON_TPU_CACHE") or Path.home() / ".cache" / "torch_on_tpu")
  key = _digest([corpus.fingerprint, vocab_size, sample_bytes, val_fraction, tokenizers.__version__])
  path = cache / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
  if not path.exists():
    backend = _train_bpe(corpus, vocab_size, sample_bytes, val_fraction)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    backend.save(str(partial))
    os.replace(partial, path)  # atomic: processes sharing the cache never see half a file
    logger.info("Trained a %d-token BPE on %s; cached at %s", vocab_size, corpus.name, path)
  backend = tokenizers.Tokenizer.from_file(str(path))
  return Tokenizer(backend, backend.token_to_id(EOS_TOKEN), str(path))


def _train_bpe(corpus: Source, vocab_size: int, sample_bytes: int, val_fraction: float):
  """Byte-level BPE from train-split documents of blocks spread over the corpus."""
  from tokenizers import Tokenizer as Backend
  from tokenizers import decoders, models, pre_tokenizers, trainers

  texts, total = [], 0
  for block in np.random.default_rng(0).permutation(len(corpus)):
    for text in corpus.read(int(block)):
      if text and not _in_validation(text, val_fraction):
        texts.append(text)
        total += len(text)
    if total >= sample_bytes:
      break
  if not texts:
    raise TorchOnTpuError(
      f"The corpus {corpus.name} has no training documents to learn a tokenizer from; point at non-empty data."
    )
  backend = Backend(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[EOS_TOKEN],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  backend.train_from_iterator(texts, trainer)
  return backend


def check_model_fit(
  tokenizer_vocab_size: int, model_vocab_size: int, seqlen: int, model_max_seqlen: int | None = None
) -> None:
  """Raises before anything compiles when the data cannot feed the model."""
  if tokenizer_vocab_size > model_vocab_size:
    raise TorchOnTpuError(
      f"The tokenizer has {tokenizer_vocab_size} tokens but the model's vocabulary has only "
      f"{model_vocab_size}; use a tokenizer with at most {model_vocab_size} tokens or a model with a larger "
      f"vocab_size."
    )
  if model_max_seqlen is not None and seqlen > model_max_seqlen:
    raise TorchOnTpuError(
      f"seqlen {seqlen} exceeds the model's maximum of {model_max_seqlen} positions; "
      f"use seqlen <= {model_max_seqlen}."
    )


# ---- one shard's document stream --------------------------------------------------------


@dataclasses.dataclass
class _Piece:
  """The tokens of consecutive documents of one block, each followed by EOS."""

  epoch: int
  block: int  # index into this shard's block list for `epoch`
  first_doc: int  # the block document `tokens` starts with
  tokens: np.ndarray
  starts: np.ndarray  # where each document begins in `tokens`
  cursor: int = 0  # next unconsumed token

  def position(self) -> list[int]:
    """`[epoch, block, doc, offset]` of the next unconsumed token."""
    doc = int(np.searchsorted(self.starts, self.cursor, side="right")) - 1
    return [self.epoch, self.block, self.first_doc + doc, self.cursor - int(self.starts[doc])]


class Stream:
  """One data shard's documents of one split, in order, epoch after epoch.

  Shard `s` of `S` owns blocks `s, s+S, ...` of a seeded permutation of all
  blocks and never reads another; each epoch `e` reorders its blocks with
  `(seed, e, s)` and the documents within a block with `(seed, e, block id)`.
  The default, shard 0 of 1, is the whole source.
  """

  def __init__(
    self,
    source: Source,
    tokenizer: Tokenizer,
    *,
    split: str = "train",
    val_fraction: float = 0.02,
    seed: int = 0,
    shuffle: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
  ):
    if split not in ("train", "val", "all"):
      raise TorchOnTpuError(f"split must be 'train', 'val' or 'all', got '{split}'.")
    self.source = source
    self.tokenizer = tokenizer
    self.split = split
    self.val_fraction = val_fraction
    self.seed = seed
    self.shuffle = shuffle
    self.shard_index = shard_index
    self.shard_count = shard_count
    if not 0 <= shard_index < shard_count:
      raise TorchOnTpuError(f"shard_index {shard_index} is outside 0..{shard_count - 1}; pass a valid index.")
    if not len(source):
      raise TorchOnTpuError(
        f"The corpus {source.name} has no documents (its files are empty); point at non-empty data."
      )
    if len(source) < shard_count:
      raise TorchOnTpuError(
        f"The corpus {source.name} has {len(source)} blocks, fewer than the {shard_count} data shards that "
        f"each need their own; pass num_shards <= {len(source)} or add data."
      )
    blocks = np.random.default_rng(seed).permutation(len(source)) if shuffle else np.arange(len(source))
    self._slice = blocks[shard_index::shard_count]
    self._order: tuple[int | None, np.ndarray] = (None, self._slice)

  def block_ids(self, epoch: int) -> np.ndarray:
    """The source blocks this shard reads in `epoch`, in order."""
    if not self.shuffle:
      return self._slice
    if self._order[0] != epoch:
      order = np.random.default_rng([self.seed, epoch, self.shard_index]).permutation(len(self._slice))
      self._order = (epoch, self._slice[order])
    return self._order[1]

  def documents(self, epoch: int, block: int) -> list[str]:
    """The split's documents of this shard's `block`-th block of `epoch`, in stream order."""
    block_id = int(self.block_ids(epoch)[block])
    docs = [t for t in self.source.read(block_id) if t]
    if self.split != "all":
      held_out = self.split == "val"
      docs = [t for t in docs if _in_validation(t, self.val_fraction) == held_out]
    if self.shuffle:
      order = np.random.default_rng([self.seed, epoch, block_id]).permutation(len(docs))
      docs = [docs[i] for i in order]
    return docs

  def epoch_documents(self, epoch: int) -> Iterator[str]:
    """Every document this shard reads in `epoch`, in stream order."""
    for block in range(len(self.block_ids(epoch))):
      yield from self.documents(epoch, block)

  def pieces(self, epoch: int = 0, block: int = 0, doc: int = 0, offset: int = 0) -> Iterator[_Piece]:
    """Tokenized runs of about `CHUNK_CHARS` of text from a stream position on, forever."""
    produced = 0
    while True:
      for k in range(block, len(self.block_ids(epoch))):
        docs = self.documents(epoch, k)
        while doc < len(docs):
          end = doc + 1
          size = len(docs[doc])
          while end < len(docs) and size + len(docs[end]) <= CHUNK_CHARS:
            size += len(docs[end])
            end += 1
          piece = self._piece(epoch, k, doc, docs[doc:end], offset)
          produced += len(piece.tokens)
          yield piece
          doc, offset = end, 0
        doc = 0
      if not produced:
        raise TorchOnTpuError(
          f"The corpus {self.source.name} has no {self.split} tokens for data shard {self.shard_index} of "
          f"{self.shard_count}; point at more data, pass a smaller num_shards, or (for split 'val') a larger "
          f"val_fraction."
        )
      epoch, block = epoch + 1, 0

  def _piece(self, epoch: int, block: int, first_doc: int, docs: list[str], offset: int) -> _Piece:
    eos = self.tokenizer.eos_id
    ids = self.tokenizer.encode_batch(docs)
    lengths = np.array([len(x) + 1 for x in ids])
    tokens = np.fromiter(
      itertools.chain.from_iterable(itertools.chain(x, (eos,)) for x in ids), np.int32, int(lengths.sum())
    )
    if offset >= lengths[0]:
      raise TorchOnTpuError(
        f"The saved data state points at token {offset} of a {lengths[0]}-token document; it was saved "
        f"with other data or another tokenizer, so restore it with the same ones."
      )
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return _Piece(epoch, block, first_doc, tokens, starts, cursor=offset)


# ---- packing and the batch iterator ------------------------------------------------------


def _pack(stream: Stream, position: list[int], rows: int, seqlen: int, with_positions: bool, with_segment_ids: bool):
  """Yields `(batch, position after it)`: `rows` windows of `seqlen + 1` tokens, `seqlen` apart."""
  need = rows * seqlen + 1
  pieces = stream.pieces(*position)
  buffer: collections.deque[_Piece] = collections.deque()
  available = 0
  while True:
    while available < need:
      piece = next(pieces)
      buffer.append(piece)
      available += len(piece.tokens) - piece.cursor
    tokens, starts, taken = [], [], 0
    for piece in buffer:
      stop = min(len(piece.tokens), piece.cursor + need - taken)
      tokens.append(piece.tokens[piece.cursor : stop])
      flags = np.zeros(stop - piece.cursor, bool)
      first = piece.starts[(piece.starts >= piece.cursor) & (piece.starts < stop)]
      flags[first - piece.cursor] = True
      starts.append(flags)
      taken += stop - piece.cursor
      if taken == need:
        break
    flat = np.concatenate(tokens)
    batch = {
      "input_ids": flat[:-1].reshape(rows, seqlen),
      "labels": flat[1:].reshape(rows, seqlen),
    }
    if with_positions or with_segment_ids:
      # A document starts at its first token and, for the rows' purposes, at every row start.
      begins = np.concatenate(starts)[:-1].reshape(rows, seqlen)
      begins[:, 0] = True
      if with_positions:
        index = np.arange(seqlen, dtype=np.int32)
        batch["positions"] = index - np.maximum.accumulate(np.where(begins, index, 0), axis=1)
      if with_segment_ids:
        batch["segment_ids"] = np.cumsum(begins, axis=1, dtype=np.int32) - 1
    consumed = need - 1
    available -= consumed
    while consumed:
      head = buffer[0]
      step = min(consumed, len(head.tokens) - head.cursor)
      head.cursor += step
      consumed -= step
      if head.cursor == len(head.tokens):
        buffer.popleft()
    yield batch, buffer[0].position()


def _rows(packers: list, start: int, stop: int):
  """Yields `(rows [start, stop) of the shards' batches stacked in order, each shard's position)`."""
  for parts in zip(*packers):
    batch = {k: np.concatenate([b[k] for b, _ in parts])[start:stop] for k in parts[0][0]}
    yield batch, [position for _, position in parts]


class _Raised:
  def __init__(self, error: BaseException):
    self.error = error


def _prefetch(items, out: queue.Queue, stop: threading.Event):
  try:
    for item in items:
      if stop.is_set():
        return
      out.put(item)
  except BaseException as e:  # handed to the consumer, who raises it
    out.put(_Raised(e))


def _shutdown(thread: threading.Thread, out: queue.Queue, stop: threading.Event):
  stop.set()
  while thread.is_alive():
    try:
      while True:
        out.get_nowait()  # unblocks a producer waiting to put
    except queue.Empty:
      pass
    thread.join(timeout=0.1)


class Batches:
  """An endless iterator of this process's batches (dicts of numpy arrays).

  A background thread keeps up to `prefetch` batches ready. `state()` is the
  position after the last batch *returned*, however far the thread has run.
  """

  def __init__(self, items: Iterator, state: dict, shards: range, gather: bool, prefetch: int):
    self._state = state
    self._shards = shards  # the data shards this process reads
    self._gather = gather
    self._error: BaseException | None = None
    self._closed = False
    self._first = next(items)  # user errors (empty data, bad records) surface here, before any compile
    self._items = items
    self._queue: queue.Queue | None = None
    if prefetch > 0:
      self._queue = queue.Queue(maxsize=prefetch)
      stop = threading.Event()
      thread = threading.Thread(target=_prefetch, args=(items, self._queue, stop), daemon=True, name="tot-data")
      thread.start()
      self._finalizer = weakref.finalize(self, _shutdown, thread, self._queue, stop)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._error is not None:
      raise self._error
    if self._closed:
      raise StopIteration
    if self._first is not None:
      item, self._first = self._first, None
    elif self._queue is None:
      item = next(self._items)
    else:
      item = self._queue.get()
      if isinstance(item, _Raised):
        self._error = item.error
        raise item.error
    batch, positions = item
    for shard, position in zip(self._shards, positions):
      self._state["shards"][shard] = position
    return batch

  def state(self) -> dict:
    """A small JSON-able dict; `batches(..., state=it.state())` continues exactly here, on any process count.

    It holds every shard's `[epoch, block, doc, offset]`: in a multi-process run
    it gathers the other processes' shards, so every process must call it
    together (the `Trainer` does). Simulated processes (`process_count=` in one
    jax process) hold only their own shards (None for the others): combine them
    with `merge_states`.
    """
    state = {**self._state, "shards": [None if p is None else list(p) for p in self._state["shards"]]}
    if self._gather:
      mine = np.full((len(state["shards"]), 4), -1, np.int32)
      for shard in self._shards:
        mine[shard] = state["shards"][shard]
      every = np.asarray(multihost_utils.process_allgather(mine)).max(axis=0)  # a shard's readers agree
      state["shards"] = every.tolist()
    return state

  def close(self) -> None:
    """Ends the iteration and stops the prefetch thread (also done when garbage collected)."""
    self._closed = True
    if self._queue is not None:
      self._finalizer()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def merge_states(states: Sequence[Mapping]) -> dict:
  """One state from the states of simulated processes, each holding its own shards' positions."""
  merged = dict(states[0])
  for other in states[1:]:
    settings = {k: v for k, v in other.items() if k != "shards"}
    if settings != {k: v for k, v in merged.items() if k != "shards"}:
      raise TorchOnTpuError(
        "The data states to merge come from runs with different data settings; merge one run's states."
      )
  merged["shards"] = [
    next((s["shards"][i] for s in states if s["shards"][i] is not None), None) for i in range(len(merged["shards"]))
  ]
  return merged


def default_num_shards(global_batch_size: int, num_blocks: int) -> int:
  """The largest divisor of the global batch that is at most the number of blocks (never the process count)."""
  return max(d for d in range(1, max(1, min(global_batch_size, num_blocks)) + 1) if global_batch_size % d == 0)


def batches(
  source_spec,
  tokenizer: Tokenizer,
  *,
  seqlen: int,
  global_batch_size: int,
  seed: int = 0,
  split: str = "train",
  val_fraction: float = 0.02,
  shuffle: bool = True,
  with_positions: bool = False,
  with_segment_ids: bool = False,
  num_shards: int | None = None,
  state: Mapping | None = None,
  prefetch: int = 2,
  process_index: int | None = None,
  process_count: int | None = None,
  field: str = "text",
) -> Batches:
  """This process's endless stream of packed batches: its rows of the global batch.

  Each global batch holds `global_batch_size / num_shards` rows from every data
  shard, in shard order; process `p` of `P` yields global rows
  `[p·B/P, (p+1)·B/P)` and reads only the shards they come from (when `P`
  divides `num_shards`, `num_shards / P` whole shards that no other process
  reads). The batch is the same for any process count. Rows are int32
  `input_ids` and `labels` (`[rows, seqlen]`), plus `positions` (each
  document's token index, 0 at document and row starts: torchtitan's
  document-masking convention) and `segment_ids` (document number within the
  row) when asked. `num_shards` defaults to `default_num_shards`;
  `source_spec` is a `Source` or anything `source()` takes; `state` is a
  previous `Batches.state()` (from any process count).
  """
  corpus = source(source_spec, field=field)
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise TorchOnTpuError(f"process_index {process_index} is outside 0..{process_count - 1}; pass a valid index.")
  if seqlen < 1 or global_batch_size < 1:
    raise TorchOnTpuError(
      f"seqlen and global_batch_size must be positive, got {seqlen} and {global_batch_size}."
    )
  if global_batch_size % process_count:
    raise TorchOnTpuError(
      f"global_batch_size {global_batch_size} does not divide over {process_count} processes; "
      f"use a multiple of {process_count}."
    )
  shards = default_num_shards(global_batch_size, len(corpus)) if num_shards is None else num_shards
  if shards < 1 or global_batch_size % shards:
    raise TorchOnTpuError(
      f"num_shards {shards} does not divide global_batch_size {global_batch_size}; pass a divisor of "
      f"{global_batch_size}."
    )
  config = dict(
    version=STATE_VERSION,
    source=corpus.fingerprint,
    tokenizer=f"{Path(tokenizer.name).name}:{tokenizer.vocab_size}",
    split=split,
    val_fraction=val_fraction,
    shuffle=shuffle,
    seed=seed,
    seqlen=seqlen,
    global_batch_size=global_batch_size,
    num_shards=shards,
  )
  rows = global_batch_size // shards
  local = global_batch_size // process_count
  start, stop = process_index * local, (process_index + 1) * local
  mine = range(start // rows, (stop - 1) // rows + 1)
  positions: list = [None] * shards
  for shard in mine:
    positions[shard] = [0, 0, 0, 0]
  if state is not None:
    for key, value in config.items():
      if state.get(key) != value:
        raise TorchOnTpuError(
          f"The data state was saved with {key}={state.get(key)!r} but this run has {key}={value!r}; "
          f"restore it with the same data settings."
        )
    for shard in mine:
      if state["shards"][shard] is None:
        raise TorchOnTpuError(
          f"The data state has no position for shard {shard} (it is one simulated process's part); restore "
          f"a state from all processes' Batches.state() or data.merge_states."
        )
      positions[shard] = [int(x) for x in state["shards"][shard]]
  packers = [
    _pack(
      Stream(
        corpus, tokenizer, split=split, val_fraction=val_fraction, seed=seed, shuffle=shuffle,
        shard_index=shard, shard_count=shards,
      ),
      positions[shard], rows, seqlen, with_positions, with_segment_ids,
    )
    for shard in mine
  ]
  items = _rows(packers, start - mine.start * rows, stop - mine.start * rows)
  gather = process_count > 1 and jax.process_count() > 1
  return Batches(items, {**config, "shards": positions}, mine, gather, prefetch)


def eval_batches(
  source_spec, tokenizer: Tokenizer, *, seqlen: int, global_batch_size: int, num_batches: int, **kwargs
) -> list[dict]:
  """A fixed list of this process's validation rows (split 'val', unshuffled), the same at every eval.

  One data shard by default: the held-out documents are few, and every process
  reads them all and keeps its rows, so the global batches are the same for
  any process count. They repeat if they hold fewer tokens than `num_batches`
  need; keyword arguments are those of `batches`.
  """
  kwargs = {"split": "val", "shuffle": False, "num_shards": 1, **kwargs, "prefetch": 0}
  it = batches(source_spec, tokenizer, seqlen=seqlen, global_batch_size=global_batch_size, **kwargs)
  return list(itertools.islice(it, num_batches))


# ---- onto the mesh --------------------------------------------------------------------------


def to_global(
  batch: Mapping[str, np.ndarray], mesh: Mesh, axes: Sequence[str] | None = None
) -> dict[str, jax.Array]:
  """This process's rows → global `jax.Array`s, dim 0 sharded over `axes`, the rest replicated.

  `axes` defaults to the mesh's data axes (`torch_on_tpu.mesh.data_axes`).
  Every process calls this with its own rows, in the same step.
  """
  axes = mesh_lib.data_axes(mesh) if axes is None else tuple(axes)
  for axis in axes:
    if axis not in mesh.shape:
      raise TorchOnTpuError(
        f"Batch axis '{axis}' is not in the mesh {dict(mesh.shape)}; pass axes from its names."
      )
  ways = math.prod(mesh.shape[a] for a in axes)
  lead = (axes[0] if len(axes) == 1 else axes) if axes else None
  if not axes and jax.process_count() > 1:
    raise TorchOnTpuError(
      f"The mesh {dict(mesh.shape)} has no data axis to split the processes' rows over; pass axes=."
    )
  out = {}
  for name, local in batch.items():
    local = np.asarray(local)
    rows = local.shape[0] * jax.process_count()
    if rows % ways:
      raise TorchOnTpuError(
        f"The global batch of {rows} rows ('{name}') does not divide over the {ways}-way data axes {axes}; "
        f"use a global batch size that is a multiple of {ways}."
      )
    sharding = NamedSharding(mesh, PartitionSpec(lead, *([None] * (local.ndim - 1))))
    out[name] = jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))
  return out
