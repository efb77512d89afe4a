"""Meta-device torch modules → sharded `jax.Array`s, never a full copy on one host.

A model built under `torch.device("meta")` has shapes but no storage. We run the
model's *own* initialisation (its family's, `Family.init_fn`: torchtitan's
`init_states`, HF's `initialize_weights`; else every module's `reset_parameters`) on torchax tensors, traced once and run
as jits (one per kind of tensor, `_run_shared`) whose `out_shardings` are the
resolved parameter shardings: XLA generates each
shard on the device that owns it, so a parameter is born sharded and no host
ever holds the whole model. The same traced program under `jax.eval_shape`
gives abstract arrays (shapes, dtypes, shardings) with nothing allocated.

An already initialised CPU model is uploaded one tensor at a time, each device
reading only its own slice.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding

from torch_on_tpu import models
from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.lowering import host
from torch_on_tpu.wrapper import module_state

# jax has no public dead-code elimination for jaxprs; this one is stable across
# the 0.x releases we support (pinned in constraints.txt).

torchax = _compat.import_torchax()
from torchax.ops import mappings  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402

logger = logging.getLogger(__name__)

# Global bytes of outputs one chunk of tensors made their own way produces (see `_run_shared`):
# the floor, and all of it where devices do not report their memory (CPU, whose
# "device memory" is the host RAM the materialisation benchmark holds to 1.15x).
INIT_CHUNK_BYTES = 256 * 2**20
# On accelerators a chunk's outputs may take this share of each device's memory
# (its temporaries about three times that). Each chunk is one compile, and GPU
# compiles are slow: a 1B model in 256 MiB chunks took 165 s to initialise on an H100.
INIT_CHUNK_DEVICE_SHARE = 1 / 16
# Values of at most this many elements that depend only on the seed (the random
# keys) are computed before the tensors, and passed to them as inputs.
_SMALL_ELEMENTS = 16


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """One distinct tensor of a module: its canonical name and every alias (ties)."""

  name: str
  shape: tuple[int, ...]
  dtype: torch.dtype
  is_param: bool
  persistent: bool = True  # buffers only: part of state_dict
  aliases: tuple[str, ...] = ()


def inventory(module: torch.nn.Module) -> list[TensorEntry]:
  """Every distinct parameter and buffer, tied names grouped under the first name."""
  entries: dict[int, dict] = {}
  order: list[int] = []

  def add(name, t, is_param, persistent):
    key = id(t)
    if key in entries:
      entries[key]["aliases"].append(name)
      return
    order.append(key)
    entries[key] = dict(
      name=name,
      shape=tuple(t.shape),
      dtype=t.dtype,
      is_param=is_param,
      persistent=persistent,
      aliases=[],
    )

  for name, p in module.named_parameters(remove_duplicate=False):
    add(name, p, True, True)
  for mod_name, mod in module.named_modules(remove_duplicate=False):
    for buf_name, b in _compat.module_tensor_dicts(mod)[1].items():
      if b is None:
        continue
      full = f"{mod_name}.{buf_name}" if mod_name else buf_name
      add(full, b, False, buf_name not in _compat.non_persistent_buffers(mod))
  return [TensorEntry(**{**entries[k], "aliases": tuple(entries[k]["aliases"])}) for k in order]


def is_meta(module: torch.nn.Module) -> bool:
  """True when every tensor is on meta; raises when meta and real tensors mix."""
  devices = {t.device.type for _, t in module_state.named_tensors(module)}
  if devices == {"meta"}:
    return True
  if "meta" in devices:
    meta = [n for n, t in module_state.named_tensors(module) if t.device.type == "meta"]
    real = [n for n, t in module_state.named_tensors(module) if t.device.type != "meta"]
    raise TorchOnTpuError(
      f"The model mixes meta tensors ('{meta[0]}') with real ones ('{real[0]}'); build it "
      f"entirely under torch.device('meta') or entirely initialised on CPU."
    )
  return False


def reset_parameters_everywhere(module: torch.nn.Module) -> None:
  for sub in module.modules():
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
      reset()


def materialize(
  module: torch.nn.Module,
  entries: list[TensorEntry],
  out_shardings: Mapping[str, NamedSharding],
  *,
  seed: int = 0,
  init_fn: Callable[[torch.nn.Module], None] | None = None,
  stacks: Mapping[str, Sequence[str]] | None = None,
  abstract: bool = False,
) -> dict[str, jax.Array]:
  """Runs the init of a meta `module` sharded on the devices; returns name → array.

  `stacks` (scan stacking) names arrays the caller stores as its members
  stacked on a new leading axis, in place of the members; `out_shardings` is
  keyed by the stored names. With `abstract=True` nothing is computed: arrays
  are `jax.ShapeDtypeStruct`s.
  """
  init_fn = init_fn or models.family_of(module).init_fn(module) or reset_parameters_everywhere
  stacks = dict(stacks or {})
  env = torchax.default_env()
  untouched: list[str] = []

  def program(key):
    arrays = {}
    with env, env.override_property(prng=key), _traceable_trunc_normal(), _installed(
      module, entries, arrays, untouched
    ):
      with torch.no_grad():
        init_fn(module)
    return arrays

  key = jax.random.key(seed)
  if abstract:
    out = jax.eval_shape(lambda k: stack(program(k), stacks), key)
  else:
    out = _run_shared(program, key, out_shardings, stacks)
  if untouched:
    logger.warning(
      "The model's init left %d tensors unwritten (they are zeros): %s. Pass init_fn= "
      "or give those modules a reset_parameters().",
      len(untouched),
      ", ".join(untouched),
    )
  if abstract:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=out_shardings[k]) for k, v in out.items()}
  return out


def stack(arrays: dict, stacks: Mapping[str, Sequence[str]]) -> dict:
  """Canonical per-tensor dict → stored dict, each stack's members stacked on a new leading axis."""
  members = {m for group in stacks.values() for m in group}
  out = {k: v for k, v in arrays.items() if k not in members}
  for name, group in stacks.items():
    out[name] = jnp.stack([arrays[m] for m in group])
  return out


