"""Every mode's train step, built by the real TPU compiler for a slice this machine does not have.

Small shapes on compile-only devices (`tot.make_mesh(target=...)`): each test asserts that the
step compiled for the slice, fits its HBM (the compiler's arguments + temporaries against the
budget it reports), and holds the kernels that mode is for on TPU: Mosaic (splash attention,
`tpu_custom_call`) where attention runs and for MoE experts (megablox). Nothing runs.
"""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from recipes import hf as hf_recipe
from recipes import llama3 as llama3_recipe
from tests import helpers as h
from tests import test_bf16_training as bf16_training
from torch_on_tpu.core import _compat
from torch_on_tpu.lowering import ragged, target_device
from torch_on_tpu.models.torchtitan import build_llama3, moe
from torch_on_tpu.parallel import collectives, targets
from torch_on_tpu.training import compile_report, lora, program_cost
from torch_on_tpu.training.trainer import default_split

MOSAIC = "tpu_custom_call"
tp = h.titan_parity()


def _loss(outputs, labels):
  logits = outputs.logits if hasattr(outputs, "logits") else outputs
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def compile_step(jm, inputs, labels, **step_kw):
  step = tot.make_train_step(jm, _loss, optax.adamw(1e-3), compute_dtype=jnp.bfloat16, **step_kw)
  report = step.compile(inputs, labels)
  hbm = targets.target_of(jm.mesh.devices.flat).hbm_bytes
  assert report.temp_bytes > 0 and report.fits(hbm), report
  return report


def titan(seq):
  """torchtitan's Llama 3 debugmodel (6 layers, dim 256), SDPA attention, RoPE for `seq`."""
  return build_llama3("debugmodel", attention="sdpa", max_seq_len=seq)


def tokens(batch, seq):
  return jax.ShapeDtypeStruct((batch, seq), jnp.int32)


def test_scanned_llama3_step_compiles_for_v6e_with_splash_kernels():
  mesh = tot.make_mesh(target="v6e-8", fsdp=-1)
  jm = tot.ShardedModule(titan(256), mesh=mesh, abstract=True, scan=True)
  report = compile_step(jm, tokens(8, 256), tokens(8, 256))
  assert report.custom_calls.get(MOSAIC, 0) > 0, report.custom_calls  # splash, forward and backward
  assert report.collective_bytes.by_kind.get("all-gather", 0) > 0


def test_offload_inputs_keeps_every_layer_input_in_host_memory():
  """`remat="offload_inputs"`: `full`'s recomputation with each layer's input in pinned host
  memory: the same recomputation as `full`, and the host holds at least every layer's
  input (6 layers x 512 tokens x 256 wide in bf16, one row of 8 per chip)."""
  mesh = tot.make_mesh(target="v6e-8", fsdp=-1)
  reports = {}
  for remat in ("full", "offload_inputs"):
    jm = tot.ShardedModule(titan(512), mesh=mesh, abstract=True, scan=True, remat=remat)
    reports[remat] = compile_step(jm, tokens(8, 512), tokens(8, 512))
  assert reports["full"].host_offloaded_bytes == 0
  assert reports["offload_inputs"].host_offloaded_bytes >= 6 * 512 * 256 * 2, reports["offload_inputs"]
  # `full`'s recomputation (within 5%: 2.9% more FLOPs here, XLA splits the loops around the transfers)
  assert abs(reports["offload_inputs"].flops / reports["full"].flops - 1) < 0.05


