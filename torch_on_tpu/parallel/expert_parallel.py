"""Expert parallelism that moves tokens: each token's routed rows travel to the devices holding
their experts, the experts run there, and the results come back.

An expert's weights are the largest tensors of an MoE layer and the rows routed to it are few, so
gathering experts to the tokens (every data shard receiving every layer's experts) costs far
more than sending the rows (DeepSeek-V3: 21 GiB of bf16 experts a layer against a few hundred MiB
of rows). With an `ep` axis on the mesh the experts split over the expert-parallel group,
`ep × cp × tp` (torchtitan's: its `ep` borrows devices from `dp_shard × cp × tp`, and inside the
MoE the tokens are split over `cp` and `tp` too, so every device of the group routes tokens of
its own); the other data axes (`fsdp`) shard what remains of each expert FSDP-style.

`exchange` runs inside a `shard_map` over the group: rows sorted by expert go out in one ragged
all-to-all (a slice per destination expert, landing where the receiver's rows for that expert
begin, so what arrives is already grouped by expert), the local experts run the grouped matmul,
and a second ragged all-to-all brings each row back to its place. Dropless: a device can receive
at most `devices × tokens × min(top_k, local experts)` rows, and the receive buffer has that
size; the grouped matmul computes only the rows that arrived (rows past them are zeros).
XLA:CPU has no ragged all-to-all (jax 0.10), so there the same transfer is made from an
all-gather of the senders' rows: the same values, more bytes, for tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torch_on_tpu.core import hlo_text
from torch_on_tpu.lowering import device_checks, target_device
from torch_on_tpu.parallel import mesh as mesh_lib
from torch_on_tpu.parallel import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where an MoE layer's routed experts run: a `shard_map` region over the mesh in which every
  device routes tokens of its own (its rows of the batch over `batch_axes`, its piece of the
  sequence over `sequence_axes`) and sends them to the devices of `group` holding their experts;
  with no group, each device runs every expert on its own tokens, the weights gathered whole."""

  mesh: Mesh
  batch_axes: tuple[str, ...]
  sequence_axes: tuple[str, ...]
  group: tuple[str, ...]

  def ways(self) -> tuple[int, int]:
    """(pieces of the batch, pieces of the sequence)."""
    return mesh_lib.batch_ways(self.mesh, self.batch_axes), mesh_lib.batch_ways(self.mesh, self.sequence_axes)

  def fits(self, batch: int, sequence: int) -> bool:
    rows, pieces = self.ways()
    return batch % rows == 0 and sequence % pieces == 0

  def token_spec(self, ndim: int, flat: bool = False) -> P:
    """Tokens [batch, sequence, ...] split as the region routes them; `flat`: [batch·sequence, ...]."""
    lead = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
    if flat:
      return P(lead(self.batch_axes + self.sequence_axes), *[None] * (ndim - 1))
    return P(lead(self.batch_axes), lead(self.sequence_axes), *[None] * (ndim - 2))

  def weight_spec(self, shape) -> tuple:
    """How the sharding presets store an expert tensor [experts, ...]: `sharding.expert_spec` under
    expert parallelism, else the "fsdp" preset's (the "ep" preset without `ep` keeps its experts
    over fsdp; entered as fsdp stores them, they are resharded at the region's boundary)."""
    if self.group:
      return sharding_lib.expert_spec(shape, self.mesh)
    return sharding_lib.fsdp_spec(shape, self.mesh)

  def run(self, body, tokens: list, weights: list, *, flat: bool = False, extra: tuple = ()):
    """`body(*extra, *tokens, *weights)` on each device: `tokens` split as `token_spec`, `weights`
    stored as `weight_spec` and gathered inside to each device's experts (all of them without a
    group); `extra` replicated. Returns the body's output split like the first token array."""
    # without a group every device needs every expert: the weights enter whole, gathered by the
    # partitioner outside the region (in the layout the kernels read; gathered inside, each arrived
    # split-dim-major and was copied again), their gradients summed at its boundary
    stored = [self.weight_spec(w.shape) if self.group else (None,) * w.ndim for w in weights]

    def local(*args):
      head, toks, ws = args[: len(extra)], args[len(extra): len(extra) + len(tokens)], args[len(extra) + len(tokens):]
      whole = [_gathered(w, spec, keep=self.group) for w, spec in zip(ws, stored)]
      return body(*head, *toks, *whole)

    in_specs = (*(P(),) * len(extra), *(self.token_spec(t.ndim, flat) for t in tokens), *(P(*s) for s in stored))
    out_spec = self.token_spec(tokens[0].ndim, flat)
    return device_checks.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
      *extra, *tokens, *weights
    )


