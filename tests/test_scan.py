"""Scan over layers: same numbers as the layer loop, original names, clear refusals."""

import collections
import copy
import warnings

import jax
import numpy as np
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h
from tests.helpers import jax_view, torch_view
from torch_on_tpu import models
from torch_on_tpu.wrapper import scan as scan_lib

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

CASES = [
  ("titan", h.titan, dict(fsdp=8), "fsdp"),
  ("titan", h.titan, dict(fsdp=4, tp=2), "fsdp_tp"),
  ("hf-llama", h.hf, dict(fsdp=8), "fsdp"),
  ("hf-llama", h.hf, dict(fsdp=4, tp=2), "fsdp_tp"),
]


@pytest.mark.parametrize("name,builder,mesh_axes,sharding", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_scanned_equals_unscanned_within_1e_6(name, builder, mesh_axes, sharding):
  mesh = tot.make_mesh(**mesh_axes)
  loop = tot.ShardedModule(builder(), mesh=mesh, sharding=sharding)
  scanned = tot.ShardedModule(builder(), mesh=mesh, sharding=sharding, scan=True)
  kwargs = h.call_kwargs(loop.module)
  tokens, labels = h.random_batch(h.vocab_of(loop.module))
  a = tot.to_cpu(h.logits_of(loop(tokens, **kwargs)))
  b = tot.to_cpu(h.logits_of(scanned(tokens, **kwargs)))
  assert h.rel(b, a) < 1e-6
  _, ga = h.jax_loss_and_grads(loop, tokens, labels, kwargs)
  _, gb = h.jax_loss_and_grads(scanned, tokens, labels, kwargs)
  gb = h.per_layer(scanned, gb)
  assert set(gb) == set(ga)
  worst = max((h.rel(gb[n], ga[n]), n) for n in ga)
  assert worst[0] < 1e-6, worst


def test_stacked_params_keep_the_maps_sharding_with_none_on_the_layer_dim():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", scan=True)
  stacked = jm.params["layers.scan.layer.attention.wo.weight"]
  assert stacked.shape == (6, 256, 256)
  assert stacked.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
  assert jm.buffers["layers.scan.layer.attention.rope.cache"].shape == (6, h.SEQ, 8)  # buffers stay buffers
  assert "layers.scan.layer.attention.rope.cache" not in jm.params


def test_a_model_with_weights_stacks_them_in_place_without_a_warning():
  """A model holding real weights is placed layer by layer, then stacked one stacked tensor at
  a time (its layers' copies freed), with nothing for jax to warn about."""
  ref = h.hf("llama", device="cpu")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), scan=True)
  assert not [str(w.message) for w in caught if "donated" in str(w.message)]
  stacked = jm.params["model.layers.scan.layer.mlp.up_proj.weight"]
  for i, layer in enumerate(ref.model.layers):
    assert (np.asarray(stacked[i]) == layer.mlp.up_proj.weight.detach().numpy()).all()


def test_state_dict_uses_the_original_per_layer_names():
  plain = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=5)
  scanned = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), seed=5, scan=True)
  a, b = plain.state_dict(), scanned.state_dict()
  assert list(a) == list(b)
  assert "layers.3.attention.qkv_linear.wq.weight" in b  # torchtitan's own save hooks still run
  for name in ("layers.3.attention.wo.weight", "layers.0.attention.qkv_linear.wk.weight", "norm.weight"):
    assert torch.equal(a[name], b[name])
  ref = h.titan(device="cpu")
  ref.load_state_dict(dict(b), strict=True)


def _loss_grads_and_temp_bytes(jm, tokens, labels):
  def loss_fn(params, t, y):
    out = jm.functional_call(params, jm.buffers, h.torch_view(t), use_cache=False)
    with h.torchax.default_env():
      loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), h.torch_view(y).flatten())
    return h.jax_view(loss)

  args = (jm.params, jm.place(tokens), jm.place(labels))
  compiled = jax.jit(jax.value_and_grad(loss_fn)).lower(*args).compile()
  loss, grads = compiled(*args)
  return float(loss), h.per_layer(jm, grads), compiled.memory_analysis().temp_size_in_bytes