def test_a_policy_keeping_matmul_outputs_keeps_nothing_of_ropes_pair_swap(monkeypatch):
  """The RoPE pair swap is a matmul (`models/torchtitan/rope.py`); `dots_and_attention` kept its
  product per layer like a projection's and redid the rotation from it (Llama 3 1B on v5p-8 at
  8 × 8192 tokens: 2.5 GiB while the product was fp32; bf16 now, exact in the input's dtype).
  Tagged as a matmul, the rotated query and key are kept instead, and nothing of the swap: the
  temporaries are lower by most of the swap's product (0.89 of it measured since the loss writes
  its gradient over the logits, 1.22 before: the allocation around it is laid out anew)."""
  from torch_on_tpu.models.torchtitan import rope

  def temps():
    mesh = tot.make_mesh(target="v5p-8", fsdp=-1)
    jm = tot.ShardedModule(titan(512), mesh=mesh, abstract=True, scan=True, remat="dots_and_attention")
    return compile_step(jm, tokens(8, 512), tokens(8, 512)).temp_bytes

  ours = temps()
  monkeypatch.setattr(rope, "rotate", rope._rotate)  # the swap's product as any matmul's
  kept = temps()
  layers, heads, head_dim = 6, 16 + 16, 16  # debugmodel: 16 query and 16 key heads of 16 dims
  assert kept - ours >= 0.75 * layers * (8 // 4) * 512 * heads * head_dim * 2, (ours, kept)  # bf16, per chip


def test_a_remat_policy_naming_modules_offloads_exactly_their_outputs():
  """MaxText's v6e recipe spelled in torchtitan's module names: each layer's input and its q/k/v
  and out projections in host memory, the rest recomputed. The host holds those three outputs of
  every layer, to the byte: 6 layers × 512 tokens a chip × (256 + 768 + 256) wide × 2 bytes; with
  only the input offloaded (the out projection kept on the chip), the input alone."""
  mesh = tot.make_mesh(target="v6e-8", fsdp=-1)
  per_layer_token = {"offload:input,attention.qkv_linear.wqkv,attention.wo": 256 + 768 + 256, "save:attention.wo+offload:input": 256}
  for remat, width in per_layer_token.items():
    jm = tot.ShardedModule(titan(512), mesh=mesh, abstract=True, scan=True, remat=remat)
    report = compile_step(jm, tokens(8, 512), tokens(8, 512))
    assert report.host_offloaded_bytes == 6 * 512 * width * 2, (remat, report)
    assert report.cost.host_bytes >= 2 * report.host_offloaded_bytes  # written in the forward, read in the backward
    assert "(the compiler's peak " in str(report) and ", arguments and host memory included)" in str(report)  # it counts them


def test_context_parallel_step_keeps_splash_across_the_cp_axis():
  """Splash on the gathered K/V; in all within 1.1× of what FSDP over the 8 devices and `cp`
  need (its K/V gathered each forward pass, their gradients reduce-scattered, the zig-zag
  balance's query and output rows): 1.04× measured. The zig-zag's exchanges over 2 devices
  keep half of each piece in place: permutes of a device to itself move nothing."""
  mesh = tot.make_mesh(target="v6e-8", fsdp=4, cp=2)
  model = titan(512)
  jm = tot.ShardedModule(model, mesh=mesh, abstract=True, scan=True, remat="full")
  batch, seq = 4, 512
  report = compile_step(jm, tokens(batch, seq), tokens(batch, seq))
  assert report.custom_calls.get(MOSAIC, 0) > 0 and report.attention_splits, report
  local_tokens, layers = batch * seq // mesh.size, len(model.config.layers)
  attention = model.config.layers[0].attention
  width = model.config.dim  # query heads × head dim
  kv_width = width * (attention.n_kv_heads or attention.n_heads) // attention.n_heads
  sharded = sum(v.size for v in jm.params.values() if any(v.sharding.spec))
  needed = collectives.fsdp_ideal_bytes(sharded, mesh.size, weight_bytes=2, gradient_bytes=2) + collectives.cp_ideal_bytes(
    local_tokens, kv_width, 2, layers=layers, activation_bytes=2, recomputed=True, balanced_width=width,
  )
  assert report.collective_bytes.total <= 1.1 * needed, (str(report.collective_bytes), needed)


def test_pipeline_stages_compile_for_v6e():
  mesh = tot.make_mesh(target="v6e-8", pp=2, fsdp=4)
  jm = tot.ShardedModule(titan(128), mesh=mesh, abstract=True, scan=True, microbatches=4)
  report = compile_step(jm, tokens(8, 128), tokens(8, 128))
  assert report.pipeline and report.collective_bytes.by_kind.get("collective-permute", 0) > 0, report


# The README's HF architectures whose attention is torch's SDPA: gpt-oss runs eager (its sinks),
# Mamba has no attention, Qwen3-Next's full-attention layers are SDPA beside its linear ones.
HF_SDPA = sorted(set(bf16_training.HF) - {"gpt_oss", "mamba"})


@pytest.mark.parametrize("arch", HF_SDPA)
def test_each_hf_sdpa_architecture_steps_on_splash_on_v5p(arch):
  """transformers' mask and attention interfaces hand the model's causal (and padding) mask to the
  bridge as segment ids, so its attention is splash's Mosaic kernel, not XLA on a dense mask."""
  config = bf16_training.HF[arch]()
  config._attn_implementation = "sdpa"
  if arch == "gpt2":
    config.attn_pdrop = 0.0  # its default attention dropout (0.1) runs on the XLA kernel: splash has none
  mesh = tot.make_mesh(target="v5p-8", fsdp=-1)
  jm = tot.ShardedModule(h.build_causal_lm(config), mesh=mesh, abstract=True)
  inputs = {"input_ids": tokens(8, 64), "attention_mask": tokens(8, 64), "use_cache": False}
  report = compile_step(jm, inputs, tokens(8, 64))
  assert report.custom_calls.get(MOSAIC, 0) > 0, (arch, report.custom_calls)


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba"])
def test_hf_linear_attention_and_state_space_steps_compile_for_v5p(arch):
  """Qwen3-Next's gated delta rule (transformers' torch code, not flash-linear-attention's CUDA
  kernels; its mixed layer types run unscanned) and Mamba's fp32 residual under bf16 compute,
  scanned."""
  mesh = tot.make_mesh(target="v5p-8", fsdp=-1)
  jm = tot.ShardedModule(h.build_causal_lm(bf16_training.HF[arch]()), mesh=mesh, abstract=True, scan=True)
  assert (jm._layout is not None) == (arch == "mamba")
  compile_step(jm, {"input_ids": tokens(8, 64), "use_cache": False}, tokens(8, 64))


def test_lora_step_compiles_for_v5p():
  mesh = tot.make_mesh(target="v5p-8", fsdp=-1)
  config = h.hf_config("llama")
  base = tot.ShardedModule(h.build_causal_lm(config), mesh=mesh, abstract=True)
  jm = lora.wrap(base, h.build_causal_lm(config), rank=4)
  compile_step(jm, {"input_ids": tokens(4, 64)}, tokens(4, 64), trainable=lora.TRAINABLE)


def _family_step(spec, target, expert_hidden=64, **mesh_axes):
  """A torchtitan family's debug flavor, made small as the parity tests make it (2 layers, vocab
  256, 8 experts of top-2 with `expert_hidden` units), scanned as the recipe runs it, called as
  torchtitan's trainer calls it, compiled for `target` in bf16."""
  with torch.device("meta"):
    model = tp.shrink(tp.registry_config(spec), layers=2, expert_hidden=expert_hidden).build()
  mesh = tot.make_mesh(target=target, **(mesh_axes or {"fsdp": -1}))
  jm = tot.ShardedModule(model, mesh=mesh, abstract=True, scan=True, sharding="ep" if "ep" in mesh_axes else "fsdp")
  batch = {key: tokens(8, 64) for key in ("input_ids", "labels", "positions", "segment_ids")}
  return compile_step(jm, *default_split(jm, batch))


@pytest.mark.parametrize("spec", ["qwen3:debugmodel", "deepseek_v3:debugmodel", "kimi_k2_7:debugmodel",
                                  "qwen3_5:debugmodel", "gpt_oss:debugmodel", "muse_glimmer:debugmodel"])
def test_each_torchtitan_familys_debug_flavor_compiles_for_v5p_with_mosaic_attention(spec):
  report = _family_step(spec, "v5p-8")
  assert report.custom_calls.get(MOSAIC, 0) > 0, (spec, report.custom_calls)



def test_qwen3_5s_linear_attention_moves_only_what_fsdp_needs_on_v6e():
  """torchtitan folds Qwen3.5's batch into one sequence for its Gated DeltaNet. Run as one
  recurrence over all B·L tokens, every step of it gathered the rows from every data shard:
  359.6 GiB of all-gather per chip for this step (4 layers, 8 × 512 tokens, v6e-8) and 1.63 GB
  of temporaries. Each row scanned on the devices that hold it (every row starts a document),
  the step moves what FSDP needs: weights gathered twice in bf16, gradients reduce-scattered."""
  with torch.device("meta"):
    model = tp.shrink(tp.registry_config("qwen3_5:debugmodel"), layers=4).build()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(target="v6e-8", fsdp=-1), abstract=True, scan=True, sharding="fsdp")
  batch = {key: tokens(8, 512) for key in ("input_ids", "labels", "positions", "segment_ids")}
  report = compile_step(jm, *default_split(jm, batch))
  sharded = sum(v.size for v in jm.params.values() if any(v.sharding.spec))
  ideal = collectives.fsdp_ideal_bytes(sharded, jm.mesh.size, weight_bytes=2, gradient_bytes=2)
  assert report.collective_bytes.total <= 1.1 * ideal, (str(report.collective_bytes), ideal)

