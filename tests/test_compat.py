"""`_compat`: the torchax import shim (needed and sufficient on this stack, a no-op
elsewhere), the quiet import, and every internal API we rely on."""

import contextlib
import importlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from torch_on_tpu.core import _compat

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_plain_torchax_import_fails_on_this_stack_so_the_shim_is_needed():
  assert _compat.dimname_shim_needed()
  plain = _run("import torchax, torchax.decompositions")
  assert plain.returncode != 0
  assert "no overload name" in plain.stderr


def test_the_shim_is_sufficient_and_leaves_torch_as_it_was():
  shimmed = _run(
    "import torch_on_tpu, torch\ntorch_on_tpu.setup()\nimport torchax\n"
    "env = torchax.default_env()\n"
    "assert torch.ops.aten.mm in env._ops and len(env._ops) > 400\n"
    "try:\n"
    "    torch.ops.aten.prod.dim_Dimname\n"
    "except AttributeError:\n"
    "    print('restored')\n"
  )
  assert shimmed.returncode == 0, shimmed.stderr[-2000:]
  assert "restored" in shimmed.stdout


@pytest.mark.parametrize("setup_first", [False, True])
def test_torchax_imports_after_torch_on_tpu_before_or_after_setup(setup_first):
  code = (
    "import torch, torch_on_tpu as tot\n"
    + ("tot.setup()\n" if setup_first else "")
    + "import torchax\nimport torchax\n"  # a second import is the same module
    "env = torchax.default_env()\n"
    "with env:\n"
    "    y = (torch.ones(2, device='jax') * 3).sum()\n"
    "tot.setup()\n"
    "jm = tot.ShardedModule(torch.nn.Linear(2, 2))\n"
    "print(float(y), tuple(tot.to_cpu(jm(torch.ones(1, 2))).shape))\n"
  )
  assert _printed(code) == ["6.0", "(1,", "2)"]


def test_torch_compile_of_cpu_code_works_after_the_bridge_started():
  code = (
    "import torch, torch_on_tpu as tot\n"
    "tot.setup()\n"
    "model = torch.nn.Linear(4, 3)\n"
    "x = torch.randn(5, 4)\n"
    "compiled = torch.compile(model)\n"
    "y = compiled(x)\n"
    "y.sum().backward()\n"
    "print(torch.allclose(y, model(x)), tuple(model.weight.grad.shape))\n"
  )
  assert _printed(code) == ["True", "(3,", "4)"]


def _printed(code: str) -> list[str]:
  """The words `code` prints in a fresh interpreter (which must exit cleanly)."""
  run = _run(code)
  assert run.returncode == 0, run.stderr[-2000:]
  return run.stdout.split()


def test_only_named_tensor_overloads_are_tolerated():
  assert _compat.is_named_tensor_overload("dim_Dimname")
  assert _compat.is_named_tensor_overload("correction_names")
  assert not _compat.is_named_tensor_overload("dim_int")
  with _compat._tolerate_removed_dimname_overloads():
    assert repr(torch.ops.aten.prod.dim_Dimname).startswith("<removed overload")
    with pytest.raises(AttributeError):
      torch.ops.aten.prod.not_an_overload


def test_the_shim_is_a_no_op_where_it_is_not_needed(monkeypatch):
  monkeypatch.setattr(_compat, "torch_has_dimname_overloads", lambda: True)
  assert not _compat.dimname_shim_needed()
  monkeypatch.undo()
  real_version = importlib.metadata.version
  monkeypatch.setattr(
    importlib.metadata, "version", lambda name: "0.0.14" if name == "torchax" else real_version(name)
  )
  assert not _compat.dimname_shim_needed()


def test_a_small_model_runs_forward_through_torchax():
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
  x = torch.randn(8, 16)
  expected = model(x).detach()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  got = tot.to_cpu(jm(x))
  assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


# ---- torchvision: imported before any torchax mode can see its import-time op ---------------

