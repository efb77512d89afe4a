"""Shared helper for family maps: keep only the rules a given model has names for."""

from __future__ import annotations

import torch

from torch_on_tpu.parallel.sharding import compile_pattern


def present_rules(module: torch.nn.Module, table: dict) -> dict:
  """`table` minus patterns matching none of the module's parameter names, so a
  family map fits every variant of the family (fused or split projections,
  with or without biases)."""
  names = [n for n, _ in module.named_parameters()]
  return {p: s for p, s in table.items() if any(compile_pattern(p).match(n) for n in names)}
