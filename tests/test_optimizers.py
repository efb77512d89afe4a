"""AdamW with bf16 moments beside fp32 weights (`training.optimizers`, the recipes' --adam_states,
torchtitan's fused_opt_states_bf16): steps against torch's fused mixed-precision AdamW written out
in plain torch (torch's CPU fused AdamW refuses bf16 states with fp32 params), the moments' dtype
through a checkpoint, the memory plan, and the recipe's optimizer under inject_hyperparams, with
--param_groups and with LoRA."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from recipes import llama3, runner
from tests import helpers as h
from torch_on_tpu.io import checkpoint
from torch_on_tpu.training import lora, optimizers, plan

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


class Tiny(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.emb = torch.nn.Embedding(256, 64)
    self.hidden = torch.nn.Linear(64, 64)
    self.out = torch.nn.Linear(64, 256, bias=False)

  def forward(self, tokens):
    return self.out(torch.nn.functional.gelu(self.hidden(self.emb(tokens))))


def ce(out, labels):
  return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def batches(n, seed=0):
  g = torch.Generator().manual_seed(seed)
  return [(torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g)) for _ in range(n)]


def bf16_adamw():
  return optimizers.adamw(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"], state_dtype=jnp.bfloat16)


def sharded(abstract=False):
  with torch.device("meta"):
    model = Tiny()
  return tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1), seed=0, abstract=abstract)


@torch.no_grad()
def fused_adamw_mixed_precision(params, state, step):
  """torch's `_fused_adamw_` on fp32 params with bf16 moments (CUDA's `FusedAdamMathFunctorMP`,
  aten/src/ATen/native/cuda/fused_adam_utils.cuh `adam_math`): the moments widened to fp32, the
  update in fp32 from them, bias corrections in double, the moments rounded to bf16 on store."""
  lr, b1, b2, eps, wd = HP["lr"], HP["b1"], HP["b2"], HP["eps"], HP["weight_decay"]
  bias1, bias2_sqrt = 1 - b1**step, (1 - b2**step) ** 0.5
  for name, p in params.items():
    g = p.grad
    m, v = state.setdefault(name, (torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16)))
    m, v = m.float(), v.float()
    p.mul_(1 - lr * wd)  # param -= lr·wd·param
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p.sub_((lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))
    state[name] = (m.bfloat16(), v.bfloat16())


def test_five_steps_match_torchs_fused_adamw_on_fp32_weights_with_bf16_moments():
  jm = sharded()
  ref = Tiny()
  ref.load_state_dict(jm.state_dict())
  start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
  step = tot.make_train_step(jm, ce, bf16_adamw())
  fp32 = tot.make_train_step(sharded(), ce, optax.adamw(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"]))
  params, state, ours, theirs = dict(ref.named_parameters()), {}, [], []
  for i, (x, y) in enumerate(batches(5), 1):
    ours.append(float(step(x, y)))
    fp32(x, y)
    ref.zero_grad()
    loss = ce(ref(x), y)
    loss.backward()
    fused_adamw_mixed_precision(params, state, i)
    theirs.append(loss.item())
  assert theirs[-1] < theirs[0]
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)  # measured: 9e-8
  (adam, *_) = step.opt_state
  trained, plain = jm.state_dict(), fp32.model.state_dict()
  for name, p in params.items():
    moved = rel(trained[name] - start[name], p.detach() - start[name])  # the 5 updates, not the weights' size
    assert moved < 2e-4, (name, moved)  # measured: 1e-6 to 6e-5
    # the same run with fp32 moments lands 1e-3 away: the check sees the bf16 rounding
    assert rel(plain[name] - start[name], p.detach() - start[name]) > 5e-4, name
    for got, want in zip((adam.mu[name], adam.nu[name]), state[name]):
      assert got.dtype == jnp.bfloat16
      assert rel(np.asarray(got, np.float32), want.float()) < 1e-4, name  # measured: at most 4e-5 (1 bf16 ulp: 2^-8 of a value)
      assert np.mean(np.asarray(got, np.float32) == want.float().numpy()) > 0.99, name  # bit for bit but a rounding here and there


def test_a_checkpoint_keeps_the_bf16_moments_and_resumes_the_same_steps(tmp_path):
  data = batches(3, seed=1)
  saving = tot.make_train_step(sharded(), ce, bf16_adamw())
  for x, y in data[:2]:
    saving(x, y)
  with checkpoint.Checkpointer(tmp_path, model=saving.model) as ckpt:
    ckpt.save(2, saving.state, force=True)
  resumed = tot.make_train_step(sharded(), ce, bf16_adamw())
  with checkpoint.Checkpointer(tmp_path, model=resumed.model) as ckpt:
    resumed.state = ckpt.restore(resumed.abstract_state()).state
  for got, want in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(saving.opt_state)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert {v.dtype for v in jax.tree.leaves((resumed.opt_state[0].mu, resumed.opt_state[0].nu))} == {jnp.dtype(jnp.bfloat16)}
  assert float(resumed(*data[2])) == float(saving(*data[2]))


def test_the_plans_optimizer_state_is_half_with_bf16_moments():
  shape = plan.DecoderShape(layers=1, dim=64, ffn_dim=64, heads=4, kv_heads=4, head_dim=16, vocab=256)
  sizes = dict(global_batch_size=8, seqlen=16)
  fp32 = plan.plan_memory(tot.make_train_step(sharded(True), ce, optax.adamw(1e-3)), shape, **sizes)
  bf16 = plan.plan_memory(tot.make_train_step(sharded(True), ce, bf16_adamw()), shape, **sizes)
  count = 4  # Adam's int32 step count
  assert bf16.optimizer - count == (fp32.optimizer - count) // 2 == fp32.params  # 2+2 bytes a parameter, not 4+4
  assert bf16.params == fp32.params and bf16.grads == fp32.grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16-all"])
def test_the_recipes_adam_states_flag_under_inject_hyperparams_and_param_groups(dtype):
  """--adam_states=bfloat16: bf16 moments whatever --dtype, the hyperparameters in fp32 (bf16 would round
  β2=0.999 to 1), the lr still read from the state; with --param_groups each group's lr and weight decay as before."""
  weights = jnp.float32 if dtype == "float32" else jnp.bfloat16
  params = {"emb.weight": jnp.full((4, 3), 0.5, weights), "out.weight": jnp.full((3,), -1.0, weights)}
  jm = types.SimpleNamespace(params=params, stored_layout=lambda: {})
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.01, p.dtype), params)
  groups = json.dumps([{"pattern": "emb", "lr": 1e-3, "weight_decay": 0.0}])
  for param_groups in (None, groups):
    flags = llama3.Llama3Flags(dtype=dtype, adam_states="bfloat16", beta2=0.999, lr=1e-2, warmup_steps=1, steps=4, param_groups=param_groups)
    opt = runner._optimizer(flags, jm, lora=False)
    state = opt.init(params)
    updates, state = jax.jit(opt.update)(grads, state, params)
    adam = next(s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState))
    assert {v.dtype for v in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    hyper = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0] if ".hyperparams[" in jax.tree_util.keystr(path)}
    assert {v.dtype for v in hyper.values()} == {jnp.dtype(jnp.float32)}, hyper
    (rate,) = [v for k, v in hyper.items() if k.endswith("['learning_rate']")]
    assert float(rate) == pytest.approx(1e-2)
    # a first Adam step moves every weight by about lr (its sign's), its decay on top where it decays
    lr = {"emb.weight": 1e-3 if param_groups else 1e-2, "out.weight": 1e-2}
    for name in params:
      decay = flags.weight_decay if name == "out.weight" or not param_groups else 0.0
      assert updates[name].dtype == jnp.float32
      np.testing.assert_allclose(-updates[name], lr[name] * (1 + decay * np.asarray(params[name], np.float32)), rtol=1e-5, err_msg=name)
  plain = runner._optimizer(llama3.Llama3Flags(dtype=dtype, beta2=0.999), jm, lora=False)
  state = plain.init(params)
  assert {v.dtype for v in jax.tree.leaves((state.inner_state[0].mu, state.inner_state[0].nu))} == {jnp.dtype(weights)}
  # bf16 weights without the flag: the same fp32 hyperparameters (β2=0.999 kept, not rounded to 1: a NaN first step)
  assert float(state.hyperparams["b2"]) == pytest.approx(0.999, abs=1e-7) and state.hyperparams["b2"].dtype == jnp.float32
  updates, _ = jax.jit(plain.update)(grads, state, params)
  assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))


