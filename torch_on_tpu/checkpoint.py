"""Checkpoints: orbax training state, and safetensors for the PyTorch world.

Training runs get preempted and pods fail, so a run saves its whole state with
orbax (asynchronous, atomic, keep-last-N) and resumes bit-exactly; pretrained
weights come in from a safetensors directory under the model's original
`state_dict` names (scan-stacked layers included: they are read per original
layer name). Exports back out are `torch_on_tpu/export.py`.

    ckpt = Checkpointer("runs/a/ckpt", save_every=500, keep=3)
    restored = ckpt.restore(abstract_state(state, mesh, params=jm.params))  # None: fresh run
    with PreemptionGuard() as guard:
      for step in range(start, steps):
        state = train_step(state, batch)
        stop = guard.should_stop(step + 1)
        if stop or step + 1 == steps or ckpt.should_save(step + 1):
          ckpt.save(step + 1, state, data=loader.state(), config=run_config, force=True)
        if stop:
          break                                              # and exit 0; a relaunch resumes
    ckpt.close()                                             # waits for the last save

The training state is any pytree of jax arrays (params, buffers, optax state,
step, RNG key); by convention its `"params"` entry is the `JittableModule`'s
params dict, which is what `tools/convert.py` reads. With `model=jm`, layers
that `jm` holds stacked (scan) are stored under their original per-layer
names, in params and in every dict keyed like them (optimizer moments), so a
run resumes with scan on or off. Data-iterator state and the resolved run
config are JSON dicts saved next to it. Weights never go through pickle.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import torch
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from torch_on_tpu import _compat, integrity, storage
from torch_on_tpu import scan as scan_lib
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.materialize import torch_to_numpy

torchax = _compat.import_torchax()
from torchax.ops import mappings  # noqa: E402

logger = logging.getLogger(__name__)

PARAMS_KEY = "params"  # the training state's entry holding `JittableModule.params`
_SHOWN = 5  # mismatches listed by name in an error; the rest are counted

# ---- orbax training checkpoints ---------------------------------------------------------


@dataclasses.dataclass
class Restored:
  """What `Checkpointer.restore` read back: the step and the three saved items."""

  step: int
  state: object
  data: dict
  config: dict


class Checkpointer:
  """Periodic, asynchronous, atomic training checkpoints in one directory.

  `save` returns once the arrays are copied off the devices (donating them
  afterwards is safe) and writes in the background while training goes on.
  Each step is written to a temporary directory and renamed when complete,
  so a crash mid-save leaves a checkpoint that is ignored (and deleted in the
  background by the next `Checkpointer` on that directory). The newest `keep`
  steps are kept. `read_only=True` (for tools reading a live run's directory)
  neither writes nor cleans up.

  `model` (the `JittableModule` whose params and buffers the state holds)
  puts its scan-stacked arrays on disk as one array per original layer name
  (`layers.0.attention.wq.weight`, ...), wherever a dict in the state is keyed
  by them (params, buffers, optax moments), and restores them into its own
  layout: a checkpoint resumes with scan on or off, on any mesh. Saving
  slices the stacked arrays on their devices, so until `save` returns the
  devices hold those arrays twice.

  Every step carries checksums of its files (`integrity`), checked before it
  is read. A storage fault while writing (full disk, no permission, read-only
  or vanished directory) is raised by `save`, `wait` or `close` as one
  sentence naming the path and the free space; the steps saved before stay
  complete.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    save_every: int = 1000,
    keep: int | None = 3,
    async_save: bool = True,
    read_only: bool = False,
    model=None,
  ):
    if save_every < 1:
      raise TorchOnTpuError(f"Checkpointer save_every must be at least 1, got {save_every}.")
    self.directory = Path(directory).absolute()
    self.read_only = read_only
    self._async = async_save
    self._layers = _LayerNames(model)
    self._writing: int | None = None  # the step the newest save started
    storage.quiet_orbax_thread_tracebacks()
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
      # Every `save_every` steps and at a preemption sync point; not orbax's
      # default extra save at the first step of a run.
      save_decision_policy=policies.AnySavePolicy(
        [policies.FixedIntervalPolicy(save_every), policies.PreemptionCheckpointingPolicy()]
      ),
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      # Checksums go into the step directory after its data, before the rename that completes it.
      async_options=ocp.AsyncOptions(
        post_finalization_callback=self._write_checksums,
        # In the caller: a directory that cannot be made fails save(), not threads waiting on it.
        create_directories_asynchronously=False,
      )
      if async_save
      else None,
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
    )
    handlers = {
      "state": ocp.PyTreeCheckpointHandler(),
      "data": ocp.JsonCheckpointHandler(),
      "config": ocp.JsonCheckpointHandler(),
    }
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    # The steps this directory held: if it disappears, saving on would start a new
    # one silently with the run's history gone, so `save` says so instead.
    self._held_steps = list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    """True every `save_every` steps (and at a multi-host preemption sync point)."""
    return self._manager.should_save(step)

  def save(
    self,
    step: int,
    state,
    *,
    data: Mapping | None = None,
    config: Mapping | None = None,
    force: bool = False,
  ) -> bool:
    """Starts saving `state` (a pytree of arrays) as `step`; False when skipped.

    Without `force` only steps `should_save` picks are written; a step that is
    already saved is never written again.
    """
    if self._held_steps and not self.directory.is_dir():
      raise TorchOnTpuError(storage.vanished(self.directory, step, self._held_steps))
    if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
      return False
    args = ocp.args.Composite(
      state=ocp.args.PyTreeSave(self._layers.unstack(state)),
      data=ocp.args.JsonSave(_json_item("data", data)),
      config=ocp.args.JsonSave(_json_item("config", config)),
    )
    with self._storage_faults():
      self._manager.wait_until_finished()  # the previous save's fault is reported as that step's
      self._writing = step
      started = self._manager.save(step, args=args, force=force)
    if started and not self._async:
      self._write_checksums()
    if started:
      self._held_steps.append(step)
    return started

  def restore(self, target, *, step: int | None = None, partial: bool = False) -> Restored | None:
    """Reads a checkpoint into the shardings of `target`; None when there is none.

    `target` has the saved state's structure; its leaves are arrays or
    `jax.ShapeDtypeStruct`s whose shardings say where each value goes (another
    mesh shape or device count than the saving run's is fine: see
    `abstract_state`). `partial=True` reads only the entries `target` names
    (e.g. `{"params": ...}` out of a full training state). Names or shapes that
    differ from the checkpoint raise before anything is read.

    A step is checked before it is read: its files against their checksums,
    its metadata for being readable. Without `step`, a damaged newest step is
    logged, set aside (renamed `<step>.damaged`, nothing is deleted; a
    read-only Checkpointer leaves it) and the next newest is tried. A damaged
    `step`, or every step damaged, raises one sentence naming the step and the file.
    """
    saved = self.all_steps()
    if step is not None and step not in saved:
      raise TorchOnTpuError(
        f"No checkpoint for step {step} in {self.directory}; saved steps are {saved or 'none'}."
      )
    damaged = []
    for candidate in [step] if step is not None else saved[::-1]:
      restored, problem = self._restore_checked(candidate, target, partial)
      if restored is not None:
        self.set_aside([s for s, _ in damaged], "damaged")
        return restored
      damaged.append((candidate, problem))
      if step is None:
        logger.warning("The checkpoint at %s is damaged (%s); trying the previous step.", self.directory / str(candidate), problem)
    if step is not None:
      raise TorchOnTpuError(
        f"The checkpoint at {self.directory / str(step)} is damaged ({problem}); restore another "
        f"step (saved steps are {saved})."
      )
    if damaged:
      listed = "; ".join(f"step {s}: {p}" for s, p in damaged[:_SHOWN])
      raise TorchOnTpuError(
        f"Every checkpoint in {self.directory} is damaged ({listed}); restore from a copy or start "
        f"afresh in another directory."
      )
    return None

  def saved_config(self, step: int | None = None) -> dict | None:
    """The run config saved with `step` (default: the newest), read alone; None when unreadable."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    try:
      return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except (ValueError, KeyError, AttributeError, TypeError, OSError):
      return None  # damaged: restore says how, and falls back

  def _restore_checked(self, step: int, target, partial: bool) -> tuple[Restored | None, str | None]:
    """(the restored step, None), or (None, what is damaged); a target that does not match raises."""
    problem = integrity.problem(self.directory / str(step))
    if problem is not None:
      return None, problem
    try:
      saved_tree = self._manager.item_metadata(step)["state"].tree
    except (ValueError, KeyError, AttributeError, TypeError, OSError) as e:
      return None, f"its metadata is unreadable ({_first_line(e)})"
    stored = self._layers.unstack(target)
    if stored is not target and not _mismatches(_leaf_shapes(saved_tree), _leaf_shapes(target), allow_unexpected=partial):
      stored = target  # saved stacked, before checkpoints kept the original names
    self._check_matches(step, saved_tree, stored, partial)
    args = ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
        item=stored,
        restore_args=ocp.checkpoint_utils.construct_restore_args(stored),
        partial_restore=partial,
      ),
      data=ocp.args.JsonRestore(),
      config=ocp.args.JsonRestore(),
    )
    try:
      out = self._manager.restore(step, args=args)
    except TorchOnTpuError:
      raise
    except (ValueError, KeyError, AttributeError, TypeError, OSError) as e:
      return None, f"reading it failed: {_first_line(e)}"
    state = out["state"] if stored is target else self._layers.restack(out["state"])
    return Restored(step=step, state=state, data=out["data"], config=out["config"]), None

  def set_aside(self, steps, reason: str) -> list[Path]:
    """Renames step directories to `<step>.<reason>` (never deleting them), so
    that orbax no longer sees them; the new paths. A read-only Checkpointer renames nothing."""
    if self.read_only or not steps:
      return []
    moved = []
    if jax.process_index() == 0:
      for step in steps:
        target = self.directory / f"{step}.{reason}"
        n = 1
        while target.exists():
          n += 1
          target = self.directory / f"{step}.{reason}-{n}"
        (self.directory / str(step)).rename(target)
        moved.append(target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("torch_on_tpu.checkpoint.set_aside")
    self._manager.reload()
    return moved

  def _check_matches(self, step, saved_tree, target, partial):
    saved = _leaf_shapes(saved_tree)
    wanted = _leaf_shapes(target)
    problems = _mismatches(saved, wanted, allow_unexpected=partial)
    if problems:
      subset = not _mismatches(saved, wanted, allow_unexpected=True)
      if subset:
        fix = "pass partial=True to read only the entries the target names"
      elif any(f".{scan_lib.SCAN}.{scan_lib.LAYER}." in n for n in saved):
        fix = (
          "it holds scan-stacked layers (saved before checkpoints kept the original names): resume "
          "it with scan=True, or convert it with tools/convert.py to_safetensors and import that"
        )
      else:
        fix = "restore it into the model and optimizer that saved it"
      raise TorchOnTpuError(
        f"The checkpoint at {self.directory / str(step)} does not match the state to restore "
        f"({problems}); {fix}."
      )

  def is_saving(self) -> bool:
    """True while a started save is still being written in the background."""
    return self._manager.is_saving_in_progress()

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    with self._storage_faults():
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves, then releases orbax's background resources."""
    with self._storage_faults():
      self._manager.close()

  def _write_checksums(self) -> None:
    """Process 0 records the checksums of the step being saved (orbax's save thread)."""
    if jax.process_index() != 0:
      return
    final = self.directory / str(self._writing)
    pending = sorted(self.directory.glob(f"{self._writing}.orbax-checkpoint-tmp*"), key=lambda p: p.stat().st_mtime)
    integrity.write_manifest(pending[-1] if pending else final)

  @contextlib.contextmanager
  def _storage_faults(self):
    """A storage fault from orbax (or its threads) → one sentence; anything else as it was."""
    try:
      yield
    except Exception as e:
      complete = sorted(int(p.name) for p in _listing(self.directory) if p.name.isdigit())
      kept = f"step {complete[-1]} is the newest complete checkpoint" if complete else "no complete checkpoint is there"
      message = storage.storage_error(e, f"checkpoint step {self._writing}", self.directory, kept)
      if message is None:
        raise
      raise TorchOnTpuError(message) from None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def abstract_state(tree, mesh: jax.sharding.Mesh | None = None, *, params: Mapping | None = None):
  """A restore target: every leaf a `jax.ShapeDtypeStruct` with a concrete sharding.

  Leaves may be arrays (their sharding is kept) or `ShapeDtypeStruct`s, e.g.
  from `jax.eval_shape(optimizer.init, jm.params)`. A leaf without a concrete
  sharding whose last key names one of `params` (e.g. `jm.params`: optimizer
  moments are keyed like the params) with the same shape takes that
  parameter's sharding; an abstract-mesh sharding is rebound to `mesh`; any
  other leaf is replicated over `mesh`.
  """
  params = dict(params or {})

  def leaf(path, x):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh):
      sharding = None if mesh is None else NamedSharding(mesh, sharding.spec)
    name = getattr(path[-1], "key", None) if path else None
    if sharding is None and name in params and tuple(params[name].shape) == tuple(x.shape):
      sharding = params[name].sharding
    if sharding is None:
      if mesh is None:
        raise TorchOnTpuError(
          f"abstract_state got leaf '{jax.tree_util.keystr(path, simple=True, separator='/')}' "
          f"without a concrete sharding; pass mesh= (or params=) to place it."
        )
      sharding = NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(leaf, tree)


