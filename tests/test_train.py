"""make_train_step: parity with a PyTorch eager loop, accumulation, remat, donation,
recompilation reports, mixed precision, randomness and state round trips."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import torch_on_tpu as tot
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.models.hf import build_causal_lm
from torch_on_tpu.models.torchtitan import llama3_config

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

VOCAB = 2048
HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ce_loss(out, labels):
  logits = out.logits if hasattr(out, "logits") else out
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def adamw():
  return optax.adamw(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"])


def torch_adamw(params):
  return torch.optim.AdamW(
    params, lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
  )


def titan_config(n_layers=None, seqlen=32):
  config = llama3_config("debugmodel", attention="sdpa", max_seq_len=seqlen)
  if n_layers is not None:
    config.layers = config.layers[:n_layers]
  return config


def titan(n_layers=None, seqlen=32, **kwargs):
  config = titan_config(n_layers, seqlen)
  with torch.device("meta"):
    model = config.build()
  return config, tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1), **kwargs)


def batches(n, batch=8, seqlen=32, vocab=VOCAB, seed=0):
  g = torch.Generator().manual_seed(seed)
  return [
    (torch.randint(0, vocab, (batch, seqlen), generator=g), torch.randint(0, vocab, (batch, seqlen), generator=g))
    for _ in range(n)
  ]


class Tiny(torch.nn.Module):
  """Embedding → dropout → linear: compiles in a blink, for the mechanics tests."""

  def __init__(self, vocab=512, dim=64, dropout=0.0):
    super().__init__()
    self.emb = torch.nn.Embedding(vocab, dim)
    self.drop = torch.nn.Dropout(dropout)
    self.out = torch.nn.Linear(dim, vocab)

  def forward(self, tokens):
    return self.out(self.drop(self.emb(tokens)))


def tiny(dropout=0.0, seed=0, **kwargs):
  with torch.device("meta"):
    model = Tiny(dropout=dropout)
  return tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1), seed=seed, **kwargs)


def tiny_batch(batch=8, seqlen=16, seed=0):
  return batches(1, batch, seqlen, vocab=512, seed=seed)[0]


# ---- parity with PyTorch eager ----------------------------------------------------------


def test_llama3_debugmodel_matches_torch_adamw_for_20_steps():
  config, jm = titan()
  with torch.device("cpu"):
    ref = config.build()
  ref.load_state_dict(jm.state_dict())
  step = tot.make_train_step(jm, ce_loss, adamw())
  opt = torch_adamw(ref.parameters())
  ours, theirs = [], []
  for x, y in batches(20):
    ours.append(float(step(x, y)))
    opt.zero_grad()
    loss = ce_loss(ref(x), y)
    loss.backward()
    opt.step()
    theirs.append(loss.item())
  assert theirs[-1] < theirs[0] - 0.05  # it does train
  for i, (a, b) in enumerate(zip(ours, theirs)):
    assert abs(a - b) / abs(b) < 1e-4, f"step {i}: {a} vs torch {b}"
  assert step.step_count == 20


def test_hf_llama_matches_torch_adamw_for_20_steps():
  config = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
  )
  jm = tot.ShardedModule(build_causal_lm(config), mesh=tot.make_mesh(fsdp=-1))
  ref = build_causal_lm(config, device="cpu")
  ref.load_state_dict(jm.state_dict())
  step = tot.make_train_step(jm, ce_loss, adamw())
  opt = torch_adamw(ref.parameters())
  for i, (x, y) in enumerate(batches(20, vocab=256)):
    ours = float(step({"input_ids": x}, y))
    opt.zero_grad()
    loss = ce_loss(ref(input_ids=x), y)
    loss.backward()
    opt.step()
    assert abs(ours - loss.item()) / loss.item() < 1e-4, f"step {i}: {ours} vs torch {loss.item()}"


def test_clip_norm_matches_torch_clip_grad_norm():
  jm = tiny()
  ref = Tiny()
  ref.load_state_dict(jm.state_dict())
  step = tot.make_train_step(jm, ce_loss, adamw(), clip_norm=0.5)
  opt = torch_adamw(ref.parameters())
  for seed in range(4):
    x, y = tiny_batch(seed=seed)
    ours = float(step(x, y))
    opt.zero_grad()
    loss = ce_loss(ref(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    assert abs(ours - loss.item()) / loss.item() < 1e-5
    assert float(step.metrics["grad_norm"]) == pytest.approx(norm.item(), rel=1e-4)
    assert norm.item() > 0.5  # clipping was active


def test_grad_accum_matches_the_full_batch():
  data = batches(4, batch=16)
  losses = {}
  for k in (1, 4):
    _, jm = titan(n_layers=2)
    step = tot.make_train_step(jm, ce_loss, adamw(), grad_accum=k)
    losses[k] = [float(step(x, y)) for x, y in data]
    params = {n: np.asarray(v) for n, v in jm.params.items()}
    losses[f"params{k}"] = params
  for a, b in zip(losses[4], losses[1]):
    assert abs(a - b) / b < 1e-5
  for name, ref in losses["params1"].items():
    assert rel(losses["params4"][name], ref) < 1e-4, name


def test_grad_accum_needs_divisible_batch():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw(), grad_accum=3)
  with pytest.raises(tot.TorchOnTpuError, match=r"grad_accum=3.*inputs has shape \(8, 16\)"):
    step(*tiny_batch())


# ---- remat ------------------------------------------------------------------------------


def test_whole_forward_remat_recomputes_without_changing_results(caplog):
  # Whole-forward remat recomputes the forward inside the backward pass: more FLOPs, the
  # same results. It recomputes the whole forward at once, so its peak is about that of
  # no remat; the memory savings come from per-layer remat (tests/test_scan.py).
  data = batches(2, batch=16, seqlen=128)
  reports, losses = {}, {}
  for policy in ("none", "full", "offload_dots"):
    _, jm = titan(n_layers=1, seqlen=128)
    step = tot.make_train_step(jm, ce_loss, adamw(), forward_remat=policy)
    with caplog.at_level(logging.WARNING):
      reports[policy] = step.compile(*data[0])
    losses[policy] = [float(step(x, y)) for x, y in data]
  assert reports["full"].flops > reports["offload_dots"].flops > reports["none"].flops
  for policy, values in losses.items():
    np.testing.assert_allclose(values, losses["none"], rtol=1e-6, err_msg=policy)
  # CPU memory is host memory: offload_dots says so and keeps the same values in place.
  assert "'offload_dots'" in caplog.text and "'dots_with_no_batch_dims_saveable'" in caplog.text


def test_unknown_remat_policy_is_named():
  with pytest.raises(tot.TorchOnTpuError, match="'dots'.*full"):
    tot.make_train_step(tiny(), ce_loss, adamw(), forward_remat="dots")
  assert remat_lib.checkpoint(len, None) is len


# ---- compilation, donation, recompilation ---------------------------------------------


def test_params_and_optimizer_state_are_donated():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw())
  old_params = dict(jm.params)
  old_opt = jax.tree.leaves(step.opt_state)
  step(*tiny_batch())
  assert all(a.is_deleted() for a in old_params.values())
  assert all(a.is_deleted() for a in old_opt if a.ndim)
  assert not any(a.is_deleted() for a in jm.params.values())
  assert jm.params.keys() == old_params.keys()


def test_without_donation_old_arrays_survive():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw(), donate=False)
  old = dict(jm.params)
  step(*tiny_batch())
  assert not any(a.is_deleted() for a in old.values())


def test_state_keeps_its_shardings_and_scalars_are_replicated():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw())
  step(*tiny_batch())
  for name, arr in jm.params.items():
    assert arr.sharding == jm.param_shardings[name]
  adam = step.opt_state[0]
  assert adam.mu["emb.weight"].sharding == jm.param_shardings["emb.weight"]
  assert adam.mu["emb.weight"].sharding.spec[0] == "fsdp"
  assert adam.count.sharding.spec == jax.sharding.PartitionSpec()


def test_batch_shape_change_reports_the_recompilation(caplog):
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw())
  with caplog.at_level(logging.WARNING, logger="torch_on_tpu.training.step"):
    step(*tiny_batch(seqlen=16))
    step(*tiny_batch(seqlen=16, seed=1))
    assert "recompiles" not in caplog.text
    step(*tiny_batch(seqlen=8))
  lines = [r.getMessage() for r in caplog.records if "recompiles" in r.getMessage()]
  assert lines == ["Train step recompiles: inputs shape (8, 16) → (8, 8)."]
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="torch_on_tpu.training.step"):
    x, y = tiny_batch(seqlen=8)
    step(x, y.to(torch.int16))
  assert "labels dtype int32 → int16" in caplog.text


def test_compile_ahead_then_call_does_not_recompile(caplog):
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw())
  x, y = tiny_batch()
  report = step.compile(x, y)
  assert report.flops > 0 and report.temp_bytes > 0 and report.argument_bytes > 0
  assert report.alias_bytes > 0  # donated state is written in place
  assert "GFLOP" in str(report)
  with caplog.at_level(logging.INFO, logger="torch_on_tpu.training.step"):
    step(x, y)
  assert "compiled" not in caplog.text and len(step._executables) == 1


def test_compile_on_an_abstract_model_allocates_nothing():
  config = titan_config(n_layers=1)
  with torch.device("meta"):
    model = config.build()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1), abstract=True)
  step = tot.make_train_step(jm, ce_loss, adamw(), grad_accum=2)
  spec = jax.ShapeDtypeStruct((8, 32), jnp.int32)
  report = step.compile(spec, spec)
  assert report.flops > 0 and report.peak_bytes > report.argument_bytes
  assert isinstance(step.opt_state[0].mu["norm.weight"], jax.ShapeDtypeStruct)
  with pytest.raises(tot.TorchOnTpuError, match="abstract"):
    step(torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))


# ---- mixed precision ----------------------------------------------------------------------


def test_bf16_compute_keeps_fp32_master_weights():
  data = [tiny_batch(seed=i) for i in range(3)]
  fp32 = tot.make_train_step(tiny(), ce_loss, adamw())
  ref = [float(fp32(x, y)) for x, y in data]
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw(), compute_dtype=jnp.bfloat16)
  got = [float(step(x, y)) for x, y in data]
  assert all(v.dtype == jnp.float32 for v in jm.params.values())
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(step.opt_state[0].mu))
  assert step.metrics["loss"].dtype == jnp.float32
  np.testing.assert_allclose(got, ref, rtol=2e-2)
  assert got != ref  # the forward really ran in bf16


def test_all_bf16_stores_params_and_optimizer_state_in_bf16():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw(), master_dtype=torch.bfloat16)
  x, y = tiny_batch()
  losses = [float(step(x, y)) for _ in range(3)]
  assert all(v.dtype == jnp.bfloat16 for v in jm.params.values())
  assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(step.opt_state[0].mu))
  assert losses[2] < losses[0] and len(step._executables) == 1


def test_dropout_differs_per_step_and_is_reproducible_from_the_seed():
  x, y = tiny_batch()
  step = tot.make_train_step(tiny(dropout=0.5), ce_loss, optax.sgd(0.0), seed=0, donate=False)
  start = step.state
  first = [float(step(x, y)) for _ in range(3)]
  assert len(set(first)) == 3  # lr 0: only the dropout mask changes between steps
  step.state = start
  assert [float(step(x, y)) for _ in range(3)] == first  # same seed and step: same masks
  step.state = tot.TrainState(params=start["params"], buffers=start["buffers"], opt_state=start["opt_state"], rng=jax.random.PRNGKey(1), step=0)
  assert [float(step(x, y)) for _ in range(3)] != first
  # evaluate() traces the model in eval mode: no dropout, the torch eval-mode loss.
  ref = Tiny(dropout=0.5).eval()
  ref.load_state_dict(step.model.state_dict())
  assert float(step.evaluate(x, y)) == pytest.approx(ce_loss(ref(x), y).item(), rel=1e-5)


def test_learning_rate_metric_follows_the_schedule():
  schedule = optax.linear_schedule(1e-2, 0.0, 10)
  step = tot.make_train_step(tiny(), ce_loss, optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))
  plain = tot.make_train_step(tiny(), ce_loss, optax.adamw(schedule), learning_rate=schedule)
  x, y = tiny_batch()
  for i in range(3):
    step(x, y)
    plain(x, y)
    assert float(step.metrics["learning_rate"]) == pytest.approx(float(schedule(i)))
    assert float(plain.metrics["learning_rate"]) == pytest.approx(float(schedule(i)))


def test_pure_step_under_the_users_own_jit_matches_the_stateful_step():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw(), donate=False)
  x, y = (jnp.asarray(t.numpy()) for t in tiny_batch())  # on one device: the step places them
  opt_state = adamw().init(jm.params)
  loss, new_params, _, _, metrics = jax.jit(step.pure)(jm.params, jm.buffers, opt_state, x, y)
  ours = step(x, y)
  assert float(loss) == pytest.approx(float(ours), rel=1e-6)
  assert set(metrics) == {"loss", "grad_norm", "nonfinite"} and int(metrics["nonfinite"]) == 0
  assert rel(new_params["out.weight"], jm.params["out.weight"]) < 1e-6


def test_state_round_trip_resumes_exactly():
  data = [tiny_batch(seed=i) for i in range(4)]
  jm = tiny(dropout=0.1)
  step = tot.make_train_step(jm, ce_loss, adamw())
  for x, y in data[:2]:
    step(x, y)
  saved = jax.tree.map(np.asarray, step.state)
  assert int(saved["step"]) == 2
  expected = [float(step(x, y)) for x, y in data[2:]]

  other = tot.make_train_step(tiny(dropout=0.1, seed=5), ce_loss, adamw())
  other.state = saved
  assert other.step_count == 2
  assert [float(other(x, y)) for x, y in data[2:]] == expected
  assert other.abstract_state()["params"]["out.weight"].sharding == other.model.param_shardings["out.weight"]


def test_state_from_another_model_is_refused():
  step = tot.make_train_step(tiny(), ce_loss, adamw())
  state = step.state
  state["params"]["out.weight"] = jnp.zeros((3, 3))
  with pytest.raises(tot.TorchOnTpuError, match=r"params\['out.weight'\] is float32\[3, 3\]"):
    step.state = state


def test_loss_must_be_a_scalar():
  step = tot.make_train_step(tiny(), lambda out, labels: out.sum(-1), adamw())
  with pytest.raises(tot.TorchOnTpuError, match="scalar.*shape \\(8, 16\\)"):
    step(*tiny_batch())


def test_evaluate_gives_the_loss_without_updating():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw())
  x, y = tiny_batch()
  before = float(step.evaluate(x, y))
  assert float(step(x, y)) == pytest.approx(before, rel=1e-6)
  assert float(step.evaluate(x, y)) < before


def test_step_returns_a_torch_scalar_and_refuses_a_batch_that_does_not_split():
  jm = tiny()
  step = tot.make_train_step(jm, ce_loss, adamw())
  x, y = tiny_batch()
  loss = step(x, y)
  assert isinstance(loss, torch.Tensor) and loss.shape == () and loss.dtype == torch.float32
  assert float(loss) == loss.item() == loss.cpu().item() == pytest.approx(float(step.metrics["loss"]))
  assert isinstance(step.evaluate(x, y), torch.Tensor)
  with pytest.raises(tot.TorchOnTpuError, match=r"inputs has 6 rows, which do not split over the 8 data devices \(fsdp\)"):
    step(x[:6], y[:6])
