"""What a compiled program computes and moves per device, read from its optimized HLO with loops
counted by trip count (XLA's own cost analysis counts a loop body once), and the roofline time
those give on a chip.

Per kernel (a fusion, or an instruction outside any fusion) run `n` times: its FLOPs are the
matmuls inside it (dots, and the convolutions the TPU compiler writes them as: 2 × output
elements × the contracted size), its HBM bytes its operands plus its result in device memory (a
fusion's intermediates stay on chip); its time is the larger of FLOPs at the chip's peak and bytes
at its HBM bandwidth. Only buffers in HBM count (a layout's default memory space): what the TPU
compiler placed in on-chip memory (VMEM, `S(1)`) moves no HBM bytes, and what a kernel reads from
or writes to pinned host memory (host offload, `S(5)`) is counted apart, as host bytes. An
asynchronous op counts once, at its start: `async-start` by the computation it runs, as often as
it runs; `copy-start`, `dynamic-slice-start` and the like as the op they start. Custom calls (Mosaic kernels: splash attention) add no FLOPs to `flops`: the caller
adds the attention's FLOPs it knows from the model (`roofline_seconds(extra_flops=)`). What the
Mosaic kernels say they compute (the `cost_estimate` each carries: splash, the grouped matmuls of
MoE experts) is summed apart, as `kernel_flops`, loops counted.
Collectives are counted apart (`parallel.collectives`); they overlap compute on TPU.
"""

from __future__ import annotations

import dataclasses
import math
import re

from torch_on_tpu.core import hlo_text

# Instructions that move no data of their own (views, tuples, parameters) or are collectives.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "while", "conditional", "call", "copy-done", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "async-start", "async-update", "async-done", "send-done",
         "recv-done"}
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "send", "recv")
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')  # a Mosaic kernel's, in its backend_config


@dataclasses.dataclass
class ProgramCost:
  """Per device, per execution of the program."""

  flops: float  # matmul FLOPs (the Mosaic kernels' not included)
  hbm_bytes: float  # bytes the kernels read and write in device memory
  kernels: list  # (flops, bytes, runs) of every kernel: what the roofline sums
  host_bytes: float = 0.0  # bytes the kernels read from or write to pinned host memory (offloading)
  kernel_flops: float = 0.0  # the Mosaic kernels' FLOPs, as their cost estimates give them (not in `flops`)

  def roofline_seconds(self, peak_flops: float, hbm_bandwidth: float, extra_flops: float = 0.0) -> float:
    """Σ over kernels of max(FLOPs / peak, bytes / bandwidth), plus `extra_flops` (the attention
    kernels' FLOPs) at the peak."""
    seconds = sum(runs * max(f / peak_flops, b / hbm_bandwidth) for f, b, runs in self.kernels)
    return seconds + extra_flops / peak_flops


def program_cost(text: str | hlo_text.Module) -> ProgramCost:
  module = hlo_text.parse(text) if isinstance(text, str) else text
  fused = module.fused()
  kernels, flops, hbm, host, kernel_flops = [], 0.0, 0.0, 0.0, 0.0
  for name, runs in module.runs().items():
    if name in fused:
      continue  # inside a fusion: counted with it
    shapes = module.shapes[name]
    for inst in module.computations[name]:
      if inst.op in _FREE or inst.op.endswith("-done") or inst.op.removesuffix("-start") in _COLLECTIVES:
        continue
      if inst.op == "custom-call" and 'custom_call_target="AllocateBuffer"' in inst.rest:
        continue  # a buffer set aside (the host's for offloaded activations): nothing moves
      moved = _bytes(inst, module, shapes, "hbm")
      computed = _flops(inst, module, shapes)
      kernels.append((computed, moved, runs))
      flops += computed * runs
      hbm += moved * runs
      host += _bytes(inst, module, shapes, "host") * runs
      if inst.op == "custom-call" and (estimate := _KERNEL_FLOPS.search(inst.rest)):
        kernel_flops += int(estimate.group(1)) * runs
  return ProgramCost(flops, hbm, kernels, host, kernel_flops)


