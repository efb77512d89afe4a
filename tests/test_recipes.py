"""The recipes end to end on tiny configs, called in-process (the compile cache is shared):
train, resume, eval, dry run, a plan that does not fit, a run-time OOM, HF + LoRA, --help."""

import dataclasses
import json
import logging
import pathlib
import resource
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

import torch_on_tpu as tot
from recipes import cli, hf, llama3, runner
from recipes import flags as recipe_flags
from tests import helpers as h
from torch_on_tpu.io import checkpoint, data
from torch_on_tpu.lowering import remat as remat_lib
from torch_on_tpu.training import lora

ROOT = pathlib.Path(__file__).parent.parent
TINY = dict(seqlen=32, global_batch_size=8, lr=1e-2, warmup_steps=2, eval_batches=2)


def titan_flags(tmp_path, name="run", **kw):
  return llama3.Llama3Flags(log_dir=str(tmp_path / name), **{**TINY, **kw})


def losses(summary):
  return [r["loss"] for r in summary["records"] if "loss" in r]


def test_train_then_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
  full = llama3.run(titan_flags(tmp_path, "full", steps=8, save_every=4, eval_every=4, keep_checkpoints=1))
  log_dir = tmp_path / "full"
  printed = capsys.readouterr()
  assert "lr=" in printed.err  # the progress bar shows the learning rate
  assert printed.out.splitlines()[-4:] == [
    f"Run directory: {log_dir} (metrics.jsonl, TensorBoard)",
    f"Last checkpoint: {log_dir / 'ckpt' / '8'}",
    f"Plot: {log_dir / 'training.png'}",
    f"Export for transformers: .venv/bin/python tools/convert.py to_hf {log_dir / 'ckpt'} {log_dir / 'export'} "
    f"--model=llama3:debugmodel --tokenizer={log_dir / 'tokenizer'} --step=8",
  ]
  # train and eval loss fall; checkpoints, metrics.jsonl, the plot, the saved config
  assert np.mean(losses(full)[-3:]) < losses(full)[0] - 0.5
  assert full["final_eval_loss"] < full["start"]["eval_loss"] - 0.5
  assert sorted(p.name for p in (log_dir / "ckpt").iterdir() if p.name.isdigit()) == ["8"]  # --keep_checkpoints=1
  lines = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines if "loss" in r] == list(range(1, 9))
  assert [r["step"] for r in lines if "eval_loss" in r] == [0, 4, 8]  # from step 0: where the curve starts
  assert (log_dir / "training.png").stat().st_size > 0
  with checkpoint.Checkpointer(log_dir / "ckpt", read_only=True) as ckpt:
    ocp = checkpoint.training_state.ocp
    saved = ckpt._manager.restore(8, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  assert saved["config"]["steps"] == 8 and saved["config"]["ckpt_dir"] == str(log_dir / "ckpt")

  # preempted after step 3 (SIGTERM: save, stop), relaunched with the same flags:
  # continues at step 4 with the same losses
  with monkeypatch.context() as patch:
    patch.setattr(checkpoint.PreemptionGuard, "should_stop", lambda self, step: step == 3)
    stopped = llama3.run(titan_flags(tmp_path, "split", steps=8, save_every=4, eval_every=4))
  assert stopped["preempted"] and stopped["steps"] == 3
  assert "Stopped at step 3 by a signal: the same command resumes from it." in capsys.readouterr().out
  assert stopped["final_eval_loss"] is None and stopped["last_eval"]["step"] == 0  # not step 0's as the run's
  resumed = llama3.run(titan_flags(tmp_path, "split", steps=8, save_every=4, eval_every=4))
  assert resumed["start"]["step"] == 3
  assert losses(resumed) == losses(full)[3:]
  assert resumed["final_eval_loss"] == full["final_eval_loss"]


def test_a_small_corpus_trains_without_eval_and_a_finished_run_only_samples(tmp_path, monkeypatch, capsys):
  notes = tmp_path / "notes"
  notes.mkdir()
  for i in range(9):  # the README's --data='notes/*.txt': too few documents to hold one out for eval
    (notes / f"{i}.txt").write_text(f"Note {i}: the cat sat on the mat and looked at the {i} birds outside.\n")
  flags = dict(steps=1, data=str(notes / "*.txt"), sample="The cat")
  first = llama3.run(titan_flags(tmp_path, **flags))  # --eval_every at its default
  out = capsys.readouterr().out
  assert "No eval: 9 files under" in out and "training on all of it without eval (--eval_every=0 skips this look)" in out
  assert f"Sample: 'The cat' → {first['sample']!r}" in out
  assert first["sample"] and first["final_eval_loss"] is None  # greedy tokens decoded to text

  # relaunched with --sample: the saved weights are sampled; the train step is neither compiled nor run
  monkeypatch.setattr(tot.TrainStep, "compile", lambda *a: pytest.fail("compiled the train step"))
  monkeypatch.setattr(tot, "Trainer", lambda *a, **k: pytest.fail("ran the Trainer"))
  again = llama3.run(titan_flags(tmp_path, **flags))
  out = capsys.readouterr()
  assert "already holds step 1 of --steps=1; sampling from it.\n" in out.out and again["sample"] == first["sample"]
  assert "trained" not in out.out and "%|" not in out.err  # no training summary, no progress bar

  monkeypatch.setattr(runner, "_run", lambda *args: pytest.fail("built the model"))
  done = llama3.run(titan_flags(tmp_path, steps=1))  # relaunched after it finished, without --sample
  assert done["finished"] and done["last_step"] == 1
  assert capsys.readouterr().out.splitlines() == [
    f"Nothing to train: {tmp_path / 'run' / 'ckpt'} already holds step 1 of --steps=1; raise --steps to "
    "train further or pass another --ckpt_dir."
  ]


def test_resume_refuses_changed_state_flags_picks_a_step_and_starts_afresh_without_deleting(tmp_path, capsys):
  llama3.run(titan_flags(tmp_path, steps=4, save_every=2, eval_every=0))
  ckpt_dir = tmp_path / "run" / "ckpt"
  capsys.readouterr()
  for flag, saved, changed in (("dtype", "float32", "bfloat16-all"),):
    with pytest.raises(tot.TorchOnTpuError) as err:
      llama3.run(titan_flags(tmp_path, steps=6, eval_every=0, **{flag: changed}))
    assert str(err.value) == (
      f"The checkpoint at {ckpt_dir} was saved by a run of other settings (--{flag}={saved} there, --{flag}={changed} here); "
      f"resume it with the saved ones, or start afresh with --resume=False or another --ckpt_dir."
    )
    assert "Resumed" not in capsys.readouterr().out

  # --resume_step=2: step 4 is set aside (not deleted); metrics.jsonl keeps one record per step
  again = llama3.run(titan_flags(tmp_path, steps=4, save_every=2, eval_every=0, resume_step=2))
  assert again["start"]["step"] == 2
  assert "Resumed from step 2 of" in capsys.readouterr().out
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ["2", "4", "4.superseded"]
  logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]

  fresh = llama3.run(titan_flags(tmp_path, steps=1, eval_every=0, resume=False))
  assert fresh["start"]["step"] == 0
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ["1", "2.replaced", "4.replaced", "4.superseded"]


