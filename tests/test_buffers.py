"""Buffers behave as in PyTorch: what a forward writes into them (BatchNorm's running
statistics and `num_batches_tracked`) is kept by the train step and the forward.

Tolerance: running statistics and weights within 1e-6 relative (‖Δ‖/‖ref‖, fp32) of
eager torch after the same steps. Under jit the batch statistics are global over the
whole batch however it is sharded (torch's SyncBatchNorm; DDP's BatchNorm would use
each device's rows), so fsdp=8 matches eager torch on the full batch.
"""

import jax
import optax
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h

STEPS = 4
LR = 0.1


class SmallCNN(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    self.bn = torch.nn.BatchNorm2d(8)
    self.head = torch.nn.Linear(8, 4)

  def forward(self, x):
    return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def cnn():
  torch.manual_seed(0)
  return SmallCNN()


def images(step):
  g = torch.Generator().manual_seed(step)
  return torch.randn(16, 3, 6, 6, generator=g) * 2 + 1, torch.randint(0, 4, (16,), generator=g)


def ce(out, labels):
  return torch.nn.functional.cross_entropy(out, labels)


@pytest.mark.parametrize("devices", [1, 8])
def test_batchnorm_running_statistics_match_torch_after_training(devices):
  ref = cnn()
  opt = torch.optim.SGD(ref.parameters(), lr=LR)
  for i in range(STEPS):
    opt.zero_grad()
    ce(ref(images(i)[0]), images(i)[1]).backward()
    opt.step()

  mesh = tot.make_mesh(jax.devices()[:devices], fsdp=devices)
  jm = tot.ShardedModule(cnn(), mesh=mesh, sharding="replicated" if devices == 1 else "fsdp")
  step = tot.make_train_step(jm, ce, optax.sgd(LR))
  for i in range(STEPS):
    step(*images(i))
  state = jm.state_dict()
  for name in ("bn.running_mean", "bn.running_var", "conv.weight", "head.weight"):
    assert h.rel(state[name], ref.state_dict()[name]) < 1e-6, name
  assert state["bn.num_batches_tracked"].item() == STEPS
  assert jm.buffers["bn.running_mean"].sharding == jm.buffer_shardings["bn.running_mean"]
  # eval mode now normalises with the trained statistics, as torch does
  ref.eval()
  jm.module.eval()
  x = images(99)[0]
  assert h.rel(tot.to_cpu(jm(x)), ref(x).detach()) < 1e-5


def test_forward_in_train_mode_updates_buffers_and_grad_accum_carries_them():
  ref = cnn()
  jm = tot.ShardedModule(cnn(), mesh=tot.make_mesh(fsdp=8), sharding="fsdp")
  x = images(0)[0]
  jm(x), ref(x)
  assert h.rel(jm.state_dict()["bn.running_var"], ref.bn.running_var) < 1e-6
  assert jm.state_dict()["bn.num_batches_tracked"].item() == 1

  # grad_accum=2: two forwards in a row, each updating the statistics (rows i mod 2)
  step = tot.make_train_step(jm, ce, optax.sgd(0.0), grad_accum=2)
  step(*images(1))
  for rows in (images(1)[0][0::2], images(1)[0][1::2]):
    ref(rows)
  assert h.rel(jm.state_dict()["bn.running_mean"], ref.bn.running_mean) < 1e-6
  assert jm.state_dict()["bn.num_batches_tracked"].item() == 3


class Block(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(8, 8)
    self.bn = torch.nn.BatchNorm1d(8)

  def forward(self, x):
    return self.bn(self.lin(x))


class Stack(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.layers = torch.nn.ModuleList([Block(), Block()])

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def test_scanned_layers_carry_their_buffer_updates_out_of_the_scan():
  torch.manual_seed(0)
  ref = Stack()
  jm = tot.ShardedModule(Stack().requires_grad_(False), mesh=tot.make_mesh(fsdp=8), scan=True)
  ref.load_state_dict(dict(jm.state_dict()))
  assert "layers.scan.layer.bn.running_mean" in jm.buffers  # stacked: one scan
  x = torch.randn(8, 8)
  for _ in range(2):
    got = tot.to_cpu(jm(x))
    want = ref(x).detach()
  assert h.rel(got, want) < 1e-6
  state = jm.state_dict()
  for name in ("layers.0.bn.running_mean", "layers.1.bn.running_var"):
    assert h.rel(state[name], ref.state_dict()[name]) < 1e-6, name
  assert state["layers.1.bn.num_batches_tracked"].item() == 2