NAMED = "save:self_attn.o_proj,mlp.down_proj,attention+offload:input"  # HF Llama's modules; on the CPU offload keeps in place


def test_remat_policies_change_memory_not_results():
  tokens, labels = h.random_batch(256)
  runs = {
    policy: _loss_grads_and_temp_bytes(
      tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8), scan=True, remat=policy), tokens, labels
    )
    for policy in ("none", "full", "dots_saveable", NAMED)
  }
  base_loss, base_grads, base_temp = runs["none"]
  for policy in ("full", "dots_saveable", NAMED):
    loss, grads, _ = runs[policy]
    assert loss == pytest.approx(base_loss, rel=1e-6)
    assert max(h.rel(grads[n], base_grads[n]) for n in base_grads) < 1e-6
  assert runs["full"][2] < runs[NAMED][2] < base_temp  # the named outputs kept beside `full`'s inputs


def test_loop_mode_runs_the_same_stack_unscanned_with_the_same_remat():
  tokens, labels = h.random_batch(256)
  mesh = tot.make_mesh(fsdp=8)
  looped = tot.ShardedModule(h.hf(), mesh=mesh, scan=False, remat="full")
  assert looped._layout is not None and not looped.module.model.layers.scan.scanned
  scanned = _loss_grads_and_temp_bytes(tot.ShardedModule(h.hf(), mesh=mesh, scan=True, remat="full"), tokens, labels)
  loop = _loss_grads_and_temp_bytes(looped, tokens, labels)
  unrolled = _loss_grads_and_temp_bytes(tot.ShardedModule(h.hf(), mesh=mesh, scan=True, unroll=2), tokens, labels)
  for other in (loop, unrolled):
    assert other[0] == pytest.approx(scanned[0], rel=1e-6)
    assert max(h.rel(other[1][n], scanned[1][n]) for n in scanned[1]) < 1e-6


def test_non_homogeneous_stack_names_the_first_differing_layer_and_param(caplog):
  layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
  problem = scan_lib.homogeneity_problem(layers)
  assert problem == "layer 2's 'weight' is ((4, 8), torch.float32), layer 0's is ((8, 8), torch.float32)"
  with pytest.raises(tot.TorchOnTpuError, match="layer 2's 'weight'"):
    tot.StackedLayers(layers)
  mixed = [torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)]
  assert "layer 1 is a LayerNorm" in scan_lib.homogeneity_problem(mixed)


class Uneven(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.Linear(64, 64, bias=False)])

  def forward(self, x):
    for b in self.blocks:
      x = b(x)
    return x


def test_model_with_uneven_layers_runs_unscanned_with_a_notice(caplog):
  with torch.device("meta"):
    model = Uneven()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8), scan=True)
  assert jm._layout is None
  assert any("cannot scan 'blocks'" in m and "layer 1 has no tensor 'bias'" in m for m in caplog.messages)
  assert tot.to_cpu(jm(torch.randn(8, 64))).shape == (8, 64)


def test_scanned_module_can_be_used_directly_with_extra_arguments():
  torch.manual_seed(0)

  class Block(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, scale, *, shift=None):
      return (torch.tanh(self.proj(x)) * scale + shift, None)

  layers = [Block() for _ in range(3)]
  x, scale, shift = torch.randn(4, 16), torch.randn(16), torch.randn(16)
  expected = x
  for layer in layers:
    expected = layer(expected, scale, shift=shift)[0]
  expected = expected.detach()

  class Holder(torch.nn.Module):
    def __init__(self, layers):
      super().__init__()
      self.stack = tot.StackedLayers(layers)

    def forward(self, x, scale, shift):
      return self.stack(x, scale, shift=shift)

  jm = tot.ShardedModule(Holder(layers), mesh=tot.make_mesh(fsdp=8), sharding="replicated")
  out, none = jm(x, scale, shift)
  assert none is None
  assert torch.allclose(tot.to_cpu(out), expected, atol=1e-6)


