"""Is the data pipeline fast enough? Its tokens/s alone vs what the CPU demo's train step consumes.

    .venv/bin/python tools/bench_data.py            # default corpus, seqlen 256, batch 16

The pipeline number is tokenize + pack + batch on the default corpus with no
prefetch (one consumer thread pulling as fast as it can). The step number is a
jitted forward + backward of torchtitan's Llama 3 `debugmodel` (SDPA) through
`ShardedModule.functional_call` and `jax.value_and_grad` of a cross-entropy
loss, on 8 simulated CPU devices, fed by the same pipeline with prefetch; the
time the step loop waited for its next batch is reported too.
"""

from __future__ import annotations

import argparse
import time

from torch_on_tpu.runtime import xla_flags  # noqa: E402  (imports nothing heavy: set before jax starts)

xla_flags.simulate_cpu_devices(8, replace=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import torch_on_tpu as tot  # noqa: E402
from torch_on_tpu.core import _compat  # noqa: E402
from torch_on_tpu.io import data  # noqa: E402
from torch_on_tpu.models.torchtitan import build_llama3  # noqa: E402

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402


def pipeline_tokens_per_s(tok, seqlen, batch, n):
  start = time.perf_counter()
  it = data.batches(None, tok, seqlen=seqlen, global_batch_size=batch, prefetch=0)
  for _ in range(n):
    next(it)
  return n * batch * seqlen / (time.perf_counter() - start)


def step_tokens_per_s(tok, seqlen, batch, steps):
  """Returns (tokens/s of the step, mean seconds the loop waited for data, loss)."""
  mesh = tot.make_mesh(fsdp=-1)
  model = build_llama3("debugmodel", attention="sdpa", max_seq_len=seqlen)
  data.check_model_fit(tok.vocab_size, model.tok_embeddings.num_embeddings, seqlen, seqlen)
  jm = tot.ShardedModule(model, mesh=mesh, sharding="fsdp")

  def loss_fn(params, buffers, input_ids, labels):
    logits = jax_view(jm.functional_call(params, buffers, torch_view(input_ids))).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

  step = jax.jit(jax.value_and_grad(loss_fn))
  it = data.batches(None, tok, seqlen=seqlen, global_batch_size=batch, prefetch=2)
  waited, elapsed, loss = 0.0, 0.0, None
  for i in range(steps + 1):  # step 0 compiles and is not timed
    start = time.perf_counter()
    arrays = data.to_global(next(it), mesh)
    fetched = time.perf_counter()
    loss, grads = step(jm.params, jm.buffers, arrays["input_ids"], arrays["labels"])
    jax.block_until_ready(grads)
    if i:
      waited += fetched - start
      elapsed += time.perf_counter() - start
  it.close()
  return steps * batch * seqlen / elapsed, waited / steps, float(loss)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlen", type=int, default=256)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--pipeline-batches", type=int, default=200)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--vocab-size", type=int, default=data.DEFAULT_VOCAB_SIZE)
  parser.add_argument("--cache-dir", default=None, help="tokenizer cache (default ~/.cache/torch_on_tpu)")
  args = parser.parse_args()

  start = time.perf_counter()
  tok = data.build_tokenizer(None, vocab_size=args.vocab_size, cache_dir=args.cache_dir)
  tokenizer_s = time.perf_counter() - start
  pipeline = pipeline_tokens_per_s(tok, args.seqlen, args.batch, args.pipeline_batches)
  step, waited, loss = step_tokens_per_s(tok, args.seqlen, args.batch, args.steps)

  rows = [
    ("tokenizer build (BPE, trained or cached)", f"{tokenizer_s:.2f} s"),
    (f"pipeline alone: tokenize+pack+batch ({args.pipeline_batches} batches)", f"{pipeline:,.0f} tokens/s"),
    (
      f"train step: debugmodel fwd+bwd, {len(jax.devices())} {jax.default_backend()} devices ({args.steps} steps)",
      f"{step:,.0f} tokens/s",
    ),
    ("ratio pipeline / step (target >= 10x)", f"{pipeline / step:,.0f}x"),
    ("step loop's wait for the next batch (prefetch 2)", f"{waited * 1e3:.2f} ms/step"),
    ("loss at the last step (vocab %d)" % tok.vocab_size, f"{loss:.3f}"),
  ]
  corpus = data.default_corpus().name
  print(f"data pipeline benchmark: default corpus ({corpus}), seqlen {args.seqlen}, batch {args.batch}")
  width = max(len(r[0]) for r in rows)
  print(f"{'measurement'.ljust(width)}  value")
  print(f"{'-' * width}  {'-' * 18}")
  for name, value in rows:
    print(f"{name.ljust(width)}  {value}")


if __name__ == "__main__":
  main()
