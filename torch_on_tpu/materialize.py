"""Meta-device torch modules → sharded `jax.Array`s, never a full copy on one host.

A model built under `torch.device("meta")` has shapes but no storage. We run the
model's *own* initialisation (torchtitan `init_states`, HF `initialize_weights`,
else every module's `reset_parameters`) on torchax tensors inside one `jax.jit`
whose `out_shardings` are the resolved parameter shardings: XLA generates each
shard on the device that owns it, so a parameter is born sharded and no host
ever holds the whole model. The same traced program under `jax.eval_shape`
gives abstract arrays (shapes, dtypes, shardings) with nothing allocated.

An already initialised CPU model is uploaded one tensor at a time, each device
reading only its own slice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding

from torch_on_tpu import _compat
from torch_on_tpu.errors import TorchOnTpuError

# jax has no public dead-code elimination for jaxprs; this one is stable across
# the 0.x releases we support (pinned in constraints.txt).
from jax._src.interpreters import partial_eval as _partial_eval  # noqa: E402

torchax = _compat.import_torchax()
from torchax.ops import mappings  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402

logger = logging.getLogger(__name__)

# Global bytes of outputs one materialisation jit produces (see `_run_in_chunks`):
# the floor, and all of it where devices do not report their memory (CPU, whose
# "device memory" is the host RAM the materialisation benchmark holds to 1.15x).
INIT_CHUNK_BYTES = 256 * 2**20
# On accelerators a chunk's outputs may take this share of each device's memory
# (its temporaries about three times that). Each chunk is one compile, and GPU
# compiles are slow: a 1B model in 256 MiB chunks took 165 s to initialise on an H100.
INIT_CHUNK_DEVICE_SHARE = 1 / 16


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
    for buf_name, b in mod._buffers.items():
      if b is None:
        continue
      full = f"{mod_name}.{buf_name}" if mod_name else buf_name
      add(full, b, False, buf_name not in mod._non_persistent_buffers_set)
  return [TensorEntry(**{**entries[k], "aliases": tuple(entries[k]["aliases"])}) for k in order]


def is_meta(module: torch.nn.Module) -> bool:
  """True when every tensor is on meta; raises when meta and real tensors mix."""
  devices = {t.device.type for t in _tensors(module)}
  if devices == {"meta"}:
    return True
  if "meta" in devices:
    meta = [n for n, t in _named_tensors(module) if t.device.type == "meta"]
    real = [n for n, t in _named_tensors(module) if t.device.type != "meta"]
    raise TorchOnTpuError(
      f"The model mixes meta tensors ('{meta[0]}') with real ones ('{real[0]}'); build it "
      f"entirely under torch.device('meta') or entirely initialised on CPU."
    )
  return False


def default_init_fn(module: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
  """The model's own initialisation, in order of preference."""
  if callable(getattr(module, "init_states", None)):  # torchtitan
    return lambda m: m.init_states(buffer_device=torch.device("jax"))
  if callable(getattr(module, "initialize_weights", None)):  # HF transformers
    return _hf_init

  return reset_parameters_everywhere


def _hf_init(module: torch.nn.Module) -> None:
  """HF's `initialize_weights`, run as if for the first time.

  HF marks modules `_is_hf_initialized` and then skips them; the marks would
  make a second materialisation of the same meta model leave zeros.
  """
  saved = {m: m.__dict__.pop("_is_hf_initialized") for m in module.modules() if "_is_hf_initialized" in m.__dict__}
  try:
    module.initialize_weights()
  finally:
    for m in module.modules():
      m.__dict__.pop("_is_hf_initialized", None)
    for m, flag in saved.items():
      m._is_hf_initialized = flag


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
  restructure: Callable[[dict], dict] | None = None,
  abstract: bool = False,
) -> dict[str, jax.Array]:
  """Runs the init of a meta `module` as one sharded jit; returns name → array.

  `restructure` (e.g. scan stacking) maps the canonical-name dict to the layout
  the caller stores, inside the same jit; `out_shardings` is keyed by its output.
  With `abstract=True` nothing is computed: arrays are `jax.ShapeDtypeStruct`s.
  """
  init_fn = init_fn or default_init_fn(module)
  env = torchax.default_env()
  untouched: list[str] = []

  def program(key):
    arrays = {}
    with env, env.override_property(prng=key), _traceable_trunc_normal(), _installed(
      module, entries, arrays, untouched
    ):
      with torch.no_grad():
        init_fn(module)
    return restructure(arrays) if restructure else arrays

  key = jax.random.key(seed)
  if abstract:
    out = jax.eval_shape(jax.jit(program, out_shardings=dict(out_shardings)), key)
  else:
    out = _run_in_chunks(program, key, out_shardings, chunk_budget(out_shardings.values()))
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


def chunk_budget(shardings) -> int:
  """Global output bytes per init jit for arrays placed by `shardings`: a share of
  the smallest device memory times the device count on accelerators that report
  it, `INIT_CHUNK_BYTES` otherwise (and at least that)."""
  devices = {d for s in shardings for d in s.device_set}
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices if d.platform != "cpu"]
  if not devices or len(limits) < len(devices) or None in limits:
    return INIT_CHUNK_BYTES
  return max(INIT_CHUNK_BYTES, int(min(limits) * INIT_CHUNK_DEVICE_SHARE) * len(devices))


