"""torchtitan models as transformers writes them: one module per torchtitan family, named as
torchtitan names it (`llama3`, `qwen3`, `deepseek_v3`, …), each with its HF config, its table or
adapter and its refusals side by side, and a `hf_form(module)`. A family's export is one new file
here; a family without one exports only under its own names (`export_safetensors`)."""

from __future__ import annotations

import importlib

import torch

from torch_on_tpu.models.family import HFForm


def hf_form(module: torch.nn.Module) -> HFForm | None:
  """The HF form of a torchtitan model, from the export module of its family; None without one."""
  family = type(module).__module__.split(".")[2]
  try:
    exporter = importlib.import_module(f"{__name__}.{family}")
  except ModuleNotFoundError as e:
    if e.name != f"{__name__}.{family}":
      raise
    return None
  return exporter.hf_form(module)
