"""LoRA fine-tuning with peft's own adapters, on a mesh, without a second copy of the model.

    base = tot.ShardedModule(build(), mesh=mesh, abstract=True)   # or materialised by init
    checkpoint.import_safetensors(base, weights_dir)                # the pretrained weights
    jm = lora.wrap(base, build(), rank=16, scan=True)               # peft model, base arrays shared
    step = tot.make_train_step(jm, loss_fn, optax.adamw(1e-4), trainable=lora.TRAINABLE)

Why peft: its `LoraConfig` and module names are what HF users know, and its
forward is the reference LoRA. Why not peft's initialisation: materialising a
peft model runs the base model's init over the adapters too (HF draws
`lora_B` from a normal instead of zeros), and the pretrained weights are
stored under the base model's names, not peft's. So the base model is
materialised (or imported) under its own names first, then the peft model is
built abstract and handed the same arrays by name; only the adapters are new:
`lora_A` as peft's default (Kaiming-uniform, bound 1/√fan_in) and `lora_B`
zeros, so training starts from exactly the base model.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from torch_on_tpu.errors import TorchOnTpuError, arg
from torch_on_tpu.wrapper import module_state
from torch_on_tpu.wrapper.module import ShardedModule

# `make_train_step(trainable=...)` patterns for the adapters (peft names them
# `<module>.lora_A.<adapter>.weight` and `<module>.lora_B.<adapter>.weight`).
TRAINABLE = ("**.lora_A.**", "**.lora_B.**")
_PREFIX = "base_model.model."


def base_name(name: str) -> str:
  """A peft parameter name → the base model's name for it (adapters have none)."""
  return name.removeprefix(_PREFIX).replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
  return ".lora_A." in name or ".lora_B." in name


def parse_targets(text: str):
  """A `--lora_targets` flag → `wrap`'s targets: peft's "all-linear" or a list of module names."""
  return text if text == "all-linear" else [t.strip() for t in str(text).split(",")]


def wrap(
  base: ShardedModule,
  module,
  *,
  rank: int,
  alpha: float | None = None,
  targets="all-linear",
  dropout: float = 0.0,
  seed: int = 0,
  **jittable_kwargs,
) -> ShardedModule:
  """A ShardedModule of `module` (a fresh meta copy of `base`'s model) with peft
  LoRA adapters of `rank` on `targets`, whose base params are `base`'s arrays.

  `alpha` defaults to `2 * rank`; `jittable_kwargs` (scan, remat, attention...)
  go to the new ShardedModule. `base`'s arrays are read by original name and
  shared where `base` stores them as the result does (both unscanned, or both
  scanned: a pipeline's stages need the scan); otherwise stacked or sliced here.
  An abstract `base` gives an abstract result.
  """
  import peft

  if not isinstance(rank, int) or rank < 1:
    raise TorchOnTpuError(f"LoRA rank must be a positive integer, got {rank!r}.")
  if targets == "all-linear" and not callable(getattr(module, "get_output_embeddings", None)):
    targets = _linears_but_the_head(module)  # peft finds the output head of HF models only
  config = peft.LoraConfig(
    r=rank,
    lora_alpha=alpha if alpha is not None else 2 * rank,
    target_modules=targets,
    lora_dropout=dropout,
  )
  try:
    with warnings.catch_warnings():  # peft asks transformers 5 for a property it deprecated: not the user's to fix
      warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
      model = peft.get_peft_model(module, config)
  except ValueError as e:
    raise TorchOnTpuError(f"peft cannot put LoRA adapters on {arg('targets', targets)} ({e}); name modules the model has.") from None
  specs = base._resolved.specs  # by original name, whether or not `base` stacks its layers
  sharding = {name: tuple(specs[base.canonical_name(base_name(name))]) for name in _original_names(model) if not is_adapter(name)}
  sharding.update({pattern: (None, None) for pattern in TRAINABLE})  # adapters are small: replicated
  jm = ShardedModule(
    model,
    mesh=base.mesh,
    sharding=sharding,
    data_axes=base.data_axes,
    attention=base.attention,
    abstract=True,
    init_fn=_shapes_only,
    **jittable_kwargs,
  )
  if any(isinstance(v, jax.ShapeDtypeStruct) for v in base.params.values()):
    return jm  # an abstract base (planning, dry runs): shapes and shardings only
  key = jax.random.PRNGKey(seed)
  for stored, (originals, stacked) in jm.stored_layout().items():
    arrays = jm.params if stored in jm.params else jm.buffers
    like = arrays[stored]
    if is_adapter(originals[0]):
      key, sub = jax.random.split(key)
      arrays[stored] = _adapter_init(sub, like, ".lora_A." in originals[0])
    else:
      arrays[stored] = _shared(base, [base_name(o) for o in originals], like, stacked)
  return jm


def _linears_but_the_head(model) -> list[str]:
  """peft's "all-linear" for a model that is not HF's: the last names of its linears but the output head (`lm_head`)."""
  import torch

  return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"})


def _shapes_only(model) -> None:
  """The abstract build's init: every tensor written, as its values come from `base` and `_adapter_init`
  (a family's own init may not reach peft's adapters: torchtitan's `init_states` does not)."""
  for tensor in [*model.parameters(), *model.buffers()]:
    tensor.zero_()


def _original_names(model) -> list[str]:
  return [n for n, _ in module_state.named_tensors(model)]


def _adapter_init(key, like, is_a: bool) -> jax.Array:
  if not is_a:
    return jax.jit(lambda: jnp.zeros(like.shape, like.dtype), out_shardings=like.sharding)()
  bound = 1.0 / like.shape[-1] ** 0.5  # kaiming_uniform_(a=√5), peft's default for lora_A
  return jax.jit(
    lambda k: jax.random.uniform(k, like.shape, like.dtype, -bound, bound), out_shardings=like.sharding
  )(key)


def _shared(base: ShardedModule, names: list[str], like, stacked: bool) -> jax.Array:
  """`base`'s array for these original names: its own when `base` stores them alike (unscanned, or
  scanned as one stack in this order, as under a pipeline), else gathered and placed like `like`."""
  found = [base._layout.lookup(base.canonical_name(n)) if base._layout else (base.canonical_name(n), None) for n in names]
  stores = {s for s, _ in found}
  if len(stores) == 1 and [i for _, i in found] == (list(range(len(names))) if stacked else [None]):
    (store,) = stores
    array = base.params[store] if store in base.params else base.buffers[store]
    if array.shape == like.shape and array.dtype == like.dtype and array.sharding == like.sharding:
      return array
  return _place([base.array_for(n) for n in names], like, stacked)


def _place(values, like, stacked: bool) -> jax.Array:
  if stacked:
    return jax.jit(lambda *xs: jnp.stack(xs).astype(like.dtype), out_shardings=like.sharding)(*values)
  value = values[0].astype(like.dtype) if values[0].dtype != like.dtype else values[0]
  return jax.device_put(value, like.sharding)
