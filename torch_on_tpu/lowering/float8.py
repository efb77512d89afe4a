"""float8 training the PyTorch way: torchao's `Float8Linear` on XLA's fp8 matmuls.

A model converted by torchao (`convert_to_float8_training`) or by torchtitan's
float8 converter runs unmodified: torchao's own code computes the amax, the
scales and the float8 casts; what reaches the bridge is

- `aten._scaled_mm` (torchao's hardware path, `emulate=False`), lowered here to
  one `dot_general` on the `float8_e4m3fn` / `float8_e5m2` operands with fp32
  accumulation and the scales applied to the fp32 result as torch applies them
  (tensorwise: two scalars; rowwise: a column of row scales times a row of
  column scales), then the bias, then the output dtype;
- `aten._scaled_grouped_mm`, the grouped form (2-D tokens × 3-D experts with
  group offsets, or 2-D × 2-D for a weight gradient), lowered the same way per
  group;
- torchao's float8 linear `autograd.Function`, run with its own backward
  (`autograd_functions`, as every Function under the bridge): the gradient is cast to float8 with torchao's scales
  and both backward matmuls are `_scaled_mm`s too (jax differentiating the
  forward would not do that);
- torchao's `Float8TrainingTensor` (the float8 data and its scale, a tensor
  subclass), whose handler runs inside torchax's modes (`_compat`).

The recipe side (`convert`) swaps a model's linears the way torchtitan does:
every `Linear` whose dims are multiples of 16, except the skipped names (the
output head by default). Weights stay high-precision parameters under their
own names: float8 is a compute format, checkpoints and exports do not change.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu.core import _compat, extras
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import ragged

# torchao's float8 recipes (Float8LinearRecipeName) the bridge runs exactly.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# Modules kept in high precision unless the user says otherwise: the output head
# (torchtitan's `lm_head`, HF's `lm_head`), as torchtitan's large configs do.
DEFAULT_SKIP = ("lm_head",)
# Matmul dims float8 kernels need (torchtitan's filter: both dims multiples of 16).
ALIGNMENT = 16

_FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
# Output dtypes a scaled matmul may ask for (its `out_dtype` arrives as a torch dtype).
_OUT_DTYPES = {
  torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
  torch.float8_e4m3fn: jnp.float8_e4m3fn, torch.float8_e5m2: jnp.float8_e5m2,
}


def _refuse_operands(op: str, a, b):
  if a.dtype not in _FP8 or b.dtype not in _FP8:
    raise TorchOnTpuError(
      f"torch.{op} of {a.dtype} × {b.dtype} is not lowered; only float8_e4m3fn / float8_e5m2 operands "
      f"are (the fnuz float8 types and MX formats are not: use a torchao float8 recipe, {', '.join(RECIPES)})."
    )


def _out_dtype(op: str, out_dtype, a):
  dtype = _OUT_DTYPES.get(out_dtype, out_dtype) if out_dtype is not None else a.dtype
  if dtype in _FP8:
    raise TorchOnTpuError(
      f"torch.{op} with a float8 output is not lowered; pass out_dtype=torch.bfloat16 or torch.float32 "
      f"(torchao's float8 training does)."
    )
  return dtype


def _scales(op: str, scale, rows: int, axis: int):
  """A scale as an fp32 array broadcasting against the (rows, cols) result: a scalar
  (tensorwise) or one value per row (axis 0) / column (axis 1) of the result."""
  scale = scale.astype(jnp.float32)
  if scale.size == 1:
    return scale.reshape(())
  if scale.size == rows and (scale.ndim == 1 or scale.shape[1 - axis] == 1):
    return scale.reshape((rows, 1) if axis == 0 else (1, rows))
  raise TorchOnTpuError(
    f"torch.{op} with a scale of shape {tuple(scale.shape)} is not lowered; only tensorwise (one value) and "
    f"rowwise (one per row of the left operand, one per column of the right) scales are, as torchao's "
    f"{', '.join(RECIPES)} recipes use (blockwise and MX scales are not)."
  )


def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
  """torch's `_scaled_mm`: `(a @ b) * scale_a * scale_b + bias` from an fp32 accumulation.

  `use_fast_accum` asks cuBLAS for a cheaper accumulation; XLA accumulates in
  fp32 either way (the exact answer, at most a few ulps from cuBLAS's).
  """
  _refuse_operands("_scaled_mm", a, b)
  if scale_result is not None:
    raise TorchOnTpuError("torch._scaled_mm with scale_result (a float8 output) is not lowered; leave it None.")
  dtype = _out_dtype("_scaled_mm", out_dtype, a)
  acc = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  out = acc * _scales("_scaled_mm", scale_a, a.shape[0], 0) * _scales("_scaled_mm", scale_b, b.shape[1], 1)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  return out.astype(dtype)


def _scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
  """torch's `_scaled_grouped_mm` in the two forms MoE training uses, rowwise-scaled:

  - 2-D `a` (tokens, K) × 3-D `b` (groups, K, N), `offs` the cumulative row
    counts per group; `scale_a` one value per token row, `scale_b` (groups, N);
  - 2-D `a` (M, tokens) × 2-D `b` (tokens, N), `offs` cutting the shared token
    dim into groups (a weight gradient); result (groups, M, N), `scale_a`
    (groups·M) and `scale_b` (groups·N), group-major (torch's meta checks give
    the sizes; torch has no CPU kernel to compare with, so the tests compare
    each group with a `_scaled_mm` of its own).
  """
  op = "_scaled_grouped_mm"
  _refuse_operands(op, a, b)
  if scale_result is not None or bias is not None or offs is None:
    raise TorchOnTpuError(
      f"torch.{op} is lowered with offs and without bias or scale_result (the forms MoE training uses); "
      f"pass offs and add any bias afterwards."
    )
  dtype = _out_dtype(op, out_dtype, a)
  ends = offs.astype(jnp.int32)
  sizes = jnp.diff(ends, prepend=0)
  if a.ndim == 2 and b.ndim == 3:
    acc = ragged.ragged_matmul(a, b, sizes, preferred_element_type=jnp.float32)
    groups, n = b.shape[0], b.shape[2]
    row_group = jnp.searchsorted(ends, jnp.arange(a.shape[0]), side="right")
    col_scales = scale_b.astype(jnp.float32).reshape(groups, n)
    col = col_scales[jnp.minimum(row_group, groups - 1)]
    out = acc * scale_a.astype(jnp.float32).reshape(-1, 1) * col
    out = jnp.where((row_group < groups)[:, None], out, 0.0)
    return out.astype(dtype)
  if a.ndim == 2 and b.ndim == 2:
    groups = offs.shape[0]
    token_group = jnp.searchsorted(ends, jnp.arange(a.shape[1]), side="right")
    one_hot = (token_group[None, :] == jnp.arange(groups)[:, None]).astype(a.dtype)  # (groups, tokens)
    acc = jnp.einsum(
      "mt,gt,tn->gmn", a, one_hot, b, preferred_element_type=jnp.float32
    )
    out = acc * scale_a.astype(jnp.float32).reshape(groups, -1, 1) * scale_b.astype(jnp.float32).reshape(groups, 1, -1)
    return out.astype(dtype)
  raise TorchOnTpuError(
    f"torch.{op} of a {a.ndim}-D by a {b.ndim}-D tensor is not lowered; only 2-D × 3-D (tokens × experts) "
    f"and 2-D × 2-D (a weight gradient) are."
  )


def register(env) -> None:
  """Lowers the scaled matmuls into torchax's environment `env`."""
  for packet, fn in ((torch.ops.aten._scaled_mm, _scaled_mm), (torch.ops.aten._scaled_grouped_mm, _scaled_grouped_mm)):
    _compat.set_op(env, packet, _compat.make_operator(packet, fn, jax_function=True))


# ---- what the bridge cannot run: refused before anything is built -------------------------

# torchao / torchtitan low-precision training the bridge does not lower, by class name (no
# import): why, and what to do instead.
_MX = "torchao's MX formats (MXFP8/MXFP4: block scales of 32 in e8m0) are not lowered; train these linears in bf16 or with a float8 recipe"
_NVFP4 = "the NVFP4 format is not lowered; train these linears in bf16 or with a float8 recipe"
_UNSUPPORTED = {
  "TrainingWeightWrapperBaseTensor": (
    "torchao's float8/MX grouped-experts training (torchtitan's Float8GroupedExperts) quantizes with Triton "
    "kernels that only run on CUDA, from a weight subclass the bridge's arrays do not keep; train the experts in bf16"
  ),
  "WeightWithDynamicFloat8CastTensor": (
    "torchao's float8 all-gather is a torch FSDP2 feature and the bridge's FSDP is XLA's; convert with "
    "enable_fsdp_float8_all_gather=False (the same numerics)"
  ),
  "MXTensor": _MX, "MXLinear": _MX, "MXFP8Linear": _MX, "NVFP4Tensor": _NVFP4, "NVFP4Linear": _NVFP4,
}


def prepare(module: torch.nn.Module) -> None:
  """Before a model is wrapped: one sentence for low-precision training the bridge would not
  compute as torch does; where torchao's `Float8Linear` is used, its float8 tensors compute
  inside torchax (its float8 matmul runs its own backward, as every `autograd.Function` does)."""
  uses_float8_linear = False
  for name, obj in [*module.named_modules(), *module.named_parameters()]:
    for cls in type(obj).__mro__:
      library = cls.__module__.split(".")[0]
      if cls.__name__ in _UNSUPPORTED and library in ("torchao", "torchtitan"):
        raise TorchOnTpuError(f"'{name or type(module).__name__}' is {type(obj).__name__}: {_UNSUPPORTED[cls.__name__]}.")
      uses_float8_linear |= cls.__module__ == "torchao.float8.float8_linear" and cls.__name__ == "Float8Linear"
  if uses_float8_linear:
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    _compat.dispatch_inside_torchax(Float8TrainingTensor)


# ---- the recipe side: which linears compute in float8 -------------------------------------


def check_recipe(recipe: str) -> None:
  if recipe not in RECIPES:
    raise TorchOnTpuError(
      f"float8 recipe {recipe!r} is not one the bridge runs; choose one of {', '.join(RECIPES)} "
      f"(torchao's Float8LinearRecipeName; MX formats are not lowered)."
    )


def converts(fqn: str, in_features: int, out_features: int, skip=DEFAULT_SKIP) -> bool:
  """torchtitan's float8 module filter: both dims multiples of 16 and no skipped name in the path."""
  aligned = in_features % ALIGNMENT == 0 and out_features % ALIGNMENT == 0
  return aligned and not any(name in fqn for name in skip)


def _torchao_float8():
  return extras.require("torchao.float8", "float8 training")  # its import-time noise: core.dependency_noise


def torchao_config(recipe: str, *, emulate: bool = False):
  """torchao's `Float8LinearConfig` for a recipe name."""
  check_recipe(recipe)
  config = _torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
  return dataclasses.replace(config, emulate=emulate) if emulate else config


def convert(target, recipe: str, skip=DEFAULT_SKIP, *, emulate: bool = False):
  """`target` with its linears computing in float8 (`recipe`), the way torchtitan converts.

  `target` is a torchtitan model config (converted with torchtitan's own
  `Float8LinearConverter`, before the model is built) or any built
  `nn.Module` (torchao's `convert_to_float8_training`, in place). Linears with
  a dim not a multiple of 16 or a `skip` name in their path stay as they are.
  """
  config = torchao_config(recipe, emulate=emulate)
  if hasattr(target, "traverse"):  # a torchtitan config tree
    quantization = extras.require("torchtitan.components.quantization", "float8 training of torchtitan models")
    # emulate=True only gets past the converter's GPU check; the recipe's config replaces its own.
    converter = quantization.Float8LinearConverter(
      quantization.Float8LinearConverter.Config(emulate=True, filter_fqns=list(skip))
    )
    converter.torchao_config = config
    return converter.convert(target)
  if not isinstance(target, torch.nn.Module):
    raise TorchOnTpuError(
      f"float8.convert takes a torchtitan model config or a torch.nn.Module, got {type(target).__name__}."
    )
  if type(target).__module__.startswith("torchtitan."):
    raise TorchOnTpuError(
      "A built torchtitan model converts to float8 at its config, before it is built (its Linears carry "
      "torchtitan's init): pass the model config to float8.convert, or use --float8 in recipes.llama3."
    )
  return _torchao_float8().convert_to_float8_training(
    target, config=config, module_filter_fn=lambda m, fqn: converts(fqn, m.in_features, m.out_features, skip)
  )
