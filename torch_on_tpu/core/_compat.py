"""Everything torch_on_tpu relies on that torch, torchax or jax do not promise.

Two kinds, both here so that an upgrade of any of the three is checked in one
place (and by tests/test_compat.py):

- version shims, each gated on the versions it fixes and a no-op elsewhere
  (`import_torchax` applies the one torchax needs under torch 2.13; every module
  of the package imports torchax through it);
- the internal (underscore) APIs we call, listed in `INTERNAL_APIS`, each behind
  a small function below.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import sys

import torch
import torch.utils._pytree as torch_pytree  # noqa: F401  (re-exported: the package's one import of it)

# torchax releases up to and including this one name the named-tensor (Dimname)
# ATen overloads at import time; torch 2.13 removed those overloads.
_LAST_TORCHAX_NAMING_DIMNAME_OVERLOADS = (0, 0, 13)


def _version_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def torch_has_dimname_overloads() -> bool:
  """True where torch still registers the named-tensor ATen overloads."""
  return hasattr(torch.ops.aten.prod, "dim_Dimname")


def dimname_shim_needed() -> bool:
  """The torchax import failure on torch>=2.13 applies to this stack."""
  try:
    torchax_version = _version_tuple(importlib.metadata.version("torchax"))
  except importlib.metadata.PackageNotFoundError:
    return False
  return (
    not torch_has_dimname_overloads()
    and torchax_version <= _LAST_TORCHAX_NAMING_DIMNAME_OVERLOADS
  )


class _RemovedOverload:
  """Stands in for an ATen overload torch no longer has.

  torchax only uses these names as keys of its autocast table and as entries of
  the list it hands to `torch._decomp.get_decompositions`; a stand-in that is
  not a `torch._ops.OperatorBase` is never dispatched to and is ignored there.
  """

  def __init__(self, qualified_name: str):
    self.qualified_name = qualified_name

  def __repr__(self) -> str:
    return f"<removed overload {self.qualified_name}>"


def is_named_tensor_overload(overload_name: str) -> bool:
  """ATen names its named-tensor overloads `*Dimname*` or `*names*`
  (`prod.dim_Dimname`, `std.correction_names`, `norm.names_ScalarOpt_dim`)."""
  return "dimname" in overload_name.lower() or "names" in overload_name.split("_")


@contextlib.contextmanager
def _tolerate_removed_dimname_overloads():
  """While active, `torch.ops.aten.<op>.<...Dimname...>` of a removed overload
  resolves to a `_RemovedOverload` instead of raising AttributeError."""
  packet_cls = torch._ops.OpOverloadPacket
  original_getattr = packet_cls.__getattr__

  def getattr_with_fallback(self, key):
    try:
      return original_getattr(self, key)
    except AttributeError:
      if not is_named_tensor_overload(key):
        raise
      return _RemovedOverload(f"{self._qualified_op_name}.{key}")

  packet_cls.__getattr__ = getattr_with_fallback
  try:
    yield
  finally:
    packet_cls.__getattr__ = original_getattr


def import_torchvision_outside_torchax() -> None:
  """Imports torchvision now, where it is installed and not yet imported.

  torchvision's first import checks its CUDA build by calling one of its own torch
  ops. If that first import happens lazily inside a traced step (seen on the CUDA
  image with torch 2.11), torchax's mode receives the op, has no lowering for it,
  and the trace fails with `OperatorNotFound: torchvision::_cuda_version`.
  """
  import importlib.util
  if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
    return
  try:
    import torchvision  # noqa: F401
  except Exception:  # noqa: BLE001 (a broken torchvision is for whoever uses it to report)
    pass


@contextlib.contextmanager
def torchax_import_shims():
  """Active while torchax's modules first load (see `torchax_import`): the
  named-tensor overload stand-ins where this stack needs them."""
  shim = _tolerate_removed_dimname_overloads if dimname_shim_needed() else contextlib.nullcontext
  with shim():
    yield


def after_torchax_import(torchax) -> None:
  """Right after torchax's `__init__` ran, still under the shims: the modules its
  environment loads lazily (both name Dimname overloads), then torch's accelerator fix."""
  import torchax.amp
  import torchax.decompositions  # noqa: F401

  keep_torch_accelerator_off_torchax(torchax)


def keep_torch_accelerator_off_torchax(torchax) -> None:
  """torchax renames torch's spare device backend to `jax` and registers a device module
  that says it is available, so `torch.accelerator` reports a `jax` accelerator it cannot
  query (no streams, no device index) and `torch.compile` of plain CPU code fails. The
  module says unavailable instead; torchax never asks it (`torch.device("jax")` and its
  tensors are unaffected)."""
  torchax.device_module.is_available = lambda: False


