"""One process of the multi-host tests: a tiny torchtitan Llama 3 trained through the library.

Run it alone (one process, all its devices) or under `python -m torch_on_tpu.launch`
(which makes `import torch_on_tpu` join the processes). Every process builds the
same global batch for a step from `(seed, step)` and keeps only its own rows,
which `data.to_global` assembles into the global array, so the data is the same
whatever the process count. Process 0 writes `metrics.jsonl` (one loss per step)
into `--log_dir`; checkpoints go to `--ckpt_dir` every `--save_every` steps, and
`--resume_step N` restores step N from there first (on any process count).
`--die_at N` makes the last process SIGKILL itself after step N, to test what
the others do then.

    python tests/multihost_worker.py --log_dir L --ckpt_dir C --steps 10 --save_every 5
"""

import argparse
import os
import signal
import sys

import jax
import numpy as np
import optax
import torch
import torch.nn.functional as F

import torch_on_tpu as tot  # joins the other processes, when launched with them
from torch_on_tpu import checkpoint, data
from torch_on_tpu.models.torchtitan import llama3_config

SEQ, BATCH, LAYERS = 16, 8, 2


class SyntheticBatches:
  """Step k's global batch is a pure function of `(seed, k)`; this process yields its rows.

  With `die_at`, the last process SIGKILLs itself instead of serving step `die_at + 1`.
  """

  def __init__(self, vocab: int, seed: int, die_at: int | None = None):
    self.vocab, self.seed, self.step = vocab, seed, 0
    self.die_at = die_at if jax.process_index() == jax.process_count() - 1 else None
    rows = BATCH // jax.process_count()
    self.rows = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)

  def __iter__(self):
    return self

  def __next__(self):
    if self.step == self.die_at:
      print(f"process {jax.process_index()} kills itself after step {self.step}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    tokens = np.random.default_rng([self.seed, self.step]).integers(0, self.vocab, (BATCH, SEQ + 1), np.int32)
    self.step += 1
    local = tokens[self.rows]
    return {"input_ids": local[:, :-1], "labels": local[:, 1:]}

  def state(self) -> dict:
    return {"step": self.step}


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--log_dir", required=True)
  p.add_argument("--ckpt_dir", default=None)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--save_every", type=int, default=5)
  p.add_argument("--resume_step", type=int, default=None)
  p.add_argument("--die_at", type=int, default=None)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  config = llama3_config("debugmodel", attention="sdpa", max_seq_len=SEQ)
  config.layers = config.layers[:LAYERS]
  with torch.device("meta"):
    model = config.build()
  mesh = tot.make_mesh(fsdp=-1)
  jm = tot.JittableModule(model, mesh=mesh, sharding="fsdp", seed=args.seed)
  vocab = jm.params["tok_embeddings.weight"].shape[0]

  def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

  step = tot.make_train_step(jm, loss_fn, optax.adamw(1e-3), seed=args.seed)
  batches = SyntheticBatches(vocab, args.seed, args.die_at)
  ckpt = checkpoint.Checkpointer(args.ckpt_dir, save_every=args.save_every, keep=None) if args.ckpt_dir else None
  if args.resume_step is not None:
    restored = ckpt.restore(step.abstract_state(), step=args.resume_step)
    step.state = restored.state
    batches.step = restored.data["step"]
    print(f"resumed from step {restored.step} on {jax.process_count()} processes", flush=True)

  trainer = tot.Trainer(
    step,
    batches,
    steps=args.steps,
    log_dir=args.log_dir,
    to_global=lambda batch: data.to_global(batch, mesh),
    checkpointer=ckpt,
    progress=False,
  )
  trainer.run()
  if ckpt is not None:
    ckpt.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
