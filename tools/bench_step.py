"""Train-step benchmark: torch_on_tpu's compiled step vs PyTorch eager vs torch.compile.

    .venv/bin/python tools/bench_step.py                 # 1-device mesh (the default)
    .venv/bin/python tools/bench_step.py --devices=8     # 8 simulated CPU devices
    .venv/bin/python tools/bench_step.py --runners=torch_on_tpu,torch_on_tpu_unchecked  # the index checks' cost

One model for all three: torchtitan's Llama 3 built from torchtitan's own config
classes with debugmodel's structure (vocab 2048, RoPE, SwiGLU, fused QKV) at
4 layers, dim 1024, 16 heads, SDPA attention; batch 8 × seq 512, fp32, AdamW
(same hyperparameters), the same initial weights. After a warm-up step each,
the runners take turns step by step, so load from other processes hits all of
them alike; the table shows medians. MFU is model FLOPs (torchtitan's count) per
second (median step) over an fp32 XLA matmul rate measured between the rounds
(the best one; `--peak=cached` uses `torch_on_tpu.training.metrics.cpu_matmul_peak`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=1, help="simulated CPU devices (mesh fsdp size)")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--dim", type=int, default=1024)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--seq", type=int, default=512)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=3, help="timed steps per runner")
  p.add_argument("--runners", default="torch_on_tpu,eager,compile", help="comma-separated subset")
  p.add_argument("--peak", choices=("measured", "cached"), default="measured")
  p.add_argument("--profile", default=None, help="write a jax profiler trace of one step here")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def llama3_bench_config(*, layers, dim, heads, seq):
  """torchtitan's debugmodel structure at another size, from torchtitan's config classes."""
  from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
  from torchtitan.models.common.attention import ScaledDotProductAttention
  from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, _output_linear_init, model_registry

  debug = model_registry("debugmodel").model
  vocab = debug.vocab_size
  layer_configs = _build_llama3_layers(
    fuse_qkv=True,
    n_layers=layers,
    dim=dim,
    n_heads=heads,
    hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
    rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=500000, scaling="llama"),
    attn_backend="flex",
  )
  for layer in layer_configs:
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
  return Llama3Model.Config(
    dim=dim,
    vocab_size=vocab,
    tok_embeddings=Embedding.Config(
      num_embeddings=vocab, embedding_dim=dim, param_init=debug.tok_embeddings.param_init
    ),
    norm=RMSNorm.Config(normalized_shape=dim, param_init=debug.norm.param_init),
    lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
    layers=layer_configs,
  )


HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def make_batches(args, vocab):
  import torch

  gen = torch.Generator().manual_seed(0)
  shape = (args.batch, args.seq)
  return [
    (torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen))
    for _ in range(args.steps + 1)
  ]


def loss_fn(logits, labels):
  import torch

  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def torch_worker(args) -> None:
  """The PyTorch runners, in their own process: torch.compile refuses to run in a
  process where torchax has registered its `jax` device. Reads `<runner> <batch>`
  lines, answers `<seconds> <loss>`."""
  import safetensors.torch
  import torch

  config = llama3_bench_config(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq)
  batches = make_batches(args, config.vocab_size)
  state = safetensors.torch.load_file(args.worker)

  def runner(compiled: bool):
    with torch.device("cpu"):
      model = config.build()
    model.load_state_dict(state)
    opt = torch.optim.AdamW(
      model.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )

    def fwd_bwd(x, y):
      loss = loss_fn(model(x), y)
      loss.backward()
      return loss

    fwd_bwd_fn = torch.compile(fwd_bwd) if compiled else fwd_bwd
    opt_step = torch.compile(opt.step) if compiled else opt.step

    def run(x, y):
      opt.zero_grad(set_to_none=True)
      loss = fwd_bwd_fn(x, y)
      opt_step()
      return loss.item()

    return run

  runners = {"eager": runner(False), "compile": runner(True)}
  print(f"ready torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
  for line in sys.stdin:
    name, index = line.split()
    start = time.perf_counter()
    loss = runners[name](*batches[int(index)])
    print(f"{time.perf_counter() - start} {loss}", flush=True)


class TorchRunners:
  """Talks to `torch_worker` in a child process."""

  def __init__(self, args, state_path):
    import subprocess

    argv = [sys.executable, os.path.abspath(__file__), f"--worker={state_path}"]
    argv += [f"--{k}={getattr(args, k)}" for k in ("layers", "dim", "heads", "seq", "batch", "steps")]
    self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.banner = self.proc.stdout.readline().strip()

  def step(self, name, index) -> tuple[float, float]:
    self.proc.stdin.write(f"{name} {index}\n")
    self.proc.stdin.flush()
    seconds, loss = self.proc.stdout.readline().split()
    return float(seconds), float(loss)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.worker:
    return torch_worker(args)
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(args.devices)

  import tempfile

  import jax
  import optax
  import safetensors.torch
  import torch

  import torch_on_tpu as tot
  from torch_on_tpu.training import metrics

  names = args.runners.split(",")
  config = llama3_bench_config(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq)
  batches = make_batches(args, config.vocab_size)
  tokens = args.batch * args.seq
  with torch.device("meta"):
    meta_model = config.build()
  flops = metrics.flops_per_token(meta_model, args.seq)
  jm = tot.ShardedModule(meta_model, mesh=tot.make_mesh(fsdp=args.devices), sharding="fsdp")
  print(
    f"model: torchtitan Llama 3, {args.layers} layers, dim {args.dim}, {args.heads} heads, vocab "
    f"{config.vocab_size}, {flops.n_params / 1e6:.1f}M params; batch {args.batch} x seq {args.seq}, "
    f"fp32, AdamW; {len(jax.devices())} jax device(s)",
    flush=True,
  )

  runs = {}  # name → run(batch index) → (seconds, loss)
  for name, checked in (("torch_on_tpu", True), ("torch_on_tpu_unchecked", False)):
    if name not in names:
      continue
    step = tot.make_train_step(
      jm, loss_fn, optax.adamw(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"]),
      check_indices=checked,
    )
    print(f"{name}: {step.compile(*batches[0])}", flush=True)

    def ours(index, step=step):
      start = time.perf_counter()
      loss = float(step(*batches[index]))
      return time.perf_counter() - start, loss

    runs[name] = ours
  workdir = tempfile.TemporaryDirectory()
  torch_runners = None
  if {"eager", "compile"} & set(names):
    state_path = os.path.join(workdir.name, "init.safetensors")
    safetensors.torch.save_file({k: v.contiguous() for k, v in jm.state_dict().items()}, state_path)
    torch_runners = TorchRunners(args, state_path)
    print(f"torch worker: {torch_runners.banner}", flush=True)
    for name in ("eager", "compile"):
      if name in names:
        runs[name] = lambda index, name=name: torch_runners.step(name, index)

  try:
    first_loss = {}
    for name, run in runs.items():  # warm-up: compilation, allocator, caches
      seconds, first_loss[name] = run(0)
      print(f"{name}: first step {seconds:.1f} s, loss {first_loss[name]:.4f}", flush=True)
    if args.profile and "torch_on_tpu" in runs:
      jax.profiler.start_trace(args.profile)
      runs["torch_on_tpu"](1)
      jax.profiler.stop_trace()
      print(f"profile written to {args.profile}", flush=True)
    times = {name: [] for name in runs}
    peaks = []
    for index in range(1, len(batches)):
      for name, run in runs.items():
        times[name].append(run(index)[0])
      if args.peak == "measured":  # between rounds, under the same load as the steps
        peaks.append(metrics.measure_matmul_flops(repeats=3))
  finally:
    if torch_runners is not None:
      torch_runners.close()
    workdir.cleanup()

  peak = max(peaks) if peaks else metrics.cpu_matmul_peak()
  print(f"XLA fp32 matmul peak ({args.peak}, best of the rounds): {peak / 1e9:.1f} GFLOP/s", flush=True)
  print_table(times, first_loss, flops, tokens, peak)
  if {"torch_on_tpu", "torch_on_tpu_unchecked"} <= set(times):
    checked, unchecked = (statistics.median(times[k]) for k in ("torch_on_tpu", "torch_on_tpu_unchecked"))
    paired = statistics.median(a / b for a, b in zip(times["torch_on_tpu"], times["torch_on_tpu_unchecked"]))
    print(
      f"index checks (make_train_step(check_indices=True) vs False): {checked / unchecked - 1:+.2%} of the step "
      f"(medians), {paired - 1:+.2%} (median of the rounds' ratios: each round runs both back to back)"
    )
  print(
    f"FLOPs/token: torchtitan {flops.torchtitan / 1e6:.1f}M (MFU uses this), causal "
    f"{flops.causal / 1e6:.1f}M; per-step seconds: "
    + "; ".join(f"{k} " + ", ".join(f"{t:.2f}" for t in v) for k, v in times.items())
  )


def print_table(times, first_loss, flops, tokens, peak) -> None:
  eager = statistics.median(times["eager"]) if "eager" in times else None
  fastest_eager = min(times["eager"]) if "eager" in times else None
  headers = ["runner", "step s (median)", "vs eager", "step s (min)", "vs eager (min)", "tokens/s", "model GFLOP/s", "MFU", "loss step 1"]
  rows = []
  for name, values in times.items():
    median = statistics.median(values)
    achieved = flops.torchtitan * tokens / median
    rows.append(
      [
        name,
        f"{median:.2f}",
        f"{median / eager:.2f}x" if eager else "-",
        f"{min(values):.2f}",
        f"{min(values) / fastest_eager:.2f}x" if fastest_eager else "-",
        f"{tokens / median:,.0f}",
        f"{achieved / 1e9:.1f}",
        f"{100 * achieved / peak:.1f}%",
        f"{first_loss[name]:.4f}",
      ]
    )
  widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
  print()
  print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
  print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
  for r in rows:
    print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
  print()


if __name__ == "__main__":
  sys.exit(main())
