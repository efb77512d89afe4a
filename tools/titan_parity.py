"""Every torchtitan registry family against PyTorch eager: forward, scanned, 5 AdamW steps, sharded.

    .venv/bin/python tools/titan_parity.py                       # the whole matrix (minutes)
    .venv/bin/python tools/titan_parity.py qwen3:debugmodel_moe --modes forward,train
    .venv/bin/python tools/titan_parity.py gpt_oss:debugmodel --round_robin --modes spread,train
    .venv/bin/python tools/titan_parity.py deepseek_v3:debugmodel --mtp_layers=1   # multi-token prediction

Each model is torchtitan's own registry entry (`model_registry(flavor).model`),
made small the same way for every family (`shrink`: fewer layers, a small
vocabulary, 8 experts of top-2, RoPE tables sized to the sequence, sliding
windows shorter than it), built unmodified on meta, initialised with
torchtitan's own init, called as torchtitan's trainer calls it (tokens,
positions, `get_attention_masks`) on a packed batch with documents, through
`ShardedModule` on 8 simulated CPU devices. The reference (`EagerReference`)
is the same torchtitan model in eager torch on CPU, its flex attention
computed densely as its kernels round (a varlen model's reference runs flex:
varlen needs FlashAttention), with torchtitan's MoE load-balancing hook
registered on a `torch.optim.AdamW` exactly as its trainer registers it.
Numbers are ‖Δ‖/‖ref‖. Against torchtitan's own run on a GPU (varlen's
FlashAttention, CUDA's autocast), from the same pieces: tools/titan_gpu_reference.py.

Precision: fp32, except the families torchtitan cannot run in fp32 (`PRECISION`:
gpt-oss), compared as torchtitan trains them, bf16 compute from fp32 weights
(FSDP's mixed precision; `compute_dtype` on our side); `--precision` sets it for
all. `--round_robin` routes MoE tokens by torchtitan's debug rule instead of by
score, so that no routing flip hides a difference in the numerics.

Modes: `forward` (fsdp=8), `scan` (scan=True, fsdp=8), `train` (5 AdamW steps:
every step's loss, then every parameter and buffer, persistent or not),
`scan_train`, `tp` (fsdp=4 x tp=2 from torchtitan's TP plan), `ep`
(ep=8, experts placed by torchtitan's EP plan; MoE families), `spread` (two
valid eager references against each other, forward and the same 5 steps: the
second with every fp32 `F.linear` accumulated in fp64, as tools/bf16_sweep.py
defines it, and attention's probabilities kept in fp32 for P·V; the yardstick
where torchtitan computes in bf16, as its MoE experts do).
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
MODES = ("forward", "scan", "train", "scan_train", "tp", "ep", "ep_train", "ep_tp_train", "ep_pp_train", "spread")
# The sharded modes' meshes and presets: torchtitan's TP plan; experts over ep=8; experts over
# ep x tp (its expert-parallel group borrowing tp: the tokens split over tp inside the MoE); experts
# over ep inside pipeline stages (the MoE's token counts carried through the stages).
LAYOUTS = {
  "tp": (dict(fsdp=4, tp=2), "fsdp_tp"),
  "ep": (dict(ep=8), "ep"),
  "ep_train": (dict(ep=8), "ep"),
  "ep_tp_train": (dict(fsdp=2, ep=2, tp=2), "fsdp_tp"),
  "ep_pp_train": (dict(pp=2, fsdp=2, ep=2), "ep"),
}
SEQ = 32
BATCH = 8
VOCAB = 256
# AdamW's eps bounds how much a gradient's rounding moves an update (lr/eps per unit): at
# torchtitan's 1e-8 a gradient within fp32 noise of zero flips Adam's first, sign-like step
# (qwen3 debugmodel: gradients 2e-6 apart, one such element puts tok_embeddings 4.7e-4 off
# after 5 steps); 1e-6 keeps the comparison about the gradients. `--eps` sets it.
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-6, 0.1
# Families compared in the precision torchtitan trains them in (bf16 compute, fp32 weights)
# because torchtitan's own fp32 forward cannot run: gpt-oss's experts return bf16 into an fp32
# scatter-add. `--precision` overrides it for every family.
PRECISION = {"gpt_oss": "bf16"}


def registry_config(spec: str, **registry_kwargs):
  """torchtitan's config for `family:flavor`, from the family's own registry."""
  name, flavor = spec.split(":")
  return importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor, **registry_kwargs).model


def shrink(config, *, layers: int | None = 3, vocab: int = VOCAB, experts: int = 8, top_k: int = 2,
           expert_hidden: int = 64, seqlen: int = SEQ, window: int = SEQ // 2, round_robin: bool = False):
  """The same torchtitan config, small: its first `layers` blocks (a hybrid keeps one of
  each kind it has), `vocab` tokens, `experts` routed experts of `expert_hidden` units
  (top-`top_k`), RoPE tables of `seqlen` positions, sliding windows of `window` tokens
  (shorter than the sequence, so the window masks something). `round_robin` routes tokens
  by torchtitan's own debug rule (`_debug_force_load_balance`) instead of by score: no
  routing flip can then hide a difference in the experts' numerics. Changes `config` in place."""
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
      elif name == "_debug_force_load_balance":
        setattr(node, name, round_robin)
      elif name == "sliding_window_size" and isinstance(value, int):
        setattr(node, name, window)
      elif name == "window_size" and isinstance(value, tuple) and value[0] >= 0:  # varlen's (window - 1, 0)
        setattr(node, name, (window - 1, value[1]))
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
def eager_flex(p_in_fp32=False, lse_gradient=True):
  """torchtitan's flex attention computed in plain eager torch: its BlockMask's
  mask_mod evaluated densely, then softmax attention (and the log-sum-exp where
  asked), `dense_flex_attention`; the BlockMask builders (the decoders' and the vision
  encoders') uncompiled. torch's own flex_attention cannot serve as the reference here:
  uncompiled it still calls torch.compile (which cannot run once torchax has claimed
  torch's spare device backend) and it has no CPU backward."""
  import functools

  from torch.nn.attention.flex_attention import create_block_mask
  from torchtitan.models.common import attention

  # the vision encoders' own compiled builder, where each imported it by name
  vision = [m for name, m in list(sys.modules.items()) if name.startswith("torchtitan.models.") and m is not None
            and "compiled_create_block_mask" in vars(m)]
  saved = attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask
  saved_vision = [m.compiled_create_block_mask for m in vision]
  attention.FlexAttention._compiled_flex_attn = functools.partial(
    dense_flex_attention, p_in_fp32=p_in_fp32, lse_gradient=lse_gradient
  )
  attention._compiled_create_block_mask = create_block_mask  # uncompiled by default
  for m in vision:
    m.compiled_create_block_mask = create_block_mask
  try:
    yield
  finally:
    attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask = saved
    for m, builder in zip(vision, saved_vision):
      m.compiled_create_block_mask = builder


