"""Every MoE architecture of the README at every expert-parallel layout against eager torch, one table.

    .venv/bin/python tools/moe_sweep.py                                   # every family × layout
    .venv/bin/python tools/moe_sweep.py --families=olmoe,qwen3:debugmodel_moe
    .venv/bin/python tools/moe_sweep.py --layouts=ep_tp,pp

On 8 simulated CPU devices, each family wrapped as a user wraps it (`ShardedModule(model, mesh=...,
sharding="ep", scan=True)`, `make_train_step`) on three meshes (`LAYOUTS`): `ep` (experts over 8),
`ep_tp` (fsdp 2 × ep 2 × tp 2: the expert-parallel group borrows tp, the tokens split over it inside
the MoE) and `pp` (pp 2 × fsdp 2 × ep 2: experts over ep inside two pipeline stages). A row: the
forward's ‖Δ‖/‖ref‖ against eager torch, then 5 AdamW steps from the same weights, the worst step's
loss and the worst trained weight, and the verdict against the tolerances the docs state:

* HF transformers' MoE classes (the tiny configs of tests/test_moe.py, fp32, a left-padded batch,
  HF's loss with the router's load-balancing term): forward 1e-5, every step's loss 1e-4, weights
  1e-4 (tests/test_moe.py, tests/test_plain_api_axes.py).
* torchtitan's registry flavors (tools/titan_parity.py's `check`: its shrunk configs, packed
  documents, its load-balancing hook on both sides): fp32 with the experts' bf16 casts taken out on
  both sides (`fp32_experts`), forward 1e-5, losses 1e-5, weights 1e-4, balancing buffers 1e-6
  (docs/moe.md); gpt-oss in torchtitan's bf16 compute, routed round-robin, forward, losses and
  weights each within 3× the spread of two valid eager references (docs/torchtitan.md).

Under `pp` a torchtitan flavor has layers enough for whole periods of its pattern on each stage
(`PP_LAYERS`; blocks whose tensors differ from the stack's, DeepSeek-V3's dense first layer and
Qwen3.5's full-attention ones, run outside the stages, as the scan runs them), HF's router logits are off (a pipeline hands back no per-layer
outputs, so the loss is the cross-entropy alone), and HF's stacks of mixed `layer_types` are not
run (`NOT_RUN`: the bridge refuses them under pp). Exits 1 when a row fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ and torch_on_tpu of this checkout

HF_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_next")
TITAN_FAMILIES = ("qwen3:debugmodel_moe", "deepseek_v3:debugmodel", "kimi_k2_7:debugmodel", "qwen3_5:debugmodel_moe", "gpt_oss:debugmodel")
# layout → (mesh axes, tools/titan_parity.py's mode for it)
LAYOUTS = {
  "ep": (dict(ep=8), "ep_train"),
  "ep_tp": (dict(fsdp=2, ep=2, tp=2), "ep_tp_train"),
  "pp": (dict(pp=2, fsdp=2, ep=2), "ep_pp_train"),
}
STEPS = 5
HF_TOL = dict(forward=1e-5, losses=1e-4, weights=1e-4)
TITAN_TOL = dict(forward=1e-5, losses=1e-5, weights=1e-4, buffers=1e-6)
SPREADS = 3  # bf16 rows: within this many times the spread of two eager references
# Layouts a family does not run, and why (tests/test_moe_sweep.py checks the refusal still stands).
NOT_RUN = {
  (family, "pp"): "n/a: pp refuses HF's mixed layer_types (docs/pipeline.md)"
  for family in ("gpt_oss", "qwen3_next")
}
# torchtitan flavors shrunk for pp (`titan_parity.shrink`'s layers): whole periods of their layer
# pattern on each of 2 stages (gpt-oss: sliding and full windows alternate; Qwen3.5: its 4-layer
# pattern twice, though only its first run of identical linear-attention blocks enters the stages).
PP_LAYERS = {"qwen3": 2, "deepseek_v3": 3, "kimi_k2_7": 3, "qwen3_5": 8, "gpt_oss": 4}


def hf_row(family: str, layout: str) -> dict:
  """One HF family on one layout: forward, worst step loss and worst weight, ‖Δ‖/‖ref‖."""
  import copy

  import optax
  import torch

  import torch_on_tpu as tot
  from tests import helpers as h
  from tests import test_moe
  from torch_on_tpu.models import hf

  lr, betas, eps, wd = (getattr(h.titan_parity(), k) for k in ("LR", "BETAS", "EPS", "WD"))
  ref = test_moe.build(family, **({"output_router_logits": False} if layout == "pp" else {}))
  axes, _ = LAYOUTS[layout]
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(**axes), sharding="ep", scan=True)
  inputs, _ = test_moe.left_padded_batch()
  forward = {k: v for k, v in inputs.items() if k != "labels"}

  def eager(**batch):
    """The model in eager torch on transformers' torch code (a kernel package an earlier import installed,
    fla's for Qwen3-Next, cannot run on CPU)."""
    with hf.torch_reference_kernels(ref):
      return ref(**batch)

  with torch.no_grad():
    want = eager(**forward).logits
  result = {"forward": h.rel(tot.to_cpu(jm(**forward).logits), want)}
  step = tot.make_train_step(jm, test_moe.model_loss, optax.adamw(lr, b1=betas[0], b2=betas[1], eps=eps, weight_decay=wd))
  opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
  losses = []
  for i in range(STEPS):
    batch, labels = test_moe.left_padded_batch(seed=i + 1)
    ours = float(step(batch, labels))
    opt.zero_grad()
    theirs = eager(**batch).loss
    theirs.backward()
    opt.step()
    losses.append(h.rel(ours, theirs.item()))
  trained = jm.state_dict()
  result["losses"] = max(losses)
  result["weights"] = max(h.rel(trained[n], p.detach()) for n, p in ref.named_parameters())
  return result


