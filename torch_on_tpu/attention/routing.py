"""Attention kernels behind `scaled_dot_product_attention` (and torchtitan's flex).

torchax lowers SDPA by building an L×S bias and the full score matrix: at long
sequence lengths that alone exhausts memory. While `kernels(mode, ...)` is
active (JittableModule enters it around every trace), SDPA runs one of:

- `"splash"`: Pallas splash attention (TPU; Pallas interpret mode elsewhere, for tests),
- `"cudnn"`: `jax.nn.dot_product_attention(implementation="cudnn")` (GPU; its
  `"xla"` implementation elsewhere, so the argument plumbing runs on CPU too),
- `"xla"`: a blocked online-softmax kernel with a recomputing backward that only
  holds a few (block_q × block_kv) tiles of scores per batch and head,

each in `shard_map` over the mesh (batch over the data axes, heads over `tp`).
`"auto"` picks by platform. A call a kernel cannot express (dropout, explicit
masks, L≠S for splash; fp32 or masks for cuDNN) runs the XLA kernel instead,
said once in the log. Semantics are torch's: top-left causal mask, bool or
additive `attn_mask`, default scale 1/√d, GQA, dropout on the attention
weights, and rows with nothing to attend to give 0 (as torch 2.13 eager does);
query, key and value broadcast as torch's matmuls do (batch dims, one key/value
head for many query heads without `enable_gqa`, 2-D and 3-D inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from torch_on_tpu import _compat, ops
from torch_on_tpu import remat as remat_lib
from torch_on_tpu.errors import TorchOnTpuError

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

logger = logging.getLogger(__name__)

MODES = ("auto", "splash", "cudnn", "xla")

# Splash's tunables (`jax.experimental.pallas.ops.tpu.splash_attention.BlockSizes`);
# the XLA kernel reads `block_q` and `block_kv` too.
BLOCK_SIZE_KEYS = (
  "block_q",
  "block_kv",
  "block_kv_compute",
  "block_q_dkv",
  "block_kv_dkv",
  "block_kv_dkv_compute",
  "block_q_dq",
  "block_kv_dq",
  "use_fused_bwd_kernel",
)
# XLA kernel tiles: on CPU smaller tiles were faster (cache-resident, finer causal
# skipping; tools/bench_attention.py); accelerators favour fewer, larger steps.
_XLA_BLOCK_CPU = 256
_XLA_BLOCK_ACCELERATOR = 512
_SPLASH_LANES = 128  # splash tiles the kv axis in multiples of the TPU lane width

_said: set[str] = set()


def _say_once(level: int, message: str) -> None:
  if message not in _said:
    _said.add(message)
    logger.log(level, message)


def kernels(mode, *, mesh, data_axes, block_sizes):
  """While active, SDPA (and torchtitan's flex attention) run our kernel.

  `mode=None` leaves torchax's default lowering untouched.
  """
  if mode is None:
    return contextlib.nullcontext()
  return installed(Attention(mode, mesh=mesh, data_axes=data_axes, block_sizes=block_sizes))


@contextlib.contextmanager
def installed(attn: Attention):
  """While active, SDPA (and torchtitan's flex attention) run `attn`'s kernel."""
  sdpa = attn.sdpa
  overrides = {
    torch.nn.functional.scaled_dot_product_attention: sdpa,
    torch.ops.aten.scaled_dot_product_attention: sdpa,
  }
  with contextlib.ExitStack() as stack:
    stack.enter_context(ops.bridge_overrides(overrides, is_jax_function=True))
    if "torchtitan.models.common.attention" in sys.modules:
      from torch_on_tpu.models import torchtitan as titan

      stack.enter_context(titan.flex_routed_to(attn.flex))
    yield


def check_block_sizes(block_sizes) -> dict:
  """Validated copy of an `attention_block_sizes` dict."""
  out = dict(block_sizes or {})
  for name, value in out.items():
    if name not in BLOCK_SIZE_KEYS:
      raise TorchOnTpuError(
        f"attention_block_sizes has unknown key '{name}'; use some of {', '.join(BLOCK_SIZE_KEYS)}."
      )
    if name == "use_fused_bwd_kernel":
      if not isinstance(value, bool):
        raise TorchOnTpuError(
          f"attention_block_sizes['{name}'] must be True or False, got {value!r}."
        )
    elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise TorchOnTpuError(
        f"attention_block_sizes['{name}'] must be a positive int, got {value!r}."
      )
  return out


class Attention:
  """One resolved kernel choice: `mode` on this mesh's platform, with its settings."""

  def __init__(self, mode, *, mesh=None, data_axes=(), block_sizes=None):
    if mode not in MODES:
      raise TorchOnTpuError(
        f"attention={mode!r} is not a kernel; use one of {', '.join(map(repr, MODES))} or None."
      )
    self.mesh = mesh
    self.data_axes = tuple(a for a in (data_axes or ()) if mesh is not None and mesh.shape[a] > 1)
    self.block_sizes = check_block_sizes(block_sizes)
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    platform = device.platform
    if platform == "gpu" and "rocm" in getattr(device.client, "platform_version", "").lower():
      platform = "rocm"
    self.platform = platform
    self.xla_block = _XLA_BLOCK_CPU if platform == "cpu" else _XLA_BLOCK_ACCELERATOR
    self.kind, self.accelerated, reason = _resolve(mode, platform)
    _say_once(logging.INFO, f"attention={mode!r} on {platform}: {reason}")

  # ---- the torch side ----------------------------------------------------------------

  def sdpa(
    self,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
  ):
    """`F.scaled_dot_product_attention`'s signature, on jax arrays (torchax unwraps them)."""
    if attn_mask is not None and is_causal:
      raise TorchOnTpuError(
        "scaled_dot_product_attention got both attn_mask and is_causal=True, which torch "
        "rejects too; fold the causal mask into attn_mask or drop it."
      )
    rng = torchax.default_env().get_and_rotate_prng_key() if dropout_p > 0 else None
    return self(
      query,
      key,
      value,
      mask=attn_mask,
      causal=is_causal,
      scale=scale,
      dropout_rate=dropout_p,
      dropout_key=rng,
      enable_gqa=enable_gqa,
    )

  def flex(self, q, k, v, *, segment_ids, scale, enable_gqa):
    """Causal (document-causal with `segment_ids`) attention on torch tensors (B, N, L, H)."""
    seg = None if segment_ids is None else jax_view(segment_ids)
    out = self(
      jax_view(q),
      jax_view(k),
      jax_view(v),
      causal=True,
      segment_ids=None if seg is None else (seg, seg),
      scale=scale,
      enable_gqa=enable_gqa,
    )
    return torch_view(out)

  # ---- the jax side ------------------------------------------------------------------

  def __call__(
    self,
    q,
    k,
    v,
    *,
    mask=None,
    causal=False,
    segment_ids=None,
    scale=None,
    dropout_rate=0.0,
    dropout_key=None,
    enable_gqa=False,
  ):
    """Attention on jax arrays laid out like torch's: q (..., Hq, L, D), k/v (..., Hkv, S, D).

    `mask` is bool (True = attend) or additive, broadcastable to (..., Hq, L, S);
    `segment_ids` is a (q_ids (B, L), kv_ids (B, S)) pair: only equal ids attend.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    out_ndim = max(q.ndim, k.ndim, v.ndim)
    q, k, v = _broadcast_like_torch(q, k, v, enable_gqa)
    lead = q.shape[:-3]
    hq, length, dim = q.shape[-3:]
    hkv, kv_len = k.shape[-3], k.shape[-2]
    batch = math.prod(lead)
    q = q.reshape(batch, hq, length, dim)
    k = k.reshape(batch, hkv, kv_len, dim)
    v = v.reshape(batch, hkv, kv_len, v.shape[-1])
    if mask is not None:
      mask = _mask_4d(jnp.asarray(mask), lead, (hq, length, kv_len))
    if segment_ids is not None:
      segment_ids = tuple(jnp.asarray(s, jnp.int32).reshape(batch, -1) for s in segment_ids)
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    seed = None
    if dropout_rate > 0:
      if dropout_key is None:
        raise TorchOnTpuError("attention dropout_rate > 0 needs a dropout_key (a jax PRNG key).")
      seed = jax.random.bits(dropout_key, (2,), jnp.uint32)

    kind = self._kind_for(q, k, v, mask, causal, segment_ids, dropout_rate)
    call = functools.partial(
      self._local, kind=kind, causal=causal, scale=scale, dropout_rate=float(dropout_rate)
    )
    out = checkpoint_name(self._sharded(call, q, k, v, mask, segment_ids, seed), remat_lib.ATTENTION_NAME)
    out = out.reshape(*lead, hq, length, v.shape[-1])
    return out.reshape(out.shape[len(out.shape) - out_ndim :]) if out_ndim < out.ndim else out

  def _kind_for(self, q, k, v, mask, causal, segment_ids, dropout_rate) -> str:
    """The configured kernel, or "xla" (said once) where it cannot express the call."""
    if self.kind == "xla":
      return "xla"
    reason = None
    length, kv_len = q.shape[2], k.shape[2]
    if dropout_rate > 0:
      reason = "dropout"
    elif mask is not None:
      reason = "an explicit attn_mask"
    elif self.kind == "splash" and length != kv_len:
      reason = f"query length {length} != key length {kv_len}"
    elif self.kind == "cudnn":
      if segment_ids is not None:
        reason = "document (segment id) masks"
      elif causal and length != kv_len:
        reason = f"a causal mask with query length {length} != key length {kv_len}"
      elif v.shape[-1] != q.shape[-1]:
        reason = f"a value head dim ({v.shape[-1]}) unlike the query's ({q.shape[-1]})"
      elif self.accelerated and q.dtype not in (jnp.bfloat16, jnp.float16):
        reason = f"{q.dtype} inputs (cuDNN flash attention takes bf16/fp16)"
      elif self.accelerated and (q.shape[-1] % 8 or q.shape[-1] > 128):
        reason = f"head dim {q.shape[-1]} (cuDNN takes multiples of 8 up to 128)"
    if reason is None:
      return self.kind
    _say_once(
      logging.WARNING,
      f"attention: the {self.kind} kernel cannot express {reason}; those calls run the XLA kernel.",
    )
    return "xla"

  def _local(self, q, k, v, mask, segment_ids, seed, offsets, *, kind, causal, scale, dropout_rate):
    """One shard's attention, (B, H, L, D) in and out."""
    if kind == "splash":
      return _splash(
        q, k, v, segment_ids, causal=causal, scale=scale,
        block_sizes=self.block_sizes, interpret=not self.accelerated,
      )
    if kind == "cudnn":
      out = jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3),
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        scale=scale,
        is_causal=causal,
        implementation="cudnn" if self.accelerated else "xla",
      )
      return out.transpose(0, 2, 1, 3)
    return xla_attention(
      q, k, v, mask=mask, segment_ids=segment_ids, causal=causal, scale=scale,
      dropout_rate=dropout_rate, dropout_seed=seed, offsets=offsets,
      block_q=self.block_sizes.get("block_q", self.xla_block),
      block_kv=self.block_sizes.get("block_kv", self.xla_block),
    )

  def _sharded(self, call, q, k, v, mask, segment_ids, seed):
    """Runs `call` per shard: batch over the data axes, heads over `tp`, where they divide."""
    batch, hq = q.shape[:2]
    hkv = k.shape[1]
    mesh = self.mesh
    data = self.data_axes
    if mesh is None or mesh.size == 1:
      return call(q, k, v, mask, segment_ids, seed, None)
    ways = math.prod(mesh.shape[a] for a in data)
    b_axes = (data if len(data) > 1 else data[0]) if data and batch % ways == 0 else None
    tp = mesh.shape.get("tp", 1)
    h_axis = "tp" if tp > 1 and hq % tp == 0 and hkv % tp == 0 else None
    if b_axes is None and h_axis is None:
      return call(q, k, v, mask, segment_ids, seed, None)
    qkv_spec = P(b_axes, h_axis, None, None)
    args, specs = [q, k, v], [qkv_spec] * 3
    if mask is not None:
      args.append(mask)
      specs.append(
        P(b_axes if mask.shape[0] > 1 else None, h_axis if mask.shape[1] > 1 else None, None, None)
      )
    if segment_ids is not None:
      args.extend(segment_ids)
      specs.extend([P(b_axes, None)] * 2)
    if seed is not None:
      args.append(seed)
      specs.append(P(None))

    def body(q, k, v, *rest):
      rest = iter(rest)
      m = next(rest) if mask is not None else None
      seg = (next(rest), next(rest)) if segment_ids is not None else None
      s = next(rest) if seed is not None else None
      b_off = lax.axis_index(b_axes) * q.shape[0] if b_axes is not None else 0
      h_off = lax.axis_index(h_axis) * q.shape[1] if h_axis is not None else 0
      return call(q, k, v, m, seg, s, (b_off, h_off))

    return jax.shard_map(
      body, mesh=mesh, in_specs=tuple(specs), out_specs=qkv_spec, check_vma=False
    )(*args)


