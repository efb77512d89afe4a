"""torchtitan's Muse Glimmer as HF's MuseGlimmer (text, and its vision tower, adapter and projection),
through torchtitan's adapter."""

from __future__ import annotations

import dataclasses

from torch_on_tpu.models.torchtitan.export.adapter import hf_via_adapter, refuse_hf


def _muse_glimmer_hf_config(config):
  """HF's MuseGlimmer config for torchtitan's Muse Glimmer; refuses what HF's computes
  differently. HF's model is its vision-language class (transformers loads it with
  `AutoModelForImageTextToText`): a vision flavor's tower, adapter and projection are written
  (`_muse_glimmer_hf_vision`); for a text flavor HF still builds a tower, here the smallest one
  (no layers), which the export leaves unwritten. torchtitan's model holds no image id (its
  caller passes one with each call, and replaces those tokens only when it passes pixels), while
  HF replaces its image and video ids by token 0 on every call: they are set to ids no token
  has, so HF's text logits are ours for every sequence."""
  import transformers
  from torchtitan.models.common.attention import FlexAttention, VarlenAttention
  from torchtitan.models.common.rope import ComplexRoPE

  layers = [(layer, layer.attention) for layer in config.layers]
  first = layers[0][1]
  heads, head_dim = first.n_heads, first.head_dim or config.dim // first.n_heads
  windows = {_muse_window(a) for _, a in layers} - {None}
  final, embedding, lm_head = config.norm, config.tok_embeddings.norm, config.lm_head
  pre_eps = {final.eps, embedding.eps, *(n.eps for layer, a in layers for n in (layer.attention_norm, layer.ffn_norm, a.qk_norm) if n)}
  post_eps = {n.eps for layer, _ in layers for n in (layer.post_attention_norm, layer.post_ffn_norm)}
  layer_gains = {_gain(n) for layer, _ in layers for n in (layer.attention_norm, layer.ffn_norm, layer.post_attention_norm, layer.post_ffn_norm)}
  problem = None
  if config.enable_weight_tying:
    problem = "its output is tied to its embedding"
  elif any(_muse_layer_shape(layer) != _muse_layer_shape(layers[0][0]) for layer, _ in layers):
    problem = "its layers differ in shape or query scale"
  elif not isinstance(first.rope, ComplexRoPE.Config) or first.rope.scaling != "none" or first.rope.dim != head_dim:
    problem = f"its RoPE is {type(first.rope).__qualname__} with scaling '{first.rope.scaling}' over {first.rope.dim} of {head_dim} dims"
  elif first.qk_norm is None or first.o_gate is None:
    problem = "it has no q/k norm or no output gate (HF's always applies both)"
  elif len(windows) > 1:
    problem = f"its layers use sliding windows of {len(windows)} sizes (HF has one)"
  elif {a.window_size for _, a in layers} != {None} and not isinstance(first.inner_attention, (FlexAttention.Config, VarlenAttention.Config)):
    problem = f"its windowed layers run {type(first.inner_attention).__qualname__.split('.')[0]}, which attends past their windows (HF's does not)"
  elif layer_gains != {1.0} or _gain(final) != 0.0 or {_gain(embedding), _gain(first.qk_norm)} != {None}:
    problem = "its norms are not HF's (1 + weight in the layers, weight at the end, none on the embedding and q/k)"
  elif len(pre_eps) > 1 or len(post_eps) > 1:
    problem = "its norms' epsilons are not HF's two (one before and one after each sub-layer)"
  elif getattr(lm_head, "output_soft_cap_temp", None) is None:
    problem = "its logits are not soft-capped (HF's always are)"
  refuse_hf(problem, "Muse Glimmer", "MuseGlimmer")
  vision = _muse_glimmer_hf_vision(config, pre_eps)
  theta = float(first.rope.theta)
  text = transformers.MuseGlimmerTextConfig(
    vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=layers[0][0].feed_forward.w1.out_features,
    num_hidden_layers=len(layers), num_attention_heads=heads, num_key_value_heads=first.n_kv_heads or heads,
    head_dim=head_dim, hidden_activation="silu", max_position_embeddings=first.rope.max_seq_len,
    rms_norm_eps=pre_eps.pop(), post_norm_eps=post_eps.pop(), tie_word_embeddings=False, attention_bias=False,
    rope_parameters=dict(rope_type="default", rope_theta=theta),
    **({"sliding_window": windows.pop()} if windows else {}),  # HF's default where no layer slides
    layer_types=["sliding_attention" if _muse_window(a) else "full_attention" for _, a in layers],
    layer_rope_theta=[theta if a.use_rope else 0 for _, a in layers],  # HF reads only 0 (no RoPE) or not
    qk_scale_factor=float(first.scale_query_by), output_multiplier=float(lm_head.output_multiplier),
    final_logit_softcapping=float(lm_head.output_soft_cap_temp), bos_token_id=None, eos_token_id=None,
  )
  hf = transformers.MuseGlimmerConfig(
    text_config=text, **vision, image_token_id=config.vocab_size, video_token_id=config.vocab_size + 1,
    tie_word_embeddings=False, architectures=["MuseGlimmerForConditionalGeneration"],
  )
  return hf, None


