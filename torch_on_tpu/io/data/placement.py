"""Onto the mesh: each process's host rows → global `jax.Array`s, the batch dim over the
data axes and the sequence (dim 1) over `cp` where the mesh has one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.parallel import mesh as mesh_lib


def to_global(
  batch: Mapping[str, np.ndarray], mesh: Mesh, axes: Sequence[str] | None = None
) -> dict[str, jax.Array]:
  """This process's rows → global `jax.Array`s, dim 0 sharded over `axes`, the rest replicated.

  `axes` defaults to the mesh's data axes (`torch_on_tpu.parallel.mesh.data_axes`).
  Every process calls this with its own rows, in the same step.
  """
  axes = mesh_lib.data_axes(mesh) if axes is None else tuple(axes)
  for axis in axes:
    if axis not in mesh.shape:
      raise TorchOnTpuError(
        f"Batch axis '{axis}' is not in the mesh {dict(mesh.shape)}; pass axes from its names."
      )
  ways = mesh_lib.batch_ways(mesh, axes)
  if not axes and jax.process_count() > 1:
    raise TorchOnTpuError(
      f"The mesh {dict(mesh.shape)} has no data axis to split the processes' rows over; pass axes=."
    )
  _, blocks = process_rows(mesh, axes)
  out = {}
  for name, local in batch.items():
    local = np.asarray(local)
    rows = local.shape[0] * blocks
    if rows % ways:
      raise TorchOnTpuError(
        f"The global batch of {rows} rows ('{name}') does not divide over the {ways}-way data axes {axes}; "
        f"use a global batch size that is a multiple of {ways}."
      )
    sequence = mesh_lib.splits_sequence(mesh, local.shape)  # dim 1 over `cp`: each device its piece
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(axes, local.ndim, sequence))
    if jax.process_count() > 1:
      _check_rows_per_process(sharding, (rows, *local.shape[1:]), local.shape[0], name)
    out[name] = jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))
  return out


def process_rows(mesh: Mesh, axes: Sequence[str] | None = None) -> tuple[int, int]:
  """(which block of every global batch this process's devices hold, how many blocks):
  what to pass `data.batches` as `process_index` / `process_count`.

  Without pipeline stages, process p of P holds block p of P. Processes that differ
  only along axes that do not split the batch (`pp`: a stage per slice) hold the same
  rows, so they read the same block.
  """
  axes = mesh_lib.data_axes(mesh) if axes is None else tuple(axes)
  ways = mesh_lib.batch_ways(mesh, axes)
  sharding = NamedSharding(mesh, mesh_lib.batch_spec(axes, 1))
  held = sorted({r for index in sharding.addressable_devices_indices_map((ways,)).values() for r in range(*index[0].indices(ways))})
  if held != list(range(held[0], held[0] + len(held))) or ways % len(held):
    raise TorchOnTpuError(
      f"This process's devices hold batch rows {held} of {ways} on the mesh {dict(mesh.shape)}, not one "
      f"contiguous block; build the mesh with make_mesh, which keeps each process's devices together."
    )
  return held[0] // len(held), ways // len(held)


def _check_rows_per_process(sharding, shape, local_rows: int, name: str) -> None:
  """Each process's devices must hold exactly the rows it brings: a mesh axis that splits
  something else than rows (`cp`, `tp`) across processes would need the same rows twice."""
  starts = {index[0].start or 0 for index in sharding.addressable_devices_indices_map(shape).values()}
  held = len(starts) * sharding.shard_shape(shape)[0]
  if held != local_rows:
    raise TorchOnTpuError(
      f"The batch '{name}': this process's devices hold {held} of the global rows but it brings {local_rows}; "
      f"a mesh axis other than the data axes spans processes (cp or tp across hosts); put those axes "
      f"within each host's devices."
    )
