"""ShardedModule at parity with PyTorch eager (fp32, CPU, 8 simulated devices).

Tolerances: logits within 1e-5 and every parameter's cross-entropy gradient
within 1e-4, relative (‖Δ‖/‖ref‖), against the same weights in eager torch.
"""

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

import torch_on_tpu as tot
from tests import helpers as h

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

CASES = [
  ("titan", h.titan, dict(fsdp=8), "fsdp"),
  ("titan", h.titan, dict(fsdp=4, tp=2), "fsdp_tp"),
  ("hf-llama", h.hf, dict(fsdp=8), "fsdp"),
  ("hf-llama", h.hf, dict(fsdp=4, tp=2), "fsdp_tp"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[3]}")
def case(request):
  name, builder, mesh_axes, sharding = request.param
  jm = tot.ShardedModule(builder(), mesh=tot.make_mesh(**mesh_axes), sharding=sharding)
  ref = h.reference(jm, builder)
  kwargs = h.call_kwargs(ref)
  tokens, labels = h.random_batch(h.vocab_of(ref))
  ref_logits, ref_loss, ref_grads = h.torch_loss_and_grads(ref, tokens, labels, kwargs)
  return dict(
    name=name, jm=jm, ref=ref, kwargs=kwargs, tokens=tokens, labels=labels,
    ref_logits=ref_logits, ref_loss=ref_loss, ref_grads=ref_grads, sharding=sharding,
  )


def test_logits_match_eager(case):
  out = case["jm"](case["tokens"], **case["kwargs"])
  logits = tot.to_cpu(h.logits_of(out))
  assert logits.shape == case["ref_logits"].shape
  assert h.rel(logits, case["ref_logits"]) < 1e-5


def test_gradients_match_eager(case):
  loss, grads = h.jax_loss_and_grads(case["jm"], case["tokens"], case["labels"], case["kwargs"])
  assert h.rel(loss, case["ref_loss"]) < 1e-5
  assert set(grads) == set(case["ref_grads"])
  worst = max((h.rel(grads[n], case["ref_grads"][n]), n) for n in grads)
  assert worst[0] < 1e-4, worst


def test_parameters_are_really_sharded(case):
  jm = case["jm"]
  mesh = jm.mesh
  for name, arr in jm.params.items():
    spec = arr.sharding.spec
    assert spec == jm.param_shardings[name].spec
    shard = arr.addressable_shards[0].data.shape
    expected = tuple(
      n // int(np.prod([mesh.shape[a] for a in ((e,) if isinstance(e, str) else (e or ()))]))
      for n, e in zip(arr.shape, tuple(spec) + (None,) * (arr.ndim - len(spec)))
    )
    assert shard == expected, (name, spec, shard)
  if case["sharding"] == "fsdp":
    big = [n for n, a in jm.params.items() if a.size >= 2**14]
    assert big and all("fsdp" in tuple(jm.params[n].sharding.spec) for n in big)
  else:
    tp_sharded = [n for n, a in jm.params.items() if "tp" in tuple(a.sharding.spec)]
    assert len(tp_sharded) >= 5


def test_specs_follow_the_preset(case):
  specs = {n: a.sharding.spec for n, a in case["jm"].params.items()}
  if case["sharding"] == "fsdp":
    # the embedding's largest dim (its vocabulary); tensors under FSDP_MIN_ELEMENTS replicated
    name = "tok_embeddings.weight" if case["name"] == "titan" else "model.embed_tokens.weight"
    assert specs[name] == P("fsdp", None)
    norm = "norm.weight" if case["name"] == "titan" else "model.norm.weight"
    assert specs[norm] == P(None)
    assert specs["lm_head.weight"] == P("fsdp", None)  # the output head too
    if case["name"] == "titan":  # a linear the family knows splits its hidden-size dim (MaxText's `embed`)
      params = case["jm"].params
      column, row = "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"
      assert params[column].shape[0] > params[column].shape[1] and specs[column] == P(None, "fsdp")
      assert params[row].shape[1] > params[row].shape[0] and specs[row] == P("fsdp", None)
    else:  # the tiny model's projections are too small to shard; what the preset would split of them:
      from torch_on_tpu import models

      dims = models.family_of(h.hf()).fsdp_dims(h.hf())
      assert dims["model.layers.0.mlp.up_proj.weight"] == 1 and dims["model.layers.0.mlp.down_proj.weight"] == 0
      assert dims["model.layers.1.self_attn.q_proj.weight"] == 1 and "lm_head.weight" not in dims
  elif case["name"] == "titan":
    assert specs["layers.0.attention.qkv_linear.wqkv.weight"] == P("tp", "fsdp")
    assert specs["layers.3.attention.wo.weight"] == P("fsdp", "tp")
    assert specs["layers.5.feed_forward.w2.weight"] == P("fsdp", "tp")
    assert specs["norm.weight"] == P(None)
  else:
    assert specs["model.layers.0.self_attn.q_proj.weight"] == P("tp", "fsdp")
    assert specs["model.layers.1.self_attn.o_proj.weight"] == P("fsdp", "tp")
    assert specs["model.layers.1.mlp.down_proj.weight"] == P("fsdp", "tp")
    assert specs["lm_head.weight"] == P("tp", "fsdp")


def test_state_dict_has_the_models_own_names(case):
  sd = case["jm"].state_dict()
  ref_sd = case["ref"].state_dict()
  assert list(sd) == list(ref_sd)
  name = next(iter(ref_sd))
  assert isinstance(sd[name], torch.Tensor) and sd[name].device.type == "cpu"
  assert torch.equal(sd[name], ref_sd[name])


def test_hf_output_is_a_model_output_and_flags_are_static():
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8))  # scan=False: as with scan=True, no KV cache by default
  tokens, _ = h.random_batch(256)
  out = jm(input_ids=tokens)
  assert type(out).__name__ == "CausalLMOutputWithPast"
  assert out.past_key_values is None
  assert torch.equal(tot.to_cpu(jm(input_ids=tokens, use_cache=False).logits), tot.to_cpu(out.logits))
  hidden = jm(input_ids=tokens, use_cache=False, output_hidden_states=True)
  assert len(hidden.hidden_states) == 3  # embeddings + 2 layers: the flag reached the model
  assert len(jm._compiled) == 3  # one program per distinct set of static flags