_FAKE_VISION = '''
import torch

# torchax's dispatch mode takes every op of the torchvision namespace.
_lib = torch.library.Library("torchvision", "DEF")
_lib.define("_cuda_version() -> int")
_lib.impl("_cuda_version", lambda: -1, "CompositeExplicitAutograd")
torch.ops.torchvision._cuda_version()  # what torchvision's extension check does on import
'''


def _package(root, name, body):
  (root / name).mkdir()
  (root / name / "__init__.py").write_text(body)


def test_an_import_time_op_inside_torchax_mode_fails_so_torchvision_goes_first(tmp_path):
  _package(tmp_path, "late_vision", _FAKE_VISION)
  code = (
    f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
    "import torch_on_tpu; torch_on_tpu.setup()\n"
    "import torchax\n"
    "with torchax.default_env():\n"
    "  import late_vision\n"
  )
  late = _run(code)
  assert late.returncode != 0 and "has no lowering" in late.stderr


def test_torchvision_is_imported_at_setup_and_a_broken_one_is_ignored(tmp_path):
  good, broken = tmp_path / "good", tmp_path / "broken"
  good.mkdir(), broken.mkdir()
  _package(good, "torchvision", _FAKE_VISION)
  _package(broken, "torchvision", "raise RuntimeError('operator torchvision::nms does not exist')\n")
  check = "import sys; sys.path.insert(0, {!r})\nimport torch_on_tpu; torch_on_tpu.setup()\nprint('torchvision' in sys.modules)\n"
  assert _run(check.format(str(good))).stdout.strip() == "True"
  ignored = _run(check.format(str(broken)))
  assert ignored.returncode == 0 and ignored.stdout.strip() == "False"


# ---- a quiet import ------------------------------------------------------------------------


def test_import_changes_nothing_and_setup_starts_the_platform_on_first_use():
  code = (
    "import os, sys\n"
    "before = dict(os.environ)\n"
    "import torch_on_tpu as tot\n"
    "assert dict(os.environ) == before, 'the import changed the environment'\n"
    "heavy = sorted(m for m in ('torch', 'jax', 'torchax', 'torchvision') if m in sys.modules)\n"
    "assert not heavy, heavy\n"
    "from torch_on_tpu import runtime, xla_flags\n"
    "assert not runtime.started()\n"
    "mesh = tot.make_mesh(fsdp=-1)\n"
    "assert runtime.started()\n"
    "assert all(f'{k}={v}' in os.environ['XLA_FLAGS'] for k, v in xla_flags.DEFAULTS.items())\n"
    "print(type(mesh).__name__, tot.ShardedModule.__name__)\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.split() == ["Mesh", "ShardedModule"]


def test_an_unknown_public_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'JitableModule'"):
    tot.JitableModule  # noqa: B018


# ---- every internal API we rely on, checked against the pinned versions ---------------------
# One check per entry of `_compat.INTERNAL_APIS` (torch 2.13, torchax 0.0.13, jax 0.10): a new
# internal use without a check here fails `test_every_internal_api_has_a_check`.


def _check_op_table():
  env = _compat.torchax_env()
  previous = _compat.registered_op(env, torch.ops.aten.mm)
  assert previous is not None and _compat.has_lowering(env, torch.ops.aten.mm)
  calls = []
  _compat.set_op(env, torch.ops.aten.mm, _compat.make_operator(
    torch.ops.aten.mm, lambda a, b: calls.append(1) or a @ b, jax_function=True
  ))
  try:
    x = tot.to_cpu(tot.ShardedModule(_MatMul(), mesh=tot.make_mesh(fsdp=1, devices=jax.devices()[:1]))(torch.eye(2)))
  finally:
    _compat.set_op(env, torch.ops.aten.mm, previous)
  assert calls and torch.equal(x, torch.eye(2) @ torch.full((2, 2), 2.0))


class _MatMul(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.w = torch.nn.Parameter(torch.full((2, 2), 2.0))

  def forward(self, x):
    return torch.mm(x, self.w)


def _check_batch_norm():
  x = torch.randn(4, 3, 5)
  ones, zeros = jnp.ones(3), jnp.zeros(3)
  out, mean, _ = _compat.torchax_batch_norm(jnp.asarray(x.numpy()), ones, zeros, zeros, ones, True, 0.1, 1e-5)
  want = torch.nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), training=True)
  np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(mean), x.mean((0, 2)).numpy(), rtol=1e-5, atol=1e-6)


