"""Context parallelism: what splitting the sequence over `cp` devices saves, and a projection.

    python tools/bench_cp.py memory                 # temporaries per device, cp = 1, 2, 4 at 4096
    python tools/bench_cp.py project --chip=v5p     # Llama 3 8B at 131072 on a simulated v5p slice

`memory`: one training step of torchtitan's Llama 3 (`--model`, bf16 compute,
scanned, the recipe's remat) on one sequence of `--seqlen` tokens per data shard, compiled on
abstract params (nothing allocated) over 1, 2 and 4 simulated CPU devices, the
sequence split over all of them (`cp`): XLA's compiled temporaries per device
side by side with their ratio to cp=1, the collectives the step runs, and how
attention crossed the split. Then the causal balance: each device's attention
FLOPs from the chunk layout (`metrics.causal_attention_pairs`), zig-zag and
contiguous, and their spread.

`project`: the recipe's dry run (`recipes.llama3 ... --dry_run`, abstract: no
allocation) on as many simulated devices as the slice has chips, then tokens/s
per chip from the step's model FLOPs (the `causal` convention, x4/3 with full
remat; XLA's cost analysis counts a loop body once), the collective bytes of
the compiled step (loops counted by trip count, `torch_on_tpu.parallel.collectives`),
and the chip's bf16 peak and ICI bandwidth: step time = max(FLOPs / (peak x
EFFICIENCY), bytes / (ICI / 2)). A projection for a TPU from a CPU compile:
the XLA attention kernel stands in for splash, and XLA CPU's partitioner
leaves some all-reduces a TPU turns into reduce-scatters (an upper bound on bytes).
"""

from __future__ import annotations

import argparse
import sys

# bf16 dense FLOP/s, HBM bytes, ICI bytes/s per chip (Google Cloud's published figures).
CHIPS = {
  "v5p": dict(peak=459e12, hbm_gib=95, ici=4800e9 / 8),
  "v6e": dict(peak=918e12, hbm_gib=32, ici=3584e9 / 8),
}
EFFICIENCY = 0.5  # the fraction of peak a long-context step's matmuls and attention reach
CPS = (1, 2, 4)


def memory(args) -> int:
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(max(CPS), replace=False)
  import jax
  import jax.numpy as jnp
  import optax
  import torch.nn.functional as F

  import torch_on_tpu as tot
  from torch_on_tpu.models import torchtitan as titan
  from torch_on_tpu.training import metrics

  tot.setup()

  def loss_fn(out, labels):
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())

  print(
    f"Llama 3 {args.model}, {args.batch} x {args.seqlen} tokens, bf16 compute, scan, remat {args.remat}, "
    f"the sequence over cp devices:"
  )
  print(f"{'cp':>3} {'temporaries/device':>19} {'vs cp=1':>8}  collectives/device, attention")
  base = None
  for cp in CPS:
    model = titan.build_llama3(args.model, max_seq_len=args.seqlen)
    devices = jax.devices()[:cp]
    mesh = tot.make_mesh(devices, cp=cp) if cp > 1 else tot.make_mesh(devices, fsdp=1)
    jm = tot.ShardedModule(model, mesh=mesh, sharding="fsdp", attention="xla", abstract=True, scan=True, remat=args.remat)
    step = tot.make_train_step(jm, loss_fn, optax.adamw(1e-4), compute_dtype=jnp.bfloat16)
    spec = jax.ShapeDtypeStruct((args.batch, args.seqlen), jnp.int32)
    report = step.compile((spec, spec, titan.FlexMasks(spec)), spec)
    base = base or report.temp_bytes
    split = "; ".join(report.attention_splits) or "whole sequence"
    print(
      f"{cp:>3} {report.temp_bytes / 2**30:>15.2f} GiB {base / report.temp_bytes:>7.2f}x  "
      f"{report.collective_bytes}; {split}",
      flush=True,
    )
  shape = tot.plan.decoder_shape(titan.build_llama3(args.model, max_seq_len=args.seqlen))
  per_pair = 12 * shape.layers * shape.heads * shape.head_dim
  print(f"\nCausal attention TFLOP per device per sequence of {args.seqlen}, from the chunk layout:")
  for cp in (2, 4, 8):
    rows = []
    for balanced in (True, False):
      flops = [p * per_pair / 1e12 for p in metrics.causal_attention_pairs(args.seqlen, cp, balanced=balanced)]
      spread = max(flops) / min(flops) - 1
      rows.append(f"{'zig-zag' if balanced else 'contiguous'} {' '.join(f'{f:.3f}' for f in flops)} (spread {100 * spread:.1f}%)")
    print(f"  cp={cp}: " + " | ".join(rows))
  return 0


