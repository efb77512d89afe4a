"""Regenerates every measured figure in the README (and docs/) from the command that produces it.

    .venv/bin/python tools/readme_figures.py --list              # every figure: where, renderer, command
    .venv/bin/python tools/readme_figures.py --only=--dry_run    # rerun the figures whose command contains this
    .venv/bin/python tools/readme_figures.py                     # rerun them all (hours: the benchmarks)

A figure is a region of a Markdown page between two comments; the opening one
holds the command (from the repo root, exactly as a user types it) and,
optionally, how to render its output:

    <!-- figure dry_run: python -m recipes.llama3 --model=8B --cpu_devices=8 --dry_run -->
    *2026-11-24, 2-core CPU (x86_64), 23.5 GiB RAM:* `python -m recipes.llama3 ...` → 16.8 s, ...
    <!-- /figure -->

The script runs the command in a scratch directory (so a run directory of
yours is never touched), renders its output and rewrites the region: the
date, the machine and the command first, then what the renderer made of the
output. To add a figure, write the two comments into the page; a benchmark
that prints Markdown tables needs nothing more (the default renderer copies
them), anything else names a renderer here (`RENDERERS`: one function,
`(output, seconds, directory) → Markdown`). `tests/test_readme.py` checks that
every region is well-formed and names a renderer that exists, and renders the
dry-run figures from the output of the same commands it runs.

A command that needs an accelerator this machine lacks (`requires=` in the
comment: `<!-- figure requires=gpu: ... -->`) is skipped with a note, its
region kept as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FIGURE = re.compile(
  r"^<!-- figure(?P<options>(?: [a-z_]+(?:=[a-z0-9_]+)?)*): (?P<command>.+?) -->\n(?P<body>.*?)^<!-- /figure -->$",
  re.M | re.S,
)
# what a scratch directory links back to, so that documented paths (tools/, recipes/, .venv/) resolve
LINKED = ("tools", "recipes", "torch_on_tpu", "tests", ".venv", "setup.py", "constraints.txt")


@dataclasses.dataclass
class Figure:
  page: Path
  command: str
  renderer: str
  requires: str | None
  body: str
  start: int  # offset of the region in the page's text
  end: int

  @property
  def line(self) -> int:
    return self.page.read_text()[: self.start].count("\n") + 1


def figures(pages=PAGES) -> list[Figure]:
  """Every figure region of the pages, in order."""
  found = []
  for page in pages:
    for m in FIGURE.finditer(page.read_text()):
      options = dict(o.partition("=")[::2] for o in m["options"].split())
      renderer = next((name for name, value in options.items() if not value), "tables")
      found.append(Figure(page, m["command"], renderer, options.get("requires"), m["body"], m.start(), m.end()))
  return found


# ---- running a command as a user would ------------------------------------------------------


@contextlib.contextmanager
def scratch_directory() -> Iterator[Path]:
  """A fresh directory that looks like the repo root (links to its code and .venv), removed after."""
  with tempfile.TemporaryDirectory(prefix="tot-docs-") as directory:
    for name in LINKED:
      if (ROOT / name).exists():
        os.symlink(ROOT / name, Path(directory) / name)
    yield Path(directory)


def user_env() -> dict:
  """The environment a user's shell has: the repo importable, no simulated devices or test settings
  (nor the answers to libtpu's start-up questions that this process may have set)."""
  test_settings = ("XLA_", "JAX_", "PYTEST_", "TOT_", "TPU_", "ALLOW_MULTIPLE_LIBTPU_LOAD")
  env = {k: v for k, v in os.environ.items() if not k.startswith(test_settings)}
  env["PYTHONPATH"] = str(ROOT)
  return env


def argv_of(command: str) -> list[str]:
  """A documented command as an argv: `python` (and `.venv/bin/python`) is this interpreter."""
  argv = shlex.split(command, comments=True)
  if argv and (argv[0] in ("python", "python3") or argv[0].endswith("/bin/python")):
    argv[0] = sys.executable
  return argv


def run(command: str, directory: Path, timeout: float = 6 * 3600) -> tuple[str, float]:
  """Runs `command` in `directory` as a user would; (stdout + stderr, wall seconds). Fails on a non-zero exit."""
  start = time.monotonic()
  done = subprocess.run(
    argv_of(command), cwd=directory, env=user_env(), capture_output=True, text=True, timeout=timeout,
  )
  seconds = time.monotonic() - start
  output = done.stdout + done.stderr
  if done.returncode != 0:
    tail = "\n".join(output.strip().splitlines()[-5:])
    raise RuntimeError(f"`{command}` exited with {done.returncode}:\n{tail}")
  return output, seconds


# ---- renderers: (output, seconds, directory) → Markdown --------------------------------------


def render_tables(output: str, seconds: float, directory: Path) -> str:
  """The Markdown tables the command printed, as printed (each its own table)."""
  blocks = re.split(r"\n(?!\|)", "\n".join(line if line.startswith("|") else "" for line in output.splitlines()))
  tables = "\n\n".join(block.strip("\n") for block in blocks if block.strip())
  if not tables:
    raise ValueError("the command printed no Markdown table; name a renderer in the figure's comment")
  return "\n\n" + tables


def render_dry_run(output: str, seconds: float, directory: Path) -> str:
  """A recipe's --dry_run: its time, the memory plan and the compiled peak per device."""
  plan = re.search(r"^\s*total\s+([\d.]+) (GiB|MiB)", output, re.M)
  peak = re.search(r"Compiled peak per device: ([\d.]+) GiB", output)
  if not plan or not peak:
    raise ValueError("no memory plan total or compiled peak in the dry run's output")
  plan_gib = float(plan[1]) / (1024 if plan[2] == "MiB" else 1)
  return f"{seconds:.1f} s, no parameters allocated; plan {plan_gib:.1f} GiB/device, compiled peak {float(peak[1]):.1f} GiB"


def render_demo(output: str, seconds: float, directory: Path) -> str:
  """A recipe's training run: train and eval loss at start and end, tokens/s, the wall time."""
  log = max(directory.glob("runs/*/metrics.jsonl"), key=lambda path: path.stat().st_mtime)  # the run just made
  records = [json.loads(line) for line in log.read_text().splitlines()]
  train = [r["loss"] for r in records if "loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  speed = re.search(r"([\d,]+) tok/s", output)
  start, end = sum(train[:5]) / len(train[:5]), sum(train[-10:]) / len(train[-10:])
  minutes, rest = divmod(round(seconds), 60)
  return (
    f"train loss {start:.2f} → {end:.2f} (mean of the first 5 / last 10 steps), held-out eval loss "
    f"{evals[0]:.3f} → {evals[-1]:.3f}, {speed[1] if speed else '?'} tokens/s, **{minutes} min {rest} s** in "
    f"all, compilation included"
  )


RENDERERS: dict[str, Callable[[str, float, Path], str]] = {
  "tables": render_tables,
  "dry_run": render_dry_run,
  "demo": render_demo,
}


# ---- the regions ------------------------------------------------------------------------------


def machine() -> str:
  """This machine in a few words: cores, RAM, accelerator."""
  words = [f"{os.cpu_count()}-core CPU ({platform.machine()})"]
  with contextlib.suppress(OSError, ValueError):
    kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())[1])
    words.append(f"{kib / 2**20:.1f} GiB RAM")
  gpu = accelerator()
  if gpu:
    words.append(gpu)
  words.append(f"load average {os.getloadavg()[0]:.1f}")  # at the start: other work on the machine slows timings
  return ", ".join(words)


