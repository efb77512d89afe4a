"""Every torchtitan registry family against PyTorch eager: forward, scanned, 5 AdamW steps, sharded.

    .venv/bin/python tools/titan_parity.py                       # the whole matrix (minutes)
    .venv/bin/python tools/titan_parity.py qwen3:debugmodel_moe --modes forward,train

Each model is torchtitan's own registry entry (`model_registry(flavor).model`),
made small the same way for every family (`shrink`: fewer layers, a small
vocabulary, 8 experts of top-2, RoPE tables sized to the sequence), built
unmodified on meta, initialised with torchtitan's own init, called as
torchtitan's trainer calls it (tokens, positions, `get_attention_masks`) on a
packed batch with documents, through `ShardedModule` on 8 simulated CPU
devices. The reference is the same torchtitan model in eager torch on CPU
(fp32), its flex attention run uncompiled, with torchtitan's MoE
load-balancing hook registered on a `torch.optim.AdamW` exactly as its
trainer registers it. Numbers are ‖Δ‖/‖ref‖.

Modes: `forward` (fsdp=8), `scan` (scan=True, fsdp=8), `train` (5 AdamW steps:
every step's loss, then every parameter and buffer, persistent or not),
`scan_train`, `tp` (fsdp=4 x tp=2 from torchtitan's TP plan), `ep`
(ep=8, experts placed by torchtitan's EP plan; MoE families), `spread` (two
valid eager references against each other, forward and the same 5 steps: the
second with every fp32 `F.linear` accumulated in fp64, as tools/bf16_sweep.py
defines it on the precision branch; the yardstick where torchtitan computes in
bf16, as its MoE experts do).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import sys
import time

SPECS = (
  "llama3:debugmodel",
  "qwen3:debugmodel",
  "qwen3:debugmodel_moe",
  "deepseek_v3:debugmodel",
  "kimi_k2_7:debugmodel",
  "qwen3_5:debugmodel",
  "qwen3_5:debugmodel_moe",
  "gpt_oss:debugmodel",
)
MODES = ("forward", "scan", "train", "scan_train", "tp", "ep", "spread")
SEQ = 32
BATCH = 8
VOCAB = 256
# AdamW's eps bounds how much a gradient's rounding moves an update (lr/eps per unit): at
# torchtitan's 1e-8 a gradient within fp32 noise of zero flips Adam's first, sign-like step
# (qwen3 debugmodel: gradients 2e-6 apart, one such element puts tok_embeddings 4.7e-4 off
# after 5 steps); 1e-6 keeps the comparison about the gradients. `--eps` sets it.
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-6, 0.1


def registry_config(spec: str, **registry_kwargs):
  """torchtitan's config for `family:flavor`, from the family's own registry."""
  name, flavor = spec.split(":")
  return importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor, **registry_kwargs).model


def shrink(config, *, layers: int | None = 3, vocab: int = VOCAB, experts: int = 8, top_k: int = 2,
           expert_hidden: int = 64, seqlen: int = SEQ):
  """The same torchtitan config, small: its first `layers` blocks (a hybrid keeps one of
  each kind it has), `vocab` tokens, `experts` routed experts of `expert_hidden` units
  (top-`top_k`), RoPE tables of `seqlen` positions. Changes `config` in place."""
  if layers is not None:
    kinds = {}
    for i, block in enumerate(config.layers):
      kinds.setdefault(_kind(block), []).append(i)
    keep = sorted(set(range(min(layers, len(config.layers)))) | {ix[0] for ix in kinds.values()})
    config.layers = [config.layers[i] for i in keep]
  old_vocab = config.vocab_size
  old_experts = [None]

  def walk(node, parent_name=""):
    if not dataclasses.is_dataclass(node):
      return
    cls = type(node).__qualname__
    for field in dataclasses.fields(node):
      value = getattr(node, field.name)
      name = field.name
      if name in ("vocab_size", "num_embeddings") and value == old_vocab:
        setattr(node, name, vocab)
      elif name == "out_features" and value == old_vocab:
        setattr(node, name, vocab)
      elif name == "num_experts" and isinstance(value, int):
        old_experts[0] = value
        setattr(node, name, experts)
      elif name == "top_k" and isinstance(value, int):
        setattr(node, name, min(value, top_k))
      elif name == "hidden_dim" and "Experts" in cls:
        setattr(node, name, expert_hidden)
      elif name == "max_seq_len" and isinstance(value, int):
        setattr(node, name, seqlen)
      elif name in ("num_expert_groups", "num_limited_groups") and value is not None:
        setattr(node, name, min(value, 2 if name == "num_expert_groups" else 1))
      elif isinstance(value, list):
        for item in value:
          walk(item, name)
      else:
        walk(value, name)
    if cls.endswith("TokenChoiceTopKRouter.Config") and node.gate.out_features == old_experts[0]:
      node.gate.out_features = experts

  walk(config)
  return config


def _kind(block) -> str:
  attention = getattr(block, "attention", None) or getattr(block, "attn", None)
  return f"{type(block).__qualname__}/{type(attention).__qualname__}/{getattr(block, 'moe', None) is not None}"


def build(config, device="meta"):
  import torch

  with torch.device(device):
    return config.build()


@contextlib.contextmanager
def eager_flex():
  """torchtitan's flex attention computed in plain eager torch: its BlockMask's
  mask_mod evaluated densely, then softmax attention (and the log-sum-exp where
  asked). torch's own flex_attention cannot serve as the reference here: uncompiled it
  still calls torch.compile (which cannot run once torchax has claimed torch's spare
  device backend) and it has no CPU backward."""
  from torch.nn.attention.flex_attention import create_block_mask
  from torchtitan.models.common import attention

  saved = attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask
  attention.FlexAttention._compiled_flex_attn = _dense_flex_attention
  attention._compiled_create_block_mask = create_block_mask  # uncompiled by default
  try:
    yield
  finally:
    attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask = saved


@contextlib.contextmanager
def eager_linear_attention():
  """Qwen3.5's Gated DeltaNet on CPU for the eager reference: flash-linear-attention's
  own pure-torch recurrence (`naive_recurrent_gated_delta_rule`, after its l2norm) and a
  plain depthwise `F.conv1d`, each run document by document from torchtitan's offsets
  (its Triton kernels need CUDA)."""
  import torch
  import torch.nn.functional as F

  model = sys.modules.get("torchtitan.models.qwen3_5.model")
  if model is None:
    yield
    return
  from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

  def pieces(cu_seqlens, total):
    bounds = [0, total] if cu_seqlens is None else cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

  def conv(x, weight, cu_seqlens, _host):
    taps = weight.shape[-1]
    outs = [
      F.conv1d(F.pad(x[:, part].transpose(1, 2), [taps - 1, 0]), weight, groups=weight.shape[0]).transpose(1, 2)
      for part in pieces(cu_seqlens, x.shape[1])
    ]
    return F.silu(torch.cat(outs, dim=1))

  def kernel(self, q, k, v, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None):
    if q.shape[2] != v.shape[2]:
      q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    l2 = lambda x: (x.float() / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)  # noqa: E731
    q, k = l2(q), l2(k)
    outs = [
      naive_recurrent_gated_delta_rule(q[:, p], k[:, p], v[:, p], beta[:, p], g[:, p])[0]
      for p in pieces(cu_seqlens, q.shape[1])
    ]
    return torch.cat(outs, dim=1).to(v.dtype)

  saved = model._causal_conv1d_varlen, model.GatedDeltaKernel.forward
  model._causal_conv1d_varlen, model.GatedDeltaKernel.forward = conv, kernel
  try:
    yield
  finally:
    model._causal_conv1d_varlen, model.GatedDeltaKernel.forward = saved


def _dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                          return_aux=None, kernel_options=None):
  import torch
  from torch.nn.attention.flex_attention import AuxOutput, create_mask

  assert score_mod is None
  B, H, L, D = q.shape
  if enable_gqa and k.shape[1] != H:
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
  mask = create_mask(block_mask.mask_mod, B, 1, L, k.shape[2], device=q.device)
  scores = (q @ k.transpose(-2, -1)) * (D**-0.5 if scale is None else scale)
  scores = scores.masked_fill(~mask, float("-inf"))
  lse = torch.logsumexp(scores, dim=-1)
  out = torch.softmax(scores, dim=-1) @ v
  return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


@contextlib.contextmanager
def fp32_experts():
  """torchtitan's GroupedExperts without its bf16 casts, for ours and the reference alike:
  the MoE mechanics (routing, dispatch, combine, load balancing) checked at fp32 exactness,
  apart from the bf16 numerics (measured by the `spread` mode)."""
  import torch
  import torch.nn.functional as F
  from torchtitan.models.common.moe import GroupedExperts

  def forward(self, x, counts):
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    mm = lambda a, w: self._grouped_mm(A=a, B_t=w.transpose(-2, -1), offs=offsets)  # noqa: E731
    return mm(F.silu(mm(x, self.w1_EFD)) * mm(x, self.w3_EFD), self.w2_EDF).type_as(x)

  original = GroupedExperts.forward
  GroupedExperts.forward = forward
  try:
    yield
  finally:
    GroupedExperts.forward = original


@contextlib.contextmanager
def fp64_linears():
  """The second valid eager reference: every fp32 `F.linear` accumulated in fp64 and rounded
  to fp32 (a more exact matmul path; tools/bf16_sweep.py's `Fp64Linears`). Where torchtitan
  computes in bf16 (MoE experts), an fp32-level difference upstream moves some bf16 inputs
  by one unit: the spread any valid bf16 computation has."""
  import importlib.util
  from pathlib import Path

  spec = importlib.util.spec_from_file_location("bf16_sweep", Path(__file__).with_name("bf16_sweep.py"))
  sweep = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(sweep)
  with sweep.Fp64Linears():
    yield


def packed_batch(vocab=VOCAB, batch=BATCH, seq=SEQ, seed=0):
  """(tokens, labels, positions): every row holds 2-3 documents (positions restart at 0)."""
  import torch

  g = torch.Generator().manual_seed(seed)
  tokens = torch.randint(0, vocab, (batch, seq), generator=g)
  labels = torch.randint(0, vocab, (batch, seq), generator=g)
  positions = torch.zeros(batch, seq, dtype=torch.long)
  for row in range(batch):
    cuts = sorted(torch.randperm(seq - 2, generator=g)[: 1 + row % 2].add(1).tolist())
    start = 0
    for cut in [*cuts, seq]:
      positions[row, start:cut] = torch.arange(cut - start)
      start = cut
  return tokens, labels, positions


def rel(a, b) -> float:
  import numpy as np

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def ce(out, labels):
  import torch

  return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


class _ParallelDims:
  """What torchtitan's load-balancing hook asks of its ParallelDims on one device."""

  ep_enabled, tp = False, 1

  @staticmethod
  def get_optional_mesh(_name):
    return None


def eager_reference(config, state):
  """The same torchtitan model in eager torch (fp32, CPU), loaded with `state`, and a
  `torch.optim.AdamW` with torchtitan's MoE load-balancing hook registered on it."""
  import torch
  from torchtitan.components.optimizer import register_moe_load_balancing_hook

  model = build(config, device="cpu")
  model.load_state_dict(state, strict=False)
  for name, _ in list(model.named_buffers()):
    if name in state:
      model.get_buffer(name).copy_(state[name])
  optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
  register_moe_load_balancing_hook(optimizer, [model], _ParallelDims())
  return model, optimizer


def eager_call(model, tokens, positions):
  from torch_on_tpu.models.torchtitan import TorchtitanFamily

  extra = {}
  if "special_tokens" in inspect.signature(model.forward).parameters:
    extra["special_tokens"] = {"image_id": -1, "video_id": -1}  # text only, as the bridge calls it
  with TorchtitanFamily().running(model), eager_flex(), eager_linear_attention():
    return model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions), **extra)


