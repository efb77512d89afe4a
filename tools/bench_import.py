"""Import-time benchmark: `import torch_on_tpu` against `import torch, jax`.

    .venv/bin/python tools/bench_import.py                     # this checkout, 7 runs each
    .venv/bin/python tools/bench_import.py --root=../main --repeat=11

Each import runs in a fresh interpreter (`python -c`), the two alternating so
a busy machine slows both alike; wall seconds of the whole process, median
over the runs. The target (issue 21) is `torch_on_tpu` within 0.5 s of
`torch, jax`; the import itself is quiet (nothing loads until first use), so the
row that counts is `tot.setup()`, the platform start-up a first use runs. `--top=N`
also lists the packages the start-up adds beyond `torch, jax` with their import time
(own time of their modules, `python -X importtime`), for whoever trims it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

BASELINE = "import torch, jax"
OURS = "import torch_on_tpu"
STARTED = "import torch_on_tpu as tot; tot.setup()"  # the import is quiet; this is the first use's start-up


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 help="checkout whose torch_on_tpu is imported (default: this one)")
  p.add_argument("--repeat", type=int, default=7, help="fresh interpreters per import")
  p.add_argument("--top", type=int, default=0, help="list the N slowest packages torch_on_tpu adds")
  return p.parse_args(argv)


def wall_seconds(code: str, root: str) -> float:
  env = {**os.environ, "PYTHONPATH": root}
  start = time.perf_counter()
  subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True)
  return time.perf_counter() - start


def own_seconds(code: str, root: str) -> dict[str, float]:
  """module → its own import seconds (`-X importtime`) in a fresh interpreter running `code`."""
  env = {**os.environ, "PYTHONPATH": root}
  done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=root, env=env,
                        capture_output=True, text=True, check=True)
  out = {}
  for line in done.stderr.splitlines():
    if line.startswith("import time:") and "|" in line:
      own, _, name = (x.strip() for x in line.split(":", 1)[1].split("|"))
      if own.isdigit():
        out[name] = int(own) / 1e6
  return out


def added_packages(root: str, n: int) -> list[tuple[float, str]]:
  """(seconds, top-level package) of the n slowest packages only the start-up imports."""
  baseline = own_seconds(BASELINE, root)
  totals = {}
  for name, seconds in own_seconds(STARTED, root).items():
    if name not in baseline:
      top = name.split(".")[0]
      totals[top] = totals.get(top, 0.0) + seconds
  return sorted(((s, p) for p, s in totals.items()), reverse=True)[:n]


def main(argv=None) -> None:
  args = parse_args(argv)
  wall_seconds(STARTED, args.root)  # warm the page cache and .pyc files
  times = {BASELINE: [], OURS: [], STARTED: []}
  for _ in range(args.repeat):
    for code in times:
      times[code].append(wall_seconds(code, args.root))
  base, ours, started = (statistics.median(times[c]) for c in (BASELINE, OURS, STARTED))
  print(f"{BASELINE!r}: {base:.2f} s   {OURS!r}: {ours:.2f} s   {STARTED!r}: {started:.2f} s   "
        f"difference {started - base:+.2f} s (target ≤ +0.50 s; median of {args.repeat}, {args.root})")
  for seconds, name in added_packages(args.root, args.top):
    print(f"  {seconds:6.3f} s  {name}")


if __name__ == "__main__":
  main()