class _LayerNames:
  """A model's scan-stacked arrays ↔ their original per-layer names, wherever a
  dict in a state tree is keyed by the stacked names (params, buffers, and the
  optimizer's moments, which optax keys like the params)."""

  def __init__(self, model):
    layout = model.stored_layout() if model is not None else {}
    self.groups = {k: originals for k, (originals, stacked) in layout.items() if stacked}
    self._first = {originals[0]: k for k, originals in self.groups.items()}

  def unstack(self, tree):
    """Each stacked array (or `ShapeDtypeStruct`) → one per original layer name,
    sliced on its devices; the tree itself when nothing is stacked."""
    if not self.groups:
      return tree

    def node(x):
      if not self._holds(x, self.groups):
        return x
      out = {}
      for key, value in x.items():
        layers = self.groups.get(key)
        if layers and isinstance(value, (jax.Array, jax.ShapeDtypeStruct)) and value.shape[:1] == (len(layers),):
          out.update(zip(layers, _layer_slices(value)))
        else:
          out[key] = value
      return out

    return jax.tree.map(node, tree, is_leaf=lambda x: self._holds(x, self.groups))

  def restack(self, tree):
    """The inverse of `unstack` on a restored tree, one group at a time (the
    per-layer arrays of a group are released as soon as it is stacked)."""

    def node(x):
      if not self._holds(x, self._first):
        return x
      for first, key in self._first.items():
        if first in x:
          x[key] = _stack_layers([x.pop(n) for n in self.groups[key]])
      return x

    return jax.tree.map(node, tree, is_leaf=lambda x: self._holds(x, self._first))

  @staticmethod
  def _holds(x, names) -> bool:
    return isinstance(x, Mapping) and any(k in names for k in x)


