"""bf16 rounding parity: each op's bf16 output and input gradient, jitted through the
bridge, against torch eager on CPU in bf16, as the share of elements that are
bit-identical (and the largest difference in bf16 units, ulp).

torch computes a bf16 elementwise, activation or norm op in fp32 and rounds once;
a lowering that computes in bf16 rounds at every step (torchax's `silu` is
`x * sigmoid(x)` in bf16: two roundings). This sweep finds such ops.

    python tools/bf16_sweep.py                       # every op, forward and backward
    python tools/bf16_sweep.py --ops=silu,gelu --n=65536
    python tools/bf16_sweep.py --excess_precision=true   # XLA may skip bf16 roundings

Prints one row per op: forward exact %, max ulp, backward exact %, max ulp.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROW = 64  # the last dim row-wise ops (softmax, norms) reduce over


def _norm_weight(x):
  return torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype)


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
  "layer_norm": (lambda x: F.layer_norm(x, (x.shape[-1],), _norm_weight(x), _norm_weight(x) - 1), 1),
  "rms_norm": (lambda x: F.rms_norm(x, (x.shape[-1],), _norm_weight(x), 1e-6), 1),
  "swiglu": (lambda x, y: F.silu(x) * y, 2),
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

  from torch_on_tpu import _compat

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
  out, grads = jax.jit(both)(arrays, ct)
  as_torch = lambda a: torch.from_numpy(np.asarray(a).view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
  return as_torch(out), [as_torch(g) for g in grads]


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, int]:
  """(share of bit-identical elements, largest difference in bf16 units)."""
  a, b = ours.view(torch.int16).int(), theirs.view(torch.int16).int()
  # bf16 bit patterns, ordered: negative numbers count down from the sign bit.
  a = torch.where(a < 0, -32768 - a, a)
  b = torch.where(b < 0, -32768 - b, b)
  nan = ours.isnan() & theirs.isnan()
  diff = torch.where(nan, 0, (a - b).abs())
  return float((diff == 0).float().mean()), int(diff.max())


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
      "forward": forward[0], "forward_ulp": forward[1],
      "backward": min(b[0] for b in backward), "backward_ulp": max(b[1] for b in backward),
    })
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
  parser.add_argument("--n", type=int, default=16384, help="elements per input")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--excess_precision", choices=("default", "true", "false"), default="default",
    help="XLA's xla_allow_excess_precision (may it skip bf16 roundings?); default: what the bridge sets",
  )
  args = parser.parse_args(argv)
  if args.excess_precision != "default":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_allow_excess_precision={args.excess_precision}"
  names = [o for o in args.ops.split(",") if o]
  unknown = [o for o in names if o not in OPS]
  if unknown:
    parser.error(f"unknown op {unknown[0]!r}; choose from {', '.join(OPS)}")
  print(f"{'op':<12} {'fwd exact':>9} {'fwd ulp':>7} {'bwd exact':>9} {'bwd ulp':>7}")
  for r in sweep(names, args.n, args.seed):
    print(f"{r['op']:<12} {r['forward']:>9.1%} {r['forward_ulp']:>7} {r['backward']:>9.1%} {r['backward_ulp']:>7}")


if __name__ == "__main__":
  main()
