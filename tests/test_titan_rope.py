"""torchtitan's complex RoPE as the bridge runs it (`models/torchtitan/rope.py`): the same values
and gradients as torchtitan's own in fp32 and bf16, and no complex tensors in the TPU program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import helpers as h
from torch_on_tpu.core import _compat
from torch_on_tpu.models.torchtitan import rope

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


def _inputs(dtype):
  from torchtitan.models.common.rope import ComplexRoPE

  g = torch.Generator().manual_seed(0)
  query = (torch.randn(2, 16, 4, 32, generator=g) * 3).to(dtype)
  key = (torch.randn(2, 16, 2, 32, generator=g) * 3).to(dtype)
  angles = torch.outer(torch.arange(16.0), 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32)))
  cache = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # torchtitan's (1, seq, 1, dim/2)
  return ComplexRoPE.apply_rotary_emb, query, key, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotation_matches_torchtitans_complex_product(dtype):
  """fp32: within 1e-6 (the same products and sums); bf16: the same bf16 values; the gradients
  (through jax) against torch autograd of torchtitan's own function."""
  original, query, key, cache = _inputs(dtype)
  query.requires_grad_(), key.requires_grad_()
  want_q, want_k = original(query, key, cache)
  weights_q, weights_k = torch.randn(want_q.shape), torch.randn(want_k.shape)
  ((want_q.float() * weights_q).sum() + (want_k.float() * weights_k).sum()).backward()

  cos, sin = (jnp.asarray(part.numpy()) for part in (cache.real, cache.imag))
  to_jax = lambda t: jnp.asarray(t.detach().float().numpy(), jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32)  # noqa: E731

  def loss(q, k):
    rq, rk = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
    return (rq.astype(jnp.float32) * weights_q.numpy()).sum() + (rk.astype(jnp.float32) * weights_k.numpy()).sum(), (rq, rk)

  (_, (got_q, got_k)), (grad_q, grad_k) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(to_jax(query), to_jax(key))
  f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
  tolerance = 1e-6 if dtype == torch.float32 else 0.0
  for got, want in ((got_q, want_q), (got_k, want_k)):
    assert got.dtype == (jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32)
    assert h.rel(f32(got), want.detach().float()) <= tolerance
  for got, want in ((grad_q, query.grad), (grad_k, key.grad)):
    assert h.rel(f32(got), want.float()) <= (1e-6 if dtype == torch.float32 else 2**-8)


def test_torchtitans_rope_is_rotated_without_complex_tensors_while_the_model_runs():
  original, query, key, cache = _inputs(torch.float32)
  env = torchax.default_env()
  with env, rope.pairs_rotated():
    from torchtitan.models.common.rope import ComplexRoPE

    q, k = ComplexRoPE.apply_rotary_emb(*(torch_view(jnp.asarray(t.numpy())) for t in (query, key, cache)))
    text = jax.jit(lambda a, b, c: [jax_view(x) for x in ComplexRoPE.apply_rotary_emb(torch_view(a), torch_view(b), torch_view(c))]).lower(
      *(jnp.asarray(t.numpy()) for t in (query, key, cache))).as_text()
  assert ComplexRoPE.apply_rotary_emb is original  # put back
  want_q, want_k = original(query, key, cache)
  assert h.rel(jax_view(q), want_q) <= 1e-6 and h.rel(jax_view(k), want_k) <= 1e-6
  assert _complex_ops(text) == set()  # the cache is read as its real and imaginary parts only
  unpatched = jax.jit(lambda a, b, c: [jax_view(x) for x in original(torch_view(a), torch_view(b), torch_view(c))])
  with env:
    assert _complex_ops(unpatched.lower(*(jnp.asarray(t.numpy()) for t in (query, key, cache))).as_text())  # torchtitan's own


def _complex_ops(text: str) -> set[str]:
  """The ops of a lowered program that compute on complex values (not the cache's real/imag reads)."""
  ops = set()
  for line in text.splitlines():
    if "complex<" in line and "func.func" not in line and "stablehlo.real" not in line and "stablehlo.imag" not in line:
      ops.add(line.split("=")[-1].strip().split(" ")[0])
  return ops
