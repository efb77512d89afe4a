"""Scan over layers: a model's stack of identical blocks runs as one `lax.scan`.

Compile time of an unrolled layer loop grows with depth; a scan compiles the
block once. `StackedLayers` stacks N homogeneous layers' parameters and buffers
along a new leading dim and runs them with `jax.lax.scan`, with a remat policy
per layer. `find_layer_stack` + `ScanLayout` swap a model's own layer container
(torchtitan's `layers` ModuleDict iterated with `.values()`, HF's
`model.layers` ModuleList sliced with `[:n]`) for a container whose iteration
yields one view per layer, served from one scan over the whole stack, so the
model's forward runs unchanged.

Names stay the model's: sharding maps written for `layers.*.attention.wo.weight`
resolve on the per-layer names and the stacked parameter gets `None` on its
layer dim; `state_dict()` and checkpoints read `layers.3.attention.wo.weight`
as slice 3 of the stacked array.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import PartitionSpec

from torch_on_tpu import models
from torch_on_tpu.core import _compat
from torch_on_tpu.errors import TorchOnTpuError, arg
from torch_on_tpu.lowering import device_checks, target_device
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.parallel import mesh as mesh_lib
from torch_on_tpu.wrapper import module_state

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

logger = logging.getLogger(__name__)

# The stacked copy of layer 0's tensors lives at `<stack path>.<SCAN>.<LAYER>.<name in layer>`.
SCAN = "scan"
LAYER = "layer"


def _stack_params(layers: list[torch.nn.Module], name: str, is_param: bool) -> torch.Tensor:
  """One per-layer tensor name stacked along a new leading layer dim (meta stays meta)."""
  get = (lambda m: m.get_parameter(name)) if is_param else (lambda m: m.get_buffer(name))
  first = get(layers[0])
  if first.device.type == "meta":
    stacked = torch.empty((len(layers), *first.shape), dtype=first.dtype, device="meta")
  else:
    stacked = torch.stack([get(layer).detach() for layer in layers])
  return torch.nn.Parameter(stacked, requires_grad=first.requires_grad) if is_param else stacked


class StackedLayers(torch.nn.Module):
  """N homogeneous layers whose tensors are stacked, run as one `jax.lax.scan`
  (or, with `scan=False`, as a Python loop over the same stacked tensors).

  Call it like one layer: `h = scanned(h, *extra, **kw)`. The extra positional
  and keyword arguments are the same for every layer (RoPE tables, masks,
  position ids, HF's `position_embeddings` tuple). A layer returns the hidden
  state, or a tuple whose first element is the hidden state (its other
  elements, an aux loss say, leave the scan per layer); called directly it
  returns the last layer's output. A model that calls its layers by keyword
  only (Flux's `img, txt = block(img=img, txt=txt, vec=vec, pe=pe)`) carries
  several states: the leading tensor keywords, as many as the layer returns.

  Same class and same tensors do not make the same function: a layer may
  steer its control flow by its own attributes (rotary embedding on some
  layers only, a different block every other layer). So at each trace every
  layer is traced on its own (its own module object, its slice of the stacked
  tensors) and the jaxprs are compared: identical layers run as one scan;
  layers that repeat with a period p run as a scan over groups of p; layers
  with no repeat run as a loop, said once in the log. The loop calls each
  layer's own module, so it computes exactly what the unscanned model does.

  Args:
    layers: the layers, all of one class with the same tensor names, shapes
      and dtypes. Layer 0 becomes the template; its tensors are replaced by
      stacked ones (leading dim N).
    remat: per-layer rematerialisation policy name (see `torch_on_tpu.lowering.remat`);
      None: `remat.SCANNED_DEFAULT` for a scan (matmul and attention outputs
      kept, elementwise work recomputed: what the unrolled loop keeps), `none`
      for a loop.
    unroll: how many scan iterations run unrolled (`lax.scan(unroll=)`).
    scan: True: one scan; False: a Python loop over the layers (same remat),
      for comparison or per-layer remat without a scan; compile time then
      grows with depth.
    pipeline: a `torch_on_tpu.parallel.pipeline.Pipeline`: the stack runs as pipeline
      stages over the mesh's `pp` axis (the stacked tensors then hold the
      layers in the schedule's `storage_order`).
    carry_sharding: `(ndim, batch, length) → NamedSharding` of a hidden state (ShardedModule's
      batch sharding): the scan's carry is pinned to it on every layer, so the partitioner
      keeps the activations split over the batch rather than choosing a layout that
      reshards them in every layer.
    inputs_period: the model's loop hands layer i the inputs it hands layer i mod p (HF's
      `layer_types`: a mask per attention kind); see `call_layer`.
  """

  def __init__(
    self,
    layers,
    *,
    remat: str | None = None,
    unroll: int = 1,
    scan: bool = True,
    pipeline=None,
    carry_sharding=None,
    inputs_period: int = 1,
  ):
    super().__init__()
    layers = list(layers)
    if not layers:
      raise TorchOnTpuError("StackedLayers needs at least one layer.")
    problem = homogeneity_problem(layers)
    if problem:
      raise TorchOnTpuError(f"StackedLayers needs identical layers: {problem}.")
    self.num_layers = len(layers)
    self._family = models.family_of(layers[0])  # whose hooks capture per-layer outputs
    self.remat = remat_lib.layer_policy(remat, scanned=scan)
    if remat is None and scan:
      _say_default_policy_once()
    self._named = remat_lib.named(self.remat)  # a policy that names the layer's modules: their outputs tagged
    if self._named is not None:
      _check_module_globs(self._named, layers[0], self.remat)
    self.unroll = unroll
    self.scanned = scan
    self.pipeline = pipeline
    self.carry_sharding = carry_sharding
    self.inputs_period = inputs_period
    self._seen_inputs: list[tuple] = []  # this pass's inputs of the layers run before a periodic scan
    if pipeline is not None and not scan:
      raise TorchOnTpuError(
        "Pipeline stages split a scanned layer stack, but StackedLayers got scan=False; use scan=True."
      )
    template = layers[0]
    stored = pipeline.schedule.storage_order(len(layers)) if pipeline else range(len(layers))
    in_storage = [layers[i] for i in stored]
    stacked_params = {n: _stack_params(in_storage, n, True) for n, _ in template.named_parameters()}
    stacked_buffers = {n: _stack_params(in_storage, n, False) for n, _ in template.named_buffers()}
    for name, t in {**stacked_params, **stacked_buffers}.items():
      module_state.set_tensor(template, name, t, is_param=name in stacked_params)
    self.add_module(LAYER, template)
    # Every layer's own module object (a tuple is not registered as submodules, so
    # their stale per-layer tensors never show in named_parameters()).
    self._layers = tuple(layers)
    self._said_unrolled = False
    self._stack_cache: _StackCache | None = None
    # The keywords that carry the hidden states from layer to layer; () = the first positional argument.
    self._state_names: tuple[str, ...] = ()

  def __getattr__(self, name):
    # Used directly as one module, it answers for its template layer's attributes.
    try:
      return super().__getattr__(name)
    except AttributeError:
      if LAYER not in self.__dict__.get("_modules", {}):
        raise
      return getattr(self._modules[LAYER], name)

  def train(self, mode: bool = True):
    super().train(mode)
    for layer in self._layers:  # the unregistered layers follow train/eval too
      layer.train(mode)
    return self

  def _stacked(self) -> dict[str, jax.Array]:
    return {n: jax_view(t) for n, t in module_state.named_tensors(self._modules[LAYER])}

  def _run_one(self, index: int, extras: dict, args, kwargs, h, tensors, key):
    """Layer `index`'s own module on the hidden state `h`, with its slice of the stacked
    tensors: (new hidden state, (arrays of the output-capture calls it recorded,
    arrays of its other outputs, its buffers' new values by name))."""
    layer = self._layers[index]
    template = self._modules[LAYER]
    h = jax.tree.map(lambda a: checkpoint_name(a, remat_lib.LAYER_INPUT_NAME), h)  # what `offload_inputs` moves
    # traced by scans, remat and the layer comparison: its index reads are not collected
    # as checks of the whole program (device_checks)
    with torchax.default_env().override_property(prng=key), _swapped(layer, tensors), device_checks.not_collected():
      with self._family.deferred_layer_outputs(layer, template) as records, _tagged_outputs(layer, self._named):
        if self._state_names:
          out = layer(*args, **kwargs, **dict(zip(self._state_names, torch_view(h))))
        else:
          out = layer(torch_view(h), *args, **kwargs)
      updates = _buffer_updates(layer, tensors)
    if self._state_names:
      states = len(self._state_names)
      hidden, rest = tuple(out[:states]), tuple(out[states:]) or None
    else:
      hidden, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    rest_leaves, extras.setdefault("rest", {})[index] = _split_tree(rest)
    record_leaves = []
    if records:
      record_leaves, extras.setdefault("records", {})[index] = _split_records(records)
    return jax_view(hidden), (record_leaves, rest_leaves, updates)

  def _layer_output(self, extras, index: int, hidden, produced) -> tuple:
    """(layer `index`'s output in its own form, its recorded capture calls)."""
    record_leaves, rest_leaves, _ = produced
    rest = _rebuild_tree(extras["rest"][index], rest_leaves)
    if self._state_names:
      out = (*torch_view(hidden), *(rest or ()))
    else:
      out = torch_view(hidden) if rest is None else (torch_view(hidden), *rest)
    records = _rebuild_records(extras["records"][index], record_leaves) if record_leaves else []
    return out, records

  def _stack(self, hidden, inputs: list[tuple], start: int = 0, count: int | None = None) -> list[tuple]:
    """Layers `start` to `start + count` (default: to the last) in order from `hidden`, layer i
    given `inputs[(i - start) % len(inputs)]` (its `(args, kwargs)`): each layer's (output,
    recorded capture calls)."""
    count = self.num_layers - start if count is None else count
    for _, kwargs in inputs:
      _refuse_caches(kwargs)
    if self.pipeline is not None:
      return self._pipelined(hidden, *inputs[0])
    every = self._stacked()
    env = torchax.default_env()
    keys = jax.random.split(env.get_and_rotate_prng_key(), self.num_layers)[start : start + count]
    stacked = every if count == self.num_layers else jax.tree.map(lambda a: a[start : start + count], every)
    extras = {}
    h = jax_view(hidden)
    period = self._period(extras, inputs, start, h, stacked, keys) if self.scanned else count
    run = [
      remat_lib.checkpoint(functools.partial(self._run_one, start + j, extras, *inputs[j % len(inputs)]), self.remat)
      for j in range(period)
    ]
    outputs, updates = [], {}
    if period == count:
      for i in range(count):
        h, produced = run[i](h, jax.tree.map(lambda a, i=i: a[i], stacked), keys[i])
        outputs.append(self._layer_output(extras, start + i, h, produced))
        updates[start + i] = produced[2]
      self._write_buffers(every, updates)
      return outputs
    groups = count // period
    last, per_layer = self._scan_groups(run, h, stacked, keys)
    for g in range(groups):
      for j in range(period):
        h_g, produced = jax.tree.map(lambda a, g=g: a[g], per_layer[j])
        if (g, j) == (groups - 1, period - 1):
          # the stack's output is the scan's final carry, not a slice of the per-layer outputs:
          # where nothing reads an earlier layer's output, the program then drops that stacked
          # [layers, ...] buffer and its cotangent (two copies of every layer's hidden state)
          h_g = last
        outputs.append(self._layer_output(extras, start + j, h_g, produced))
        updates[start + g * period + j] = produced[2]
    self._write_buffers(every, updates)
    return outputs

  def _scan_groups(self, run, h, stacked, keys):
    """The layers of `stacked` (leading dim a multiple of `len(run)`, the period) as one
    scan over groups of a period: (last hidden state, per period position: its
    (hidden states, produced arrays) stacked over the groups)."""
    period = len(run)
    groups = keys.shape[0] // period
    # A period of one layer scans the stacked arrays as they are: the layer's weights are
    # then the scan's own per-iteration slices, which jax does not save again as stacked
    # residuals (a slice of a regrouped array it would, a copy of every stacked weight).
    grouped = (stacked, keys) if period == 1 else jax.tree.map(
      lambda a: a.reshape(groups, period, *a.shape[1:]), (stacked, keys)
    )

    entry = jax.tree.map(lambda a: a.dtype, h)
    widened = self._widened(run, h, grouped, period)
    if widened is not None:  # the carry takes the dtype the layers hand on; the first layer still gets h's own
      h = jax.tree.map(lambda a, d: a.astype(d), h, widened)

    def body(h, xs):
      tensors, group_keys, group = xs
      per_layer = []
      h = self._pinned(h)
      for j in range(period):
        pick = (lambda a: a) if period == 1 else (lambda a, j=j: a[j])
        layer = lambda h, run=run[j], t=jax.tree.map(pick, tensors), k=pick(group_keys): run(h, t, k)  # noqa: E731
        if widened is not None and j == 0:
          as_entered = lambda h: layer(jax.tree.map(lambda a, d: a.astype(d), h, entry))  # noqa: E731 (exact: h was widened)
          h, produced = jax.lax.cond(group == 0, as_entered, layer, h)
        else:
          h, produced = layer(h)
        per_layer.append((h, produced))
      return self._pinned(h), per_layer

    return jax.lax.scan(body, h, (*grouped, jnp.arange(groups)), unroll=self.unroll)

  def _widened(self, run, h, grouped, period):
    """The dtypes a group hands on where they differ from the ones it gets (HF Mamba adds its
    residual in fp32: a bf16 hidden state comes out fp32), else None. The scan then carries the
    wider dtype and runs the first layer on the hidden state as it came (widening it is exact,
    narrowing it back too), so every layer sees what it sees in a loop, as in torch."""
    tensors, keys = grouped
    first = jax.tree.map(lambda a: a[0], tensors)
    out = h
    for j in range(period):
      pick = (lambda a: a) if period == 1 else (lambda a, j=j: a[j])
      out, _ = jax.eval_shape(run[j], out, jax.tree.map(pick, first), pick(keys[0]))
    if jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, h):
      return None
    return jax.tree.map(lambda a: a.dtype, out)

  def _pinned(self, h):
    """The hidden state laid out as `carry_sharding` says (as it is without one), and, where the
    layers keep their inputs on a TPU beside matmul outputs sent to host memory (`offload_dots`),
    row-major: the TPU compiler otherwise stores the kept inputs token-minor, as the transfers
    leave, and copies the whole stack back before the backward loop (Llama 3.1 8B on v6e-8:
    temporaries 16.5 → 12.9 GiB, HBM traffic 487 → 478 GB; elsewhere its own choice reads less)."""
    if self.carry_sharding is not None:
      pin = lambda a: jax.lax.with_sharding_constraint(a, self.carry_sharding(a.ndim, *a.shape[:2])) if a.ndim >= 2 else a  # noqa: E731
      h = jax.tree.map(pin, h)
    if self.remat == "offload_dots" and target_device.device().platform == "tpu":
      row_major = lambda a: with_layout_constraint(a, Layout(major_to_minor=tuple(range(a.ndim)))) if a.ndim >= 2 else a  # noqa: E731
      h = jax.tree.map(row_major, h)
    return h

  def _pipelined(self, hidden, args, kwargs) -> list[tuple]:
    """The stack as pipeline stages (`torch_on_tpu.parallel.pipeline`): the last layer's output,
    and for the layers before it a NaN stand-in (a pipeline hands no intermediate
    layer's output to the model; one that used it would see NaN, never a wrong number)."""
    schedule = self.pipeline.schedule
    n = self.num_layers
    stacked = self._stacked()  # stored in schedule.storage_order
    env = torchax.default_env()
    keys = jax.random.split(env.get_and_rotate_prng_key(), n)[np.asarray(schedule.storage_order(n))]
    h = jax_view(hidden)
    extras = {}
    name = type(self._layers[0]).__name__
    period = self._period(extras, [(args, kwargs)], 0, h, stacked, keys, loop_ok=False)
    per_block = n // (schedule.stages * schedule.virtual_stages)
    if per_block % period:
      raise TorchOnTpuError(
        f"The {n} {name} layers repeat every {period} layers but a pipeline block holds {per_block} "
        f"(pp={schedule.stages} × virtual_stages={schedule.virtual_stages}); pick pp and virtual_stages "
        f"so that {n} / (pp × virtual_stages) is a multiple of {period}."
      )
    problem = self.pipeline.batch_problem(h.shape[0])
    if problem:
      raise TorchOnTpuError(f"Pipeline: {problem}.")
    leaves, tree = _compat.torch_pytree.tree_flatten((args, kwargs))
    rows = [isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == h.shape[0] for x in leaves]
    if any(rows) and h.ndim > 1 and h.shape[0] == h.shape[1]:
      raise TorchOnTpuError(
        f"Pipeline: the batch reaching the layer stack has {h.shape[0]} rows, as many as its sequence "
        f"positions, so per-row layer arguments cannot be told from per-position ones; use a batch "
        f"size other than {h.shape[0]}."
      )
    per_example = [jax_view(x) for x, r in zip(leaves, rows) if r]
    buffers = {n for n, _ in self._modules[LAYER].named_buffers()}
    state = {n: a for n, a in stacked.items() if n in buffers}
    weights = {n: a for n, a in stacked.items() if n not in buffers}

    def stage(block, h_mb, mine, microbatch, block_state):
      tensors, block_keys = block
      tensors = {**tensors, **block_state}
      it = iter(mine)
      own = [torch_view(next(it)) if r else x for x, r in zip(leaves, rows)]
      margs, mkwargs = _compat.torch_pytree.tree_unflatten(own, tree)
      run = [
        remat_lib.checkpoint(functools.partial(self._run_one, j, extras, margs, mkwargs), self.remat)
        for j in range(period)
      ]
      block_keys = jax.vmap(lambda k: jax.random.fold_in(k, microbatch))(block_keys)
      h_mb, per_layer = self._scan_groups(run, h_mb, tensors, block_keys)
      if any(leaf for _, (records, rest, _) in per_layer for leaf in (records, rest)) or extras.get("records"):
        raise TorchOnTpuError(
          f"A {name} layer returns more than its hidden state (extra outputs, or outputs the model "
          f"captures per layer), which a pipeline cannot hand back per layer; train without pp or "
          f"turn the per-layer outputs off."
        )
      return h_mb, _block_buffers(block_state, [updates for _, (_, _, updates) in per_layer])

    out, state = self.pipeline.run(stage, (weights, keys), h, per_example, state)
    template = self._modules[LAYER]
    for name, value in state.items():  # in the stored order, as the stacked buffers keep them
      _compat.set_array(template.get_buffer(name), value)
    stand_in = (torch_view(jnp.full(h.shape, jnp.nan, h.dtype)), [])
    return [stand_in] * (n - 1) + [(torch_view(out), [])]

  def _write_buffers(self, stacked: dict, updates: dict[int, dict]) -> None:
    """Buffer updates the layers made in their forward (MoE token counts, running
    statistics), per layer index, written into the stacked buffers (carried out of
    the scan as per-layer outputs, like a layer's other outputs)."""
    template = self._modules[LAYER]
    for name in sorted({n for per_layer in updates.values() for n in per_layer}):
      old = stacked[name]
      new = jax.numpy.stack([updates[i].get(name, old[i]) if i in updates else old[i] for i in range(self.num_layers)])
      _compat.set_array(template.get_buffer(name), new)

  def forward(self, hidden, *args, **kwargs):
    """Every layer in order; returns the last layer's output."""
    outputs = self._stack(hidden, [(args, kwargs)])
    for _, records in outputs:
      self._family.replay_layer_outputs(self._modules[LAYER], records)
    return outputs[-1][0]

  def _period(self, extras, inputs, start, h, stacked, keys, *, loop_ok: bool = True) -> int:
    """The smallest p, a multiple of the inputs' period, dividing the n layers of `stacked`
    (from layer `start`) such that layer i computes the same function as layer i mod p
    (`loop_ok=False`: no such p < n is refused, not run as a loop)."""
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    per_layer = {n: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for n, a in stacked.items()}
    n, m = keys.shape[0], len(inputs)
    signatures = [
      _jaxpr_signature(
        jax.make_jaxpr(functools.partial(self._run_one, start + i, extras, *inputs[i % m]))(
          jax.tree.map(abstract, h), per_layer, abstract(keys[i])
        )
      )
      for i in range(n)
    ]
    period = next(p for p in range(m, n + 1, m) if not n % p and all(signatures[i] == signatures[i % p] for i in range(n)))
    if period == n and n > 1 and not loop_ok:
      raise TorchOnTpuError(
        f"The {n} {type(self._layers[0]).__name__} layers do not all compute the same function (layer "
        f"{next(i for i in range(n) if signatures[i] != signatures[0])} differs from layer 0), so they "
        f"cannot be split into pipeline stages; train this model without pp."
      )
    if period == n and n > m:
      self._say_unrolled(
        f"the {n} {type(self._layers[0]).__name__} layers do not all compute the same function (layer "
        f"{start + next(i for i in range(n) if signatures[i] != signatures[i % m])} differs from layer "
        f"{start + next(i for i in range(n) if signatures[i] != signatures[i % m]) % m}), so they "
        f"run as a loop, one layer after another, exactly as unscanned"
      )
    return period

  def _say_unrolled(self, why: str) -> None:
    if not self._said_unrolled:
      self._said_unrolled = True
      logger.warning("scan: %s.", why)

  def keyword_states(self, kwargs) -> tuple[str, ...]:
    """The keywords a layer called by keyword only hands on to the next: its leading tensor
    keywords that its output's leading tensors match in shape and dtype (traced once,
    abstractly; the rest of its output leaves the scan per layer); a refusal when none do.
    Layer 1 must then get exactly those outputs, or the layers run one at a time."""
    layer = self._layers[0]
    per_layer = {n: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for n, a in self._stacked().items()}

    def returned(tensors):
      with torchax.default_env().override_property(prng=jax.random.key(0)), _swapped(layer, tensors):
        return jax_view(layer(**kwargs))

    out = jax.eval_shape(returned, per_layer)
    out = out if isinstance(out, tuple) else (out,)
    names = []
    for name, o in zip((n for n, v in kwargs.items() if isinstance(v, torch.Tensor)), out):
      given = jax_view(kwargs[name])
      if not isinstance(o, jax.ShapeDtypeStruct) or (o.shape, o.dtype) != (given.shape, given.dtype):
        break
      names.append(name)
    if not names:
      raise TorchOnTpuError(
        f"The model calls its scanned {type(layer).__name__} layers by keyword, and a layer's output does not "
        f"start with its first keyword tensor (the state scan would carry); pass the hidden state as the "
        f"first positional argument or use {arg('scan', False)}."
      )
    return tuple(names)

  def call_layer(self, index: int, hidden, args, kwargs):
    """What the model's own loop calls for layer `index` (through `_LayerView`).

    Layer 0's call runs the whole stack (a scan) from its input and keeps every
    layer's output; layer i's call then hands back layer i's output, as long as
    the model passes on exactly what layer i - 1 returned, with the same other
    arguments. A model that changes the hidden state or the arguments between
    layers (per-layer masks, skipped layers) gets those layers run one at a time,
    unrolled, on what it passes: its own loop, computed as written.

    With an `inputs_period` p > 1 (the loop hands layer i what it handed layer i mod p),
    layers 0 to p - 1 run one at a time and what each got is kept; layer p's call, given
    what layer 0 got, runs the whole groups of p after them as one scan over groups, each
    position with its own inputs, and the layers past the last whole group run one at a
    time again.
    """
    if self.inputs_period > 1:
      return self._call_periodic(index, hidden, args, kwargs)
    cache = self._stack_cache
    if index == 0 or cache is None or not cache.serves(index, hidden, args, kwargs):
      if index == 0:
        outputs = self._stack(hidden, [(args, kwargs)])
        self._stack_cache = _StackCache([(args, kwargs)], outputs)
        return self._serve(0)
      self._stack_cache = None
      if self.pipeline is not None:
        raise TorchOnTpuError(
          f"The model changes the hidden state or the arguments between its {type(self._layers[0]).__name__} "
          f"layers (at layer {index}), so they cannot run as one pipelined stack; train it without pp."
        )
      self._say_unrolled(
        f"the model changes the hidden state or the arguments between its {type(self._layers[0]).__name__} "
        f"layers, so from layer {index} on they run one at a time, unrolled (compile time grows with depth)"
      )
      return self.run_layer(index, hidden, *args, **kwargs)
    return self._serve(index)

  def _call_periodic(self, index: int, hidden, args, kwargs):
    """`call_layer` for a loop whose inputs repeat every `inputs_period` layers."""
    p = self.inputs_period
    cache = self._stack_cache
    if index == 0:
      self._seen_inputs, self._stack_cache = [], None
    elif cache is not None:
      if cache.serves(index, hidden, args, kwargs):
        return self._serve(index)
      self._stack_cache = None
      self._say_unrolled(
        f"the model's inputs to its {type(self._layers[0]).__name__} layers stop repeating every {p} "
        f"layers at layer {index}, so from there on they run one at a time, unrolled"
      )
    groups = (self.num_layers - p) // p
    if index < p and index == len(self._seen_inputs):
      self._seen_inputs.append((args, kwargs))
    elif index == p and len(self._seen_inputs) == p and groups and _same_arguments((args, kwargs), self._seen_inputs[0]):
      outputs = self._stack(hidden, self._seen_inputs, start=p, count=groups * p)
      self._stack_cache = _StackCache(self._seen_inputs, outputs, start=p)
      return self._serve(index)
    return self.run_layer(index, hidden, *args, **kwargs)

  def _serve(self, index: int):
    cache = self._stack_cache
    out, records = cache.outputs[index - cache.start]
    self._family.replay_layer_outputs(self._modules[LAYER], records)
    states = len(self._state_names)
    if states:
      cache.returned[index] = tuple(out[:states])
    else:
      cache.returned[index] = out[0] if isinstance(out, tuple) else out
    if index == cache.start + len(cache.outputs) - 1:
      self._stack_cache = None  # the stack's pass is over; keep no traced values
      self._seen_inputs = []
    return out

  def run_layer(self, index: int, hidden, *args, **kwargs):
    """Layer `index` alone, unrolled, on exactly the given input and arguments."""
    _refuse_caches(kwargs)
    index = range(self.num_layers)[index]
    extras = {}
    key = jax.random.split(torchax.default_env().get_and_rotate_prng_key(), self.num_layers)[index]
    tensors = jax.tree.map(lambda a: a[index], self._stacked())
    run = remat_lib.checkpoint(functools.partial(self._run_one, index, extras, args, kwargs), self.remat)
    h, produced = run(jax_view(hidden), tensors, key)
    self._write_buffers(self._stacked(), {index: produced[2]})
    out, records = self._layer_output(extras, index, h, produced)
    self._family.replay_layer_outputs(self._modules[LAYER], records)
    return out


class _StackCache:
  """One pass of the model's loop over a scanned stack: the outputs of the layers from
  `start`, the inputs each got (by position, repeating), and what was handed out, to check
  the model passes them on unchanged."""

  def __init__(self, inputs: list[tuple], outputs, start: int = 0):
    self.inputs, self.start = inputs, start
    self.outputs = outputs
    self.returned: dict[int, object] = {}

  def serves(self, index: int, hidden, args, kwargs) -> bool:
    if not self.start < index < self.start + len(self.outputs):
      return False
    before = self.returned.get(index - 1)
    if isinstance(hidden, tuple):  # several states, by keyword
      same = isinstance(before, tuple) and len(before) == len(hidden) and all(a is b for a, b in zip(hidden, before))
    else:
      same = hidden is before
    return same and _same_arguments((args, kwargs), self.inputs[(index - self.start) % len(self.inputs)])


def _same_arguments(a, b) -> bool:
  """The same tensors (by identity) and equal plain values."""
  flat_a, tree_a = _compat.torch_pytree.tree_flatten(a)
  flat_b, tree_b = _compat.torch_pytree.tree_flatten(b)
  if tree_a != tree_b:
    return False
  for x, y in zip(flat_a, flat_b):
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
      if x is not y:
        return False
    else:
      try:
        if not bool(x == y):
          return False
      except Exception:  # noqa: BLE001 (values without a plain ==)
        if x is not y:
          return False
  return True


class _LayerView:
  """`container[i]` of a scanned stack (torch's `TransformerEncoder` reads `layers[0]`):
  layer i's attributes, its slice of each stacked tensor, and calling it runs layer i."""

  def __init__(self, scanned: StackedLayers, index: int, path: str = ""):
    self._scanned = scanned
    self._index = index
    self._path = path

  def _module(self) -> torch.nn.Module:
    layer = self._scanned._layers[self._index]
    return layer.get_submodule(self._path) if self._path else layer

  def __getattr__(self, name):
    module = self._module()
    full = f"{self._path}.{name}" if self._path else name
    if any(name in own for own in _compat.module_tensor_dicts(module)):
      template = self._scanned._modules[LAYER]
      owner = template.get_submodule(self._path) if self._path else template
      stacked = getattr(owner, name)
      return None if stacked is None else stacked[self._index]
    value = getattr(module, name)
    if isinstance(value, torch.nn.Module):
      return _LayerView(self._scanned, self._index, full)
    return value

  def __call__(self, *args, **kwargs):
    if self._path:
      raise TorchOnTpuError(
        f"The model calls '{self._path}' of one scanned layer on its own; scan runs whole layers, "
        f"so use {arg('scan', False)}."
      )
    scanned = self._scanned
    if args:
      scanned._state_names = ()
      return scanned.call_layer(self._index, args[0], args[1:], kwargs)
    if self._index == 0 or not scanned._state_names:
      scanned._state_names = scanned.keyword_states(kwargs)
    names = scanned._state_names
    others = {k: v for k, v in kwargs.items() if k not in names}
    return scanned.call_layer(self._index, tuple(kwargs[n] for n in names), (), others)


class ScanContainer(torch.nn.Module):
  """Stands where the model's layer container stood. Iterating it (directly,
  `.values()`, slices) or indexing it yields one `_LayerView` per layer: layer
  i's attributes, and a call that the `StackedLayers` serves from one scan over
  the whole stack (see `StackedLayers.call_layer`)."""

  def __init__(self, scanned: StackedLayers, stack: LayerStack):
    super().__init__()
    self.add_module(SCAN, scanned)
    self._original_type = type(stack.container).__name__
    scanned_keys = {k: i for i, k in enumerate(stack.keys)}
    self._order = [(k, scanned_keys.get(k)) for k in stack.all_keys]
    for key, index in self._order:
      if index is None:  # a block outside the identical run keeps its place and names
        self.add_module(key, stack.container._modules[key])

  def _views(self) -> list:
    scanned = self._modules[SCAN]
    return [self._modules[k] if i is None else _LayerView(scanned, i) for k, i in self._order]

  def __iter__(self):
    return iter(self._views())

  def values(self):
    return self._views()

  def __len__(self):
    return len(self._order)

  def __getitem__(self, index):
    n = len(self._order)
    if isinstance(index, slice):
      return self._views()[index]
    if isinstance(index, str) and index in [k for k, _ in self._order]:  # a ModuleDict's key
      index = [k for k, _ in self._order].index(index)
    if isinstance(index, int) and -n <= index < n:
      return self._views()[index]
    raise TorchOnTpuError(
      f"The model indexes its scanned {self._original_type} with [{index!r}], which names no layer "
      f"of its {n}."
    )


@dataclasses.dataclass
class LayerStack:
  """Where a model keeps its blocks: `path` of the container, the child keys of the
  run of identical blocks that scans (`keys`), and all child keys in order."""

  path: str
  keys: list[str]
  container: torch.nn.Module
  all_keys: list[str] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    self.all_keys = self.all_keys or list(self.keys)

  @property
  def layers(self) -> list[torch.nn.Module]:
    return [self.container._modules[k] for k in self.keys]


def find_layer_stack(module: torch.nn.Module) -> LayerStack | None:
  """The ModuleList/ModuleDict holding the most parameters in ≥2 same-class blocks."""
  best, best_count = None, 0
  for path, mod in module.named_modules():
    if not isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)) or len(mod) < 2:
      continue
    keys = list(mod._modules)
    kinds = {type(mod._modules[k]) for k in keys}
    if len(kinds) != 1:
      continue
    count = sum(p.numel() for p in mod.parameters())
    if count > best_count:
      best, best_count = LayerStack(path, keys, mod, keys), count
  return best


