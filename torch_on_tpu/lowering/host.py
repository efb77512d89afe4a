"""Host transfers: torch CPU tensors ⇄ numpy ⇄ jax arrays, for every module that crosses.

Low in the import graph on purpose (it imports only torch, numpy, jax and
torchax's tensor type): the lowerings (`.cpu()`, tensors a forward creates
on the CPU), the module wrapper and the checkpoint readers all need it.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import device_checks

torchax = _compat.import_torchax()
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
  """Zero-copy where numpy has the dtype (bf16 goes through a uint16 view)."""
  if t.layout != torch.strided:
    raise TorchOnTpuError(
      f"A {t.layout} tensor cannot become a jax array (jax arrays are dense, torch_on_tpu has no "
      f"sparse layouts); pass x.to_dense()."
    )
  t = t.detach()
  if t.dtype == torch.bfloat16:
    import ml_dtypes

    return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
  return t.contiguous().numpy()


def to_global_array(t: torch.Tensor, sharding: NamedSharding) -> jax.Array:
  """A host torch tensor → a global jax.Array; each device copies only its slice."""
  host = torch_to_numpy(t)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_cpu(tree):
  """Torch tensors backed by jax arrays (or jax arrays) → plain CPU torch tensors."""

  def convert(x):
    if isinstance(x, TorchaxTensor):
      device_checks.raise_pending(x)  # a failed index check of the program that made it
      x = x.jax()
    if isinstance(x, jax.Array):
      host = np.asarray(jax.device_get(x))
      if host.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(host.view(np.uint16))).view(torch.bfloat16)
      return torch.from_numpy(np.array(host))
    return x

  return _compat.torch_pytree.tree_map(convert, tree, is_leaf=lambda x: isinstance(x, jax.Array))
