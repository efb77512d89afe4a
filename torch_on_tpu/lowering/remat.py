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

Or name what a layer keeps, MaxText's `remat_policy=custom` for a torch layer: `save:` and
`offload:` each followed by comma-separated globs over the layer's own module paths (their
outputs are kept on the device / moved to host memory; everything else is recomputed), joined by
`+`. Two more names: `input` (the layer's input) and `attention` (the attention kernel's outputs
and softmax statistics). For torchtitan's Llama 3, MaxText's v6e recipe (the layer input and the
q/k/v/out projections offloaded) is `offload:input,attention.qkv_linear.wqkv,attention.wo`; HF's
Llama keeps its attention outputs on the device with `save:attention,self_attn.o_proj`.

The offloading policies need device memory distinct from host memory (TPU, GPU).
On the CPU "device" memory already is host memory, so there is nothing to gain:
each says so once and keeps the same values in place (`offload_dots` as
`dots_with_no_batch_dims_saveable`, `offload_inputs` as `full`, a named `offload:` as `save:`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
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
# A module forward hook marked with this attribute acts on each output tensor alike (the tags of
# the named policies), so a module that computes its output in pieces may apply it to the pieces.
PER_TENSOR_HOOK = "torch_on_tpu_per_tensor_hook"
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

# The outputs of a layer's modules that a `Named` policy keeps carry one of these names
# (`scan.StackedLayers` tags them while the layer runs).
SAVED_NAME = "torch_on_tpu.saved"
OFFLOADED_NAME = "torch_on_tpu.offloaded"
_RESERVED = {"input": LAYER_INPUT_NAME, "attention": ATTENTION_NAME}


@dataclasses.dataclass(frozen=True)
class Named:
  """A policy that names what a layer keeps: globs over the layer's module paths (and the reserved
  `input` and `attention`) whose outputs are kept on the device (`save`) or in host memory
  (`offload`); the rest is recomputed. Its text form is `save:a,b+offload:c`."""

  save: tuple[str, ...] = ()
  offload: tuple[str, ...] = ()

  @classmethod
  def parse(cls, text: str) -> Named:
    groups = {"save": [], "offload": []}
    for group in text.split("+"):
      action, _, globs = group.partition(":")
      names = [g.strip() for g in globs.split(",") if g.strip()]
      if action.strip() not in groups or not names:
        raise TorchOnTpuError(
          f"Unknown remat policy {text!r}; choose one of {', '.join(NAMES)}, or name what each layer keeps as "
          f"save:<module globs> and/or offload:<module globs> joined by '+' (e.g. offload:input,attention.wo)."
        )
      groups[action.strip()] += names
    both = set(groups["save"]) & set(groups["offload"])
    if both:
      raise TorchOnTpuError(f"The remat policy {text!r} both saves and offloads {', '.join(sorted(both))}; name each once.")
    return cls(tuple(groups["save"]), tuple(groups["offload"]))

  def __str__(self) -> str:
    return "+".join(f"{a}:{','.join(g)}" for a, g in (("save", self.save), ("offload", self.offload)) if g)

  @property
  def globs(self) -> tuple[str, ...]:
    """The module globs, without the reserved names."""
    return tuple(g for g in (*self.save, *self.offload) if g not in _RESERVED)

  def tag(self, path: str) -> str | None:
    """The name the output of the layer's module at `path` carries (`SAVED_NAME`, `OFFLOADED_NAME`),
    or None when the policy does not name it (saved wins where globs of both match)."""
    if any(fnmatch.fnmatchcase(path, g) for g in self.save if g not in _RESERVED):
      return SAVED_NAME
    if any(fnmatch.fnmatchcase(path, g) for g in self.offload if g not in _RESERVED):
      return OFFLOADED_NAME
    return None

  def policy(self, offload: bool) -> Callable:
    """The `jax.checkpoint` policy: what is named is saved or offloaded (saved where `offload` is
    False: no host memory apart from the device's), the rest recomputed."""
    saved = [SAVED_NAME, *(_RESERVED[g] for g in self.save if g in _RESERVED)]
    offloaded = [OFFLOADED_NAME, *(_RESERVED[g] for g in self.offload if g in _RESERVED)]
    if not offload:
      saved, offloaded = saved + offloaded, []
    names = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded, offload_src="device",
      offload_dst="pinned_host",
    )
    if ATTENTION_NAME not in saved:
      return names

    def policy(prim, *args, **params):  # jax's cuDNN attention keeps its statistics in its own primitive
      return True if _cudnn_attention_saveable(prim) else names(prim, *args, **params)

    return policy


def named(name: str | None) -> Named | None:
  """The `Named` policy a name spells, None for one of `NAMES` (or None)."""
  return None if name is None or name in NAMES else Named.parse(name)


_offload_notices: set[str] = set()

# What a scanned stack's layers keep when no policy is given. A scan has to
# store every residual jax's autodiff picks as a stacked buffer written per
# layer, where an unrolled loop lets XLA fuse cheap elementwise residuals
# (norm intermediates in fp32, dtype converts) into their backward consumers;
# keeping only matmul and attention outputs gives the scan what the loop keeps
# (CHANGELOG.md, "Scan memory").
SCANNED_DEFAULT = "dots_and_attention"


def layer_policy(name: str | None, *, scanned: bool) -> str:
  """The per-layer policy a layer stack runs: `name`, or for None the default
  (`SCANNED_DEFAULT` for a scan, `none` for a loop)."""
  if name is None:
    return SCANNED_DEFAULT if scanned else "none"
  return check(name)


def check(name: str) -> str:
  """`name` if it is a policy in `NAMES` or a `Named` one (in its own spelling), else one sentence
  listing them (nothing is decided about the platform here: that waits for the trace, `policy`)."""
  return name if name in NAMES else str(Named.parse(name))


def host_offload_supported(device: jax.Device | None = None) -> bool:
  """True where activations can move to pinned host memory and back (TPU, GPU): on `device`, or
  the device the program being traced is for."""
  device = device or target_device.device()
  if device.platform == "cpu":
    return False
  return any(m.kind == "pinned_host" for m in device.addressable_memories())


def policy(name: str) -> Callable:
  """The `jax.checkpoint` policy for a name in `NAMES` or a `Named` one, for the device being traced for."""
  check(name)
  if name in _FIXED:
    return _FIXED[name]
  spelled = named(name)
  if spelled is not None:
    offload = host_offload_supported()
    if spelled.offload and not offload and name not in _offload_notices:
      _offload_notices.add(name)
      logger.warning("remat=%r: %s has no device memory apart from host memory, so what it offloads is kept in place.",
                     name, target_device.device().platform.upper())
    return spelled.policy(offload)
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
