"""Chat data: conversations → tokens whose labels are the assistant's answers only, packed whole.

A record gives a conversation, a list of `{"role", "content"}` messages: its `messages`
field, role:field pairs (`user:question,assistant:answer`: one message per field, in
that order), or any `sample_processor(record) -> messages`. It is rendered with the
tokenizer's chat template where it has one, else with `PLAIN`, our own:

    <|user|>\\n{content}\\n<|assistant|>\\n{content}<EOS>

(every message a `<|role|>` line and its content; an assistant's content ends with EOS
rather than a newline). A sample is its tokens `t` (EOS-terminated): inputs `t[:-1]`,
labels `t[1:]` with -100 (`IGNORE_INDEX`, which cross-entropy skips) on every token that
is not part of an assistant answer, so only answers train (each assistant turn of a
multi-turn conversation). Rows hold whole samples greedily, as torchtitan's
`ChatDataset`: a sample that does not fit starts the next row, the row's rest is EOS
with -100 labels, a sample longer than a row is dropped (as is one with no answer),
and positions restart at 0 at each sample (document masking). A row never splits a
sample, so the stream position of the next sample, `[epoch, block, doc, 0]`, is the
whole resumable state, as for text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import numpy as np

from torch_on_tpu.errors import TorchOnTpuError, arg, named
from torch_on_tpu.io.data.sources import Source, digest, source
from torch_on_tpu.io.data.stream import EmptySplit, Stream
from torch_on_tpu.io.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
DEFAULT_FIELD = "messages"
PLAIN = "<|{role}|>\n"  # our template's header line of a message (used where the tokenizer has no chat template)


class Conversations(Source):
  """A source of records seen as conversations: each document is its messages as a JSON list
  (which the train/validation hash and the stream handle like any text; "" for none)."""

  def __init__(self, records: Source, *, field: str = DEFAULT_FIELD, sample_processor: Callable | None = None):
    self.records = records
    self.name = records.name
    self.field = field
    self._processor = sample_processor or _processor_for(field, records.name)
    how = f"processor:{getattr(sample_processor, '__qualname__', type(sample_processor).__name__)}" if sample_processor else field
    self.fingerprint = digest(["chat", records.fingerprint, how])
    if len(records):
      self.read(0)  # a wrong field or a malformed conversation fails here, not minutes into training

  def __len__(self):
    return len(self.records)

  def read(self, block: int) -> list[str]:
    return [_as_json(self._processor(record), self.name) for record in self.records.read(block)]

  def texts(self) -> Source:
    """The conversations as our template renders them: what a tokenizer trained on this data learns from."""
    return _Rendered(self)


class _Rendered(Source):
  def __init__(self, conversations: Conversations):
    self._conversations = conversations
    self.name = conversations.name
    self.fingerprint = digest(["chat-text", conversations.fingerprint, PLAIN])

  def __len__(self):
    return len(self._conversations)

  def read(self, block):
    return ["".join(text for text, _ in _plain_segments(json.loads(d))) if d else "" for d in self._conversations.read(block)]


def conversations(spec, *, field: str | None = None, sample_processor: Callable | None = None) -> Conversations:
  """`Conversations` from a data spec (JSON, JSONL, Parquet files or a datasets directory, as `source` reads them)."""
  if isinstance(spec, Conversations):
    return spec
  if spec is None:
    raise TorchOnTpuError(
      f"Chat data needs files of conversations (the built-in corpus is plain text); name them with {named('data')}."
    )
  return Conversations(source(spec, field=None, records=True), field=field or DEFAULT_FIELD, sample_processor=sample_processor)


def _processor_for(field: str, name: str) -> Callable:
  """record → messages: the list in `field`, or one message per `role:field` pair."""
  pairs = [p.split(":", 1) for p in field.split(",")] if ":" in field else None
  if pairs is not None and any(len(p) != 2 or not all(p) for p in pairs):
    raise TorchOnTpuError(f"{arg('field', field)} is neither a field name nor role:field pairs (user:question,assistant:answer); write one.")
  wanted = [f for _, f in pairs] if pairs else [field]

  def messages(record):
    missing = [f for f in wanted if f not in record]
    if missing:
      raise TorchOnTpuError(
        f"Chat data {name} has no field '{missing[0]}' (a record has fields {sorted(record)}); name the conversation's "
        f"field with {named('field')}, or role:field pairs such as user:question,assistant:answer."
      )
    if pairs is None:
      return record[field]
    return [{"role": role, "content": record[f]} for role, f in pairs]

  return messages


def _as_json(messages, name: str) -> str:
  """A conversation as canonical JSON text, checked: a list of {role, content} with text in both."""
  if not isinstance(messages, (list, tuple)) or not all(
    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), (str, type(None))) for m in messages
  ):
    raise TorchOnTpuError(
      f"Chat data {name} has a conversation that is not a list of {{'role': ..., 'content': ...}} messages with text "
      f"(got {str(messages)[:80]!r}); fix the data or its sample_processor."
    )
  return json.dumps([{"role": m["role"], "content": m.get("content") or ""} for m in messages], ensure_ascii=False) if messages else ""


def _plain_segments(messages: list[dict]) -> list[tuple[str, bool]]:
  """Our template as (text, is answer) pieces; an answer's closing EOS is added by `encode`."""
  segments = []
  for m in messages:
    segments.append((PLAIN.format(role=m["role"]), False))
    answer = m["role"] == "assistant"
    segments.append((m["content"] if answer else m["content"] + "\n", answer))
  return segments