def _layer_sharding(sharding, stacked: bool):
  """A stacked array's sharding without its layer dim (`stacked=False`), or one layer's with it."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = PartitionSpec(*tuple(sharding.spec)[1:]) if not stacked else PartitionSpec(None, *sharding.spec)
  return NamedSharding(sharding.mesh, spec)


def _layer_slices(value) -> list:
  sharding = _layer_sharding(value.sharding, stacked=False)
  if isinstance(value, jax.ShapeDtypeStruct):
    return [jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=sharding)] * value.shape[0]
  return _unstack(value, sharding)


@functools.partial(jax.jit, static_argnums=1)
def _unstack(stacked, sharding):
  return [jax.lax.with_sharding_constraint(stacked[i], sharding) for i in range(stacked.shape[0])]


def _stack_layers(layers: list):
  return _stack(layers, _layer_sharding(layers[0].sharding, stacked=True))


@functools.partial(jax.jit, static_argnums=1)
def _stack(layers, sharding):
  return jax.lax.with_sharding_constraint(jax.numpy.stack(layers), sharding)


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _listing(directory: Path) -> list[Path]:
  try:
    return list(directory.iterdir())
  except OSError:
    return []


def _json_item(what: str, value: Mapping | None) -> dict:
  value = dict(value or {})
  try:
    json.dumps(value)
  except (TypeError, ValueError) as e:
    raise TorchOnTpuError(
      f"The checkpoint's {what} dict is not JSON-serialisable ({e}); keep it to "
      f"str/int/float/bool/None, lists and dicts."
    ) from None
  return value


def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
  """Leaf path ('opt_state/0/mu/layers.0.w') → shape; typed PRNG keys as their key data."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      x = jax.eval_shape(jax.random.key_data, x)
    out[jax.tree_util.keystr(path, simple=True, separator="/")] = tuple(getattr(x, "shape", ()))
  return out


