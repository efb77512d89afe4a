"""A torchtitan run's checkpoint (torch.distributed.checkpoint) as a start (`--weights`): the model's
tensors of the latest step, or of the step named, land in any layout and compute what torch does;
the training state beside them is not read; a damaged checkpoint or another model's is one sentence."""

import jax
import pytest
import torch
import torch.distributed.checkpoint as dcp

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.io import checkpoint


def _titan_checkpoint(directory, model, step, scale):
  """What torchtitan's CheckpointManager writes at `step`: the model's state_dict at the top level
  (moved off its init by `scale`), its training state under its own keys."""
  gen = torch.Generator().manual_seed(step)
  state = {k: v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
           for k, v in model.state_dict().items()}
  training = {
    "optimizer": {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in state.items()}, "lr": 1e-3},
    "lr_scheduler": {"last_epoch": step}, "train_state": {"step": step}, "dataloader": {"position": 7},
  }
  dcp.save({**state, **training}, checkpoint_id=str(directory / f"step-{step}"), no_dist=True)
  return state


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_a_torchtitan_checkpoint_starts_the_model_from_its_latest_step(tmp_path, scan):
  torch.manual_seed(0)
  source = h.titan(device="cpu")
  _titan_checkpoint(tmp_path / "checkpoint", source, step=5, scale=0.01)
  latest = _titan_checkpoint(tmp_path / "checkpoint", source, step=10, scale=0.02)
  jm = tot.ShardedModule(h.titan(device="cpu"), mesh=tot.make_mesh(fsdp=4, devices=jax.devices()[:4]), sharding="fsdp", scan=scan)
  checkpoint.import_pretrained(jm, tmp_path / "checkpoint")
  h.assert_holds_and_computes(jm, latest, source)  # step 10's tensors, exactly


def test_a_named_step_is_read_and_a_damaged_or_foreign_checkpoint_is_one_sentence(tmp_path):
  torch.manual_seed(0)
  source = h.titan(device="cpu")
  first = _titan_checkpoint(tmp_path / "checkpoint", source, step=5, scale=0.01)
  _titan_checkpoint(tmp_path / "checkpoint", source, step=10, scale=0.02)
  jm = tot.ShardedModule(h.titan(device="cpu"), mesh=tot.make_mesh(fsdp=8), sharding="fsdp")
  checkpoint.import_pretrained(jm, tmp_path / "checkpoint" / "step-5")
  assert all(torch.equal(jm.state_dict()[k], first[k]) for k in first)

  hf = h.hf(device="cpu")  # another architecture's checkpoint: refused before anything is read
  dcp.save(hf.state_dict(), checkpoint_id=str(tmp_path / "hf" / "step-1"), no_dist=True)
  with pytest.raises(tot.TorchOnTpuError, match=r"^The tensors of the checkpoint at .*step-1 do not match the model \(.*missing.*; load a checkpoint saved from this model"):
    checkpoint.import_pretrained(jm, tmp_path / "hf")
  assert all(torch.equal(jm.state_dict()[k], first[k]) for k in first)

  (tmp_path / "checkpoint" / "step-10" / ".metadata").write_bytes(b"not a checkpoint")
  with pytest.raises(tot.TorchOnTpuError, match=r"step-10/\.metadata is not a readable torch.distributed.checkpoint index .*; point --weights at a complete"):
    checkpoint.import_pretrained(jm, tmp_path / "checkpoint")
  for data in (tmp_path / "checkpoint" / "step-5").glob("*.distcp"):
    data.write_bytes(data.read_bytes()[:100])  # truncated
  with pytest.raises(tot.TorchOnTpuError, match=r"failed .*Reading .* from the checkpoint at .*step-5 failed .*incomplete or damaged"):
    checkpoint.import_pretrained(jm, tmp_path / "checkpoint" / "step-5")