def longest_identical_run(stack: LayerStack) -> LayerStack | None:
  """The longest run of ≥ 2 consecutive blocks that stack (same class, tensor names,
  shapes and dtypes, none shared), as a LayerStack over the same container; or None."""
  layers = [stack.container._modules[k] for k in stack.all_keys]
  kinds = [(type(m), tuple(_signature(m).items())) for m in layers]
  best = (0, 0)
  start = 0
  for i in range(1, len(layers) + 1):
    if i == len(layers) or kinds[i] != kinds[start]:
      if i - start > best[1] - best[0]:
        best = (start, i)
      start = i
  begin, end = best
  if end - begin < 2 or homogeneity_problem(layers[begin:end]):
    return None
  return LayerStack(stack.path, stack.all_keys[begin:end], stack.container, stack.all_keys)


def homogeneity_problem(layers: list[torch.nn.Module]) -> str | None:
  """Why these layers cannot be stacked (first differing layer and tensor), or None."""
  first = layers[0]
  ref = _signature(first)
  seen = {id(t) for _, t in module_state.named_tensors(first)}
  for i, layer in enumerate(layers[1:], start=1):
    if type(layer) is not type(first):
      return f"layer {i} is a {type(layer).__name__}, layer 0 a {type(first).__name__}"
    sig = _signature(layer)
    for name in ref:
      if name not in sig:
        return f"layer {i} has no tensor '{name}' that layer 0 has"
      if sig[name] != ref[name]:
        return f"layer {i}'s '{name}' is {sig[name]}, layer 0's is {ref[name]}"
    extra = [n for n in sig if n not in ref]
    if extra:
      return f"layer {i} has a tensor '{extra[0]}' that layer 0 lacks"
    shared = [n for n, t in module_state.named_tensors(layer) if id(t) in seen]
    if shared:
      return f"layer {i} shares its tensor '{shared[0]}' with another layer"
    seen.update(id(t) for _, t in module_state.named_tensors(layer))
  return None


