"""`python -m recipes.torchtitan --module <family> --config <function> --section.key=value`: torchtitan's
own configs, parsed by its ConfigManager, mapped onto the recipe's flags; every function torchtitan
0.3.0 ships for its language families either maps or is refused in one sentence naming why."""

import ast
import dataclasses
import functools
import importlib
import importlib.util
import json
import re
import shlex
import types

import pytest
import torch

from recipes import cli, titan_config
from recipes import flags as recipe_flags
from recipes import torchtitan as titan_recipe
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.models.torchtitan import LANGUAGE_FAMILIES
from torch_on_tpu.training.lr_schedule import warmup_stable_decay

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

# What cannot run here, by config function: the sentence says why.
REFUSED = {
  "nvfp4|mxfp8": r"torchtitan could not build its config .*(NVFP4|MXFP8)",
  "671b_float8": r"changes deepseek_v3:671B's model at .*inner_experts \(.*Float8GroupedExper",
  "flex_flash": r"could not build its config .*Flash backend",
  "^sft_qwen3": r"dataloader.dataset_path='openai/gsm8k' is a download by name",
  "minimal_async_ep": r"parallelism degrees .* do not multiply to the 8 devices here; .*--cpu_devices=N",
  "_mm$": r"multimodal data loader of torchtitan's .* imports torchvision.* --model=muse_glimmer:<flavor>",
}


def config_functions(family):
  """The functions of torchtitan's `<family>.config_registry` that build a Trainer.Config."""
  return titan_config.config_functions(importlib.import_module(f"torchtitan.models.{family}.config_registry"))


@pytest.mark.parametrize("family", LANGUAGE_FAMILIES)
def test_every_config_torchtitan_ships_maps_onto_the_flags_or_is_refused_in_a_sentence(family):
  try:
    names = config_functions(family)
  except ModuleNotFoundError as e:  # its registry imports a multimodal loader's torchvision
    assert e.name == "torchvision"
    with pytest.raises(TorchOnTpuError, match=rf"multimodal data loader of torchtitan's {family} configs .* imports torchvision.*--model={family}:<flavor>"):
      titan_config.parse(["--module", family, "--config", "anything"])
    return
  mapped = 0
  for name in names:
    expected = [why for pattern, why in REFUSED.items() if re.search(pattern, name)]
    try:
      config = titan_config.parse(["--module", family, "--config", name])
      flags, _ = titan_config.to_flags(config, devices=8)
    except TorchOnTpuError as e:
      assert expected and re.search(expected[0], str(e)), (name, str(e))
      assert "\n" not in str(e)
      continue
    assert not expected, f"{name} mapped; expected a refusal"
    run = titan_recipe.TorchtitanFlags(**flags)
    recipe_flags.check_flags(run, read_files=False)  # every value one the recipe takes
    group = config.optimizer.param_groups[0].optimizer_kwargs
    assert (run.model, run.seqlen, run.steps, run.lr) == (f"{family}:{config.model_spec.flavor}", config.training.seq_len, config.training.steps, group["lr"])
    assert run.fsdp * run.tp * run.cp * run.pp == 8  # ep borrows from fsdp x cp x tp, as torchtitan's does
    assert run.global_batch_size == config.training.local_batch_size * run.fsdp * run.grad_accum
    mapped += 1
  assert mapped >= 2, names  # each family's own debug and full-size configs


