"""`torch.autocast("jax", dtype=...)` regions inside a model compute what CUDA's autocast computes
(`lowerings/autocast.py`): the casts against hand-cast eager torch (the same computation, so
the tolerances are rounding-level), the policy against torch's own CUDA autocast kernels run
on fake CUDA tensors, and fp32 regions inside bf16 models (torchtitan's MoE router)."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_on_tpu as tot
from tests.helpers import rel
from torch_on_tpu.core import _compat
from torch_on_tpu.lowering.aten import autocast

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
  # and eager's: the bias joins the fp32 accumulator, one rounding, as torch's addmm
  assert rel(out, F.linear(x.to(BF16), w, b).float()) == 0


def test_a_bf16_region_without_bias_equals_the_hand_cast_eager_linear():
  torch.manual_seed(0)
  m, x = Repro(BF16), torch.randn(8, 8)
  m.l.bias = None
  ref = F.linear(x.to(BF16), m.l.weight.detach().to(BF16))
  fp32 = F.linear(x, m.l.weight.detach())  # before wrapping: the module's weights then move to meta
  out = tot.ShardedModule(m, mesh=tot.make_mesh(fsdp=8))(x)
  assert out.dtype == BF16
  assert rel(tot.to_cpu(out).float(), ref.float()) <= 1e-6
  assert rel(fp32, ref.float()) > 1e-3  # an fp32 linear would fail


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


# ---- fp32 regions in bf16 models: torchtitan's MoE router -------------------------------------


def _router(bf16=True):
  from torchtitan.models.common.linear import Linear
  from torchtitan.models.common.moe import TokenChoiceTopKRouter

  torch.manual_seed(0)
  config = TokenChoiceTopKRouter.Config(
    num_experts=8, gate=Linear.Config(in_features=16, out_features=8), top_k=2, score_func="softmax"
  )
  router = config.build()
  nn.init.normal_(router.gate.weight, std=0.5)
  return router.to(BF16) if bf16 else router


def test_torchtitans_router_scores_in_fp32_inside_a_bf16_model():
  """`TokenChoiceTopKRouter` computes its gate under `torch.autocast(x.device.type, fp32)`; with
  bf16 parameters its scores are the fp32 gate's, as on CUDA (a bf16 gate is 2e-3 off)."""
  router = _router()
  x = torch.randn(2, 6, 16).to(BF16)
  weight = router.gate.weight.detach().clone()
  fp32_gate = F.softmax(F.linear(x.float(), weight.float()), dim=-1)
  bf16_gate = F.softmax(F.linear(x, weight).float(), dim=-1)
  assert rel(bf16_gate, fp32_gate) > 1e-3

  top_scores, experts, scores = tot.ShardedModule(router, mesh=tot.make_mesh(jax.devices()[:1], fsdp=1))(x)
  assert scores.dtype == top_scores.dtype == torch.float32
  assert rel(tot.to_cpu(scores), fp32_gate) <= 1e-6
  chosen = tot.to_cpu(experts).sort(-1).values
  assert torch.equal(chosen, fp32_gate.topk(2, dim=-1).indices.sort(-1).values)


def test_torchtitans_router_trains_its_fp32_gate_under_a_bf16_compute_dtype():
  """torchtitan's setting: fp32 master weights, bf16 compute (`compute_dtype`), the gate in fp32."""
  router = _router(bf16=False)
  master = router.gate.weight.detach().clone().requires_grad_()
  x, target = torch.randn(2, 6, 16).to(BF16), torch.rand(2, 6, 8)

  def loss_fn(outputs, target):
    return ((outputs[2] - target) ** 2).mean()

  jm = tot.ShardedModule(router, mesh=tot.make_mesh(jax.devices()[:1], fsdp=1))
  lr = 0.5
  step = tot.make_train_step(jm, loss_fn, optax.sgd(lr), compute_dtype=jnp.bfloat16)
  loss = step(x, target).item()
  scores = F.softmax(F.linear(x.float(), master.to(BF16).float()), dim=-1)  # cast to bf16, gate in fp32
  ref_loss = loss_fn((None, None, scores), target)
  ref_loss.backward()
  assert abs(loss - ref_loss.item()) <= 1e-6 * ref_loss.item()
  trained = tot.to_cpu(jm.state_dict()["gate.weight"])
  assert rel((master.detach() - trained) / lr, master.grad) <= 1e-6


