"""Compile-only targets: a TPU slice you do not have, as devices the real TPU compiler builds for.

    mesh = tot.make_mesh(target="v6e-8", fsdp=-1)    # 8 compile-only TPU v6e devices
    jm = tot.ShardedModule(model, mesh=mesh, abstract=True)
    report = tot.make_train_step(jm, loss_fn, optax.adamw(1e-4)).compile(tokens, labels)

libtpu (a pinned dependency) gives a compile-only client for any slice
(`jax.experimental.topologies`): `jit(...).lower(...).compile()` on its devices yields the exact
TPU executable (Mosaic kernels included), its memory analysis and its optimized HLO; nothing
runs and nothing is allocated. The target is an argument of the mesh, never a separate code path:
the same ShardedModule, step, plan and compile report serve a CPU test and a v5p-1024 dry run.

A target is named as Cloud TPU names its slices: `<generation>-<size>`, where the size counts
chips for v5e and v6e and TensorCores (two per chip) for v4 and v5p (`v5p-8` is 4 chips, as in
Cloud TPU's accelerator types); `<n>x<slice>` is n slices joined by the data-center network
(`2xv6e-256`), the mesh's first axis spanning them. A libtpu topology (`v6e:2x4`, `tpu7x:2x2x1`)
is taken as well. libtpu 0.0.42 knows the generations in `GENERATIONS`.
"""

from __future__ import annotations

import dataclasses
import math
import re

from torch_on_tpu.core import extras
from torch_on_tpu.errors import TorchOnTpuError, first_line

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation as libtpu and Cloud TPU name it, and the chip's published figures."""

  name: str  # Cloud TPU's name: v6e
  topology: str  # libtpu's topology prefix: v6e
  torus_dims: int  # 2 (v5e, v6e) or 3 (v4, v5p, tpu7x)
  cores_per_chip: int  # TensorCores a Cloud TPU name counts per chip (v4, v5p: 2)
  devices_per_chip: int  # devices jax sees per chip (tpu7x: its 2 TensorCores)
  hbm_bytes: int  # per device, as the TPU compiler budgets it
  peak_bf16_flops: float  # per device, dense
  hbm_bandwidth: float  # bytes/s per device
  chip_config: str | None = None  # libtpu's chip_config_name (v4: its TensorCores as one device)

  def chips(self, size: int) -> int:
    return size // self.cores_per_chip


# HBM per device as libtpu 0.0.42's compiler budgets it ("exceeds available HBM (31.25G)" for
# v6e), and the chips' published bf16 dense peak and HBM bandwidth (tpu7x's halved per device).
GENERATIONS = {
  g.name: g
  for g in (
    Generation("v4", "v4", 3, 2, 1, int(30.75 * GiB), 275e12, 1.2e12, chip_config="megacore"),
    Generation("v5e", "v5e", 2, 1, 1, int(15.75 * GiB), 197e12, 819e9),
    Generation("v5p", "v5p", 3, 2, 1, int(95.74 * GiB), 459e12, 2.765e12),
    Generation("v6e", "v6e", 2, 1, 1, int(31.25 * GiB), 918e12, 1.64e12),
    Generation("tpu7x", "tpu7x", 3, 1, 2, int(94.75 * GiB), 2307e12 / 2, 7.37e12 / 2),
  )
}
_ALIASES = {"v5litepod": "v5e", "v6": "v6e", "v7": "tpu7x", "v7x": "tpu7x"}


@dataclasses.dataclass(frozen=True)
class Target:
  """A slice (or several) to compile for."""

  name: str  # as given: v6e-8, 2xv6e-256, v6e:2x4
  generation: Generation
  topology: str  # libtpu's: v6e:2x4
  slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(int(n) for n in self.topology.split(":")[1].split("x")) * self.slices

  @property
  def hbm_bytes(self) -> int:
    return self.generation.hbm_bytes

  def __str__(self) -> str:
    kind = f"{self.slices} × {self.topology}" if self.slices > 1 else self.topology
    return f"{self.name} ({kind}, {self.chips} chips, {self.hbm_bytes / GiB:.2f} GiB HBM per device)"