def test_llama3_8b_is_torchtitans_run_on_the_recipes_flags():
  config = titan_config.parse(["--module", "llama3", "--config", "llama3_8b", "--training.steps=3",
                               "--parallelism.tensor_parallel_degree=2", "--checkpoint.enable", "--checkpoint.interval=2"])
  flags, notes = titan_config.to_flags(config, devices=8)
  assert {k: flags[k] for k in ("model", "steps", "seqlen", "fsdp", "tp", "global_batch_size", "dtype", "save_every")} == dict(
    model="llama3:8B", steps=3, seqlen=8192, fsdp=4, tp=2, global_batch_size=4, dtype="bfloat16", save_every=2,
  )
  assert (flags["lr_decay"], flags["warmup_steps"], flags["beta2"], flags["weight_decay"]) == ("linear", 200, 0.95, 0.1)
  assert any("hf_assets_path './assets/hf/Llama-3.1-8B' holds no tokenizer.json" in n for n in notes), notes
  with pytest.raises(TorchOnTpuError, match=r"torchtitan's lr_scheduler\.total_steps=100 has no counterpart.*drop it \(its default is None\)"):
    titan_config.to_flags(titan_config.parse(["--module", "llama3", "--config", "llama3_8b", "--lr_scheduler.total_steps=100"]), devices=8)
  bf16_states, _ = titan_config.to_flags(
    titan_config.parse(["--module", "llama3", "--config", "llama3_8b", "--optimizer.implementation=fused_opt_states_bf16"]), devices=8)
  assert (bf16_states["adam_states"], bf16_states["dtype"]) == ("bfloat16", "bfloat16")  # its fused AdamW's bf16 moments
  assert "adam_states" not in flags


@pytest.mark.parametrize("kw", [
  dict(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
  dict(warmup_steps=3, decay_ratio=None, decay_type="cosine", min_lr_factor=0.1),
  dict(warmup_steps=0, decay_ratio=0.5, decay_type="sqrt", min_lr_factor=0.2),
  dict(warmup_steps=12, decay_ratio=None, decay_type="linear", min_lr_factor=0.0),  # warmup longer than the run
])
def test_the_schedule_is_torchtitans_step_for_step(kw):
  from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

  steps, lr = 10, 1e-3
  config = types.SimpleNamespace(optimizer=default_adamw(lr=lr), lr_scheduler=LRSchedulersContainer.Config(**kw), training=types.SimpleNamespace(steps=steps))
  ours = warmup_stable_decay(lr, steps, warmup_steps=kw["warmup_steps"], decay_ratio=kw["decay_ratio"], decay=kw["decay_type"], min_lr_factor=kw["min_lr_factor"])
  assert [float(ours(k)) for k in range(steps)] == pytest.approx(torchtitans_lrs(config), rel=1e-6, abs=1e-12)


def torchtitans_lrs(config) -> list[float]:
  """The learning rate of each step under torchtitan's own optimizer and scheduler for `config`."""
  model = torch.nn.Linear(2, 2)
  optimizers = dataclasses.replace(config.optimizer, implementation="for-loop").build(model_parts=[model])
  schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
  lrs = []
  for _ in range(config.training.steps):
    lrs.append(optimizers.optimizers[0].param_groups[0]["lr"])
    optimizers.step()
    schedulers.step()
  return lrs


def test_torchtitans_debug_config_trains_as_it_is_and_the_printed_flags_are_the_same_run(tmp_path, capsys):
  dump = tmp_path / "outputs"
  argv = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps=3", "--training.seq_len=64", "--checkpoint.enable",
          "--training.local_batch_size=1", f"--dump_folder={dump}", "--metrics.log_freq=5", "--eval_every=0"]
  titan_recipe.command(argv)
  said = capsys.readouterr().out
  assert "torchtitan's hf_assets_path './tests/assets/tokenizer' holds no tokenizer.json here" in said
  assert "torchtitan's dataset 'c4_test' is a download by name" in said
  records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
  assert [r["learning_rate"] for r in records if "loss" in r] == pytest.approx(torchtitans_lrs(titan_config.parse(argv[:-1])), rel=1e-6)
  assert all(torch.isfinite(torch.tensor([r["loss"] for r in records if "loss" in r])))
  (same,) = [line.split(": ", 1)[1] for line in said.splitlines() if line.startswith("The same run in this recipe's flags: ")]
  words = shlex.split(same)
  assert words[:3] == [".venv/bin/python", "-m", "recipes.torchtitan"]
  pasted = titan_recipe.TorchtitanFlags(**{a[2:].split("=", 1)[0]: ast.literal_eval(a.split("=", 1)[1]) for a in cli.parse_argv(words[3:], titan_recipe.TorchtitanFlags)})
  assert (pasted.model, pasted.global_batch_size, pasted.lr_decay, pasted.eval_every) == ("llama3:debugmodel", 8, "linear", 0)
  titan_recipe.command(words[3:])  # pasted: the same run, which is done (its checkpoint holds the last step)
  assert f"Nothing to train: {dump}/checkpoint already holds step 3 of --steps=3" in capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
  (["--parallelism.data_parallel_shard_degree=3"], r"do not multiply to the 8 devices here; .*--cpu_devices=N simulates"),
  (["--checkpoint.initial_load_path=/nonexistent/step-10"], r"--weights: '/nonexistent/step-10' does not exist"),
  (["--lr_decay=cubic"], r"^error: --lr_decay='cubic' is not one of cosine, linear, sqrt"),  # before any command is printed
])
def test_a_config_that_cannot_run_is_one_sentence_and_a_nonzero_status(argv, said, capsys):
  command = functools.partial(titan_recipe.command, ["--module", "llama3", "--config", "llama3_debugmodel", *argv])
  with pytest.raises(SystemExit) as stop:
    command()
  said_out = capsys.readouterr()
  err = said_out.err.strip()
  assert stop.value.code != 0 and re.search(said, err) and len(err.splitlines()) == 1, err
  assert "--lr_decay=cubic" not in said_out.out  # no printed command carries the bad value


