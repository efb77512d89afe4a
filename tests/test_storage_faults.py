"""Storage faults outside the checkpoint directory: the log directory (metrics, TensorBoard,
the plot), an export, jax's compilation cache, the tokenizer cache, and the tracebacks a
failed save's threads leave behind. Each is one sentence naming the path and its free
space; nothing half-written stays. (Checkpoint saves on a full disk: test_checkpoint_faults;
the whole recipe under the launcher: test_process_faults.)"""

from __future__ import annotations

import logging
import types

import pytest
import torch

import torch_on_tpu as tot
from tests.test_checkpoint_faults import tmpfs
from torch_on_tpu.core import storage
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import data, export
from torch_on_tpu.training import metrics


def one_sentence(message: str) -> bool:
  return "\n" not in message and message.endswith(".") and "Traceback" not in message


def test_a_full_log_directory_names_the_metrics_file_and_the_plot_leaves_nothing_half_written(tmp_path, monkeypatch):
  monkeypatch.setattr(metrics, "_tensorboard_writer", lambda directory: None)  # TensorBoard: its own case below
  with tmpfs(tmp_path / "disk", size="64k") as disk:
    log = metrics.RunLog(disk / "run")
    with pytest.raises(TorchOnTpuError) as err:
      for step in range(100_000):
        log.log(step, {"loss": 1.0 / (step + 1), "note": "x" * 200})
    message = str(err.value)
    assert message.startswith(f"Could not write the metrics log to {disk / 'run' / 'metrics.jsonl'}: the filesystem is full (")
    assert "MiB free of 0.1 MiB" in message and message.endswith("free space there or pass another --log_dir.")
    assert one_sentence(message)
    with pytest.raises(TorchOnTpuError, match=r"Could not write the training plot to .*training\.png: the filesystem is full"):
      log.plot()
    assert sorted(p.name for p in (disk / "run").iterdir()) == ["metrics.jsonl"]  # no partial PNG


def test_tensorboard_on_a_full_disk_is_named(tmp_path):
  with tmpfs(tmp_path / "disk", size="16k") as disk:
    with pytest.raises(TorchOnTpuError) as err:
      log = metrics.RunLog(disk / "run")
      for step in range(100_000):
        log.log(step, {f"metric_{i}": float(i) for i in range(50)})
      log.close()
    assert one_sentence(str(err.value))
    assert f"to {disk / 'run'}" in str(err.value) and "the filesystem is full" in str(err.value)


def test_an_export_to_a_full_disk_is_named_and_leaves_the_directory_as_it_was(tmp_path):
  jm = tot.ShardedModule(torch.nn.Linear(256, 256), mesh=tot.make_mesh(fsdp=-1))
  with tmpfs(tmp_path / "disk", size="128k") as disk:
    with pytest.raises(TorchOnTpuError) as err:
      export.export_safetensors(jm, disk / "out")
    message = str(err.value)
    assert message.startswith(f"Could not write the export to {disk / 'out'}: the filesystem is full (")
    assert f"{disk / 'out'} is as it was" in message and one_sentence(message)
    assert list(disk.iterdir()) == []  # the temporary directory is gone too


def test_a_compile_cache_that_cannot_be_written_is_said_once_and_its_cut_entries_removed(tmp_path, caplog):
  cache = tmp_path / "jax"
  cache.mkdir()
  (cache / "jit_f-aaa-cache").write_bytes(b"")  # what a failed write leaves
  (cache / "jit_g-bbb-cache").write_bytes(b"\x00" * 100)  # cut short
  (cache / "jit_h-ccc-cache").write_bytes(b"\x00" * 100)  # a good entry of another program
  shown = []
  storage.watch_compile_cache(cache)
  show = storage._show_warning(lambda *args: shown.append(args))
  full = "Error writing persistent compilation cache entry for 'jit_g': OSError: [Errno 28] No space left on device"
  with caplog.at_level(logging.WARNING, logger="torch_on_tpu.core.storage"):
    for _ in range(3):
      show(UserWarning(full), UserWarning, "compiler.py", 833)
    show(UserWarning("something else"), UserWarning, "x.py", 1)
  said = [r.getMessage() for r in caplog.records]
  assert len(said) == 1 and said[0].startswith(f"Could not write compiled programs to {cache}: the filesystem is full (")
  assert said[0].endswith("the run goes on, compiling what it cannot cache; free space there or pass --compile_cache=off.")
  assert len(shown) == 1  # other warnings pass through
  assert sorted(p.name for p in cache.iterdir()) == ["jit_h-ccc-cache"]


def test_a_tokenizer_cache_on_a_full_disk_is_said_and_the_run_goes_on(tmp_path, caplog):
  texts = tmp_path / "corpus.txt"
  texts.write_text("\n".join(f"document {i} about torch and jax on tpus" for i in range(400)))
  corpus = data.source(str(texts))
  with tmpfs(tmp_path / "disk", size="4k") as disk, caplog.at_level(logging.WARNING, logger="torch_on_tpu.core.storage"):
    tokenizer = data.build_tokenizer(None, vocab_size=300, corpus=corpus, cache_dir=disk)
    assert tokenizer.decode(tokenizer.encode_batch(["document 7 about jax"])[0]) == "document 7 about jax"
    assert [p.name for p in (disk / "tokenizers").iterdir()] == []  # no partial file
  said = [r.getMessage() for r in caplog.records]
  assert len(said) == 1 and said[0].startswith("Could not write the trained tokenizer to ")
  assert "the run goes on without caching it" in said[0]


def test_the_threads_copies_of_a_storage_fault_print_nothing():
  storage.quiet_thread_tracebacks()
  shown = []
  hook = storage._unraisable_hook(shown.append)
  unraisable = lambda e: types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=None, err_msg=None, object=None)  # noqa: E731
  hook(unraisable(RuntimeError("Event loop is closed")))  # a tensorstore write finishing after its save failed
  hook(unraisable(ValueError("a real bug")))
  assert [str(u.exc_value) for u in shown] == ["a real bug"]
  # asyncio's "never retrieved" for the write futures of a save that hit a full disk
  record = logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "Future exception was never retrieved", None,
                             (ValueError, ValueError("RESOURCE_EXHAUSTED: [os_error_code='28']"), None))
  assert not logging.getLogger("asyncio").filters[0].filter(record)
  record.exc_info = (ValueError, ValueError("a real bug"), None)
  assert logging.getLogger("asyncio").filters[0].filter(record)
  # TensorBoard's writer thread dying on a full disk (RunLog raises the same fault)
  seen = []
  thread_hook = storage._thread_hook(seen.append)
  writer = type("_AsyncWriterThread", (), {})()
  thread_hook(types.SimpleNamespace(thread=writer, exc_value=OSError(28, "No space left on device")))
  thread_hook(types.SimpleNamespace(thread=writer, exc_value=ValueError("a real bug")))
  assert len(seen) == 1


def test_errno_is_read_from_causes_but_not_from_a_suppressed_context():
  full = OSError(28, "No space left on device")
  try:
    try:
      raise full
    except OSError:
      raise TorchOnTpuError("already one sentence") from None
  except TorchOnTpuError as e:
    assert storage.error_code(e) is None
  assert storage.error_code(RuntimeError("Failed writing (os error 28)")) == 28  # tokenizers' (Rust) form
  assert storage.error_code(ValueError("[Errno 2] No such file")) is None  # only real OSErrors count
