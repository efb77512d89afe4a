"""Convert model weights between orbax training checkpoints, safetensors and HF directories.

A training run writes orbax checkpoints; PyTorch, transformers and peft load
safetensors. Every direction needs the model's parameter names and shapes,
which come from building the model on meta (nothing is allocated until
weights are read):

    python tools/convert.py to_hf runs/a/ckpt out/ --model=llama3:1B --tokenizer=runs/a/tokenizer [--step=1000]
    python tools/convert.py to_hf runs/b/ckpt out/ --hf_config=path/with/config.json [--mode=adapter]
    python tools/convert.py to_safetensors runs/a/ckpt out/ --model=llama3:1B [--step=1000]
    python tools/convert.py to_orbax path/to/hf_model runs/c/ckpt [--hf_config=...] [--step=0]

`to_hf` writes a directory `AutoModelForCausalLM.from_pretrained` loads
(weights, config.json, the run's tokenizer; Muse Glimmer, which HF has only as
a vision-language class, loads with `AutoModelForImageTextToText`); for a LoRA run (its saved config
names the rank) the adapters are merged into the base weights, or written
alone for peft with `--mode=adapter` (`torch_on_tpu/io/export.py`).
`to_safetensors` writes the model's own `state_dict` names (a LoRA run's are
peft's). Both read the training state's `params` and `buffers` entries (the
weights and the state_dict buffers, such as an MoE's trained expert bias; not
the optimizer state), tensor by tensor; `to_orbax` writes a checkpoint holding
`{"params": ..., "buffers": ...}` under the original names, which a run with or
without scan restores with `Checkpointer(..., model=jm).restore({"params": ...}, partial=True)`.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch_on_tpu as tot
from torch_on_tpu import errors
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import checkpoint, export
from torch_on_tpu.training import lora


def build_model(model: str | None = None, hf_config: str | None = None, mtp_layers: int = 0):
  """The meta torch model a spec names: torchtitan's `<family>:<flavor>` (with `mtp_layers`
  multi-token-prediction layers) or an HF config directory."""
  if (model is None) == (hf_config is None):
    raise TorchOnTpuError(
      "Name the model with exactly one of --model=<torchtitan family>:<flavor> (llama3:1B, qwen3:debugmodel_moe) "
      "or --hf_config=<dir with config.json>."
    )
  if hf_config is not None:
    import transformers

    from torch_on_tpu.models.hf import build_causal_lm

    return build_causal_lm(transformers.AutoConfig.from_pretrained(hf_config))
  import torch

  from torch_on_tpu.models.torchtitan import registry_config

  # The sequence length changes no weight; the smallest RoPE cache will do.
  config = registry_config(str(model), max_seq_len=1, mtp_layers=mtp_layers)
  with torch.device("meta"):
    return config.build()


def _abstract_module(model, hf_config, scan=False, adapters: dict | None = None, mtp_layers: int = 0):
  """The model on meta, sharded over the local devices; with `adapters` (lora.wrap's
  rank, alpha, targets) the LoRA model a run with them trained; with the run's `mtp_layers`."""
  mesh = tot.make_mesh(fsdp=-1)
  build = lambda: build_model(model, hf_config, mtp_layers)  # noqa: E731
  if not adapters:
    return tot.ShardedModule(build(), mesh=mesh, sharding="fsdp", scan=scan, abstract=True)
  base = tot.ShardedModule(build(), mesh=mesh, sharding="fsdp", abstract=True)
  return lora.wrap(base, build(), scan=scan, **adapters)


def _adapters(ckpt, step) -> dict | None:
  """The LoRA settings the run's saved config names (recipes' --lora_rank ...), None without."""
  config = ckpt.saved_config(step) or {}
  if not config.get("lora_rank"):
    return None
  return dict(rank=config["lora_rank"], alpha=config.get("lora_alpha"), targets=lora.parse_targets(config.get("lora_targets", "all-linear")))


def _saved_state(jm) -> dict:
  """What a checkpoint holds of `jm`: its params and its state_dict buffers (an MoE's
  trained expert bias); non-persistent buffers (RoPE tables, counts) are rebuilt."""
  layout = jm.stored_layout()
  buffers = {k: a for k, a in jm.buffers.items() if jm.is_persistent(layout[k][0][0])}
  return {checkpoint.PARAMS_KEY: jm.params, **({checkpoint.BUFFERS_KEY: buffers} if buffers else {})}


