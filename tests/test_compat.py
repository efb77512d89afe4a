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


# ---- torchvision: imported before any torchax mode can see its import-time op ---------------

_FAKE_VISION = '''
import torch

# torchax's dispatch mode takes every op of the torchvision namespace.
_lib = torch.library.Library("torchvision", "DEF")
_lib.define("_cuda_version() -> int")
_lib.impl("_cuda_version", lambda: -1, "CompositeExplicitAutograd")
torch.ops.torchvision._cuda_version()  # what torchvision's extension check does on import
'''


def _package(root, name, body):
  (root / name).mkdir()
  (root / name / "__init__.py").write_text(body)


def test_an_import_time_op_inside_torchax_mode_fails_so_torchvision_goes_first(tmp_path):
  _package(tmp_path, "late_vision", _FAKE_VISION)
  code = (
    f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
    "import torch_on_tpu, torchax\n"
    "with torchax.default_env():\n"
    "  import late_vision\n"
  )
  late = _run(code)
  assert late.returncode != 0 and "has no lowering" in late.stderr


def test_torchvision_is_imported_with_torch_on_tpu_and_a_broken_one_is_ignored(tmp_path):
  good, broken = tmp_path / "good", tmp_path / "broken"
  good.mkdir(), broken.mkdir()
  _package(good, "torchvision", _FAKE_VISION)
  _package(broken, "torchvision", "raise RuntimeError('operator torchvision::nms does not exist')\n")
  check = "import sys; sys.path.insert(0, {!r})\nimport torch_on_tpu\nprint('torchvision' in sys.modules)\n"
  assert _run(check.format(str(good))).stdout.strip() == "True"
  ignored = _run(check.format(str(broken)))
  assert ignored.returncode == 0 and ignored.stdout.strip() == "False"
