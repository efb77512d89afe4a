"""Text → token ids, offline: a tokenizer file or directory, or a byte-level BPE trained once and cached.

Training is deterministic, so hosts that each train their own get the same
tokenizer; the cache file is written atomically, so hosts sharing it never
read half a file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from torch_on_tpu.core import storage
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io.data.sources import Source, default_corpus, digest, in_validation

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 2048  # torchtitan's Llama 3 debugmodel vocabulary
EOS_TOKEN = "<|endoftext|>"
# Names tokenizers commonly give their end-of-document token, tried in order.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class Tokenizer:
  """A HF `tokenizers.Tokenizer` plus the EOS id that packing puts after each document.

  `chat` is the transformers tokenizer of a directory whose config has a chat template
  (chat data renders conversations with it); None elsewhere.
  """

  def __init__(self, backend, eos_id: int, name: str, chat=None):
    self.backend = backend
    self.eos_id = int(eos_id)
    self.name = name
    self.chat = chat

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
  chat = hf if getattr(hf, "chat_template", None) else None
  if eos_token is None and hf.eos_token_id is not None:
    return Tokenizer(backend, hf.eos_token_id, str(path), chat)
  return Tokenizer(backend, _eos_id(backend, eos_token, path), str(path), chat)


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
  key = digest([corpus.fingerprint, vocab_size, sample_bytes, val_fraction, tokenizers.__version__])
  path = cache / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
  if path.exists():
    backend = tokenizers.Tokenizer.from_file(str(path))
  else:
    backend = _train_bpe(corpus, vocab_size, sample_bytes, val_fraction)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with storage.cache_write("the trained tokenizer", path, partial=partial, elsewhere="set TORCH_ON_TPU_CACHE elsewhere"):
      path.parent.mkdir(parents=True, exist_ok=True)
      backend.save(str(partial))
      os.replace(partial, path)  # atomic: processes sharing the cache never see half a file
      logger.info("Trained a %d-token BPE on %s; cached at %s", vocab_size, corpus.name, path)
  return Tokenizer(backend, backend.token_to_id(EOS_TOKEN), str(path))


def _train_bpe(corpus: Source, vocab_size: int, sample_bytes: int, val_fraction: float):
  """Byte-level BPE from train-split documents of blocks spread over the corpus."""
  from tokenizers import Tokenizer as Backend
  from tokenizers import decoders, models, pre_tokenizers, trainers

  texts, total = [], 0
  for block in np.random.default_rng(0).permutation(len(corpus)):
    for text in corpus.read(int(block)):
      if text and not in_validation(text, val_fraction):
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
