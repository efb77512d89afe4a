"""What the train step's program is made of, so a regression in its cost cannot come back silently.

Traced for a compile-only TPU slice (the programs a TPU or GPU runs; the CPU mesh takes the CPU
linear of `lowering.aten.model_ops` instead), nothing allocated.
"""

import collections

import jax
import jax.numpy as jnp
import optax
import torch
from jax.extend import core as jex

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.models.torchtitan import build_llama3
from torch_on_tpu.parallel import collectives


def _dot_operand_dtypes(jaxpr, found=None) -> collections.Counter:
  """(lhs dtype, rhs dtype) of every matmul in `jaxpr` and the jaxprs inside it."""
  found = collections.Counter() if found is None else found
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
      found[tuple(str(v.aval.dtype) for v in eqn.invars[:2])] += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, (jex.ClosedJaxpr, jex.Jaxpr)):
          _dot_operand_dtypes(getattr(sub, "jaxpr", sub), found)
  return found


def test_a_bf16_step_runs_every_matmul_in_bf16_both_ways():
  """bf16 linears with a bias add it in the fp32 accumulator and round once, as torch's addmm does,
  without widening their backward: every GEMM of the step, forward and backward, is bf16 × bf16
  (jax differentiating an fp32 accumulator fed its fp32 cotangent to dX and dW, two thirds of the
  step's GEMM FLOPs in fp32: 0.314 → 0.194 s/step for Llama 3 1B on an H100)."""
  config = h.hf_config("qwen2")  # q, k and v projections with biases
  # attention on XLA's kernel: splash (which HF models reach on TPU) keeps its softmax gradient's products in fp32 by design
  jm = tot.ShardedModule(h.build_causal_lm(config), mesh=tot.make_mesh(target="v5p-8", fsdp=-1), abstract=True, attention="xla")
  loss = lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())  # noqa: E731
  step = tot.make_train_step(jm, loss, optax.sgd(1e-3), compute_dtype=jnp.bfloat16)
  shapes = lambda tree: {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}  # noqa: E731
  ids = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  opt_state = jax.eval_shape(step.optimizer.init, shapes(jm.params))
  jaxpr = jax.make_jaxpr(step.pure)(shapes(jm.params), shapes(jm.buffers), opt_state, {"input_ids": ids}, ids)
  dtypes = _dot_operand_dtypes(jaxpr.jaxpr)
  assert set(dtypes) == {("bfloat16", "bfloat16")} and sum(dtypes.values()) >= 3 * 7 * config.num_hidden_layers, dtypes  # forward, dX, dW


def _titan_step_on(target: str, seq: int, **module_kw):
  model = build_llama3("debugmodel", attention="sdpa", max_seq_len=seq)
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(target=target, fsdp=-1), abstract=True, scan=True, **module_kw)
  loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
  tokens = jax.ShapeDtypeStruct((8, seq), jnp.int32)
  return jm, tot.make_train_step(jm, loss, optax.adamw(1e-3), compute_dtype=jnp.bfloat16).compile(tokens, tokens)


def test_an_fsdp_step_on_tpu_moves_weights_and_gradients_and_nothing_else():
  """FSDP's collectives only: weights all-gathered, gradients reduce-scattered (the TPU compiler's
  all-reduce-scatter fusions), no all-to-all. The scan's hidden state is pinned to the batch
  split on every layer: left to the partitioner, it was resharded in every layer (all-to-all
  1.0 → 10.0 GiB per chip per step for Llama 3 1B on v5p-8 once the stacked layer outputs were
  dropped; RoPE's complex view is elementwise and splits as the batch does). In all, within
  1.1× of FSDP's ideal: each weight gathered in bf16 for the forward and again for the
  backward, its gradient reduce-scattered in bf16 (0.98× measured)."""
  jm, report = _titan_step_on("v6e-8", 256, remat="full")
  kinds = {k: v for k, v in report.collective_bytes.by_kind.items() if v > 64 * 1024}
  assert set(kinds) <= {"all-gather", "reduce-scatter", "collective-permute"} and "all-to-all" not in kinds, kinds
  sharded = sum(v.size for v in jm.params.values() if any(v.sharding.spec))
  ideal = collectives.fsdp_ideal_bytes(sharded, jm.mesh.size, weight_bytes=2, gradient_bytes=2)
  assert report.collective_bytes.total <= 1.1 * ideal, (report.collective_bytes, ideal)