def test_lora_adapters_alone_get_bf16_moments_and_train():
  base = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=-1))
  jm = lora.wrap(base, h.hf(), rank=4)
  flags = llama3.Llama3Flags(adam_states="bfloat16", lr=1e-2, warmup_steps=1, steps=3)
  step = tot.make_train_step(jm, lambda out, y: ce(out.logits, y), runner._optimizer(flags, jm, lora=True), trainable=lora.TRAINABLE)
  ids = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
  inputs, labels = {"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]
  losses = [float(step(inputs, labels)) for _ in range(3)]
  adam = step.opt_state.inner_state[0]
  assert set(adam.mu) == set(step.trainable) and all("lora_" in k for k in adam.mu)  # the adapters alone
  assert {v.dtype for v in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
  assert losses[-1] < losses[0]


def test_a_checkpoint_whose_optimizer_has_another_layout_says_to_start_the_optimizer_afresh(tmp_path, monkeypatch):
  """A checkpoint whose weights match but whose optimizer state has another layout (saved by an older
  version's AdamW, say): one sentence naming --resume_fresh=optimizer, which then resumes it."""
  flags = llama3.Llama3Flags(log_dir=str(tmp_path / "run"), seqlen=32, global_batch_size=8, steps=1, eval_every=0, save_every=1)
  llama3.run(flags)
  other = lambda flags, jm, lora: optax.inject_hyperparams(optimizers.adamw, static_args=("state_dtype",))(  # noqa: E731
    learning_rate=1e-3, state_dtype=jnp.float32)
  monkeypatch.setattr(runner, "_optimizer", other)
  with pytest.raises(tot.TorchOnTpuError) as refused:
    llama3.run(llama3.Llama3Flags(**{**vars(flags), "steps": 2}))
  assert str(refused.value).endswith("its optimizer state has another layout than this run's AdamW; keep its weights and "
                                     "data position and start the optimizer afresh with --resume_fresh=optimizer.")
  resumed = llama3.run(llama3.Llama3Flags(**{**vars(flags), "steps": 2, "resume_fresh": "optimizer"}))
  assert [r["step"] for r in resumed["records"] if "loss" in r] == [2]