def _check_decomps():
  env = _compat.torchax_env()
  assert _compat.has_decomposition(env, torch.ops.aten.addcmul_) or _compat.has_lowering(env, torch.ops.aten.addcmul_)
  assert not _compat.has_decomposition(env, torch.ops.aten.mm)


def _check_tensor_internals():
  from torchax.interop import torch_view

  t = torch_view(jnp.zeros(3))
  assert _compat.tensor_env(t) is _compat.torchax_env()
  _compat.set_array(t, jnp.ones(3))
  assert float(t.jax().sum()) == 3.0


def _check_reparametrized():
  lin = torch.nn.Linear(2, 2)
  with _compat.reparametrized(lin, {"weight": torch.zeros(2, 2), "bias": torch.ones(2)}):
    assert torch.equal(lin(torch.randn(1, 2)), torch.ones(1, 2))
  assert not torch.equal(lin.weight, torch.zeros(2, 2))


def _check_trunc_normal_helper():
  seen = []
  with _compat.trunc_normal_helper(lambda t, mean, std, a, b, generator=None, original=None: seen.append((a, b)) or t):
    torch.nn.init.trunc_normal_(torch.empty(3), a=-1.0, b=1.0)
  assert seen == [(-1.0, 1.0)]
  assert torch.nn.init.trunc_normal_(torch.empty(1000), a=-0.5, b=0.5).abs().max() <= 0.5


def _check_module_dicts():
  lin = torch.nn.BatchNorm1d(2)
  params, buffers = _compat.module_tensor_dicts(lin)
  assert set(params) == {"weight", "bias"} and "running_mean" in buffers
  _compat.place_tensor(lin, "running_mean", torch.ones(2), False)
  assert torch.equal(lin.running_mean, torch.ones(2))


def _check_non_persistent_buffers():
  bn = torch.nn.BatchNorm1d(2)
  bn.register_buffer("scratch", torch.zeros(1), persistent=False)
  assert _compat.non_persistent_buffers(bn) == {"scratch"}
  assert "scratch" not in bn.state_dict()


def _check_forward_hooks():
  lin = torch.nn.Linear(2, 2)
  handle = lin.register_forward_hook(lambda *a: None)
  assert list(_compat.forward_hooks(lin)) == [handle.id]


def _check_cross_entropy():
  logits, target = torch.randn(4, 5), torch.tensor([0, 1, 2, -100])
  for reduction in ("mean", "sum", "none"):
    want = torch.nn.functional.cross_entropy(logits, target, reduction=reduction)
    got = _compat.torch_cross_entropy(logits, target, None, None, None, reduction, -100, 0.0)
    assert torch.allclose(got, want)
  legacy = _compat.torch_cross_entropy(logits, target, None, False, None, "mean", -100, 0.0)
  assert torch.allclose(legacy, torch.nn.functional.cross_entropy(logits, target, reduction="sum"))


def _check_pytree():
  leaves, spec = _compat.torch_pytree.tree_flatten({"a": [1, 2], "b": 3})
  assert leaves == [1, 2, 3] and _compat.torch_pytree.tree_unflatten(leaves, spec) == {"a": [1, 2], "b": 3}


def _check_dce_jaxpr():
  closed = jax.make_jaxpr(lambda x: (x + 1.0, x * 2.0))(1.0)
  pruned, used_inputs = _compat.dce_jaxpr(closed.jaxpr, [False, True])
  assert len(pruned.outvars) == 1 and used_inputs == [True]
  assert len(pruned.eqns) == 1 and "mul" in str(pruned.eqns[0].primitive)


def _check_backend_started():
  assert _compat.backend_started()  # conftest started the platform
  run = _run("from torch_on_tpu import _compat\nprint(_compat.backend_started())\nimport jax\njax.devices()\nprint(_compat.backend_started())")
  assert run.stdout.split() == ["False", "True"], run.stderr[-1000:]