def _muse_glimmer_hf_vision(config, text_eps: set) -> dict:
  """The vision part of HF's MuseGlimmer config (`vision_config`, the adapter's and projection's
  widths) for torchtitan's vision tower, adapter, projection and perception norm; the smallest
  tower for a text flavor. Refuses what HF's vision path computes differently."""
  import transformers
  from torchtitan.models.common.attention import FlexAttention
  from torchtitan.models.common.nn_modules import GELU

  enc, adapter, projection, norm = config.vision_encoder, config.vision_adapter, config.vision_projection, config.perception_emb_norm
  if enc is adapter is projection is norm is None:
    return dict(vision_config=transformers.MuseGlimmerVisionConfig(
      num_hidden_layers=0, hidden_size=1, num_attention_heads=1, intermediate_size=1, patch_size=1, patch_temporal=1,
      merge_size=1, pos_emb_height=1, pos_emb_width=1, max_position_embeddings=1,
    ), out_hidden_size=1, projector_hidden_size=1)
  block = enc and enc.block
  linears = block and (block.attn.wq, block.attn.wk, block.attn.wv, block.attn.proj, block.mlp.fc1, block.mlp.fc2)
  problem = None
  if None in (enc, adapter, projection, norm):
    problem = "its vision stack lacks an encoder, adapter, projection or perception norm (HF's has all four)"
  elif enc.pos_emb_grid_h != enc.pos_emb_grid_w:
    problem = f"its vision position grid (and window) is {enc.pos_emb_grid_h}x{enc.pos_emb_grid_w} patches, HF's is square"
  elif not isinstance(block.attn.inner_attention, FlexAttention.Config):
    problem = f"its vision attention runs {type(block.attn.inner_attention).__qualname__.split('.')[0]}, not the masks of its windows"
  elif not isinstance(block.mlp.act_fn, GELU.Config):
    problem = f"its vision MLP's activation is {type(block.mlp.act_fn).__qualname__.split('.')[0]}, HF's a GELU"
  elif enc.head_dim * enc.num_heads != enc.latent_dim or enc.rope_freq.head_dim != enc.head_dim:
    problem = "its vision heads do not split its width evenly"
  elif enc.conv1.in_features != 3 * enc.patch_temporal * enc.patch_size**2 or enc.conv1.bias:
    problem = "its patch embedding is not a bias-free linear map of 3-channel patches"
  elif not all(linear.bias for linear in linears) or adapter.c_fc.bias or adapter.c_proj.bias or projection.bias:
    problem = "its vision linear layers' biases differ from HF's (the tower's biased, the adapter's and projection's not)"
  elif {block.norm1.eps, block.norm2.eps} != {1e-5} or enc.ln_pre.eps != enc.ln_post.eps or not all(
      n.elementwise_affine for n in (block.norm1, block.norm2, enc.ln_pre, enc.ln_post)):
    problem = "its vision layer norms are not HF's (affine; eps 1e-5 in the layers, one eps before and after them)"
  elif norm.elementwise_affine or {norm.eps} != text_eps:
    problem = "its perception norm is not HF's (scaleless, the text norms' eps)"
  elif (adapter.c_fc.in_features, adapter.c_proj.in_features) != (enc.output_dim, adapter.c_proj.out_features) or \
      enc.output_dim != enc.latent_dim * enc.downsample_factor**2:
    problem = "its vision adapter's widths are not HF's (the merged patches in, one width through)"
  refuse_hf(problem, "Muse Glimmer", "MuseGlimmer")
  every = enc.sparse_attention_factor  # torchtitan's _layer_uses_global_attention
  layer_types = ["full_attention" if i == enc.num_layers - 1 or (i + 1) % every == 0 else "window_attention"
                 for i in range(enc.num_layers)]
  vision_config = transformers.MuseGlimmerVisionConfig(
    num_hidden_layers=enc.num_layers, hidden_size=enc.latent_dim, num_attention_heads=enc.num_heads,
    intermediate_size=block.mlp.fc1.out_features, hidden_act={"none": "gelu", "tanh": "gelu_pytorch_tanh"}[block.mlp.act_fn.approximate],
    patch_size=enc.patch_size, patch_temporal=enc.patch_temporal, merge_size=enc.downsample_factor,
    pos_emb_height=enc.pos_emb_grid_h, pos_emb_width=enc.pos_emb_grid_w, max_position_embeddings=enc.pos_emb_grid_h * enc.pos_emb_grid_w,
    layer_norm_eps=enc.ln_pre.eps, layer_types=layer_types,
    rope_parameters=dict(rope_type="axial", rope_theta=float(enc.rope_freq.rope_theta)),
  )
  return dict(vision_config=vision_config, out_hidden_size=enc.output_dim, projector_hidden_size=adapter.c_proj.out_features,
              projector_hidden_act="gelu")  # torchtitan's adapter: F.gelu, exact


def _muse_window(attention) -> int | None:
  """The window a Muse Glimmer layer attends in: varlen's kernel argument (left, 0) where it runs
  varlen (what torchtitan computes with), its mask's key otherwise."""
  from torchtitan.models.common.attention import VarlenAttention

  inner = attention.inner_attention
  if isinstance(inner, VarlenAttention.Config):
    return inner.window_size[0] + 1 if inner.window_size[0] >= 0 else None
  return attention.window_size


def _muse_layer_shape(layer) -> tuple:
  a = layer.attention
  return (a.n_heads, a.n_kv_heads, a.head_dim, a.scale_query_by, layer.feed_forward.w1.out_features, dataclasses.replace(a.rope, max_seq_len=0))


def _gain(norm) -> float | None:
  """The constant an RMSNorm's weight is centred on (torchtitan's `RMSGainCenterNorm`), 0 for a
  plain learnable one, None for one without a weight."""
  if not norm.elementwise_affine:
    return None
  return getattr(norm, "gain_center", 0.0)


def hf_form(module):
  return hf_via_adapter(module, _muse_glimmer_hf_config)