def _mismatches(found: Mapping, wanted: Mapping, *, allow_unexpected: bool = False) -> str:
  """'' when `found` has every name of `wanted` with its shape; else a summary."""
  missing = [n for n in wanted if n not in found]
  unexpected = [] if allow_unexpected else [n for n in found if n not in wanted]
  shapes = [
    f"{n} is {tuple(found[n])} but {tuple(wanted[n])} is expected"
    for n in wanted
    if n in found and tuple(found[n]) != tuple(wanted[n])
  ]
  parts = []
  for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
    if items:
      shown = ", ".join(items[:_SHOWN])
      if len(items) > _SHOWN:
        shown += f" and {len(items) - _SHOWN} more"
      parts.append(f"{len(items)} {label}: {shown}")
  return "; ".join(parts)


# ---- preemption --------------------------------------------------------------------------


class PreemptionGuard:
  """SIGTERM / SIGINT become a request to stop after the current step.

  The loop asks `should_stop(step)` after each step; when it says so the loop
  saves and exits 0, and a relaunch resumes. A second signal stops at once
  (`KeyboardInterrupt`). On several processes no handler is installed: jax's
  preemption service catches SIGTERM and every process stops at the same step
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`); SIGINT
  then interrupts as usual.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.signals = tuple(signals)
    self.requested = False
    self.signal_name: str | None = None
    self._previous: dict = {}

  def __enter__(self):
    if jax.process_count() == 1:
      for sig in self.signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
    self.requested = True
    self.signal_name = signal.Signals(signum).name
    logger.warning(
      "Got %s: finishing the current step, saving a checkpoint, then exiting "
      "(send it again to stop at once).",
      self.signal_name,
    )

  def should_stop(self, step: int) -> bool:
    """True once a stop was requested (on every process at the same `step`)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested


