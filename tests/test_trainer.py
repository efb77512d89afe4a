"""Trainer: logs (JSONL, TensorBoard, PNG, profile), eval, the NaN guard, and the
checkpoint / preemption hooks."""

import json
import types

import numpy as np
import optax
import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.training import metrics
from torch_on_tpu.training import trainer as trainer_lib

VOCAB = 512


class Tiny(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.emb = torch.nn.Embedding(VOCAB, 64)
    self.out = torch.nn.Linear(64, VOCAB)

  def forward(self, tokens):
    return self.out(self.emb(tokens))


def ce_loss(out, labels):
  return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())


def make_step(loss_fn=ce_loss, lr=1e-2, **kw):
  with torch.device("meta"):
    model = Tiny()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1))
  return tot.make_train_step(jm, loss_fn, optax.adamw(lr), **kw)


class Batches:
  """A resumable iterator of numpy batches, like the data pipeline's."""

  def __init__(self, seed=0):
    self.rng = np.random.default_rng(seed)
    self.served = 0

  def __iter__(self):
    return self

  def __next__(self):
    self.served += 1
    ids = self.rng.integers(0, VOCAB, (8, 17))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

  def state(self):
    return {"served": self.served}


class RecordingCheckpointer:
  """Saves every `every` steps; records what it was given."""

  def __init__(self, every):
    self.every = every
    self.saves = []
    self.waited = False

  def should_save(self, step):
    return step % self.every == 0

  def save(self, step, state, *, data, config, force):
    assert int(state["step"]) == step and config is None
    self.saves.append((step, data, force))

  def wait(self):
    self.waited = True


def test_trainer_writes_jsonl_tensorboard_png_and_a_profile(tmp_path, capsys):
  step = make_step()
  validation = [next(Batches(seed=99)) for _ in range(2)]
  trainer = tot.Trainer(
    step,
    Batches(),
    steps=6,
    log_dir=tmp_path,
    eval_data=validation,
    eval_every=4,
    profile_steps=(2, 3),
    flops_per_token=6 * 2 * VOCAB * 64,
    peak_flops=1e12,
    progress=False,
  )
  summary = trainer.run()

  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
  assert {"loss", "grad_norm", "step_time", "tokens_per_second", "mfu"} <= set(train[0])
  assert train[-1]["loss"] < train[0]["loss"]
  assert train[2]["tokens_per_second"] == pytest.approx(8 * 16 / train[2]["step_time"])
  assert [r["step"] for r in records if "eval_loss" in r] == [0, 4, 6]  # at the start, every 4, at the end
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))
  assert summary["steps"] == 6 and summary["final_loss"] == train[-1]["loss"]
  assert summary["median_mfu"] > 0 and summary["compile_seconds"] > 0
  assert "trained 6 steps" in capsys.readouterr().out


