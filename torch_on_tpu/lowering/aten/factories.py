"""Tensors a traced forward creates on the CPU are made on the device, as in an eager CPU run.

A model written and tested on the CPU calls `torch.arange(n)`, `torch.zeros(...)`,
`torch.eye(n, device="cpu")`, a window function, or `x.cpu()`, and mixes the
result with its activations. Under the bridge the activations are device
arrays, so a CPU tensor made this way could not meet them (torchax refuses
mixed math, and a CPU tensor cannot be a program output). While the model (or
the train step's loss) is traced, the CPU *is* the device: factory calls
without a device get torchax's (`torch.device` as a context, torch's own list
of factories), and a device that names the CPU (`device="cpu"`, `.to("cpu")`,
`.cpu()`) is read as the device. Random factories then draw from the step's
key like every other random op; the rest become constants or iotas of the
program.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.overrides import TorchFunctionMode

from torch_on_tpu.core import _compat

torchax = _compat.import_torchax()
import jax.numpy as jnp  # noqa: E402
from torchax.ops import mappings  # noqa: E402

_DEVICE = "jax"  # torchax's name for the device (it renames torch's spare backend)
_ACTIVE = contextvars.ContextVar("cpu_means_device", default=False)


def cpu_means_device() -> bool:
  """True while model or loss code is traced (`made_on_device`)."""
  return _ACTIVE.get()


def _is_cpu(device) -> bool:
  if isinstance(device, torch.device):
    return device.type == "cpu"
  return isinstance(device, str) and device.split(":")[0] == "cpu"


def _on_device(value):
  return _DEVICE if _is_cpu(value) else value


class _CpuMeansDevice(TorchFunctionMode):
  """Rewrites a CPU device argument to the device (see the module docstring)."""

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = dict(kwargs or {})
    if func is torch.Tensor.cpu:  # a plain tensor's; a jax-backed one's is `model_ops._to_host`
      return args[0].to(_DEVICE)
    if "device" in kwargs:
      kwargs["device"] = _on_device(kwargs["device"])
    if func is torch.Tensor.to:
      args = tuple(_on_device(a) for a in args)
    return func(*args, **kwargs)


@contextlib.contextmanager
def made_on_device():
  """Context, entered inside torchax's environment while model or loss code is traced."""
  token = _ACTIVE.set(True)
  try:
    with torch.device(_DEVICE), _CpuMeansDevice():
      yield
  finally:
    _ACTIVE.reset(token)


def _hann_window(window_length, periodic=True, *, dtype=None, layout=None, device=None, pin_memory=None):
  """torch.hann_window (the one factory torchax does not lower): 0.5 - 0.5·cos(2πn / N)."""
  dtype = mappings.t2j_dtype(dtype) if dtype is not None else jnp.float32
  if window_length == 1:
    return jnp.ones((1,), dtype)
  n = window_length if periodic else window_length - 1
  return (0.5 - 0.5 * jnp.cos(2 * jnp.pi * jnp.arange(window_length) / n)).astype(dtype)


def register(env) -> None:
  for packet in (torch.ops.aten.hann_window.default, torch.ops.aten.hann_window.periodic):
    _compat.set_op(env, packet, _compat.make_operator(packet, _hann_window, jax_function=True))
