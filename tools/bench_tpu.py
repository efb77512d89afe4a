"""Ours and MaxText compiled by the real TPU compiler for the same slice, side by side (no TPU needed).

    python tools/bench_tpu.py                                   # both rows, remat full and offload
    python tools/bench_tpu.py --rows=1b-v5p --remats=full       # one cell
    python tools/bench_tpu.py --maxtext=/work/maxtext-src --maxtext_python=/work/maxtext-venv/bin/python
    python tools/bench_tpu.py --rows=8b-v6e --remats=full --collective_matmul=true   # the compiler's windowed einsums
    python tools/bench_tpu.py --rows=qwen3-30b-v5p,qwen3-30b-v5p-ep8                  # mixture-of-experts
    python tools/bench_tpu.py --rows=deepseek-671b-v5p                                # opt-in: MaxText's side ~35 min

Rows: Llama 3.1 8B on v6e-8 (global batch 8 × 8192, torchprime's and MaxText's v6e recipe) and
Llama 3 1B on v5p-8 (batch 4 × 8192; MaxText's `default` decoder at the same sizes, tied
embeddings as torchtitan's 1B). Mixture-of-experts: Qwen3-30B-A3B on v5p-64 (one sequence of 4096
a chip, remat full), fsdp over the 32 chips and fsdp 4 × ep 8 (`--ep=8`; MaxText's
`ici_expert_parallelism=8`); DeepSeek-V3 671B on v5p-1024 at 6 × 8192 tokens a chip, MaxText's own
published recipe (`deepseek3_671b_v5p_1024`, read from its source) beside ours (`DEEPSEEK_FLAGS`),
opt-in as it is not in the default `--rows`. Both sides: fp32 weights and AdamW, bf16
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
The experts' grouped matmuls are Mosaic kernels on both sides (jax's megablox) that report their
FLOPs (`ProgramCost.kernel_flops`), for the rows their buffers hold: under expert parallelism a
receive buffer holds more rows than balanced routing sends (ours twice as many, more rounds when
a device gets more; MaxText's sized for the worst routing, `ep × min(top_k, local experts) / top_k`
times as many), so the table counts them at balanced routing (divided by that factor), as it
counts the ragged all-to-alls; the collectives column shows the buffers' bound apart. The "experts gathered" column is the all-gather of expert weights alone.

MaxText is optional: give its source checkout and a Python that runs it (jax 0.10.2, libtpu
0.0.42.1, flax 0.12.8, qwix, tokamax, grain; CHANGELOG.md, "Ours and MaxText on the TPU
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
# Each row: the slice, torchtitan's model ("<family>:<flavor>"), the global batch and sequence, our
# recipe's extra flags, MaxText's overrides (or the published recipe it reads), the remats it runs.
ROWS = {
  "8b-v6e": dict(target="v6e-8", model="llama3:8B", batch=8, seqlen=8192,
                 maxtext=["model_name=llama3.1-8b", "compile_topology=v6e-8"]),
  "1b-v5p": dict(target="v5p-8", model="llama3:1B", batch=4, seqlen=8192,
                 maxtext=["compile_topology=v5p-8", "base_emb_dim=2048", "base_num_query_heads=32", "base_num_kv_heads=8",
                          "base_num_decoder_layers=16", "base_mlp_dim=8192", "head_dim=64", "vocab_size=128256",
                          "logits_via_embedding=true", "rope_max_timescale=500000"]),
  "qwen3-30b-v5p": dict(target="v5p-64", model="qwen3:30B-A3B", batch=32, seqlen=4096, remats=("full",),
                        maxtext=["model_name=qwen3-30b-a3b", "compile_topology=v5p-64"]),
  "qwen3-30b-v5p-ep8": dict(target="v5p-64", model="qwen3:30B-A3B", batch=32, seqlen=4096, remats=("full",), ours=dict(ep=8),
                            maxtext=["model_name=qwen3-30b-a3b", "compile_topology=v5p-64", "ici_expert_parallelism=8"]),
  "deepseek-671b-v5p": dict(target="v5p-1024", model="deepseek_v3:671B", batch=6 * 512, seqlen=8192, remats=("recipe",),
                            opt_in=True, maxtext_recipe="deepseek3_671b_v5p_1024"),
}
# Ours for DeepSeek-V3 on v5p-1024: experts split 8 ways (tokens sent to them), the layer inputs in
# host memory, six microbatches of one sequence a chip.
DEEPSEEK_FLAGS = dict(ep=8, remat="offload_inputs", grad_accum=6)
# Keys of MaxText's published v5p recipes that its config at e591f30 no longer has (renamed
# `wi_/wo_tile_*` with the same defaults) and its profiler's: dropped when it is compiled.
MAXTEXT_STALE_KEYS = ("tile_batch_seq", "tile_embed_dim", "tile_mlp_dim", "profiler", "skip_first_n_steps_for_profiler", "profiler_steps")
OURS_REMAT = {"full": "full", "offload": "offload:input,attention.qkv_linear.wqkv,attention.wo", "recipe": None}
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
  p.add_argument("--rows", default=",".join(r for r, row in ROWS.items() if not row.get("opt_in")),
                 help="comma-separated subset of " + ", ".join(ROWS) + " (default: all but the opt-in ones)")
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
      p.error(f"--remats: {remat!r} is not one of {', '.join(r for r in OURS_REMAT if r != 'recipe')}")
  if bool(args.maxtext) != bool(args.maxtext_python):
    p.error("--maxtext and --maxtext_python go together (MaxText's source and the Python that runs it)")
  return args


def cells(args) -> list[tuple[str, str]]:
  """(row, remat) pairs to compile: each row with the asked remats it runs (its own list, else full
  and offload); a row whose remats are none of them runs its first ("recipe": its own)."""
  asked = args.remats.split(",")
  out = []
  for row in args.rows.split(","):
    remats = ROWS[row].get("remats", ("full", "offload"))
    out += [(row, r) for r in remats if r in asked] or [(row, remats[0])]
  return out


def model_facts(row: dict) -> dict:
  """From torchtitan's config of the row's model, built on meta: its parameter count, decoder shape
  and MoE sizes (experts, top-k, dim, expert hidden; None for a dense model)."""
  import torch

  from torch_on_tpu import models
  from torch_on_tpu.models.torchtitan import moe, registry_config

  with torch.device("meta"):
    model = registry_config(row["model"], max_seq_len=row["seqlen"]).build()
  layers = [m for m in model.modules() if moe.is_moe(m)]
  experts = None
  if layers:
    inner = layers[0].routed_experts.inner_experts
    experts = dict(count=layers[0].router.num_experts, top_k=layers[0].router.top_k, shape=tuple(inner.w1_EFD.shape[1:]))
  return dict(params=sum(p.numel() for p in model.parameters()), shape=models.family_of(model).decoder_shape(model), experts=experts)


def attention_flops(facts: dict, row: dict, chips: int, recompute: bool) -> float:
  """Causal attention FLOPs per chip per step (forward, backward, and the forward again under a
  remat that recomputes it): q·k and p·v, 2·2·L·H·Dh·S²/2 per sequence forward, twice that backward."""
  s = facts["shape"]
  forward = 2 * 2 * s.attention_layers * s.heads * s.head_dim * row["seqlen"] ** 2 / 2 * row["batch"] / chips
  return forward * (3 + (1 if recompute else 0))


def buffer_factor(facts: dict, ep: int, ours: bool) -> float:
  """How many times the rows of balanced routing an expert-parallel receive buffer holds (1 without
  expert parallelism): ours `expert_parallel.RECEIVE_BUFFER_ROWS` (more rounds when a device gets
  more), MaxText's the worst case (its `ragged_buffer_factor` default), `ep × min(top_k, local
  experts) / top_k`."""
  from torch_on_tpu.parallel import expert_parallel

  experts = facts["experts"]
  if not experts or ep <= 1:
    return 1.0
  top_k, local = experts["top_k"], experts["count"] // ep
  size = expert_parallel.receive_rows if ours else expert_parallel.worst_case_rows
  return size(top_k, top_k, local, ep) / top_k


def expert_gathers(text: str, facts: dict) -> int:
  """Bytes received by all-gathers of expert weights (a result shaped like some experts' [dim, hidden]
  weights), loops counted."""
  from torch_on_tpu.core import hlo_text
  from torch_on_tpu.parallel import collectives

  experts = facts["experts"]
  if not experts:
    return 0
  wanted = set(experts["shape"])

  def expert_shaped(shape: str) -> bool:
    dims = hlo_text.dims(shape)
    return len(dims) >= 3 and wanted <= set(dims)

  return collectives.collective_bytes(text, select=expert_shaped).by_kind.get("all-gather", 0)


def cell_numbers(report_like: dict, row: dict, remat: str, facts: dict, ep: int, ours: bool) -> dict:
  """The table's numbers from a compiled program's memory analysis and its HLO's costs; `ep`: the
  program's expert-parallel degree (its Mosaic experts counted at balanced routing)."""
  from torch_on_tpu.parallel import collectives, targets

  generation = targets.parse(row["target"]).generation
  chips = targets.parse(row["target"]).chips * generation.devices_per_chip
  cost = report_like["cost"]
  experts = cost.kernel_flops / buffer_factor(facts, ep, ours)
  extra = attention_flops(facts, row, chips, recompute=remat in ("full", "recipe")) + experts
  return dict(
    arguments=report_like["arguments"], temporaries=report_like["temporaries"], host=report_like["host"],
    collectives=report_like["collectives"], bounds=report_like["bounds"], expert_gathers=report_like["expert_gathers"],
    flops=cost.flops + extra, expert_flops=experts, hbm_bytes=cost.hbm_bytes, host_bytes=cost.host_bytes,
    roofline_s=cost.roofline_seconds(generation.peak_bf16_flops, generation.hbm_bandwidth, extra),
    hbm_budget=generation.hbm_bytes,
    fsdp_ideal=collectives.fsdp_ideal_bytes(facts["params"], chips, weight_bytes=2, gradient_bytes=2),
  )


def ours(row_name: str, remat: str, collective_matmul: bool) -> dict:
  """Our step through the recipe's own path (`recipes.torchtitan --target --dry_run`), in this process."""
  from recipes import llama3, torchtitan
  from torch_on_tpu.training import compile_report

  row = ROWS[row_name]
  flags = dict(row.get("ours", {}), **(DEEPSEEK_FLAGS if remat == "recipe" else {"remat": OURS_REMAT[remat]}))
  texts = []
  reported = compile_report.report
  compile_report.report = lambda compiled, seconds: texts.append(compiled.as_text()) or reported(compiled, seconds)
  common = dict(seqlen=row["seqlen"], global_batch_size=row["batch"], dtype="bfloat16", target=row["target"], dry_run=True,
                compile_cache="off", collective_matmul=collective_matmul, **flags)
  family, flavor = row["model"].split(":")
  try:
    if family == "llama3":  # the Llama 3 recipe: its own defaults, as the README's commands run it
      report = llama3.run(llama3.Llama3Flags(model=flavor, **common))["compile"]
    else:
      report = torchtitan.run(torchtitan.TorchtitanFlags(model=row["model"], **common))["compile"]
  except Exception as e:  # noqa: BLE001 (a refusal, e.g. the compiler's own out-of-memory, is a cell too)
    return {"error": str(e).splitlines()[0][:300]}
  finally:
    compile_report.report = reported
  facts = model_facts(row)
  return cell_numbers(dict(arguments=report.argument_bytes, temporaries=report.temp_bytes, host=report.host_offloaded_bytes,
                           collectives=report.collective_bytes.by_kind, bounds=report.collective_bytes.bounds,
                           expert_gathers=expert_gathers(texts[-1], facts), cost=report.cost),
                      row, remat, facts, flags.get("ep", 1), ours=True)


def maxtext_overrides(row: dict, remat: str, source: str, python: str) -> tuple[list[str], dict]:
  """MaxText's overrides for a cell and the environment it adds: the row's own with the remat's, or
  the published recipe the row names, read from MaxText's source (its tuning parameters and the
  libtpu flags it sets)."""
  if "maxtext_recipe" not in row:
    chips = _chips(row)
    return ([f"per_device_batch_size={row['batch'] // chips}", f"max_target_length={row['seqlen']}", *row["maxtext"],
             *MAXTEXT_REMAT[remat]], {})
  read = subprocess.run(
    [python, "-c", "import json, sys; from benchmarks import maxtext_v5p_model_configs as c; "
                   f"r = c.{row['maxtext_recipe']}; print(json.dumps(dict(model=r.model_type, tuning=r.tuning_params, xla=r.xla_flags)))"],
    env={**os.environ, "PYTHONPATH": f"{source}:{source}/src", "DECOUPLE_GCLOUD": "TRUE"}, capture_output=True, text=True, cwd=source,
  )
  if read.returncode != 0:
    raise RuntimeError(f"MaxText's recipe {row['maxtext_recipe']} could not be read: {(read.stderr.strip().splitlines() or ['?'])[-1]}")
  recipe = json.loads(read.stdout.strip().splitlines()[-1])
  tuning = {k: v for k, v in recipe["tuning"].items() if k not in MAXTEXT_STALE_KEYS}
  overrides = [f"model_name={recipe['model']}", f"compile_topology={row['target']}",
               *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in tuning.items())]
  return overrides, {"LIBTPU_INIT_ARGS": recipe["xla"].strip()}


def _chips(row: dict) -> int:
  from torch_on_tpu.parallel import targets

  target = targets.parse(row["target"])
  return target.chips * target.generation.devices_per_chip


def maxtext(row_name: str, remat: str, source: str, python: str, collective_matmul: bool) -> dict:
  """MaxText's own `train_compile` for the same cell, in its own process; its optimized HLO read
  with our estimator."""
  from torch_on_tpu.parallel import collectives
  from torch_on_tpu.training import program_cost

  row = ROWS[row_name]
  try:
    overrides, added_env = maxtext_overrides(row, remat, source, python)
  except RuntimeError as e:
    return {"error": str(e)}
  with tempfile.TemporaryDirectory() as dump:
    command = [
      python, "-m", "maxtext.trainers.pre_train.train_compile", f"{source}/src/maxtext/configs/base.yml",
      f"run_name=bench_{row_name}_{remat}", f"base_output_directory={dump}/out", "compile_topology_num_slices=1",
      "dataset_type=synthetic", "enable_checkpointing=false",
      "dump_hlo=true", f"dump_hlo_local_dir={dump}/xla/", "dump_hlo_delete_local_after=false", *overrides,
    ]
    env = {**os.environ, **LIBTPU_ENV, "DECOUPLE_GCLOUD": "TRUE", "PYTHONPATH": f"{source}/src", **added_env}
    env.pop("XLA_FLAGS", None)  # MaxText sets its own dump flags
    if not collective_matmul and "LIBTPU_INIT_ARGS" not in added_env:  # MaxText's DISABLE_COLLECTIVE_MATMUL (benchmarks/xla_flags_library.py)
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
  ep = next((int(o.split("=")[1]) for o in overrides if o.startswith("ici_expert_parallelism=")), 1)
  facts = model_facts(row)
  moved = collectives.collective_bytes(text)
  return cell_numbers(dict(arguments=arguments, temporaries=temporaries, host=sum(host), collectives=moved.by_kind,
                           bounds=moved.bounds, expert_gathers=expert_gathers(text, facts), cost=program_cost.program_cost(text)),
                      row, remat, facts, ep, ours=False)


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
    "| row | remat | program | args + temps GiB (of HBM) | host GiB | collectives GiB (all-gather / reduce-scatter / all-reduce "
    "/ permute / all-to-all / ragged, its bound) | experts gathered GiB | × FSDP ideal | TFLOP (experts) | HBM GB | host GB moved "
    "| roofline s | vs MaxText |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  kinds = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all", "ragged-all-to-all")
  for (row, remat), sides in results.items():
    base = sides.get("MaxText", {}).get("roofline_s")
    for side, n in sides.items():
      if "error" in n:
        lines.append(f"| {row} | {remat} | {side} | {n['error']} | | | | | | | | | |")
        continue
      c = n["collectives"]
      moved = " / ".join(f"{c.get(k, 0) / GiB:.1f}" for k in kinds)
      bound = n["bounds"].get("ragged-all-to-all")
      moved += f" (≤ {bound / GiB:.1f})" if bound else ""
      vs = f"{n['roofline_s'] / base:.2f} ×" if base and side != "MaxText" else "-"
      experts = f" ({n['expert_flops'] / 1e12:.1f})" if n["expert_flops"] else ""
      lines.append(
        f"| {row} | {remat} | {side} | {n['arguments'] / GiB:.2f} + {n['temporaries'] / GiB:.2f} = "
        f"{(n['arguments'] + n['temporaries']) / GiB:.2f} ({n['hbm_budget'] / GiB:.2f}) | {n['host'] / GiB:.1f} | "
        f"{sum(c.values()) / GiB:.1f} ({moved}) | {n['expert_gathers'] / GiB:.1f} | {sum(c.values()) / n['fsdp_ideal']:.2f} | "
        f"{n['flops'] / 1e12:.1f}{experts} | {n['hbm_bytes'] / 1e9:.0f} | {n.get('host_bytes', 0) / 1e9:.0f} | {n['roofline_s']:.3f} | {vs} |"
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
  for row, remat in cells(args):
    sides = {"torch_on_tpu": in_worker(__file__, f"{row}:{remat}:{args.collective_matmul}")}
    if args.maxtext:
      sides["MaxText"] = maxtext(row, remat, args.maxtext, args.maxtext_python, args.collective_matmul == "true")
    results[(row, remat)] = sides
    print(f"{row} {remat}: done", file=sys.stderr, flush=True)
  if not args.maxtext:
    print("MaxText not given (--maxtext, --maxtext_python): our rows only; CHANGELOG.md says how to set it up.")
  print(table(results))
  if args.json:
    json.dump({f"{r}:{m}": v for (r, m), v in results.items()}, open(args.json, "w"), indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
