"""`PreemptionGuard`: a SIGTERM (a preempted VM, a scheduler's notice) becomes "save and stop
at the next step", agreed by every process."""

from __future__ import annotations

import logging
import signal

import jax
from jax.experimental import multihost_utils

from torch_on_tpu.core import _compat

torchax = _compat.import_torchax()

logger = logging.getLogger(__name__)


class PreemptionGuard:
  """SIGTERM / SIGINT become a request to stop after the current step.

  The loop asks `should_stop(step)` after each step; when it says so the loop
  saves and exits 0, and a relaunch resumes. A second signal stops the process
  at once, as the signal does by default (no traceback, no waiting for a compile
  or a step that holds the interpreter; checkpoints are written whole or not at
  all). On several processes no handler is installed: jax's
  preemption service catches SIGTERM and every process stops at the same step
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`); SIGINT
  then interrupts as usual.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.signals = tuple(signals)
    self.requested = False
    self.signal_name: str | None = None
    self._previous: dict = {}

  def __enter__(self):
    if jax.process_count() == 1:
      for sig in self.signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame):
    self.requested = True
    self.signal_name = signal.Signals(signum).name
    for sig in self.signals:  # the next one is the OS's: it ends the process even inside a compile
      signal.signal(sig, signal.SIG_DFL)
    logger.warning(
      "Got %s: finishing the current step, saving a checkpoint, then exiting "
      "(send it again to stop at once).",
      self.signal_name,
    )

  def should_stop(self, step: int) -> bool:
    """True once a stop was requested (on every process at the same `step`)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested
