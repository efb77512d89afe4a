"""Pipeline stages over the `pp` axis: parity with the same model without stages, original
names in checkpoints whatever the stage layout, cross-stage traffic, clear refusals."""

import copy
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h
from tests.test_checkpoint import randomized, tiny_titan
from tests.test_scan import IndexedStack
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import checkpoint
from torch_on_tpu.io.checkpoint import training_state
from torch_on_tpu.parallel import pipeline
from torch_on_tpu.training import plan
from torch_on_tpu.wrapper import state_entries

parity = h.load_module("tools/pp_parity.py")
bench = h.load_module("tools/bench_pp.py")


def test_circular_pipeline_with_tp_and_grad_accum_trains_like_the_model_without_stages():
  """pp=2 × fsdp=2 × tp=2, 2 virtual stages, the XLA attention kernel in its shard_map inside
  each stage, 2-way grad accumulation (its gradients are what the steps apply), clipping:
  5 AdamW steps against fsdp=4 × tp=2 (the whole matrix: tools/pp_parity.py)."""
  r = parity.compare(
    "titan", dict(pp=2, fsdp=2, tp=2), dict(fsdp=4, tp=2), "fsdp_tp", 2, 4, grad_accum=2, batch=16, attention="xla",
    check_grads=False,
  )
  assert r["init"] == 0.0  # the same initial weights under the same names, whatever the layout
  assert r["moved"] > 1e-3  # the steps trained: the comparison is not of constants
  assert r["losses"] < parity.TOLERANCE, r
  assert r["weights"] < parity.TOLERANCE, r
  assert r["bubble"] == pytest.approx(1 / 9)


@pytest.mark.parametrize(
  "model, axes, ref_axes, preset, virtual, context_parallel, split",
  [
    ("titan", dict(pp=2, cp=2, fsdp=2), dict(cp=2, fsdp=4), "fsdp", 2, "ring", "cp=2: K/V ring (ppermute), zig-zag causal balance"),
    ("hf", dict(pp=2, cp=2, tp=2), dict(cp=2, fsdp=2, tp=2), "fsdp_tp", 1, "auto", "cp=2: K/V all-gathered, zig-zag causal balance"),
  ],
)
def test_stages_with_each_sequence_over_cp_train_like_the_model_without_stages(
  monkeypatch, model, axes, ref_axes, preset, virtual, context_parallel, split
):
  """Attention's cp `shard_map` (the ring's ppermutes and custom gradient, or the K/V gather)
  runs inside the vmapped stages: 2 AdamW steps against the same cp without stages, fp32,
  losses and trained weights within ‖Δ‖/‖ref‖ < 1e-4 (measured ≤ 4e-5, the microbatch sum's rounding)."""
  monkeypatch.setitem(parity.BUILDERS, "titan", functools.partial(parity.titan8, layers=4))
  built = []

  def sharded(*args, **kw):
    built.append(sharded_module(*args, context_parallel=context_parallel, **kw))
    return built[-1]

  sharded_module = tot.ShardedModule
  monkeypatch.setattr(tot, "ShardedModule", sharded)
  r = parity.compare(model, axes, ref_axes, preset, virtual, 4, steps=2, batch=8)
  assert r["init"] == 0.0 and r["moved"] > 1e-3
  assert r["losses"] < parity.TOLERANCE, r
  assert r["weights"] < parity.TOLERANCE, r
  assert [jm.attention_splits() for jm in built] == [(split,)] * 2


def test_any_scanned_module_pipelines_even_layers_that_repeat_in_pairs():
  torch.manual_seed(0)
  ref = IndexedStack("alternate")  # odd layers compute another function: a period of 2
  x = torch.randn(8, 32)
  mesh = tot.make_mesh(pp=2, fsdp=4)
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=mesh, sharding="replicated", scan=True, microbatches=4)
  assert h.rel(tot.to_cpu(jm(x)), ref(x).detach()) < 1e-6

  def total(params):
    return h.jax_view(jm.functional_call(params, jm.buffers, h.torch_view(jm.place(x)))).sum()

  ref(x).sum().backward()
  grads = h.per_layer(jm, jax.jit(jax.grad(total))(jm.params))
  for name, p in ref.named_parameters():
    assert h.rel(grads[name], p.grad) < 1e-5, name


