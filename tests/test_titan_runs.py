"""torchtitan's own commands through `python -m recipes.torchtitan`, run as torchtitan runs them:
reruns in one dump folder, checkpoints (model-only, in an export dtype, in HF form), warm starts
from a run's own steps, profiler traces and TensorBoard; and a slice of torchtitan's integration
cases (tools/titan_integration.py, whose whole list is one command)."""

import json
import pathlib
import re
import subprocess

import orbax.checkpoint as ocp
import pytest

from recipes import torchtitan as titan_recipe
from tests import helpers as h

pytestmark = pytest.mark.compile_bound

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["--training.seq_len=64", "--training.local_batch_size=1"]  # 8 rows a step on the suite's 8 devices


def run(capsys, dump, *overrides, steps=2, config=("llama3", "llama3_debugmodel")):
  """One torchtitan command in `dump`: (its stdout, its losses by step, its eval losses by step)."""
  titan_recipe.command(["--module", config[0], "--config", config[1], *SMALL, f"--training.steps={steps}",
                        f"--dump_folder={dump}", *overrides])
  records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
  return (capsys.readouterr().out, {r["step"]: r["loss"] for r in records if "loss" in r},
          {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r})


def refusal(capsys, dump, *overrides, steps=2, config=("llama3", "llama3_debugmodel")) -> str:
  """The one line a command that cannot run says on stderr (its exit status nonzero)."""
  with pytest.raises(SystemExit) as stop:
    run(capsys, dump, *overrides, steps=steps, config=config)
  err = capsys.readouterr().err.strip()
  assert stop.value.code != 0 and len(err.splitlines()) == 1 and "Traceback" not in err, err
  return err


def test_a_rerun_without_checkpointing_trains_afresh_and_writes_traces_and_tensorboard(tmp_path, capsys):
  """torchtitan's default (checkpoint.enable off) keeps no checkpoint: a second run in the same dump
  folder trains from scratch, the same losses again; the profiler's traces land where torchtitan
  writes its own (`profiling/traces/iteration_<step>`), the TensorBoard scalars beside metrics.jsonl."""
  observe = ["--profiler.enable_profiling", "--profiler.profile_freq=2", "--profiler.profiler_warmup=0", "--metrics.enable_tensorboard"]
  said, first, _ = run(capsys, tmp_path, *observe)
  assert "torchtitan's checkpoint.enable=False: as in torchtitan, no checkpoint is resumed or saved" in said
  assert "No checkpoint saved" in said and not (tmp_path / "checkpoint").exists()
  assert list((tmp_path / "profiling" / "traces" / "iteration_2").rglob("*.xplane.pb"))
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  said, again, _ = run(capsys, tmp_path, "--compile.enable")
  assert "Nothing to train" not in said and again == pytest.approx(first, abs=1e-6)
  assert "torchtitan's compile.enable=True: read past, the step is always one compiled XLA program" in said


