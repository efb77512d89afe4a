"""One process of the multi-host tests: a tiny torchtitan Llama 3 trained through the library on real data.

Run it alone (one process, all its devices) or under `python -m torch_on_tpu.launch`
(`tot.setup()` joins the processes). The data is
`data.batches` on the built-in corpus (the Python standard library, with its
cached BPE): each process reads only its own data shards and yields its rows
of the global batch, which is the same for any process count, and
`data.to_global` assembles the rows into the global array. Process 0 writes
`metrics.jsonl` (one loss per step) into `--log_dir`, and `batches.txt`: a
digest of every step's global batch as the step sees it (gathered from the
devices), so a test can check that every process count trains on the same rows
in the same places. Checkpoints (with the data state) go to `--ckpt_dir` every
`--save_every` steps, and `--resume_step N` restores step N from there first
(on any process count). `--pp N` splits the (scanned) layers into N pipeline stages. `--die_at N` makes the last process SIGKILL itself
after step N, to test what the others do then. `--export_dir D` exports the
trained model as an HF directory (every process taking part) and writes the
model's logits on fixed tokens to `D.logits.npy`.

    python tests/multihost_worker.py --log_dir L --ckpt_dir C --steps 10 --save_every 5
"""

import argparse
import hashlib
import os
import signal
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import torch
import torch.nn.functional as F
from jax.experimental import multihost_utils

import torch_on_tpu as tot
from torch_on_tpu.io import checkpoint, data, export
from torch_on_tpu.models.torchtitan import llama3_config

SEQ, BATCH, LAYERS = 16, 8, 2


class DieAfter:
  """The data iterator, except that the last process SIGKILLs itself instead of serving step `die_at + 1`."""

  def __init__(self, batches: data.Batches, die_at: int | None):
    self.batches, self.step = batches, 0
    self.die_at = die_at if jax.process_index() == jax.process_count() - 1 else None

  def __iter__(self):
    return self

  def __next__(self):
    if self.step == self.die_at:
      print(f"process {jax.process_index()} kills itself after step {self.step}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    self.step += 1
    return next(self.batches)

  def state(self) -> dict:
    return self.batches.state()


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--log_dir", required=True)
  p.add_argument("--ckpt_dir", default=None)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--save_every", type=int, default=5)
  p.add_argument("--resume_step", type=int, default=None)
  p.add_argument("--die_at", type=int, default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--export_dir", default=None)
  p.add_argument("--pp", type=int, default=1, help="pipeline stages (the layers scanned, split over a pp axis)")
  args = p.parse_args(argv)
  tot.setup()  # joins the other processes before anything starts jax's backend

  config = llama3_config("debugmodel", attention="sdpa", max_seq_len=SEQ)
  config.layers = config.layers[:LAYERS]
  with torch.device("meta"):
    model = config.build()
  mesh = tot.make_mesh(pp=args.pp, fsdp=-1) if args.pp > 1 else tot.make_mesh(fsdp=-1)
  stages = dict(scan=True, microbatches=2 * args.pp) if args.pp > 1 else {}
  jm = tot.ShardedModule(model, mesh=mesh, sharding="fsdp", seed=args.seed, **stages)
  tokenizer = data.build_tokenizer(None, vocab_size=config.vocab_size)
  data.check_model_fit(tokenizer.vocab_size, config.vocab_size, SEQ, SEQ)

  def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

  step = tot.make_train_step(jm, loss_fn, optax.adamw(1e-3), seed=args.seed)
  ckpt = checkpoint.Checkpointer(args.ckpt_dir, save_every=args.save_every, keep=None, model=jm) if args.ckpt_dir else None
  saved = None
  if args.resume_step is not None:
    restored = ckpt.restore(step.abstract_state(), step=args.resume_step)
    step.state, saved = restored.state, restored.data
    print(f"resumed from step {restored.step} on {jax.process_count()} processes", flush=True)
  index, count = data.process_rows(mesh)
  batches = data.batches(
    None, tokenizer, seqlen=SEQ, global_batch_size=BATCH, seed=args.seed, with_positions=True, state=saved,
    process_index=index, process_count=count,
  )
  digests = Path(args.log_dir, "batches.txt")
  digests.parent.mkdir(parents=True, exist_ok=True)

  def to_global(batch):
    arrays = data.to_global(batch, mesh)
    rows = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in sorted(arrays.items())}
    if jax.process_index() == 0:
      digest = hashlib.sha256(b"".join(v.tobytes() for v in rows.values())).hexdigest()[:16]
      with open(digests, "a") as f:
        f.write(digest + "\n")
    return arrays

  trainer = tot.Trainer(
    step,
    DieAfter(batches, args.die_at),
    steps=args.steps,
    log_dir=args.log_dir,
    to_global=to_global,
    checkpointer=ckpt,
    progress=False,
  )
  trainer.run()
  if ckpt is not None:
    ckpt.close()
  batches.close()
  if args.export_dir:
    export.export(jm, args.export_dir, tokenizer=tokenizer)
    logits = multihost_utils.process_allgather(jm(torch.arange(2 * SEQ).reshape(2, SEQ)).jax(), tiled=True)
    if jax.process_index() == 0:
      np.save(f"{args.export_dir}.logits.npy", logits)
  return 0


if __name__ == "__main__":
  sys.exit(main())
