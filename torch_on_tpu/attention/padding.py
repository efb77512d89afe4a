"""Padding a sequence axis up to a tile multiple: both kernels tile the sequence."""

from __future__ import annotations

import jax.numpy as jnp


def round_up(n: int, m: int) -> int:
  """`n` rounded up to a multiple of `m`."""
  return -(-n // m) * m


def pad_to(x, axis: int, size: int, value=0, *, broadcast=False):
  """Pads `axis` up to `size`; with `broadcast`, a size-1 (broadcast) axis stays."""
  if x is None or x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)