@contextlib.contextmanager
def eager_linear_attention():
  """Qwen3.5's Gated DeltaNet on CPU for the eager reference: transformers' pure-torch
  recurrence for Qwen3.5 (`torch_recurrent_gated_delta_rule`, l2-normalising q and k) and a
  plain depthwise `F.conv1d`, each run document by document from torchtitan's offsets
  (flash-linear-attention's Triton kernels, which torchtitan calls, need CUDA)."""
  import torch
  import torch.nn.functional as F
  from transformers.models.qwen3_5 import modeling_qwen3_5

  model = sys.modules.get("torchtitan.models.qwen3_5.model")
  if model is None:
    yield
    return
  recurrence = modeling_qwen3_5.torch_recurrent_gated_delta_rule.__wrapped__  # its torch code, never a package's kernel

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
    outs = [
      recurrence(q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], use_qk_l2norm_in_kernel=True)[0]
      for p in pieces(cu_seqlens, q.shape[1])
    ]
    return torch.cat(outs, dim=1).to(v.dtype)

  saved = model._causal_conv1d_varlen, model.GatedDeltaKernel.forward
  model._causal_conv1d_varlen, model.GatedDeltaKernel.forward = conv, kernel
  try:
    yield
  finally:
    model._causal_conv1d_varlen, model.GatedDeltaKernel.forward = saved


def dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                         return_aux=None, kernel_options=None, p_in_fp32=False, lse_gradient=True):
  """torch's flex attention by its definition, in plain differentiable torch (torch's own eager
  flex has no CPU backward), as its kernels (and FlashAttention's) round: scores, softmax
  statistics and the log-sum-exp in fp32 whatever the inputs' dtype; below fp32 the
  unnormalized probabilities exp(s - max) are rounded to V's dtype for P·V, which accumulates
  in fp32 and is divided by the row sum before the output's one rounding (`p_in_fp32` keeps
  them fp32: the math path; `lse_gradient=False` returns the log-sum-exp cut from the graph, as
  torch's `varlen_attn` backward drops its gradient, in 2.11 and 2.13). The mask is the
  BlockMask's `mask_mod` evaluated on every (batch, query, key) at once by broadcasting; rows
  that see nothing give 0."""
  import torch
  from torch.nn.attention.flex_attention import AuxOutput

  assert score_mod is None
  B, H, L, D = q.shape
  index = lambda n, axis: torch.arange(n).view([n if a == axis else 1 for a in range(4)])  # noqa: E731
  mask = block_mask.mask_mod(index(B, 0), torch.zeros(1, 1, 1, 1, dtype=torch.long), index(L, 2), index(k.shape[2], 3))
  mask = mask.expand(B, 1, L, k.shape[2])
  if enable_gqa and k.shape[1] != H:
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
  scores = (q.float() @ k.float().transpose(-2, -1)) * (D**-0.5 if scale is None else scale)
  scores = scores.masked_fill(~mask, float("-inf"))
  top = scores.amax(-1, keepdim=True)
  p = torch.exp(scores - top.masked_fill(top.isneginf(), 0.0))
  total = p.sum(-1, keepdim=True)
  lse = (top + torch.log(total)).squeeze(-1)
  lse = lse if lse_gradient else lse.detach()
  if not p_in_fp32:
    p = p.to(v.dtype).float()
  out = (p @ v.float()) / total.masked_fill(total == 0, 1.0)
  return out.to(q.dtype), AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


@contextlib.contextmanager
def cuda_router_autocast():
  """torchtitan's MoE router computes its gate under `torch.autocast(dtype=torch.float32)`:
  on CUDA (where torchtitan trains) that runs the gate in fp32 when the parameters are bf16;
  CPU autocast refuses fp32 and would run it in bf16. The reference computes it as CUDA
  does: inputs and weights cast to fp32."""
  import torch.nn.functional as F
  from torchtitan.models.common.moe import TokenChoiceTopKRouter

  original = TokenChoiceTopKRouter.forward

  def forward(self, x, expert_bias=None):
    gate = self.gate
    saved = gate.forward
    bias = lambda: None if gate.bias is None else gate.bias.float()  # noqa: E731
    gate.forward = lambda h: F.linear(h.float(), gate.weight.float(), bias())
    try:
      return original(self, x, expert_bias)
    finally:
      gate.forward = saved

  TokenChoiceTopKRouter.forward = forward
  try:
    yield
  finally:
    TokenChoiceTopKRouter.forward = original


@contextlib.contextmanager
def fp32_experts():
  """torchtitan's GroupedExperts (and gpt-oss's, with their biases and clamped SwiGLU) without
  their bf16 casts, for ours and the reference alike: the MoE mechanics (routing, dispatch,
  combine, load balancing) checked at fp32 exactness, apart from the bf16 numerics (measured
  by the `spread` mode)."""
  import torch
  import torch.nn.functional as F
  from torchtitan.models.common.moe import GroupedExperts
  from torchtitan.models.gpt_oss import moe as gpt_oss_moe

  def forward(self, x, counts):
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    mm = lambda a, w: self._grouped_mm(A=a, B_t=w.transpose(-2, -1), offs=offsets)  # noqa: E731
    return mm(F.silu(mm(x, self.w1_EFD)) * mm(x, self.w3_EFD), self.w2_EDF).type_as(x)

  def gpt_oss_forward(self, x, counts):
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    per_row = torch.cat([counts, (x.shape[0] - offsets[-1]).unsqueeze(0).to(counts.dtype)]).long()
    mm = lambda a, w: self._grouped_mm(A=a, B_t=w.transpose(-2, -1), offs=offsets)  # noqa: E731
    rows = lambda b: torch.cat([b, b.new_zeros(1, b.shape[-1])]).repeat_interleave(  # noqa: E731
      per_row, dim=0, output_size=x.shape[0]
    )
    h = gpt_oss_moe.swiglu(mm(x, self.mlp1_weight_EGD) + rows(self.mlp1_bias_EG), limit=self.swiglu_limit)
    return mm(h, self.mlp2_weight_EDF) + rows(self.mlp2_bias_ED)

  originals = GroupedExperts.forward, gpt_oss_moe.GptOssGroupedExperts.forward
  GroupedExperts.forward, gpt_oss_moe.GptOssGroupedExperts.forward = forward, gpt_oss_forward
  try:
    yield
  finally:
    GroupedExperts.forward, gpt_oss_moe.GptOssGroupedExperts.forward = originals


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


