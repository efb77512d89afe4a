"""Meta → sharded arrays: the model's own init, seeded, born sharded, ties kept."""

import logging

import jax
import numpy as np
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)


def _stats_match(ours: dict, cpu: dict, skip=()):
  """Per-tensor mean/std of our init vs torch's own init on CPU."""
  for name, ref in cpu.items():
    if name in skip or not ref.is_floating_point():
      continue
    got = ours[name].double()
    ref = ref.double()
    if ref.numel() < 2 or ref.std() == 0:  # norms and biases start as constants: exact
      assert torch.equal(got, ref), name
      continue
    assert ref.numel() >= 1000, name  # enough samples for 10% statistics
    assert abs(got.mean() - ref.mean()) < 0.1 * ref.std() + 1e-6, name
    assert abs(got.std() / ref.std() - 1) < 0.1, (name, got.std(), ref.std())


def test_torchtitan_init_matches_its_cpu_init_statistically():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8))
  torch.manual_seed(0)
  cpu = h.titan(device="cpu")
  with torch.no_grad():
    cpu.init_states(buffer_device=torch.device("cpu"))
  ours = jm.state_dict()
  _stats_match({k: ours[k] for k in cpu.state_dict()}, cpu.state_dict())
  # the depth-scaled init of later layers is smaller: torchtitan's init really ran
  assert ours["layers.5.attention.wo.weight"].std() < 0.6 * ours["layers.0.attention.wo.weight"].std()
  # computed buffers get their real values (RoPE tables), replicated
  rope = jm.array_for("layers.0.attention.rope.cache")
  np.testing.assert_allclose(np.asarray(rope), cpu.layers["0"].attention.rope.cache.numpy(), rtol=1e-6)
  assert rope.sharding.is_fully_replicated


def test_hf_init_matches_its_cpu_init_statistically():
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8))
  torch.manual_seed(0)
  cpu = h.hf(device="cpu")
  ours = jm.state_dict()
  _stats_match({k: ours[k] for k in cpu.state_dict()}, cpu.state_dict())
  inv_freq = np.asarray(jm.array_for("model.rotary_emb.inv_freq"))
  np.testing.assert_allclose(inv_freq, cpu.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_init_is_seeded_and_independent_of_the_mesh():
  a = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=3)
  b = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", seed=3)
  c = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=4)
  name = "layers.2.feed_forward.w1.weight"
  assert np.array_equal(np.asarray(a.params[name]), np.asarray(b.params[name]))
  assert not np.array_equal(np.asarray(a.params[name]), np.asarray(c.params[name]))


def test_each_param_is_born_in_its_sharding():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
  w = jm.params["layers.0.feed_forward.w1.weight"]
  assert w.sharding.spec == jax.sharding.PartitionSpec("tp", "fsdp")
  assert {s.data.shape for s in w.addressable_shards} == {(384, 64)}


def test_tied_weights_stay_one_array_under_both_names():
  config = h.hf_config()
  config.tie_word_embeddings = True
  model = h.build_causal_lm(config)
  assert model.lm_head.weight is model.model.embed_tokens.weight
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  assert "lm_head.weight" not in jm.params and "model.embed_tokens.weight" in jm.params
  sd = jm.state_dict()
  assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
  tokens, labels = h.random_batch(256)
  ref = h.build_causal_lm(config, device="cpu")
  ref.load_state_dict(dict(sd))
  ref.eval()
  ref_logits, _, ref_grads = h.torch_loss_and_grads(ref, tokens, labels, {"use_cache": False})
  loss, grads = h.jax_loss_and_grads(jm, tokens, labels, {"use_cache": False})
  # the tied grad is the sum of both uses, as in torch
  assert h.rel(grads["model.embed_tokens.weight"], ref_grads["model.embed_tokens.weight"]) < 1e-4


def test_abstract_materialisation_allocates_nothing():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), abstract=True)
  w = jm.params["tok_embeddings.weight"]
  assert isinstance(w, jax.ShapeDtypeStruct)
  assert w.shape == (2048, 256) and w.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)


