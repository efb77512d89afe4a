"""The recipes' learning-rate schedule: linear warmup, a stable stretch, then a linear, sqrt or cosine
decay to a floor — torchtitan's `LRSchedulersContainer` step for step, so a torchtitan config run here
follows the learning rates it follows under torchtitan (optax's own warmup-cosine starts at 0 and has
no stable stretch, which torchtitan's `decay_ratio` needs)."""

from __future__ import annotations

import math

DECAYS = ("cosine", "linear", "sqrt")


def warmup_stable_decay(peak: float, steps: int, *, warmup_steps: int, decay_ratio: float | None = None,
                        decay: str = "cosine", min_lr_factor: float = 0.0):
  """An optax schedule (update count → learning rate) of `steps` optimizer steps.

  Update k (0-based) of the warmup takes `peak·(k+1)/warmup_steps`; the decay takes the last
  `round(steps·decay_ratio)` steps (all after warmup when None) and ends one step short of its
  floor `peak·min_lr_factor` (torchtitan's "virtual last step", so the last update is not 0)."""
  import jax.numpy as jnp

  if decay not in DECAYS:
    raise ValueError(f"decay {decay!r} is not one of {', '.join(DECAYS)}")
  warmup = min(warmup_steps, steps)
  decay_steps = steps - warmup if decay_ratio is None else min(round(steps * decay_ratio), steps - warmup)
  flat_until = steps + 1 - decay_steps  # warmup + stable steps

  def schedule(count):
    k = jnp.asarray(count, jnp.float32)
    rising = (k + 1) / max(warmup, 1)
    progress = jnp.clip((k + 1 - flat_until) / max(decay_steps, 1), 0.0, 1.0)
    if decay == "linear":
      falling = 1 - progress
    elif decay == "sqrt":
      falling = 1 - jnp.sqrt(progress)
    else:
      falling = 0.5 * (1 + jnp.cos(math.pi * progress))
    falling = min_lr_factor + (1 - min_lr_factor) * falling
    return peak * jnp.where(k < warmup, rising, jnp.where(k < flat_until, 1.0, falling))

  return schedule