def test_layers_that_do_not_split_into_equal_blocks_train_like_the_model_without_stages(monkeypatch):
  """6 layers over pp=2 × 2 virtual stages (4 blocks): layers 0-3 run in the stages, 4 and 5 after
  them as the model's own modules. 2 AdamW steps against fsdp=8, fp32: losses and trained weights
  within ‖Δ‖/‖ref‖ < 1e-4 (the microbatch sum's rounding), every name and shape the model's."""
  monkeypatch.setitem(parity.BUILDERS, "titan", functools.partial(parity.titan8, layers=6))
  r = parity.compare("titan", dict(pp=2, fsdp=4), dict(fsdp=8), "fsdp", 2, 4, steps=2, batch=16)
  assert r["init"] == 0.0 and r["moved"] > 1e-3
  assert r["losses"] < parity.TOLERANCE, r
  assert r["weights"] < parity.TOLERANCE, r
  # torchtitan's pp_looped case: 6 layers over pp=4, two of them after the stages
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(pp=4, fsdp=2), scan=True, abstract=True)
  assert jm.stored_layout()["layers.scan.layer.attention.wo.weight"] == ([f"layers.{i}.attention.wo.weight" for i in range(4)], True)
  assert jm.stored_layout()["layers.5.attention.wo.weight"] == (["layers.5.attention.wo.weight"], False)
  want = {n: tuple(t.shape) for n, t in h.titan().state_dict().items()}
  assert {e.name: e.shape for e in state_entries.entries(jm)} == want


def test_the_cross_stage_traffic_inside_the_schedule_is_collective_permutes_only():
  hlo, mesh = bench.compile_step(4, dict(pp=2, fsdp=4), microbatches=4, virtual_stages=2)
  traffic = bench.cross_stage_traffic(hlo, mesh)
  assert traffic["broken"] == []
  in_loops = {op for (op, spans, looped) in traffic["table"] if spans and looped}
  assert in_loops == {"collective-permute"}  # the hand-off, forward and backward
  # every stage's FSDP gathers stay inside the stage: no all-gather across stages in a loop
  assert ("all-gather", False, True) in traffic["table"]


