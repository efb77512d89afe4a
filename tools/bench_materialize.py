"""Peak host memory while materialising a model born sharded, vs the model's size.

    python tools/bench_materialize.py                  # torchtitan Llama 3 1B, fsdp=8 (simulated CPU devices)
    python tools/bench_materialize.py --flavor=debugmodel --devices=8

On CPU the simulated devices' memory *is* host memory, so the sharded model
itself (1x model bytes) is expected in RSS; the target bounds everything else:
peak RSS increase over the post-import baseline ≤ 1.15 × model bytes + 300 MB,
i.e. no second copy of the model ever exists in host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from peak_rss import PeakRss, rss  # tools/ is on sys.path when run as a script


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--flavor", default="1B")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--seqlen", type=int, default=2048, help="RoPE table length (the training seqlen)")
  parser.add_argument("--scan", action="store_true")
  parser.add_argument("--json", default=None, help="also write the result here")
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

  import jax

  import torch_on_tpu as tot
  from torch_on_tpu.models.torchtitan import build_llama3

  model = build_llama3(args.flavor, attention="sdpa", max_seq_len=args.seqlen)
  mesh = tot.make_mesh(fsdp=-1)
  param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
  jax.block_until_ready(jax.numpy.zeros(1))
  baseline = rss()
  start = time.perf_counter()
  with PeakRss() as peak:
    jm = tot.JittableModule(model, mesh=mesh, sharding="fsdp", scan=args.scan)
    jax.block_until_ready(jm.params)
  seconds = time.perf_counter() - start
  increase = peak.peak - baseline
  target = 1.15 * param_bytes + 300 * 2**20
  result = {
    "model": f"torchtitan llama3 {args.flavor}",
    "devices": len(jax.devices()),
    "scan": args.scan,
    "param_bytes": param_bytes,
    "baseline_rss": baseline,
    "peak_rss": peak.peak,
    "peak_increase": increase,
    "target": target,
    "ratio_to_model": increase / param_bytes,
    "seconds": seconds,
    "meets_target": increase <= target,
  }
  gib = 2**30
  print(f"| model | devices | params (GiB) | peak RSS increase (GiB) | x model | target (GiB) | time (s) | ok |")
  print(f"|---|---|---|---|---|---|---|---|")
  print(
    f"| {result['model']}{' scan' if args.scan else ''} | {result['devices']} | {param_bytes / gib:.2f} | "
    f"{increase / gib:.2f} | {result['ratio_to_model']:.3f} | {target / gib:.2f} | {seconds:.1f} | "
    f"{'yes' if result['meets_target'] else 'NO'} |"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0 if result["meets_target"] else 1


if __name__ == "__main__":
  sys.exit(main())