def test_a_mistyped_override_is_torchtitans_own_parser_answering_with_the_nearest_field(capsys):
  with pytest.raises(SystemExit) as stop:
    titan_recipe.command(["--module", "llama3", "--config", "llama3_debugmodel", "--training.stepz=3"])
  err = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().err).split())  # tyro's panel, its box drawn away
  assert stop.value.code == 2 and "Unrecognized options: --training.stepz=3" in err and "--training.steps INT" in err, err
  assert "run .venv/bin/python -m recipes.torchtitan --module llama3 --config llama3_debugmodel --help" in err, err  # pastes


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_familys_own_debug_config_plans_and_compiles_as_it_is(family, tmp_path, capsys):
  """torchtitan's `<family>_debugmodel` (MLA and MoE; sinks and windows in torchtitan's bf16), only
  shortened, through the plan and the compile (`--dry_run`); Llama 3's trains above."""
  titan_recipe.command(["--module", family, "--config", f"{family}_debugmodel", "--training.seq_len=64",
                        "--training.local_batch_size=1", f"--dump_folder={tmp_path}", "--dry_run"])
  said = capsys.readouterr().out
  assert f'"model": "{family}:debugmodel"' in said and '"dtype": "bfloat16"' in said
  assert "Memory plan per device" in said and "Compiled step: compiled in" in said


@pytest.mark.parametrize("module, config, backend, kind", [
  ("llama3", "llama3_debugmodel_varlen_attn", "varlen", "VarlenAttention"),
  ("gpt_oss", "gpt_oss_debugmodel_flex", "flex", "FlexAttention"),
  ("gpt_oss", "gpt_oss_debugmodel", "", "VarlenAttention"),  # the family's own backend: no flag
])
def test_a_config_built_with_another_attention_backend_maps_onto_attn_backend(module, config, backend, kind):
  """torchtitan's configs that build their flavor with another `attn_backend` train that model:
  the flag names the backend, and the recipe's model has the config's attention modules."""
  from torch_on_tpu.models.torchtitan import registry_config

  flags, _ = titan_config.to_flags(titan_config.parse(["--module", module, "--config", config]), devices=8)
  assert flags.get("attn_backend", "") == backend, flags
  built = registry_config(flags["model"], attn_backend=backend)
  assert type(built.layers[0].attention.inner_attention).__qualname__ == f"{kind}.Config"
  recipe_flags.check_flags(titan_recipe.TorchtitanFlags(**flags), read_files=False)  # a value the flag takes
  with pytest.raises(TorchOnTpuError, match=r"--attn_backend='flash' is not one of default, flex, varlen, sdpa"):
    recipe_flags.check_flags(titan_recipe.TorchtitanFlags(**{**flags, "attn_backend": "flash"}), read_files=False)


