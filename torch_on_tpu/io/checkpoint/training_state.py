"""Orbax training checkpoints: the whole training state, saved asynchronously and atomically,
restored bit-exactly into any mesh, under the model's original names (scan-stacked layers
sliced per layer), with checksums checked before a restore."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from torch_on_tpu.core import _compat, storage
from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.io import integrity
from torch_on_tpu.runtime import health
from torch_on_tpu.wrapper import scan as scan_lib
from torch_on_tpu.wrapper import state_entries

torchax = _compat.import_torchax()

logger = logging.getLogger(__name__)


PARAMS_KEY = "params"  # the training state's entry holding `ShardedModule.params`
BUFFERS_KEY = "buffers"  # ... and `ShardedModule.buffers` (an MoE's trained expert bias)

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

  `model` (the `ShardedModule` whose params and buffers the state holds)
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
    storage.quiet_thread_tracebacks()
    if not read_only:
      storage.note_checkpoints(self.directory)  # what a fault anywhere in the run reports as safe
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
    if jax.process_count() > 1:
      storage.on_background_fault(self._background_fault)
    with self._storage_faults():
      self._manager.wait_until_finished()  # the previous save's fault is reported as that step's
      self._writing = step
      health.doing(f"saving checkpoint step {step}")
      started = self._manager.save(step, args=args, force=force)
    if started and not self._async:
      self._write_checksums()
    if started:
      self._held_steps.append(step)
      health.background(lambda: f"writing checkpoint step {step}" if self.is_saving() else None)
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
      health.doing(f"restoring checkpoint step {candidate}")
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
      listed = "; ".join(f"step {s}: {p}" for s, p in damaged[: state_entries.SHOWN])
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
      return None, f"its metadata is unreadable ({first_line(e)})"
    stored = self._layers.unstack(target)
    if stored is not target and not state_entries.mismatches(_leaf_shapes(saved_tree), _leaf_shapes(target), allow_unexpected=partial):
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
      return None, f"reading it failed: {first_line(e)}"
    state = out["state"] if stored is target else self._layers.restack(out["state"], target)
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
      multihost_utils.sync_global_devices("torch_on_tpu.io.checkpoint.set_aside")
    self._manager.reload()
    return moved

  def _check_matches(self, step, saved_tree, target, partial):
    saved = _leaf_shapes(saved_tree)
    wanted = _leaf_shapes(target)
    problems = state_entries.mismatches(saved, wanted, allow_unexpected=partial)
    if problems:
      subset = not state_entries.mismatches(saved, wanted, allow_unexpected=True)
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
    health.background(None)
    storage.on_background_fault(None)
    with self._storage_faults():
      self._manager.close()

  def _write_checksums(self) -> None:
    """Process 0 records the checksums of the step being saved (orbax's save thread)."""
    if jax.process_index() != 0:
      return
    final = self.directory / str(self._writing)
    pending = sorted(self.directory.glob(f"{self._writing}.orbax-checkpoint-tmp*"), key=lambda p: p.stat().st_mtime)
    integrity.write_manifest(pending[-1] if pending else final)

  def _background_fault(self, error: BaseException) -> None:
    """A background write that failed on this process: the others wait for it in the
    save's barrier (and it for them), so it ends the run here, in one sentence."""
    health.abort(self._fault_sentence(error))

  def _fault_sentence(self, error: BaseException) -> str | None:
    return storage.storage_error(
      error, f"checkpoint step {self._writing}", self.directory, storage.kept(self.directory),
      elsewhere="point the checkpoints at a larger disk",
    )

  @contextlib.contextmanager
  def _storage_faults(self):
    """A storage fault from orbax (or its threads) → one sentence; anything else as it was."""
    try:
      yield
    except Exception as e:
      message = self._fault_sentence(e)
      if message is None:
        raise
      raise TorchOnTpuError(message) from None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def step_directory(path: Path) -> tuple[Path, int] | None:
  """(the checkpoint directory, the step) an orbax step `path` names (a run's `ckpt/4`), or a
  directory of steps (its newest); None when `path` is neither."""
  if (path / "_CHECKPOINT_METADATA").is_file() and path.name.isdigit():
    return path.parent, int(path.name)
  steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").is_file()) if path.is_dir() else []
  return (path, steps[-1]) if steps else None


def import_weights(jm, directory: Path, step: int) -> None:
  """The weights (params and buffers) of a training checkpoint's `step` into `jm`, each into its
  sharding and dtype: a run starting from another run's step (full, or its model-only last step)."""
  layout = jm.stored_layout()
  abstract = lambda arrays: {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in arrays.items()}  # noqa: E731
  buffers = {k: a for k, a in jm.buffers.items() if jm.is_persistent(layout[k][0][0])}  # the rest (RoPE tables) rebuilt
  target = {PARAMS_KEY: abstract(jm.params), **({BUFFERS_KEY: abstract(buffers)} if buffers else {})}
  with Checkpointer(directory, read_only=True, model=jm) as ckpt:
    restored = ckpt.restore(target, step=step, partial=True)
  jm.params.update(restored.state[PARAMS_KEY])
  jm.buffers.update(restored.state.get(BUFFERS_KEY, {}))


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

  def restack(self, tree, target=None):
    """The inverse of `unstack` on a restored tree, one group at a time (the
    per-layer arrays of a group are released as soon as it is stacked), each
    stacked array in its sharding in `target` (the layer dim over `pp` with
    pipeline stages), else replicated on the layer dim."""
    placed = {}
    if target is not None:
      for node_ in jax.tree.leaves(target, is_leaf=lambda x: self._holds(x, self.groups)):
        if self._holds(node_, self.groups):
          placed.update({k: v.sharding for k, v in node_.items() if k in self.groups and hasattr(v, "sharding")})

    def node(x):
      if not self._holds(x, self._first):
        return x
      for first, key in self._first.items():
        if first in x:
          x[key] = _stack_layers([x.pop(n) for n in self.groups[key]], placed.get(key))
      return x

    return jax.tree.map(node, tree, is_leaf=lambda x: self._holds(x, self._first))

  @staticmethod
  def _holds(x, names) -> bool:
    return isinstance(x, Mapping) and any(k in names for k in x)


def _stacked_sharding(sharding):
  """One layer's sharding with a leading layer dim, replicated (no target to follow)."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))


def _layer_slices(value) -> list:
  sharding = _one_layer_sharding(value.sharding, value.shape)
  if isinstance(value, jax.ShapeDtypeStruct):
    return [jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=sharding)] * value.shape[0]
  return _unstack(value, sharding)


def _one_layer_sharding(sharding, shape):
  """One layer's sharding: the stacked one without its layer dim. Axes that split the layer
  dim (pipeline stages over `pp`) move onto the first dim of the layer they divide, so a
  checkpoint written or read never holds every stage's layers on every device."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  moved, inner = _axes(spec[0]), list(spec[1:])
  mesh = sharding.mesh
  for dim, entry in enumerate(inner if moved else []):
    axes = _axes(entry)
    if shape[1 + dim] % math.prod(mesh.shape[a] for a in (*axes, *moved)) == 0:
      inner[dim] = (*axes, *moved)
      break
  return NamedSharding(mesh, PartitionSpec(*inner))


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.partial(jax.jit, static_argnums=1)
def _unstack(stacked, sharding):
  return [jax.lax.with_sharding_constraint(stacked[i], sharding) for i in range(stacked.shape[0])]


def _stack_layers(layers: list, sharding=None):
  return _stack(layers, sharding or _stacked_sharding(layers[0].sharding))


@functools.partial(jax.jit, static_argnums=1)
def _stack(layers, sharding):
  return jax.lax.with_sharding_constraint(jax.numpy.stack(layers), sharding)


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


