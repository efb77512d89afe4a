"""The chunked cross-entropy head: parity with torch eager, its fallback, its use in the
train step, and the temporaries it saves at a 128k vocabulary (abstract compile only)."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
import transformers

import torch_on_tpu as tot
from tests import helpers as h
from tests import test_plan
from torch_on_tpu.core import _compat
from torch_on_tpu.training import losses

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)


def _targets(rows, vocab, ignore_index, seed=0):
  t = np.random.default_rng(seed).integers(0, vocab, rows)
  t[::5] = ignore_index  # -100, or a real class that is then ignored
  t[3] = vocab - 1
  return t


# vocab 37: one chunk (no loop); 1000 by 128: a last chunk overlapping its neighbour;
# 1024 by 128: chunks that tile the vocabulary exactly.
@pytest.mark.parametrize("vocab,chunk", [(37, None), (1000, 128), (1024, 128)])
@pytest.mark.parametrize("ignore_index", [-100, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_chunked_cross_entropy_matches_torch_loss_and_gradient(vocab, chunk, ignore_index, reduction, label_smoothing):
  x = np.random.default_rng(1).standard_normal((64, vocab)).astype(np.float32) * 3
  t = _targets(64, vocab, ignore_index)
  xt = torch.tensor(x, requires_grad=True)
  kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
  want = F.cross_entropy(xt, torch.tensor(t), **kw)
  want.backward(torch.ones_like(want))

  loss, vjp = jax.vjp(lambda a: losses.chunked_cross_entropy(a, jnp.asarray(t), chunk=chunk, **kw), jnp.asarray(x))
  (grad,) = vjp(jnp.ones_like(loss))
  assert loss.dtype == jnp.float32
  assert h.rel(loss, want.detach()) < 1e-5
  assert h.rel(grad, xt.grad) < 1e-5


def test_bf16_logits_get_a_bf16_gradient_from_fp32_statistics():
  x = np.random.default_rng(2).standard_normal((16, 300)).astype(np.float32) * 4
  x16 = jnp.asarray(x, jnp.bfloat16)
  t = jnp.asarray(_targets(16, 300, -100))
  loss, vjp = jax.vjp(lambda a: losses.chunked_cross_entropy(a, t, chunk=128), x16)
  (grad,) = vjp(jnp.ones_like(loss))
  want, want_vjp = jax.vjp(lambda a: losses.chunked_cross_entropy(a, t), x16.astype(jnp.float32))
  assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
  assert abs(float(loss) - float(want)) < 1e-6  # bf16 → fp32 is exact; the sums are fp32
  np.testing.assert_array_equal(grad, want_vjp(jnp.ones_like(want))[0].astype(jnp.bfloat16))


@pytest.mark.parametrize("chunk", [None, 128])
def test_logits_in_the_models_own_shape_get_their_gradient_in_that_shape(chunk):
  """[batch, seq, vocab] logits with [batch·seq] targets: the same loss and gradient as the flat
  rows, the gradient in the logits' own shape (what XLA:TPU needs to write it over them)."""
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 8, 300)) * 3, jnp.bfloat16)
  t = jnp.asarray(_targets(16, 300, -100))
  kw = dict(chunk=chunk, label_smoothing=0.1)
  loss, vjp = jax.vjp(lambda a: losses.chunked_cross_entropy(a, t, **kw), x)
  (grad,) = vjp(jnp.ones_like(loss))
  want, want_vjp = jax.vjp(lambda a: losses.chunked_cross_entropy(a, t, **kw), x.reshape(16, 300))
  assert grad.shape == x.shape and grad.dtype == jnp.bfloat16
  assert float(loss) == float(want)
  np.testing.assert_array_equal(grad.reshape(16, 300), want_vjp(jnp.ones_like(want))[0])


