"""Where documents come from: a corpus as numbered blocks, each one sequential read.

Blocks (a group of small files, a byte range of a JSONL file, a run of
Parquet/Arrow rows) are the unit a process reads and an epoch shuffles, so
a shard never reads what another shard owns. Everything is local: files on
disk, a HF `datasets` directory, or, with none given, the Python standard
library's own `.py` files, which every machine that runs this package has.
A document hash splits every source into train and a held-out validation set.
With `field=None` the record-holding sources (JSON lines, JSON, Parquet,
datasets) yield whole records (dicts) rather than text: chat data (`chat.py`)
reads its conversations from them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from torch_on_tpu.errors import TorchOnTpuError, named

BLOCK_BYTES = 256 * 1024
BLOCK_ROWS = 1024
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


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
    self.fingerprint = digest(["text", lines, block_bytes, [(p.name, s) for p, s in zip(self.paths, sizes)]])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    if self.lines:
      index, start, end = self._blocks[block]
      return [line.decode("utf-8", errors="replace") for line in _read_lines(self.paths[index], start, end)]
    return [self.paths[i].read_bytes().decode("utf-8", errors="replace") for i in self._blocks[block]]


class JsonLines(Source):
  """JSONL files, one JSON object per line; the document is the string in `field` (None: the record)."""

  def __init__(self, paths: Sequence, *, field: str | None = "text", block_bytes: int = BLOCK_BYTES):
    self.paths = [Path(p) for p in paths]
    self.field = field
    self.name = _describe(self.paths)
    sizes = [p.stat().st_size for p in self.paths]
    self._blocks = _byte_ranges(sizes, block_bytes)
    self.fingerprint = digest(["jsonl", field, block_bytes, [(p.name, s) for p, s in zip(self.paths, sizes)]])
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
      if self.field is None and isinstance(record, dict):
        docs.append(record)
        continue
      if not isinstance(record, dict) or self.field not in record:
        present = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise TorchOnTpuError(
          f"JSONL file '{path}' has no field '{self.field}' (a record has fields {present}); "
          f"name one of those with {named('field')}."
        )
      docs.append(_as_text(record[self.field], self.field, path))
    return docs


class Parquet(Source):
  """Parquet files; the document is the string column `field` (None: the row), read a row range at a time."""

  def __init__(self, paths: Sequence, *, field: str | None = "text", block_rows: int = BLOCK_ROWS):
    import pyarrow.parquet as pq

    self.paths = [Path(p) for p in paths]
    self.field = field
    self.name = _describe(self.paths)
    self._blocks = []
    for index, path in enumerate(self.paths):
      meta = pq.ParquetFile(path)
      columns = meta.schema_arrow.names
      if field is not None and field not in columns:
        raise TorchOnTpuError(
          f"Parquet file '{path}' has no column '{field}' (it has {columns}); name one of those with {named('field')}."
        )
      for group in range(meta.num_row_groups):
        rows = meta.metadata.row_group(group).num_rows
        self._blocks += [(index, group, a, min(a + block_rows, rows)) for a in range(0, rows, block_rows)]
    self.fingerprint = digest(["parquet", field, block_rows, [(p.name, p.stat().st_size) for p in self.paths]])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    import pyarrow.parquet as pq

    index, group, start, stop = self._blocks[block]
    table = pq.ParquetFile(self.paths[index]).read_row_group(group, columns=None if self.field is None else [self.field])
    if self.field is None:
      return table.slice(start, stop - start).to_pylist()
    values = table.column(0).slice(start, stop - start).to_pylist()
    return [_as_text(v, self.field, self.paths[index]) for v in values]


class HFDataset(Source):
  """A HF `datasets.Dataset` saved with `save_to_disk` (memory-mapped Arrow, read offline); `field=None`: whole rows."""

  def __init__(self, path, *, field: str | None = "text", block_rows: int = BLOCK_ROWS):
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
    if field is not None and field not in ds.column_names:
      raise TorchOnTpuError(
        f"Dataset '{path}' has no column '{field}' (it has {ds.column_names}); name one of those with {named('field')}."
      )
    self._ds = ds if field is None else ds.select_columns([field])
    self._blocks = [(a, min(a + block_rows, len(ds))) for a in range(0, len(ds), block_rows)]
    self.fingerprint = digest(["hf", field, block_rows, ds._fingerprint, len(ds)])

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    start, stop = self._blocks[block]
    if self.field is None:
      return [self._ds[i] for i in range(start, stop)]
    return [_as_text(v, self.field, self.path) for v in self._ds[start:stop][self.field]]


class JsonFile(Source):
  """`.json` files each holding an array of records (or JSON lines), as `datasets.load_dataset("json")`
  reads them; a file is parsed whole, once, and cut into blocks of `block_rows` records."""

  def __init__(self, paths: Sequence, *, field: str | None = "text", block_rows: int = BLOCK_ROWS):
    self.paths = [Path(p) for p in paths]
    self.field = field
    self.name = _describe(self.paths)
    self._records = [self._load(p) for p in self.paths]
    self._blocks = [(i, a, min(a + block_rows, len(r))) for i, r in enumerate(self._records) for a in range(0, len(r), block_rows)]
    self.fingerprint = digest(["json", field, block_rows, [(p.name, p.stat().st_size) for p in self.paths]])
    if self._blocks:
      self.read(0)  # a wrong field name fails here

  @staticmethod
  def _load(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    try:
      records = json.loads(text)
    except json.JSONDecodeError:
      try:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
      except json.JSONDecodeError as e:
        raise TorchOnTpuError(f"JSON file '{path}' is neither a JSON array nor JSON lines ({e}); fix it.") from None
    if isinstance(records, dict) and len(records) == 1 and isinstance(next(iter(records.values())), list):
      records = next(iter(records.values()))  # {"data": [...]}: the one list it holds
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
      raise TorchOnTpuError(f"JSON file '{path}' does not hold a list of records (JSON objects); write one.")
    return records

  def __len__(self):
    return len(self._blocks)

  def read(self, block):
    index, start, stop = self._blocks[block]
    records = self._records[index][start:stop]
    if self.field is None:
      return records
    missing = next((r for r in records if self.field not in r), None)
    if missing is not None:
      raise TorchOnTpuError(
        f"JSON file '{self.paths[index]}' has no field '{self.field}' (a record has fields {sorted(missing)}); "
        f"name one of those with {named('field')}."
      )
    return [_as_text(r[self.field], self.field, self.paths[index]) for r in records]


def default_corpus() -> TextFiles:
  """The running interpreter's standard library `.py` files (no tests, no site-packages)."""
  paths = []
  for directory, subdirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
    subdirs[:] = [d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS]
    paths += [Path(directory, f) for f in files if f.endswith(".py")]
  paths.sort()
  version = ".".join(map(str, sys.version_info[:3]))
  return TextFiles(paths, name=f"python-stdlib-{version}")