def _resolve(mode: str, platform: str) -> tuple[str, bool, str]:
  """(kernel, runs natively on this platform, why) for a mode on a platform."""
  if mode == "auto":
    if platform == "tpu":
      return "splash", True, "Pallas splash attention (auto on TPU)"
    if platform == "gpu":
      return "cudnn", True, "cuDNN flash attention via jax.nn.dot_product_attention (auto on GPU)"
    return "xla", True, f"blocked XLA attention with a recomputing backward (auto on {platform})"
  if mode == "splash":
    if platform == "tpu":
      return "splash", True, "Pallas splash attention"
    return "splash", False, (
      f"Pallas splash attention in interpret mode (slow: {platform} has no TPU)"
    )
  if mode == "cudnn":
    if platform == "gpu":
      return "cudnn", True, "cuDNN flash attention via jax.nn.dot_product_attention"
    return "cudnn", False, (
      f"jax.nn.dot_product_attention's XLA implementation ({platform} has no cuDNN; "
      f"same arguments, full score matrix)"
    )
  return "xla", True, "blocked XLA attention with a recomputing backward"


def _broadcast_like_torch(q, k, v, enable_gqa):
  """q (..., Hq, L, D), k (..., Hk, S, D), v (..., Hv, S, Dv) broadcast as torch's SDPA
  does (its matmuls broadcast every dim but the last two): equal leading dims,
  k and v with the same heads, q's heads a multiple of theirs (GQA; MQA when 1)."""
  if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
    raise TorchOnTpuError(
      f"attention needs query/key/value with a sequence and a feature dim; got shapes "
      f"{q.shape}, {k.shape}, {v.shape}."
    )
  ndim = max(q.ndim, k.ndim, v.ndim, 3)
  q, k, v = (x.reshape((1,) * (ndim - x.ndim) + x.shape) for x in (q, k, v))
  if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
    raise TorchOnTpuError(
      f"attention key {k.shape} / value {v.shape} do not fit query {q.shape}; key needs the "
      f"query's feature dim and value the key's length."
    )
  try:
    lead = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
  except ValueError:
    raise TorchOnTpuError(
      f"attention query {q.shape}, key {k.shape} and value {v.shape} have batch dims that do "
      f"not broadcast together."
    ) from None
  hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
  if enable_gqa:
    if hk != hv or hq % hk:
      raise TorchOnTpuError(
        f"attention with enable_gqa=True needs key and value with the same heads and query heads a "
        f"multiple of them; got {hq} query, {hk} key and {hv} value heads."
      )
    heads_q = heads_kv = None
  elif hk == hv and (hq == hk or hk == 1):
    heads_q = heads_kv = None  # one key/value head for all query heads is GQA with one group
  else:
    try:
      heads = jnp.broadcast_shapes((hq,), (hk,), (hv,))[0]
    except ValueError:
      raise TorchOnTpuError(
        f"attention query has {hq} heads but key/value have {hk}/{hv}; pass enable_gqa=True "
        f"(with query heads a multiple of key/value heads) or repeat the key/value heads."
      ) from None
    heads_q = heads_kv = heads
  q = jnp.broadcast_to(q, (*lead, heads_q or hq, *q.shape[-2:]))
  k = jnp.broadcast_to(k, (*lead, heads_kv or hk, *k.shape[-2:]))
  v = jnp.broadcast_to(v, (*lead, heads_kv or hv, *v.shape[-2:]))
  return q, k, v


