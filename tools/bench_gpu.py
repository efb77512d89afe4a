"""GPU benchmark: torch_on_tpu (JAX on the GPU) vs torchtitan's Llama 3 in PyTorch, same GPU.

    python tools/bench_gpu.py                                      # Llama 3 1B, seq 8192 x 1 and 2048 x 4
    python tools/bench_gpu.py --model=8B --layers=8 --shapes=8192x1
    python tools/bench_gpu.py --remat=dots_saveable --shapes=8192x2
    python tools/bench_gpu.py --profile                                     # + traces, time by kernel class
    python tools/bench_gpu.py --smoke --profile                             # the whole table on CPU, tiny, in a minute
    python tools/bench_gpu.py --float8=rowwise                              # + each runner with float8 linears

One model for every runner: torchtitan's own Llama 3 config for `--model` (optionally
cut to `--layers`), SDPA attention, RoPE sized to the sequence. Training as torchtitan
does it on one GPU: bf16 compute with fp32 master weights and AdamW state, gradient
clipping at 1.0, random tokens; every runner gets the same batches and, when
`torch_on_tpu` runs, the same initial weights (it writes them, the others load them),
so the losses of the first step agree to bf16 rounding.

- `torch_on_tpu`: the recipe's path at its defaults (`recipes.llama3 --dtype=bfloat16`):
  ShardedModule with the recipe's layer stack (`recipes.flags.default_scan`: the layer loop
  on GPU, a scan elsewhere; `--scan` / `--no-scan` choose) and the
  recipe's remat (`--remat=auto`), SDPA on cuDNN flash attention, `make_train_step`.
- `compile`: torchtitan's model in PyTorch under `torch.autocast(bf16)` (what torchtitan
  uses when there is no FSDP to do mixed precision), each block and the loss
  `torch.compile`d as torchtitan's `--compile` does, fused AdamW.
- `eager`: the same without `torch.compile`.

`--float8=RECIPE` runs each runner a second time (`<runner>+float8`) with the model's
linears converted to torchao's `Float8Linear` for that recipe by torchtitan's converter
(`torch_on_tpu.lowering.float8.convert`: the output head stays bf16), ours lowered to XLA's fp8
dots, PyTorch's on `torch._scaled_mm`; "vs bf16" is a run's speed over the same runner's
without float8, "vs compile" over `compile` of the same precision.

Every runner uses one device (the first), as torchtitan's single-GPU numbers do.
Each (runner, shape) runs in its own process, one after another, so JAX and PyTorch
never hold the GPU's memory at the same time and a runner that runs out of memory
costs only its own row. Step time is the wall time of `--steps` steps after
`--warmup` steps, over `--steps`. MFU is model FLOPs per second over the device's
bf16 dense peak (`torch_on_tpu.training.metrics.PEAK_BF16_FLOPS`), under torchtitan's
convention (attention counted non-causal) and the causal one (on CPU, over the
cached measured matmul rate). Peak memory is the
device allocator's high-water mark (JAX `peak_bytes_in_use`, PyTorch
`max_memory_allocated`); on CPU ours is the compiled program's own estimate. Time to
first step is what a user waits before training starts: building and initialising the
model, compiling (ours ahead of the step, `torch.compile` inside it) and the first step.

`--profile` traces `PROFILE_STEPS` more steps per run after the timed ones (jax.profiler
for ours, torch.profiler for PyTorch) into `--trace_dir` and prints each run's device
time per step by kernel class (`kernel_class`: gemm, attention, other) and its
`--top_kernels` longest kernels by name. Only GPU
kernels are counted; a CPU run writes its traces and reports no kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

RUNNERS = ("torch_on_tpu", "compile", "eager")
SMOKE = dict(model="debugmodel", layers=2, shapes="64x2,32x4", steps=1, warmup=1)  # every runner, both shapes, tiny
PROFILE_STEPS = 2
# Kernel names by class, by substring (lower case), attention first: cuDNN's and
# flash kernels also carry gemm-like architecture tags (sm90, xmma, cutlass).
KERNEL_CLASSES = (
  ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")),
  ("gemm", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "_mm_", "dot_")),
)
HP = dict(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0)
RESULT = "RESULT "  # a worker's last stdout line: RESULT {json}
WORKER_ENV = dict(os.environ)  # as the user started us, before this process sets anything


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="1B", help="torchtitan Llama 3 flavor (debugmodel, 1B, 3B, 8B, ...)")
  p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all)")
  p.add_argument("--shapes", default="8192x1,2048x4", help="comma-separated SEQxBATCH")
  p.add_argument("--steps", type=int, default=10, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
  p.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of " + ", ".join(RUNNERS))
  p.add_argument("--remat", default="auto", help="torch_on_tpu per-layer remat: auto (the recipe's) or torch_on_tpu.lowering.remat.NAMES")
  p.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None, help="torch_on_tpu: the layer stack as a scan (default: the recipe's, the loop on GPU)")
  p.add_argument("--attention", default="auto", help="torch_on_tpu attention kernel: auto (cuDNN on GPU), cudnn, xla")
  p.add_argument("--float8", default=None, help="also run each runner with float8 linears: rowwise, tensorwise, rowwise_with_gw_hp")
  p.add_argument("--xla_flags", default="", help="extra XLA_FLAGS for the torch_on_tpu runner")
  p.add_argument("--timeout", type=float, default=600, help="seconds a run may take before it is stopped")
  p.add_argument("--json", default=None, help="also write every run's numbers here")
  p.add_argument("--profile", action="store_true", help="trace each run and print device time by kernel class")
  p.add_argument("--top_kernels", type=int, default=15, help="--profile also lists each run's N longest kernels (0: none)")
  p.add_argument("--trace_dir", default="bench_gpu_traces", help="--profile writes its traces under here, one folder a run")
  p.add_argument("--smoke", action="store_true", help="tiny: " + ", ".join(f"--{k}={v}" for k, v in SMOKE.items()))
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # RUNNER:SEQxBATCH
  p.add_argument("--state", default=None, help=argparse.SUPPRESS)  # ours writes its initial params, PyTorch loads them
  args = p.parse_args(argv)
  if args.smoke:
    vars(args).update(SMOKE)
  asked = args.runners.split(",")
  unknown = set(asked) - set(RUNNERS)
  if unknown:
    p.error(f"--runners names {', '.join(sorted(unknown))}; choose from {', '.join(RUNNERS)}.")
  args.runners = [r for r in RUNNERS if r in asked]  # ours first: it writes the shared initial weights
  for shape in args.shapes.split(","):
    parse_shape(shape, p.error)
  if args.warmup < 1 or args.steps < 1:
    p.error("--warmup and --steps must be at least 1 (the first step compiles).")
  return args


def parse_shape(text: str, error=None) -> tuple[int, int]:
  try:
    seq, batch = (int(x) for x in text.lower().split("x"))
    if seq > 0 and batch > 0:
      return seq, batch
  except ValueError:
    pass
  (error or SystemExit)(f"shape {text!r} is not SEQxBATCH with positive integers, e.g. 8192x1.")


def torchtitan_on_older_torch() -> list[str]:
  """Imports torchtitan's Llama 3 package, with placeholders for torch names it lacks.

  torchtitan 0.3.0 imports, at module level, names that newer torch added (FSDP's
  `DataParallelMeshDims`, ...) for parallelisms this benchmark never applies; the
  GPU image's torch 2.11 lacks some. Each missing name becomes an empty class (a
  missing module an empty module) and the import is retried; on a torch that has
  them all this only imports. Returns what it filled in.
  """
  import importlib
  import types

  filled = []
  while len(filled) < 50:
    try:
      importlib.import_module("torchtitan.models.llama3")
      return filled
    except ImportError as e:
      missing = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(e))
      if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "torch":
        sys.modules[e.name] = types.ModuleType(e.name)
        filled.append(e.name)
      elif missing and missing.group(2).split(".")[0] == "torch":
        name, module = missing.groups()
        setattr(importlib.import_module(module), name, type(name, (), {"__module__": module}))
        filled.append(f"{module}.{name}")
      else:
        raise
  raise ImportError(f"torchtitan still does not import after placeholders for {', '.join(filled)}")


def llama3_config(model: str, *, layers: int | None, seqlen: int, float8: str | None = None):
  """torchtitan's config for the flavor: SDPA attention, RoPE for `seqlen`, first `layers` layers,
  linears in `float8` (a torchao recipe) when given.

  Built from torchtitan (and `torch_on_tpu.lowering.float8`'s converter, which imports no torchax)
  so the PyTorch workers never load torchax, whose `jax` device makes torch.compile refuse to run.
  """
  import dataclasses

  filled = torchtitan_on_older_torch()
  if filled:
    print(f"torch lacks what torchtitan imports; placeholders for: {', '.join(filled)}", flush=True)
  from torchtitan.models.common.attention import ScaledDotProductAttention
  from torchtitan.models.llama3 import model_registry

  config = model_registry(model).model
  if layers is not None:
    if not 0 < layers <= len(config.layers):
      raise SystemExit(f"--layers={layers}: Llama 3 {model} has {len(config.layers)} layers; pick 1..{len(config.layers)}.")
    config.layers = config.layers[:layers]
  for layer in config.layers:
    if seqlen > layer.attention.rope.max_seq_len:
      raise SystemExit(f"seq {seqlen} exceeds Llama 3 {model}'s {layer.attention.rope.max_seq_len} positions; use a shorter one.")
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
    layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seqlen)
  if float8 is not None:
    from torch_on_tpu.lowering.float8 import convert

    config = convert(config, float8)
  return config


def make_batches(n: int, seqlen: int, batch: int, vocab: int):
  import torch

  gen = torch.Generator().manual_seed(0)
  return [
    (torch.randint(0, vocab, (batch, seqlen), generator=gen), torch.randint(0, vocab, (batch, seqlen), generator=gen))
    for _ in range(n)
  ]


def loss_fn(logits, labels):
  import torch

  return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def timed_steps(step, batches, warmup: int, sync, profile=None) -> dict:
  """Runs warm-up then timed steps; `step(x, y)` returns the loss, `sync(loss)` waits for it.
  With `profile` (a context manager factory), `PROFILE_STEPS` more steps run inside it."""
  start = time.perf_counter()
  first = sync(step(*batches[0]))
  first_step_s = time.perf_counter() - start
  for x, y in batches[1:warmup]:
    sync(step(x, y))
  timed = batches[warmup:]
  start = time.perf_counter()
  for x, y in timed:
    loss = step(x, y)
  last = sync(loss)
  step_s = (time.perf_counter() - start) / len(timed)
  if profile:
    with profile():
      for i in range(PROFILE_STEPS):
        sync(step(*timed[i % len(timed)]))
  return dict(step_s=step_s, first_step_s=first_step_s, first_loss=first, last_loss=last)


def kernel_class(name: str) -> str:
  """gemm, attention or other, from a GPU kernel's name (`KERNEL_CLASSES`)."""
  lower = name.lower()
  return next((cls for cls, keys in KERNEL_CLASSES if any(k in lower for k in keys)), "other")


def kernel_events(trace: dict | list):
  """(name, seconds) of every GPU kernel in a Chrome-format trace: torch.profiler's (events
  of category `kernel`) or jax.profiler's (events on a `/device:` process's `Stream` lines)."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and "name" in e.get("args", {})}
  device = {pid for (pid, tid), name in names.items() if tid is None and name.startswith("/device:")}
  for e in events:
    if e.get("ph") != "X":
      continue
    on_stream = e.get("pid") in device and names.get((e.get("pid"), e.get("tid")), "").startswith("Stream")
    if e.get("cat") == "kernel" or on_stream:
      yield e["name"], e.get("dur", 0) / 1e6


def kernel_seconds(trace: dict | list) -> dict[str, float]:
  """Seconds of GPU kernels by class (`kernel_class`) in a trace."""
  seconds = dict.fromkeys(["gemm", "attention", "other"], 0.0)
  for name, s in kernel_events(trace):
    seconds[kernel_class(name)] += s
  return seconds


def top_kernels(trace: dict | list, n: int) -> list[list]:
  """The `n` kernels that took the most time in a trace: [name, seconds, launches], largest first."""
  totals = {}
  for name, s in kernel_events(trace):
    seconds, launches = totals.get(name, (0.0, 0))
    totals[name] = (seconds + s, launches + 1)
  ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:n]
  return [[name, seconds, launches] for name, (seconds, launches) in ranked]


def read_trace(path: str) -> dict | list:
  import gzip

  with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    return json.load(f)


def trace_dir(args, runner: str, seqlen: int, batch: int) -> str:
  return os.path.join(os.path.abspath(args.trace_dir), f"{runner}-{seqlen}x{batch}")


# ---- the workers: one (runner, shape) per process -------------------------------------------


def ours_worker(args, seqlen: int, batch: int, float8: str | None) -> dict:
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
  import jax
  import jax.numpy as jnp
  import optax
  import torch

  import torch_on_tpu as tot
  from recipes.flags import default_scan

  tot.setup()  # before jax starts its backend: our XLA flag defaults, and libtpu quiet where no TPU is

  config = llama3_config(args.model, layers=args.layers, seqlen=seqlen, float8=float8)
  with torch.device("meta"):
    model = config.build()
  scan = default_scan(jax.devices()[0].platform) if args.scan is None else args.scan
  start = time.perf_counter()
  jm = tot.ShardedModule(
    model, mesh=tot.make_mesh(jax.devices()[:1], fsdp=1), sharding="fsdp", attention=args.attention,
    scan=scan, remat=None if args.remat == "auto" else args.remat,
  )
  jax.block_until_ready(jm.params)
  init_s = time.perf_counter() - start
  print(f"torch_on_tpu {seqlen}x{batch}: params initialized on {jax.devices()[0]} in {init_s:.1f} s", flush=True)
  optimizer = optax.adamw(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"])
  step = tot.make_train_step(jm, loss_fn, optimizer, clip_norm=HP["clip_norm"], compute_dtype=jnp.bfloat16)
  batches = make_batches(args.warmup + args.steps, seqlen, batch, config.vocab_size)
  start = time.perf_counter()
  report = step.compile(*batches[0])
  compile_s = time.perf_counter() - start
  print(f"torch_on_tpu {seqlen}x{batch}: {report}", flush=True)
  if args.state and not os.path.exists(args.state):  # the PyTorch runners start from these weights
    import safetensors.torch

    state = {k: v.contiguous() for k, v in jm.state_dict().items()}
    safetensors.torch.save_file(state, args.state + ".partial")
    os.replace(args.state + ".partial", args.state)
  profile = None
  if args.profile:
    where = trace_dir(args, "torch_on_tpu" + ("+float8" if float8 else ""), seqlen, batch)
    profile = lambda: jax.profiler.trace(where, create_perfetto_trace=True)  # noqa: E731
  result = timed_steps(step, batches, args.warmup, sync=float, profile=profile)
  if args.profile:
    import glob

    (path,) = glob.glob(os.path.join(where, "**", "perfetto_trace.json.gz"), recursive=True)
    trace = read_trace(path)
    result.update(trace=path, kernel_s=kernel_seconds(trace), top_kernels=top_kernels(trace, args.top_kernels))
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  peak_memory = stats.get("peak_bytes_in_use", report.peak_bytes)
  return dict(
    result, init_s=init_s, compile_s=compile_s, first_step_total_s=init_s + compile_s + result["first_step_s"],
    peak_memory=peak_memory, device=device.device_kind, stack=f"jax {jax.__version__}", scan=scan,
  )


def torch_worker(args, seqlen: int, batch: int, float8: str | None, *, compiled: bool) -> dict:
  import torch

  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  torch.manual_seed(0)
  config = llama3_config(args.model, layers=args.layers, seqlen=seqlen, float8=float8)
  start = time.perf_counter()
  with device:
    model = config.build()
  if args.state and os.path.exists(args.state):
    import safetensors.torch

    missing, unexpected = model.load_state_dict(safetensors.torch.load_file(args.state, device=str(device)), strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    if unexpected or set(missing) - buffers:
      raise SystemExit(f"{args.state} does not hold this model's parameters: missing {missing}, unexpected {unexpected}")
  if cuda:
    torch.cuda.synchronize()
  init_s = time.perf_counter() - start
  if compiled:  # torchtitan's --compile: each block on its own, fullgraph
    for name, block in model.layers.named_children():
      model.layers.register_module(name, torch.compile(block, fullgraph=True))
  loss = torch.compile(loss_fn) if compiled else loss_fn
  opt = torch.optim.AdamW(
    model.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"],
    weight_decay=HP["weight_decay"], fused=cuda,
  )

  def step(x, y):
    with torch.autocast(device.type, dtype=torch.bfloat16):
      value = loss(model(x), y)
    value.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), HP["clip_norm"], foreach=cuda)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value

  def sync(value):
    return float(value)  # a device → host copy: waits for the step

  batches = [(x.to(device), y.to(device)) for x, y in make_batches(args.warmup + args.steps, seqlen, batch, config.vocab_size)]
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  profiler = None
  if args.profile:
    from torch.profiler import ProfilerActivity

    profiler = torch.profiler.profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
  result = timed_steps(step, batches, args.warmup, sync, profile=profiler and (lambda: profiler))
  if profiler:
    where = trace_dir(args, ("compile" if compiled else "eager") + ("+float8" if float8 else ""), seqlen, batch)
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, "trace.json")
    profiler.export_chrome_trace(path)
    trace = read_trace(path)
    result.update(trace=path, kernel_s=kernel_seconds(trace), top_kernels=top_kernels(trace, args.top_kernels))
  return dict(
    result, init_s=init_s, compile_s=None, first_step_total_s=init_s + result["first_step_s"],
    peak_memory=torch.cuda.max_memory_allocated() if cuda else None,
    device=torch.cuda.get_device_name() if cuda else "cpu", stack=f"torch {torch.__version__}",
  )


def worker(args) -> None:
  run, shape = args.worker.split(":")
  runner, _, precision = run.partition("+")
  float8 = args.float8 if precision == "float8" else None
  seqlen, batch = parse_shape(shape)
  if runner == "torch_on_tpu":
    result = ours_worker(args, seqlen, batch, float8)
  else:
    result = torch_worker(args, seqlen, batch, float8, compiled=runner == "compile")
  print(RESULT + json.dumps(result), flush=True)


# ---- the driver -----------------------------------------------------------------------------


def run_one(args, argv, runner: str, shape: str) -> dict:
  """One worker process, its output streamed; its RESULT line, or the reason it gave none."""
  import threading

  cmd = [sys.executable, os.path.abspath(__file__), *argv, f"--worker={runner}:{shape}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=WORKER_ENV)
  timer = threading.Timer(args.timeout, proc.kill)
  timer.start()
  lines, result = [], None
  for line in proc.stdout:
    line = line.rstrip("\n")
    if line.startswith(RESULT):
      result = json.loads(line[len(RESULT):])
    else:
      lines.append(line)
      print(f"  {line}", flush=True)
  proc.wait()
  timed_out = not timer.is_alive()
  timer.cancel()
  if proc.returncode == 0 and result is not None:
    return result
  if timed_out:
    return dict(error=f"stopped after {args.timeout:.0f} s")
  return dict(error=failure_reason(lines, proc.returncode))


def failure_reason(lines: list[str], returncode: int) -> str:
  """The table's one-cell reason for a worker that gave no result: out of memory, else the
  exception's own line (jax appends a note after it), else the last line printed."""
  text = "\n".join(lines)
  if any(s in text for s in ("RESOURCE_EXHAUSTED", "OutOfMemoryError", "out of memory")):
    return "out of memory"
  raised = [x.strip() for x in lines if re.match(r"\s*[\w.]*(Error|Exception|NotFound)\w*: ", x)]
  last = raised or [x.strip() for x in lines if x.strip()]
  return last[-1][:200] if last else f"exit {returncode}"


def table(rows: list[dict]) -> str:
  headers = [
    "shape", "runner", "step s", "tokens/s", "vs compile", "vs bf16", "MFU (titan)", "MFU (causal)",
    "peak mem GiB", "loss first→last", "init s", "to first step s",
  ]
  lines = []
  for r in rows:
    if "error" in r:
      lines.append([r["shape"], r["runner"], r["error"]] + [""] * (len(headers) - 3))
      continue
    precision = r["runner"].partition("+")[2]
    compile_run = "compile" + (f"+{precision}" if precision else "")
    base = next((o for o in rows if o["shape"] == r["shape"] and o["runner"] == compile_run and "error" not in o), None)
    bf16_run = r["runner"].partition("+")[0]
    bf16 = next((o for o in rows if o["shape"] == r["shape"] and o["runner"] == bf16_run and "error" not in o), None)
    mfu = lambda key: f"{100 * r[key] * r['tokens_per_s'] / r['peak_flops']:.1f}%" if r.get("peak_flops") else "-"  # noqa: E731
    lines.append([
      r["shape"], r["runner"], f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}",
      f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
      f"{r['tokens_per_s'] / bf16['tokens_per_s']:.2f}x" if bf16 and precision else "-",
      mfu("flops_torchtitan"), mfu("flops_causal"),
      f"{r['peak_memory'] / 2**30:.1f}" if r.get("peak_memory") else "-",
      f"{r['first_loss']:.3f}→{r['last_loss']:.3f}", f"{r['init_s']:.1f}", f"{r['first_step_total_s']:.1f}",
    ])
  return markdown(headers, lines)


