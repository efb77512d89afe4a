"""Pipeline parallelism: the stacked layers split into stages over the `pp` mesh axis.

The layer stack (`StackedLayers`) holds every layer's tensors in one array with a
leading layer dim. With a `pp` axis of size S that dim is sharded over `pp`: each
stage's devices hold a contiguous block of the stored layers. One step stays one
compiled program; the schedule is a `lax.scan` over clock ticks in which every
stage runs its layers on its own microbatch at once and hands the result to the
next stage:

* the stage dim is an array dim sharded over `pp` (GSPMD style, as MaxText's
  circular pipeline): the stage function is `vmap`ped over it with
  `spmd_axis_name="pp"`, so everything inside a stage — the FSDP gathers, TP's
  collectives, activation constraints and attention's own `shard_map` — composes
  as it does without a pipeline (vmap adds `pp` to their specs);
* the hand-off is `jnp.roll` of the stage outputs along that dim, which XLA's
  partitioner lowers to one collective permute per tick (checked in the optimized
  HLO by `tools/bench_pp.py`); no stage ever reads another stage's layers;
* each stage's forward per tick is rematerialised (GPipe): the backward keeps only
  the stage inputs of every tick and recomputes the stage's layers;
* circular (interleaved) with V virtual stages: stage s holds V blocks of layers
  (blocks s, s+S, s+2S, ... of the S·V blocks in layer order) and every
  microbatch goes round the ring V times; the bubble shrinks V-fold.
* the blocks are equal (the stacked arrays shard their layer dim over `pp`): of L
  layers the first `L − L mod S·V` run in the stages and the rest after them, as the
  model's own modules on the batch split over every device (`Schedule.staged_layers`).

Microbatch m at stage s in its round r runs at tick `r·M + m + s`; a schedule
of M microbatches takes `V·M + S − 1` ticks, `S − 1` of them filling and
draining: the bubble fraction is `(S − 1) / (V·M + S − 1)`. Stage 0 reads its
microbatches from a buffer that starts as the input and into which the last
stage's outputs arrive (the roll's wrap-around), so a circular round needs no
extra traffic and the outputs collect there too.

Embedding, final norm, head and loss stay outside the pipeline: they run on the
whole batch split over the data axes *and* `pp` (each pp device does 1/S of
them; no stage idles waiting for them, none computes them twice), the sequence
over `cp` where the mesh has one (`batch_sharding`), with their parameters
FSDP-sharded over `pp` as well. The cost is one activation-sized
collective each way at the pipeline's boundary per step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_on_tpu.errors import TorchOnTpuError, arg, named
from torch_on_tpu.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which microbatch each stage runs at each tick.

  Args:
    stages: S, the size of the `pp` mesh axis.
    microbatches: M, how many pieces the batch reaching the layer stack is cut
      into (row i goes to microbatch i mod M, so every microbatch spans all
      data shards).
    virtual_stages: V, blocks of layers per stage visited round-robin
      (circular / interleaved schedule); 1 is plain GPipe fill/drain.
  """

  stages: int
  microbatches: int
  virtual_stages: int = 1

  def __post_init__(self):
    for name in ("stages", "microbatches", "virtual_stages"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise TorchOnTpuError(f"The pipeline's {name} must be a positive integer, got {value!r}.")
    if self.virtual_stages > 1 and self.microbatches < self.stages:
      raise TorchOnTpuError(
        f"A circular pipeline ({arg('virtual_stages', self.virtual_stages)}) needs at least as many "
        f"microbatches as stages, got {arg('microbatches', self.microbatches)} for pp={self.stages}; use "
        f"{named('microbatches')} of at least {self.stages}, or {arg('virtual_stages', 1)}."
      )

  @property
  def ticks(self) -> int:
    """Clock ticks of one pass: `V·M + S − 1`."""
    return self.virtual_stages * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """The share of stage-ticks spent filling and draining: `(S − 1) / (V·M + S − 1)`."""
    return (self.stages - 1) / self.ticks

  def __str__(self) -> str:
    kind = "plain GPipe" if self.virtual_stages == 1 else f"circular, {self.virtual_stages} virtual stages"
    return (
      f"pp={self.stages} × {self.microbatches} microbatches ({kind}): bubble "
      f"{self.bubble_fraction:.1%} of {self.ticks} ticks"
    )

  def layers_problem(self, num_layers: int) -> str | None:
    """Why `num_layers` layers cannot fill this schedule's blocks (fewer layers than blocks), or None."""
    blocks = self.stages * self.virtual_stages
    if num_layers >= blocks:
      return None
    return (
      f"the model's {num_layers} layers are fewer than the pp={self.stages} × virtual_stages={self.virtual_stages} "
      f"= {blocks} blocks of the schedule, each of which holds at least one layer; use pp × virtual_stages of at "
      f"most {num_layers}"
    )

  def staged_layers(self, num_layers: int) -> int:
    """How many of `num_layers` layers run in the stages: the most that split into the S·V
    blocks equally (stacked arrays sharded over `pp` need equal blocks); the rest, fewer than
    S·V, run after the pipeline as the model's own modules (`scan.layout_for`)."""
    return num_layers - num_layers % (self.stages * self.virtual_stages)

  def storage_order(self, num_layers: int) -> list[int]:
    """Stored position → layer index: stage s's layers contiguous, its V blocks in round order.

    The stacked arrays keep the layers in this order so that sharding the layer dim
    over `pp` puts each stage's blocks on its devices (identity for V = 1). Names do
    not change: the stacked name's group lists the original per-layer names in the
    same order, which is what checkpoints and `state_dict()` read.
    """
    per_block = num_layers // (self.stages * self.virtual_stages)
    return [
      (v * self.stages + s) * per_block + j
      for s in range(self.stages)
      for v in range(self.virtual_stages)
      for j in range(per_block)
    ]


def stages_of(mesh: Mesh) -> int:
  """The size of the mesh's `pp` axis (1 without one)."""
  return int(mesh.shape.get(mesh_lib.PIPELINE_AXIS, 1))


def outside_spec(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
  """A parameter outside the layer stack (embedding, head, final norm): its map's spec,
  with `pp` added to the dim `fsdp` already splits where `fsdp·pp` divides it, so the
  pp devices, which share its compute, share its memory too."""
  entries = list(spec) + [None] * (len(shape) - len(tuple(spec)))
  pp = mesh_lib.PIPELINE_AXIS
  if any(pp in _axes(e) for e in entries):
    return PartitionSpec(*entries)
  for dim, entry in enumerate(entries):
    axes = _axes(entry)
    if "fsdp" in axes:
      ways = math.prod(mesh.shape[a] for a in axes) * mesh.shape[pp]
      if shape[dim] % ways == 0:
        entries[dim] = (*axes, pp)
      break
  return PartitionSpec(*entries)


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


class Pipeline:
  """A `Schedule` on a mesh: runs a stage function over the stacked layers."""

  def __init__(self, schedule: Schedule, mesh: Mesh, data_axes):
    self.schedule = schedule
    self.mesh = mesh
    self.data_axes = tuple(a for a in data_axes if mesh.shape[a] > 1)
    self.staging = False  # while the stages trace: their pins must not name `pp` (the vmap adds it)

  def batch_problem(self, batch: int) -> str | None:
    m = self.schedule.microbatches
    if batch % m:
      divisors = [d for d in range(1, batch + 1) if batch % d == 0]
      return (
        f"the batch of {batch} rows reaching the layer stack does not split into {arg('microbatches', m)}; "
        f"use a microbatch count that divides it ({divisors}) or a batch that is a multiple of {m}"
      )
    return None

  def output_sharding(self, ndim: int, rows: int) -> NamedSharding | None:
    """Where the tokens go after the layer stack, as rows (batch-major, the loss's): over the
    data axes and `pp` (the head and the loss then run once over all devices), then `cp` (each
    device's piece of its rows' sequences); None where they do not divide."""
    axes = (*self.data_axes, mesh_lib.PIPELINE_AXIS)
    if mesh_lib.sequence_ways(self.mesh) > 1:
      axes = (*axes, mesh_lib.SEQUENCE_AXIS)
    if rows % mesh_lib.batch_ways(self.mesh, axes):
      return None
    return NamedSharding(self.mesh, PartitionSpec(axes, *[PartitionSpec.UNCONSTRAINED] * (ndim - 1)))

  def batch_sharding(self, shape) -> NamedSharding | None:
    """A batch tensor [B, L, ...] outside the stages: rows over the data axes and `pp`, the
    sequence over `cp` where the mesh splits it, other dims free; None where the rows do not
    divide. Pinned to the data axes alone (`cp`'s activation pins), the head would run on
    every stage's devices again."""
    axes = (*self.data_axes, mesh_lib.PIPELINE_AXIS)
    if shape[0] % mesh_lib.batch_ways(self.mesh, axes):
      return None
    rest = [PartitionSpec.UNCONSTRAINED] * (len(shape) - 1)
    if mesh_lib.splits_sequence(self.mesh, shape):
      rest[0] = mesh_lib.SEQUENCE_AXIS
    return NamedSharding(self.mesh, PartitionSpec(axes, *rest))

  def spread(self, tree):
    """Arrays of `tree` (labels) split like the pipeline's output (`batch_sharding`);
    each pp device keeps its slice of what it held whole, so no data moves."""

    def leaf(x):
      sharding = self.batch_sharding(x.shape) if isinstance(x, jax.Array) and x.ndim else None
      return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    return jax.tree.map(leaf, tree)

  def _constrain(self, x, lead: tuple, batch_dim: int):
    """Pins the stage/microbatch dims of `x`; the batch dim over the data axes where they
    divide it; every other dim left to the partitioner."""
    ways = mesh_lib.batch_ways(self.mesh, self.data_axes)
    data = self.data_axes if self.data_axes and x.shape[batch_dim] % ways == 0 else None
    data = data[0] if data and len(data) == 1 else data
    entries = [*lead, data] + [PartitionSpec.UNCONSTRAINED] * (x.ndim - len(lead) - 1)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*entries)))

  def run(self, stage_fn, stacked, hidden, per_example, state=None):
    """The layer stack on `hidden` [B, ...], pipelined.

    `stacked`: pytree of arrays with a leading dim of the stored layers (in
    `storage_order`); `per_example`: pytree of arrays [B, ...] the layers take per
    row (masks, positions); `state`: arrays like `stacked` that the layers update as they
    run (buffers: MoE token counts), carried from tick to tick, each microbatch's update
    kept in the order the stage runs them, a tick that runs no microbatch changing nothing.
    `stage_fn(block, h, per_example_mb, microbatch, block_state)` runs one block of layers
    (`block`: `stacked` sliced to that block's layers, `block_state` its `state`) on one
    microbatch `h` [B/M, ...] and returns (h, the block's new state); it is traced once,
    vmapped over the stages. Returns the last layer's output [B, ...], batch split over the
    data axes and `pp`, and the final `state`.
    """
    s_count, m_count, v_count = self.schedule.stages, self.schedule.microbatches, self.schedule.virtual_stages
    pp = mesh_lib.PIPELINE_AXIS
    to_blocks = lambda a: a.reshape(s_count, v_count, a.shape[0] // (s_count * v_count), *a.shape[1:])  # noqa: E731
    blocks = jax.tree.map(to_blocks, stacked)
    state = {} if state is None else state
    state_blocks = jax.tree.map(to_blocks, state)
    split = lambda a: a.reshape(a.shape[0] // m_count, m_count, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731
    micro = self._constrain(split(hidden), (None,), 1)
    per_example = jax.tree.map(lambda a: self._constrain(split(a), (None,), 1), per_example)
    # Stage 0's inbox: the microbatches, then the last stage's outputs as they come round;
    # slot M takes what nobody files (a write there instead of a select: the backward then
    # keeps an index per tick, not a mask the size of the activations).
    scratch = jnp.zeros_like(micro[:1])
    inbox = jnp.broadcast_to(jnp.concatenate([micro, scratch]), (s_count, m_count + 1, *micro.shape[1:]))
    inbox = self._constrain(inbox, (pp, None), 2)
    state = self._constrain(jnp.broadcast_to(micro[0], (s_count, *micro.shape[1:])), (pp,), 1)
    stage_ids = jnp.arange(s_count)

    def one_stage(block_all, h, stage, tick, state_all):
      offset = tick - stage
      microbatch = offset % m_count
      round_ = jnp.clip(offset // m_count, 0, v_count - 1)
      block = jax.tree.map(lambda a: a[round_], block_all)
      mine = jax.tree.map(lambda a: a[microbatch], per_example)
      before = jax.tree.map(lambda a: a[round_], state_all)
      h, after = stage_fn(block, h, mine, microbatch, before)
      runs = (offset >= 0) & (offset < v_count * m_count)  # a bubble tick's update is dropped
      after = jax.tree.map(lambda new, old: jax.lax.stop_gradient(jnp.where(runs, new, old)), after, before)
      return h, jax.tree.map(lambda a, b: a.at[round_].set(b), state_all, after)

    run_stages = jax.vmap(
      jax.checkpoint(one_stage, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=True),
      in_axes=(0, 0, 0, None, 0),
      spmd_axis_name=pp,
    )

    def receive(inbox, state, tick):
      """Stage 0 files what the last stage finished one tick ago (round r, microbatch m)."""
      arrived = tick - s_count  # that output's offset: r·M + m
      slot = arrived % m_count

      def file(box, stage, incoming):
        keep = (stage == 0) & (arrived >= 0)
        return box.at[jnp.where(keep, slot, m_count)].set(incoming)

      return self._constrain(jax.vmap(file)(inbox, stage_ids, state), (pp, None), 2)

    def take(box, stage, own, tick):
      """Stage 0 takes its inbox's microbatch for this tick; the others what they were handed."""
      return jnp.stack([own, box[tick % m_count]])[(stage == 0).astype(jnp.int32)]

    def tick_fn(carry, tick):
      inbox, state, buffers = carry
      inbox = receive(inbox, state, tick)
      inputs = jax.vmap(take, in_axes=(0, 0, 0, None))(inbox, stage_ids, state, tick)
      outputs, buffers = run_stages(blocks, inputs, stage_ids, tick, buffers)
      outputs = self._constrain(outputs, (pp,), 1)
      return (inbox, jnp.roll(outputs, 1, axis=0), buffers), None

    ticks = self.schedule.ticks
    self.staging = True
    try:
      (inbox, state, state_blocks), _ = jax.lax.scan(tick_fn, (inbox, state, state_blocks), jnp.arange(ticks))
    finally:
      self.staging = False
    inbox = receive(inbox, state, ticks)
    # Stage 0's inbox holds every microbatch's last output; the masked sum over stages
    # is one reduce-scatter (or all-reduce) of one activation tensor.
    first = stage_ids.reshape(-1, *([1] * (inbox.ndim - 1))) == 0
    done = jnp.sum(jnp.where(first, inbox, jnp.zeros((), inbox.dtype)), axis=0)[:m_count]
    done = self._constrain(done, (pp if m_count % s_count == 0 else None,), 1)
    out = done.swapaxes(0, 1).reshape(hidden.shape)
    return out, jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), state_blocks)