def test_expert_parallel_moves_tokens_to_the_experts_on_v5p(monkeypatch):
  """Experts split over ep=4: each chip keeps its 2 of the 8 experts and the tokens travel to them
  in ragged all-to-alls (counted at balanced routing, the receive buffer's bound beside it), so the
  step gathers less than plain FSDP, which brings every expert to every chip. The experts' outputs
  are added to their tokens' rows (`moe.combine_by_rows`): torchtitan's scatter by an index
  expanded to every element holds that int32 index, and its backward a gather by it, as real TPU
  buffers (more HBM traffic here; DeepSeek-V3 671B on v5p-1024, one sequence per chip: 79.4 → 76.1
  GiB of temporaries)."""
  fsdp = _family_step("qwen3:debugmodel_moe", "v5p-8")
  report = _family_step("qwen3:debugmodel_moe", "v5p-8", ep=4)
  moved = report.collective_bytes
  assert 0 < moved.by_kind["ragged-all-to-all"] < moved.bounds["ragged-all-to-all"], moved
  assert moved.by_kind["all-gather"] < fsdp.collective_bytes.by_kind["all-gather"] and moved.total < fsdp.collective_bytes.total
  monkeypatch.setattr(moe, "combine_by_rows", contextlib.nullcontext)
  by_element = _family_step("qwen3:debugmodel_moe", "v5p-8", ep=4)
  assert report.cost.hbm_bytes < by_element.cost.hbm_bytes