class Plain(torch.nn.Module):
  """A user's own model: nn layers with reset_parameters, and one custom tensor."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(64, 256)
    self.norm = torch.nn.LayerNorm(256)
    self.scale = torch.nn.Parameter(torch.ones(256))

  def forward(self, x):
    return self.norm(self.proj(x)) * self.scale


def test_plain_models_use_reset_parameters_and_name_what_nothing_initialised(caplog):
  with torch.device("meta"):
    model = Plain()
  with caplog.at_level(logging.WARNING):
    jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))
  w = np.asarray(jm.params["proj.weight"])
  bound = 1 / np.sqrt(64)  # nn.Linear's kaiming-uniform bound
  assert np.abs(w).max() <= bound and w.std() > 0.5 * bound / np.sqrt(3)
  assert np.array_equal(np.asarray(jm.params["norm.weight"]), np.ones(256, np.float32))
  assert any("scale" in m and "unwritten" in m for m in caplog.messages)


def test_a_custom_init_fn_runs_on_device():
  with torch.device("meta"):
    model = Plain()

  def init(m):
    m.reset_parameters = None
    for sub in m.modules():
      if hasattr(sub, "reset_parameters") and callable(sub.reset_parameters):
        sub.reset_parameters()
    torch.nn.init.constant_(m.scale, 2.0)

  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8), init_fn=init)
  assert np.array_equal(np.asarray(jm.params["scale"]), np.full(256, 2.0, np.float32))


def test_meta_and_real_tensors_mixed_is_a_clear_error():
  model = Plain()
  model.proj.to("meta")
  with pytest.raises(tot.TorchOnTpuError, match="mixes meta tensors"):
    tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8))


class _Device:
  def __init__(self, platform, stats):
    self.platform, self._stats = platform, stats

  def memory_stats(self):
    return self._stats


class _Sharding:
  def __init__(self, devices):
    self.device_set = set(devices)


def test_init_chunks_grow_with_accelerator_memory_and_stay_small_on_cpu():
  from torch_on_tpu.wrapper import materialize

  floor = materialize.INIT_CHUNK_BYTES
  gpu = [_Device("gpu", {"bytes_limit": 64 * 2**30})]
  assert materialize.chunk_budget([_Sharding(gpu)]) == 4 * 2**30  # 1/16 of 64 GiB
  pod = [_Device("tpu", {"bytes_limit": 16 * 2**30}) for _ in range(8)]
  assert materialize.chunk_budget([_Sharding(pod[:4]), _Sharding(pod)]) == 8 * 2**30  # 1 GiB per device
  assert materialize.chunk_budget([_Sharding([_Device("gpu", {"bytes_limit": 2**30})])]) == floor
  assert materialize.chunk_budget([_Sharding([_Device("gpu", None)])]) == floor  # memory unknown
  assert materialize.chunk_budget([_Sharding(jax.devices())]) == floor  # CPU: host RAM, keep it small


def test_chunking_does_not_change_the_values():
  """One jit per parameter and one jit for all: the same traced program, the same numbers."""
  from torch_on_tpu.wrapper import materialize

  budget = materialize.INIT_CHUNK_BYTES
  try:
    materialize.INIT_CHUNK_BYTES = 1
    small = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=5)
    materialize.INIT_CHUNK_BYTES = 2**40
    whole = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=5)
  finally:
    materialize.INIT_CHUNK_BYTES = budget
  assert small.params.keys() == whole.params.keys()
  for name in small.params:
    assert np.array_equal(np.asarray(small.params[name]), np.asarray(whole.params[name])), name


def test_init_compiles_once_per_kind_of_tensor_not_per_layer(caplog):
  """Each layer's tensors are made by the same program: the compile count is flat in depth."""
  counts = []
  for layers in (2, 4):
    config = h.hf_config()
    config.num_hidden_layers = layers
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torch_on_tpu.wrapper.materialize"):
      tot.ShardedModule(h.build_causal_lm(config), mesh=tot.make_mesh(fsdp=8))
    (message,) = [r.getMessage() for r in caplog.records if "compiled programs" in r.getMessage()]
    counts.append(int(message.split(" from ")[1].split()[0]))
  assert counts[0] == counts[1] < 2 * 9  # fewer programs than the 2-layer model's tensors


def test_a_scanned_stack_is_born_with_the_values_of_its_layers():
  """The stacked arrays come from one lax.map over the layers' inputs: bitwise the unscanned init."""
  loop = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=5).state_dict()
  scanned = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=5, scan=True).state_dict()
  assert loop.keys() == scanned.keys()
  for name in loop:
    assert torch.equal(loop[name], scanned[name]), name
