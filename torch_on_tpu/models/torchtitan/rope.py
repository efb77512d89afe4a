"""torchtitan's complex RoPE with the same numbers and no complex tensors.

torchtitan's `ComplexRoPE.apply_rotary_emb` views each query and key as [..., head_dim/2, 2]
fp32 pairs, multiplies them as complex numbers by the cache and views the product back. Traced
for the TPU that trailing pair dim becomes relayout copies and complex buffers: about 0.68 GB of
HBM traffic for one [8192, 32, 128] query's forward and backward where reading and writing it
once each way is 0.27. Here the rotation is written over the flat head dim: each pair's swap
(x[2i+1], x[2i]) is a matmul by a ±1 permutation (exact in the input's own dtype: one nonzero
term per output, full precision for fp32 inputs), then `x·cos + swap·sin` in fp32, rounded to the
input's dtype as torchtitan's `type_as` rounds it (0.34 GB, the same values: a·c − b·s and
a·s + b·c per pair, as torch's complex product)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.models.torchtitan import swapped

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


def pairs_rotated():
  """While active, torchtitan's `ComplexRoPE` rotates with `rotate` (the same values)."""

  def make(original):
    def apply_rotary_emb(query, key, rope_cache):
      if not swapped.traced(query):  # eager torch (a reference, an export check): torchtitan's own
        return original.__func__(query, key, rope_cache)
      cache = jax_view(rope_cache) if swapped.traced(rope_cache) else jnp.asarray(rope_cache.detach().cpu().numpy())
      cos, sin = jnp.real(cache), jnp.imag(cache)
      return torch_view(rotate(jax_view(query), cos, sin)), torch_view(rotate(jax_view(key), cos, sin))

    return staticmethod(apply_rotary_emb)

  return swapped.method("torchtitan.models.common.rope", "ComplexRoPE", "apply_rotary_emb", make)


def rotate(x, cos, sin):
  """`_rotate`, its output a matmul's to the remat policies (`remat.MATMUL_NAME`): a policy that
  keeps matmul outputs (`dots_and_attention`, the scan's default) keeps the rotated query and key
  in their own dtype. Untagged, it kept the pair swap's fp32 product instead and redid the rotation
  from it (a policy sees through a nested `jax.checkpoint`): twice the bytes per layer."""
  return checkpoint_name(_rotate(x, cos, sin), remat_lib.MATMUL_NAME)


def _rotate(x, cos, sin):
  """x [..., D] with its adjacent pairs (x[2i], x[2i+1]) rotated by angle i: (a·c − b·s, a·s + b·c)
  in fp32 with c, s = `cos`, `sin` [..., D/2] (broadcast against x's leading dims), in x's dtype."""
  dim = x.shape[-1]
  swap = np.zeros((dim, dim), np.float32)
  swap[np.arange(1, dim, 2), np.arange(0, dim, 2)] = -1.0  # out[2i] = -x[2i+1]
  swap[np.arange(0, dim, 2), np.arange(1, dim, 2)] = 1.0  # out[2i+1] = x[2i]
  # a signed permutation: exact in x's own dtype, so the product stays in it (an fp32 product was
  # fused with the sum below, which then read an fp32, relaid copy of x: Llama 3 1B at 2048 tokens
  # on v5p-8, 1.5 GB of the step's HBM traffic)
  swapped = jnp.einsum(
    "...d,de->...e", x, jnp.asarray(swap, x.dtype), preferred_element_type=x.dtype, precision=jax.lax.Precision.HIGHEST
  )
  cos, sin = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
  return (x.astype(jnp.float32) * cos + swapped.astype(jnp.float32) * sin).astype(x.dtype)