def _bytes(inst: hlo_text.Instruction, module: hlo_text.Module, shapes: dict, where: str) -> float:
  """Bytes one kernel reads and writes in `where`'s memory ("hbm" or "host"): its operands and
  its result, except what it only slices (a slice, static or dynamic, reads its slice: the TPU
  compiler prefetches a buffer into VMEM as many slices of it) and what it updates in
  place (a dynamic update slice reads and writes its update, not the whole buffer it writes into)."""
  size = lambda shape: hlo_text.nbytes(shape, where=where)  # noqa: E731
  operands = [size(shapes.get(op, "")) for op in inst.operands()]
  op, result = inst.op, inst.shape
  if op == "copy-start":  # (destination, source, context)
    op, result = "copy", hlo_text.tuple_elements(result)[0]
  elif op.endswith("-start"):  # ((operands), result, context)
    op, result = op.removesuffix("-start"), hlo_text.tuple_elements(result)[1]
  if op in ("slice", "dynamic-slice") and inst.operands():
    source = shapes.get(inst.operands()[0], "")
    read = hlo_text.nbytes(result) if size(source) else 0  # the slice, from where its source lives
    return read + size(result)
  if op == "dynamic-update-slice" and len(operands) >= 2:
    buffer = shapes.get(inst.operands()[0], "")
    written = hlo_text.nbytes(shapes.get(inst.operands()[1], "")) if size(buffer) else 0  # into the buffer's memory
    return operands[1] + written
  if op != "fusion":
    return size(result) + sum(operands)
  (callee, _), *_ = module.callees(inst) or [(None, 0)]
  body = module.computations.get(callee, [])
  params, users = _parameter_users(body)
  root = next((i for i in body if i.root), None)
  written = size(inst.shape)
  in_place = None
  if root is not None and root.op == "dynamic-update-slice" and root.operands()[0] in users:
    in_place = root.operands()[0]
    written = size(module.shapes[callee].get(root.operands()[1], ""))  # its update, read and written
  total = written
  for index, operand in enumerate(operands):
    name = params.get(str(index))
    if name == in_place:
      continue  # the buffer updated in place is neither read nor written whole
    sliced = _sliced_bytes(module, name, users[name]) if name is not None else None
    total += operand if sliced is None else sliced if operand else 0  # what it reads only in slices, its slices
  return total


def _parameter_users(body: list) -> tuple[dict, dict]:
  """A fusion body's parameters by index, and each one's users, in one pass (a body can hold
  thousands of instructions and parameters)."""
  params = {re.search(r"^(\d+)", i.rest).group(1): i.name for i in body if i.op == "parameter"}
  users = {name: [] for name in params.values()}
  for i in body:
    for name in dict.fromkeys(i.operands()):
      if name in users:
        users[name].append(i)
  return params, users


def _sliced_bytes(module: hlo_text.Module, name: str, users: list) -> int | None:
  """The bytes a fusion reads of its parameter `name` when it reads it only through slices,
  directly or as the operand of a nested fusion that does (the TPU compiler nests the slice of
  a scan's stacked residual in the loop fusion that feeds a matmul); None when it reads more."""
  total = 0
  for user in users:
    if user.op in ("slice", "dynamic-slice") and user.operands()[0] == name:
      total += hlo_text.nbytes(user.shape)
    elif user.op == "fusion" and module.callees(user):
      (inner, _), *_ = module.callees(user)
      params, inner_users = _parameter_users(module.computations.get(inner, []))
      for index, operand in enumerate(user.operands()):
        if operand == name:
          read = _sliced_bytes(module, params.get(str(index), ""), inner_users.get(params.get(str(index)), []))
          if read is None:
            return None
          total += read
    else:
      return None
  return total if users else None


def _flops(inst: hlo_text.Instruction, module: hlo_text.Module, shapes: dict) -> float:
  """The matmul FLOPs of one instruction (a fusion's: of the computations it calls)."""
  if inst.op == "fusion":
    return sum(_flops(i, module, module.shapes[callee]) for callee, _ in module.callees(inst)
               for i in module.computations[callee])
  out = math.prod(hlo_text.dims(inst.shape))
  operands = inst.operands()
  if inst.op == "dot" and operands:
    lhs = hlo_text.dims(shapes.get(operands[0], ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
    size = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
    return 2.0 * out * size
  if inst.op == "convolution" and operands:
    lhs = hlo_text.dims(shapes.get(operands[0], ""))
    labels = re.search(r"dim_labels=([0-9a-z]+)_", inst.rest)
    groups = re.search(r"feature_group_count=(\d+)", inst.rest)
    if not (labels and lhs) or "f" not in labels.group(1):
      return 0.0
    features = lhs[labels.group(1).index("f")]
    return 2.0 * out * features * _taps(inst.rest) / (int(groups.group(1)) if groups else 1)
  return 0.0


def _taps(rest: str) -> int:
  """Input positions one output of a convolution reads per feature: its window's size, except
  along a dim the TPU compiler uses to batch a dot: a window padded by size-1 on both sides and
  reversed, or one over an input dilated by as much as the window is wide (`size=n stride=n-1
  lhs_dilate=n`, as it writes `ragged_dot`'s weight gradient): each output reads one position of
  it. A window over an input dilated by d reads one real position per d taps."""
  window = re.search(r"window=\{([^}]*)\}", rest)
  if window is None:
    return 1
  fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1)))
  sizes = [int(x) for x in fields.get("size", "1").split("x")]
  per_dim = lambda name, default: fields[name].split("x") if name in fields else [default] * len(sizes)  # noqa: E731
  pads, reversed_, dilated = per_dim("pad", ""), per_dim("rhs_reversal", "0"), per_dim("lhs_dilate", "1")
  return math.prod(1 if r == "1" and p == f"{n - 1}_{n - 1}" else -(-n // int(d))
                   for n, p, r, d in zip(sizes, pads, reversed_, dilated))