def test_output_holding_a_cache_is_refused_with_a_clear_message():
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8))
  tokens, _ = h.random_batch(256)
  with pytest.raises(tot.TorchOnTpuError, match="use_cache=False"):
    jm(input_ids=tokens, use_cache=True)


def test_train_and_eval_switch_the_mode_as_on_a_torch_module():
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
  reference = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).eval()
  reference.load_state_dict(model.state_dict())
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8), sharding="replicated")
  x = torch.randn(8, 16)
  assert jm.training and jm.eval() is jm and not jm.training and not model[1].training
  assert h.rel(tot.to_cpu(jm(x)).numpy(), reference(x).detach().numpy()) < 1e-6  # eval: eager's eval output
  dropped = tot.to_cpu(jm.train()(x))
  assert jm.training and 0.3 < (dropped == 0).float().mean() < 0.7  # train: dropout, as torch
  evaluated = jm.eval()(x)  # its own program again: no dropout
  assert h.rel(tot.to_cpu(evaluated).numpy(), reference(x).detach().numpy()) < 1e-6
  assert repr(evaluated).startswith("tensor([[") and repr(evaluated).endswith("device='jax')")


def test_to_cpu_and_dot_cpu_give_plain_tensors():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8))
  tokens, _ = h.random_batch(2048)
  out = jm(tokens)
  for plain in (tot.to_cpu(out), out.cpu()):
    assert type(plain) is torch.Tensor and plain.device.type == "cpu"
    assert plain.shape == (h.BATCH, h.SEQ, 2048)


def test_sharding_table_lists_every_tensor_with_bytes_per_device():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
  table = jm.sharding_table()
  names = [r["name"] for r in table.rows]
  assert set(names) == set(jm.params) | set(jm.buffers)
  row = next(r for r in table.rows if r["name"] == "layers.0.attention.wo.weight")
  assert row["shard_shape"] == (64, 128)
  assert row["bytes_per_device"] == 64 * 128 * 4
  text = str(table)
  assert "layers.0.attention.wo.weight" in text and "('fsdp', 'tp')" in text


def test_batch_is_sharded_over_the_data_axes():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
  placed = jm.place(torch.zeros(8, 16, dtype=torch.long))
  assert placed.sharding.spec == P("fsdp", None)
  odd = jm.place(torch.zeros(3, 16, dtype=torch.long))
  assert odd.sharding.spec == P(None, None)  # 3 rows cannot split 4 ways: replicated


def test_an_initialised_cpu_model_is_uploaded_unchanged():
  torch.manual_seed(0)
  cpu_model = h.hf(device="cpu")
  expected = {k: v.clone() for k, v in cpu_model.state_dict().items()}
  jm = tot.ShardedModule(cpu_model, mesh=tot.make_mesh(fsdp=8))
  sd = jm.state_dict()
  assert all(torch.equal(sd[k], expected[k]) for k in expected)
  assert all(p.device.type == "meta" for p in cpu_model.parameters())  # host copy released
  tokens, _ = h.random_batch(256)
  ref = h.hf(device="cpu")
  ref.load_state_dict(expected)
  got = tot.to_cpu(jm(tokens, use_cache=False).logits)
  assert h.rel(got, ref(tokens, use_cache=False).logits.detach()) < 1e-5
  with pytest.raises(tot.TorchOnTpuError, match="moved its parameters and buffers onto the mesh"):
    cpu_model(tokens)  # the wrapped module is meta now: one sentence, not a meta-device trace


def test_state_dict_survives_torch_save_with_torch_dtypes(tmp_path):
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
  expected = {k: v.clone() for k, v in net.state_dict().items()}
  jm = tot.ShardedModule(net, mesh=tot.make_mesh(fsdp=8))
  torch.save(jm.state_dict(), tmp_path / "sd.pt")
  loaded = torch.load(tmp_path / "sd.pt")
  assert loaded["1.num_batches_tracked"].dtype == torch.int64
  assert {k: v.dtype for k, v in loaded.items()} == {k: v.dtype for k, v in expected.items()}
  assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_wrapping_something_else_is_a_clear_error():
  with pytest.raises(tot.TorchOnTpuError, match="torch.nn.Module"):
    tot.ShardedModule(lambda x: x)
  with pytest.raises(tot.TorchOnTpuError, match="data_axes names 'dp'"):
    tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), data_axes=("dp",))


def test_jitted_forward_compiles_once_per_signature():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8))
  tokens, _ = h.random_batch(2048)
  first = jm(tokens)
  second = jm(tokens + 1)
  assert len(jm._compiled) == 1
  assert not np.allclose(np.asarray(jax.device_get(first.jax())), np.asarray(jax.device_get(second.jax())))


def test_attention_settings_are_checked_when_wrapping():
  with pytest.raises(tot.TorchOnTpuError, match="attention='flash' is not a kernel"):
    tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), attention="flash")
  with pytest.raises(tot.TorchOnTpuError, match="unknown key 'block_x'"):
    tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), attention_block_sizes={"block_x": 128})
