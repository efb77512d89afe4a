"""The bytes a compiled program moves between devices, read from its optimized HLO.

XLA's own cost analysis counts each loop body once; a scanned model runs its
layer's collectives once per layer, so here every collective is multiplied by
the trip counts of the loops around it (`known_trip_count`, else the largest
integer constant the loop's condition compares with). Per device and per
execution, the bytes received, by the usual ring algorithms over a group of n
devices: all-gather out·(n-1)/n, reduce-scatter out·(n-1), all-reduce
2·out·(n-1)/n, all-to-all out·(n-1)/n, collective-permute out. The TPU compiler
runs SPMD's all-reduce-then-slice of a sharded gradient as one reduce-scatter (an
`all-reduce-scatter` fusion): counted as the reduce-scatter it is.
"""

from __future__ import annotations

import dataclasses
import math
import re

from torch_on_tpu.core.sizes import human_bytes

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) ([a-z-]+)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([\d,]*)\]")


@dataclasses.dataclass
class CollectiveBytes:
  """Bytes received per device in one execution, by kind of collective."""

  by_kind: dict

  @property
  def total(self) -> int:
    return sum(self.by_kind.values())

  def __str__(self) -> str:
    parts = [f"{kind} {human_bytes(n)}" for kind, n in sorted(self.by_kind.items(), key=lambda kv: -kv[1]) if n]
    return f"{human_bytes(self.total)} ({', '.join(parts)})" if parts else "none"


def collective_bytes(hlo_text: str) -> CollectiveBytes:
  """Per-device bytes received by the collectives of an optimized HLO module's text."""
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      bodies[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      if line.rstrip() == "}":  # a computation's end; a Mosaic kernel's config spans lines that start with "}}"
        current = None
      else:
        bodies[current].append(line)
  memo: dict[str, dict] = {}

  def of(name: str) -> dict:
    if name in memo:
      return memo[name]
    memo[name] = {}  # a recursion guard; HLO computations do not recurse
    totals: dict[str, float] = {}
    for line in bodies.get(name, ()):
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      shape, op, rest = match.groups()
      kind = op.removesuffix("-start")
      if kind in _KINDS and not op.endswith("-done"):
        totals[kind] = totals.get(kind, 0) + _received(kind, _bytes(shape), _group_size(rest))
      scatter = _reduce_scatter_fusion(op, rest, bodies)
      if scatter is not None:  # the TPU compiler's all-reduce + slice, run as a reduce-scatter
        totals["reduce-scatter"] = totals.get("reduce-scatter", 0) + _received("reduce-scatter", _bytes(shape), scatter)
        continue
      for callee, times in _callees(op, rest, bodies):
        for k, n in of(callee).items():
          totals[k] = totals.get(k, 0) + n * times
    memo[name] = totals
    return totals

  return CollectiveBytes({k: int(v) for k, v in of(entry).items()} if entry else {})


def _bytes(shape: str) -> int:
  """Bytes of an instruction's result (a tuple's elements summed; an async start's
  (operand, result) pair counted once, as its result)."""
  arrays = [_ITEMSIZE.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(shape)]
  if shape.startswith("(") and len(arrays) == 2 and arrays[0] <= arrays[1]:
    return arrays[1]  # *-start: (operand, output)
  return sum(arrays)


def _group_size(rest: str) -> int:
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
  if mesh:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
  if iota:
    return int(iota.group(2))
  explicit = re.search(r"replica_groups=\{\{([^}]*)\}", rest)
  if explicit:
    return len(explicit.group(1).split(","))
  return 2  # collective-permute: pairs


def _received(kind: str, out: int, n: int) -> float:
  if n <= 1 and kind != "collective-permute":
    return 0.0
  return {
    "all-gather": out * (n - 1) / n,
    "reduce-scatter": out * (n - 1),
    "all-reduce": 2 * out * (n - 1) / n,
    "all-to-all": out * (n - 1) / n,
    "collective-permute": out,
  }[kind]


def _reduce_scatter_fusion(op: str, rest: str, bodies: dict) -> int | None:
  """The group size of a TPU `all-reduce-scatter` fusion (SPMD's all-reduce followed by each
  device's slice, which the TPU compiler runs as one reduce-scatter), or None for another op."""
  called = re.search(r"calls=%(all-reduce-scatter[^\s,}]*)", rest) if op == "fusion" else None
  if called is None:
    return None
  groups = [_group_size(line) for line in bodies.get(called.group(1), ()) if " all-reduce(" in line]
  return groups[0] if groups else None


def _callees(op: str, rest: str, bodies: dict) -> list[tuple[str, int]]:
  """(computation, times it runs per run of the caller) of an instruction."""
  if op == "while":
    body = re.search(r"body=%([^\s,]+)", rest)
    cond = re.search(r"condition=%([^\s,]+)", rest)
    trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
    if trips:
      times = int(trips.group(1))
    else:
      constants = [int(c) for line in bodies.get(cond.group(1), ()) if cond for c in re.findall(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)", line)]
      times = max(constants, default=1)
    return [(body.group(1), times)] if body else []
  names = re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%([^\s,}]+)", rest)
  branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
  if branches:
    names += re.findall(r"%([^\s,]+)", branches.group(1))
  return [(n, 1) for n in names if n in bodies]