def project(args) -> int:
  sys.argv = [sys.argv[0]]
  from recipes import llama3

  chip = CHIPS[args.chip]
  flags = llama3.Llama3Flags(
    model=args.model, seqlen=args.seqlen, global_batch_size=args.global_batch_size, cp=args.cp, tp=args.tp,
    remat=args.remat, dtype="bfloat16", cpu_devices=args.chips, memory_gib=chip["hbm_gib"], dry_run=True,
  )
  result = llama3.run(flags)
  import torch_on_tpu as tot
  from torch_on_tpu.models.torchtitan import build_llama3

  report, plan = result["compile"], result["plan"]
  per_token = tot.metrics.flops_per_token(build_llama3(args.model, max_seq_len=args.seqlen), args.seqlen)
  tokens = args.global_batch_size * args.seqlen / args.chips
  recompute = 4 / 3 if args.remat == "full" else 1.0
  flops = per_token.causal * tokens * recompute
  compute_s = flops / (chip["peak"] * EFFICIENCY)
  comm_s = report.collective_bytes.total / (chip["ici"] / 2)
  step_s = max(compute_s, comm_s)
  print(
    f"\nProjection, {args.chips} {args.chip} chips, {args.global_batch_size} x {args.seqlen} tokens, cp={args.cp}:\n"
    f"  plan {plan.total / 2**30:.1f} GiB per chip of {chip['hbm_gib']} GiB ({'fits' if plan.fits else 'does NOT fit'})\n"
    f"  model FLOPs per chip per step {flops / 1e12:.1f} TFLOP (causal, x{recompute:.2f} remat): "
    f"{compute_s:.2f} s at {int(EFFICIENCY * 100)}% of {chip['peak'] / 1e12:.0f} TFLOP/s\n"
    f"  collectives per chip per step {report.collective_bytes}: {comm_s:.2f} s at {chip['ici'] / 2 / 1e9:.0f} GB/s\n"
    f"  step {step_s:.2f} s -> {tokens / step_s:,.0f} tokens/s/chip"
  )
  return 0 if plan.fits else 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  mem = sub.add_parser("memory", help="compiled temporaries per device, cp = 1, 2, 4")
  mem.add_argument("--model", default="1B")
  mem.add_argument("--seqlen", type=int, default=4096)
  mem.add_argument("--batch", type=int, default=1)
  mem.add_argument("--remat", default="dots_and_attention")
  proj = sub.add_parser("project", help="the recipe's dry run on a simulated slice, projected tokens/s/chip")
  proj.add_argument("--chip", choices=sorted(CHIPS), default="v5p")
  proj.add_argument("--chips", type=int, default=64)
  proj.add_argument("--model", default="8B")
  proj.add_argument("--seqlen", type=int, default=131072)
  proj.add_argument("--global_batch_size", type=int, default=8)
  proj.add_argument("--cp", type=int, default=8)
  proj.add_argument("--tp", type=int, default=1)
  proj.add_argument("--remat", default="full")
  args = parser.parse_args(argv)
  return memory(args) if args.command == "memory" else project(args)


if __name__ == "__main__":
  sys.exit(main())
