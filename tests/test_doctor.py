"""`python -m torch_on_tpu.doctor`: reports the stack, and fails clearly when it is broken."""

import re
import subprocess
import sys

from torch_on_tpu.runtime import doctor


def _doctor(env_extra=None, tmp_path=None):
  import os

  env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}  # the doctor's own start-up sizes it
  env.update(env_extra or {})
  return subprocess.run(
    [sys.executable, "-m", "torch_on_tpu.doctor"], capture_output=True, text=True, env=env, timeout=300
  )


def test_doctor_reports_versions_devices_and_kernels():
  run = _doctor({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert run.returncode == 0, run.stderr
  for needle in ("torch", "2.13.0", "torchax", "0.0.13", "jax", "torchtitan", "platform", "cpu"):
    assert needle in run.stdout
  assert re.search(r"devices\s+8 \(processes: 1\)", run.stdout)
  assert "splash" in run.stdout and "xla" in run.stdout and "cudnn" in run.stdout
  flags = "--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type="
  assert re.search(r"XLA_FLAGS\s+" + re.escape(flags) + "\n", run.stdout)  # the user's flags, then our default
  assert re.search(r"PJRT_NPROC\s+25\n", run.stdout)  # 3 threads per simulated device and one (xla_flags)


def test_doctor_names_a_device_count_that_is_not_a_number():
  run = _doctor({"XLA_FLAGS": "--xla_force_host_platform_device_count=eight"})
  assert run.returncode != 0 and "Traceback" not in run.stderr
  assert "XLA_FLAGS sets --xla_force_host_platform_device_count=eight; give a whole number" in run.stderr
  assert "torchax" not in run.stderr


def test_doctor_fails_naming_torchax_when_it_cannot_import(tmp_path):
  broken = tmp_path / "torchax"
  broken.mkdir()
  (broken / "__init__.py").write_text("raise ImportError('simulated broken torchax')\n")
  run = _doctor({"PYTHONPATH": str(tmp_path)})
  assert run.returncode == 1
  assert "cannot import torchax" in run.stderr and "simulated broken torchax" in run.stderr
  assert "setup_env.sh" in run.stderr


def test_wrong_torch_and_missing_packages_are_named():
  found = doctor.versions()
  found["torch"] = "2.9.1+cu128"
  found["optax"] = None
  issues = doctor.problems(found)
  assert any("torch 2.9.1+cu128 is installed" in i and "torch==2.13.0" in i for i in issues)
  assert any(i.startswith("optax is not installed") for i in issues)
