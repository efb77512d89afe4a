"""`generate`: a quick look at what a model writes, greedy or top-k, one jitted program.

    ids = tot.generate(model, prompt_ids, max_new_tokens=32)            # greedy
    ids = tot.generate(model, prompt_ids, max_new_tokens=32, top_k=40)  # sampled

The whole loop is one `jax.jit`, in one of two forms:

- KV cache (where the model's family has one: HF causal LMs' `StaticCache`,
  `models.hf.StaticCacheCarry`): the cache, sized prompt + new tokens, is built
  inside the program; the prompt runs once (prefill), then each iteration of a
  `fori_loop` feeds the one last token. The cache's tensors are read out as jax
  arrays after a step and carried to the next iteration, which puts them back
  before the model runs. What cannot be carried that way (a sliding window
  whose position is a Python int; any Python state a decode step changes)
  makes the whole cached path give way to the full forward, with one log line
  saying why.
- Full forward (torchtitan's Llama 3, which has no KV cache; other modules; HF
  models the cache cannot serve): the prompt sits at the start of a fixed-size
  token buffer and each iteration runs the model's forward over the buffer and
  writes the next token after the last one. Causal attention keeps the
  not-yet-written positions from affecting the logits read.

Both read the same logits up to the order of fp32 sums (the parity tests
hold them to each other and to eager torch, ≤ 1e-5 relative), so they pick
the same tokens; the cache only saves the work. Meant for a look at the text during training, not for serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.lowering.host import to_cpu
from torch_on_tpu.models.family import CacheNotCarried
from torch_on_tpu.training.step import call_model
from torch_on_tpu.wrapper.module import ShardedModule

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

logger = logging.getLogger(__name__)


def generate(
  model: ShardedModule,
  prompt: torch.Tensor,
  max_new_tokens: int,
  *,
  top_k: int | None = None,
  seed: int = 0,
  inputs_fn: Callable | None = None,
  cache: bool | None = None,
) -> torch.Tensor:
  """The prompt `(batch, length)` token ids followed by `max_new_tokens` more, as a CPU tensor.

  Args:
    model: the ShardedModule of a causal LM (logits, an output with `.logits`, or a list
      whose first item is the next token's logits).
    prompt: integer token ids, `(batch, length)` or `(length,)`; the rows of a
      batch have the same length (no padding).
    max_new_tokens: tokens to add.
    top_k: None: greedy (argmax); k: sample among the k likeliest tokens.
    seed: the sampling seed.
    inputs_fn: `token ids (a jax array) → what the model is called with`
      (an array, tuple or dict, as the train step's `inputs`); default: the
      model family's call for a batch of ids (`Family.model_inputs`; HF:
      `input_ids=`, `use_cache=False`; otherwise the ids alone). A custom one runs the full forward (it is given the whole buffer).
    cache: None: the model's KV cache where it has one that can be carried
      exactly, else a full forward per token (logged once, with why); True: the
      KV cache or an error; False: always the full forward.
  """
  prompt = torch.as_tensor(prompt)
  if prompt.ndim == 1:
    return generate(
      model, prompt[None], max_new_tokens, top_k=top_k, seed=seed, inputs_fn=inputs_fn, cache=cache
    )[0]
  if prompt.ndim != 2 or prompt.is_floating_point() or prompt.shape[1] == 0:
    raise TorchOnTpuError(
      f"generate needs a non-empty prompt of integer token ids shaped (batch, length), got "
      f"{prompt.dtype} {tuple(prompt.shape)}."
    )
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise TorchOnTpuError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
  if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
    raise TorchOnTpuError(f"top_k must be None (greedy) or a positive integer, got {top_k!r}.")
  if cache not in (None, True, False):
    raise TorchOnTpuError(f"cache must be None (auto), True or False, got {cache!r}.")
  length = prompt.shape[1]
  tokens = _token_buffer(prompt, max_new_tokens)
  key = jax.random.key(seed)
  module = model.module
  was_training = module.training
  module.eval()  # traced once: dropout off
  try:
    # compiled once per model and call shape, then reused (a call is then only the run)
    program = model.program(
      ("generate", inputs_fn, tuple(tokens.shape), length, top_k, cache),
      lambda: _compiled(model, inputs_fn, length, max_new_tokens, top_k, cache, tokens, key),
    )
    out, _ = program(model.params, model.buffers, tokens, key)
  finally:
    module.train(was_training)
  return to_cpu(out).long()


def _token_buffer(prompt: torch.Tensor, new: int) -> jax.Array:
  """`(batch, length + new)` int32 ids: the prompt, then zeros where the new tokens go."""
  batch, length = prompt.shape
  return jnp.zeros((batch, length + new), jnp.int32).at[:, :length].set(jnp.asarray(prompt.numpy(), jnp.int32))


def _compiled(model, inputs_fn, length, new, top_k, cache, tokens, key, keep_logits=False):
  """The compiled program `(params, buffers, tokens, key) → (tokens, kept logits)`: the
  cached one where it can be had (see `cache` in `generate`), else the full forward.
  `keep_logits` keeps each step's logits read, `(new, batch, vocab)`, else None."""
  args = (model.params, model.buffers, tokens, key)
  options = model.compile_options
  make_cache, reason = (None, None) if cache is False else _decode_cache(model, inputs_fn, length + new)
  if make_cache is not None:
    cached = jax.jit(_cached_loop(model, make_cache, length, new, top_k, keep_logits), compiler_options=options)
    try:
      return cached.lower(*args).compile()
    except CacheNotCarried as e:
      reason = str(e)
    except Exception as e:  # noqa: BLE001 (whatever stops the cached form, the full forward may still run)
      reason = f"tracing it failed ({first_line(e)})"
  if cache is True:
    raise TorchOnTpuError(
      f"generate(cache=True) cannot use this model's KV cache: {reason}; pass cache=None to run a full "
      f"forward per token instead."
    )
  if cache is None and reason is not None and model.family.has_decode_cache:
    logger.info("generate runs a full forward per token, without the model's KV cache: %s.", reason)
  full = _full_forward_loop(model, inputs_fn or _default_inputs(model), length, new, top_k, keep_logits)
  return jax.jit(full, compiler_options=options).lower(*args).compile()


def _decode_cache(model: ShardedModule, inputs_fn, max_cache_len: int):
  """`(make, None)`: the family's KV cache for this model (see `Family.decode_cache`), or `(None, why not)`."""
  if model.family.has_decode_cache:
    if inputs_fn is not None:
      return None, "a custom inputs_fn is given the whole token buffer"
    if any(stacked for _, stacked in model.stored_layout().values()):
      return None, "its layers are stacked (scan=True or a remat policy) and run as one step, which carries no KV cache"
  return model.family.decode_cache(model.module, max_cache_len)


def _cached_loop(model, make_cache, length, new, top_k, keep_logits):
  def step_logits(params, buffers, ids, carry):
    out, _ = call_model(model, params, buffers, carry.inputs(ids))
    return jax_view(_next_token_logits(out))[:, -1].astype(jnp.float32)

  def loop(params, buffers, tokens, key):
    carry = make_cache()
    logits = step_logits(params, buffers, tokens[:, :length], carry)  # prefill
    tokens, key = _write(tokens, length, logits, key, top_k)
    state = carry.python_state()

    def body(i, loop_state):
      tokens, key, arrays, kept = loop_state
      carry.load(arrays)
      position = length + i + 1  # where this step's token goes
      last = jax.lax.dynamic_slice_in_dim(tokens, position - 1, 1, axis=1)
      logits = step_logits(params, buffers, last, carry)
      carry.check(state)
      tokens, key = _write(tokens, position, logits, key, top_k)
      return tokens, key, carry.arrays(), _keep(kept, i + 1, logits)

    kept = _keep(_logits_buffer(logits, new), 0, logits) if keep_logits else None
    tokens, _, _, kept = jax.lax.fori_loop(0, new - 1, body, (tokens, key, carry.arrays(), kept))
    return tokens, kept

  return loop


def _full_forward_loop(model, inputs_fn, length, new, top_k, keep_logits):
  def next_logits(params, buffers, tokens, position):
    out, _ = call_model(model, params, buffers, inputs_fn(tokens))
    logits = jax_view(_next_token_logits(out))
    return jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False).astype(jnp.float32)

  def loop(params, buffers, tokens, key):
    def body(i, state):
      tokens, key, kept = state
      position = length + i
      logits = next_logits(params, buffers, tokens, position)
      tokens, key = _write(tokens, position, logits, key, top_k)
      return tokens, key, _keep(kept, i, logits)

    kept = _logits_buffer(jax.eval_shape(next_logits, params, buffers, tokens, length), new) if keep_logits else None
    tokens, _, kept = jax.lax.fori_loop(0, new, body, (tokens, key, kept))
    return tokens, kept

  return loop