def stack_placed(arrays: dict, stacks: Mapping[str, Sequence[str]], shardings: Mapping[str, NamedSharding]) -> dict:
  """`stack` for arrays already on the devices, one stacked tensor at a time, each stack's
  members freed once it is made: the peak holds one stacked tensor beyond the model, not a
  second copy of every layer."""
  members = {m for group in stacks.values() for m in group}
  out = {k: v for k, v in arrays.items() if k not in members}
  for name, group in stacks.items():
    out[name] = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=shardings[name])(*(arrays[m] for m in group))
    for m in group:
      arrays[m].delete()
  return out


def chunk_budget(shardings) -> int:
  """Global output bytes per init jit for arrays placed by `shardings`: a share of
  the smallest device memory times the device count on accelerators that report
  it, `INIT_CHUNK_BYTES` otherwise (and at least that)."""
  devices = {d for s in shardings for d in s.device_set}
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices if d.platform != "cpu"]
  if not devices or len(limits) < len(devices) or None in limits:
    return INIT_CHUNK_BYTES
  return max(INIT_CHUNK_BYTES, int(min(limits) * INIT_CHUNK_DEVICE_SHARE) * len(devices))


@dataclasses.dataclass
class _Piece:
  """The part of the traced init that makes one tensor, as a function of its inputs.

  `signature` is the function's text with every literal lifted to an input, so
  tensors made alike (each layer's `wq`, whatever its std) share it and one
  compiled program; `args` are this tensor's inputs. None where the text is not
  a faithful identity (numpy abbreviates long arrays with '...').
  """

  fn: Callable
  args: list
  signature: str | None


