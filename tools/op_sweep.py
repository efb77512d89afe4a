"""PyTorch's operator test database through the public API, op by op: exact, wrong, or refused.

    .venv/bin/python tools/op_sweep.py                       # the whole op_db, table to stdout
    .venv/bin/python tools/op_sweep.py --ops=linalg.eigh,norm --verbose
    .venv/bin/python tools/op_sweep.py --json=runs/op_sweep.json --markdown=runs/op_sweep.md
    .venv/bin/python tools/op_sweep.py --shard=0/2 --json=a.json & ...; tools/op_sweep.py --merge a.json b.json

Every op of `torch.testing._internal.common_methods_invocations.op_db` with
float32 CPU samples runs every sample op_db generates for it under a fixed seed
(`--samples=N` keeps the first N, for a quick look):

- forward: the op inside a module's `forward`, called through `ShardedModule`
  (one simulated device), against eager torch;
- backward: the sample's differentiable tensors become the module's
  parameters, the op is called as torch's gradient tests call it (its
  `gradcheck_wrapper`, the outputs its sample's `output_process_fn_grad`
  keeps), the loss is Σ out·w over the floating outputs (w fixed random), and
  `TrainStep.gradients` is compared with torch's autograd.

A sample is *exact* when every output has torch's shape, the same kind of
dtype (bool / integer / floating / complex; jax's 32-bit integers stand in for
int64) and values within ‖Δ‖/‖ref‖ ≤ 1e-5 (NaN and ±Inf where torch has them;
an absolute floor of 1e-6·√n for outputs that are zero in torch; only shape
and dtype for `empty` and its kin, whose values torch leaves unspecified), *wrong*
when it runs and differs, *refused* when it raises `TorchOnTpuError` with a
one-sentence message, and *error* for anything else. An op takes its worst
sample (wrong, then error, then refused). Samples that draw from torch's
generator (random ops, dropout) and samples eager torch itself rejects are
left out, and so are ops left with none.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import signal
import time
import warnings

import numpy as np
import torch

TOLERANCE = 1e-5
# Ops whose values torch leaves unspecified (uninitialised memory): shape and dtype are compared.
UNSPECIFIED_VALUES = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
VERDICTS = ("exact", "wrong", "refused", "error")
# An op's verdict in one mode: its worst sample's, with how many samples were judged.
Outcome = collections.namedtuple("Outcome", "verdict detail samples", defaults=(1,))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ops", default=None, help="comma-separated op names (name or name.variant); default all")
  p.add_argument("--samples", type=int, default=0, help="samples per op (0: all of them)")
  p.add_argument("--modes", default="forward,backward")
  p.add_argument("--timeout", type=int, default=120, help="seconds per sample before it counts as an error")
  p.add_argument("--json", default=None, help="write every op's outcome here")
  p.add_argument("--markdown", default=None, help="write the summary and the non-exact ops here")
  p.add_argument("--verbose", action="store_true", help="print each op as it finishes")
  p.add_argument("--shard", default="0/1", help="i/n: run every n-th op from the i-th (merge the JSONs with --merge)")
  p.add_argument("--merge", nargs="*", default=None, help="JSON files of shards to merge into one table")
  return p.parse_args(argv)


# ---- which ops -----------------------------------------------------------------------------


def op_key(op) -> str:
  return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def float32_ops(names=None):
  """op_db's ops with float32 CPU support, sorted by key; `names` keeps those named."""
  from torch.testing._internal.common_methods_invocations import op_db

  ops = sorted((o for o in op_db if torch.float32 in o.supported_dtypes("cpu")), key=op_key)
  if names:
    wanted = set(names)
    ops = [o for o in ops if op_key(o) in wanted or o.name in wanted]
  return ops


def samples_of(op, count: int, requires_grad: bool):
  """The first `count` of the op's float32 samples (all of them when `count` is 0)."""
  torch.manual_seed(0)
  out = []
  for sample in op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad):
    out.append(sample)
    if len(out) == count:
      break
  return out


# ---- samples as tensors + structure --------------------------------------------------------


def _flatten(sample):
  leaves, spec = torch.utils._pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
  return leaves, spec


