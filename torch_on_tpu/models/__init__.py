"""Model-family adapters: builders and sharding maps for known families.

The generic path needs none of this; an adapter only adds knowledge a family
has (its FSDP+TP map, how to build it from a registry).
"""

from __future__ import annotations

import torch

from torch_on_tpu.errors import TorchOnTpuError


def sharding_map(module: torch.nn.Module, preset: str) -> dict:
  """The named preset (`"fsdp_tp"`) for the module's family."""
  from torch_on_tpu.models import hf, torchtitan

  if preset != "fsdp_tp":
    raise TorchOnTpuError(
      f"Unknown sharding preset '{preset}'; use 'fsdp', 'replicated', 'fsdp_tp' or a dict {{pattern: spec}}."
    )
  for family in (torchtitan, hf):
    found = family.fsdp_tp_map(module)
    if found is not None:
      return found
  raise TorchOnTpuError(
    f"No 'fsdp_tp' map is known for {type(module).__name__}; pass a sharding map "
    f"{{pattern: spec}} naming its parameters, or use sharding='fsdp'."
  )
