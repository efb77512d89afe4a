"""bf16 training parity: every architecture of the README's tables, 5 AdamW steps with
`compute_dtype=bfloat16` through the bridge against eager torch training the same way,
judged by the spread of two valid eager bf16 runs.

    python tools/bf16_parity.py                      # every HF architecture, then torchtitan's families
    python tools/bf16_parity.py llama mixtral qwen3:debugmodel --steps=5

Both sides train as torchtitan's FSDP mixed precision and our recipes do: fp32 master weights
and AdamW state, forward and backward on bf16 copies of the parameters (buffers as they are),
fp32 gradients, the loss on fp32 logits. The eager runs, on CPU:

- A, one process, the model as built (HF's SDPA attention): the whole batch's bf16
  gradients, cast to fp32;
- B, the same training on eight data-parallel ranks (each eighth of the batch's bf16
  gradients cast to fp32 and averaged, FSDP's `reduce_dtype=float32`, as the bridge's
  fsdp=8 mesh) with HF's other attention kernel (`attn_implementation="eager"`: its
  probabilities rounded and summed in another order), as valid a bf16 run as A.

Reported per architecture: the largest loss difference over the steps and ‖ΔW‖/‖W_A − W_0‖
over all trained weights, ours against A and B against A (the spread); an architecture
passes when ours is within 3× the spread on both. torchtitan Flux and torch.nn's own modules
take another B: the correctly rounded run (every bf16 op computed in fp64 and rounded once,
eight ranks; their other CPU kernels round as A's do). torchtitan's families go through
tools/titan_parity.py (`--precision=bf16`, its own measures: the largest relative loss
difference and the worst tensor's ‖ΔW‖/‖W‖; its second reference accumulates fp32 linears in
fp64 and keeps attention's probabilities fp32). Exit status 1 when any is not within 3×. MoE routers can flip a token's expert on a
one-unit difference, after which trained weights diverge chaotically (docs/torchtitan.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS, BATCH, SEQ, VOCAB = 5, 8, 16, 256
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
SPREAD_FACTOR = 3


@dataclasses.dataclass
class Case:
  """One architecture as both sides train it.

  `data`: per step `(inputs, target)`, inputs a dict (keyword arguments) or a tuple (positional),
  every tensor's dim 0 the batch; `loss(outputs, target)` reads fp32 outputs; `other_kernel`: B's
  copy of the model and the context B runs in (another attention kernel where there is one)."""

  model: object
  data: list
  loss: object
  sharding: object = "fsdp"
  scan: bool = True
  other_kernel: object = None


def hf_architectures() -> dict:
  """name → a tiny config of every HF architecture the README lists (the suite's own configs)."""
  from tests import test_bf16_training

  return dict(test_bf16_training.HF)


def batches(steps: int = STEPS, seed: int = 0):
  tokens = torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
  return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _logits(out):
  return out.logits if hasattr(out, "logits") else out


def _token_loss(out, labels):
  import torch.nn.functional as F

  return F.cross_entropy(_logits(out).float().flatten(0, 1), labels.flatten())


def _mse(out, target):
  import torch.nn.functional as F

  return F.mse_loss(out.float(), target)


def _rows(tree, rows):
  """The batch rows `rows` of every tensor in `tree` (dim 0 is the batch)."""
  return torch.utils._pytree.tree_map(lambda x: x[rows] if isinstance(x, torch.Tensor) else x, tree)


def _call(model, inputs):
  return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def eager_bf16(case: Case, ranks: int = 1, other_kernel: bool = False):
  """(losses, trained parameters) of eager torch in bf16 mixed precision over `ranks` data-parallel ranks."""
  model, context = case.other_kernel(case.model) if other_kernel else (case.model, contextlib.nullcontext)
  master = copy.deepcopy(model).float().train()
  opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
  losses = []
  for inputs, target in case.data:
    work = copy.deepcopy(master)
    for p in work.parameters():
      p.data = p.data.to(torch.bfloat16)
    grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    total = 0.0
    for rows in torch.arange(len(target)).chunk(ranks):
      work.zero_grad()
      with context():
        loss = case.loss(_call(work, _rows(inputs, rows)), target[rows])
        loss.backward()
      for n, p in work.named_parameters():
        if p.grad is not None:
          grads[n] += p.grad.float() / ranks
      total += loss.item() / ranks
    for n, p in master.named_parameters():
      p.grad = grads[n]
    opt.step()
    losses.append(total)
  return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def bridge_bf16(case: Case):
  """(losses, trained parameters) of the same training through `make_train_step`, fsdp over 8 devices."""
  import jax.numpy as jnp
  import optax

  import torch_on_tpu as tot

  jm = tot.ShardedModule(copy.deepcopy(case.model), mesh=tot.make_mesh(fsdp=8), sharding=case.sharding, scan=case.scan)
  adamw = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
  step = tot.make_train_step(jm, case.loss, adamw, compute_dtype=jnp.bfloat16)
  losses = [float(step(inputs, target)) for inputs, target in case.data]
  names = {n for n, _ in case.model.named_parameters()}
  return losses, {n: tot.to_cpu(v) for n, v in jm.state_dict().items() if n in names}


def judge(ours, a, b, initial) -> dict:
  """Loss and weight differences of ours and of B, each against A (see the module docstring)."""
  def moved(run):
    num = sum(float((run[n].double() - a[1][n].double()).norm() ** 2) for n in a[1])
    den = sum(float((a[1][n].double() - initial[n].double()).norm() ** 2) for n in a[1])
    return (num / den) ** 0.5

  gap = lambda run: max(abs(x - y) for x, y in zip(run[0], a[0]))  # noqa: E731
  result = {"loss": gap(ours), "loss_spread": gap(b), "weights": moved(ours[1]), "weights_spread": moved(b[1])}
  result["ok"] = all(result[k] <= SPREAD_FACTOR * result[k + "_spread"] for k in ("loss", "weights"))
  return result


def parity(case: Case) -> dict:
  """`judge` for one case: ours, A (one process) and B (eight ranks, its other kernel)."""
  initial = {n: p.detach().clone() for n, p in case.model.named_parameters()}
  a = eager_bf16(case, ranks=1)
  b = eager_bf16(case, ranks=8, other_kernel=True)
  return judge(bridge_bf16(case), a, b, initial)


def _eager_attention(model):
  """A copy of `model` whose attention runs HF's "eager" kernel (where it has attention)."""
  other = copy.deepcopy(model)
  for module in other.modules():
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
      config._attn_implementation = "eager"
  return other, contextlib.nullcontext


class _CorrectlyRounded(torch.utils._python_dispatch.TorchDispatchMode):
  """Every bf16 op computed in fp64 and its output rounded once to the dtype torch gives it:
  the correctly rounded bf16 run, in forward and backward (in-place ops, and ops without an
  fp64 kernel, run as they are)."""

  def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    if func._schema.is_mutable or not _has_bf16((args, kwargs)):
      return out
    wide = lambda t: t.double() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t  # noqa: E731
    try:
      exact = func(*torch.utils._pytree.tree_map(wide, args), **torch.utils._pytree.tree_map(wide, kwargs))
    except RuntimeError:  # no fp64 kernel (oneDNN's RNN): the op as A runs it
      return out
    return torch.utils._pytree.tree_map(
      lambda o, e: e.to(o.dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() and isinstance(e, torch.Tensor) else o,
      out, exact,
    )


def _has_bf16(tree) -> bool:
  return any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in torch.utils._pytree.tree_leaves(tree))


def _correctly_rounded(model):
  """B for torch.nn's modules and Flux: `_CorrectlyRounded`, with oneDNN off (its RNN kernel has
  no fp64 form; torch's native one is built of ops that do). Their other torch kernels alone
  (SDPA's math kernel, oneDNN off, eight ranks) round as A's do: weights 1e-3 from A's."""

  @contextlib.contextmanager
  def context():
    with torch.backends.mkldnn.flags(enabled=False), _CorrectlyRounded():
      yield

  return model, context


def hf_case(arch: str, steps: int = STEPS) -> Case:
  from tests import helpers as h

  config = hf_architectures()[arch]()
  for key, value in list(vars(config).items()):  # no dropout: both sides draw their own masks
    if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
      setattr(config, key, 0.0)
  torch.manual_seed(0)
  model = h.build_causal_lm(config, device="cpu")
  kwargs = h.call_kwargs(model)
  data = [({"input_ids": tokens, **kwargs}, labels) for tokens, labels in batches(steps)]
  return Case(model, data, _token_loss, other_kernel=_eager_attention)


def hf_parity(arch: str, steps: int = STEPS) -> dict:
  """`judge` for one HF architecture of `hf_architectures()`."""
  return parity(hf_case(arch, steps))


# ---- torchtitan Flux and torch.nn's own modules ------------------------------------------------


def _float_case(model, inputs_of, steps, **kw) -> Case:
  """A model on bf16 floating inputs (as FSDP's `cast_forward_inputs` hands them on), MSE to a random target."""
  data = []
  for step in range(steps):
    inputs = inputs_of(step)
    inputs = torch.utils._pytree.tree_map(
      lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, inputs
    )
    with torch.no_grad():
      shape = _call(copy.deepcopy(model).to(torch.bfloat16), inputs).shape
    data.append((inputs, torch.randn(shape, generator=torch.Generator().manual_seed(1000 + step))))
  return Case(model, data, _mse, **kw)


def _randn(*shape, seed):
  return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ids(shape, high, seed):
  return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


class _Causal(torch.nn.Module):
  """`nn.TransformerEncoder` called as a causal stack (its mask is not per example, so it is made here)."""

  def __init__(self, encoder):
    super().__init__()
    self.encoder = encoder

  def forward(self, x):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
    return self.encoder(x, mask=mask, is_causal=True)


def module_cases() -> dict:
  """name → a builder of a `Case`: torchtitan Flux and the README's torch.nn rows."""
  from tests import test_torch_nn as nn_tests
  from tests import test_torchtitan_windows as windows

  nn = torch.nn

  def flux(steps):
    torch.manual_seed(0)
    model = windows.tiny_flux()
    return _float_case(model, lambda i: windows.flux_batch(i)[0], steps, other_kernel=_correctly_rounded)

  def torch_module(name):
    make, shape = nn_tests.MODULES[name]

    def build(steps):
      torch.manual_seed(0)
      model = make()
      return _float_case(model, lambda i: (_randn(*shape, seed=i),), steps, sharding=nn_tests._split_map(model),
                         scan=False, other_kernel=_correctly_rounded)
    return build

  def encoder(norm_first):
    def build(steps):
      torch.manual_seed(0)
      layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
      model = _Causal(nn.TransformerEncoder(layer, num_layers=3, norm=nn.LayerNorm(32), enable_nested_tensor=False))
      return _float_case(model, lambda i: (_randn(BATCH, 10, 32, seed=i),), steps, other_kernel=_correctly_rounded)
    return build

  def embedding(steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32, padding_idx=0), nn.Linear(32, 64))
    data = [((_ids((BATCH, 12), 64, seed=i),), _ids((BATCH, 12), 64, seed=100 + i)) for i in range(steps)]
    return Case(model, data, _token_loss, sharding=nn_tests._split_map(model), scan=False, other_kernel=_correctly_rounded)

  def embedding_bag(steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(64, 32, mode="mean"), nn.Linear(32, 16))
    data = [((_ids((BATCH, 6), 64, seed=i),), _ids((BATCH,), 16, seed=100 + i)) for i in range(steps)]
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.float(), y)  # noqa: E731
    return Case(model, data, loss, sharding=nn_tests._split_map(model), scan=False, other_kernel=_correctly_rounded)

  return {
    "flux": flux,
    **{f"nn.{name.replace(' + ', '+')}": torch_module(name) for name in nn_tests.MODULES},
    "nn.TransformerEncoder(post-norm)": encoder(False),
    "nn.TransformerEncoder(pre-norm)": encoder(True),
    "nn.Embedding(padding_idx)": embedding,
    "nn.EmbeddingBag(mean)": embedding_bag,
  }


