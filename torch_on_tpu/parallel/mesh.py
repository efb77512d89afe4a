"""Device meshes and device facts.

`make_mesh(fsdp=-1)` / `make_mesh(fsdp=4, tp=2)` builds a `jax.sharding.Mesh`
over all global devices (every host's), ordered by `jax.make_mesh` so that
neighbouring mesh coordinates are neighbours in the physical topology.
`make_mesh(target="v6e-8", fsdp=-1)` builds it over a TPU slice's compile-only
devices instead (`parallel.targets`): programs on it compile, nothing runs.
Axes are `Auto`: shardings propagate through torch code like GSPMD does.
"""

from __future__ import annotations

import logging
import math

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec

from torch_on_tpu import runtime
from torch_on_tpu.errors import TorchOnTpuError, call, named
from torch_on_tpu.parallel import targets

logger = logging.getLogger(__name__)

# Mesh axes that carry the batch, in the order a batch dim is split over them.
# Expert-parallel devices take their share of the batch too (tokens reach the
# experts on other devices through XLA's collectives).
DATA_AXIS_NAMES = ("data", "dp", "fsdp", "ep", "batch")

# The mesh axis that splits the stacked layers into pipeline stages (`torch_on_tpu.parallel.pipeline`);
# not a data axis. Name it first in `make_mesh` so stages sit farthest apart (across slices).
PIPELINE_AXIS = "pp"

# Context parallelism: the axis that splits dim 1 (the sequence) of every batch tensor
# with one. It is not a data axis; its devices shard the parameters FSDP-style
# together with `fsdp` (`param_axes`), so CP costs no parameter memory.
SEQUENCE_AXIS = "cp"
# The axes parameters shard over FSDP-style: `fsdp`, and `ep` and `cp`, whose devices hold
# different tokens too (an expert-parallel device is a data-parallel one outside the experts).
PARAM_AXIS_NAMES = ("fsdp", "ep", SEQUENCE_AXIS)

# Expert parallelism: MoE experts split over `ep` and, inside an MoE layer, over the axes whose
# devices hold other tokens there too (torchtitan's expert-parallel group borrows `cp` and `tp`:
# the tokens are split over both inside the MoE). `parallel.expert_parallel` moves the tokens.
EXPERT_AXIS = "ep"
EXPERT_GROUP_AXES = (EXPERT_AXIS, SEQUENCE_AXIS, "tp")


def make_mesh(devices=None, *, target: str | None = None, **axes: int) -> Mesh:
  """A named mesh over all global devices; one axis may be -1 (fill the rest).

  `make_mesh(fsdp=-1)` puts every device on one `fsdp` axis;
  `make_mesh(fsdp=4, tp=2)` needs exactly 8 devices. `target` names a TPU slice
  to compile for (`"v6e-8"`, `"2xv6e-256"`: `parallel.targets`) whose compile-only
  devices the mesh is made of; with several slices the first axis spans them.
  """
  runtime.setup()  # before jax lists devices: XLA flags, a multi-process join
  if not axes:
    axes = {"fsdp": -1}
  if target is not None:
    if devices is not None:
      raise TorchOnTpuError("make_mesh takes devices= or target=, not both; a target names its own devices.")
    devices = targets.devices(target)
  devices = list(jax.devices() if devices is None else devices)
  count = len(devices)
  names = tuple(axes)
  sizes = [int(s) for s in axes.values()]
  fill = [n for n, s in zip(names, sizes) if s == -1]
  if len(fill) > 1:
    raise TorchOnTpuError(
      f"make_mesh got -1 for axes {fill}; only one axis may fill the remaining devices."
    )
  bad = [n for n, s in zip(names, sizes) if s == 0 or s < -1]
  if bad:
    raise TorchOnTpuError(f"{call('make_mesh', axes)}: mesh axis sizes must be positive or -1.")
  known = math.prod(s for s in sizes if s != -1)
  if fill:
    if count % known:
      raise TorchOnTpuError(
        f"{call('make_mesh', axes)}: the fixed axes multiply to {known}, which does not divide "
        f"the {count} available devices; pick sizes whose product divides {count}{_simulate_hint(devices, known)}."
      )
    sizes[names.index(fill[0])] = count // known
  if math.prod(sizes) != count:
    raise TorchOnTpuError(
      f"{call('make_mesh', axes)} needs {math.prod(sizes)} devices but {count} are available; "
      f"make the axis sizes multiply to {count} or use -1 on one axis{_simulate_hint(devices, math.prod(sizes))}."
    )
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1:
    return _multislice_mesh(tuple(sizes), names, devices, slices)
  try:
    return jax.make_mesh(tuple(sizes), names, axis_types=(AxisType.Auto,) * len(names), devices=devices)
  except NotImplementedError:
    # jax maps each axis onto whole physical torus axes (or products of them); an axis of 2 on a
    # 4x4 v6e slice has none. Splitting a torus axis between mesh axes works too, its collectives
    # running over part of a ring.
    from jax.experimental import mesh_utils

    logger.info("mesh %s: an axis splits a physical torus axis of the %d devices", dict(zip(names, sizes)), count)
    grid = mesh_utils.create_device_mesh(tuple(sizes), devices, allow_split_physical_axes=True)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _simulate_hint(devices: list, wanted: int) -> str:
  """On CPU devices: how to simulate `wanted` of them (a command line's flag, or XLA's own)."""
  if not devices or devices[0].platform != "cpu":
    return ""
  flag = named("cpu_devices")  # `--cpu_devices` where a recipe's command line runs
  how = f"{flag}={wanted}" if flag.startswith("--") else f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted} before jax starts"
  return f", or simulate {wanted} CPU devices with {how}"


