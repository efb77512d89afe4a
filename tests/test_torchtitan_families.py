"""Every torchtitan registry family, unmodified: recognised, torchtitan's init and inputs,
at parity with eager torch (the slice of `tools/titan_parity.py` that fits the suite).

Models are each family's own `debugmodel` from its registry, made small by one rule
for all (`titan_parity.shrink`: 2-4 layers, vocab 256, 8 experts of top-2), called
as torchtitan's trainer calls them (tokens, positions, `get_attention_masks` on a
packed batch) on 8 simulated devices. Tolerances (‖Δ‖/‖ref‖): fp32 forward 1e-5
(scanned too); where torchtitan computes its MoE experts in bf16 the yardstick is
the spread of two valid eager references (`titan_parity.check(..., "spread")`),
measured in the same test, ×3.
"""

import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu import metrics, models

tp = h.titan_parity()


def tiny(spec, layers=2, **kw):
  return tp.shrink(tp.registry_config(spec), layers=layers, **kw)


# (family, layers kept, also scanned): dense with qk-norm; MLA + MoE (dense first layer);
# Qwen3.5's hybrid of Gated DeltaNet and gated full attention; Kimi (a multimodal decoder, text only).
FORWARD = [("qwen3:debugmodel", 2, False), ("deepseek_v3:debugmodel", 3, True), ("qwen3_5:debugmodel", 4, False),
           ("kimi_k2_7:debugmodel", 2, False)]


@pytest.mark.parametrize("spec,layers,scanned", FORWARD, ids=[f[0].split(":")[0] for f in FORWARD])
def test_a_family_forward_matches_eager_torch(spec, layers, scanned):
  config = tiny(spec, layers=layers)
  assert tp.check(spec, "forward", config=config)["forward"] < 1e-5
  if scanned:
    assert tp.check(spec, "scan", config=config)["forward"] < 1e-5


def test_every_registry_family_is_recognised_with_its_shape():
  for spec in (*tp.SPECS, "muse_glimmer:debugmodel"):  # Muse Glimmer: its embedding wrapped with a norm
    with torch.device("meta"):
      model = tiny(spec).build()
    family = models.family_of(model)
    assert family.name == "torchtitan", spec
    shape = family.decoder_shape(model)
    assert shape is not None and shape.layers == len(model.layers) and shape.vocab == tp.VOCAB, spec
    flops = metrics.flops_per_token(model, seqlen=tp.SEQ)
    assert flops.torchtitan > 0, spec


def test_moe_flops_count_the_active_experts_only():
  with torch.device("meta"):
    model = tiny("qwen3:debugmodel_moe", layers=1).build()
  moe = model.layers["0"].moe
  experts = sum(p.numel() for p in moe.routed_experts.inner_experts.parameters())
  shape = models.family_of(model).decoder_shape(model)
  assert shape.inactive_params == experts * (8 - 2) // 8  # 8 experts, top-2
  total = metrics.flops_per_token(model, seqlen=tp.SEQ).n_matmul_params
  assert total == sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel() - shape.inactive_params


def test_tp_and_ep_maps_come_from_torchtitans_own_plans():
  from torch_on_tpu.models.torchtitan import fsdp_tp_map, parallel_plan

  with torch.device("meta"):
    model = tiny("qwen3:debugmodel_moe", layers=1).build()
  table = fsdp_tp_map(model)
  assert table["layers.0.attention.qkv_linear.wqkv.weight"] == ("tp", "fsdp")  # colwise
  assert table["layers.0.attention.wo.weight"] == ("fsdp", "tp")  # rowwise
  assert table["layers.0.moe.routed_experts.inner_experts.w2_EDF"] == ("fsdp", None, "tp")
  assert table["layers.0.attention_norm.weight"] == (None,)
  experts = models.family_of(model).expert_parameters(model)
  assert sorted(experts) == [f"layers.0.moe.routed_experts.inner_experts.{w}" for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
  assert all(dims == {"ep": 0} for name, dims in parallel_plan(model, ep=True).items() if name in experts)
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(ep=8), sharding="ep", abstract=True)
  assert tuple(jm.params["layers.0.moe.routed_experts.inner_experts.w1_EFD"].sharding.spec)[0] == "ep"


