"""torchtitan's models, every family its registries build: configs, inputs, shape, sharding, export.

    config = registry_config("qwen3:debugmodel_moe", max_seq_len=2048)   # torchtitan's own
    with torch.device("meta"):
      model = config.build()
    jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
    logits = jm(**jm.family.model_inputs(model, {"input_ids": tokens, "positions": positions}))

`TorchtitanFamily` answers for all of them by rules read from torchtitan's own
code (docs/torchtitan.md): the model is called by name (`tokens=`,
`positions=`, `attention_masks=`) with the masks its own `get_attention_masks`
chooses, built as the bridge's stand-ins (`FlexMasks`, `VarlenMasks`: the
compiled BlockMask builder cannot run beside jax); while ShardedModule's
attention kernels are active, flex and varlen attention run them. The TP and
EP maps come from each family's own sharding plan; MoE load balancing is the
family's `optimizer_pre_step`; Qwen3.5's linear attention runs the bridge's
kernels; export goes through each family's `state_dict_adapter`.

`build_llama3(flavor, attention="sdpa")` keeps Llama 3's builder: "sdpa" swaps
each layer's inner attention for torchtitan's own `ScaledDotProductAttention`
(plain causal attention, no document masking), the config change torchtitan
itself makes for models that use SDPA.

Called by hand, pass `attention_masks(model, positions)` where torchtitan's trainer
passes `model.get_attention_masks(positions)`:

    logits = jm(tokens, positions=positions, attention_masks=attention_masks(model, positions))

FlexAttention and VarlenAttention then run the bridge's kernels with the mask they
were given: causal, documents, sliding windows (muse_glimmer, gpt-oss, whose layers
pick theirs from a dict) and gpt-oss's attention sinks; what they cannot express is
refused in one sentence. `flex_masks(positions)` is the document-causal mask alone
(Llama 3, Qwen 3).

One concern per module: `configs` (torchtitan's registry configs, Llama 3's builder), `plans`
(its TP/EP plans as sharding maps), `masks` (the masks torchtitan's trainer passes, as the
bridge's stand-ins), `attention` (its flex and varlen attention routed to the bridge's kernels),
`linear_attention` (Qwen3.5's Gated DeltaNet in jax), `mtp` (multi-token prediction), `moe`
(MoE shapes and load balancing), `family` (`TorchtitanFamily`), and `export/`, one module per
torchtitan family (its HF config, table or adapter, and refusals).
"""

from __future__ import annotations

from torch_on_tpu.models.torchtitan.attention import flex_routed_to, varlen_routed_to
from torch_on_tpu.models.torchtitan.configs import (
  FLAVORS,
  LANGUAGE_FAMILIES,
  build_llama3,
  is_torchtitan,
  llama3_config,
  registry_config,
)
from torch_on_tpu.models.torchtitan.family import TorchtitanFamily
from torch_on_tpu.models.torchtitan.masks import FlexMasks, VarlenMasks, attention_masks, document_ids, flex_masks, varlen_masks
from torch_on_tpu.models.torchtitan.mtp import MTP_SCALE, mtp_depths, mtp_loss
from torch_on_tpu.models.torchtitan.plans import fsdp_tp_map, parallel_plan

__all__ = [
  "FLAVORS", "LANGUAGE_FAMILIES", "MTP_SCALE", "FlexMasks", "TorchtitanFamily", "VarlenMasks", "attention_masks",
  "build_llama3", "document_ids", "flex_masks", "flex_routed_to", "fsdp_tp_map", "is_torchtitan", "llama3_config",
  "mtp_depths", "mtp_loss", "parallel_plan", "registry_config", "varlen_masks", "varlen_routed_to",
]
