"""Context parallelism: the `cp` mesh axis splits the sequence; attention crosses the split.

Kernel blocks on global positions against a dense reference; the routed call at
cp > 1 (both K/V strategies, causal, documents, padding masks, dropout) against
the same call unsplit; the zig-zag balance from the chunk layout; the mesh, data
and sharding contracts; one model slice of `tools/parity_cp.py` (whose full
matrix is in the README); what cannot be split, refused. Tolerances: kernel and
routed calls 1e-5, trained weights 1e-4 (‖Δ‖/‖ref‖).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_on_tpu as tot
from torch_on_tpu.attention import context
from torch_on_tpu.attention.routing import Attention
from torch_on_tpu.attention.xla_flash import xla_attention, xla_attention_backward
from torch_on_tpu.io.data import to_global
from torch_on_tpu.models.hf import build_causal_lm
from torch_on_tpu.parallel import mesh as mesh_lib
from torch_on_tpu.parallel import sharding
from torch_on_tpu.training import metrics

from . import helpers as h

TOL = 1e-5
MESHES = {"cp8": dict(cp=8), "fsdp2xcp4": dict(fsdp=2, cp=4), "fsdp2xtp2xcp2": dict(fsdp=2, tp=2, cp=2)}


def normal(*shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def dense(q, k, v, q0, kv0, scale):
  """Causal attention on global positions q0 + i, kv0 + j, written out: (out, lse)."""
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
  rows, cols = q0 + jnp.arange(q.shape[2])[:, None], kv0 + jnp.arange(k.shape[2])[None]
  s = jnp.where(cols <= rows, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, -1)
  seen = ~jnp.isneginf(lse)
  p = jnp.where(seen[..., None], jnp.exp(s - jnp.where(seen, lse, 0)[..., None]), 0.0)
  return jnp.einsum("bhqk,bhkd->bhqd", p, v), lse


# ---- the kernel: blocks of a longer sequence ------------------------------------------------


@pytest.mark.parametrize("q0,kv0", [(30, 0), (16, 20), (5, 40)])
def test_kernel_blocks_mask_on_global_positions_with_lse_and_its_gradient(q0, kv0):
  """Offsets shift the causal diagonal; (5, 40) sees no key at all: zeros, lse -inf."""
  q, k, v = normal(2, 2, 24, 8, seed=0), normal(2, 2, 40, 8, seed=1), normal(2, 2, 40, 8, seed=2)
  dout, dlse = normal(2, 2, 24, 8, seed=3), normal(2, 2, 24, seed=4)

  def loss(fn, q, k, v):
    out, lse = fn(q, k, v)
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse) * dlse), (out, lse)

  ours = lambda q, k, v: xla_attention(  # noqa: E731
    q, k, v, causal=True, scale=0.3, q_offset=jnp.int32(q0), kv_offset=kv0, return_lse=True, block_q=8, block_kv=16
  )
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)
  (_, (ref, ref_lse)), ref_grads = jax.value_and_grad(
    lambda *a: loss(lambda *b: dense(*b, q0, kv0, 0.3), *a), argnums=(0, 1, 2), has_aux=True
  )(q, k, v)
  assert bool((jnp.isneginf(lse) == jnp.isneginf(ref_lse)).all())
  if bool(jnp.isneginf(ref_lse).all()):
    assert float(jnp.abs(out).max()) == 0 and all(float(jnp.abs(g).max()) == 0 for g in grads)
    return
  assert h.rel(out, ref) < TOL
  assert h.rel(jnp.where(jnp.isneginf(ref_lse), 0, lse), jnp.where(jnp.isneginf(ref_lse), 0, ref_lse)) < TOL
  for g, r in zip(grads, ref_grads):
    assert h.rel(g, r) < TOL


def test_block_backward_from_the_whole_output_sums_to_the_whole_gradient():
  """The ring's backward: each key block's gradients from the whole out and lse, no recompute."""
  q, k, v = normal(1, 2, 16, 8, seed=0), normal(1, 2, 32, 8, seed=1), normal(1, 2, 32, 8, seed=2)
  dout = normal(1, 2, 16, 8, seed=3)
  out, lse = dense(q, k, v, 16, 0, 0.25)
  _, vjp = jax.vjp(lambda q, k, v: dense(q, k, v, 16, 0, 0.25)[0], q, k, v)
  ref_dq, ref_dk, ref_dv = vjp(dout)
  dq = 0
  for start in (0, 16):
    dq_b, dk_b, dv_b = xla_attention_backward(
      q, k[:, :, start:start + 16], v[:, :, start:start + 16], out, lse, dout,
      causal=True, scale=0.25, q_offset=16, kv_offset=start, block_q=8, block_kv=8,
    )
    dq = dq + dq_b
    assert h.rel(dk_b, ref_dk[:, :, start:start + 16]) < TOL
    assert h.rel(dv_b, ref_dv[:, :, start:start + 16]) < TOL
  assert h.rel(dq, ref_dq) < TOL


# ---- attention across the cp split -------------------------------------------------------------


def routed(att, q, k, v, dout, **kwargs):
  """(out, (dq, dk, dv)) of the call, one compile."""

  def loss(q, k, v):
    out = att(q, k, v, **kwargs)
    return jnp.sum(out * dout), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


CALLS = {
  # name: (strategies, call kwargs builder); explicit masks at cp: the HF model test
  "causal-window": (("all_gather",), lambda seg: dict(causal=True, window=20, enable_gqa=True)),
  "documents": (("ring",), lambda seg: dict(causal=True, segment_ids=(seg, seg), enable_gqa=True)),
  "dropout-sinks": (
    ("all_gather",),
    lambda seg: dict(
      causal=True, dropout_rate=0.3, dropout_key=jax.random.key(7), sinks=jnp.linspace(-1.0, 1.0, 4), enable_gqa=True
    ),
  ),
}


def inputs(b=4, hq=4, hkv=2, length=64, d=8):
  q, k, v = normal(b, hq, length, d, seed=0), normal(b, hkv, length, d, seed=1), normal(b, hkv, length, d, seed=2)
  seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(4), 0.1, (b, length)).astype(jnp.int32), axis=1)
  return q, k, v, normal(b, hq, length, d, seed=3), seg


def test_attention_across_cp_equals_the_unsplit_call():
  """A sliding window (K/V gathered, zig-zag), documents (the ring), dropout and sinks
  (global positions; a sink joins each row once) on one mesh; the other meshes and explicit
  masks run in the model tests and tools/parity_cp.py."""
  mesh = tot.make_mesh(**MESHES["fsdp2xcp4"])
  q, k, v, dout, seg = inputs()
  whole = Attention("xla", block_sizes=dict(block_q=8, block_kv=8))
  for name in CALLS:
    strategies, make = CALLS[name]
    kwargs = make(seg)
    ref_out, ref_grads = routed(whole, q, k, v, dout, **kwargs)
    for strategy in strategies:
      att = Attention(
        "xla", mesh=mesh, data_axes=mesh_lib.data_axes(mesh), block_sizes=dict(block_q=4, block_kv=4),
        context_parallel=strategy,
      )
      out, grads = routed(att, q, k, v, dout, **kwargs)
      assert att.splits, (name, strategy)
      assert h.rel(out, ref_out) < TOL, (name, strategy)
      for g, r in zip(grads, ref_grads):
        assert h.rel(g, r) < TOL, (name, strategy)


def test_splash_across_cp_runs_one_kernel_per_device_offset(caplog):
  """Splash (Pallas interpret mode here) on the gathered K/V, its static causal mask at each
  device's zig-zag offsets (lax.switch on the device index): documents, MQA, fsdp=4 x cp=2."""
  mesh = tot.make_mesh(fsdp=4, cp=2)
  q, k, v = normal(4, 2, 512, 8, seed=0), normal(4, 1, 512, 8, seed=1), normal(4, 1, 512, 8, seed=2)
  dout = normal(4, 2, 512, 8, seed=3)
  seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(4), 0.01, (4, 512)).astype(jnp.int32), axis=1)
  kwargs = dict(causal=True, segment_ids=(seg, seg), enable_gqa=True)
  ref_out, ref_grads = routed(Attention("xla"), q, k, v, dout, **kwargs)
  att = Attention("splash", mesh=mesh, data_axes=("fsdp",))
  with caplog.at_level("WARNING", logger="torch_on_tpu.attention.routing"):
    out, grads = routed(att, q, k, v, dout, **kwargs)
  assert "cannot express" not in caplog.text  # splash ran, not the XLA fallback
  assert att.splits == {"cp=2: K/V all-gathered, zig-zag causal balance"}
  assert h.rel(out, ref_out) < TOL
  for g, r in zip(grads, ref_grads):
    assert h.rel(g, r) < TOL