def _call(op, leaves, spec):
  x, args, kwargs = torch.utils._pytree.tree_unflatten(list(leaves), spec)
  return op(x, *args, **kwargs)


def _call_for_grad(op, leaves, spec, sample):
  """As torch's own gradient tests call an op: through its `gradcheck_wrapper` (which
  makes a Hermitian or triangular input of a general one), keeping the outputs its
  sample's `output_process_fn_grad` selects."""
  x, args, kwargs = torch.utils._pytree.tree_unflatten(list(leaves), spec)
  return sample.output_process_fn_grad(op.gradcheck_wrapper(op, x, *args, **kwargs))


def _clone(leaves):
  return [_copy(x) if isinstance(x, torch.Tensor) else x for x in leaves]


def _copy(x, dtype=None):
  """`x` detached and copied (in `dtype`); a view (op_db's `as_strided.partial_views`: a slice with a
  storage offset) stays one, over a copy of its whole storage, which `as_strided` reads."""
  x = x.detach()
  dtype = dtype or x.dtype
  if x.storage_offset() == 0 and x.is_contiguous():
    return x.clone().to(dtype)
  storage = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage()).clone().to(dtype)
  return storage.as_strided(x.shape, x.stride(), x.storage_offset())


def _output_tensors(out):
  leaves, _ = torch.utils._pytree.tree_flatten(out)
  return leaves


def _kind(dtype) -> str:
  if dtype == torch.bool:
    return "bool"
  if dtype.is_complex:
    return "complex"
  if dtype.is_floating_point:
    return "floating"
  return "integer"


def compare(got, want, values=True) -> str | None:
  """None when `got` matches eager's `want` (see the module docstring), else what differs."""
  got_leaves, want_leaves = _output_tensors(got), _output_tensors(want)
  if len(got_leaves) != len(want_leaves):
    return f"{len(got_leaves)} outputs, torch has {len(want_leaves)}"
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    if not isinstance(w, torch.Tensor):
      if isinstance(g, torch.Tensor):
        g = g.cpu().item() if g.numel() == 1 else g
      if isinstance(w, float) and isinstance(g, (int, float)) and math.isclose(g, w, rel_tol=TOLERANCE):
        continue
      if g != w:
        return f"output {i}: {g!r}, torch {w!r}"
      continue
    if not isinstance(g, torch.Tensor):
      return f"output {i}: a {type(g).__name__}, torch a tensor"
    g = _dense(g.detach().cpu())
    w = _dense(w.detach())
    if tuple(g.shape) != tuple(w.shape):
      return f"output {i}: shape {tuple(g.shape)}, torch {tuple(w.shape)}"
    if _kind(g.dtype) != _kind(w.dtype):
      return f"output {i}: dtype {g.dtype}, torch {w.dtype}"
    problem = _value_difference(g, w) if values else None
    if problem:
      return f"output {i}: {problem}"
  return None


def _dense(t: torch.Tensor) -> torch.Tensor:
  return t if t.layout == torch.strided else t.to_dense()


def _value_difference(g: torch.Tensor, w: torch.Tensor) -> str | None:
  if w.numel() == 0:
    return None
  if _kind(w.dtype) in ("bool", "integer"):
    mismatched = int((g.to(torch.int64) != w.to(torch.int64)).sum())
    return f"{mismatched} of {w.numel()} values differ" if mismatched else None
  g64 = g.to(torch.complex128 if w.is_complex() else torch.float64)
  w64 = w.to(g64.dtype)
  for name, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
    gm, wm = test(g64.real if w.is_complex() else g64), test(w64.real if w.is_complex() else w64)
    if not torch.equal(gm, wm):
      return f"{name} at {int((gm != wm).sum())} positions where torch differs"
  finite = torch.isfinite(w64.real if w.is_complex() else w64)
  if w.is_complex():
    finite &= torch.isfinite(w64.imag)
  delta = (g64 - w64)[finite]
  ref = w64[finite]
  err = float(torch.linalg.vector_norm(delta))
  norm = float(torch.linalg.vector_norm(ref))
  if math.isnan(err):
    return "NaN where torch is finite"
  if err <= TOLERANCE * norm or err <= 1e-6 * math.sqrt(max(ref.numel(), 1)) * (norm == 0 or norm < 1e-6):
    return None
  return f"rel err {err / norm:.2e}" if norm else f"abs err {err:.2e} (torch 0)"