def test_a_lora_model_maps_onto_the_lora_flags_that_make_it_the_same():
  """torchtitan's LoRAConverter (after its float8 converter, emulated) → --lora_rank, --lora_alpha,
  --lora_targets (the adapted modules' names: its targets wq and wkv name configs the debugmodel's
  fused q/k/v projection does not have, so only wo is adapted) and the float8 flags; without float8, the
  LoRA flags alone. A LoRA model these flags cannot make is refused in one sentence."""
  from torchtitan.components.lora import LoRAConverter
  from torchtitan.models.llama3 import model_registry
  from torchtitan.models.llama3.config_registry import llama3_debugmodel

  flags, _ = titan_config.to_flags(titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel_float8_emulate_lora"]), devices=8)
  assert {k: flags.get(k) for k in ("model", "lora_rank", "lora_alpha", "lora_targets", "float8", "float8_skip")} == dict(
    model="llama3:debugmodel", lora_rank=8, lora_alpha=16.0, lora_targets="wo", float8="tensorwise", float8_skip="",
  )
  recipe_flags.check_flags(titan_recipe.TorchtitanFlags(**flags), read_files=False)
  config = llama3_debugmodel()
  config.model_spec = model_registry("debugmodel", converters=[LoRAConverter.Config(rank=4, alpha=2.0, target_modules=["w3", "w1"])])
  flags, _ = titan_config.to_flags(config, devices=8)
  assert (flags["lora_rank"], flags["lora_alpha"], flags["lora_targets"], flags.get("float8")) == (4, 2.0, "w1,w3", None)
  config.model_spec.model.lm_head = model_registry("debugmodel").model.lm_head  # an output head that trains too
  with pytest.raises(TorchOnTpuError, match=r"^torchtitan's config puts LoRA adapters on llama3:debugmodel's model, but converting "
                     r"the registry's model with LoRAConverter\(rank=4, alpha=2.0, target_modules=\['w1', 'w3'\]\) does not give it "
                     r"\(at model_spec.model.lm_head\); .*converters alone.$"):
    titan_config.to_flags(config, devices=8)
  config.model_spec = model_registry("debugmodel", converters=[LoRAConverter.Config(rank=4, alpha=2.0, target_modules=["w1"])])
  config.model_spec.model.layers[0].feed_forward.w1.rank = 2
  with pytest.raises(TorchOnTpuError, match=r"with 2 different ranks or alphas; --lora_rank and --lora_alpha set one for every adapter"):
    titan_config.to_flags(config, devices=8)


def test_a_float8_converted_model_maps_onto_the_float8_flags_that_convert_it_the_same():
  """torchtitan's float8 converter (emulated: its own check wants an NVIDIA GPU) with a filter: the
  flags name the torchao recipe its linears hold and the linears it left alone, and converting the
  registry's model with them gives the config's model exactly (else the config is refused)."""
  from torchtitan.components.quantization import Float8LinearConverter
  from torchtitan.models.llama3 import model_registry
  from torchtitan.models.llama3.config_registry import llama3_debugmodel

  from torch_on_tpu.lowering import float8

  config = llama3_debugmodel()
  converter = Float8LinearConverter.Config(emulate=True, filter_fqns=["feed_forward"])
  config.model_spec = model_registry("debugmodel", converters=[converter])
  flags, _ = titan_config.to_flags(config, devices=8)
  skip = flags["float8_skip"].split(",")
  assert flags["float8"] in float8.RECIPES and len(skip) == 3 * 6 and all(".feed_forward.w" in n for n in skip), flags
  held = {type(m).__name__ for m in config.model_spec.model.build().modules()}  # built as torchtitan builds it
  assert "Float8Linear" in held


def test_async_tp_and_symmetric_memory_fsdp_are_the_same_computation_here():
  """torchtitan's async-TP config (its attention and feed-forward with the TP collectives fused into
  their GEMMs) and FSDP over CUDA symmetric memory (which torchtitan's own check refuses without an
  SM90 GPU) compute what the stock model and plain FSDP do: mapped, the switch said in a line."""
  config = titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel_dist_gemm", "--parallelism.tensor_parallel_degree=2"])
  flags, notes = titan_config.to_flags(config, devices=8)
  assert (flags["model"], flags["tp"]) == ("llama3:debugmodel", 2)
  assert any("AllGatherFusedFeedForward, AllGatherFusedQKVLinear, RowParallelLinear" in n and "the same computation" in n for n in notes), notes
  config = titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.enable-fsdp-symm-mem"])
  assert config.parallelism.enable_fsdp_symm_mem
  _, notes = titan_config.to_flags(config, devices=2)
  assert any("parallelism.enable_fsdp_symm_mem=True" in n and "the same gradients" in n for n in notes), notes


def test_torchtitans_float8_configs_built_for_a_gpu_map_onto_the_float8_flags():
  """`llama3_debugmodel_float8` (torchao's hardware path, which torchtitan builds only beside an SM89+
  GPU) is built as there and maps onto --float8; the converter's check of the machine is torchtitan's
  own again afterwards, and MXFP8 (a format the bridge does not run) is still refused."""
  from torchtitan.components.quantization import float8 as titan_float8

  check = titan_float8.has_cuda_capability
  flags, _ = titan_config.to_flags(titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel_float8"]), devices=8)
  assert (flags["float8"], flags["float8_skip"]) == ("rowwise", "")
  assert titan_float8.has_cuda_capability is check and not check(8, 9)
  with pytest.raises(TorchOnTpuError, match=r"could not build its config .*MXFP8.*\(--float8\)\.$"):
    titan_config.parse(["--module", "llama3", "--config", "llama3_8b_mxfp8"])


@pytest.mark.parametrize("argv, said", [
  (["--optimizer.lr=1e-4"], "--optimizer.lr is how torchtitan 0.2 spelled it; torchtitan 0.3.0 writes "
                            "--optimizer.param-groups.0.optimizer-kwargs.lr=1e-4 (this recipe's flag: --lr=1e-4)."),
  (["--activation_checkpoint.mode", "full"], "torchtitan 0.3.0 writes the subcommand activation-checkpoint:full, written last "
                                             "(this recipe's flag: --remat (full; auto for selective; none))."),
  (["--profiling.enable_profiling"], "torchtitan 0.3.0 writes --profiler.enable_profiling (this recipe's flag: --profile=FIRST,LAST)."),
])
def test_an_older_torchtitans_spelling_is_answered_with_its_030_spelling_and_the_recipes_flag(argv, said):
  with pytest.raises(TorchOnTpuError) as err:
    titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", *argv])
  assert said in str(err.value)


def test_a_misspelled_config_is_answered_with_the_registrys_configs_and_its_nearest():
  with pytest.raises(TorchOnTpuError) as err:
    titan_config.parse(["--module", "qwen3", "--config", "qwen3_debugmodel_moe"])
  said = str(err.value)
  assert "no config 'qwen3_debugmodel_moe'; did you mean qwen3_moe_debug or qwen3_debugmodel_moe_param_groups?" in said
  assert said.endswith("qwen3_moe_debug, qwen3_moe_deepep, sft_qwen3_8b_math.") and "decoder_vocab_size" not in said, said


def test_the_last_module_and_config_written_are_the_ones_taken_as_torchtitan_takes_them():
  first = [m for m in ("qwen3_5", "kimi_k2_7") if importlib.util.find_spec("torchvision") is None] or ["qwen3"]
  config = titan_config.parse(["--module", first[0], "--config", "anything", "--module", "llama3", "--config", "llama3_debugmodel"])
  assert (config.model_spec.name, config.model_spec.flavor) == ("llama3", "debugmodel")


def test_options_torchtitans_pytorch_needs_and_this_run_does_not_are_each_said_not_read_past():
  config = titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", "--compile.enable", "--profiler.enable_profiling",
                               "--metrics.enable_tensorboard", "--parallelism.fsdp_reshard_after_forward=always",
                               "--override.imports", "torchtitan.overrides.fused_swiglu.fused_swiglu"])
  used = set()
  flags, notes = titan_config.to_flags(config, devices=8, used=used)
  said = "\n".join(notes)
  assert (flags["profile"], flags["profile_dir"]) == ("10,10,10", "./outputs/profiling/traces")  # where torchtitan writes its traces
  for field in ("compile.enable=True", "metrics.enable_tensorboard", "parallelism.fsdp_reshard_after_forward='always'",
                "override.imports torchtitan.overrides.fused_swiglu.fused_swiglu"):
    assert f"torchtitan's {field}" in said, (field, said)
  assert "pipeline_parallel_schedule" not in said  # the config's own schedule: said only with pipeline stages
  assert {"profiler.enable_profiling", "override.imports", "activation_checkpoint"} <= used


