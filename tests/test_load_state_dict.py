"""`ShardedModule.load_state_dict` as torch's: the tensors land in the model's shardings (scanned
or not, any mesh), torchtitan's wq/wk/wv fuse into its wqkv, the result names missing and
unexpected keys as torch's does, and strict / non-strict refuse and keep what torch's do."""

import jax
import numpy as np
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h


def _sharded(model, scan, fsdp=8):
  return tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=fsdp, devices=jax.devices()[:fsdp]), sharding="fsdp", scan=scan)


def _trained_elsewhere(model):
  """`model`'s state_dict with every float tensor moved off its init (so loading it changes all)."""
  gen = torch.Generator().manual_seed(1)
  return {k: v + 0.02 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_a_torchtitan_state_dict_loads_into_any_layout_and_computes_what_torch_does(scan):
  torch.manual_seed(0)
  source = h.titan(device="cpu")
  state = _trained_elsewhere(source)  # wq / wk / wv, as torchtitan's model saves them
  assert any(k.endswith(".wq.weight") for k in state)
  jm = _sharded(h.titan(device="cpu"), scan=scan, fsdp=4 if scan else 8)
  result = jm.load_state_dict(state)
  assert (result.missing_keys, result.unexpected_keys) == ([], [])
  h.assert_holds_and_computes(jm, state, source)  # every tensor exactly as given


def test_strict_and_non_strict_answer_as_torch_does():
  torch.manual_seed(0)
  model = h.hf(device="cpu")
  jm = _sharded(h.hf(device="cpu"), scan=True)
  state = _trained_elsewhere(model)
  layer1 = "model.layers.1.mlp.up_proj.weight"
  partial = {k: v for k, v in state.items() if k != layer1} | {"extra.weight": torch.zeros(3)}
  before, before_norm = jm.state_dict()[layer1], jm.state_dict()["model.norm.weight"]

  with pytest.raises(tot.TorchOnTpuError, match=rf"1 missing: {layer1}; 1 unexpected: extra.weight\); .*strict=False"):
    jm.load_state_dict(partial)
  assert torch.equal(jm.state_dict()["model.norm.weight"], before_norm)  # refused before anything loaded

  ours = jm.load_state_dict(partial, strict=False)
  theirs = model.load_state_dict(partial, strict=False)
  assert (ours.missing_keys, ours.unexpected_keys) == (theirs.missing_keys, theirs.unexpected_keys)
  loaded = jm.state_dict()
  # the missing layer of the scanned stack keeps its values; its other layer and the rest are loaded
  assert torch.equal(loaded[layer1], before)
  assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])
  assert not torch.equal(loaded["model.norm.weight"], before_norm)
  assert all(torch.equal(loaded[k], state[k]) for k in state if k != layer1)

  wrong = dict(state, **{"lm_head.weight": torch.zeros(7, 64)})
  for strict in (True, False):  # a shape that differs is refused either way, before anything loads
    with pytest.raises(tot.TorchOnTpuError, match=r"shape mismatch: lm_head.weight is \(7, 64\) but \(256, 64\)"):
      jm.load_state_dict(wrong, strict=strict)


def test_values_are_cast_to_the_dtypes_the_model_holds():
  torch.manual_seed(0)
  jm = _sharded(h.hf(device="cpu").to(torch.bfloat16), scan=False)
  state = {k: v.double() for k, v in _trained_elsewhere(h.hf(device="cpu")).items()}
  jm.load_state_dict(state)
  weight = jm.state_dict()["model.layers.0.self_attn.q_proj.weight"]
  assert weight.dtype == torch.bfloat16
  assert np.array_equal(weight.float().numpy(), state["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16).float().numpy())


def test_an_hf_checkpoint_of_torchtitans_llama3_starts_a_torchtitan_model(tmp_path):
  """HF's names (an untied `lm_head.weight`, which torchtitan's Llama 3 also has) are read by
  torchtitan's own Llama3StateDictAdapter.from_hf: every tensor back exactly; weights of another
  architecture are refused in one sentence before anything loads."""
  from torch_on_tpu.io import checkpoint, export

  torch.manual_seed(0)
  source = h.titan(device="cpu")
  state = _trained_elsewhere(source)
  source.load_state_dict(state)
  export.export(_sharded(source, scan=False, fsdp=1), tmp_path / "hf")
  jm = _sharded(h.titan(device="cpu"), scan=True, fsdp=4)
  checkpoint.import_pretrained(jm, tmp_path / "hf")
  loaded = jm.state_dict()
  assert all(torch.equal(loaded[k], state[k]) for k in state)
  h.hf(device="cpu").save_pretrained(tmp_path / "other")  # an HF Llama of another size
  with pytest.raises(tot.TorchOnTpuError, match=r"do not match the model|cannot read these weights"):
    checkpoint.import_pretrained(jm, tmp_path / "other")