def _check_persistent_cache_off():
  import jax
  from jax._src import compilation_cache

  jax.jit(lambda x: x + 1)(1.0)  # a compile: jax has decided, once for the process, that it uses its cache
  backend = jax.devices()[0].client
  assert compilation_cache.is_cache_used(backend)  # conftest points it at .cache/jax-tests
  with _compat.without_persistent_cache():
    assert not jax.config.jax_enable_compilation_cache
    assert not compilation_cache.is_cache_used(backend)
  assert jax.config.jax_enable_compilation_cache and compilation_cache.is_cache_used(backend)


def _check_clusters():
  assert _compat.managed_cluster_size() == 0  # this machine is no pod, Slurm job or MPI run


def _check_device_module():
  torchax = _compat.import_torchax()
  # torchax's rename is what makes torch see an accelerator; its device module is the one asked.
  assert torch._C._get_privateuse1_backend_name() == "jax"
  assert torch.get_device_module("jax") is torchax.device_module
  assert torch.accelerator.current_accelerator() == torch.device("jax")
  assert not torch.accelerator.is_available()


def _check_distributed_client():
  """One process joins a 1-process run and uses every client call `health` and `fingerprint` make."""
  run = _run(textwrap.dedent("""
    import jax
    from torch_on_tpu import _compat, launch
    assert _compat.distributed_client() is None
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(f"127.0.0.1:{launch.free_port()}", 1, 0, heartbeat_timeout_seconds=5)
    client = _compat.distributed_client()
    client.key_value_set("t/a/0", "x", allow_overwrite=True)
    client.key_value_set("t/a/0", "y", allow_overwrite=True)
    client.wait_at_barrier("t/barrier", 5000)
    print(client.key_value_dir_get("t/a/"), client.key_value_try_get("t/a/0"), sorted(client.get_live_nodes([0])))
  """))
  assert run.stdout.split("\n")[0] == "[('t/a/0', 'y')] y [0]", run.stdout + run.stderr[-2000:]


# A custom op of a namespace torchax leaves alone, with only a CPU kernel.
_cpu_only = torch.library.Library("tot_compat", "DEF")
_cpu_only.define("double(Tensor x) -> Tensor")
_cpu_only.impl("double", lambda x: x * 2, "CPU")


@contextlib.contextmanager
def _torchax_own_tensor_dispatch():
  """torchax's own `Tensor.__torch_dispatch__` back for a while (the bridge computes a jax-backed
  tensor's math outside the environment in it, `model_ops._outside_the_environment`)."""
  from torchax.tensor import Tensor

  from torch_on_tpu.lowering.aten import model_ops

  ours = Tensor.__dict__["__torch_dispatch__"]
  Tensor.__torch_dispatch__ = classmethod(model_ops._TORCHAX_DISPATCH)
  try:
    yield
  finally:
    Tensor.__torch_dispatch__ = ours


def _check_tensor_dispatch():
  from torchax.interop import torch_view

  x = torch_view(jnp.arange(3.0))
  with _torchax_own_tensor_dispatch(), pytest.raises(AssertionError, match="only do math within the torchax environment"):
    x + 1  # what torchax does outside its environment
  assert float((x + 1).jax().sum()) == 6.0  # what the bridge does: computed in it


@_torchax_own_tensor_dispatch()
def _check_dispatch_mode():
  from torchax.interop import torch_view

  env = _compat.torchax_env()
  assert "tot_compat" not in _compat.TORCHAX_NAMESPACES and "aten" in _compat.TORCHAX_NAMESPACES
  assert getattr(env._dispatch_mode, "routes_other_namespaces", False)  # setup() installed ours
  seen = []
  mode = env._dispatch_mode
  env._dispatch_mode = type(mode).__mro__[1](env)  # torchax's own mode: runs the eager kernel
  try:
    with env, pytest.raises(AssertionError, match="within the torchax environment"):
      torch.ops.tot_compat.double(torch_view(jnp.ones(2)))
    _compat.route_other_namespaces(env, lambda m, op, types, args, kwargs: seen.append(op) or args[0])
    with env:
      torch.ops.tot_compat.double(torch_view(jnp.ones(2)))
  finally:
    env._dispatch_mode = mode
  assert seen == [torch.ops.tot_compat.double.default]