class ScanLayout:
  """How a model's per-layer tensors map to stacked ones, and back.

  Built before materialisation from the model's original structure; `groups`
  (stacked name → per-layer names) tells materialisation what to stack;
  `apply` swaps the container afterwards.
  """

  def __init__(self, stack: LayerStack, entries, *, pipeline=None, inputs_period: int = 1):
    self.stack = stack
    self.pipeline = pipeline
    self.inputs_period = inputs_period
    self.prefix = f"{stack.path}." if stack.path else ""
    self.internal_prefix = f"{self.prefix}{SCAN}.{LAYER}."
    order = pipeline.schedule.storage_order(len(stack.keys)) if pipeline else range(len(stack.keys))
    per_layer = [f"{self.prefix}{stack.keys[i]}." for i in order]
    template = stack.layers[0]
    self.names_in_layer = [n for n, _ in module_state.named_tensors(template)]
    self.groups: dict[str, list[str]] = {
      self.internal_prefix + n: [p + n for p in per_layer] for n in self.names_in_layer
    }
    self._where = {orig: (internal, i) for internal, group in self.groups.items() for i, orig in enumerate(group)}
    names = {e.name for e in entries}
    aliased = [a for e in entries for a in e.aliases if a in self._where or e.name in self._where]
    if aliased:
      raise TorchOnTpuError(
        f"Cannot scan '{stack.path}': its tensor '{aliased[0]}' is tied to another tensor; use {arg('scan', False)}."
      )
    missing = [o for o in self._where if o not in names]
    if missing:
      raise TorchOnTpuError(f"Cannot scan '{stack.path}': tensor '{missing[0]}' is not a distinct tensor.")

  def original_module_name(self, name: str) -> str:
    """A module name in the swapped model → its name in layer 0 of the original."""
    inside = self.internal_prefix[:-1]
    if name == inside or name.startswith(self.internal_prefix):
      return f"{self.prefix}{self.stack.keys[0]}{name[len(inside):]}"
    return name

  def lookup(self, name: str) -> tuple[str, int | None]:
    """Original name → (stored name, layer index or None when not stacked)."""
    return self._where.get(name, (name, None))

  def internal_specs(self, specs: Mapping[str, PartitionSpec]) -> dict[str, PartitionSpec]:
    out = {k: v for k, v in specs.items() if k not in self._where}
    for internal, group in self.groups.items():
      first = specs[group[0]]
      for orig in group[1:]:
        if specs[orig] != first:
          raise TorchOnTpuError(
            f"Scanned layers need one sharding per stacked tensor, but '{orig}' resolves to "
            f"{tuple(specs[orig])} and '{group[0]}' to {tuple(first)}; write the map with '*' for "
            f"the layer index or use {arg('scan', False)}."
          )
      layer_axis = None
      if self.pipeline is not None:
        layer_axis = mesh_lib.PIPELINE_AXIS
        if any(layer_axis in ((e,) if isinstance(e, str) else tuple(e or ())) for e in first):
          raise TorchOnTpuError(
            f"The sharding map puts '{group[0]}' on the '{layer_axis}' axis, which already splits the "
            f"stacked layers into pipeline stages; shard layer tensors over the other axes."
          )
      out[internal] = PartitionSpec(layer_axis, *first)
    return out

  def apply(
    self,
    module: torch.nn.Module,
    *,
    remat: str | None,
    unroll: int,
    scan: bool,
    carry_sharding=None,
  ) -> StackedLayers:
    """Swaps the model's layer container for the scan (in place)."""
    scanned = StackedLayers(
      self.stack.layers, remat=remat, unroll=unroll, scan=scan, pipeline=self.pipeline,
      carry_sharding=carry_sharding, inputs_period=self.inputs_period,
    )
    container = ScanContainer(scanned, self.stack)
    owner_path, _, leaf = self.stack.path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    setattr(owner, leaf, container)
    return scanned