def kernel_table(rows: list[dict]) -> str:
  """Device time per step by kernel class, for the runs `--profile` traced."""
  headers = ["shape", "runner", "gemm ms", "attention ms", "other ms", "kernels / step time", "trace"]
  lines = []
  for r in rows:
    if "kernel_s" not in r:
      continue
    ms = {k: 1e3 * v / PROFILE_STEPS for k, v in r["kernel_s"].items()}
    busy = sum(ms.values()) / (1e3 * r["step_s"])
    lines.append([r["shape"], r["runner"], *(f"{ms[k]:.1f}" for k in ("gemm", "attention", "other")),
                  f"{busy:.0%}" if busy else "no GPU kernels", r["trace"]])
  return markdown(headers, lines)


def top_kernel_table(row: dict) -> str:
  """One run's longest kernels, per step: what to look at first in its trace."""
  headers = ["kernel", "class", "ms / step", "launches / step"]
  lines = [[name if len(name) <= 90 else name[:87] + "...", kernel_class(name), f"{1e3 * s / PROFILE_STEPS:.2f}", f"{n / PROFILE_STEPS:g}"]
           for name, s, n in row["top_kernels"]]
  return markdown(headers, lines)


def markdown(headers: list[str], lines: list[list]) -> str:
  widths = [max(len(str(x[i])) for x in [headers, *lines]) for i in range(len(headers))]
  fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
  return "\n".join([fmt(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines)])