def test_the_loss_reads_the_models_output_in_its_own_shape():
  """Flattened rows of the model's bf16 output reach the chunked loss as that output itself
  ([batch, seq, vocab]); rows that are not its leading dims flattened get their own view."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 40)), jnp.bfloat16)
  t = torch_view(jnp.asarray(_targets(8, 40, -100)))
  upcasts = losses.Upcasts()
  model = tot.ShardedModule(torch.nn.Linear(1, 1), mesh=tot.make_mesh(fsdp=-1))
  with torchax.default_env(), losses.installed(model, upcasts), upcasts, mock.patch.object(losses, "chunked_cross_entropy") as chunked:
    wide = upcasts.to_fp32(torch_view(x))
    F.cross_entropy(wide.flatten(0, 1), t)
    assert chunked.call_args.args[0].shape == (2, 4, 40) and chunked.call_args.args[0].dtype == jnp.bfloat16
    F.cross_entropy(wide.view(8, 40), t)
    assert chunked.call_args.args[0].shape == (2, 4, 40)
    F.cross_entropy(wide.transpose(0, 1).reshape(8, 40), t)  # other rows: not a rearrangement kept
    assert chunked.call_args.args[0].shape == (8, 40) and chunked.call_args.args[0].dtype == jnp.float32
    F.cross_entropy(wide[:1].flatten(0, 1), t[:4])  # a slice: its own rows, in bf16
    assert chunked.call_args.args[0].shape == (4, 40) and chunked.call_args.args[0].dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "call",
  [
    lambda x, t: F.cross_entropy(x, t, weight=x.new_ones(x.shape[1]).cumsum(0) / x.shape[1]),
    lambda x, t: F.cross_entropy(x.reshape(4, 4, -1).transpose(1, 2), t.reshape(4, 4)),  # (N, C, d)
    lambda x, t: F.cross_entropy(x, torch.softmax(x * 2, 1).detach()),  # probability targets
  ],
  ids=["class weights", "N-D logits", "probabilities"],
)
def test_what_the_chunked_head_cannot_express_goes_to_torchax(call):
  x = torch.randn(16, 40)
  t = torch.tensor(_targets(16, 40, -100))
  env = torchax.default_env()
  with env, losses.installed(tot.ShardedModule(torch.nn.Linear(1, 1), mesh=tot.make_mesh(fsdp=-1))), mock.patch.object(losses, "chunked_cross_entropy") as chunked:
    ours = call(torch_view(jnp.asarray(x.numpy())), torch_view(jnp.asarray(t.numpy())))
  chunked.assert_not_called()
  assert h.rel(jax_view(ours), call(x, t)) < 1e-6


def _llama(vocab, layers=2):
  return transformers.LlamaConfig(
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=layers,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
  )


def _ce(out, labels):
  return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def test_hf_llama_step_loss_and_grads_match_torch_through_the_chunked_head():
  config = _llama(vocab=300)  # not a multiple of the chunk below
  jm = tot.ShardedModule(h.build_causal_lm(config), mesh=tot.make_mesh(fsdp=-1))
  ref = h.reference(jm, lambda device: h.build_causal_lm(config, device=device))
  g = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, 300, (8, 16), generator=g)
  labels = torch.randint(0, 300, (8, 16), generator=g)
  labels[:, :3] = -100
  step = tot.make_train_step(jm, _ce, optax.adamw(1e-3))
  real = losses.chunked_cross_entropy
  with mock.patch.object(losses, "chunked_cross_entropy", side_effect=lambda *a, **k: real(*a, **k, chunk=128)) as chunked:
    loss, grads = step.gradients({"input_ids": tokens}, labels)
  chunked.assert_called()
  ref.zero_grad()
  want = _ce(ref(input_ids=tokens), labels)
  want.backward()
  assert abs(float(loss) - want.item()) / want.item() < 1e-5
  for name, p in ref.named_parameters():
    assert h.rel(grads[name], p.grad) < 1e-5, name


def test_a_128k_vocabulary_step_saves_at_least_the_fp32_logits_in_temporaries():
  """tokens × vocab × 4 bytes fewer temporaries than torchax's lowering (one device)."""
  vocab, batch, seq = 128256, 2, 2048
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  spec = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  temps = {}
  for name, head in (("torchax", lambda model, upcasts: contextlib.nullcontext()), ("chunked", losses.installed)):
    with torch.device("meta"):
      model = transformers.LlamaForCausalLM(_llama(vocab, layers=1))
    jm = tot.ShardedModule(model, mesh=mesh, abstract=True)
    step = tot.make_train_step(jm, _ce, optax.adamw(1e-3))
    with mock.patch.object(losses, "installed", head):
      temps[name] = step.compile({"input_ids": spec}, spec).temp_bytes
  assert temps["torchax"] - temps["chunked"] >= batch * seq * vocab * 4, temps


