"""HF models' SDPA attention through transformers' own mask and attention interfaces: the mask a model
asks for (causal, bidirectional, a sliding window, Llama 4's chunks; any padding) reaches the
bridge's kernels as segment ids (splash on TPU: `test_tpu_compile.py`), and computes what torch does,
padded rows included; what the reader does not recognise stays transformers' own dense mask."""

import jax
import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import masking_utils as mu

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.core import _compat
from torch_on_tpu.models import hf_attention

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

LENGTH = 12


def paddings():
  """2-D attention masks: none; left, right and middle padding, and a row that is all padding."""
  mask = torch.ones(5, LENGTH, dtype=torch.long)
  mask[0, :5] = 0
  mask[1, 9:] = 0
  mask[2, 3:7] = 0
  mask[3, :] = 0
  return [None, mask]


def left_padding(mask):
  return torch.zeros(5, dtype=torch.long) if mask is None else (mask.cumsum(-1) == 0).sum(-1)


PATTERNS = {
  "causal": lambda pad: mu.causal_mask_function,
  "bidirectional": lambda pad: mu.bidirectional_mask_function,
  "sliding window 3": lambda pad: mu.sliding_window_causal_mask_function(3),
  "chunks of 4": lambda pad: mu.chunked_causal_mask_function(4, left_padding(pad)),
  "causal, nested": lambda pad: mu.and_masks(mu.and_masks(mu.causal_mask_function), mu.sliding_window_overlay(5)),
}
POSITIONS = torch.tensor([list(range(5)) + list(range(7))] * 3 + [list(range(12))] + [[0] * 12])  # packed: 5 + 7 tokens
PACKED = {  # as create_causal_mask composes them for position_ids without an attention_mask
  f"packed, {name}": (lambda pad, name=name: mu.packed_sequence_compatibility_function(
    PATTERNS[name](pad), POSITIONS, mu.find_packed_sequence_indices(POSITIONS)))
  for name in ("causal", "sliding window 3", "chunks of 4")
}


def dense(masks, length):
  """transformers' own (B or 1, 1, L, L) boolean mask for the pattern of `masks` (an `HFMasks`)."""
  rows = torch.arange(length)[:, None]
  cols = torch.arange(length)[None, :]
  allowed = torch.ones(length, length, dtype=torch.bool)
  if masks.causal:
    allowed = allowed & (cols <= rows)
  if masks.window is not None:
    allowed = allowed & (cols > rows - masks.window)
  allowed = allowed[None, None]
  if masks.q_ids is not None:
    allowed = allowed & (masks.q_ids[:, None, :, None] == masks.kv_ids[:, None, None, :])
  if masks.keep is not None:
    allowed = allowed & masks.keep[:, None, :, None]
  return allowed


@pytest.mark.parametrize("pattern", sorted({**PATTERNS, **PACKED}))
def test_each_pattern_read_from_transformers_mask_functions_is_its_own_mask(pattern):
  for padding in paddings()[:1] if pattern in PACKED else paddings():
    function = {**PATTERNS, **PACKED}[pattern](padding)
    theirs = mu.sdpa_mask(
      batch_size=5, q_length=LENGTH, kv_length=LENGTH, mask_function=function, attention_mask=padding,
      allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
    )
    read = hf_attention.read_pattern(function)
    assert read is not None, pattern
    ours = dense(hf_attention.build_masks(LENGTH, padding, **read), LENGTH)
    assert torch.equal(ours.expand_as(theirs), theirs), (pattern, padding)


def test_patterns_it_cannot_express_stay_transformers_dense_masks():
  ids = torch.zeros(2, LENGTH, dtype=torch.long)
  for function in (
    mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)),  # image tokens seeing each other
    mu.sliding_window_bidirectional_mask_function(3),  # a two-sided window: one-sided in the kernels
    mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids)),  # documents without their positions
    mu.sliding_window_overlay(3),  # an overlay on no base pattern
  ):
    assert hf_attention.read_pattern(function) is None
  sdpa_mask = hf_attention._mask_builder(mu.sdpa_mask)  # and the builder hands them to transformers'
  dense = sdpa_mask(batch_size=2, q_length=LENGTH, kv_length=LENGTH, mask_function=mu.sliding_window_bidirectional_mask_function(3),
                    attention_mask=None, allow_is_causal_skip=False)
  assert isinstance(dense, torch.Tensor) and dense.shape == (2, 1, LENGTH, LENGTH)
  decode = sdpa_mask(batch_size=2, q_length=1, kv_length=LENGTH, q_offset=LENGTH - 1, mask_function=mu.causal_mask_function,
                     attention_mask=torch.ones(2, LENGTH, dtype=torch.bool), allow_is_causal_skip=False)
  assert isinstance(decode, torch.Tensor)  # a decode step against a cache: transformers' own