def parse(name: str) -> Target:
  """The target a name means, or one sentence naming the names that work."""
  text = str(name).strip()
  slices, _, rest = text.rpartition("x") if re.fullmatch(r"\d+x\S+", text) else ("1", "", text)
  slices = int(slices)
  if ":" in rest:
    prefix, _, shape = rest.partition(":")
    generation = _generation(prefix, text)
    if not re.fullmatch(r"\d+(x\d+)*", shape) or len(shape.split("x")) != generation.torus_dims:
      raise TorchOnTpuError(
        f"TPU topology '{rest}' is not {generation.torus_dims} numbers joined by 'x' (e.g. "
        f"{generation.topology}:{_shape(4, generation.torus_dims)}); give a slice name like {generation.name}-8 instead."
      )
    return Target(text, generation, f"{generation.topology}:{shape}", slices)
  match = re.fullmatch(r"([a-z0-9]+?)-(\d+)", rest)
  if not match or slices < 1:
    raise TorchOnTpuError(
      f"'{text}' is not a TPU slice name; write <generation>-<size> (v6e-8, v5p-1024), "
      f"<slices>x<slice> (2xv6e-256) or a libtpu topology (v6e:2x4); generations: {', '.join(GENERATIONS)}."
    )
  generation = _generation(match[1], text)
  size = int(match[2])
  chips = generation.chips(size)
  if size % generation.cores_per_chip or chips < 1 or chips & (chips - 1):
    unit = "TensorCores, two per chip," if generation.cores_per_chip == 2 else "chips"
    raise TorchOnTpuError(
      f"'{text}': a {generation.name} slice name counts {unit} in a power of two (e.g. "
      f"{generation.name}-{4 * generation.cores_per_chip}); for another shape give its topology, e.g. "
      f"{generation.topology}:{_shape(4, generation.torus_dims)}."
    )
  return Target(text, generation, f"{generation.topology}:{_shape(chips, generation.torus_dims)}", slices)


def _generation(prefix: str, text: str) -> Generation:
  generation = GENERATIONS.get(_ALIASES.get(prefix, prefix))
  if generation is None:
    raise TorchOnTpuError(
      f"'{text}' names TPU generation '{prefix}', which libtpu's compile-only client does not "
      f"know; use one of {', '.join(GENERATIONS)}."
    )
  return generation


def _shape(chips: int, dims: int) -> str:
  """The torus a power-of-two chip count forms, as Cloud TPU lays slices out: 2-D slices as
  square as they go (2x4, 16x16); 3-D ones grown from 2x2x1 one dim at a time (2x2x2, 2x2x4,
  2x4x4, 4x4x4, ...)."""
  if dims == 2:
    side = [1, 1]
    while side[0] * side[1] < chips:
      side[side[0] > side[1]] *= 2  # grow the shorter side; the longer goes second
      side.sort()
    return "x".join(map(str, side))
  side = [2, 2, 1] if chips >= 4 else [chips, 1, 1]
  while math.prod(side) < chips:
    i = min(range(3), key=lambda d: (side[d], -d))  # the smallest dim, the last among equals
    side[i] *= 2
    side = sorted(side[:2]) + [side[2]] if side[2] <= side[0] else sorted(side)
  return "x".join(map(str, side))


# Targets → their compile-only devices, made once per process (a mesh's devices say its target).
_made: dict[Target, tuple] = {}


def devices(target: str | Target) -> tuple:
  """The compile-only devices of `target` (a name or a `Target`), from libtpu's client."""
  from torch_on_tpu.runtime import libtpu

  target = target if isinstance(target, Target) else parse(target)
  if target in _made:
    return _made[target]
  extras.require("libtpu", f"Compiling for {target.name}")
  libtpu.quiet_without_chips()
  try:
    from jax.experimental import topologies

    kwargs = {"num_slices": target.slices} if target.slices > 1 else {}
    if target.generation.chip_config:
      kwargs["chip_config_name"] = target.generation.chip_config
    found = topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **kwargs).devices
  except Exception as e:  # noqa: BLE001 (libtpu's refusal, said as one sentence)
    raise TorchOnTpuError(f"libtpu does not build a compile-only {target.topology} slice ({first_line(e)}); pick another size.") from None
  _made[target] = tuple(found)
  return _made[target]


def target_of(devices_) -> Target | None:
  """The target a mesh's devices were made for (None: real devices, or not from `devices`)."""
  first = next(iter(devices_), None)
  for target, found in _made.items():
    if found and first is found[0]:
      return target
  return None