def accelerator() -> str | None:
  """The GPU's name (nvidia-smi), the TPU's presence (/dev/accel*), or None."""
  if shutil.which("nvidia-smi"):
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    if names.returncode == 0 and names.stdout.strip():
      return names.stdout.strip().splitlines()[0]
  if list(Path("/dev").glob("accel*")):
    return "TPU"
  return None


def kind_of(accelerator_name: str | None) -> str:
  """"tpu", "gpu" or "cpu": what a figure's `requires=` names."""
  return "cpu" if accelerator_name is None else "tpu" if accelerator_name == "TPU" else "gpu"


def body(figure: Figure, rendered: str, when: datetime.date, where: str) -> str:
  """A region's text: when, where and the command, then the rendered output."""
  separator = "" if rendered.startswith("\n") else " "  # a table goes below, after an empty line
  return f"*{when.isoformat()}, {where}:* `{figure.command}` →{separator}{rendered}\n"


def rewrite(figure: Figure, text: str) -> None:
  """Puts `text` into the figure's region (the page is re-read: earlier regions may have changed length)."""
  page = figure.page.read_text()
  for m in FIGURE.finditer(page):
    if m["command"] == figure.command:
      opening = page[m.start() : m.start("body")]
      figure.page.write_text(page[: m.start()] + opening + text + "<!-- /figure -->" + page[m.end() :])
      return
  raise ValueError(f"the region of `{figure.command}` is gone from {figure.page}")


def regenerate(figure: Figure, when: datetime.date | None = None) -> str:
  """Runs the figure's command, renders it and rewrites its region; returns the new text."""
  where = machine()
  with scratch_directory() as directory:
    output, seconds = run(figure.command, directory)
    rendered = RENDERERS[figure.renderer](output, seconds, directory)
  text = body(figure, rendered, when or datetime.date.today(), where)
  rewrite(figure, text)
  return text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--list", action="store_true", help="list the figures and exit")
  parser.add_argument("--only", default=None, help="only the figures whose command contains this text (or is it)")
  args = parser.parse_args(argv)
  chosen = [f for f in figures() if args.only is None or args.only in f.command]
  chosen = [f for f in chosen if f.command == args.only] or chosen  # a whole command picks just its figure
  if args.list or not chosen:
    for f in chosen:
      print(f"{f.page.relative_to(ROOT)}:{f.line}  [{f.renderer}{', needs ' + f.requires if f.requires else ''}]  {f.command}")
    return 0 if chosen else 1
  failed = 0
  for f in chosen:
    if f.requires and f.requires != kind_of(accelerator()):
      print(f"skipped (needs a {f.requires}): {f.command}", flush=True)
      continue
    print(f"running: {f.command}", flush=True)
    try:
      print(regenerate(f), flush=True)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
      failed += 1
      print(f"failed, region kept: {e}", file=sys.stderr, flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
