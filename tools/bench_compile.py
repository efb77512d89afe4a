"""Compile-time benchmark: the full train step with the layer stack scanned vs unrolled.

    .venv/bin/python tools/bench_compile.py                      # 2, 8, 32 layers
    .venv/bin/python tools/bench_compile.py --layers=2,8 --seq=128

One model family: torchtitan's Llama 3 `debugmodel` (dim 256, 16 heads, vocab
2048, SDPA attention) with its layer stack resized to 2, 8 and 32 copies of
its first layer. For each depth the whole AdamW train step (forward, backward,
optimizer, one jit) is compiled ahead of time with `scan=True` (one
`lax.scan` over stacked layer params) and with `scan=False` (the model's own
Python loop, every layer traced and compiled separately), then run for a few
steps. Compile times are wall seconds of `jax.jit(...).lower().compile()`
with no compilation cache. Targets: with scan, 32 layers compile in ≤ 1.3 ×
the 2-layer time; the scanned step runs within 5% of the loop's step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", default="2,8,32", help="comma-separated layer counts")
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
  p.add_argument("--devices", type=int, default=1, help="simulated CPU devices (fsdp mesh)")
  return p.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(args.devices)

  import jax
  import optax
  import torch

  import torch_on_tpu as tot
  from torch_on_tpu.models.torchtitan import llama3_config

  tot.setup()  # before jax.devices() starts the backend: our XLA flags, libtpu quiet where no TPU is
  base = llama3_config("debugmodel", attention="sdpa", max_seq_len=args.seq)
  gen = torch.Generator().manual_seed(0)
  shape = (args.batch, args.seq)
  batches = [
    (torch.randint(0, base.vocab_size, shape, generator=gen), torch.randint(0, base.vocab_size, shape, generator=gen))
    for _ in range(args.steps + 1)
  ]

  def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

  print(
    f"model: torchtitan Llama 3 debugmodel layers (dim {base.dim}), batch {args.batch} x seq {args.seq}, fp32, "
    f"AdamW; {len(jax.devices())} jax device(s); jax {jax.__version__}",
    flush=True,
  )

  def build_step(n_layers, scan):
    with torch.device("meta"):
      meta_model = dataclasses.replace(base, layers=[base.layers[0]] * n_layers).build()
    jm = tot.ShardedModule(meta_model, mesh=tot.make_mesh(fsdp=args.devices), sharding="fsdp", scan=scan)
    return tot.make_train_step(jm, loss_fn, optax.adamw(1e-4))

  # A process's first compile of each kind (scan, loop) also pays one-time
  # tracing and XLA start-up costs; throwaway 2-layer compiles keep them out
  # of the measured rows.
  for scan in (True, False):
    build_step(2, scan).compile(*batches[0])
  rows = []
  for n_layers in [int(n) for n in args.layers.split(",")]:
    for scan in (True, False):
      step = build_step(n_layers, scan)
      report = step.compile(*batches[0])
      step(*batches[0])  # warm-up
      times = []
      for batch in batches[1:]:
        start = time.perf_counter()
        float(step(*batch))
        times.append(time.perf_counter() - start)
      rows.append((n_layers, scan, report.seconds, statistics.median(times)))
      print(
        f"{n_layers} layers, {'scan' if scan else 'loop'}: compile {report.seconds:.1f} s, "
        f"step {statistics.median(times):.3f} s",
        flush=True,
      )
      del step
  print_table(rows)


def print_table(rows) -> None:
  compile_s = {(n, scan): c for n, scan, c, _ in rows}
  step_s = {(n, scan): s for n, scan, _, s in rows}
  smallest = min(n for n, *_ in rows)
  print()
  print("| layers | compile scan (s) | compile loop (s) | scan vs smallest scan | step scan (s) | step loop (s) | scan / loop step |")
  print("|---|---|---|---|---|---|---|")
  for n in sorted({n for n, *_ in rows}):
    print(
      f"| {n} | {compile_s[n, True]:.1f} | {compile_s[n, False]:.1f} | "
      f"{compile_s[n, True] / compile_s[smallest, True]:.2f}x | {step_s[n, True]:.3f} | "
      f"{step_s[n, False]:.3f} | {step_s[n, True] / step_s[n, False]:.2f}x |"
    )
  print()


if __name__ == "__main__":
  sys.exit(main())
