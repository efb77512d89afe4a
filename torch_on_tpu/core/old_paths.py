"""The module paths from before the layout of 2026-11-27, kept working.

`torch_on_tpu.train` is now `torch_on_tpu.training.step`, `torch_on_tpu.checkpoint`
`torch_on_tpu.io.checkpoint`, and so on (`MOVED`). A user's `import torch_on_tpu.checkpoint`,
`from torch_on_tpu import lora`, `tot.export` and `python -m torch_on_tpu.launch` still work:
a finder on `sys.meta_path` (installed by `import torch_on_tpu`) answers an old path with the
module at its new one, the same object under both names (so a patch through either is seen by
both), and serves its code to `python -m`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

PACKAGE = "torch_on_tpu"

# Old path under torch_on_tpu → new path under torch_on_tpu (a package's submodules follow it).
MOVED = {
  "_compat": "core._compat", "torchax_import": "core.torchax_import", "extras": "core.extras",
  "stack": "core.stack", "storage": "core.storage",
  "lowerings": "lowering.aten", "op_table": "lowering.op_table", "device_checks": "lowering.device_checks",
  "refusals": "lowering.refusals", "autograd_functions": "lowering.autograd_functions", "host": "lowering.host",
  "remat": "lowering.remat", "ragged": "lowering.ragged", "float8": "lowering.float8",
  "xla_flags": "runtime.xla_flags", "distributed": "runtime.distributed", "health": "runtime.health",
  "fingerprint": "runtime.fingerprint", "launch": "runtime.launch", "doctor": "runtime.doctor",
  "mesh": "parallel.mesh", "sharding": "parallel.sharding", "pipeline": "parallel.pipeline",
  "collectives": "parallel.collectives",
  "module": "wrapper.module", "module_state": "wrapper.module_state", "materialize": "wrapper.materialize",
  "scan": "wrapper.scan", "ops": "wrapper.ops",
  "train": "training.step", "losses": "training.losses", "plan": "training.plan", "lora": "training.lora",
  "metrics": "training.metrics", "generation": "training.generation", "trainer": "training.trainer",
  "checkpoint": "io.checkpoint", "data": "io.data", "export": "io.export", "integrity": "io.integrity",
}


def new_name(name: str) -> str | None:
  """The module an old dotted path now names (`torch_on_tpu.checkpoint.preemption` →
  `torch_on_tpu.io.checkpoint.preemption`), or None for a path that did not move."""
  prefix, _, rest = name.partition(".")
  first, _, tail = rest.partition(".")
  if prefix != PACKAGE or first not in MOVED:
    return None
  return ".".join([PACKAGE, MOVED[first], *([tail] if tail else [])])


class _Alias(importlib.abc.Loader):
  """Loads an old path as the module at its new one."""

  def __init__(self, target: str):
    self.target = target

  def create_module(self, spec):
    module = importlib.import_module(self.target)
    self._spec = module.__spec__  # importlib sets the alias's spec on it; `exec_module` puts it back
    return module

  def exec_module(self, module) -> None:
    module.__spec__ = self._spec

  def get_code(self, fullname):
    """For `python -m <old path>`: the new module's code."""
    return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    new = new_name(fullname)
    if new is None:
      return None
    found = importlib.util.find_spec(new)
    if found is None:
      return None
    spec = importlib.util.spec_from_loader(fullname, _Alias(new), origin=found.origin,
                                           is_package=found.submodule_search_locations is not None)
    if found.submodule_search_locations is not None:
      spec.submodule_search_locations = list(found.submodule_search_locations)
    return spec


def install() -> None:
  """Puts the finder first on `sys.meta_path`, once (`import torch_on_tpu` calls it): first, so that
  a submodule under an old package path (`torch_on_tpu.checkpoint.training_state`) is the new
  module, not a second copy the path finder would load from the package's folder."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