def _widened(leaves):
  """The sample's float32 tensors as float64 (the reference rounding is judged against)."""
  return [
    _copy(x, torch.float64) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else
    (_copy(x) if isinstance(x, torch.Tensor) else x)
    for x in leaves
  ]


def rounding_only(got, want, want64) -> tuple[bool, str]:
  """Whether every floating output of ours is as close to torch's float64 result as
  torch's own float32 result is (within 2×, or 1e-5 relative): then the difference from
  eager float32 is rounding, not a different function. Also a note with both distances."""
  ok, notes = True, []
  for g, w, w64 in zip(_output_tensors(got), _output_tensors(want), _output_tensors(want64)):
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
      continue
    if not isinstance(w64, torch.Tensor) or tuple(w64.shape) != tuple(w.shape):
      return False, ""
    g64, w32, ref = (_dense(t.detach().cpu()).double() for t in (g, w, w64))
    finite = torch.isfinite(ref) & torch.isfinite(w32)
    if not torch.equal(torch.isfinite(g64), torch.isfinite(w32)):
      return False, ""
    ours = float(torch.linalg.vector_norm((g64 - ref)[finite]))
    torchs = float(torch.linalg.vector_norm((w32 - ref)[finite]))
    norm = max(float(torch.linalg.vector_norm(ref[finite])), 1e-30)
    ok &= ours <= max(2 * torchs, TOLERANCE * norm)
    notes.append(f"{ours / norm:.1e} vs torch float32 {torchs / norm:.1e}")
  return ok and bool(notes), "float64 distance " + ", ".join(notes)


def is_random(op, sample) -> bool:
  """The sample draws random numbers (bernoulli, dropout, randn, ...): the call advances
  torch's generator (see `_unfixed_seeds`). Its values cannot match torch's generator."""
  leaves, spec = _flatten(sample)
  torch.manual_seed(1)
  before = torch.get_rng_state()
  try:
    with torch.no_grad():
      _call(op, _clone(leaves), spec)
  except Exception:  # noqa: BLE001 (eager rejects the sample: judged, and skipped, later)
    return False
  return not torch.equal(before, torch.get_rng_state())


@contextlib.contextmanager
def _unfixed_seeds():
  """op_db wraps random ops in `wrapper_set_seed`, which seeds torch's generator inside
  the call; while active, the wrapper just calls the op, so `is_random` can see the draw."""
  from torch.testing._internal import common_methods_invocations as cmi

  original = cmi.wrapper_set_seed
  cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
  try:
    yield
  finally:
    cmi.wrapper_set_seed = original


# ---- through the bridge -------------------------------------------------------------------


class _Forward(torch.nn.Module):
  """The op on a sample whose tensors arrive as arguments."""

  def __init__(self, op, spec, statics):
    super().__init__()
    self.op, self.spec, self.statics = op, spec, statics

  def forward(self, *tensors):
    it = iter(tensors)
    leaves = [next(it) if s is _TENSOR else s for s in self.statics]
    return _call(self.op, leaves, self.spec)


class _WithParams(torch.nn.Module):
  """The op on a sample whose differentiable tensors are this module's parameters."""

  def __init__(self, op, spec, sample, leaves, trained):
    super().__init__()
    self.op, self.spec, self.sample = op, spec, sample
    self.slots = []  # per leaf: ("p", name) | ("in", k) | ("static", value)
    inputs = 0
    for i, x in enumerate(leaves):
      if i in trained:
        self.register_parameter(f"p{i}", torch.nn.Parameter(_copy(x)))
        self.slots.append(("p", f"p{i}"))
      elif isinstance(x, torch.Tensor):
        self.slots.append(("in", inputs))
        inputs += 1
      else:
        self.slots.append(("static", x))

  def forward(self, *tensors):
    leaves = [
      getattr(self, v) if k == "p" else tensors[v] if k == "in" else v for k, v in self.slots
    ]
    return _call_for_grad(self.op, leaves, self.spec, self.sample)


class _Tensor:
  pass


_TENSOR = _Tensor()


