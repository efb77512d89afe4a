"""`import torchax` works in a process that imported torch_on_tpu, before or after `tot.setup()`.

torchax 0.0.13 fails to import under torch 2.13 unless `_compat`'s shims are
active while its modules load (they name removed named-tensor overloads). A
user who mixes torchax's own API with ours imports it themselves, so
`import torch_on_tpu` installs this finder: it imports nothing and does
nothing until torchax is imported, then runs torchax's own loader under
`_compat.torchax_import_shims()` and finishes with `_compat.after_torchax_import`.
"""

from __future__ import annotations

import contextlib

from torch_on_tpu.core import import_hooks


@contextlib.contextmanager
def _shimmed(torchax):
  from torch_on_tpu.core import _compat

  with _compat.torchax_import_shims():
    yield
    _compat.after_torchax_import(torchax)


def install() -> None:
  """Puts the finder first on `sys.meta_path` (once)."""
  import_hooks.install(import_hooks.ImportInside("torchax", _shimmed))
