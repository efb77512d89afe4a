"""Multi-host start-up: one process per host, joined through `jax.distributed`.

On a TPU pod slice (and under Slurm / Open MPI) jax finds the other hosts by
itself. Elsewhere the run is described by environment variables, which
`python -m torch_on_tpu.launch` sets for local multi-process runs:

    TOT_COORDINATOR      host:port of process 0's coordinator (JAX_COORDINATOR_ADDRESS also works)
    TOT_NUM_PROCESSES    how many processes take part
    TOT_PROCESS_ID       this process's index, 0..TOT_NUM_PROCESSES-1
    TOT_HEARTBEAT_TIMEOUT  seconds without a heartbeat before a process counts as dead (default 20)

jax must join the others before it starts its backend, so the platform
start-up (`runtime.setup()`, run on first use of the bridge) joins when the
environment describes a multi-process run; calling `initialize_distributed()`
afterwards is then a no-op that reports the run. A single process with nothing
configured stays alone.

When a process dies the others must not hang in a collective: process 0's
coordinator marks a process dead after `TOT_HEARTBEAT_TIMEOUT` seconds without a
heartbeat and every other process then aborts with "the JAX distributed
service detected fatal errors ... another task died"; if process 0 itself dies,
the others' CPU collectives fail at once ("Connection closed by peer").
"""

from __future__ import annotations

import logging
import os

import jax

from torch_on_tpu import _compat
from torch_on_tpu.errors import TorchOnTpuError

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "TOT_COORDINATOR"
ENV_NUM_PROCESSES = "TOT_NUM_PROCESSES"
ENV_PROCESS_ID = "TOT_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "TOT_HEARTBEAT_TIMEOUT"
JAX_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # read by jax.distributed itself too

HEARTBEAT_TIMEOUT_SECONDS = 20  # jax's default of 100 s would leave survivors hanging for minutes
INIT_TIMEOUT_SECONDS = 300  # pod hosts boot minutes apart
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
    initialization_timeout=INIT_TIMEOUT_SECONDS,
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
  jax.distributed.initialize(**kwargs)


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
