"""Export through torchtitan's own `state_dict_adapter`: its `to_hf` run on the device arrays entry by
entry (or on the few entries it fuses into one HF tensor), with the HF config a family's export
module makes, and the refusals every family's export shares."""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.models.family import FromSeveral, HFForm
from torch_on_tpu.models.torchtitan.configs import is_torchtitan

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


def hf_via_adapter(module: torch.nn.Module, make_config, fix=None) -> HFForm | None:
  """The model as transformers writes it: names and layouts from the family's own
  `torchtitan.models.<name>.state_dict_adapter` (its `to_hf`, run on the device arrays entry by
  entry, or on the few entries it fuses into one HF tensor; `fix` wraps an adapter whose `to_hf`
  is not what transformers reads), the config from `make_config(module.config)` → (the
  transformers config, a check of the values or None). None for a model without a config or
  a family without one adapter."""
  family = type(module).__module__.split(".")[2] if is_torchtitan(module) else None
  adapter = family_adapter(module)
  if adapter is None:
    return None
  adapter = (fix or (lambda a: a))(adapter)
  config, check = make_config(module.config)
  built = as_built(module)
  # tied aliases (lm_head of tied embeddings) aside; buffers written where the adapter names them
  # (DeepSeek-V3's expert bias), none required (RoPE tables; load-balancing state: `check`'s)
  aliases = {n for n, _ in built.named_parameters(remove_duplicate=False)} - {n for n, _ in built.named_parameters()}
  shapes = {name: value for name, value in built.state_dict().items() if name not in aliases}
  required = {name for name, _ in built.named_parameters()}
  made_at = {}  # an HF tensor is written where its first entry is
  for hf, parts in _adapter_sources(adapter, shapes, required, family).items():
    make = functools.partial(_hf_tensor, adapter, parts, hf)
    made_at.setdefault(parts[0], []).append((hf, make if len(parts) == 1 else FromSeveral(parts, make)))
  return HFForm(config, lambda name: made_at.get(name, []), check)


def family_adapter(module: torch.nn.Module):
  """The family's own `torchtitan.models.<name>.state_dict_adapter` for `module`'s config; None for
  a model without a config or a family without exactly one adapter."""
  family = type(module).__module__.split(".")[2] if is_torchtitan(module) else None
  if family is None or getattr(module, "config", None) is None:
    return None
  try:
    adapters = importlib.import_module(f"torchtitan.models.{family}.state_dict_adapter")
  except ModuleNotFoundError:
    return None
  from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

  classes = [c for c in vars(adapters).values() if isinstance(c, type) and issubclass(c, BaseStateDictAdapter) and c.__module__ == adapters.__name__]
  return classes[0](module.config, None) if len(classes) == 1 else None


def from_hf(module: torch.nn.Module, tensors: dict) -> dict:
  """HF-named tensors (a transformers checkpoint of this architecture) → `module`'s own state_dict
  names and layouts, by the family's adapter's `from_hf`."""
  adapter = family_adapter(module)
  family = type(module).__module__.split(".")[2]
  if adapter is None:
    raise TorchOnTpuError(
      f"torchtitan's {family} has no state_dict_adapter to read HF weights with; give weights under the model's "
      f"own state_dict names (export_safetensors writes them)."
    )
  try:
    return adapter.from_hf(tensors)
  except Exception as e:  # noqa: BLE001 (the adapter indexes and reshapes what it expects: another model's names fail there)
    raise TorchOnTpuError(
      f"torchtitan's {family} state_dict_adapter cannot read these weights as an HF checkpoint of this model "
      f"({first_line(e)}); give an HF checkpoint of "
      f"this architecture and size, or weights under the model's own state_dict names."
    ) from None


def as_built(module: torch.nn.Module) -> torch.nn.Module:
  """The model as its config builds it, on meta: the state_dict names an export reads (a scanned
  model's own are its stacked layers'), shapes only."""
  with torch.device("meta"):
    return module.config.build()


def _adapter_sources(adapter, shapes: dict, required: set, family: str) -> dict[str, tuple[str, ...]]:
  """HF name → the state_dict entries the adapter's `to_hf` makes it of: alone where an entry
  converts by itself; the rest by layer (an adapter fuses a layer's q/k/v or its experts' w1/w3),
  each HF tensor narrowed to the entries it needs. Checked against one pass over the whole
  dict (names and shapes, on meta), so a grouping the adapter does not make is refused, and so
  is a `required` entry (a parameter) it gives no HF name."""

  def to_hf(names) -> dict:
    try:
      return adapter.to_hf({n: shapes[n] for n in names})
    except Exception:  # noqa: BLE001 (an adapter may index the partner of an entry it fuses: a part is missing)
      return {}

  whole = {hf: tuple(v.shape) for hf, v in adapter.to_hf(dict(shapes)).items()}
  sources, fused = {}, {}
  for name in shapes:
    alone = to_hf([name])
    sources.update({hf: (name,) for hf in alone})
    if not alone:
      fused.setdefault(re.match(r"(.*?\.\d+\.|)", name).group(1), []).append(name)
  for group in fused.values():
    for hf, value in to_hf(group).items():
      needed = list(group)
      for name in group:  # drop the entries this HF tensor is made without
        rest = [n for n in needed if n != name]
        made = to_hf(rest).get(hf)
        if made is not None and made.shape == value.shape:
          needed = rest
      sources[hf] = tuple(needed)
  used = {name for parts in sources.values() for name in parts}
  dropped = [name for name in shapes if name in required and name not in used]
  if dropped:
    raise TorchOnTpuError(
      f"torchtitan's {family} state_dict_adapter gives no HF name for parameter '{dropped[0]}' ({len(dropped)} "
      f"dropped in all), so its export would be incomplete; export_safetensors writes the model's own names."
    )
  ours = {hf: tuple(to_hf(parts)[hf].shape) for hf, parts in sources.items()}
  if ours != whole:
    differ = sorted(set(ours.items()) ^ set(whole.items()))[0][0]
    raise TorchOnTpuError(
      f"torchtitan's {family} state_dict_adapter makes '{differ}' differently from the whole state_dict than "
      f"from its parts, so the export cannot be written tensor by tensor; export_safetensors writes the model's own names."
    )
  return sources


def _hf_tensor(adapter, names: tuple[str, ...], hf_name: str, *arrays: jax.Array) -> jax.Array:
  """The adapter's `to_hf` on device arrays (through torchax's view of them)."""
  with torchax.default_env():
    return jax_view(adapter.to_hf({n: torch_view(a) for n, a in zip(names, arrays)})[hf_name])


def refuse_hf(problem: str | None, ours: str, hf: str) -> None:
  """One sentence for a torchtitan model whose HF form would compute otherwise (`problem`: why)."""
  if problem is not None:
    raise TorchOnTpuError(f"This torchtitan {ours} cannot be written as HF {hf}: {problem}; export_safetensors writes its own names.")


def no_expert_bias(layers, hf_name: str = "Qwen3-MoE"):
  """HF's `hf_name` routes without torchtitan's load-balancing bias: a trained (nonzero) one is refused
  (`layers`: how many, all MoE, or the MoE layers' numbers)."""

  def check(read):
    for i in range(layers) if isinstance(layers, int) else layers:
      bias = read(f"layers.{i}.moe.expert_bias_E")
      if bool(jnp.any(bias != 0)):
        raise TorchOnTpuError(
          f"layers.{i}.moe.expert_bias_E is nonzero (torchtitan's MoE load balancing moved it) and HF's "
          f"{hf_name} routes without an expert bias, so its logits would differ; export_safetensors writes "
          f"the model with it."
        )

  return check
