"""Multi-host start-up: one process per host, joined through `jax.distributed`.

On a TPU pod slice (and under Slurm / Open MPI) jax finds the other hosts by
itself. Elsewhere the run is described by environment variables, which
`python -m torch_on_tpu.launch` sets for local multi-process runs:

    TOT_COORDINATOR      host:port of process 0's coordinator (JAX_COORDINATOR_ADDRESS also works)
    TOT_NUM_PROCESSES    how many processes take part
    TOT_PROCESS_ID       this process's index, 0..TOT_NUM_PROCESSES-1
    TOT_HEARTBEAT_TIMEOUT  seconds without a heartbeat before a process counts as dead (default 20)
    TOT_INIT_TIMEOUT     seconds to wait for the coordinator and every process at start (default 300)

jax must join the others before it starts its backend, so the platform
start-up (`runtime.setup()`, run on first use of the bridge) joins when the
environment describes a multi-process run; calling `initialize_distributed()`
afterwards is then a no-op that reports the run. A single process with nothing
configured stays alone.

When a process dies, hangs or fails, the others must not hang in a collective:
`torch_on_tpu.runtime.health` watches the run (jax's heartbeats, in recoverable mode) and stops
every process within `TOT_HEARTBEAT_TIMEOUT` seconds with one sentence naming it;
`torch_on_tpu.runtime.fingerprint` refuses processes that run other code (checked here, at
join) or another config. Joining waits at most `TOT_INIT_TIMEOUT` seconds, says after
`JOIN_NOTICE_SECONDS` what it is waiting for, and then ends the process with one sentence
naming the coordinator's address (exit `health.EXIT_NO_COORDINATOR`), before jax's own
timeout would abort it with a C++ stack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading

import jax

from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.runtime import fingerprint, health

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "TOT_COORDINATOR"
ENV_NUM_PROCESSES = "TOT_NUM_PROCESSES"
ENV_PROCESS_ID = "TOT_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "TOT_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "TOT_INIT_TIMEOUT"
JAX_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # read by jax.distributed itself too

HEARTBEAT_TIMEOUT_SECONDS = 20  # jax's default of 100 s would leave survivors hanging for minutes
INIT_TIMEOUT_SECONDS = 300  # pod hosts boot minutes apart
JOIN_NOTICE_SECONDS = 10  # a join still waiting after this long says what it waits for
_JAX_INIT_MARGIN_SECONDS = 30  # jax's own join timeout is later than ours: ours speaks first
SHUTDOWN_TIMEOUT_SECONDS = 60  # how long a finished process waits at exit for the slowest one


def initialize_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  local_device_ids=None,
  heartbeat_timeout_seconds: int | None = None,
) -> bool:
  """Joins this process to the run's other processes; True when it runs with others.

  Arguments override the `TOT_*` environment variables; with neither, a
  managed cluster jax recognises (a multi-host TPU pod slice, Slurm, Open MPI)
  is joined automatically and anything else is a single-process no-op.
  Calling it again (or after `tot.setup()` joined) does nothing more.
  """
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  coordinator = coordinator_address or os.environ.get(ENV_COORDINATOR) or os.environ.get(JAX_ENV_COORDINATOR)
  count = _setting(num_processes, ENV_NUM_PROCESSES)
  index = _setting(process_id, ENV_PROCESS_ID)
  heartbeat = _setting(heartbeat_timeout_seconds, ENV_HEARTBEAT_TIMEOUT)
  timeouts = dict(
    initialization_timeout=_setting(None, ENV_INIT_TIMEOUT) or INIT_TIMEOUT_SECONDS,
    heartbeat_timeout_seconds=heartbeat or HEARTBEAT_TIMEOUT_SECONDS,
    shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS,
  )
  given = {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: count, ENV_PROCESS_ID: index}
  if any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    if missing:
      raise TorchOnTpuError(
        f"A multi-process run needs a coordinator address, a process count and a process id, but "
        f"{', '.join(missing)} is not set; set all three (or none, for a single process)."
      )
    if count < 1 or not 0 <= index < count:
      raise TorchOnTpuError(
        f"Process id {index} is outside 0..{count - 1} for {count} processes; give each process a "
        f"distinct id below {ENV_NUM_PROCESSES}."
      )
    if count == 1:
      return False
    _join(
      coordinator_address=coordinator,
      num_processes=count,
      process_id=index,
      local_device_ids=local_device_ids,
      **timeouts,
    )
  elif _compat.managed_cluster_size() > 1:
    _join(local_device_ids=local_device_ids, **timeouts)
  else:
    return False
  health.start(_compat.distributed_client(), jax.process_index(), jax.process_count(), timeouts["heartbeat_timeout_seconds"])
  fingerprint.check_code()
  logger.info(
    "Process %d of %d joined the run (%d devices in all).", jax.process_index(), jax.process_count(), jax.device_count()
  )
  return True


def _join(**kwargs) -> None:
  if _compat.backend_started():
    raise TorchOnTpuError(
      "jax already started its backend in this process, so it can no longer join the other "
      f"processes; set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} in the "
      "environment and call `tot.setup()` before any other jax use, or launch with "
      "`python -m torch_on_tpu.launch`."
    )
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes need collectives
  # A dead process is recorded, not fatal to the others: torch_on_tpu.runtime.health stops them, naming it.
  jax.config.update("jax_enable_recoverability", True)
  timeout = kwargs["initialization_timeout"]
  with _join_watchdog(kwargs.get("coordinator_address"), kwargs.get("num_processes"), kwargs.get("process_id"), timeout):
    jax.distributed.initialize(**{**kwargs, "initialization_timeout": timeout + _JAX_INIT_MARGIN_SECONDS})


@contextlib.contextmanager
def _join_watchdog(coordinator: str | None, count: int | None, index: int | None, timeout: float):
  """While joining: after `JOIN_NOTICE_SECONDS` one line on what the join waits for;
  after `timeout` one sentence naming the coordinator and the timeout, and the process
  ends (`health.EXIT_NO_COORDINATOR`)."""
  joined = threading.Event()
  where = coordinator or "the address the cluster's metadata gives"
  me = f"Process {index}" if index is not None else "This process"

  notice = min(JOIN_NOTICE_SECONDS, timeout / 2)

  def watch():
    if joined.wait(notice):
      return
    print(
      f"{me} is waiting for the run's coordinator at {where} and the other processes "
      f"(of {count or 'all'}); it gives up after {timeout:.0f} s ({ENV_INIT_TIMEOUT}).", file=sys.stderr, flush=True,
    )
    if joined.wait(timeout - notice):
      return
    if index == 0:
      why = f"it started the coordinator at {where}, but not all {count} processes joined within {timeout:.0f} s ({ENV_INIT_TIMEOUT})"
      fix = f"start the others with {ENV_COORDINATOR}={where} and {ENV_NUM_PROCESSES}={count}, each with its own {ENV_PROCESS_ID}"
    elif coordinator and not _answers(coordinator):
      why = f"nothing answers at the coordinator's address {where} within {timeout:.0f} s ({ENV_INIT_TIMEOUT})"
      fix = "start process 0 (it holds the coordinator), or check the address, the port and the firewall"
    else:
      why = f"the coordinator at {where} answers, but not all {count or ''} processes joined within {timeout:.0f} s ({ENV_INIT_TIMEOUT})".replace("  ", " ")
      fix = f"start every process with the same {ENV_NUM_PROCESSES} and a distinct {ENV_PROCESS_ID}"
    sentence = f"{me} could not join the run: {why}; {fix}."
    health.refuse_alone(sentence)
    os.write(2, f"error: {sentence}\n".encode())
    os._exit(health.EXIT_NO_COORDINATOR)

  threading.Thread(target=watch, daemon=True, name="tot-join-watchdog").start()
  try:
    yield
  finally:
    joined.set()


def _answers(address: str) -> bool:
  """Something accepts TCP connections at `host:port`."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
      return True
  except (OSError, ValueError):
    return False


def _setting(value, env_name: str) -> int | None:
  if value is not None:
    return int(value)
  text = os.environ.get(env_name)
  if text is None or not text.strip():
    return None
  try:
    return int(text)
  except ValueError:
    raise TorchOnTpuError(f"{env_name}={text!r} is not an integer; set it to a whole number.") from None