def _run_shared(program, key, out_shardings, stacks) -> dict[str, jax.Array]:
  """Runs the traced init with one compile per distinct way a tensor is made, not per tensor.

  The program is traced once. The small values that depend only on the seed
  (the chain of random keys) are computed first, in one jit; every tensor's
  slice of the program then takes them as inputs, so tensors made alike (the
  same init in every layer) are the same function: one compiled program
  serves them all, a stack of them runs as one `lax.map` over its members'
  inputs, and the compile count is flat in depth. Tensors made their own way
  run in chunks of at most `chunk_budget` output bytes, largest first. One
  tensor's (or chunk's) random-number temporaries exist at a time, so peak
  memory stays near the model itself; values are those of the whole program.
  """
  closed, shapes = jax.make_jaxpr(program, return_shape=True)(key)
  replicated = NamedSharding(next(iter(out_shardings.values())).mesh, jax.sharding.PartitionSpec())
  main, inputs = _hoist_seed_values(closed, key, replicated)
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  index = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
  pieces = {name: _piece(main, inputs, i) for name, i in index.items()}
  groups = {name: list(stacks.get(name, [name])) for name in out_shardings}
  signature = {}  # stored name → what its compiled program is keyed by, if shared
  for name, group in groups.items():
    sigs = {pieces[m].signature for m in group}
    if len(sigs) == 1 and None not in sigs:
      signature[name] = (name in stacks, sigs.pop(), out_shardings[name])
  uses = collections.Counter(signature.values())
  shared = [n for n in out_shardings if n in signature and (n in stacks or uses[signature[n]] > 1)]
  own = [n for n in out_shardings if n not in shared]
  member_bytes = {n: _nbytes(shapes[groups[n][0]]) for n in out_shardings}
  nbytes = {n: member_bytes[n] * len(groups[n]) for n in own}
  chunks = list(_chunks(sorted(own, key=lambda n: -nbytes[n]), nbytes, chunk_budget(out_shardings.values())))
  # Largest tensors first, one program at a time: the random-number temporaries
  # (about 3x a tensor) then exist while little of the model does.
  units = [(max(member_bytes[n] for n in c), c) for c in chunks] + [(member_bytes[n], n) for n in shared]
  out, compiled = {}, {}
  for _, unit in sorted(units, key=lambda u: -u[0]):
    if isinstance(unit, list):
      out.update(_run_chunk({n: [pieces[m] for m in groups[n]] for n in unit}, out_shardings, stacks))
      jax.block_until_ready([out[n] for n in unit])
      continue
    first = pieces[groups[unit][0]]
    if signature[unit] not in compiled:
      make = _mapped(first.fn, out_shardings[unit]) if unit in stacks else first.fn
      compiled[signature[unit]] = jax.jit(make, out_shardings=[out_shardings[unit]])
    args = first.args
    if unit in stacks:
      args = [_stack_args([pieces[m].args[j] for m in groups[unit]]) for j in range(len(first.args))]
    (out[unit],) = jax.block_until_ready(compiled[signature[unit]](*args))
  logger.info(
    "init: %d arrays from %d compiled programs (%d shared by %d arrays, %d chunks)",
    len(out), 1 + len(compiled) + len(chunks), len(compiled), len(shared), len(chunks),
  )
  return {name: out[name] for name in out_shardings}


def _nbytes(aval) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize


def _hoist_seed_values(closed, key, sharding):
  """Splits off the equations that make small values from the seed alone (the key chain).

  Returns the rest of the program as a jaxpr whose inputs are those values and
  the program's constants, and the inputs, computed (replicated) by one jit.
  """
  jaxpr = closed.jaxpr
  seed_vars = set(jaxpr.invars)
  hoisted, rest = [], []
  for eqn in jaxpr.eqns:
    small = all(_is_small(v.aval) for v in eqn.outvars)
    from_seed = all(isinstance(v, jex.Literal) or v in seed_vars for v in eqn.invars)
    if small and from_seed and not eqn.effects:
      hoisted.append(eqn)
      seed_vars.update(eqn.outvars)
    else:
      rest.append(eqn)
  needed = {v for eqn in rest for v in eqn.invars if not isinstance(v, jex.Literal)}
  needed.update(v for v in jaxpr.outvars if not isinstance(v, jex.Literal))
  boundary = [v for v in jaxpr.invars if v in needed] + [v for eqn in hoisted for v in eqn.outvars if v in needed]
  prelude = jex.Jaxpr([], list(jaxpr.invars), boundary, hoisted)
  values = jax.jit(jex.jaxpr_as_fun(jex.ClosedJaxpr(prelude, [])), out_shardings=sharding)(key)
  main = jex.Jaxpr([], boundary + list(jaxpr.constvars), jaxpr.outvars, rest, jaxpr.effects)
  return main, list(values) + list(closed.consts)


def _is_small(aval) -> bool:
  return hasattr(aval, "shape") and int(np.prod(aval.shape, dtype=np.int64)) <= _SMALL_ELEMENTS


