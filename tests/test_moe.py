"""Mixture-of-experts: HF's MoE families unmodified, jitted, expert-parallel, at parity.

transformers 5 runs experts through `torch._grouped_mm` (lowered to
`jax.lax.ragged_dot`: dropless, one static shape). Every family is checked
against PyTorch eager on CPU (fp32, ‖Δ‖/‖ref‖) on a left-padded batch with the
router's auxiliary loss in the loss: logits (from the scanned model where the layers
scan) and loss within 1e-5, gradients within 1e-4, scanned = unscanned within 1e-6,
and 5 AdamW steps with the same per-step losses (1e-4).
"""

import copy

import numpy as np
import optax
import pytest
import torch
import transformers

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.lowering.aten import model_ops
from torch_on_tpu.parallel import mesh as mesh_lib

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

COMMON = dict(
  vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
  max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True,
)
EXPERTS = dict(num_experts_per_tok=2)
FAMILIES = {
  "mixtral": lambda: transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **EXPERTS, **COMMON),
  "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
    intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8, **EXPERTS, **COMMON
  ),
  "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
    intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16, **EXPERTS, **COMMON
  ),
  "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=32, num_experts=8, **EXPERTS, **COMMON),
  "deepseek_v3": lambda: transformers.DeepseekV3Config(
    intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, n_group=1,
    topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, **EXPERTS, **{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3},
  ),
  "gpt_oss": lambda: transformers.GptOssConfig(
    intermediate_size=32, num_local_experts=8, head_dim=16, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"], **EXPERTS, **COMMON,
  ),
}
# Qwen3-Next: MoE layers in a hybrid stack (Gated DeltaNet and full attention), trained in bf16 by
# tests/test_bf16_training.py and at every expert layout by tools/moe_sweep.py.
HYBRID = {
  "qwen3_next": lambda: transformers.Qwen3NextConfig(
    intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, head_dim=16,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], **EXPERTS, **COMMON,
  ),
}
# Why a family's layers do not scan (they then run unscanned, with the reason logged).
# DeepSeek-V3's dense first layer runs as it is and its MoE layers 1-2 scan.
UNSCANNED = {"gpt_oss": "2 layers of alternating kinds: under two whole groups to scan after the first"}


def build(family, device="cpu", experts="grouped_mm", **overrides):
  """`family`'s tiny model in eager torch, seed 0; `overrides` set config fields."""
  config = {**FAMILIES, **HYBRID}[family]()
  config.update(overrides)
  config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # gpt-oss: attention sinks
  config._experts_implementation = experts
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(config)
  model.eval()
  return model


def left_padded_batch(seed=0, batch=8, seqlen=16):
  g = torch.Generator().manual_seed(seed)
  tokens = torch.randint(1, 256, (batch, seqlen + 1), generator=g)
  mask = torch.ones(batch, seqlen, dtype=torch.long)
  mask[::2, :5] = 0
  x, y = tokens[:, :-1], tokens[:, 1:].clone()
  y[mask == 0] = -100
  return {"input_ids": x, "attention_mask": mask, "labels": y, "use_cache": False}, y


def model_loss(out, labels):
  return out.loss  # HF's: cross-entropy plus router_aux_loss_coef × the load-balancing loss


def torch_loss_and_grads(ref, inputs):
  ref.zero_grad()
  out = ref(**inputs)
  out.loss.backward()
  return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def ours_loss_and_grads(jm, inputs, labels):
  step = tot.make_train_step(jm, model_loss, optax.sgd(1.0))
  loss, grads = step.gradients(inputs, labels)
  grads = h.per_layer(jm, {k: np.asarray(v) for k, v in grads.items()}) if jm._layout else grads
  return loss, grads


# ---- the grouped matmul ------------------------------------------------------------------------


def grouped_reference(a, b, offs):
  """torch's `_grouped_mm` 2-D × 3-D by its definition: row group g times b[g]."""
  out, start = [], 0
  for g, end in enumerate(offs.tolist()):
    out.append(a[start:end] @ b[g])
    start = end
  return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_lowering_matches_torch_values_and_gradients(dtype):
  import jax
  import jax.numpy as jnp

  g = torch.Generator().manual_seed(0)
  a, b = torch.randn(24, 16, generator=g), torch.randn(5, 16, 8, generator=g)
  offs = torch.tensor([3, 3, 10, 21, 21], dtype=torch.int32)  # empty groups; 3 rows past the last
  a_, b_ = (x.to(dtype).float().clone().requires_grad_() for x in (a, b))
  want = grouped_reference(a_, b_, offs)
  w = torch.randn(want.shape, generator=g)
  (want * w).sum().backward()

  def ours(a, b):
    return model_ops._grouped_mm(a, b, jnp.asarray(offs.numpy()))

  jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
  aj, bj = jnp.asarray(a.numpy()).astype(jdtype), jnp.asarray(b.numpy()).astype(jdtype)
  out, vjp = jax.vjp(ours, aj, bj)
  assert out.dtype == jdtype and out.shape == (24, 8)
  assert not np.asarray(out[21:], np.float32).any()  # rows past the last group are zero
  da, db = vjp(jnp.asarray(np.pad(w.numpy(), ((0, 3), (0, 0)))).astype(jdtype))
  tol = 1e-5 if dtype == torch.float32 else 1e-2
  assert h.rel(np.asarray(out[:21], np.float32), want.detach().numpy()) < tol
  assert h.rel(np.asarray(da[:21], np.float32), a_.grad[:21].numpy()) < tol
  assert h.rel(np.asarray(db, np.float32), b_.grad.numpy()) < tol


