"""Every process of a run must run the same code on the same config and the same data
order; one that does not is refused at start, in one sentence naming it and the difference.

A process started with another flag, another checkout or another data file would not
fail: it would compute something else (or wait forever in a collective the others never
reach). So the processes compare fingerprints through the coordination service's
key-value store (`health.exchange`): the code at join (`check_code`: torch_on_tpu's and
the running script's source files, the library versions), the resolved config before
anything is built (the recipes), and the config and data settings when a `Trainer`
starts. Digests go first; only when they differ are the values themselves exchanged, to
name the difference. Process 0 is the reference: with two processes nobody can tell
which of them is the odd one, so the sentence shows both values.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from torch_on_tpu.core import stack
from torch_on_tpu.runtime import health

_PACKAGE = Path(__file__).resolve().parent.parent  # torch_on_tpu/, above runtime/


def check_code() -> None:
  """Refuses a run whose processes run different code (called when the run is joined)."""
  check_same(code=code())


def code() -> dict:
  """This process's code: library versions, and a digest of each source file of
  torch_on_tpu, of the running script (or `-m` module) and of its package."""
  roots = {_PACKAGE}
  main = getattr(sys.modules.get("__main__"), "__file__", None)
  files = {}
  if main:
    main = Path(main).resolve()
    files[f"__main__:{main.name}"] = _digest_file(main)
    package = main.parent
    if (package / "__init__.py").exists() and package != _PACKAGE:
      roots.add(package)
  for root in sorted(roots):
    for path in sorted(root.rglob("*.py")):
      files[f"{root.name}/{path.relative_to(root)}"] = _digest_file(path)
  return {"versions": stack.versions(), "files": files}


def check_same(**kinds) -> None:
  """Refuses, on every process, a run where some process has another value of one of
  `kinds` (e.g. `config=`, `data=`; JSON-able) than process 0: `health.ProcessFault`
  with `EXIT_MISMATCH`. Every process must call it with the same kinds."""
  digests = health.exchange(f"digest:{','.join(sorted(kinds))}", {k: _digest(v) for k, v in kinds.items()})
  differing = sorted({k for d in digests for k in kinds if d[k] != digests[0][k]})
  if not differing:
    return
  values = health.exchange(f"values:{','.join(differing)}", {k: kinds[k] for k in differing})
  process = next(i for i, d in enumerate(digests) if d != digests[0])
  kind = next(k for k in differing if digests[process][k] != digests[0][k])
  sentence = (
    f"{health.describe(process).capitalize()} differs from {health.describe(0)} in its {_NAMES.get(kind, kind)}: "
    f"{_difference(kind, values[process][kind], values[0][kind])}; start every process with the same command, "
    f"code and data (refused before anything was trained)."
  )
  health.refuse(sentence, faulty=process)
  raise health.ProcessFault(sentence, health.EXIT_MISMATCH)


_NAMES = {"code": "code", "config": "config", "data": "data order"}


def _difference(kind: str, there, here) -> str:
  """'--lr=0.001 there, --lr=0.003 on process 0' for the first entry that differs."""
  path, mine, reference = _first_difference(there, here)
  if kind == "config" and len(path) == 1:
    return f"--{path[0]}={mine} there, --{path[0]}={reference} on process 0"
  if kind == "code" and path[:1] == ("files",):
    if mine is None or reference is None:
      return f"{path[-1]} exists on only one of them"
    return f"{path[-1]} differs"
  if kind == "code" and path[:1] == ("versions",):
    return f"{path[-1]} {mine} there, {reference} on process 0"
  name = ".".join(str(p) for p in path) or kind
  return f"{name}={mine!r} there, {name}={reference!r} on process 0"


def _first_difference(a, b, path=()):
  if isinstance(a, dict) and isinstance(b, dict):
    for key in sorted(set(a) | set(b), key=str):
      if a.get(key) != b.get(key):
        return _first_difference(a.get(key), b.get(key), (*path, key))
  return path, a, b


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _digest_file(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
