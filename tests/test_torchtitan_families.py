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
from torch_on_tpu import models
from torch_on_tpu.training import metrics

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

tp = h.titan_parity()


def tiny(spec, layers=2, registry=None, **kw):
  return tp.shrink(tp.registry_config(spec, **(registry or {})), layers=layers, **kw)


# (family, layers kept, also scanned, registry arguments): dense with qk-norm; MLA + MoE (dense first
# layer) with a multi-token-prediction layer (every output compared: the main logits and the depth's;
# scanned, the main layers scan and the MTP layer runs after); Qwen3.5's hybrid of Gated DeltaNet and
# gated full attention; Kimi (DeepSeek-V3's decoder in a multimodal model, text only, no MTP).
FORWARD = [("qwen3:debugmodel", 2, False, None), ("deepseek_v3:debugmodel", 3, True, {"num_mtp_layers": 1}),
           ("qwen3_5:debugmodel", 4, False, None), ("kimi_k2_7:debugmodel", 2, False, None)]


@pytest.mark.parametrize("spec,layers,scanned,registry", FORWARD, ids=[f[0].split(":")[0] for f in FORWARD])
def test_a_family_forward_matches_eager_torch(spec, layers, scanned, registry):
  config = tiny(spec, layers=layers, registry=registry)
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


def test_qwen3_5s_linear_attention_returns_its_inputs_dtype_as_flash_linear_attention_does():
  """fla's kernel returns `o.to(q.dtype)`: a bf16 layer stays bf16 (an fp32 output made the rest
  of the layer fp32, and a scanned stack's carry change dtype)."""
  import jax.numpy as jnp

  from torch_on_tpu.models.torchtitan import linear_attention

  q = k = jnp.ones((1, 6, 2, 4), jnp.bfloat16)
  v = jnp.ones((1, 6, 2, 3), jnp.bfloat16)
  g, beta = jnp.full((1, 6, 2), -0.1, jnp.float32), jnp.full((1, 6, 2), 0.5, jnp.bfloat16)
  assert linear_attention._gated_delta_rule(q, k, v, g, beta).dtype == jnp.bfloat16



def test_qwen3_5s_gated_delta_rule_scans_the_rows_side_by_side_each_as_if_alone():
  """torchtitan folds the batch into one varlen sequence of B·L tokens; every row starts a
  document, so the recurrence runs L steps with the rows side by side (B·L steps one row after
  another kept every data shard waiting on all the others' rows), and each row's output is what
  the row gives alone, documents restarting the state inside it."""
  import jax
  import jax.numpy as jnp

  from torch_on_tpu.models.torchtitan import linear_attention

  rows, length, heads = 3, 8, 2
  keys = jax.random.split(jax.random.key(0), 5)
  q, k = (jax.random.normal(key, (1, rows * length, heads, 4)) for key in keys[:2])
  v = jax.random.normal(keys[2], (1, rows * length, heads, 3))
  g, beta = -jax.random.uniform(keys[3], (1, rows * length, heads)), jax.random.uniform(keys[4], (1, rows * length, heads))
  documents = jnp.asarray([[0] * 8, [0] * 3 + [1] * 5, [4] * 6 + [5] * 2], jnp.int32)
  jaxpr = jax.make_jaxpr(linear_attention._gated_delta_rule)(q, k, v, g, beta, documents).jaxpr
  assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [length]
  together = linear_attention._gated_delta_rule(q, k, v, g, beta, documents)
  for r in range(rows):
    part = slice(r * length, (r + 1) * length)
    alone = linear_attention._gated_delta_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], documents[r:r + 1])
    assert jnp.array_equal(together[:, part], alone), r
  # a document boundary restarts the state: row 1's second document is what it gives as a row of its own
  second = slice(length + 3, 2 * length)
  restarted = linear_attention._gated_delta_rule(q[:, second], k[:, second], v[:, second], g[:, second], beta[:, second])
  assert jnp.array_equal(together[:, second], restarted)

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