def _grouped_matmul_step(x, w, sizes, dy):
  """MoE experts' grouped matmul as `_grouped_mm` runs it (an fp32 product rounded to bf16), and its VJP."""
  out, vjp = jax.vjp(lambda x, w: ragged.ragged_matmul(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype), x, w)
  return out, vjp(dy)


def _grouped_matmul_args(rows, k, n, groups, sharding=lambda spec: None, specs=(None,) * 4):
  shapes = (((rows, k), jnp.bfloat16), ((groups, k, n), jnp.bfloat16), ((groups,), jnp.int32), ((rows, n), jnp.bfloat16))
  return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(spec)) for (shape, dtype), spec in zip(shapes, specs)]


def test_the_grouped_matmul_compiled_for_a_tpu_runs_megablox_with_no_convolution_over_the_experts():
  """Traced for a TPU device (here a compile-only one, on a CPU-only machine), MoE experts run jax's
  megablox kernels, forward and backward; elsewhere the blocked loop. XLA's `ragged_dot` built the
  weight gradient as a convolution over every expert, G× its FLOPs (Qwen3-30B-A3B's 32,768 rows ×
  2,048 → 768 over 128 experts on a v5p chip: 13.2 TFLOP instead of 0.1). Here the product, the
  input and the weight gradient are three Mosaic kernels of 2·M·K·N FLOPs each, and no
  convolution is left."""
  device = targets.devices("v5p-8")[0]
  rows, k, n, groups = 1024, 256, 512, 8
  args = _grouped_matmul_args(rows, k, n, groups, lambda _: jax.sharding.SingleDeviceSharding(device))
  traced = lambda: str(jax.make_jaxpr(lambda *a: _grouped_matmul_step(*a))(*args))  # noqa: E731 (a fresh trace each time)
  with target_device.compiling_for(device), _compat.without_persistent_cache():
    on_tpu = traced()
    compiled = jax.jit(lambda *a: _grouped_matmul_step(*a)).lower(*args).compile()
  assert "pallas_call" in on_tpu and "ragged_dot" not in on_tpu
  assert "pallas_call" not in traced() and "ragged_dot" not in traced()
  text = compiled.as_text()
  assert " convolution(" not in text and text.count(MOSAIC) >= 3
  assert abs(program_cost.program_cost(text).kernel_flops / (3 * 2 * rows * k * n) - 1) < 0.05


