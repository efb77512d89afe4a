"""Sharding maps: glob patterns over parameter names → partition specs.

A map is a dict `{pattern: spec}`:

* a *spec* is a tuple with one entry per tensor dim: a mesh axis name, `None`
  (replicated), or a tuple of axis names (`("fsdp", "tp")`);
* a *pattern* is matched against the full dotted name. `*` matches one name
  component (a layer index: `layers.*.attention.wo.weight`), `**` matches any
  number of components (`**.bias`). Patterns match the names `named_parameters()`
  and `named_buffers()` report (the state_dict keys, for almost every model).
* **Precedence:** when several patterns match a name, the most specific wins:
  the one with the most literal (non-wildcard) characters; a tie goes to the
  entry written first.
* An entry whose pattern matches no parameter or buffer but matches a module
  name is an *activation rule*: that module's output (the first element when it
  returns a tuple) is constrained to the spec with `with_sharding_constraint`,
  e.g. `{"layers.*": ("fsdp", None, None)}` pins the hidden state between blocks.

Parameters no pattern covers are replicated and listed once (a `strict=True`
resolution makes that an error). Presets: `"fsdp"` (each parameter's largest dim over the
parameter axes; for a linear its model family knows, the dim of the model's hidden size, as
MaxText shards its `embed` axis: the gathers and gradient reductions then run as the TPU
compiler's collective matmuls without relayouts), `"replicated"`, `"ep"`
(expert parallel: the leading expert dim of every stacked expert tensor, a
parameter under a module named `experts` or those the model's family names,
over the `ep` mesh axis, or over `fsdp` where the mesh has no `ep`; everything
else as `"fsdp"`), and the
FSDP+TP maps for known model families (`"fsdp_tp"`, see `torch_on_tpu.models`).
In a glob map the same is `{"**.experts.*": ("ep", None, None)}`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.parallel import mesh as mesh_lib

logger = logging.getLogger(__name__)

# "fsdp" preset: tensors with fewer elements than this are replicated; sharding
# them saves less memory than the all-gather costs in latency.
FSDP_MIN_ELEMENTS = 2**14

Spec = tuple  # entries: str | None | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """What resolution needs to know about one parameter or buffer."""

  name: str
  shape: tuple[int, ...]
  is_param: bool = True
  fsdp_dim: int | None = None  # the dim the fsdp presets split where it divides (its family's choice)


@dataclasses.dataclass
class Resolved:
  """The outcome of resolving a map against a model and a mesh."""

  specs: dict[str, PartitionSpec]  # every parameter and buffer name
  activations: dict[str, PartitionSpec]  # activation rules: module pattern → spec
  uncovered: list[str]  # parameter names no pattern covered (replicated)

  def shardings(self, mesh: Mesh) -> dict[str, NamedSharding]:
    return {name: NamedSharding(mesh, spec) for name, spec in self.specs.items()}


def compile_pattern(pattern: str) -> re.Pattern:
  """`*` → one dotted component, `**` → any number of components."""
  out = []
  i = 0
  while i < len(pattern):
    if pattern.startswith("**", i):
      out.append(".*")
      i += 2
    elif pattern[i] == "*":
      out.append("[^.]*")
      i += 1
    elif pattern[i] == "?":
      out.append("[^.]")
      i += 1
    else:
      out.append(re.escape(pattern[i]))
      i += 1
  return re.compile("".join(out) + r"\Z")


def specificity(pattern: str) -> int:
  return len(pattern.replace("*", "").replace("?", ""))


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _fmt_spec(spec) -> str:
  return "(" + ", ".join(repr(e) for e in spec) + ("," if len(spec) == 1 else "") + ")"


def _fmt_mesh(mesh: Mesh) -> str:
  return "mesh(" + ", ".join(f"{a}={n}" for a, n in mesh.shape.items()) + ")"


def check_spec(name: str, shape: Sequence[int], spec, mesh: Mesh) -> PartitionSpec:
  """Validates one spec for one tensor; raises a one-sentence error naming both."""
  spec = tuple(spec)
  where = f"parameter '{name}' of shape {tuple(shape)} with spec {_fmt_spec(spec)} on {_fmt_mesh(mesh)}"
  if len(spec) != len(shape):
    raise TorchOnTpuError(
      f"Sharding {where}: the spec has {len(spec)} entries but the tensor has {len(shape)} dims; "
      f"give one entry (axis name, tuple of axes, or None) per dim."
    )
  used = []
  for dim, (size, entry) in enumerate(zip(shape, spec)):
    axes = _axes_of(entry)
    for axis in axes:
      if axis not in mesh.shape:
        raise TorchOnTpuError(
          f"Sharding {where}: the mesh has no axis '{axis}' (it has {list(mesh.axis_names)}); "
          f"rename the axis in the map or add it to make_mesh."
        )
      if axis in used:
        raise TorchOnTpuError(
          f"Sharding {where}: axis '{axis}' is used on two dims; each mesh axis may shard one dim."
        )
      used.append(axis)
    ways = math.prod(mesh.shape[a] for a in axes)
    if ways > 1 and size % ways:
      raise TorchOnTpuError(
        f"Sharding {where}: dim {dim} has size {size}, which {'×'.join(axes)}={ways} does not divide; "
        f"shard another dim, replicate it (None), or change the mesh."
      )
  return PartitionSpec(*spec)


def fsdp_spec(shape: Sequence[int], mesh: Mesh, axes: Sequence[str] | None = None, prefer: int | None = None) -> tuple:
  """The "fsdp" preset for one tensor: the dim `prefer` if the parameter axes (`mesh.param_axes`:
  `fsdp` and `cp`, or the given `axes`) divide it, else its largest dim they divide, else replicated."""
  axes = mesh_lib.param_axes(mesh) if axes is None else tuple(axes)
  ways = math.prod(mesh.shape[a] for a in axes)
  spec = [None] * len(shape)
  if ways == 1 or math.prod(shape) < FSDP_MIN_ELEMENTS:
    return tuple(spec)
  candidates = [d for d, n in enumerate(shape) if n % ways == 0]
  if candidates:
    best = prefer if prefer in candidates else max(candidates, key=lambda d: (shape[d], -d))
    spec[best] = axes[0] if len(axes) == 1 else axes
  return tuple(spec)


def with_param_axes(table: Mapping[str, Spec], mesh: Mesh) -> dict:
  """A family's map with each `"fsdp"` entry widened to all the parameter axes
  (`("fsdp", "cp")` on a mesh with a `cp` axis; `"cp"` alone without `fsdp`)."""
  axes = mesh_lib.param_axes(mesh)
  if axes in ((), ("fsdp",)):
    return dict(table)
  wide = axes[0] if len(axes) == 1 else axes

  def widen(entry):
    if entry == "fsdp":
      return wide
    if isinstance(entry, tuple) and "fsdp" in entry:
      return tuple(a for e in entry for a in (axes if e == "fsdp" else (e,)))
    return entry

  return {pattern: tuple(widen(e) for e in spec) for pattern, spec in table.items()}


def resolve(
  sharding_map: Mapping[str, Spec] | str,
  tensors: Sequence[TensorInfo],
  module_names: Sequence[str],
  mesh: Mesh,
  *,
  strict: bool = False,
  experts: Sequence[str] | None = None,
) -> Resolved:
  """Resolves a map (or preset name) for every tensor; one clear error on any mistake.
  `experts` names the tensors the "ep" and "fsdp" presets shard on their expert dim (the model
  family's answer), instead of the generic rule."""
  if isinstance(sharding_map, str):
    return _resolve_preset(sharding_map, tensors, mesh, experts)
  tensors = list(tensors)
  rules = [(p, compile_pattern(p), tuple(s)) for p, s in sharding_map.items()]
  tensor_names = [t.name for t in tensors]

  matched_tensor = {p: False for p, _, _ in rules}
  specs: dict[str, PartitionSpec] = {}
  uncovered = []
  for t in tensors:
    hits = [(p, s) for p, rx, s in rules if rx.match(t.name)]
    for p, _ in hits:
      matched_tensor[p] = True
    if not hits:
      specs[t.name] = PartitionSpec(*([None] * len(t.shape)))
      if t.is_param:
        uncovered.append(t.name)
      continue
    best = max(hits, key=lambda h: specificity(h[0]))  # max keeps the first of equals
    specs[t.name] = check_spec(t.name, t.shape, best[1], mesh)

  activations = {}
  for p, rx, s in rules:
    if matched_tensor[p]:
      continue
    modules = [m for m in module_names if rx.match(m)]
    if not modules:
      near = difflib.get_close_matches(p, tensor_names + list(module_names), n=3, cutoff=0.5)
      hint = f" Near misses: {near}." if near else ""
      raise TorchOnTpuError(
        f"Sharding pattern '{p}' (spec {_fmt_spec(s)}) matches no parameter, buffer or module "
        f"of the model on {_fmt_mesh(mesh)}; fix the name ('*' stands for one name component).{hint}"
      )
    for axis in (a for e in s for a in _axes_of(e)):
      if axis not in mesh.shape:
        raise TorchOnTpuError(
          f"Activation rule '{p}' with spec {_fmt_spec(s)}: the mesh has no axis '{axis}' "
          f"(it has {list(mesh.axis_names)}); rename the axis or add it to make_mesh."
        )
    activations[p] = PartitionSpec(*s)

  if uncovered:
    if strict:
      raise TorchOnTpuError(
        f"Sharding map (strict) covers no pattern for {len(uncovered)} parameters, first "
        f"'{uncovered[0]}'; add patterns for them or drop strict=True to replicate them."
      )
    logger.warning(
      "Sharding map covers no pattern for %d parameters; they are replicated: %s",
      len(uncovered),
      ", ".join(uncovered),
    )
  return Resolved(specs=specs, activations=activations, uncovered=uncovered)


def _resolve_preset(name: str, tensors: Sequence[TensorInfo], mesh: Mesh, experts=None) -> Resolved:
  if name == "replicated":
    specs = {t.name: PartitionSpec(*([None] * len(t.shape))) for t in tensors}
  elif name == "fsdp":
    if not mesh_lib.param_axes(mesh):
      raise TorchOnTpuError(
        f"The 'fsdp' sharding preset needs an 'fsdp' mesh axis (or 'cp', whose devices shard parameters too) but "
        f"the mesh is {_fmt_mesh(mesh)}; "
        f"build it with make_mesh(fsdp=-1) or pass a sharding map."
      )
    experts = None if experts is None else set(experts)
    specs = {
      t.name: PartitionSpec(*(fsdp_spec(t.shape, mesh, prefer=_fsdp_dim(t, experts)) if t.is_param else [None] * len(t.shape)))
      for t in tensors
    }
  elif name == "ep":
    experts = None if experts is None else set(experts)
    specs = {t.name: _expert_parallel_spec(t, mesh, experts) for t in tensors}
  else:
    raise TorchOnTpuError(
      f"Unknown sharding preset '{name}'; use 'fsdp', 'replicated', 'ep', 'fsdp_tp' (known model "
      f"families) or a dict {{pattern: spec}}."
    )
  return Resolved(specs=specs, activations={}, uncovered=[])


def _fsdp_dim(t: TensorInfo, experts: set | None) -> int | None:
  """The dim the "fsdp" preset prefers: a stacked expert tensor [experts, ...] its expert dim, so
  each device holds whole experts and the gather concatenates on the major dim, landing in the
  layout the grouped-matmul kernels read (split on its minor dim, XLA:TPU gathers it transposed
  and copies it: Qwen3-30B-A3B on v5p-64, 2 × 77 GB a step); any other its family's choice."""
  return 0 if len(t.shape) >= 3 and is_expert(t.name, t.shape, experts) else t.fsdp_dim


def is_expert(name: str, shape, experts: set | None = None) -> bool:
  """Whether the "ep" preset splits this tensor on its expert dim: one the model's family names
  (`experts`), or by the generic rule a tensor of 2+ dims under a module named `experts`."""
  if experts is not None:
    return name in experts
  return "experts" in name.split(".")[:-1] and len(shape) >= 2


def with_experts(table: Mapping[str, Spec], tensors: Sequence[TensorInfo], mesh: Mesh, experts=None) -> dict:
  """A family's map (`"fsdp_tp"`) on a mesh with an `ep` axis: its expert tensors stored as the
  "ep" preset stores them (`expert_spec`), by exact name so they win over the map's patterns."""
  if "ep" not in mesh.shape:
    return dict(table)
  experts = None if experts is None else set(experts)
  return {**table, **{t.name: expert_spec(t.shape, mesh) for t in tensors if t.is_param and is_expert(t.name, t.shape, experts)}}


def _expert_parallel_spec(t: TensorInfo, mesh: Mesh, experts: set | None = None) -> PartitionSpec:
  """The "ep" preset for one tensor: an expert weight as `expert_spec`; any other parameter
  split over the parameter axes (`ep` among them: its devices hold different data, so the dense
  weights shard over them as over `fsdp`, their gradients reduce-scattered over every data
  device, not all-reduced across `ep`)."""
  if "ep" not in mesh.shape and "fsdp" not in mesh.shape:
    raise TorchOnTpuError(
      f"The 'ep' sharding preset needs an 'ep' (or 'fsdp') mesh axis but the mesh is {_fmt_mesh(mesh)}; "
      f"build it with make_mesh(ep=..., fsdp=...)."
    )
  if is_expert(t.name, t.shape, experts):
    return check_spec(t.name, t.shape, expert_spec(t.shape, mesh), mesh)
  axes = mesh_lib.param_axes(mesh)
  return PartitionSpec(*(fsdp_spec(t.shape, mesh, axes, prefer=t.fsdp_dim) if t.is_param and axes else (None,) * len(t.shape)))


def expert_spec(shape: Sequence[int], mesh: Mesh) -> tuple:
  """How the "ep" preset stores an expert tensor [experts, ...]: the experts over the
  expert-parallel group (`mesh.expert_axes`: `ep`, `cp`, `tp`), the other dims
  FSDP-style over the remaining parameter axes; on a mesh without `ep`, the experts over `fsdp`."""
  group = mesh_lib.expert_axes(mesh)
  if "ep" not in mesh.shape:
    return ("fsdp",) + (None,) * (len(shape) - 1)
  rest = tuple(a for a in mesh_lib.param_axes(mesh) if a not in group)
  inner = fsdp_spec(shape[1:], mesh, rest) if rest else (None,) * (len(shape) - 1)
  lead = None if not group else group[0] if len(group) == 1 else group
  return (lead, *inner)
