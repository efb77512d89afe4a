"""Sharded gradient sweep: every op whose backward gathers or scatters, on tables
sharded over the mesh, against torch eager on one CPU (values and gradients).

The table is 64 rows on `fsdp=8` (8 rows a shard) or `fsdp=4, tp=2`; the ids
fall in every shard and on both sides of every shard boundary. A gradient that
is wrong on a few rows only (the misplaced `padding_idx` gradient was wrong on
7 of 64) fails the per-element check even where the norm barely moves.
"""

import copy

import jax
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding, PartitionSpec

import torch_on_tpu as tot
from tests import helpers as h

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

ROWS, DIM = 64, 8
TOL = 1e-5
BOUNDARY_IDS = [0, 7, 8, 9, 15, 16, 23, 24, 31, 32, 39, 40, 47, 48, 55, 56, 63]


def _ids(shape, seed, pad=None):
  """Ids covering every shard boundary, random ids, and (if given) many pad ids."""
  g = torch.Generator().manual_seed(seed)
  ids = torch.randint(0, ROWS, shape, generator=g).flatten()
  ids[: len(BOUNDARY_IDS)] = torch.tensor(BOUNDARY_IDS)
  if pad is not None:
    ids[len(BOUNDARY_IDS) :: 3] = pad
  return ids[torch.randperm(ids.numel(), generator=g)].reshape(shape)


def _param(*shape, seed=0):
  g = torch.Generator().manual_seed(seed)
  return torch.nn.Parameter(torch.randn(*shape, generator=g))


class Op(torch.nn.Module):
  """A table (and any extra params) through one op: `forward(*inputs) = fn(self, *inputs)`."""

  def __init__(self, fn, **params):
    super().__init__()
    self.fn = fn
    self.table = _param(ROWS, DIM)
    for i, (name, shape) in enumerate(params.items(), start=1):
      setattr(self, name, _param(*shape, seed=i))

  def forward(self, *inputs):
    return self.fn(self, *inputs)


class Embeddings(torch.nn.Module):
  """torch.nn's own embedding modules, as users write them."""

  def __init__(self, cls, **kwargs):
    super().__init__()
    self.emb = cls(ROWS, DIM, **kwargs)

  def forward(self, *inputs, **kwargs):
    return self.emb(*inputs, **kwargs)


def _unique_rows(n, seed):
  return torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed))[:n]


def _setitem(m, rows):
  t = m.table.clone()
  t[8] = m.row_a  # one row at a shard boundary: the single-index scatter XLA folded wrongly
  t[rows] = m.rows_b
  return t