def test_auto_strategy_names_its_reason_and_the_ring_takes_only_plain_calls():
  assert context.choose("auto", heads=32, kv_heads=8, ways=4, plain=True)[0] == "all_gather"
  assert context.choose("auto", heads=16, kv_heads=16, ways=4, plain=True)[0] == "ring"
  assert context.choose("auto", heads=16, kv_heads=16, ways=2, plain=True)[0] == "all_gather"
  assert context.choose("ring", heads=16, kv_heads=16, ways=4, plain=False)[0] == "all_gather"
  assert context.choose("auto", heads=16, kv_heads=16, ways=4, plain=True, kernel="splash")[0] == "all_gather"
  with pytest.raises(tot.TorchOnTpuError, match="context_parallel='bad' is not a strategy"):
    Attention("xla", context_parallel="bad")


def test_unsplittable_lengths_run_whole_and_say_so(caplog):
  mesh = tot.make_mesh(cp=8)
  att = Attention("xla", mesh=mesh)
  q = normal(1, 2, 24, 8, seed=0)  # 24 does not split into 16 causal chunks
  out = jax.jit(lambda q: att(q, q, q, causal=True))(q)
  assert not att.splits
  assert h.rel(out, dense(q, q, q, 0, 0, 8**-0.5)[0]) < TOL