def check_flags(args) -> None:
  """Flags the workers would fail on, refused here in one sentence before any starts."""
  from torch_on_tpu import attention
  from torch_on_tpu.lowering import remat
  from torch_on_tpu.models.torchtitan import FLAVORS

  if args.model not in FLAVORS:
    raise SystemExit(f"--model={args.model!r} is not a torchtitan Llama 3 flavor; choose one of {', '.join(FLAVORS)}.")
  if args.remat not in ("auto", *remat.NAMES):
    raise SystemExit(f"--remat={args.remat!r} is not a remat policy; choose one of {', '.join(('auto', *remat.NAMES))}.")
  if args.attention not in attention.MODES:
    raise SystemExit(f"--attention={args.attention!r} is not a kernel; choose one of {', '.join(attention.MODES)}.")
  if args.json and os.path.isdir(args.json):
    raise SystemExit(f"--json={args.json} is a directory; name a file in it, e.g. {os.path.join(args.json, 'bench.json')}.")
  if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
    raise SystemExit(f"--json={args.json}: its directory does not exist; create it or pick another path.")
  if args.float8 is not None:
    from torch_on_tpu.errors import TorchOnTpuError
    from torch_on_tpu.lowering.float8 import check_recipe

    try:
      check_recipe(args.float8)
    except TorchOnTpuError as e:
      raise SystemExit(f"--float8: {e}") from None
  for shape in args.shapes.split(","):
    llama3_config(args.model, layers=args.layers, seqlen=parse_shape(shape)[0])  # flavor, layers, RoPE length