def all_tensors(jm):
  """Every parameter and buffer of the wrapped model by original name (non-persistent buffers too)."""
  from torch_on_tpu import to_cpu

  return {name: to_cpu(jm.array_for(name)) for name in jm._entries}


def wrap(config, mode):
  import torch_on_tpu as tot

  axes = {"tp": dict(fsdp=4, tp=2), "ep": dict(ep=8)}.get(mode, dict(fsdp=8))
  sharding = {"tp": "fsdp_tp", "ep": "ep"}.get(mode, "fsdp")
  return tot.ShardedModule(build(config), mesh=tot.make_mesh(**axes), sharding=sharding, scan=mode.startswith("scan"))


def check(spec: str, mode: str, *, steps: int = 5, config=None) -> dict:
  """One family in one mode: {forward | losses, weights, buffers: worst rel error}.
  Mode `spread` compares two valid eager references instead (`fp64_linears`): the noise
  floor of the computation."""
  import optax
  import torch

  import torch_on_tpu as tot

  config = config if config is not None else shrink(registry_config(spec))
  jm = wrap(config, "train" if mode == "spread" else mode)
  state = all_tensors(jm)
  ref, optimizer = eager_reference(config, state)
  tokens, labels, positions = packed_batch()
  if mode in ("forward", "scan", "tp", "ep"):
    inputs = jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})
    ref.eval()
    jm.module.eval()
    got = tot.to_cpu(jm(**inputs))
    with torch.no_grad():
      want = eager_call(ref, tokens, positions)
    return {"forward": rel(got, want)}
  if mode == "spread":
    other, other_optimizer = eager_reference(config, state)
    ref.eval(), other.eval()  # the forward's spread (eval: no token counted)
    with torch.no_grad():
      whole = eager_call(ref, tokens, positions)
      with fp64_linears():
        more_exact = eager_call(other, tokens, positions)
    forward_spread = rel(more_exact, whole)
    ref.train(), other.train()

    def step(inputs, labels):  # the second reference: every fp32 F.linear accumulated in fp64
      tokens, positions = inputs
      other_optimizer.zero_grad()
      with fp64_linears():
        loss = ce(eager_call(other, tokens, positions), labels)
        loss.backward()
      other_optimizer.step()
      return loss.item()

    trained_of = lambda: {**dict(other.named_parameters()), **dict(other.named_buffers())}  # noqa: E731
  else:
    step = tot.make_train_step(jm, ce, optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD))
    trained_of = lambda: all_tensors(jm)  # noqa: E731
  losses = []
  for i in range(steps):
    tokens, labels, positions = packed_batch(seed=i)
    if mode == "spread":
      inputs = (tokens, positions)
    else:
      inputs = jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})
    got = float(step(inputs, labels))
    optimizer.zero_grad()
    loss = ce(eager_call(ref, tokens, positions), labels)
    loss.backward()
    optimizer.step()
    losses.append(rel(got, loss.item()))
  trained = trained_of()
  want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
  params = {n for n, _ in ref.named_parameters()}
  per_weight = {n: rel(torch.as_tensor(trained[n]).detach(), want[n].detach()) for n in params}
  buffers = {
    n: rel(torch.as_tensor(trained[n]).detach(), want[n]) for n in want if n not in params and want[n].is_floating_point()
  }
  return {
    **({"forward": forward_spread} if mode == "spread" else {}),
    "losses": max(losses), "weights": max(per_weight.values()), "buffers": max(buffers.values(), default=0.0),
    "_buffers": buffers, "_weights": per_weight,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("specs", nargs="*", default=list(SPECS))
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--eps", type=float, default=EPS, help="AdamW eps of both sides")
  args = p.parse_args(argv)
  globals()["EPS"] = args.eps
  from torch_on_tpu import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  for spec in args.specs:
    for mode in args.modes.split(","):
      if mode == "ep" and "moe" not in spec and spec.split(":")[0] not in ("deepseek_v3", "kimi_k2_7", "gpt_oss"):
        continue
      start = time.perf_counter()
      try:
        result = check(spec, mode)
        shown = ", ".join(f"{k} {v:.1e}" for k, v in result.items() if not k.startswith("_"))
      except Exception as e:  # noqa: BLE001 (a table of outcomes: each failure is one row)
        shown = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      print(f"{spec:28s} {mode:10s} {shown}  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
  sys.exit(main())