def test_stages_over_cp_compile_for_v6e_with_splash_and_the_head_split_over_every_device(monkeypatch):
  """pp=2 × cp=2 × fsdp=2 by the real TPU compiler: splash (Mosaic) on the gathered K/V inside
  the stages, the hand-off a collective permute, and the head's logits 1/8 of the tokens on each
  device (rows over fsdp and `pp`, the sequence over `cp`; not on every stage's devices again)."""
  from tests import test_tpu_compile as tpu
  from torch_on_tpu.training import compile_report

  texts = []
  report_of = compile_report.report
  monkeypatch.setattr(compile_report, "report", lambda compiled, seconds: texts.append(compiled.as_text()) or report_of(compiled, seconds))
  mesh = tot.make_mesh(target="v6e-8", pp=2, cp=2, fsdp=2)
  jm = tot.ShardedModule(tpu.titan(512), mesh=mesh, abstract=True, scan=True, microbatches=4)
  report = tpu.compile_step(jm, tpu.tokens(8, 512), tpu.tokens(8, 512))
  assert report.custom_calls.get(tpu.MOSAIC, 0) > 0, report.custom_calls
  assert report.attention_splits == ("cp=2: K/V all-gathered, zig-zag causal balance",), report
  assert report.pipeline and report.collective_bytes.by_kind.get("collective-permute", 0) > 0, report
  logits = set(re.findall(r"\[(\d+),2048\]", texts[-1]))  # the debugmodel's vocab: 2048
  assert logits == {str(8 * 512 // 8)}, logits


def test_a_pp_checkpoint_holds_original_names_and_resumes_at_pp1_and_back(tmp_path):
  """pp=4 saves, pp=1 resumes and saves, a circular pp=2 × 2 resumes: every layer's params
  and optimizer moments land under their own names, bit for bit."""
  optimizer = optax.adamw(1e-3)

  def module(axes, **kw):
    jm = tot.ShardedModule(tiny_titan(4), mesh=tot.make_mesh(**axes), scan=True, abstract=True, **kw)
    jm.params.update(randomized(dict(jm.params), 1))
    return jm

  def state(jm):
    return {"params": dict(jm.params), "opt_state": randomized(optimizer.init(jm.params), 2)}

  def target(jm):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(jm))

  def originals(jm, st):
    return {"params": h.per_layer(jm, st["params"]), "mu": h.per_layer(jm, st["opt_state"][0].mu)}

  pp4 = module(dict(pp=4, fsdp=2))
  saved = state(pp4)
  with checkpoint.Checkpointer(tmp_path / "a", model=pp4) as ckpt:
    ckpt.save(1, saved, force=True)
  plain = module(dict(fsdp=8))
  with checkpoint.Checkpointer(tmp_path / "a", model=plain) as ckpt:
    at_pp1 = ckpt.restore(target(plain)).state
  with checkpoint.Checkpointer(tmp_path / "b", model=plain) as ckpt:
    ckpt.save(1, at_pp1, force=True)
  circular = module(dict(pp=2, fsdp=4), virtual_stages=2)
  assert circular.stored_layout()["layers.scan.layer.attention.wo.weight"][0] == [
    f"layers.{i}.attention.wo.weight" for i in (0, 2, 1, 3)  # stage 0 holds blocks 0 and 2
  ]
  with checkpoint.Checkpointer(tmp_path / "b", model=circular) as ckpt:
    back = ckpt.restore(target(circular)).state
  want = originals(pp4, saved)
  for got in (originals(plain, at_pp1), originals(circular, back)):
    for part in want:
      assert got[part].keys() == want[part].keys()
      for name in want[part]:
        np.testing.assert_array_equal(got[part][name], want[part][name], err_msg=f"{part} {name}")
  assert back["params"]["layers.scan.layer.attention.wo.weight"].sharding.spec[0] == "pp"
  # Written and read, a layer is split over the stages too, not held whole by each of them.
  one_layer = training_state._layer_slices(pp4.params["layers.scan.layer.attention.wo.weight"])[0]
  assert one_layer.sharding.spec[0] == ("fsdp", "pp")


@pytest.mark.parametrize(
  "build, kw, match",
  [
    (h.titan, dict(axes=dict(pp=4, fsdp=2), virtual_stages=2), r"6 layers are fewer than the pp=4 × virtual_stages=2 = 8 blocks .* at most 6"),
    (h.titan, dict(axes=dict(pp=2, fsdp=4), scan=False), r"pp=2, which splits the scanned layer stack .* scan=True"),
    (h.titan, dict(axes=dict(pp=2, fsdp=4), microbatches=1, virtual_stages=3), r"circular pipeline .* use microbatches of at least 2"),
    (h.titan, dict(axes=dict(fsdp=8), microbatches=4), r"microbatches and virtual_stages .* mesh .* has no .pp. axis"),
    (lambda: IndexedStack("per-layer scale"), dict(axes=dict(pp=2, fsdp=4)), None),
    (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), dict(axes=dict(pp=2, fsdp=4)), r"found no stack .* without pp"),
  ],
)
def test_what_a_pipeline_cannot_run_is_refused_in_one_sentence(build, kw, match):
  kw = dict(kw)
  mesh = tot.make_mesh(**kw.pop("axes"))
  kw.setdefault("scan", True)
  if match is None:  # layers that compute different functions: refused when traced
    jm = tot.ShardedModule(build(), mesh=mesh, sharding="replicated", abstract=True, **kw)
    with pytest.raises(TorchOnTpuError, match=r"do not all compute the same function .* without pp"):
      jax.eval_shape(lambda p, x: h.jax_view(jm.functional_call(p, jm.buffers, h.torch_view(x))), jm.params, jnp.zeros((8, 32)))
    return
  with pytest.raises(TorchOnTpuError, match=match):
    tot.ShardedModule(build(), mesh=mesh, abstract=True, **kw)