def test_wandb_gets_every_logged_metric_offline_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch):
  """Weights & Biases offline (`WANDB_MODE=offline`, as a machine without its login runs it): the run
  is written under log_dir/wandb, every logged value in its file, and a second Trainer over the same
  log_dir continues the same run id (its file grows)."""
  import wandb

  wandb.teardown()  # wandb keeps the settings of an earlier run in this process
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # log_dir wins over wandb's own default
  step = make_step()
  trainer = tot.Trainer(step, Batches(), steps=3, log_dir=tmp_path, progress=False,
                        wandb=dict(project="tot-test", config={"lr": 1e-3}))
  trainer.run()
  (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
  written = run_file.read_bytes()
  losses = [r["loss"] for r in trainer.records if "loss" in r]
  assert len(losses) == 3 and all(json.dumps(v).encode() in written for v in losses), losses
  assert b"tot-test" in written and b"grad_norm" in written
  again = tot.Trainer(step, Batches(seed=7), steps=5, log_dir=tmp_path, progress=False, wandb=dict(project="tot-test"))
  again.run()
  runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
  assert {r.name for r in runs} == {run_file.name}  # the same run id
  later = [r["loss"] for r in again.records if "loss" in r]
  assert all(json.dumps(v).encode() in b"".join(r.read_bytes() for r in runs) for v in later)
  assert not (tmp_path / "elsewhere").exists()


def test_wandb_without_a_login_is_one_sentence_naming_the_two_ways_on(tmp_path, monkeypatch):
  h.no_wandb_login(monkeypatch, tmp_path)
  with pytest.raises(tot.TorchOnTpuError, match=r"could not start .* run `wandb login`, or set WANDB_MODE=offline to keep"):
    metrics.RunLog(tmp_path / "run", wandb=dict(project="p"))


def loss_with_scale(out, labels):
  return ce_loss(out, labels["targets"]) * labels["scale"].mean()


def nan_at(*bad_steps):
  """Batches and a split_batch that make the loss NaN at `bad_steps`."""

  def split(batch):
    scale = np.full((8,), np.nan if batch["step"] in bad_steps else 1.0, np.float32)
    return batch["input_ids"], {"targets": batch["labels"], "scale": scale}

  def batches():
    data = Batches()
    for i in range(1, 100):
      yield {**next(data), "step": i}

  return batches(), split


def test_nan_loss_stops_with_the_step_and_saves_nothing_after_it():
  data, split = nan_at(5)
  checkpointer = RecordingCheckpointer(every=2)
  trainer = tot.Trainer(
    make_step(loss_with_scale), data, steps=10, split_batch=split, checkpointer=checkpointer, progress=False
  )
  with pytest.raises(tot.TorchOnTpuError, match=r"Step 5 made the training state non-finite \(loss nan.*newest saved step is 4;"):
    trainer.run()
  assert [s for s, _, _ in checkpointer.saves] == [2, 4]
  assert checkpointer.waited
  assert [r["step"] for r in trainer.records] == [1, 2, 3, 4]


def test_an_update_that_overflows_the_params_is_never_saved():
  """lr=1e39: step 1's loss is finite but its update makes the params Inf/NaN."""
  checkpointer = RecordingCheckpointer(every=1)
  step = make_step(lr=1e39)
  with pytest.raises(tot.TorchOnTpuError, match="Step 1 made the training state non-finite.*no checkpoint was saved"):
    tot.Trainer(step, Batches(), steps=4, checkpointer=checkpointer, progress=False).run()
  assert checkpointer.saves == []

  # Skipping keeps the state for a non-finite loss or gradient; an update gone non-finite from
  # finite ones would recur at every step, so the run stops at it, unsaved.
  step = make_step(lr=1e39, skip_nonfinite=True)
  with pytest.raises(tot.TorchOnTpuError, match=r"Step 1's update made the training state non-finite from a finite loss .* stopped without saving it, no checkpoint was saved by this run; check the learning rate"):
    tot.Trainer(step, Batches(), steps=10, checkpointer=checkpointer, max_skips=3, progress=False).run()
  assert checkpointer.saves == []


def test_a_skipped_nan_batch_leaves_the_state_and_the_run_goes_on():
  data, split = nan_at(3)
  step = make_step(loss_with_scale, skip_nonfinite=True)
  reference = make_step(loss_with_scale)
  trainer = tot.Trainer(step, data, steps=5, split_batch=split, progress=False)
  assert trainer.run()["steps"] == 5
  assert [r["skipped"] for r in trainer.records] == [0, 0, 1, 0, 0]
  ref_data, ref_split = nan_at()
  batches = [next(ref_data) for _ in range(5)]
  for i, batch in enumerate(batches):
    if i != 2:  # the reference never sees the bad batch
      reference(*ref_split(batch))
  for k, v in step.model.params.items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(reference.model.params[k]))


def test_checkpoints_on_cadence_and_at_the_end_with_the_data_state():
  checkpointer = RecordingCheckpointer(every=3)
  summary = tot.Trainer(make_step(), Batches(), steps=7, checkpointer=checkpointer, progress=False).run()
  assert checkpointer.saves == [
    (3, {"served": 3}, False),
    (6, {"served": 6}, False),
    (7, {"served": 7}, True),
  ]
  assert not summary["preempted"]


def test_a_stop_request_saves_and_returns_preempted():
  checkpointer = RecordingCheckpointer(every=100)
  step = make_step()
  summary = tot.Trainer(
    step, Batches(), steps=50, checkpointer=checkpointer, stop_requested=lambda s: s == 4, progress=False
  ).run()
  assert summary["preempted"] and summary["steps"] == 4 == step.step_count
  assert checkpointer.saves == [(4, {"served": 4}, True)]


def test_resumed_trainer_continues_from_the_step_count():
  step = make_step()
  tot.Trainer(step, Batches(), steps=3, progress=False).run()
  trainer = tot.Trainer(step, Batches(), steps=5, progress=False)
  assert trainer.run()["steps"] == 5
  assert [r["step"] for r in trainer.records] == [4, 5]


def test_a_profile_window_repeats_every_k_steps_each_into_its_iteration_folder(tmp_path):
  """torchtitan's profiler cadence (`profile_freq`): the window (here one step) again every 2 steps,
  each trace in `iteration_<its last step>`, where torchtitan puts its own."""
  tot.Trainer(make_step(), Batches(), steps=5, log_dir=None, profile_steps=(2, 2), profile_every=2, profile_dir=tmp_path, progress=False).run()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["iteration_2", "iteration_4"]
  assert all(list(p.rglob("*.xplane.pb")) for p in tmp_path.iterdir())


def test_default_split_needs_input_ids_and_labels():
  step = make_step()
  with pytest.raises(tot.TorchOnTpuError, match="'input_ids' and 'labels'"):
    tot.Trainer(step, iter([{"tokens": np.zeros((8, 16))}]), steps=1, progress=False).run()
  with pytest.raises(tot.TorchOnTpuError, match="log_dir or profile_dir"):
    tot.Trainer(step, [], steps=1, profile_steps=(1, 2))


