"""ATen lowerings torchax lacks, registered into its environment at import.

torchax lowers most functional ATen ops but misses some in-place variants that
model init code uses (`erfinv_`, reached from `nn.init.trunc_normal_`). Any
in-place op `aten.X_` whose functional twin `aten.X` has a lowering gets one:
compute `X`, write the result back into the mutated tensor.

`.cpu()` on a jax-backed tensor returns a plain CPU tensor even outside the
torchax environment (torchax only allows it inside), and `.item()`, `float()`
and `int()` give Python numbers, so model outputs and the train step's loss
come back the way torch users expect (the device is waited on only then).

`normal_` is written out: torchax routes it through `aten.normal`, whose
overloads in torch 2.13 no longer accept `(self, mean, std)`, so every
`nn.init.normal_` (HF's default init) fails.

`split` / `split_with_sizes` (a fused QKV projection's `.split`) lower to
`jnp.split`, whose gradient is one concatenate; torchax's per-piece slices
differentiate to a zero-padded full-size array per piece, summed.

Batch norm in training updates `running_mean` / `running_var` in place as
torch does (torchax computes them and drops them, and with the biased
variance): the momentum average with the unbiased batch variance. Under jit
the batch statistics are over the whole global batch, whatever its sharding
(torch's `SyncBatchNorm`, not DDP's per-device statistics).
"""

from __future__ import annotations

import numpy as np
import torch

from torch_on_tpu import _compat
from torch_on_tpu.errors import TorchOnTpuError

torchax = _compat.import_torchax()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torchax.interop import torch_view  # noqa: E402
from torchax.ops import op_base, ops_registry  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402
from torchax.view import View  # noqa: E402


# In-place ops that change the tensor's shape or strides: writing the functional
# result back with copy_ would be wrong, so they are left to torchax.
_SHAPE_CHANGING = {"as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_", "resize_", "set_", "swapdims_", "swapaxes_"}


def _has_lowering(env, packet) -> bool:
  return packet in env._ops or getattr(packet, "default", None) in env._ops


def missing_inplace_variants(env) -> list[tuple[str, object, object]]:
  """(name, in-place packet, functional packet) for each in-place op torchax cannot lower."""
  out = []
  for name in dir(torch.ops.aten):
    if not name.endswith("_") or name.startswith("_") or name.endswith("__"):
      continue
    if name in _SHAPE_CHANGING:
      continue
    inplace = getattr(torch.ops.aten, name, None)
    functional = getattr(torch.ops.aten, name[:-1], None)
    if inplace is None or functional is None:
      continue
    if _has_lowering(env, inplace) or env._decomps.get(getattr(inplace, "default", None)):
      continue
    if _has_lowering(env, functional):
      out.append((name, inplace, functional))
  return out


def _normal_(self, mean=0.0, std=1.0, *, generator=None, env=None):
  target = self.torch() if isinstance(self, View) else self
  key = env.get_and_rotate_prng_key(generator)
  dtype = target.jax().dtype
  sample = jax.random.normal(key, tuple(target.shape)) * std + mean
  if isinstance(self, View):
    self.update(env.j2t_iso(sample.astype(dtype)))
  else:
    self._elem = sample.astype(dtype)
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


def _batch_norm(input, weight, bias, running_mean, running_var, training=False, momentum=0.1, eps=1e-5):
  """`aten.native_batch_norm` with torch's in-place running-statistics update."""
  from torchax.ops import jaten

  x = input.jax()
  view = lambda t: None if t is None else t.jax()  # noqa: E731
  out = jaten._aten__native_batch_norm_legit(
    x, view(weight), view(bias), view(running_mean), view(running_var), training, momentum, eps
  )
  if training and running_mean is not None:
    axes = (0, *range(2, x.ndim))
    count = x.size // x.shape[1]
    mean = jnp.mean(x, axis=axes)
    unbiased = jnp.var(x, axis=axes) * (count / max(count - 1, 1))
    for stat, batch in ((running_mean, mean), (running_var, unbiased)):
      old = stat.jax()
      stat._elem = ((1 - momentum) * old + momentum * batch).astype(old.dtype)
  return tuple(torch_view(o) for o in out)


def register(env) -> list[str]:
  """Registers the missing lowerings into `env`; returns the in-place ops added."""
  env._ops[torch.ops.aten.normal_] = ops_registry.Operator(
    torch.ops.aten.normal_,
    _normal_,
    is_jax_function=False,
    is_user_defined=False,
    needs_env=True,
    is_view_op=True,
  )
  # torch's device-side assert (torchtitan's RoPE bounds check on `positions`):
  # jax has no asynchronous device assert, so the check is skipped.
  env._ops[torch.ops.aten._assert_async] = ops_registry.Operator(
    torch.ops.aten._assert_async,
    lambda *args, **kwargs: None,
    is_jax_function=True,
    is_user_defined=False,
    needs_env=False,
    is_view_op=False,
  )
  for packet in (torch.ops.aten.split, torch.ops.aten.split_copy, torch.ops.aten.split_with_sizes):
    env._ops[packet] = ops_registry.Operator(
      packet, _split, is_jax_function=True, is_user_defined=False, needs_env=False, is_view_op=False
    )
  for packet in (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default):
    env._ops[packet] = ops_registry.Operator(
      packet, _batch_norm, is_jax_function=False, is_user_defined=False, needs_env=False, is_view_op=False
    )
  TorchaxTensor.cpu = _to_host
  TorchaxTensor.item = _item
  TorchaxTensor.__float__ = lambda self: float(_item(self))
  TorchaxTensor.__int__ = lambda self: int(_item(self))
  added = []
  for name, inplace, functional in missing_inplace_variants(env):
    op = ops_registry.Operator(
      inplace,
      op_base.InplaceOp(functional),
      is_jax_function=False,
      is_user_defined=False,
      needs_env=False,
      is_view_op=True,
    )
    env._ops[inplace] = op
    added.append(name)
  return added


def _item(self):
  """`.item()` on a jax-backed tensor, inside torchax's environment or not."""
  return np.asarray(jax.device_get(self.jax())).item()


def _to_host(self, *args, **kwargs):
  """`.cpu()` on a jax-backed tensor outside torchax's environment: a plain CPU copy."""
  from torch_on_tpu.module import to_cpu

  return to_cpu(self)