def test_the_grouped_matmul_xlas_partitioner_splits_stays_ragged_dot():
  """jax refuses a Mosaic kernel the partitioner would split ("Mosaic kernels cannot be automatically
  partitioned"): across a mesh outside a shard_map the grouped matmul stays `ragged_dot`, which the
  partitioner splits itself; inside a shard_map over every mesh axis (torchtitan's experts per data
  shard) each device runs megablox on its own rows."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(targets.devices("v5p-8")), ("fsdp",))
  specs = (P("fsdp", None), P(None, "fsdp", None), P(), P("fsdp", None))
  args = _grouped_matmul_args(1024, 256, 512, 8, lambda spec: NamedSharding(mesh, spec), specs)

  def per_shard(x, w, sizes, dy):
    out, (dx, dw) = _grouped_matmul_step(x, w, sizes, dy)
    return out, dx, jax.lax.psum(dw, "fsdp")

  # check_vma off, as `expert_parallel.Layout` runs experts (megablox's kernels declare no varying axes)
  local = jax.shard_map(per_shard, mesh=mesh, in_specs=(P("fsdp", None), P(), P(), P("fsdp", None)),
                        out_specs=(P("fsdp", None), P("fsdp", None), P()), check_vma=False)
  with target_device.compiling_for(mesh.devices.flat[0]), _compat.without_persistent_cache():
    for step, kernel in ((_grouped_matmul_step, "ragged_dot"), (local, "pallas_call")):
      fresh = lambda *a, step=step: step(*a)  # noqa: E731 (traced anew, not from another test's trace)
      assert kernel in str(jax.make_jaxpr(fresh)(*args))
      jax.jit(fresh).lower(*args).compile()  # "Mosaic kernels cannot be automatically partitioned" with megablox outside


def test_moe_experts_of_a_torchtitan_step_on_v5p_run_megablox(monkeypatch):
  """Qwen3's debug MoE scanned on v5p-8 as the recipe runs it (each data shard's experts under a
  shard_map): with `ragged_dot` its three expert weights' gradients were convolutions over the 8
  experts (`lhs_dilate=8`); now none is, and each weight's gradient is a `tgmm` kernel. The
  experts are stored split on their expert dim, so their gather lands in the layout the kernels
  read: split on the minor dim (64 of 256 columns a chip), each arrived transposed and was copied
  again (Qwen3-30B-A3B on v5p-64: 154 GB a step). 128 units an expert: a minor dim of 64 is laid
  out transposed whatever the split (half a 128-lane tile), and copied for the kernels."""
  texts = []
  report = compile_report.report
  keep_text = lambda compiled, seconds: texts.append(compiled.as_text()) or report(compiled, seconds)  # noqa: E731
  monkeypatch.setattr(compile_report, "report", keep_text)
  cost = _family_step("qwen3:debugmodel_moe", "v5p-8", expert_hidden=128).cost
  assert not re.search(r" convolution\(.*lhs_dilate", texts[-1])
  assert texts[-1].count("jit(tgmm)/pallas_call") == 3 and cost.kernel_flops > 0
  expert_copies = re.findall(r"= bf16\[(?:1,)?8,\d+,\d+\]\{[^}]*\} copy\(", texts[-1])
  assert not expert_copies, expert_copies


def test_a_step_compiled_again_for_a_target_reads_nothing_back_from_the_compile_cache():
  """A compile-only client writes its executables to jax's persistent cache but cannot read them
  back. jax decides once per process whether it uses that cache, so after any other compile (the
  recipe's own) the second compile of the same step read what the first had written and warned
  that the cache was damaged (`--target=v6e-8 --dry_run` run twice)."""
  import warnings

  jax.jit(lambda x: x * 2)(jnp.ones(2))  # conftest's cache is in use for this process from here on
  mesh = tot.make_mesh(target="v5p-8", fsdp=-1)
  inputs = jax.ShapeDtypeStruct((8, 256), jnp.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):  # two steps: each compiles the same program
      jm = tot.ShardedModule(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)), mesh=mesh, abstract=True)
      tot.make_train_step(jm, lambda out, y: ((out - y) ** 2).mean(), optax.sgd(0.1)).compile(inputs, inputs)
  assert not [w for w in caught if "persistent compilation cache" in str(w.message)], [str(w.message) for w in caught]


def test_llama3_recipe_dry_run_on_a_target_prints_the_chip_verdict(capsys):
  summary = llama3_recipe.run(llama3_recipe.Llama3Flags(target="v6e-8", dry_run=True, seqlen=128, dtype="bfloat16"))
  out = capsys.readouterr().out
  assert "TPU compiler, per chip of v6e-8 (31.2 GiB HBM): arguments" in out and ": fits); the compiler's peak " in out
  assert "; host offloaded 0 B; plan " in out
  assert "Collectives per chip per step (loops counted):" in out and "Remat auto → dots_and_attention" in out
  assert summary["compile"].fits(summary["plan"].device_bytes)


def test_remat_auto_on_a_target_takes_the_next_policy_when_the_tpu_compiler_says_no(capsys):
  """The debugmodel at 16 × 1024 tokens in 256 MiB a chip: the plan takes the scan's default
  (196 MiB planned), whose program the TPU compiler makes 0.29 GiB; so is the next policy's, the
  projections kept; auto then compiles `full` (51 MiB), which fits, and the run goes on with it."""
  flags = llama3_recipe.Llama3Flags(target="v6e-8", dry_run=True, seqlen=1024, global_batch_size=16, dtype="bfloat16",
                                    memory_gib=0.25, compile_cache="off")
  summary = llama3_recipe.run(flags)
  out = capsys.readouterr().out
  assert "Remat auto → dots_and_attention: about " in out
  assert "Remat auto: The step does not fit v6e-8: the TPU compiler's program holds " in out
  assert "; trying dots_with_no_batch_dims_saveable" in out and "; trying full" in out
  assert summary["remat"] == "full" and summary["compile"].fits(summary["plan"].device_bytes)
  assert "remat full" in summary["plan"].description
  # asked for by name, a policy is kept where the compiler refuses it (a shorter sequence: a quicker compile)
  with pytest.raises(tot.TorchOnTpuError, match="does not fit v6e-8"):
    llama3_recipe.run(dataclasses.replace(flags, remat="full", seqlen=256, memory_gib=0.012))


def test_hf_recipe_dry_run_compiles_for_v5e(tmp_path, capsys):
  h.hf_config("llama").save_pretrained(tmp_path)
  summary = hf_recipe.run(hf_recipe.HFFlags(config=str(tmp_path), target="v5e-4", dry_run=True, seqlen=64, dtype="bfloat16"))
  assert "per chip of v5e-4 (15.8 GiB HBM)" in capsys.readouterr().out
  assert summary["compile"].fits(summary["plan"].device_bytes)


@pytest.mark.parametrize("target", ["v5p-8", "tpu7x:2x2x1"])
def test_float8_matmuls_reach_the_tpu_compiler_as_float8_with_or_without_an_fp8_mxu(target):
  """torchao's rowwise float8 linears (torchtitan's converter; the head stays bf16) compile for a
  chip without an fp8 MXU (v5p) and one with (tpu7x) alike: the optimized program keeps float8
  operands for every converted matmul, forward and backward; the compiler decides how the chip
  runs them."""
  from torch_on_tpu.lowering import float8
  from torch_on_tpu.models.torchtitan import llama3_config

  config = float8.convert(llama3_config("debugmodel", attention="sdpa", max_seq_len=256), "rowwise")
  with torch.device("meta"):
    model = config.build()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(target=target, fsdp=-1), abstract=True, scan=True)
  report = compile_step(jm, tokens(8, 256), tokens(8, 256))
  assert report.matmuls.get("f8e4m3fn×f8e4m3fn", 0) >= 15 and report.matmuls.get("bf16×bf16", 0) >= 1, report.matmuls
