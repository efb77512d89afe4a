"""torchtitan's own model configs, from its registries: `"<family>:<flavor>"` (with RoPE tables sized to
the run's sequence length and DeepSeek-V3's multi-token-prediction layers) and Llama 3's builder."""

from __future__ import annotations

import dataclasses
import difflib
import inspect

import torch

from torch_on_tpu.core import extras
from torch_on_tpu.errors import TorchOnTpuError

FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")


def is_torchtitan(module) -> bool:
  """A torchtitan module (or config: its classes live in the same modules)."""
  return type(module).__module__.startswith("torchtitan.")


# The language-model families torchtitan 0.3.0 registers (flux, a diffusion model, takes no tokens).
LANGUAGE_FAMILIES = ("llama3", "qwen3", "deepseek_v3", "kimi_k2_7", "qwen3_5", "gpt_oss", "muse_glimmer")


def registry_config(spec: str, *, max_seq_len: int | None = None, mtp_layers: int = 0, attn_backend: str = ""):
  """torchtitan's own config for `"<family>:<flavor>"` (`torchtitan.models.<family>.model_registry`),
  with RoPE tables sized to `max_seq_len` as torchtitan's trainer sizes them for its sequence length;
  `mtp_layers` > 0 builds that many multi-token-prediction layers (`num_mtp_layers`, DeepSeek-V3's);
  `attn_backend` the registry's attention backend ("flex", "varlen", "sdpa"; "": the family's own)."""
  import importlib

  from torch_on_tpu import errors

  extras.require("torchtitan", "torchtitan's models")
  family, _, flavor = spec.partition(":")
  if family not in LANGUAGE_FAMILIES or not flavor:
    raise TorchOnTpuError(
      f"'{spec}' is not <family>:<flavor> of torchtitan; {_near(family, LANGUAGE_FAMILIES)}families: "
      f"{', '.join(LANGUAGE_FAMILIES)}."
    )
  registry = importlib.import_module(f"torchtitan.models.{family}")
  flavors = sorted({n for k, v in vars(registry).items() if k.endswith("_configs") and isinstance(v, dict) for n in v})
  if flavor not in flavors:
    raise TorchOnTpuError(
      f"torchtitan's {family} has no flavor '{flavor}'; {_near(flavor, flavors, family + ':')}choose one of {', '.join(flavors)}."
    )
  mtp = {}
  if mtp_layers:
    if "num_mtp_layers" not in inspect.signature(registry.model_registry).parameters:
      raise TorchOnTpuError(
        f"torchtitan's {family} has no multi-token prediction (its model_registry takes no num_mtp_layers); "
        f"leave {errors.arg('mtp_layers', 0)}."
      )
    mtp = {"num_mtp_layers": mtp_layers}
  backend = {"attn_backend": attn_backend} if attn_backend else {}
  config = registry.model_registry(flavor, **mtp, **backend).model
  for layer in [*config.layers, *getattr(config, "mtp_layers", ())] if max_seq_len is not None else ():
    attention = getattr(layer, "attention", None) or getattr(layer, "attn", None)
    rope = getattr(attention, "rope", None)
    if rope is None:
      continue
    if max_seq_len > rope.max_seq_len:
      raise TorchOnTpuError(
        f"seqlen {max_seq_len} exceeds {spec}'s maximum of {rope.max_seq_len} positions; use a shorter --seqlen."
      )
    attention.rope = dataclasses.replace(rope, max_seq_len=max_seq_len)
  return config


def _near(name: str, names, prefix: str = "") -> str:
  """'did you mean X? ' for the closest of `names`, or nothing."""
  near = difflib.get_close_matches(name, list(names), n=1)
  return f"did you mean '{prefix}{near[0]}'? " if near else ""


def llama3_config(flavor: str = "debugmodel", *, attention: str = "flex", max_seq_len: int | None = None):
  """torchtitan's `Llama3Model.Config` for a flavor, from its own registry.

  `max_seq_len` sizes the RoPE cache the way torchtitan's trainer does for
  the training sequence length (otherwise every layer holds 131072 positions).
  """
  extras.require("torchtitan", "torchtitan's Llama 3")
  from torchtitan.models.common.attention import ScaledDotProductAttention
  from torchtitan.models.llama3 import model_registry

  if flavor not in FLAVORS:
    raise TorchOnTpuError(f"Unknown Llama 3 flavor '{flavor}'; choose one of {', '.join(FLAVORS)}.")
  if attention not in ("flex", "sdpa"):
    raise TorchOnTpuError(f"torchtitan attention must be 'flex' or 'sdpa', got '{attention}'.")
  config = model_registry(flavor).model
  for layer in config.layers:
    if attention == "sdpa":
      layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if max_seq_len is not None:
      if max_seq_len > layer.attention.rope.max_seq_len:
        raise TorchOnTpuError(
          f"seqlen {max_seq_len} exceeds Llama 3 {flavor}'s maximum of "
          f"{layer.attention.rope.max_seq_len} positions; use a shorter --seqlen."
        )
      layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len)
  return config


def build_llama3(flavor: str = "debugmodel", *, attention: str = "flex", max_seq_len: int | None = None, device="meta"):
  """torchtitan's Llama 3 model, built on `device` (meta by default: no memory)."""
  config = llama3_config(flavor, attention=attention, max_seq_len=max_seq_len)
  with torch.device(device):
    return config.build()