# ---- the zig-zag balance, from the chunk layout ------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_spreads_causal_work_evenly_and_contiguous_does_not(cp):
  balanced = metrics.causal_attention_pairs(4096, cp, balanced=True)
  contiguous = metrics.causal_attention_pairs(4096, cp, balanced=False)
  total = 4096 * 4097 // 2
  assert sum(balanced) == sum(contiguous) == total
  assert max(balanced) / min(balanced) - 1 < 0.10
  assert max(contiguous) / min(contiguous) - 1 > 1.0
  owners = sorted(c for me in range(cp) for c in context.zigzag_chunks(me, cp))
  assert owners == list(range(2 * cp))


# ---- mesh, data and sharding contracts ---------------------------------------------------------


def test_cp_is_a_parameter_axis_not_a_data_axis_and_splits_dim_1_of_batch_tensors():
  mesh = tot.make_mesh(fsdp=2, cp=4)
  assert mesh_lib.data_axes(mesh) == ("fsdp",)
  assert mesh_lib.param_axes(mesh) == ("fsdp", "cp")
  batch = to_global({"input_ids": np.zeros((4, 64), np.int32), "lengths": np.zeros((4,), np.int32)}, mesh)
  assert tuple(batch["input_ids"].sharding.spec) == ("fsdp", "cp")
  assert tuple(batch["lengths"].sharding.spec) == ("fsdp",)
  assert batch["input_ids"].addressable_shards[0].data.shape == (2, 16)


def test_parameters_shard_over_fsdp_and_cp_in_the_presets_and_family_maps():
  mesh = tot.make_mesh(fsdp=2, cp=2, tp=2)
  jm = tot.ShardedModule(h.hf("llama"), mesh=mesh, sharding="fsdp_tp", abstract=True)
  assert tuple(jm.param_shardings["model.layers.0.self_attn.q_proj.weight"].spec) == ("tp", ("fsdp", "cp"))
  jm = tot.ShardedModule(h.hf("llama"), mesh=tot.make_mesh(cp=8), sharding="fsdp", abstract=True)
  assert tuple(jm.param_shardings["model.embed_tokens.weight"].spec) == ("cp", None)
  assert sharding.with_param_axes({"w": ("tp", "fsdp")}, tot.make_mesh(fsdp=8)) == {"w": ("tp", "fsdp")}


# ---- models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_tool():
  return h.load_module(h.Path(__file__).parent.parent / "tools" / "parity_cp.py")


def test_torchtitan_documents_train_at_cp_like_at_cp1_and_resume_across(parity_tool):
  """A slice of tools/parity_cp.py: torchtitan's flex attention over packed documents at
  fsdp=2 x cp=4 (the ring, zig-zag) against cp=1: forward, 5 AdamW steps, trained weights;
  then the state trained at cp=4 continues at cp=1."""
  r = parity_tool.compare("titan", "fsdp2xcp4", scan=False)
  assert r["forward"] < parity_tool.FORWARD_TOL, r
  assert max(r["losses"], r["weights"], r["resumed_loss"]) < parity_tool.TRAIN_TOL, r
  assert r["attention"] == "cp=4: K/V ring (ppermute), zig-zag causal balance", r


