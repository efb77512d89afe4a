"""The memory plan against the compilers it predicts: per chip, plan vs the TPU compiler vs XLA:CPU.

    python tools/plan_calibration.py                                # the grid: 1B and 8B, v5p-8 and v6e-8, 5 remats
    python tools/plan_calibration.py --models=1B --targets=v5p-8 --remats=full --cpu=false   # one cell
    python tools/plan_calibration.py --models=8B --targets=v5p-16 --layouts=tp2,cp2 --seqlen=4096 --remats=auto --cpu=false
    python tools/plan_calibration.py --models=qwen3:30B-A3B --targets=v5p-64 --layouts=fsdp,ep8 --seqlen=4096 --batch=32 --remats=full --cpu=false

Each cell is `python -m recipes.llama3 --model=M --seqlen=8192 --global_batch_size=8
--dtype=bfloat16 --remat=R --target=T --dry_run` (torchtitan's Llama 3, fsdp over every chip,
scanned, fp32 weights and AdamW, bf16 compute, splash attention; a model named `<family>:<flavor>`
runs `recipes.torchtitan` instead; `--layouts` adds tensor, context and expert parallelism:
`tp2` is `--tp=2`, `cp2` `--cp=2`, `ep8` `--ep=8`): the plan's total per chip beside
the TPU compiler's arguments + temporaries, the compiler's own count of its peak
(`peak_memory_in_bytes`: what its schedule holds at once, what the plan is held to within 10%; the
temporaries' allocation is laid out larger), what it offloads to host memory, and, with
`--cpu`, the same step compiled by XLA:CPU on as many simulated devices (what the plan was fitted
to before there was a TPU compiler here). `auto` is the scanned stack's default
(`dots_and_attention`, asked for by name: the recipe's `--remat=auto` would step down where the
compiler refuses it); `maxtext_offload` is MaxText's v6e recipe in torchtitan's module names
(`offload:input,attention.qkv_linear.wqkv,attention.wo`, as `tools/bench_tpu.py` runs it). Cells that do not fit the chip are measured all the same (the recipe's
refusal is lifted with `--memory_gib`; where the TPU compiler itself refuses, its temporaries
come from its message and the arguments are the plan's params and optimizer state, which the
plan counts exactly; such a cell has no schedule to hold the plan to, and the exit status, 0 when
every other cell is within 10%, leaves it out). The compiler's peak counts host memory too: where
a program offloads, it bounds the chip's peak from above without being it (`offload_dots` reads as
its arguments plus everything on the host, to the MiB), and so does the allocation; such a cell is
held to the lower of the two and says so. Each compile runs in its own process: 1–4 min and up to
4 GB of RAM each on a 2-core VM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # recipes and torch_on_tpu from this checkout, run as a script
from bench_tpu import in_worker  # noqa: E402 (tools/ is the script's own folder on sys.path)

MODELS, TARGETS, REMATS = ("1B", "8B"), ("v5p-8", "v6e-8"), ("none", "auto", "full", "offload_dots", "maxtext_offload")
LAYOUTS = {"fsdp": {}, "tp2": {"tp": 2}, "cp2": {"cp": 2}, "ep8": {"ep": 8}}
POLICY = {"auto": "dots_and_attention", "maxtext_offload": "offload:input,attention.qkv_linear.wqkv,attention.wo"}
SEQLEN, BATCH = 8192, 8
TOLERANCE = 0.10  # the plan's promise: within 10% of the TPU compiler's peak (`yardstick`)
GiB = 2**30


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default=",".join(MODELS), help="comma-separated Llama 3 flavors (" + ", ".join(MODELS) +
                 ") or torchtitan <family>:<flavor> specs")
  p.add_argument("--layouts", default="fsdp", help="comma-separated subset of " + ", ".join(LAYOUTS))
  p.add_argument("--seqlen", type=int, default=SEQLEN)
  p.add_argument("--batch", type=int, default=BATCH, help="global batch")
  p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated TPU slices (tot.parallel.targets names)")
  p.add_argument("--remats", default=",".join(REMATS), help="comma-separated subset of " + ", ".join(REMATS))
  p.add_argument("--cpu", default="true", choices=("true", "false"), help="also compile each cell with XLA:CPU")
  p.add_argument("--json", default=None, help="also write every cell's numbers here")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # MODEL:TARGET:REMAT:PLATFORM, in this process
  p.add_argument("--out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for name, allowed in (("layouts", LAYOUTS), ("remats", REMATS)):
    for value in getattr(args, name).split(","):
      if value not in allowed:
        p.error(f"--{name}: {value!r} is not one of {', '.join(allowed)}")
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.parallel import targets

  for target in args.targets.split(","):
    try:
      targets.parse(target)
    except TorchOnTpuError as e:
      p.error(f"--targets: {e}")
  return args


def cell(model: str, target: str, remat: str, platform: str, layout: str = "fsdp", seqlen: int = SEQLEN, batch: int = BATCH) -> dict:
  """One dry run through the recipe, in this process: the plan's total and the compiler's figures."""
  from recipes import llama3, torchtitan
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.parallel import targets

  slice_ = targets.parse(target)
  where = dict(target=target) if platform == "tpu" else dict(cpu_devices=slice_.chips * slice_.generation.devices_per_chip)
  common = dict(seqlen=seqlen, global_batch_size=batch, dtype="bfloat16", remat=POLICY.get(remat, remat), dry_run=True,
                compile_cache="off", memory_gib=4096, **LAYOUTS[layout], **where)
  recipe, flags = (torchtitan, torchtitan.TorchtitanFlags(model=model, **common)) if ":" in model else (
    llama3, llama3.Llama3Flags(model=model, **common))
  printed = io.StringIO()
  try:
    with contextlib.redirect_stdout(printed):
      summary = recipe.run(flags)
  except TorchOnTpuError as e:  # the TPU compiler's own refusal: its temporaries alone exceed HBM
    needed = re.search(r"needs ([\d.]+) GiB of temporaries", str(e))
    if needed is None:
      raise
    plan = {row: float(n) * GiB for row, n in re.findall(r"^  (params|optimizer state|total) +([\d.]+) GiB$", printed.getvalue(), re.M)}
    return dict(plan=plan["total"], plan_host=0, arguments=plan["params"] + plan["optimizer state"], host=0,
                temporaries=float(needed[1]) * GiB, refused=True, hbm=slice_.generation.hbm_bytes)
  plan, report = summary["plan"], summary["compile"]
  return dict(plan=plan.total, plan_host=plan.host_offloaded, arguments=report.argument_bytes, temporaries=report.temp_bytes,
              compiler_peak=report.compiler_peak_bytes, host=report.host_offloaded_bytes or 0, hbm=slice_.generation.hbm_bytes)


def table(results: dict) -> str:
  lines = [
    "| model | slice | layout | remat | plan GiB | TPU compiler: args + temps GiB (of HBM) | plan / TPU | compiler's peak GiB | plan / peak "
    "| host offloaded GiB: plan / TPU | XLA:CPU args + temps GiB |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (model, target, layout, remat), sides in results.items():
    tpu, cpu = sides["tpu"], sides.get("cpu")
    cpu_cell = "-" if cpu is None else cpu.get("error") or f"{(cpu['arguments'] + cpu['temporaries']) / GiB:.2f}"
    if "error" in tpu:
      lines.append(f"| {model} | {target} | {layout} | {remat} | | {tpu['error']} | | | | | {cpu_cell} |")
      continue
    peak = tpu["arguments"] + tpu["temporaries"]
    refused = " (refused: over HBM; arguments = the plan's params + optimizer state)" if tpu.get("refused") else ""
    compiler_peak, held_to = tpu.get("compiler_peak"), yardstick(tpu)
    if not compiler_peak:
      peak_cells = "- (no schedule) | -"
    elif not tpu["host"]:
      peak_cells = f"{compiler_peak / GiB:.2f} | {_ratio(tpu['plan'], compiler_peak)}"
    else:
      bound = "the peak" if held_to == compiler_peak else "the allocation"
      peak_cells = f"{compiler_peak / GiB:.2f} (host counted) | {_ratio(tpu['plan'], held_to)} of {bound}, the chip's bound"
    lines.append(
      f"| {model} | {target} | {layout} | {remat} | {tpu['plan'] / GiB:.2f} | {tpu['arguments'] / GiB:.2f} + {tpu['temporaries'] / GiB:.2f} = "
      f"{peak / GiB:.2f} ({tpu['hbm'] / GiB:.2f}){refused} | {_ratio(tpu['plan'], peak)} | {peak_cells} "
      f"| {tpu['plan_host'] / GiB:.1f} / {tpu['host'] / GiB:.1f} | {cpu_cell} |"
    )
  return "\n".join(lines)


def yardstick(tpu: dict) -> float | None:
  """What a cell's plan is held to: the compiler's peak; where the program offloads (the peak
  then counts host memory too), the lower of it and the allocation, both bounds of the chip's
  peak; None for a cell without a schedule."""
  compiler_peak = tpu.get("compiler_peak")
  if not compiler_peak:
    return None
  return min(compiler_peak, tpu["arguments"] + tpu["temporaries"]) if tpu["host"] else compiler_peak


def _ratio(plan: float, compiled: float) -> str:
  ratio = plan / compiled
  return f"{ratio:.2f}" + ("" if abs(ratio - 1) <= TOLERANCE else " (outside 10%)")


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    spec = json.loads(args.worker)
    if spec["platform"] == "tpu":
      from torch_on_tpu.runtime import libtpu

      libtpu.quiet_without_chips()
    json.dump(cell(**spec), open(args.out, "w"))
    return 0
  results = {}
  for model in args.models.split(","):
    for target in args.targets.split(","):
      for layout in args.layouts.split(","):
        for remat in args.remats.split(","):
          spec = dict(model=model, target=target, remat=remat, layout=layout, seqlen=args.seqlen, batch=args.batch)
          sides = {"tpu": in_worker(__file__, json.dumps({**spec, "platform": "tpu"}), "tpu compile")}
          if args.cpu == "true":  # a CPU cell needs its device count before jax starts: its own process too
            sides["cpu"] = in_worker(__file__, json.dumps({**spec, "platform": "cpu"}), "cpu compile")
          results[(model, target, layout, remat)] = sides
          print(f"{model} {target} {layout} {remat}: {json.dumps(sides)}", file=sys.stderr, flush=True)
  print(table(results))
  if args.json:
    json.dump([{"model": m, "target": t, "layout": lay, "remat": r, **sides} for (m, t, lay, r), sides in results.items()],
              open(args.json, "w"), indent=1)
  # A refused cell has no schedule to hold the plan to: the temporaries its refusal names are
  # larger than what the same per-chip program holds where it fits (CHANGELOG.md).
  worst = [abs(s["tpu"]["plan"] / yardstick(s["tpu"]) - 1) for s in results.values() if yardstick(s["tpu"])]
  return 0 if worst and max(worst) <= TOLERANCE else 1


if __name__ == "__main__":
  sys.exit(main())
