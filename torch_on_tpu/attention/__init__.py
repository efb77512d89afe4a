"""Attention kernels behind `scaled_dot_product_attention` (and torchtitan's flex)."""

from torch_on_tpu.attention.routing import (
  BLOCK_SIZE_KEYS,
  MODES,
  Attention,
  check_block_sizes,
  dropout_keep_scale,
  installed,
  kernels,
  splash_block_sizes,
  xla_attention,
)

__all__ = [
  "BLOCK_SIZE_KEYS",
  "MODES",
  "Attention",
  "check_block_sizes",
  "dropout_keep_scale",
  "installed",
  "kernels",
  "splash_block_sizes",
  "xla_attention",
]
