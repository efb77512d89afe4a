"""Which kernel runs an SDPA or flex call, and how it is fed: the mode resolved per
platform, q/k/v and masks broadcast like torch, the call spread over the mesh in
`shard_map` (batch over the data axes, heads over `tp`, the sequence over `cp`:
`context.py`), the override installed for one trace."""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from torch_on_tpu import models
from torch_on_tpu.attention import context, splash, xla_flash
from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import device_checks, op_table
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.parallel import mesh as mesh_lib

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

logger = logging.getLogger(__name__)

MODES = ("auto", "splash", "cudnn", "xla")

_said: set[str] = set()


def _say_once(level: int, message: str) -> None:
  if message not in _said:
    _said.add(message)
    logger.log(level, message)


def kernels(mode, *, mesh, data_axes, block_sizes, context_parallel="auto"):
  """While active, SDPA (and the families' own attention, torchtitan's flex) run our kernel.

  `mode=None` leaves torchax's default lowering untouched.
  """
  if mode is None:
    return contextlib.nullcontext()
  return installed(
    Attention(mode, mesh=mesh, data_axes=data_axes, block_sizes=block_sizes, context_parallel=context_parallel)
  )


@contextlib.contextmanager
def installed(attn: Attention):
  """While active, SDPA (and the model families' own attention entry points, such as
  torchtitan's flex attention) run `attn`'s kernel; an SDPA the user overrides with
  `tot.override_op` keeps the user's definition."""
  sdpa = attn.sdpa
  env = _compat.torchax_env()
  overrides = {
    target: sdpa
    for target in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)
    if not _compat.overridden_by_user(env, target)
  }
  with op_table.bridge_overrides(overrides, is_jax_function=True), models.attention_routes(attn.flex):
    yield



