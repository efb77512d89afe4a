"""How torchtitan itself shards a model (its `sharding.set_*_sharding_config`), read as the bridge's
TP / EP dims, as an FSDP+TP sharding map and as the dims plain FSDP splits."""

from __future__ import annotations

import inspect

import torch

from torch_on_tpu.models.torchtitan.configs import is_torchtitan


def parallel_plan(module: torch.nn.Module, *, ep: bool = False) -> dict[str, dict[str, int]]:
  """How torchtitan itself shards `module`: parameter name → {mesh axis: the dim it
  shards} for its TP (and, with `ep`, EP) axes, read from the model's own
  `torchtitan.models.<name>.sharding.set_*_sharding_config` (sequence parallelism
  off) applied to a copy of its config and built on meta. {} when the model's package
  has no such plan."""
  import copy
  import importlib

  package = type(module).__module__.rsplit(".", 1)[0]
  try:
    plans = importlib.import_module(package + ".sharding")
  except ImportError:
    return {}
  setters = [
    fn for name, fn in vars(plans).items()
    if name.startswith("set_") and name.endswith("_sharding_config") and getattr(fn, "__module__", None) == plans.__name__
    and next(iter(inspect.signature(fn).parameters)) == "config"
  ]
  config = getattr(module, "config", None)
  if len(setters) != 1 or config is None:
    return {}
  config = copy.deepcopy(config)
  accepted = inspect.signature(setters[0]).parameters
  setters[0](config, **{k: v for k, v in dict(enable_sp=False, enable_ep=ep).items() if k in accepted})
  with torch.device("meta"):
    built = config.build()
  plan = {}
  for prefix, sub in built.named_modules():
    sharding_config = getattr(sub, "_sharding_config", None)  # torchtitan's Module keeps its config's
    for name, layout in (sharding_config.state_shardings if sharding_config else {}).items():
      dims = {axis.value: placement.dim for axis, placement in layout.axis_types.items() if hasattr(placement, "dim")}
      dims = {axis: dims[axis] for axis in ("tp", "ep") if axis in dims}
      if dims:
        plan[f"{prefix}.{name}" if prefix else name] = dims
  return plan


def fsdp_tp_map(module: torch.nn.Module) -> dict | None:
  """torchtitan's own TP plan as a sharding map: each parameter's TP dim over `tp`,
  its first other dim longer than 1 over `fsdp` (1-D parameters replicated; a depthwise
  conv's `(channels, 1, kernel)` takes fsdp on its kernel dim)."""
  if not is_torchtitan(module):
    return None
  plan = parallel_plan(module)
  if not plan:
    return None
  table = {}
  for name, param in module.named_parameters():
    tp = plan.get(name, {}).get("tp")
    spec = [None] * param.ndim
    if tp is not None:
      spec[tp % param.ndim] = "tp"
    free = [d for d in range(param.ndim) if spec[d] is None and param.shape[d] > 1]
    if param.ndim >= 2 and free:
      spec[free[0]] = "fsdp"
    table[name] = tuple(spec)
  return table


def fsdp_dims(module: torch.nn.Module, vocab: int | None = None) -> dict[str, int]:
  """The dim the "fsdp" preset splits of each linear weight torchtitan's TP plan shards: the
  one the plan does not (the model's hidden size: a column-parallel weight's input, a row-parallel
  one's output), as MaxText shards its `embed` axis. Tables over the vocabulary (the embedding,
  the output head) keep the preset's own choice, their vocabulary: split over the hidden size, the
  looked-up rows would be resharded, and a decoding step's logits computed whole on every device."""
  if not is_torchtitan(module):
    return {}
  plan = parallel_plan(module)
  dims = {}
  for name, param in module.named_parameters():
    tp = plan.get(name, {}).get("tp")
    if tp is not None and param.ndim == 2 and vocab not in param.shape:
      dims[name] = 1 - tp % 2
  return dims
