"""What model code and training need from ATen that torchax lacks or lowers wrongly.

torchax lowers most functional ATen ops but misses some in-place variants that
model init code uses (`erfinv_`, reached from `nn.init.trunc_normal_`), and lowers others
through decompositions that write into a copy of a view (`x[a:b].masked_fill_(m, v)` left `x`
unchanged). Any such in-place op `aten.X_` whose functional twin `aten.X` has a lowering gets
one: compute `X`, write the result back into the mutated tensor, or through the view into its base.

`.cpu()` on a jax-backed tensor returns a plain CPU tensor even outside the
torchax environment (torchax only allows it inside), `.item()`, `float()`
and `int()` give Python numbers, and `print` shows torch's own form
(`tensor(5.8658, device='jax')`), so model outputs and the train step's loss
come back the way torch users expect (the device is waited on only then).

`normal_` is written out: torchax routes it through `aten.normal`, whose
overloads in torch 2.13 no longer accept `(self, mean, std)`, so every
`nn.init.normal_` (HF's default init) fails.

`split` / `split_with_sizes` (a fused QKV projection's `.split`) lower to
`jnp.split`, whose gradient is one concatenate; torchax's per-piece slices
differentiate to a zero-padded full-size array per piece, summed.

`embedding` and `_embedding_bag` are written out. torchax drops the padding
row's gradient with `grad.at[padding_idx].set(0)`, a single-index scatter that
XLA miscompiles when the table is sharded (see `xla_flags.compile_options`): the
pad token's gradient lands on the first row of every other vocabulary shard.
Here the pad positions' cotangents are masked before the scatter-add instead,
which is what torch's `embedding_backward` does (it skips them), and
`scale_grad_by_freq`, which torchax ignores, divides each row's gradient by the
id's count in the batch. torchax's `_embedding_bag` reads the offsets on the
host (no jit); ours segments the bags with traced offsets.

`_grouped_mm` (the grouped GEMM transformers 5 runs mixture-of-experts
experts through) lowers to `ragged.ragged_matmul` (`jax.lax.ragged_dot` on
TPU): one static-shape program for any routing, dropless, its gradient ragged
too. Rows past the last group (torch leaves them unwritten) come out zero.

`torch.take_along_dim` is lowered as a torch function: torch checks its index
for int64 before dispatching, and ids are int32 jax arrays here. Along a `dim`
it takes indices modulo the dimension's size, as torch does (-1 is the last,
and so is -6 of 5); without one, an index outside the flattened tensor raises
in torch and is refused here.

Batch norm in training updates `running_mean` / `running_var` in place as
torch does (torchax computes them and drops them, and with the biased
variance): the momentum average with the unbiased batch variance. Under jit
the batch statistics are over the whole global batch, whatever its sharding
(torch's `SyncBatchNorm`, not DDP's per-device statistics).

On CPU, `F.linear` runs a kernel whose weight gradient XLA CPU lays out well
(`cpu_linear`): ShardedModule enters it around every trace of the model, so
its forward and the train step both get it. It is installed per trace, not at
import, because it depends on the mesh's platform; a user's own override of
`F.linear` (`tot.override_op`) is left in place.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import device_checks, float8, host, op_table, ragged
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.lowering.aten import factories, low_precision

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from torchax.interop import torch_view  # noqa: E402
from torchax.ops import mappings, op_base  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402
from torchax.view import View  # noqa: E402

# In-place ops that change the tensor's shape or strides: writing the functional
# result back with copy_ would be wrong, so they are left to torchax.
_SHAPE_CHANGING = {"as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_", "resize_", "set_", "swapdims_", "swapaxes_"}


def inplace_variants(env) -> list[tuple[str, object, object]]:
  """(name, in-place overload, functional twin) for each in-place op torchax cannot lower, or
  lowers through a decomposition: one that runs on a copy of a view, so `x[a:b].masked_fill_(m, v)`
  (GraniteSpeech's conformer), `.zero_()` or `.addcmul_()` on a slice left `x` as it was."""
  out = []
  for name in dir(torch.ops.aten):
    if not name.endswith("_") or name.startswith("_") or name.endswith("__") or name in _SHAPE_CHANGING:
      continue
    inplace = getattr(torch.ops.aten, name, None)
    functional = getattr(torch.ops.aten, name[:-1], None)
    if inplace is None or functional is None or _compat.has_lowering(env, inplace):
      continue
    for overload in inplace.overloads():
      target, twin = getattr(inplace, overload), getattr(functional, overload, None)
      if _compat.registered_op(env, target) is None and _same_arguments(target, twin) and _lowered_or_decomposed(env, twin):
        out.append((name, target, twin))
  return out


def _same_arguments(inplace, functional) -> bool:
  if functional is None:
    return False
  spell = lambda op: [(a.name, str(a.type), a.kwarg_only) for a in _compat.op_schema(op).arguments]  # noqa: E731
  return spell(inplace) == spell(functional)


def _lowered_or_decomposed(env, op) -> bool:
  packet = op.overloadpacket
  return _compat.registered_op(env, op) is not None or _compat.has_lowering(env, packet) or _compat.decomposition(op) is not None


def _normal_(self, mean=0.0, std=1.0, *, generator=None, env=None):
  target = self.torch() if isinstance(self, View) else self
  key = env.get_and_rotate_prng_key(generator)
  dtype = target.jax().dtype
  sample = jax.random.normal(key, tuple(target.shape)) * std + mean
  if isinstance(self, View):
    self.update(env.j2t_iso(sample.astype(dtype)))
  else:
    _compat.set_array(self, sample.astype(dtype))
  return self


def _split(x, sizes, dim=0):
  """torch.split on a jax array: `sizes` is a piece length (last piece may be shorter) or a list."""
  length = x.shape[dim]
  if isinstance(sizes, int):
    sizes = [sizes] * -(-length // sizes)
  elif sum(sizes) != length:
    raise TorchOnTpuError(
      f"split sizes {list(sizes)} sum to {sum(sizes)}, but dimension {dim} has size {length}; "
      "give sizes that add up to it (as torch.split requires)."
    )
  return jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=dim)


@jax.custom_jvp
def _scale_gradient(x, scale):
  """`x`, whose gradient is multiplied by `scale` (a constant, broadcast against x)."""
  return x


@_scale_gradient.defjvp
def _scale_gradient_jvp(primals, tangents):
  x, scale = primals
  return x, tangents[0] * jax.lax.stop_gradient(scale).astype(tangents[0].dtype)


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
  """torch's `aten.embedding`: rows of `weight`; pad ids get no gradient; an id past the
  table raises (`device_checks`)."""
  device_checks.index_in_range(indices, weight.shape[0], what=f"embedding (a table of {weight.shape[0]} rows)")
  rows = jnp.take(weight, indices, axis=0)
  if padding_idx is not None and padding_idx >= 0:
    keep = (indices != padding_idx)[..., None]
    rows = jnp.where(keep, rows, jax.lax.stop_gradient(rows))
  if scale_grad_by_freq:
    counts = jnp.zeros(weight.shape[0], jnp.int32).at[indices.reshape(-1)].add(1)
    rows = _scale_gradient(rows, 1.0 / jnp.maximum(counts[indices], 1)[..., None])
  return rows


_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _embedding_bag(
  weight,
  indices,
  offsets,
  scale_grad_by_freq=False,
  mode=_BAG_SUM,
  sparse=False,
  per_sample_weights=None,
  include_last_offset=False,
  padding_idx=-1,
):
  """torch's `aten._embedding_bag` with traced offsets: `(output, offset2bag, bag_size, max_indices)`.

  Bag b holds `indices[offsets[b]:offsets[b + 1]]` (the last one runs to the
  end unless `include_last_offset`); pad ids take no part in any bag; an empty
  bag gives zeros, as in torch.
  """
  if padding_idx is None:
    padding_idx = -1
  num_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
  positions = jnp.arange(indices.shape[0])
  bag = jnp.searchsorted(offsets[:num_bags], positions, side="right") - 1
  if include_last_offset:
    bag = jnp.where(positions < offsets[-1], bag, num_bags)
  counted = indices != padding_idx
  bag = jnp.where(counted & (bag >= 0), bag, num_bags)  # num_bags: dropped by the segment ops
  rows = _embedding(weight, indices, padding_idx, scale_grad_by_freq)
  bag_size = jax.ops.segment_sum(jnp.ones_like(indices), bag, num_segments=num_bags)
  empty = (bag_size == 0)[:, None]
  if mode == _BAG_MAX:
    output = jax.ops.segment_max(rows, bag, num_segments=num_bags)
    output = jnp.where(empty, jnp.zeros_like(output), output)
    is_max = (rows == output[jnp.minimum(bag, num_bags - 1)]) & (bag < num_bags)[:, None]
    max_indices = jax.ops.segment_max(
      jnp.where(is_max, indices[:, None], -1), bag, num_segments=num_bags
    )
    max_indices = jnp.where(empty, -1, max_indices)
  else:  # a bf16 table's bags summed in fp32 and rounded, then averaged and rounded, as torch's kernel
    accumulated = rows.astype(low_precision.accumulator(rows))
    if per_sample_weights is not None:
      accumulated = accumulated * per_sample_weights[:, None].astype(accumulated.dtype)
    output = jax.ops.segment_sum(accumulated, bag, num_segments=num_bags).astype(rows.dtype)
    if mode == _BAG_MEAN:
      output = output / jnp.maximum(bag_size, 1)[:, None].astype(output.dtype)
    max_indices = jnp.zeros_like(bag_size)
  offset2bag = jnp.minimum(bag, num_bags - 1).astype(indices.dtype)
  return output, offset2bag, bag_size.astype(indices.dtype), max_indices.astype(indices.dtype)


def _take_along_dim(x, indices, dim=None):
  """Without `dim`, torch gathers from the flattened tensor and raises on an index outside it;
  along a `dim` it takes every index modulo that dimension's size (so -1 is the last)."""
  size = x.size if dim is None else x.shape[dim]
  if dim is None or size == 0:
    device_checks.index_in_range(indices, size, what=f"take_along_dim (a dimension of size {size})")
  if dim is None:
    return jnp.take_along_axis(x.reshape(-1), indices.reshape(-1), axis=0)
  return jnp.take_along_axis(x, indices % size if size else indices, axis=dim)


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
  """torch's `_grouped_mm` in the form MoE experts use: 2-D `mat_a` whose row group g
  (groups ending at the cumulative `offs`) is multiplied by `mat_b[g]` of a 3-D `mat_b`."""
  if not (mat_a.ndim == 2 and mat_b.ndim == 3 and offs is not None):
    raise TorchOnTpuError(
      f"_grouped_mm of a {mat_a.ndim}-D by a {mat_b.ndim}-D tensor "
      f"{'with' if offs is not None else 'without'} offs is not lowered; only the 2-D × 3-D form "
      f"with offs (mixture-of-experts layers) is."
    )
  dtype = mappings.t2j_dtype(out_dtype) if out_dtype is not None else mat_a.dtype
  sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)
  if bias is None:  # the kernels accumulate in fp32 and round once to `dtype`, as torch's does
    return ragged.ragged_matmul(mat_a, mat_b, sizes, preferred_element_type=dtype)
  out = ragged.ragged_matmul(mat_a, mat_b, sizes, preferred_element_type=jnp.promote_types(dtype, jnp.float32))
  return (out + bias).astype(dtype)