def test_kv_caches_are_refused_under_scan():
  jm = tot.ShardedModule(h.hf(), mesh=tot.make_mesh(fsdp=8), scan=True)
  tokens, _ = h.random_batch(256)
  with pytest.raises(tot.TorchOnTpuError, match="use_cache=False"):
    jm(tokens, use_cache=True)


class IndexedBlock(torch.nn.Module):
  """Same class and tensors in every layer, but the computation depends on the layer index."""

  def __init__(self, index, kind):
    super().__init__()
    self.proj = torch.nn.Linear(32, 32)
    self.rotate = kind == "alternate" and index % 2 == 1  # e.g. rotary embedding on odd layers only
    self.scale = float(index + 1) if kind == "per-layer scale" else 1.0

  def forward(self, x):
    y = self.proj(x) * self.scale
    if self.rotate:
      y = torch.roll(y, 1, dims=-1)
    return x + torch.tanh(y)


class IndexedStack(torch.nn.Module):
  def __init__(self, kind, n=4):
    super().__init__()
    self.blocks = torch.nn.ModuleList([IndexedBlock(i, kind) for i in range(n)])

  def forward(self, x):
    for b in self.blocks:
      x = b(x)
    return x


@pytest.mark.parametrize("kind,runs_as", [("alternate", "scan over pairs"), ("per-layer scale", "loop")])
def test_layers_that_differ_by_index_scan_in_groups_or_loop_never_wrong(kind, runs_as, caplog):
  torch.manual_seed(0)
  ref = IndexedStack(kind)
  x = torch.randn(8, 32)
  want = ref(x).detach()
  mesh = tot.make_mesh(fsdp=8)
  scanned = tot.ShardedModule(copy.deepcopy(ref), mesh=mesh, sharding="replicated", scan=True)
  assert scanned._layout is not None
  got = tot.to_cpu(scanned(x))
  assert h.rel(got, want) < 1e-6
  said = [m for m in caplog.messages if "do not all compute the same function" in m]
  if runs_as == "loop":
    assert said and "layer 1 differs from layer 0" in said[0] and "run as a loop" in said[0]
  else:
    assert not said
    text = jax.jit(lambda p, b, x: jax_view(scanned.functional_call(p, b, torch_view(x)))).lower(
      scanned.params, scanned.buffers, scanned.place(x)
    ).as_text()
    assert "stablehlo.while" in text  # a scan over the 2 pairs, not an unrolled loop
  def total(params):
    return jax_view(scanned.functional_call(params, scanned.buffers, torch_view(scanned.place(x)))).sum()

  ref.zero_grad()
  ref(x).sum().backward()
  grads = h.per_layer(scanned, jax.jit(jax.grad(total))(scanned.params))
  for name, p in ref.named_parameters():
    assert h.rel(grads[name], p.grad) < 1e-5, name


def test_a_loop_steered_by_per_layer_attributes_or_arguments_runs_as_written(caplog):
  """The model's own loop reads each layer's attributes and passes per-layer arguments:
  the layers it skips or feeds differently run one at a time, as it wrote them."""

  class Steered(IndexedStack):
    def forward(self, x, scales):
      for i, b in enumerate(self.blocks):
        x = x if b.rotate else b(x) * scales[i]
      return x

  torch.manual_seed(0)
  ref = Steered("alternate")
  x, scales = torch.randn(8, 32), torch.tensor([1.0, 0.5, 2.0, 1.5])
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), sharding="replicated", scan=True)
  assert h.rel(tot.to_cpu(jm(x, scales)), ref(x, scales).detach()) < 1e-6
  assert any("run one at a time" in m for m in caplog.messages)


def _mixed_attention_model(device="cpu"):
  """HF Gemma 3 with sliding and full attention alternating over 7 layers: each kind gets its
  own mask (a window of 8 < 16 tokens) and its own RoPE tables."""
  import transformers

  config = transformers.Gemma3TextConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 3 + ["sliding_attention"], tie_word_embeddings=False,
  )
  config._attn_implementation = "sdpa"
  torch.manual_seed(0)
  model = h.build_causal_lm(config, device=device)
  model.eval()
  return model