def reference_loss(out, labels, positions):
  """The loss torchtitan's trainer takes: the mean cross-entropy, or for a multi-token-prediction
  model (a list of logits) its `MTPLoss` called as its trainer calls it (positions, divided by
  the valid label count)."""
  if not isinstance(out, list):
    return ce(out, labels)
  from torchtitan.components.loss import IGNORE_INDEX
  from torchtitan.models.deepseek_v3.mtp import MTPLoss

  loss, _ = MTPLoss(MTPLoss.Config())(out, labels, (labels != IGNORE_INDEX).sum(), positions=positions)
  return loss


def bridge_loss(out, targets):
  """Ours, in the train step: `ce`, or torchtitan's `MTPLoss` through the bridge (`models.torchtitan.mtp_loss`)
  with the positions carried in the labels pytree."""
  if not isinstance(targets, dict):
    return ce(out, targets)
  from torch_on_tpu.models.torchtitan import mtp_loss

  return mtp_loss(out, targets["labels"], targets["positions"])


def rel_outputs(got, want) -> float:
  """`rel` of a forward's outputs, the worst of a list's (main logits and each MTP depth's)."""
  if isinstance(want, list):
    assert isinstance(got, list) and len(got) == len(want), (type(got), len(want))
    return max(rel(g.float(), w.float()) for g, w in zip(got, want))
  return rel(got.float(), want.float())


class _ParallelDims:
  """What torchtitan's load-balancing hook asks of its ParallelDims on one device."""

  ep_enabled, tp = False, 1

  @staticmethod
  def get_optional_mesh(_name):
    return None


@contextlib.contextmanager
def single_device_titan():
  """torchtitan's SPMD type annotations off, as for a model run on one device outside its
  trainer (its "partial_dtensor" backend annotates nothing on plain tensors)."""
  from torchtitan.distributed import utils as titan_distributed

  before = titan_distributed.get_spmd_backend()
  titan_distributed.set_spmd_backend("partial_dtensor")
  try:
    yield
  finally:
    titan_distributed.set_spmd_backend(before)


