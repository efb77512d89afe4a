"""`torch.autocast(device_type="jax", dtype=...)` regions inside a model, computed as CUDA's
autocast computes them.

Model code opens autocast regions on its tensors' device (`x.device.type` is `"jax"` for the
bridge's tensors: torchax's name for torch's private backend); torchax left such regions
without effect (a bf16 region computed in fp32) and torch refused fp32 as their dtype. Our
users come from GPUs, so the policy is CUDA's, not CPU's (CPU autocast rejects fp32 and casts
another list): `CUDA_POLICY` is aten/src/ATen/autocast_mode.h's CUDA lists in torch 2.13, and
`tests/test_autocast.py` pins it to the ops this torch registers for `AutocastCUDA` and checks
dtypes against torch's own CUDA kernels (run on fake CUDA tensors). fp32 is a valid target, as
on CUDA (torchtitan's MoE router computes its gate in fp32 inside a bf16 model).

Ops meet the policy where torch applies it, at two levels:
- an op reaching torch's dispatcher runs its kernel under the `AutocastPrivateUse1` key (the
  key torch gives a private backend's autocast): the casts, then the op again with autocast
  off for its pieces, as CUDA's kernels exclude the key. torchax's tensors do not carry the
  key, so it is included for the thread while torchax's modes are entered; torch's own
  autocast state (`torch.is_autocast_enabled("jax")`, set by `torch.autocast`) switches it.
- a torch function torchax lowers before the dispatcher (`F.linear`, `torch.einsum`,
  `F.scaled_dot_product_attention`, `torch.cdist`, the train step's `F.cross_entropy`,
  `F.interpolate`) gets the same casts in torchax's function mode; one whose pieces CUDA
  would cast but torchax lowers whole is refused inside a region.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError

DEVICE = "jax"  # torchax's name for torch's private backend: `x.device.type` of its tensors

LOWER_PRECISION = "lower_precision_fp"  # float inputs cast to the region's dtype
FP32 = "fp32"  # float inputs cast to fp32
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # an unset `dtype=` set to fp32 (softmax, sum, ...)
FP32_APPEND_DTYPE = "fp32_append_dtype"  # run as the overload taking `dtype=`, set to fp32 (norm)
PROMOTE = "promote"  # float inputs cast to the widest of them and the region's dtype
BANNED = "banned"  # refused, as CUDA's autocast refuses it

_POLICY_OPS = {
  LOWER_PRECISION: """
    _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul
    einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
    _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
    cudnn_convolution_transpose""",
  FP32: """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
    group_norm rms_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
    l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
    soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist
    pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
    upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
    _upsample_bicubic2d_aa""",
  FP32_SET_OPT_DTYPE: """
    prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
    linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList""",
  FP32_APPEND_DTYPE: "norm.Scalar norm.ScalarOpt_dim",
  PROMOTE: "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add",
  BANNED: "binary_cross_entropy",
}

# "name" or "name.overload" (ATen's spelling) → policy; torch 2.13's CUDA lists (see above).
CUDA_POLICY = {name: policy for policy, names in _POLICY_OPS.items() for name in names.split()}

# fp32_append_dtype: the overload each one runs as, with `dtype=torch.float32`.
_WITH_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}

# Torch functions torchax lowers before the dispatcher whose CUDA path is one cast away:
# `F.cross_entropy` is `log_softmax(dtype=fp32)` then an fp32 `nll_loss` under CUDA's autocast,
# `F.interpolate` an fp32 `upsample_*` (its "area" mode is an uncast adaptive average pool).
_FUNCTION_EQUIVALENTS = {"cross_entropy": FP32, "interpolate": FP32}

# Torch functions torchax lowers whole although CUDA's autocast casts their pieces (a matmul
# inside `cov`, `log` and `pow` inside `gaussian_nll_loss`): refused inside a region.
_LOWERED_WHOLE = {"cov", "corrcoef", "linalg_matrix_power", "gaussian_nll_loss", "_sparse_mm"}

_registrations: list = []  # torch.library's registrations live as long as these objects


def register(env) -> None:
  """Autocast regions on `jax` follow `CUDA_POLICY` in `env` (see the module docstring)."""
  _compat.accept_fp32_autocast(_compat.import_torchax())
  _compat.route_torch_functions(env, _on_function, _compat.autocast_key_included)
  if _registrations:
    return
  every_op = torch.library.Library("_", "IMPL")
  every_op.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")  # ops without a policy
  aten = torch.library.Library("aten", "IMPL")
  for name, policy in CUDA_POLICY.items():
    op = _overload(name)
    if op is not None:
      aten.impl(op, _kernel(name, op, policy), "AutocastPrivateUse1")
  _registrations.extend([every_op, aten])


def state() -> tuple[bool, torch.dtype]:
  """Whether autocast on `jax` is on, and its dtype: part of a compiled program's key, as a
  region around a call changes the program traced."""
  return torch.is_autocast_enabled(DEVICE), torch.get_autocast_dtype(DEVICE)


def _overload(name: str):
  base, _, overload = name.partition(".")
  return getattr(getattr(torch.ops.aten, base, None), overload or "default", None)


def _kernel(name, op, policy):
  def autocast_kernel(*args, **kwargs):
    with _autocast_off():
      target, args, kwargs = _cast(op, policy, args, kwargs, name)
      return target(*args, **kwargs)

  return autocast_kernel


@contextlib.contextmanager
def _autocast_off():
  """An op's pieces run without autocast, as CUDA's autocast kernels exclude its key."""
  torch.set_autocast_enabled(DEVICE, False)
  try:
    yield
  finally:
    torch.set_autocast_enabled(DEVICE, True)


def _eligible(x) -> bool:
  """CUDA's test: a floating tensor on the device, not fp64; anything else is left as it is."""
  return (
    isinstance(x, torch.Tensor) and _compat.is_jax_backed(x) and x.is_floating_point() and x.dtype != torch.float64
  )


