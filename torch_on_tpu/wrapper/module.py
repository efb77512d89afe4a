"""`ShardedModule`: the object the user holds.

    model = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1), sharding="fsdp")
    logits = model(tokens)                 # jitted; CPU inputs are placed on the mesh

It takes a torch module nobody edited (built on `meta`, or initialised on CPU),
resolves a sharding map against its parameter names, materialises every
parameter directly in its sharding, and runs the module's own `forward` as a
pure function of `(params, buffers, inputs)` under `jax.jit`.

The boundary between the two worlds stays visible: `.params` / `.buffers` are
dicts of `jax.Array` (the jax world, what the train step and checkpoints use);
`functional_call` takes torch tensors that view those arrays (`torch_view`) and
runs torch code.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_on_tpu import attention as attention_lib
from torch_on_tpu import models, runtime
from torch_on_tpu.core import _compat
from torch_on_tpu.core.sizes import human_bytes
from torch_on_tpu.errors import TorchOnTpuError, arg, named
from torch_on_tpu.lowering import aten, device_checks, float8, host, op_table, refusals, target_device
from torch_on_tpu.parallel import mesh as mesh_lib
from torch_on_tpu.parallel import pipeline as pipeline_lib
from torch_on_tpu.parallel import sharding as sharding_lib
from torch_on_tpu.runtime import xla_flags
from torch_on_tpu.wrapper import materialize, module_state, state_loading
from torch_on_tpu.wrapper import scan as scan_lib

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402
from torchax.tensor import Tensor as TorchaxTensor  # noqa: E402

logger = logging.getLogger(__name__)


class ShardedModule:
  """A torch module whose parameters live on a device mesh as sharded jax arrays.

  Args:
    module: the torch model, built under `torch.device("meta")` (preferred: no
      host copy is ever made) or initialised on CPU.
    mesh: from `make_mesh`; defaults to all devices on one `fsdp` axis.
    sharding: a map `{pattern: spec}`, or a preset: `"fsdp"`, `"replicated"`,
      `"fsdp_tp"` (known model families, see `torch_on_tpu.models`).
    strict: parameters no pattern covers are an error instead of replicated.
    seed: the init seed (materialisation is reproducible for a given seed).
    init_fn: `init_fn(module)` initialising in place; default is the model's own.
    data_axes: mesh axes the batch dim is sharded over; default `mesh.data_axes`.
    attention: which kernel runs `scaled_dot_product_attention` (and
      torchtitan's flex attention): `"auto"` (by platform), `"splash"`,
      `"cudnn"`, `"xla"`, or `None` (torchax's default lowering).
    attention_block_sizes: splash kernel block sizes (see `attention`).
    context_parallel: how attention's K/V cross a `cp` mesh axis (the sequence
      split, `torch_on_tpu.attention.context`): `"auto"` (K/V gathered under
      GQA, at cp=2 and for splash; the ring otherwise), `"all_gather"` or `"ring"`.
    scan: run the model's stack of identical blocks as one `lax.scan`
      (compile time flat in depth); names stay the original per-layer ones.
    remat: per-layer rematerialisation policy (`torch_on_tpu.lowering.remat.NAMES`).
      With `scan=False` the stack runs as a Python loop with the same policy.
    unroll: layers per scan iteration.
    abstract: build shapes and shardings only (`jax.ShapeDtypeStruct`s), for
      memory planning and ahead-of-time compiles; nothing is allocated.
    microbatches: with a `pp` mesh axis (pipeline stages, `torch_on_tpu.parallel.pipeline`):
      how many microbatches the batch is cut into in the layer stack; None: as
      many as stages (the fewest that keep every stage busy once filled).
    virtual_stages: with a `pp` axis: blocks of layers per stage, visited
      round-robin (circular schedule; the bubble shrinks by this factor); 1 is
      plain GPipe.
  """

  def __init__(
    self,
    module: torch.nn.Module,
    *,
    mesh: Mesh | None = None,
    sharding: str | Mapping = "fsdp",
    strict: bool = False,
    seed: int = 0,
    init_fn: Callable[[torch.nn.Module], None] | None = None,
    data_axes: tuple[str, ...] | None = None,
    attention: str | None = "auto",
    attention_block_sizes: Mapping | None = None,
    context_parallel: str = "auto",
    scan: bool = False,
    remat: str | None = None,
    unroll: int = 1,
    abstract: bool = False,
    microbatches: int | None = None,
    virtual_stages: int = 1,
  ):
    if not isinstance(module, torch.nn.Module):
      raise TorchOnTpuError(
        f"ShardedModule wraps a torch.nn.Module, got {type(module).__name__}."
      )
    runtime.setup()
    float8.prepare(module)  # torchao's float8 linears; low-precision formats the bridge does not lower
    self.module = module
    self.family = models.family_of(module)
    self.family.prepare(module)
    self._pre_step = self.family.optimizer_pre_step(module)  # by the original names, before any scan swap
    self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(fsdp=-1)
    self.data_axes = tuple(data_axes) if data_axes is not None else mesh_lib.data_axes(self.mesh)
    for axis in self.data_axes:
      if axis not in self.mesh.shape:
        raise TorchOnTpuError(
          f"data_axes names '{axis}', which the mesh {dict(self.mesh.shape)} lacks."
        )
    if attention is None and mesh_lib.sequence_ways(self.mesh) > 1:
      raise TorchOnTpuError(
        f"attention=None leaves SDPA to torchax's own lowering, which cannot split the sequence over "
        f"the mesh's {mesh_lib.SEQUENCE_AXIS}={mesh_lib.sequence_ways(self.mesh)}; pick an attention kernel "
        f"('auto') or use a mesh without {mesh_lib.SEQUENCE_AXIS} (cp=1)."
      )
    self.attention = attention
    self.context_parallel = context_parallel
    self._attention = (
      None
      if attention is None
      else attention_lib.Attention(
        attention, mesh=self.mesh, data_axes=self.data_axes, block_sizes=attention_block_sizes,
        context_parallel=context_parallel,
      )
    )

    entries = materialize.inventory(module)
    self._entries = {e.name: e for e in entries}
    self._aliases = {alias: e.name for e in entries for alias in e.aliases}
    self._state_dict_names = list(module.state_dict(keep_vars=True))
    self._hooked_modules = _outermost_hooked_modules(module)
    fsdp_dims = self.family.fsdp_dims(module) if sharding in ("fsdp", "ep") else {}
    tensors = [sharding_lib.TensorInfo(e.name, e.shape, e.is_param, fsdp_dims.get(e.name)) for e in entries]
    experts = self.family.expert_parameters(module) if isinstance(sharding, str) else None
    self._resolved = sharding_lib.resolve(
      _sharding_map_for(module, sharding, self.mesh, tensors, experts),
      tensors,
      [name for name, _ in module.named_modules() if name],
      self.mesh,
      strict=strict,
      experts=experts if sharding in ("ep", "fsdp") else None,
    )
    self.pipeline = self._pipeline(scan, microbatches, virtual_stages)
    self._layout = None
    if scan or remat not in (None, "none"):
      self._layout = scan_lib.layout_for(module, entries, pipeline=self.pipeline)
    if self._layout:
      self._specs = self._layout.internal_specs(self._resolved.specs)
      if self.pipeline:
        shapes = {e.name: e.shape for e in entries}
        self._specs.update({
          n: pipeline_lib.outside_spec(spec, shapes[n], self.mesh)
          for n, spec in self._specs.items()
          if n in shapes and self._entries[n].is_param
        })
      stacks = self._layout.groups
    else:
      self._specs = dict(self._resolved.specs)
      stacks = None
    stored = {n: NamedSharding(self.mesh, s) for n, s in self._specs.items()}

    self._views = {}
    if abstract or materialize.is_meta(module):
      arrays = materialize.materialize(
        module, entries, stored, seed=seed, init_fn=init_fn, stacks=stacks, abstract=abstract
      )
    else:
      # each tensor as it is stored: outside a pipeline's stack, over `pp` too (`outside_spec`)
      placed = {n: stored.get(n, s) for n, s in self._resolved.shardings(self.mesh).items()}
      arrays = materialize.upload(module, entries, placed)
      # tensors torch holds as views of a larger storage: `as_strided` on them reads by it
      self._views = {n: v for n, t in module_state.named_tensors(module) if n in arrays and (v := aten.storage_layout(t))}
      if stacks:
        arrays = materialize.stack_placed(arrays, stacks, stored)
      _to_meta(module)

    if self._layout:
      self._layout.apply(module, remat=remat, unroll=unroll, scan=scan, carry_sharding=self.batch_sharding)
      is_param = {n: self._entries[group[0]].is_param for n, group in self._layout.groups.items()}
    else:
      is_param = {}
    is_param.update({e.name: e.is_param for e in entries})
    self.params: dict[str, jax.Array] = {n: a for n, a in arrays.items() if is_param[n]}
    self.buffers: dict[str, jax.Array] = {n: a for n, a in arrays.items() if not is_param[n]}
    self._rng = jax.random.key(seed + 1)
    self._compiled: dict = {}
    if not getattr(module, "_tot_wrapped", False):
      module.register_forward_pre_hook(_refuse_direct_call)
      module._tot_wrapped = True

  def _pipeline(self, scan: bool, microbatches, virtual_stages):
    """The pipeline over the mesh's `pp` axis, or None without one (knobs then refused)."""
    stages = pipeline_lib.stages_of(self.mesh)
    if stages == 1:
      if microbatches is not None or virtual_stages != 1:
        raise TorchOnTpuError(
          f"{named('microbatches')} and {named('virtual_stages')} set up pipeline stages, but the mesh "
          f"{dict(self.mesh.shape)} has no '{mesh_lib.PIPELINE_AXIS}' axis larger than 1; build it with "
          f"make_mesh(pp=N, ...) or drop them."
        )
      return None
    if mesh_lib.PIPELINE_AXIS in self.data_axes:
      raise TorchOnTpuError(
        f"data_axes names '{mesh_lib.PIPELINE_AXIS}', which splits the layers into pipeline stages, "
        f"not the batch; leave it out of data_axes."
      )
    if not scan:
      raise TorchOnTpuError(
        f"The mesh has {mesh_lib.PIPELINE_AXIS}={stages}, which splits the scanned layer stack into "
        f"pipeline stages; pass {arg('scan', True)}."
      )
    schedule = pipeline_lib.Schedule(stages, stages if microbatches is None else microbatches, virtual_stages)
    return pipeline_lib.Pipeline(schedule, self.mesh, self.data_axes)

  # ---- the jax world ---------------------------------------------------------------

  @property
  def param_shardings(self) -> dict[str, NamedSharding]:
    return {k: NamedSharding(self.mesh, self._specs[k]) for k in self.params}

  @property
  def buffer_shardings(self) -> dict[str, NamedSharding]:
    return {k: NamedSharding(self.mesh, self._specs[k]) for k in self.buffers}

  @property
  def compile_options(self) -> dict[str, str]:
    """XLA options every program over this model's mesh is compiled with (`xla_flags`)."""
    return xla_flags.compile_options(self.mesh.devices.flat[0].platform)

  @property
  def batch_ways(self) -> int:
    """How many ways the data axes split a batch."""
    return mesh_lib.batch_ways(self.mesh, self.data_axes)

  def batch_sharding(self, ndim: int, batch_size: int | None = None, seq_len: int | None = None) -> NamedSharding:
    """Dim 0 over the data axes (replicated where they do not divide it: the
    forward takes any batch; the train step refuses one that does not split);
    dim 1, the sequence, over `cp` where the mesh has one that divides `seq_len`."""
    splits = batch_size is None or batch_size % self.batch_ways == 0
    sequence = seq_len is not None and mesh_lib.splits_sequence(self.mesh, (batch_size, seq_len))
    return NamedSharding(self.mesh, mesh_lib.batch_spec(self.data_axes if splits else (), ndim, sequence))

  def token_sharding(self, rows: int) -> NamedSharding | None:
    """(rows, ...) of flattened batch × sequence positions over the data axes and `cp`
    (each device its tokens: their order is the batch's, batch-major); over the data axes
    alone where those do not divide `rows`; None where neither does."""
    axes = self.data_axes + ((mesh_lib.SEQUENCE_AXIS,) if mesh_lib.sequence_ways(self.mesh) > 1 else ())
    for candidate in (axes, self.data_axes):
      if candidate and rows % mesh_lib.batch_ways(self.mesh, candidate) == 0:
        return NamedSharding(self.mesh, mesh_lib.batch_spec(candidate, 2))
    return None

  def place(self, tensor: torch.Tensor) -> jax.Array:
    """A host tensor → a global array, batch dim sharded over the data axes (and its
    sequence, dim 1, over `cp`)."""
    if isinstance(tensor, TorchaxTensor):
      return tensor.jax()
    if tensor.ndim == 0:
      return jnp.asarray(host.torch_to_numpy(tensor))
    sharding = self.batch_sharding(tensor.ndim, *tensor.shape[:2])
    return host.to_global_array(tensor, sharding)

  # ---- the torch world ---------------------------------------------------------------

  def functional_call(self, params: Mapping, buffers: Mapping, *args, **kwargs):
    """Runs the module's own forward with the given params and buffers.

    Values may be jax arrays or torch tensors viewing them; the call must be
    traced or run where torchax may compute (we enter its environment).
    Buffer updates the forward makes land in the torch tensors passed in (as
    with `torch.func.functional_call`); `functional_call_with_buffers` returns them.
    """
    return self.functional_call_with_buffers(params, buffers, *args, **kwargs)[0]

  def functional_call_with_buffers(self, params: Mapping, buffers: Mapping, *args, **kwargs):
    """`functional_call` that also returns the buffers the forward changed, in place
    or by rebinding (BatchNorm's running statistics, counters, EMA buffers):
    `(output, {name: new jax array})`, each in the buffer's stored dtype and sharding."""
    env = torchax.default_env()
    tensors = {**dict(buffers), **dict(params)}
    tensors = {k: aten.mark_storage(torch_view(v), self._views.get(k)) if isinstance(v, jax.Array) else v for k, v in tensors.items()}
    before = {n: jax_view(tensors[n]) for n in buffers}
    for alias, name in self._aliases.items():
      if name in tensors:
        tensors[alias] = tensors[name]
    # Random ops rotate the env's key; scoping the key keeps a traced key from
    # leaking into torchax's global state (pass a fresh key with
    # `env.override_property(prng=key)` around the call for per-step randomness).
    kwargs = {**self.family.call_defaults(self.module), **kwargs}
    with env, env.override_property(prng=env.param.prng):
      with self._activation_constraints(), self._sequence_split(args, kwargs), self._attention_kernels(), \
          aten.cpu_linear(self.mesh), aten.made_on_device(), self.family.running(self.module, self.mesh, self.data_axes), \
          target_device.compiling_for(self.mesh.devices.flat[0]):
        with _compat.reparametrized(self.module, tensors), _running_wrapped():
          out = self.module(*args, **kwargs)
          after = {n: jax_view(self.module.get_buffer(n)) for n in before}
    changed = {n: self._as_stored(n, a, before[n]) for n, a in after.items() if a is not before[n]}
    return out, changed

  def optimizer_pre_step(self, buffers: Mapping) -> dict:
    """The buffers the model's family updates before each optimizer step (torchtitan's
    MoE load balancing), from `buffers` (stored names) as the forwards left them:
    `{stored name: new array}`; {} for models without such an update."""
    if self._pre_step is None:
      return {}

    def read(name):
      stored, index = self._layout.lookup(name) if self._layout else (name, None)
      return buffers[stored] if index is None else buffers[stored][index]

    changed = {}
    for name, value in self._pre_step(read).items():
      stored, index = self._layout.lookup(name) if self._layout else (name, None)
      changed[stored] = value if index is None else changed.get(stored, buffers[stored]).at[index].set(value)
    return {n: self._as_stored(n, a, buffers[n]) for n, a in changed.items()}

  def _as_stored(self, name: str, new, old):
    """A buffer's new value in its old dtype and its sharding (under jit: a constraint)."""
    if tuple(new.shape) != tuple(old.shape):
      raise TorchOnTpuError(
        f"The forward changed buffer '{name}' from shape {tuple(old.shape)} to {tuple(new.shape)}; "
        f"a buffer keeps its shape in a compiled step, so update it in place with the same shape."
      )
    sharding = NamedSharding(self.mesh, self._specs[name])
    return jax.lax.with_sharding_constraint(new.astype(old.dtype), sharding)

  def _attention_kernels(self):
    if not self._attention:
      return contextlib.nullcontext()
    self._attention.splits.clear()  # what this trace's calls do across `cp`
    return attention_lib.installed(self._attention)

  def attention_splits(self) -> tuple[str, ...]:
    """How the last trace's attention calls crossed the `cp` axis (strategy, layout)."""
    return tuple(sorted(self._attention.splits)) if self._attention else ()

  def __call__(self, *args, **kwargs):
    """Jitted forward. Tensors are traced (CPU ones placed on the mesh); every
    other argument (flags like `use_cache=False`) is static. Buffers the forward
    changes (BatchNorm's running statistics in train mode) are written back."""
    leaves, treedef = _compat.torch_pytree.tree_flatten((args, kwargs))
    is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
    statics = tuple(None if t else x for x, t in zip(leaves, is_tensor))
    dynamic = [self.place(x) for x, t in zip(leaves, is_tensor) if t]
    views = tuple(aten.storage_layout(x) if t and not _compat.is_jax_backed(x) else None for x, t in zip(leaves, is_tensor))
    try:
      key = (treedef, is_tensor, statics)
      hash(key)
    except TypeError as e:
      raise TorchOnTpuError(
        f"A non-tensor argument to the model is unhashable ({e}); pass tensors for data "
        f"and hashable Python values (bools, ints, strings, tuples) for flags."
      ) from None
    jitted, out_spec = self.program(key, lambda: self._build_forward(treedef, is_tensor, statics, views))
    if any(views[i] != layout for i, layout in out_spec.get("views_read", {}).items()):  # it read a view's storage
      jitted, out_spec = self.program((key, views), lambda: self._build_forward(treedef, is_tensor, statics, views))
    self._rng, rng = jax.random.split(self._rng)
    with refusals.translated():  # an op that cannot be compiled: one sentence naming it
      out_leaves, changed, checks = jitted(self.params, self.buffers, dynamic, rng)
    self.buffers.update(changed)  # unchanged where an index check failed
    outputs = _unflatten_output(out_spec, out_leaves)
    if out_spec["check_messages"]:
      pending = device_checks.Pending(checks, out_spec["check_messages"])
      device_checks.attach([t for t in _compat.torch_pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)], pending)
    return outputs

  # ---- as a torch module: train / eval ------------------------------------------------

  def train(self, mode: bool = True) -> ShardedModule:
    """As `nn.Module.train`: the wrapped module's mode (dropout, BatchNorm's statistics).
    Each mode gets its own compiled forward."""
    self.module.train(mode)
    return self

  def eval(self) -> ShardedModule:
    """As `nn.Module.eval`: `train(False)`."""
    return self.train(False)

  @property
  def training(self) -> bool:
    return self.module.training

  def _modes(self) -> tuple[bool, ...]:
    return tuple(m.training for m in self.module.modules())

  def program(self, key, build: Callable):
    """The program compiled for this model under `key` (its forward per call signature,
    `generate`'s loop per shape): `build()` once, then the same one. The op overrides in
    force (`op_table.generation()`), every submodule's train/eval mode and a `torch.autocast`
    region around the call are part of the key, so any change compiles afresh (a program
    traced in train mode runs dropout)."""
    key = (key, op_table.generation(), self._modes(), aten.autocast_state())
    if key not in self._compiled:
      self._compiled[key] = build()
    return self._compiled[key]

  def _build_forward(self, treedef, is_tensor, statics, views):
    """`views`: per argument, the storage layout of a host tensor torch holds as a view, which
    `as_strided` reads by (`out_spec["views_read"]`: the ones it read, which the program depends on)."""
    out_spec = {}

    def forward(params, buffers, dynamic, rng):
      it = iter(dynamic)
      leaves = [aten.mark_storage(torch_view(next(it)), v) if t else s for t, s, v in zip(is_tensor, statics, views)]
      args, kwargs = _compat.torch_pytree.tree_unflatten(leaves, treedef)
      env = torchax.default_env()
      with env.override_property(prng=rng), device_checks.collecting() as collector, aten.storage_reads() as read:
        out, changed = self.functional_call_with_buffers(params, buffers, *args, **kwargs)
      out_spec["views_read"] = {i: views[i] for i, x in enumerate(leaves) if id(x) in read}
      # index checks (device_checks): a failed one keeps the buffers as they were and is
      # raised when an output is read
      checks = collector.checks()
      out_spec["check_messages"] = collector.messages
      changed = device_checks.keep_if_ok(checks, changed, {n: buffers[n] for n in changed})
      flat, out_tree = _compat.torch_pytree.tree_flatten(out)
      _check_output_leaves(flat)
      out_spec["tree"] = out_tree
      out_spec["is_tensor"] = [isinstance(x, torch.Tensor) for x in flat]
      out_spec["statics"] = [None if isinstance(x, torch.Tensor) else x for x in flat]
      return [jax_view(x) for x in flat if isinstance(x, torch.Tensor)], changed, checks

    return jax.jit(forward, compiler_options=self.compile_options), out_spec

  @contextlib.contextmanager
  def _activation_constraints(self):
    """Forward hooks pinning the outputs of modules the map names (activation rules)."""
    rules = self._resolved.activations
    if not rules:
      yield
      return
    handles = []
    compiled = [(sharding_lib.compile_pattern(p), p, s) for p, s in rules.items()]
    for name, mod in self.module.named_modules():
      if self._layout:
        name = self._layout.original_module_name(name)
      hits = [(sharding_lib.specificity(p), p, s) for rx, p, s in compiled if rx.match(name)]
      if hits:
        _, pattern, spec = max(hits, key=lambda h: h[0])
        handles.append(mod.register_forward_hook(_constrain_hook(name, pattern, spec, self.mesh)))
    try:
      yield
    finally:
      for h in handles:
        h.remove()

  @contextlib.contextmanager
  def _sequence_split(self, args, kwargs):
    """With a `cp` axis: every module output shaped like the batch (B, L, ...) keeps its
    batch over the data axes and its sequence over `cp`, other dims left to GSPMD.

    Unpinned, GSPMD follows the parameters' FSDP sharding (over `cp` too) onto the
    matmuls' feature dims and gathers the whole sequence on every device."""
    lead = next(
      (tuple(x.shape[:2]) for x in _compat.torch_pytree.tree_leaves((args, kwargs))
       if isinstance(x, torch.Tensor) and mesh_lib.splits_sequence(self.mesh, x.shape)),
      None,
    )
    if lead is None:
      yield
      return
    batch_axes = self.data_axes if lead[0] % self.batch_ways == 0 else ()

    def pin(module, inputs, output):
      first = output[0] if isinstance(output, tuple) and output else output
      if not isinstance(first, torch.Tensor) or tuple(first.shape[:2]) != lead:
        return output
      spec = mesh_lib.batch_spec(batch_axes, 2, sequence=True)
      sharding = NamedSharding(self.mesh, PartitionSpec(*spec, *([PartitionSpec.UNCONSTRAINED] * (first.ndim - 2))))
      if self.pipeline is not None and not self.pipeline.staging:  # outside the stages the rows split over `pp` too
        sharding = self.pipeline.batch_sharding(first.shape) or sharding
      pinned = torch_view(jax.lax.with_sharding_constraint(jax_view(first), sharding))
      return (pinned, *output[1:]) if isinstance(output, tuple) else pinned

    name_of = self._layout.original_module_name if self._layout else (lambda name: name)
    handle = torch.nn.modules.module.register_module_forward_hook(pin)
    try:
      with attention_lib.unsplit.refused(self.module, lead[1], name_of):
        yield
    finally:
      handle.remove()

  # ---- inspection and export ---------------------------------------------------------

  def stored_layout(self) -> dict[str, tuple[list[str], bool]]:
    """Each key of `.params` / `.buffers` → (the original tensor names it holds,
    whether they are stacked along a leading layer dim by scan)."""
    groups = self._layout.groups if self._layout else {}
    return {k: (groups[k], True) if k in groups else ([k], False) for k in [*self.params, *self.buffers]}

  def canonical_name(self, name: str) -> str:
    """A tied tensor's other names (HF's `lm_head.weight`) → the name it is stored under."""
    return self._aliases.get(name, name)

  def is_persistent(self, name: str) -> bool:
    """Whether an original tensor name is part of the state_dict (non-persistent buffers are not)."""
    return self._entries[self.canonical_name(name)].persistent

  @property
  def hooked_modules(self) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of submodules whose state_dict hooks rename or reshape their entries."""
    return list(self._hooked_modules)

  def array_for(self, name: str) -> jax.Array:
    """The array behind one parameter or buffer name of the original module."""
    canonical = self.canonical_name(name)
    stored, index = self._layout.lookup(canonical) if self._layout else (canonical, None)
    arr = self.params[stored] if stored in self.params else self.buffers[stored]
    return arr if index is None else arr[index]

  def state_dict(self) -> dict[str, torch.Tensor]:
    """Original names → plain CPU torch tensors, each copied to host on access."""
    return LazyStateDict(self)

  def load_state_dict(self, state_dict: Mapping, strict: bool = True):
    """torch's `Module.load_state_dict`: the tensors of `state_dict` (the names `state_dict()`
    gives) into the model, each device reading only its block, cast to the dtypes the model
    holds. Returns torch's `(missing_keys, unexpected_keys)`; with `strict` either raises, and a
    shape that differs always does, before anything is loaded. Without `strict`, what is missing
    keeps its values. A train step made before trains the loaded values from its next call
    (its optimizer state stays as it was, as a torch optimizer's does)."""
    missing, unexpected = state_loading.load(
      self, [state_loading.TensorSource(state_dict)], strict=strict, origin="the tensors of the state_dict",
      fix="pass a state_dict of this architecture and size" + ("" if not strict else ", or strict=False to load the names that match"),
    )
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

  def sharding_table(self) -> "ShardingTable":
    rows = []
    for name, arr in {**self.params, **self.buffers}.items():
      spec = self._specs[name]
      sharding = NamedSharding(self.mesh, spec)
      shard = sharding.shard_shape(tuple(arr.shape))
      rows.append(
        dict(
          name=name,
          shape=tuple(arr.shape),
          dtype=str(jnp.dtype(arr.dtype)),
          spec=str(tuple(spec)),
          shard_shape=shard,
          bytes_per_device=math.prod(shard) * jnp.dtype(arr.dtype).itemsize,
        )
      )
    return ShardingTable(rows)


class LazyStateDict(Mapping):
  """The model's `state_dict()` (same names, same tensors) as plain CPU tensors,
  each copied to the host when accessed, never all at once.

  Names come from the torch module's own `state_dict()`, so modules that rename
  on save through state_dict hooks (torchtitan's fused `wqkv` saves as
  `wq`/`wk`/`wv`) keep their names: such a module's hook runs on device arrays
  when one of its entries is read.
  """

  def __init__(self, jm: ShardedModule):
    self._jm = jm
    self._names = jm._state_dict_names
    self._hooked = jm._hooked_modules

  def __getitem__(self, name):
    tensor = host.to_cpu(self.array(name))
    if any(name.startswith(prefix + ".") for prefix, _ in self._hooked):
      return tensor
    dtype = self._jm._entries[self._jm.canonical_name(name)].dtype
    # jax keeps integers in 32 bits: give back torch's own (num_batches_tracked is int64)
    return tensor if dtype.is_floating_point or tensor.dtype == dtype else tensor.to(dtype)

  def array(self, name) -> jax.Array:
    """The entry as a device array, not copied to the host (every process holds its shards)."""
    if name not in self._names:
      raise KeyError(name)
    for prefix, mod in self._hooked:
      if name.startswith(prefix + "."):
        return jax_view(self._from_hooked_module(prefix, mod)[name])
    return self._jm.array_for(name)

  def _from_hooked_module(self, prefix, mod):
    own = {n: torch_view(self._jm.array_for(f"{prefix}.{n}")) for n, _ in module_state.named_tensors(mod)}
    with torchax.default_env(), _compat.reparametrized(mod, own):
      return mod.state_dict(prefix=prefix + ".", keep_vars=True)

  def __iter__(self):
    return iter(self._names)

  def __len__(self):
    return len(self._names)

  def __reduce__(self):
    """`torch.save(jm.state_dict())` / pickle: saved as an OrderedDict of CPU tensors, as
    torch's own state_dict (what `torch.load`'s weights_only unpickler accepts)."""
    return (collections.OrderedDict, (list(self.items()),))


@dataclasses.dataclass
class ShardingTable:
  rows: list[dict]

  def __str__(self) -> str:
    headers = ["name", "shape", "dtype", "spec", "per-device shape", "bytes/device"]
    body = [
      [
        r["name"],
        "x".join(map(str, r["shape"])) or "()",
        r["dtype"],
        r["spec"],
        "x".join(map(str, r["shard_shape"])) or "()",
        human_bytes(r["bytes_per_device"]),
      ]
      for r in self.rows
    ]
    total = sum(r["bytes_per_device"] for r in self.rows)
    body.append(["total", "", "", "", "", human_bytes(total)])
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, body)])


