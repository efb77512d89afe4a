"""ATen lowerings torchax lacks or lowers unlike torch, registered into its environment by `runtime.setup()`.

One module per concern:

- `model_ops`: what model code and training need (in-place inits, `normal_`,
  split, embedding / embedding bag, `_grouped_mm`, batch norm's running
  statistics, `take_along_dim`, the CPU `F.linear`, `.cpu()` / `.item()`).
"""

from __future__ import annotations

from torch_on_tpu.lowerings import model_ops
from torch_on_tpu.lowerings.model_ops import cpu_linear

__all__ = ["cpu_linear", "register"]


def register(env) -> list[str]:
  """Registers every group into `env`; returns the in-place ops added."""
  return model_ops.register(env)
