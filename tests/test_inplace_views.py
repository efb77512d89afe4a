"""In-place ops on a slice of a tensor write into that tensor, as in torch: torchax lowers
many in-place ops through decompositions that ran on a copy of the slice, so
`x[a:b].masked_fill_(m, v)` (GraniteSpeech's conformer attention) left `x` unchanged."""

import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h

OPS = {
  "masked_fill_": lambda v: v.masked_fill_(torch.arange(v.shape[-1]) % 2 == 0, -5.0),
  "zero_": lambda v: v.zero_(),
  "addcmul_": lambda v: v.addcmul_(v, v, value=0.5),
  "addcdiv_": lambda v: v.addcdiv_(v, v + 3, value=0.5),
  "index_fill_": lambda v: v.index_fill_(-1, torch.tensor([0, 2]), 9.0),
  "index_add_": lambda v: v.index_add_(-1, torch.tensor([0, 2]), torch.ones(*v.shape[:-1], 2)),
  "lerp_": lambda v: v.lerp_(torch.zeros_like(v), 0.25),
  "clamp_": lambda v: v.clamp_(-0.1, 0.1),
  "exp_": lambda v: v.exp_(),
  "gelu_ (F.gelu inplace)": lambda v: torch.nn.functional.silu(v, inplace=True),
  "tril_": lambda v: v.tril_(),
  "masked_scatter_": lambda v: v.masked_scatter_(v > 0, torch.full_like(v, 7.0)),
  "nan_to_num_": lambda v: v.div_(0.0).nan_to_num_(posinf=1.0, neginf=-1.0),
}
VIEWS = {
  "x[1:3]": lambda x: x[1:3],
  "x[0:8:4]": lambda x: x[0:8:4],
  "x[2]": lambda x: x[2],
  "x[:, 1:]": lambda x: x[:, 1:],
}


class Writes(torch.nn.Module):
  def __init__(self, op, view):
    super().__init__()
    self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
    self.op, self.view = op, view

  def forward(self, x):
    x = x * self.scale
    self.op(self.view(x))
    return x


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_inplace_ops_on_a_slice_write_into_the_tensor(view):
  x = torch.randn(8, 3, 3, generator=torch.Generator().manual_seed(0))
  wrong = {}
  for name, op in OPS.items():
    with torch.no_grad():
      theirs = Writes(op, VIEWS[view])(x)
    ours = tot.to_cpu(tot.ShardedModule(Writes(op, VIEWS[view]), mesh=tot.make_mesh(fsdp=8))(x))
    if not h.rel(ours, theirs) < 1e-6:
      wrong[name] = h.rel(ours, theirs)
  assert not wrong, wrong
