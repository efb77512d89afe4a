"""Pallas splash attention (TPU; interpret mode elsewhere, for tests): its block
sizes, the user's `attention_block_sizes` checked against them, and the per-shard call."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from torch_on_tpu.attention.padding import pad_to, round_up
from torch_on_tpu.errors import TorchOnTpuError

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
_SPLASH_LANES = 128  # splash tiles the kv axis in multiples of the TPU lane width


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


def splash_block_sizes(length: int, overrides: dict):
  """(padded length, splash BlockSizes): 512/256/128 tiles, whichever divides the
  length rounded up to 128, unless overridden."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  padded = round_up(length, _SPLASH_LANES)
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
  block_sizes = sk.BlockSizes(**sizes, use_fused_bwd_kernel=fused)
  return round_up(length, _tile(block_sizes)), block_sizes


def _tile(sizes) -> int:
  """The length every splash tile size divides."""
  values = [v for v in dataclasses.astuple(sizes) if isinstance(v, int) and not isinstance(v, bool)]
  return math.lcm(_SPLASH_LANES, *values)


def tiles_whole(length: int, overrides: dict) -> bool:
  """Whether `length` query rows fill splash's tiles with no padding (a block of a
  longer sequence must: a padded row there could see no key at all)."""
  return splash_block_sizes(length, overrides)[0] == length


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, shape: tuple, causal: bool, window: int | None, q_offset: int, block_sizes, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  if window is not None:  # keys at r - window < col (<= r when causal), r the global row
    head_mask = sm.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=q_offset)
  else:
    head_mask = sm.CausalMask(shape, offset=q_offset) if causal else sm.FullMask(shape)
  # Concrete mask tables even when first built inside a trace: the kernel is cached.
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mha(
      sm.MultiHeadMask([head_mask] * heads),
      block_sizes=block_sizes,
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
    )


def splash_attention(
  q, k, v, segment_ids, sinks=None, *, causal, window=None, scale, block_sizes, interpret, q_offset: int = 0
):
  """Splash on one shard: (B, Hq, L, D) with L == S; q pre-scaled as splash expects;
  `sinks` (Hq,) per-head logits joining each row's softmax.

  Padding to the tile multiple gets its own segment id, so real rows never see
  padded keys and padded rows (dropped afterwards) always see their own key.
  A block of a longer sequence (context parallelism's gathered K/V): L rows
  filling whole tiles (`tiles_whole`) at global position `q_offset` (an int:
  one kernel per offset) against keys 0..S-1, masked on global positions.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  batch, heads, length, _ = q.shape
  kv_length = k.shape[2]
  padded, sizes = splash_block_sizes(length, block_sizes)
  kv_padded = padded if kv_length == length else round_up(kv_length, _tile(sizes))
  if (padded != length or kv_padded != kv_length) and segment_ids is None:
    segment_ids = (jnp.zeros((batch, length), jnp.int32), jnp.zeros((batch, kv_length), jnp.int32))
  seg = None
  if segment_ids is not None:
    pad_id = jnp.iinfo(jnp.int32).min
    seg = sk.SegmentIds(pad_to(segment_ids[0], 1, padded, pad_id), pad_to(segment_ids[1], 1, kv_padded, pad_id))
  qp = pad_to(q * jnp.asarray(scale, q.dtype), 2, padded)
  kp, vp = pad_to(k, 2, kv_padded), pad_to(v, 2, kv_padded)
  kernel = _splash_kernel(heads, (padded, kv_padded), causal, window, q_offset, sizes, interpret)
  out = jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(qp, kp, vp, seg, sinks)
  return out[:, :, :length]