def test_hf_layers_of_alternating_kinds_scan_in_groups_each_with_its_own_mask(caplog):
  """`config.layer_types` repeating every 2 layers: layers 0-1 run one at a time and show which
  mask and RoPE tables each kind gets, layers 2-5 run as one scan over 2 groups of (sliding, full),
  layer 6 (past the last whole group) runs alone; logits and gradients as eager torch's (a
  layer given the other kind's mask would be off by far more)."""
  ref = _mixed_attention_model()
  tokens, labels = h.random_batch(256)
  kwargs = {"use_cache": False}
  ref_logits, ref_loss, ref_grads = h.torch_loss_and_grads(ref, tokens, labels, kwargs)
  mesh = tot.make_mesh(fsdp=8)
  scanned = tot.ShardedModule(copy.deepcopy(ref), mesh=mesh, scan=True)
  assert scanned._layout is not None and scanned._layout.inputs_period == 2
  logits = tot.to_cpu(scanned(tokens, **kwargs).logits)
  assert h.rel(logits, ref_logits) < 1e-5
  loss, grads = h.jax_loss_and_grads(scanned, tokens, labels, kwargs)
  grads = h.per_layer(scanned, grads)
  assert h.rel(loss, ref_loss) < 1e-5
  worst = max((h.rel(grads[n], ref_grads[n]), n) for n in ref_grads)
  assert worst[0] < 1e-4, worst
  assert not any("one at a time" in m or "as a loop" in m or "cannot scan" in m for m in caplog.messages)
  text = jax.jit(lambda p, b, t: jax_view(scanned.functional_call(p, b, torch_view(t), **kwargs).logits)).lower(
    scanned.params, scanned.buffers, scanned.place(tokens)
  ).as_text()
  assert text.count("stablehlo.while") == 1  # the two groups, one loop


class KindsBlock(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(32, 32)

  def forward(self, x, mask):
    return x + torch.tanh(self.proj(x)) * mask


class KindsStack(torch.nn.Module):
  """8 layers, each handed the mask of its kind; `kinds` alternates (a, b) until it stops."""

  def __init__(self, kinds):
    super().__init__()
    self.kinds = kinds
    self.layers = torch.nn.ModuleList([KindsBlock() for _ in kinds])

  def forward(self, x):
    masks = {"a": torch.ones(32), "b": torch.linspace(-2.0, 2.0, 32)}
    for kind, layer in zip(self.kinds, self.layers):
      x = layer(x, masks[kind])
    return x


class KindsFamily(models.Family):
  """A family whose loop hands layer i what it hands layer i mod 2 (as HF's `layer_types`)."""

  name = "kinds"

  def claims(self, module):
    return isinstance(module, KindsStack)

  def layer_inputs_period(self, module, layers):
    return 2


@pytest.fixture
def kinds_family():
  family = models.register(KindsFamily())
  yield family
  models.unregister(family)


@pytest.mark.parametrize("breaks_at", [None, 6])
def test_inputs_that_stop_repeating_run_one_at_a_time_from_there_never_wrong(breaks_at, kinds_family, caplog):
  """Layers 2-7 run as one scan over 3 groups of (a, b); a loop that hands layer 6 the other kind's
  mask gets layers 6-7 run one at a time on what it hands them, said once (serving layer 6 the
  scan's output, computed with mask a, would be off by far more than the bound)."""
  kinds = ["a", "b"] * 4
  if breaks_at is not None:
    kinds[breaks_at] = "b"
  torch.manual_seed(0)
  ref = KindsStack(kinds)
  x = torch.randn(8, 32)
  want = ref(x).detach()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), sharding="replicated", scan=True)
  assert jm._layout is not None and jm._layout.inputs_period == 2
  assert h.rel(tot.to_cpu(jm(x)), want) < 1e-6
  said = [m for m in caplog.messages if "stop repeating" in m]
  if breaks_at is None:
    assert not said
  else:
    assert len(said) == 1 and f"at layer {breaks_at}," in said[0] and "one at a time" in said[0], said


