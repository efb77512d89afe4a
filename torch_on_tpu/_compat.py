"""Version shims for torch / torchax / jax, each gated on the versions it fixes.

Every shim here must be a no-op on a stack that does not need it, and must be
applied before the library it patches is first imported. `import torch_on_tpu`
applies them; nothing else in the package imports `torchax` before this module.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re

import torch

# torchax releases up to and including this one name the named-tensor (Dimname)
# ATen overloads at import time; torch 2.13 removed those overloads.
_LAST_TORCHAX_NAMING_DIMNAME_OVERLOADS = (0, 0, 13)


def _version_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def torch_has_dimname_overloads() -> bool:
  """True where torch still registers the named-tensor ATen overloads."""
  return hasattr(torch.ops.aten.prod, "dim_Dimname")


def dimname_shim_needed() -> bool:
  """The torchax import failure on torch>=2.13 applies to this stack."""
  try:
    torchax_version = _version_tuple(importlib.metadata.version("torchax"))
  except importlib.metadata.PackageNotFoundError:
    return False
  return (
    not torch_has_dimname_overloads()
    and torchax_version <= _LAST_TORCHAX_NAMING_DIMNAME_OVERLOADS
  )


class _RemovedOverload:
  """Stands in for an ATen overload torch no longer has.

  torchax only uses these names as keys of its autocast table and as entries of
  the list it hands to `torch._decomp.get_decompositions`; a stand-in that is
  not a `torch._ops.OperatorBase` is never dispatched to and is ignored there.
  """

  def __init__(self, qualified_name: str):
    self.qualified_name = qualified_name

  def __repr__(self) -> str:
    return f"<removed overload {self.qualified_name}>"


def is_named_tensor_overload(overload_name: str) -> bool:
  """ATen names its named-tensor overloads `*Dimname*` or `*names*`
  (`prod.dim_Dimname`, `std.correction_names`, `norm.names_ScalarOpt_dim`)."""
  return "dimname" in overload_name.lower() or "names" in overload_name.split("_")


@contextlib.contextmanager
def _tolerate_removed_dimname_overloads():
  """While active, `torch.ops.aten.<op>.<...Dimname...>` of a removed overload
  resolves to a `_RemovedOverload` instead of raising AttributeError."""
  packet_cls = torch._ops.OpOverloadPacket
  original_getattr = packet_cls.__getattr__

  def getattr_with_fallback(self, key):
    try:
      return original_getattr(self, key)
    except AttributeError:
      if not is_named_tensor_overload(key):
        raise
      return _RemovedOverload(f"{self._qualified_op_name}.{key}")

  packet_cls.__getattr__ = getattr_with_fallback
  try:
    yield
  finally:
    packet_cls.__getattr__ = original_getattr


# Entry points that must start without torchax or jax: the doctor diagnoses a
# broken install, the launcher only starts the processes that do the work.
_LIGHT_ENTRY_POINTS = ("torch_on_tpu.doctor", "torch_on_tpu.launch")


def started_as_light_tool() -> bool:
  """True when this process is `python [options] -m` one of `_LIGHT_ENTRY_POINTS`."""
  import sys

  argv = getattr(sys, "orig_argv", [])
  for i, arg in enumerate(argv[1:-1], 1):
    if arg == "-m":
      return argv[i + 1] in _LIGHT_ENTRY_POINTS
    if not arg.startswith("-"):
      return False
  return False


def import_torchvision_outside_torchax() -> None:
  """Imports torchvision now, where it is installed and not yet imported.

  torchvision's first import checks its CUDA build by calling one of its own torch
  ops. If that first import happens lazily inside a traced step (seen on the CUDA
  image with torch 2.11), torchax's mode receives the op, has no lowering for it,
  and the trace fails with `OperatorNotFound: torchvision::_cuda_version`.
  """
  import importlib.util
  import sys

  if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
    return
  try:
    import torchvision  # noqa: F401
  except Exception:  # noqa: BLE001 (a broken torchvision is for whoever uses it to report)
    pass


def import_torchax():
  """Imports torchax, applying the shims this stack needs first."""
  import sys

  if "torchax" in sys.modules:
    return sys.modules["torchax"]
  import_torchvision_outside_torchax()
  shim = _tolerate_removed_dimname_overloads if dimname_shim_needed() else contextlib.nullcontext
  with shim():
    import torchax
    # Loaded lazily by torchax's Environment; both name Dimname overloads.
    import torchax.amp
    import torchax.decompositions  # noqa: F401
  return torchax
