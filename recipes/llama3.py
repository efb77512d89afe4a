"""`python -m recipes.llama3`: train torchtitan's Llama 3 on whatever devices exist.

    python -m recipes.llama3                                   # debugmodel on the built-in corpus
    python -m recipes.llama3 --model=8B --seqlen=8192 --global_batch_size=8 \\
        --cpu_devices=8 --dry_run                              # plan + compile, nothing allocated
    python -m recipes.llama3 --help                            # every flag with its default

The model is torchtitan's own config for the flavor (`--model_impl=titan`), or
the same architecture as a transformers `LlamaConfig` (`--model_impl=hf`).
"""

from __future__ import annotations

import dataclasses

from recipes import cli, runner
from recipes import flags as recipe_flags

MODELS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")


@dataclasses.dataclass
class Llama3Flags(recipe_flags.Flags):
  model: str = recipe_flags.flag("debugmodel", f"torchtitan Llama 3 flavor: {', '.join(MODELS)}", choices=MODELS)
  model_impl: str = recipe_flags.flag(
    "titan", "titan (torchtitan's model) or hf (transformers' Llama, same numbers)", choices=("titan", "hf")
  )
  titan_attention: str = recipe_flags.flag(
    "flex", "the attention module torchtitan builds: flex (document-causal over packed documents) or sdpa (plain causal)",
    choices=("flex", "sdpa"),
  )


def hf_config(flavor: str):
  """transformers' `LlamaConfig` with the numbers of torchtitan's flavor."""
  import transformers

  from torch_on_tpu.models.torchtitan import llama3_config

  config = llama3_config(flavor)
  layer = config.layers[0]
  attention, rope = layer.attention, layer.attention.rope
  hf = transformers.LlamaConfig(
    vocab_size=config.vocab_size,
    hidden_size=config.dim,
    intermediate_size=layer.feed_forward.w1.out_features,
    num_hidden_layers=len(config.layers),
    num_attention_heads=attention.n_heads,
    num_key_value_heads=attention.qkv_linear.n_kv_heads,
    head_dim=attention.qkv_linear.head_dim,
    max_position_embeddings=rope.max_seq_len,
    rms_norm_eps=config.norm.eps,
    tie_word_embeddings=config.enable_weight_tying,
    rope_parameters={
      "rope_type": "llama3",
      "rope_theta": float(rope.theta),
      "factor": rope.scaling_factor,
      "low_freq_factor": rope.low_freq_factor,
      "high_freq_factor": rope.high_freq_factor,
      "original_max_position_embeddings": rope.original_max_position_embeddings,
    },
  )
  hf._attn_implementation = "sdpa"
  return hf


def recipe(flags: Llama3Flags) -> runner.Recipe:
  from torch_on_tpu.errors import TorchOnTpuError

  if flags.model_impl == "titan":
    import torch

    from torch_on_tpu.models.torchtitan import llama3_config

    if flags.titan_attention == "flex" and flags.attention == "none":
      raise TorchOnTpuError(
        "--attention=none leaves attention to torchax's own SDPA lowering, which cannot run torchtitan's "
        "flex attention; add --titan_attention=sdpa (plain causal attention) or pick an --attention kernel."
      )

    def build():
      config = llama3_config(flags.model, attention=flags.titan_attention, max_seq_len=flags.seqlen)
      with torch.device("meta"):
        return recipe_flags.float8_converted(config, flags).build()  # torchtitan converts its config

    return runner.Recipe(
      name=f"llama3-{flags.model}", build=build, family="titan", weights=flags.weights,
      convert_model=f"--model=llama3:{flags.model}",
    )
  from torch_on_tpu.models.hf import build_causal_lm

  config = hf_config(flags.model)  # --model_impl=hf
  if flags.seqlen > config.max_position_embeddings:
    raise TorchOnTpuError(
      f"--seqlen={flags.seqlen} exceeds Llama 3 {flags.model}'s maximum of "
      f"{config.max_position_embeddings} positions; use a shorter --seqlen."
    )
  return runner.Recipe(
    name=f"llama3-{flags.model}-hf", build=lambda: recipe_flags.float8_converted(build_causal_lm(config), flags), family="hf",
    weights=flags.weights,
  )


def run(flags: Llama3Flags) -> dict:
  """The recipe for parsed flags (tests call this in-process); returns the run's summary."""
  return runner.run(flags, recipe)


main = cli.cli(Llama3Flags, run, "Train torchtitan's Llama 3 (or its HF twin) with torch_on_tpu.")

if __name__ == "__main__":
  cli.fire_main(main)
