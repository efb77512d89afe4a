"""Our ATen lowerings: PyTorch eager's results, with gradients XLA runs well."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_on_tpu as tot
from torch_on_tpu import _compat

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


@pytest.mark.parametrize(
  "shape,sizes,dim", [((6, 20), [4, 10, 6], -1), ((6, 20), 7, 1), ((9, 4), 3, 0), ((2, 3, 8), [8], 2)]
)
def test_split_matches_torch_and_its_gradient_is_one_concatenate(shape, sizes, dim):
  x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))

  def loss(t):  # each piece weighted differently, so a misplaced gradient shows
    return sum((i + 1) * (piece**2).sum() for i, piece in enumerate(torch.split(t, sizes, dim)))

  leaf = x.clone().requires_grad_()
  expected = loss(leaf)
  expected.backward()
  env = torchax.default_env()

  def loss_jax(a):
    with env:
      return jax_view(loss(torch_view(a)))

  a = jnp.asarray(x.numpy())
  value, grad = jax.value_and_grad(loss_jax)(a)
  assert abs(float(value) - expected.item()) <= 1e-6 * abs(expected.item())
  np.testing.assert_allclose(np.asarray(grad), leaf.grad.numpy(), rtol=1e-6)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss_jax))(a))
  if len(torch.split(x, sizes, dim)) > 1:
    assert "concatenate" in jaxpr
  assert "pad[" not in jaxpr and "add_any" not in jaxpr


def test_split_sizes_that_miss_the_dimension_are_named():
  with torchax.default_env(), pytest.raises(tot.TorchOnTpuError, match=r"sum to 14, but dimension -1 has size 20"):
    torch.split(torch_view(jnp.ones((6, 20))), [4, 10], -1)
