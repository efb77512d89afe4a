"""The one exception type the bridge raises for user mistakes, and how its
messages name what the user typed.

Every message is a single sentence that names the offending thing (parameter,
shape, axis, path) and what to do. Entry points (recipes, tools) print it and
exit non-zero instead of showing a traceback.

A message that tells the user to set something names it with `arg("remat",
"full")`: `remat='full'` for a Python caller, `--remat=full` while a command
line that sets that call argument runs (`spoken_as_flags`, installed by the
recipes and tools from their own flag definitions). One message serves both,
and the library never needs to know which command lines exist.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator, Mapping


class TorchOnTpuError(ValueError):
  """A user-facing configuration or input error with a one-sentence message."""


def first_line(error: BaseException) -> str:
  """`Type: the first line of its message` (at most 200 characters): how a library's
  error is quoted inside one of our sentences."""
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


_UNSET = object()
# call argument name → the command-line flag that sets it, while a command line runs; None: Python.
# Process-wide, not a context variable: errors raised in worker threads (data prefetch) speak the same way.
_flags: dict[str, str] | None = None


@contextlib.contextmanager
def spoken_as_flags(flags: Mapping[str, str]) -> Iterator[None]:
  """Within: `arg(name, ...)` writes `--flag=...` for each call argument `name` in `flags`
  (`{"field": "data_field", "remat": "remat"}`), so errors name the flags the user typed."""
  global _flags
  previous, _flags = _flags, dict(flags)
  try:
    yield
  finally:
    _flags = previous


def spoken() -> dict[str, str]:
  """The spellings installed now ({} from Python), so an inner command line adds its own to an
  outer one's (a torchtitan config's fields, then the recipe's flags)."""
  return dict(_flags or {})


def settable(name: str) -> bool:
  """Whether the user can set call argument `name` where they are (always from Python;
  from a command line only if one of its flags sets it): suggest it only then."""
  return _flags is None or name in _flags


def arg(name: str, value=_UNSET) -> str:
  """How the user sets call argument `name` (to `value`): `name=value` from Python,
  `--flag=value` (`--flag` for True, a list comma-separated) under `spoken_as_flags`.
  Without a value: `name=` / `--flag=`."""
  flag = None if _flags is None else _flags.get(name)
  if flag is None:
    return f"{name}=" if value is _UNSET else f"{name}={value!r}"
  if value is _UNSET:
    return f"--{flag}="
  if value is True:
    return f"--{flag}"
  if isinstance(value, bool):
    text = str(value).lower()
  elif isinstance(value, (list, tuple)):
    text = ",".join(map(str, value))  # a command line's list: comma-separated
  else:
    text = str(value)
  return f"--{flag}={shlex.quote(text)}"


def named(name: str) -> str:
  """Call argument `name` as the user writes it, without a value: `seqlen` or `--seqlen`."""
  flag = None if _flags is None else _flags.get(name)
  return name if flag is None else f"--{flag}"


def call(function: str, values: Mapping[str, object]) -> str:
  """A call's settings as the user wrote them: `make_mesh(fsdp=64, tp=4)` or `--fsdp=64 --tp=4`."""
  return f"{function}({args(values)})" if _flags is None else args(values)


def args(values: Mapping[str, object]) -> str:
  """Several settings, as `arg` writes each: `fsdp=64, tp=4` or `--fsdp=64 --tp=4`."""
  written = [arg(name, value) for name, value in values.items()]
  return " ".join(written) if _flags is not None else ", ".join(written)
