"""`import torchtitan.models.qwen3_5` works without flash-linear-attention installed.

torchtitan's Qwen3.5 imports fla-core's Triton kernels at module level, and the bridge
replaces every one of them while a ShardedModule runs (`models.torchtitan.linear_attention`).
We do not install fla-core: wherever it is importable, transformers binds its kernels into
every Qwen3.5 and Qwen3-Next it loads, on CPU too, where they fail ("0 active drivers"), so an
export could not generate where the project is installed. `import torch_on_tpu` installs this
finder: when torchtitan's Qwen3.5 module loads and no real `fla` exists, the names it imports
are stand-ins for that import only (taken out of `sys.modules` afterwards, so nothing else ever
sees an `fla`); called in eager torch, a stand-in says what to do in one sentence.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

from torch_on_tpu.core import import_hooks

_MODULE = "torchtitan.models.qwen3_5.model"

# The fla modules torchtitan 0.3.0's Qwen3.5 imports at its top, and the names it takes from each.
_IMPORTED = {
  "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
  "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
  "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
  "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",),
}

MISSING = (
  "torchtitan's Qwen3.5 called flash-linear-attention's {name} in eager torch, and fla-core is not installed: "
  "run the model through tot.ShardedModule (which computes its Gated DeltaNet itself), or on a CUDA machine "
  "pip install fla-core==0.6.0."
)


def _kernel(name: str):
  def missing(*args, **kwargs):
    raise RuntimeError(MISSING.format(name=name))

  missing.__name__ = missing.__qualname__ = name
  return missing


def _autograd_function(name: str) -> type:
  import torch  # loaded by then: torchtitan imports it first

  def forward(ctx, *args, **kwargs):
    raise RuntimeError(MISSING.format(name=name))

  return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "__module__": __name__})


def _standin_modules() -> dict[str, types.ModuleType]:
  modules = {}
  for path, names in _IMPORTED.items():
    parts = path.split(".")
    for depth in range(1, len(parts) + 1):
      modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    for name in names:
      value = _autograd_function(name) if name[0].isupper() else _kernel(name)
      setattr(modules[path], name, value)
  for path, module in modules.items():  # packages: `from fla.ops.gated_delta_rule.chunk import ...`
    module.__path__ = []
    parent, _, child = path.rpartition(".")
    if parent:
      setattr(modules[parent], child, module)
  return modules


@contextlib.contextmanager
def _standins_present(_module):
  standins = {k: v for k, v in _standin_modules().items() if k not in sys.modules}
  sys.modules.update(standins)
  try:
    yield
  finally:
    for name, standin in standins.items():
      if sys.modules.get(name) is standin:
        del sys.modules[name]


def _fla_absent() -> bool:
  return "fla" not in sys.modules and importlib.machinery.PathFinder.find_spec("fla") is None


def install() -> None:
  """Puts the finder first on `sys.meta_path` (once)."""
  import_hooks.install(import_hooks.ImportInside(_MODULE, _standins_present, _fla_absent))
