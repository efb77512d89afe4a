"""bf16 rounding parity: each op's bf16 output and input gradient, jitted through the
bridge, against torch eager on CPU in bf16, as the share of elements that are
bit-identical (and the largest difference in bf16 units, ulp).

torch computes a bf16 elementwise, activation or norm op in fp32 and rounds once;
a lowering that computes in bf16 rounds at every step (torchax's `silu` is
`x * sigmoid(x)` in bf16: two roundings). This sweep finds such ops.

    python tools/bf16_sweep.py                       # every op, forward and backward
    python tools/bf16_sweep.py --ops=silu,gelu --n=65536
    python tools/bf16_sweep.py --excess_precision=true   # XLA may skip bf16 roundings
    python tools/bf16_sweep.py --moe                      # the model-level check below

`--moe`: torchtitan's qwen3 `debugmodel_moe` (its experts compute in bf16 whatever the
model's dtype), cut to 2 layers, SDPA attention, fp32 elsewhere, on 8 simulated devices
(fsdp=8): logits and parameter gradients of a cross-entropy loss, ‖Δ‖/‖ref‖ against torch
eager on CPU (reference A). The spread of valid references is reference B against A: the
same model with every fp32 `F.linear` accumulated in fp64 and rounded to fp32 (a more exact
but equally valid matmul path). In fp32 the two differ at fp32 rounding level; the bf16
experts round their inputs to bf16, so an fp32-level difference there moves some inputs by
one bf16 unit, and that is the spread any valid bf16 run has. (Running each expert as its own
`torch.mm` instead of `torch._grouped_mm` gives bit-identical results on CPU.) The bridge
runs with XLA's excess precision off (its default) and on.

Prints a Markdown table, one row per op: the share of bit-identical elements and
‖Δ‖/‖ref‖, forward and backward (the gradient of every input for a random cotangent).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROW = 64  # the last dim row-wise ops (softmax, norms) reduce over


# name → (function of bf16 tensors, number of inputs); rows of ROW for row-wise ops.
OPS = {
  "silu": (F.silu, 1),
  "gelu": (F.gelu, 1),
  "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), 1),
  "relu": (F.relu, 1),
  "sigmoid": (torch.sigmoid, 1),
  "tanh": (torch.tanh, 1),
  "softplus": (F.softplus, 1),
  "mish": (F.mish, 1),
  "elu": (F.elu, 1),
  "leaky_relu": (F.leaky_relu, 1),
  "hardswish": (F.hardswish, 1),
  "exp": (torch.exp, 1),
  "log": (lambda x: torch.log(x.abs() + 0.5), 1),
  "sqrt": (lambda x: torch.sqrt(x.abs()), 1),
  "rsqrt": (lambda x: torch.rsqrt(x.abs() + 0.1), 1),
  "reciprocal": (lambda x: torch.reciprocal(x.abs() + 0.1), 1),
  "erf": (torch.erf, 1),
  "sin": (torch.sin, 1),
  "cos": (torch.cos, 1),
  "square": (torch.square, 1),
  "pow3": (lambda x: torch.pow(x, 3), 1),
  "add": (torch.add, 2),
  "mul": (torch.mul, 2),
  "div": (lambda x, y: x / (y.abs() + 0.1), 2),
  "softmax": (functools.partial(F.softmax, dim=-1), 1),
  "log_softmax": (functools.partial(F.log_softmax, dim=-1), 1),
  "logsumexp": (functools.partial(torch.logsumexp, dim=-1), 1),
  "mean": (functools.partial(torch.mean, dim=-1), 1),
  "sum": (functools.partial(torch.sum, dim=-1), 1),
  "var": (functools.partial(torch.var, dim=-1), 1),
  "layer_norm": (lambda x, w: F.layer_norm(x, (ROW,), w[0], w[1]), 2),
  "rms_norm": (lambda x, w: F.rms_norm(x, (ROW,), w[0], 1e-6), 2),
  "swiglu": (lambda x, y: F.silu(x) * y, 2),
  "group_norm": (lambda x, w: F.group_norm(x.view(x.shape[0], 16, ROW // 16), 4, w[0, :16], w[1, :16]), 2),
  "conv1d_bias": (lambda x, w: F.conv1d(x.view(x.shape[0], 16, ROW // 16), w[:32, :48].reshape(32, 16, 3), w[32, :32], padding=1), 2),
  "linear_bias": (lambda x, w: F.linear(x, w[:ROW], w[ROW]), 2),
  "addmm": (lambda x, w: torch.addmm(w[ROW], x, w[:ROW]), 2),
}


def bf16_inputs(count: int, n: int, seed: int) -> list[torch.Tensor]:
  """`count` bf16 tensors (n // ROW, ROW) spanning magnitudes 0.01 to 10."""
  g = torch.Generator().manual_seed(seed)
  out = []
  for _ in range(count):
    scale = torch.logspace(-2, 1, n // ROW, dtype=torch.float32)[:, None]
    out.append((torch.randn(n // ROW, ROW, generator=g) * scale).to(torch.bfloat16))
  return out


def torch_eager(fn, xs, cotangent):
  leaves = [x.clone().requires_grad_() for x in xs]
  out = fn(*leaves)
  out.backward(cotangent)
  return out.detach(), [x.grad for x in leaves]


def bridge(fn, xs, cotangent):
  """The same function, jitted through torchax with the bridge's lowerings."""
  import jax

  from torch_on_tpu.core import _compat

  torchax = _compat.import_torchax()
  from torchax.interop import jax_view, torch_view

  env = torchax.default_env()

  def f(*arrays):
    with env:
      return jax_view(fn(*torch_view(arrays)))

  def both(arrays, ct):
    out, vjp = jax.vjp(f, *arrays)
    return out, vjp(ct)

  arrays = [jax.numpy.asarray(x.view(torch.int16).numpy()).view(jax.numpy.bfloat16) for x in xs]
  ct = jax.numpy.asarray(cotangent.view(torch.int16).numpy()).view(jax.numpy.bfloat16)
  from torch_on_tpu.runtime import xla_flags

  out, grads = jax.jit(both, compiler_options=xla_flags.compile_options("cpu"))(arrays, ct)
  as_torch = lambda a: torch.from_numpy(np.asarray(a).view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
  return as_torch(out), [as_torch(g) for g in grads]


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
  """(share of bit-identical elements, ‖Δ‖/‖ref‖)."""
  same = (ours.view(torch.int16) == theirs.view(torch.int16)) | (ours.isnan() & theirs.isnan())
  a, b = ours.double(), theirs.double()
  return float(same.double().mean()), float((a - b).norm() / b.norm().clamp_min(1e-300))


def sweep(names, n: int = 16384, seed: int = 0) -> list[dict]:
  """One row per op: forward and backward agreement with torch eager CPU bf16."""
  import torch_on_tpu as tot

  tot.setup()
  rows = []
  for name in names:
    fn, count = OPS[name]
    xs = bf16_inputs(count, n, seed)
    with torch.no_grad():
      shape = fn(*xs).shape
    cotangent = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    want, want_grads = torch_eager(fn, xs, cotangent)
    got, got_grads = bridge(fn, xs, cotangent)
    forward = agreement(got, want)
    backward = [agreement(g, w) for g, w in zip(got_grads, want_grads)]
    rows.append({
      "op": name,
      "forward": forward[0], "forward_rel": forward[1],
      "backward": min(b[0] for b in backward), "backward_rel": max(b[1] for b in backward),
    })
  return rows


def _qwen3_moe(layers: int):
  from torchtitan.models.common.attention import ScaledDotProductAttention
  from torchtitan.models.qwen3 import model_registry

  config = model_registry("debugmodel_moe").model
  config.layers = config.layers[:layers]
  for layer in config.layers:
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
  torch.manual_seed(0)
  with torch.device("cpu"):
    model = config.build()
  model.init_states(buffer_device=torch.device("cpu"))
  return model


class Fp64Linears(torch.overrides.TorchFunctionMode):
  """Reference B: every fp32 `F.linear` accumulated in fp64, rounded to fp32."""

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func is F.linear and args[0].dtype == torch.float32:
      x, w, *rest = args
      b = rest[0] if rest else kwargs.get("bias")
      return F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    return func(*args, **kwargs)


def _eager(model, tokens, labels):
  model.zero_grad()
  logits = model(tokens)
  F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
  return logits.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def moe_spread(layers: int = 2, batch: int = 8, seq: int = 64) -> dict:
  """name → (‖Δ‖/‖A‖ of logits, of gradients, the bridge's fastest of 3 forward+backward
seconds): reference B, and the bridge with excess precision off and on."""
  import copy

  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  import jax

  import torch_on_tpu as tot
  from torch_on_tpu.core import _compat

  torchax = _compat.import_torchax()
  from torchax.interop import jax_view, torch_view
  tot.setup()
  ref = _qwen3_moe(layers)
  g = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, 2048, (batch, seq), generator=g)
  labels = torch.randint(0, 2048, (batch, seq), generator=g)
  logits_a, grads_a = _eager(copy.deepcopy(ref), tokens, labels)
  with Fp64Linears():
    logits_b, grads_b = _eager(copy.deepcopy(ref), tokens, labels)

  def flat(grads):
    return np.concatenate([np.asarray(grads[n]).ravel() for n in sorted(grads_a)])

  rows = {"reference B": (_rel(logits_b, logits_a), _rel(flat(grads_b), flat(grads_a)), None)}
  tot.override_op(torch.ops.torchtitan.deterministic_scatter_add.default, lambda o, i, s: o.scatter_add(0, i, s))
  mesh = tot.make_mesh(fsdp=8)
  for excess in (False, True):
    xla_flags.EXCESS_PRECISION = excess
    jm = tot.ShardedModule(copy.deepcopy(ref), mesh=mesh, sharding="fsdp", attention="xla")

    def loss(params, tokens, labels):
      with torchax.default_env():
        logits = jm.functional_call(params, jm.buffers, torch_view(tokens))
        value = F.cross_entropy(logits.flatten(0, 1).float(), torch_view(labels).flatten())
      return jax_view(value), jax_view(logits.float())

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=jm.compile_options)
    args = (jm.params, jm.place(tokens), jm.place(labels))
    (_, logits), grads = step(*args)
    times = []
    for _ in range(3):
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      times.append(time.perf_counter() - start)
    grads = {n: np.asarray(a, np.float32) for n, a in grads.items()}
    rows[f"bridge, excess precision {'on' if excess else 'off'}"] = (
      _rel(np.asarray(logits), logits_a), _rel(flat(grads), flat(grads_a)), min(times)
    )
  xla_flags.EXCESS_PRECISION = False
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
  parser.add_argument("--n", type=int, default=16384, help="elements per input")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--excess_precision", choices=("default", "true", "false"), default="default",
    help="XLA's xla_allow_excess_precision (may it skip bf16 roundings?); default: what the bridge sets",
  )
  parser.add_argument("--moe", action="store_true", help="qwen3 debugmodel_moe against two eager references")
  args = parser.parse_args(argv)
  if args.moe:
    print("| qwen3 debugmodel_moe, ‖Δ‖/‖A‖ | logits | gradients | forward + backward s |")
    print("|---|---|---|---|")
    for name, (logits, grads, seconds) in moe_spread().items():
      print(f"| {name} | {logits:.2e} | {grads:.2e} | {'' if seconds is None else f'{seconds:.2f}'} |")
    return 0
  if args.excess_precision != "default":
    from torch_on_tpu.runtime import xla_flags

    xla_flags.EXCESS_PRECISION = args.excess_precision == "true"
  names = [o for o in args.ops.split(",") if o]
  unknown = [o for o in names if o not in OPS]
  if unknown:
    parser.error(f"unknown op {unknown[0]!r}; choose from {', '.join(OPS)}")
  print("| op | forward bit-identical | forward ‖Δ‖/‖ref‖ | backward bit-identical | backward ‖Δ‖/‖ref‖ |")
  print("|---|---|---|---|---|")
  for r in sweep(names, args.n, args.seed):
    print(f"| {r['op']} | {r['forward']:.1%} | {r['forward_rel']:.1e} | {r['backward']:.1%} | {r['backward_rel']:.1e} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