_spreads: dict = {}


def titan_row(spec: str, layout: str) -> dict:
  """One torchtitan flavor on one layout through `titan_parity.check` (forward and 5 steps), with
  the tolerances of its precision (a bf16 row's from the spread, measured once per config)."""
  import copy

  from tests import helpers as h

  tp = h.titan_parity()
  _, mode = LAYOUTS[layout]
  family = spec.split(":")[0]
  bf16 = tp.precision_of(spec) == "bf16"
  layers = PP_LAYERS[family] if layout == "pp" else 3

  def config():
    config = tp.registry_config(spec)
    if layers > len(config.layers):  # more layers than the flavor has: its pattern repeated
      config.layers = [copy.deepcopy(config.layers[i % len(config.layers)]) for i in range(layers)]
    return tp.shrink(config, layers=layers, round_robin=bf16)

  if not bf16:
    with tp.fp32_experts():
      return {**tp.check(spec, mode, steps=STEPS, config=config(), forward=True), "tolerance": TITAN_TOL}
  if (spec, layers) not in _spreads:
    _spreads[spec, layers] = tp.check(spec, "spread", steps=STEPS, config=config())
  spread = _spreads[spec, layers]
  tolerance = {k: SPREADS * spread[k] for k in ("forward", "losses", "weights")}
  return {**tp.check(spec, mode, steps=STEPS, config=config(), forward=True), "tolerance": tolerance}


def row(family: str, layout: str) -> dict:
  """{forward, losses, weights[, buffers], tolerance, verdict, seconds} of one family on one layout."""
  if (family, layout) in NOT_RUN:
    return {"verdict": NOT_RUN[family, layout], "seconds": 0.0}
  start = time.perf_counter()
  titan = ":" in family
  try:
    result = titan_row(family, layout) if titan else {**hf_row(family, layout), "tolerance": HF_TOL}
    over = [k for k, limit in result["tolerance"].items() if not result[k] <= limit]
    result["verdict"] = "pass" if not over else "fail: " + ", ".join(over)
  except Exception as e:  # noqa: BLE001 (a table of outcomes: each failure is one row)
    result = {"verdict": f"fail: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
  result["seconds"] = time.perf_counter() - start
  return result


def table_row(family: str, layout: str, result: dict) -> str:
  name = f"torchtitan {family}" if ":" in family else f"HF {family}"
  mesh = " × ".join(f"{k} {v}" for k, v in LAYOUTS[layout][0].items())
  shown = lambda k: f"{result[k]:.1e}" if k in result else "—"  # noqa: E731
  tolerance = result.get("tolerance")
  limits = " / ".join(f"{tolerance[k]:.1e}" for k in tolerance) if tolerance else "—"
  cells = [name, f"{layout} ({mesh})", *(shown(k) for k in ("forward", "losses", "weights", "buffers")), limits,
           result["verdict"], f"{result['seconds']:.0f}"]
  return "| " + " | ".join(cells) + " |"


HEADER = (
  "| family | layout | forward | losses (worst of 5 steps) | weights | buffers | tolerances (forward / losses / weights / buffers) | verdict | s |\n"
  "|---|---|---|---|---|---|---|---|---|"
)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--families", default=",".join(TITAN_FAMILIES + HF_FAMILIES),
                 help="comma-separated: HF families (test_moe's names) and torchtitan family:flavor specs")
  p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
  args = p.parse_args(argv)
  args.families, args.layouts = args.families.split(","), args.layouts.split(",")
  unknown = [f for f in args.families if f not in HF_FAMILIES + TITAN_FAMILIES] + [x for x in args.layouts if x not in LAYOUTS]
  if unknown:
    p.error(f"unknown: {', '.join(unknown)}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)  # before jax starts
  print(HEADER, flush=True)
  failed = False
  for family in args.families:
    for layout in args.layouts:
      result = row(family, layout)
      failed |= result["verdict"].startswith("fail")
      print(table_row(family, layout, result), flush=True)
  return int(failed)


if __name__ == "__main__":
  sys.exit(main())
