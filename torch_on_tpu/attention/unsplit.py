"""Attention that context parallelism cannot split: a score matrix the model builds itself.

With a `cp` axis only SDPA and the families' attention entry points reach the
bridge's kernel, which splits the sequence. A model that writes its attention
by hand (`softmax(q @ k.transpose(-2, -1))`, HF's `attn_implementation="eager"`)
would still compute the right numbers under GSPMD, but by gathering the whole
sequence's keys and holding an L×L score matrix per row block: no longer
context parallel, and at the lengths CP is for, out of memory. Such a model is
refused in one sentence naming the module, while it is traced.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from torch_on_tpu.errors import TorchOnTpuError

# Products that can form a (…, L, S) score matrix from (…, L, d) and (…, d, S).
_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.baddbmm, torch.einsum}


class _ScoreWatch(TorchFunctionMode):
  """Raises when a product of two batched tensors yields a (…, L, L) matrix, L the sequence length."""

  def __init__(self, length: int, where):
    super().__init__()
    self.length = length
    self.where = where

  def __torch_function__(self, func, types, args=(), kwargs=None):
    out = func(*args, **(kwargs or {}))
    if func in _PRODUCTS and isinstance(out, torch.Tensor) and out.ndim >= 3:
      operands = args[1:] if func is torch.einsum else args
      batched = [x for x in _tensors(operands) if x.ndim >= 3]
      if len(batched) >= 2 and tuple(out.shape[-2:]) == (self.length, self.length):
        raise TorchOnTpuError(
          f"Module '{self.where()}' computes attention by hand (a {self.length}x{self.length} score "
          f"matrix from {getattr(func, '__name__', func)}), which the cp mesh axis cannot split; call "
          f"F.scaled_dot_product_attention there (HF: attn_implementation=\"sdpa\") or run with cp=1."
        )
    return out


def _tensors(values):
  for x in values:
    if isinstance(x, torch.Tensor):
      yield x
    elif isinstance(x, (list, tuple)):
      yield from _tensors(x)


@contextlib.contextmanager
def refused(module: torch.nn.Module, length: int, name_of=lambda name: name):
  """While active, a hand-written score matrix over `length` positions inside `module` is
  refused, naming the innermost module running it (`name_of` maps internal names back)."""
  names = {id(m): name for name, m in module.named_modules()}
  running: list[torch.nn.Module] = []

  def enter(m, args):
    running.append(m)

  def leave(m, args, output):
    if running and running[-1] is m:
      running.pop()

  def where() -> str:
    inner = next((names[id(m)] for m in reversed(running) if id(m) in names), "")
    return name_of(inner) or type(module).__name__

  handles = [
    torch.nn.modules.module.register_module_forward_pre_hook(enter),
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True),
  ]
  try:
    with _ScoreWatch(length, where):
      yield
  finally:
    for handle in handles:
      handle.remove()
