"""torchtitan's fused q/k/v projection as the bridge runs it (`models/torchtitan/qkv.py`): q, k
and v each from their own rows of `wqkv`, the same values and gradients as torchtitan's own
forward in fp32 and bf16, torchtitan's own where the linear is not a plain one, and no split of
a fused output in the TPU program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.core import _compat
from torch_on_tpu.models.torchtitan import build_llama3, qkv
from torch_on_tpu.parallel import targets

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


def _fused(bias: bool):
  from torchtitan.models.common.attention import FusedQKVLinear
  from torchtitan.models.common.linear import Linear

  heads, kv_heads, head_dim, dim = 8, 2, 16, 128  # 128 inputs: a lane row, so projected apart
  config = FusedQKVLinear.Config(
    n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
    wqkv=Linear.Config(in_features=dim, out_features=(heads + 2 * kv_heads) * head_dim, bias=bias),
  )
  torch.manual_seed(0)
  module = config.build()
  with torch.no_grad():
    module.wqkv.weight.normal_(0, 0.2)
    if bias:
      module.wqkv.bias.normal_(0, 0.2)
  return module


def _run(module, x, cotangents):
  """(q, k, v) and the gradients of Σ cotangent·output for x, the weight and the bias, through jax."""
  names = [n for n, _ in module.named_parameters()]

  def loss(x, params):
    with torchax.default_env():
      out = torch.func.functional_call(module, {n: torch_view(p) for n, p in params.items()}, (torch_view(x),))
      out = [jax_view(o).astype(jnp.float32) for o in out]
    return sum((o * c).sum() for o, c in zip(out, cotangents)), out

  params = {n: jnp.asarray(p.detach().float().numpy(), x.dtype) for n, p in module.named_parameters()}
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
  return out, grads[0], [grads[1][n] for n in names]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q_k_and_v_projected_apart_match_the_fused_split(dtype, bias):
  """fp32: within 1e-6 (the same dot products, summed in another order at most); bf16: within one
  rounding of the products' sums (2^-8); the gradients of x, the fused weight and its bias alike."""
  module = _fused(bias)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 128)), dtype)
  shapes = [(2, 5, 8, 16), (2, 5, 2, 16), (2, 5, 2, 16)]
  cotangents = [jnp.asarray(np.random.default_rng(i + 1).normal(size=s), jnp.float32) for i, s in enumerate(shapes)]
  want = _run(module, x, cotangents)
  with qkv.projected_apart():
    got = _run(module, x, cotangents)
  tolerance = 1e-6 if dtype == jnp.float32 else 2**-8
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert h.rel(np.asarray(g, np.float32), np.asarray(w, np.float32)) <= tolerance


def test_a_linear_with_a_hook_of_its_own_keeps_the_fused_projection():
  """A forward hook that is not one of the remat policies' per-tensor tags sees the fused output, as
  in torchtitan; those tags (`remat.PER_TENSOR_HOOK`) see q, k and v, by head as attention reads
  them (offloaded so, Llama 3 1B's step on v5p-8 reads 158 → 147 GB of HBM)."""
  from torch_on_tpu.lowering import remat

  module = _fused(False)
  params = {n: torch_view(jnp.asarray(p.detach().numpy())) for n, p in module.named_parameters()}
  x = torch_view(jnp.ones((1, 3, 128), jnp.float32))
  seen = []
  hook = lambda m, args, out: seen.append(tuple(t.shape for t in (out if isinstance(out, tuple) else (out,))))  # noqa: E731
  handle = module.wqkv.register_forward_hook(hook)
  with torchax.default_env(), qkv.projected_apart():
    torch.func.functional_call(module, params, (x,))
  handle.remove()
  setattr(hook, remat.PER_TENSOR_HOOK, True)
  handle = module.wqkv.register_forward_hook(hook)
  with torchax.default_env(), qkv.projected_apart():
    torch.func.functional_call(module, params, (x,))
  handle.remove()
  assert seen == [((1, 3, 192),), ((1, 3, 8, 16), (1, 3, 2, 16), (1, 3, 2, 16))]


@pytest.mark.parametrize("chips, apart", [(2, True), (8, False)])
def test_the_tpu_step_projects_apart_where_each_chip_holds_a_lane_row_of_inputs(chips, apart):
  """Traced for a TPU slice, the Llama 3 forward has no split of a fused projection (the strided
  copies that cost Llama 3.1 8B on v6e-8 46 GB of its step's HBM traffic, 501 → 455 GB) where each
  chip's share of the debugmodel's 256 input columns is 128 or more (2 v6e chips); over 8 chips (32
  each) torchtitan's own forward runs. Its forward is put back after either."""
  from torchtitan.models.common.attention import FusedQKVLinear

  original = FusedQKVLinear.forward
  model = build_llama3("debugmodel", attention="sdpa", max_seq_len=128)
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(targets.devices("v6e-8")[:chips], fsdp=-1), abstract=True, scan=True)
  ids = jax.ShapeDtypeStruct((8, 128), jnp.int32)
  lowered = jax.jit(lambda p, b, i: jax_view(jm.functional_call(p, b, torch_view(i)))).lower(jm.params, jm.buffers, ids)
  text = lowered.as_text(debug_info=True)
  assert ("aten::split" not in text) == apart and "dot_general" in text, text[:2000]
  assert FusedQKVLinear.forward is original
