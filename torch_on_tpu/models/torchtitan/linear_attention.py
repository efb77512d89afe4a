"""Qwen3.5's linear attention (Gated DeltaNet) in jax: flash-linear-attention's Triton kernels run only
on CUDA torch tensors, so while a ShardedModule runs, torchtitan's document-resetting causal conv and
gated delta rule run these instead."""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu.core import _compat

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


@contextlib.contextmanager
def routed():
  """While active, torchtitan's Gated DeltaNet (Qwen3.5) runs its document-resetting causal
  conv and its gated delta rule as the bridge's (`_causal_conv_by_document`,
  `_gated_delta_rule`) instead of flash-linear-attention's Triton kernels, which run
  only on CUDA torch tensors."""
  qwen3_5 = sys.modules.get("torchtitan.models.qwen3_5.model")
  if qwen3_5 is None:
    yield
    return
  conv, kernel = qwen3_5._causal_conv1d_varlen, qwen3_5.GatedDeltaKernel.forward

  def routed_kernel(self, q, k, v, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None):
    if q.shape[2] != v.shape[2]:  # value heads share key heads, as torchtitan's forward expands them
      q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    documents = None if cu_seqlens is None else jax_view(cu_seqlens)
    return torch_view(_gated_delta_rule(*(jax_view(t) for t in (q, k, v, g, beta)), documents))

  qwen3_5._causal_conv1d_varlen = lambda x, weight, ids, _host: _causal_conv_by_document(x, weight, ids)
  qwen3_5.GatedDeltaKernel.forward = routed_kernel
  try:
    yield
  finally:
    qwen3_5._causal_conv1d_varlen, qwen3_5.GatedDeltaKernel.forward = conv, kernel


def _causal_conv_by_document(x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
  """flash-linear-attention's varlen `causal_conv1d` (depthwise, SiLU, restarted at each
  document): x (1, B·L, D), the B rows torchtitan folded, weight (D, 1, K), documents (B, L).
  Every row starts a document, so each row is shifted on its own (no token crosses a row,
  and so none crosses the devices the rows are split over)."""
  rows, length = documents.shape
  taps = weight.shape[-1]
  w = weight.reshape(weight.shape[0], taps)
  x = x.reshape(rows, length, x.shape[-1])
  out = torch.zeros_like(x)
  for back in range(taps):  # tap `back` reads the token `back` steps earlier, in the same document
    earlier = torch.nn.functional.pad(x, (0, 0, back, 0))[:, :length]
    same = documents == torch.nn.functional.pad(documents, (back, 0), value=-1)[:, :length]
    out = out + earlier * same[..., None].to(x.dtype) * w[:, taps - 1 - back]
  return torch.nn.functional.silu(out).reshape(1, rows * length, -1)


def _gated_delta_rule(q, k, v, g, beta, documents=None):
  """flash-linear-attention's `chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`
  as a sequential scan (jax arrays; q, k (1, T, H, K), v (1, T, H, V), g, beta (1, T, H)):
  per head, the state S (K, V) decays by exp(g), is corrected toward v along k by beta,
  and is read by q scaled by K^-1/2. S restarts at each document of `documents` (B, L),
  the ids of the B rows torchtitan folded into T = B·L tokens, and so at every row's
  start: the rows are unfolded and scanned side by side (L steps, each row's state on
  the devices that hold its row), not one after another. Without `documents` the T
  tokens are one stream, as flash-linear-attention runs them without `cu_seqlens`.
  fp32 inside, output in q's dtype (as flash-linear-attention's)."""
  out_dtype = q.dtype  # flash-linear-attention's: `o.to(q.dtype)`
  rows, length = (1, q.shape[1]) if documents is None else documents.shape
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  l2 = lambda x: (f32(x) / jnp.sqrt(jnp.sum(f32(x) ** 2, -1, keepdims=True) + 1e-6)).astype(x.dtype)  # noqa: E731
  # (1, B·L, ...) → (L, B, ...): the scan's steps lead, the rows ride along.
  by_step = lambda x: f32(x).reshape(rows, length, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
  scale = q.shape[-1] ** -0.5
  q, k = by_step(l2(q)) * scale, by_step(l2(k))
  v, g, beta = by_step(v), by_step(g), by_step(beta)
  starts = jnp.zeros((length, rows), bool).at[0].set(True)
  if documents is not None:
    starts = starts.at[1:].set((documents[:, 1:] != documents[:, :-1]).T)

  def step(state, xs):
    q_t, k_t, v_t, g_t, beta_t, start = xs
    state = jnp.where(start[:, None, None, None], 0.0, state) * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)) * beta_t[..., None]
    state = state + k_t[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

  init = jnp.zeros((rows, q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
  _, out = jax.lax.scan(step, init, (q, k, v, g, beta, starts))
  return out.swapaxes(0, 1).reshape(1, rows * length, *out.shape[2:]).astype(out_dtype)