@pytest.mark.parametrize("sizes", [[3, 0, 7, 11, 0], [40, 0, 0, 0, 1, 25, 30, 8]], ids=["empty-groups", "skewed"])
def test_blocked_ragged_matmul_matches_ragged_dot_and_pads_at_most_a_block_per_group(sizes):
  """The CPU/GPU form of the grouped matmul against jax's dense-masked `ragged_dot`."""
  import jax
  import jax.numpy as jnp

  from torch_on_tpu.lowering import ragged

  rows, groups = sum(sizes) + 4, len(sizes)  # 4 rows past the last group
  rng = np.random.RandomState(0)
  a = jnp.asarray(rng.randn(rows, 16), jnp.float32)
  b = jnp.asarray(rng.randn(groups, 16, 8), jnp.float32)
  w = jnp.asarray(rng.randn(rows, 8), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  ours = jax.value_and_grad(lambda a, b: (ragged.ragged_matmul(a, b, gs) * w).sum(), (0, 1))(a, b)
  theirs = jax.value_and_grad(lambda a, b: (jax.lax.ragged_dot(a, b, gs) * w).sum(), (0, 1))(a, b)
  assert abs(float(ours[0]) - float(theirs[0])) < 1e-5 * float(jnp.abs(w).sum())
  for mine, ref in zip(ours[1], theirs[1]):
    assert h.rel(np.asarray(mine), np.asarray(ref)) < 1e-6
  assert not np.asarray(ragged.ragged_matmul(a, b, gs)[sum(sizes):]).any()
  block = ragged.block_rows(rows, groups)
  assert 8 <= block <= max(8, 8 * (rows / groups) ** 0.5) and block & (block - 1) == 0
  # Fewer, larger blocks where experts are many and rows per expert few (each block re-reads its
  # expert's matrix): 64 experts at 2,048 rows; tools/bench_moe.py's 8 experts keep 128.
  assert (ragged.block_rows(2048, 64), ragged.block_rows(4096, 8)) == (32, 128)


# ---- the families ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_family_matches_torch_scanned_and_trained(family, caplog):
  ref = build(family)
  inputs, labels = left_padded_batch()
  ref_logits, ref_loss, ref_grads = torch_loss_and_grads(ref, inputs)

  mesh = tot.make_mesh(fsdp=8)
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=mesh)
  loss, grads = ours_loss_and_grads(jm, inputs, labels)
  assert h.rel(loss, ref_loss) < 1e-5
  worst = max((h.rel(grads[n], g), n) for n, g in ref_grads.items())
  assert worst[0] < 1e-4, worst

  # The logits are compared once, from the scanned model where the layers scan (one program
  # fewer to compile: the unscanned forward is checked through its loss and gradients).
  scanned = tot.ShardedModule(copy.deepcopy(ref), mesh=mesh, scan=True)
  forward = {k: v for k, v in inputs.items() if k != "labels"}
  logits = tot.to_cpu((jm if family in UNSCANNED else scanned)(**forward).logits)
  assert h.rel(logits, ref_logits) < 1e-5
  if family in UNSCANNED:
    assert scanned._layout is None and any("cannot scan" in m for m in caplog.messages), UNSCANNED[family]
  else:
    assert scanned._layout is not None
    scanned_loss, scanned_grads = ours_loss_and_grads(scanned, inputs, labels)
    assert h.rel(scanned_loss, loss) < 1e-6  # the router aux loss leaves the scan too
    worst = max((h.rel(scanned_grads[n], np.asarray(g)), n) for n, g in grads.items())
    assert worst[0] < 1e-6, worst

  hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  step = tot.make_train_step(jm, model_loss, optax.adamw(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"]))
  opt = torch.optim.AdamW(ref.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["weight_decay"])
  for i in range(5):
    batch, y = left_padded_batch(seed=i + 1)
    ours = float(step(batch, y))
    opt.zero_grad()
    theirs = ref(**batch).loss
    theirs.backward()
    opt.step()
    assert abs(ours - theirs.item()) <= 1e-4 * abs(theirs.item()), f"step {i}: {ours} vs torch {theirs.item()}"


def test_eager_experts_loop_runs_the_grouped_path_with_the_same_numbers():
  ref = build("mixtral", experts="eager")
  inputs, _ = left_padded_batch()
  forward = {k: v for k, v in inputs.items() if k != "labels"}
  want = ref(**forward).logits.detach()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8))
  assert h.rel(tot.to_cpu(jm(**forward).logits), want) < 1e-5