def test_hf_layers_of_alternating_kinds_train_scanned_under_fsdp_tp_as_torch():
  """Gemma 3's alternating sliding / full layers, scanned in groups, 3 AdamW steps on an fsdp x tp
  mesh: every loss and every trained weight within 1e-4 of torch eager's AdamW."""
  import optax
  import torch.nn.functional as F

  ref = _mixed_attention_model()
  ref.train()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", scan=True)
  assert jm._layout is not None and jm._layout.inputs_period == 2

  def loss_fn(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

  hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  step = tot.make_train_step(jm, loss_fn, optax.adamw(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"]))
  opt = torch.optim.AdamW(ref.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["weight_decay"])
  for i in range(3):
    tokens, labels = h.random_batch(256, seed=i)
    ours = float(step({"input_ids": tokens, "use_cache": False}, labels))
    opt.zero_grad()
    loss = loss_fn(ref(input_ids=tokens, use_cache=False), labels)
    loss.backward()
    opt.step()
    assert abs(ours - loss.item()) <= 1e-4 * abs(loss.item()), f"step {i}: loss {ours} vs torch {loss.item()}"
  trained = jm.state_dict()
  worst = max((h.rel(trained[n].numpy(), p.detach().numpy()), n) for n, p in ref.named_parameters())
  assert worst[0] < 1e-4, worst


class AuxBlock(torch.nn.Module):
  """A layer returning (hidden, aux loss, None): the aux output is carried out of the scan."""

  def __init__(self):
    super().__init__()
    self.proj = torch.nn.Linear(32, 32)

  def forward(self, x, mask):
    y = x + torch.tanh(self.proj(x)) * mask
    return y, (y**2).mean(), None


class AuxStack(torch.nn.Module):
  def __init__(self, n=4):
    super().__init__()
    self.layers = torch.nn.ModuleList([AuxBlock() for _ in range(n)])

  def forward(self, x, mask):
    aux = []
    for layer in self.layers:
      x, loss, _ = layer(x, mask)
      aux.append(loss)
    return x + torch.stack(aux).sum()


def test_layers_returning_extra_outputs_scan_and_hand_each_layer_its_own(caplog):
  torch.manual_seed(0)
  ref = AuxStack()
  x, mask = torch.randn(8, 32), torch.ones(32)
  want = ref(x, mask).detach()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), sharding="replicated", scan=True)
  assert jm._layout is not None
  assert h.rel(tot.to_cpu(jm(x, mask)), want) < 1e-6
  assert not any("one at a time" in m or "as a loop" in m for m in caplog.messages)  # one scan served every layer


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_torch_transformer_encoder_scans_at_parity(norm_first, caplog):
  """torch's own stack reads `self.layers[0]` for its fast-path checks."""
  torch.manual_seed(0)
  layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
  ref = torch.nn.TransformerEncoder(layer, num_layers=3, norm=torch.nn.LayerNorm(32), enable_nested_tensor=False)
  ref.eval()
  x = torch.randn(8, 10, 32)
  mask = torch.nn.Transformer.generate_square_subsequent_mask(10)
  want = ref(x, mask=mask, is_causal=True).detach()
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), scan=True)
  assert jm._layout is not None and not any("do not all compute" in m for m in caplog.messages)
  assert h.rel(tot.to_cpu(jm(x, mask=mask, is_causal=True)), want) < 1e-5
  assert jm.module.layers[0].self_attn.batch_first
  assert tuple(jm.module.layers[2].linear1.weight.shape) == (64, 32)  # its own slice of the stack


def _abstract_step(scan, remat=None, seq=512):
  import optax
  import torch.nn.functional as F

  from torch_on_tpu.models.torchtitan import build_llama3

  mesh = tot.make_mesh(fsdp=1, devices=jax.devices()[:1])
  model = build_llama3("debugmodel", attention="sdpa", max_seq_len=seq)
  jm = tot.ShardedModule(model, mesh=mesh, scan=scan, remat=remat, abstract=True, attention="xla")
  step = tot.make_train_step(jm, lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()), optax.adamw(1e-3))
  tokens = jax.ShapeDtypeStruct((2, seq), jax.numpy.int32)
  return jm, step, step.compile(tokens, tokens)


