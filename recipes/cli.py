"""The recipes' command line: `--name=value` flags checked against a flags dataclass before anything
runs (types, names, booleans, a mistyped name answered with the nearest one), then handed to fire,
which runs the recipe and serves `--help`."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from recipes.flags import Flags

REPO = Path(__file__).resolve().parent.parent


def python_command() -> str:
  """The interpreter a printed command starts with, so that it runs pasted into a fresh shell at the
  repo root: the repo's own venv by its path (`.venv/bin/python`), any other as `python`."""
  here = os.path.abspath(sys.executable)
  venv = REPO / ".venv" / "bin"
  return ".venv/bin/python" if os.path.dirname(here) == str(venv) else "python"


def cli(flags_cls, run_fn: Callable, summary: str) -> Callable:
  """A function for `fire.Fire` whose signature and docstring are `flags_cls`'s fields."""
  shared = {f.name for f in dataclasses.fields(Flags)}
  fields = sorted(dataclasses.fields(flags_cls), key=lambda f: f.name in shared)  # model flags first

  def main(**kwargs):
    unknown = sorted(set(kwargs) - {f.name for f in fields})
    if unknown:
      raise SystemExit(f"Unknown flag --{unknown[0]}; see --help for the flags.")
    try:
      run_fn(flags_cls(**kwargs))
    except Exception as e:
      from torch_on_tpu.errors import TorchOnTpuError
      from torch_on_tpu.runtime import health

      if isinstance(e, TorchOnTpuError):  # one sentence, not a traceback
        health.failed(str(e))  # the other processes stop at once, naming this one
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(getattr(e, "exit_code", health.EXIT_ERROR)) from None
      raise

  main.__signature__ = inspect.Signature(
    [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in fields]
  )
  args = "\n".join(f"    {f.name}: {f.metadata['help']}" for f in fields)
  main.__doc__ = f"{summary}\n\n  Args:\n{args}\n"
  main.flags_cls = flags_cls
  return main


def _no_output(result):
  """For fire's `serialize`: the recipe prints its own summary."""
  return None


def fire_main(main: Callable, argv: list[str] | None = None) -> None:
  """Checks the command line, then hands it to fire (which runs `main` and serves --help).

  fire alone reports a flag it could not use only after the run, and guesses
  each value's type from its text (`--scan=false` is the string "false"), so
  every flag is checked against `main`'s flags first and passed on as a
  Python literal of the flag's type. A mistake exits with status 2 and one
  sentence, before anything is built.
  """
  from torch_on_tpu.core import extras

  fire = extras.require("fire", "The recipes' command line")

  argv = sys.argv[1:] if argv is None else argv
  try:
    command = parse_argv(argv, main.flags_cls)
  except FlagError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  fire.Fire(main, command=command, serialize=_no_output)


class FlagError(ValueError):
  """A command-line mistake: one sentence for the user."""


_HELP = ("-h", "--help", "--helpfull")
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def parse_argv(argv: list[str], flags_cls) -> list[str]:
  """The command line checked against `flags_cls`'s fields → `--name=<literal>` args for fire.

  Takes `--name=value`, `--name value`, `--flag` / `--noflag` for booleans
  (true/false, 1/0, yes/no in any case), `-` for `_` in names, and `None` for
  optional flags. `--help` and fire's own flags after a bare `--` pass through.
  """
  if any(a in _HELP for a in argv):
    return list(argv)
  if "--" in argv:
    cut = argv.index("--")
    return parse_argv(argv[:cut], flags_cls) + argv[cut:]
  types = typing.get_type_hints(flags_cls)
  names = [f.name for f in dataclasses.fields(flags_cls)]
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    i += 1
    if not arg.startswith("--"):
      raise FlagError(f"Unexpected argument {arg!r}; the recipe takes only --name=value flags (see --help).")
    name, has_value, value = arg[2:].partition("=")
    name = name.replace("-", "_")
    if name not in types and name.startswith("no") and _kind(types.get(name[2:])) is bool and not has_value:
      name, has_value, value = name[2:], True, "false"
    if name not in types:
      elsewhere = _recipes_taking(name)
      near = difflib.get_close_matches(name, names, n=1)
      if elsewhere:
        hint = f"it is a flag of {' and '.join(f'python -m {r}' for r in elsewhere)}, not of this recipe."
      else:
        hint = f"did you mean --{near[0]}?" if near else "see --help for the flags."
      raise FlagError(f"Unknown flag --{name}; {hint}")
    kind = _kind(types[name])
    if not has_value:
      if kind is bool and (i == len(argv) or argv[i].lower() not in (*_TRUE, *_FALSE)):
        value = "true"
      elif i < len(argv) and not argv[i].startswith("--"):
        value, i = argv[i], i + 1
      else:
        raise FlagError(f"--{name} needs a value: write --{name}=VALUE.")
    out.append(f"--{name}={_literal(name, value, kind, _optional(types[name]))!r}")
  return out


RECIPES = ("recipes.llama3", "recipes.hf", "recipes.torchtitan")


def _recipes_taking(name: str) -> list[str]:
  """The recipes whose flags include `name` (`--lora_rank`, given to recipes.llama3, is recipes.hf's),
  so a flag of another recipe is not answered with this one's nearest name."""
  import importlib

  return [r for r in RECIPES if name in {f.name for f in dataclasses.fields(importlib.import_module(r).main.flags_cls)}]


def _kind(hint) -> type | None:
  """`int`, `float`, `bool` or `str` of a field's type (`int | None` → int)."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return args[0] if args else hint


def _optional(hint) -> bool:
  return type(None) in typing.get_args(hint)


def _literal(name: str, text: str, kind: type, optional: bool):
  """A flag's text as a value of its type, or a FlagError naming what to write."""
  if optional and text == "None":
    return None
  if kind is bool:
    if text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise FlagError(f"--{name}={text} is not a boolean; write --{name}=true or --{name}=false.")
  if kind is int:
    try:
      return int(text)
    except ValueError:
      raise FlagError(f"--{name}={text} is not an integer; give a whole number, e.g. --{name}=8.") from None
  if kind is float:
    try:
      return float(text)
    except ValueError:
      raise FlagError(f"--{name}={text} is not a number; give one like --{name}=0.001.") from None
  return text