def _check_decomposition_table():
  assert _compat.decomposition(torch.ops.aten.addcmul.default) is not None
  assert _compat.decomposition(torch.ops.tot_compat.double.default) is None


def _check_op_kernels():
  assert _compat.has_kernel(torch.ops.tot_compat.double.default, "CPU")
  assert not _compat.has_kernel(torch.ops.tot_compat.double.default, "CompositeExplicitAutograd")
  got = _compat.run_kernel(torch.ops.aten.full_like.default, "CompositeExplicitAutograd", (torch.ones(2), 3.0), {})
  assert torch.equal(got, torch.full((2,), 3.0))


def _check_torchax_modes():
  from torchax.interop import torch_view

  x = torch_view(jnp.arange(3.0))
  with _torchax_own_tensor_dispatch(), pytest.raises(AssertionError, match="only do math within the torchax environment"):
    x + 1
  with _compat.torchax_modes(_compat.torchax_env()):
    assert float((x + 1).jax().sum()) == 6.0
    with _compat.torchax_modes(_compat.torchax_env()):  # nothing pushed twice
      assert torch.overrides._get_current_function_mode_stack().count(_compat.torchax_env()._function_mode) == 1


def _check_amp_supported_dtypes():
  tot.setup()
  assert torch.get_device_module("jax").get_amp_supported_dtype() == [torch.float16, torch.bfloat16, torch.float32]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # torch says "Disabling autocast" for a dtype the module lacks
    with torch.autocast("jax", dtype=torch.float32):
      assert torch.is_autocast_enabled("jax") and torch.get_autocast_dtype("jax") == torch.float32


def _check_function_mode_routed():
  from torchax import tensor

  tot.setup()
  env = _compat.torchax_env()
  assert isinstance(env._function_mode, tensor.XLAFunctionMode) and env._function_mode.routes_torch_functions
  with env:
    assert env._function_mode in torch.overrides._get_current_function_mode_stack()


def _check_autocast_key_included():
  key = torch._C.DispatchKey.AutocastPrivateUse1
  assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
  with _compat.autocast_key_included():
    assert torch._C._dispatch_tls_is_dispatch_key_included(key)
    with _compat.autocast_key_included():
      pass
    assert torch._C._dispatch_tls_is_dispatch_key_included(key)  # the inner exit restores
  assert not torch._C._dispatch_tls_is_dispatch_key_included(key)


def _check_op_schema():
  names = [a.name for a in _compat.op_schema(torch.ops.aten.softmax.int).arguments]
  assert names == ["self", "dim", "dtype"]


def _check_cuda_autocast_ops():
  ops = _compat.cuda_autocast_ops()
  assert {"aten::mm", "aten::softmax.int", "aten::layer_norm", "aten::addcmul"} <= ops
  assert "aten::relu" not in ops


class _SignGradient(torch.autograd.Function):
  """x ↦ 2x whose backward passes the gradient's sign: jax differentiating the forward would give 2."""

  @staticmethod
  def forward(ctx, x, scale):
    ctx.scale = scale
    ctx.save_for_backward(x)
    return x * 2

  @staticmethod
  def backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.sign(grad) * ctx.scale + x * 0, None


def _check_function_apply():
  from torchax.interop import torch_view

  routed = torch.autograd.Function.__dict__["apply"].__func__
  assert routed.routed_by_torch_on_tpu  # setup() routed it, once for every subclass
  _compat.route_function_apply(lambda *a, **k: None)  # idempotent: the router stays
  assert torch.autograd.Function.__dict__["apply"].__func__ is routed
  x = torch.randn(3, requires_grad=True)
  _SignGradient.apply(x, 0.5).sum().backward()  # eager torch: torch's own apply, its own graph node
  assert torch.equal(x.grad, torch.full((3,), 0.5))

  def f(a):
    with _compat.torchax_env(), _compat.torchax_env().override_property(prng=jax.random.PRNGKey(0)):
      return _SignGradient.apply(torch_view(a), 0.5).sum().jax()

  assert np.allclose(jax.grad(f)(jnp.ones(3) * 3), 0.5)  # its backward ran, not jax's derivative (2)
  assert np.allclose(jax.jit(f)(jnp.ones(3)), 6.0)


