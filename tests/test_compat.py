"""The torchax import shim: needed and sufficient on this stack, a no-op elsewhere."""

import importlib.metadata
import subprocess
import sys

import pytest
import torch

import torch_on_tpu as tot
from torch_on_tpu import _compat


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_plain_torchax_import_fails_on_this_stack_so_the_shim_is_needed():
  assert _compat.dimname_shim_needed()
  plain = _run("import torchax, torchax.decompositions")
  assert plain.returncode != 0
  assert "no overload name" in plain.stderr


def test_the_shim_is_sufficient_and_leaves_torch_as_it_was():
  shimmed = _run(
    "import torch_on_tpu, torchax, torch\n"
    "env = torchax.default_env()\n"
    "assert torch.ops.aten.mm in env._ops and len(env._ops) > 400\n"
    "try:\n"
    "    torch.ops.aten.prod.dim_Dimname\n"
    "except AttributeError:\n"
    "    print('restored')\n"
  )
  assert shimmed.returncode == 0, shimmed.stderr[-2000:]
  assert "restored" in shimmed.stdout


def test_only_named_tensor_overloads_are_tolerated():
  assert _compat.is_named_tensor_overload("dim_Dimname")
  assert _compat.is_named_tensor_overload("correction_names")
  assert not _compat.is_named_tensor_overload("dim_int")
  with _compat._tolerate_removed_dimname_overloads():
    assert repr(torch.ops.aten.prod.dim_Dimname).startswith("<removed overload")
    with pytest.raises(AttributeError):
      torch.ops.aten.prod.not_an_overload


def test_the_shim_is_a_no_op_where_it_is_not_needed(monkeypatch):
  monkeypatch.setattr(_compat, "torch_has_dimname_overloads", lambda: True)
  assert not _compat.dimname_shim_needed()
  monkeypatch.undo()
  real_version = importlib.metadata.version
  monkeypatch.setattr(
    importlib.metadata, "version", lambda name: "0.0.14" if name == "torchax" else real_version(name)
  )
  assert not _compat.dimname_shim_needed()


def test_a_small_model_runs_forward_through_torchax():
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
  x = torch.randn(8, 16)
  expected = model(x).detach()
  jm = tot.JittableModule(model, mesh=tot.make_mesh(fsdp=8))
  got = tot.to_cpu(jm(x))
  assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
