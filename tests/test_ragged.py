"""The grouped matmul's TPU form (jax's megablox kernels, `lowering/ragged.py`) run in Pallas's
interpreter on the CPU, against torch's `_grouped_mm`: values and both gradients in fp32 and bf16,
with empty groups, rows past the last group and row counts no multiple of the row tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import helpers as h
from torch_on_tpu.lowering import ragged

# (group sizes, rows, K, N)
CASES = {
  "one-tile": ([0, 3, 0, 7, 11, 0], 24, 16, 8),  # empty first and last groups, 3 rows past them: one tile of 32
  "tiles": ([40, 0, 0, 100, 1, 25, 130, 0], 300, 64, 32),  # 3 tiles of 128 rows, groups across their edges, 4 rows past
}


def _ours(a, b, sizes, dtype):
  """As `_grouped_mm` calls it: an fp32 product rounded once to the operands' dtype."""
  return ragged.ragged_matmul(a, b, sizes, preferred_element_type=jnp.float32, interpret=True).astype(dtype)


def _against_torch(sizes, rows, k, n, dtype):
  """(ours, torch's) values, input and weight gradients on the rows that are in a group; ours
  on the rows past them, where `a` holds NaN, and whose cotangents are large."""
  g = torch.Generator().manual_seed(0)
  a, b = torch.randn(rows, k, generator=g).to(dtype), torch.randn(len(sizes), k, n, generator=g).to(dtype)
  w = torch.randn(rows, n, generator=g).to(dtype)
  end = sum(sizes)
  a[end:] = float("nan")  # a worst-case-sized buffer's unused rows: they must reach nothing
  w[end:] = 1e4
  offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
  a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
  want = torch._grouped_mm(a_, b_, offs=offs)
  want[:end].backward(w[:end])

  jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
  to_jax = lambda x: jnp.asarray(x.float().numpy()).astype(jdtype)  # noqa: E731
  out, vjp = jax.vjp(lambda a, b: _ours(a, b, jnp.asarray(sizes, jnp.int32), jdtype), to_jax(a), to_jax(b))
  da, db = vjp(to_jax(w))
  ours = [np.asarray(x, np.float32) for x in (out, da, db)]
  theirs = [x.detach().float().numpy() for x in (want, a_.grad, b_.grad)]
  return ours, theirs, end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_megablox_matches_torch_grouped_mm_values_and_gradients(case, dtype):
  """‖Δ‖/‖torch‖ within 1e-6 in fp32 (measured ≤ 1.2e-7) and 1e-4 in bf16: both round the fp32
  sums once to bf16, so they agree but where a sum added in another order rounds to the
  neighbouring bf16 (measured 0, 3e-7 on the input gradient). Rows past the last group: exact
  zeros, and zero input gradients, though `a` is NaN there."""
  ours, theirs, end = _against_torch(*CASES[case], dtype)
  tol = 1e-6 if dtype == torch.float32 else 1e-4
  for mine, ref in zip(ours[:2], theirs[:2]):
    assert h.rel(mine[:end], ref[:end]) < tol
    assert not mine[end:].any(), mine[end:]  # zeros, not NaN
  assert h.rel(ours[2], theirs[2]) < tol and np.isfinite(ours[2]).all()


def test_partial_tiles_along_both_matrix_dims_are_masked(monkeypatch):
  """Dims no multiple of their tile (K = 200 and N = 300 in tiles of 128, as a gpt-oss width
  of 2,880 takes tiles of 512): megablox masks the contracting remainder and drops the output's."""
  monkeypatch.setattr(ragged, "tiling", lambda *shape: ((128, 128, 128),) * 3)
  ours, theirs, end = _against_torch([50, 0, 70, 60], 190, 200, 300, torch.float32)
  for mine, ref in zip(ours, theirs):
    assert h.rel(mine[:end], ref[:end]) < 1e-6
  assert not ours[0][end:].any() and not ours[1][end:].any()


def test_tiles_fit_vmem_and_keep_each_weight_in_it_across_its_rows():
  """The tiles for MoE shapes (bf16 operands, fp32 product): the product's and the input
  gradient's contracting dim whole where it fits 14 MiB (each weight read once), rows in tiles
  of 128 (256 where groups average 512 rows or more), a tiny dim as one tile."""
  bf16 = dict(in_bytes=2, out_bytes=4, grad_bytes=(2, 2))
  qwen3 = ragged.tiling(32768, 2048, 768, 128, **bf16)  # Qwen3-30B-A3B's gate/up, 128 experts
  assert qwen3 == ((128, 2048, 768), (128, 768, 2048), (128, 2048, 768))
  deepseek = ragged.tiling(32768, 7168, 2048, 256, **bf16)  # DeepSeek-V3: dim 7,168, 2,048 per expert
  assert deepseek == ((128, 7168, 256), (128, 2048, 1024), (128, 1024, 1024))
  gpt_oss = ragged.tiling(16384, 2880, 5760, 32, **bf16)  # 2,880 = 22.5 × 128: a partial last tile
  assert gpt_oss == ((256, 2880, 512), (256, 5760, 256), (256, 1024, 1024))
  assert ragged.tiling(24, 64, 32, 4, **bf16) == ((32, 64, 32), (32, 32, 64), (32, 64, 32))


def test_operands_megablox_does_not_take_go_to_ragged_dot():
  a, b = jnp.zeros((32, 16), jnp.float8_e4m3fn), jnp.zeros((4, 16, 8), jnp.float8_e4m3fn)
  traced = jax.make_jaxpr(lambda a, b: ragged.ragged_matmul(a, b, jnp.full((4,), 8), preferred_element_type=jnp.float32,
                                                            interpret=True))(a, b)
  assert "ragged_dot" in str(traced) and "pallas_call" not in str(traced)
