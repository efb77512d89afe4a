"""`python -m recipes.hf --config=DIR`: train or fine-tune any HF causal LM, LoRA included.

    python -m recipes.hf --config=path/to/model_dir --weights=path/to/model_dir \\
        --lora_rank=16 --data='notes/*.txt'                # LoRA fine-tune from pretrained weights
    python -m recipes.hf --config=config.json              # train from the config's own init

The model is `AutoModelForCausalLM.from_config` on meta; `--weights` streams a
safetensors directory straight into the sharded params. With `--lora_rank`,
peft LoRA adapters go on `--lora_targets` and only they train (the base params
get no gradient and no optimizer state). Every flag of `recipes.llama3` but
the model ones applies.
"""

from __future__ import annotations

import dataclasses
import os
import re

from recipes import cli, runner
from recipes import flags as recipe_flags


def _local_config(path, flags) -> None:
  """--config is a local config.json or a directory holding one: hub names are not fetched."""
  from torch_on_tpu.errors import TorchOnTpuError

  if path is None:
    raise TorchOnTpuError("recipes.hf needs it: a config.json or a model directory holding one.")
  if not os.path.exists(path):
    hub = "" if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", path) or path.endswith(".json") else (
      f" (recipes.hf reads local files and fetches no hub names: download the model first, e.g. "
      f"`hf download {path} --local-dir models/{path.replace('/', '--')}`, and pass that directory)"
    )
    raise TorchOnTpuError(f"{path!r} does not exist{hub}; pass a config.json or a directory holding one.")
  if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
    raise TorchOnTpuError(f"directory {path!r} has no config.json; point at the file or its directory.")


@dataclasses.dataclass
class HFFlags(recipe_flags.LoraFlags):
  config: str | None = recipe_flags.flag(None, "config.json of the model, or a directory holding one (required)", check=_local_config)


def load_config(path: str):
  """An HF config from a config.json or a model directory, offline."""
  import transformers

  directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
  if os.path.isdir(path) or os.path.basename(path) == "config.json":
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
  else:
    config = transformers.AutoConfig.from_dict(transformers.PretrainedConfig.get_config_dict(path)[0])
  config._attn_implementation = "sdpa"  # the bridge's attention kernels run SDPA
  return config


def recipe(flags: HFFlags) -> runner.Recipe:
  from torch_on_tpu.errors import TorchOnTpuError
  from torch_on_tpu.models.hf import build_causal_lm

  config = load_config(flags.config)
  limit = getattr(config, "max_position_embeddings", None)
  if limit is not None and flags.seqlen > limit:
    raise TorchOnTpuError(f"--seqlen={flags.seqlen} exceeds the model's maximum of {limit} positions; use a shorter --seqlen.")
  lora = recipe_flags.lora_settings(flags)  # with --float8: float8 base linears, high-precision adapters
  directory = (os.path.dirname(flags.config) or ".") if os.path.isfile(flags.config) else flags.config
  name = os.path.basename(os.path.normpath(directory))
  return runner.Recipe(
    name=f"hf-{name or config.model_type}" + ("-lora" if lora else ""),
    build=lambda: recipe_flags.float8_converted(build_causal_lm(config), flags),
    family="hf",
    weights=flags.weights,
    lora=lora,
    convert_model=f"--hf_config={directory}",
  )


def run(flags: HFFlags) -> dict:
  """The recipe for parsed flags (tests call this in-process); returns the run's summary."""
  if flags.tokenizer is None and flags.config and os.path.isdir(flags.config):
    if any(os.path.exists(os.path.join(flags.config, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
      flags = dataclasses.replace(flags, tokenizer=flags.config)  # the model's own tokenizer
  return runner.run(flags, recipe)


main = cli.cli(HFFlags, run, "Train or LoRA fine-tune an HF causal LM with torch_on_tpu.")

if __name__ == "__main__":
  cli.fire_main(main)
