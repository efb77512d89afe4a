"""What one compiled step costs per device: memory from XLA's own analysis (arguments, outputs,
donated, temporaries, host-offloaded); FLOPs, HBM bytes and the collectives' bytes from its
optimized HLO with loops counted; its ops and kernels; how attention and a pipeline ran. `TrainStep.compile()` returns it; the recipes print it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import warnings

from torch_on_tpu.core import hlo_text
from torch_on_tpu.core.sizes import human_bytes
from torch_on_tpu.parallel.collectives import CollectiveBytes, collective_bytes
from torch_on_tpu.training.program_cost import ProgramCost, program_cost

_OPCODE = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(", re.M)
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass
class CompileReport:
  """Per-device facts about one compiled step (from XLA's own analyses)."""

  seconds: float
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None  # outputs written into donated arguments
  temp_bytes: int | None = None
  # The compiler's own count of its peak (`peak_memory_in_bytes`, arguments included): on TPU,
  # for a program of GiBs, what its schedule holds at once, below arguments + temporaries (the
  # allocation is laid out larger); what the plan is calibrated against. Not the fit verdict:
  # for a small program it reads above the allocation, and it counts host memory too
  # (`_peak_counts`), so where the program offloads it only bounds the chip's peak.
  compiler_peak_bytes: int | None = None
  generated_code_bytes: int | None = None
  host_offloaded_bytes: int | None = None  # host temporaries + host arguments/outputs
  attention_splits: tuple[str, ...] = ()  # how attention crossed a `cp` axis (context parallelism)
  collective_bytes: CollectiveBytes | None = None  # received per device per step, loops counted
  flops: float | None = None  # matmul FLOPs per device, loops counted (Mosaic kernels' not included)
  bytes_accessed: float | None = None  # HBM bytes the kernels read and write, loops counted
  cost: ProgramCost | None = None  # per kernel, for a roofline (`ProgramCost.roofline_seconds`)
  pipeline: str | None = None  # the schedule and its bubble fraction, with a `pp` axis
  ops: dict[str, int] = dataclasses.field(default_factory=dict)  # HLO opcode → instructions in the optimized program
  custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # kernel target → calls (Mosaic: tpu_custom_call)
  matmuls: dict[str, int] = dataclasses.field(default_factory=dict)  # "lhs×rhs" operand dtypes → matmuls (dots, TPU convolutions)

  @property
  def peak_bytes(self) -> int | None:
    """Arguments + outputs not aliased to them + temporaries: the step's device memory."""
    if self.argument_bytes is None:
      return None
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def fits(self, device_bytes: int | None) -> bool:
    """The program's memory per device fits `device_bytes` (no memory analysis: assumed to)."""
    return self.peak_bytes is None or device_bytes is None or self.peak_bytes <= device_bytes

  def _peak_counts(self) -> str:
    """What the compiler's peak adds up: it counts host memory with the chip's, so where the
    program offloads, the host's bytes are in it (Llama 3 8B at `offload_dots` on v6e-8: the peak
    is its arguments plus all 21.5 GiB on the host, to the MiB, above the chip's allocation)."""
    return "arguments and host memory included" if self.host_offloaded_bytes else "arguments included"

  def __str__(self) -> str:
    parts = [f"compiled in {self.seconds:.1f} s"]
    if self.argument_bytes is not None:
      parts.append(
        f"per device: arguments {human_bytes(self.argument_bytes)}, outputs "
        f"{human_bytes(self.output_bytes)} ({human_bytes(self.alias_bytes)} donated), "
        f"temporaries {human_bytes(self.temp_bytes)}"
        + (f" (the compiler's peak {human_bytes(self.compiler_peak_bytes)}, {self._peak_counts()})" if self.compiler_peak_bytes else "")
        + f", generated code "
        f"{human_bytes(self.generated_code_bytes)}, host offloaded "
        f"{human_bytes(self.host_offloaded_bytes)}"
      )
    if self.flops is not None:
      kernels = self.cost.kernel_flops if self.cost is not None else 0
      mosaic = f" (+ {kernels / 1e9:.2f} in Mosaic kernels, as they report them)" if kernels else ""
      parts.append(f"{self.flops / 1e9:.2f} GFLOP{mosaic}, {human_bytes(self.bytes_accessed or 0)} accessed")
    if self.pipeline is not None:
      parts.append(self.pipeline)
    if self.collective_bytes is not None:
      parts.append(f"collectives {self.collective_bytes}")
    if self.attention_splits:
      parts.append("attention across " + "; ".join(self.attention_splits))
    return "; ".join(parts)


def report(compiled, seconds) -> CompileReport:
  report = CompileReport(seconds=seconds)
  try:
    mem = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    mem = None
  if mem is not None:
    report.argument_bytes = mem.argument_size_in_bytes
    report.output_bytes = mem.output_size_in_bytes
    report.alias_bytes = mem.alias_size_in_bytes
    report.temp_bytes = mem.temp_size_in_bytes
    report.compiler_peak_bytes = getattr(mem, "peak_memory_in_bytes", 0) or None  # 0 where a backend does not say
    report.generated_code_bytes = mem.generated_code_size_in_bytes
    report.host_offloaded_bytes = sum(
      getattr(mem, f"host_{k}_size_in_bytes", 0) or 0 for k in ("argument", "output", "temp")
    )
  try:
    text = compiled.as_text()
  except Exception:  # noqa: BLE001 (a backend without HLO text: the report goes without)
    text = None
  if text is not None:
    module = hlo_text.parse(text)
    report.collective_bytes = collective_bytes(module)
    report.cost = program_cost(module)  # loops by trip count, where XLA's cost analysis counts a body once
    report.flops, report.bytes_accessed = report.cost.flops, report.cost.hbm_bytes
    report.ops = dict(collections.Counter(_OPCODE.findall(text)))
    report.custom_calls = dict(collections.Counter(_CUSTOM_CALL.findall(text)))
    report.matmuls = dict(collections.Counter(
      "×".join(module.shapes[name].get(op, "?").split("[")[0] for op in inst.operands()[:2])
      for name, insts in module.computations.items() for inst in insts if inst.op in ("dot", "convolution")
    ))
  return report


@contextlib.contextmanager
def quiet_donation_warnings():
  """Donated buffers XLA cannot reuse (e.g. small scalars) are harmless; jax warns per compile."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    yield