def _check_differentiation_tracers():
  seen = []

  def f(x):
    seen.append(_compat.is_differentiated(x))
    return x * 2

  jax.grad(f)(1.0)
  jax.jit(jax.grad(f))(1.0)
  jax.jit(f)(1.0)
  assert seen == [True, True, False] and not _compat.is_differentiated(jnp.ones(2))


def _check_float8_dispatch():
  from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
  from torchao.float8.float8_training_tensor import LinearMMConfig
  from torchax.interop import torch_view

  from torch_on_tpu.lowering import float8

  float8.prepare(float8.convert(torch.nn.Linear(16, 16), "tensorwise"))

  def roundtrip(a):
    # grad mode off, as inside torchao's float8 matmul Function (its casts are Functions too)
    with _compat.torchax_env(), torch.no_grad():
      f8 = hp_tensor_to_float8_dynamic(torch_view(a), torch.float8_e4m3fn, LinearMMConfig())
      return f8._data.jax(), f8.reshape(-1).to_original_precision().jax()

  data, back = jax.jit(roundtrip)(jnp.linspace(-3.0, 3.0, 16).reshape(4, 4))
  assert data.dtype == jnp.float8_e4m3fn and back.shape == (16,)
  np.testing.assert_allclose(np.asarray(back), np.linspace(-3.0, 3.0, 16), rtol=2**-3)


_INTERNAL_API_CHECKS = {
  "torchax.tensor.XLADispatchMode": _check_dispatch_mode,
  "torchax.tensor.Tensor.__torch_dispatch__": _check_tensor_dispatch,
  "torchax.tensor.Environment._dispatch_mode": _check_dispatch_mode,
  "torch._decomp.decomposition_table": _check_decomposition_table,
  "torch._ops.OpOverload._op_dk": _check_op_kernels,
  "torchax.tensor.Environment._ops": _check_op_table,
  "torchax.tensor.Environment._decomps": _check_decomps,
  "torchax.ops.ops_registry.Operator": _check_op_table,
  "torchax.ops.jaten._aten__native_batch_norm_legit": _check_batch_norm,
  "torchax.tensor.Tensor._elem": _check_tensor_internals,
  "torchax.tensor.Tensor._env": _check_tensor_internals,
  "torch.nn.utils.stateless._reparametrize_module": _check_reparametrized,
  "torch.nn.init._no_grad_trunc_normal_": _check_trunc_normal_helper,
  "torch.nn.Module._parameters/_buffers": _check_module_dicts,
  "torch.nn.Module._forward_hooks": _check_forward_hooks,
  "torch.nn.Module._non_persistent_buffers_set": _check_non_persistent_buffers,
  "torch._C._nn.cross_entropy_loss": _check_cross_entropy,
  "torch.nn._reduction": _check_cross_entropy,
  "torch.utils._pytree": _check_pytree,
  "jax._src.interpreters.partial_eval.dce_jaxpr": _check_dce_jaxpr,
  "jax._src.xla_bridge.backends_are_initialized": _check_backend_started,
  "jax._src.config.enable_compilation_cache, jax._src.compilation_cache._cache_checked/_cache_used": _check_persistent_cache_off,
  "jax._src.clusters.ClusterEnv": _check_clusters,
  "torchax.device_module.is_available": _check_device_module,
  "torchax.device_module.get_amp_supported_dtype": _check_amp_supported_dtypes,
  "torchax.tensor.Environment._function_mode": _check_function_mode_routed,
  "torch._C dispatch TLS (AutocastPrivateUse1 included)": _check_autocast_key_included,
  "torch._ops.OpOverload._schema": _check_op_schema,
  "torch._C._dispatch_get_registrations_for_dispatch_key": _check_cuda_autocast_ops,
  "jax._src.distributed.global_state.client": _check_distributed_client,
  "torchax.tensor.Environment._function_mode/_dispatch_mode, torch's mode stacks": _check_torchax_modes,
  "torch.autograd.Function.apply": _check_function_apply,
  "jax._src.interpreters.ad.JVPTracer/LinearizeTracer": _check_differentiation_tracers,
  "torchao.float8.float8_training_tensor.Float8TrainingTensor.__torch_dispatch__": _check_float8_dispatch,
}


