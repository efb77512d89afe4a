"""`tot.generate` with the model's KV cache vs a full forward per token, one HF Llama, one run.

    .venv/bin/python tools/bench_generate.py          # 4 layers, hidden 256, prompt 16, 64 new tokens

Both programs are compiled first (the compile is reported, not timed in the
per-token figure); each then runs `--runs` times and the median is divided by
the new tokens. Eager torch's own `model.generate` (its dynamic KV cache) on the
same weights is the third row. The three must give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--dim", type=int, default=256)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
  p.add_argument("--new", type=int, default=64, help="new tokens")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--runs", type=int, default=3, help="timed runs per program")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  import numpy as np
  import torch
  import transformers

  import torch_on_tpu as tot

  tot.setup()  # before jax.devices() starts the backend: our XLA flags, libtpu quiet where no TPU is
  gen = importlib.import_module("torch_on_tpu.training.generation")
  config = transformers.LlamaConfig(
    vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.dim * 8 // 3, num_hidden_layers=args.layers,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=args.prompt + args.new,
    tie_word_embeddings=False,
  )
  config._attn_implementation = "sdpa"
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_config(config).eval()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=1, devices=jax.devices()[:1]))
  prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
  tokens = gen._token_buffer(prompt, args.new)
  key = jax.random.key(0)
  rows, outputs = [], {}
  for name, cache in (("KV cache", True), ("full forward", False)):
    start = time.perf_counter()
    program = gen._compiled(jm, None, args.prompt, args.new, None, cache, tokens, key)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.runs):
      t = time.perf_counter()
      out, _ = program(jm.params, jm.buffers, tokens, key)
      out.block_until_ready()
      times.append(time.perf_counter() - t)
    outputs[name] = np.asarray(out)
    rows.append((name, statistics.median(times), compile_s))
  times = []
  with torch.no_grad():
    for _ in range(args.runs):
      t = time.perf_counter()
      eager = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new, do_sample=False)
      times.append(time.perf_counter() - t)
  outputs["eager torch"] = eager.numpy()
  rows.append(("eager torch (model.generate)", statistics.median(times), None))
  print(
    f"generate: HF Llama {args.layers} layers, hidden {args.dim}, vocab {args.vocab}, batch {args.batch}, "
    f"prompt {args.prompt} + {args.new} new tokens, greedy; median of {args.runs} runs"
  )
  print("| program | ms / new token | run (s) | compile (s) |")
  print("|---|---|---|---|")
  for name, run_s, compile_s in rows:
    compiled = "" if compile_s is None else f"{compile_s:.1f}"
    print(f"| {name} | {1000 * run_s / args.new:.2f} | {run_s:.3f} | {compiled} |")
  same = all(np.array_equal(outputs["KV cache"], o) for o in outputs.values())
  print(f"same tokens: {same}")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