def _mask_4d(mask, lead, tail):
  """torch-broadcastable mask → (1 or B, 1 or Hq, 1 or L, 1 or S), dtype kept."""
  full = (*lead, *tail)
  if mask.ndim > len(full):
    raise TorchOnTpuError(
      f"attn_mask of shape {mask.shape} has more dims than the scores {full}; drop its "
      f"extra leading dims."
    )
  mask = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
  for have, want in zip(mask.shape, full):
    if have not in (1, want):
      raise TorchOnTpuError(
        f"attn_mask of shape {mask.shape} does not broadcast to the scores' shape {full}; "
        f"each dim must be 1 or match."
      )
  lead_mask = mask.shape[: len(lead)]
  if any(d != 1 for d in lead_mask):
    mask = jnp.broadcast_to(mask, (*lead, *mask.shape[len(lead):]))
    mask = mask.reshape(math.prod(lead), *mask.shape[len(lead):])
  else:
    mask = mask.reshape(1, *mask.shape[len(lead):])
  return mask


# ---- the XLA kernel ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tiles:
  causal: bool
  scale: float
  rate: float
  block_q: int
  block_kv: int
  length: int
  kv_length: int

  @property
  def padded(self) -> tuple[int, int]:
    return _round_up(self.length, self.block_q), _round_up(self.kv_length, self.block_kv)