def test_scanned_stack_by_default_keeps_no_more_than_the_unrolled_loop_and_recomputes_no_matmul():
  """The CPU proxy for the scan's cost: XLA's temporaries of the whole train step
  (debugmodel, seq 512) scanned at the default policy vs the plain layer loop, and
  the scan body's FLOPs against keeping everything (no matmul or attention recomputed)."""
  _, _, scanned = _abstract_step(scan=True)
  _, _, loop = _abstract_step(scan=False)
  _, _, keep_all = _abstract_step(scan=True, remat="none")
  assert scanned.temp_bytes <= 1.05 * loop.temp_bytes, (scanned.temp_bytes, loop.temp_bytes)
  assert keep_all.temp_bytes > 1.1 * scanned.temp_bytes  # what the default saves
  assert scanned.flops <= 1.01 * keep_all.flops, (scanned.flops, keep_all.flops)


def test_scanned_step_copies_no_stacked_parameter_or_gradient_per_iteration():
  import re

  jm, step, _ = _abstract_step(scan=True)
  text = next(iter(step._executables.values())).as_text()
  bodies = {b for _, b in re.findall(r"while\([^)]*\), condition=%?([\w.-]+), body=%?([\w.-]+)", text)}
  assert bodies
  shapes = {tuple(a.shape) for k, a in jm.params.items() if ".scan." in k}
  shapes |= {s[1:] for s in shapes}
  copied = []
  for computation in re.split(r"\n(?=\S.*\{\n)", text):
    name = re.match(r"^%?([\w.-]+)", computation)
    if not name or name.group(1) not in bodies:
      continue
    for shape in re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", computation):
      if tuple(int(d) for d in shape.split(",") if d) in shapes:
        copied.append(shape)
  assert not copied, copied
  # Nor a stacked copy written per iteration: a forward loop carries each stacked
  # parameter's shape (size-1 dims aside) as often as the model has such parameters, a
  # backward loop twice as often (their gradients). A layer that read its weights from
  # a slice of regrouped arrays had jax save every weight again as a stacked residual.
  counts = collections.Counter(_squeezed(a.shape) for k, a in jm.params.items() if ".scan." in k)
  loops = re.findall(r"= \(([^)]*)\) while\(.*op_name=\"([^\"]*)\"", text)
  assert loops
  for carried, op_name in loops:
    allowed = 2 if "transpose(" in op_name else 1
    shapes = collections.Counter(_squeezed(int(d) for d in m.split(",")) for m in re.findall(r"\w+\[([\d,]+)\]", carried))
    extra = {shape: n for shape, n in shapes.items() if shape in counts and n > allowed * counts[shape]}
    assert not extra, (op_name, extra)


def _squeezed(shape) -> tuple:
  return tuple(d for d in shape if d != 1)


def test_layers_called_by_keyword_carry_their_leading_keyword_states():
  """Flux's form, `img, txt = block(img=img, txt=txt, vec=vec)`: the leading keywords
  the layer hands back are carried (here x; the aux loss leaves per layer)."""

  class KeywordCalls(AuxStack):
    def forward(self, x, mask):
      aux = []
      for layer in self.layers:
        x, loss, _ = layer(x=x, mask=mask)
        aux.append(loss)
      return x + torch.stack(aux).sum()

  torch.manual_seed(0)
  ref = KeywordCalls()
  x, mask = torch.randn(8, 32), torch.rand(32)
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(fsdp=8), sharding="replicated", scan=True)
  assert h.rel(tot.to_cpu(jm(x, mask)), ref(x, mask).detach()) < 1e-6
  assert jm.module.layers._modules["scan"]._state_names == ("x",)


def test_a_keyword_layer_that_hands_back_no_keyword_state_is_refused_in_one_sentence():
  class KeywordCalls(AuxStack):
    def forward(self, x, mask):
      for layer in self.layers:
        x, _, _ = layer(mask=mask, x=x)
      return x

  jm = tot.ShardedModule(KeywordCalls(), mesh=tot.make_mesh(fsdp=8), sharding="replicated", scan=True)
  with pytest.raises(tot.TorchOnTpuError, match="does not start with its first keyword tensor"):
    jm(torch.randn(8, 32), torch.ones(32))
