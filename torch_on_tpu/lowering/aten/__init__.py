"""ATen lowerings torchax lacks or lowers unlike torch, registered into its environment by `runtime.setup()`.

One module per concern:

- `model_ops`: what model code and training need (in-place inits, `normal_`,
  split, embedding / embedding bag, `_grouped_mm`, batch norm's running
  statistics, `take_along_dim`, the CPU `F.linear`, `.cpu()` / `.item()`);
- `torch_semantics`: ops torchax lowers unlike torch (special functions, norms,
  Hermitian linear algebra, saved statistics' gradients), found by
  `tools/op_sweep.py`;
- `index_checks`: torchax's index reads with torch's range check
  (`device_checks`; the embedding and cross-entropy lowerings check their own);
- `added_ops`: ops torchax has no working lowering for, from jax's pieces
  (`ldexp`, `nonzero_static`, `narrow` with a tensor start, `combinations`,
  `cov`, `max_unpool`, `index_reduce`, `adaptive_max_pool`, `segment_reduce`);
- `factories`: tensors traced code makes on the CPU are made on the device
  (`made_on_device`, entered per trace);
- `custom_ops`: ops of other `torch.library` namespaces (torchtitan's
  custom ops, a user's own) traced through their decomposition or composite
  implementation, or refused naming `override_op`;
- `autocast`: `torch.autocast("jax", dtype=...)` regions inside a model computed
  with CUDA's autocast policy (fp32 accepted as a target);
- `low_precision`: bf16 / fp16 activations, softmax and layer norm rounded
  once as torch does; registered last, each wrapping the lowering the groups
  above left, so it wins only for low-precision inputs.
"""

from __future__ import annotations

from torch_on_tpu.lowering.aten import added_ops, autocast, custom_ops, factories, index_checks, low_precision, model_ops, torch_semantics
from torch_on_tpu.lowering.aten.autocast import state as autocast_state
from torch_on_tpu.lowering.aten.factories import made_on_device
from torch_on_tpu.lowering.aten.model_ops import cpu_linear
from torch_on_tpu.lowering.aten.torch_semantics import mark_storage, storage_layout, storage_reads

__all__ = ["autocast_state", "cpu_linear", "made_on_device", "mark_storage", "register", "storage_layout", "storage_reads"]


def register(env) -> list[str]:
  """Registers every group into `env`; returns the in-place ops added."""
  factories.register(env)
  torch_semantics.register(env)
  added_ops.register(env)
  index_checks.register(env)
  added = model_ops.register(env)
  low_precision.register(env)
  custom_ops.register(env)
  autocast.register(env)
  return added
