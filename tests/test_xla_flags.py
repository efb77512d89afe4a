"""torch_on_tpu's default XLA flags: added at import, never over a user's own value."""

import logging
import os
import subprocess
import sys

import pytest

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.runtime import xla_flags

YNN = "--xla_cpu_experimental_ynn_fusion_type"
DEFAULTS = f"{YNN}="


def test_defaults_are_added_and_user_values_kept():
  assert xla_flags.with_defaults("") == DEFAULTS
  assert xla_flags.with_defaults("--xla_force_host_platform_device_count=8") == (
    f"--xla_force_host_platform_device_count=8 {DEFAULTS}"
  )
  mine = f"{YNN}=dot --xla_force_host_platform_device_count=2"
  assert xla_flags.with_defaults(mine) == mine


def test_simulated_devices_get_three_threads_each_and_one_unless_the_user_sized_the_pool():
  """A thread blocks in a collective until every device arrives; with one thread per device
  and two collectives of one device waiting at once, the last device had no thread left and
  XLA aborted the run (xla_flags docstring)."""
  cpus = len(os.sched_getaffinity(0))
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  xla_flags.apply_defaults(env)
  assert env["PJRT_NPROC"] == str(max(cpus, 25))
  for kept in ({"PJRT_NPROC": "12"}, {"NPROC": "12"}):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", **kept}
    xla_flags.apply_defaults(env)
    assert env.get("PJRT_NPROC") == kept.get("PJRT_NPROC")
  env = {}
  xla_flags.simulate_cpu_devices(4, env)  # before jax starts, so jax code run before tot.setup() has them too
  assert env["PJRT_NPROC"] == str(max(cpus, 13))
  with pytest.raises(TorchOnTpuError, match="sets --xla_force_host_platform_device_count=eight; give a whole number"):
    xla_flags.apply_defaults({"XLA_FLAGS": "--xla_force_host_platform_device_count=eight"})
  for one_device in ({}, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}):
    xla_flags.apply_defaults(one_device)
    assert "PJRT_NPROC" not in one_device


def _fresh_process(xla_flags_value, body):
  """stdout of `body` run in a fresh process that starts torch_on_tpu first, with
  `xla_flags_value` as its XLA_FLAGS (None: unset) and no PJRT_NPROC of ours."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
  if xla_flags_value is not None:
    env["XLA_FLAGS"] = xla_flags_value
  code = "import os, torch_on_tpu\ntorch_on_tpu.setup()\nimport jax, jax.numpy as jnp\n" + body
  run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  return run.stdout


def test_xla_sizes_its_cpu_pool_from_the_setting():
  """XLA reads PJRT_NPROC when it sizes the pool that runs the simulated devices' programs."""
  setting, threads = _fresh_process(
    "--xla_force_host_platform_device_count=8",
    "jax.block_until_ready(jnp.ones(8) * 2)\n"
    "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
    "print(os.environ['PJRT_NPROC'], names.count('tf_XLAEigen'))\n",
  ).split()
  assert int(threads) == int(setting) >= 25


def _dot_hlo(xla_flags_value):
  """XLA_FLAGS and the compiled HLO of a CPU matmul in a fresh process."""
  out = _fresh_process(
    xla_flags_value,
    "a = jnp.ones((128, 128))\nprint(os.environ['XLA_FLAGS'])\nprint(jax.jit(jnp.dot).lower(a, a).compile().as_text())\n",
  )
  flags, hlo = out.split("\n", 1)
  return flags, hlo


def test_setup_switches_cpu_dots_off_ynnpack_unless_the_user_says_otherwise():
  flags, hlo = _dot_hlo(None)
  assert flags == DEFAULTS
  assert "ynn_fusion" not in hlo and " dot(" in hlo
  flags, hlo = _dot_hlo(f"{YNN}=dot")  # jax's own default, chosen explicitly
  assert flags == f"{YNN}=dot"
  assert "ynn_fusion" in hlo


def test_late_setup_says_the_defaults_did_not_apply(caplog):
  import jax

  jax.devices()  # this process's backend is running
  environ = {}
  with caplog.at_level(logging.INFO, logger="torch_on_tpu.runtime.xla_flags"):
    xla_flags.apply_defaults(environ)
  assert environ["XLA_FLAGS"] == DEFAULTS
  assert "call tot.setup() first" in caplog.text


def test_tpu_programs_compile_without_collective_matmuls_unless_asked_or_the_user_decides(monkeypatch):
  """The TPU compiler's windowed einsums are off by the threshold MaxText's tuned recipes use;
  `COLLECTIVE_MATMUL` (the recipes' `--collective_matmul`) or the user's own flag in
  LIBTPU_INIT_ARGS leaves the compiler its choice. Nothing of it reaches CPU or GPU programs."""
  threshold = "xla_jf_spmd_threshold_for_windowed_einsum_mib"
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  assert xla_flags.compile_options("tpu")[threshold] == "1000000"
  assert threshold not in xla_flags.compile_options("cpu") and threshold not in xla_flags.compile_options("gpu")
  monkeypatch.setattr(xla_flags, "COLLECTIVE_MATMUL", True)
  assert threshold not in xla_flags.compile_options("tpu")
  monkeypatch.setattr(xla_flags, "COLLECTIVE_MATMUL", False)
  for own in ("--xla_jf_spmd_threshold_for_windowed_einsum_mib=64", "--xla_tpu_enable_windowed_einsum_for_all_gather=true"):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", f"--xla_tpu_enable_latency_hiding_scheduler=true {own}")
    assert threshold not in xla_flags.compile_options("tpu"), own