EXPERT_PARALLEL = [(f, dict(ep=4, fsdp=2)) for f in FAMILIES] + [("mixtral", dict(fsdp=8)), ("qwen3_moe", dict(fsdp=2, ep=2, tp=2))]


@pytest.mark.parametrize(
  "family,mesh_axes", EXPERT_PARALLEL,
  ids=[f"{f}-" + ",".join(f"{k}={v}" for k, v in m.items()) for f, m in EXPERT_PARALLEL],
)
def test_expert_parallel_splits_experts_and_matches_one_device(family, mesh_axes):
  """Experts split over 4 devices (2 of 8 each; or over all 8 on a plain fsdp mesh; or over ep × tp,
  the tokens split over tp inside the MoE), scanned where the family scans: logits, loss and
  gradients as torch eager's."""
  ref = build(family)
  inputs, labels = left_padded_batch()
  ref_logits, ref_loss, ref_grads = torch_loss_and_grads(ref, inputs)
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(**mesh_axes), sharding="ep", scan=True)
  expert_axis = mesh_lib.expert_axes(jm.mesh) if "ep" in mesh_axes else "fsdp"
  expert_axis = expert_axis[0] if len(expert_axis) == 1 else expert_axis
  experts = [(n, s.spec) for n, s in jm.param_shardings.items() if ".experts." in n and len(s.spec) >= 2]
  assert experts and all(
    spec[1 if ".scan." in n else 0] == expert_axis for n, spec in experts
  ), experts  # the expert dim (after the layer dim when scanned) is split
  dense = jm.param_shardings["model.embed_tokens.weight"].spec
  assert ("fsdp", "ep") in tuple(dense) if "ep" in mesh_axes else "fsdp" in tuple(dense), dense  # FSDP over every data device
  forward = {k: v for k, v in inputs.items() if k != "labels"}
  assert h.rel(tot.to_cpu(jm(**forward).logits), ref_logits) < 1e-5
  loss, grads = ours_loss_and_grads(jm, inputs, labels)
  assert h.rel(loss, ref_loss) < 1e-5
  worst = max((h.rel(grads[n], g), n) for n, g in ref_grads.items())
  assert worst[0] < 1e-4, worst


def test_expert_parallel_preset_names_an_expert_count_the_axis_does_not_divide():
  config = FAMILIES["mixtral"]()
  config.num_local_experts = 6
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config)
  with pytest.raises(tot.TorchOnTpuError, match=r"experts.gate_up_proj.*dim 0 has size 6, which ep=4 does not divide"):
    tot.ShardedModule(model, mesh=tot.make_mesh(ep=4, fsdp=2), sharding="ep")


def test_recipe_trains_plans_checkpoints_and_exports_an_moe_model(tmp_path):
  """`python -m recipes.hf --config=DIR` on a Mixtral config: dry run, training with
  checkpoints, and an export that transformers loads back to the same logits."""
  from recipes import hf as hf_recipe

  model_dir = tmp_path / "mixtral"
  config = FAMILIES["mixtral"]()
  config.max_position_embeddings, config.vocab_size = 64, 512  # room for the recipe's byte-level BPE
  config.save_pretrained(model_dir)
  tiny = dict(seqlen=32, global_batch_size=8, lr=1e-2, warmup_steps=2, eval_batches=2)

  planned = hf_recipe.run(hf_recipe.HFFlags(config=str(model_dir), log_dir=str(tmp_path / "dry"), dry_run=True, **tiny))
  assert planned["compile"].peak_bytes > 0 and planned["plan"].total > 0

  summary = hf_recipe.run(
    hf_recipe.HFFlags(config=str(model_dir), log_dir=str(tmp_path / "run"), steps=6, save_every=3, eval_every=3, **tiny)
  )
  losses = [r["loss"] for r in summary["records"] if "loss" in r]
  assert np.mean(losses[-2:]) < losses[0]  # it trains, router aux loss included
  assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir() if p.name.isdigit()) == ["3", "6"]

  convert = h.load_module(h.Path(__file__).parent.parent / "tools" / "convert.py")
  convert.to_safetensors(str(tmp_path / "run" / "ckpt"), str(tmp_path / "export"), hf_config=str(model_dir))
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", config=model_dir / "config.json")
  loaded.eval()
  jm = summary["train_step"].model
  tokens = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(3))
  want = loaded(tokens, use_cache=False).logits.detach()
  assert h.rel(tot.to_cpu(jm(tokens, use_cache=False).logits), want) < 1e-5


def test_a_grouped_mm_form_experts_do_not_use_is_refused_in_one_sentence():
  import jax.numpy as jnp

  with pytest.raises(tot.TorchOnTpuError, match=r"_grouped_mm of a 3-D by a 3-D tensor without offs is not lowered"):
    model_ops._grouped_mm(jnp.ones((2, 4, 8)), jnp.ones((2, 8, 4)))