def test_qwen3_5_under_tp_puts_fsdp_on_a_dim_it_can_split_and_matches_eager():
  """Its depthwise conv weights are (channels, 1, kernel): fsdp goes on the kernel dim, not the 1."""
  from torch_on_tpu.models.torchtitan import fsdp_tp_map

  spec = "qwen3_5:debugmodel"
  with torch.device("meta"):
    model = tiny(spec, layers=1).build()
  table = fsdp_tp_map(model)
  assert table["layers.0.attn.conv_q.weight"] == ("tp", None, "fsdp")
  assert tp.check(spec, "tp", config=tiny(spec, layers=2))["forward"] < 1e-5


def test_moe_trains_scanned_with_torchtitans_load_balancing():
  """5 AdamW steps of Qwen3-MoE, scanned, fsdp=8, against torchtitan's eager trainer with its
  load-balancing hook: losses, every weight, and the balancing buffers (expert_bias_E moved by
  the pre-step rule, tokens_per_expert_E counted by the scanned layers and reset). The experts'
  bf16 casts are taken out on both sides (`fp32_experts`) so the check is exact; the bf16
  experts themselves are measured against two eager references by tools/titan_parity.py."""
  spec = "qwen3:debugmodel_moe"
  with tp.fp32_experts():
    ours = tp.check(spec, "scan_train", config=tiny(spec))
  assert ours["losses"] < 1e-5 and ours["weights"] < 1e-4, ours
  biases = {n: e for n, e in ours["_buffers"].items() if n.endswith("expert_bias_E")}
  counts = {n: e for n, e in ours["_buffers"].items() if n.endswith("tokens_per_expert_E")}
  assert len(biases) == len(counts) == 2 and max(biases.values()) < 1e-6 and max(counts.values()) == 0.0, ours["_buffers"]


def test_gpt_oss_in_torchtitans_precision_is_within_the_spread_of_eager_references():
  """gpt-oss whole, as torchtitan trains it: bf16 compute from fp32 weights (FSDP's mixed
  precision), its default varlen attention with sinks and a sliding window shorter than the
  sequence, MoE experts with biases, the load-balancing hook. The reference is torchtitan's
  eager model on CPU on the flex backend (varlen needs FlashAttention). Routing by torchtitan's
  round-robin debug rule, so no routing flip hides a difference: forward and 3 AdamW steps
  (losses, every weight) within 3x the spread of two valid eager references; with learned
  routing, the forward too."""
  spec = "gpt_oss:debugmodel"
  fixed = tiny(spec, round_robin=True)
  spread = tp.check(spec, "spread", config=fixed, steps=3)
  assert tp.check(spec, "forward", config=fixed)["forward"] < 3 * spread["forward"]
  ours = tp.check(spec, "train", config=fixed, steps=3)
  assert ours["losses"] < 3 * spread["losses"] and ours["weights"] < 3 * spread["weights"], (ours, spread)
  learned = tiny(spec)
  spread = tp.check(spec, "spread", config=learned, steps=0)
  assert tp.check(spec, "forward", config=learned)["forward"] < 3 * spread["forward"]


