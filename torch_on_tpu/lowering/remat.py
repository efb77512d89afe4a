"""Rematerialisation (activation checkpointing) policies by name.

A policy decides which intermediate values of the forward pass the backward
pass keeps; everything else is recomputed. One vocabulary serves the whole
forward (`make_train_step(forward_remat=...)`) and the per-layer body of a scanned
layer stack:

| name | keeps for the backward pass |
|---|---|
| `none` | everything (no recomputation; most memory) |
| `full` | nothing but the inputs (recompute the whole forward; least memory) |
| `dots_saveable` | every matmul output |
| `dots_with_no_batch_dims_saveable` | matmul outputs without batch dims (the projections, not attention scores) |
| `dots_and_attention` | every matmul output and the attention kernels' outputs and softmax statistics: what an unrolled layer loop ends up keeping; cheap elementwise work (norms, activations, dtype converts) is recomputed |
| `offload_dots` | like the previous, but moved to pinned host memory until the backward pass |
| `offload_inputs` | like `full`, but each layer's input waits in pinned host memory instead of the device's (MaxText's `decoder_layer_input=offload`): no activation of the layer stack stays on the device |

The offloading policies need device memory distinct from host memory (TPU, GPU).
On the CPU "device" memory already is host memory, so there is nothing to gain:
each says so once and keeps the same values in place (`offload_dots` as
`dots_with_no_batch_dims_saveable`, `offload_inputs` as `full`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import device_checks, target_device

logger = logging.getLogger(__name__)

NAMES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "dots_and_attention", "offload_dots",
         "offload_inputs")
IN_PLACE = {"offload_dots": "dots_with_no_batch_dims_saveable", "offload_inputs": "full"}  # where nothing can offload

# Matmuls the bridge runs inside a `custom_vjp` (the CPU `F.linear` of
# `torch_on_tpu.lowering.aten`) are invisible to the dot-based policies; they tag their
# output with this `checkpoint_name` so those policies keep it all the same.
MATMUL_NAME = "torch_on_tpu.matmul"
_NAMED_MATMULS = jax.checkpoint_policies.save_only_these_names(MATMUL_NAME)
# The attention kernels' outputs and softmax statistics (a custom call or a
# custom_vjp, not a dot) carry this name, so a policy can keep them instead of
# recomputing the whole attention.
ATTENTION_NAME = "torch_on_tpu.attention"
# jax's cuDNN attention keeps its softmax statistics as an output of its forward primitive, inside
# jax's own custom_vjp where no name reaches them; a policy that keeps attention keeps these
# primitives' outputs, else the backward re-runs the forward kernel (16 → 32 calls per step).
_CUDNN_ATTENTION_FORWARD = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fp8_fwd_wrapper"})


def _cudnn_attention_saveable(prim, *_, **__) -> bool:
  return getattr(prim, "name", None) in _CUDNN_ATTENTION_FORWARD


# A scanned layer's input (the hidden state it is given) carries this name, so a policy can
# move it off the device (`offload_inputs`).
LAYER_INPUT_NAME = "torch_on_tpu.layer_input"

_FIXED = {
  "none": jax.checkpoint_policies.everything_saveable,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, _NAMED_MATMULS
  ),
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _NAMED_MATMULS
  ),
  "dots_and_attention": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _cudnn_attention_saveable),
    jax.checkpoint_policies.save_only_these_names(MATMUL_NAME, ATTENTION_NAME),
  ),
}

_offload_notices: set[str] = set()

# What a scanned stack's layers keep when no policy is given. A scan has to
# store every residual jax's autodiff picks as a stacked buffer written per
# layer, where an unrolled loop lets XLA fuse cheap elementwise residuals
# (norm intermediates in fp32, dtype converts) into their backward consumers;
# keeping only matmul and attention outputs gives the scan what the loop keeps
# (docs/performance.md, "Scan memory").
SCANNED_DEFAULT = "dots_and_attention"


def layer_policy(name: str | None, *, scanned: bool) -> str:
  """The per-layer policy a layer stack runs: `name`, or for None the default
  (`SCANNED_DEFAULT` for a scan, `none` for a loop)."""
  if name is None:
    return SCANNED_DEFAULT if scanned else "none"
  return check(name)


def check(name: str) -> str:
  """`name` if it is a policy in `NAMES`, else one sentence listing them (nothing is decided
  about the platform here: that waits for the trace, `policy`)."""
  if name not in NAMES:
    raise TorchOnTpuError(f"Unknown remat policy {name!r}; choose one of {', '.join(NAMES)}.")
  return name


def host_offload_supported(device: jax.Device | None = None) -> bool:
  """True where activations can move to pinned host memory and back (TPU, GPU): on `device`, or
  the device the program being traced is for."""
  device = device or target_device.device()
  if device.platform == "cpu":
    return False
  return any(m.kind == "pinned_host" for m in device.addressable_memories())


def policy(name: str) -> Callable:
  """The `jax.checkpoint` policy for a name in `NAMES`, for the device being traced for."""
  check(name)
  if name in _FIXED:
    return _FIXED[name]
  if host_offload_supported():
    if name == "offload_inputs":
      return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT_NAME],
        offload_src="device", offload_dst="pinned_host",
      )
    return _offload_dots_and_named_matmuls("device", "pinned_host")
  if name not in _offload_notices:
    _offload_notices.add(name)
    logger.warning(
      "remat=%r: %s has no device memory apart from host memory, so nothing would be offloaded; "
      "using %r (keeps the same values in place).",
      name, target_device.device().platform.upper(), IN_PLACE[name],
    )
  return _FIXED[IN_PLACE[name]]


def _offload_dots_and_named_matmuls(src: str, dst: str) -> Callable:
  """Moves to `dst` the matmul outputs without batch dims and the matmuls the bridge runs in a
  `custom_vjp` (named `MATMUL_NAME`: a bf16 linear with a bias), recomputing the rest."""
  dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims(src, dst)
  named = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[MATMUL_NAME], offload_src=src, offload_dst=dst
  )

  def policy(prim, *args, **params):
    return (named if getattr(prim, "name", None) == "name" else dots)(prim, *args, **params)  # `name`: checkpoint_name's

  return policy


def checkpoint(fn: Callable, name: str | None, **kwargs) -> Callable:
  """`fn` under `jax.checkpoint` with the named policy; `fn` itself for None or `none`.

  Extra keyword arguments (`static_argnums`, `prevent_cse`) go to `jax.checkpoint`. Index
  checks (`device_checks`) are not collected inside: their values live in the checkpoint's
  own trace (a caller that wants them collects inside `fn` and returns them).
  """
  if name is None or name == "none":
    return fn
  return jax.checkpoint(device_checks.unchecked(fn), policy=policy(name), **kwargs)
