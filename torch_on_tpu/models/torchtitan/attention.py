"""torchtitan's FlexAttention and VarlenAttention routed to the bridge's attention kernels while a
ShardedModule runs: the masks they were given (`masks`), their windows, and gpt-oss's attention sinks
(its `out_transform`); what the kernels cannot express is refused in one sentence."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.torchtitan.masks import FlexMasks, VarlenMasks

logger = logging.getLogger(__name__)

def _sinks_of(out_transform):
  """The per-head sink logits an `out_transform` applies (gpt-oss's), or a refusal."""
  if out_transform is None:
    return None
  from torchtitan.models.gpt_oss.model import Attention as GptOssAttention

  if getattr(out_transform, "__func__", None) is GptOssAttention._apply_sinks:
    # out * sigmoid(lse - sink): the sink is one more logit in each row's softmax, with no value.
    return out_transform.__self__.sinks
  name = getattr(out_transform, "__qualname__", type(out_transform).__name__)
  raise TorchOnTpuError(
    f"torchtitan attention got out_transform '{name}' over the log-sum-exp, which the bridge's attention "
    f"kernels express only as gpt-oss's attention sinks; use a config without it."
  )


@functools.cache
def _say_varlen_lse_gradient() -> None:
  """Once per process, where the bridge's gradient differs from torchtitan's on CUDA on purpose
  (a warning: recipes show no info lines, and a user comparing runs needs to know)."""
  logger.warning(
    "torchtitan's varlen attention with an out_transform (gpt-oss's sinks): the bridge differentiates "
    "the log-sum-exp it rescales by, as torchtitan's flex backend does; torch's varlen_attn backward "
    "on CUDA drops that gradient, so trained attention weights differ from a torchtitan GPU run on "
    "varlen (docs/torchtitan.md, 'Against torchtitan on a GPU')."
  )


@contextlib.contextmanager
def varlen_routed_to(attend):
  """While active, torchtitan's VarlenAttention runs `attend` on a `VarlenMasks` or `FlexMasks` (documents):
  its own `window_size` (left, right) as causal/window, its bf16 inputs as it casts them,
  an out_transform as `_sinks_of` reads it."""
  from torchtitan.models.common.attention import VarlenAttention

  original = VarlenAttention.__dict__["forward"]

  def routed(self, q, k, v, *, attention_masks, scale=None, out_transform=None, **kwargs):
    if not isinstance(attention_masks, (FlexMasks, VarlenMasks)):
      raise TorchOnTpuError(
        f"torchtitan VarlenAttention got attention_masks of type {type(attention_masks).__name__}; pass "
        f"attention_masks=torch_on_tpu.models.torchtitan.attention_masks(model, positions) instead."
      )
    left, right = self.window_size
    if right not in (0, -1) or (right == -1 and left != -1):
      raise TorchOnTpuError(
        f"torchtitan VarlenAttention has window_size {self.window_size}; the bridge's kernels take "
        f"(-1, 0) causal, (W - 1, 0) a causal sliding window, or (-1, -1) full attention."
      )
    if out_transform is not None:
      _say_varlen_lse_gradient()
    window = attention_masks.window if left < 0 else left + 1
    if attention_masks.window is not None and left >= 0:
      window = min(window, attention_masks.window)
    # varlen_attn takes bf16 only: torchtitan casts q, k, v, and the output back.
    q16, k16, v16 = (t.to(torch.bfloat16).transpose(1, 2) for t in (q, k, v))
    out = attend(
      q16, k16, v16, segment_ids=attention_masks.segment_ids, causal=right == 0 and attention_masks.causal,
      window=window, sinks=_sinks_of(out_transform), scale=scale, enable_gqa=kwargs.get("enable_gqa", False),
    )
    return out.transpose(1, 2).to(q.dtype)

  VarlenAttention.forward = routed
  try:
    yield
  finally:
    VarlenAttention.forward = original


@contextlib.contextmanager
def flex_routed_to(attend):
  """While active, torchtitan's FlexAttention runs `attend(q, k, v, segment_ids=, causal=,
  window=, sinks=, scale=, enable_gqa=)` (q, k, v as (B, N, L, H)) instead of its
  `torch.compile`d flex_attention, for a `FlexMasks` mask."""
  from torchtitan.models.common.attention import FlexAttention

  original = FlexAttention.__dict__["forward"]

  def routed(self, q, k, v, *, attention_masks, score_mod=None, scale=None, enable_gqa=False,
             out_transform=None, **kwargs):
    if score_mod is not None:
      raise TorchOnTpuError(
        "torchtitan FlexAttention got a score_mod, which the bridge's attention kernels do "
        "not express; use a model config without score_mod or attention=None."
      )
    if not isinstance(attention_masks, FlexMasks):
      raise TorchOnTpuError(
        f"torchtitan FlexAttention got attention_masks of type {type(attention_masks).__name__}; pass "
        f"attention_masks=torch_on_tpu.models.torchtitan.attention_masks(model, positions) instead."
      )
    out = attend(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
      segment_ids=attention_masks.segment_ids, causal=attention_masks.causal, window=attention_masks.window,
      sinks=_sinks_of(out_transform), scale=scale, enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2)

  FlexAttention.forward = routed
  try:
    yield
  finally:
    FlexAttention.forward = original
