"""The family interface: what the core asks about a kind of model, answered in one place.

A family (torchtitan, HF transformers, a user's own) subclasses `Family` and
overrides only what it knows; every hook's default is the generic answer, the
one a plain `nn.Module` gets. `torch_on_tpu.models.family_of(module)` picks the
family once per model; the core never tests for a family itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping

import torch


@dataclasses.dataclass(frozen=True)
class DecoderShape:
  """The numbers of a decoder that activation memory and FLOPs depend on."""

  layers: int
  dim: int
  ffn_dim: int  # hidden units a token passes through per layer (MoE: its active experts')
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int
  attention_layers: int | None = None  # layers with softmax attention; None: all of them
  inactive_params: int = 0  # parameters a token does not touch (routed experts not chosen)
  predictions: int = 1  # lm_head applications per token: 1 + multi-token-prediction depths
  moe_layers: int = 0  # layers with routed experts
  experts: int = 0  # routed experts per MoE layer
  top_k: int = 0  # of them each token is sent to
  expert_ffn: int = 0  # one expert's hidden units


@dataclasses.dataclass(frozen=True)
class FromSeveral:
  """An HF tensor made of several of the model's (a fused projection): `make(*their arrays)`."""

  sources: tuple[str, ...]  # state_dict names, in `make`'s argument order
  make: Callable


@dataclasses.dataclass(frozen=True)
class HFForm:
  """How a model is written as an HF transformers model (`export`)."""

  config: object  # a transformers PretrainedConfig: its save_pretrained writes config.json
  # state_dict name → (HF name, a transform of the array, a `FromSeveral`, or None), or a list
  # of such pairs (one tensor written as several, or as none); None: names unchanged
  rename: Callable[[str], tuple[str, Callable | None] | list[tuple[str, Callable | None]]] | None = None
  # refuses (raises) a model whose values HF's form cannot hold, given `read(name) → array`
  check: Callable[[Callable[[str], object]], None] | None = None


class CacheNotCarried(Exception):
  """A decode cache holds state that a loop-carried value cannot (raised while tracing)."""


class Family:
  """A model family. Subclass it, override what the family knows, `models.register` it."""

  name = "generic"
  has_decode_cache = False  # whether `decode_cache` can ever return one (generate says why not, then)

  def claims(self, module: torch.nn.Module) -> bool:
    """Whether `module` (the top-level model the user wraps) belongs to this family."""
    return True

  def prepare(self, module: torch.nn.Module) -> None:
    """Adjusts the model before it is wrapped, without changing its results
    (HF: run mixture-of-experts layers through their grouped path)."""

  def init_fn(self, module: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """The model's own initialisation, run on device at materialisation; None: every
    submodule's `reset_parameters()`."""
    return None

  def call_defaults(self, module: torch.nn.Module) -> dict:
    """Keyword arguments every forward gets unless the caller passes them (HF: no KV cache,
    which a compiled call could not return)."""
    return {}

  def model_inputs(self, module: torch.nn.Module, batch: Mapping):
    """What the model is called with for a batch of the data pipeline's arrays
    (`input_ids`, optionally `positions` and `segment_ids` of packed documents):
    an array, a tuple of positional arguments, or a dict."""
    ids, positions = batch["input_ids"], batch.get("positions")
    return ids if positions is None else (ids, positions)

  def decoder_shape(self, module: torch.nn.Module) -> DecoderShape | None:
    """The decoder's shape for the memory plan and FLOPs; None when not a known decoder."""
    return None

  def sharding_map(self, module: torch.nn.Module, preset: str) -> dict | None:
    """The named sharding preset (`"fsdp_tp"`) for this model; None when unknown."""
    return None

  def fsdp_dims(self, module: torch.nn.Module) -> dict[str, int]:
    """Parameter name → the dim the "fsdp" presets split (where the mesh divides it), for the
    parameters whose largest dim is not the one to split: a linear's hidden-size dim."""
    return {}

  def running(self, module: torch.nn.Module, mesh=None, data_axes=()) -> contextlib.AbstractContextManager:
    """Context around every call of the model's forward the bridge traces (on `mesh`, the batch
    split over `data_axes`)."""
    return contextlib.nullcontext()

  def optimizer_pre_step(self, module: torch.nn.Module):
    """The state update the model's own training runs before each optimizer step
    (after the forward and backward of every microbatch): a function of
    `read(name) → array` (buffers by their original names) returning
    `{name: new array}`, or None when there is none."""
    return None

  def expert_parameters(self, module: torch.nn.Module) -> list[str] | None:
    """Names of the parameters the "ep" preset shards on their leading expert dim;
    None: the generic rule (stacked tensors under a module named `experts`)."""
    return None

  def attention_routes(self, attend) -> list[contextlib.AbstractContextManager]:
    """Contexts that send the family's own attention entry points (beyond torch's SDPA)
    to the bridge's kernel `attend` while a model is traced."""
    return []

  def layer_stack_problem(self, module: torch.nn.Module, layers) -> str | None:
    """Why the layers of this model must not be stacked into one scanned step, or None."""
    return None

  def layer_inputs_period(self, module: torch.nn.Module, layers) -> int:
    """p where the model's loop hands layer i the inputs it hands layer i mod p (masks
    picked per layer kind); the scan then runs groups of p layers."""
    return 1

  def deferred_layer_outputs(self, layer: torch.nn.Module, template: torch.nn.Module):
    """Context around one scanned layer's trace that records what the family's hooks
    would capture from it (HF's `output_hidden_states`, router logits); yields the
    records or None. `replay_layer_outputs` hands them to the hooks afterwards."""
    return contextlib.nullcontext(None)

  def replay_layer_outputs(self, template: torch.nn.Module, records) -> None:
    """Feeds records from `deferred_layer_outputs` to the family's hooks, in order."""

  def hf_form(self, module: torch.nn.Module) -> HFForm | None:
    """The model as HF transformers writes it (config, names, layouts); None: not expressible."""
    return None

  def from_hf(self, module: torch.nn.Module, tensors: dict) -> dict:
    """HF-named tensors of this architecture → the model's own state_dict names (an HF model's
    are HF's: unchanged)."""
    return tensors

  def decode_cache(self, module: torch.nn.Module, max_len: int):
    """The model's own KV cache for decoding one token at a time inside a jitted loop:
    `(make, None)` where `make()`, called inside the trace, returns a cache carry
    (`inputs(ids)`: the call for one step; `arrays()` / `load(arrays)`: its tensors
    as jax arrays, carried between iterations; `python_state()` / `check(before)`:
    raise `CacheNotCarried` if a step changed anything else), or `(None, why not)`."""
    return None, "the model has no KV cache the bridge can carry"

  def __repr__(self) -> str:
    return f"<model family {self.name}>"
