"""Model families: the only code that knows torchtitan, HF transformers or any other kind of model.

Each family is a `Family` (see `family.py`) in a file of its own; the core asks
`family_of(module)` once per model and then calls the family's hooks. A new
family is one file and one `register(MyFamily())`: nothing in the core changes.
Families are tried newest-registered first; the generic family answers last.
"""

from __future__ import annotations

import contextlib

import torch

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.family import DecoderShape, Family

__all__ = ["DecoderShape", "Family", "attention_routes", "families", "family_of", "register", "sharding_map", "unregister"]

_GENERIC = Family()
_registered: list[Family] = []  # by register(), newest first
_builtin: list[Family] = []


def families() -> list[Family]:
  """Every family in lookup order: registered ones (newest first), the built-in ones, generic."""
  if not _builtin:  # imported on first use: the family files import their libraries' helpers
    from torch_on_tpu.models.hf import HFFamily
    from torch_on_tpu.models.torchtitan import TorchtitanFamily

    _builtin.extend([TorchtitanFamily(), HFFamily()])
  return [*_registered, *_builtin, _GENERIC]


def register(family: Family) -> Family:
  """Adds `family`, asked before every family registered earlier; returns it."""
  if not isinstance(family, Family):
    raise TorchOnTpuError(f"register() takes a models.Family instance, got {type(family).__name__}.")
  _registered.insert(0, family)
  return family


def unregister(family: Family) -> None:
  """Removes a family added with `register`."""
  _registered.remove(family)


def family_of(module: torch.nn.Module) -> Family:
  """The family `module` belongs to (the generic one when no other claims it)."""
  return next(f for f in families() if f.claims(module))


def sharding_map(module: torch.nn.Module, preset: str) -> dict:
  """The named preset (`"fsdp_tp"`) for the module's family."""
  if preset != "fsdp_tp":
    raise TorchOnTpuError(
      f"Unknown sharding preset '{preset}'; use 'fsdp', 'replicated', 'ep', 'fsdp_tp' or a dict {{pattern: spec}}."
    )
  found = family_of(module).sharding_map(module, preset)
  if found is None:
    raise TorchOnTpuError(
      f"No 'fsdp_tp' map is known for {type(module).__name__}; pass a sharding map "
      f"{{pattern: spec}} naming its parameters, or use sharding='fsdp'."
    )
  return found


@contextlib.contextmanager
def attention_routes(attend):
  """While active, every family's own attention entry points run the kernel `attend`."""
  with contextlib.ExitStack() as stack:
    for family in families():
      for route in family.attention_routes(attend):
        stack.enter_context(route)
    yield