CASES = {
  "embedding": (lambda: Op(lambda m, x: F.embedding(x, m.table)), lambda: (_ids((8, 12), 1),)),
  "embedding padding_idx=0": (
    lambda: Embeddings(torch.nn.Embedding, padding_idx=0),
    lambda: (_ids((8, 12), 2, pad=0),),
  ),
  "embedding padding_idx=8 (first row of shard 1)": (
    lambda: Embeddings(torch.nn.Embedding, padding_idx=8),
    lambda: (_ids((8, 12), 3, pad=8),),
  ),
  "embedding scale_grad_by_freq, padding_idx=63": (
    lambda: Embeddings(torch.nn.Embedding, padding_idx=63, scale_grad_by_freq=True),
    lambda: (_ids((8, 12), 4, pad=63),),
  ),
  "index_select": (
    lambda: Op(lambda m, x: m.table.index_select(0, x.flatten()).view(*x.shape, DIM)),
    lambda: (_ids((8, 12), 5),),
  ),
  "gather": (lambda: Op(lambda m, i: torch.gather(m.table, 0, i)), lambda: (_ids((16, DIM), 6),)),
  "take_along_dim": (
    lambda: Op(lambda m, i: torch.take_along_dim(m.table, i, dim=0)),
    lambda: (_ids((16, DIM), 7),),
  ),
  "scatter_add": (
    lambda: Op(lambda m, i: m.table.scatter_add(0, i, m.src), src=(16, DIM)),
    lambda: (_ids((16, DIM), 8),),
  ),
  "index_add": (
    lambda: Op(lambda m, x: m.table.index_add(0, x, m.src), src=(24, DIM)),
    lambda: (_ids((24,), 9),),
  ),
  "index_put accumulate": (
    lambda: Op(lambda m, x: m.table.index_put((x,), m.src, accumulate=True), src=(24, DIM)),
    lambda: (_ids((24,), 10),),
  ),
  "index_put / setitem": (
    lambda: Op(_setitem, row_a=(DIM,), rows_b=(16, DIM)),
    lambda: (_unique_rows(16, 11),),
  ),
  "advanced indexing": (
    lambda: Op(lambda m, r, c: m.table[r, c]),
    lambda: (_ids((8, 12), 12), torch.randint(0, DIM, (8, 12), generator=torch.Generator().manual_seed(0))),
  ),
  "masked_scatter": (
    lambda: Op(lambda m, mask: m.table.masked_scatter(mask, m.src), src=(ROWS * DIM,)),
    lambda: (torch.rand(ROWS, DIM, generator=torch.Generator().manual_seed(13)) > 0.5,),
  ),
  "one_hot @ table": (
    lambda: Op(lambda m, x: F.one_hot(x, ROWS).float() @ m.table),
    lambda: (_ids((8, 12), 14),),
  ),
  "EmbeddingBag sum, offsets, per_sample_weights": (
    lambda: Embeddings(torch.nn.EmbeddingBag, mode="sum"),
    lambda: (_ids((48,), 15), torch.tensor([0, 3, 3, 10, 20, 21, 30, 40]), torch.rand(48)),
  ),
  "EmbeddingBag mean, padding_idx=8": (
    lambda: Embeddings(torch.nn.EmbeddingBag, mode="mean", padding_idx=8),
    lambda: (_ids((48,), 16, pad=8), torch.tensor([0, 5, 5, 12, 20, 33, 40, 47])),
  ),
  "EmbeddingBag max": (
    lambda: Embeddings(torch.nn.EmbeddingBag, mode="max"),
    lambda: (_ids((48,), 17), torch.tensor([0, 6, 12, 18, 24, 24, 36, 42])),
  ),
  "EmbeddingBag sum, include_last_offset": (
    lambda: Embeddings(torch.nn.EmbeddingBag, mode="sum", include_last_offset=True),
    lambda: (_ids((48,), 19), torch.tensor([0, 2, 9, 9, 17, 30, 31, 40, 48])),
  ),
  "EmbeddingBag 2-D input": (
    lambda: Embeddings(torch.nn.EmbeddingBag, mode="mean"),
    lambda: (_ids((8, 6), 18),),
  ),
  "cross_entropy ignore_index=-100": (
    lambda: Op(lambda m, x, y: F.cross_entropy(x @ m.table.T, y)),
    lambda: (torch.randn(32, DIM), torch.where(torch.arange(32) % 5 == 0, -100, _ids((32,), 19))),
  ),
  "cross_entropy ignore_index=8": (
    lambda: Op(lambda m, x, y: F.cross_entropy(x @ m.table.T, y, ignore_index=8)),
    lambda: (torch.randn(32, DIM), _ids((32,), 20, pad=8)),
  ),
  "nll_loss weighted, ignore_index=40": (
    lambda: Op(lambda m, x, y, w: F.nll_loss(F.log_softmax(x @ m.table.T, -1), y, weight=w, ignore_index=40)),
    lambda: (torch.randn(32, DIM), _ids((32,), 21, pad=40), torch.rand(ROWS) + 0.5),
  ),
}

MESHES = {"fsdp=8": dict(fsdp=8), "fsdp=4,tp=2": dict(fsdp=4, tp=2)}


def _sharding_map(module, mesh_axes):
  """Every table-sized dim split: rows over fsdp, the embedding dim over tp (where there is one)."""
  spec = {ROWS: "fsdp", DIM: "tp" if "tp" in mesh_axes else None}
  return {n: tuple(spec.get(d) for d in p.shape) for n, p in module.named_parameters()}


def _loss(out, weights):
  return (out.float() * weights).sum()


