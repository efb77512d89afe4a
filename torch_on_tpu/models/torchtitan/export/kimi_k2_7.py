"""torchtitan's Kimi K2.x as HF's: its text model as DeepSeek's (`deepseek_v3`), with a vision encoder
as HF's Kimi-K2.5."""

from __future__ import annotations

import dataclasses

from torch_on_tpu.models.torchtitan.export.adapter import refuse_hf
from torch_on_tpu.models.torchtitan.export.deepseek_v3 import _deepseek_hf_config, hf_deepseek


def _kimi_hf_config(config):
  """HF's config for torchtitan's Kimi K2.x: its text model's (`_deepseek_hf_config`) without a
  vision encoder; with one, HF's Kimi-K2.5 (`kimi_k25`): that text model, MoonViT (pre-norm
  LayerNorm blocks, tanh-GELU MLPs, 2D RoPE, a bicubically resampled position table) and the
  projector (LayerNorm per patch, exact-GELU MLP). Its image and video placeholder is the id one
  past the vocabulary: HF embeds placeholder ids as token 0, so no text token may be one (torchtitan
  takes the id with each call). Refuses in one sentence what HF's vision tower cannot express."""
  import transformers

  encoder = config.vision_encoder
  if encoder is None:
    return _deepseek_hf_config(config)
  text, check = _deepseek_hf_config(dataclasses.replace(config, vision_encoder=None))
  block, projector = encoder.block, encoder.projector
  norms = [block.norm1, block.norm2, encoder.final_norm, projector.pre_norm]
  linears = [encoder.patch_embed_proj, block.attn.wq, block.attn.wk, block.attn.wv, block.attn.proj, block.mlp.fc1, block.mlp.fc2,
             projector.linear_1, projector.linear_2]
  problem = None
  if encoder.in_channels != 3:
    problem = f"its vision encoder reads {encoder.in_channels} channels (HF's patch embedding reads 3)"
  elif encoder.init_pos_emb_height != encoder.init_pos_emb_width or encoder.interpolation_mode != "bicubic":
    problem = "its vision position table is not square or not resampled bicubically"
  elif any(n.eps != 1e-5 for n in norms[:3]) or not all(n.elementwise_affine for n in norms):
    problem = "its vision LayerNorms are not HF's (affine, eps 1e-5 in the encoder)"
  elif not all(linear.bias for linear in linears):
    problem = "its vision linear layers lack biases (HF's all have them)"
  elif block.mlp.act_fn.approximate != "tanh" or projector.act_fn.approximate != "none":
    problem = "its vision GELUs are not HF's (tanh's approximation in the encoder, exact in the projector)"
  elif encoder.rotary_pos_emb.head_dim * encoder.num_heads != encoder.dim:
    problem = "its vision RoPE does not span each head's whole width (HF's does)"
  elif projector.vt_hidden_size != encoder.dim or encoder.text_hidden_size != config.dim:
    problem = "its vision projector's sizes are not the encoder's and the text model's"
  refuse_hf(problem, "Kimi", "Kimi-K2.5")
  vision = transformers.Kimi_K25VisionConfig(
    patch_size=encoder.patch_size, pos_emb_height=encoder.init_pos_emb_height, pos_emb_width=encoder.init_pos_emb_width,
    num_attention_heads=encoder.num_heads, num_hidden_layers=encoder.num_layers, hidden_size=encoder.dim,
    intermediate_size=block.mlp.fc1.out_features, hidden_act="gelu_pytorch_tanh", merge_kernel_size=list(encoder.merge_kernel_size),
    rope_parameters=dict(rope_type="axial", rope_theta=float(encoder.rotary_pos_emb.theta)),
  )
  text.architectures = None
  hf = transformers.Kimi_K25Config(
    text_config=text, vision_config=vision, projection_hidden_size=encoder.dim, projection_layer_norm_eps=projector.pre_norm.eps,
    image_token_id=config.vocab_size, video_token_id=config.vocab_size, tie_word_embeddings=text.tie_word_embeddings,
    architectures=["Kimi_K25ForConditionalGeneration"],
  )
  return hf, check


def hf_form(module):
  return hf_deepseek(module, _kimi_hf_config)