def test_an_fsdp_tp_step_on_tpu_moves_what_fsdp_and_tp_need(monkeypatch):
  """fsdp=4 × tp=2: each weight's tp part gathered and reduce-scattered over fsdp, each layer's
  activations all-reduced over tp (Megatron's count, recomputed under remat full), and the
  logits gathered over tp once for the loss, which reads whole rows. The loss's gradient buffer
  is pinned to its rows' split after its chunk loop: left to take the head's vocabulary split,
  it was gathered whole for every chunk (Llama 3 1B at batch 8 × 2048 on v6e-8: 68.3 → 6.7 GiB
  of collectives per chip per step; here 38.1 → 22.1 MiB). The whole-row gradient keeps the
  logits' own split: pinned to the rows' split, it was gathered over tp again (0.96×). Within
  0.94× of those counts (0.915× measured)."""
  from torch_on_tpu.training import losses

  monkeypatch.setattr(losses, "MIN_CHUNK", 128)
  monkeypatch.setattr(losses, "CHUNK_BYTES", 512 * 4 * 128)  # 16 chunks of the debugmodel's 2048 columns
  seq, batch, fsdp, tp = 256, 8, 4, 2
  model = build_llama3("debugmodel", attention="sdpa", max_seq_len=seq)
  mesh = tot.make_mesh(target="v6e-8", fsdp=fsdp, tp=tp)
  jm = tot.ShardedModule(model, mesh=mesh, sharding="fsdp_tp", abstract=True, scan=True, remat="full")
  loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  report = tot.make_train_step(jm, loss, optax.adamw(1e-3), compute_dtype=jnp.bfloat16).compile(tokens, tokens)
  assert report.ops.get("while", 0) >= 3, report.ops  # the layers' loops and the loss's chunk loops
  tp_part = sum(v.size // (tp if "tp" in jax.tree.leaves(tuple(v.sharding.spec)) else 1)
                for v in jm.params.values() if "fsdp" in jax.tree.leaves(tuple(v.sharding.spec)))
  rows, dim, layers, vocab = batch * seq // fsdp, model.config.dim, len(model.config.layers), model.config.vocab_size
  needed = (
    collectives.fsdp_ideal_bytes(tp_part, fsdp, weight_bytes=2, gradient_bytes=2)
    + collectives.tp_ideal_bytes(rows, dim, tp, layers=layers, activation_bytes=2, recomputed=True)
    + rows * vocab * 2 * (tp - 1) // tp  # the logits, gathered over tp for the loss
  )
  assert report.collective_bytes.total <= 0.94 * needed, (str(report.collective_bytes), needed)


def _loss_step_temporaries() -> tuple[int, int, collections.Counter]:
  """(temporaries, one device's [tokens, vocab] logits in bytes, op counts) of a bf16 HF Llama
  step compiled for v5p-8: a 16384-token vocabulary, 256 tokens a device."""
  config = h.hf_config("llama")
  config.vocab_size = 16384
  jm = tot.ShardedModule(h.build_causal_lm(config), mesh=tot.make_mesh(target="v5p-8", fsdp=-1), abstract=True)
  loss = lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
  ids = jax.ShapeDtypeStruct((4, 256), jnp.int32)
  report = tot.make_train_step(jm, loss, optax.sgd(1e-3), compute_dtype=jnp.bfloat16).compile({"input_ids": ids}, ids)
  return report.temp_bytes, 256 * config.vocab_size * 2, collections.Counter(report.ops)


def test_the_loss_writes_its_gradient_over_the_logits_on_tpu(monkeypatch):
  """On TPU the loss's backward is one fused pass over whole rows, written into the logits'
  own buffer: the chunk loop the CPU runs writes a second [tokens, vocab] buffer (Llama 3.1 8B
  on v6e-8 at batch 8 × 8192: temporaries 11.24 → 9.61 GiB). The bit-pattern view of bf16
  logits, a CPU workaround, stays off: on TPU it cost another copy (Llama 3 1B on v5p-8:
  temporaries 11.2 → 7.3 GiB without it)."""
  from torch_on_tpu.training import losses

  in_place, logits, ops = _loss_step_temporaries()
  assert ops.get("bitcast-convert", 0) == 0 and ops.get("while", 0) >= 1, ops  # the forward's chunk loop
  monkeypatch.setattr(losses, "_gradient_chunk", lambda chunk, vocab: vocab // 2)  # a loop of two chunks
  looped, _, _ = _loss_step_temporaries()
  assert looped - in_place >= 0.9 * logits, (looped, in_place, logits)


def _step_instructions(layers: int) -> int:
  model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1))
  step = tot.make_train_step(jm, torch.nn.functional.mse_loss, optax.adamw(1e-3), skip_nonfinite=True)
  x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
  return sum(step.compile(x, x).ops.values())


