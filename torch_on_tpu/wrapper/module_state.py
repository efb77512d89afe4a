"""A torch module's tensors by dotted name: walking them and putting one in place.

Parameters and buffers are handled alike everywhere the bridge swaps tensors
(init, scan stacking, checkpoint twins), so the walk and the swap live here once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from torch_on_tpu.core import _compat


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
  """Every parameter, then every buffer, with tied tensors listed under each of their names."""
  yield from module.named_parameters(remove_duplicate=False)
  yield from module.named_buffers(remove_duplicate=False)


def owner_of(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
  """The submodule holding tensor `name` and the tensor's name on it."""
  path, _, leaf = name.rpartition(".")
  return (module.get_submodule(path) if path else module), leaf


def set_tensor(module: torch.nn.Module, name: str, value, *, is_param: bool) -> None:
  """Puts `value` at `name` as a parameter or buffer, whatever its tensor type or device."""
  owner, leaf = owner_of(module, name)
  _compat.place_tensor(owner, leaf, value, is_param)


def snapshot(module: torch.nn.Module) -> list:
  """Every submodule's own parameter and buffer entries, for `restore`."""
  return [(m, *(dict(d) for d in _compat.module_tensor_dicts(m))) for m in module.modules()]


def restore(saved: list) -> None:
  """Puts back what `snapshot` recorded, whatever was swapped in since."""
  for m, params, buffers in saved:
    for live, kept in zip(_compat.module_tensor_dicts(m), (params, buffers)):
      live.clear()
      live.update(kept)
