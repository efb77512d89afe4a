"""Every transformers architecture whose own code calls `F.scaled_dot_product_attention` (not
through transformers' attention interface) computes torch's forward through `ShardedModule` on
fsdp=8. Falcon hands the mask transformers built to SDPA itself and adds ALiBi to it, so that mask
must stay a tensor (`hf_attention.PatternedMask`); the others feed SDPA their own biases
(relative positions, attention pooling, GraniteSpeech's masked_fill_ on a slice of its scores)."""

import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.deepseek_ocr2 import modeling_deepseek_ocr2
from transformers.models.unlimited_ocr import modeling_unlimited_ocr

import torch_on_tpu as tot
from tests import helpers as h

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

T = transformers
BATCH = 8  # a row per device
TOKENS = torch.randint(0, 256, (BATCH, 12), generator=torch.Generator().manual_seed(1))
PADDING = torch.ones(BATCH, 12, dtype=torch.long)
PADDING[0, :3] = 0  # left
PADDING[1, 9:] = 0  # right
PIXELS = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(2))
FEATURES = torch.randn(BATCH, 12, 16, generator=torch.Generator().manual_seed(3))  # 12 frames: a partial block of 5
SAM = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
           window_size=2, global_attn_indexes=(1,), mlp_dim=64)
SPEECH = dict(input_dim=16, num_layers=2, hidden_dim=32, num_heads=2, dim_head=16, output_dim=8, context_size=5,
              max_pos_emb=8, dropout=0.0, conv_kernel_size=3)
DATA2VEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
                drop_path_rate=0.0, out_indices=(1,))
TEXT = dict(input_ids=TOKENS, attention_mask=PADDING, use_cache=False)
logits = lambda out: out.logits  # noqa: E731
hidden = lambda out: out.last_hidden_state  # noqa: E731

# case → (the modeling file whose code calls SDPA, architecture class, config, inputs, output read)
CASES = {
  "falcon, rotary": ("falcon", T.FalconForCausalLM, lambda: T.FalconConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256, new_decoder_architecture=True, num_kv_heads=2,
  ), TEXT, logits),
  "falcon, alibi": ("falcon", T.FalconForCausalLM, lambda: T.FalconConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256, alibi=True, multi_query=False,
  ), TEXT, logits),
  "inkling2": ("inkling2", T.Inkling2ForCausalLM, lambda: T.Inkling2TextConfig(
    vocab_size=256, unpadded_vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4, rel_extent=8,
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
    max_position_embeddings=64, eos_token_id=None,
  ), TEXT, logits),
  "granite_speech": ("granite_speech", T.GraniteSpeechCTCEncoder, lambda: T.GraniteSpeechEncoderConfig(**SPEECH),
                     dict(hidden_states=FEATURES), hidden),
  "granite_speech_plus": ("granite_speech_plus", T.GraniteSpeechPlusCTCEncoder, lambda: T.GraniteSpeechPlusEncoderConfig(**SPEECH),
                          dict(hidden_states=FEATURES), hidden),
  "aimv2": ("aimv2", T.Aimv2VisionModel, lambda: T.Aimv2VisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8, use_head=True,
  ), dict(pixel_values=PIXELS), lambda out: out.pooler_output),
  "data2vec_vision": ("data2vec", T.Data2VecVisionModel, lambda: T.Data2VecVisionConfig(**DATA2VEC, use_relative_position_bias=True),
                      dict(pixel_values=PIXELS), hidden),
  "data2vec_vision, shared bias": ("data2vec", T.Data2VecVisionModel, lambda: T.Data2VecVisionConfig(
    **DATA2VEC, use_shared_relative_position_bias=True), dict(pixel_values=PIXELS), hidden),
  "sam": ("sam", T.SamVisionModel, lambda: T.SamVisionConfig(**SAM, num_pos_feats=8), dict(pixel_values=PIXELS), hidden),
  "sam_hq": ("sam_hq", T.SamHQVisionModel, lambda: T.SamHQVisionConfig(**SAM, num_pos_feats=8), dict(pixel_values=PIXELS), hidden),
  "unlimited_ocr": ("unlimited_ocr", modeling_unlimited_ocr.UnlimitedOcrSamVisionEncoder, lambda: T.UnlimitedOcrSamVisionConfig(
    **SAM, downsample_channels=(16, 32)), dict(pixel_values=PIXELS), hidden),
  "deepseek_ocr2": ("deepseek_ocr2", modeling_deepseek_ocr2.DeepseekOcr2SamVisionEncoder, lambda: T.DeepseekOcr2SamVisionConfig(
    **SAM, downsample_channels=[16, 32]), dict(pixel_values=PIXELS), hidden),
}


def test_the_cases_cover_every_modeling_file_that_calls_sdpa_itself():
  """A transformers upgrade that adds one fails here until it has a case."""
  models = Path(transformers.__file__).parent / "models"
  calling = {
    path.parent.name for path in models.glob("*/modeling_*.py")
    if re.search(r"(?<![\w\"`])(F|functional)\.scaled_dot_product_attention\(", path.read_text())
  }
  assert calling == {model for model, *_ in CASES.values()}


def build(cls, config, device):
  with torch.device(device):
    model = cls._from_config(config, attn_implementation="sdpa" if cls._supports_sdpa else None)
  return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_torch(case):
  """fp32, random weights (zero-initialised tables and biases too), ‖Δ‖/‖ref‖ ≤ 1e-5."""
  _, cls, config, inputs, output = CASES[case]
  torch.manual_seed(0)
  ref = build(cls, config(), "cpu")
  with torch.no_grad():
    for p in ref.parameters():
      p.add_(torch.randn_like(p) * 0.1)
    expected = output(ref(**inputs))
  jm = tot.ShardedModule(build(cls, config(), "meta"), mesh=tot.make_mesh(fsdp=8))
  jm.load_state_dict(ref.state_dict())
  assert h.rel(tot.to_cpu(output(jm(**inputs))), expected) < 1e-5