def _restore(checkpoint_dir: str, model, hf_config, step):
  """(the abstract model holding the checkpoint's params and buffers, the step read).

  Checkpoints hold the original per-layer names; one saved before that, by a
  run with `scan=True`, holds its layers stacked: that layout is tried when
  the plain one does not match.
  """
  if not Path(checkpoint_dir).is_dir():
    raise TorchOnTpuError(f"No checkpoint directory at {checkpoint_dir}.")
  with checkpoint.Checkpointer(checkpoint_dir, read_only=True) as ckpt:
    adapters = _adapters(ckpt, step)
    mtp_layers = (ckpt.saved_config(step) or {}).get("mtp_layers", 0)  # the recipe's --mtp_layers: the model it trained
    try:
      jm = _abstract_module(model, hf_config, adapters=adapters, mtp_layers=mtp_layers)
      restored = ckpt.restore(_saved_state(jm), step=step, partial=True)
    except TorchOnTpuError as plain_error:
      jm = _abstract_module(model, hf_config, scan=True, adapters=adapters, mtp_layers=mtp_layers)
      try:
        restored = ckpt.restore(_saved_state(jm), step=step, partial=True)
      except TorchOnTpuError:
        raise plain_error from None
  if restored is None:
    raise TorchOnTpuError(f"{checkpoint_dir} holds no complete checkpoint to convert.")
  jm.params.update(restored.state[checkpoint.PARAMS_KEY])
  jm.buffers.update(restored.state.get(checkpoint.BUFFERS_KEY, {}))
  return jm, restored.step


def to_safetensors(
  checkpoint_dir: str,
  out_dir: str,
  *,
  model: str | None = None,
  hf_config: str | None = None,
  step: int | None = None,
  max_shard_gb: float = 4.0,
  overwrite: bool = False,
) -> None:
  """Orbax checkpoint (latest step, or `step`) → safetensors directory of the model's state_dict."""
  jm, read = _restore(checkpoint_dir, model, hf_config, step)
  out = export.export_safetensors(jm, out_dir, max_shard_bytes=int(max_shard_gb * 2**30), overwrite=overwrite)
  print(f"wrote step {read} of {checkpoint_dir} to {out}")


def to_hf(
  checkpoint_dir: str,
  out_dir: str,
  *,
  model: str | None = None,
  hf_config: str | None = None,
  step: int | None = None,
  mode: str | None = None,
  tokenizer: str | None = None,
  max_shard_gb: float = 4.0,
  overwrite: bool = False,
) -> None:
  """Orbax checkpoint (latest step, or `step`) → a directory transformers loads (peft for
  `mode="adapter"`), with `tokenizer` (a tokenizer directory or tokenizer.json) beside the
  weights. `mode` defaults to "merged" for a LoRA run and "full" otherwise."""
  jm, read = _restore(checkpoint_dir, model, hf_config, step)
  if mode is None:
    mode = "merged" if hasattr(jm.module, "peft_config") else "full"
  out = export.export(
    jm, out_dir, mode=mode, tokenizer=tokenizer, max_shard_bytes=int(max_shard_gb * 2**30), overwrite=overwrite
  )
  print(f"wrote step {read} of {checkpoint_dir} to {out} ({mode})")
  if tokenizer is None and mode != "adapter":
    kept = Path(checkpoint_dir).parent / "tokenizer"  # where a recipe run keeps its own, beside its ckpt/
    where = f"the run's own is {kept}: add --tokenizer={kept}" if kept.is_dir() else "pass --tokenizer=DIR"
    print(f"no tokenizer written: AutoTokenizer.from_pretrained({str(out)!r}) needs one; {where}")


def to_orbax(
  weights: str,
  out_dir: str,
  *,
  model: str | None = None,
  hf_config: str | None = None,
  step: int = 0,
) -> None:
  """Safetensors file or directory → orbax checkpoint `{"params": ..., "buffers": ...}` at `step`
  (original names: runs with and without scan restore it).

  An HF model directory (with config.json) needs no model spec.
  """
  if not Path(weights).exists():
    raise TorchOnTpuError(f"No weights at {weights}; give a .safetensors file or a directory holding them.")
  if model is None and hf_config is None and (Path(weights) / "config.json").is_file():
    hf_config = weights
  jm = _abstract_module(model, hf_config)
  checkpoint.import_safetensors(jm, weights)
  with checkpoint.Checkpointer(out_dir) as ckpt:
    if step in ckpt.all_steps():
      raise TorchOnTpuError(
        f"{out_dir} already has a checkpoint for step {step}; pick another --step or directory."
      )
    ckpt.save(step, _saved_state(jm), config={"converted_from": str(weights)}, force=True)
  print(f"wrote {weights} to {out_dir} as step {step}")


COMMANDS = {"to_hf": to_hf, "to_safetensors": to_safetensors, "to_orbax": to_orbax}


def main(argv=None) -> int:
  import fire

  from torch_on_tpu.runtime import libtpu

  libtpu.quiet_without_chips()  # no chips here: libtpu's start-up questions answered before jax starts
  # each command's keyword arguments are its flags: errors name them as --flags
  flags = {name: name for command in COMMANDS.values() for name in inspect.signature(command).parameters}
  try:
    with errors.spoken_as_flags(flags):
      fire.Fire(COMMANDS, command=argv)
  except TorchOnTpuError as e:
    print(f"convert: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