def layout_for(module: torch.nn.Module, entries, *, pipeline=None) -> ScanLayout | None:
  """The scan layout for a model's layer stack, or None (with the reason logged); with a
  `pipeline`, a stack that cannot scan or split into its stages is refused instead."""

  def cannot(why: str):
    if pipeline is not None:
      raise TorchOnTpuError(
        f"pp={pipeline.schedule.stages} splits a scanned layer stack into stages, but {why}; "
        f"train this model without pp."
      )
    logger.warning("scan=True: %s; running unscanned.", why)

  stack = find_layer_stack(module)
  if stack is None:
    return cannot("found no stack of two or more identical blocks")
  family = models.family_of(module)
  problem = family.layer_stack_problem(module, stack.layers)
  if problem:
    return cannot(f"cannot scan '{stack.path}' because {problem}")
  inputs_period = family.layer_inputs_period(module, stack.layers)
  if inputs_period > 1 and pipeline is not None:
    return cannot(f"the model hands '{stack.path}' different inputs every {inputs_period} layers")
  problem = homogeneity_problem(stack.layers)
  if problem:
    run = longest_identical_run(stack)
    if run is None:
      return cannot(f"cannot scan '{stack.path}' because {problem}")
    if inputs_period > 1:
      return cannot(f"cannot scan '{stack.path}' because {problem}")
    logger.warning(
      "scan=True: '%s' is not one stack of identical blocks (%s); its blocks %s to %s scan and the "
      "others run as they are.", stack.path, problem, run.keys[0], run.keys[-1],
    )
    stack = run
  if pipeline is not None:
    problem = pipeline.schedule.layers_problem(len(stack.keys))
    if problem:
      raise TorchOnTpuError(f"Pipeline: {problem}.")
    staged = pipeline.schedule.staged_layers(len(stack.keys))
    if staged < len(stack.keys):
      schedule = pipeline.schedule
      blocks = schedule.stages * schedule.virtual_stages
      after = stack.keys[staged:]
      logger.warning(
        "pp=%d: the %d layers of '%s' do not split into pp × virtual_stages = %d equal blocks; layers %s to %s run in "
        "the stages (%d per block) and %s after them, as the model's own modules, on the batch split over the stages "
        "too (their weights sharded over pp as the head's are).",
        schedule.stages, len(stack.keys), stack.path, blocks, stack.keys[0], stack.keys[staged - 1], staged // blocks,
        f"layer {after[0]}" if len(after) == 1 else f"layers {after[0]} to {after[-1]}",
      )
      stack = LayerStack(stack.path, stack.keys[:staged], stack.container, stack.all_keys)
  return ScanLayout(stack, entries, pipeline=pipeline, inputs_period=inputs_period)


