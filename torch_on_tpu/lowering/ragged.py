"""Grouped (ragged) matmul: rows sorted by group, each group times its own matrix.

`ragged_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) → [M, N]`: rows
`[start_g, start_g + size_g)` of `lhs` times `rhs[g]`; rows past the last
group give zeros. It is what a dropless mixture-of-experts layer needs (HF's
`torch._grouped_mm`): one static shape for any routing.

On TPU it runs jax's megablox kernels (Pallas): `gmm` for the product and its input gradient,
`tgmm` for the weight gradient. XLA's `ragged_dot` runs the first two as good kernels but the
weight gradient (ragged contracting dim) as a dense masked product over every group, G× the
FLOPs (Qwen3-30B-A3B's 32,768 rows × 2,048 → 768 over 128 experts on a v5p chip: 13.2 TFLOP
instead of 0.1, and 512 MiB of temporaries). The VJP is ours, not megablox's `ops.gmm`: its
kernels leave output rows past the last group unwritten (any bits, NaN too) in the product and
in the input gradient alike, which we mask to zeros; and our backward feeds the cotangent to the
kernels in the operands' dtype (bf16 at the MXU's bf16 rate; a bf16 caller's fp32 product is
rounded to bf16 anyway, as torch's output is). Every kernel accumulates in fp32 and rounds once.

Tiles (`tiling`): rows in tiles of 128 (256 where groups average 512 rows or more; all of them,
padded to 16, when fewer than 128): each group computes its partial first and last tile whole,
about tm / (rows per group) extra work. The contracting dim whole when it fits VMEM (a weight
tile then stays there across its group's row tiles: each weight read once), the output dim as
wide as then fits; the weight gradient's two dims the pair that re-reads the rows and the
cotangent least. Below a whole dim, tiles are 128·2^i whose partial last tile (masked by
megablox) wastes at most 1/8 of it. `ragged_dot` remains where megablox cannot go: operands
other than bf16 and fp32 (float8), and a program XLA's partitioner splits over devices (jax
refuses to partition a Mosaic kernel; inside a `shard_map` over every mesh axis, as the expert
regions run, megablox runs). `interpret=True` runs this path in Pallas's interpreter (its
numerics, tested on CPU).

Elsewhere jax lowers `ragged_dot` to a dense dot over every group with a mask, G times the
FLOPs (8 experts: 8×, and 11× the time on CPU). So on CPU and GPU the rows
are laid out in blocks of B rows that each belong to one group (every group
padded to a multiple of B) and a loop over the blocks multiplies each by its
group's matrix: (M + G·B)·K·N multiply-adds over M/B + G blocks, each of which
reads its group's [K, N] matrix again. Small blocks waste reads, large ones
padded rows; B is the largest power of two ≤ 8·√(M/G), at most one power of two from the
fastest measured on CPU (64 experts at 2,048 rows: B 8 → 32, fwd + bwd 0.33 →
0.18 s, B 16 0.16 s; 8 experts at 4,096 rows it stays 128: 1.25× the active
multiply-adds). Its VJP is written out: the input gradient is the same blocked product with each
matrix transposed, and the weight gradient adds every block's `xᵀ·dy` into its
group's slot in place (no full-size buffer per block). Either output carries the
matmul `checkpoint_name`, so the dot-keeping remat policies (a scan's default
among them) keep it instead of recomputing the experts in the backward.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.lowering import target_device

_MIN_BLOCK, _MAX_BLOCK = 8, 256
_VMEM_BYTES = 14 << 20  # of the 16 MiB of VMEM a Mosaic kernel gets by default on v4/v5 (32 on v6e)


def ragged_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, interpret=False):
  """`lhs` [M, K] rows grouped by `group_sizes` [G] (in order), times `rhs` [G, K, N];
  `interpret`: the TPU kernels in Pallas's interpreter, on any platform."""
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
  group_sizes = group_sizes.astype(jnp.int32)
  if interpret or target_device.device().platform == "tpu":
    tiles = _megablox_tiling(lhs, rhs, out_dtype)
    if tiles is None or _split_by_xla(lhs, rhs):
      out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    else:
      out = _megablox(lhs, rhs, group_sizes, tiles, out_dtype, interpret)
  else:
    out = _blocked(lhs, rhs, group_sizes, block_rows(lhs.shape[0], rhs.shape[0]), out_dtype)
  # A matmul a remat policy must see as one: both forms are kernels in a custom VJP.
  return checkpoint_name(out, remat_lib.MATMUL_NAME)


