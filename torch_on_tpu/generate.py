"""`generate`: a quick look at what a model writes, greedy or top-k, one jitted program.

    ids = tot.generate(model, prompt_ids, max_new_tokens=32)            # greedy
    ids = tot.generate(model, prompt_ids, max_new_tokens=32, top_k=40)  # sampled

The whole loop is one `jax.jit`: the prompt sits at the start of a fixed-size
token buffer and each of the `max_new_tokens` iterations of a `fori_loop` runs
the model's own forward (eval mode) over the buffer and writes the next token
after the last one. Causal attention keeps the not-yet-written positions from
affecting the logits read. There is no KV cache, so each token costs a full
forward of the buffer: meant for a look at the text during training, not for
serving.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models import hf
from torch_on_tpu.module import JittableModule, to_cpu
from torch_on_tpu.train import call_model

torchax = _compat.import_torchax()
from torchax.interop import jax_view  # noqa: E402


def generate(
  model: JittableModule,
  prompt: torch.Tensor,
  max_new_tokens: int,
  *,
  top_k: int | None = None,
  seed: int = 0,
  inputs_fn: Callable | None = None,
) -> torch.Tensor:
  """The prompt `(batch, length)` token ids followed by `max_new_tokens` more, as a CPU tensor.

  Args:
    model: the JittableModule of a causal LM (logits, or an output with `.logits`).
    prompt: integer token ids, `(batch, length)` or `(length,)`.
    max_new_tokens: tokens to add.
    top_k: None: greedy (argmax); k: sample among the k likeliest tokens.
    seed: the sampling seed.
    inputs_fn: `token ids (a jax array) → what the model is called with`
      (an array, tuple or dict, as the train step's `inputs`); default
      `input_ids=` (with `use_cache=False`) for HF models, the ids alone otherwise.
  """
  prompt = torch.as_tensor(prompt)
  if prompt.ndim == 1:
    return generate(model, prompt[None], max_new_tokens, top_k=top_k, seed=seed, inputs_fn=inputs_fn)[0]
  if prompt.ndim != 2 or prompt.is_floating_point() or prompt.shape[1] == 0:
    raise TorchOnTpuError(
      f"generate needs a non-empty prompt of integer token ids shaped (batch, length), got "
      f"{prompt.dtype} {tuple(prompt.shape)}."
    )
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise TorchOnTpuError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
  if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
    raise TorchOnTpuError(f"top_k must be None (greedy) or a positive integer, got {top_k!r}.")
  inputs_fn = inputs_fn or _default_inputs(model)
  batch, length = prompt.shape
  tokens = jnp.zeros((batch, length + max_new_tokens), jnp.int32).at[:, :length].set(
    jnp.asarray(prompt.numpy(), jnp.int32)
  )
  program = jax.jit(_generation_loop(model, inputs_fn, length, max_new_tokens, top_k))
  module = model.module
  was_training = module.training
  module.eval()  # traced once: dropout off
  try:
    out = program(model.params, model.buffers, tokens, jax.random.key(seed))
  finally:
    module.train(was_training)
  return to_cpu(out).long()


def _generation_loop(model, inputs_fn, length, new, top_k):
  def next_logits(params, buffers, tokens, position):
    out, _ = call_model(model, params, buffers, inputs_fn(tokens))
    logits = jax_view(out.logits if hasattr(out, "logits") else out)
    return jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False).astype(jnp.float32)

  def loop(params, buffers, tokens, key):
    def body(i, state):
      tokens, key = state
      position = length + i
      logits = next_logits(params, buffers, tokens, position)
      if top_k is None:
        chosen = jnp.argmax(logits, axis=-1)
      else:
        key, draw = jax.random.split(key)
        values, indices = jax.lax.top_k(logits, top_k)
        pick = jax.random.categorical(draw, values, axis=-1)
        chosen = jnp.take_along_axis(indices, pick[:, None], axis=-1)[:, 0]
      tokens = jax.lax.dynamic_update_index_in_dim(tokens, chosen.astype(tokens.dtype), position, axis=1)
      return tokens, key

    return jax.lax.fori_loop(0, new, body, (tokens, key))[0]

  return loop


def _default_inputs(model: JittableModule) -> Callable:
  if hf.is_hf(model.module):
    return lambda ids: {"input_ids": ids, "use_cache": False}
  return lambda ids: ids