def _next_token_logits(out):
  """A causal LM's logits: `.logits`, the output itself, or the first of a list (a model that
  also predicts further tokens, torchtitan's multi-token prediction: the next token's first)."""
  if hasattr(out, "logits"):
    return out.logits
  return out[0] if isinstance(out, list) else out


def _write(tokens, position, logits, key, top_k):
  """`tokens` with the token chosen from `logits` written at `position`, and the next key."""
  if top_k is None:
    chosen = jnp.argmax(logits, axis=-1)
  else:
    key, draw = jax.random.split(key)
    values, indices = jax.lax.top_k(logits, top_k)
    pick = jax.random.categorical(draw, values, axis=-1)
    chosen = jnp.take_along_axis(indices, pick[:, None], axis=-1)[:, 0]
  tokens = jax.lax.dynamic_update_index_in_dim(tokens, chosen.astype(tokens.dtype), position, axis=1)
  return tokens, key


def _logits_buffer(logits, new):
  """Room for each step's logits, `(new, batch, vocab)`."""
  return jnp.zeros((new, *logits.shape), jnp.float32)


def _keep(kept, step, logits):
  return None if kept is None else jax.lax.dynamic_update_index_in_dim(kept, logits, step, axis=0)


def _default_inputs(model: ShardedModule) -> Callable:
  """The family's call for the token buffer, built in the torch world as the Trainer's
  (torch ops on the ids: torchtitan's default positions and document masks)."""

  def inputs(ids):
    with torchax.default_env():
      return model.family.model_inputs(model.module, {"input_ids": torch_view(ids)})

  return inputs