def test_every_internal_api_has_a_check():
  assert set(_INTERNAL_API_CHECKS) == set(_compat.INTERNAL_APIS)


@pytest.mark.parametrize("name", sorted(_INTERNAL_API_CHECKS))
def test_internal_api_behaves_as_we_rely_on(name):
  _INTERNAL_API_CHECKS[name]()


# ---- optional dependencies -----------------------------------------------------------------


def test_a_missing_extra_is_named_in_one_sentence(monkeypatch):
  from torch_on_tpu.core import extras

  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError, as when not installed
  with pytest.raises(tot.TorchOnTpuError, match=r"The plot needs matplotlib, which is not installed; .*torch_on_tpu\[logging\]"):
    extras.require("matplotlib", "The plot")
  monkeypatch.setitem(sys.modules, "torchtitan", None)
  from torch_on_tpu.models import torchtitan

  with pytest.raises(tot.TorchOnTpuError, match=r"torch_on_tpu\[torchtitan\]"):
    torchtitan.llama3_config("debugmodel")


def test_a_users_file_shadowing_an_extra_is_named_not_called_missing(tmp_path):
  """A script named `torchtitan.py` is what `import torchtitan` finds from its directory: the
  sentence names that file, not a missing install."""
  script = tmp_path / "torchtitan.py"
  script.write_text("from torch_on_tpu.models.torchtitan import build_llama3\nbuild_llama3('debugmodel', max_seq_len=64)\n")
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent)}
  done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode != 0
  assert f"but `import torchtitan` finds {script}, a file of that name; rename it" in done.stderr, done.stderr[-1500:]


def test_metrics_are_logged_without_the_logging_extra(tmp_path, monkeypatch):
  from torch_on_tpu.training import metrics

  monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None)
  log = metrics.RunLog(tmp_path)
  log.log(1, {"loss": 2.0})
  log.close()
  assert not log.can_plot
  assert (tmp_path / "metrics.jsonl").read_text().strip() == '{"step": 1, "loss": 2.0}'
  assert not (tmp_path / "tensorboard").exists()


def test_public_names_are_not_shadowed_by_submodules():
  import pkgutil

  for info in pkgutil.walk_packages(tot.__path__, "torch_on_tpu."):
    if not info.name.endswith(("__main__", ".doctor", ".launch")):
      importlib.import_module(info.name)  # importing a submodule sets an attribute of its package
  for name in tot.__all__:
    assert not isinstance(getattr(tot, name), type(sys)), f"tot.{name} is a module"


# ---- renamed public names keep working, with a DeprecationWarning ------------------------------


def test_former_names_warn_and_behave_as_the_new_ones():
  layers = [torch.nn.Linear(4, 4) for _ in range(2)]
  with pytest.warns(DeprecationWarning, match="tot.ScannedModule is now tot.StackedLayers"):
    old = tot.ScannedModule(layers, loop=True)
  assert isinstance(old, tot.StackedLayers) and not old.scanned
  with pytest.warns(DeprecationWarning, match="tot.JittableModule is now tot.ShardedModule"):
    assert tot.JittableModule is tot.ShardedModule
  jm = tot.ShardedModule(torch.nn.Linear(4, 4), mesh=tot.make_mesh(fsdp=8))
  loss = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
  with pytest.warns(DeprecationWarning, match=r"make_train_step\(remat=\) is now forward_remat="):
    step = tot.make_train_step(jm, loss, optax.sgd(0.1), remat="full")
  assert step.forward_remat == "full"
  with pytest.raises(tot.TorchOnTpuError, match="not both"):
    tot.make_train_step(jm, loss, optax.sgd(0.1), remat="full", forward_remat="full")