def _export_and_compare_logits(jm, tmp_path, seq, auto="AutoModelForCausalLM") -> dict:
  """Exports `jm`, loads it in transformers (with its `auto` class) and checks its logits
  against ours (fp32, the experts' bf16 casts out on our side: HF's experts run in the
  weights' fp32); returns the tensors written."""
  from safetensors.torch import load_file

  hf = _export_and_load(jm, tmp_path, auto)
  tokens, _, _ = tp.packed_batch(batch=2, seq=seq)
  positions = torch.arange(seq).repeat(2, 1)  # one document per row: HF's causal LM sees the same
  with tp.fp32_experts():
    jm.module.eval()
    ours = tot.to_cpu(jm(**jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})))
  with torch.no_grad():
    assert h.rel(ours, hf(tokens).logits) < 1e-5
  return {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def _export_and_load(jm, tmp_path, auto="AutoModelForCausalLM"):
  import transformers

  from torch_on_tpu import export

  export.export(jm, tmp_path / "hf")
  model = getattr(transformers, auto).from_pretrained(tmp_path / "hf", dtype=torch.float32)
  return model.eval()


@pytest.mark.parametrize("spec", ["qwen3:debugmodel", "qwen3:debugmodel_moe"])
def test_export_through_torchtitans_state_dict_adapter_gives_our_logits(spec, tmp_path):
  """torchtitan's own Qwen3StateDictAdapter names and splits the tensors; transformers loads
  the directory and computes our logits (the MoE with the experts' bf16 casts out on our
  side: HF's experts run in the weights' fp32), and the adapter's from_hf gives back our
  state_dict exactly (read from the files: transformers fuses the experts it loads)."""
  from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

  config = tiny(spec)
  jm = tp.wrap(config, "forward")
  written = _export_and_compare_logits(jm, tmp_path, seq=16)
  back = Qwen3StateDictAdapter(config, None).from_hf(written)
  state = jm.state_dict()
  for name, value in back.items():
    assert torch.equal(value, state[name]), name


def test_gpt_oss_exports_as_hf_gpt_oss_with_our_logits(tmp_path):
  """torchtitan's own gpt-oss adapter would drop the experts (its names predate the model's),
  so gpt-oss is written by our table (`hf_gpt_oss`): transformers loads the directory as GptOss (YaRN RoPE,
  sinks, a sliding window shorter than the sequence, biased experts and router) and computes
  our fp32 logits (the experts' bf16 casts out on our side, `fp32_experts`: HF's experts run
  in the weights' fp32); every weight is written, the experts transposed to HF's layout."""
  import transformers

  # flex attention: fp32 as HF's (varlen casts q, k, v to bf16 for FlashAttention, as torchtitan does)
  config = tp.shrink(tp.registry_config("gpt_oss:debugmodel", attn_backend="flex"), layers=2)
  jm = tp.wrap(config, "forward")
  written = _export_and_compare_logits(jm, tmp_path, seq=tp.SEQ)
  hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
  assert hf_config.layer_types[:2] == ["sliding_attention", "full_attention"] and hf_config.sliding_window == 16
  state = jm.state_dict()
  assert torch.equal(written["model.layers.0.mlp.experts.gate_up_proj"],
                     state["layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"].transpose(-1, -2))
  buffers = {n for n, _ in jm.module.named_buffers()}
  assert len(written) == len([n for n in state if n not in buffers])  # every weight (wq, wk, wv apart), no buffer


def test_an_adapter_that_drops_a_parameter_is_refused(tmp_path, monkeypatch):
  """An adapter out of date with its model (torchtitan 0.3.0's gpt-oss adapter knows its experts
  as `mlp1_weight`, the model names them `mlp1_weight_EGD`) would write an incomplete directory."""
  from torch_on_tpu import export
  from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

  original = Qwen3StateDictAdapter.to_hf
  monkeypatch.setattr(
    Qwen3StateDictAdapter, "to_hf",
    lambda self, sd: {} if any(k.endswith("attention.q_norm.weight") for k in sd) else original(self, sd),
  )
  jm = tp.wrap(tiny("qwen3:debugmodel", layers=1), "forward")
  with pytest.raises(tot.TorchOnTpuError, match=r"no HF name for parameter 'layers.0.attention.q_norm.weight' \(1 dropped"):
    export.export(jm, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()


def test_a_trained_expert_bias_hf_qwen3_moe_cannot_hold_is_refused(tmp_path):
  import jax.numpy as jnp

  jm = tp.wrap(tiny("qwen3:debugmodel_moe", layers=1), "forward")
  jm.buffers["layers.0.moe.expert_bias_E"] = jnp.full(8, 1e-3)
  with pytest.raises(tot.TorchOnTpuError, match="expert_bias_E is nonzero.*export_safetensors"):
    _export_and_load(jm, tmp_path)


def tiny_muse_glimmer(flavor="debugmodel", window=16):
  """Muse Glimmer's debugmodel with 4 layers (windowed with RoPE ×3, then global without: NoPE)
  and windows of `window` tokens."""
  config = tiny(f"muse_glimmer:{flavor}", layers=4, seqlen=64)
  for layer in config.layers:
    if layer.attention.window_size is not None:
      layer.attention.window_size = window
  return config


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_muse_glimmer_exports_as_hf_muse_glimmer_with_our_logits(tmp_path, scan):
  """torchtitan's own MuseGlimmerStateDictAdapter names the tensors (q/k rows to HF's RoPE
  order); transformers loads the directory as MuseGlimmer (sliding windows shorter than the
  sequence, a NoPE global layer, q/k norms and query scale, output gate, centred norms,
  embedding norm, soft-capped logits) and computes our fp32 logits; every weight is written
  and the adapter's from_hf gives it back exactly. Norm gains moved off torchtitan's init (0:
  its init logits are all zero), so every norm's convention shows; the final one's to about 4,
  so logits reach ±13, where the soft cap (20) bends them. Scanned too: the adapter is given
  the names the model was built with, not its stacked ones."""
  import transformers
  from torchtitan.models.muse_glimmer.state_dict_adapter import MuseGlimmerStateDictAdapter

  config = tiny_muse_glimmer()
  with h.eager_torchtitan():
    model = tp.build(config, device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(torch.randn(p.shape, generator=g) * 0.2 + (4.0 if name == "norm.weight" else 0.0))
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8), sharding="fsdp", scan=scan)
  written = _export_and_compare_logits(jm, tmp_path, seq=40, auto="AutoModelForImageTextToText")
  hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
  text = hf_config.text_config
  assert text.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and text.sliding_window == 16
  assert text.layer_rope_theta[2] > 0 and text.layer_rope_theta[3] == 0  # the global layer has no RoPE
  assert min(hf_config.image_token_id, hf_config.video_token_id) >= tp.VOCAB  # HF zeroes those ids: none is a token
  state = jm.state_dict()
  assert len(written) == len(state) == 51  # every weight (4 layers of 12, embedding, final norm, head), no buffer
  back = MuseGlimmerStateDictAdapter(config, None).from_hf(written)
  assert back.keys() == state.keys()
  for name, value in back.items():
    assert torch.equal(value, state[name]), name


def test_muse_glimmer_on_varlen_exports_the_window_its_kernel_is_given():
  """Under varlen attention each layer's window is the kernel's (left, 0) argument, baked in at
  build time; that is the window torchtitan computes with and the one HF is given."""
  config = tp.shrink(tp.registry_config("muse_glimmer:debugmodel", attn_backend="varlen"), layers=4)  # varlen windows: 16
  assert {layer.attention.window_size for layer in config.layers} == {128, None}
  with torch.device("meta"):
    model = config.build()
  text = models.family_of(model).hf_form(model).config.text_config
  assert text.sliding_window == 16 and text.layer_types == ["sliding_attention"] * 3 + ["full_attention"]


def _tied(config):
  config.enable_weight_tying = True


def _two_windows(config):
  config.layers[0].attention.window_size = 8


def _rope_scaled(config):
  for layer in config.layers:
    layer.attention.rope.scaling = "llama"


def _sdpa(config):
  from torchtitan.models.common.attention import ScaledDotProductAttention

  for layer in config.layers:
    layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _not_capped(config):
  config.lm_head.output_soft_cap_temp = None


def _plain_layer_norm(config):
  for layer in config.layers:
    layer.ffn_norm.gain_center = 0.0


def _another_post_eps(config):
  config.layers[1].post_ffn_norm.eps = 1e-6


def _no_output_gate(config):
  for layer in config.layers:
    layer.attention.o_gate = None


def _uneven_query_scale(config):
  config.layers[1].attention.scale_query_by *= 2


MUSE_REFUSALS = {  # id: (flavor, change to its config, the refusal's reason)
  "vision": ("debugmodel_mm", None, "it has a vision tower"),
  "tied": ("debugmodel", _tied, "tied to its embedding"),
  "windows": ("debugmodel", _two_windows, "sliding windows of 2 sizes"),
  "rope": ("debugmodel", _rope_scaled, "scaling 'llama'"),
  "sdpa": ("debugmodel", _sdpa, "run ScaledDotProductAttention, which attends past their windows"),
  "softcap": ("debugmodel", _not_capped, "not soft-capped"),
  "norms": ("debugmodel", _plain_layer_norm, r"norms are not HF's \(1 \+ weight"),
  "eps": ("debugmodel", _another_post_eps, "epsilons"),
  "gate": ("debugmodel", _no_output_gate, "no output gate"),
  "layers": ("debugmodel", _uneven_query_scale, "differ in shape or query scale"),
}


@pytest.mark.parametrize("flavor,edit,problem", MUSE_REFUSALS.values(), ids=MUSE_REFUSALS.keys())
def test_a_muse_glimmer_hf_computes_differently_is_refused(flavor, edit, problem):
  config = tiny_muse_glimmer(flavor)
  if edit is not None:
    edit(config)
  with torch.device("meta"):
    model = config.build()
  with pytest.raises(tot.TorchOnTpuError, match=f"cannot be written as HF MuseGlimmer: .*{problem}.*; export_safetensors"):
    models.family_of(model).hf_form(model)
