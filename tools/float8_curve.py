"""float8 training against bf16: the recipe's 200-step debugmodel loss curves, one run each.

    .venv/bin/python tools/float8_curve.py                  # bf16, rowwise, tensorwise; 200 steps each
    .venv/bin/python tools/float8_curve.py --steps=20 --recipes=rowwise

Each run is `python -m recipes.llama3 --dtype=bfloat16` (bf16 compute, fp32
master weights and AdamW, the same seed, data and schedule), with `--float8`
added for the float8 runs. The table gives the mean loss of the last 10 steps
and each float8 run's distance from the bf16 run there (the issue's bar: 2%), and the largest distance between the
two runs' 10-step running means after step 10.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

TAIL = 10  # steps averaged for "the loss at the end"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--recipes", default="rowwise,tensorwise", help="float8 recipes to run besides bf16")
  p.add_argument("--seqlen", type=int, default=128)
  p.add_argument("--global_batch_size", type=int, default=8)
  p.add_argument("--json", default=None, help="also write the curves here")
  return p.parse_args(argv)


def train(float8: str | None, args, directory: str) -> list[float]:
  from recipes import llama3

  flags = llama3.Llama3Flags(
    dtype="bfloat16", float8=float8, steps=args.steps, seqlen=args.seqlen, global_batch_size=args.global_batch_size,
    eval_every=0, save_every=args.steps, log_dir=f"{directory}/{float8 or 'bf16'}",
  )
  summary = llama3.run(flags)
  return [r["loss"] for r in summary["records"] if "loss" in r]


def running_means(curve: list[float]) -> list[float]:
  """The mean of each step's last `TAIL` losses, from step `TAIL` on (the last one is "the end")."""
  return [sum(curve[i - TAIL:i]) / TAIL for i in range(TAIL, len(curve) + 1)]


def main(argv=None) -> int:
  args = parse_args(argv)
  from recipes import startup

  startup.setup_platform(8)
  curves = {}
  with tempfile.TemporaryDirectory() as directory:
    for recipe in (None, *[r for r in args.recipes.split(",") if r]):
      curves[recipe or "bf16"] = train(recipe, args, directory)
  means = {name: running_means(c) for name, c in curves.items()}
  print(f"\n| run | first loss | loss at the end (last {TAIL}) | vs bf16 | widest gap of the {TAIL}-step means |")
  print("|---|---|---|---|---|")
  for name, curve in curves.items():
    gap = max(abs(a / b - 1) for a, b in zip(means[name], means["bf16"]))
    print(f"| {name} | {curve[0]:.4f} | {means[name][-1]:.4f} | {means[name][-1] / means['bf16'][-1] - 1:+.2%} | {gap:.2%} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(curves, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