def layout(mesh: Mesh | None, data_axes) -> Layout | None:
  """The region's layout on `mesh`, or None where the experts stay in the one compiled program as
  the model wrote them: no mesh or one device, or `tp` without expert parallelism (the experts
  are then tensor-parallel, each device computing its slice of every token's experts)."""
  if mesh is None:
    return None
  group = mesh_lib.expert_axes(mesh)
  tp = mesh.shape.get("tp", 1) > 1
  if tp and "tp" not in group:
    return None
  batch = tuple(a for a in data_axes if a in mesh.shape and mesh.shape[a] > 1)
  sequence = tuple(a for a in mesh.axis_names if a in (mesh_lib.SEQUENCE_AXIS, "tp") and mesh.shape[a] > 1)
  if not (batch or sequence):
    return None
  return Layout(mesh, batch, sequence, group)


def _gathered(weight, spec, keep=()):
  """Inside the region, `weight` gathered over every axis of `spec` but those in `keep`."""
  for dim, entry in enumerate(spec):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    gather = tuple(a for a in axes if a not in keep)
    if gather:
      weight = lax.all_gather(weight, gather if len(gather) > 1 else gather[0], axis=dim, tiled=True)
  return weight


# A device's receive buffer holds this many times the rows it routes itself (what it receives at
# balanced routing). Rows past it arrive in more rounds of the same exchange,
# never dropped; the worst case, every device's tokens sent to one device's experts, would need a
# buffer `devices × min(top_k, local experts) / top_k` times larger (DeepSeek-V3 at ep=64: 32×).
# Those rounds run under `hlo_text.UNCOUNTED_SCOPE`: the reports count them as not running, as at
# balanced routing.
RECEIVE_BUFFER_ROWS = 2