def test_dry_run_plans_and_compiles_without_allocating(tmp_path, capsys):
  out = llama3.run(titan_flags(tmp_path, dry_run=True, remat="full", grad_accum=2, fuse_head=True))
  printed = capsys.readouterr().out
  assert "Memory plan per device" in printed and "Compiled step" in printed and "GFLOP" in printed
  assert out["compile"].flops > 0 and out["compile"].peak_bytes > 0
  step = out["plan"]._context[0]
  assert step.fuse_head and "head fused with the loss" in printed and '"fuse_head": true' in printed
  assert all(type(v).__name__ == "ShapeDtypeStruct" for v in step.model.params.values())
  assert not (tmp_path / "run").exists()  # no checkpoint, no logs
  assert '"scan": true' in printed  # --scan's default, resolved for the CPU devices


def test_scan_defaults_to_what_is_faster_on_the_runs_devices(tmp_path, capsys, monkeypatch):
  """The layer loop on GPU (the scan's per-layer slice copies cost 6% of the step there), a scan on
  TPU and CPU (`test_dry_run_plans_and_compiles_without_allocating`); the resolved value is what the
  run config prints and what the model is built with."""
  assert (recipe_flags.default_scan("gpu"), recipe_flags.default_scan("tpu"), recipe_flags.default_scan("cpu")) == (False, True, True)
  assert recipe_flags.default_scan("gpu", pipeline=True)  # pipeline stages split the scan
  platforms = []
  monkeypatch.setattr(runner, "default_scan", lambda platform, pipeline: platforms.append(platform) or pipeline)
  out = llama3.run(titan_flags(tmp_path, dry_run=True))
  assert platforms == ["cpu"] and '"scan": false' in capsys.readouterr().out
  assert not any(".scan.layer." in name for name in out["plan"]._context[0].model.params)


