"""The blocked XLA attention kernel: online softmax over (query tile × key tile)
loops, a custom VJP that recomputes each tile's scores in backward, hashed dropout.

It runs wherever XLA does (the CPU default; the fallback for calls splash or
cuDNN cannot express) and only ever holds a few tiles of scores per batch and head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from torch_on_tpu.attention.padding import pad_to, round_up
from torch_on_tpu.lowering import remat as remat_lib

# Tiles: on CPU smaller tiles were faster (cache-resident, finer causal skipping;
# tools/bench_attention.py); accelerators favour fewer, larger steps.
_BLOCK_CPU = 256
_BLOCK_ACCELERATOR = 512


def default_block(platform: str) -> int:
  """The query and key tile length on `platform` when the user sets none."""
  return _BLOCK_CPU if platform == "cpu" else _BLOCK_ACCELERATOR


@dataclasses.dataclass(frozen=True)
class _Tiles:
  causal: bool
  window: int | None  # a query sees keys less than `window` positions back (itself included)
  scale: float
  rate: float
  block_q: int
  block_kv: int
  length: int
  kv_length: int

  @property
  def padded(self) -> tuple[int, int]:
    return round_up(self.length, self.block_q), round_up(self.kv_length, self.block_kv)


def xla_attention(
  q,
  k,
  v,
  *,
  mask=None,
  segment_ids=None,
  causal=False,
  window=None,
  sinks=None,
  scale,
  dropout_rate=0.0,
  dropout_seed=None,
  offsets=None,
  q_offset=None,
  kv_offset=None,
  return_lse=False,
  block_q=_BLOCK_CPU,
  block_kv=_BLOCK_CPU,
):
  """Blocked attention: q (B, Hq, L, D), k/v (B, Hkv, S, D) → (B, Hq, L, Dv).

  Loops over query tiles and, inside, over the key tiles a tile can see (causal
  skips the rest, and so does a sliding `window`), keeping a running max and sum
  (online softmax). `sinks` (Hq,) are per-head logits with no value (gpt-oss's
  attention sinks): each joins every row's softmax denominator. Backward
  recomputes each tile's scores from q, k and the saved log-sum-exp, so memory
  stays O(L·D) plus a few tiles. `mask` is (1|B, 1|Hq, 1|L, 1|S), bool or additive
  (float masks get a gradient when differentiated). Dropout keeps an element
  by hashing (seed, global batch, head, row, col), so any tiling or sharding
  (`offsets` = this shard's first batch and head) drops the same elements.

  Blocks of a longer sequence (context parallelism): `q_offset` and `kv_offset`
  (ints or traced scalars) are the global positions of q's and k's first rows;
  the causal mask, the window and dropout are evaluated on global positions,
  and tiles they hide wholly are skipped. `return_lse=True` returns
  `(out, lse)`, lse (B, Hq, L) fp32 the log-sum-exp of each row's scores
  (sinks included; -inf where a row sees nothing), for combining blocks; its
  gradient flows too.
  """
  tiles, q5, k, v, mask, q_seg, kv_seg, sinks, dropout_seed, offsets, origin = _prepare(
    q, k, v, mask, segment_ids, causal, window, sinks, scale, dropout_rate, dropout_seed, offsets,
    q_offset, kv_offset, block_q, block_kv,
  )
  out, lse = _flash(q5, k, v, mask, q_seg, kv_seg, sinks, dropout_seed, offsets, origin, tiles)
  out = out.reshape(*q.shape[:3], v.shape[-1])
  if not return_lse:
    return out
  return out, lse[..., : q.shape[2]].reshape(q.shape[:3])


def xla_attention_backward(q, k, v, out, lse, dout, **kwargs):
  """(dq, dk, dv) of one block of a longer attention, from the whole attention's
  output `out` and log-sum-exp `lse` (B, Hq, L) and the output's cotangent `dout`.

  The softmax over all blocks is exp(s - lse) with the whole row's lse, and
  the backward's row term is rowsum(dout · out) of the whole output: given
  both, each block's gradients are exact without recomputing its forward
  (ring attention's backward). `kwargs` as `xla_attention`'s (no float masks,
  no sinks: a sink belongs to no block).
  """
  tiles, q5, k, v, mask, q_seg, kv_seg, _, seed, offsets, origin = _prepare(
    q, k, v, kwargs.get("mask"), kwargs.get("segment_ids"), kwargs.get("causal", False), kwargs.get("window"),
    None, kwargs["scale"], kwargs.get("dropout_rate", 0.0), kwargs.get("dropout_seed"), kwargs.get("offsets"),
    kwargs.get("q_offset"), kwargs.get("kv_offset"), kwargs.get("block_q", _BLOCK_CPU),
    kwargs.get("block_kv", _BLOCK_CPU),
  )
  shape5 = q5.shape[:4]
  lse5 = pad_to(lse.reshape(shape5), 3, tiles.padded[0], -jnp.inf)
  dq, dk, dv, _, _ = _flash_backward(
    tiles, q5, k, v, mask, q_seg, kv_seg, None, seed, offsets, origin,
    out.reshape(*shape5, -1), lse5, dout.reshape(*shape5, -1), None, False, whole_rows=False,
  )
  return dq.reshape(q.shape), dk, dv


def _prepare(q, k, v, mask, segment_ids, causal, window, sinks, scale, dropout_rate, dropout_seed, offsets,
             q_offset, kv_offset, block_q, block_kv):
  """The tiling and the kernel's inputs: q as (B, K, G, L, D), masks and sinks per kv
  head group, the global origin (q_offset, kv_offset) as an int32 pair or None (both 0)."""
  batch, hq, length, dim = q.shape
  hkv, kv_length = k.shape[1], k.shape[2]
  groups = hq // hkv
  tiles = _Tiles(
    causal=bool(causal),
    window=None if window is None else int(window),
    scale=float(scale),
    rate=float(dropout_rate),
    block_q=min(block_q, length),
    block_kv=min(block_kv, kv_length),
    length=length,
    kv_length=kv_length,
  )
  q5 = q.reshape(batch, hkv, groups, length, dim)
  if mask is not None:
    mh = mask.shape[1]
    heads = (hkv, groups) if mh > 1 else (1, 1)
    mask = mask.reshape(mask.shape[0], *heads, *mask.shape[2:])
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  if sinks is not None:
    sinks = sinks.reshape(hkv, groups)
  if tiles.rate > 0:
    offsets = jnp.asarray((0, 0) if offsets is None else offsets, jnp.uint32)
  else:
    dropout_seed = offsets = None
  q_offset = 0 if q_offset is None else q_offset
  kv_offset = 0 if kv_offset is None else kv_offset
  origin = None
  if not all(isinstance(o, int) and o == 0 for o in (q_offset, kv_offset)):
    origin = jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)])
  return tiles, q5, k, v, mask, q_seg, kv_seg, sinks, dropout_seed, offsets, origin



def _tile(x, axis: int, index, size: int):
  """Tile `index` of `x` along `axis` (the whole of a broadcast, size-1 axis)."""
  if x is None:
    return None
  if x.shape[axis] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, index * size, size, axis)


# XLA CPU rewrites any reduction over an axis longer than this into a reduce-window
# plus a reduce, and runs that reduce-window as a separate, slow loop over the tile.
_CPU_REDUCE_WINDOW = 32


def _reduce_last(combine, reduce, x):
  """`reduce(x, axis=-1)`, folded in halves down to 32 columns first.

  The halves combine elementwise, so XLA fuses them with the ops that make `x`
  and the final 32-wide reduce escapes XLA CPU's tree-reduction rewrite: about
  15% off the forward of a 256-wide tile on CPU (CHANGELOG.md).
  """
  return reduce(_fold_halves(combine, x, x.ndim - 1), axis=-1)


def _fold_halves(combine, x, axis: int):
  """`x` with `axis` combined half onto half while longer than 32 and even."""
  while x.shape[axis] > _CPU_REDUCE_WINDOW and x.shape[axis] % 2 == 0:
    half = x.shape[axis] // 2
    x = combine(lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, 2 * half, axis=axis))
  return x


def _einsum32(spec, a, b):
  """einsum accumulating in fp32 (inputs may be bf16)."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _mix32(x):
  """A 32-bit integer hash with full avalanche (xor-shift-multiply rounds)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def dropout_keep_scale(seed, batch_ids, head_ids, rows, cols, rate: float):
  """1/(1-rate) where the element is kept, else 0; broadcast over the index arrays.

  A pure function of (seed, global batch, head, row, col): tiling, sharding and
  recomputation in backward all see the same dropout pattern.
  """
  u = jnp.uint32
  batch_ids, head_ids, rows, cols = (
    jnp.asarray(x).astype(u) for x in (batch_ids, head_ids, rows, cols)
  )
  h = _mix32(seed[0] + batch_ids * u(0x9E3779B9) + head_ids * u(0x85EBCA6B))
  h = _mix32(h ^ (seed[1] + rows * u(0xC2B2AE35)))
  h = _mix32(h + cols * u(0x27D4EB2F))
  threshold = min(int(round(rate * 2.0**32)), 2**32 - 1)
  keep = h >= u(threshold)
  kept = 0.0 if rate >= 1 else 1.0 / (1.0 - rate)
  return jnp.where(keep, jnp.float32(kept), jnp.float32(0.0))


def _global_start(origin, axis: int):
  """The global position of the block's first query (axis 0) or key (axis 1) row."""
  return 0 if origin is None else origin[axis]


def _scores(t: _Tiles, qi, kj, mask_ij, q_seg_i, kv_seg_j, i, j, origin=None, *, keys_first=False):
  """Scaled, masked fp32 scores of query tile i against key tile j: (B, K, G, bq, bk),
  or with `keys_first` (B, K, bk, G, bq), the layout in which the backward's
  key-side matmuls (dK, dV) contract the tile without transposing it. Masks
  compare global row/col positions (`origin`: the block's first query and key)."""
  if keys_first:
    s = _einsum32("bksd,bkgqd->bksgq", kj, qi) * t.scale
    grid, q_axis, kv_axis = (t.block_kv, 1, t.block_q), 2, 0
  else:
    s = _einsum32("bkgqd,bksd->bkgqs", qi, kj) * t.scale
    grid, q_axis, kv_axis = (t.block_q, t.block_kv), 0, 1
  q0, kv0 = _global_start(origin, 0), _global_start(origin, 1)
  rows = q0 + i * t.block_q + lax.broadcasted_iota(jnp.int32, grid, q_axis)
  cols = kv0 + j * t.block_kv + lax.broadcasted_iota(jnp.int32, grid, kv_axis)
  allowed = None

  def both(a, b):
    return b if a is None else a & b

  if t.causal:
    allowed = both(allowed, cols <= rows)
  if t.window is not None:
    allowed = both(allowed, rows - cols < t.window)
  if t.kv_length % t.block_kv:
    allowed = both(allowed, cols < kv0 + t.kv_length)
  if q_seg_i is not None:
    if keys_first:
      same = kv_seg_j[:, None, :, None, None] == q_seg_i[:, None, None, None, :]
    else:
      same = (q_seg_i[:, :, None] == kv_seg_j[:, None, :])[:, None, None]
    allowed = both(allowed, same)
  if mask_ij is not None:
    if keys_first:
      mask_ij = jnp.moveaxis(mask_ij, 4, 2)
    if mask_ij.dtype == jnp.bool_:
      allowed = both(allowed, mask_ij)
    else:
      s = s + mask_ij.astype(jnp.float32)
  if allowed is not None:
    s = jnp.where(allowed, s, -jnp.inf)
  return s


def _drop(t: _Tiles, seed, offsets, shape, i, j, origin=None, *, keys_first=False):
  """Dropout keep-scale for a scores tile of `shape` (laid out as `_scores` makes it)."""
  batch, hkv = shape[:2]
  groups = shape[3] if keys_first else shape[2]
  head_shape = (1, hkv, 1, groups, 1) if keys_first else (1, hkv, groups, 1, 1)
  group_axis = 3 if keys_first else 2
  b = offsets[0] + lax.broadcasted_iota(jnp.uint32, (batch, 1, 1, 1, 1), 0)
  h = offsets[1] + (
    lax.broadcasted_iota(jnp.uint32, head_shape, 1) * groups
    + lax.broadcasted_iota(jnp.uint32, head_shape, group_axis)
  )
  q0, kv0 = _global_start(origin, 0), _global_start(origin, 1)
  if keys_first:
    rows = q0 + i * t.block_q + lax.broadcasted_iota(jnp.int32, (1, 1, t.block_q), 2)
    cols = kv0 + j * t.block_kv + lax.broadcasted_iota(jnp.int32, (t.block_kv, 1, 1), 0)
  else:
    rows = q0 + i * t.block_q + lax.broadcasted_iota(jnp.int32, (t.block_q, 1), 0)
    cols = kv0 + j * t.block_kv + lax.broadcasted_iota(jnp.int32, (1, t.block_kv), 1)
  return dropout_keep_scale(seed, b, h, rows, cols, t.rate)


def _kv_tiles_seen(t: _Tiles, i, n_kv: int, origin=None):
  """Key tiles [first, last) query tile i attends to: all, or (causal) up to its
  last row, and (window) from its first row's window on; on global positions
  (`origin`), shifted by how far the block's queries start after its keys."""
  static = isinstance(i, int) and origin is None
  shift = 0 if origin is None else origin[0] - origin[1]
  last = n_kv
  if t.causal:
    last = (shift + (i + 1) * t.block_q - 1) // t.block_kv + 1
    last = min(n_kv, last) if static else jnp.clip(last, 0, n_kv)
  first = 0
  if t.window is not None:
    first = (shift + i * t.block_q - t.window + 1) // t.block_kv
    first = max(0, first) if static else jnp.clip(first, 0, n_kv)
  return first, last


def _q_tiles_seeing(t: _Tiles, j, n_q: int, origin=None):
  """Query tiles [first, last) that attend to key tile j (the transpose of `_kv_tiles_seen`)."""
  static = isinstance(j, int) and origin is None
  shift = 0 if origin is None else origin[1] - origin[0]
  first = 0
  if t.causal:
    first = (shift + j * t.block_kv) // t.block_q
    first = first if static else jnp.clip(first, 0, n_q)
  last = n_q
  if t.window is not None:
    last = (shift + (j + 1) * t.block_kv + t.window - 2) // t.block_q + 1
    last = min(n_q, last) if static else jnp.clip(last, 0, n_q)
  return first, last


# Loops that run inline when they have a single, static step: short sequences
# (one tile) then compile like plain dense attention.


def _for(lo, hi, body, carry):
  if isinstance(lo, int) and isinstance(hi, int) and hi - lo == 1:
    return body(lo, carry)
  return lax.fori_loop(lo, hi, body, carry)


def _map(fn, n: int):
  if n == 1:
    return jax.tree.map(lambda x: x[None], fn(0))
  return lax.map(fn, jnp.arange(n))


def _scan(fn, carry, n: int):
  if n == 1:
    carry, y = fn(carry, 0)
    return carry, jax.tree.map(lambda x: x[None], y)
  return lax.scan(fn, carry, jnp.arange(n))


def _padded_inputs(t: _Tiles, q, k, v, mask, q_seg, kv_seg):
  lp, sp = t.padded
  return (
    pad_to(q, 3, lp),
    pad_to(k, 2, sp),
    pad_to(v, 2, sp),
    pad_to(pad_to(mask, 3, lp, broadcast=True), 4, sp, broadcast=True),
    pad_to(q_seg, 1, lp),
    pad_to(kv_seg, 1, sp),
  )


def _flash_forward(t: _Tiles, q, k, v, mask, q_seg, kv_seg, sinks, seed, offsets, origin):
  """(out (B, K, G, L, Dv), log-sum-exp (B, K, G, Lp) fp32, sinks included)."""
  batch, hkv, groups, length, _ = q.shape
  dv = v.shape[-1]
  qp, kp, vp, maskp, q_segp, kv_segp = _padded_inputs(t, q, k, v, mask, q_seg, kv_seg)
  lp, sp = t.padded
  n_q, n_kv = lp // t.block_q, sp // t.block_kv
  stat_shape = (batch, hkv, groups, t.block_q)

  def query_tile(i):
    qi = _tile(qp, 3, i, t.block_q)
    mask_i = _tile(maskp, 3, i, t.block_q)
    q_seg_i = _tile(q_segp, 1, i, t.block_q)

    def step(j, carry):
      m, l, acc = carry
      kj, vj = _tile(kp, 2, j, t.block_kv), _tile(vp, 2, j, t.block_kv)
      mask_ij, kv_seg_j = _tile(mask_i, 4, j, t.block_kv), _tile(kv_segp, 1, j, t.block_kv)
      s = _scores(t, qi, kj, mask_ij, q_seg_i, kv_seg_j, i, j, origin)
      m_new = jnp.maximum(m, _reduce_last(jnp.maximum, jnp.max, s))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      correction = jnp.exp(m - m_safe)
      l = l * correction + _reduce_last(jnp.add, jnp.sum, p)
      if t.rate > 0:
        p = p * _drop(t, seed, offsets, s.shape, i, j, origin)
      pv = _einsum32("bkgqs,bksd->bkgqd", p.astype(vj.dtype), vj)
      return m_new, l, acc * correction[..., None] + pv

    init = (
      jnp.full(stat_shape, -jnp.inf, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
      jnp.zeros((*stat_shape, dv), jnp.float32),
    )
    m, l, acc = _for(*_kv_tiles_seen(t, i, n_kv, origin), step, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    if sinks is None:
      return out.astype(q.dtype), lse
    # A sink is one more logit in each row's softmax, with no value: the rows' own softmax
    # times sigmoid(lse - sink). Applied after it, with torch's roundings of gpt-oss's
    # out_transform: the output and the factor each rounded to q's dtype, then their product.
    sink = sinks.astype(jnp.float32)[None, :, :, None]
    factor = jax.nn.sigmoid(lse - sink)
    out = (out.astype(q.dtype) * factor[..., None].astype(q.dtype)).astype(q.dtype)
    return out, jnp.logaddexp(lse, sink)

  outs, lses = _map(query_tile, n_q)
  out = jnp.moveaxis(outs, 0, 3).reshape(batch, hkv, groups, lp, dv)[:, :, :, :length]
  lse = jnp.moveaxis(lses, 0, 3).reshape(batch, hkv, groups, lp)
  return out, lse


def _flash_backward(
  t: _Tiles, q, k, v, mask, q_seg, kv_seg, sinks, seed, offsets, origin, out, lse, dout, dlse, mask_grad,
  whole_rows=True,
):
  """Gradients of the blocked attention (or, `whole_rows=False`, of one block of a
  longer one, `lse` the whole row's).

  dS = P·(dP - δ) cancels where one key dominates a row, so P and δ must carry the
  same rounding as dP, as in torch's softmax backward. When one key tile holds every
  key a row sees (`whole_rows` and a single tile: short sequences), P is the tile's
  own softmax and δ = rowsum(P·dP): as close to float64 as torch's float32. Otherwise
  P = exp(s - lse) and δ = rowsum(dout·out), FlashAttention's one-pass form: an lse
  rounded to fp32 and a recomputed s each move P by ~eps·|s|, which on peaked rows
  (|s| ~ 60) puts dQ and dK some 6× further from float64 than torch's float32.
  """
  batch, hkv, groups, length, dim = q.shape
  kv_length = k.shape[2]
  qp, kp, vp, maskp, q_segp, kv_segp = _padded_inputs(t, q, k, v, mask, q_seg, kv_seg)
  lp, sp = t.padded
  n_q, n_kv = lp // t.block_q, sp // t.block_kv
  doutp = pad_to(dout, 3, lp)
  in_tile = whole_rows and n_kv == 1
  delta = None
  if not in_tile or sinks is not None:
    out_dot_dout = doutp.astype(jnp.float32) * pad_to(out, 3, lp).astype(jnp.float32)
    delta = _reduce_last(jnp.add, jnp.sum, out_dot_dout)
    if dlse is not None:  # d lse / d s = the softmax itself: it joins dP's row term
      delta = delta - dlse
  lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  dsinks = p_sink = None
  if sinks is not None:  # d/d sink of a row is -p(sink) · Σ dout·out
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, :, None] - lse_safe)
    dsinks = -(p_sink * delta).sum(axis=(0, 3)).astype(sinks.dtype)
  # dQ accumulates with the query axis last, (B, K, D, G, Lp): the tile matmul that
  # produces it then reads the keys-first score gradient without transposing it.
  dq0 = jnp.zeros((batch, hkv, dim, groups, lp), jnp.float32)
  dmask0 = jnp.zeros(maskp.shape, jnp.float32) if mask_grad else None

  def key_tile(carry, j):
    dq, dmask = carry
    kj, vj = _tile(kp, 2, j, t.block_kv), _tile(vp, 2, j, t.block_kv)
    kv_seg_j = _tile(kv_segp, 1, j, t.block_kv)
    mask_j = _tile(maskp, 4, j, t.block_kv)

    def step(i, c):
      dq, dmask, dk, dv = c
      qi, doi = _tile(qp, 3, i, t.block_q), _tile(doutp, 3, i, t.block_q)
      mask_ij, q_seg_i = _tile(mask_j, 3, i, t.block_q), _tile(q_segp, 1, i, t.block_q)
      # Tiles are keys-first, (B, K, bk, G, bq): dK and dV contract their trailing axes.
      s = _scores(t, qi, kj, mask_ij, q_seg_i, kv_seg_j, i, j, origin, keys_first=True)
      p = jnp.exp(s - _tile(lse_safe, 3, i, t.block_q)[:, :, None])
      if in_tile:
        p = _renormalized(p, None if p_sink is None else _tile(p_sink, 3, i, t.block_q)[:, :, None])
      dp = _einsum32("bksd,bkgqd->bksgq", vj, doi)
      if t.rate > 0:
        keep = _drop(t, seed, offsets, s.shape, i, j, origin, keys_first=True)
        pd, dp = p * keep, dp * keep
      else:
        pd = p
      dv = dv + _einsum32("bksgq,bkgqd->bksd", pd.astype(doi.dtype), doi)
      if in_tile:  # dp already carries the dropout
        delta_i = _reduce_keys(jnp.add, jnp.sum, p * dp)
        if dlse is not None:
          delta_i = delta_i - _tile(dlse, 3, i, t.block_q)[:, :, None]
      else:
        delta_i = _tile(delta, 3, i, t.block_q)[:, :, None]
      ds = p * (dp - delta_i)
      dq_i = _einsum32("bksd,bksgq->bkdgq", kj, ds.astype(kj.dtype))
      dq = lax.dynamic_update_slice_in_dim(
        dq, _tile(dq, 4, i, t.block_q) + dq_i * t.scale, i * t.block_q, 4
      )
      dk = dk + _einsum32("bksgq,bkgqd->bksd", ds.astype(qi.dtype), qi)
      if dmask is not None:
        dmask = _accumulate_mask_grad(t, dmask, jnp.moveaxis(ds, 2, 4), i, j)
      return dq, dmask, dk, dv

    zeros_kv = jnp.zeros((batch, hkv, t.block_kv, dim), jnp.float32)
    zeros_v = jnp.zeros((batch, hkv, t.block_kv, vp.shape[-1]), jnp.float32)
    dq, dmask, dk, dv = _for(*_q_tiles_seeing(t, j, n_q, origin), step, (dq, dmask, zeros_kv, zeros_v))
    return (dq, dmask), (dk * t.scale, dv)

  (dq, dmask), (dks, dvs) = _scan(key_tile, (dq0, dmask0), n_kv)
  dq = jnp.moveaxis(dq, 2, 4)[:, :, :, :length].astype(q.dtype)
  dk = jnp.moveaxis(dks, 0, 2).reshape(batch, hkv, sp, dim)[:, :, :kv_length].astype(k.dtype)
  dv = jnp.moveaxis(dvs, 0, 2).reshape(batch, hkv, sp, -1)[:, :, :kv_length].astype(v.dtype)
  if dmask is not None:
    dmask = dmask[:, :, :, : mask.shape[3], : mask.shape[4]].astype(mask.dtype)
  return dq, dk, dv, dmask, dsinks


def _reduce_keys(combine, reduce, x):
  """`reduce` over the key axis of a keys-first tile (B, K, bk, G, bq), kept as size 1;
  folded in halves first as `_reduce_last` does."""
  return reduce(_fold_halves(combine, x, 2), axis=2, keepdims=True)


def _renormalized(p, p_sink):
  """A keys-first tile of exp(s - lse) holding whole rows, divided by its own row sums
  (plus the sink's share `p_sink`): exactly a softmax of the recomputed scores, free of
  the rounding in the saved lse and of a recomputed s that differs from the forward's."""
  total = _reduce_keys(jnp.add, jnp.sum, p)
  if p_sink is not None:
    total = total + p_sink
  return p / jnp.where(total > 0, total, 1.0)


def _accumulate_mask_grad(t: _Tiles, dmask, ds, i, j):
  """Adds tile (i, j)'s score gradient into the additive mask's gradient, summed over
  the dims the mask broadcasts along."""
  summed = tuple(a for a in range(5) if dmask.shape[a] == 1 and ds.shape[a] != 1)
  update = ds.sum(axis=summed, keepdims=True) if summed else ds
  starts = [0, 0, 0, 0, 0]
  if dmask.shape[3] != 1:
    starts[3] = i * t.block_q
  if dmask.shape[4] != 1:
    starts[4] = j * t.block_kv
  current = lax.dynamic_slice(dmask, starts, update.shape)
  return lax.dynamic_update_slice(dmask, current + update, starts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _flash(q, k, v, mask, q_seg, kv_seg, sinks, seed, offsets, origin, t):
  """(out (B, K, G, L, Dv), lse (B, K, G, Lp))."""
  return _flash_forward(t, q, k, v, mask, q_seg, kv_seg, sinks, seed, offsets, origin)


def _flash_fwd(q, k, v, mask, q_seg, kv_seg, sinks, seed, offsets, origin, t):
  # symbolic_zeros: primals arrive wrapped, saying whether each is differentiated.
  def value(x):
    return None if x is None else x.value

  mask_grad = mask is not None and mask.perturbed and value(mask).dtype != jnp.bool_
  args = [value(x) for x in (q, k, v, mask, q_seg, kv_seg, sinks, seed, offsets, origin)]
  out, lse = _flash_forward(t, *args)
  out, lse = (checkpoint_name(x, remat_lib.ATTENTION_NAME) for x in (out, lse))
  return (out, lse), (*args, out, lse, jnp.zeros(()) if mask_grad else None)


def _flash_bwd(t, res, cotangents):
  *args, out, lse, mask_grad = res
  dout, dlse = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
  if dout is None:
    dout = jnp.zeros_like(out)
  dq, dk, dv, dmask, dsinks = _flash_backward(t, *args, out, lse, dout, dlse, mask_grad is not None)
  return dq, dk, dv, dmask, None, None, dsinks, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)
