"""Custom ops (`torch.library`, any namespace) inside a model run through the bridge:
by an override, torch's decomposition, or the op's composite implementation; an op
with only device kernels is refused at trace time, naming the op and `override_op`."""

import optax
import pytest
import torch
import torch.nn.functional as F

import torch_on_tpu as tot
from tests.helpers import rel

_lib = torch.library.Library("tot_test", "DEF")
_lib.define("cpu_only_gelu(Tensor x) -> Tensor")
_lib.impl("cpu_only_gelu", lambda x: F.gelu(x), "CPU")
_lib.define("implicit_gelu(Tensor x) -> Tensor")
_lib.impl("implicit_gelu", lambda x: F.gelu(x), "CompositeImplicitAutograd")


@torch.library.custom_op("tot_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
  """A user's custom op: its implementation is torch code (a composite kernel)."""
  return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
  return torch.empty_like(x)


class Net(torch.nn.Module):
  def __init__(self, op):
    super().__init__()
    self.proj = torch.nn.Linear(16, 16)
    self.op = op

  def forward(self, x):
    return self.op(self.proj(x))


def _run(op, x):
  torch.manual_seed(0)
  model = Net(op)
  want = model(x).detach()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  return tot.to_cpu(jm(x)), want, jm


def _titan_scatter_add(t):
  import torchtitan.ops.scatter_add  # noqa: F401  (registers torchtitan's op)

  return torch.ops.torchtitan.deterministic_scatter_add(t, torch.zeros_like(t, dtype=torch.long), t)


# (the op in the model, the same function in plain torch for the eager reference's gradient)
CASES = {
  "custom_op": (lambda t: torch.ops.tot_test.scaled_tanh(t, 3.0), lambda t: torch.tanh(t) * 3.0),
  "composite_implicit": (torch.ops.tot_test.implicit_gelu, F.gelu),
  "torchtitan_scatter_add": (_titan_scatter_add, _titan_scatter_add),
}


@pytest.mark.parametrize("case", CASES)
def test_a_custom_op_with_a_composite_implementation_runs_and_trains(case):
  op, plain = CASES[case]
  x = torch.randn(8, 16)
  got, want, jm = _run(op, x)
  assert rel(got, want) < 1e-6
  # and its gradient is jax's, of the same function
  step = tot.make_train_step(jm, lambda out, y: F.mse_loss(out, y), optax.sgd(0.1))
  eager = Net(plain)
  eager.load_state_dict(dict(jm.state_dict()))
  step(x, torch.zeros(8, 16))
  F.mse_loss(eager(x), torch.zeros(8, 16)).backward()
  trained = jm.state_dict()
  for name, p in eager.named_parameters():
    assert rel(trained[name], (p - 0.1 * p.grad).detach()) < 1e-5, name


def test_a_custom_op_with_only_device_kernels_is_refused_naming_it_and_override_op():
  with pytest.raises(tot.TorchOnTpuError, match=r"tot_test::cpu_only_gelu .*tot.override_op\(torch.ops.tot_test.cpu_only_gelu.default"):
    _run(torch.ops.tot_test.cpu_only_gelu, torch.randn(8, 16))


def test_an_override_gives_a_device_only_op_its_lowering():
  x = torch.randn(8, 16)
  with tot.override_op(torch.ops.tot_test.cpu_only_gelu.default, lambda t: F.gelu(t)):
    got, want, _ = _run(torch.ops.tot_test.cpu_only_gelu, x)
  assert rel(got, want) < 1e-6


def test_plain_torch_tensors_still_run_the_ops_own_kernel():
  x = torch.randn(4)
  assert torch.equal(torch.ops.tot_test.cpu_only_gelu(x), F.gelu(x))