def _multislice_mesh(sizes: tuple, names: tuple, devices: list, slices: int) -> Mesh:
  """A mesh over several slices: the first axis spans them (its devices in different slices
  talk over the data-center network), the rest lies inside each slice."""
  from jax.experimental import mesh_utils

  if sizes[0] % slices:
    raise TorchOnTpuError(
      f"The mesh's first axis, {names[0]}={sizes[0]}, spans the {slices} slices and must be a multiple of "
      f"{slices}; put an axis of {slices} (or a multiple) first, e.g. dp={slices} or pp={slices}."
    )
  inside = (sizes[0] // slices, *sizes[1:])
  across = (slices, *([1] * (len(sizes) - 1)))
  # An axis may split a physical torus axis (cp=2 inside a 16x16 v6e slice), as jax.make_mesh allows.
  grid = mesh_utils.create_hybrid_device_mesh(inside, across, devices, allow_split_physical_axes=True)
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def data_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes a batch dim is sharded over by default.

  Those named like data axes (`data`, `dp`, `fsdp`, `ep`, `batch`); a mesh with none of
  them (say only `tp`) replicates the batch.
  """
  return tuple(a for a in mesh.axis_names if a in DATA_AXIS_NAMES)


def param_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes parameters are FSDP-sharded over: `fsdp`, `ep` and `cp`, those the mesh has."""
  return tuple(a for a in PARAM_AXIS_NAMES if a in mesh.shape)


def expert_axes(mesh: Mesh | None) -> tuple[str, ...]:
  """The mesh axes MoE experts split over: with an `ep` axis (of any size), `ep`, `cp` and `tp`,
  those the mesh has with more than one device, in mesh order; without one, none."""
  if mesh is None or EXPERT_AXIS not in mesh.shape:
    return ()
  return tuple(a for a in mesh.axis_names if a in EXPERT_GROUP_AXES and mesh.shape[a] > 1)


def sequence_ways(mesh: Mesh) -> int:
  """How many pieces the `cp` axis splits a sequence into (1 without one)."""
  return mesh.shape.get(SEQUENCE_AXIS, 1)


def batch_ways(mesh: Mesh, axes) -> int:
  """How many pieces the mesh axes `axes` split a batch into."""
  return math.prod(mesh.shape[a] for a in axes)


def batch_spec(axes, ndim: int, sequence: bool = False) -> PartitionSpec:
  """Dim 0 over the mesh axes `axes` (none: replicated); with `sequence`, dim 1 over
  `cp` (context parallelism); the other dims replicated."""
  axes = tuple(axes)
  lead = None if not axes else axes[0] if len(axes) == 1 else axes
  if sequence and ndim >= 2:
    return PartitionSpec(lead, SEQUENCE_AXIS, *([None] * (ndim - 2)))
  return PartitionSpec(lead, *([None] * (ndim - 1)))


def splits_sequence(mesh: Mesh, shape) -> bool:
  """Whether a batch tensor of `shape` has its dim 1 (the sequence) split over `cp`:
  the mesh has a `cp` axis of more than one device and it divides dim 1."""
  ways = sequence_ways(mesh)
  return ways > 1 and len(shape) >= 2 and shape[1] % ways == 0
