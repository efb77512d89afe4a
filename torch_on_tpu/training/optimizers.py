"""AdamW whose moments are stored in a narrower dtype than they are computed in: torchtitan's
`optimizer.implementation=fused_opt_states_bf16`, torch's fused AdamW on fp32 params with bf16
`exp_avg` / `exp_avg_sq` (its CUDA kernel's mixed-precision path: the stored moments widened to
fp32, updated in fp32, the step taken from those fp32 values, the moments rounded to nearest on
store). Half the optimizer state's memory for the weights' own precision. optax's `mu_dtype` covers
the first moment only, and its arithmetic follows the inputs' dtypes."""

from __future__ import annotations


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, state_dtype=None):
  """optax's `scale_by_adam` with mu and nu stored in `state_dtype` (None: as optax keeps them)
  and the update computed in at least fp32 from the stored values, gradients included."""
  import jax
  import jax.numpy as jnp
  import optax

  inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  if state_dtype is None:
    return inner
  stored = jnp.dtype(state_dtype)
  narrow = lambda tree: jax.tree.map(lambda x: x.astype(stored), tree)  # noqa: E731  round to nearest even
  wide = lambda tree: jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), tree)  # noqa: E731

  def init(params):
    state = inner.init(params)
    return state._replace(mu=narrow(state.mu), nu=narrow(state.nu))

  def update(updates, state, params=None):
    updates, new = inner.update(wide(updates), state._replace(mu=wide(state.mu), nu=wide(state.nu)), params)
    return updates, new._replace(mu=narrow(new.mu), nu=narrow(new.nu))

  return optax.GradientTransformation(init, update)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4, *, state_dtype=None):
  """`optax.adamw` (no mask, no Nesterov) with its moments stored in `state_dtype` (`scale_by_adam`);
  None is `optax.adamw` itself. Under `optax.inject_hyperparams` name `state_dtype` in `static_args`
  (a dtype is callable, which inject_hyperparams would take for a schedule)."""
  import optax

  if state_dtype is None:
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  return optax.chain(
    scale_by_adam(b1=b1, b2=b2, eps=eps, state_dtype=state_dtype),
    optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(learning_rate),
  )
