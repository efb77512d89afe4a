"""A tiny training run for the checkpoint tests, driven as a real process.

It trains a 2-layer HF Llama with a jitted AdamW step on deterministic synthetic
batches (a seeded numpy generator whose state is saved with each checkpoint),
uses the saved jax RNG key to mask the loss, appends `step loss.hex()` per step
to `--log`, saves every `--save_every` steps and at exit, and resumes from
`--dir` when a checkpoint is there. SIGTERM/SIGINT: finish the step, save, exit 0.

    python tests/ckpt_worker.py --dir D --log L --steps 24 --save_every 4
"""

import argparse
import os
import sys
import time

from torch_on_tpu.runtime import xla_flags  # noqa: E402  (imports nothing heavy: set before jax starts)

xla_flags.simulate_cpu_devices(8, replace=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
from torchax.interop import jax_view, torch_view  # noqa: E402

import torch_on_tpu as tot  # noqa: E402
from torch_on_tpu.io import checkpoint  # noqa: E402
from torch_on_tpu.models.hf import build_causal_lm  # noqa: E402

VOCAB, BATCH, SEQ = 128, 8, 16


def tiny_llama_config():
  return transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
  )


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  p.add_argument("--log", required=True)
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--save_every", type=int, default=4)
  p.add_argument("--die_mid_save_at", type=int, default=-1, help="SIGKILL self once this save started")
  p.add_argument("--step_sleep", type=float, default=0.0, help="idle seconds per step (to aim signals)")
  args = p.parse_args(argv)
  config = {"steps": args.steps, "save_every": args.save_every, "lr": 1e-2, "data_seed": 1234}

  mesh = tot.make_mesh(fsdp=-1)
  model_config = tiny_llama_config()
  # Eager attention: with SDPA (the bridge's kernel through transformers' mask interface) one step's
  # logged loss came out one ulp apart between the pytest process's reference and its workers, the
  # states after it bitwise equal; not understood yet (2026-11-28 note), and not this test's subject.
  model_config._attn_implementation = "eager"
  jm = tot.ShardedModule(build_causal_lm(model_config), mesh=mesh, sharding="fsdp", seed=0)
  optimizer = optax.adamw(config["lr"])

  def init_state(params):
    return {
      "params": params,
      "opt_state": optimizer.init(params),
      "step": jnp.zeros((), jnp.int32),
      "rng": jax.random.key(7),
    }

  target = checkpoint.abstract_state(jax.eval_shape(init_state, jm.params), mesh, params=jm.params)
  shardings = jax.tree.map(lambda s: s.sharding, target)
  batch_sharding = jm.batch_sharding(2, BATCH)

  def train_step(state, tokens):
    rng, mask_key = jax.random.split(state["rng"])

    def loss_fn(params):
      out = jm.functional_call(params, jm.buffers, torch_view(tokens[:, :-1]))
      logp = jax.nn.log_softmax(jax_view(out.logits).astype(jnp.float32))
      nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      keep = jax.random.bernoulli(mask_key, 0.9, nll.shape)
      return jnp.sum(nll * keep) / jnp.maximum(jnp.sum(keep), 1)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}, loss

  step_fn = jax.jit(
    train_step,
    in_shardings=(shardings, batch_sharding),
    out_shardings=(shardings, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
    donate_argnums=0,
  )
  data = np.random.default_rng(config["data_seed"])

  ckpt = checkpoint.Checkpointer(args.dir, save_every=args.save_every, keep=2)
  restored = ckpt.restore(target)
  if restored is None:
    state, start = jax.jit(init_state, out_shardings=shardings)(jm.params), 0
  else:
    if restored.config != config:
      sys.exit(f"checkpoint config {restored.config} differs from this run's {config}")
    state, start = restored.state, restored.step
    data.bit_generator.state = restored.data["generator"]
    assert int(state["step"]) == start
    print(f"resumed from step {start}", flush=True)

  def save(step, force=False):
    data_state = {"generator": data.bit_generator.state}
    return ckpt.save(step, state, data=data_state, config=config, force=force)

  with open(args.log, "a") as log, checkpoint.PreemptionGuard() as guard:
    for step in range(start, args.steps):
      tokens = jax.device_put(data.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32), batch_sharding)
      state, loss = step_fn(state, tokens)
      log.write(f"{step} {float(loss).hex()}\n")
      log.flush()
      done = step + 1
      if ckpt.should_save(done):
        save(done)
        if done == args.die_mid_save_at:
          os.kill(os.getpid(), 9)
      if guard.should_stop(done):
        save(done, force=True)
        ckpt.close()
        print(f"preempted by {guard.signal_name}: saved step {done}; relaunch to resume", flush=True)
        return 0
      time.sleep(args.step_sleep)
  save(args.steps, force=True)
  ckpt.close()
  print(f"finished {args.steps} steps", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
