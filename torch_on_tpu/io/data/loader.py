"""This process's batches: the shards' rows of each global batch, prefetched, with a resumable state.

A global batch is the same number of rows from every data shard, in shard
order; the shard count does not depend on the process count, so the batch is
the same for any number of processes, and a process reads only the shards its
rows come from. The shards' positions are the whole iterator state: restoring
it re-reads one block per shard and continues exactly, on any process count.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from torch_on_tpu.errors import TorchOnTpuError, arg, args
from torch_on_tpu.io.data import chat
from torch_on_tpu.io.data.sources import source
from torch_on_tpu.io.data.stream import Stream, pack
from torch_on_tpu.io.data.tokenizer import Tokenizer

STATE_VERSION = 2


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

  def __init__(self, items: Iterator, state: dict, shards: range, gather: bool, prefetch: int, stats=None):
    self.stats = stats  # chat data's `chat.Stats` (kept and dropped samples); None for text
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

  @property
  def settings(self) -> dict:
    """What decides the order of the batches (corpus, tokenizer, seed, shapes, shards),
    without the positions: equal on every process of a run (the `Trainer` checks)."""
    return {k: v for k, v in self._state.items() if k != "shards"}

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
  field: str | None = None,
  data_format: str = "text",
  sample_processor=None,
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
  previous `Batches.state()` (from any process count). `field` is the text's
  (default "text"). `data_format="chat"` reads conversations instead (`chat`:
  `field` default "messages", or `sample_processor(record) -> messages`):
  rows of whole samples whose labels are -100 but on the answers.
  """
  if data_format not in ("text", "chat"):
    raise TorchOnTpuError(f"{arg('data_format', data_format)} is not one of text, chat; pick one of those.")
  is_chat = data_format == "chat"
  if is_chat:
    corpus = chat.conversations(source_spec, field=field, sample_processor=sample_processor)
  else:
    corpus = source(source_spec, field=field or "text")
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise TorchOnTpuError(f"process_index {process_index} is outside 0..{process_count - 1}; pass a valid index.")
  if seqlen < 1 or global_batch_size < 1:
    raise TorchOnTpuError(f"{args(dict(seqlen=seqlen, global_batch_size=global_batch_size))}: both must be positive.")
  if global_batch_size % process_count:
    raise TorchOnTpuError(
      f"{arg('global_batch_size', global_batch_size)} does not divide over {process_count} processes; "
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
    **({"format": "chat"} if is_chat else {}),
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
  stats = chat.Stats(seqlen) if is_chat else None
  packers = [
    (functools.partial(chat.pack, stats=stats) if is_chat else pack)(
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
  return Batches(items, {**config, "shards": positions}, mine, gather, prefetch, stats)


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
