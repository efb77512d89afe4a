"""torch.nn's own modules, unmodified, on fsdp=8: outputs and gradients as torch eager's.

Their parameters are split over the mesh by an explicit map (the "fsdp" preset
leaves tensors this small replicated), so the gradients go through the same
sharded reductions as a large model's.
"""

import copy

import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h


class First(torch.nn.Module):
  """The first output of a module that returns a tuple (`LSTM`, `MultiheadAttention`)."""

  def __init__(self, module, self_attention=False):
    super().__init__()
    self.module = module
    self.self_attention = self_attention

  def forward(self, x):
    return self.module(x, x, x)[0] if self.self_attention else self.module(x)[0]


def _conv_norm():
  return torch.nn.Sequential(torch.nn.Conv1d(16, 32, 3, padding=1), torch.nn.GroupNorm(4, 32), torch.nn.GELU())


MODULES = {
  "LSTM": (lambda: First(torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)), (8, 10, 16)),
  "GRU": (lambda: First(torch.nn.GRU(16, 32, batch_first=True, bidirectional=True)), (8, 10, 16)),
  "MultiheadAttention": (lambda: First(torch.nn.MultiheadAttention(32, 4, batch_first=True), True), (8, 10, 32)),
  "Conv1d + GroupNorm": (_conv_norm, (8, 16, 12)),
}


def _split_map(module):
  """Dim 0 of every parameter it divides over 8 devices, the rest replicated."""
  return {n: ("fsdp",) + (None,) * (p.ndim - 1) if p.shape[0] % 8 == 0 else (None,) * p.ndim for n, p in module.named_parameters()}


@pytest.mark.parametrize("name", MODULES)
def test_torch_nn_module_matches_eager(name):
  make, shape = MODULES[name]
  torch.manual_seed(0)
  ref = make()
  x = torch.randn(*shape)
  want = ref(x)
  weights = torch.randn(want.shape)
  (want * weights).sum().backward()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), sharding=_split_map(ref))
  assert h.rel(tot.to_cpu(jm(x)).detach(), want.detach()) < 1e-5
  step = tot.make_train_step(jm, lambda out, w: (out * w).sum(), optax.sgd(1.0))
  _, grads = step.gradients(x, weights)
  for n, p in ref.named_parameters():
    assert h.rel(np.asarray(grads[n]), p.grad) < 1e-4, n
