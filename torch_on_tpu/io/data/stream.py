"""One data shard's token stream and its packing into rows.

A shard packs its documents, each followed by EOS, into one token stream and
cuts rows of `seqlen + 1` tokens every `seqlen` tokens: `input_ids` is a row
without its last token, `labels` without its first, so every token is an
input once and (after the first) a label once. The stream is a pure function
of the seed and the position `(epoch, block, document, token offset)`, which
is why that position is all a resumable state needs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np

from torch_on_tpu.errors import TorchOnTpuError, arg, named, settable
from torch_on_tpu.io.data.sources import Source, in_validation
from torch_on_tpu.io.data.tokenizer import Tokenizer

CHUNK_CHARS = 32 * 1024  # text tokenized at a time, so a shard starts without tokenizing a whole block


class EmptySplit(TorchOnTpuError):
  """A data shard's split holds no documents at all (a small corpus has no held-out ones)."""


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
        f"each need their own; pass {arg('num_shards', len(source))} or fewer, or add data."
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
      docs = [t for t in docs if in_validation(t, self.val_fraction) == held_out]
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
        raise EmptySplit(
          f"The corpus {self.source.name} has no {self.split} tokens for data shard {self.shard_index} of "
          f"{self.shard_count}; {self._fixes()}."
        )
      epoch, block = epoch + 1, 0

  def _fixes(self) -> str:
    """What the user can change for an empty split, in the arguments (or flags) they have."""
    fixes = ["point at more data"]
    if self.shard_count > 1 and settable("num_shards"):
      fixes.append(f"pass a smaller {named('num_shards')}")
    if self.split == "val":
      if settable("val_fraction"):
        fixes.append(f"hold out more documents with a larger {named('val_fraction')}")
      fixes.append(f"evaluate nothing with {arg('eval_every', 0)}")
    return ", ".join(fixes[:-1]) + f" or {fixes[-1]}" if len(fixes) > 1 else fixes[0]

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


def pack(stream: Stream, position: list[int], rows: int, seqlen: int, with_positions: bool, with_segment_ids: bool):
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