def _bf16_step(vocab, layers=1, abstract=True, **kw):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  with torch.device("meta" if abstract else "cpu"):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama(vocab, layers=layers))
  jm = tot.ShardedModule(model, mesh=mesh, abstract=abstract)
  return tot.make_train_step(jm, _ce, optax.adamw(1e-3), compute_dtype=jnp.bfloat16, **kw)


def _no_source():
  """The step as it was: the chunked head reads the fp32 copy."""
  none = staticmethod(lambda t: None)
  return mock.patch.multiple(losses.Upcasts, source=none, whole=none)


def test_the_bf16_step_builds_no_fp32_copy_of_the_logits():
  """The loss sees fp32 logits, but the chunked head reads their bf16 source: no chunk
  loop carries an f32 [tokens, vocab] buffer, and the temporaries drop by at least a
  bf16 copy of the logits against reading the fp32 copy. (On CPU the lm_head's dot
  itself writes fp32 before rounding to bf16, so one fp32 [tokens, vocab] buffer stays
  in the step; the drop measured here is 0.76 of the fp32 logits, not 2.)"""
  vocab, batch, seq = 32000, 2, 256
  spec = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  temps, carried = {}, {}
  for name, patch in (("bf16 source", contextlib.nullcontext()), ("fp32 copy", _no_source())):
    step = _bf16_step(vocab)
    with patch:
      temps[name] = step.compile({"input_ids": spec}, spec).temp_bytes
    text = next(iter(step._executables.values())).as_text()
    carried[name] = [line for line in text.splitlines() if " while(" in line and f"f32[{batch * seq},{vocab}]" in line]
  assert carried["fp32 copy"] and not carried["bf16 source"], carried
  assert temps["fp32 copy"] - temps["bf16 source"] >= batch * seq * vocab * 2, temps


def test_reading_the_bf16_source_gives_the_fp32_copys_loss_and_gradients():
  g = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, 300, (4, 16), generator=g)
  labels = torch.randint(0, 300, (4, 16), generator=g)
  labels[:, :2] = -100
  step = _bf16_step(300, layers=2, abstract=False)
  loss, grads = step.gradients({"input_ids": tokens}, labels)
  with _no_source():
    want, want_grads = _bf16_step(300, layers=2, abstract=False).gradients({"input_ids": tokens}, labels)
  assert abs(float(loss) - float(want)) <= 1e-6 * abs(float(want))
  for name, grad in want_grads.items():
    assert h.rel(grads[name], grad) < 1e-6, name


