"""Ours and MaxText compiled by the real TPU compiler for the same slice, side by side (no TPU needed).

    python tools/bench_tpu.py                                   # both rows, remat full and offload
    python tools/bench_tpu.py --rows=1b-v5p --remats=full       # one cell
    python tools/bench_tpu.py --maxtext=/work/maxtext-src --maxtext_python=/work/maxtext-venv/bin/python
    python tools/bench_tpu.py --rows=8b-v6e --remats=full --collective_matmul=true   # the compiler's windowed einsums

Rows: Llama 3.1 8B on v6e-8 (global batch 8 × 8192, torchprime's and MaxText's v6e recipe) and
Llama 3 1B on v5p-8 (batch 4 × 8192; MaxText's `default` decoder at the same sizes, tied
embeddings as torchtitan's 1B). Both sides: fsdp over every chip, fp32 weights and AdamW, bf16
compute, splash attention, the layer stack scanned, and (`--collective_matmul=false`, the default)
the TPU compiler's collective matmuls off on both sides: ours by default (`runtime.xla_flags`),
MaxText's by the libtpu flag its tuned recipes set. Remat `full` is MaxText's default; `offload`
is MaxText's v6e recipe (`remat_policy=custom`: the layer input and the q/k/v/out projections
offloaded) on both sides, ours spelled by torchtitan's module names
(`--remat=offload:input,attention.qkv_linear.wqkv,attention.wo`).

Per chip, from each compiled program: arguments + temporaries and host-offloaded bytes (XLA's
memory analysis); collective bytes by kind, FLOPs, HBM bytes and the bytes moved to and from host
memory, read from the optimized HLO with loops counted by trip count (`parallel.collectives`, `training.program_cost`: XLA's cost analysis
counts a loop body once); and a roofline step time from the same estimator for both sides
(per kernel, max of FLOPs at the chip's bf16 peak and bytes at its HBM bandwidth, plus the
attention kernels' FLOPs, which Mosaic calls do not report, at the peak; collectives assumed
hidden under compute). It is a lower bound for comparing the two programs, not a measured time.

MaxText is optional: give its source checkout and a Python that runs it (jax 0.10.2, libtpu
0.0.42.1, flax 0.12.8, qwix, tokamax, grain; docs/performance.md, "Ours and MaxText on the TPU
compiler", says how to set it up); without them the table has our rows only. Each compile runs
in its own process (1–3 min and up to 3.5 GB of RAM each on a 2-core VM).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # recipes and torch_on_tpu from this checkout, run as a script
ROWS = {
  "8b-v6e": dict(target="v6e-8", flavor="8B", batch=8, seqlen=8192,
                 maxtext=["model_name=llama3.1-8b", "compile_topology=v6e-8"]),
  "1b-v5p": dict(target="v5p-8", flavor="1B", batch=4, seqlen=8192,
                 maxtext=["compile_topology=v5p-8", "base_emb_dim=2048", "base_num_query_heads=32", "base_num_kv_heads=8",
                          "base_num_decoder_layers=16", "base_mlp_dim=8192", "head_dim=64", "vocab_size=128256",
                          "logits_via_embedding=true", "rope_max_timescale=500000"]),
}
OURS_REMAT = {"full": "full", "offload": "offload:input,attention.qkv_linear.wqkv,attention.wo"}
MAXTEXT_REMAT = {
  "full": ["remat_policy=full"],
  "offload": ["remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload", "key_proj=offload",
              "value_proj=offload", "out_proj=offload"],
}
# libtpu without chips: quiet, and shared with other processes (torch_on_tpu.runtime.libtpu)
LIBTPU_ENV = {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1",
              "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
GiB = 2**30


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ", ".join(ROWS))
  p.add_argument("--remats", default="full,offload", help="comma-separated subset of full, offload")
  p.add_argument("--maxtext", default=os.environ.get("MAXTEXT_SRC"), help="MaxText source checkout (its src/ on PYTHONPATH)")
  p.add_argument("--maxtext_python", default=os.environ.get("MAXTEXT_PYTHON"), help="the Python that runs MaxText")
  p.add_argument("--collective_matmul", default="false", choices=("false", "true"),
                 help="both sides: let the TPU compiler run sharded matmuls as collective matmuls (its default; "
                      "ours turns them off unless asked, MaxText's tuned recipes do so by a libtpu flag)")
  p.add_argument("--json", default=None, help="also write every cell's numbers here")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # ROW:REMAT, ours, in this process
  p.add_argument("--out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for row in args.rows.split(","):
    if row not in ROWS:
      p.error(f"--rows: {row!r} is not one of {', '.join(ROWS)}")
  for remat in args.remats.split(","):
    if remat not in OURS_REMAT:
      p.error(f"--remats: {remat!r} is not one of {', '.join(OURS_REMAT)}")
  if bool(args.maxtext) != bool(args.maxtext_python):
    p.error("--maxtext and --maxtext_python go together (MaxText's source and the Python that runs it)")
  return args


def attention_flops(flavor: str, batch: int, seqlen: int, chips: int, recompute: bool) -> float:
  """Causal attention FLOPs per chip per step (forward, backward, and the forward again under full
  remat): q·k and p·v, 2·2·L·H·Dh·S²/2 per sequence forward, twice that backward."""
  from torch_on_tpu.models.torchtitan import llama3_config

  config = llama3_config(flavor)
  layers, heads, head_dim = len(config.layers), config.layers[0].attention.n_heads, config.dim // config.layers[0].attention.n_heads
  forward = 2 * 2 * layers * heads * head_dim * seqlen * seqlen / 2 * batch / chips
  return forward * (3 + (1 if recompute else 0))


def fsdp_ideal(flavor: str, chips: int) -> int:
  """FSDP's collective bytes per chip per step for the model (`parallel.collectives.fsdp_ideal_bytes`):
  every weight gathered in bf16 for the forward and again for the backward, gradients
  reduce-scattered in bf16."""
  from torch_on_tpu.models.torchtitan import build_llama3
  from torch_on_tpu.parallel import collectives

  params = sum(p.numel() for p in build_llama3(flavor).parameters())
  return collectives.fsdp_ideal_bytes(params, chips, weight_bytes=2, gradient_bytes=2)


def cell_numbers(report_like: dict, row: dict, remat: str) -> dict:
  """The table's numbers from a compiled program's memory analysis and its HLO's costs."""
  from torch_on_tpu.parallel import targets

  generation = targets.parse(row["target"]).generation
  chips = targets.parse(row["target"]).chips * generation.devices_per_chip
  extra = attention_flops(row["flavor"], row["batch"], row["seqlen"], chips, recompute=remat == "full")
  cost = report_like["cost"]
  return dict(
    arguments=report_like["arguments"], temporaries=report_like["temporaries"], host=report_like["host"],
    collectives=report_like["collectives"], flops=cost.flops + extra, hbm_bytes=cost.hbm_bytes, host_bytes=cost.host_bytes,
    roofline_s=cost.roofline_seconds(generation.peak_bf16_flops, generation.hbm_bandwidth, extra),
    hbm_budget=generation.hbm_bytes, fsdp_ideal=fsdp_ideal(row["flavor"], chips),
  )


