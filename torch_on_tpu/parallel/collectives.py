"""The bytes a compiled program moves between devices, read from its optimized HLO.

XLA's own cost analysis counts each loop body once; a scanned model runs its
layer's collectives once per layer, so here every collective is multiplied by
the trip counts of the loops around it (`known_trip_count`, else the largest
integer constant the loop's condition compares with). Per device and per
execution, the bytes received, by the usual ring algorithms over a group of n
devices: all-gather out·(n-1)/n, reduce-scatter out·(n-1), all-reduce
2·out·(n-1)/n, all-to-all out·(n-1)/n, collective-permute out (none where every
device sends to itself). The TPU compiler runs SPMD's all-reduce-then-slice of a sharded gradient as one reduce-scatter (an
`all-reduce-scatter` fusion): counted as the reduce-scatter it is.

A ragged all-to-all (expert parallelism's tokens to their experts and back) moves what the
routing decides: counted at balanced routing, where a device receives as many rows as it sends
(the smaller of its two buffers: the rows going out, or the rows coming back), ·(n-1)/n; its
bound, the receive buffer filled from the other devices, output·(n-1)/n, is kept apart (`bounds`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from torch_on_tpu.core import hlo_text
from torch_on_tpu.core.sizes import human_bytes

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "ragged-all-to-all")


@dataclasses.dataclass
class CollectiveBytes:
  """Bytes received per device in one execution, by kind of collective."""

  by_kind: dict
  bounds: dict = dataclasses.field(default_factory=dict)  # kinds whose bytes depend on data: their most

  @property
  def total(self) -> int:
    return sum(self.by_kind.values())

  def __str__(self) -> str:
    bound = lambda kind: f" (at most {human_bytes(self.bounds[kind])})" if kind in self.bounds else ""  # noqa: E731
    parts = [f"{kind} {human_bytes(n)}{bound(kind)}" for kind, n in sorted(self.by_kind.items(), key=lambda kv: -kv[1]) if n]
    return f"{human_bytes(self.total)} ({', '.join(parts)})" if parts else "none"


def collective_bytes(text: str | hlo_text.Module, select=None) -> CollectiveBytes:
  """Per-device bytes received by the collectives of an optimized HLO module (its text or its
  parsed `hlo_text.Module`); `select(result_shape) -> bool` keeps only some of them."""
  module = hlo_text.parse(text) if isinstance(text, str) else text
  scatters = {inst.name: _reduce_scatter_fusion(inst, module) for insts in module.computations.values() for inst in insts}
  inside_scatters = {callee for insts in module.computations.values() for inst in insts if scatters[inst.name]
                     for callee, _ in module.callees(inst)}
  totals: dict[str, float] = {}
  bounds: dict[str, float] = {}
  for name, times in module.runs().items():
    if name in inside_scatters:
      continue  # counted as the reduce-scatter its fusion is
    for inst in module.computations[name]:
      kind = inst.op.removesuffix("-start")
      if select is not None and not select(inst.shape):
        continue
      if kind == "ragged-all-to-all" and not inst.op.endswith("-done"):
        n = _group_size(inst.rest)
        sent = _bytes(module.shapes[name].get(inst.operands()[0], "")) if inst.operands() else 0
        balanced = min(sent, _bytes(inst.shape))  # the rows routed, whichever of the two buffers holds exactly them
        totals[kind] = totals.get(kind, 0) + times * _received("all-to-all", balanced, n)
        bounds[kind] = bounds.get(kind, 0) + times * _received("all-to-all", _bytes(inst.shape), n)
      elif kind in _KINDS and not inst.op.endswith("-done") and not _stays_put(kind, inst.rest):
        totals[kind] = totals.get(kind, 0) + times * _received(kind, _bytes(inst.shape), _group_size(inst.rest))
      if scatters[inst.name]:  # the TPU compiler's all-reduce + slice, run as a reduce-scatter
        received = _received("reduce-scatter", _bytes(inst.shape), scatters[inst.name])
        totals["reduce-scatter"] = totals.get("reduce-scatter", 0) + times * received
  return CollectiveBytes({k: int(v) for k, v in totals.items()}, {k: int(v) for k, v in bounds.items()})


def fsdp_ideal_bytes(sharded_elements: int, devices: int, *, weight_bytes: int, gradient_bytes: int, gathers: int = 2) -> int:
  """What FSDP must receive per device per step, by ring algorithms: every sharded weight
  all-gathered `gathers` times in the dtype it is computed in (forward, and again for the
  backward when the layers are not kept gathered between them) and its gradient
  reduce-scattered once: (gathers · weight_bytes + gradient_bytes) · N · (n - 1) / n.
  A program can move less (an embedding looked up, or a head applied, where its rows live
  moves activations instead) or more (the TPU compiler's windowed einsums pass blocks
  of activations round a ring, to hide the transfer behind the matmul)."""
  return int((gathers * weight_bytes + gradient_bytes) * sharded_elements * (devices - 1) / devices)


def tp_ideal_bytes(tokens: int, hidden: int, devices: int, *, layers: int, activation_bytes: int, recomputed: bool = False) -> int:
  """What Megatron's tensor parallelism must receive per device per step, by ring algorithms:
  in each layer the attention's and the MLP's outputs all-reduced in the forward and the
  gradients at their inputs in the backward (4 all-reduces of [tokens, hidden] a layer, 6 when
  the backward recomputes the forward), 2 · size · (n - 1) / n each; `tokens` are one tp
  group's (the batch's over the data axes). Sequence parallelism moves the same bytes (each
  all-reduce a reduce-scatter and an all-gather). Not counted: the loss on logits split over
  the vocabulary (a vocabulary-parallel loss moves only per-row statistics)."""
  per_layer = 6 if recomputed else 4
  return int(layers * per_layer * 2 * tokens * hidden * activation_bytes * (devices - 1) / devices)


def cp_ideal_bytes(tokens: int, kv_width: int, devices: int, *, layers: int, activation_bytes: int,
                   recomputed: bool = False, balanced_width: int = 0) -> int:
  """What context parallelism must receive per device per step: in each layer K and V
  (`tokens` a device × `kv_width`, K/V heads × head dim) gathered from the other n - 1
  devices by every forward pass (twice when the backward recomputes the forward) and their
  gradients reduce-scattered back, (passes + 1) · 2 · tokens · kv_width · bytes · (n - 1);
  a ring passing the blocks round moves the same. `balanced_width` (the query width, heads ×
  head dim), for a causal split balanced zig-zag: each pass also brings the queries' rows
  to the devices computing them and the outputs back, and the backward their gradients,
  about (2 - 2/n) · tokens · width · bytes a pass (exactly that over 2 devices)."""
  passes = 2 if recomputed else 1
  kv = (passes + 1) * 2 * tokens * kv_width * activation_bytes * (devices - 1)
  balance = (passes + 1) * (2 - 2 / devices) * tokens * balanced_width * activation_bytes
  return int(layers * (kv + balance))


def _bytes(shape: str) -> int:
  """Bytes of an instruction's result (an async start's (operand, result) pair counted once, as its result)."""
  arrays = [hlo_text.nbytes(part) for part in re.findall(r"(?:pred|[sufc]\d+|bf16)\[[\d,]*\]", shape)]
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


def _stays_put(kind: str, rest: str) -> bool:
  """A collective-permute whose every device sends to itself (a `ppermute` whose pairs all
  map a device onto itself, as a zig-zag exchange over 2 devices has): a copy, nothing moves."""
  pairs = re.search(r"source_target_pairs=\{([^=]*)\}", rest) if kind == "collective-permute" else None
  return pairs is not None and all(a == b for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))


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


def _reduce_scatter_fusion(inst: hlo_text.Instruction, module: hlo_text.Module) -> int | None:
  """The group size of a TPU `all-reduce-scatter` fusion (SPMD's all-reduce followed by each
  device's slice, which the TPU compiler runs as one reduce-scatter), or None for another op."""
  called = re.search(r"calls=%(all-reduce-scatter[^\s,}]*)", inst.rest) if inst.op == "fusion" else None
  if called is None:
    return None
  groups = [_group_size(i.rest) for i in module.computations.get(called.group(1), ()) if i.op == "all-reduce"]
  return groups[0] if groups else None