def xla_attention(
  q,
  k,
  v,
  *,
  mask=None,
  segment_ids=None,
  causal=False,
  scale,
  dropout_rate=0.0,
  dropout_seed=None,
  offsets=None,
  block_q=_XLA_BLOCK_CPU,
  block_kv=_XLA_BLOCK_CPU,
):
  """Blocked attention: q (B, Hq, L, D), k/v (B, Hkv, S, D) → (B, Hq, L, Dv).

  Loops over query tiles and, inside, over the key tiles a tile can see (causal
  skips the rest), keeping a running max and sum (online softmax). Backward
  recomputes each tile's scores from q, k and the saved log-sum-exp, so memory
  stays O(L·D) plus a few tiles. `mask` is (1|B, 1|Hq, 1|L, 1|S), bool or additive
  (float masks get a gradient when differentiated). Dropout keeps an element
  by hashing (seed, global batch, head, row, col), so any tiling or sharding
  (`offsets` = this shard's first batch and head) drops the same elements.
  """
  batch, hq, length, dim = q.shape
  hkv, kv_length = k.shape[1], k.shape[2]
  groups = hq // hkv
  tiles = _Tiles(
    causal=bool(causal),
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
  if tiles.rate > 0:
    offsets = jnp.asarray((0, 0) if offsets is None else offsets, jnp.uint32)
  else:
    dropout_seed = offsets = None
  out = _flash(q5, k, v, mask, q_seg, kv_seg, dropout_seed, offsets, tiles)
  return out.reshape(batch, hq, length, v.shape[-1])


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_to(x, axis: int, size: int, value=0, *, broadcast=False):
  """Pads `axis` up to `size`; with `broadcast`, a size-1 (broadcast) axis stays."""
  if x is None or x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


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
  15% off the forward of a 256-wide tile on CPU (docs/performance.md).
  """
  while x.shape[-1] > _CPU_REDUCE_WINDOW and x.shape[-1] % 2 == 0:
    half = x.shape[-1] // 2
    x = combine(x[..., :half], x[..., half:])
  return reduce(x, axis=-1)


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


def _scores(t: _Tiles, qi, kj, mask_ij, q_seg_i, kv_seg_j, i, j, *, keys_first=False):
  """Scaled, masked fp32 scores of query tile i against key tile j: (B, K, G, bq, bk),
  or with `keys_first` (B, K, bk, G, bq), the layout in which the backward's
  key-side matmuls (dK, dV) contract the tile without transposing it."""
  if keys_first:
    s = _einsum32("bksd,bkgqd->bksgq", kj, qi) * t.scale
    grid, q_axis, kv_axis = (t.block_kv, 1, t.block_q), 2, 0
  else:
    s = _einsum32("bkgqd,bksd->bkgqs", qi, kj) * t.scale
    grid, q_axis, kv_axis = (t.block_q, t.block_kv), 0, 1
  rows = i * t.block_q + lax.broadcasted_iota(jnp.int32, grid, q_axis)
  cols = j * t.block_kv + lax.broadcasted_iota(jnp.int32, grid, kv_axis)
  allowed = None

  def both(a, b):
    return b if a is None else a & b

  if t.causal:
    allowed = both(allowed, cols <= rows)
  if t.kv_length % t.block_kv:
    allowed = both(allowed, cols < t.kv_length)
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


def _drop(t: _Tiles, seed, offsets, shape, i, j, *, keys_first=False):
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
  if keys_first:
    rows = i * t.block_q + lax.broadcasted_iota(jnp.int32, (1, 1, t.block_q), 2)
    cols = j * t.block_kv + lax.broadcasted_iota(jnp.int32, (t.block_kv, 1, 1), 0)
  else:
    rows = i * t.block_q + lax.broadcasted_iota(jnp.int32, (t.block_q, 1), 0)
    cols = j * t.block_kv + lax.broadcasted_iota(jnp.int32, (1, t.block_kv), 1)
  return dropout_keep_scale(seed, b, h, rows, cols, t.rate)


def _kv_tiles_seen(t: _Tiles, i, n_kv: int):
  """Key tiles query tile i attends to: all, or (causal) up to its last row."""
  if not t.causal:
    return n_kv
  last = ((i + 1) * t.block_q - 1) // t.block_kv + 1
  return min(n_kv, last) if isinstance(i, int) else jnp.minimum(n_kv, last)


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
    _pad_to(q, 3, lp),
    _pad_to(k, 2, sp),
    _pad_to(v, 2, sp),
    _pad_to(_pad_to(mask, 3, lp, broadcast=True), 4, sp, broadcast=True),
    _pad_to(q_seg, 1, lp),
    _pad_to(kv_seg, 1, sp),
  )


def _flash_forward(t: _Tiles, q, k, v, mask, q_seg, kv_seg, seed, offsets):
  """(out (B, K, G, L, Dv), log-sum-exp (B, K, G, Lp) fp32)."""
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
      s = _scores(t, qi, kj, mask_ij, q_seg_i, kv_seg_j, i, j)
      m_new = jnp.maximum(m, _reduce_last(jnp.maximum, jnp.max, s))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      correction = jnp.exp(m - m_safe)
      l = l * correction + _reduce_last(jnp.add, jnp.sum, p)
      if t.rate > 0:
        p = p * _drop(t, seed, offsets, s.shape, i, j)
      pv = _einsum32("bkgqs,bksd->bkgqd", p.astype(vj.dtype), vj)
      return m_new, l, acc * correction[..., None] + pv

    init = (
      jnp.full(stat_shape, -jnp.inf, jnp.float32),
      jnp.zeros(stat_shape, jnp.float32),
      jnp.zeros((*stat_shape, dv), jnp.float32),
    )
    m, l, acc = _for(0, _kv_tiles_seen(t, i, n_kv), step, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out.astype(q.dtype), lse

  outs, lses = _map(query_tile, n_q)
  out = jnp.moveaxis(outs, 0, 3).reshape(batch, hkv, groups, lp, dv)[:, :, :, :length]
  lse = jnp.moveaxis(lses, 0, 3).reshape(batch, hkv, groups, lp)
  return out, lse


def _flash_backward(
  t: _Tiles, q, k, v, mask, q_seg, kv_seg, seed, offsets, out, lse, dout, mask_grad
):
  batch, hkv, groups, length, dim = q.shape
  kv_length = k.shape[2]
  qp, kp, vp, maskp, q_segp, kv_segp = _padded_inputs(t, q, k, v, mask, q_seg, kv_seg)
  lp, sp = t.padded
  n_q, n_kv = lp // t.block_q, sp // t.block_kv
  doutp = _pad_to(dout, 3, lp)
  out_dot_dout = doutp.astype(jnp.float32) * _pad_to(out, 3, lp).astype(jnp.float32)
  delta = _reduce_last(jnp.add, jnp.sum, out_dot_dout)
  lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  # dQ accumulates with the query axis last, (B, K, D, G, Lp): the tile matmul that
  # produces it then reads the keys-first score gradient without transposing it.
  dq0 = jnp.zeros((batch, hkv, dim, groups, lp), jnp.float32)
  dmask0 = jnp.zeros(maskp.shape, jnp.float32) if mask_grad else None

  def key_tile(carry, j):
    dq, dmask = carry
    kj, vj = _tile(kp, 2, j, t.block_kv), _tile(vp, 2, j, t.block_kv)
    kv_seg_j = _tile(kv_segp, 1, j, t.block_kv)
    mask_j = _tile(maskp, 4, j, t.block_kv)
    first = (j * t.block_kv) // t.block_q if t.causal else 0

    def step(i, c):
      dq, dmask, dk, dv = c
      qi, doi = _tile(qp, 3, i, t.block_q), _tile(doutp, 3, i, t.block_q)
      mask_ij, q_seg_i = _tile(mask_j, 3, i, t.block_q), _tile(q_segp, 1, i, t.block_q)
      # Tiles are keys-first, (B, K, bk, G, bq): dK and dV contract their trailing axes.
      s = _scores(t, qi, kj, mask_ij, q_seg_i, kv_seg_j, i, j, keys_first=True)
      p = jnp.exp(s - _tile(lse_safe, 3, i, t.block_q)[:, :, None])
      dp = _einsum32("bksd,bkgqd->bksgq", vj, doi)
      if t.rate > 0:
        keep = _drop(t, seed, offsets, s.shape, i, j, keys_first=True)
        pd, dp = p * keep, dp * keep
      else:
        pd = p
      dv = dv + _einsum32("bksgq,bkgqd->bksd", pd.astype(doi.dtype), doi)
      ds = p * (dp - _tile(delta, 3, i, t.block_q)[:, :, None])
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
    dq, dmask, dk, dv = _for(first, n_q, step, (dq, dmask, zeros_kv, zeros_v))
    return (dq, dmask), (dk * t.scale, dv)

  (dq, dmask), (dks, dvs) = _scan(key_tile, (dq0, dmask0), n_kv)
  dq = jnp.moveaxis(dq, 2, 4)[:, :, :, :length].astype(q.dtype)
  dk = jnp.moveaxis(dks, 0, 2).reshape(batch, hkv, sp, dim)[:, :, :kv_length].astype(k.dtype)
  dv = jnp.moveaxis(dvs, 0, 2).reshape(batch, hkv, sp, -1)[:, :, :kv_length].astype(v.dtype)
  if dmask is not None:
    dmask = dmask[:, :, :, : mask.shape[3], : mask.shape[4]].astype(mask.dtype)
  return dq, dk, dv, dmask


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, mask, q_seg, kv_seg, seed, offsets, t):
  return _flash_forward(t, q, k, v, mask, q_seg, kv_seg, seed, offsets)[0]


def _flash_fwd(q, k, v, mask, q_seg, kv_seg, seed, offsets, t):
  # symbolic_zeros: primals arrive wrapped, saying whether each is differentiated.
  def value(x):
    return None if x is None else x.value

  mask_grad = mask is not None and mask.perturbed and value(mask).dtype != jnp.bool_
  args = [value(x) for x in (q, k, v, mask, q_seg, kv_seg, seed, offsets)]
  out, lse = _flash_forward(t, *args)
  out, lse = (checkpoint_name(x, remat_lib.ATTENTION_NAME) for x in (out, lse))
  return out, (*args, out, lse, jnp.zeros(()) if mask_grad else None)


def _flash_bwd(t, res, dout):
  *args, out, lse, mask_grad = res
  dq, dk, dv, dmask = _flash_backward(t, *args, out, lse, dout, mask_grad is not None)
  return dq, dk, dv, dmask, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


# ---- splash ---------------------------------------------------------------------------------


def splash_block_sizes(length: int, overrides: dict):
  """(padded length, splash BlockSizes): 512/256/128 tiles, whichever divides the
  length rounded up to 128, unless overridden."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  padded = _round_up(length, _SPLASH_LANES)
  base = next(b for b in (512, 256, 128) if padded % b == 0)
  fused = overrides.get("use_fused_bwd_kernel", False)
  get = overrides.get
  block_q, block_kv = get("block_q", base), get("block_kv", base)
  sizes = dict(
    block_q=block_q,
    block_kv=block_kv,
    block_kv_compute=get("block_kv_compute", block_kv),
    block_q_dkv=get("block_q_dkv", block_q),
    block_kv_dkv=get("block_kv_dkv", block_kv),
  )
  sizes["block_kv_dkv_compute"] = get("block_kv_dkv_compute", sizes["block_kv_dkv"])
  if not fused:
    sizes.update(block_q_dq=get("block_q_dq", block_q), block_kv_dq=get("block_kv_dq", block_kv))
  padded = _round_up(length, math.lcm(_SPLASH_LANES, *sizes.values()))
  return padded, sk.BlockSizes(**sizes, use_fused_bwd_kernel=fused)


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, padded: int, causal: bool, block_sizes, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  shape = (padded, padded)
  head_mask = sm.CausalMask(shape) if causal else sm.FullMask(shape)
  # Concrete mask tables even when first built inside a trace: the kernel is cached.
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mha(
      sm.MultiHeadMask([head_mask] * heads),
      block_sizes=block_sizes,
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
    )


def _splash(q, k, v, segment_ids, *, causal, scale, block_sizes, interpret):
  """Splash on one shard: (B, Hq, L, D) with L == S; q pre-scaled as splash expects.

  Padding to the tile multiple gets its own segment id, so real rows never see
  padded keys and padded rows (dropped afterwards) always see their own key.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  batch, heads, length, _ = q.shape
  padded, sizes = splash_block_sizes(length, block_sizes)
  if padded != length and segment_ids is None:
    segment_ids = (jnp.zeros((batch, length), jnp.int32),) * 2
  seg = None
  if segment_ids is not None:
    pad_id = jnp.iinfo(jnp.int32).min
    seg = sk.SegmentIds(*(_pad_to(s, 1, padded, pad_id) for s in segment_ids))
  qp = _pad_to(q * jnp.asarray(scale, q.dtype), 2, padded)
  kp, vp = _pad_to(k, 2, padded), _pad_to(v, 2, padded)
  kernel = _splash_kernel(heads, padded, causal, sizes, interpret)
  out = jax.vmap(kernel)(qp, kp, vp, seg)
  return out[:, :, :length]