def accept_fp32_autocast(torchax) -> None:
  """`torch.autocast` asks the device module which dtypes autocast on `jax` supports; torchax
  says fp16 and bf16 and torch disables the region for any other, with a warning. CUDA's
  autocast accepts fp32 too (a region computing in fp32 inside a low-precision model), and so
  does ours (`lowerings.autocast`)."""
  torchax.device_module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16, torch.float32]


def is_jax_backed(tensor) -> bool:
  """`tensor` is one of torchax's (a jax array, or a view of one)."""
  torchax = import_torchax()
  return isinstance(tensor, (torchax.tensor.Tensor, torchax.view.View))


def import_torchax():
  """Imports torchax (with the shims, through `torchax_import`) after torchvision."""
  if "torchax" not in sys.modules:
    import_torchvision_outside_torchax()
  import torchax

  keep_torch_accelerator_off_torchax(torchax)  # also where torchax came in before torch_on_tpu
  return torchax


# ---- Internal APIs of torchax, torch and jax ---------------------------------------------
# Every use of a private name of the three libraries goes through the functions below, so an
# upgrade is checked here and in tests/test_compat.py (one test per entry of INTERNAL_APIS),
# not hunted across the package. A public hook is used where one exists.

INTERNAL_APIS = {
  "torchax.tensor.Environment._ops": "the op table our lowerings and overrides are written into",
  "torchax.tensor.Environment._decomps": "whether torchax decomposes an in-place op itself",
  "torchax.ops.ops_registry.Operator": "a table entry (how torchax calls a lowering)",
  "torchax.ops.jaten._aten__native_batch_norm_legit": "torchax's batch norm, under our running-stats update",
  "torchax.tensor.Tensor._elem": "the jax array inside a torchax tensor, written in place by init",
  "torchax.tensor.Tensor._env": "the environment a torchax tensor belongs to (its PRNG)",
  "torch.nn.utils.stateless._reparametrize_module": "a module run with other tensors, no copy",
  "torch.nn.init._no_grad_trunc_normal_": "the helper trunc_normal_ calls, swapped while init is traced",
  "torch.nn.Module._parameters/_buffers": "placing a tensor on a module without nn.Module's checks",
  "torch.nn.Module._forward_hooks": "HF output-capture hooks recorded for a scanned stack",
  "torch.nn.Module._non_persistent_buffers_set": "which buffers a state_dict leaves out, per module",
  "torch._C._nn.cross_entropy_loss": "torch's own cross-entropy, where ours does not apply",
  "torch.nn._reduction": "resolving F.cross_entropy's legacy size_average/reduce arguments",
  "torch.utils._pytree": "torch's pytree utilities (no public twin)",
  "jax._src.interpreters.partial_eval.dce_jaxpr": "pruning a traced init to the outputs of one chunk",
  "jax._src.xla_bridge.backends_are_initialized": "whether XLA_FLAGS and a distributed join still apply",
  "jax._src.config.enable_compilation_cache, jax._src.compilation_cache._cache_checked/_cache_used": "off while compiling for a compile-only TPU target (its executables cannot be read back)",
  "jax._src.clusters.ClusterEnv": "the clusters jax.distributed would detect by itself",
  "torchax.device_module.is_available": "kept False so torch.accelerator (and torch.compile) ignore torchax's backend",
  "jax._src.distributed.global_state.client": "the coordination service's client: key-value store, barriers, live processes",
  "torchax.tensor.XLADispatchMode": "torchax's dispatch mode and the op namespaces it intercepts (others run eagerly)",
  "torchax.tensor.Environment._dispatch_mode": "the mode instance an environment enters, replaced to route other namespaces",
  "torch._decomp.decomposition_table": "the decompositions torch registers for ops (custom ops included)",
  "torch._ops.OpOverload._op_dk": "calling one dispatch key's kernel of an op (a custom op's composite implementation)",
  "torchax.tensor.Environment._function_mode/_dispatch_mode, torch's mode stacks": "torchax's modes, re-entered where torch popped them",
  "jax._src.interpreters.ad.JVPTracer/LinearizeTracer": "a Function's forward that reads a tensor it was not given (autograd_functions)",
  "torch.autograd.Function.apply": "routed for every subclass, so a Function on jax-backed tensors runs its own backward (autograd_functions)",
  "torchao.float8.float8_training_tensor.Float8TrainingTensor.__torch_dispatch__": "runs inside torchax's modes when it wraps jax-backed tensors",
  "torchax.device_module.get_amp_supported_dtype": "widened to fp32, so torch.autocast('jax', dtype=torch.float32) is accepted as CUDA's is",
  "torchax.tensor.Environment._function_mode": "the function-mode instance an environment enters, replaced to apply autocast casts",
  "torch._C dispatch TLS (AutocastPrivateUse1 included)": "torch dispatches to the AutocastPrivateUse1 kernels though torchax's tensors do not carry that key",
  "torch._ops.OpOverload._schema": "an op's arguments by name and position (autocast's dtype argument)",
  "torch._C._dispatch_get_registrations_for_dispatch_key": "the ops torch's CUDA autocast casts (AutocastCUDA), the reference for ours",
  "torchax.tensor.Tensor.__torch_dispatch__": "replaced so a jax-backed tensor's math outside torchax's environment runs in it (a model's outputs in a user's script)",
}