def _check_output_leaves(flat):
  for x in flat:
    if not isinstance(x, (torch.Tensor, type(None), bool, int, float, str)):
      raise TorchOnTpuError(
        f"The model's output contains a {type(x).__name__}, which cannot leave a compiled "
        f"function; return tensors (for HF models pass use_cache=False)."
      )


def _unflatten_output(out_spec, out_leaves):
  it = iter(out_leaves)
  flat = [
    torch_view(next(it)) if t else s for t, s in zip(out_spec["is_tensor"], out_spec["statics"])
  ]
  return _compat.torch_pytree.tree_unflatten(flat, out_spec["tree"])


def _constrain_hook(name, pattern, spec, mesh):
  sharding = NamedSharding(mesh, spec)

  def hook(module, args, output):
    first = output[0] if isinstance(output, tuple) else output
    if not isinstance(first, torch.Tensor):
      return output
    if first.ndim != len(spec):
      raise TorchOnTpuError(
        f"Activation rule '{pattern}' gives spec {tuple(spec)} ({len(spec)} dims) but module "
        f"'{name}' outputs shape {tuple(first.shape)}; give one entry per output dim."
      )
    pinned = torch_view(jax.lax.with_sharding_constraint(jax_view(first), sharding))
    return (pinned, *output[1:]) if isinstance(output, tuple) else pinned

  return hook