def test_the_hf_round_trip_starts_where_the_saved_run_ended_and_so_does_its_own_orbax_step(tmp_path, capsys):
  """torchtitan's HF round trip: a run saving its last step model-only in HF form
  (`last_save_in_hf`), a new run starting from it (`initial_load_in_hf`): the new run's first
  loss, on the held-out batches before its first step, is the saved run's at its last step. The
  run's own orbax step (`initial_load_path=<run>/checkpoint/2`) starts it the same."""
  validate = ["--validator.enable", "--validator.freq=2", "--validator.steps=2"]
  saved = tmp_path / "saved"
  _, _, saved_evals = run(capsys, saved, "--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf", *validate)
  step = saved / "checkpoint" / "2"
  assert "opt_state" not in (step / "state" / "_METADATA").read_text()  # the weights alone, as torchtitan's last step
  hf = saved / "checkpoint" / "step-2"
  assert (hf / "model.safetensors.index.json").is_file() and json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
  _, _, from_hf = run(capsys, tmp_path / "from_hf", f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_in_hf", *validate, steps=1)
  _, _, from_orbax = run(capsys, tmp_path / "from_orbax", f"--checkpoint.initial_load_path={step}", *validate, steps=1)
  assert from_hf[0] == pytest.approx(saved_evals[2], abs=1e-5) and from_orbax[0] == pytest.approx(saved_evals[2], abs=1e-5)
  assert abs(saved_evals[0] - saved_evals[2]) > 1e-3  # it trained: where the new runs start is not the init


def test_a_model_only_last_step_in_bf16_holds_bf16_weights_and_a_rerun_is_refused_naming_what_differs(tmp_path, capsys):
  """`last_save_model_only` with `export_dtype bfloat16`: the last step holds the weights alone, in
  bf16. A rerun of another config in that folder is refused naming every setting that differs; one
  asking for more steps cannot resume the weights alone (torchtitan cannot either) and says how to
  start from them, in torchtitan's own option."""
  run(capsys, tmp_path, "--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype=bfloat16")
  tree = ocp.PyTreeCheckpointer().metadata(tmp_path / "checkpoint" / "2" / "state").item_metadata.tree
  assert set(tree) == {"params", "buffers"} and {str(m.dtype) for m in tree["params"].values()} == {"bfloat16"}
  err = refusal(capsys, tmp_path, "--checkpoint.enable", "--training.mixed_precision_param=float32", config=("qwen3", "qwen3_debugmodel"), steps=3)
  assert re.search(r"saved by a run of other settings \(--model=llama3:debugmodel there, --model=qwen3:debugmodel here; "
                   r"--dtype=bfloat16 there, --dtype=float32 here\)", err), err
  err = refusal(capsys, tmp_path, "--checkpoint.enable", steps=3)
  assert "holds the model's weights alone" in err and f"--checkpoint.initial_load_path={tmp_path}/checkpoint/2" in err, err


def test_a_seed_checkpoint_is_the_initial_weights_as_step_0(tmp_path, capsys):
  titan_recipe.command(["--module", "llama3", "--config", "llama3_debugmodel", *SMALL, f"--dump_folder={tmp_path}",
                        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"])
  assert (tmp_path / "checkpoint" / "0" / "state").is_dir() and not (tmp_path / "metrics.jsonl").exists()


def test_sft_trains_on_the_answers_of_its_chat_data(tmp_path, capsys, monkeypatch):
  """torchtitan's `sft_debugmodel` (ChatDataLoader over its repository's tests/assets/sft_test/data.json,
  whose stand-in this repository ships at the same path): chat data, the loss on the answers only."""
  monkeypatch.chdir(ROOT)  # the config names its data relative to the repository's root
  said, losses, _ = run(capsys, tmp_path, steps=3, config=("llama3", "sft_debugmodel"))
  assert "torchtitan's ChatDataLoader: chat data from 'tests/assets/sft_test/data.json'" in said
  assert "--data_format=chat --data_field=user:question,assistant:answer" in said
  assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]


# torchtitan's integration cases the suite runs (the whole list: tools/titan_integration.py): a
# rerun in one dump folder with another config and layout, profiling with TensorBoard, a refusal.
SLICE = ("2d_eager", "muse_glimmer_mm_fsdp+tp+sp")


def test_a_slice_of_torchtitans_integration_cases_trains_at_plain_fsdps_losses_or_is_refused(tmp_path):
  tool = h.load_module("tools/titan_integration.py")
  cases = {c.name: c for c in tool.CASES}
  references: dict = {}
  verdicts = {name: tool.run_case(cases[name], tmp_path, references) for name in SLICE}
  assert [o.verdict for o in verdicts["2d_eager"]] == ["trained", "trained"], verdicts["2d_eager"]
  assert all(o.losses for o in verdicts["2d_eager"])
  (multimodal,) = verdicts["muse_glimmer_mm_fsdp+tp+sp"]
  assert multimodal.verdict == "refused" and "trains language models on text or chat data only" in multimodal.reason


def test_the_commands_a_run_prints_run_pasted_into_a_fresh_shell_at_the_repo_root(tmp_path):
  """What a torchtitan command prints to paste (the same run in the recipe's flags, the export, the
  help a mistyped override points to) runs in a shell that has neither the venv on PATH nor the
  repo on PYTHONPATH, and says nothing of libtpu's start-up."""
  fresh = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
  run = [".venv/bin/python", "-m", "recipes.torchtitan", "--module", "llama3", "--config", "llama3_debugmodel", *SMALL,
         "--training.steps=2", "--checkpoint.enable", f"--dump_folder={tmp_path / 'run'}", "--cpu_devices=8"]
  first = subprocess.run(run, cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-2000:]
  said = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in first.stdout.splitlines() if ": " in line}
  for what, expect in [("The same run in this recipe's flags", "Nothing to train"), ("Export for transformers", "wrote step 2")]:
    pasted = subprocess.run(["bash", "-c", said[what]], cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=600)
    out = pasted.stdout + pasted.stderr
    assert pasted.returncode == 0 and expect in out, f"{said[what]}:\n{out[-2000:]}"
    assert not h.libtpu_start_up_lines(out), out
  mistyped = subprocess.run([*run[:7], "--training.stepz=3"], cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=600)
  said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", mistyped.stderr).split())  # tyro's panel, its box drawn away
  (help_command,) = re.findall(r"run (\S+ -m recipes\.torchtitan .*? --help)", said)
  pasted = subprocess.run(["bash", "-c", help_command], cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=600)
  assert pasted.returncode == 0 and "--training.steps" in pasted.stdout, f"{help_command}:\n{pasted.stderr[-2000:]}"
