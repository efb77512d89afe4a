"""`import torchax` works in a process that imported torch_on_tpu, before or after `tot.setup()`.

torchax 0.0.13 fails to import under torch 2.13 unless `_compat`'s shims are
active while its modules load (they name removed named-tensor overloads). A
user who mixes torchax's own API with ours imports it themselves, so
`import torch_on_tpu` installs this finder: it imports nothing and does
nothing until torchax is imported, then runs torchax's own loader under
`_compat.torchax_import_shims()` and finishes with `_compat.after_torchax_import`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _ShimmedLoader(importlib.abc.Loader):
  """torchax's own loader, run with the shims active."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    from torch_on_tpu.core import _compat

    with _compat.torchax_import_shims():
      self._loader.exec_module(module)
      _compat.after_torchax_import(module)

  def __getattr__(self, name):  # resource readers, get_source, ...: torchax's loader's own
    return getattr(self._loader, name)


class _TorchaxFinder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name != "torchax":
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _ShimmedLoader(spec.loader)
    return spec


def install() -> None:
  """Puts the finder first on `sys.meta_path` (once)."""
  if not any(isinstance(f, _TorchaxFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchaxFinder())
