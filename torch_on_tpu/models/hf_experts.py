"""HF's mixture-of-experts experts modules run where their experts live.

transformers 5 computes the routed experts of its MoE models in one module per layer, made by
`use_experts_implementation` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss and ~60
others): `experts(hidden [T, D], top_k_index [T, K], top_k_weights [T, K]) → [T, D]`, each
token's K chosen experts' outputs weighted and summed. While a model runs, that call becomes a
`shard_map` region (`expert_parallel.Layout`): each device sorts its own tokens' rows by expert,
the rows go to the devices holding their experts (`expert_parallel.exchange`), where the
module's own code runs on them (each row as a token with one expert of weight 1; rows past the
arrivals carry HF's expert-parallel sentinel, an id past the local experts, which its code skips),
and the results come back to be weighted and summed as HF sums them. Without expert parallelism
each device runs every expert on its own tokens, the weights gathered whole: traced as one
program, the sort over the batch-sharded tokens would be replicated on every device.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.parallel import expert_parallel

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


def experts_classes(module: torch.nn.Module) -> set[type]:
  """The classes of the HF experts modules in `module` (those `use_experts_implementation` made)."""
  return {type(m) for m in module.modules() if hasattr(m, "_is_expert_parallel")}


def routed_shape(module: torch.nn.Module) -> dict:
  """`DecoderShape`'s MoE fields for an HF model's experts modules (none: {}): their count, experts,
  the config's experts per token and one expert's hidden units."""
  layers = [m for m in module.modules() if hasattr(m, "_is_expert_parallel")]
  if not layers:
    return {}
  experts = layers[0]
  config = experts.config
  top_k = next((getattr(config, k) for k in ("num_experts_per_tok", "top_k", "moe_topk") if isinstance(getattr(config, k, None), int)), 0)
  down = experts.down_proj
  return dict(moe_layers=len(layers), experts=experts.num_experts, top_k=top_k,
              expert_ffn=down.shape[1] if getattr(experts, "is_transposed", False) else down.shape[2])


@contextlib.contextmanager
def where_they_live(module: torch.nn.Module, mesh, data_axes):
  """While active, `module`'s HF experts modules run in the region on `mesh` (see the module's
  docstring); a no-op where the layout keeps them in one program (`expert_parallel.layout`)."""
  region = expert_parallel.layout(mesh, data_axes)
  classes = experts_classes(module) if region is not None else set()
  originals = {cls: cls.forward for cls in classes}
  for cls, original in originals.items():
    cls.forward = _regional(original, region)
  try:
    yield
  finally:
    for cls, original in originals.items():
      cls.forward = original


def _regional(original, region: expert_parallel.Layout):
  def forward(self, hidden_states, top_k_index, top_k_weights):
    tokens, top_k = top_k_index.shape
    rows, pieces = region.ways()
    if hidden_states.ndim != 2 or tokens % (rows * pieces):
      return original(self, hidden_states, top_k_index, top_k_weights)
    names, weights = zip(*((n, jax_view(p)) for n, p in self.named_parameters()))
    experts = self.num_experts

    def local(x, index, scores, *weights):
      flat = index.reshape(-1)
      order = jnp.argsort(flat, stable=True)
      counts = jnp.zeros(experts, jnp.int32).at[flat].add(1)

      def run_local(received, sizes, local_ids):
        ones = jnp.ones((received.shape[0], 1), scores.dtype)
        with _compat.reparametrized(self, dict(zip(names, map(torch_view, weights)))), \
            _attributes(self, num_experts=sizes.shape[0], _is_expert_parallel=bool(region.group)):
          out = original(self, torch_view(received), torch_view(local_ids[:, None]), torch_view(ones))
        return jax_view(out)

      sorted_out = expert_parallel.exchange(x[order // top_k], counts, run_local, axes=region.group, top_k=top_k)
      per_choice = torch_view(jnp.zeros_like(sorted_out).at[order].set(sorted_out))  # [T·K, D], token-major
      # HF's own sum: each choice's output times its weight, summed over the K choices
      weighted = per_choice * torch_view(scores).reshape(-1, 1)
      return jax_view(weighted.view(-1, top_k, weighted.shape[-1]).sum(dim=1).to(torch_view(x).dtype))

    out = region.run(local, [jax_view(hidden_states), jax_view(top_k_index), jax_view(top_k_weights)], list(weights), flat=True)
    return torch_view(out)

  return forward


@contextlib.contextmanager
def _attributes(obj, **values):
  """`obj`'s attributes set to `values` while active, then restored."""
  before = {k: getattr(obj, k) for k in values if hasattr(obj, k)}
  for k, v in values.items():
    setattr(obj, k, v)
  try:
    yield
  finally:
    for k in values:
      if k in before:
        setattr(obj, k, before[k])
      else:
        delattr(obj, k)