def _piece(main, inputs: list, index: int) -> _Piece:
  """Output `index` of `main` alone, its literals lifted to inputs."""
  pruned, used = _compat.dce_jaxpr(main, [i == index for i in range(len(main.outvars))], instantiate=False)
  args = [x for x, u in zip(inputs, used) if u]
  lifted, eqns = [], []
  for eqn in pruned.eqns:
    invars = []
    for v in eqn.invars:
      if isinstance(v, jex.Literal):
        invars.append(jex.Var(v.aval))
        lifted.append(invars[-1])
        args.append(np.asarray(v.val, dtype=v.aval.dtype))
      else:
        invars.append(v)
    eqns.append(eqn.replace(invars=invars))
  jaxpr = jex.Jaxpr([], [*pruned.invars, *lifted], pruned.outvars, eqns, pruned.effects)
  text = str(jaxpr)
  return _Piece(jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, [])), args, None if "..." in text else text)


def _mapped(fn: Callable, sharding: NamedSharding) -> Callable:
  """`fn` over its stacked inputs, one member at a time (`lax.map`), each member
  placed as a slice of the stack (`sharding`) so every device draws only its part."""
  member = NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))

  def run(*stacked):
    return [jax.lax.map(lambda args: jax.lax.with_sharding_constraint(fn(*args)[0], member), stacked)]

  return run


def _stack_args(values: list):
  if isinstance(values[0], np.ndarray):
    return np.stack(values)
  return jnp.stack(values)


def _run_chunk(chunk: dict[str, list[_Piece]], out_shardings, stacks) -> dict[str, jax.Array]:
  """One jit for the arrays of `chunk`, each from its members' pieces."""
  names = list(chunk)

  def run(*args_per_name):
    out = []
    for name, args in zip(names, args_per_name):
      made = [piece.fn(*a)[0] for piece, a in zip(chunk[name], args)]
      out.append(jnp.stack(made) if name in stacks else made[0])
    return out

  args = [[piece.args for piece in chunk[name]] for name in names]
  return dict(zip(names, jax.jit(run, out_shardings=[out_shardings[n] for n in names])(*args)))


def _chunks(names, size, budget):
  chunk, total = [], 0
  for name in names:
    if chunk and total + size[name] > budget:
      yield chunk
      chunk, total = [], 0
    chunk.append(name)
    total += size[name]
  if chunk:
    yield chunk


def _traceable_trunc_normal():
  """`nn.init.trunc_normal_` that works on torchax tensors under jit.

  torch's version is a no-op on tensors that report `is_meta` (torchax tensors
  do) and rejection-samples in a data-dependent Python loop that cannot be
  traced. Model code binds `nn.init.trunc_normal_` early (in `partial`s), so we
  swap the module-level helper it calls, for the duration of materialisation.
  """
  def trunc_normal(tensor, mean, std, a, b, generator=None, *, original):
    if not isinstance(tensor, TorchaxTensor):
      return original(tensor, mean, std, a, b, generator=generator)
    key = _compat.tensor_env(tensor).get_and_rotate_prng_key(generator)
    sample = jax.random.truncated_normal(key, (a - mean) / std, (b - mean) / std, tuple(tensor.shape))
    _compat.set_array(tensor, (sample * std + mean).astype(tensor.jax().dtype))
    return tensor

  return _compat.trunc_normal_helper(trunc_normal)


@contextlib.contextmanager
def _installed(module, entries, arrays: dict, untouched: list):
  """Swaps every meta tensor for a zero-filled torchax tensor (ties kept), and
  on exit reads back what the init wrote into `arrays` and restores the meta ones."""
  env = torchax.default_env()
  saved = module_state.snapshot(module)
  initial = {}
  for e in entries:
    value = TorchaxTensor(jnp.zeros(e.shape, mappings.t2j_dtype(e.dtype)), env)
    if e.is_param:
      value = torch.nn.Parameter(value, requires_grad=False)
    initial[e.name] = value.jax()
    for name in (e.name, *e.aliases):
      module_state.set_tensor(module, name, value, is_param=e.is_param)
  try:
    yield
    current = dict(module_state.named_tensors(module))
    for e in entries:
      value = current[e.name]
      arrays[e.name] = value.jax() if isinstance(value, TorchaxTensor) else value
      if arrays[e.name] is initial[e.name]:
        untouched.append(e.name)
  finally:
    module_state.restore(saved)


def upload(
  module: torch.nn.Module,
  entries: list[TensorEntry],
  shardings: Mapping[str, NamedSharding],
) -> dict[str, jax.Array]:
  """An initialised CPU model → sharded arrays, one tensor at a time."""
  current = dict(module_state.named_tensors(module))
  return {e.name: host.to_global_array(current[e.name], shardings[e.name]) for e in entries}
