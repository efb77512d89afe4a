"""A model family of its own, added in this one file: nothing in torch_on_tpu's core
knows `ToyLM`. `tests/test_families.py` registers it and checks every hook is used."""

from __future__ import annotations

import torch

from torch_on_tpu import models

VOCAB, DIM, LAYERS = 64, 32, 2


class ToyLM(torch.nn.Module):
  """Embedding, a stack of linear blocks, a head; `temperature` divides the logits."""

  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Embedding(VOCAB, DIM)
    self.blocks = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))
    self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

  def forward(self, tokens, *, temperature: float = 1.0):
    h = self.embed(tokens)
    for block in self.blocks:
      h = h + torch.tanh(block(h))
    return self.head(h) / temperature


class ToyFamily(models.Family):
  name = "toy"

  def claims(self, module):
    return isinstance(module, ToyLM)

  def init_fn(self, module):
    def init(m):
      torch.nn.init.normal_(m.embed.weight, std=1.0)
      for block in m.blocks:
        torch.nn.init.constant_(block.weight, 0.01)
      torch.nn.init.constant_(m.head.weight, 0.02)

    return init

  def call_defaults(self, module):
    return {"temperature": 2.0}

  def model_inputs(self, module, batch):
    return {"tokens": batch["input_ids"]}

  def decoder_shape(self, module):
    return models.DecoderShape(layers=LAYERS, dim=DIM, ffn_dim=DIM, heads=1, kv_heads=1, head_dim=DIM, vocab=VOCAB)

  def sharding_map(self, module, preset):
    if preset != "fsdp_tp":
      return None
    return {"embed.weight": ("fsdp", "tp"), "blocks.*.weight": ("tp", "fsdp"), "head.weight": ("tp", "fsdp")}
