"""Messages of our dependencies that tell a user of the bridge nothing, silenced where they arise:
each by the module that emits it and its text, never a whole logger or warning category."""

from __future__ import annotations

import logging

# logger → texts its records start with: torchax says an init's `param.data.uniform_()` copies
LOG_RECORDS = {
  "torchax.tensor": ("In-place to .data modifications still results a copy",),
  # torchao (float8) on import: its optional CUDA extensions (MXFP8, CUTLASS sm90a) have no CPU build
  "torchao": ("Failed to load ",),
  # torch on torchao's import: its Enum configs registered as pytree constants, a deprecation for torchao
  "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}


class _DropRecords(logging.Filter):
  def __init__(self, prefixes):
    super().__init__()
    self.prefixes = tuple(prefixes)

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(self.prefixes)


def silence() -> None:
  """Installs the filters (once per process: a filter added twice is one filter)."""
  for name, prefixes in LOG_RECORDS.items():
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropRecords) for f in logger.filters):
      logger.addFilter(_DropRecords(prefixes))