_default_policy_said = False


def _check_module_globs(named: remat_lib.Named, layer: torch.nn.Module, spelled: str) -> None:
  """Every glob of a named remat policy matches a module of the layer (one sentence naming them if not)."""
  paths = [path for path, _ in layer.named_modules() if path]
  for glob in named.globs:
    if not any(fnmatch.fnmatchcase(path, glob) for path in paths):
      raise TorchOnTpuError(
        f"{arg('remat', spelled)}: no module of the {type(layer).__name__} layer matches {glob!r}; its modules are "
        f"{', '.join(paths)} (and `input`, `attention`: the layer's input, the attention kernel's outputs)."
      )


@contextlib.contextmanager
def _tagged_outputs(layer: torch.nn.Module, named: remat_lib.Named | None):
  """While the layer runs, the outputs of the modules `named` names carry its tag
  (`checkpoint_name`), which its `jax.checkpoint` policy saves or offloads."""
  if named is None:
    yield
    return

  def tagger(name):
    def hook(module, args, output):
      tag = lambda a: checkpoint_name(a, name) if isinstance(a, jax.Array) else a  # noqa: E731
      return torch_view(jax.tree.map(tag, jax_view(output)))

    setattr(hook, remat_lib.PER_TENSOR_HOOK, True)
    return hook

  handles = [module.register_forward_hook(tagger(named.tag(path))) for path, module in layer.named_modules()
             if path and named.tag(path)]
  try:
    yield
  finally:
    for handle in handles:
      handle.remove()