def _cast_all(tree, dtype):
  return _compat.torch_pytree.tree_map_only(
    torch.Tensor, lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, tree
  )


def _cast(op, policy, args, kwargs, name=None):
  """(the op to run, its args, its kwargs) under `policy` in the current region; `name` is
  the op's `CUDA_POLICY` key."""
  if policy == LOWER_PRECISION:
    return (op, *_cast_all((args, kwargs), torch.get_autocast_dtype(DEVICE)))
  if policy == FP32:
    return (op, *_cast_all((args, kwargs), torch.float32))
  if policy == PROMOTE:
    return (op, *_cast_all((args, kwargs), _promoted(op, (args, kwargs))))
  if policy == BANNED:
    if any(_compat.is_jax_backed(a) for a in args):
      raise TorchOnTpuError(
        f"{op.__name__} is refused inside torch.autocast, as CUDA's autocast refuses it (unsafe "
        f"in low precision); use F.binary_cross_entropy_with_logits on the logits, or compute "
        f"it under torch.autocast('{DEVICE}', enabled=False)."
      )
    return op, args, kwargs
  if not (args and _eligible(args[0])):  # both fp32 dtype policies look at the first input only
    return op, args, kwargs
  if policy == FP32_APPEND_DTYPE:
    return _with_defaults_filled(getattr(op.overloadpacket, _WITH_DTYPE[name]), op, args, kwargs)
  return op, *_dtype_set(op, args, kwargs)  # FP32_SET_OPT_DTYPE


def _promoted(op, tree) -> torch.dtype:
  """CUDA's `promote` rule: fp32 if any input (or the region) is fp32, else the one half type
  they share; bf16 beside fp16 is refused, as CUDA refuses it."""
  dtype = torch.get_autocast_dtype(DEVICE)
  for t in _compat.torch_pytree.tree_leaves(tree):
    if not _eligible(t) or t.dtype == dtype:
      continue
    if torch.float32 not in (dtype, t.dtype):
      raise TorchOnTpuError(
        f"{op.__name__} inside torch.autocast got {dtype} and {t.dtype} together, which CUDA's "
        f"autocast refuses to promote; cast its inputs to one dtype first."
      )
    dtype = torch.float32
  return dtype


def _dtype_set(op, args, kwargs):
  """`dtype=torch.float32` where the call left the op's optional `dtype` unset."""
  position = next(i for i, a in enumerate(_compat.op_schema(op).arguments) if a.name == "dtype")
  if position < len(args):
    if args[position] is None:
      args = (*args[:position], torch.float32, *args[position + 1 :])
    return args, kwargs
  if kwargs.get("dtype") is None:
    kwargs = {**kwargs, "dtype": torch.float32}
  return args, kwargs


def _with_defaults_filled(target, op, args, kwargs):
  """`op`'s call as one of `target`, its overload with `dtype=`: positional defaults written
  out, `dtype=torch.float32`."""
  schema = [a for a in _compat.op_schema(op).arguments if not a.kwarg_only]
  args = (*args, *(a.default_value for a in schema[len(args) :]))
  return target, args, {**kwargs, "dtype": torch.float32}


def _on_function(mode, func, args, kwargs, torchax_call):
  """torchax's function mode: a function it lowers itself gets its policy's casts first."""
  if not torch.is_autocast_enabled(DEVICE) or _compat.registered_op(mode.env, func) is None:
    return torchax_call(args, kwargs)  # reaches the dispatcher, where the kernels apply
  name = getattr(func, "__name__", "")
  if name in _LOWERED_WHOLE:
    raise TorchOnTpuError(
      f"torch.{name} inside torch.autocast('{DEVICE}'): the bridge lowers it whole, so CUDA's "
      f"autocast casts of its pieces cannot be applied; call it under "
      f"torch.autocast('{DEVICE}', enabled=False)."
    )
  policy = _function_policy(name, func, args, kwargs)
  if policy is None:
    return torchax_call(args, kwargs)
  if policy not in (LOWER_PRECISION, FP32, PROMOTE):
    raise TorchOnTpuError(
      f"torch.{name} inside torch.autocast('{DEVICE}') runs a lowering of the whole function "
      f"(an override of it), to which CUDA's {policy} policy cannot be applied; call it under "
      f"torch.autocast('{DEVICE}', enabled=False)."
    )
  with _autocast_off():
    _, args, kwargs = _cast(func, policy, args, kwargs)
    return torchax_call(args, kwargs)


def _function_policy(name, func, args, kwargs):
  """The policy of torch function `func` as CUDA's autocast applies it, or None."""
  if name == "interpolate" and _bound(func, args, kwargs).get("mode") == "area":
    return None
  return _FUNCTION_EQUIVALENTS.get(name) or CUDA_POLICY.get(name)


def _bound(func, args, kwargs) -> dict:
  return inspect.signature(func).bind(*args, **kwargs).arguments