def torchax_env():
  """torchax's default environment (starting it starts jax's backend)."""
  return import_torchax().default_env()


def make_operator(target, fn, *, jax_function: bool, needs_env: bool = False, view_op: bool = False, user: bool = False):
  """A torchax op-table entry: `fn` takes jax arrays (`jax_function`) or torch tensors."""
  from torchax.ops import ops_registry

  return ops_registry.Operator(
    target, fn, is_jax_function=jax_function, is_user_defined=user, needs_env=needs_env, is_view_op=view_op
  )


def registered_op(env, target):
  """The entry torchax dispatches `target` to, or None."""
  return env._ops.get(target)


def set_op(env, target, operator) -> None:
  """Installs `operator` (from `make_operator` / `registered_op`) for `target`; None removes it."""
  if operator is None:
    env._ops.pop(target, None)
  else:
    env._ops[target] = operator


def overridden_by_user(env, target) -> bool:
  """`target` runs an override installed with `override_op` (or the bridge's own)."""
  return bool(getattr(env._ops.get(target), "is_user_defined", False))


def has_lowering(env, packet) -> bool:
  """torchax lowers `packet` (or its `.default` overload) itself."""
  return packet in env._ops or getattr(packet, "default", None) in env._ops


def has_decomposition(env, packet) -> bool:
  """torchax decomposes `packet`'s default overload into other ops."""
  return bool(env._decomps.get(getattr(packet, "default", None)))


# The op namespaces torchax's dispatch mode lowers itself; an op of any other namespace
# runs its eager kernel on jax-backed tensors (and fails) unless routed.
TORCHAX_NAMESPACES = ("aten", "_c10d_functional", "torchvision", "xla")


def route_other_namespaces(env, handler) -> None:
  """Makes `env`'s dispatch mode hand every op outside `TORCHAX_NAMESPACES` to
  `handler(mode, op, types, args, kwargs)` (re-enter `mode` to run torch code on
  jax-backed tensors) instead of calling the op's eager kernel."""
  from torchax import tensor

  if getattr(env._dispatch_mode, "routes_other_namespaces", False):
    return

  class RoutingDispatchMode(tensor.XLADispatchMode):
    routes_other_namespaces = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
      if isinstance(func, torch._ops.OpOverload) and func.namespace not in TORCHAX_NAMESPACES:
        return handler(self, func, types, args, kwargs or {})
      return super().__torch_dispatch__(func, types, args, kwargs)

  env._dispatch_mode = RoutingDispatchMode(env)


def route_torch_functions(env, handler, while_entered) -> None:
  """Makes `env`'s function mode hand every torch function call to
  `handler(mode, func, args, kwargs, torchax_call)` (`torchax_call(args, kwargs)` runs
  torchax's own handling), with `while_entered()` (a context manager) active for as long as
  the mode is entered."""
  from torchax import tensor

  if getattr(env._function_mode, "routes_torch_functions", False):
    return

  class RoutingFunctionMode(tensor.XLAFunctionMode):
    routes_torch_functions = True

    def __init__(self, env):
      super().__init__(env)
      self.entered = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
      def torchax_call(args, kwargs):
        return tensor.XLAFunctionMode.__torch_function__(self, func, types, args, kwargs)

      return handler(self, func, args, kwargs or {}, torchax_call)

    def __enter__(self):
      stack = contextlib.ExitStack()
      stack.enter_context(while_entered())
      self.entered.append(stack)
      return super().__enter__()

    def __exit__(self, *exc):
      try:
        return super().__exit__(*exc)
      finally:
        self.entered.pop().close()

  env._function_mode = RoutingFunctionMode(env)


