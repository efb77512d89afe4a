"""`torch.autograd.Function`s run with their own backward under the bridge (autograd_functions):
Functions whose backward is not their forward's derivative, trained against torch eager."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.utils.checkpoint

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.core import _compat

Function = torch.autograd.Function


class StraightThroughRound(Function):
  """Rounds to quarters; the gradient passes straight through (jax's derivative of round is 0)."""

  @staticmethod
  def forward(ctx, x):
    return torch.round(x * 4) / 4

  @staticmethod
  def backward(ctx, grad):
    return grad


class GradientReversal(Function):
  @staticmethod
  def forward(ctx, x, alpha):
    ctx.alpha = alpha  # non-tensor state
    return x.clone()

  @staticmethod
  def backward(ctx, grad):
    return -ctx.alpha * grad, None


class ClippedBackward(Function):
  """x², with its gradient clipped to ±0.05."""

  @staticmethod
  def forward(ctx, x):
    ctx.save_for_backward(x)
    return x * x

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return (2 * x * grad).clamp(-0.05, 0.05)


class ScaledMatmul(Function):
  """x @ wᵀ saving its tensors as attributes (one nested in a list) next to non-tensor state;
  the weight gradient depends on `needs_input_grad` (the data input needs none)."""

  @staticmethod
  def forward(ctx, x, w):
    ctx.x, ctx.pair, ctx.meta = x, [w, None], {"scale": 0.5, "shape": tuple(x.shape)}
    return x @ w.t()

  @staticmethod
  def backward(ctx, grad):
    x, (w, _) = ctx.x, ctx.pair
    grad_x = grad @ w * ctx.meta["scale"] if ctx.needs_input_grad[0] else None
    grad_w = grad.flatten(0, -2).t() @ x.flatten(0, -2) * (1.0 if ctx.needs_input_grad[0] else 3.0)
    return grad_x, grad_w


class TopIndexAndMask(Function):
  """Three outputs: a differentiable one, an integer index, a mask marked non-differentiable."""

  @staticmethod
  def forward(ctx, x):
    mask = (x > 0).to(x.dtype)
    ctx.mark_non_differentiable(mask)
    return x * 2, torch.argmax(x, dim=-1), mask

  @staticmethod
  def backward(ctx, grad, grad_index, grad_mask):
    assert grad_index.shape == grad_mask.shape[:-1]  # materialized (zeros), not None
    return grad * 3 + grad_mask


class UnusedSecondOutput(Function):
  """Two outputs, only the first used: without materialized gradients the second's is None."""

  @staticmethod
  def forward(ctx, x):
    ctx.set_materialize_grads(False)
    return x * 2, x * 5

  @staticmethod
  def backward(ctx, grad, grad_unused):
    assert grad_unused is None
    return grad * 0.5


class SetupContextStyle(Function):
  """The newer API: forward without ctx, `setup_context`, a keyword argument with a default."""

  @staticmethod
  def forward(x, k=2.0):
    return torch.sin(x) * k

  @staticmethod
  def setup_context(ctx, inputs, output):
    x, k = inputs
    ctx.save_for_backward(x)
    ctx.k = k

  @staticmethod
  def backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * ctx.k * 0.25, None  # a quarter of cos(x)·k·grad's scale, and no cosine


class Block(torch.nn.Module):
  def __init__(self, dim):
    super().__init__()
    self.lin = torch.nn.Linear(dim, dim)
    self.w = torch.nn.Parameter(torch.randn(dim, dim) * 0.3)

  def forward(self, h):
    y = StraightThroughRound.apply(self.lin(h))
    y = ClippedBackward.apply(GradientReversal.apply(y, 0.5))
    y, _index, mask = TopIndexAndMask.apply(y)
    y, _unused = UnusedSecondOutput.apply(y)
    y = ScaledMatmul.apply(SetupContextStyle.apply(y, k=3.0), self.w)
    return h + torch.tanh(y) * mask


class Net(torch.nn.Module):
  def __init__(self, dim=16, n_layers=2):
    super().__init__()
    self.inp = torch.nn.Parameter(torch.randn(dim, dim) * 0.3)
    self.layers = torch.nn.ModuleList(Block(dim) for _ in range(n_layers))
    self.head = torch.nn.Linear(dim, dim)

  def forward(self, x):
    h = ScaledMatmul.apply(x, self.inp)
    for layer in self.layers:
      h = layer(h)
    return self.head(h)


def mse(out, y):
  return ((out - y) ** 2).mean()


def adamw():
  return optax.adamw(3e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def train_both(model, steps=3, seed=0, **wrap):
  """`steps` AdamW steps through make_train_step and in torch eager: (ours, torch's, losses)."""
  jm = tot.ShardedModule(copy.deepcopy(model), mesh=tot.make_mesh(fsdp=8), **{k: v for k, v in wrap.items() if k != "forward_remat"})
  step = tot.make_train_step(jm, mse, adamw(), forward_remat=wrap.get("forward_remat"))
  ref = copy.deepcopy(model)
  opt = torch.optim.AdamW(ref.parameters(), lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
  g = torch.Generator().manual_seed(seed)
  losses = []
  for _ in range(steps):
    x, y = torch.randn(8, 4, 16, generator=g), torch.randn(8, 4, 16, generator=g)
    ours = float(step(x, y))
    opt.zero_grad()
    loss = mse(ref(x), y)
    loss.backward()
    opt.step()
    losses.append((ours, loss.item()))
  return {n: t.numpy() for n, t in jm.state_dict().items()}, {n: t.detach().numpy() for n, t in ref.state_dict().items()}, jm, losses


@pytest.mark.parametrize(
  "wrap",
  [{}, {"scan": True, "remat": "full"}, {"forward_remat": "dots_saveable"}],
  ids=["layer-loop", "scanned+remat", "forward-remat"],
)
def test_functions_with_their_own_backward_train_as_in_torch(wrap):
  """3 AdamW steps: trained weights within 1e-6 of torch eager's; jax's derivative of the
  forwards (round's is zero, the reversal's +1) would be far off."""
  torch.manual_seed(0)
  model = Net()
  ours, theirs, jm, losses = train_both(model, **wrap)
  if wrap.get("scan"):
    assert jm._layout is not None and jm.module.layers.scan.scanned
  for a, b in losses:
    assert abs(a - b) <= 1e-6 * abs(b)
  start = {n: t.detach().numpy() for n, t in model.state_dict().items()}
  for name in theirs:
    assert h.rel(theirs[name], start[name]) > 1e-3, name  # every weight moved
    assert h.rel(ours[name], theirs[name]) <= 1e-6, name


# ---- one Function, one behaviour ----------------------------------------------------------


def jax_grads(fn, *tensors):
  """Gradients of `fn(*tensors).sum()` w.r.t. every tensor, through the bridge (jax)."""
  env = _compat.torchax_env()

  def f(*arrays):
    with env, env.override_property(prng=jax.random.PRNGKey(0)):
      return fn(*(h.torch_view(a) for a in arrays)).sum().jax()

  return jax.jit(jax.grad(f, argnums=tuple(range(len(tensors)))))(*(jnp.asarray(t.numpy()) for t in tensors))


def torch_grads(fn, *tensors):
  leaves = [t.clone().requires_grad_() for t in tensors]
  fn(*leaves).sum().backward()
  return [t.grad for t in leaves]


class DoubleInPlace(Function):
  @staticmethod
  def forward(ctx, x):
    ctx.mark_dirty(x)
    return x.mul_(2)

  @staticmethod
  def backward(ctx, grad):
    return grad * 5


def test_mark_dirty_updates_the_callers_tensor_and_runs_the_backward():
  def fn(x):
    y = x * 1
    z = DoubleInPlace.apply(y)
    assert z is y  # apply returns the caller's tensor, as torch does
    return y * y

  x = torch.randn(5)
  want = torch_grads(fn, x)[0]
  assert h.rel(np.asarray(jax_grads(fn, x)[0]), want.numpy()) < 1e-6


def test_a_function_under_no_grad_runs_torchs_apply_and_passes_no_gradient():
  def fn(x):
    with torch.no_grad():
      y = StraightThroughRound.apply(x * 3)
    return x * y

  x = torch.randn(5)
  want = torch_grads(fn, x)[0]
  assert h.rel(np.asarray(jax_grads(fn, x)[0]), want.numpy()) < 1e-6


def test_nested_tensors_get_no_gradient_and_keyword_tensors_one_as_in_torch():
  class FromList(Function):
    @staticmethod
    def forward(ctx, xs, y, bias=None):
      return xs[0] * y + bias

    @staticmethod
    def backward(ctx, grad):
      assert ctx.needs_input_grad == (False, True, True)  # torch passes a keyword argument on as positional
      return None, grad * 7, grad * 2

  fn = lambda x, y, b: FromList.apply([x], y, bias=b)  # noqa: E731
  tensors = [torch.randn(4) for _ in range(3)]
  wants = torch_grads(fn, *tensors)
  assert wants[0] is None
  for ours, want in zip(jax_grads(fn, *tensors), wants):
    np.testing.assert_allclose(np.asarray(ours), np.zeros(4) if want is None else want.numpy(), rtol=1e-6)


def test_a_backward_gradient_of_a_broadcast_shape_is_summed_as_torch_does():
  class Broadcasting(Function):
    @staticmethod
    def forward(ctx, x):
      return x * 2

    @staticmethod
    def backward(ctx, grad):
      return grad.expand(3, *grad.shape)

  x = torch.randn(4)
  assert h.rel(np.asarray(jax_grads(Broadcasting.apply, x)[0]), torch_grads(Broadcasting.apply, x)[0].numpy()) < 1e-6


def test_what_cannot_run_is_refused_in_one_sentence():
  class InPlaceUnmarked(Function):
    @staticmethod
    def forward(ctx, x):
      x.add_(1)
      return x * 2

    @staticmethod
    def backward(ctx, grad):
      return grad

  class TooFewGradients(Function):
    @staticmethod
    def forward(ctx, x, y):
      return x * y

    @staticmethod
    def backward(ctx, grad):
      return grad

  weight = h.torch_view(jnp.ones(4))

  class ReadsAParameter(Function):
    @staticmethod
    def forward(ctx, x):
      return x * weight

    @staticmethod
    def backward(ctx, grad):
      return grad

  x = torch.randn(4)
  with pytest.raises(tot.TorchOnTpuError, match=r"InPlaceUnmarked.forward modifies an input in place without ctx.mark_dirty"):
    jax_grads(lambda a: InPlaceUnmarked.apply(a * 1), x)
  with pytest.raises(tot.TorchOnTpuError, match=r"TooFewGradients.backward returned 1 gradients for 2 inputs"):
    jax_grads(TooFewGradients.apply, x, x)

  def through_parameter(a, w):
    nonlocal weight
    weight = w
    return ReadsAParameter.apply(a)

  with pytest.raises(tot.TorchOnTpuError, match=r"ReadsAParameter.forward computes with a jax-backed tensor that is not among its arguments"):
    jax_grads(through_parameter, x, x)


# ---- torch.utils.checkpoint ----------------------------------------------------------------


class Checkpointed(torch.nn.Module):
  def __init__(self, use_reentrant):
    super().__init__()
    self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    self.use_reentrant = use_reentrant

  def inner(self, h):
    return torch.tanh(self.b(torch.relu(self.a(h))))

  def forward(self, x):
    h = self.a(x)
    return self.b(torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=self.use_reentrant))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_torch_checkpoint_in_a_model_trains_as_in_torch(use_reentrant):
  torch.manual_seed(0)
  ours, theirs, _, _ = train_both(Checkpointed(use_reentrant))
  for name in theirs:
    assert h.rel(ours[name], theirs[name]) <= 1e-6, name


def test_torch_eager_keeps_torchs_own_apply():
  x = torch.randn(3, requires_grad=True)
  GradientReversal.apply(x, 2.0).sum().backward()
  assert torch.equal(x.grad, torch.full((3,), -2.0))
  assert StraightThroughRound.apply(x).grad_fn.__class__.__name__ == "StraightThroughRoundBackward"


def test_random_ops_in_a_forward_draw_inside_the_custom_vjp():
  class StochasticRound(Function):
    @staticmethod
    def forward(ctx, x):
      return torch.floor(x + torch.rand_like(x))

    @staticmethod
    def backward(ctx, grad):
      return grad

  grad = jax_grads(lambda x: StochasticRound.apply(x) * 2, torch.randn(64))[0]
  np.testing.assert_array_equal(np.asarray(grad), np.full(64, 2.0))
