"""`TorchtitanFamily`: every model torchtitan's registries build (and models of one's own built from
its modules), answered by rules read from torchtitan's own code (docs/torchtitan.md)."""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch

from torch_on_tpu.models.family import DecoderShape, Family
from torch_on_tpu.models.torchtitan import export, linear_attention, moe, qkv, rope
from torch_on_tpu.models.torchtitan.attention import flex_routed_to, varlen_routed_to
from torch_on_tpu.models.torchtitan.configs import is_torchtitan
from torch_on_tpu.models.torchtitan.export import adapter as export_adapter
from torch_on_tpu.models.torchtitan.masks import attention_masks, document_ids, guard_keyed_masks, uses_masked_attention, with_documents
from torch_on_tpu.models.torchtitan.mtp import mtp_depths
from torch_on_tpu.models.torchtitan.plans import fsdp_dims, fsdp_tp_map, parallel_plan


class TorchtitanFamily(Family):
  """torchtitan's decoders (Llama 3 and those built like it)."""

  name = "torchtitan"

  def claims(self, module):
    # The model, or a peft wrapper around one (LoRA: `training.lora.wrap`), whose attributes reach the model's.
    inner = getattr(getattr(module, "base_model", None), "model", None)  # peft's PeftModel → LoraModel → model
    return is_torchtitan(module) or (inner is not None and is_torchtitan(inner))

  def init_fn(self, module):
    if callable(getattr(module, "init_states", None)):
      return lambda m: m.init_states(buffer_device=torch.device("jax"))
    return None

  def decoder_shape(self, module):
    """Read from the module's structure, for every torchtitan decoder: its attention
    modules (those holding an `inner_attention`; MLA's scores and values counted at
    their own head dims), the widest per-token FFN (a MoE layer's `top_k` routed experts
    plus its shared ones) and the routed-expert parameters a token does not touch. A
    multi-token-prediction layer counts as a layer (its block runs per token like the others)
    and each depth applies the lm_head once more (`predictions`)."""
    layers = getattr(module, "layers", None)
    if layers is None or not len(layers) or not hasattr(module, "tok_embeddings"):
      return None
    blocks = list(layers.values() if hasattr(layers, "values") else layers)
    blocks += list(module.mtp_layers) if mtp_depths(module) else []
    attentions = [m for b in blocks for m in b.modules() if hasattr(m, "inner_attention") and hasattr(m, "n_heads")]
    if not attentions:
      return None
    attention = attentions[0]
    if hasattr(attention, "qk_head_dim"):  # MLA: q·k over qk_head_dim, p·v over v_head_dim, per head
      head_dim, kv_heads = (attention.qk_head_dim + attention.v_head_dim) // 2, attention.n_heads
    else:
      head_dim, kv_heads = attention.head_dim, attention.n_kv_heads or attention.n_heads
    moes = [m for b in blocks for m in b.modules() if moe.is_moe(m)]
    # the token table itself, also where it is wrapped (Muse Glimmer's EmbeddingWithNorm)
    embedding = next(m for m in module.tok_embeddings.modules() if isinstance(m, torch.nn.Embedding))
    return DecoderShape(
      layers=len(blocks),
      dim=embedding.embedding_dim,
      ffn_dim=max(moe.ffn_width(b) for b in blocks),
      heads=attention.n_heads,
      kv_heads=kv_heads,
      head_dim=head_dim,
      vocab=embedding.num_embeddings,
      attention_layers=len(attentions),
      inactive_params=sum(moe.inactive_expert_params(m) for m in moes),
      predictions=1 + mtp_depths(module),
      **moe.routed_shape(moes),
    )

  def sharding_map(self, module, preset):
    return fsdp_tp_map(module) if preset == "fsdp_tp" else None

  def fsdp_dims(self, module):
    shape = self.decoder_shape(module)
    return fsdp_dims(module, vocab=shape.vocab if shape else None)

  def optimizer_pre_step(self, module):
    """torchtitan's MoE load balancing (`moe.load_balancing`)."""
    return moe.load_balancing(module)

  def expert_parameters(self, module):
    """The routed-expert weights torchtitan's EP plan shards on their expert dim."""
    plan = parallel_plan(module, ep=True) if is_torchtitan(module) else {}
    experts = [name for name, dims in plan.items() if dims.get("ep") == 0]
    return experts or None

  def prepare(self, module):
    guard_keyed_masks(module)

  def model_inputs(self, module, batch):
    ids, positions, segments = batch["input_ids"], batch.get("positions"), batch.get("segment_ids")
    multimodal = "special_tokens" in inspect.signature(module.forward).parameters
    if positions is None and multimodal:  # Qwen3.5 asserts it is given positions: one document per row
      positions = torch.arange(ids.shape[-1], dtype=ids.dtype, device=ids.device).expand(ids.shape)
    if positions is None:
      return ids
    inputs = {"tokens": ids, "positions": positions}  # by name: every torchtitan decoder takes them so
    if uses_masked_attention(module):
      # What torchtitan's trainer passes, get_attention_masks(positions), with the loader's document ids
      # (the batch's arrays may be traced or span hosts: torchtitan's mask code runs on a stand-in).
      documents = document_ids(positions).to(torch.int32) if segments is None else segments
      layout = attention_masks(module, torch.zeros(1, 1, dtype=torch.long))
      inputs["attention_masks"] = with_documents(layout, documents)
    if multimodal:
      # A multimodal decoder called with text only (Qwen3.5 reads the ids even then): no
      # pixels, and placeholder ids no token has.
      inputs["special_tokens"] = {"image_id": -1, "video_id": -1}
    return inputs

  def decode_cache(self, module, max_len):
    return None, "torchtitan's decoders have no KV cache"

  def hf_form(self, module):
    """The family's HF form, from its own export module (`export.hf_form`)."""
    return export.hf_form(module)

  def from_hf(self, module, tensors):
    """HF weights read by the family's own state_dict_adapter (its `from_hf`)."""
    return export_adapter.from_hf(module, tensors)

  @contextlib.contextmanager
  def running(self, module, mesh=None, data_axes=()):
    """torchtitan's SPMD type annotations off while the model runs: the bridge runs it
    as single-device code and shards it from outside (its "partial_dtensor" backend,
    which annotates nothing on plain tensors); Qwen3.5's linear-attention kernels
    (flash-linear-attention's Triton, which cannot run under jax) routed to the bridge's; its
    complex RoPE without complex tensors (`rope.pairs_rotated`); its routed experts run where they
    live, every token dispatcher as its local one (`moe`)."""
    from torchtitan.distributed import utils as titan_distributed

    before = titan_distributed.get_spmd_backend()
    titan_distributed.set_spmd_backend("partial_dtensor")
    try:
      with linear_attention.routed(), moe.combine_by_rows(), moe.dispatched_locally(), moe.experts_where_they_live(mesh, data_axes), \
          rope.pairs_rotated(), qkv.projected_apart(mesh):
        yield
    finally:
      titan_distributed.set_spmd_backend(before)

  def attention_routes(self, attend):
    # Any model built from torchtitan's attention modules (not only its top-level classes).
    if "torchtitan.models.common.attention" not in sys.modules:
      return []
    return [flex_routed_to(attend), varlen_routed_to(attend)]