def ours(row_name: str, remat: str, collective_matmul: bool) -> dict:
  """Our step through the recipe's own path (`recipes.llama3 --target --dry_run`), in this process."""
  from recipes import llama3

  row = ROWS[row_name]
  flags = llama3.Llama3Flags(model=row["flavor"], seqlen=row["seqlen"], global_batch_size=row["batch"], dtype="bfloat16",
                             remat=OURS_REMAT[remat], target=row["target"], dry_run=True, compile_cache="off",
                             collective_matmul=collective_matmul)
  try:
    report = llama3.run(flags)["compile"]
  except Exception as e:  # noqa: BLE001 (a refusal, e.g. the compiler's own out-of-memory, is a cell too)
    return {"error": str(e).splitlines()[0][:300]}
  numbers = cell_numbers(dict(arguments=report.argument_bytes, temporaries=report.temp_bytes, host=report.host_offloaded_bytes,
                              collectives=report.collective_bytes.by_kind, cost=report.cost), row, remat)
  return numbers


def maxtext(row_name: str, remat: str, source: str, python: str, collective_matmul: bool) -> dict:
  """MaxText's own `train_compile` for the same cell, in its own process; its optimized HLO read
  with our estimator."""
  from torch_on_tpu.parallel import collectives
  from torch_on_tpu.training import program_cost

  row = ROWS[row_name]
  with tempfile.TemporaryDirectory() as dump:
    command = [
      python, "-m", "maxtext.trainers.pre_train.train_compile", f"{source}/src/maxtext/configs/base.yml",
      f"run_name=bench_{row_name}_{remat}", f"base_output_directory={dump}/out", "compile_topology_num_slices=1",
      "per_device_batch_size=1", f"max_target_length={row['seqlen']}", "dataset_type=synthetic", "enable_checkpointing=false",
      "dump_hlo=true", f"dump_hlo_local_dir={dump}/xla/", "dump_hlo_delete_local_after=false",
      *row["maxtext"], *MAXTEXT_REMAT[remat],
    ]
    env = {**os.environ, **LIBTPU_ENV, "DECOUPLE_GCLOUD": "TRUE", "PYTHONPATH": f"{source}/src"}
    env.pop("XLA_FLAGS", None)  # MaxText sets its own dump flags
    if not collective_matmul:  # MaxText's DISABLE_COLLECTIVE_MATMUL (benchmarks/xla_flags_library.py)
      env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " --xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000").strip()
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=dump)
    memory = re.search(r"argument_size_in_bytes=(\d+).*?temp_size_in_bytes=(\d+).*?host_argument_size_in_bytes=(\d+)"
                       r".*?host_output_size_in_bytes=(\d+).*?host_temp_size_in_bytes=(\d+)", run.stdout + run.stderr)
    if run.returncode != 0 or memory is None:
      tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
      return {"error": f"MaxText's train_compile failed: {tail[0][:300]}"}
    (hlo,) = glob.glob(f"{dump}/xla/module_*.jit_train_step.*.after_optimizations.txt")[:1] or [None]
    if hlo is None:
      return {"error": "MaxText's dump has no optimized train_step module"}
    text = Path(hlo).read_text()
  arguments, temporaries, *host = (int(x) for x in memory.groups())
  return cell_numbers(dict(arguments=arguments, temporaries=temporaries, host=sum(host),
                           collectives=collectives.collective_bytes(text).by_kind, cost=program_cost.program_cost(text)), row, remat)


