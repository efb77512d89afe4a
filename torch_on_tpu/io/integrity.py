"""Checksums of a checkpoint's files, written when it is saved and checked before it is read.

Orbax's files carry no checksums of their own: flipped bytes in an array file
restore as different numbers, without a word. Each step directory gets a
`checksums.json` (size and sha256 of every file of its items: `state/`,
`data/`, `config/`; orbax rewrites its own top-level bookkeeping files when it
commits), written after all the data is on disk and before the step becomes
visible, so a complete step always has one. `problem` names the first file that is missing, has
another size or another hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "checksums.json"
_CHUNK = 8 * 2**20


def write_manifest(step_dir: Path) -> None:
  """Records size and sha256 of every file in the items under `step_dir` (written atomically)."""
  files = {
    str(p.relative_to(step_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)}
    for p in sorted(step_dir.glob("*/**/*"))
    if p.is_file()
  }
  tmp = step_dir / f".{MANIFEST}.tmp"
  tmp.write_text(json.dumps({"files": files}, indent=1))
  tmp.rename(step_dir / MANIFEST)


def problem(step_dir: Path) -> str | None:
  """What is wrong with the files of `step_dir` against its manifest, or None.

  A step without a manifest (saved before checksums existed) is not checked.
  """
  path = step_dir / MANIFEST
  if not path.exists():
    return None
  try:
    files = json.loads(path.read_text())["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"its {MANIFEST} is unreadable ({type(e).__name__})"
  for name, want in files.items():
    p = step_dir / name
    if not p.is_file():
      return f"{name} is missing"
    size = p.stat().st_size
    if size != want["size"]:
      return f"{name} has {size} bytes where {want['size']} were written"
    if _sha256(p) != want["sha256"]:
      return f"{name} does not match its checksum"
  return None


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()