@contextlib.contextmanager
def autocast_key_included():
  """Context: torch dispatches ops to their `AutocastPrivateUse1` kernels (where autocast on
  `jax`, torch's renamed private backend, is enabled). torchax's tensors are meta tensors to
  torch's dispatcher, without that key, so it is included for the thread instead."""
  key = torch._C.DispatchKey.AutocastPrivateUse1
  before = torch._C._dispatch_tls_is_dispatch_key_included(key)
  torch._C._dispatch_tls_set_dispatch_key_included(key, True)
  try:
    yield
  finally:
    torch._C._dispatch_tls_set_dispatch_key_included(key, before)


def op_schema(op):
  """An ATen OpOverload's schema (its arguments: names, positions, defaults)."""
  return op._schema


def cuda_autocast_ops() -> set[str]:
  """The ops torch's CUDA autocast casts ("aten::mm", "aten::softmax.int", ...): those with an
  `AutocastCUDA` kernel in this torch (registered in CPU builds too)."""
  return set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))


def decomposition(op):
  """torch's registered decomposition of `op` (an OpOverload), or None."""
  import torch._decomp

  return torch._decomp.decomposition_table.get(op)


def has_kernel(op, dispatch_key: str) -> bool:
  """`op` has a kernel registered for `dispatch_key` ("CompositeExplicitAutograd", ...)."""
  return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), dispatch_key)


def run_kernel(op, dispatch_key: str, args, kwargs):
  """Calls `op`'s kernel for `dispatch_key` directly (its sub-ops dispatch as usual)."""
  return op._op_dk(getattr(torch._C.DispatchKey, dispatch_key), *args, **kwargs)


def torchax_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
  """torchax's own batch-norm lowering on jax arrays: (output, saved mean, saved inverse std)."""
  from torchax.ops import jaten

  return jaten._aten__native_batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps)


def tensor_env(tensor):
  """The torchax environment a torchax tensor belongs to."""
  return tensor._env


def set_array(tensor, array) -> None:
  """Replaces the jax array inside a torchax tensor (an in-place write)."""
  tensor._elem = array


def reparametrized(module: torch.nn.Module, tensors: dict):
  """Context: `module` runs with `tensors` (dotted name → tensor) in place of its own."""
  return torch.nn.utils.stateless._reparametrize_module(module, tensors)


@contextlib.contextmanager
def trunc_normal_helper(replacement):
  """Context: `nn.init.trunc_normal_` calls `replacement(tensor, mean, std, a, b,
  generator=None, original=...)`. Model code binds `trunc_normal_` early (in
  `partial`s), so the module-level helper it calls is what can be swapped."""
  original = torch.nn.init._no_grad_trunc_normal_
  torch.nn.init._no_grad_trunc_normal_ = lambda *a, **k: replacement(*a, original=original, **k)
  try:
    yield
  finally:
    torch.nn.init._no_grad_trunc_normal_ = original


def place_tensor(owner: torch.nn.Module, leaf: str, value, is_param: bool) -> None:
  """Puts `value` on `owner` as parameter or buffer `leaf`, bypassing nn.Module's type checks
  (a torchax tensor or a meta stand-in is not an `nn.Parameter` of the module's device)."""
  (owner._parameters if is_param else owner._buffers)[leaf] = value


def module_tensor_dicts(module: torch.nn.Module) -> tuple[dict, dict]:
  """The module's own parameter and buffer dicts (live, not copies)."""
  return module._parameters, module._buffers


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
  """Names of the module's own buffers that its state_dict leaves out."""
  return module._non_persistent_buffers_set


def forward_hooks(module: torch.nn.Module) -> dict:
  """The module's forward hooks (live dict: id → hook)."""
  return module._forward_hooks


def torch_cross_entropy(input, target, weight, size_average, reduce, reduction, ignore_index, label_smoothing):
  """torch's own cross-entropy kernel entry (what `F.cross_entropy` calls after its checks),
  with the legacy `size_average` / `reduce` arguments resolved as torch resolves them."""
  if size_average is not None or reduce is not None:
    reduction_enum = torch.nn._reduction.legacy_get_enum(size_average, reduce)
  else:
    reduction_enum = torch.nn._reduction.get_enum(reduction)
  return torch._C._nn.cross_entropy_loss(input, target, weight, reduction_enum, ignore_index, label_smoothing)


def dce_jaxpr(jaxpr, used_outputs: list[bool], *, instantiate: bool = True):
  """`jaxpr` pruned to `used_outputs`; returns (jaxpr, which inputs it still uses)."""
  from jax._src.interpreters import partial_eval

  return partial_eval.dce_jaxpr(jaxpr, used_outputs, instantiate=instantiate)


