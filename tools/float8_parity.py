"""float8 numerics: torch_on_tpu against torchao itself, 5 SGD steps from the same weights.

    .venv/bin/python tools/float8_parity.py              # the table in docs/float8.md

The references are torchao in eager torch on the CPU: its hardware path
(`emulate=False`, torch's own CPU `_scaled_mm`) and its emulation
(`emulate=True`, fp32 matmuls of the dequantized operands). Each row trains one
model (a 2-linear MLP per recipe, torchtitan's Llama 3 debugmodel cut to 2
scanned layers, a 2-layer HF Llama) through `ShardedModule` + `make_train_step`
on 8 simulated devices and gives the largest relative error ‖Δ‖/‖ref‖ over the
steps' losses and over the trained weights, how far the weights moved, and how
far torchao's two paths are from each other. `tests/test_float8.py` runs a
slice of these rows with their bars.
"""

from __future__ import annotations

import argparse
import copy
import sys

STEPS = 5
# (model, recipe, SGD learning rate): the docs' table
CASES = (
  ("mlp", "tensorwise", 0.5), ("mlp", "rowwise", 0.5), ("mlp", "rowwise_with_gw_hp", 0.5),
  ("titan", "rowwise", 0.2), ("titan", "rowwise", 0.5), ("hf", "tensorwise", 0.03), ("hf", "tensorwise", 0.2),
)
REFERENCES = ("hardware", "emulation")


def rel(a, b) -> float:
  import numpy as np

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def mse(out, target):
  return ((out - target) ** 2).mean()


def cross_entropy(out, labels):
  import torch

  logits = out.logits if hasattr(out, "logits") else out
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def mlp():
  import torch

  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 48, bias=False))


def titan_config(recipe: str, emulate: bool = False):
  from torch_on_tpu.lowering import float8
  from torch_on_tpu.models.torchtitan import llama3_config

  config = llama3_config("debugmodel", attention="sdpa", max_seq_len=32)
  config.layers = config.layers[:2]
  return float8.convert(config, recipe, emulate=emulate)


def hf_config():
  import transformers

  return transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
  )


def tokens(vocab: int, batch: int = 8, seqlen: int = 32) -> list:
  import torch

  g = torch.Generator().manual_seed(0)
  batches = []
  for _ in range(STEPS):
    inputs = torch.randint(0, vocab, (batch, seqlen), generator=g)
    batches.append((inputs, torch.randint(0, vocab, (batch, seqlen), generator=g)))
  return batches


def setup(kind: str, recipe: str, references=REFERENCES):
  """(ShardedModule, {reference: eager torch model}, loss, batches as the model takes them)."""
  import torch

  import torch_on_tpu as tot
  from torch_on_tpu.lowering import float8
  from torch_on_tpu.models.hf import build_causal_lm

  mesh = tot.make_mesh(fsdp=-1)
  emulate = {"hardware": False, "emulation": True}
  if kind == "mlp":
    base = mlp()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, 32, generator=g), torch.randn(8, 8, 48, generator=g)) for _ in range(STEPS)]
    jm = tot.ShardedModule(float8.convert(copy.deepcopy(base), recipe), mesh=mesh)
    refs = {r: float8.convert(copy.deepcopy(base), recipe, emulate=emulate[r]) for r in references}
    return jm, refs, mse, data
  if kind == "titan":
    with torch.device("meta"):
      jm = tot.ShardedModule(titan_config(recipe).build(), mesh=mesh, scan=True)
    with torch.device("cpu"):
      refs = {r: titan_config(recipe, emulate[r]).build() for r in references}
    return jm, refs, cross_entropy, tokens(2048)
  if kind == "hf":
    jm = tot.ShardedModule(float8.convert(build_causal_lm(hf_config()), recipe), mesh=mesh)
    refs = {r: float8.convert(build_causal_lm(hf_config(), device="cpu"), recipe, emulate=emulate[r]) for r in references}
    return jm, refs, cross_entropy, [({"input_ids": x}, y) for x, y in tokens(256)]
  raise SystemExit(f"unknown model {kind!r}: mlp, titan or hf")


def torch_steps(model, loss_fn, batches, lr: float):
  """Losses and final state of `model` trained eagerly with SGD."""
  import torch

  opt = torch.optim.SGD(model.parameters(), lr=lr)
  losses = []
  for x, y in batches:
    opt.zero_grad()
    loss = loss_fn(model(**x) if isinstance(x, dict) else model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
  return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(kind: str, recipe: str, lr: float, references=REFERENCES) -> dict:
  """One row: ours against each reference (loss, weights), how far the weights moved, the references' spread."""
  import optax

  import torch_on_tpu as tot

  jm, refs, loss_fn, batches = setup(kind, recipe, references)
  initial = {k: v.clone() for k, v in jm.state_dict().items()}
  step = tot.make_train_step(jm, loss_fn, optax.sgd(lr))
  ours = [float(step(x, y)) for x, y in batches]
  state = jm.state_dict()
  row = {"moved": 0.0}
  trained = {}
  for name, model in refs.items():
    model.load_state_dict(initial)
    losses, weights = torch_steps(model, loss_fn, batches, lr)
    trained[name] = weights
    row[name] = (max(abs(a - b) / b for a, b in zip(ours, losses)), max(rel(state[k], weights[k]) for k in weights))
    row["moved"] = max(row["moved"], max(rel(weights[k], initial[k]) for k in weights))
  if len(trained) == 2:
    a, b = trained.values()
    row["references"] = max(rel(a[k], b[k]) for k in a)
  return row


NAMES = {"mlp": "2-linear MLP", "titan": "torchtitan Llama 3 debugmodel, 2 layers scanned", "hf": "HF Llama, 2 layers, hidden 64"}


def main(argv=None) -> int:
  argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)  # before jax starts
  print("| model, recipe, lr (weights moved) | vs torchao hardware path: loss, weights | vs torchao emulation: loss, weights | torchao's two paths: weights |")
  print("|---|---|---|---|")
  for kind, recipe, lr in CASES:
    row = compare(kind, recipe, lr)
    cells = [f"loss {row[r][0]:.1e}, weights {row[r][1]:.1e}" for r in REFERENCES]
    print(f"| {NAMES[kind]}, {recipe}, {lr} ({row['moved']:.1%}) | {cells[0]} | {cells[1]} | {row['references']:.1e} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
