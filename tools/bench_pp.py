"""Pipeline stages: measured step FLOPs and bubble against the formula, and where the
cross-stage traffic goes, from the optimized HLO of compiled train steps. One command:

    .venv/bin/python tools/bench_pp.py                     # pp=4 × fsdp=2, M = 4, 8, 12, 16, V = 1 and 2

Each program is compiled on abstract params (nothing allocated) for 8 simulated
CPU devices: torchtitan's Llama 3 debugmodel made 8 layers deep, batch 96 × 16
tokens, fp32, AdamW with clipping.

FLOPs: XLA's `cost_analysis()` counts a loop body once, so the matmul FLOPs are
counted here from the optimized HLO, every `dot` times the trip counts of the
loops around it. The reference is the same model on `fsdp=8` without stages,
whose layers recompute their forward in the backward (`remat="full"`), as a
pipeline stage does; its depth doubled gives the per-device FLOPs of the layers
(Λ). A pipelined step executes its bubble ticks in full (SPMD: every stage runs
every tick, on garbage while filling and draining), so ideally
`F(M) = F_ref + Λ·(S − 1)/(V·M)`: the measured bubble is
`(F(M) − F_ref) / (F(M) − F_ref + Λ)`, to compare with `(S − 1)/(V·M + S − 1)`.
Work the pipeline adds beyond the bubble (a head computed on every stage instead
of once, matmuls the partitioner splits differently inside a stage) shows as a
larger measured bubble; the table gives both.

Traffic: every collective of the program, by whether its devices span stages
(their `pp` coordinates differ) and whether it runs inside a loop. The check:
inside loops, and for anything jax traced inside the schedule, the only
cross-stage collectives are collective permutes; what crosses stages outside
them runs once per step (the embedding/head parameters FSDP-gathered over every
device, and the pipeline's boundary: one activation tensor each way).
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCH = 96  # splits into 4, 8, 12 and 16 microbatches, each over fsdp=2
SEQ = 16

# ---- the optimized HLO ------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"^[a-z0-9]+\[([\d,]*)\]")
_ENTRY = " entry"  # computations() keeps the entry computation's name under this key
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def computations(hlo: str) -> dict[str, list[tuple]]:
  """Computation name → its instructions (name, result type, opcode, rest of the line)."""
  out, current = {}, None
  for line in hlo.splitlines():
    if current is None or not line.startswith(" "):
      m = _COMPUTATION.match(line)
      if m and "=" not in line.split("{")[0].split("(")[0]:
        current = out.setdefault(m.group(1), [])
        if line.startswith("ENTRY"):
          out.setdefault(_ENTRY, m.group(1))
        continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      current.append(m.groups())
  return out


def multipliers(comps: dict) -> dict[str, int]:
  """How many times each computation runs per step: loop bodies times their known trip
  counts, everything else once per call (a loop without a known count counts once)."""
  calls = collections.defaultdict(list)
  for name, instrs in comps.items():
    if name == _ENTRY:
      continue
    for _, _, op, rest in instrs:
      trips = 1
      if op == "while":
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
        trips = int(m.group(1)) if m else 1
        for callee in re.findall(r"body=%?([\w.\-]+)", rest):
          calls[name].append((callee, trips))
        continue
      for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest):
        calls[name].append((callee, 1))
      for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
        for callee in re.findall(r"%?([\w.\-]+)", group):
          calls[name].append((callee, 1))
  entry = comps[_ENTRY]
  times = collections.Counter()

  def visit(name, n):
    times[name] += n
    for callee, k in calls.get(name, []):
      visit(callee, n * k)

  visit(entry, 1)
  return times


def dot_flops(hlo: str) -> float:
  """Matmul FLOPs per device per step: 2 · output elements · contracted size, per `dot`,
  times how often its computation runs."""
  comps = computations(hlo)
  times = multipliers(comps)
  total = 0.0
  for name, instrs in comps.items():
    if name == _ENTRY:
      continue
    shapes = {n: t for n, t, _, _ in instrs}
    for _, result, op, rest in instrs:
      if op != "dot" or not times.get(name):
        continue
      lhs = re.match(r"%([\w.\-]+)", rest).group(1)
      lhs_dims = _dims(shapes[lhs])
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
      k = math.prod(lhs_dims[int(d)] for d in contracting.split(",") if d)
      total += 2.0 * math.prod(_dims(result)) * k * times[name]
  return total


def _dims(type_text: str) -> list[int]:
  m = _ARRAY.match(type_text)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _iota(dims, perm) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def device_groups(rest: str) -> list[list[int]]:
  """The device groups of one collective (logical ids), from any of XLA's spellings."""
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(0))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if m:
    dims = [int(d) for d in m.group(3).split(",")]
    perm = [int(p) for p in m.group(4).split(",")] if m.group(4) else None
    return _iota(dims, perm).reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}", rest
  )
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    sizes = [int(n) for _, n in axes]
    if m.group(2):
      perm = [int(p) for p in m.group(3).split(",")] if m.group(3) else None
      ids = _iota([int(d) for d in m.group(2).split(",")], perm).reshape(sizes)
    else:
      ids = np.arange(math.prod(sizes)).reshape(sizes)
    over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m.group(4)]
    rest_axes = [i for i in range(len(axes)) if i not in over]
    return ids.transpose(rest_axes + over).reshape(-1, math.prod(sizes[i] for i in over)).tolist()
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
  if m:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  raise ValueError(f"unreadable device groups: {rest[:200]}")


