"""`python -m recipes.torchtitan`: train any model torchtitan's registries build.

    python -m recipes.torchtitan --model=qwen3:debugmodel_moe              # Qwen3-MoE debug flavor
    python -m recipes.torchtitan --model=deepseek_v3:debugmodel --ep=8 --cpu_devices=8
    python -m recipes.torchtitan --model=deepseek_v3:debugmodel --mtp_layers=1    # multi-token prediction
    python -m recipes.torchtitan --model=qwen3:8B --seqlen=4096 --dry_run   # plan + compile only
    python -m recipes.torchtitan --help                                     # every flag with its default
    python -m recipes.torchtitan --module llama3 --config llama3_debugmodel --training.steps=3   # torchtitan's own config
    python -m recipes.torchtitan --model=llama3:debugmodel --lora_rank=8 --lora_targets=wo --float8=rowwise   # LoRA, float8 base

`--model=<family>:<flavor>` names an entry of `torchtitan.models.<family>.model_registry`
(llama3, qwen3, deepseek_v3, kimi_k2_7, qwen3_5, gpt_oss, muse_glimmer); the model
is torchtitan's own config for it, unmodified, with RoPE tables sized to `--seqlen`
as torchtitan's trainer sizes them. Flags, data, checkpoints, the memory plan, MFU
and export are the Llama 3 recipe's (`python -m recipes.llama3` is this recipe's
`--model=llama3:<flavor>` with its own flags). `--module/--config` run torchtitan's own configs
and overrides (`recipes.titan_config`). `--lora_rank` puts peft's LoRA adapters on `--lora_targets`
(module names) and trains only them, as torchtitan's `LoRAConverter` does; with `--float8` the
frozen base linears compute in float8 and the adapters in `--dtype`, as its `LoRAFloat8Linear` does.
"""

from __future__ import annotations

import copy
import dataclasses
import sys

from recipes import cli, runner, titan_config
from recipes import flags as recipe_flags
from torch_on_tpu.models.torchtitan import LANGUAGE_FAMILIES


def _mtp_check(value: int, flags: TorchtitanFlags) -> None:
  """--mtp_layers: a family with multi-token prediction; neither pipeline nor context parallel (torchtitan runs MTP with neither)."""
  from torch_on_tpu.errors import TorchOnTpuError, arg, named
  from torch_on_tpu.models.torchtitan import registry_config

  if value:
    registry_config(flags.model, mtp_layers=value)  # refuses a family without it
    if flags.pp > 1 or flags.cp > 1:
      raise TorchOnTpuError(
        f"multi-token prediction with {arg('pp', flags.pp)} {arg('cp', flags.cp)}: torchtitan runs it with neither pipeline "
        f"nor context parallelism, nor does the bridge yet; use {arg('pp', 1)} {arg('cp', 1)} (those devices on {named('fsdp')})."
      )


@dataclasses.dataclass
class TorchtitanFlags(recipe_flags.LoraFlags):
  model: str = recipe_flags.flag("qwen3:debugmodel", f"<family>:<flavor> of torchtitan's registries; families: {', '.join(LANGUAGE_FAMILIES)}")
  mtp_layers: int = recipe_flags.flag(
    0, "multi-token-prediction layers (torchtitan's num_mtp_layers; DeepSeek-V3): the model also predicts that many "
    "tokens past the next and trains with torchtitan's MTPLoss (0: the flavor's own, none in torchtitan 0.3.0)",
    minimum=0, check=_mtp_check,
  )
  attn_backend: str = recipe_flags.flag(
    "default", "torchtitan's attention backend for the model (its model_registry's attn_backend: flex, varlen or sdpa; "
    "default: the family's own); each runs on the bridge's attention kernels", choices=("default", "flex", "varlen", "sdpa"),
  )
  mtp_scale: float = recipe_flags.flag(0.3, "the weight of the multi-token-prediction depths' mean loss beside the main loss (torchtitan's MTPLoss mtp_scale)", minimum=0)


def recipe(flags: TorchtitanFlags) -> runner.Recipe:
  import torch

  from torch_on_tpu.models.torchtitan import mtp_depths, mtp_loss, registry_config

  config = registry_config(flags.model, max_seq_len=flags.seqlen, mtp_layers=flags.mtp_layers,
                           attn_backend="" if flags.attn_backend == "default" else flags.attn_backend)

  def build():
    with torch.device("meta"):
      return recipe_flags.float8_converted(copy.deepcopy(config) if flags.float8 else config, flags).build()  # torchtitan converts its config

  lora = recipe_flags.lora_settings(flags)

  mtp = {}
  if mtp_depths(config):  # its outputs are the main logits and one per depth: torchtitan's MTPLoss, which reads the positions
    mtp = dict(
      loss=lambda outputs, y: mtp_loss(outputs, y["labels"], y["positions"], scale=flags.mtp_scale),
      labels=lambda batch: {"labels": batch["labels"], "positions": batch["positions"]},
    )
  return runner.Recipe(
    name=flags.model.replace(":", "-") + ("-lora" if lora else ""), build=build, family="titan", weights=flags.weights,
    lora=lora, convert_model=f"--model={flags.model}", **mtp,
  )


def run(flags: TorchtitanFlags) -> dict:
  """The recipe for parsed flags (tests call this in-process); returns the run's summary."""
  return runner.run(flags, recipe)


main = cli.cli(
  TorchtitanFlags, run,
  "Train any torchtitan registry model with torch_on_tpu (or run torchtitan's own config: --module <family> "
  "--config <config_registry function> [--section.key=value ...], its help: --module llama3 --config llama3_debugmodel --help).",
)


def command(argv: list[str]) -> None:
  """The command line: torchtitan's `--module/--config` (then any of our flags), or our flags."""
  if titan_config.wanted(argv):
    titan_config.main(argv, main)
  else:
    cli.fire_main(main, argv)


if __name__ == "__main__":
  command(sys.argv[1:])