# ---- safetensors import (export is torch_on_tpu/export.py) ------------------------------

_INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One `state_dict` name: shape and dtype, and whether it is a module's own array."""

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  direct: bool  # False: produced by a module's state_dict hook (torchtitan's wq/wk/wv)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _abstract(jm) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Every original tensor name (ties by their canonical name) → (shape, dtype)."""
  arrays = {**jm.params, **jm.buffers}
  out = {}
  for key, (originals, stacked) in jm.stored_layout().items():
    shape = arrays[key].shape[1:] if stacked else arrays[key].shape
    for original in originals:
      out[original] = (tuple(shape), np.dtype(arrays[key].dtype))
  return out


def _meta_twin(prefix: str, mod: torch.nn.Module, abstract) -> torch.nn.Module:
  """A copy of a hooked module whose tensors are meta ones of its own original
  shapes and current dtypes, to run its state_dict hooks on (nothing allocated)."""
  twin = copy.deepcopy(mod)
  for name, _ in [*twin.named_parameters(), *twin.named_buffers()]:
    shape, dtype = abstract[f"{prefix}.{name}"]
    path, _, leaf = name.rpartition(".")
    owner = twin.get_submodule(path)
    meta = torch.empty(shape, dtype=mappings.j2t_dtype(dtype), device="meta")
    if leaf in owner._parameters:
      owner._parameters[leaf] = torch.nn.Parameter(meta, requires_grad=False)
    else:
      owner._buffers[leaf] = meta
  return twin


def _plan(jm) -> list[_Entry]:
  """Every `state_dict` name of the model with its shape and dtype, nothing read.

  Names under a module whose state_dict hooks rename or reshape (torchtitan's
  fused `wqkv` saved as `wq`/`wk`/`wv`) take their shapes from running those
  hooks on a meta copy of the module.
  """
  abstract = _abstract(jm)
  hooked = {}
  for prefix, mod in jm.hooked_modules:
    twin = _meta_twin(prefix, mod, abstract)
    for name, t in twin.state_dict(prefix=prefix + ".", keep_vars=True).items():
      hooked[name] = _Entry(name, tuple(t.shape), np.dtype(mappings.t2j_dtype(t.dtype)), False)
  out = []
  for name in jm.state_dict():
    if name in hooked:
      out.append(hooked[name])
    else:
      out.append(_Entry(name, *abstract[jm.canonical_name(name)], True))
  return out


