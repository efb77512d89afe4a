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
passes when ours is within 3× the spread on both. torchtitan's families go through
tools/titan_parity.py (`--precision=bf16`, its own measures: the largest relative loss
difference and the worst tensor's ‖ΔW‖/‖W‖; its second reference accumulates fp32 linears in
fp64 and keeps attention's probabilities fp32). Exit status 1 when any is not within 3×. MoE routers can flip a token's expert on a
one-unit difference, after which trained weights diverge chaotically (docs/torchtitan.md).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS, BATCH, SEQ, VOCAB = 5, 8, 16, 256
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
SPREAD_FACTOR = 3


def hf_architectures() -> dict:
  """name → a tiny config of every HF architecture the README lists (the suite's own configs)."""
  from tests import test_bf16_training

  return dict(test_bf16_training.HF)


def batches(steps: int = STEPS, seed: int = 0):
  import torch

  tokens = torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
  return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _logits(out):
  return out.logits if hasattr(out, "logits") else out


def eager_bf16(model, data, kwargs, ranks: int = 1):
  """(losses, trained parameters) of eager torch in bf16 mixed precision over `ranks` data-parallel ranks."""
  import torch
  import torch.nn.functional as F

  master = copy.deepcopy(model).float().train()
  opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
  losses = []
  for tokens, labels in data:
    work = copy.deepcopy(master)
    for p in work.parameters():
      p.data = p.data.to(torch.bfloat16)
    grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    total = 0.0
    for rows in torch.arange(len(tokens)).chunk(ranks):
      work.zero_grad()
      logits = _logits(work(tokens[rows], **kwargs)).float()
      loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten())
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


def bridge_bf16(model, data, kwargs):
  """(losses, trained parameters) of the same training through `make_train_step`, fsdp over 8 devices, scanned."""
  import jax.numpy as jnp
  import optax
  import torch.nn.functional as F

  import torch_on_tpu as tot

  jm = tot.ShardedModule(copy.deepcopy(model), mesh=tot.make_mesh(fsdp=8), scan=True)
  loss = lambda out, y: F.cross_entropy(_logits(out).flatten(0, 1), y.flatten())  # noqa: E731
  adamw = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
  step = tot.make_train_step(jm, loss, adamw, compute_dtype=jnp.bfloat16)
  losses = [float(step({"input_ids": tokens, **kwargs}, labels)) for tokens, labels in data]
  names = {n for n, _ in model.named_parameters()}
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


def _eager_attention(model):
  """A copy of `model` whose attention runs HF's "eager" kernel (where it has attention)."""
  other = copy.deepcopy(model)
  for module in other.modules():
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
      config._attn_implementation = "eager"
  return other


def hf_parity(arch: str, steps: int = STEPS) -> dict:
  """`judge` for one HF architecture of `hf_architectures()`."""
  import torch

  from tests import helpers as h

  config = hf_architectures()[arch]()
  for key, value in list(vars(config).items()):  # no dropout: both sides draw their own masks
    if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
      setattr(config, key, 0.0)
  torch.manual_seed(0)
  model = h.build_causal_lm(config, device="cpu")
  kwargs = h.call_kwargs(model)
  data = batches(steps)
  initial = {n: p.detach().clone() for n, p in model.named_parameters()}
  a = eager_bf16(model, data, kwargs, ranks=1)
  b = eager_bf16(_eager_attention(model), data, kwargs, ranks=8)
  return judge(bridge_bf16(model, data, kwargs), a, b, initial)


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

  names = args.names or [*sorted(hf_architectures()), *h.titan_parity().SPECS, "muse_glimmer:debugmodel"]
  headers = {
    False: "| HF architecture | largest loss Δ (spread) | ‖ΔW‖/‖W_A − W_0‖ (spread) | within 3× | s |",
    True: "| torchtitan family | largest relative loss Δ (spread) | worst tensor's ‖ΔW‖/‖W‖ (spread) | within 3× | s |",
  }
  failed, shown_header = 0, None
  for name in names:
    titan = ":" in name
    if shown_header is not titan:
      print(("\n" if shown_header is not None else "") + headers[titan] + "\n|---|---|---|---|---|")
      shown_header = titan
    start = time.perf_counter()
    try:
      r = titan_parity(name, args.steps) if titan else hf_parity(name, args.steps)
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