@pytest.mark.parametrize("argv, expected", [
  ([], dict(save_every=0)),
  (["--checkpoint.enable"], dict(save_every=10, last_save="full")),  # llama3_debugmodel keeps its last step whole
  (["--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype=bfloat16"], dict(last_save="model", last_save_dtype="bfloat16")),
  (["--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"], dict(last_save="hf")),
  (["--checkpoint.enable", "--checkpoint.exclude_from_loading", "lr_scheduler,dataloader,optimizer"], dict(resume_fresh="data,optimizer")),
  (["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"], dict(steps=0)),
])
def test_torchtitans_checkpoint_options_map_onto_what_the_recipe_saves_and_resumes(argv, expected):
  flags, _ = titan_config.to_flags(titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", *argv]), devices=8)
  assert {k: flags.get(k) for k in expected} == expected
  with pytest.raises(TorchOnTpuError, match=r"exclude_from_loading=optimizer: .*with the optimizer and lr_scheduler together"):
    titan_config.to_flags(titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", "--checkpoint.enable",
                                              "--checkpoint.exclude_from_loading", "optimizer"]), devices=8)


def test_override_imports_runs_the_users_module_and_applies_its_overrides(tmp_path, monkeypatch):
  """torchtitan users hook their code in by `--override.imports`: the module is imported and its
  `@override` applied, as torchtitan's trainer does; what it then changes is judged like any config
  (here a norm's eps: a model the registry's flavor is not); a module that does not import is one sentence."""
  (tmp_path / "my_hooks.py").write_text(
    "import dataclasses\n"
    "from torchtitan.config import override\n"
    "from torchtitan.models.common.nn_modules import RMSNorm\n"
    "@override(target=RMSNorm.Config, fqns=['*.norm'])\n"
    "def wider_eps(cfg):\n"
    "  return dataclasses.replace(cfg, eps=1e-3)\n"
  )
  (tmp_path / "needs_cuda.py").write_text("import flash_attn_interface  # noqa\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  config = titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports", "my_hooks.wider_eps"])
  assert config.model_spec.model.norm.eps == 1e-3
  with pytest.raises(TorchOnTpuError, match=r"changes llama3:debugmodel's model at model_spec\.model\.norm\.eps \(0\.001 instead of 1e-05\)"):
    titan_config.to_flags(config, devices=8)
  with pytest.raises(TorchOnTpuError, match=r"could not import its module \(it needs flash_attn_interface, not installed here"):
    titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports", "needs_cuda.fn"])


