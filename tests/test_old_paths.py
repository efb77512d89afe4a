"""The module paths from before the package's layout keep working (`core/old_paths.py`)."""

import importlib
import subprocess
import sys

import pytest

import torch_on_tpu as tot
from torch_on_tpu.core import old_paths


@pytest.mark.parametrize("old", sorted(old_paths.MOVED))
def test_every_old_path_is_its_new_module(old):
  new = importlib.import_module(f"torch_on_tpu.{old_paths.MOVED[old]}")
  assert importlib.import_module(f"torch_on_tpu.{old}") is new
  assert new.__spec__.name == new.__name__ == f"torch_on_tpu.{old_paths.MOVED[old]}"  # its own spec kept


def test_old_submodule_paths_and_attribute_access_work():
  from torch_on_tpu.io.checkpoint import training_state
  from torch_on_tpu.lowering.aten import model_ops
  from torch_on_tpu.training import lora

  import torch_on_tpu.checkpoint.training_state as old_state  # noqa: E402 (the old spelling on purpose)
  from torch_on_tpu import lora as old_lora
  from torch_on_tpu.lowerings import model_ops as old_ops

  assert (old_state, old_lora, old_ops) == (training_state, lora, model_ops)
  assert tot.export is importlib.import_module("torch_on_tpu.io.export")


def test_a_path_that_never_existed_is_still_missing():
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("torch_on_tpu.no_such_module")
  with pytest.raises(AttributeError):
    tot.no_such_module  # noqa: B018


def test_old_command_paths_run_under_python_dash_m():
  out = subprocess.run([sys.executable, "-m", "torch_on_tpu.launch", "--help"], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and "python -m torch_on_tpu.launch" in out.stdout, out.stderr