def cross_stage_traffic(hlo: str, mesh) -> dict:
  """Every collective: (opcode, spans stages, inside a loop) → [count, bytes per device
  per step]; and the cross-stage collectives that break the rule (see the module doc)."""
  stage_of = np.unravel_index(np.arange(mesh.size), mesh.devices.shape)[list(mesh.axis_names).index("pp")]
  comps = computations(hlo)
  times = multipliers(comps)
  loops = _loop_computations(comps)
  table = collections.defaultdict(lambda: [0, 0.0])
  broken = []
  for name, instrs in comps.items():
    if name == _ENTRY:
      continue
    for iname, result, op, rest in instrs:
      base = op.removesuffix("-start")
      if base not in COLLECTIVES:
        continue
      groups = device_groups(rest)
      spans = any(len({int(stage_of[d]) for d in g}) > 1 for g in groups)
      looped = name in loops
      traced_in_schedule = "while/body" in (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1]
      nbytes = _bytes(result) * times.get(name, 0)
      row = table[(base, spans, looped)]
      row[0] += times.get(name, 0)
      row[1] += nbytes
      if spans and base != "collective-permute" and (looped or traced_in_schedule):
        broken.append(f"{iname} ({op} {result[:60]}, in {name})")
  return {"table": dict(table), "broken": broken}


def _loop_computations(comps: dict) -> set[str]:
  """Computations that run inside some loop body (transitively)."""
  inside = set()
  todo = [
    callee
    for name, instrs in comps.items() if name != _ENTRY
    for _, _, op, rest in instrs if op == "while"
    for callee in re.findall(r"body=%?([\w.\-]+)", rest)
  ]
  while todo:
    name = todo.pop()
    if name in inside:
      continue
    inside.add(name)
    for _, _, op, rest in comps.get(name, []):
      todo.extend(re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest))
  return inside


_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1, "s8": 1, "u8": 1}


def _bytes(type_text: str) -> int:
  return sum(
    math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
    for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", type_text)
  )


# ---- the programs -----------------------------------------------------------------------


def compile_step(layers: int, axes: dict, *, microbatches=None, virtual_stages=1, remat=None):
  """(optimized HLO, the model's mesh) of one train step of the debugmodel made `layers` deep."""
  import jax
  import jax.numpy as jnp
  import optax
  import pp_parity

  import torch_on_tpu as tot

  model = pp_parity.titan8(layers=layers, seqlen=SEQ)
  pipeline = dict(microbatches=microbatches, virtual_stages=virtual_stages) if "pp" in axes else {}
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(**axes), scan=True, remat=remat, abstract=True, **pipeline)

  step = tot.make_train_step(jm, pp_parity._loss, optax.adamw(1e-3), clip_norm=1.0)
  spec = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
  step.compile(spec, spec)
  return next(iter(step._executables.values())).as_text(), jm.mesh


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pp", type=int, default=4)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2])
  args = parser.parse_args(argv)

  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  import torch_on_tpu as tot

  tot.setup()
  s = args.pp
  start = time.perf_counter()
  ref_hlo, _ = compile_step(args.layers, dict(fsdp=8), remat="full")
  deep_hlo, _ = compile_step(2 * args.layers, dict(fsdp=8), remat="full")
  f_ref, f_deep = dot_flops(ref_hlo), dot_flops(deep_hlo)
  layers = f_deep - f_ref
  print(f"reference fsdp=8, remat full: {f_ref / 1e9:.3f} GFLOP per device per step, layers {layers / 1e9:.3f}")
  print(f"{'pp':>3} {'V':>2} {'M':>3} {'GFLOP/dev':>10} {'vs ref':>7} {'bubble':>8} {'formula':>8}  cross-stage collectives: in loops / once per step; rule broken by")
  worst, broken = -1.0, False
  for v in args.virtual:
    for m in range(s, 4 * s + 1, s):
      hlo, mesh = compile_step(args.layers, dict(pp=s, fsdp=8 // s), microbatches=m, virtual_stages=v)
      f = dot_flops(hlo)
      measured = (f - f_ref) / (f - f_ref + layers)
      formula = (s - 1) / (v * m + s - 1)
      worst = max(worst, measured - formula)
      traffic = cross_stage_traffic(hlo, mesh)
      in_loops = {k[0]: c for k, (c, _) in traffic["table"].items() if k[1] and k[2]}
      once = {k[0]: f"{c}×, {b / 2**10:.0f} KiB" for k, (c, b) in traffic["table"].items() if k[1] and not k[2]}
      print(
        f"{s:>3} {v:>2} {m:>3} {f / 1e9:>10.3f} {f / f_ref:>7.3f} {measured:>8.1%} {formula:>8.1%}  "
        f"{in_loops} / {once}; {traffic['broken'][:2] or 'none'}",
        flush=True,
      )
      broken = broken or bool(traffic["broken"])
  print(f"largest measured − formula bubble: {worst:+.2%}; cross-stage rule {'BROKEN' if broken else 'held'} ({time.perf_counter() - start:.0f} s)")
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main())
