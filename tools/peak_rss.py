"""Peak resident memory of this process, sampled in a thread: the memory benchmarks' meter."""

from __future__ import annotations

import threading
import time


def rss() -> int:
  import psutil

  return psutil.Process().memory_info().rss


class PeakRss:
  """Samples this process's RSS every `interval` seconds; `.peak` is the maximum seen."""

  def __init__(self, interval=0.005):
    self.interval = interval
    self.peak = rss()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, rss())
      time.sleep(self.interval)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, rss())
