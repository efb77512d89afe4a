"""The README's snippets, and every shell command in a fenced block of the README and docs/, run
as written, so they cannot rot; every figure region names its date, machine and command."""

import ast
import contextlib
import dataclasses
import datetime
import importlib
import io
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import types

import pytest

from recipes import cli, titan_config
from recipes.flags import check_flags
from tests import helpers as h
from torch_on_tpu.parallel import targets
from torch_on_tpu.runtime import launch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def snippet(name: str) -> str:
  match = re.search(rf"<!-- readme-test: {name} -->\s*```python\n(.*?)```", README.read_text(), re.S)
  assert match, f"README has no snippet marked 'readme-test: {name}'"
  return match.group(1)


@pytest.mark.parametrize("name", ["hf", "torchtitan"])
def test_three_line_snippet_trains(name):
  scope = {}
  exec(compile(snippet(name), f"README.md:{name}", "exec"), scope)
  first = float(scope["loss"])
  assert repr(scope["loss"]) == f"tensor({first:.4f}, device='jax')"  # prints as torch's tensors do
  second = float(scope["step"](*_same_batch(name, scope)))
  assert math.isfinite(first) and second < first  # a real update on the same batch lowers the loss
  params = scope["model"].params
  assert any(len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated for a in params.values())
  if name == "torchtitan":
    assert "layers.0.attention.wo.weight" in scope["torch_state"]


def _same_batch(name, scope):
  tokens = scope["tokens"]
  if name == "hf":
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]
  return {"tokens": tokens[:, :-1], "attention_masks": scope["flex_masks"]()}, tokens[:, 1:]


# ---- every shell command in a fenced block of the README and docs/ ---------------------------
#
# A block runs as written in CI (recipe runs at a tiny step count), in doc order, in one scratch
# directory that looks like the repo root, with the docs' placeholders (`path/to/model_dir`,
# `notes/*.txt`) made there. A block preceded by `<!-- ci: not run (why); checked: what -->` is
# not run (it needs a TPU, a GPU, the network or your own script); every command is still
# checked as far as it can be here: its flags parsed and passed through the recipe's start-up
# checks, the launcher's command line, a benchmark's arguments, the pins and extras it installs.

ROOT = README.parent
figures = h.load_module(ROOT / "tools" / "readme_figures.py")
FENCE = re.compile(r"(?:^<!-- ci: (?P<mark>[^\n]*?) -->\n)?^```(?P<lang>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")
CI_SCRIPT = (ROOT / ".ci" / "run").read_text()
TINY_STEPS = "2"  # a documented training command runs this many steps here


@dataclasses.dataclass
class Command:
  where: str  # page:line
  argv: list[str]
  runs: bool  # its block is not marked `ci: not run`


def documented_commands() -> list[Command]:
  """Every command of every shell block, `\\`-continuations joined, `&&` chains split, comments dropped."""
  found = []
  for page in figures.PAGES:
    text = page.read_text()
    for m in FENCE.finditer(text):
      if m["lang"] not in SHELL:
        continue
      line = text[: m.start("body")].count("\n") + 1
      runs = not (m["mark"] or "").startswith("not run")
      for offset, command in enumerate(m["body"].replace("\\\n", " ").splitlines()):
        words = shlex.split(command, comments=True)
        while words:
          cut = words.index("&&") if "&&" in words else len(words)
          found.append(Command(f"{page.relative_to(ROOT)}:{line + offset}", words[:cut], runs))
          words = words[cut + 1 :]
  return found


def test_every_fenced_block_names_its_language():
  """A command cannot hide from these tests in an untagged block: output and diagrams are `text`."""
  for page in figures.PAGES:
    for m in FENCE.finditer(page.read_text()):
      assert m["lang"].strip(), f"{page.relative_to(ROOT)}: a fenced block without a language (```text for output)"


def test_every_documented_command_is_understood_and_its_flags_check(tmp_path, monkeypatch):
  commands = documented_commands()
  assert len(commands) >= 20 and sum(c.runs for c in commands) >= 8
  monkeypatch.chdir(tmp_path)  # a script the launcher is given must exist where it runs
  (tmp_path / "train.py").write_text("")
  for command in commands:
    try:
      check(command.argv)
    except Exception as e:  # noqa: BLE001 (name the command, whatever went wrong)
      pytest.fail(f"{command.where}: `{shlex.join(command.argv)}`: {type(e).__name__}: {e}")


def check(argv: list[str]) -> None:
  """What can be checked of a command without running it; fails on a command it does not know."""
  program, args = argv[0], argv[1:]
  if program == "bash" and args == ["tools/setup_env.sh"]:
    assert "bash tools/setup_env.sh" in CI_SCRIPT  # CI starts with exactly this
  elif program.endswith("pip") and args[:1] == ["install"]:
    check_install(args[1:])
  elif program.startswith("python3") and args[:2] == ["-m", "venv"]:
    assert sys.version_info[:2] >= (3, 11)
  elif program in ("gcloud", "xpk"):
    (inner,) = [a.split("=", 1)[1] for a in args if a.startswith("--command=")]
    check(shlex.split(inner.split("&&")[-1]))  # after `cd somewhere &&`
  elif program in ("python", "python3") or program.endswith("/bin/python"):
    check_python(args)
  else:
    raise AssertionError("a command these tests do not know: teach check() what to verify of it, or drop it")


def check_python(args: list[str]) -> None:
  if args[:2] == ["-m", "pytest"]:
    assert f".venv/bin/python -m pytest {' '.join(args[2:])}".strip() in CI_SCRIPT  # what CI runs
  elif args[:2] == ["-m", "torch_on_tpu.launch"]:
    parsed = launch.parse_args(args[2:])
    if parsed.module:
      check_python(["-m", parsed.module, *parsed.target_args])
  elif args[:1] == ["-m"] and args[1].startswith("recipes."):
    recipe_flags(args[1], args[2:], read_files=False)
  elif args[:2] == ["-m", "torch_on_tpu.doctor"]:
    pass
  elif args[0].startswith("tools/"):
    script = h.load_module(ROOT / args[0])
    if hasattr(script, "parse_args"):
      script.parse_args(args[1:])
  else:
    raise AssertionError("a Python command these tests do not know")


def recipe_flags(module: str, args: list[str], *, read_files: bool = True, mesh=None):
  """The recipe's flags as its command line parses them, through its start-up checks (None for --help)."""
  flags_cls = importlib.import_module(module).main.flags_cls
  if module == "recipes.torchtitan" and titan_config.wanted(args):  # torchtitan's own config: its ConfigManager's, mapped onto the flags
    titan, ours = titan_config.split_argv(args, flags_cls)
    own = recipe_flags(module, ours, read_files=read_files)
    target = own.target and targets.parse(own.target)
    devices = target.chips * target.generation.devices_per_chip if target else own.cpu_devices or 1
    mapped, _ = titan_config.to_flags(titan_config.parse(titan), devices)
    args = shlex.split(titan_config.command_line(mapped))[3:] + ours
  parsed = cli.parse_argv(args, flags_cls)
  if any(a in ("-h", "--help") for a in parsed):
    return None
  values = {}
  for item in parsed:
    name, _, literal = item[2:].partition("=")
    values[name] = ast.literal_eval(literal)
  flags = flags_cls(**values)
  check_flags(flags, read_files=read_files)
  if mesh is not None:
    check_flags(flags, mesh)
  return flags


def check_install(args: list[str]) -> None:
  """`pip install -e ".[extras]"`: the extras exist; `pip install pkg==V`: V is the pinned version."""
  setup = (ROOT / "setup.py").read_text()
  pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
  for arg in args:
    extras = re.fullmatch(r"\.\[(.*)\]", arg)
    if extras:
      for extra in extras[1].split(","):
        assert f'"{extra}"' in setup, f"setup.py has no extra {extra!r}"
    elif "==" in arg:
      name, version = arg.split("==")
      assert pins.get(name) == version, f"{arg} but constraints.txt pins {name}=={pins.get(name)}"


# ---- every Python block of docs/ ---------------------------------------------------------------
#
# The README's snippets run whole (above). A block in docs/ is a fragment of a longer program: it
# is marked `<!-- python fragment; given: a, b -->`, naming what it takes from the text around it,
# and every other name it uses is imported or defined in it (a missing import is a rotted snippet).

PYTHON_FENCE = re.compile(r"(?:^<!-- python fragment; given: (?P<given>[^\n]*?) -->\n)?^```python\n(?P<body>.*?)^```$", re.M | re.S)