def _outermost_hooked_modules(module) -> list[tuple[str, torch.nn.Module]]:
  """Submodules whose state_dict hooks may rename or reshape their entries."""
  found = []
  for prefix, mod in module.named_modules():
    if not prefix or not (mod._state_dict_hooks or mod._state_dict_pre_hooks):
      continue
    if not any(prefix.startswith(outer + ".") for outer, _ in found):
      found.append((prefix, mod))
  return found


_RUNNING_WRAPPED = contextvars.ContextVar("running_wrapped", default=False)


@contextlib.contextmanager
def _running_wrapped():
  """Marks a ShardedModule's own call of its module (which `_refuse_direct_call` lets through)."""
  token = _RUNNING_WRAPPED.set(True)
  try:
    yield
  finally:
    _RUNNING_WRAPPED.reset(token)


def _refuse_direct_call(module, args):
  """A forward pre-hook: the wrapped module holds only meta tensors, so calling it is a mistake."""
  if not _RUNNING_WRAPPED.get():
    raise TorchOnTpuError(
      "This module was wrapped by ShardedModule, which moved its parameters and buffers onto "
      "the mesh and left the module itself on the meta device; call the ShardedModule "
      "(jm(x)) instead, or, for eager CPU use, load jm.state_dict() into a fresh copy of the model."
    )


def _sharding_map_for(module, sharding, mesh, tensors, experts):
  """A preset name as resolution takes it; a family's map (`"fsdp_tp"`) with its `fsdp` entries
  over all the parameter axes (`ep` and `cp` too: neither costs parameter memory) and, on a mesh
  with `ep`, its experts split over the expert-parallel group."""
  if isinstance(sharding, str) and sharding not in ("fsdp", "replicated", "ep"):
    table = sharding_lib.with_param_axes(models.sharding_map(module, sharding), mesh)
    return sharding_lib.with_experts(table, tensors, mesh, experts)
  return sharding


def _to_meta(module: torch.nn.Module) -> None:
  """Frees the host copy of an uploaded model; its values now live on the mesh."""
  module.to_empty(device="meta")