def test_multi_token_prediction_trains_with_torchtitans_mtp_loss():
  """DeepSeek-V3 with one MTP layer (torchtitan's `deepseek_v3_debugmodel_mtp`), 3 AdamW steps,
  fsdp=8, against torchtitan's eager model trained with its own `MTPLoss` (labels rolled by the
  depth within each packed document, scale 0.3): losses, every weight (the MTP layer's too) and
  buffers (the MTP layer's MoE counts grow unbalanced, as torchtitan's hook leaves them). Experts
  in fp32 on both sides, as in the MoE test above, so the check is exact."""
  spec = "deepseek_v3:debugmodel"
  with tp.fp32_experts():
    ours = tp.check(spec, "train", config=tiny(spec, registry={"num_mtp_layers": 1}), steps=3)
  assert ours["losses"] < 1e-5 and ours["weights"] < 1e-4 and ours["buffers"] < 1e-6, ours
  assert any(n.startswith("mtp_layers.0.moe.") for n in ours["_weights"])


def test_multi_token_prediction_layers_count_in_the_shape_and_flops():
  """An MTP layer is one more block per token (its routed experts counted active as top-k of
  them) and its depth one more lm_head matmul."""
  spec = "deepseek_v3:debugmodel"
  with torch.device("meta"):
    plain, mtp = tiny(spec).build(), tiny(spec, registry={"num_mtp_layers": 1}).build()
  shapes = [models.family_of(m).decoder_shape(m) for m in (plain, mtp)]
  assert (shapes[1].layers, shapes[1].predictions) == (shapes[0].layers + 1, 2)
  layer = mtp.mtp_layers[0]
  experts = sum(p.numel() for p in layer.moe.routed_experts.inner_experts.parameters())
  added = sum(p.numel() for p in layer.parameters()) - experts * (8 - 2) // 8 + tp.VOCAB * mtp.norm.weight.numel()
  flops = [metrics.flops_per_token(m, seqlen=tp.SEQ) for m in (plain, mtp)]
  assert flops[1].n_matmul_params - flops[0].n_matmul_params == added
  attention = lambda f: f.torchtitan - 6 * f.n_matmul_params  # noqa: E731
  assert attention(flops[1]) == attention(flops[0]) * (shapes[0].layers + 1) / shapes[0].layers