def worst_case_rows(rows: int, top_k: int, local_experts: int, devices: int) -> int:
  """Rows a device may receive: every device's tokens (`rows / top_k` each) sending each of its
  rows' `min(top_k, local_experts)` hits to this device's experts."""
  return devices * (rows // top_k) * min(top_k, local_experts)


def receive_rows(rows: int, top_k: int, local_experts: int, devices: int) -> int:
  """The receive buffer's rows: `RECEIVE_BUFFER_ROWS` times a device's own, at most the worst case."""
  return min(RECEIVE_BUFFER_ROWS * rows, worst_case_rows(rows, top_k, local_experts, devices))


def exchange(rows, counts, run_local, *, axes: tuple[str, ...], top_k: int):
  """Inside a `shard_map` over `axes`: `rows` [N, D] sorted by expert id, `counts` [E] rows per
  expert; each row goes to the device holding its expert (device i holds experts
  [i·E/n, (i+1)·E/n)), `run_local(received [R, D], group_sizes [E/n], local_ids [R])` runs the
  local experts on what arrived grouped by expert (rows past the last group are zeros, their
  local id E/n), and each result comes back to its row's place: [N, D].

  A device's arrivals, grouped by expert, fill positions [0, total) of a virtual buffer; round k
  moves those in [kR, (k+1)R) for a receive buffer of R rows. The first round always runs; the
  others only where some device has arrivals left, so no row is ever dropped."""
  counts = counts.astype(jnp.int32)
  experts = counts.shape[0]
  if not axes:
    return run_local(rows, counts, _local_ids(counts, rows.shape[0]))
  n = lax.axis_size(axes)
  if experts % n:
    raise ValueError(f"{experts} experts do not split over the {n} devices of {axes}")
  local = experts // n
  me = lax.axis_index(axes)
  everyone = lax.all_gather(counts, axes)  # [n, E]: each source's rows per expert
  per = everyone.reshape(n, n, local)  # [source, destination, local expert]
  # where each source's slice for (destination, expert) lands among the destination's arrivals
  landing = _exclusive_cumsum(per.sum(0), 1)[None] + _exclusive_cumsum(per, 0)  # [source, destination, expert]
  sent_from = _exclusive_cumsum(everyone, 1).reshape(n, n, local)  # where the slice starts in the source's rows
  window = receive_rows(rows.shape[0], top_k, local, n)
  worst = worst_case_rows(rows.shape[0], top_k, local, n)

  def round_(k):
    """Round k's results at their rows' places, zeros elsewhere (the rounds move disjoint rows)."""
    low, high = k * window, (k + 1) * window
    start = jnp.clip(landing, low, high)
    size = jnp.clip(landing + per, low, high) - start  # [source, destination, expert]: what moves this round
    moves = size > 0  # a slice that moves nothing gets offsets 0 (clipped ones could point anywhere)
    src = jnp.where(moves, sent_from + start - landing, 0)  # its first row in the source's rows
    start = jnp.where(moves, start, low)
    mine = lambda a: lax.dynamic_index_in_dim(a, me, 0, keepdims=False).reshape(-1)  # noqa: E731  as a source
    arrivals = lambda a: lax.dynamic_index_in_dim(a, me, 1, keepdims=False).reshape(-1)  # noqa: E731  as a destination
    arrived = ragged_all_to_all(
      rows, jnp.zeros((window, *rows.shape[1:]), rows.dtype), input_offsets=mine(src), send_sizes=mine(size),
      output_offsets=mine(start - low), recv_sizes=arrivals(size), axes=axes,
    )
    here = lax.dynamic_index_in_dim(size, me, 1, keepdims=False).sum(0)  # [expert]: this round's rows per local expert
    done = run_local(arrived, here, _local_ids(here, window))
    return ragged_all_to_all(
      done, jnp.zeros(rows.shape, done.dtype), input_offsets=arrivals(start - low), send_sizes=arrivals(size),
      output_offsets=arrivals(src), recv_sizes=mine(size), axes=axes,
    )

  out = round_(0)
  rounds = -(-worst // window)
  if rounds == 1:
    return out
  needed = -(-per.sum((0, 2)).max() // window)  # rounds the fullest device needs: the same on every device
  # Each further round recomputed in its backward (nothing kept but what it was given), taken only
  # where some device has arrivals left; traced round by round, so nothing is stacked over rounds.
  again = jax.checkpoint(lambda k: round_(k), policy=jax.checkpoint_policies.nothing_saveable)
  with jax.named_scope(hlo_text.UNCOUNTED_SCOPE):
    for k in range(1, rounds):
      out = out + lax.cond(k < needed, again, lambda k: jnp.zeros_like(out), k)
  return out


def ragged_all_to_all(operand, output, *, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
  """`jax.lax.ragged_all_to_all` where the platform has it (TPU, GPU); on the CPU the same
  result from an all-gather of every device's operand and offsets."""
  args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  if target_device.device().platform != "cpu":
    return lax.ragged_all_to_all(*args, axis_name=axes)
  return _gathered_ragged_all_to_all(*args, axes=axes)


def _gathered_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axes):
  """`ragged_all_to_all`'s result made from gathered operands: output row r takes row
  `r - start + input_offset` of the source whose slice for this device starts at or before r
  and covers it, else keeps `output[r]`."""
  del recv_sizes  # implied by the senders' send_sizes
  n = lax.axis_size(axes)
  per_device = input_offsets.shape[0] // n
  me = lax.axis_index(axes)
  mine = lambda x: lax.dynamic_slice_in_dim(lax.all_gather(x, axes), me * per_device, per_device, 1).reshape(-1)  # noqa: E731
  src_offsets, sizes, starts = mine(input_offsets), mine(send_sizes), mine(output_offsets)
  source = jnp.repeat(jnp.arange(n), per_device)
  starts = jnp.where(sizes > 0, starts, output.shape[0])  # an empty slice covers no row, wherever it points
  order = jnp.argsort(starts, stable=True)
  starts, sizes, src_offsets, source = starts[order], sizes[order], src_offsets[order], source[order]
  row = jnp.arange(output.shape[0])
  slot = jnp.clip(jnp.searchsorted(starts, row, side="right") - 1, 0, starts.shape[0] - 1)
  hit = (row >= starts[slot]) & (row < starts[slot] + sizes[slot])
  gathered = lax.all_gather(operand, axes).reshape(-1, *operand.shape[1:])
  index = jnp.where(hit, source[slot] * operand.shape[0] + src_offsets[slot] + row - starts[slot], 0)
  picked = gathered[index]
  return jnp.where(hit.reshape(-1, *[1] * (output.ndim - 1)), picked, output)


def _exclusive_cumsum(x, axis):
  return jnp.cumsum(x, axis=axis) - x


def _local_ids(sizes, rows: int):
  """The local expert of each row of a buffer grouped by expert; rows past the last group get
  len(sizes)."""
  return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right").astype(jnp.int32)