def test_a_batch_the_microbatches_do_not_divide_and_pp_in_a_layer_map_are_refused():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(pp=2, fsdp=4), scan=True, abstract=True, microbatches=3)
  step = tot.make_train_step(jm, parity._loss, optax.adamw(1e-3))
  batch = jax.ShapeDtypeStruct((8, h.SEQ), jnp.int32)
  with pytest.raises(TorchOnTpuError, match=r"8 rows .* does not split into microbatches=3; .*\[1, 2, 4, 8\]"):
    step.compile(batch, batch)
  with pytest.raises(TorchOnTpuError, match=r"'layers.0.attention.wo.weight' on the 'pp' axis"):
    tot.ShardedModule(
      h.titan(), mesh=tot.make_mesh(pp=2, fsdp=4), scan=True, abstract=True, sharding={"layers.*.attention.wo.weight": ("pp", None)}
    )


def test_the_plan_and_the_compile_report_give_the_bubble_and_the_plan_suggests_stages():
  schedule = pipeline.Schedule(4, 8, virtual_stages=2)
  assert schedule.ticks == 19 and schedule.bubble_fraction == pytest.approx(3 / 19)
  assert schedule.storage_order(16) == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
  shape = plan.decoder_shape(h.titan())
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(pp=2, fsdp=4), scan=True, abstract=True, microbatches=4)
  step = tot.make_train_step(jm, parity._loss, optax.adamw(1e-3))
  memory = plan.plan_memory(step, shape, global_batch_size=8, seqlen=h.SEQ)
  assert "pipeline pp=2 × 4 microbatches (plain GPipe): bubble 20.0% of 5 ticks" in str(memory)
  # A 48-layer model without stages, each layer recomputed, a batch grad_accum cannot cut
  # further: 10% less memory than it needs, and stages are what fits (each tick keeps only
  # its stage's input, not every layer's).
  deep = lambda: parity.titan8(layers=48, seqlen=256)  # noqa: E731
  flat = tot.make_train_step(
    tot.ShardedModule(deep(), mesh=tot.make_mesh(fsdp=8), scan=True, abstract=True, remat="full"),
    parity._loss, optax.adamw(1e-3),
  )
  shape = plan.decoder_shape(deep())
  need = plan.plan_memory(flat, shape, global_batch_size=8, seqlen=256, remat="full").total
  tight = plan.plan_memory(flat, shape, global_batch_size=8, seqlen=256, remat="full", device_bytes=0.9 * need / plan.USABLE)
  assert tight.fits is False
  assert "use pipeline stages: pp=2 with fsdp=4, microbatches=8 and remat='full'" in tight.message()


def test_recipe_flags_resolve_the_microbatches_and_refuse_what_cannot_run():
  from recipes import flags as recipe_flags
  from recipes import llama3, runner

  recipe = llama3.recipe(llama3.Llama3Flags())
  assert runner.resolve(llama3.Llama3Flags(pp=4, global_batch_size=24), recipe)["microbatches"] == 12
  assert runner.resolve(llama3.Llama3Flags(pp=2, global_batch_size=16, grad_accum=2), recipe)["microbatches"] == 8
  assert runner.resolve(llama3.Llama3Flags(pp=2, microbatches=2), recipe)["microbatches"] == 2
  assert list(recipe_flags.mesh_axes(llama3.Llama3Flags(pp=2, cp=1))) == ["pp", "fsdp", "tp"]  # stages outermost
  recipe_flags.check_flags(llama3.Llama3Flags(pp=2, cp=2))  # stages and context parallelism together
  assert list(recipe_flags.mesh_axes(llama3.Llama3Flags(pp=2, cp=2))) == ["pp", "fsdp", "cp", "tp"]
  for flags, match in [
    (llama3.Llama3Flags(pp=2, microbatches=3, global_batch_size=8), r"--microbatches=3 does not divide the 8 rows"),
    (llama3.Llama3Flags(microbatches=4), r"give --pp=N"),
  ]:
    with pytest.raises(TorchOnTpuError, match=match):
      recipe_flags.check_flags(flags)
