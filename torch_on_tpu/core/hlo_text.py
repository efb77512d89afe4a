"""An optimized HLO module's text, read as its computations, their instructions and how many times
each computation runs per execution (loops by trip count), for what the reports count from it:
collective bytes (`parallel.collectives`), FLOPs and HBM bytes (`training.program_cost`).

A loop's trip count is its `known_trip_count`, else what its induction variable gives (start,
step and the bound its condition compares with), else the largest integer constant of its
condition. A computation called by a fusion is marked fused: its instructions run inside one
kernel, so only the fusion's own operands and result touch memory. A loop or conditional traced
under the jax name scope `UNCOUNTED_SCOPE` runs only in unusual cases (an expert-parallel device
receiving more rows than its buffer holds: `parallel.expert_parallel`): counted as not running.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
            "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")  # a layout's memory space: none or 0 is HBM, 5 pinned host memory,
HOST_MEMORY_SPACE = 5                     # others on-chip memory (on TPU, 1 is VMEM; 2 its synchronisation flags)
_CALLS = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%([^\s,}]+)")
UNCOUNTED_SCOPE = "tot_uncounted"


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the result's shape text (a tuple's too)
  op: str
  rest: str  # operands and attributes
  root: bool = False  # its computation's result
  _operands: list[str] | None = dataclasses.field(default=None, repr=False, compare=False)

  def operands(self) -> list[str]:
    """The names of the instruction's operands, in order (read once: a program's cost asks often)."""
    if self._operands is None:
      self._operands = self._read_operands()
    return self._operands

  def _read_operands(self) -> list[str]:
    depth, args = 0, []
    for i, ch in enumerate(self.rest):
      if ch in "([{":
        depth += 1
      elif ch in ")]}":
        if depth == 0:
          args = self.rest[:i]
          break
        depth -= 1
    return re.findall(r"%([^\s,)]+)", args) if args else []


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instruction]]
  entry: str | None
  shapes: dict[str, dict[str, str]]  # computation → instruction (or parameter) name → its shape text

  def runs(self) -> dict[str, float]:
    """Computation → how many times it runs per execution of the module."""
    counts: dict[str, float] = {}

    def visit(name: str, times: float) -> None:
      counts[name] = counts.get(name, 0) + times
      for inst in self.computations.get(name, ()):
        for callee, n in self.callees(inst):
          visit(callee, times * n)

    if self.entry:
      visit(self.entry, 1)
    return counts

  def fused(self) -> set[str]:
    """The computations a fusion calls (their instructions run inside its kernel)."""
    return {callee for insts in self.computations.values() for inst in insts if inst.op == "fusion"
            for callee, _ in self.callees(inst)}

  @functools.cached_property
  def _where(self) -> dict[int, str]:
    """id(instruction) → the computation it is in."""
    return {id(i): name for name, insts in self.computations.items() for i in insts}

  def _named(self, computation: str) -> dict[str, Instruction]:
    return {i.name: i for i in self.computations.get(computation, ())}

  @staticmethod
  def _constant(named: dict[str, Instruction], name: str) -> int | None:
    """The integer value `name` holds in a computation (`named`: its instructions by name), where
    it is a scalar constant (through copies and converts)."""
    inst = named.get(name)
    while inst is not None and inst.op in ("copy", "convert", "bitcast") and inst.operands():
      inst = named.get(inst.operands()[0])
    if inst is None or inst.op != "constant":
      return None
    value = re.match(r"(-?\d+)\)", inst.rest)
    return int(value.group(1)) if value else None

  def _trip_count(self, loop: Instruction, cond: str, body: str) -> int:
    """A loop's trip count from its induction variable: the tuple element its condition compares
    with a constant bound, its start in the loop's operand, its step in the body's result (the
    TPU compiler's windowed einsums count up by 2). Where the pattern is not found: the largest
    integer constant the condition holds."""
    insts = self.computations.get(cond, ())
    fallback = max((int(c) for i in insts for c in re.findall(r"[su](?:8|16|32|64)\[\](?:\{[^}]*\})? constant\((-?\d+)\)",
                                                               f"{i.shape} {i.op}({i.rest}")), default=1)
    at_cond, at_body, at_caller = self._named(cond), self._named(body), self._named(self._where.get(id(loop), ""))
    root = next((i for i in insts if i.root), None)
    direction = re.search(r"direction=(\w+)", root.rest) if root is not None and root.op == "compare" else None
    if direction is None or len(root.operands()) != 2:
      return max(fallback, 1)
    a, b = root.operands()
    op = direction.group(1)
    if self._constant(at_cond, a) is not None:
      a, b, op = b, a, {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(op, op)
    bound, counter = self._constant(at_cond, b), at_cond.get(a)
    if bound is None or counter is None or counter.op != "get-tuple-element" or op not in ("LT", "LE", "NE"):
      return max(fallback, 1)
    index = int(re.search(r"index=(\d+)", counter.rest).group(1))
    body_root = next((i for i in self.computations.get(body, ()) if i.root), None)
    step = None
    if body_root is not None and body_root.op == "tuple" and index < len(body_root.operands()):
      update = at_body.get(body_root.operands()[index])
      if update is not None and update.op == "add":
        step = next((c for c in (self._constant(at_body, o) for o in update.operands()) if c is not None), None)
    if not step or step < 0:
      return max(fallback, 1)
    start_tuple = at_caller.get(loop.operands()[0]) if loop.operands() else None
    start = None
    if start_tuple is not None and start_tuple.op == "tuple" and index < len(start_tuple.operands()):
      start = self._constant(at_caller, start_tuple.operands()[index])
    start = 0 if start is None else start  # a start computed at run time: from 0, as loops mostly count
    span = bound - start + (1 if op == "LE" else 0)
    return max(-(-span // step), 0)

  def callees(self, inst: Instruction) -> list[tuple[str, int]]:
    """(computation, times it runs per run of `inst`)."""
    if inst.op in ("while", "conditional") and re.search(rf'op_name="[^"]*/{UNCOUNTED_SCOPE}/', inst.rest):
      return []
    if inst.op == "while":
      body = re.search(r"body=%([^\s,]+)", inst.rest)
      cond = re.search(r"condition=%([^\s,]+)", inst.rest)
      trips = re.search(r'known_trip_count":\{"n":"(\d+)"', inst.rest)
      if trips:
        times = int(trips.group(1))
      elif cond and body:
        times = self._trip_count(inst, cond.group(1), body.group(1))
      else:
        times = 1
      return [(body.group(1), times)] + ([(cond.group(1), times + 1)] if cond else []) if body else []
    names = _CALLS.findall(inst.rest)
    branches = re.search(r"branch_computations=\{([^}]*)\}", inst.rest)
    if branches:
      names += re.findall(r"%([^\s,]+)", branches.group(1))
    return [(n, 1) for n in names if n in self.computations]


def parse(text: str) -> Module:
  computations: dict[str, list[Instruction]] = {}
  shapes: dict[str, dict[str, str]] = {}
  entry, current = None, None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      computations[current], shapes[current] = [], {}
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      if line.rstrip() == "}":  # a computation's end; a Mosaic kernel's config spans lines that start with "}}"
        current = None
        continue
      inst = _INSTRUCTION.match(line)
      if inst:
        root, name, shape, op, rest = inst.groups()
        computations[current].append(Instruction(name, shape, op, rest, root=bool(root)))
        shapes[current][name] = shape
      elif computations[current]:  # an instruction's text continued (a Mosaic kernel's metadata spans lines)
        computations[current][-1].rest += "\n" + line
  return Module(computations, entry, shapes)


def nbytes(shape: str, *, where: str = "anywhere") -> int:
  """Bytes of a shape text (a tuple's elements summed): all of them, or only those whose layout
  puts them in the device's HBM (`where="hbm"`) or in pinned host memory (`where="host"`)."""
  total = 0
  for t, dims, layout in _SHAPE.findall(shape):
    space = _MEMORY_SPACE.search(layout)
    space = int(space.group(1)) if space else 0
    if where == "anywhere" or space == {"hbm": 0, "host": HOST_MEMORY_SPACE}[where]:
      total += ITEMSIZE.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
  return total


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape text (`(a, (b, c), d)` → `a`, `(b, c)`, `d`); a
  shape that is no tuple, alone."""
  text = shape.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        parts.append(text[start:i])
    elif ch == "," and depth == 1:
      parts.append(text[start:i])
      start = i + 1
  return [re.sub(r"^/\*index=\d+\*/", "", p.strip()).strip() for p in parts if p.strip()]


def dims(shape: str) -> list[int]:
  """The dimensions of an array shape text."""
  found = _SHAPE.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []
