"""tools/titan_gpu_reference.py, the GPU comparison of torchtitan's models, in the parts that run
without a GPU: the attention backward as torch's varlen computes it, torchtitan imported on an
older torch, and the runs written, read back and compared."""

import pathlib
import subprocess
import sys

import torch

from tests import helpers as h

tp = h.titan_parity()
gpu = h.load_module("tools/titan_gpu_reference.py")


def _sink_scaled_attention(lse_gradient: bool):
  """gpt-oss's sink rescale on `dense_flex_attention`: (output, gradients of q, k, v)."""
  from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

  g = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(1, 2, 8, 4, generator=g, requires_grad=True) for _ in range(3))
  mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 8, 8, device="cpu")
  out, aux = tp.dense_flex_attention(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True), lse_gradient=lse_gradient)
  scaled = out * torch.sigmoid(aux.lse - 0.5).unsqueeze(-1)
  scaled.square().sum().backward()
  return scaled.detach(), q.grad, k.grad, v.grad


def test_the_varlen_backward_reference_drops_exactly_the_log_sum_exps_gradient():
  """`lse_gradient=False` is torch's varlen_attn backward: the same forward, the same V
  gradient (the log-sum-exp does not depend on V), other Q and K gradients."""
  full, cut = _sink_scaled_attention(True), _sink_scaled_attention(False)
  assert torch.equal(full[0], cut[0]) and torch.allclose(full[3], cut[3], rtol=1e-6, atol=1e-7)
  assert tp.rel(cut[1], full[1]) > 1e-2 and tp.rel(cut[2], full[2]) > 1e-2


def test_the_gpu_side_imports_torchtitan_on_a_torch_older_than_it_wants():
  """torch 2.11 lacks a name torchtitan's FSDP module imports and `varlen_attn` keywords it
  passes: placeholders for the names (named), the keywords dropped (named), the model built."""
  script = """
import importlib.abc, sys
import torch.distributed.fsdp as fsdp
del fsdp.DataParallelMeshDims
class Older(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name == "torch.distributed._mesh_layout":
      raise ModuleNotFoundError(f"No module named '{name}'")
sys.modules.pop("torch.distributed._mesh_layout", None)
sys.meta_path.insert(0, Older())
from tests import helpers as h
gpu = h.load_module("tools/titan_gpu_reference.py")
print(sorted(gpu.import_family("gpt_oss:debugmodel")))
from torchtitan.models.common import attention
seen = {}
attention.varlen_attn = lambda q, *, scale=None: seen.update(scale=scale)
dropped = set()
gpu.keywords_for_this_torch(dropped)
attention.varlen_attn(1, scale=0.5, num_splits=1)
print(sorted(dropped), seen)
tp = gpu.titan_parity()
print(type(tp.build(gpu.config_of(tp, {"spec": "gpt_oss:debugmodel", "layers": 2, "round_robin": False}))).__name__)
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=pathlib.Path(__file__).resolve().parent.parent, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert lines[-3] == "['torch.distributed._mesh_layout', 'torch.distributed.fsdp.DataParallelMeshDims']"
  assert lines[-2] == "['num_splits'] {'scale': 0.5}"
  assert lines[-1] == "GptOssModel"


def test_runs_are_written_read_back_and_compared(tmp_path):
  g = torch.Generator().manual_seed(0)
  weights = {"w": torch.randn(4, 4, generator=g)}
  want = tp.Run(forward=torch.randn(2, 3, generator=g), losses=[2.0, 1.5], tensors={**weights, "counts": torch.ones(3)},
                grads={"w": torch.randn(4, 4, generator=g)})
  gpu.save_run(tmp_path, "want", want)
  back = gpu.load_run(tp, tmp_path, "want")
  assert torch.equal(back.forward, want.forward) and back.losses == want.losses
  assert torch.equal(back.grads["w"], want.grads["w"]) and torch.equal(back.tensors["counts"], want.tensors["counts"])
  got = tp.Run(forward=want.forward * 1.01, losses=[2.02, 1.5], tensors={"w": weights["w"] * 0.9, "counts": torch.ones(3)},
               grads={"w": want.grads["w"] * 1.1})
  result = tp.compare(got, back, {"w"})
  assert abs(result["forward"] - 0.01) < 1e-6 and abs(result["losses"] - 0.01) < 1e-6
  assert abs(result["grads"] - 0.1) < 1e-6 and abs(result["weights"] - 0.1) < 1e-6 and result["buffers"] == 0.0


def test_a_step_run_out_of_order_is_one_sentence_and_exit_2(tmp_path, capsys):
  """`run`/`compare` on a directory missing what an earlier step writes: which file, which
  step to run first; `run` without a CUDA GPU likewise. No traceback."""
  assert gpu.main(["compare", str(tmp_path)]) == 2
  assert f"{tmp_path} has no meta.json; run 'titan_gpu_reference.py make {tmp_path}' first." in capsys.readouterr().err
  for name in ("meta.json", "bridge.json", "state.safetensors"):
    (tmp_path / name).write_text("{}")
  assert gpu.main(["compare", str(tmp_path)]) == 2
  assert "has no cuda.json; run 'titan_gpu_reference.py run" in capsys.readouterr().err
  assert gpu.main(["run", str(tmp_path)]) == 2  # this machine has no GPU
  assert capsys.readouterr().err.strip() == "titan_gpu_reference run: this torch sees no CUDA GPU; run it on a GPU machine."