def _weights_for(outputs, seed=0):
  gen = torch.Generator().manual_seed(seed)
  return [
    torch.randn(o.shape, generator=gen).to(o.dtype) if _differentiable_output(o) else None
    for o in _output_tensors(outputs)
  ]


def _differentiable_output(o) -> bool:
  return isinstance(o, torch.Tensor) and o.dtype.is_floating_point


def weighted_sum(outputs, weights):
  """Σ out·w over the floating outputs (the loss both sides differentiate)."""
  total = None
  for o, w in zip(_output_tensors(outputs), weights):
    if w is None or not isinstance(o, torch.Tensor):
      continue
    term = (o * w).sum()
    total = term if total is None else total + term
  return total


class Bridge:
  """The public API on one simulated device: what a user would call."""

  def __init__(self):
    import optax

    import torch_on_tpu as tot

    self.tot = tot
    self.optax = optax
    devices = __import__("jax").devices()[:1]
    self.mesh = tot.make_mesh(devices, fsdp=1)

  def forward(self, op, leaves, spec):
    statics = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    tensors = [_copy(x) for x in leaves if isinstance(x, torch.Tensor)]
    jm = self.tot.ShardedModule(_Forward(op, spec, statics), mesh=self.mesh, sharding="replicated")
    out = jm(*tensors)
    return self.tot.to_cpu(out)

  def gradients(self, op, sample, leaves, spec, trained, weights):
    module = _WithParams(op, spec, sample, leaves, trained)
    inputs = tuple(_copy(x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and i not in trained)
    jm = self.tot.ShardedModule(module, mesh=self.mesh, sharding="replicated")
    labels = [None if w is None else w.float().numpy() for w in weights]  # the step sees fp32 outputs

    def loss_fn(outputs, labels):
      from torchax.interop import torch_view

      ws = [None if w is None else torch_view(w) for w in labels]
      return weighted_sum(outputs, ws)

    step = self.tot.make_train_step(jm, loss_fn, self.optax.sgd(0.0))
    _, grads = step.gradients(inputs, labels)
    return {int(k[1:]): torch.from_numpy(np.array(v)) for k, v in grads.items()}


# ---- one op --------------------------------------------------------------------------------


class _Timeout(Exception):
  pass


@contextlib.contextmanager
def _time_limit(seconds):
  def fire(*_):
    raise _Timeout(f"took over {seconds} s")

  old = signal.signal(signal.SIGALRM, fire)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _error_outcome(e: BaseException) -> Outcome:
  from torch_on_tpu.errors import TorchOnTpuError

  refused = e
  while refused is not None and not isinstance(refused, TorchOnTpuError):
    refused = refused.__cause__ or refused.__context__
  if refused is not None:
    message = str(refused)
    if "\n" in message.strip() or not message.rstrip().endswith((".", ")")):
      return Outcome("error", f"TorchOnTpuError not one sentence: {message[:300]!r}")
    return Outcome("refused", message)
  first = (str(e).strip().splitlines() or [""])[0]
  return Outcome("error", f"{type(e).__name__}: {first[:300]}")


def run_forward(bridge, op, sample, timeout) -> Outcome | None:
  if is_random(op, sample):
    return None
  leaves, spec = _flatten(sample)
  try:
    torch.manual_seed(0)
    with torch.no_grad():
      want = _call(op, _clone(leaves), spec)
  except Exception:  # noqa: BLE001 (a sample eager torch rejects is not ours to judge)
    return None
  try:
    with _time_limit(timeout), warnings.catch_warnings():
      warnings.simplefilter("ignore")
      got = bridge.forward(op, _clone(leaves), spec)
  except Exception as e:  # noqa: BLE001
    return _error_outcome(e)
  if op.name in SINGULAR_VECTORS and not want[0].is_complex():
    got = aligned_singular_vectors(got, want, SINGULAR_VECTORS[op.name])
  def reference64():
    with torch.no_grad():
      torch.manual_seed(0)
      return _call(op, _widened(leaves), spec)

  return _verdict(got, want, reference64, values=op.name not in UNSPECIFIED_VALUES)


def run_backward(bridge, op, sample, timeout) -> Outcome | None:
  if is_random(op, sample):
    return None
  leaves, spec = _flatten(sample)
  trained = {
    i for i, x in enumerate(leaves)
    if isinstance(x, torch.Tensor) and x.requires_grad and x.dtype.is_floating_point
  }
  if not trained:
    return None
  try:
    params = [_copy(x).requires_grad_(i in trained) if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves)]
    torch.manual_seed(0)
    out = _call_for_grad(op, params, spec, sample)
    weights = _weights_for(out)
    loss = weighted_sum(out, weights)
    if loss is None or not loss.requires_grad:
      return None
    order = sorted(trained)
    grads = torch.autograd.grad(loss, [params[i] for i in order], allow_unused=True)
    want = [torch.zeros_like(params[i]) if g is None else g for i, g in zip(order, grads)]
  except Exception:  # noqa: BLE001
    return None
  try:
    with _time_limit(timeout), warnings.catch_warnings():
      warnings.simplefilter("ignore")
      got = bridge.gradients(op, sample, _clone(leaves), spec, trained, weights)
  except Exception as e:  # noqa: BLE001
    return _error_outcome(e)
  def reference64():
    params = [x.requires_grad_(i in trained) if isinstance(x, torch.Tensor) else x for i, x in enumerate(_widened(leaves))]
    torch.manual_seed(0)
    out = _call_for_grad(op, params, spec, sample)
    loss = weighted_sum(out, [None if w is None else w.double() for w in weights])
    grads = torch.autograd.grad(loss, [params[i] for i in order], allow_unused=True)
    return [torch.zeros_like(params[i]) if g is None else g for i, g in zip(order, grads)]

  return _verdict([got[i] for i in order], want, reference64)