def _scatter_value(prior):
  """`scatter(dim, index, value)` of one value as a mask over the scattered dim: position j of a
  row takes `value` where the row's indices hold j. torchax's scatter (`prior`) addresses every
  element by computed coordinates, which XLA's partitioner cannot split along a batch-sharded dim:
  it gathered the whole operand to every device (torchtitan's MoE routing map, [batch, seq,
  experts], once per layer). Where the index does not span the other dims, or `reduce` is given,
  `prior` runs."""

  def lowered(x, dim, index, value, reduce=None):
    dim = dim % x.ndim if x.ndim else 0
    others = [d for d in range(x.ndim) if d != dim]
    if reduce is not None or index.ndim != x.ndim or any(index.shape[d] != x.shape[d] for d in others):
      return prior(x, dim, index, value, reduce)
    size = x.shape[dim]
    device_checks.index_in_range(index, size, what=f"scatter (a dimension of size {size})")
    hits = jnp.moveaxis(index, dim, -1)[..., None] == jnp.arange(size)  # [..., k, size]
    mask = jnp.moveaxis(hits.any(axis=-2), -1, dim)
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)

  return lowered


def cpu_linear(mesh):
  """While active on a CPU mesh, `F.linear` runs `_linear` (see there); elsewhere,
  or where the user overrides `F.linear`, a no-op."""
  overridden = _compat.overridden_by_user(_compat.torchax_env(), torch.nn.functional.linear)
  if mesh.devices.flat[0].platform != "cpu" or overridden:
    return contextlib.nullcontext()
  return op_table.bridge_overrides({torch.nn.functional.linear: _linear_with_bias}, is_jax_function=True)


