"""`torch.autocast("jax", dtype=...)` regions inside a model compute what CUDA's autocast computes
(`lowerings/autocast.py`): the casts against hand-cast eager torch (the same computation, so
the tolerances are rounding-level), the policy against torch's own CUDA autocast kernels run
on fake CUDA tensors, and fp32 regions inside bf16 models (torchtitan's MoE router)."""

import warnings

import jax
import optax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_on_tpu as tot
from torch_on_tpu import _compat
from torch_on_tpu.lowerings import autocast

from tests.helpers import rel

BF16 = torch.bfloat16


class Repro(nn.Module):
  """The issue's repro: a linear inside a region of the input's device type."""

  def __init__(self, dtype):
    super().__init__()
    self.dtype = dtype
    self.l = nn.Linear(8, 4)

  def forward(self, x):
    with torch.autocast(device_type=x.device.type, dtype=self.dtype):
      return self.l(x)


def test_a_bf16_region_computes_the_linear_in_bf16():
  torch.manual_seed(0)
  m, x = Repro(BF16), torch.randn(8, 8)
  w, b = m.l.weight.detach().to(BF16), m.l.bias.detach().to(BF16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "Disabling autocast"
    out = tot.ShardedModule(m, mesh=tot.make_mesh(fsdp=8))(x)
  assert out.dtype == BF16
  out = tot.to_cpu(out).float()
  # the bridge's bf16 linear on the inputs cast by hand: the same computation
  bf16_linear = nn.Linear(8, 4).to(BF16)
  bf16_linear.load_state_dict({"weight": w, "bias": b})
  bf16_out = tot.ShardedModule(bf16_linear, mesh=tot.make_mesh(fsdp=8))(x.to(BF16))
  assert rel(out, tot.to_cpu(bf16_out).float()) == 0
  # eager's: the bridge adds a bf16 bias to the rounded product, torch rounds once (addmm), so
  # they differ at one bf16 rounding; without the bias they are the same to the bit
  assert rel(out, F.linear(x.to(BF16), w, b).float()) <= 5e-3
  assert rel(out - b.float(), F.linear(x.to(BF16), w).float()) <= 1e-2


def test_a_bf16_region_without_bias_equals_the_hand_cast_eager_linear():
  torch.manual_seed(0)
  m, x = Repro(BF16), torch.randn(8, 8)
  m.l.bias = None
  ref = F.linear(x.to(BF16), m.l.weight.detach().to(BF16))
  out = tot.ShardedModule(m, mesh=tot.make_mesh(fsdp=8))(x)
  assert out.dtype == BF16
  assert rel(tot.to_cpu(out).float(), ref.float()) <= 1e-6
  assert rel(F.linear(x, m.l.weight.detach()), ref.float()) > 1e-3  # an fp32 linear would fail


def test_an_fp32_region_in_a_bf16_model_computes_in_fp32_without_a_warning():
  torch.manual_seed(0)
  m, x = Repro(torch.float32).to(BF16), torch.randn(8, 8).to(BF16)
  ref = F.linear(x.float(), m.l.weight.float(), m.l.bias.float()).detach()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = tot.ShardedModule(m, mesh=tot.make_mesh(fsdp=8))(x)
  assert out.dtype == torch.float32
  assert rel(tot.to_cpu(out), ref) <= 1e-6


class Block(nn.Module):
  """bf16 autocast over linear, matmul, softmax, exp, layer_norm, with a region turned off."""

  def __init__(self):
    super().__init__()
    # no biases in the bf16 linears: the bridge rounds a bf16 linear's bias add apart from its
    # product, torch once (see test_a_bf16_region_computes_the_linear_in_bf16)
    self.a, self.b, self.c = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(16, 16, bias=False)
    self.ln = nn.LayerNorm(8)

  def forward(self, x):
    with torch.autocast(device_type=x.device.type, dtype=BF16):
      h = self.a(x)
      att = torch.softmax(h @ h.transpose(-1, -2) / 4, dim=-1)
      h = att @ h
      g = torch.exp(h / 8)
      with torch.autocast(device_type=x.device.type, enabled=False):
        z = self.c(g + h.float())
      return x + self.ln(self.b(z)).float()


def hand_cast_block(m, x):
  """`Block` as CUDA's autocast computes it, every cast written out."""
  h = F.linear(x.to(BF16), m.a.weight.to(BF16))  # linear: bf16
  att = torch.softmax(h @ h.transpose(-1, -2) / 4, dim=-1, dtype=torch.float32)  # softmax: dtype=fp32
  h = att.to(BF16) @ h  # matmul: bf16
  g = torch.exp((h / 8).float())  # exp: fp32
  z = F.linear(g + h.float(), m.c.weight)  # autocast off: fp32
  y = F.linear(z.to(BF16), m.b.weight.to(BF16))
  return x + F.layer_norm(y.float(), (8,), m.ln.weight, m.ln.bias)  # layer_norm: fp32


class Net(nn.Module):
  def __init__(self):
    super().__init__()
    self.layers = nn.ModuleList([Block(), Block()])

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def _mse(out, y):
  return ((out - y) ** 2).mean()


@pytest.mark.parametrize("scan, devices", [(False, 1), (True, 1), (True, 8)])
def test_a_bf16_block_trains_as_the_hand_cast_reference(scan, devices):
  """Forward, loss and one SGD step (fp32 master weights) against hand-cast eager torch. On 8
  devices the gradient of a weight used in a bf16 matmul is a sum of the devices' bf16 partial
  products (each rounded): 1-3e-3 from one device's product, measured; all else is held to 2e-6."""
  torch.manual_seed(0)
  ref = Net()
  x, y = torch.randn(8, 5, 8), torch.randn(8, 5, 8)
  jm = tot.ShardedModule(_copy(ref), mesh=tot.make_mesh(jax.devices()[:devices], fsdp=devices), scan=scan)
  assert any(stacked for _, stacked in jm.stored_layout().values()) == scan
  out = tot.to_cpu(jm(x))
  expected = x
  for layer in ref.layers:
    expected = hand_cast_block(layer, expected)
  assert rel(out, expected.detach()) <= 1e-6

  lr = 0.1
  step = tot.make_train_step(jm, _mse, optax.sgd(lr))
  loss = float(step(x, y))
  ref_loss = _mse(expected, y)
  assert abs(loss - ref_loss.item()) <= 1e-6 * ref_loss.item()
  ref_loss.backward()
  trained = {n: tot.to_cpu(t) for n, t in jm.state_dict().items()}
  for name, p in ref.named_parameters():
    gradient = (p.detach() - trained[name]) / lr
    sharded_bf16_product = devices > 1 and name.endswith(("a.weight", "b.weight"))
    assert rel(gradient, p.grad) <= (5e-3 if sharded_bf16_product else 2e-6), name


def _copy(module):
  clone = type(module)()
  clone.load_state_dict(module.state_dict())
  return clone