def _assert_close(what, got, want, scale=None):
  """Every element within TOL of `scale` (default: the largest |ref|, and then ‖Δ‖/‖ref‖ ≤ TOL too)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} vs torch's {want.shape}"
  relative = h.rel(got, want) if scale is None else 0.0
  scale = max(np.abs(want).max() if scale is None else scale, 1e-30)
  worst = np.unravel_index(np.abs(got - want).argmax(), want.shape)
  assert relative <= TOL and np.abs(got - want).max() <= TOL * scale, (
    f"{what}: ‖Δ‖/‖ref‖ = {h.rel(got, want):.2e}, worst element {worst} off by "
    f"{np.abs(got - want).max():.2e} (scale {scale:.2e})"
  )


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_torch(case, mesh_name):
  make_module, make_inputs = CASES[case]
  torch.manual_seed(0)
  ref = make_module()
  inputs = make_inputs()
  want = ref(*inputs)
  weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(99))
  _loss(want, weights).backward()

  axes = MESHES[mesh_name]
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(**axes), sharding=_sharding_map(ref, axes))
  assert any("fsdp" in tuple(s.spec) for s in jm.param_shardings.values())
  _assert_close(f"{case} output", tot.to_cpu(jm(*inputs)).detach(), want.detach())

  step = tot.make_train_step(jm, _loss, optax.sgd(1.0))
  replicated = NamedSharding(jm.mesh, PartitionSpec())
  per_example = [x if x.shape[0] % jm.batch_ways == 0 else jax.device_put(x.numpy(), replicated) for x in inputs]
  loss, grads = step.gradients(per_example, weights)  # bag offsets (bags + 1) are not per example
  # The loss sums terms of both signs: its rounding is relative to the terms' magnitude.
  magnitude = float((want.detach().abs() * weights.abs()).sum())
  _assert_close(f"{case} loss", loss, _loss(want, weights).detach(), scale=magnitude)
  for name, p in ref.named_parameters():
    _assert_close(f"{case} gradient of {name}", grads[name], p.grad)


def test_single_row_scatter_into_a_sharded_array_is_right_with_our_compile_options():
  """The XLA fold behind the misplaced padding gradient (see `xla_flags`), in plain jax:
  a scatter-add with sharded ids, then one row set, into a row-sharded table."""
  import jax.numpy as jnp

  jm = tot.ShardedModule(Op(lambda m, x: x), mesh=tot.make_mesh(fsdp=8), sharding={"table": ("fsdp", None)})
  ids = _ids((8, 12), 30, pad=0).numpy()
  updates = np.random.RandomState(0).randn(8, 12, DIM).astype(np.float32)

  def accumulate_then_zero_row_0(ids, updates):
    return jnp.zeros((ROWS, DIM)).at[ids].add(updates).at[0].set(0.0)

  want = np.zeros((ROWS, DIM), np.float32)
  np.add.at(want, ids, updates)
  want[0] = 0
  got = jax.jit(
    accumulate_then_zero_row_0,
    out_shardings=jm.param_shardings["table"],
    compiler_options=jm.compile_options,
  )(jm.place(torch.from_numpy(ids)), jm.place(torch.from_numpy(updates)))
  assert jm.param_shardings["table"].spec == PartitionSpec("fsdp", None)
  _assert_close("rows", got, want)


def _padded_batches(n, pad_in_loss, vocab=256, batch=8, seqlen=32, pad=0):
  """Left-padded rows (the pad id in the first 8 positions of every other row), with
  the pads' labels ignored (-100) or, as in packed pretraining with pad = eos, trained on."""
  g = torch.Generator().manual_seed(7)
  out = []
  for _ in range(n):
    tokens = torch.randint(1, vocab, (batch, seqlen + 1), generator=g)
    tokens[::2, :8] = pad
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    if not pad_in_loss:
      y[y == pad] = -100
    out.append(({"input_ids": x, "attention_mask": (x != pad).long(), "use_cache": False}, y))
  return out


@pytest.mark.parametrize(
  "mesh_axes,sharding,pad_in_loss",
  [(dict(fsdp=8), "fsdp", False), (dict(fsdp=8), "fsdp", True), (dict(fsdp=4, tp=2), "fsdp_tp", True)],
  ids=["fsdp=8-pads-ignored", "fsdp=8-pads-in-loss", "fsdp=4,tp=2-pads-in-loss"],
)
def test_hf_model_with_pad_token_trains_like_torch(mesh_axes, sharding, pad_in_loss):
  """An HF Llama whose config sets pad_token_id (so `nn.Embedding(padding_idx=0)`), 5 AdamW
  steps on batches holding the pad token: losses and every trained weight as torch's."""
  import transformers

  config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
  )
  config._attn_implementation = "sdpa"
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_config(config)
  assert ref.model.embed_tokens.padding_idx == 0
  jm = tot.ShardedModule(copy.deepcopy(ref), mesh=tot.make_mesh(**mesh_axes), sharding=sharding)
  assert any(jm.param_shardings["model.embed_tokens.weight"].spec)  # the table is split

  def loss_fn(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

  hp = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  step = tot.make_train_step(jm, loss_fn, optax.adamw(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"]))
  opt = torch.optim.AdamW(ref.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["weight_decay"])
  for i, (inputs, labels) in enumerate(_padded_batches(5, pad_in_loss)):
    ours = float(step(inputs, labels))
    opt.zero_grad()
    loss = loss_fn(ref(**inputs), labels)
    loss.backward()
    opt.step()
    assert abs(ours - loss.item()) <= 1e-4 * abs(loss.item()), f"step {i}: loss {ours} vs torch {loss.item()}"
  # Adam divides each update by the gradient's own size, so fp32 rounding in tiny gradient
  # elements reaches ~1e-5 of the weights after 5 steps even on one device; a misplaced
  # row gradient moves whole rows by ~lr per step, 1e-2 of the largest weight.
  trained = jm.state_dict()
  for name, p in ref.named_parameters():
    got, want = trained[name].numpy(), p.detach().numpy()
    worst = np.abs(got - want).max() / np.abs(want).max()
    assert h.rel(got, want) < 5e-5 and worst < 1e-3, f"trained {name}: ‖Δ‖/‖ref‖ {h.rel(got, want):.1e}, worst {worst:.1e}"