def free_names(source: str) -> set[str]:
  """The names `source` reads that it neither binds nor imports (builtins aside)."""
  import builtins

  bound, read = set(dir(builtins)), set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Name):
      (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      bound.add(node.name)
    elif isinstance(node, ast.arg):
      bound.add(node.arg)
    elif isinstance(node, ast.alias):
      bound.add((node.asname or node.name).split(".")[0])
    elif isinstance(node, ast.ExceptHandler) and node.name:
      bound.add(node.name)
  return read - bound


def test_every_python_block_in_docs_imports_what_it_uses_and_names_what_it_is_given():
  blocks = 0
  for page in figures.PAGES[1:]:
    text = page.read_text()
    for m in PYTHON_FENCE.finditer(text):
      where = f"{page.relative_to(ROOT)}:{text[: m.start('body')].count(chr(10)) + 1}"
      assert m["given"] is not None, f"{where}: a Python block without its `<!-- python fragment; given: ... -->` line"
      given = set() if m["given"] == "nothing" else {n.strip() for n in m["given"].split(",")}
      missing = free_names(m["body"]) - given
      assert not missing, f"{where}: uses {sorted(missing)}, neither imported, defined, nor named as given"
      blocks += 1
  assert blocks >= 10
  assert free_names("x = jnp.zeros(3)") == {"jnp"}  # what the check catches


def test_every_figure_region_names_its_date_machine_command_and_a_renderer():
  regions = figures.figures()
  assert len(regions) >= 6
  assert len({f.command for f in regions}) == len(regions), "two figures with one command"
  for f in regions:
    assert f.renderer in figures.RENDERERS, f"{f.command}: no renderer {f.renderer!r}"
    assert re.match(rf"\*\d{{4}}-\d\d-\d\d, [^*]+:\* `{re.escape(f.command)}` →[ \n]", f.body), f"{f.command}: {f.body[:80]}"
    argv = figures.argv_of(f.command)
    assert argv[0] == sys.executable, f"{f.command}: a figure's command is a Python command from the repo root"
    if "--dry_run" in f.command:  # the flags work for the devices the command simulates, as in the README's 405B
      flags = recipe_flags(argv[2], argv[3:])
      fsdp = flags.fsdp if flags.fsdp != -1 else flags.cpu_devices // flags.tp
      recipe_flags(argv[2], argv[3:], mesh=types.SimpleNamespace(shape={"fsdp": fsdp, "tp": flags.tp}, axis_names=("fsdp", "tp")))
    else:
      check_python(argv[1:])


def test_a_figure_is_regenerated_in_place_with_its_date_machine_and_command(tmp_path):
  page = tmp_path / "page.md"
  command = "python -c \"print('| a | b |'); print('not a table')\""
  page.write_text(f"before\n\n<!-- figure: {command} -->\nold\n<!-- /figure -->\n\nafter\n")
  (figure,) = figures.figures([page])
  text = figures.regenerate(figure, when=datetime.date(2026, 11, 24))
  assert text.startswith(f"*2026-11-24, {os.cpu_count()}-core CPU") and text.endswith(f":* `{command}` →\n\n| a | b |\n")
  assert page.read_text() == f"before\n\n<!-- figure: {command} -->\n{text}<!-- /figure -->\n\nafter\n"


def make_placeholders(directory) -> None:
  """What the docs' commands name as stand-ins for the user's files: a small HF model, a few notes."""
  import transformers

  config = transformers.LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
  )
  transformers.LlamaForCausalLM(config).save_pretrained(directory / "path" / "to" / "model_dir")
  (directory / "notes").mkdir()
  for i in range(9):
    (directory / "notes" / f"{i}.txt").write_text(f"Note {i}: what the cat saw from the window on day {i}.\n")


def tiny(argv: list[str]) -> list[str]:
  """A documented training command at `TINY_STEPS` steps (a dry run or --help as it is)."""
  if "--dry_run" in argv or "--help" in argv or not any(a.startswith("recipes.") for a in argv):
    return argv
  return [a for a in argv if not a.startswith("--steps=")] + [f"--steps={TINY_STEPS}"]


def run_documented(argv: list[str], directory) -> tuple[int, str]:
  """(exit status, output) of a documented command run in `directory`. A `tools/` script runs its
  `main(argv)` in this process: the same code as its `__main__` (`sys.exit(main())`), without
  paying a fresh interpreter's imports per command; everything else in a fresh process."""
  if argv[1].startswith("tools/"):
    script = h.load_module(ROOT / argv[1])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(directory), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      returncode = script.main(argv[2:])
    return returncode, out.getvalue() + err.getvalue()
  result = subprocess.run(argv, cwd=directory, env=figures.user_env(), capture_output=True, text=True, timeout=900)
  return result.returncode, result.stdout + result.stderr


@pytest.mark.timeout(1800)  # some 15 recipe runs and compiles, one after another (256 s alone on 2 cores)
def test_every_runnable_documented_command_runs_as_written():
  """One pass over the docs in order (a convert command reads the run a recipe command made); a
  command that is also a figure's renders that figure from its output (at the tiny step count)."""
  done, rendered = set(), []
  regions = {}
  for figure in figures.figures():
    regions.setdefault(tuple(figures.argv_of(figure.command)), []).append(figure)
  with figures.scratch_directory() as directory:
    make_placeholders(directory)
    for command in documented_commands():
      argv = tiny(figures.argv_of(shlex.join(command.argv)))
      if not command.runs or argv[0] != sys.executable or "pytest" in argv or tuple(argv) in done:
        continue  # not run here; or CI itself is the pytest command; or already run
      done.add(tuple(argv))
      start = time.monotonic()
      returncode, output = run_documented(argv, directory)
      print(f"{time.monotonic() - start:6.1f} s  {command.where}  {shlex.join(command.argv)}")  # with -s: where the time goes
      assert returncode == 0, f"{command.where}: `{shlex.join(command.argv)}` exited {returncode}:\n{output[-3000:]}"
      noise = h.libtpu_start_up_lines(output)
      assert not noise, f"{command.where}: `{shlex.join(command.argv)}` printed libtpu's start-up lines: {noise[:2]}"
      for figure in regions.get(tuple(figures.argv_of(shlex.join(command.argv))), []):
        rendered.append(figures.RENDERERS[figure.renderer](output, 1.0, directory))  # its figure renders from it
  assert len(done) >= 8
  assert len(rendered) >= 2 and any("compiled peak" in r for r in rendered) and any("eval loss" in r for r in rendered)