def _linear_with_bias(x, weight, bias=None):
  """`x @ weight.T + bias` accumulated in `low_precision.accumulator` and rounded once, as
  torch's addmm (cuBLAS's bias epilogue likewise): a bf16 bias add after a rounded product
  would round twice."""
  out = _linear(x, weight)
  if bias is not None:
    out = out + bias.astype(out.dtype)
  return checkpoint_name(out.astype(jnp.result_type(x, weight)), remat_lib.MATMUL_NAME)


@jax.custom_vjp
def _linear(x, weight):
  """`x @ weight.T`, whose weight gradient contracts the tokens as `[in, tokens] @ [tokens, out]`.

  Differentiating the einsum gives `dW = dYᵀ·X`, for which XLA CPU transposes
  dY inside the elementwise fusion that produces it (a strided, slow loop);
  written this way it transposes the activation X and the small result
  instead (CHANGELOG.md has the measurements).
  """
  return jnp.einsum("...a,ba->...b", x, weight, preferred_element_type=low_precision.accumulator(x, weight))


def _linear_fwd(x, weight):
  return _linear(x, weight), (x, weight)


def _linear_bwd(residuals, grad):
  x, weight = residuals
  dx = jnp.einsum("...b,ba->...a", grad, weight)
  x2 = x.reshape(-1, x.shape[-1])
  g2 = grad.reshape(-1, grad.shape[-1])
  dw = (x2.T @ g2).T
  return dx.astype(x.dtype), dw.astype(weight.dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


def _register_jax_lowering(env, packet, fn) -> None:
  _compat.set_op(env, packet, _compat.make_operator(packet, fn, jax_function=True))


def _batch_norm(input, weight, bias, running_mean, running_var, training=False, momentum=0.1, eps=1e-5):
  """`aten.native_batch_norm` with torch's in-place running-statistics update."""
  x = input.jax()
  view = lambda t: None if t is None else t.jax()  # noqa: E731
  untracked = running_mean is None  # (training only: torchax's formula wants statistics to update)
  out = _compat.torchax_batch_norm(
    x, view(weight), view(bias), jnp.zeros(x.shape[1], x.dtype) if untracked else view(running_mean),
    jnp.ones(x.shape[1], x.dtype) if untracked else view(running_var), training, momentum, eps
  )
  if training and running_mean is not None:
    axes = (0, *range(2, x.ndim))
    count = x.size // x.shape[1]
    mean = jnp.mean(x, axis=axes)
    unbiased = jnp.var(x, axis=axes) * (count / max(count - 1, 1))
    for stat, batch in ((running_mean, mean), (running_var, unbiased)):
      old = stat.jax()
      _compat.set_array(stat, ((1 - momentum) * old + momentum * batch).astype(old.dtype))
  # the saved mean and inverse deviation carry no gradient in torch's autograd
  out = (out[0], *(None if o is None else jax.lax.stop_gradient(o) for o in out[1:]))
  return tuple(torch_view(o) for o in out)


def _batch_norm_without_running_stats(input, weight, bias, training, momentum, eps):
  """`aten._native_batch_norm_legit.no_stats` (`track_running_stats=False`): the batch norm above,
  whose saved statistics likewise carry no gradient (torch's decomposition would let them)."""
  return _batch_norm(input, weight, bias, None, None, training, momentum, eps)


def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
  """`aten._batch_norm_with_update` (what `F.batch_norm` in training reaches through export
  paths): the training batch norm above, and an empty reserve as on CPU."""
  out, mean, rstd = _batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
  return out, mean, rstd, torch_view(jnp.zeros((0,), jnp.uint8))


def register(env) -> list[str]:
  """Registers the missing lowerings into `env`; returns the in-place ops added."""
  _compat.set_op(
    env,
    torch.ops.aten.normal_,
    _compat.make_operator(torch.ops.aten.normal_, _normal_, jax_function=False, needs_env=True, view_op=True),
  )
  # torch's device-side assert (torchtitan's RoPE bounds check on `positions`):
  # jax has no asynchronous device assert, so the check is skipped.
  _register_jax_lowering(env, torch.ops.aten._assert_async, lambda *args, **kwargs: None)
  for packet in (torch.ops.aten.split, torch.ops.aten.split_copy, torch.ops.aten.split_with_sizes):
    _register_jax_lowering(env, packet, _split)
  _register_jax_lowering(env, torch.ops.aten.embedding, _embedding)
  for packet in (torch.ops.aten._embedding_bag, torch.ops.aten._embedding_bag_forward_only):
    _register_jax_lowering(env, packet, _embedding_bag)
  _register_jax_lowering(env, torch.ops.aten._grouped_mm, _grouped_mm)
  _register_jax_lowering(env, torch.ops.aten.scatter.value, _scatter_value(_compat.registered_op(env, torch.ops.aten.scatter.value).func))
  float8.register(env)  # the scaled (float8) matmuls
  for function in (torch.take_along_dim, torch.Tensor.take_along_dim):
    _register_jax_lowering(env, function, _take_along_dim)
  for packet in (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default):
    _compat.set_op(env, packet, _compat.make_operator(packet, _batch_norm, jax_function=False))
  packet = torch.ops.aten._native_batch_norm_legit.no_stats
  _compat.set_op(env, packet, _compat.make_operator(packet, _batch_norm_without_running_stats, jax_function=False))
  packet = torch.ops.aten._batch_norm_with_update.default
  _compat.set_op(env, packet, _compat.make_operator(packet, _batch_norm_with_update, jax_function=False))
  TorchaxTensor.cpu = _to_host
  TorchaxTensor.__torch_dispatch__ = classmethod(_outside_the_environment)
  TorchaxTensor.type_as = _type_as
  TorchaxTensor.item = _item
  TorchaxTensor.__float__ = lambda self: float(_item(self))
  TorchaxTensor.__int__ = lambda self: int(_item(self))
  TorchaxTensor.__repr__ = TorchaxTensor.__str__ = _repr
  added = []
  for name, inplace, functional in inplace_variants(env):
    _compat.set_op(env, inplace, _compat.make_operator(inplace, op_base.InplaceOp(functional), jax_function=False, view_op=True))
    added.append(name)
  return added


_TORCHAX_DISPATCH = TorchaxTensor.__dict__["__torch_dispatch__"].__func__


def _outside_the_environment(cls, func, types, args=(), kwargs=None):
  """Torch math on jax-backed tensors outside torchax's environment (a `ShardedModule`'s outputs in
  a user's script: `jm(x).logits * 2`, a loss against CPU labels) computed in it, on the device:
  torchax raises an AssertionError there. CPU tensors it meets go to the device, as torchax does
  for tensors made inside; an op that gives a Python value (`torch.allclose`) gives one; an output
  whose program's index check failed raises that first."""
  if func in (torch.ops._c10d_functional.wait_tensor.default, torch.ops.prim.device.default):
    return _TORCHAX_DISPATCH(cls, func, types, args, kwargs)
  leaves = _compat.torch_pytree.tree_leaves((args, kwargs))
  jax_backed = [t for t in leaves if _compat.is_jax_backed(t)]
  for t in jax_backed:
    device_checks.raise_pending(t)
  env = _compat.tensor_env(jax_backed[0])
  with env:
    args, kwargs = _compat.torch_pytree.tree_map_only(torch.Tensor, env.to_xla, (args, kwargs or {}))
    out = func(*args, **kwargs)
  returns = [str(r.type) for r in _compat.op_schema(func).returns]
  if returns in (["bool"], ["int"], ["float"], ["Scalar"]) and _compat.is_jax_backed(out):  # torch.allclose, torch.equal
    return _item(out)
  return out


def _item(self):
  """`.item()` on a jax-backed tensor, inside torchax's environment or not (a failed
  index check of the program that made it is raised first)."""
  device_checks.raise_pending(self)
  return np.asarray(jax.device_get(self.jax())).item()


def _type_as(self, other):
  """torch's `type_as`: a copy in `other`'s dtype (torchax's own casts the tensor in place,
  and fails when `other` is a view, as RoPE's output is in torchtitan's Qwen3.5)."""
  return self.to(other.dtype)


def _repr(self) -> str:
  """torch's repr of the values, marked as living on a jax device; an array other
  processes hold parts of is described, not gathered."""
  array = self.jax()
  if isinstance(array, jax.core.Tracer):  # inside a trace (an error message naming the tensor): no values yet
    return f"tensor(<traced {array.dtype}{list(array.shape)}>, device='jax')"
  if not array.is_fully_addressable:
    return f"tensor(<{array.dtype}{list(array.shape)} over {len(array.sharding.device_set)} devices>, device='jax')"
  text = repr(_to_host(self))
  return f"{text[:-1]}, device='jax')"


def _to_host(self, *args, **kwargs):
  """`.cpu()` on a jax-backed tensor: a plain CPU copy, except in traced model code,
  where the CPU means the device (`factories`)."""
  if factories.cpu_means_device():
    return self
  device_checks.raise_pending(self)
  return host.to_cpu(self)
