"""Torch code inside the compiled program behaves as eager torch, or says in one sentence why not:
tensors made on the CPU in a forward, out-of-range indices, data-dependent shapes, and
parameters the loss never reaches."""

import jax
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.lowering import device_checks


def _one_device():
  return tot.make_mesh(jax.devices()[:1], fsdp=1)


# ---- tensors made inside the forward ------------------------------------------------------


class _Factories(torch.nn.Module):
  """A forward written for the CPU: factory calls with no device, an explicit "cpu", .cpu()."""

  def forward(self, x):
    n = x.shape[-1]
    positions = torch.arange(n)  # default device
    window = torch.hann_window(n) + torch.zeros(n, device="cpu") + torch.eye(n)[0]
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])[:n]
    return (x + positions + window * table).cpu(), torch.rand(n)


def test_tensors_made_on_the_cpu_in_a_forward_are_made_on_the_device():
  x = torch.randn(2, 4)
  jm = tot.ShardedModule(_Factories(), mesh=_one_device())
  out, noise = jm(x)
  want = _Factories()(x)[0]
  assert h.rel(tot.to_cpu(out), want) < 1e-6
  again = jm(x)[1]  # a random factory draws from the step's key: new values per call
  assert not torch.equal(tot.to_cpu(noise), tot.to_cpu(again))


# ---- out-of-range indices -----------------------------------------------------------------


def _embedding_model():
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 6))


def _ce(out, labels):
  return F.cross_entropy(out.reshape(-1, 6), labels.reshape(-1))


def test_an_id_past_the_table_raises_when_the_forward_result_is_read():
  jm = tot.ShardedModule(_embedding_model(), mesh=_one_device())
  out = jm(torch.tensor([[1, 12, 3]]))  # dispatched: nothing waits yet
  with pytest.raises(IndexError, match=r"embedding \(a table of 10 rows\) is 12, outside the valid range \[0, 10\)"):
    tot.to_cpu(out)
  assert tot.to_cpu(jm(torch.tensor([[1, 2, 3]]))).shape == (1, 3, 6)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_bad_step_is_not_applied_and_raises_before_the_next(grad_accum):
  jm = tot.ShardedModule(_embedding_model(), mesh=tot.make_mesh(fsdp=-1))
  step = tot.make_train_step(jm, _ce, optax.adamw(1e-2), grad_accum=grad_accum)
  x = torch.tensor([[1, 2, 3], [4, 5, 6]] * 4)
  y = torch.tensor([[1, 2, 3], [0, 1, 2]] * 4)
  step(x, y)
  before = {k: np.asarray(v) for k, v in jm.params.items()}
  opt_before = [np.asarray(v) for v in jax.tree.leaves(step.opt_state)]
  bad_ids = x.clone()
  bad_ids[5, 1] = 15
  loss = step(bad_ids, y)
  with pytest.raises(IndexError, match=r"^Step 1 was not applied: an index given to embedding .* is 15"):
    float(loss)
  assert all(np.array_equal(np.asarray(jm.params[k]), v) for k, v in before.items())
  assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(step.opt_state), opt_before))
  assert step.step_count == 1
  bad_targets = y.clone()
  bad_targets[0, 0] = 6
  step(x, bad_targets)  # returns at once; the next call raises before its update
  with pytest.raises(tot.TorchOnTpuError, match=r"cross_entropy as a target \(logits of 6 classes\) is 6"):
    step(x, y)
  assert all(np.array_equal(np.asarray(jm.params[k]), v) for k, v in before.items())
  step(x, y)
  assert step.step_count == 2


def test_a_check_inside_a_shard_map_region_reaches_the_caller_with_the_first_devices_value():
  """Checks made per device (torchtitan's MoE experts run under `shard_map`) leave the region
  combined: failed on any device, the bad value of the first failing one."""
  mesh = tot.make_mesh(fsdp=-1)

  def local(ids):
    device_checks.index_in_range(ids, 10, what="a table of 10 rows")
    return ids * 2

  collectors = []

  @jax.jit
  def program(ids):
    with device_checks.collecting() as collector:
      out = device_checks.shard_map(local, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))(ids)
    collectors.append(collector)
    return out, collector.checks()

  ids = np.arange(16, dtype=np.int32).reshape(8, 2) % 10
  out, checks = program(ids)
  assert np.array_equal(out, ids * 2) and not checks.flags.any()
  ids[6, 0], ids[5, 1] = 11, 13  # rows 5 and 6 live on devices 5 and 6
  _, checks = program(ids)
  assert checks.flags.tolist() == [True] and checks.values.tolist() == [13]
  assert "a table of 10 rows is {value}" in collectors[-1].messages[0][0]


# ---- data-dependent shapes ----------------------------------------------------------------


class _Nonzero(torch.nn.Module):
  def forward(self, x):
    return torch.nonzero(x > 0)


def test_a_data_dependent_shape_is_refused_naming_the_static_form():
  jm = tot.ShardedModule(_Nonzero(), mesh=_one_device())
  with pytest.raises(tot.TorchOnTpuError, match=r"^nonzero needs tensor values .* use torch.nonzero_static\(x, size=n\)"):
    jm(torch.randn(3, 3))


# ---- parameters the loss does not reach ---------------------------------------------------


class _TwoBranches(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.used = torch.nn.Linear(4, 4)
    self.unused = torch.nn.Linear(4, 4)  # a vision tower in a text-only step, say
    self.scale = torch.nn.Parameter(torch.ones(4))  # read only through a detach

  def forward(self, x):
    return self.used(x) * self.scale.detach()


def test_parameters_the_loss_does_not_reach_are_left_as_torch_optim_leaves_them():
  torch.manual_seed(0)
  model = _TwoBranches()
  ref = _TwoBranches()
  ref.load_state_dict(model.state_dict())
  jm = tot.ShardedModule(model, mesh=_one_device())
  step = tot.make_train_step(jm, lambda out, y: ((out - y) ** 2).mean(), optax.adamw(1e-2, weight_decay=0.1))
  opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
  g = torch.Generator().manual_seed(1)
  for _ in range(3):
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    step(x, y)
    opt.zero_grad()
    ((ref(x) - y) ** 2).mean().backward()
    opt.step()
  for name, p in ref.named_parameters():
    got = tot.to_cpu(jm.params[name])
    if name.startswith("used"):
      assert h.rel(got, p.detach()) < 1e-5, name
    else:  # no weight decay, no moment decay: bit for bit what it was
      assert torch.equal(got, p.detach()), name
  mu = step.opt_state[0].mu
  assert not np.asarray(mu["unused.weight"]).any() and np.asarray(mu["used.weight"]).any()
