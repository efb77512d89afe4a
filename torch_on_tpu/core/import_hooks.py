"""One module's own import, run inside a context: the finder `core.torchax_import` and
`core.fla_standins` put on `sys.meta_path`. It imports nothing and does nothing until that
module is imported, then runs the module's own loader with the context active."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager


class _LoaderInside(importlib.abc.Loader):
  """The module's own loader, its `exec_module` run inside `around(module)`."""

  def __init__(self, loader, around):
    self._loader, self._around = loader, around

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    with self._around(module):
      self._loader.exec_module(module)

  def __getattr__(self, name):  # resource readers, get_source, ...: the module's own loader's
    return getattr(self._loader, name)


class ImportInside(importlib.abc.MetaPathFinder):
  """Finds `name` as Python would and loads it inside `around(module)`, while `wanted()`."""

  def __init__(self, name: str, around: Callable[[object], AbstractContextManager],
               wanted: Callable[[], bool] = lambda: True):
    self.name, self._around, self._wanted = name, around, wanted

  def find_spec(self, name, path=None, target=None):
    if name != self.name or not self._wanted():
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _LoaderInside(spec.loader, self._around)
    return spec


def install(finder: ImportInside) -> None:
  """Puts `finder` first on `sys.meta_path`, once per module name."""
  if not any(isinstance(f, ImportInside) and f.name == finder.name for f in sys.meta_path):
    sys.meta_path.insert(0, finder)