class Attention:
  """One resolved kernel choice: `mode` on this mesh's platform, with its settings.

  `context_parallel` picks how K/V cross a `cp` split (`context.STRATEGIES`);
  `splits` collects, per trace, how each call ran across it (the compile report's).
  """

  def __init__(self, mode, *, mesh=None, data_axes=(), block_sizes=None, context_parallel="auto"):
    if mode not in MODES:
      raise TorchOnTpuError(
        f"attention={mode!r} is not a kernel; use one of {', '.join(map(repr, MODES))} or None."
      )
    if context_parallel not in context.STRATEGIES:
      raise TorchOnTpuError(
        f"context_parallel={context_parallel!r} is not a strategy; use one of "
        f"{', '.join(map(repr, context.STRATEGIES))}."
      )
    self.context_parallel = context_parallel
    self.splits: set[str] = set()
    self.mesh = mesh
    self.data_axes = tuple(a for a in (data_axes or ()) if mesh is not None and mesh.shape[a] > 1)
    self.block_sizes = splash.check_block_sizes(block_sizes)
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    platform = device.platform
    if platform == "gpu" and "rocm" in getattr(device.client, "platform_version", "").lower():
      platform = "rocm"
    self.platform = platform
    self.xla_block = xla_flash.default_block(platform)
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

  def flex(self, q, k, v, *, segment_ids, scale, enable_gqa, causal=True, window=None, sinks=None):
    """A family's masked attention (torchtitan's flex, varlen; HF's SDPA) on torch tensors (B, N, L, H): causal
    or not, within documents (`segment_ids` (B, L), or a (queries', keys') pair), a sliding `window`, per-head `sinks`."""
    if segment_ids is None or isinstance(segment_ids, tuple):
      seg = None if segment_ids is None else tuple(jax_view(s) for s in segment_ids)
    else:
      seg = (jax_view(segment_ids),) * 2
    out = self(
      jax_view(q),
      jax_view(k),
      jax_view(v),
      causal=causal,
      window=window,
      sinks=None if sinks is None else jax_view(sinks),
      segment_ids=seg,
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
    window=None,
    sinks=None,
    segment_ids=None,
    scale=None,
    dropout_rate=0.0,
    dropout_key=None,
    enable_gqa=False,
  ):
    """Attention on jax arrays laid out like torch's: q (..., Hq, L, D), k/v (..., Hkv, S, D).

    `mask` is bool (True = attend) or additive, broadcastable to (..., Hq, L, S);
    `segment_ids` is a (q_ids (B, L), kv_ids (B, S)) pair: only equal ids attend;
    `window` W: a query at row r sees keys at r - W < col (torchtitan's sliding
    window; with `causal`, col <= r too); `sinks` (Hq,): per-head logits that join
    each row's softmax with no value (gpt-oss).
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

    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
      raise TorchOnTpuError(f"attention window must be a positive int (keys a query sees), got {window!r}.")
    if sinks is not None:
      sinks = jnp.asarray(sinks)
      if sinks.shape != (hq,):
        raise TorchOnTpuError(
          f"attention sinks must hold one logit per query head, shape ({hq},); got {sinks.shape}."
        )

    split = self._split_for(q, k, mask, causal, dropout_rate, sinks)
    kind = self._kind_for(q, k, v, mask, causal, window, segment_ids, dropout_rate, sinks, split)
    settings = dict(kind=kind, causal=causal, window=window, scale=scale, dropout_rate=float(dropout_rate))
    out = checkpoint_name(
      self._sharded(q, k, v, mask, segment_ids, sinks, seed, split, settings), remat_lib.ATTENTION_NAME
    )
    out = out.reshape(*lead, hq, length, v.shape[-1])
    return out.reshape(out.shape[len(out.shape) - out_ndim :]) if out_ndim < out.ndim else out

  def _split_for(self, q, k, mask, causal, dropout_rate, sinks) -> context.Split | None:
    """How this call crosses the `cp` axis, or None where the mesh has none or the call
    cannot be split (then it runs whole on each cp device, said once)."""
    ways = mesh_lib.sequence_ways(self.mesh) if self.mesh is not None else 1
    if ways == 1:
      return None
    length, kv_len = q.shape[2], k.shape[2]
    pieces = 2 * ways if causal else ways
    if length != kv_len or length % pieces:
      _say_once(
        logging.WARNING,
        f"attention: query length {length} / key length {kv_len} does not split into {pieces} equal "
        f"pieces over {mesh_lib.SEQUENCE_AXIS}={ways}; such calls run whole on every "
        f"{mesh_lib.SEQUENCE_AXIS} device (same result, no saving).",
      )
      return None
    strategy, why = context.choose(
      self.context_parallel, heads=q.shape[1], kv_heads=k.shape[1], ways=ways,
      plain=mask is None and dropout_rate == 0 and sinks is None, kernel=self.kind,
    )
    split = context.Split(mesh_lib.SEQUENCE_AXIS, ways, strategy, balanced=bool(causal))
    self.splits.add(split.describe())
    _say_once(logging.INFO, f"attention across {split.describe()} ({why})")
    return split

  def _kind_for(self, q, k, v, mask, causal, window, segment_ids, dropout_rate, sinks, split=None) -> str:
    """The configured kernel, or "xla" (said once) where it cannot express the call."""
    if self.kind == "xla":
      return "xla"
    reason = None
    length, kv_len = q.shape[2], k.shape[2]
    if split is not None and (self.kind != "splash" or split.strategy == "ring"):
      reason = f"context parallelism's {'ring' if split.strategy == 'ring' else 'offset masks'}"
    elif dropout_rate > 0:
      reason = "dropout"
    elif mask is not None:
      reason = "an explicit attn_mask"
    elif self.kind == "splash" and length != kv_len:
      reason = f"query length {length} != key length {kv_len}"
    elif split is not None and not splash.tiles_whole(_query_block(length, split), self.block_sizes):
      reason = f"context-parallel query blocks of {_query_block(length, split)} rows (not whole splash tiles)"
    elif self.kind == "cudnn":
      if sinks is not None:
        reason = "attention sinks"
      elif window is not None and not causal:
        reason = "a sliding window without a causal mask"
      elif segment_ids is not None:
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

  def _local(
    self, q, k, v, mask, segment_ids, sinks, seed, offsets, *, kind, causal, window, scale, dropout_rate
  ):
    """One shard's attention, (B, H, L, D) in and out."""
    if kind == "splash":
      return splash.splash_attention(
        q, k, v, segment_ids, sinks, causal=causal, window=window, scale=scale,
        block_sizes=self.block_sizes, interpret=not self.accelerated,
      )
    if kind == "cudnn":
      out = jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3),
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        scale=scale,
        is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn" if self.accelerated else "xla",
      )
      return out.transpose(0, 2, 1, 3)
    return xla_flash.xla_attention(
      q, k, v, mask=mask, segment_ids=segment_ids, causal=causal, window=window, sinks=sinks, scale=scale,
      dropout_rate=dropout_rate, dropout_seed=seed, offsets=offsets, **self._xla_blocks(),
    )

  def _block(self, q, k, v, mask, q_seg, kv_seg, q_offset, kv_offset, *, causal, window, scale, sinks=None,
             seed=None, offsets=None, dropout_rate=0.0):
    """One block of a sequence split over `cp`: (out, lse) on global positions."""
    return xla_flash.xla_attention(
      q, k, v, mask=mask, segment_ids=None if q_seg is None else (q_seg, kv_seg), causal=causal,
      window=window, sinks=sinks, scale=scale, dropout_rate=dropout_rate, dropout_seed=seed, offsets=offsets,
      q_offset=q_offset, kv_offset=kv_offset, return_lse=True, **self._xla_blocks(),
    )

  def _block_backward(self, q, k, v, mask, q_seg, kv_seg, q_offset, kv_offset, out, lse, dout, *, causal,
                      window, scale):
    """One block's (dq, dk, dv) from the whole attention's output and log-sum-exp (the ring's)."""
    return xla_flash.xla_attention_backward(
      q, k, v, out, lse, dout, mask=mask, segment_ids=None if q_seg is None else (q_seg, kv_seg),
      causal=causal, window=window, scale=scale, q_offset=q_offset, kv_offset=kv_offset, **self._xla_blocks(),
    )

  def _splash_block(self, q, k, v, q_seg, kv_seg, *, q_offset: int, causal, window, scale, sinks=None):
    """Splash for one block of a sequence split over `cp`, at a static query offset."""
    return splash.splash_attention(
      q, k, v, None if q_seg is None else (q_seg, kv_seg), sinks, causal=causal, window=window, scale=scale,
      block_sizes=self.block_sizes, interpret=not self.accelerated, q_offset=q_offset,
    )

  def _xla_blocks(self) -> dict:
    return dict(
      block_q=self.block_sizes.get("block_q", self.xla_block),
      block_kv=self.block_sizes.get("block_kv", self.xla_block),
    )

  def specs(self, q_shape, k_shape, split) -> tuple:
    """(batch axes, head axis, sequence axis) of attention's `shard_map` on this mesh: the
    batch over the data axes and heads over `tp` where they divide, the sequence over `cp`
    when the call is `split`; None where a dim stays whole."""
    mesh, data = self.mesh, self.data_axes
    batch, hq = q_shape[:2]
    hkv = k_shape[1]
    b_axes = mesh_lib.batch_spec(data, 1)[0] if batch % mesh_lib.batch_ways(mesh, data) == 0 else None
    tp = mesh.shape.get("tp", 1)
    h_axis = "tp" if tp > 1 and hq % tp == 0 and hkv % tp == 0 else None
    return b_axes, h_axis, split.axis if split is not None else None

  def _sharded(self, q, k, v, mask, segment_ids, sinks, seed, split, settings):
    """Runs the kernel per shard: batch over the data axes, heads over `tp`, where they
    divide; the sequence over `cp` (`context.attend`) when the call is `split`."""
    mesh = self.mesh
    if mesh is None or mesh.size == 1:
      return self._local(q, k, v, mask, segment_ids, sinks, seed, None, **settings)
    b_axes, h_axis, s_axis = self.specs(q.shape, k.shape, split)
    if b_axes is None and h_axis is None and s_axis is None and settings["kind"] != "splash":
      # nothing to split; a Mosaic kernel still runs per device (the partitioner cannot split it)
      return self._local(q, k, v, mask, segment_ids, sinks, seed, None, **settings)
    qkv_spec = P(b_axes, h_axis, s_axis, None)
    args, specs = [q, k, v], [qkv_spec] * 3
    if mask is not None:
      args.append(mask)
      specs.append(
        P(
          b_axes if mask.shape[0] > 1 else None,
          h_axis if mask.shape[1] > 1 else None,
          s_axis if mask.shape[2] > 1 else None,  # this device's rows, every column
          None,
        )
      )
    if segment_ids is not None:
      args.extend(segment_ids)
      specs.extend([P(b_axes, s_axis)] * 2)
    if sinks is not None:
      args.append(sinks)
      specs.append(P(h_axis))
    if seed is not None:
      args.append(seed)
      specs.append(P(None))

    def body(q, k, v, *rest):
      rest = iter(rest)
      m = next(rest) if mask is not None else None
      seg = (next(rest), next(rest)) if segment_ids is not None else None
      sk = next(rest) if sinks is not None else None
      s = next(rest) if seed is not None else None
      b_off = lax.axis_index(b_axes) * q.shape[0] if b_axes is not None else 0
      h_off = lax.axis_index(h_axis) * q.shape[1] if h_axis is not None else 0
      if split is None:
        return self._local(q, k, v, m, seg, sk, s, (b_off, h_off), **settings)
      shape = dict(causal=settings["causal"], window=settings["window"], scale=settings["scale"])
      kernel = functools.partial(
        self._block, **shape, sinks=sk, seed=s, dropout_rate=settings["dropout_rate"],
        offsets=(b_off, h_off) if s is not None else None,
      )
      backward = functools.partial(self._block_backward, **shape)
      fixed = functools.partial(self._splash_block, **shape, sinks=sk) if settings["kind"] == "splash" else None
      q_seg, kv_seg = seg if seg is not None else (None, None)
      return context.attend(kernel, backward, split, q, k, v, m, q_seg, kv_seg, fixed=fixed)

    return device_checks.shard_map(
      body, mesh=mesh, in_specs=tuple(specs), out_specs=qkv_spec, check_vma=False
    )(*args)


def _query_block(length: int, split) -> int:
  """The query rows one kernel call takes under `split`: a zig-zag chunk or a device's piece."""
  return length // split.ways // (2 if split.balanced else 1)


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