def import_safetensors(jm, path: str | os.PathLike) -> None:
  """Loads safetensors weights (an HF model directory, its index, or one file)
  into `jm`'s params and buffers, straight into their shardings.

  Each process reads only the slices its devices hold (layers stacked by
  `scan=True` included). Names are the model's `state_dict` names (a tied
  weight may be stored once; torchtitan's `wq`/`wk`/`wv` are fused into `wqkv`
  by the module's own load hook, per layer). Values are cast to the dtypes `jm`
  holds. Different names or shapes raise before anything is read. Each of jm's
  arrays is released before its replacement is read (so the old and the new
  model never coexist in memory); a read failing midway says jm is half-loaded.
  """
  files = _safetensors_files(Path(path))
  entries = {e.name: e for e in _plan(jm)}
  with contextlib.ExitStack() as stack:
    handles = [stack.enter_context(_SafetensorsFile(f)) for f in files]
    where = {name: h for h in handles for name in h.keys()}
    found = {name: h.shape(name) for name, h in where.items()}
    # A tied group (HF's embed_tokens / lm_head) needs only one of its names stored.
    names_of: dict[str, list[str]] = {}
    for e in entries.values():
      if e.direct:
        names_of.setdefault(jm.canonical_name(e.name), []).append(e.name)
    wanted = {e.name: e.shape for e in entries.values() if not e.direct}
    for names in names_of.values():
      for n in [n for n in names if n in found] or names[:1]:
        wanted[n] = entries[n].shape
    problems = _mismatches(found, wanted)
    if problems:
      raise TorchOnTpuError(
        f"The safetensors weights at {path} do not match the model ({problems}); "
        f"load weights saved from this model architecture and size."
      )

    readers = {}
    for canonical, names in names_of.items():
      name = next(n for n in names if n in found)
      readers[canonical] = functools.partial(where[name].read, name)
    merged: dict = {}  # hooked modules' merged tensors, kept while one array is read
    abstract = _abstract(jm)
    for prefix, mod in jm.hooked_modules:
      readers.update(_hooked_readers(prefix, _meta_twin(prefix, mod, abstract), where, merged))
    shardings = {**jm.param_shardings, **jm.buffer_shardings}
    likes = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in {**jm.params, **jm.buffers}.items()}
    todo = [(k, o, stacked) for k, (o, stacked) in jm.stored_layout().items() if jm.is_persistent(o[0])]
    for done, (key, originals, stacked) in enumerate(todo):  # non-persistent buffers: jm keeps its own
      # jm's own array goes before its replacement is read: two copies of the model never coexist.
      held = jm.params if key in jm.params else jm.buffers
      held[key] = likes[key]
      _return_freed_memory()
      try:
        held[key] = _read_array([readers[o] for o in originals], stacked, likes[key], shardings[key])
      except Exception as e:
        raise TorchOnTpuError(
          f"Importing {path} failed at '{originals[0]}' after {done} of {len(todo)} arrays were "
          f"replaced ({_first_line(e)}); the model is half-loaded: build it again."
        ) from e
      merged.clear()


def _return_freed_memory() -> None:
  """Hands freed heap pages back to the OS (glibc's `malloc_trim`; elsewhere nothing).

  A replaced array's memory was allocated by the runtime's threads, and glibc
  keeps what they free in their own arenas, where the next array (allocated
  from other threads) does not reuse it: without this, an import over an
  initialised model held both in resident memory.
  """
  trim = getattr(_libc(), "malloc_trim", None)
  if trim is not None:
    trim(0)


@functools.cache
def _libc():
  import ctypes

  try:
    return ctypes.CDLL("libc.so.6")
  except OSError:
    return None


def _open_safetensors(path: Path):
  """`safe_open(path)`, with a truncated or malformed file named in one sentence."""
  from safetensors import SafetensorError, safe_open

  try:
    return safe_open(str(path), framework="pt")
  except (SafetensorError, OSError) as e:
    raise TorchOnTpuError(
      f"{path} is not a readable safetensors file ({str(e).strip()}); re-download or re-export it."
    ) from None


