"""Every mesh axis through the plain API a user writes — `ShardedModule(model, mesh=make_mesh(...),
sharding=...)` and `make_train_step` — on an HF model and a torchtitan one: 3 AdamW steps against
eager torch, every step's loss and every trained weight within 1e-4 (‖Δ‖/‖ref‖, fp32). The HF
models are built on the CPU and uploaded, as `AutoModelForCausalLM.from_config` gives them (the
pipeline's upload once placed the embedding off the step's sharding), and padded on the left, so
the mask transformers builds crosses the tensor, sequence and pipeline splits."""

import copy

import optax
import pytest
import torch
import torch.nn.functional as F

import torch_on_tpu as tot
from tests import helpers as h
from tests.test_moe import build as build_moe
from torch_on_tpu.models.hf import build_causal_lm

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

TOL = 1e-4
STEPS = 3
# AdamW as tools/titan_parity.py sets it (its eps keeps a first, sign-like step off fp32 noise)
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-6, 0.1
# axis → (mesh, sharding preset, scan)
AXES = {
  "tp": (dict(fsdp=4, tp=2), "fsdp_tp", False),
  "cp": (dict(fsdp=4, cp=2), "fsdp", False),
  "pp": (dict(pp=2, fsdp=4), "fsdp", True),
  "ep": (dict(fsdp=2, ep=4), "ep", False),
}


def hf_batch(seed):
  tokens, labels = h.random_batch(256, seed=seed)
  padding = torch.ones_like(tokens)
  padding[0, :5] = 0
  padding[3, :2] = 0
  return {"input_ids": tokens, "attention_mask": padding}, labels


def ce(out, labels):
  return F.cross_entropy(h.logits_of(out).flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("axis", sorted(AXES))
def test_hf_model_trains_like_torch(axis):
  axes, sharding, scan = AXES[axis]
  if axis == "ep":
    ref = build_moe("qwen3_moe")
  else:
    torch.manual_seed(0)
    ref = build_causal_lm(h.hf_config("llama"), device="cpu")
  initial = copy.deepcopy(ref.state_dict())
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(**axes), sharding=sharding, scan=scan)
  step = tot.make_train_step(jm, ce, optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD))
  opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
  for i in range(STEPS):
    inputs, labels = hf_batch(i)
    ours = float(step(inputs, labels))
    opt.zero_grad()
    theirs = ce(ref(**inputs, use_cache=False), labels)
    theirs.backward()
    opt.step()
    assert h.rel(ours, theirs.item()) < TOL, (i, ours, theirs.item())
  trained = jm.state_dict()
  worst = max((h.rel(trained[n], p.detach()), n) for n, p in ref.named_parameters())
  assert worst[0] < TOL, worst
  assert h.rel(trained["lm_head.weight"], initial["lm_head.weight"]) > 1e-3  # the steps trained


@pytest.mark.parametrize("axis", sorted(AXES))
def test_torchtitan_model_trains_like_torch(axis):
  """torchtitan's Llama 3 debugmodel (Qwen3-MoE's for ep, with its load balancing and its experts in
  fp32 on both sides, `fp32_experts`, as torchtitan casts them to bf16 even in an fp32 model), 2 layers,
  on packed documents, against its eager model and `torch.optim.AdamW` (tools/titan_parity.py)."""
  parity = h.titan_parity()
  axes, sharding, scan = AXES[axis]
  spec = "qwen3:debugmodel_moe" if axis == "ep" else "llama3:debugmodel"
  config = parity.shrink(parity.registry_config(spec), layers=2)
  with parity.fp32_experts():
    jm = tot.ShardedModule(parity.build(config), mesh=tot.make_mesh(**axes), sharding=sharding, scan=scan)
    ref = parity.EagerReference(parity.flex_config(config), parity.all_tensors(jm))
    got = parity.run_bridge(jm, "fp32", forward=False, steps=STEPS, mtp=False)
    want = parity.run_reference(ref, forward=False, steps=STEPS)
  r = parity.compare(got, want, {n for n, _ in ref.model.named_parameters()})
  assert r["losses"] < TOL and r["weights"] < TOL, {k: v for k, v in r.items() if not k.startswith("_")}
