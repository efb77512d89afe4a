"""`python -m recipes.torchtitan`: train any model torchtitan's registries build.

    python -m recipes.torchtitan --model=qwen3:debugmodel_moe              # Qwen3-MoE debug flavor
    python -m recipes.torchtitan --model=deepseek_v3:debugmodel --ep=8 --cpu_devices=8
    python -m recipes.torchtitan --model=qwen3:8B --seqlen=4096 --dry_run   # plan + compile only
    python -m recipes.torchtitan --help                                     # every flag with its default

`--model=<family>:<flavor>` names an entry of `torchtitan.models.<family>.model_registry`
(llama3, qwen3, deepseek_v3, kimi_k2_7, qwen3_5, gpt_oss, muse_glimmer); the model
is torchtitan's own config for it, unmodified, with RoPE tables sized to `--seqlen`
as torchtitan's trainer sizes them. Flags, data, checkpoints, the memory plan, MFU
and export are the Llama 3 recipe's (`python -m recipes.llama3` is this recipe's
`--model=llama3:<flavor>` with its own flags).
"""

from __future__ import annotations

import dataclasses

from recipes import common
from torch_on_tpu.models.torchtitan import LANGUAGE_FAMILIES


@dataclasses.dataclass
class TorchtitanFlags(common.Flags):
  model: str = common.flag("qwen3:debugmodel", f"<family>:<flavor> of torchtitan's registries; families: {', '.join(LANGUAGE_FAMILIES)}")


def recipe(flags: TorchtitanFlags) -> common.Recipe:
  import torch

  from torch_on_tpu.models.torchtitan import registry_config

  config = registry_config(flags.model, max_seq_len=flags.seqlen)

  def build():
    with torch.device("meta"):
      return config.build()

  return common.Recipe(
    name=flags.model.replace(":", "-"), build=build, family="titan", convert_model=f"--model={flags.model}"
  )


def run(flags: TorchtitanFlags) -> dict:
  """The recipe for parsed flags (tests call this in-process); returns the run's summary."""
  return common.run(flags, recipe)


main = common.cli(TorchtitanFlags, run, "Train any torchtitan registry model with torch_on_tpu.")

if __name__ == "__main__":
  common.fire_main(main)
