"""Context parallelism inside attention: the sequence split over the `cp` mesh axis.

Every batch tensor's dim 1 is split over `cp` (`mesh.batch_spec`), so GSPMD hands
attention's `shard_map` each cp device's contiguous 1/cp of q, k and v; every
other op of the model is per token and needs nothing. Here the pieces meet:

- **Causal balance (zig-zag).** Under a causal mask the device holding the last
  piece would do most of the work. The sequence is cut into 2·cp chunks and each
  device computes the queries of chunks i and 2·cp-1-i (one early, one late:
  equal work), exchanged with two `ppermute`s on the way in and back on the way
  out. Only q's rows (and a mask's rows) move, inside attention, so every op the
  user's model runs sees the sequence in its own order: RoPE, HF's masks and
  torchtitan's document ids are computed on true positions, outputs and
  gradients come back where they belong. The kernel masks on global positions
  (`xla_attention(q_offset=, kv_offset=)`).
- **K/V across the split**, one of two strategies:
  `all_gather`: each device gathers the whole K and V (cheap under GQA, where
  they are a fraction of q) and attends its queries to them in one kernel call;
  the backward reduce-scatters their gradients. Any mask, dropout.
  `ring`: K/V blocks travel the cp ring (`ppermute`), each step's partial
  results combined by their log-sum-exp; the backward passes K/V round again
  with their gradients, computing each block's from the whole output and
  log-sum-exp (`xla_attention_backward`: no forward recompute). A device never
  holds more than two K/V blocks. No explicit masks, dropout or sinks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

STRATEGIES = ("auto", "all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class Split:
  """How one attention call runs across the `cp` axis."""

  axis: str
  ways: int
  strategy: str  # "all_gather" or "ring"
  balanced: bool  # zig-zag chunks (causal calls)

  def describe(self) -> str:
    layout = "zig-zag causal balance" if self.balanced else "contiguous pieces"
    kv = "K/V all-gathered" if self.strategy == "all_gather" else "K/V ring (ppermute)"
    return f"{self.axis}={self.ways}: {kv}, {layout}"


def choose(setting: str, *, heads: int, kv_heads: int, ways: int, plain: bool, kernel: str = "xla") -> tuple[str, str]:
  """(strategy, why) for a call: `setting` unless "auto". Auto gathers K/V when they are
  small next to q (GQA/MQA: fewer K/V heads than query heads), when the ring would be two
  steps, or for splash (whose blocks give no log-sum-exp gradient to combine); otherwise
  the ring. The ring takes only `plain` calls (no explicit mask, no dropout, no sinks: a
  sink joins each row once, not once per block)."""
  if setting == "all_gather":
    return "all_gather", "asked for"
  if not plain:
    return "all_gather", "the ring takes no explicit mask or dropout"
  if setting == "ring":
    return "ring", "asked for"
  if kernel == "splash":
    return "all_gather", "splash runs on the gathered K/V (its blocks give no log-sum-exp gradient for the ring)"
  if kv_heads < heads:
    return "all_gather", f"GQA: K/V have {kv_heads} heads for {heads} query heads"
  if ways == 2:
    return "all_gather", "two devices: the ring would be one exchange as well"
  return "ring", f"K/V as many heads as q ({heads}): gathering them would hold the whole sequence's"


def attend(kernel, backward, split: Split, q, k, v, mask, q_seg, kv_seg, *, fixed=None):
  """Attention of this device's piece of the sequence, inside `shard_map`.

  q, k, v (B, H, Lc, D) and the ids (B, Lc) are this device's contiguous piece;
  `mask` (B|1, H|1, Lc|1, S|1) holds its rows against all columns.
  `kernel(q, k, v, mask, q_seg, kv_seg, q_offset, kv_offset)` → (out, lse) is one
  block's attention on global positions; `backward(..., out, lse, dout)` → (dq, dk, dv)
  one block's gradients from the whole output (the ring's). `fixed(q, k, v, q_seg,
  kv_seg, q_offset=int)` → out, when given, is a kernel that takes its query offset
  only as a Python int (splash's masks are static): with the K/V gathered, each device
  runs the one for its own offset (`lax.switch` on the device index).
  """
  name, ways = split.axis, split.ways
  me = lax.axis_index(name)
  piece = q.shape[2]
  if split.balanced:
    q_parts = _to_zigzag(q, 2, split)
    mask_parts = _to_zigzag(mask, 2, split) if mask is not None and mask.shape[2] > 1 else (mask, mask)
    seg_parts = _to_zigzag(q_seg, 1, split) if q_seg is not None else (None, None)
    offsets = tuple(c * (piece // 2) for c in zigzag_chunks(me, ways))
  else:
    q_parts, mask_parts, seg_parts, offsets = (q,), (mask,), (q_seg,), (me * piece,)
  q_parts, seg_parts, offsets = tuple(q_parts), tuple(seg_parts), tuple(offsets)
  if split.strategy == "all_gather":
    k_all, v_all = (lax.all_gather(x, name, axis=2, tiled=True) for x in (k, v))
    kv_seg_all = None if kv_seg is None else lax.all_gather(kv_seg, name, axis=1, tiled=True)
    if fixed is not None:
      outs = tuple(
        _per_device(fixed, me, _offsets_by_device(split, part, piece), qp, k_all, v_all, sp, kv_seg_all)
        for part, (qp, sp) in enumerate(zip(q_parts, seg_parts))
      )
      return _from_zigzag(outs, 2, split) if split.balanced else outs[0]
    outs = tuple(
      kernel(qp, k_all, v_all, mp, sp, kv_seg_all, off, 0)[0]
      for qp, mp, sp, off in zip(q_parts, mask_parts, seg_parts, offsets)
    )
  else:
    outs = _ring_attention(kernel, backward, name, ways, q_parts, k, v, seg_parts, kv_seg, offsets)
  if split.balanced:
    return _from_zigzag(outs, 2, split)
  return outs[0]


def _offsets_by_device(split: Split, part: int, piece: int) -> list[int]:
  """The global offset of query part `part` on each device (ints, for static masks)."""
  if not split.balanced:
    return [0] * split.ways  # a call without a causal mask: the offset changes nothing
  return [zigzag_chunks(d, split.ways)[part] * (piece // 2) for d in range(split.ways)]


def _per_device(fixed, me, offsets: list[int], *operands):
  """`fixed` at this device's offset: one branch per distinct offset, picked by device index."""
  distinct = sorted(set(offsets))
  if len(distinct) == 1:
    return fixed(*operands, q_offset=distinct[0])
  branches = [functools.partial(_call_fixed, fixed, offset) for offset in distinct]
  index = jnp.asarray([distinct.index(o) for o in offsets], jnp.int32)[me]
  return lax.switch(index, branches, *operands)


def _call_fixed(fixed, offset, *operands):
  return fixed(*operands, q_offset=offset)


# ---- the zig-zag layout -------------------------------------------------------------------


def _owner(chunk: int, ways: int) -> int:
  """The device that computes chunk `chunk` of 2·ways: i and 2·ways-1-i go to device i."""
  return chunk if chunk < ways else 2 * ways - 1 - chunk


def zigzag_chunks(device, ways: int):
  """(the even, the odd) of the chunks of 2·ways that `device` computes: `device` and
  2·ways-1-`device`, in parity order (ints, or traced for a traced device index)."""
  other = 2 * ways - 1 - device
  if isinstance(device, int):
    return (device, other) if device % 2 == 0 else (other, device)
  even = device % 2 == 0
  return jnp.where(even, device, other), jnp.where(even, other, device)


def _to_zigzag(x, axis: int, split: Split):
  """This device's contiguous piece (chunks 2d, 2d+1) → (its even chunk, its odd chunk)."""
  ways = split.ways
  first, second = jnp.split(x, 2, axis=axis)
  even = lax.ppermute(first, split.axis, [(d, _owner(2 * d, ways)) for d in range(ways)])
  odd = lax.ppermute(second, split.axis, [(d, _owner(2 * d + 1, ways)) for d in range(ways)])
  return even, odd


def _from_zigzag(parts, axis: int, split: Split):
  """(results for the even chunk, for the odd chunk) → this device's contiguous piece."""
  ways = split.ways
  first = lax.ppermute(parts[0], split.axis, [(_owner(2 * d, ways), d) for d in range(ways)])
  second = lax.ppermute(parts[1], split.axis, [(_owner(2 * d + 1, ways), d) for d in range(ways)])
  return jnp.concatenate([first, second], axis=axis)


# ---- the ring -----------------------------------------------------------------------------


def _next(x, name, ways):
  """Every device's block to the next device of the ring."""
  return None if x is None else lax.ppermute(x, name, [(d, (d + 1) % ways) for d in range(ways)])


def _block_source(me, step, ways):
  """The device whose K/V block this device holds at ring step `step`."""
  return (me - step) % ways


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring_attention(kernel, backward, name, ways, q_parts, k, v, seg_parts, kv_seg, offsets):
  """Each query part (tuples: q, its ids, its global offset) against every device's K/V
  block as the blocks travel the ring; the backward sends them round again with their
  gradients."""
  return _ring_forward(kernel, name, ways, q_parts, k, v, seg_parts, kv_seg, offsets)[0]


def _ring_forward(kernel, name, ways, q_parts, k, v, seg_parts, kv_seg, offsets):
  me = lax.axis_index(name)
  block = k.shape[2]
  outs, lses = [None] * len(q_parts), [None] * len(q_parts)
  kb, vb, sb = k, v, kv_seg
  for step in range(ways):
    kv_offset = _block_source(me, step, ways) * block
    for p, (qp, sp, off) in enumerate(zip(q_parts, seg_parts, offsets)):
      out, lse = kernel(qp, kb, vb, None, sp, sb, off, kv_offset)
      outs[p], lses[p] = _combine(outs[p], lses[p], out.astype(jnp.float32), lse)
    if step < ways - 1:
      kb, vb, sb = (_next(x, name, ways) for x in (kb, vb, sb))
  outs = tuple(o.astype(q.dtype) for o, q in zip(outs, q_parts))
  return outs, tuple(lses)


def _combine(out_a, lse_a, out_b, lse_b):
  """Two partial attentions over disjoint keys → the attention over both (by log-sum-exp)."""
  if out_a is None:
    return out_b, lse_b
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  weight_a, weight_b = jnp.exp(lse_a - safe)[..., None], jnp.exp(lse_b - safe)[..., None]
  return out_a * weight_a + out_b * weight_b, lse


def _ring_fwd(kernel, backward, name, ways, q_parts, k, v, seg_parts, kv_seg, offsets):
  outs, lses = _ring_forward(kernel, name, ways, q_parts, k, v, seg_parts, kv_seg, offsets)
  return outs, (q_parts, k, v, seg_parts, kv_seg, offsets, outs, lses)


def _ring_bwd(kernel, backward, name, ways, res, douts):
  q_parts, k, v, seg_parts, kv_seg, offsets, outs, lses = res
  me = lax.axis_index(name)
  block = k.shape[2]
  dqs = [jnp.zeros(q.shape, jnp.float32) for q in q_parts]
  kb, vb, sb = k, v, kv_seg
  dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for step in range(ways):
    kv_offset = _block_source(me, step, ways) * block
    for p, (qp, sp, off) in enumerate(zip(q_parts, seg_parts, offsets)):
      dq_p, dk_p, dv_p = backward(qp, kb, vb, None, sp, sb, off, kv_offset, outs[p], lses[p], douts[p])
      dqs[p] = dqs[p] + dq_p.astype(jnp.float32)
      dk, dv = dk + dk_p.astype(jnp.float32), dv + dv_p.astype(jnp.float32)
    if step < ways - 1:
      kb, vb, sb = (_next(x, name, ways) for x in (kb, vb, sb))
    dk, dv = _next(dk, name, ways), _next(dv, name, ways)  # after the last step: home
  dq_parts = tuple(dq.astype(q.dtype) for dq, q in zip(dqs, q_parts))
  zero_ids = lambda ids: None if ids is None else jnp.zeros(ids.shape, jax.dtypes.float0)  # noqa: E731
  zero_offsets = tuple(jnp.zeros(jnp.shape(o), jax.dtypes.float0) for o in offsets)
  return (
    dq_parts, dk.astype(k.dtype), dv.astype(v.dtype), tuple(zero_ids(s) for s in seg_parts), zero_ids(kv_seg),
    zero_offsets,
  )


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