class EagerReference:
  """The same torchtitan model in eager torch, loaded with `state`, trained by a
  `torch.optim.AdamW` with torchtitan's MoE load-balancing hook registered on it as its
  trainer registers it.

  `precision="bf16"` is how torchtitan trains (FSDP's `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`): forward and backward see bf16 copies of the fp32 parameters (buffers
  stay as they are), the gradients come back in fp32, AdamW updates the fp32 weights.

  On the CPU (`device="cpu"`) torchtitan's GPU kernels are replaced by their definitions
  (`eager_flex`, `eager_linear_attention`; a varlen model is given flex attention by the
  caller, `flex_config`) and the router's fp32 autocast computes as on CUDA
  (`cuda_router_autocast`); `exact=True` is the second valid reference of the spread: every
  fp32 `F.linear` accumulated in fp64 (`fp64_linears`) and attention's probabilities kept in
  fp32 for P·V; `lse_gradient=False` computes attention's backward as torch's varlen
  attention does (the log-sum-exp's gradient dropped: `dense_flex_attention`). On a GPU
  (`device="cuda"`) the model runs as torchtitan runs it, its own kernels (varlen's
  FlashAttention, compiled flex attention) and CUDA's autocast, and nothing of the bridge is
  imported (tools/titan_gpu_reference.py)."""

  def __init__(self, config, state, *, precision="fp32", exact=False, device="cpu", lse_gradient=True):
    import torch
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    self.model = build(config, device=device)
    self.model.load_state_dict(state, strict=False)
    for name, _ in list(self.model.named_buffers()):
      if name in state:
        self.model.get_buffer(name).copy_(state[name])
    self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    register_moe_load_balancing_hook(self.optimizer, [self.model], _ParallelDims())
    self.precision, self.exact, self.lse_gradient = precision, exact, lse_gradient
    self.device = torch.device(device)
    assert self.device.type == "cpu" or not (exact or not lse_gradient), "the variant references are the CPU's"

  def _kernels(self, model):
    """What runs the model's attention and router here (see the class docstring)."""
    if self.device.type != "cpu":
      return [single_device_titan()]
    from torch_on_tpu.models.torchtitan import TorchtitanFamily

    contexts = [
      TorchtitanFamily().running(model), eager_flex(p_in_fp32=self.exact, lse_gradient=self.lse_gradient),
      eager_linear_attention(),
    ]
    if self.exact:
      contexts.append(fp64_linears())
    if self.precision == "bf16":
      contexts.append(cuda_router_autocast())
    return contexts

  def __call__(self, tokens, positions, params=None):
    import torch

    model = self.model
    tokens, positions = tokens.to(self.device), positions.to(self.device)
    extra = {}
    if "special_tokens" in inspect.signature(model.forward).parameters:
      extra["special_tokens"] = {"image_id": -1, "video_id": -1}  # text only, as the bridge calls it
    with contextlib.ExitStack() as stack:
      for context in self._kernels(model):
        stack.enter_context(context)
      masks = model.get_attention_masks(positions)
      if params is None:
        return model(tokens, positions=positions, attention_masks=masks, **extra)
      return torch.func.functional_call(
        model, params, (tokens,), dict(positions=positions, attention_masks=masks, **extra), strict=False
      )

  def compute_params(self, requires_grad=False):
    """The parameters forward sees: bf16 copies in mixed precision, else the weights themselves."""
    import torch

    if self.precision != "bf16":
      return None
    return {
      n: p.detach().to(torch.bfloat16).requires_grad_(requires_grad) for n, p in self.model.named_parameters()
    }

  def forward(self, tokens, positions):
    import torch

    self.model.eval()
    with torch.no_grad():
      out = self(tokens, positions, self.compute_params())
    self.model.train()
    return out

  def step(self, tokens, labels, positions) -> float:
    self.optimizer.zero_grad()
    params = self.compute_params(requires_grad=True)
    loss = reference_loss(self(tokens, positions, params), labels.to(self.device), positions.to(self.device))
    loss.backward()
    if params is not None:
      for n, p in self.model.named_parameters():
        p.grad = None if params[n].grad is None else params[n].grad.float()
    self.optimizer.step()
    return loss.item()

  def tensors(self) -> dict:
    return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}


def all_tensors(jm):
  """Every parameter and buffer of the wrapped model by original name (non-persistent buffers too)."""
  from torch_on_tpu import to_cpu

  return {name: to_cpu(jm.array_for(name)) for name in jm._entries}


def wrap(config, mode):
  import torch_on_tpu as tot

  axes, sharding = LAYOUTS.get(mode, (dict(fsdp=8), "fsdp"))
  scan = mode.startswith("scan") or mode in LAYOUTS and mode != "tp"
  return tot.ShardedModule(build(config), mesh=tot.make_mesh(**axes), sharding=sharding, scan=scan)


def precision_of(spec: str) -> str:
  """The precision torchtitan trains a family in, for this comparison: fp32, except where its
  own fp32 forward cannot run (`PRECISION`)."""
  return PRECISION.get(spec.split(":")[0], "fp32")


