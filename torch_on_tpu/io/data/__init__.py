"""Real training data: text → tokens → packed batches → per-process slices → global arrays.

    tok = data.build_tokenizer(None)                       # byte-level BPE on the default corpus
    train = data.batches(None, tok, seqlen=256, global_batch_size=16, with_positions=True)
    batch = next(train)                                    # this process's numpy rows
    arrays = data.to_global(batch, mesh)                   # global jax.Arrays, batch dim sharded
    # several processes: data.batches(..., process_index=i, process_count=n) with
    # i, n = data.process_rows(mesh) (pipeline stages on other processes read the same rows)
    saved = train.state()                                  # small JSON-able dict (all processes call it)
    train = data.batches(None, tok, seqlen=256, global_batch_size=16, state=saved)

One job per module: `sources` (documents in blocks), `tokenizer` (text →
ids), `stream` (a shard's token stream packed into rows), `chat`
(conversations packed whole, labels on the answers: `batches(...,
data_format="chat")`), `loader` (the
shards' rows of each global batch, prefetch, resumable state) and `placement`
(host rows → global arrays). Their public names are re-exported here.
"""

from torch_on_tpu.io.data import chat
from torch_on_tpu.io.data.loader import STATE_VERSION, Batches, batches, default_num_shards, eval_batches, merge_states
from torch_on_tpu.io.data.placement import process_rows, to_global
from torch_on_tpu.io.data.sources import (
  BLOCK_BYTES,
  BLOCK_ROWS,
  HFDataset,
  JsonFile,
  JsonLines,
  Parquet,
  Source,
  TextFiles,
  default_corpus,
  source,
)
from torch_on_tpu.io.data.stream import CHUNK_CHARS, EmptySplit, Stream
from torch_on_tpu.io.data.tokenizer import DEFAULT_VOCAB_SIZE, EOS_TOKEN, Tokenizer, build_tokenizer, check_model_fit

__all__ = [
  "BLOCK_BYTES",
  "BLOCK_ROWS",
  "CHUNK_CHARS",
  "DEFAULT_VOCAB_SIZE",
  "EOS_TOKEN",
  "EmptySplit",
  "STATE_VERSION",
  "Batches",
  "JsonFile",
  "HFDataset",
  "JsonLines",
  "Parquet",
  "Source",
  "Stream",
  "TextFiles",
  "Tokenizer",
  "batches",
  "build_tokenizer",
  "chat",
  "check_model_fit",
  "default_corpus",
  "default_num_shards",
  "eval_batches",
  "merge_states",
  "process_rows",
  "source",
  "to_global",
]