def tiling(rows: int, k: int, n: int, groups: int, in_bytes: int, out_bytes: int, grad_bytes: tuple[int, int]):
  """(tm, tk, tn) of the three kernels, each within `_VMEM_BYTES` (see the module docstring):
  the product (K → N), the input gradient (N → K) and the weight gradient (rows contracted, K × N).
  `grad_bytes`: the input and weight gradients' element sizes. None where no tiling fits."""
  tm = -(-rows // 16) * 16 if rows < 128 else 256 if rows >= 512 * groups else 128
  tiles = (_gmm_tiles(tm, k, n, in_bytes, out_bytes), _gmm_tiles(tm, n, k, in_bytes, grad_bytes[0]),
           _tgmm_tiles(tm, k, n, in_bytes, grad_bytes[1]))
  return None if None in tiles else tiles


def _tile_sizes(size: int) -> list[int]:
  """Tiles for a dim, largest first: all of it, then the 128·2^i below it whose partial last
  tile (masked by megablox) wastes at most 1/8 of the dim."""
  return [size] + [t for t in (4096, 2048, 1024, 512, 256, 128) if t < size and -(-size // t) * t * 8 <= size * 9]


def _gmm_tiles(tm, k, n, in_bytes, out_bytes):
  """gmm's (tm, tk, tn): tk the largest that fits beside the narrowest tn (all of k: each weight
  tile read once), then tn the widest (the rows are read once per tn)."""
  # double-buffered blocks of lhs, rhs and the output, and the fp32 accumulator
  fits = lambda tk, tn: 2 * (tm * tk + tk * tn) * in_bytes + 2 * tm * tn * out_bytes + 4 * tm * tn <= _VMEM_BYTES  # noqa: E731
  tk = next((t for t in _tile_sizes(k) if fits(t, _tile_sizes(n)[-1])), None)
  tn = next((t for t in _tile_sizes(n) if tk and fits(tk, t)), None)
  return (tm, tk, tn) if tn else None


def _tgmm_tiles(tm, k, n, in_bytes, out_bytes):
  """tgmm's (tm, tk, tn), output [tk, tn] per group: the rows [M, K] are read once per tn and
  the cotangent [M, N] once per tk; the pair that fits reading least, then the larger."""
  fits = lambda tk, tn: 2 * tm * (tk + tn) * in_bytes + 2 * tk * tn * out_bytes + 4 * tk * tn <= _VMEM_BYTES  # noqa: E731
  pairs = [(tk, tn) for tk in _tile_sizes(k) for tn in _tile_sizes(n) if fits(tk, tn)]
  read = lambda p: (k * -(-n // p[1]) + n * -(-k // p[0]), -p[0] * p[1])  # noqa: E731
  return (tm, *min(pairs, key=read)) if pairs else None


def _megablox_tiling(lhs, rhs, out_dtype):
  """The kernels' tiles for these operands, or None where megablox does not take them."""
  supported = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
  if lhs.dtype not in supported or rhs.dtype not in supported or 0 in lhs.shape + rhs.shape:
    return None  # megablox multiplies bf16 and fp32 only (float8 goes to ragged_dot), and nothing empty
  in_bytes = max(lhs.dtype.itemsize, rhs.dtype.itemsize)
  (rows, k), (groups, _, n) = lhs.shape, rhs.shape
  return tiling(rows, k, n, groups, in_bytes, out_dtype.itemsize, (lhs.dtype.itemsize, rhs.dtype.itemsize))


def _split_by_xla(*operands) -> bool:
  """XLA's partitioner splits these operands over devices (outside a shard_map over every mesh axis):
  jax refuses a Mosaic kernel there, and the partitioner splits `ragged_dot` itself."""
  manual = [t == jax.sharding.AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types]
  if any(manual):
    return not all(manual)
  return any(jax.typeof(x).sharding.mesh.size > 1 for x in operands)


def _kernels():
  """jax's megablox kernels module (imported when a TPU program first needs it)."""
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _padded(x, tm):
  return jnp.pad(x, ((0, -x.shape[0] % tm), (0, 0)))


def _gmm(x, rhs, group_sizes, tiles, out_dtype, interpret, transpose_rhs=False):
  """gmm on rows padded to its tm, rows past the last group zeroed (the kernel leaves them unwritten)."""
  rows = x.shape[0]
  out = _kernels().gmm(_padded(x, tiles[0]), rhs, group_sizes, out_dtype, tiles, transpose_rhs=transpose_rhs,
                       interpret=interpret)[:rows]
  return jnp.where((jnp.arange(rows) < group_sizes.sum())[:, None], out, jnp.zeros((), out.dtype))


def _megablox(lhs, rhs, group_sizes, tiles, out_dtype, interpret):
  """The kernels on `rhs` [G, K, N] read as its transpose [G, N, K]: MoE code passes its weights
  transposed (`w.transpose(-2, -1)`: torchtitan's, HF's), which a Mosaic kernel would otherwise
  take as a copy of every expert's weight; transposed back here, XLA folds the two away."""
  return _transposed(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes, tiles, out_dtype, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _transposed(lhs, rhs_t, group_sizes, tiles, out_dtype, interpret):
  return _gmm(lhs, rhs_t, group_sizes, tiles[0], out_dtype, interpret, transpose_rhs=True)


def _transposed_fwd(lhs, rhs_t, group_sizes, tiles, out_dtype, interpret):
  return _transposed(lhs, rhs_t, group_sizes, tiles, out_dtype, interpret), (lhs, rhs_t, group_sizes)


def _transposed_bwd(tiles, out_dtype, interpret, residuals, d_out):
  lhs, rhs_t, group_sizes = residuals
  d_out = d_out.astype(jnp.promote_types(lhs.dtype, rhs_t.dtype))
  d_lhs = _gmm(d_out, rhs_t, group_sizes, tiles[1], lhs.dtype, interpret)
  tm, tk, tn = tiles[2]
  # each group's [N, K] gradient, d_outᵀ·lhs; tgmm selects each group's rows: rows past the last
  # group (any bits) never enter the sums
  d_rhs_t = _kernels().tgmm(_padded(d_out, tm).T, _padded(lhs, tm), group_sizes, rhs_t.dtype, (tm, tn, tk), interpret=interpret)
  return d_lhs, d_rhs_t, None


_transposed.defvjp(_transposed_fwd, _transposed_bwd)


def block_rows(rows: int, groups: int) -> int:
  """B: the largest power of two ≤ 8·√(rows / groups), within [8, 256] (re-read matrices
  against padded rows, balanced)."""
  target = max(math.isqrt(64 * rows // groups), 1)
  return min(max(1 << (target.bit_length() - 1), _MIN_BLOCK), _MAX_BLOCK)


def _layout(group_sizes, rows: int, block: int):
  """Where each row goes in the blocked layout and back.

  Returns (src [S]: the row each slot holds, slot_valid [S], dest [M]: the slot
  each row went to, row_valid [M], block_group [S/B]: the group of each block).
  """
  groups = group_sizes.shape[0]
  capacity = -(-rows // block) * block + groups * block
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  padded = -(-group_sizes // block) * block
  padded_ends = jnp.cumsum(padded)
  padded_starts = padded_ends - padded

  slot = jnp.arange(capacity)
  slot_group = jnp.minimum(jnp.searchsorted(padded_ends, slot, side="right"), groups - 1)
  within = slot - padded_starts[slot_group]
  slot_valid = (within < group_sizes[slot_group]) & (slot < padded_ends[-1])
  src = jnp.where(slot_valid, starts[slot_group] + within, 0)

  row = jnp.arange(rows)
  row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), groups - 1)
  row_valid = row < ends[-1]
  dest = jnp.where(row_valid, padded_starts[row_group] + row - starts[row_group], 0)
  return src, slot_valid, dest, row_valid, slot_group[::block]


def _to_blocks(x, src, slot_valid, block):
  gathered = jnp.where(slot_valid[:, None], x[src], jnp.zeros((), x.dtype))
  return gathered.reshape(-1, block, x.shape[-1])


def _from_blocks(blocks, dest, row_valid):
  flat = blocks.reshape(-1, blocks.shape[-1])
  return jnp.where(row_valid[:, None], flat[dest], jnp.zeros((), flat.dtype))


def _block_products(x_blocks, rhs, block_group, out_dtype, transpose_rhs=False):
  """Each block times its group's matrix (transposed when asked), one block per loop step."""

  def one(_, xs):
    x, group = xs
    w = lax.dynamic_index_in_dim(rhs, group, keepdims=False)
    w = w.T if transpose_rhs else w
    return None, jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)

  _, out = lax.scan(one, None, (x_blocks, block_group))
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked(lhs, rhs, group_sizes, block, out_dtype):
  src, slot_valid, dest, row_valid, block_group = _layout(group_sizes, lhs.shape[0], block)
  products = _block_products(_to_blocks(lhs, src, slot_valid, block), rhs, block_group, out_dtype)
  return _from_blocks(products, dest, row_valid)


def _blocked_fwd(lhs, rhs, group_sizes, block, out_dtype):
  return _blocked(lhs, rhs, group_sizes, block, out_dtype), (lhs, rhs, group_sizes)


def _blocked_bwd(block, out_dtype, residuals, d_out):
  lhs, rhs, group_sizes = residuals
  operands = jnp.result_type(lhs.dtype, rhs.dtype)
  if operands in (jnp.bfloat16, jnp.float16):
    # the cotangent of a product rounded to 16 bits (torch's output) is exact in them: the backward's
    # matmuls run at the 16-bit rate, not as fp32 (XLA:GPU: TF32 at best, twice the bytes)
    d_out = d_out.astype(operands)
  src, slot_valid, dest, row_valid, block_group = _layout(group_sizes, lhs.shape[0], block)
  x_blocks = _to_blocks(lhs, src, slot_valid, block)
  dy_blocks = _to_blocks(d_out, src, slot_valid, block)
  d_lhs = _from_blocks(_block_products(dy_blocks, rhs, block_group, lhs.dtype, transpose_rhs=True), dest, row_valid)

  def accumulate(d_rhs, xs):
    x, dy, group = xs
    update = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)
    current = lax.dynamic_index_in_dim(d_rhs, group, keepdims=False)
    return lax.dynamic_update_index_in_dim(d_rhs, current + update, group, 0), None

  d_rhs, _ = lax.scan(accumulate, jnp.zeros(rhs.shape, jnp.float32), (x_blocks, dy_blocks, block_group))
  return d_lhs, d_rhs.astype(rhs.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