@pytest.mark.parametrize("argv, said", [
  (["--parallelism.context_parallel_degree=2", "--training.seq_len=66"],
   r"^error: --training\.seq_len=66 does not split into 2\*cp=4 equal chunks .* pick another --parallelism\.context_parallel_degree\.$"),
  (["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel_mtp", "--training.disable_cuda_graphs",
    "--parallelism.pipeline_parallel_degree=2"],
   r"multi-token prediction with --parallelism\.pipeline_parallel_degree=2 --parallelism\.context_parallel_degree=1: .*"
   r"use --parallelism\.pipeline_parallel_degree=1 --parallelism\.context_parallel_degree=1"),
])
def test_a_refusal_names_the_torchtitan_options_the_user_wrote_not_the_recipes_flags(argv, said, capsys):
  with pytest.raises(SystemExit):
    titan_recipe.command(["--module", "llama3", "--config", "llama3_debugmodel", *argv])
  err = capsys.readouterr().err.strip()
  assert re.search(said, err) and len(err.splitlines()) == 1, err


def test_a_check_torchtitans_config_makes_as_it_is_built_is_one_sentence_not_a_panel():
  """torchtitan's own checks (here: pipeline stages want CUDA graphs off, as its parser says on any
  machine) come out of tyro as a drawn panel; the recipe says them in one sentence."""
  with pytest.raises(TorchOnTpuError) as err:
    titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2"])
  assert str(err.value) == (
    "torchtitan refuses this config (--module llama3 --config llama3_debugmodel): Error parsing Config: CUDA graphs do not "
    "support pipeline parallelism yet. Set --training.disable_cuda_graphs."
  )


