"""Peak host memory while materialising a model born sharded, vs the model's size.

    python tools/bench_materialize.py                  # torchtitan Llama 3 1B, fsdp=8 (simulated CPU devices)
    python tools/bench_materialize.py --flavor=debugmodel --devices=8
    python tools/bench_materialize.py --weights        # an HF Llama of 166M params from safetensors

`--weights` measures what `recipes.hf --weights` does: the model materialised
(its own init), then its safetensors (written first by a separate process,
with torch's own init) imported over it with `import_safetensors`.

On CPU the simulated devices' memory *is* host memory, so the sharded model
itself (1x model bytes) is expected in RSS; the target bounds everything else:
peak RSS increase over the post-import baseline ≤ 1.15 × model bytes + 300 MB,
i.e. no second copy of the model ever exists in host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from peak_rss import PeakRss, rss  # tools/ is on sys.path when run as a script


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--flavor", default="1B")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--seqlen", type=int, default=2048, help="RoPE table length (the training seqlen)")
  parser.add_argument("--scan", action="store_true")
  parser.add_argument("--weights", action="store_true", help="import an HF Llama's safetensors instead (see above)")
  parser.add_argument("--write_weights", default=None, help=argparse.SUPPRESS)  # the writer process of --weights
  parser.add_argument("--json", default=None, help="also write the result here")
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

  if args.write_weights:
    return write_weights(args.write_weights)

  import jax

  import torch_on_tpu as tot
  from torch_on_tpu.io import checkpoint
  from torch_on_tpu.models.hf import build_causal_lm
  from torch_on_tpu.models.torchtitan import build_llama3

  with tempfile.TemporaryDirectory() as weights:
    if args.weights:
      subprocess.run([sys.executable, __file__, f"--write_weights={weights}"], check=True)
      model = build_causal_lm(hf_llama_config())
    else:
      model = build_llama3(args.flavor, attention="sdpa", max_seq_len=args.seqlen)
    mesh = tot.make_mesh(fsdp=-1)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    jax.block_until_ready(jax.numpy.zeros(1))
    baseline = rss()
    start = time.perf_counter()
    with PeakRss() as peak:
      jm = tot.ShardedModule(model, mesh=mesh, sharding="fsdp", scan=args.scan)
      if args.weights:
        checkpoint.import_safetensors(jm, weights)
      jax.block_until_ready((jm.params, jm.buffers))
    seconds = time.perf_counter() - start
  increase = peak.peak - baseline
  target = 1.15 * param_bytes + 300 * 2**20
  result = {
    "model": "HF Llama 166M, safetensors import" if args.weights else f"torchtitan llama3 {args.flavor}",
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
  print("| model | devices | params (GiB) | peak RSS increase (GiB) | x model | target (GiB) | time (s) | ok |")
  print("|---|---|---|---|---|---|---|---|")
  print(
    f"| {result['model']}{' scan' if args.scan else ''} | {result['devices']} | {param_bytes / gib:.2f} | "
    f"{increase / gib:.2f} | {result['ratio_to_model']:.3f} | {target / gib:.2f} | {seconds:.1f} | "
    f"{'yes' if result['meets_target'] else 'NO'} |"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0 if result["meets_target"] else 1


def hf_llama_config():
  """An HF Llama of 166M params (0.62 GiB fp32): big enough to tell a second copy from overhead."""
  import transformers

  return transformers.LlamaConfig(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
  )


def write_weights(directory: str) -> int:
  """The --weights file, from torch's own init on CPU (run as its own process: its memory is not measured)."""
  from transformers import AutoModelForCausalLM

  AutoModelForCausalLM.from_config(hf_llama_config()).save_pretrained(directory)
  return 0


if __name__ == "__main__":
  sys.exit(main())
