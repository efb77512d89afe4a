"""User op overrides: decorator and context manager, scoped, applied at trace time."""

import torch
import torch.nn.functional as F

import torch_on_tpu as tot


class Block(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(16, 16)

  def forward(self, x):
    return F.gelu(self.proj(x))


def _model():
  torch.manual_seed(0)
  return Block()


def test_context_manager_override_is_scoped_and_retraces():
  model = _model()
  x = torch.randn(8, 16)
  pre = model.proj(x).detach()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  exact = tot.to_cpu(jm(x))
  assert torch.allclose(exact, F.gelu(pre), atol=1e-6)
  with tot.override_op(F.gelu, lambda t, approximate="none": torch.relu(t)):
    overridden = tot.to_cpu(jm(x))
  assert torch.allclose(overridden, torch.relu(pre), atol=1e-6)
  after = tot.to_cpu(jm(x))
  assert torch.allclose(after, exact)  # the previous definition is back


def test_decorator_override_wraps_the_previous_definition_until_removed():
  model = _model()
  x = torch.randn(8, 16)
  pre = model.proj(x).detach()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))

  @tot.override_op(F.gelu)
  def tanh_gelu(t, approximate="none"):
    return F.gelu(t, approximate="tanh")  # resolves to the original inside the override

  try:
    got = tot.to_cpu(jm(x))
  finally:
    tanh_gelu.remove()
  assert torch.allclose(got, F.gelu(pre, approximate="tanh"), atol=1e-6)
  assert not torch.allclose(got, F.gelu(pre), atol=1e-7)
  assert torch.allclose(tot.to_cpu(jm(x)), F.gelu(pre), atol=1e-6)


def test_aten_ops_can_be_overridden_too():
  model = _model()
  x = torch.randn(8, 16)
  pre = model.proj(x).detach()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  with tot.override_op(torch.ops.aten.gelu.default, lambda t, approximate="none": t * 2):
    got = tot.to_cpu(jm(x))
  assert torch.allclose(got, pre * 2, atol=1e-6)