# Ops whose singular vectors are unique only up to sign (torch's docs say so): each of ours is
# flipped to torch's sign before comparing, with the matching vector of the other side.
SINGULAR_VECTORS = {"linalg.svd": "Vh", "svd": "V"}


def aligned_singular_vectors(got, want, other: str):
  """(U, S, V or Vh) of ours with every singular pair's sign chosen as torch's; with
  `full_matrices`, the vectors past the k-th span a complement whose basis is arbitrary: where
  ours spans torch's (the same projector), torch's basis is taken."""
  u, s, v = (x.detach().cpu() for x in got)
  if u.numel() == 0 or s.numel() == 0:
    return got
  k = s.shape[-1]
  flip = torch.sign((u[..., :k] * want[0][..., :k]).sum(-2))
  flip = torch.where(flip == 0, torch.ones_like(flip), flip)
  v = v.mT if other == "Vh" else v  # columns are vectors
  want_v = want[2].mT if other == "Vh" else want[2]
  u, v = (_with_complement_of(x[..., :k] * flip[..., None, :], x[..., k:], w[..., k:]) for x, w in ((u, want[0]), (v, want_v)))
  return u, s, v.mT if other == "Vh" else v


def _with_complement_of(vectors, complement, torch_complement):
  if complement.shape[-1] == 0:
    return vectors
  projector = lambda basis: basis @ basis.mT  # noqa: E731
  same = torch.linalg.matrix_norm(projector(complement) - projector(torch_complement)) <= 1e-5 * complement.shape[-1]
  return torch.cat([vectors, torch.where(same.all(), torch_complement, complement)], dim=-1)


def _verdict(got, want, reference64, values=True) -> Outcome:
  """exact / wrong for a result that ran: compared with eager float32 and, where it misses
  by value alone, with `reference64()` (the same call in float64; see `rounding_only`)."""
  problem = compare(got, want, values=values)
  if problem and " err " in problem:
    try:
      want64 = reference64()
    except Exception:  # noqa: BLE001 (no float64 kernel: judged at float32)
      want64 = None
    if want64 is not None:
      ok, note = rounding_only(got, want, want64)
      if ok:
        return Outcome("exact", note)
      problem += f" ({note})" if note else ""
  return Outcome("wrong", problem) if problem else Outcome("exact", "")


def worst(outcomes: list[Outcome]) -> Outcome:
  for verdict in ("wrong", "error", "refused"):
    for o in outcomes:
      if o.verdict == verdict:
        return o
  return outcomes[0]