def test_a_missing_wandb_login_stops_the_run_before_the_model_is_built(tmp_path, capsys, monkeypatch):
  """--wandb_project starts its run right after the mesh: without a login the recipe stops there in
  one sentence, not after a compile that can take minutes; offline, the run it started is the one
  the steps log to."""
  import wandb

  h.no_wandb_login(monkeypatch, tmp_path)
  with pytest.raises(tot.TorchOnTpuError, match=r"could not start .* run `wandb login`, or set WANDB_MODE=offline"):
    llama3.run(titan_flags(tmp_path, wandb_project="p"))
  printed = capsys.readouterr().out
  assert "Mesh" in printed and "Memory plan" not in printed and "Compiled" not in printed
  wandb.teardown()
  monkeypatch.setenv("WANDB_MODE", "offline")  # the run the recipe started gets every step's loss
  summary = llama3.run(titan_flags(tmp_path, "offline", wandb_project="p", steps=2, eval_every=0))
  assert summary["steps"] == 2
  (run_file,) = (tmp_path / "offline" / "wandb").glob("offline-run-*/run-*.wandb")
  assert run_file.stat().st_size > 0
  said = f"Weights & Biases run, offline: {run_file.parent}; upload it with: .venv/bin/python -m wandb sync {run_file.parent}"
  assert said in capsys.readouterr().out  # where it is, and the command that uploads it


def test_a_plan_that_does_not_fit_fails_with_one_suggestion(tmp_path):
  with pytest.raises(tot.TorchOnTpuError) as info:
    llama3.run(titan_flags(tmp_path, memory_gib=0.07, seqlen=64, global_batch_size=64, remat="dots_and_attention"))
  message = str(info.value)
  assert message.startswith("The step needs about") and "use --remat=full (recompute" in message  # the flag, not remat='full'
  assert message.count(". ") == 0 and message.endswith(".")


def test_an_out_of_memory_error_at_run_time_is_reported_with_the_plan(tmp_path, hf_dir, monkeypatch):
  def out_of_memory(self):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.\n<long XLA trace>")

  monkeypatch.setattr(tot.Trainer, "run", out_of_memory)
  with pytest.raises(tot.TorchOnTpuError, match=r"ran out of device memory \(RESOURCE_EXHAUSTED.*GiB per device.*compiled peak") as info:
    hf.run(hf.HFFlags(config=str(hf_dir), log_dir=str(tmp_path / "oom"), steps=1, **TINY))
  assert "long XLA trace" not in str(info.value)


