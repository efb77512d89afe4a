"""Memory and time of attention forward+backward: our kernels vs torchax's default SDPA.

    .venv/bin/python tools/bench_attention.py                 # CPU: seqlen 1k/2k/4k/8k, fp32, causal
    .venv/bin/python tools/bench_attention.py --out r.json    # also write the rows as JSON
    .venv/bin/python tools/bench_attention.py --gpu           # GPU: cuDNN path vs torch SDPA flash

CPU: each (seqlen, kernel) runs in a fresh subprocess on one device, calling
`F.scaled_dot_product_attention` on torchax tensors under `jax.jit(jax.grad)`,
with our XLA kernel installed (`attention="xla"`) or not (`None`: torchax's
default lowering). Memory is reported two ways: XLA's compiled memory analysis
(temp bytes: scratch the program needs beyond its inputs and outputs) and the
subprocess's peak resident set (`ru_maxrss`) minus its resident set before
compiling. A configuration whose compiled temp exceeds --max-run-gib is only
compiled, not run (its time shows as "-").

GPU (--gpu; needs jax with CUDA and torch with CUDA): bf16 B=4 H=32 D=128
S=8192 causal, forward+backward of our cuDNN path (jax) against PyTorch's own
SDPA with the flash backend, on the same GPU in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = {"xla": "ours (xla)", "default": "torchax default"}


def _rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_worker(cfg: dict) -> dict:
  """One configuration, in this (fresh) process."""
  import jax
  import jax.numpy as jnp
  import torch.nn.functional as F

  from torch_on_tpu import attention
  from torch_on_tpu.core import _compat

  torchax = _compat.import_torchax()
  from torchax.interop import jax_view, torch_view

  b, h, s, d = cfg["batch"], cfg["heads"], cfg["seqlen"], cfg["head_dim"]
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, w = (jax.random.normal(key, (b, h, s, d), jnp.float32) for key in keys)
  env = torchax.default_env()
  mode = None if cfg["mode"] == "default" else cfg["mode"]

  def loss(q, k, v):
    with env, attention.kernels(mode, mesh=None, data_axes=(), block_sizes={}):
      out = F.scaled_dot_product_attention(torch_view(q), torch_view(k), torch_view(v), is_causal=True)
    return jnp.sum(jax_view(out) * w)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready((q, k, v, w))
  rss_before = _rss_mib()
  compiled = step.lower(q, k, v).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  row = dict(cfg, temp_mib=temp / 2**20, seconds=None)
  if temp <= cfg["max_run_gib"] * 2**30:
    jax.block_until_ready(compiled(q, k, v))  # warm-up
    times = []
    for _ in range(cfg["repeats"]):
      start = time.perf_counter()
      jax.block_until_ready(compiled(q, k, v))
      times.append(time.perf_counter() - start)
    row["seconds"] = statistics.median(times)
  row["rss_delta_mib"] = _rss_mib() - rss_before
  return row


def run_cpu(args) -> list[dict]:
  rows = []
  for seqlen in args.seqlens:
    for mode in args.modes:
      cfg = dict(
        mode=mode, seqlen=seqlen, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        repeats=args.repeats, max_run_gib=args.max_run_gib,
      )
      proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
      )
      if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        print(f"seqlen {seqlen} {mode}: failed ({tail[0]})", file=sys.stderr)
        rows.append(dict(cfg, temp_mib=None, rss_delta_mib=None, seconds=None, error=tail[0]))
        continue
      rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
      print(_fmt_row(rows[-1]), file=sys.stderr, flush=True)
  return rows


def _fmt_row(r: dict) -> str:
  def num(x, f):
    return "-" if x is None else format(x, f)

  return (
    f"{r['seqlen']:>6}  {MODES[r['mode']]:<16}  {num(r['temp_mib'], '10.1f')}  "
    f"{num(r['rss_delta_mib'], '10.1f')}  {num(r['seconds'], '8.3f')}"
  )


def print_cpu_table(rows: list[dict], args) -> None:
  print(
    f"CPU attention forward+backward: B={args.batch} H={args.heads} D={args.head_dim} fp32 causal "
    f"(median of {args.repeats})"
  )
  print(f"{'seqlen':>6}  {'kernel':<16}  {'temp MiB':>10}  {'ΔRSS MiB':>10}  {'fwd+bwd s':>8}")
  for r in rows:
    print(_fmt_row(r))
  by = {(r["seqlen"], r["mode"]): r for r in rows}
  for seqlen in args.seqlens:
    ours, base = by.get((seqlen, "xla")), by.get((seqlen, "default"))
    if ours and base and ours.get("temp_mib") and base.get("temp_mib"):
      rss = ""
      if ours.get("rss_delta_mib") and base.get("rss_delta_mib") and base.get("seconds"):
        rss = f", peak RSS ×{ours['rss_delta_mib'] / base['rss_delta_mib']:.3f}"
      speed = ""
      if ours.get("seconds") and base.get("seconds"):
        speed = f", time ×{ours['seconds'] / base['seconds']:.2f}"
      print(f"seqlen {seqlen}: ours/default temp ×{ours['temp_mib'] / base['temp_mib']:.3f}{rss}{speed}")


def run_gpu(args) -> dict:
  """Our cuDNN path (jax) vs torch SDPA flash, bf16 causal forward+backward, one GPU."""
  import jax
  import jax.numpy as jnp
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  from torch_on_tpu import attention

  b, h, s, d = 4, 32, 8192, 128
  if jax.default_backend() != "gpu" or not torch.cuda.is_available():
    raise SystemExit(
      f"--gpu needs jax on a GPU (backend: {jax.default_backend()}) and torch with CUDA "
      f"(available: {torch.cuda.is_available()})."
    )
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, w = (jax.random.normal(key, (b, h, s, d), jnp.bfloat16) for key in keys)
  att = attention.Attention("cudnn")

  def loss(q, k, v):
    return jnp.sum((att(q, k, v, causal=True) * w).astype(jnp.float32))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready(step(q, k, v))
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    times.append(time.perf_counter() - start)
  ours = statistics.median(times)

  tq, tk, tv = (
    torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
  )
  tw = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

  def torch_step():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
      out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    out.backward(tw)

  torch_step()
  torch.cuda.synchronize()
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    torch_step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  theirs = statistics.median(times)
  flops = 4 * b * h * s * s * d / 2 * 3.5  # causal: fwd 2 matmuls, bwd 5, half the tiles
  row = dict(
    device=torch.cuda.get_device_name(), batch=b, heads=h, seqlen=s, head_dim=d,
    ours_s=ours, torch_flash_s=theirs, speed_vs_torch=theirs / ours,
    ours_tflops=flops / ours / 1e12, torch_tflops=flops / theirs / 1e12,
  )
  print(f"GPU ({row['device']}) bf16 B={b} H={h} S={s} D={d} causal, forward+backward (median of {args.repeats}):")
  print(f"  ours (cuDNN via jax): {ours * 1e3:8.2f} ms  {row['ours_tflops']:6.1f} TFLOP/s")
  print(f"  torch SDPA flash:     {theirs * 1e3:8.2f} ms  {row['torch_tflops']:6.1f} TFLOP/s")
  print(f"  ours / torch speed:   {row['speed_vs_torch']:.2f}")
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--max-run-gib", type=float, default=6.0,
    help="compile but do not run configurations whose XLA temp memory exceeds this",
  )
  parser.add_argument("--gpu", action="store_true", help="the GPU comparison instead of the CPU table")
  parser.add_argument("--out", help="write the results as JSON here")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(cpu_worker(json.loads(args.worker))))
    return
  if args.gpu:
    result = run_gpu(args)
  else:
    result = run_cpu(args)
    print_cpu_table(result, args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