def sweep_op(bridge, op, modes, samples=0, timeout=120) -> dict:
  """{mode: Outcome or None (nothing to judge)} for one op."""
  result = {}
  forward_samples = samples_of(op, samples, requires_grad=False)
  runners = {"forward": (run_forward, False), "backward": (run_backward, True)}
  for mode in modes:
    if mode == "backward" and not op.supports_autograd:
      result[mode] = None
      continue
    runner, grad = runners[mode]
    outcomes = []
    for sample in forward_samples if not grad else samples_of(op, samples, requires_grad=True):
      try:
        outcome = runner(bridge, op, sample, timeout)
      except Exception as e:  # noqa: BLE001 (a fault of the sweep itself is an error, not a crash)
        outcome = Outcome("error", f"sweep: {type(e).__name__}: {e}"[:300])
      if outcome is not None:
        outcomes.append(outcome)
    result[mode] = worst(outcomes)._replace(samples=len(outcomes)) if outcomes else None
  return result


# ---- the table -----------------------------------------------------------------------------


def summarize(results: dict, modes) -> dict:
  counts = {}
  for mode in modes:
    judged = [r[mode] for r in results.values() if r.get(mode)]
    c = collections.Counter(o.verdict for o in judged)
    counts[mode] = {v: c.get(v, 0) for v in VERDICTS} | {"ops": len(judged), "samples": sum(o.samples for o in judged)}
  return counts


def markdown(results: dict, modes, counts, seconds, samples=0) -> str:
  drawn = "every sample" if samples == 0 else f"up to {samples} samples"
  lines = [
    f"op_db float32, {drawn} per op, {time.strftime('%Y-%m-%d')}, {seconds:.0f} s of sweeping "
    f"(`python tools/op_sweep.py`)",
    "",
    "| | ops | samples | exact | silently wrong | refused (one sentence) | other error |",
    "|---|---|---|---|---|---|---|",
  ]
  for mode in modes:
    c = counts[mode]
    lines.append(
      f"| {mode} | {c['ops']} | {c['samples']} | {c['exact']} | {c['wrong']} | {c['refused']} | {c['error']} |"
    )
  for mode in modes:
    lines += ["", f"### {mode}: not exact", ""]
    for name, r in sorted(results.items()):
      o = r.get(mode)
      if o and o.verdict != "exact":
        lines.append(f"- `{name}` {o.verdict}: {o.detail}")
  return "\n".join(lines) + "\n"


def main(argv=None):
  args = parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  if args.merge:
    return _merged(args, modes)
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(1, replace=False)
  bridge = Bridge()
  index, count = (int(x) for x in args.shard.split("/"))
  ops = float32_ops(args.ops.split(",") if args.ops else None)[index::count]
  results = {}
  start = time.perf_counter()
  with _unfixed_seeds():
    for i, op in enumerate(ops):
      key = op_key(op)
      t0 = time.perf_counter()
      try:
        results[key] = sweep_op(bridge, op, modes, args.samples, args.timeout)
      except Exception as e:  # noqa: BLE001 (sample generation itself failed)
        results[key] = {"skipped": f"{type(e).__name__}: {e}"[:200]}
      if args.verbose:
        r = results[key]
        shown = ", ".join(f"{m}={r[m].verdict}: {r[m].detail[:160]}" for m in modes if r.get(m))
        print(f"[{i + 1}/{len(ops)}] {key} ({time.perf_counter() - t0:.1f}s) {shown or r}", flush=True)
  seconds = time.perf_counter() - start
  return _report(args, modes, results, seconds)


def _merged(args, modes):
  results, seconds = {}, 0.0
  for path in args.merge:
    with open(path) as f:
      shard = json.load(f)
    seconds += shard.pop("_seconds", 0.0)
    for name, r in shard.items():
      results[name] = {m: Outcome(**v) if isinstance(v, dict) else v for m, v in r.items()}
  return _report(args, modes, results, seconds)


def _report(args, modes, results, seconds):
  counts = summarize(results, modes)
  text = markdown(results, modes, counts, seconds, args.samples)
  print(text)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(text)
  if args.json:
    with open(args.json, "w") as f:
      table = {k: {m: (v._asdict() if isinstance(v, Outcome) else v) for m, v in r.items()} for k, r in results.items()}
      json.dump({**table, "_seconds": seconds}, f, indent=1)
  return counts


if __name__ == "__main__":
  main()