def in_worker(script: str, args: str, what: str = "worker") -> dict:
  """`script --worker ARGS --out FILE` in a fresh process (a compile holds GBs; each cell gets its
  own) and the JSON it writes, or {"error": its last line}. tools/plan_calibration.py runs its
  cells with it too."""
  with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
    command = [sys.executable, script, "--worker", args, "--out", out.name]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
      tail = run.stderr.strip().splitlines()[-1:] or ["no output"]
      return {"error": f"{what} failed: {tail[0][:300]}"}
    return json.load(open(out.name))


def table(results: dict) -> str:
  lines = [
    "| row | remat | program | args + temps GiB (of HBM) | host GiB | collectives GiB (all-gather / reduce-scatter / permute / all-to-all) "
    "| × FSDP ideal | TFLOP | HBM GB | host GB moved | roofline s | vs MaxText |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (row, remat), sides in results.items():
    base = sides.get("MaxText", {}).get("roofline_s")
    for side, n in sides.items():
      if "error" in n:
        lines.append(f"| {row} | {remat} | {side} | {n['error']} | | | | | | | | |")
        continue
      c = n["collectives"]
      kinds = " / ".join(f"{c.get(k, 0) / GiB:.1f}" for k in ("all-gather", "reduce-scatter", "collective-permute", "all-to-all"))
      vs = f"{n['roofline_s'] / base:.2f} ×" if base and side != "MaxText" else "-"
      lines.append(
        f"| {row} | {remat} | {side} | {n['arguments'] / GiB:.2f} + {n['temporaries'] / GiB:.2f} = "
        f"{(n['arguments'] + n['temporaries']) / GiB:.2f} ({n['hbm_budget'] / GiB:.2f}) | {n['host'] / GiB:.1f} | "
        f"{sum(c.values()) / GiB:.1f} ({kinds}) | {sum(c.values()) / n['fsdp_ideal']:.2f} | {n['flops'] / 1e12:.1f} | {n['hbm_bytes'] / 1e9:.0f} | "
        f"{n.get('host_bytes', 0) / 1e9:.0f} | {n['roofline_s']:.3f} | {vs} |"
      )
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    from torch_on_tpu.runtime import libtpu

    libtpu.quiet_without_chips()
    row, remat, collective_matmul = args.worker.split(":")
    json.dump(ours(row, remat, collective_matmul == "true"), open(args.out, "w"))
    return 0
  results = {}
  for row in args.rows.split(","):
    for remat in args.remats.split(","):
      sides = {"torch_on_tpu": in_worker(__file__, f"{row}:{remat}:{args.collective_matmul}")}
      if args.maxtext:
        sides["MaxText"] = maxtext(row, remat, args.maxtext, args.maxtext_python, args.collective_matmul == "true")
      results[(row, remat)] = sides
      print(f"{row} {remat}: done", file=sys.stderr, flush=True)
  if not args.maxtext:
    print("MaxText not given (--maxtext, --maxtext_python): our rows only; docs/performance.md says how to set it up.")
  print(table(results))
  if args.json:
    json.dump({f"{r}:{m}": v for (r, m), v in results.items()}, open(args.json, "w"), indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