def source(spec=None, *, field: str | None = "text", lines: bool = False, records: bool = False) -> Source:
  """A `Source` from a spec: None (the default corpus), a path, a glob, or a list of them.

  A directory written by `datasets.save_to_disk` is a `HFDataset`; other
  directories stand for every file under them. `.jsonl`/`.ndjson` files are
  JSON lines and `.parquet` files Parquet (both read `field`); anything else is
  text (`lines=True`: a document per line). `records=True` asks for records
  (chat data): `.json` files are then a `JsonFile`, text files are refused.
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
        return HFDataset(item, field=field)  # whole rows with field=None
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
  if records and kind == "text" and all(p.suffix.lower() == ".json" for p in paths):
    return JsonFile(paths, field=field)
  if records and kind == "text":
    raise TorchOnTpuError(
      f"Data file '{paths[0]}' is plain text, which holds no records; chat data is JSON, JSONL, Parquet or a datasets directory."
    )
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


def digest(obj) -> str:
  """A short key of JSON-able settings: a source's fingerprint, the tokenizer cache's file name."""
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _as_text(value, field, path) -> str:
  if value is None:
    return ""
  if not isinstance(value, str):
    raise TorchOnTpuError(
      f"Field '{field}' in '{path}' holds a {type(value).__name__}, not text; name a text field with {named('field')}."
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


def in_validation(text: str, fraction: float) -> bool:
  """A stable, content-keyed split: the same document is held out on every machine."""
  key = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
  return int.from_bytes(key, "little") < fraction * 2**64