def _say_default_policy_once() -> None:
  global _default_policy_said
  if not _default_policy_said:
    _default_policy_said = True
    logger.info(
      "scan: each layer keeps its matmul and attention outputs for the backward and recomputes "
      "elementwise work (remat=%r), which is what an unrolled layer loop keeps; remat='none' "
      "keeps everything.",
      remat_lib.SCANNED_DEFAULT,
    )


def _split_tree(tree) -> tuple[list, tuple]:
  """A pytree holding torch tensors → (its tensors as jax arrays, what rebuilds it)."""
  flat, spec = _compat.torch_pytree.tree_flatten(tree)
  is_tensor = [isinstance(x, torch.Tensor) for x in flat]
  return [jax_view(x) for x, t in zip(flat, is_tensor) if t], (spec, is_tensor, [None if t else x for x, t in zip(flat, is_tensor)])


def _rebuild_tree(layout, leaves):
  spec, is_tensor, static = layout
  it = iter(leaves)
  return _compat.torch_pytree.tree_unflatten([torch_view(next(it)) if t else x for x, t in zip(static, is_tensor)], spec)


def _split_records(records) -> tuple[list, tuple]:
  """Recorded (path, args, output) calls → (their tensors as jax arrays, what rebuilds them)."""
  leaves, layout = _split_tree([(args, output) for _, args, output in records])
  return leaves, (layout, [path for path, _, _ in records])