# ---- the policy is CUDA's ---------------------------------------------------------------------


def test_the_policy_table_is_the_ops_torch_casts_under_cuda_autocast():
  assert {f"aten::{name}" for name in autocast.CUDA_POLICY} == _compat.cuda_autocast_ops()


def _t(*shape, dtype=torch.float32):
  return (shape, dtype)


_LONG = torch.long
# (call, inputs): each input a (shape, dtype) spec or a plain value
_CALLS = {
  "mm": (torch.mm, [_t(3, 4), _t(4, 5)]),
  "matmul of bf16 and fp32": (torch.matmul, [_t(3, 4, dtype=BF16), _t(4, 5)]),
  "bmm": (torch.bmm, [_t(2, 3, 4), _t(2, 4, 5)]),
  "addmm": (torch.addmm, [_t(5), _t(3, 4), _t(4, 5)]),
  "baddbmm": (torch.baddbmm, [_t(2, 3, 5), _t(2, 3, 4), _t(2, 4, 5)]),
  "linear": (F.linear, [_t(3, 4), _t(5, 4), _t(5)]),
  "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [_t(3, 4), _t(4, 5)]),
  "sdpa with a float mask": (F.scaled_dot_product_attention, [_t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(4, 4)]),
  "conv2d": (F.conv2d, [_t(1, 2, 5, 5), _t(3, 2, 3, 3)]),
  "exp of bf16": (torch.exp, [_t(3, 4, dtype=BF16)]),
  "log": (torch.log, [_t(3, 4, dtype=BF16)]),
  "pow scalar exponent": (lambda a: a**2, [_t(3, dtype=BF16)]),
  "pow scalar base": (lambda a: torch.pow(2.0, a), [_t(3, dtype=BF16)]),
  "rsqrt": (torch.rsqrt, [_t(3, dtype=BF16)]),
  "softplus": (F.softplus, [_t(3, dtype=BF16)]),
  "layer_norm": (lambda a, w: F.layer_norm(a, (4,), w), [_t(3, 4, dtype=BF16), _t(4, dtype=BF16)]),
  "group_norm": (lambda a: F.group_norm(a, 2), [_t(2, 4, 3, dtype=BF16)]),
  "rms_norm": (lambda a: F.rms_norm(a, (4,)), [_t(3, 4, dtype=BF16)]),
  "mse_loss": (F.mse_loss, [_t(3, dtype=BF16), _t(3, dtype=BF16)]),
  "cross_entropy": (F.cross_entropy, [_t(3, 5, dtype=BF16), _t(3, dtype=_LONG)]),
  "logsumexp": (lambda a: torch.logsumexp(a, -1), [_t(3, 4, dtype=BF16)]),
  "cdist": (torch.cdist, [_t(3, 4, dtype=BF16), _t(2, 4, dtype=BF16)]),
  "norm": (torch.norm, [_t(3, 4, dtype=BF16)]),
  "norm over a dim": (lambda a: torch.norm(a, dim=0), [_t(3, 4, dtype=BF16)]),
  "softmax": (lambda a: torch.softmax(a, -1), [_t(3, 4, dtype=BF16)]),
  "softmax with its dtype": (lambda a: torch.softmax(a, -1, dtype=torch.float16), [_t(3, 4, dtype=BF16)]),
  "log_softmax": (lambda a: F.log_softmax(a, -1), [_t(3, 4, dtype=BF16)]),
  "sum": (torch.sum, [_t(3, 4, dtype=BF16)]),
  "sum over a dim": (lambda a: a.sum(0), [_t(3, 4, dtype=BF16)]),
  "sum of ints": (torch.sum, [_t(3, dtype=_LONG)]),
  "cumsum": (lambda a: a.cumsum(0), [_t(3, dtype=BF16)]),
  "prod": (torch.prod, [_t(3, dtype=BF16)]),
  "addcmul": (torch.addcmul, [_t(3), _t(3, dtype=BF16), _t(3, dtype=BF16)]),
  "addcmul in bf16": (torch.addcmul, [_t(3, dtype=BF16), _t(3, dtype=BF16), _t(3, dtype=BF16)]),
  "atan2": (torch.atan2, [_t(3, dtype=BF16), _t(3)]),
  "scatter_add": (lambda a, i, s: a.scatter_add(0, i, s), [_t(4, dtype=BF16), _t(3, dtype=_LONG), _t(3)]),
  "gelu (not cast)": (F.gelu, [_t(3)]),
  "add (not cast)": (torch.add, [_t(3, dtype=BF16), _t(3)]),
}