def test_gpt_oss_in_torchtitans_precision_is_within_the_spread_of_eager_references():
  """gpt-oss whole, as torchtitan trains it: bf16 compute from fp32 weights (FSDP's mixed
  precision), its default varlen attention with sinks and a sliding window shorter than the
  sequence, MoE experts with biases, the load-balancing hook. The reference is torchtitan's
  eager model on CPU on the flex backend (varlen needs FlashAttention; the run against varlen on
  a GPU is tools/titan_gpu_reference.py's, in docs/torchtitan.md). Routing by torchtitan's
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


def _export_and_compare_logits(jm, tmp_path, seq, tolerance=1e-5, auto="AutoModelForCausalLM") -> dict:
  """Exports `jm`, loads it in transformers (with its `auto` class) and checks its logits
  against ours (fp32, the experts' bf16 casts out on our side: HF's experts run in the
  weights' fp32) within `tolerance`; returns the tensors written."""
  from safetensors.torch import load_file

  hf = _export_and_load(jm, tmp_path, auto)
  tokens, _, _ = tp.packed_batch(batch=2, seq=seq)
  positions = torch.arange(seq).repeat(2, 1)  # one document per row: HF's causal LM sees the same
  with tp.fp32_experts():
    jm.module.eval()
    ours = tot.to_cpu(jm(**jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})))
  with torch.no_grad():
    assert h.rel(ours, hf(tokens).logits) < tolerance
  return {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def _export_and_load(jm, tmp_path, auto="AutoModelForCausalLM"):
  import transformers

  from torch_on_tpu.io import export

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


@pytest.mark.parametrize("spec", ["qwen3_5:debugmodel", "qwen3_5:debugmodel_moe"])
def test_qwen3_5_exports_as_hf_qwen3_5_with_our_logits_and_generates_our_tokens(spec, tmp_path):
  """torchtitan's Qwen3.5 adapter fuses a layer's q/k/v and conv entries into one HF tensor
  (the export hands it those entries together) and writes fused experts in a layout
  transformers does not read (they are written per expert, as Qwen3.5-MoE checkpoints are).
  transformers computes our logits, generates our greedy tokens where the project is installed
  (no flash-linear-attention, whose kernels transformers would call on CPU), loads the whole
  multimodal model with no key missing or left over, and every parameter comes back from the files."""
  import transformers
  from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

  config = tiny(spec, layers=4)  # three Gated DeltaNet layers, then full attention
  jm = tp.wrap(config, "forward")
  written = _export_and_compare_logits(jm, tmp_path, seq=tp.SEQ)
  text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  prompt = tp.packed_batch(batch=2, seq=6)[0]
  with tp.fp32_experts():
    ours = tot.generate(jm, prompt, max_new_tokens=4)
  assert torch.equal(text.generate(prompt, max_new_tokens=4, do_sample=False), ours)
  _, info = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", output_loading_info=True)
  assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
  back = Qwen35StateDictAdapter(config, None).from_hf(written)
  buffers = {n for n, _ in jm.module.named_buffers()}
  for name, value in jm.state_dict().items():
    if ".inner_experts.w" in name:
      layer, w = name.split(".")[1], name.split(".")[-1][:2]
      proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[w]
      back[name] = torch.stack([written[f"model.language_model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(len(value))])
    if name not in buffers:
      assert torch.equal(back[name], value), name


def test_qwen3_5s_vision_encoder_is_written_in_hf_layout(tmp_path):
  """The vision tower is written too (the bridge runs the text path; its weights are those
  loaded): transformers' Qwen3.5 vision model computes torchtitan's eager one from the files,
  once torchtitan's patch merger uses HF's exact GELU (torchtitan's config has tanh's
  approximation there, which no HF config can express: docs/checkpoints.md)."""
  import transformers

  from torch_on_tpu.io import export

  config = tiny("qwen3_5:debugmodel", layers=4)
  jm = tp.wrap(config, "forward")
  export.export(jm, tmp_path / "hf")
  hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  eager = tp.build(config, device="cpu")
  eager.load_state_dict(jm.state_dict())
  eager.vision_encoder.merger.act_fn = torch.nn.GELU()
  grid = torch.tensor([[1, 4, 4]])  # one image of 4 × 4 patches
  pixels = torch.randn(1, 16, config.vision_encoder.patch_embed_proj.in_features, generator=torch.Generator().manual_seed(0))
  with torch.no_grad(), tp.eager_flex():
    ours = eager.vision_encoder(pixels, grid_thw=grid)[0]
    assert h.rel(ours, hf.model.visual(pixels[0], grid_thw=grid).pooler_output) < 1e-5


def test_a_qwen3_5_hf_cannot_express_is_refused():
  import dataclasses

  config = tiny("qwen3_5:debugmodel_moe", layers=4)
  for layer in config.layers:
    layer.moe.router = dataclasses.replace(layer.moe.router, route_norm=False)
  module = tp.build(config)
  with pytest.raises(tot.TorchOnTpuError, match="cannot be written as HF Qwen3.5: its MoE router or shared expert differs"):
    models.family_of(module).hf_form(module)


def test_an_adapter_that_drops_a_parameter_is_refused(tmp_path, monkeypatch):
  """An adapter out of date with its model (torchtitan 0.3.0's gpt-oss adapter knows its experts
  as `mlp1_weight`, the model names them `mlp1_weight_EGD`) would write an incomplete directory."""
  from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

  from torch_on_tpu.io import export

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


def _deepseek(spec="deepseek_v3:debugmodel", **registry):
  """The family's debugmodel, small (a dense layer, then two MoE layers); Kimi's without its vision encoder."""
  config = tp.shrink(tp.registry_config(spec, **registry), layers=3)
  if spec.startswith("kimi_k2_7"):
    config.vision_encoder = None
  return config


def _check_deepseek_export(jm, tmp_path, adapter, *, bias_written, auto="AutoModelForCausalLM", fused=0):
  """Exports `jm`: transformers (its `auto` class) computes our logits at 1e-6 (what is left when
  HF's latent norms run at their own eps is 7e-6: 1e-5 would not see it), loads every tensor
  written and misses none, the experts written one per expert (`fused`: entries written fused
  into others); torchtitan's adapter's from_hf gives back our state_dict: exactly, but for the
  latent-norm inputs (`wkv_a`'s latent rows, `wq_a`), scaled by sqrt(1e-6 / 1e-5) for HF's eps
  and back to fp32 rounding."""
  import transformers

  written = _export_and_compare_logits(jm, tmp_path, seq=tp.SEQ, tolerance=1e-6, auto=auto)
  _, info = getattr(transformers, auto).from_pretrained(tmp_path / "hf", output_loading_info=True)
  assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
  state = jm.state_dict()
  params = len(list(jm.module.named_parameters()))
  moe_layers = sum(layer.moe is not None for layer in jm.module.config.layers)
  assert len(written) == params - fused + moe_layers * 3 * (8 - 1) + (moe_layers if bias_written else 0)
  back = adapter.from_hf(written)
  assert len(back) == len(written) + fused - moe_layers * 3 * (8 - 1)
  for name, value in back.items():
    if ".wkv_a." in name or ".wq_a." in name:
      rows = slice(0, 512) if ".wkv_a." in name else slice(None)
      value = value.clone()
      value[rows] = value[rows] / 0.1**0.5
      assert h.rel(value, state[name]) < 1e-6 and torch.equal(value[512:], state[name][512:]), name
    else:
      assert torch.equal(value, state[name]), name


@pytest.mark.parametrize("spec", ["deepseek_v3:debugmodel", "kimi_k2_7:debugmodel"])
def test_softmax_routed_deepseek_exports_as_hf_deepseek_v2_with_our_logits(spec, tmp_path):
  """DeepSeek-V3's debugmodel (and 16B) routes by softmax over all experts, unnormalised: HF's
  DeepSeek-V2 (MLA, interleaved RoPE, YaRN with mscale 0.7 in the softmax scale, a dense first
  layer, shared experts); named by torchtitan's own adapter. Kimi's text model is the same decoder."""
  import importlib

  import transformers

  config = _deepseek(spec)
  jm = tp.wrap(config, "forward")
  family = spec.split(":")[0]
  adapters = importlib.import_module(f"torchtitan.models.{family}.state_dict_adapter")
  adapter = {"deepseek_v3": "DeepSeekV3StateDictAdapter", "kimi_k2_7": "KimiK25StateDictAdapter"}[family]
  _check_deepseek_export(jm, tmp_path, getattr(adapters, adapter)(config, None), bias_written=False)
  hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
  assert hf_config.model_type == "deepseek_v2" and hf_config.first_k_dense_replace == 1
  assert hf_config.rope_parameters["rope_type"] == "yarn" and hf_config.rope_parameters["mscale_all_dim"] == 0.7


def test_sigmoid_routed_deepseek_exports_as_hf_deepseek_v3_with_its_expert_bias(tmp_path):
  """DeepSeek-V3 671B's routing, small: sigmoid scores, group-limited (4 groups of 2, 2 kept),
  the top-k normalised and scaled by 2.5, a trained load-balancing bias choosing the experts
  (HF's e_score_correction_bias: zeroed there, the logits move), and q through its LoRA (wq_a,
  q_norm, wq_b): HF's DeepSeek-V3."""
  import dataclasses

  import jax.numpy as jnp
  import transformers
  from torchtitan.models.common import Linear, RMSNorm
  from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

  config = _deepseek()
  for layer in config.layers:
    a, rank = layer.attention, 64
    a.q_lora_rank, a.q_norm = rank, RMSNorm.Config(normalized_shape=rank)
    a.wq_a, a.wq_b, a.wq = Linear.Config(in_features=a.dim, out_features=rank), dataclasses.replace(a.wq, in_features=rank), None
    if layer.moe is not None:
      r = layer.moe.router
      r.score_func, r.route_norm, r.route_scale, r.num_expert_groups, r.num_limited_groups = "sigmoid", True, 2.5, 4, 2
  jm = tp.wrap(config, "forward")
  for i in (1, 2):
    jm.buffers[f"layers.{i}.moe.expert_bias_E"] = jnp.linspace(-0.05, 0.05, 8) * i
  _check_deepseek_export(jm, tmp_path, DeepSeekV3StateDictAdapter(config, None), bias_written=True)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  assert hf.config.model_type == "deepseek_v3" and (hf.config.n_group, hf.config.topk_group) == (4, 2)
  tokens, _, _ = tp.packed_batch(batch=2, seq=tp.SEQ)
  with torch.no_grad():
    logits = hf(tokens).logits
    for i in (1, 2):
      hf.model.layers[i].mlp.gate.e_score_correction_bias.zero_()
    assert h.rel(hf(tokens).logits, logits) > 1e-3  # the bias chose experts


def test_kimi_exports_as_hf_kimi_k25_with_its_vision_encoder(tmp_path):
  """Kimi's debugmodel with its MoonViT vision encoder: HF's Kimi-K2.5 (its DeepSeek-V2 text model
  as above), named by torchtitan's own KimiK25StateDictAdapter (each vision layer's q/k/v fused
  into one `wqkv`, which transformers splits and permutes to its RoPE layout on load). transformers
  computes our text logits (its placeholder id is one past the vocabulary: no text token is
  re-embedded), and its vision tower and projector compute torchtitan's eager ones from the files
  on two images in one batch (one of the position table's own size, one resampled) and on a clip
  of 4 frames, fp32, at 1e-5; and so does a whole run with an image."""
  import transformers
  from torchtitan.models.kimi_k2_7.state_dict_adapter import KimiK25StateDictAdapter

  config = tp.shrink(tp.registry_config("kimi_k2_7:debugmodel"), layers=3)
  config.vision_encoder.init_pos_emb_height = config.vision_encoder.init_pos_emb_width = 4  # a 4 × 4 table
  jm = tp.wrap(config, "forward")
  vision_layers = config.vision_encoder.num_layers
  _check_deepseek_export(jm, tmp_path, KimiK25StateDictAdapter(config, None), bias_written=False,
                         auto="AutoModelForImageTextToText", fused=vision_layers * 2 * 2)  # wk, wv into wq; weight and bias
  hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  assert hf.config.model_type == "kimi_k25" and hf.config.image_token_id == hf.config.video_token_id == config.vocab_size
  eager = tp.build(config, device="cpu")
  eager.load_state_dict(jm.state_dict())
  patch = 3 * config.vision_encoder.patch_size**2
  generator = torch.Generator().manual_seed(0)
  for grids in ([[1, 4, 4], [1, 2, 6]], [[4, 2, 2]]):  # the table's own size and resampled, in one batch; a clip
    items = [torch.randn(t * rows * cols, patch, generator=generator) for t, rows, cols in grids]
    padded = torch.nn.utils.rnn.pad_sequence(items, batch_first=True)  # torchtitan's (items, patches, patch)
    merged = [rows // 2 * (cols // 2) for _, rows, cols in grids]
    grid = torch.tensor(grids)
    with torch.no_grad(), tp.eager_flex():
      ours = torch.cat([out[:n] for out, n in zip(eager.vision_encoder(padded, grid_thw=grid), merged)])
      tower = hf.model.vision_tower(torch.cat(items).view(-1, 3, *[config.vision_encoder.patch_size] * 2), grid_thw=grid)
      assert h.rel(ours, hf.model.mm_projector(tower.pooler_output).squeeze(1)) < 1e-5, grids
  # A whole image run: its placeholder an id in the vocabulary (as `<|media_pad|>` is), set in HF's config
  tokens = torch.randint(8, config.vocab_size, (1, 32), generator=generator)
  tokens[0, 5:9] = placeholder = 7  # 4 × 4 patches merge into 4 tokens
  pixels, grid, positions = torch.randn(16, patch, generator=generator), torch.tensor([[1, 4, 4]]), torch.arange(32)[None]
  hf.config.image_token_id = hf.model.config.image_token_id = placeholder
  with torch.no_grad(), tp.fp32_experts(), jm.family.running(eager), tp.eager_flex():
    ours = eager(tokens, pixel_values=pixels[None], grid_thw=grid, special_tokens={"image_id": placeholder, "video_id": placeholder},
                 attention_masks=eager.get_attention_masks(positions), positions=positions)
    theirs = hf(input_ids=tokens, pixel_values=pixels.view(16, 3, *[config.vision_encoder.patch_size] * 2), image_grid_thw=grid).logits
  assert h.rel(ours, theirs) < 1e-5


def _softmax_groups(config):
  for layer in config.layers[1:]:
    layer.moe.router.num_expert_groups, layer.moe.router.num_limited_groups = 4, 2
  return config


def _exact_vision_gelu(config):
  from torchtitan.models.common.nn_modules import GELU

  config.vision_encoder.block.mlp.act_fn = GELU.Config()
  return config


@pytest.mark.parametrize("make,refusal", [
  (lambda: _softmax_groups(_deepseek()), "DeepSeek: it routes by softmax with group-limited routing"),  # DeepSeek-V3 236B's
  # Kimi's text model is refused as above with its vision encoder too; the encoder for what HF's MoonViT cannot express
  (lambda: _softmax_groups(tiny("kimi_k2_7:debugmodel", layers=3)), "DeepSeek: it routes by softmax with group-limited"),
  (lambda: _exact_vision_gelu(tiny("kimi_k2_7:debugmodel", layers=3)), "Kimi-K2.5: its vision GELUs are not HF's"),
], ids=["softmax_groups", "kimi_vision_softmax_groups", "kimi_vision_exact_gelu"])
def test_a_deepseek_hf_cannot_express_is_refused(make, refusal, tmp_path):
  from torch_on_tpu.io import export

  with torch.device("meta"):
    model = make().build()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8), sharding="fsdp", abstract=True)
  with pytest.raises(tot.TorchOnTpuError, match=f"cannot be written as HF {refusal}.*export_safetensors"):
    export.export(jm, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()


def test_deepseek_with_multi_token_prediction_exports_its_main_model(tmp_path):
  """HF's DeepSeek has no multi-token-prediction layers and its logits never read them: the export
  leaves them out, transformers loads every tensor written and misses none, and its logits are the
  main model's (what a run with --mtp_layers=1 prints as its export command must work)."""
  import transformers

  jm = tp.wrap(_deepseek(num_mtp_layers=1), "forward")
  assert any(name.startswith("mtp_layers.") for name in jm.state_dict())
  hf = _export_and_load(jm, tmp_path)
  _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
  assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
  tokens, _, _ = tp.packed_batch(batch=2, seq=tp.SEQ)
  positions = torch.arange(tp.SEQ).repeat(2, 1)
  with tp.fp32_experts():
    jm.module.eval()
    ours = tot.to_cpu(jm(**jm.family.model_inputs(jm.module, {"input_ids": tokens, "positions": positions})))
  main = ours[0] if isinstance(ours, (list, tuple)) else ours
  with torch.no_grad():
    assert h.rel(main, hf(tokens).logits) < 1e-6


def test_a_trained_expert_bias_hf_deepseek_v2_cannot_hold_is_refused(tmp_path):
  import jax.numpy as jnp

  jm = tp.wrap(_deepseek(), "forward")
  jm.buffers["layers.2.moe.expert_bias_E"] = jnp.full(8, 1e-3)
  with pytest.raises(tot.TorchOnTpuError, match="layers.2.moe.expert_bias_E is nonzero.*DeepSeek-V2.*export_safetensors"):
    _export_and_load(jm, tmp_path)
  assert not (tmp_path / "hf").exists()


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
  and the adapter's from_hf gives it back exactly (`_check_muse_glimmer_export`; norm gains off
  torchtitan's init: `_muse_glimmer_model`). Scanned too: the adapter is given the names the
  model was built with, not its stacked ones."""
  config = tiny_muse_glimmer()
  jm = tot.ShardedModule(_muse_glimmer_model(config), mesh=tot.make_mesh(fsdp=8), sharding="fsdp", scan=scan)
  _check_muse_glimmer_export(jm, tmp_path, weights=51)  # 4 layers of 12, embedding, final norm, head


def _muse_glimmer_model(config):
  """torchtitan's Muse Glimmer on the CPU, its init, then its norm gains and vision biases moved off
  it (torchtitan's init zeroes them: its init logits are all zero), so every norm's convention
  shows; the final norm's to about 4, so logits reach ±13, where the soft cap (20) bends them."""
  with h.eager_torchtitan():
    model = tp.build(config, device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or ".ln_" in name or name.endswith(".bias"):
        p.add_(torch.randn(p.shape, generator=g) * 0.2 + (4.0 if name == "norm.weight" else 0.0))
  return model


def _check_muse_glimmer_export(jm, tmp_path, *, weights):
  """Exports `jm`: transformers loads every tensor written as MuseGlimmer and misses none of its
  model's (`weights` of them; a text flavor's HF tower is left unwritten), computes our fp32 text
  logits past the windows, and torchtitan's adapter's from_hf gives our state_dict back exactly.
  The image and video ids are none of the text's, so HF's replacing them touches no token."""
  import transformers
  from torchtitan.models.muse_glimmer.state_dict_adapter import MuseGlimmerStateDictAdapter

  written = _export_and_compare_logits(jm, tmp_path, seq=40, auto="AutoModelForImageTextToText")
  hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
  text = hf_config.text_config
  assert text.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and text.sliding_window == 16
  assert text.layer_rope_theta[2] > 0 and text.layer_rope_theta[3] == 0  # the global layer has no RoPE
  assert min(hf_config.image_token_id, hf_config.video_token_id) >= tp.VOCAB  # HF zeroes those ids: none is a token
  state = jm.state_dict()
  assert len(written) == len(state) == weights  # every weight, no buffer
  back = MuseGlimmerStateDictAdapter(jm.module.config, None).from_hf(written)
  assert back.keys() == state.keys()
  for name, value in back.items():
    assert torch.equal(value, state[name]), name
  return written


def test_muse_glimmer_vision_flavor_exports_its_vision_tower_adapter_and_projection(tmp_path):
  """debugmodel_mm (a 3-layer vision tower: windows of 2 x 2 patches, then global attention;
  axial RoPE; a learned 2 x 2 position table resampled; 2 x 2 pixel shuffle; a GELU adapter;
  the projection and its scaleless norm) exports whole: transformers loads it with no key
  missing, left over or mismatched, computes our text logits, and from the files computes what
  torchtitan's eager vision path does: its image features (tower, adapter, projection, norm; two
  images of different sizes in one call too) and a whole forward with an image, HF given its pixels in its own (temporal, channel) patch order
  and its image id where torchtitan's caller put its own. On a non-square patch grid torchtitan
  samples its position table for the transposed grid (docs/torchtitan.md): there the features
  differ, and torchtitan's table sampled in raster order gives HF's."""
  import torch.nn.functional as F
  import transformers
  from torchtitan.models.muse_glimmer import vision_encoder

  config = tiny_muse_glimmer("debugmodel_mm")
  eager = _muse_glimmer_model(config)
  jm = tot.ShardedModule(eager, mesh=tot.make_mesh(fsdp=8), sharding="fsdp")
  _check_muse_glimmer_export(jm, tmp_path, weights=51 + 3 * 16 + 9)  # a tower of 3 layers, 9 more vision weights
  eager = tp.build(config, device="cpu")
  eager.load_state_dict(jm.state_dict())
  hf, info = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
  assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
  enc = config.vision_encoder

  def features(*grids):
    """Images of these patch grids: torchtitan's padded batch, HF's packed patches."""
    pixels = torch.randn(len(grids), max(a * b for a, b in grids), enc.conv1.in_features, generator=torch.Generator().manual_seed(0))
    packed = torch.cat([image[: a * b] for image, (a, b) in zip(pixels, grids)])
    hf_pixels = vision_encoder.reorder_patch_vector(packed, patch_size=enc.patch_size, patch_temporal=enc.patch_temporal)
    grid_thw = torch.tensor([[1, a, b] for a, b in grids])
    ours = eager.perception_emb_norm(eager.vision_projection(eager.vision_adapter(eager.vision_encoder(pixels, grid_thw=grid_thw))))
    return pixels, grid_thw, ours, torch.cat(hf.model.get_image_features(hf_pixels, grid_thw).pooler_output), hf_pixels

  def raster_table(table, *, grid_h, grid_w, src_grid_h, src_grid_w, latent_dim, device):
    source = table.view(src_grid_h, src_grid_w, latent_dim).permute(2, 0, 1)[None]
    y, x = torch.meshgrid(*(torch.linspace(-1 + 1 / n, 1 - 1 / n, n) for n in (grid_h, grid_w)), indexing="ij")
    return F.grid_sample(source, torch.stack([x, y], -1).reshape(1, 1, -1, 2), align_corners=False)[0, :, 0].T

  with torch.no_grad(), tp.eager_flex():
    assert h.rel(*features((4, 4), (2, 2))[2:4]) < 1e-5  # two images, one padded in torchtitan's batch
    pixels, grid_thw, ours, theirs, hf_pixels = features((4, 4))  # 4 windows, 4 tokens out
    assert h.rel(ours, theirs) < 1e-5
    assert h.rel(*features((4, 6))[2:4]) > 1e-3
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(vision_encoder, "_vision_pos_embed", raster_table)
      assert h.rel(*features((4, 6))[2:4]) < 1e-5
    tokens, _, _ = tp.packed_batch(batch=1, seq=40)
    tokens[tokens == 7] = 8
    tokens[0, 10:14] = 7  # torchtitan's caller's image id: the image's 4 tokens
    positions = torch.arange(40)[None]
    with h.eager_torchtitan():
      ours = eager(tokens, positions, eager.get_attention_masks(positions), pixel_values=pixels, grid_thw=grid_thw,
                   special_tokens={"image_id": 7, "video_id": -1})
    hf_tokens = torch.where(tokens == 7, hf.config.image_token_id, tokens)
    assert h.rel(ours, hf(input_ids=hf_tokens, pixel_values=hf_pixels, image_grid_thw=grid_thw).logits) < 1e-5


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


def _oblong_vision_grid(config):
  config.vision_encoder.pos_emb_grid_w = 4


def _vision_sdpa(config):
  from torchtitan.models.common.attention import ScaledDotProductAttention

  config.vision_encoder.block.attn.inner_attention = ScaledDotProductAttention.Config()


MUSE_REFUSALS = {  # id: (flavor, change to its config, the refusal's reason)
  "vision_grid": ("debugmodel_mm", _oblong_vision_grid, "vision position grid .* is 2x4 patches, HF's is square"),
  "vision_attention": ("debugmodel_mm", _vision_sdpa, "vision attention runs ScaledDotProductAttention"),
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


def test_routed_experts_dispatch_each_data_shards_own_tokens(monkeypatch):
  """torchtitan's MoE sorts its tokens by expert to dispatch them. Traced as one program over a
  batch-sharded mesh, the partitioner replicated that sort and everything after it (DeepSeek-V3
  671B on v5p-1024: 26.4 TiB of temporaries per chip); run per data shard, as torchtitan's
  `local_map` runs it per rank, the same step moves a fraction of the bytes and holds less. (The
  numbers are the same: `test_moe_trains_scanned_with_torchtitans_load_balancing` trains
  through it; expert parallelism's program is measured on the TPU compiler in
  tests/test_tpu_compile.py.)"""
  import contextlib

  import jax
  import jax.numpy as jnp
  import optax

  from torch_on_tpu.models.torchtitan import moe
  from torch_on_tpu.training.trainer import default_split

  def compiled():
    with torch.device("meta"):
      model = tiny("qwen3:debugmodel_moe").build()
    jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=8), abstract=True, scan=True)
    batch = {k: jax.ShapeDtypeStruct((64, 256), jnp.int32) for k in ("input_ids", "labels", "positions", "segment_ids")}
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())  # noqa: E731
    return tot.make_train_step(jm, loss, optax.adamw(1e-3), compute_dtype=jnp.bfloat16).compile(*default_split(jm, batch))

  per_shard = compiled()
  monkeypatch.setattr(moe, "experts_where_they_live", lambda mesh, axes: contextlib.nullcontext())
  one_program = compiled()
  assert per_shard.collective_bytes.total * 4 < one_program.collective_bytes.total, (per_shard, one_program)
  assert per_shard.temp_bytes < one_program.temp_bytes


def test_qwen3_with_q_k_and_v_projected_apart_exports_with_our_logits(tmp_path):
  """`qwen3_debugmodel_non_fused_qkv` (its QKVLinear holds wq and wkv, its heads on the attention,
  not on a fused projection) is written as HF Qwen3: transformers computes our logits. The
  vocabulary is kept: this flavor's wq has as many rows as the debug vocabulary (2048)."""
  config = tiny("qwen3:debugmodel_non_fused_qkv", vocab=2048)
  _export_and_compare_logits(tp.wrap(config, "forward"), tmp_path, seq=16)
