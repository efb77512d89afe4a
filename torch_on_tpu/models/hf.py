"""HF transformers causal LMs: building from a local config, and the FSDP+TP map
for the Llama family's parameter names (Llama, Mistral, Qwen2/3, Gemma, Phi-3...)."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import sys

import torch

from torch_on_tpu.core import _compat, extras
from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.models import hf_experts
from torch_on_tpu.models._maps import present_rules
from torch_on_tpu.models.family import CacheNotCarried, DecoderShape, Family, HFForm
from torch_on_tpu.parallel.sharding import compile_pattern

logger = logging.getLogger(__name__)

_FSDP_TP = {
  "**.embed_tokens.weight": ("tp", "fsdp"),
  "**.q_proj.weight": ("tp", "fsdp"),
  "**.k_proj.weight": ("tp", "fsdp"),
  "**.v_proj.weight": ("tp", "fsdp"),
  "**.qkv_proj.weight": ("tp", "fsdp"),
  "**.q_proj.bias": ("tp",),
  "**.k_proj.bias": ("tp",),
  "**.v_proj.bias": ("tp",),
  "**.o_proj.weight": ("fsdp", "tp"),
  "**.o_proj.bias": (None,),
  "**.gate_proj.weight": ("tp", "fsdp"),
  "**.up_proj.weight": ("tp", "fsdp"),
  "**.gate_up_proj.weight": ("tp", "fsdp"),
  "**.down_proj.weight": ("fsdp", "tp"),
  "**.down_proj.bias": (None,),
  "**norm.weight": (None,),
  "**norm.bias": (None,),
  "lm_head.weight": ("tp", "fsdp"),
}


# HF models default to building a KV cache (a `DynamicCache`, Python state that cannot
# leave a compiled function, and that a scanned layer stack cannot carry), so a call runs
# without one unless the caller passes `use_cache=True` (`generate` does, with a cache
# it carries; a scanned stack refuses it with a clear error).
CALL_DEFAULTS = {"use_cache": False}


def is_hf(module: torch.nn.Module) -> bool:
  try:
    from transformers import PreTrainedModel
  except ImportError:
    return False
  return isinstance(module, PreTrainedModel)


def fsdp_tp_map(module: torch.nn.Module) -> dict | None:
  """The Llama-family map, or None for an HF model without those projection names."""
  if not is_hf(module):
    return None
  rules = present_rules(module, _FSDP_TP)
  if not any("tp" in spec for spec in rules.values()):
    return None
  return rules


def fsdp_dims(module: torch.nn.Module) -> dict[str, int]:
  """The dim the "fsdp" preset splits of each projection the Llama-family map names: the one it
  puts `fsdp` on (the model's hidden size), as MaxText shards its `embed` axis. Tables over the
  vocabulary (the embedding, the output head) keep the preset's own choice, their vocabulary."""
  if not is_hf(module):
    return {}
  rules = [(compile_pattern(p), spec.index("fsdp")) for p, spec in _FSDP_TP.items()
           if "fsdp" in spec and p not in ("**.embed_tokens.weight", "lm_head.weight")]
  dims = {}
  for name, param in module.named_parameters():
    dim = next((d for rx, d in rules if rx.match(name)), None)
    if dim is not None and param.ndim == 2:
      dims[name] = dim
  return dims


def use_jittable_experts(module: torch.nn.Module) -> None:
  """Mixture-of-experts models asked to run HF's "eager" experts loop run "grouped_mm".

  The eager loop builds per-expert token lists whose lengths depend on the
  routing (`nonzero`, `where`), which no static-shape program can hold; the
  grouped path computes the same per-token sum of the chosen experts' outputs
  with one ragged matmul (`_grouped_mm`), dropless, in one compiled shape.
  """
  switched = False
  for sub in module.modules():
    config = getattr(sub, "config", None)
    is_experts = hasattr(sub, "_is_expert_parallel")  # set by HF's `use_experts_implementation`
    if is_experts and getattr(config, "_experts_implementation", None) == "eager":
      sub.config = copy.copy(config)  # the user's config object stays as it was
      sub.config._experts_implementation = "grouped_mm"
      switched = True
  if switched:
    logger.info(
      "%s: experts run through HF's grouped_mm path instead of its eager loop (same sums; the "
      "loop's routing-dependent shapes cannot be compiled).",
      type(module).__name__,
    )


def layer_types_period(module: torch.nn.Module, layers) -> int:
  """How often an HF model's loop repeats its layers' inputs: the period of `config.layer_types`
  over the stacked layers (1 when every layer has the same kind).

  HF models with mixed attention (sliding and full, chunked and full, linear and full) pick
  each layer's mask by its kind, so the scan runs groups of one period, each position with
  its own mask (`StackedLayers.call_layer`)."""
  for owner in (module, layers[0]):
    types = list(getattr(getattr(owner, "config", None), "layer_types", None) or ())[: len(layers)]
    if len(set(types)) > 1:
      return next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
  return 1


def per_layer_inputs_problem(module: torch.nn.Module, layers) -> str | None:
  """Why an HF model's layers, whose inputs repeat every `layer_types_period` layers, are not
  worth stacking (fewer than two whole periods after the first), or None."""
  period = layer_types_period(module, layers)
  if period > 1 and (len(layers) - period) // period < 2:
    return f"the config's layer_types repeat every {period} of its {len(layers)} layers, too seldom to scan"
  return None


def _capture_hook_paths(template: torch.nn.Module) -> list[str]:
  """Paths (within a layer) of the modules carrying HF's output-capture hooks."""
  return [
    path
    for path, module in template.named_modules()
    if any(getattr(fn, "__name__", "") == "output_capturing_hook" for fn in _compat.forward_hooks(module).values())
  ]


@contextlib.contextmanager
def deferred_output_capture(layer: torch.nn.Module, template: torch.nn.Module):
  """HF's output capture (`output_router_logits`, `output_hidden_states`, ...) appends
  each layer's values to a list from forward hooks; inside a scan those values are
  traced and must leave as scan outputs instead. While active (and only when a
  capture is requested), the hooks of `template` (the hooked layer) are silenced
  and the calls of the same modules of `layer` are recorded as (path, args,
  output); `replay_output_capture` feeds them to the hooks later, in order.
  Yields the record list, or None when nothing is being captured."""
  try:
    from transformers.utils import output_capturing
  except ImportError:
    yield None
    return
  collector = output_capturing._active_collector
  paths = _capture_hook_paths(template) if collector.get() is not None else []
  if not paths:
    yield None
    return
  records: list = []

  def record(path, module, args, output):
    records.append((path, args, output))

  handles = [
    (layer.get_submodule(p) if p else layer).register_forward_hook(functools.partial(record, p)) for p in paths
  ]
  token = collector.set(None)
  try:
    yield records
  finally:
    collector.reset(token)
    for handle in handles:
      handle.remove()


def replay_output_capture(template: torch.nn.Module, records) -> None:
  """Runs HF's capture hooks of `template` on recorded (path, args, output) calls, in order."""
  for path, args, output in records:
    module = template.get_submodule(path) if path else template
    for fn in list(_compat.forward_hooks(module).values()):
      if getattr(fn, "__name__", "") == "output_capturing_hook":
        fn(module, args, output)


@contextlib.contextmanager
def torch_reference_kernels(module: torch.nn.Module):
  """While the bridge traces, transformers' kernel-or-torch functions in the model's modules
  (Qwen3-Next's gated delta rule and causal conv, ...) run transformers' torch code. Where a
  kernel package is installed (flash-linear-attention, causal-conv1d, mamba-ssm) transformers
  calls it instead, and its Triton/CUDA kernels cannot run on traced tensors; where none is,
  its wrapper would log that the slow torch path runs and to install the package.
  A packed-sequence call is refused: the torch code cannot keep the sequences apart.
  Its method caches (`compile_compatible_method_lru_cache`: Data2Vec's relative position index)
  are bypassed, as under torch.compile: a tensor cached by an eager call is a CPU tensor in the
  program, one cached by a trace a tracer outside it."""
  from transformers import pytorch_utils

  swapped = [(vars(pytorch_utils), "is_torchdynamo_compiling", pytorch_utils.is_torchdynamo_compiling)]
  vars(pytorch_utils)["is_torchdynamo_compiling"] = lambda: True  # read only by that cache's wrapper
  for name in {type(m).__module__ for m in module.modules()}:
    namespace = vars(sys.modules[name]) if name in sys.modules else {}
    for attr, fn in list(namespace.items()):
      if _kernel_or_torch(fn):
        swapped.append((namespace, attr, fn))
        namespace[attr] = _torch_path(fn)
  try:
    yield
  finally:
    for namespace, attr, fn in swapped:
      namespace[attr] = fn


def _kernel_or_torch(fn) -> bool:
  """Whether `fn` is transformers' `use_kernel_func_from_hub_with_fallback` wrapper (a
  package's kernel where it is installed, else its torch code)."""
  code = getattr(fn, "__code__", None)
  return code is not None and hasattr(fn, "__wrapped__") and "is_new_implementation" in code.co_freevars


def _torch_path(fn):
  torch_function = fn.__wrapped__

  @functools.wraps(torch_function)
  def run(*args, **kwargs):
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
      raise TorchOnTpuError(
        f"{torch_function.__name__} is given packed sequences, which transformers' torch code for it cannot "
        "keep apart and its CUDA kernel cannot run under the bridge; train this model on unpacked batches."
      )
    return torch_function(*args, **kwargs)

  return run


def build_causal_lm(config, *, device="meta") -> torch.nn.Module:
  """`AutoModelForCausalLM.from_config` on `device` (meta: nothing allocated)."""
  AutoModelForCausalLM = extras.require("transformers", "An HF model").AutoModelForCausalLM

  with torch.device(device):
    return AutoModelForCausalLM.from_config(config)


def _hf_model(module: torch.nn.Module):
  """The HF model itself, or the one a peft wrapper holds; None when neither."""
  if is_hf(module):
    return module
  inner = getattr(getattr(module, "base_model", None), "model", None)  # peft's PeftModel → LoraModel → model
  return inner if inner is not None and is_hf(inner) else None


def _init_weights_afresh(module: torch.nn.Module) -> None:
  """HF's `initialize_weights`, run as if for the first time.

  HF marks modules `_is_hf_initialized` and then skips them; the marks would
  make a second materialisation of the same meta model leave zeros.
  """
  saved = {m: m.__dict__.pop("_is_hf_initialized") for m in module.modules() if "_is_hf_initialized" in m.__dict__}
  try:
    module.initialize_weights()
  finally:
    for m in module.modules():
      m.__dict__.pop("_is_hf_initialized", None)
    for m, flag in saved.items():
      m._is_hf_initialized = flag


class StaticCacheCarry:
  """An HF `StaticCache` whose tensors travel between loop iterations as jax arrays.

  The cache writes in place (`index_copy_`, `add_` on torchax tensors), which
  rebinds each tensor's jax array; so after a step every torch tensor attribute
  of its layers is read out and carried, and put back before the next step.
  Every other attribute (ints, flags, dtypes) is Python state fixed at trace
  time: it must be the same after a decode step as before it, or the loop
  would replay a stale value on every later step.
  """

  def __init__(self, config, max_cache_len: int):
    from transformers import StaticCache

    self.cache = StaticCache(config=config, max_cache_len=max_cache_len)

  def inputs(self, ids) -> dict:
    return {"input_ids": ids, "past_key_values": self.cache, "use_cache": True}

  def arrays(self) -> list[dict]:
    from torchax.interop import jax_view

    return [{k: jax_view(v) for k, v in vars(layer).items() if isinstance(v, torch.Tensor)} for layer in self.cache.layers]

  def load(self, arrays: list[dict]) -> None:
    from torchax.interop import torch_view

    for layer, tensors in zip(self.cache.layers, arrays):
      for k, v in tensors.items():
        setattr(layer, k, torch_view(v))

  def python_state(self) -> list:
    """The cache's and its layers' non-tensor attributes."""
    owners = [self.cache, *self.cache.layers]
    return [{k: v for k, v in vars(o).items() if not isinstance(v, (torch.Tensor, list))} for o in owners]

  def check(self, before: list) -> None:
    after = self.python_state()
    if after != before:
      changed = sorted({k for b, a in zip(before, after) for k in b.keys() | a.keys() if b.get(k) != a.get(k)})
      raise CacheNotCarried(f"a decode step changes the cache's Python state ({', '.join(changed)})")


class HFFamily(Family):
  """HF transformers causal LMs (and peft models around one)."""

  name = "hf"
  has_decode_cache = True

  def claims(self, module):
    # The model (or a peft wrapper around one), or one of its parts (a decoder layer).
    return _hf_model(module) is not None or type(module).__module__.startswith("transformers.")

  def prepare(self, module):
    use_jittable_experts(module)

  def init_fn(self, module):
    return _init_weights_afresh if callable(getattr(module, "initialize_weights", None)) else None

  def call_defaults(self, module):
    return dict(CALL_DEFAULTS)

  def model_inputs(self, module, batch):
    inputs = {"input_ids": batch["input_ids"], "use_cache": False}  # a train step needs no KV cache
    if batch.get("positions") is not None:
      inputs["position_ids"] = batch["positions"]
    return inputs

  def decoder_shape(self, module):
    config = getattr(_hf_model(module) or module, "config", None)
    if not hasattr(config, "num_hidden_layers"):
      return None
    heads = config.num_attention_heads
    return DecoderShape(
      layers=config.num_hidden_layers,
      dim=config.hidden_size,
      ffn_dim=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
      heads=heads,
      kv_heads=getattr(config, "num_key_value_heads", None) or heads,
      head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
      vocab=config.vocab_size,
      **hf_experts.routed_shape(module),
    )

  def sharding_map(self, module, preset):
    return fsdp_tp_map(module) if preset == "fsdp_tp" else None

  def fsdp_dims(self, module):
    return fsdp_dims(module)

  @contextlib.contextmanager
  def running(self, module, mesh=None, data_axes=()):
    """transformers' reference kernels kept (`torch_reference_kernels`); its experts modules run
    where their experts live (`hf_experts`)."""
    with torch_reference_kernels(module), hf_experts.where_they_live(module, mesh, data_axes):
      yield

  def attention_routes(self, attend):
    if "transformers" not in sys.modules:  # no HF model in this process to route
      return []
    from torch_on_tpu.models import hf_attention

    return [hf_attention.routed(attend)]

  def layer_stack_problem(self, module, layers):
    return per_layer_inputs_problem(module, layers)

  def layer_inputs_period(self, module, layers):
    return layer_types_period(module, layers)

  def deferred_layer_outputs(self, layer, template):
    return deferred_output_capture(layer, template)

  def replay_layer_outputs(self, template, records):
    replay_output_capture(template, records)

  def hf_form(self, module):
    config = getattr(_hf_model(module) or module, "config", None)
    return HFForm(config) if callable(getattr(config, "save_pretrained", None)) else None

  def decode_cache(self, module, max_len):
    model = _hf_model(module)  # a peft wrapper passes the cache through to the model it holds
    if model is None:
      return None, f"{type(module).__name__} is a part of an HF model, not a causal LM"
    if not getattr(model, "_can_compile_fullgraph", False):
      return None, f"transformers does not mark {type(model).__name__} as compilable with a static cache"
    from transformers.cache_utils import StaticLayer

    try:
      layers = StaticCacheCarry(model.config, max_len).cache.layers
    except Exception as e:  # noqa: BLE001 (a config StaticCache cannot read: the full forward may still run)
      return None, f"transformers cannot build its StaticCache ({first_line(e)})"
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    if other:
      return None, f"its static cache has {', '.join(other)} layers, whose state moves in Python between steps"
    return (lambda: StaticCacheCarry(model.config, max_len)), None