def add_flops(args, rows) -> None:
  """Model FLOPs per token and the device's peak for every row, computed here, after
  the workers, so a runner that failed leaves the others' MFU intact."""
  import torch

  from torch_on_tpu.training import metrics

  for seqlen in sorted({int(r["shape"].split("x")[0]) for r in rows}):
    with torch.device("meta"):
      model = llama3_config(args.model, layers=args.layers, seqlen=seqlen).build()
    flops = metrics.flops_per_token(model, seqlen)
    for r in rows:
      if r["shape"].startswith(f"{seqlen}x") and "error" not in r:
        r.update(flops_torchtitan=flops.torchtitan, flops_causal=flops.causal, params=flops.n_params)
        cpu = r["device"] == "cpu"
        r["peak_flops"] = metrics.cpu_matmul_peak() if cpu else metrics.peak_flops_for_kind(r["device"])


def layer_stack(args, rows) -> str:
  """How ours ran its layers: as flagged, else as its runs resolved the recipe's default."""
  scans = {r["scan"] for r in rows if "scan" in r} if args.scan is None else {args.scan}
  return " / ".join("scan" if s else "layer loop" for s in sorted(scans)) or "the recipe's layer stack"


def save(args, rows) -> None:
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), rows=rows), f, indent=1)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  os.environ["JAX_PLATFORMS"] = "cpu"  # the driver's jax only checks flags and counts FLOPs: the workers own the GPU
  check_flags(args)
  import tempfile

  rows = []
  workdir = tempfile.TemporaryDirectory()
  argv = [*argv, f"--state={os.path.join(workdir.name, 'init.safetensors')}"]
  for shape in args.shapes.split(","):
    seqlen, batch = parse_shape(shape)
    runs = [r + suffix for r in args.runners for suffix in ("", "+float8") if suffix == "" or args.float8]
    for runner in runs:
      print(f"== {runner} {shape}", flush=True)
      result = run_one(args, argv, runner, shape)
      result.update(runner=runner, shape=f"{seqlen}x{batch}", tokens=seqlen * batch)
      if "error" not in result:
        result["tokens_per_s"] = result["tokens"] / result["step_s"]
      rows.append(result)
      save(args, rows)  # after every run, so a stopped benchmark keeps what it measured
  workdir.cleanup()
  add_flops(args, rows)
  devices = sorted({r["device"] for r in rows if "device" in r})
  stacks = sorted({r["stack"] for r in rows if "stack" in r})
  print(
    f"\nLlama 3 {args.model}" + (f" (first {args.layers} layers)" if args.layers else "")
    + f", bf16 compute / fp32 master + AdamW; ours: {layer_stack(args, rows)}, remat {args.remat}, attention {args.attention}"
    + (f"; +float8: {args.float8} (torchao Float8Linear, lm_head bf16)" if args.float8 else "")
    + f"; {', '.join(devices)}; {', '.join(stacks)}; {args.steps} timed steps after {args.warmup}\n"
  )
  save(args, rows)
  print(table(rows), flush=True)
  if args.profile:
    print(f"\nGPU kernel time per step by class ({PROFILE_STEPS} traced steps after the timed ones)\n", flush=True)
    print(kernel_table(rows), flush=True)
    for r in rows:
      if r.get("top_kernels"):
        print(f"\n{r['runner']} {r['shape']}: its {len(r['top_kernels'])} longest kernels\n\n{top_kernel_table(r)}", flush=True)
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