def _inputs(specs, device):
  return [
    torch.zeros(spec[0], dtype=spec[1], device=device) if isinstance(spec, tuple) else spec for spec in specs
  ]


def _cuda_dtypes(call, specs, dtype):
  """Output dtypes of `call` under torch's own CUDA autocast (its kernels, on fake CUDA tensors)."""
  from torch._subclasses.fake_tensor import FakeTensorMode

  with FakeTensorMode():
    before = torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_enabled("cuda", True)
    try:
      return _outcome(call, specs, "cuda")
    finally:
      torch.set_autocast_enabled("cuda", False)
      torch.set_autocast_dtype("cuda", before)


def _outcome(call, specs, device):
  """The output dtypes, or "refused" (CUDA's autocast refuses to mix bf16 and fp16 in its promote ops)."""
  try:
    out = call(*_inputs(specs, device))
  except (tot.TorchOnTpuError, RuntimeError) as e:
    if "promote" in str(e) or "prioritize" in str(e):
      return "refused"
    raise
  return [t.dtype for t in _compat.torch_pytree.tree_leaves(out)]


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_every_call_gets_the_dtypes_cuda_autocast_gives_it(dtype):
  tot.setup()
  wrong = {}
  with _compat.torchax_env(), torch.autocast("jax", dtype=dtype):
    for name, (call, specs) in _CALLS.items():
      ours = _outcome(call, specs, "jax")
      cuda = _cuda_dtypes(call, specs, dtype)
      if ours != cuda:
        wrong[name] = (ours, cuda)
  assert not wrong


# ---- regions and programs ---------------------------------------------------------------------


def test_a_region_around_the_call_compiles_its_own_program():
  class Plain(nn.Module):
    def __init__(self):
      super().__init__()
      self.l = nn.Linear(8, 4, bias=False)

    def forward(self, x):
      return self.l(x)

  jm = tot.ShardedModule(Plain(), mesh=tot.make_mesh(fsdp=8))
  x = torch.randn(8, 8)
  assert jm(x).dtype == torch.float32
  with torch.autocast("jax", dtype=BF16):
    assert jm(x).dtype == BF16
  assert jm(x).dtype == torch.float32


def test_what_cuda_autocast_refuses_is_refused():
  tot.setup()
  with _compat.torchax_env(), torch.autocast("jax", dtype=BF16):
    a = torch.rand(3, device="jax")
    with pytest.raises(tot.TorchOnTpuError, match="binary_cross_entropy_with_logits"):
      F.binary_cross_entropy(a, a)
    with pytest.raises(tot.TorchOnTpuError, match="refuses to promote"):
      torch.addcmul(a.half(), a.bfloat16(), a.bfloat16())
    with pytest.raises(tot.TorchOnTpuError, match=r"torch.cov .*enabled=False"):
      torch.cov(torch.rand(3, 4, device="jax"))


def test_cpu_tensors_in_a_jax_region_are_left_as_they_are():
  tot.setup()
  with _compat.torchax_env(), torch.autocast("jax", dtype=BF16):
    a = torch.randn(3, 4)
    assert (a @ a.T).dtype == torch.float32


def test_functions_torchax_lowers_first_get_the_casts_too():
  """`F.interpolate` is lowered before torch's dispatcher: CUDA runs its `upsample_*` in fp32,
  its "area" mode (an adaptive average pool) as given; `F.linear` and `torch.einsum` likewise."""
  tot.setup()
  with _compat.torchax_env(), torch.autocast("jax", dtype=BF16):
    a = torch.randn(1, 2, 4, 4, device="jax").to(BF16)
    assert F.interpolate(a, scale_factor=2.0).dtype == torch.float32
    assert F.interpolate(a, scale_factor=2.0, mode="bilinear").dtype == torch.float32
    assert F.interpolate(a, size=(2, 2), mode="area").dtype == BF16
    w = torch.randn(3, 4, device="jax")
    assert F.linear(a.float(), w).dtype == torch.einsum("...j,kj->...k", a.float(), w).dtype == BF16