def flex_config(config):
  """`config` with varlen attention (FlashAttention's kernel: no CPU implementation) replaced
  by flex attention, the same masks: what the eager reference can run on CPU. The windows stay
  in the attention configs (`sliding_window_size`), which flex reads."""
  import copy

  from torchtitan.models.common.attention import VarlenAttention
  from torchtitan.models.common.config_utils import get_attention_config

  config = copy.deepcopy(config)

  def walk(node):
    if not dataclasses.is_dataclass(node):
      return
    for field in dataclasses.fields(node):
      value = getattr(node, field.name)
      if isinstance(value, VarlenAttention.Config):
        setattr(node, field.name, get_attention_config("flex"))
      elif isinstance(value, list):
        for item in value:
          walk(item)
      else:
        walk(value)

  walk(config)
  return config


@contextlib.contextmanager
def computing_in(jm, precision):
  """The wrapped model's forward with its floating parameters cast to bf16 (as the train
  step's `compute_dtype` casts them), in `precision="bf16"`."""
  import jax.numpy as jnp

  if precision != "bf16":
    yield
    return
  saved = jm.params
  jm.params = {n: v.astype(jnp.bfloat16) if jnp.issubdtype(v.dtype, jnp.floating) else v for n, v in saved.items()}
  try:
    yield
  finally:
    jm.params = saved


FORWARD_MODES = ("forward", "scan", "tp", "ep")


@dataclasses.dataclass
class Run:
  """What one side computed from the same initial state: the forward's outputs (eval mode,
  on `packed_batch()`), then each training step's loss (on `packed_batch(seed=i)`), every
  parameter and buffer after them and the first step's gradients (before Adam's sign-like
  first updates make small gradient differences large)."""

  forward: object = None
  losses: list = dataclasses.field(default_factory=list)
  tensors: dict = dataclasses.field(default_factory=dict)
  grads: dict = dataclasses.field(default_factory=dict)


def run_bridge(jm, precision, *, forward: bool, steps: int, mtp: bool, grads: bool = False) -> Run:
  """The wrapped model's `Run`: forward in eval mode (parameters cast to bf16 under
  `precision="bf16"`), then `steps` AdamW steps of `make_train_step` (with `grads`, the first
  step's gradients too: one more program to compile)."""
  import jax.numpy as jnp
  import optax

  import torch_on_tpu as tot

  run = Run()
  if forward:
    tokens, _, positions = packed_batch()
    inputs = jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})
    jm.module.eval()
    with computing_in(jm, precision):
      run.forward = tot.to_cpu(jm(**inputs))
    jm.module.train()
  if steps:
    adamw = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    step = tot.make_train_step(jm, bridge_loss, adamw, compute_dtype=jnp.bfloat16 if precision == "bf16" else None)
    for i in range(steps):
      tokens, labels, positions = packed_batch(seed=i)
      inputs = jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})
      targets = {"labels": labels, "positions": positions} if mtp else labels
      if i == 0 and grads:  # the first step's gradients, from the same weights as the reference's
        run.grads = per_layer(jm, step.gradients(inputs, targets)[1])
      run.losses.append(float(step(inputs, targets)))
    run.tensors = all_tensors(jm)
  return run


def per_layer(jm, stored: dict) -> dict:
  """Arrays keyed like `jm.params` (a scanned stack's stacked) → torch tensors by original name."""
  import torch

  from torch_on_tpu import to_cpu

  groups = jm._layout.groups if jm._layout else {}
  out = {}
  for name, value in stored.items():
    value = to_cpu(value)
    out.update({n: value[i] for i, n in enumerate(groups[name])} if name in groups else {name: value})
  return {n: torch.as_tensor(v) for n, v in out.items()}


def run_reference(ref: EagerReference, *, forward: bool, steps: int) -> Run:
  """An eager reference's `Run`, the same calls as `run_bridge`'s; tensors on the CPU."""
  run = Run()
  if forward:
    tokens, _, positions = packed_batch()
    out = ref.forward(tokens, positions)
    run.forward = [o.cpu() for o in out] if isinstance(out, list) else out.cpu()
  for i in range(steps):
    tokens, labels, positions = packed_batch(seed=i)
    run.losses.append(ref.step(tokens, labels, positions))
    if i == 0:
      run.grads = {n: p.grad.detach().cpu().clone() for n, p in ref.model.named_parameters() if p.grad is not None}
  if steps:
    run.tensors = {n: t.detach().cpu() for n, t in ref.tensors().items()}
  return run


