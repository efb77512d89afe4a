"""Attention kernels behind `scaled_dot_product_attention` (and torchtitan's flex).

torchax lowers SDPA by building an L×S bias and the full score matrix: at long
sequence lengths that alone exhausts memory. While `kernels(mode, ...)` is
active (ShardedModule enters it around every trace), SDPA runs one of:

- `"splash"`: Pallas splash attention (TPU; Pallas interpret mode elsewhere, for tests),
- `"cudnn"`: `jax.nn.dot_product_attention(implementation="cudnn")` (GPU; its
  `"xla"` implementation elsewhere, so the argument plumbing runs on CPU too),
- `"xla"`: a blocked online-softmax kernel with a recomputing backward that only
  holds a few (block_q × block_kv) tiles of scores per batch and head,

each in `shard_map` over the mesh (batch over the data axes, heads over `tp`).
`"auto"` picks by platform. A call a kernel cannot express (dropout, explicit
masks, L≠S for splash; fp32 or masks for cuDNN) runs the XLA kernel instead,
said once in the log. Semantics are torch's: top-left causal mask, bool or
additive `attn_mask`, default scale 1/√d, GQA, dropout on the attention
weights, and rows with nothing to attend to give 0 (as torch 2.13 eager does);
query, key and value broadcast as torch's matmuls do (batch dims, one key/value
head for many query heads without `enable_gqa`, 2-D and 3-D inputs).
"""

from torch_on_tpu.attention import context, unsplit
from torch_on_tpu.attention.routing import MODES, Attention, installed, kernels
from torch_on_tpu.attention.splash import BLOCK_SIZE_KEYS, check_block_sizes, splash_block_sizes
from torch_on_tpu.attention.xla_flash import dropout_keep_scale, xla_attention

__all__ = [
  "BLOCK_SIZE_KEYS",
  "context",
  "unsplit",
  "MODES",
  "Attention",
  "check_block_sizes",
  "dropout_keep_scale",
  "installed",
  "kernels",
  "splash_block_sizes",
  "xla_attention",
]