def test_the_step_grows_with_its_parameters_not_with_their_square():
  """`skip_nonfinite` keeps every leaf's old value unless all the new ones are finite. XLA made
  that flag a chain of scalar ands, one per leaf, and copied the whole chain into every leaf's
  update: 40 → 80 linears went from 130k to 491k instructions (3.8×), and Qwen3.5's debugmodel
  (520 leaves) compiled 367k instructions in 105 s on CPU; computed once, 57k in 30 s."""
  small, large = _step_instructions(24), _step_instructions(48)
  assert large < 2.2 * small, (small, large)


def _optimizer_bytes(skip_nonfinite: bool) -> float:
  with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(target="v5p-8", fsdp=-1), abstract=True)
  step = tot.make_train_step(jm, torch.nn.functional.mse_loss, optax.adamw(1e-3), skip_nonfinite=skip_nonfinite)
  x = jax.ShapeDtypeStruct((8, 2048), jnp.float32)
  return step.compile(x, x).cost.hbm_bytes


def test_skipping_a_nonfinite_step_costs_no_pass_over_the_state_on_tpu():
  """The skip is decided before the update (loss and gradient norm), so keeping the old state is
  part of the update's own kernels. A predicate read from the new state needed a second pass:
  new and old read, the kept state written (this model: 1.21× the HBM bytes of the step
  without skipping; now 1.04×)."""
  skipping, plain = _optimizer_bytes(True), _optimizer_bytes(False)
  assert skipping < 1.1 * plain, (skipping, plain)


class _MLPStack(torch.nn.Module):
  """Two residual MLP blocks, their matmuls large enough that the TPU compiler would run them as
  collective matmuls (windowed einsums)."""

  def __init__(self, dim=512, hidden=2048):
    super().__init__()
    self.blocks = torch.nn.ModuleList(
      torch.nn.Sequential(torch.nn.Linear(dim, hidden, bias=False), torch.nn.SiLU(), torch.nn.Linear(hidden, dim, bias=False))
      for _ in range(2)
    )

  def forward(self, x):
    for block in self.blocks:
      x = x + block(x)
    return x


def _mlp_step_on_v6e(monkeypatch, collective_matmul: bool):
  from torch_on_tpu.runtime import xla_flags

  monkeypatch.setattr(xla_flags, "COLLECTIVE_MATMUL", collective_matmul)
  jm = tot.ShardedModule(_MLPStack(), mesh=tot.make_mesh(target="v6e-8", fsdp=-1), abstract=True)
  step = tot.make_train_step(jm, torch.nn.functional.mse_loss, optax.sgd(1e-3), compute_dtype=jnp.bfloat16)
  x = jax.ShapeDtypeStruct((8 * 2048, 512), jnp.float32)
  ideal = collectives.fsdp_ideal_bytes(sum(v.size for v in jm.params.values()), 8, weight_bytes=2, gradient_bytes=2)
  return step.compile(x, x), ideal


def test_fsdp_on_tpu_gathers_and_reduce_scatters_whole_unless_collective_matmuls_are_asked_for(monkeypatch):
  """By default the TPU compiler's collective matmuls are off (`xla_flags.COLLECTIVE_MATMUL`):
  each weight is gathered once per pass and each gradient reduce-scattered once, FSDP's ideal
  (1.00× here), where the windowed einsums moved 1.13× (Llama 3.1 8B on v6e-8: 2.04×,
  CHANGELOG.md). Asked for, they come back, and the program's FLOPs read the
  same: their loops, which count by 2 without a known trip count, are counted as they run."""
  plain, ideal = _mlp_step_on_v6e(monkeypatch, False)
  assert plain.ops.get("while", 0) == 0, plain.ops
  assert plain.collective_bytes.total <= 1.02 * ideal, (str(plain.collective_bytes), ideal)
  windowed, _ = _mlp_step_on_v6e(monkeypatch, True)
  assert windowed.ops.get("while", 0) >= 1, windowed.ops
  assert windowed.collective_bytes.total > 1.05 * ideal, (str(windowed.collective_bytes), ideal)
  assert abs(windowed.cost.flops - plain.cost.flops) <= 1e-3 * plain.cost.flops, (windowed.cost.flops, plain.cost.flops)
