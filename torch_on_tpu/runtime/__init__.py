"""A process's start-up and the run's processes: `setup()` (XLA flags, the multi-process join,
the lowerings), the join itself, the processes watching each other (health), code and config
fingerprints, the local launcher and `doctor`."""

from torch_on_tpu.runtime.startup import setup, started

__all__ = ["setup", "started"]