def _run_in_chunks(program, key, out_shardings, budget: int) -> dict[str, jax.Array]:
  """Runs the traced init as several jits, largest outputs first, each compiling
  only the part of the program its outputs need; `budget` bounds each chunk's
  global output bytes (`chunk_budget`).

  One jit for a whole model would hold every random-number temporary at once
  (about 3x the largest tensor per device, on every device); in chunks the
  temporaries of one chunk exist at a time, so peak memory stays near the model
  itself. The program is traced once; each chunk replays the same jaxpr, so
  values are identical to a single jit.
  """
  closed, shapes = jax.make_jaxpr(program, return_shape=True)(key)
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  names = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
  index = {name: i for name, i in names.items()}
  size = {name: leaves[i].size * leaves[i].dtype.itemsize for name, i in index.items()}
  out = {}
  for chunk in _chunks(sorted(index, key=lambda n: -size[n]), size, budget):
    wanted = {index[n] for n in chunk}
    used = [i in wanted for i in range(len(leaves))]
    # Dead-code-eliminate before lowering, so each jit compiles only its slice.
    pruned, used_inputs = _partial_eval.dce_jaxpr(closed.jaxpr, used, instantiate=True)
    run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(pruned, closed.consts))
    jitted = jax.jit(
      lambda k: run(*([k] if used_inputs[0] else [])),
      out_shardings=[out_shardings[n] for n in sorted(chunk, key=index.get)],
    )
    out.update(zip(sorted(chunk, key=index.get), jitted(key)))
  return out


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


@contextlib.contextmanager
def _traceable_trunc_normal():
  """`nn.init.trunc_normal_` that works on torchax tensors under jit.

  torch's version is a no-op on tensors that report `is_meta` (torchax tensors
  do) and rejection-samples in a data-dependent Python loop that cannot be
  traced. Model code binds `nn.init.trunc_normal_` early (in `partial`s), so we
  swap the module-level helper it calls, for the duration of materialisation.
  """
  original = torch.nn.init._no_grad_trunc_normal_

  def trunc_normal(tensor, mean, std, a, b, generator=None):
    if not isinstance(tensor, TorchaxTensor):
      return original(tensor, mean, std, a, b, generator=generator)
    key = tensor._env.get_and_rotate_prng_key(generator)
    sample = jax.random.truncated_normal(key, (a - mean) / std, (b - mean) / std, tuple(tensor.shape))
    tensor._elem = (sample * std + mean).astype(tensor._elem.dtype)
    return tensor

  torch.nn.init._no_grad_trunc_normal_ = trunc_normal
  try:
    yield
  finally:
    torch.nn.init._no_grad_trunc_normal_ = original


@contextlib.contextmanager
def _installed(module, entries, arrays: dict, untouched: list):
  """Swaps every meta tensor for a zero-filled torchax tensor (ties kept), and
  on exit reads back what the init wrote into `arrays` and restores the meta ones."""
  env = torchax.default_env()
  saved = _snapshot(module)
  initial = {}
  for e in entries:
    value = TorchaxTensor(jnp.zeros(e.shape, mappings.t2j_dtype(e.dtype)), env)
    if e.is_param:
      value = torch.nn.Parameter(value, requires_grad=False)
    initial[e.name] = value._elem
    for name in (e.name, *e.aliases):
      _set_tensor(module, name, value, e.is_param)
  try:
    yield
    current = dict(_named_tensors(module))
    for e in entries:
      value = current[e.name]
      arrays[e.name] = value.jax() if isinstance(value, TorchaxTensor) else value
      if arrays[e.name] is initial[e.name]:
        untouched.append(e.name)
  finally:
    _restore(saved)


def upload(
  module: torch.nn.Module,
  entries: list[TensorEntry],
  shardings: Mapping[str, NamedSharding],
) -> dict[str, jax.Array]:
  """An initialised CPU model → sharded arrays, one tensor at a time."""
  current = dict(_named_tensors(module))
  return {e.name: to_global_array(current[e.name], shardings[e.name]) for e in entries}


def to_global_array(t: torch.Tensor, sharding: NamedSharding) -> jax.Array:
  """A host torch tensor → a global jax.Array; each device copies only its slice."""
  host = torch_to_numpy(t)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
  """Zero-copy where numpy has the dtype (bf16 goes through a uint16 view)."""
  t = t.detach()
  if t.dtype == torch.bfloat16:
    import ml_dtypes

    return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
  return t.contiguous().numpy()


def _tensors(module):
  return [t for _, t in _named_tensors(module)]


def _named_tensors(module):
  yield from module.named_parameters(remove_duplicate=False)
  yield from module.named_buffers(remove_duplicate=False)


def _owner(module, name):
  path, _, leaf = name.rpartition(".")
  return (module.get_submodule(path) if path else module), leaf


def _set_tensor(module, name, value, is_param):
  owner, leaf = _owner(module, name)
  if is_param:
    owner._parameters[leaf] = value
  else:
    owner._buffers[leaf] = value


def _snapshot(module):
  return [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]


def _restore(saved):
  for m, params, buffers in saved:
    m._parameters.clear()
    m._parameters.update(params)
    m._buffers.clear()
    m._buffers.update(buffers)