def titan_parity(spec: str, steps: int = STEPS) -> dict:
  """The same judgement for a torchtitan family, through tools/titan_parity.py in bf16."""
  from tests import helpers as h

  tp = h.titan_parity()
  config = tp.shrink(tp.registry_config(spec))
  ours = tp.check(spec, "train", config=config, steps=steps, precision="bf16")
  spread = tp.check(spec, "spread", config=config, steps=steps, precision="bf16")
  result = {"loss": ours["losses"], "loss_spread": spread["losses"], "weights": ours["weights"],
            "weights_spread": spread["weights"]}
  result["ok"] = all(result[k] <= SPREAD_FACTOR * result[k + "_spread"] for k in ("loss", "weights"))
  return result


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("names", nargs="*", help="HF architectures and torchtitan specs (default: all)")
  p.add_argument("--steps", type=int, default=STEPS)
  args = p.parse_args(argv)
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  from tests import helpers as h

  modules = module_cases()
  names = args.names or [*sorted(hf_architectures()), *h.titan_parity().SPECS, "muse_glimmer:debugmodel", *modules]
  headers = {
    "hf": "| HF architecture | largest loss Δ (spread) | ‖ΔW‖/‖W_A − W_0‖ (spread) | within 3× | s |",
    "titan": "| torchtitan family | largest relative loss Δ (spread) | worst tensor's ‖ΔW‖/‖W‖ (spread) | within 3× | s |",
    "module": "| torchtitan Flux, torch.nn modules | largest loss Δ (spread) | ‖ΔW‖/‖W_A − W_0‖ (spread) | within 3× | s |",
  }
  failed, shown_header = 0, None
  for name in names:
    kind = "titan" if ":" in name else "module" if name in modules else "hf"
    if shown_header != kind:
      print(("\n" if shown_header is not None else "") + headers[kind] + "\n|---|---|---|---|---|")
      shown_header = kind
    start = time.perf_counter()
    try:
      if kind == "titan":
        r = titan_parity(name, args.steps)
      else:
        r = parity(modules[name](args.steps) if kind == "module" else hf_case(name, args.steps))
      shown = (f"{r['loss']:.1e} ({r['loss_spread']:.1e}) | {r['weights']:.1e} ({r['weights_spread']:.1e}) | "
               f"{'yes' if r['ok'] else 'NO'}")
      failed += not r["ok"]
    except Exception as e:  # noqa: BLE001 (a table of outcomes: each failure is one row)
      shown = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} | | NO"
      failed += 1
    print(f"| {name} | {shown} | {time.perf_counter() - start:.0f} |", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
