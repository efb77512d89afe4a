"""A wrapped model's outputs in a user's plain torch code, outside torchax's environment
(`model(x).logits * 2`, a loss against CPU labels, `torch.allclose`): computed on the device
as torch computes them, where torchax raised an AssertionError."""

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_on_tpu as tot
from tests import helpers as h


@pytest.fixture(scope="module")
def outputs():
  ref = h.hf("llama", device="cpu")
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8))
  tokens, labels = h.random_batch(256)
  with torch.no_grad():
    want = ref(tokens, use_cache=False).logits
  return jm(tokens).logits, want, labels


def test_torch_math_on_outputs_computes_torchs_values(outputs):
  ours, want, labels = outputs
  doubled = ours * 2
  assert doubled.device.type == "jax" and h.rel(doubled.cpu(), want * 2) < 1e-5
  assert h.rel((ours.softmax(-1)[:, -1] - 0.5).cpu(), want.softmax(-1)[:, -1] - 0.5) < 1e-5
  loss = F.cross_entropy(ours.flatten(0, 1), labels.flatten())  # the labels are CPU tensors
  assert abs(float(loss) - F.cross_entropy(want.flatten(0, 1), labels.flatten()).item()) < 1e-5
  assert torch.allclose(ours, want, atol=1e-5) is True
  assert torch.allclose(ours, want + 1) is False
  assert torch.equal(ours.argmax(-1).cpu().long(), want.argmax(-1))


def test_math_on_an_output_of_a_failed_index_check_raises_it():
  jm = tot.ShardedModule(h.hf("llama"), mesh=tot.make_mesh(fsdp=8))
  tokens = torch.full((8, 4), 300)  # past the 256-row embedding
  logits = jm(tokens).logits
  with pytest.raises(IndexError):
    logits * 2