class _SafetensorsFile:
  """One safetensors file, each block read on its own with positioned reads.

  Not through a memory map: the pages of a mapped file that were read stay in
  the process's resident memory until it is unmapped, which for a whole-model
  import is a second copy of the model next to its arrays. Here a block's rows
  are read into a buffer that lives until its device array is made.
  """

  def __init__(self, path: Path):
    with _open_safetensors(path):  # checks the header and the file's size against it
      pass
    with open(path, "rb") as f:
      size = struct.unpack("<Q", f.read(8))[0]
      self._tensors = json.loads(f.read(size))
    self._tensors.pop("__metadata__", None)
    self._start = 8 + size
    self.path = path
    self._fd = os.open(path, os.O_RDONLY)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    os.close(self._fd)

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._tensors[name]["shape"])

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    """`index` (a tuple of slices) → that block of tensor `name`; only its rows are read."""
    info = self._tensors[name]
    dtype = _numpy_dtype(info["dtype"], name, self.path)
    shape = self.shape(name)
    if not shape:
      return self._pread(info["data_offsets"][0], dtype.itemsize).view(dtype).reshape(())
    index = (*index, *[slice(None)] * (len(shape) - len(index)))
    lo, hi, _ = index[0].indices(shape[0])
    row = math.prod(shape[1:]) * dtype.itemsize
    rows = self._pread(info["data_offsets"][0] + lo * row, max(hi - lo, 0) * row)
    block = rows.view(dtype).reshape(-1, *shape[1:])
    return block[(slice(None, None, index[0].step), *index[1:])]

  def _pread(self, offset: int, count: int) -> np.ndarray:
    out = np.empty(count, np.uint8)
    view, done = memoryview(out), 0
    while done < count:
      got = os.preadv(self._fd, [view[done:]], self._start + offset + done)
      if got == 0:
        raise TorchOnTpuError(
          f"{self.path} ended while reading it (it is shorter than its header says); re-download or re-export it."
        )
      done += got
    return out


def _numpy_dtype(code: str, name: str, path: Path) -> np.dtype:
  names = {v: k for k, v in _SAFETENSORS_DTYPES.items()} | {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
  if code not in names:
    raise TorchOnTpuError(
      f"Tensor '{name}' in {path} has safetensors dtype {code}, which cannot be imported; store it as "
      f"{', '.join(sorted(names))}."
    )
  return np.dtype(jax.numpy.dtype(names[code]))


def _hooked_readers(prefix, twin, where, merged: dict) -> dict:
  """Readers for a hooked module's tensors: its stored ones merged by its own
  load hook on its meta twin (torchtitan: `wq`/`wk`/`wv` → `wqkv`), into
  `merged` when first needed."""

  def load():
    if prefix not in merged:
      own = {n[len(prefix) + 1 :]: _as_torch(where[n].read(n)) for n in where if n.startswith(prefix + ".")}
      loaded = copy.deepcopy(twin)  # the twin stays meta; `merged` alone holds the data
      loaded.load_state_dict(own, strict=True, assign=True)
      tensors = [*loaded.named_parameters(), *loaded.named_buffers()]
      merged[prefix] = {f"{prefix}.{n}": t for n, t in tensors}
    return merged[prefix]

  names = [f"{prefix}.{n}" for n, _ in [*twin.named_parameters(), *twin.named_buffers()]]
  return {name: (lambda index, name=name: torch_to_numpy(load()[name][index])) for name in names}


def _as_torch(x: np.ndarray) -> torch.Tensor:
  dtype = mappings.j2t_dtype(x.dtype)
  if x.size == 0:
    return torch.empty(x.shape, dtype=dtype)
  return torch.frombuffer(bytearray(x.tobytes()), dtype=dtype).reshape(x.shape)


def _read_array(readers, stacked: bool, like, sharding) -> jax.Array:
  """One stored array, each device's block read from the files (and cast to
  `like.dtype`); a stacked array's block gathers that block of each layer."""

  def block(reader, index):
    return np.asarray(reader(index)).astype(like.dtype, copy=False)

  def read(index):
    if not stacked:
      return block(readers[0], index)
    layers = range(len(readers))[index[0]]
    return np.stack([block(readers[i], index[1:]) for i in layers])

  # Each block goes to its device before the next is read: one block at a time in host memory.
  blocks = sharding.addressable_devices_indices_map(tuple(like.shape))
  shards = [jax.device_put(read(index), device) for device, index in blocks.items()]
  return jax.make_array_from_single_device_arrays(tuple(like.shape), sharding, shards)


def _safetensors_files(path: Path) -> list[Path]:
  if path.is_file():
    return [path]
  index = path / _INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
      raise TorchOnTpuError(
        f"{index} is not a safetensors index ({type(e).__name__}: {e}); re-download or re-export it."
      ) from None
    return [path / f for f in sorted(set(weight_map.values()))]
  files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
  if not files:
    raise TorchOnTpuError(
      f"No safetensors weights at {path}; give a .safetensors file or a directory holding "
      f"them (with {_INDEX_FILE} when sharded)."
    )
  return files