def encode(tokenizer: Tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, which of them are answer tokens) of one conversation, ending with EOS."""
  if tokenizer.chat is not None:
    ids, answer = _templated(tokenizer, messages)
  else:
    ids, answer = [], []
    for text, is_answer in _plain_segments(messages):
      piece = tokenizer.encode_batch([text])[0] if text else []
      ids += piece
      answer += [is_answer] * len(piece)
      if is_answer:
        ids.append(tokenizer.eos_id)
        answer.append(True)
  if not ids or ids[-1] != tokenizer.eos_id:
    ids.append(tokenizer.eos_id)
    answer.append(bool(messages) and messages[-1]["role"] == "assistant")
  return np.asarray(ids, np.int32), np.asarray(answer, bool)


def _templated(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
  """The chat template's text, each assistant turn located as the text its message adds (what
  torchtitan does for one turn: the prompt rendered with the generation prompt is the prefix);
  a token is an answer token where it starts inside such a span."""

  def render(turns, prompt=False):
    return tokenizer.chat.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt).rstrip("\n")

  full, spans = render(messages), []
  for j, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    before, after = render(messages[:j], prompt=True) if j else "", render(messages[: j + 1])
    if not (full.startswith(after) and after.startswith(before)):
      raise TorchOnTpuError(
        f"The chat template of tokenizer {tokenizer.name} renders a conversation's earlier turns differently once later "
        f"ones follow, so its answers cannot be located; train on single-turn conversations or with a tokenizer without it."
      )
    spans.append((len(before), len(after)))
  encoding = tokenizer.backend.encode(full, add_special_tokens=False)
  answer = [any(a <= start < b for a, b in spans) for start, _ in encoding.offsets]
  return list(encoding.ids), answer


class Stats:
  """What the chat packing kept and dropped so far (all shards of a loader); the first drop is logged."""

  def __init__(self, seqlen: int):
    self.seqlen = seqlen
    self.kept = self.too_long = self.no_answer = 0

  def drop(self, too_long: bool, name: str) -> None:
    if not (self.too_long or self.no_answer):
      logger.warning(
        "Chat data %s: a sample %s is dropped (so is every such one; the run's end gives the count).",
        name, f"longer than seqlen {self.seqlen}" if too_long else "without an assistant answer",
      )
    if too_long:
      self.too_long += 1
    else:
      self.no_answer += 1

  def line(self) -> str | None:
    """One sentence for the run's output when samples were dropped; None when none were."""
    if not (self.too_long or self.no_answer):
      return None
    return (
      f"Chat data: {self.too_long} samples longer than {arg('seqlen', self.seqlen)} and {self.no_answer} without an "
      f"assistant answer were dropped ({self.kept} kept so far)."
    )


def _samples(stream: Stream, position: list[int], seqlen: int, stats: Stats) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
  """`(position, inputs, labels)` of every kept sample from a stream position on, forever."""
  epoch, block, doc, offset = position
  if offset:
    raise TorchOnTpuError(
      f"The saved data state points into a chat sample (offset {offset}); it was saved with text data, so restore it "
      f"with the same data settings."
    )
  kept = seen = 0
  while True:
    for k in range(block, len(stream.block_ids(epoch))):
      docs = stream.documents(epoch, k)
      for d in range(doc, len(docs)):
        seen += 1
        ids, answer = encode(stream.tokenizer, json.loads(docs[d]))
        labels = np.where(answer[1:], ids[1:], IGNORE_INDEX).astype(np.int32)
        if len(ids) - 1 > seqlen or not (labels != IGNORE_INDEX).any():
          stats.drop(len(ids) - 1 > seqlen, stream.source.name)
          continue
        kept += 1
        stats.kept += 1
        yield [epoch, k, d, 0], ids[:-1], labels
      doc = 0
    if not seen:
      raise EmptySplit(
        f"The corpus {stream.source.name} has no {stream.split} conversations for data shard {stream.shard_index} of "
        f"{stream.shard_count}; {stream._fixes()}."
      )
    if not kept:
      raise TorchOnTpuError(
        f"Every chat sample of {stream.source.name} is longer than {arg('seqlen', seqlen)} or has no assistant answer; "
        f"raise seqlen or check the conversations."
      )
    epoch, block = epoch + 1, 0


def pack(stream: Stream, position: list[int], rows: int, seqlen: int, with_positions: bool, with_segment_ids: bool,
         stats: Stats | None = None):
  """Yields `(batch, position after it)`: `rows` rows of whole samples, each padded with EOS (labels -100)."""
  stats = stats or Stats(seqlen)
  samples = _samples(stream, list(position), seqlen, stats)
  pending = next(samples)
  eos = stream.tokenizer.eos_id
  while True:
    inputs = np.full((rows, seqlen), eos, np.int32)
    labels = np.full((rows, seqlen), IGNORE_INDEX, np.int32)
    positions = np.zeros((rows, seqlen), np.int32)
    segments = np.zeros((rows, seqlen), np.int32)
    for r in range(rows):
      used = count = 0
      while used + len(pending[1]) <= seqlen:  # an empty row always takes the next sample (it is at most seqlen)
        _, x, y = pending
        inputs[r, used : used + len(x)], labels[r, used : used + len(x)] = x, y
        positions[r, used : used + len(x)], segments[r, used : used + len(x)] = np.arange(len(x)), count
        used, count = used + len(x), count + 1
        pending = next(samples)
      positions[r, used:], segments[r, used:] = np.arange(seqlen - used), count  # the padding: a document of its own
    batch = {"input_ids": inputs, "labels": labels}
    if with_positions:
      batch["positions"] = positions
    if with_segment_ids:
      batch["segment_ids"] = segments
    yield batch, list(pending[0])