def hf_config(kind):
  small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
  config = {
    "llama": lambda: transformers.LlamaConfig(**small),
    "llama, bidirectional": lambda: transformers.LlamaConfig(**small, is_causal=False),
    "mistral, sliding window 4": lambda: transformers.MistralConfig(**small, sliding_window=4),
    "llama4, chunks of 4": lambda: transformers.Llama4TextConfig(
      **{**small, "num_hidden_layers": 4}, intermediate_size_mlp=128, head_dim=16, attention_chunk_size=4,
      num_local_experts=2, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
    ),
  }[kind]()
  config._attn_implementation = "sdpa"
  return config


def loss_and_grads(jm, tokens, labels, extra):
  """`h.jax_loss_and_grads` with the mask or positions (`extra`, a dict of tensors) arguments of the differentiated call."""

  def loss_fn(params, tokens, labels, extra):
    out = jm.functional_call(params, jm.buffers, torch_view(tokens), **torch_view(extra), use_cache=False)
    with torchax.default_env():
      loss = F.cross_entropy(h.logits_of(out).flatten(0, 1).float(), torch_view(labels).flatten())
    return jax_view(loss)

  placed = {k: jm.place(v) for k, v in extra.items()}
  return jax.jit(jax.value_and_grad(loss_fn))(jm.params, jm.place(tokens), jm.place(labels), placed)


CASES = [(kind, "padding") for kind in ("llama", "llama, bidirectional", "mistral, sliding window 4", "llama4, chunks of 4")] + [
  (kind, "packed documents") for kind in ("llama", "mistral, sliding window 4", "llama4, chunks of 4")
]


@pytest.mark.parametrize("kind, inputs", CASES)
def test_hf_models_compute_torchs_logits_and_gradients_through_segment_ids(kind, inputs, monkeypatch):
  """Padding: left, right, in the middle and a row of it, every position compared (padded rows too:
  torch's SDPA gives a row that sees nothing zeros, as the bridge does). Packed documents: position_ids
  that restart, which transformers turns into document masks (and Llama 4 into chunks by position).
  fp32, ‖Δ‖/‖ref‖ ≤ 1e-5 for the logits and every gradient."""
  built = []
  build = hf_attention.build_masks
  monkeypatch.setattr(hf_attention, "build_masks", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
  torch.manual_seed(0)
  config = hf_config(kind)
  jm = tot.ShardedModule(h.build_causal_lm(config), mesh=tot.make_mesh(fsdp=-1))
  ref = h.reference(jm, lambda device: h.build_causal_lm(config, device=device))
  if inputs == "padding":
    extra = {"attention_mask": torch.cat([paddings()[1], torch.ones(3, LENGTH, dtype=torch.long)])}  # 8 rows, 8 devices
  else:
    extra = {"position_ids": torch.cat([POSITIONS[:3]] * 3)[:8]}
  tokens, labels = h.random_batch(256, batch=8, seq=LENGTH)
  logits, loss, grads = h.torch_loss_and_grads(ref, tokens, labels, {**extra, "use_cache": False})
  our_loss, our_grads = loss_and_grads(jm, tokens, labels, extra)
  assert built and all(m.q_ids is not None for m in built), built  # the segment-id path, not a dense mask
  ours = tot.to_cpu(h.logits_of(jm(tokens, **extra, use_cache=False)))
  assert h.rel(ours, logits) < 1e-5 and abs(float(our_loss) - float(loss)) < 1e-5 * abs(float(loss))
  stored = h.per_layer(jm, our_grads)
  assert max(h.rel(torch.as_tensor(stored[n]), g) for n, g in grads.items()) < 1e-5
