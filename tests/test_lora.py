"""`make_train_step(trainable=...)` and `lora.wrap`: frozen params get no gradient and no
optimizer state, are not donated, and keep their values bit for bit; adapters start as
peft's (B zero, so the model is the base model) and train."""

import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.training import lora

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)


def ce(out, labels):
  logits = out.logits if hasattr(out, "logits") else out
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(seed=0):
  ids = np.random.default_rng(seed).integers(0, 256, (8, 17)).astype(np.int32)
  return {"input_ids": ids[:, :-1], "use_cache": False}, ids[:, 1:]


def test_frozen_params_keep_their_arrays_and_get_no_optimizer_state():
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=-1))
  step = tot.make_train_step(jm, ce, optax.adamw(1e-2), trainable=["**.mlp.*.weight"])
  frozen = {k: v for k, v in jm.params.items() if ".mlp." not in k}
  values = {k: np.asarray(v) for k, v in frozen.items()}
  trained_before = {k: np.asarray(v) for k, v in jm.params.items() if ".mlp." in k}
  for seed in range(3):
    step(*batch(seed))
  assert set(step.opt_state[0].mu) == set(trained_before)  # no moments for frozen params
  for k, v in frozen.items():
    assert jm.params[k] is v and not v.is_deleted()  # neither donated nor replaced
    np.testing.assert_array_equal(np.asarray(v), values[k])
  assert all(not np.array_equal(np.asarray(jm.params[k]), v) for k, v in trained_before.items())


def test_trainable_predicate_and_a_pattern_that_selects_nothing():
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=-1))
  step = tot.make_train_step(jm, ce, optax.adamw(1e-2), trainable=lambda name: name == "lm_head.weight")
  assert step.trainable == {"lm_head.weight"}
  with pytest.raises(tot.TorchOnTpuError, match="selects none of the model's"):
    tot.make_train_step(jm, ce, optax.adamw(1e-2), trainable="**.lora_A.**")


@pytest.mark.parametrize("scan", [False, True])
def test_lora_starts_as_the_base_model_and_trains_only_adapters(scan):
  mesh = tot.make_mesh(fsdp=-1)
  base = tot.ShardedModule(h.hf(), mesh=mesh)
  inputs, labels = batch()
  expected = np.asarray(base(torch.from_numpy(inputs["input_ids"]), use_cache=False).logits.jax())
  jm = lora.wrap(base, h.hf(), rank=4, scan=scan)
  got = np.asarray(jm(torch.from_numpy(inputs["input_ids"]), use_cache=False).logits.jax())
  np.testing.assert_array_equal(got, expected)  # lora_B = 0: exactly the base model
  a = [v for k, v in jm.params.items() if ".lora_A." in k]
  assert a and all(0 < float(abs(x).max()) <= 1 / x.shape[-1] ** 0.5 for x in a)
  step = tot.make_train_step(jm, ce, optax.adamw(1e-2), trainable=lora.TRAINABLE)
  base_arrays = {k: v for k, v in jm.params.items() if not lora.is_adapter(k)}
  losses = [float(step(*batch(0))) for _ in range(4)]
  assert losses[-1] < losses[0]
  assert all(jm.params[k] is v for k, v in base_arrays.items())
  assert len(step.trainable) == len(jm.params) - len(base_arrays)


def test_lora_rank_and_targets_are_checked():
  base = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=-1))
  with pytest.raises(tot.TorchOnTpuError, match="rank must be a positive integer"):
    lora.wrap(base, h.hf(), rank=0)
  with pytest.raises(tot.TorchOnTpuError, match="targets=\\['nope'\\]"):
    lora.wrap(base, h.hf(), rank=2, targets=["nope"])