def backend_started() -> bool:
  """True once jax has created a backend: XLA_FLAGS and a distributed join no longer apply."""
  bridge = sys.modules.get("jax._src.xla_bridge")  # never imports jax just to ask
  started = getattr(bridge, "backends_are_initialized", None)
  return bool(started and started())


@contextlib.contextmanager
def without_persistent_cache():
  """jax's persistent compilation cache off for the programs compiled inside: a compile-only
  client's executables are written there but cannot be read back (a warning on every reuse).
  jax decides once per process whether it uses the cache, so its flag alone is not enough
  once anything has compiled: the decision it memoized is set aside too, and restored."""
  from jax._src import compilation_cache, config  # the flag's own context manager; jax.config.update would be process-wide

  decided = compilation_cache._cache_checked, compilation_cache._cache_used
  compilation_cache._cache_checked, compilation_cache._cache_used = True, False
  try:
    with config.enable_compilation_cache(False):
      yield
  finally:
    compilation_cache._cache_checked, compilation_cache._cache_used = decided


def managed_cluster_size() -> int:
  """Processes of the cluster jax would auto-detect (TPU pod, Slurm, Open MPI); 0 if none."""
  from jax._src import clusters  # the detectors jax.distributed.initialize() itself uses

  for env in clusters.ClusterEnv._cluster_types:
    if not env.opt_in_only_method and env.is_env_present():
      return int(env.get_process_count())
  return 0


def distributed_client():
  """The coordination-service client `jax.distributed.initialize` connected (None before):
  its key-value store (`key_value_set`, `key_value_dir_get`, `key_value_try_get`),
  `wait_at_barrier` and `get_live_nodes` are what `health` and `fingerprint` use."""
  from jax._src import distributed

  return distributed.global_state.client


@contextlib.contextmanager
def torchax_modes(env):
  """Context: torchax's function and dispatch modes are active (each pushed only if it is not).

  torch pops a mode while its own handler runs, so code reached from inside a
  handler (a tensor subclass's `__torch_dispatch__`, a Function's backward run
  by jax) would otherwise compute outside torchax.
  """
  import torch.overrides
  import torch.utils._python_dispatch as python_dispatch

  with contextlib.ExitStack() as stack:
    if env._function_mode not in torch.overrides._get_current_function_mode_stack():
      stack.enter_context(env._function_mode)
    if env._dispatch_mode not in python_dispatch._get_current_dispatch_mode_stack():
      stack.enter_context(env._dispatch_mode)
    yield


def route_function_apply(router) -> None:
  """`torch.autograd.Function.apply`, for every subclass that does not define its own, becomes
  `router(cls, torch_apply, *args, **kwargs)` (idempotent); `torch_apply` is torch's own."""
  function = torch.autograd.Function
  torch_apply = function.__dict__["apply"].__func__
  if getattr(torch_apply, "routed_by_torch_on_tpu", False):
    return

  def apply(cls, *args, **kwargs):
    return router(cls, lambda *a, **k: torch_apply(cls, *a, **k), *args, **kwargs)

  apply.routed_by_torch_on_tpu = True
  apply.torch_apply = torch_apply
  function.apply = classmethod(apply)


def is_differentiated(array) -> bool:
  """`array` is being differentiated by jax here (a tracer of a JVP or linearize transformation)."""
  from jax._src.interpreters import ad

  return isinstance(array, (ad.JVPTracer, ad.LinearizeTracer))


def dispatch_inside_torchax(subclass) -> None:
  """A wrapper tensor subclass whose inner tensors are jax-backed runs its
  `__torch_dispatch__` inside torchax's modes (idempotent).

  torchax's dispatch mode hands an op whose tensors are all of another class to
  that class with the modes popped; the subclass's handler then computes on
  its inner torchax tensors, which only works inside the modes.
  """
  original = subclass.__dict__["__torch_dispatch__"].__func__
  if getattr(original, "inside_torchax", False):
    return
  from torchax.tensor import Tensor as TorchaxTensor

  def wraps_jax(x) -> bool:
    if not isinstance(x, subclass):
      return False
    names, _ = x.__tensor_flatten__()
    return any(isinstance(getattr(x, n), TorchaxTensor) for n in names)

  def dispatch(cls, func, types, args=(), kwargs=None):
    leaves = torch_pytree.tree_leaves((args, kwargs))
    if not any(wraps_jax(x) for x in leaves):
      return original(cls, func, types, args, kwargs)
    with torchax_modes(torchax_env()):
      return original(cls, func, types, args, kwargs)

  dispatch.inside_torchax = True
  subclass.__torch_dispatch__ = classmethod(dispatch)