def _rebuild_records(spec, leaves) -> list:
  layout, paths = spec
  return [(path, args, output) for path, (args, output) in zip(paths, _rebuild_tree(layout, leaves))]


def _jaxpr_signature(closed) -> tuple:
  """What makes two traced layers the same function: the program text and its constants."""
  consts = []
  for c in closed.consts:
    if isinstance(c, jax.core.Tracer):
      consts.append(("tracer", id(c)))
    else:
      value = np.asarray(c)
      consts.append((value.shape, str(value.dtype), value.tobytes()))
  return str(closed.jaxpr), tuple(consts)


def _signature(module) -> dict[str, tuple]:
  return {n: (tuple(t.shape), t.dtype) for n, t in module_state.named_tensors(module)}


@contextlib.contextmanager
def _swapped(layer: torch.nn.Module, tensors: Mapping[str, jax.Array]):
  views = {n: torch_view(a) for n, a in tensors.items()}
  with _compat.reparametrized(layer, views):
    yield


def _block_buffers(block_state: dict, updates: list[dict]) -> dict:
  """A pipeline block's buffers after its layers ran: `updates[j]` holds what period position j's
  layers wrote, stacked over the block's groups of a period; a buffer no layer wrote keeps its
  value."""
  period = len(updates)
  out = {}
  for name, old in block_state.items():
    grouped = old.reshape(old.shape[0] // period, period, *old.shape[1:])
    written = [updates[j].get(name, grouped[:, j]) for j in range(period)]
    out[name] = jnp.stack(written, axis=1).reshape(old.shape) if period > 1 else written[0]
  return out


def _buffer_updates(layer: torch.nn.Module, tensors: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """The buffers the layer's forward changed (in place or by rebinding), in their dtypes."""
  return {
    name: jax_view(buffer).astype(tensors[name].dtype)
    for name, buffer in layer.named_buffers()
    if jax_view(buffer) is not tensors[name]
  }


def _refuse_caches(kwargs):
  if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
    raise TorchOnTpuError(
      "A scanned layer stack got a KV cache (use_cache=True or past_key_values); scan runs every "
      "layer as one, so call the model with use_cache=False."
    )


class ScannedModule(StackedLayers):
  """The former name of `StackedLayers`, kept for a while: `loop=True` is `scan=False`."""

  def __init__(self, layers, *, remat: str | None = None, unroll: int = 1, loop: bool = False):
    warnings.warn(
      "tot.ScannedModule is now tot.StackedLayers (loop=True is scan=False); the old name will go.",
      DeprecationWarning,
      stacklevel=2,
    )
    super().__init__(layers, remat=remat, unroll=unroll, scan=not loop)
