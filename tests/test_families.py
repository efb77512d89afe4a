"""Model families behind one interface: a toy family added in one file drives every hook."""

import optax
import pytest
import torch
import torch.nn.functional as F

import torch_on_tpu as tot
from tests import toy_family
from tests.helpers import rel
from torch_on_tpu import models
from torch_on_tpu.training import metrics, plan
from torch_on_tpu.training.trainer import default_split


@pytest.fixture
def toy():
  family = models.register(toy_family.ToyFamily())
  yield family
  models.unregister(family)


def test_the_built_in_families_and_the_generic_one_answer_in_order():
  assert [f.name for f in models.families()][-3:] == ["torchtitan", "hf", "generic"]
  assert models.family_of(toy_family.ToyLM()).name == "generic"


def test_a_family_in_one_file_drives_init_calls_inputs_sharding_and_shape(toy):
  with torch.device("meta"):
    model = toy_family.ToyLM()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
  assert jm.family is toy
  # sharding: the family's "fsdp_tp" preset
  assert tuple(jm.params["blocks.0.weight"].sharding.spec) == ("tp", "fsdp")
  # init: the family's own
  state = jm.state_dict()
  assert torch.all(state["blocks.1.weight"] == 0.01) and torch.all(state["head.weight"] == 0.02)
  assert 0.8 < state["embed.weight"].std().item() < 1.2
  # calls: the family's defaults (temperature=2) and its inputs from a data batch
  eager = toy_family.ToyLM()
  eager.load_state_dict(state)
  ids = torch.randint(0, toy_family.VOCAB, (8, 16))
  inputs, labels = default_split(jm, {"input_ids": ids, "labels": ids})
  assert set(inputs) == {"tokens"} and labels is ids
  got = tot.to_cpu(jm(**inputs))
  assert rel(got, eager(ids, temperature=2.0).detach()) < 1e-6
  # shape: the family's decoder shape, where the memory plan and the FLOPs count read it
  assert plan.decoder_shape(model) == toy.decoder_shape(model)
  assert metrics.flops_per_token(model, seqlen=16).torchtitan > 0
  # and a train step through the family's call matches torch eager's (fp32, ≤ 1e-5 rel)
  step = tot.make_train_step(jm, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), optax.sgd(0.5))
  step(inputs, labels)
  loss = F.cross_entropy(eager(ids, temperature=2.0).flatten(0, 1), ids.flatten())
  loss.backward()
  with torch.no_grad():
    for p in eager.parameters():
      p -= 0.5 * p.grad
  trained = jm.state_dict()
  for name, want in eager.state_dict().items():
    assert rel(trained[name], want) < 1e-5, name


def test_register_takes_only_families():
  with pytest.raises(tot.TorchOnTpuError, match="models.Family instance"):
    models.register(object())