def test_a_full_disk_reaching_the_recipe_is_a_storage_error_not_device_memory(tmp_path):
  config = {"log_dir": str(tmp_path / "log"), "ckpt_dir": str(tmp_path / "ckpt")}
  full = OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))
  message = runner._run_error_message(full, None, None, config)
  assert message.startswith(f"Could not write a file of the run to {tmp_path / 'metrics.jsonl'}: the filesystem is full (")
  tensorstore = ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device [os_error_code='28']")
  message = runner._run_error_message(tensorstore, None, None, config)
  assert "the log directory" in message and str(tmp_path / "ckpt") in message and "device memory" not in message
  assert runner._run_error_message(ValueError("shapes differ"), None, None, config) is None
  # A sentence the checkpointer already made (from a tensorstore error) is not made again with another path.
  try:
    try:
      raise tensorstore
    except ValueError:
      raise tot.TorchOnTpuError("Could not write checkpoint step 3 to /ckpt: the filesystem is full.") from None
  except tot.TorchOnTpuError as named:
    assert runner._run_error_message(named, None, None, config) is None


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny HF Llama: config.json and random weights in model.safetensors."""
  path = tmp_path_factory.mktemp("tiny-llama")
  config = transformers.LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
  )
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(path)
  return path


def test_hf_lora_trains_only_the_adapters_and_exports(tmp_path, hf_dir, caplog, capsys, recwarn):
  import peft
  from safetensors.torch import load_file

  pretrained = load_file(hf_dir / "model.safetensors")
  flags = hf.HFFlags(
    config=str(hf_dir), weights=str(hf_dir), lora_rank=4, log_dir=str(tmp_path / "lora"),
    steps=10, eval_every=10, scan=False, sample="The cat", **{**TINY, "lr": 1e-1},
  )
  with caplog.at_level(logging.INFO, logger="torch_on_tpu.training.generation"):
    summary = hf.run(flags)
  assert len(summary["sample"]) > 10 and "without the model's KV cache" not in caplog.text  # the cache served it
  assert np.mean(losses(summary)[-3:]) < losses(summary)[0]
  assert summary["final_eval_loss"] < summary["start"]["eval_loss"] - 0.03
  jm = summary["train_step"].model
  adapters = [k for k in jm.params if lora.is_adapter(k)]
  assert adapters and all(k in summary["train_step"].trainable for k in adapters)
  peft_names = {lora.base_name(n): n for n in jm.state_dict() if not lora.is_adapter(n)}
  for name, value in pretrained.items():  # the base is the pretrained weights, bit for bit
    np.testing.assert_array_equal(np.asarray(jm.array_for(peft_names[name])), value.numpy(), err_msg=name)
  lora_b = [np.asarray(jm.params[k]) for k in adapters if ".lora_B." in k]
  assert all(np.abs(b).max() > 0 for b in lora_b)  # B starts at zero; training moved it

  # The printed export command: the adapters merged into a model transformers loads, with
  # the run's own tokenizer beside it; --mode=adapter: a peft adapter for the pretrained base.
  printed = capsys.readouterr().out
  (count,) = [line for line in printed.splitlines() if line.startswith("trainable params: ")]  # as peft prints it
  trainable = sum(int(np.prod(jm.params[k].shape)) for k in adapters)
  assert count.startswith(f"trainable params: {trainable:,d} || all params: ") and trainable < 0.1 * sum(v.size for v in jm.params.values())
  assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]  # peft's transformers deprecation stays quiet
  command = [line for line in printed.splitlines() if "tools/convert.py to_hf" in line][0]
  args = command.split(".venv/bin/python tools/convert.py ")[1].split()
  convert = h.load_module(ROOT / "tools" / "convert.py")
  assert convert.main(args) == 0
  out = pathlib.Path(args[2])
  tokens = torch.randint(0, 256, (2, 16))
  want = np.asarray(jm(tokens, use_cache=False).logits.jax())
  assert convert.main(args) == 1  # again: the directory exists; the error names convert's flag
  assert capsys.readouterr().err.strip().endswith("already exists and is not empty; pick a new path or pass --overwrite.")
  assert "read only" not in caplog.text and "read_only=True" not in caplog.text  # orbax's notices on a read-only open
  merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert h.rel(merged(tokens).logits.detach().numpy(), want) < 1e-5  # fp32 on CPU: ‖Δ‖/‖ref‖
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer("hello")["input_ids"] == data.build_tokenizer(summary["tokenizer_dir"]).encode_batch(["hello"])[0]
  assert convert.main([*args[:2], str(tmp_path / "adapter"), *args[3:], "--mode=adapter"]) == 0
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
  adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  assert h.rel(adapted(tokens).logits.detach().numpy(), want) < 1e-5


def test_llama3_hf_impl_is_the_same_architecture():
  from torch_on_tpu.models.hf import build_causal_lm
  from torch_on_tpu.models.torchtitan import build_llama3

  titan = build_llama3("debugmodel")
  twin = build_causal_lm(llama3.hf_config("debugmodel"))
  count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
  assert count(titan) == count(twin)
  assert twin.config.rope_parameters["rope_type"] == "llama3"


def test_bad_flags_are_one_sentence_naming_the_flag_before_the_model_is_built(tmp_path, hf_dir, monkeypatch):
  monkeypatch.setattr(tot.ShardedModule, "__init__", lambda *a, **k: pytest.fail("built the model"))
  (tmp_path / "notes.jsonl").write_text('{"body": "some text"}\n')
  for flags, message in [
    (dict(model="8b"), "--model='8b' is not one of debugmodel, 1B, 3B, 8B, 70B, 405B; did you mean --model=8B?"),
    (dict(dtype="fp8"), "--dtype='fp8' is not one of float32, bfloat16, bfloat16-all; pick one of those."),
    (dict(remat="bogus"), f"--remat: 'bogus' is not one of auto, {', '.join(remat_lib.NAMES)}, nor what each layer keeps by module "
                          "name (save:<globs> and/or offload:<globs> joined by '+', e.g. offload:input,attention.wo); pick one of those."),
    (dict(remat="offload:input+save:input"), "--remat: The remat policy 'offload:input+save:input' both saves and offloads input; name each once."),
    (dict(seqlen=0), "--seqlen=0 is below its minimum of 1; give 1 or more."),
    (dict(max_skips=-1), "--max_skips=-1 is below its minimum of 0; give 0 or more."),
    (dict(data=str(tmp_path / "notes/*.txt")), f"--data: Data glob '{tmp_path}/notes/*.txt' matches no files; check the pattern and the directory."),
    (dict(data=str(tmp_path / "notes.jsonl")), f"--data: JSONL file '{tmp_path}/notes.jsonl' has no field 'text' (a record has fields ['body']); name one of those with --data_field."),
    (dict(profile="a"), "--profile: 'a' is not FIRST,LAST (or FIRST,LAST,EVERY) step numbers; write e.g. --profile=10,12."),
    (dict(resume_step=2, resume=False), "--resume_step needs --resume=True; drop one of the two."),
    (dict(global_batch_size=6, grad_accum=4), "--global_batch_size=6 does not divide into --grad_accum=4 microbatches; make the batch a multiple of 4."),
    (dict(global_batch_size=6), "--global_batch_size=6 does not split over the 8 data devices (fsdp=8); use a multiple of 8, e.g. --global_batch_size=8."),
    (dict(fsdp=64, tp=4), "--fsdp=64 --tp=4 needs 256 devices but 8 are available; make the axis sizes multiply to 8 or use -1 on one axis, or simulate 256 CPU devices with --cpu_devices=256."),
    (dict(attention="none"), "--attention=none leaves attention to torchax's own SDPA lowering, which cannot run torchtitan's flex attention; add --titan_attention=sdpa (plain causal attention) or pick an --attention kernel."),
    (dict(cpu_devices=3), "--cpu_devices=3 but jax already started with 8 cpu devices in this process; run the recipe in a fresh process."),
  ]:
    with pytest.raises(tot.TorchOnTpuError) as info:
      llama3.run(titan_flags(tmp_path, **flags))
    assert str(info.value) == message
  for flags, message in [
    (dict(config="gpt2"), "--config: 'gpt2' does not exist (recipes.hf reads local files and fetches no hub names: download the model first, e.g. `hf download gpt2 --local-dir models/gpt2`, and pass that directory); pass a config.json or a directory holding one."),
    (dict(config="meta-llama/Llama-3.2-1B"), "--config: 'meta-llama/Llama-3.2-1B' does not exist (recipes.hf reads local files and fetches no hub names: download the model first, e.g. `hf download meta-llama/Llama-3.2-1B --local-dir models/meta-llama--Llama-3.2-1B`, and pass that directory); pass a config.json or a directory holding one."),
    (dict(config="./models/missing"), "--config: './models/missing' does not exist; pass a config.json or a directory holding one."),
    (dict(), "--config: recipes.hf needs it: a config.json or a model directory holding one."),
    (dict(config=str(tmp_path)), f"--config: directory '{tmp_path}' has no config.json; point at the file or its directory."),
    (dict(config=str(hf_dir), lora_rank=-1), "--lora_rank=-1 is below its minimum of 0; give 0 or more."),
  ]:
    with pytest.raises(tot.TorchOnTpuError) as info:
      hf.run(hf.HFFlags(**flags))
    assert str(info.value) == message


def test_library_errors_name_the_flag_that_sets_their_argument(tmp_path):
  """`errors.spoken_as_flags`: the recipe maps call arguments to its flags (--data_field sets field=)."""
  from torch_on_tpu import errors

  (tmp_path / "notes.jsonl").write_text('{"body": "some text"}\n')
  corpus = str(tmp_path / "notes.jsonl")
  with pytest.raises(tot.TorchOnTpuError, match=r"has no field 'text' \(a record has fields \['body'\]\); name one of those with field\.$"):
    data.source(corpus).read(0)
  with errors.spoken_as_flags(recipe_flags.flag_spelling(hf.HFFlags)):
    with pytest.raises(tot.TorchOnTpuError, match=r"name one of those with --data_field\.$"):
      data.source(corpus).read(0)
    assert errors.args({"fsdp": 4, "scan": False, "remat": "full", "overwrite": True}) == "--fsdp=4 --scan=false --remat=full overwrite=True"
    assert not errors.settable("val_fraction") and errors.settable("eval_every")
    assert errors.arg("targets", ["q_proj", "v_proj"]) == "--lora_targets=q_proj,v_proj"  # flag(argument="targets")
  assert errors.args({"fsdp": 4, "scan": False}) == "fsdp=4, scan=False"  # Python again outside


def _child_cpu_seconds(argv):
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_start_up_checks_stop_a_bad_batch_within_seconds_before_anything_is_built():
  """In a fresh process the check that needs the devices (the batch over them) still comes
  before the model: it costs what importing torch and jax costs (3.1 s of CPU against 3.6 s for
  that import, measured beside it, on an idle 2-core machine; building and compiling the model:
  17.7 s). Under CI's load one CPU measure ran 1.3x the other (4.3 s against 3.3 s), so the
  bound is twice the import plus a second, still well short of a build."""
  _, import_seconds = _child_cpu_seconds(["-c", "import torch, jax, torch_on_tpu.core._compat; jax.devices()"])
  done, cpu_seconds = _child_cpu_seconds(["-m", "recipes.llama3", "--global_batch_size=6", "--cpu_devices=4"])
  assert done.returncode == 1 and "Run config" not in done.stdout and "Mesh" not in done.stdout
  assert done.stderr.strip().splitlines()[-1] == (
    "error: --global_batch_size=6 does not split over the 4 data devices (fsdp=4); use a multiple of 4, e.g. --global_batch_size=8."
  )
  assert cpu_seconds < 2 * import_seconds + 1, (cpu_seconds, import_seconds)


def test_help_lists_every_flag_with_its_default():
  done = subprocess.run(
    [sys.executable, "-m", "recipes.llama3", "--help"], cwd=ROOT, capture_output=True, text=True,
    env={"PAGER": "cat", "PATH": "/usr/bin:/bin"}, timeout=120,
  )
  out = done.stdout + done.stderr  # fire writes help to stderr when it is not a terminal
  for field in dataclasses.fields(llama3.Llama3Flags):
    assert f"--{field.name}=" in out, field.name
    assert field.metadata["help"].split(" (")[0][:30] in " ".join(out.split())
  assert "Default: 'debugmodel'" in out and "Default: 128" in out


def test_command_line_mistakes_exit_2_in_one_sentence_before_anything_is_built():
  done = subprocess.run(
    [sys.executable, "-m", "recipes.llama3", "--seqln=512", "--steps=3"], cwd=ROOT, capture_output=True,
    text=True, timeout=120,
  )
  assert done.returncode == 2
  assert done.stderr.strip() == "error: Unknown flag --seqln; did you mean --seqlen?"
  for argv, message in [
    (["--scan=maybe"], "--scan=maybe is not a boolean"),
    (["--steps=3.5"], "--steps=3.5 is not an integer"),
    (["--lr", "fast"], "--lr=fast is not a number"),
    (["train"], "Unexpected argument 'train'"),
  ]:
    with pytest.raises(cli.FlagError, match=message):
      cli.parse_argv(argv, llama3.Llama3Flags)
  with pytest.raises(cli.FlagError, match="Unknown flag --lora_rnak; did you mean --lora_rank"):
    cli.parse_argv(["--lora_rnak=4"], hf.HFFlags)
  # another recipe's flag is named as that recipe's, not answered with this one's nearest name
  with pytest.raises(cli.FlagError, match=r"Unknown flag --lora_rank; it is a flag of python -m recipes.hf and python -m recipes.torchtitan, not of this recipe.$"):
    cli.parse_argv(["--lora_rank=8"], llama3.Llama3Flags)
  with pytest.raises(cli.FlagError, match=r"--mtp_layers; it is a flag of python -m recipes.torchtitan, not"):
    cli.parse_argv(["--mtp_layers=1"], hf.HFFlags)


def test_flags_reach_the_recipe_with_their_types():
  seen = []
  main = cli.cli(hf.HFFlags, seen.append, "test")
  cli.fire_main(main, ["--scan=false", "--noresume", "--global-batch-size", "4", "--lora_targets=q_proj,v_proj", "--data=None", "--lr=1e-3"])
  flags = seen[0]
  assert (flags.scan, flags.resume, flags.global_batch_size) == (False, False, 4)
  assert (flags.lora_targets, flags.data, flags.lr) == ("q_proj,v_proj", None, 1e-3)


def test_compile_cache_is_on_by_default_and_can_be_turned_off(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  recipe = runner.Recipe(name="r", build=None, family="titan")
  assert runner.resolve(llama3.Llama3Flags(), recipe)["compile_cache"] == str(tmp_path / "torch_on_tpu" / "jax")
  assert runner.resolve(llama3.Llama3Flags(compile_cache="off"), recipe)["compile_cache"] is None
  assert runner.resolve(llama3.Llama3Flags(compile_cache="none"), recipe)["compile_cache"] is None
  session = jax.config.jax_compilation_cache_dir  # the test session's own cache (conftest)
  assert runner._use_compile_cache(str(tmp_path / "c")) == session  # a cache already chosen wins
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    assert runner._use_compile_cache(str(tmp_path / "c")) == str(tmp_path / "c")
  finally:
    jax.config.update("jax_compilation_cache_dir", session)