def test_a_loss_that_rescales_the_logits_reads_the_fp32_copy():
  """Arithmetic on the fp32 logits (here a temperature) is not a rearrangement: the head
  must see the fp32 values the loss computed, not the bf16 source."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 40)), jnp.bfloat16)
  t = torch_view(jnp.asarray(_targets(8, 40, -100)))
  upcasts = losses.Upcasts()
  model = tot.ShardedModule(torch.nn.Linear(1, 1), mesh=tot.make_mesh(fsdp=-1))
  env = torchax.default_env()
  with env, losses.installed(model, upcasts), upcasts, mock.patch.object(losses, "chunked_cross_entropy") as chunked:
    wide = upcasts.to_fp32(torch_view(x))
    F.cross_entropy(wide.view(8, 40)[:, :], t)
    assert chunked.call_args.args[0].dtype == jnp.bfloat16
    F.cross_entropy(wide / 3.0, t)
    assert chunked.call_args.args[0].dtype == jnp.float32
    wide.div_(3.0)  # in place: the same tensor with other values, its bf16 source no longer them
    F.cross_entropy(wide.view(8, 40), t)
    assert chunked.call_args.args[0].dtype == jnp.float32


# ---- the output head fused with the loss ------------------------------------------------------

def _head_case(vocab, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((64, 32)).astype(np.float32)
  w = rng.standard_normal((vocab, 32)).astype(np.float32) * 0.5
  return torch.tensor(x).to(dtype).requires_grad_(), torch.tensor(w).to(dtype).requires_grad_()


def _head_grads(xt, wt, t, devices, **kw):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
  f = lambda a, b: losses.head_cross_entropy(a, b, jnp.asarray(t.numpy()), mesh=mesh, row_axes=("fsdp",), **kw)  # noqa: E731
  to_jax = lambda p: jnp.asarray(p.detach().float().numpy(), jnp.bfloat16 if p.dtype == torch.bfloat16 else jnp.float32)  # noqa: E731
  loss, vjp = jax.vjp(f, to_jax(xt), to_jax(wt))
  return loss, vjp(jnp.ones_like(loss))


def _f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32)) if not isinstance(a, torch.Tensor) else a.detach().float()


# vocab 1000 by 128: an overlapping last chunk; 1024 by 128: exact chunks; 48: one chunk, no loop
@pytest.mark.parametrize("vocab,chunk", [(1000, 128), (1024, 128), (48, None)])
@pytest.mark.parametrize("reduction,ignore_index,label_smoothing", [("mean", -100, 0.0), ("sum", 5, 0.1), ("none", -100, 0.1)])
def test_the_fused_head_matches_torchs_linear_then_cross_entropy(vocab, chunk, reduction, ignore_index, label_smoothing):
  """fp32, rows over 4 devices: the loss and both gradients within 1e-5 of torch eager."""
  xt, wt = _head_case(vocab, torch.float32)
  t = torch.tensor(_targets(64, vocab, ignore_index))
  kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
  want = F.cross_entropy(F.linear(xt, wt), t, **kw)
  want.backward(torch.ones_like(want))
  loss, (gx, gw) = _head_grads(xt, wt, t, 4, chunk=chunk, **kw)
  assert h.rel(loss, want.detach()) < 1e-5
  assert h.rel(gx, xt.grad) < 1e-5 and h.rel(gw, wt.grad) < 1e-5


def test_the_fused_bf16_head_rounds_as_torch_does():
  """bf16 on one device: the logits rounded to bf16 as the linear rounds them, the loss in fp32,
  d x and d weight each one bf16 rounding of an fp32 sum, as torch's bf16 linear backward (only
  the order of the sums differs). Over 4 devices each device's d weight is its rows' (rounded to
  bf16, as every weight gradient of a bf16 FSDP step is) and the devices' sum is reduce-scattered:
  torch's per-rank bf16 gradients summed, not one rounding of the whole sum. The order of the
  fp32 sums is the CPU's (torch's bf16 matmul on a CPU with AVX512-BF16 sums otherwise): a bf16
  ulp apart here and there, 2e-5 at most seen; chunks each rounded to bf16, then summed, are
  2.8e-3 off."""
  xt, wt = _head_case(1000, torch.bfloat16)
  t = torch.tensor(_targets(64, 1000, -100))
  want = F.cross_entropy(F.linear(xt, wt).float(), t, label_smoothing=0.1)
  want.backward()
  loss, (gx, gw) = _head_grads(xt, wt, t, 1, chunk=128, label_smoothing=0.1)
  assert gx.dtype == gw.dtype == jnp.bfloat16
  assert abs(float(loss) - want.item()) <= 1e-6 * want.item()
  assert h.rel(_f32(gx), _f32(xt.grad)) < 1e-4 and h.rel(_f32(gw), _f32(wt.grad)) < 1e-4

  _, (gx4, gw4) = _head_grads(xt, wt, t, 4, chunk=128, label_smoothing=0.1)
  ranks = []
  for rows in torch.arange(64).chunk(4):  # each rank's rows, the global mean's scale
    x, w = xt.detach()[rows].clone().requires_grad_(), wt.detach().clone().requires_grad_()
    part = F.cross_entropy(F.linear(x, w).float(), t[rows], label_smoothing=0.1, reduction="sum") / (t != -100).sum()
    part.backward()
    ranks.append(w.grad.float())
  per_rank = sum(ranks).to(torch.bfloat16).float()
  assert h.rel(_f32(gx4), _f32(xt.grad)) < 1e-4
  assert h.rel(_f32(gw4), per_rank) < 1e-4 < h.rel(per_rank, _f32(wt.grad))  # 4.6e-6; 2.8e-3


def _titan_step():
  jm = tot.ShardedModule(h.titan(device="cpu"), mesh=tot.make_mesh(fsdp=-1), seed=0)
  loss = lambda pred, y: F.cross_entropy(pred.flatten(0, 1).float(), y.flatten())  # torchtitan's own  # noqa: E731
  return jm, loss, tot.make_train_step(jm, loss, optax.adamw(1e-3), fuse_head=True)


def test_the_step_fuses_an_output_head_with_its_loss_and_matches_torch():
  """torchtitan's Llama 3 debugmodel (its `output` a bias-free linear, vocab 2048) over 8
  devices: the loss reads the head's input and weight, and the step's loss and gradients match
  torch eager within 1e-5."""
  jm, loss_fn, step = _titan_step()
  ref = h.reference(jm, h.titan)
  g = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, 2048, (8, h.SEQ), generator=g)
  labels = torch.randint(0, 2048, (8, h.SEQ), generator=g)
  with mock.patch.object(losses, "head_cross_entropy", wraps=losses.head_cross_entropy) as fused:
    loss, grads = step.gradients(tokens, labels)
  fused.assert_called()
  ref.zero_grad()
  want = loss_fn(ref(tokens), labels)
  want.backward()
  assert abs(float(loss) - want.item()) / want.item() < 1e-5
  for name, p in ref.named_parameters():
    assert h.rel(grads[name], p.grad) < 1e-5, name


def test_a_fused_head_keeps_neither_the_logits_nor_their_gradient():
  """HF Llama at a 128k vocabulary, 2 × 2048 tokens on one device, bf16 compute: the
  temporaries drop by at least the bf16 logits and their bf16 gradient."""
  vocab, batch, seq = 128256, 2, 2048
  spec = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  temps = {}
  for name, fuse in (("fused", True), ("logits", False)):
    temps[name] = _bf16_step(vocab, fuse_head=fuse).compile({"input_ids": spec}, spec).temp_bytes
  assert temps["logits"] - temps["fused"] >= 2 * (batch * seq * vocab * 2), temps


class _ScaledHead(test_plan.Tiny):
  """A bias-free output head whose result the model scales in place before returning it."""

  def forward(self, tokens):
    logits = super().forward(tokens)
    logits *= 0.5
    return logits


def test_a_head_output_changed_in_place_is_not_fused():
  """`logits *= 0.5` keeps the linear's tensor with other values: the loss must read them."""
  torch.manual_seed(0)
  model = _ScaledHead()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1), seed=0)
  ref = h.reference(jm, lambda device: _ScaledHead().to(device))
  loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
  step = tot.make_train_step(jm, loss_fn, optax.sgd(1e-3), fuse_head=True)
  tokens = torch.randint(0, 512, (8, 4), generator=torch.Generator().manual_seed(1))
  with mock.patch.object(losses, "head_cross_entropy", wraps=losses.head_cross_entropy) as fused:
    loss, grads = step.gradients(tokens, tokens)
  fused.assert_not_called()
  want = loss_fn(ref(tokens), tokens)
  want.backward()
  assert abs(float(loss) - want.item()) / want.item() < 1e-5
  assert h.rel(grads["out.weight"], ref.out.weight.grad) < 1e-5


def test_targets_of_another_length_are_refused_in_torchs_words():
  """Eager torch names both lengths; a traced chunked loss would fail inside jax instead."""
  jm = tot.ShardedModule(test_plan.Tiny(), mesh=tot.make_mesh(fsdp=-1), seed=0)
  loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()[:-1])  # noqa: E731
  step = tot.make_train_step(jm, loss_fn, optax.sgd(1e-3))
  tokens = torch.randint(0, 512, (8, 4), generator=torch.Generator().manual_seed(1))
  with pytest.raises(ValueError, match=r"^Expected input batch_size \(32\) to match target batch_size \(31\)\."):
    step.gradients(tokens, tokens)