def compare(got: Run, want: Run, params) -> dict:
  """{forward | grads | losses, weights, buffers: worst rel error} of `got` against `want`,
  for what both computed; `params` names the parameters (the other floating tensors are
  buffers)."""
  import torch

  result = {}
  if want.forward is not None:
    result["forward"] = rel_outputs(got.forward, want.forward)
  if want.grads and got.grads:
    result["grads"] = max(rel(got.grads[n], want.grads[n]) for n in want.grads)
  if want.losses:
    per_weight = {n: rel(torch.as_tensor(got.tensors[n]).detach(), want.tensors[n]) for n in params}
    buffers = {
      n: rel(torch.as_tensor(got.tensors[n]).detach(), want.tensors[n])
      for n in want.tensors if n not in params and want.tensors[n].is_floating_point()
    }
    result.update({
      "losses": max(rel(g, w) for g, w in zip(got.losses, want.losses)),
      "weights": max(per_weight.values()), "buffers": max(buffers.values(), default=0.0),
      "_buffers": buffers, "_weights": per_weight,
    })
  return result


def check(spec: str, mode: str, *, steps: int = 5, config=None, precision: str | None = None, grads: bool = False,
          forward: bool | None = None) -> dict:
  """One family in one mode: {forward | grads, losses, weights, buffers: worst rel error}
  (the first step's gradients with `grads`, or in mode `spread`). Mode `spread` compares two
  valid eager references instead (`EagerReference(exact=True)`): the noise floor of the
  computation. `precision` defaults to `precision_of(spec)`; `forward=True` adds the forward to
  a training mode (one wrapped model for both: tools/moe_sweep.py)."""
  from torch_on_tpu.models.torchtitan import mtp_depths

  precision = precision or precision_of(spec)
  config = config if config is not None else shrink(registry_config(spec))
  jm = wrap(config, "train" if mode == "spread" else mode)
  state = all_tensors(jm)
  ref = EagerReference(flex_config(config), state, precision=precision)
  forward = (mode in FORWARD_MODES or mode == "spread") if forward is None else forward
  steps = 0 if mode in FORWARD_MODES else steps
  if mode == "spread":
    exact = EagerReference(flex_config(config), state, precision=precision, exact=True)
    got = run_reference(exact, forward=forward, steps=steps)
  else:
    got = run_bridge(jm, precision, forward=forward, steps=steps, mtp=mtp_depths(ref.model) > 0, grads=grads)
  want = run_reference(ref, forward=forward, steps=steps)
  return compare(got, want, {n for n, _ in ref.model.named_parameters()})


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("specs", nargs="*", default=list(SPECS))
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--eps", type=float, default=EPS, help="AdamW eps of both sides")
  p.add_argument("--round_robin", action="store_true",
                 help="MoE routing by torchtitan's round-robin debug rule (shrink's round_robin)")
  p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                 help="every family in this precision (default: fp32, gpt_oss in bf16: PRECISION)")
  p.add_argument("--mtp_layers", type=int, default=0,
                 help="multi-token-prediction layers (num_mtp_layers; DeepSeek-V3): its outputs and MTPLoss compared")
  args = p.parse_args(argv)
  globals()["EPS"] = args.eps
  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  for spec in args.specs:
    for mode in args.modes.split(","):
      if mode.startswith("ep") and "moe" not in spec and spec.split(":")[0] not in ("deepseek_v3", "kimi_k2_7", "gpt_oss"):
        continue
      start = time.perf_counter()
      try:
        mtp = {"num_mtp_layers": args.mtp_layers} if args.mtp_layers else {}
        config = shrink(registry_config(spec, **mtp), round_robin=args.round_robin)
        result = check(spec, mode, config=config, precision=args.precision, grads=True)
        shown = ", ".join(f"{k} {v:.1e}" for k, v in result.items() if not k.startswith("_"))
      except Exception as e:  # noqa: BLE001 (a table of outcomes: each failure is one row)
        shown = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      print(f"{spec:28s} {mode:10s} {shown}  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
  sys.exit(main())