def test_hf_left_padding_at_cp_matches_torch_eager(parity_tool):
  """HF Llama (SDPA, left padding), scanned, on fsdp=2 x tp=2 x cp=2 against eager torch."""
  model, inputs, _ = parity_tool.build("llama")
  ref = model(**inputs).logits.detach().numpy()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(**MESHES["fsdp2xtp2xcp2"]), sharding="fsdp_tp", scan=True)
  assert h.rel(tot.to_cpu(jm(**inputs).logits).numpy(), ref) < TOL
  assert jm.attention_splits() == ("cp=2: K/V all-gathered, zig-zag causal balance",)  # its mask: causal + segment ids


def test_hand_written_attention_is_refused_naming_the_module():
  config = h.hf_config("llama")
  config._attn_implementation = "eager"
  jm = tot.ShardedModule(build_causal_lm(config), mesh=tot.make_mesh(fsdp=2, cp=4))
  with pytest.raises(tot.TorchOnTpuError, match=r"Module 'model\.layers\.0\.self_attn' computes attention by hand .* cp=1"):
    jm(torch.randint(0, 256, (2, 32)), use_cache=False)


def test_torchax_own_sdpa_lowering_is_refused_with_cp():
  with pytest.raises(tot.TorchOnTpuError, match=r"cannot split the sequence .* \(cp=1\)"):
    tot.ShardedModule(h.hf("llama"), mesh=tot.make_mesh(cp=8), attention=None, abstract=True)


def test_plan_splits_tokens_over_cp_and_suggests_a_cp_size():
  import optax

  from torch_on_tpu.training import plan

  def step_on(**axes):
    jm = tot.ShardedModule(h.hf("llama"), mesh=tot.make_mesh(**axes), abstract=True, scan=True)
    return tot.make_train_step(jm, lambda out, labels: out.logits.sum(), optax.adamw(1e-3))

  shape = plan.decoder_shape(h.hf("llama"))
  # Two sequences: eight data devices cannot split them; two data devices x cp=4 can.
  whole = plan.plan_memory(step_on(fsdp=8), shape, global_batch_size=2, seqlen=4096, remat="full")
  split = plan.plan_memory(step_on(fsdp=2, cp=4), shape, global_batch_size=2, seqlen=4096, remat="full")
  assert "each sequence over cp=4" in split.description
  assert split.logits * 8 == whole.logits
  tight = plan.plan_memory(
    step_on(fsdp=8), shape, global_batch_size=8, seqlen=4096, remat="full", device_bytes=whole.total // 3
  )
  assert "cp=" in tight.suggestion and "grad_accum=" in tight.suggestion, tight.suggestion  # split each sequence


def test_collective_bytes_count_loops_by_their_trip_count():
  """The compile report's collectives: an all-gather inside a 3-step loop counts 3 times."""
  from jax.sharding import PartitionSpec as P

  from torch_on_tpu.parallel.collectives import collective_bytes

  mesh = tot.make_mesh(cp=8)

  def body(x):
    def step(i, acc):
      return acc + jax.lax.all_gather(x * i, "cp", tiled=True)[: x.shape[0]]

    return jax.lax.fori_loop(0, 3, step, jnp.zeros_like(x))

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp")))
  text = fn.lower(jnp.zeros((8 * 1024,), jnp.float32)).compile().as_text()
  gathered = 8 * 1024 * 4  # bytes of each all-gather's output
  assert collective_bytes(text).by_kind == {"all-gather": 3 * gathered * 7 // 8}


def test_recipe_flag_builds_the_mesh_prints_cp_and_checks_the_sequence(tmp_path):
  from recipes import flags as recipe_flags
  from recipes import llama3, runner

  flags = llama3.Llama3Flags(cp=4, seqlen=64, log_dir=str(tmp_path))
  assert recipe_flags.mesh_axes(flags) == {"fsdp": -1, "cp": 4, "tp": 1}
  assert recipe_flags.mesh_axes(llama3.Llama3Flags()) == {"fsdp": -1, "tp": 1}  # a cp-free run keeps its mesh
  assert runner.resolve(flags, llama3.recipe(flags))["cp"] == 4
  with pytest.raises(tot.TorchOnTpuError, match=r"--seqlen=60 does not split into 2\*cp=8 equal chunks"):
    llama3.run(llama3.Llama3Flags(cp=4, seqlen=60, log_dir=str(tmp_path)))