def test_resume_through_the_checkpoint_module_continues_exactly(tmp_path):
  from torch_on_tpu.io.checkpoint import Checkpointer

  log = tmp_path / "log"
  with Checkpointer(tmp_path / "ckpt", save_every=2) as ckpt:
    first = tot.Trainer(
      make_step(), Batches(), steps=4, log_dir=log, checkpointer=ckpt, run_config={"lr": 1e-2}, progress=False
    )
    first.run()
    losses = [r["loss"] for r in first.records]

  step = make_step()
  with Checkpointer(tmp_path / "ckpt", save_every=2) as ckpt:
    restored = ckpt.restore(step.abstract_state(), step=2)
    step.state = restored.state
    data = Batches()
    for _ in range(restored.data["served"]):
      next(data)
    resumed = tot.Trainer(step, data, steps=4, log_dir=log, checkpointer=ckpt, progress=False)
    resumed.run()
  assert restored.config == {"lr": 1e-2} and step.step_count == 4
  assert [r["loss"] for r in resumed.records] == losses[2:]
  # metrics.jsonl: one record per step; the first run's steps 3-4 kept aside
  logged = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged] == [1, 2, 3, 4]
  assert [r["loss"] for r in logged] == losses
  assert [json.loads(x)["step"] for x in (log / "metrics.jsonl.after-2").read_text().splitlines()] == [1, 2, 3, 4]


def test_mfu_is_shown_against_a_datasheet_peak_never_against_a_cpu_guess(monkeypatch):
  step = types.SimpleNamespace(model=types.SimpleNamespace(mesh=tot.make_mesh(fsdp=8)), step_count=0)
  monkeypatch.setattr(metrics, "cpu_matmul_peak", lambda **k: pytest.fail("measured a CPU peak"))
  assert tot.Trainer(step, [], steps=1, flops_per_token=1e6, progress=False)._mfu(200, 16) is None
  given = tot.Trainer(step, [], steps=1, flops_per_token=1e6, peak_flops=1e9, progress=False)
  assert given._mfu(tokens_per_second=200, seqlen=16) == pytest.approx(0.2)  # a given peak is used as given
  tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v6 lite")
  on_tpu = types.SimpleNamespace(model=types.SimpleNamespace(mesh=types.SimpleNamespace(devices=np.array([tpu] * 8))), step_count=0)
  trainer = tot.Trainer.__new__(tot.Trainer)  # only the MFU bookkeeping: no devices of that kind here
  trainer.train_step, trainer.flops_per_token, trainer.peak_flops = on_tpu, 1e6, None
  assert trainer._mfu(tokens_per_second=1e8, seqlen=16) == pytest.approx(1e14 / (8 * metrics.peak_flops_for_kind("TPU v6 lite")))


def test_a_preempted_run_does_not_report_an_older_eval_as_its_eval_loss():
  summary = {"steps": 3, "preempted": True, "final_loss": 5.0, "final_eval_loss": None,
             "last_eval": {"step": 0, "loss": 8.1}, "median_tokens_per_second": None, "median_mfu": None,
             "compile_seconds": 1.0}
  assert trainer_lib.summary_line(summary) == "preempted after 3 steps, final loss 5.0000, last eval loss 8.1000 (step 0), compile 1.0 s"


def test_a_token_id_outside_the_vocabulary_is_named_before_the_step():
  step = make_step()
  batches = [next(Batches()) for _ in range(3)]
  batches[1]["input_ids"][2, 5] = VOCAB + 7
  batches[2]["labels"][0, 0] = -100  # ignored by cross_entropy: fine
  before = {k: np.asarray(v) for k, v in step.model.params.items()}
  trainer = tot.Trainer(step, iter(batches), steps=3, progress=False)
  with pytest.raises(tot.TorchOnTpuError) as err:
    trainer.run()
  assert str(err.value) == (
    f"The batch for step 2 holds token id {VOCAB + 7} at input_ids[2, 5], outside the model's vocabulary "
    f"of {VOCAB}; check that the tokenizer and the data match the model."
  )
  assert step.step_count == 1 and not np.array_equal(np.asarray(step.model.params["out.weight"]), before["out.weight"])


def test_a_state_non_finite_before_the_first_step_is_refused():
  """An lr past float32's range, kept in the optimizer state, would make every step a skip of a NaN state."""
  with torch.device("meta"):
    model = Tiny()
  jm = tot.ShardedModule(model, mesh=tot.make_mesh(fsdp=-1))
  step = tot.make_train_step(jm, ce_loss, optax.inject_hyperparams(optax.adamw)(learning_rate=1e39), skip_nonfinite=True)
  checkpointer = RecordingCheckpointer(every=1)
  with pytest.raises(tot.TorchOnTpuError, match=r"holds NaN or Inf before step 1 \(1 arrays, e.g. opt_state/hyperparams/learning_rate\); nothing was trained or saved"):
    tot.Trainer(step, Batches(), steps=3, checkpointer=checkpointer, progress=False).run()
  assert checkpointer.saves == [] and step.step_count == 0