def test_param_groups_train_each_parameter_as_adamw_with_its_groups_lr_and_weight_decay():
  """torchtitan's `qwen3_debugmodel_moe_param_groups` (embeddings without weight decay, the router's
  gates by Adam at a lower lr, AdamW for the rest) maps onto --param_groups; each parameter then moves
  exactly as optax's AdamW alone would move it with its group's settings, on the one schedule."""
  import jax
  import jax.numpy as jnp
  import optax

  from recipes import runner

  config = titan_config.parse(["--module", "qwen3", "--config", "qwen3_debugmodel_moe_param_groups"])
  flags, _ = titan_config.to_flags(config, devices=8)
  groups = json.loads(flags["param_groups"])
  assert [(g["pattern"], g["lr"], g["weight_decay"]) for g in groups] == [
    (r"(?:tok_embeddings|output)\.", 8e-4, 0.0), (r"\.router\.gate\.", 1e-4, 0.0), (".*", 8e-4, 0.1)]
  run = titan_recipe.TorchtitanFlags(**{**flags, "warmup_steps": 2, "steps": 5})
  params = {name: jnp.full((3,), 1.0 + i) for i, name in enumerate(["tok_embeddings.weight", "layers.0.moe.router.gate.weight", "norm.weight"])}
  jm = types.SimpleNamespace(params=params, stored_layout=lambda: {})
  ours = runner._optimizer(run, jm, lora=False)
  alone = {name: optax.inject_hyperparams(optax.adamw)(learning_rate=warmup_stable_decay(
    g["lr"], 5, warmup_steps=2, decay_ratio=run.decay_ratio, decay=run.lr_decay, min_lr_factor=run.min_lr_factor),
    b1=g["beta1"], b2=g["beta2"], eps=g["eps"], weight_decay=g["weight_decay"]) for name, g in zip(params, groups)}
  state, states, want = ours.init(params), {n: alone[n].init(params[n]) for n in params}, dict(params)
  for step in range(4):
    grads = {n: jnp.asarray([0.3, -1.0, 2.0]) * (step + 1) * (i + 1) for i, n in enumerate(params)}
    updates, state = ours.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    for n in want:
      update, states[n] = alone[n].update(grads[n], states[n], want[n])
      want[n] = optax.apply_updates(want[n], update)
  for n in want:
    assert jax.numpy.allclose(params[n], want[n], rtol=1e-6, atol=1e-7), n


def test_a_multimodal_data_loader_is_refused_naming_the_familys_text_model():
  """Where torchvision imports, a config reaches torchtitan's MMDataLoader (images beside the text):
  one sentence, naming the family's text model (a stand-in loader class of that name here, where the
  registries' torchvision does not import beside the CPU torch)."""
  config = titan_config.parse(["--module", "llama3", "--config", "llama3_debugmodel"])
  loader = dataclasses.make_dataclass("Config", [])
  loader.__qualname__ = "MMDataLoader.Config"
  config.dataloader = loader()
  with pytest.raises(TorchOnTpuError, match=r"MMDataLoader feeds images beside the text .* --model=llama3:<flavor>\.$"):
    titan_config.to_flags(config, devices=8)
