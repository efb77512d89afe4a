"""Checkpoints: orbax save/restore across meshes, atomicity, exact resume and
preemption with real processes, safetensors export/import, mismatch safety."""

import hashlib
import importlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.io import checkpoint, export
from torch_on_tpu.models.hf import build_causal_lm
from torch_on_tpu.models.torchtitan import llama3_config

TESTS = Path(__file__).parent
WORKER = TESTS / "ckpt_worker.py"


def tiny_titan(layers=2, device="meta"):
  """torchtitan's Llama 3 debugmodel cut to `layers` layers (fused wqkv, hooks kept)."""
  config = llama3_config("debugmodel", attention="sdpa", max_seq_len=32)
  config.layers = config.layers[:layers]
  with torch.device(device):
    return config.build()


def tiny_hf_config(hidden=32, tie=True):
  return transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=hidden,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=tie,
  )


def randomized(tree, seed):
  """Every float leaf replaced by host-random values in the same sharding
  (no compile: XLA's CPU compiles of RNG code are slow)."""
  rng = np.random.default_rng(seed)

  def leaf(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jax.device_put((0.02 * rng.standard_normal(x.shape)).astype(x.dtype), x.sharding)

  return jax.tree.map(leaf, tree)


def random_module(model, seed=0, **kw):
  """A ShardedModule whose params are random arrays in their shardings,
  instead of the model's own init, for tests that only move weights around."""
  jm = tot.ShardedModule(model, abstract=True, **kw)
  jm.params.update(randomized(dict(jm.params), seed))
  return jm


def train_state(jm, optimizer, seed=3):
  """A training state with non-trivial optimizer moments."""
  return {
    "params": dict(jm.params),
    "opt_state": randomized(optimizer.init(jm.params), seed),
    "step": jnp.asarray(5, jnp.int32),
    "rng": jax.random.key(11),
  }


def tree_bytes(tree):
  def host(x):
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)

  return [host(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(tree_bytes(a), tree_bytes(b)):
    np.testing.assert_array_equal(x, y)


def dir_digest(path):
  h = hashlib.sha256()
  for p in sorted(Path(path).rglob("*")):
    h.update(str(p.relative_to(path)).encode())
    if p.is_file():
      h.update(p.read_bytes())
  return h.hexdigest()


# ---- orbax: restore into another mesh ------------------------------------------------------


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory):
  """A 2-layer torchtitan Llama on fsdp=8 with AdamW state, saved as step 5."""
  jm = random_module(tiny_titan(), mesh=tot.make_mesh(fsdp=8), sharding="fsdp", seed=1)
  state = train_state(jm, optax.adamw(1e-3))
  directory = tmp_path_factory.mktemp("titan_run")
  with checkpoint.Checkpointer(directory) as ckpt:
    assert ckpt.save(5, state, data={"pos": 40}, config={"lr": 1e-3}, force=True)
  return jm, state, directory


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
  """A tiny tied-embedding HF Llama with AdamW state, saved as steps 2 and 4."""
  jm = random_module(build_causal_lm(tiny_hf_config()), seed=0)
  state = train_state(jm, optax.adamw(1e-3))
  directory = tmp_path_factory.mktemp("hf_run")
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(2, state, force=True)
    ckpt.save(4, state, force=True)
  return jm, state, directory


@pytest.mark.parametrize("axes, preset", [({"fsdp": 4, "tp": 2}, "fsdp_tp"), ({"fsdp": 1}, "fsdp")])
def test_restore_reshards_onto_another_mesh(titan_run, axes, preset):
  _, state, directory = titan_run
  mesh = tot.make_mesh(**axes, devices=jax.devices()[: int(np.prod(list(axes.values())))])
  target_jm = tot.ShardedModule(tiny_titan(), mesh=mesh, sharding=preset, abstract=True)
  target = checkpoint.abstract_state(
    {
      "params": target_jm.params,
      "opt_state": jax.eval_shape(optax.adamw(1e-3).init, target_jm.params),
      "step": jax.ShapeDtypeStruct((), jnp.int32),
      "rng": jax.eval_shape(lambda: jax.random.key(0)),
    },
    mesh,
    params=target_jm.params,
  )
  restored = checkpoint.Checkpointer(directory, read_only=True).restore(target)
  assert restored.step == 5 and restored.data == {"pos": 40} and restored.config == {"lr": 1e-3}
  assert_trees_equal(restored.state, state)
  for name, arr in restored.state["params"].items():
    assert arr.sharding == target_jm.param_shardings[name], name
    assert len(arr.sharding.device_set) == mesh.size
  wqkv = "layers.0.attention.qkv_linear.wqkv.weight"
  assert restored.state["opt_state"][0].mu[wqkv].sharding.spec == target_jm.param_shardings[wqkv].spec


def test_restore_of_another_model_names_the_mismatches_and_changes_nothing(hf_run):
  _, _, directory = hf_run
  before = dir_digest(directory)
  other = tot.ShardedModule(build_causal_lm(tiny_hf_config(hidden=64, tie=False)), abstract=True)
  kept = dict(other.params)
  with pytest.raises(TorchOnTpuError) as err:
    checkpoint.Checkpointer(directory).restore({"params": other.params})
  msg = str(err.value)
  assert "1 missing: params/lm_head.weight" in msg
  assert "unexpected: opt_state/0/count" in msg
  assert "params/model.embed_tokens.weight is (128, 32) but (128, 64) is expected" in msg
  assert re.search(r"and \d+ more", msg)  # long lists are cut to the first few + a count
  assert dir_digest(directory) == before
  assert all(other.params[k] is v for k, v in kept.items())


def test_partial_restore_reads_only_the_named_entries(hf_run):
  jm, state, directory = hf_run
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    restored = ckpt.restore(checkpoint.abstract_state({"params": jm.params}), step=2, partial=True)
    assert restored.step == 2 and set(restored.state) == {"params"}
    assert_trees_equal(restored.state["params"], state["params"])
    with pytest.raises(TorchOnTpuError, match=r"No checkpoint for step 3 .* saved steps are \[2, 4\]"):
      ckpt.restore(state, step=3)


# ---- orbax: original names on disk (scan flipped, another mesh), buffers ------------------------


def lm_loss(out, labels):
  return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def hf_step(scan, mesh, sharding="fsdp"):
  """A tiny HF Llama (untied, so every weight is its own) and its AdamW train step."""
  torch.manual_seed(0)
  jm = tot.ShardedModule(build_causal_lm(tiny_hf_config(tie=False)), mesh=mesh, sharding=sharding, scan=scan)
  return tot.make_train_step(jm, lm_loss, optax.adamw(1e-2))


def original_names(step):
  """params and AdamW moments of a train step under the original per-layer names, on host."""
  jm, adam = step.model, step.opt_state[0]
  return {"params": h.per_layer(jm, jm.params), "mu": h.per_layer(jm, adam.mu), "nu": h.per_layer(jm, adam.nu)}


@pytest.mark.parametrize(
  "saved_scan, resumed_scan, axes, preset",
  [(True, False, {"fsdp": 2, "tp": 4}, "fsdp_tp"), (False, True, {"fsdp": 1}, "fsdp")],
)
def test_resume_with_scan_flipped_on_another_mesh(tmp_path, saved_scan, resumed_scan, axes, preset):
  batches = [h.random_batch(128, batch=8, seq=8, seed=i) for i in range(3)]
  saving = hf_step(saved_scan, tot.make_mesh(fsdp=8))
  for tokens, labels in batches[:2]:
    saving(tokens, labels)
  with checkpoint.Checkpointer(tmp_path, model=saving.model) as ckpt:
    ckpt.save(2, saving.state, force=True)
  with checkpoint.Checkpointer(tmp_path, read_only=True) as ckpt:
    names = set(_leaf_names(ckpt._manager.item_metadata(2)["state"].tree))
  assert "params/model.layers.1.self_attn.q_proj.weight" in names  # original names on disk
  assert "opt_state/0/mu/model.layers.0.mlp.up_proj.weight" in names
  assert not [n for n in names if ".scan.layer." in n]
  expected = original_names(saving)
  next_loss = float(saving(*batches[2]))

  mesh = tot.make_mesh(**axes, devices=jax.devices()[: int(np.prod(list(axes.values())))])
  resumed = hf_step(resumed_scan, mesh, preset)
  with checkpoint.Checkpointer(tmp_path, model=resumed.model) as ckpt:
    restored = ckpt.restore(resumed.abstract_state())
  resumed.state = restored.state
  assert resumed.step_count == 2
  got = original_names(resumed)
  for part in expected:
    assert got[part].keys() == expected[part].keys()
    for name in expected[part]:
      np.testing.assert_array_equal(got[part][name], expected[part][name], err_msg=f"{part} {name}")
  for name, arr in resumed.model.params.items():
    assert arr.sharding == resumed.model.param_shardings[name], name
  # The scanned and the plain layer loop round differently: same loss within 1e-5 relative.
  assert float(resumed(*batches[2])) == pytest.approx(next_loss, rel=1e-5)


def _leaf_names(tree):
  return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_a_stacked_checkpoint_of_before_restores_scanned_and_is_refused_plain(tmp_path):
  scanned = hf_step(True, tot.make_mesh(fsdp=8))
  with checkpoint.Checkpointer(tmp_path) as ckpt:  # no model: the stacked layout, as saved before
    ckpt.save(1, scanned.state, force=True)
  with checkpoint.Checkpointer(tmp_path, model=scanned.model) as ckpt:
    restored = ckpt.restore(scanned.abstract_state())
  assert_trees_equal(restored.state, scanned.state)
  plain = hf_step(False, tot.make_mesh(fsdp=8))
  with checkpoint.Checkpointer(tmp_path, model=plain.model) as ckpt:
    with pytest.raises(TorchOnTpuError, match=r"it holds scan-stacked layers .* resume it with scan=True"):
      ckpt.restore(plain.abstract_state())


def test_batchnorm_running_statistics_survive_a_resume(tmp_path):
  from tests.test_buffers import ce, cnn, images

  def build():
    jm = tot.ShardedModule(cnn(), mesh=tot.make_mesh(fsdp=8), sharding="fsdp")
    return tot.make_train_step(jm, ce, optax.sgd(0.1))

  saving = build()
  for i in range(3):
    saving(*images(i))
  with checkpoint.Checkpointer(tmp_path, model=saving.model) as ckpt:
    ckpt.save(3, saving.state, force=True)
  saved = {k: np.asarray(v) for k, v in saving.model.buffers.items()}
  assert int(saved["bn.num_batches_tracked"]) == 3
  next_loss = float(saving(*images(3)))

  fresh = build()
  assert int(fresh.model.buffers["bn.num_batches_tracked"]) == 0
  with checkpoint.Checkpointer(tmp_path, model=fresh.model) as ckpt:
    fresh.state = ckpt.restore(fresh.abstract_state()).state
  for name, value in saved.items():
    np.testing.assert_array_equal(np.asarray(fresh.model.buffers[name]), value, err_msg=name)
  assert float(fresh(*images(3))) == next_loss
  assert_trees_equal(fresh.model.buffers, saving.model.buffers)


# ---- orbax: cadence, atomicity, async -----------------------------------------------------------


def test_save_cadence_keep_last_n_and_force(tmp_path):
  state = {"w": jnp.arange(8.0)}
  with checkpoint.Checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
    picked = [s for s in range(1, 8) if ckpt.should_save(s)]
    assert picked == [2, 4, 6]
    for s in picked:
      assert ckpt.save(s, {"w": state["w"] + s})
    assert not ckpt.save(7, state)  # not a save step
    assert ckpt.save(7, {"w": state["w"] + 7}, force=True)  # exit save
    assert not ckpt.save(7, state, force=True)  # never rewritten
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
    np.testing.assert_array_equal(ckpt.restore(state).state["w"], np.arange(8.0) + 7)


def test_json_items_must_be_json(tmp_path):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(TorchOnTpuError, match="data dict is not JSON-serialisable"):
      ckpt.save(1, {"w": jnp.zeros(2)}, data={"gen": np.random.default_rng(0)}, force=True)
    assert ckpt.all_steps() == []


def test_half_written_step_is_ignored(tmp_path):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"w": jnp.full(4, 1.0)}, force=True)
    ckpt.save(2, {"w": jnp.full(4, 2.0)}, force=True)
  # A save killed before its final rename leaves exactly this: a tmp step dir.
  crashed = tmp_path / "2.orbax-checkpoint-tmp-1234"
  (tmp_path / "2").rename(crashed)
  for f in list(crashed.rglob("*"))[:3]:
    if f.is_file():
      f.write_bytes(b"")
  reader = checkpoint.Checkpointer(tmp_path, read_only=True)  # e.g. convert.py on a live run
  assert reader.latest_step() == 1 and crashed.exists()
  reader.close()
  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.latest_step() == 1
  np.testing.assert_array_equal(ckpt.restore({"w": jnp.zeros(4)}).state["w"], np.full(4, 1.0))
  ckpt.close()
  deadline = time.time() + 60
  while crashed.exists() and time.time() < deadline:  # orbax deletes it in the background
    time.sleep(0.05)
  assert not crashed.exists()


def test_async_save_returns_before_writing_and_survives_donation(tmp_path):
  mesh = tot.make_mesh(fsdp=8)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  big = jax.device_put(jax.random.normal(jax.random.key(0), (8, 1024, 1024)), sharding)  # 32 MiB
  expected = np.asarray(big)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"w": big}, force=True)
    big.delete()  # what a donating train step does to the old params
    ckpt.wait()
    target = {"w": jax.ShapeDtypeStruct(expected.shape, expected.dtype, sharding=sharding)}
    restored = ckpt.restore(target)
  np.testing.assert_array_equal(np.asarray(restored.state["w"]), expected)


def test_preemption_guard_turns_signals_into_a_stop_request():
  previous = signal.getsignal(signal.SIGTERM)
  with checkpoint.PreemptionGuard() as guard:
    assert not guard.should_stop(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert guard.requested and guard.should_stop(2) and guard.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second signal is the OS's
  assert signal.getsignal(signal.SIGTERM) is previous


def test_a_second_signal_stops_at_once_inside_a_long_native_call_without_a_traceback():
  """The first SIGTERM asks for a stop after the step; the second ends the process while it is
  inside one 30-second native call (a compile, a step), which a Python handler would wait out."""
  script = (
    "import os, signal, sys, time, numpy as np\n"
    "from torch_on_tpu.io import checkpoint\n"
    "with checkpoint.PreemptionGuard() as guard:\n"
    "  os.kill(os.getpid(), signal.SIGTERM)\n"
    "  time.sleep(0.1)\n"
    "  assert guard.requested\n"
    "  a = np.ones((9000, 9000), np.float32)\n"
    "  print('ready', flush=True)\n"
    "  for _ in range(8): a @ a\n"
    "print('finished', flush=True)\n"
  )
  child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert child.stdout.readline().strip() == "ready"
  time.sleep(1.0)
  sent = time.monotonic()
  child.send_signal(signal.SIGTERM)
  out, err = child.communicate(timeout=60)
  assert child.returncode == -signal.SIGTERM and time.monotonic() - sent < 5, (child.returncode, out, err)
  assert "finished" not in out and "Traceback" not in err


# ---- real processes: exact resume and preemption --------------------------------------------

STEPS, SAVE_EVERY = 20, 4


def worker_env(tmp_root):
  env = dict(os.environ)
  # Relaunches reuse compiled programs (the same executables, so same numerics).
  env.update(
    JAX_COMPILATION_CACHE_DIR=str(tmp_root / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  return env


@pytest.fixture
def launch(tmp_path):
  """Starts worker processes; any still running at teardown is killed."""
  procs = []

  def start(ckpt_dir, log, *extra):
    cmd = [sys.executable, str(WORKER), *worker_args(ckpt_dir, log), *extra]
    proc = subprocess.Popen(
      cmd, env=worker_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    procs.append(proc)
    return proc

  yield start
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def worker_args(ckpt_dir, log):
  return ["--dir", str(ckpt_dir), "--log", str(log), "--steps", str(STEPS), "--save_every", str(SAVE_EVERY)]


def read_log(log):
  if not Path(log).exists():
    return {}
  lines = Path(log).read_text().splitlines()
  return dict(line.split() for line in lines if len(line.split()) == 2)


def wait_for_steps(proc, log, n, timeout=300):
  deadline = time.time() + timeout
  while len(read_log(log)) < n:
    assert proc.poll() is None, f"worker exited early:\n{proc.stdout.read()}"
    assert time.time() < deadline, "worker too slow"
    time.sleep(0.05)


def finish(proc, timeout=300):
  out, _ = proc.communicate(timeout=timeout)
  return proc.returncode, out


def resumed_step(out):
  lines = [line for line in out.splitlines() if line.startswith("resumed from step")]
  return int(lines[0].split()[-1]) if lines else 0


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
  """An uninterrupted run, in this process (same code, same compiled programs)."""
  from tests import ckpt_worker

  root = tmp_path_factory.mktemp("reference")
  assert ckpt_worker.main(worker_args(root / "ckpt", root / "log")) == 0
  losses = read_log(root / "log")
  assert len(losses) == STEPS and len(set(losses.values())) > STEPS // 2
  return losses


def test_sigkill_sigterm_and_relaunches_match_an_uninterrupted_run_bitwise(
  tmp_path, reference_losses, launch
):
  """One directory, four processes: SIGKILL at a random step; relaunch that dies
  right after starting a save; relaunch stopped by SIGTERM (saves, exits 0);
  relaunch to the end. Every logged loss equals the uninterrupted run's, bit for bit."""
  ckpt_dir = tmp_path / "ckpt"
  runs = []

  kill_at = random.randrange(SAVE_EVERY + 1, 2 * SAVE_EVERY + 2)
  proc = launch(ckpt_dir, tmp_path / "log0", "--step_sleep", "0.3")
  wait_for_steps(proc, tmp_path / "log0", kill_at)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  runs.append(read_log(tmp_path / "log0"))

  die_at = 3 * SAVE_EVERY
  code, out = finish(launch(ckpt_dir, tmp_path / "log1", "--die_mid_save_at", str(die_at)))
  assert code == -signal.SIGKILL, out
  start = resumed_step(out)
  assert start % SAVE_EVERY == 0 and start <= len(runs[0]) < die_at, (kill_at, out)
  runs.append(read_log(tmp_path / "log1"))
  assert sorted(map(int, runs[1])) == list(range(start, die_at))
  half_written = list(ckpt_dir.glob(f"{die_at}.orbax-checkpoint-tmp*"))

  proc = launch(ckpt_dir, tmp_path / "log2", "--step_sleep", "0.3")
  wait_for_steps(proc, tmp_path / "log2", 2)
  proc.send_signal(signal.SIGTERM)
  code, out = finish(proc)
  assert code == 0, out
  start = resumed_step(out)
  # The interrupted step-12 save counts only if it was finalised before the kill.
  assert start in ([die_at - SAVE_EVERY] if half_written else [die_at - SAVE_EVERY, die_at]), out
  assert "Got SIGTERM: finishing the current step" in out, out
  assert "preempted by SIGTERM: saved step" in out, out
  stopped = int(re.search(r"saved step (\d+)", out).group(1))
  runs.append(read_log(tmp_path / "log2"))
  assert sorted(map(int, runs[2])) == list(range(start, stopped)) and stopped < STEPS
  ckpt = checkpoint.Checkpointer(ckpt_dir, read_only=True)
  assert ckpt.latest_step() == stopped
  ckpt.close()

  code, out = finish(launch(ckpt_dir, tmp_path / "log3"))
  assert code == 0 and "finished" in out and resumed_step(out) == stopped, out
  runs.append(read_log(tmp_path / "log3"))
  assert sorted(map(int, runs[3])) == list(range(stopped, STEPS))
  for i, run in enumerate(runs):
    differ = [s for s in run if run[s] != reference_losses[s]]
    assert not differ, f"run {i} (first kill at {kill_at}): steps {differ} differ from the reference {[(run[s], reference_losses[s]) for s in differ]}"


# ---- safetensors export ---------------------------------------------------------------------


def test_export_torchtitan_loads_into_plain_torch_strict(tmp_path, monkeypatch):
  monkeypatch.setattr(export, "_CHUNK_BYTES", 50_000)  # many chunks per tensor
  jm = tot.ShardedModule(tiny_titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", seed=2)
  out = export.export_safetensors(jm, tmp_path / "export", max_shard_bytes=3_000_000)
  files = sorted(p.name for p in out.iterdir())
  assert "model.safetensors.index.json" in files and "model-00001-of-00004.safetensors" in files
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
  index = json.loads((out / "model.safetensors.index.json").read_text())
  loaded = {}
  for f in set(index["weight_map"].values()):
    loaded.update(load_file(out / f))
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())
  assert "layers.0.attention.qkv_linear.wq.weight" in loaded  # torchtitan's own names

  ref = tiny_titan(device="cpu")
  ref.load_state_dict(loaded, strict=True)
  expected = jm.state_dict()
  for name, t in ref.state_dict().items():
    assert torch.equal(t, expected[name]), name
  tokens = torch.randint(0, 2048, (2, 16))
  want = ref(tokens)
  got = tot.to_cpu(jm(tokens))
  assert h.rel(got.detach(), want.detach()) < 1e-5  # fp32 on CPU: ‖Δ‖/‖ref‖


def test_export_hf_loads_with_from_pretrained(tmp_path, hf_run):
  jm, _, _ = hf_run
  out = export.export_safetensors(jm, tmp_path / "hf")
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  with safe_open(out / "model.safetensors", "pt") as f:
    assert f.metadata() == {"format": "pt"}
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  expected = jm.state_dict()
  for name, t in model.state_dict().items():
    assert torch.equal(t, expected[name]), name


def test_export_is_atomic(tmp_path, monkeypatch, hf_run):
  jm, _, _ = hf_run
  target = tmp_path / "out"
  calls = []
  real = export._array_chunks

  def failing(arr):
    calls.append(1)
    if len(calls) == 5:
      raise OSError("disk full")
    return real(arr)

  monkeypatch.setattr(export, "_array_chunks", failing)
  with pytest.raises(OSError, match="disk full"):
    export.export_safetensors(jm, target, max_shard_bytes=10_000)
  assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir
  monkeypatch.setattr(export, "_array_chunks", real)

  export.export_safetensors(jm, target)
  before = dir_digest(target)
  with pytest.raises(TorchOnTpuError, match="already exists"):
    export.export_safetensors(jm, target)
  assert dir_digest(target) == before
  monkeypatch.setitem(jm.params, "model.norm.weight", jm.params["model.norm.weight"] + 1)
  export.export_safetensors(jm, target, overwrite=True)
  assert dir_digest(target) != before
  assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ---- safetensors import ---------------------------------------------------------------------


def test_import_hf_weights_reads_only_each_devices_slice(tmp_path, monkeypatch):
  hf_dir = tmp_path / "hf"
  cpu_model = build_causal_lm(tiny_hf_config(), device="cpu")
  cpu_model.save_pretrained(hf_dir)  # stores the tied lm_head once
  with safe_open(hf_dir / "model.safetensors", "pt") as f:
    assert "lm_head.weight" not in f.keys()

  jm = tot.ShardedModule(
    build_causal_lm(tiny_hf_config()), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", abstract=True
  )
  reads, mapped = [], []
  reader = importlib.import_module("torch_on_tpu.io.checkpoint.safetensors_import")
  loading = importlib.import_module("torch_on_tpu.wrapper.state_loading")
  real_pread, real_read_array = reader._SafetensorsFile._pread, loading._read_array

  def pread(self, offset, count):
    reads.append(count)
    return real_pread(self, offset, count)

  def read_array(*args):  # while arrays are read, is the file memory-mapped (its pages resident)?
    mapped.append("model.safetensors" in Path("/proc/self/maps").read_text())
    return real_read_array(*args)

  monkeypatch.setattr(reader._SafetensorsFile, "_pread", pread)
  monkeypatch.setattr(loading, "_read_array", read_array)
  checkpoint.import_safetensors(jm, hf_dir)

  expected = cpu_model.state_dict()
  got = jm.state_dict()
  for name in expected:
    assert torch.equal(got[name], expected[name]), name
  assert jm.array_for("lm_head.weight") is jm.array_for("model.embed_tokens.weight")
  q = "model.layers.0.self_attn.q_proj.weight"
  assert jm.params[q].sharding == jm.param_shardings[q]
  # Each device's rows only: the embedding (128, 32) on (tp=2, fsdp=4) is read half at a time.
  assert max(reads) == 128 * 32 * 4 // 2
  assert mapped and not any(mapped)  # read, not mapped: no second copy of the model stays resident


def test_import_torchtitan_merges_wq_wk_wv_into_wqkv_scanned_or_not(tmp_path, titan_run):
  source, _, _ = titan_run
  export.export_safetensors(source, tmp_path / "w")
  expected = source.state_dict()
  for scan in (False, True):
    jm = tot.ShardedModule(
      tiny_titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp", scan=scan, abstract=True
    )
    checkpoint.import_safetensors(jm, tmp_path / "w" / "model.safetensors")
    assert any(v.ndim == 3 for v in jm.params.values()) == scan  # stacked (layers, out, in)
    for name, arr in jm.params.items():
      assert arr.sharding == jm.param_shardings[name], name
    got = jm.state_dict()
    for name in expected:
      assert torch.equal(got[name], expected[name]), (scan, name)
    # and back out of the scanned layout, byte for byte
    out = export.export_safetensors(jm, tmp_path / f"again-{scan}")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "w" / "model.safetensors").read_bytes()


def test_import_casts_to_the_models_dtypes(tmp_path):
  cpu_model = build_causal_lm(tiny_hf_config(), device="cpu")
  bf16 = {k: v.to(torch.bfloat16) for k, v in cpu_model.state_dict().items() if k != "lm_head.weight"}
  save_file(bf16, tmp_path / "w.safetensors")
  jm = tot.ShardedModule(build_causal_lm(tiny_hf_config()), abstract=True)
  checkpoint.import_safetensors(jm, tmp_path / "w.safetensors")
  w = jm.params["model.norm.weight"]
  assert w.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(w), bf16["model.norm.weight"].float().numpy())


def test_import_of_another_model_names_the_mismatches_and_changes_nothing(tmp_path, hf_run):
  other = build_causal_lm(tiny_hf_config(hidden=64, tie=False), device="cpu")
  other.save_pretrained(tmp_path / "other")
  sd = other.state_dict()
  sd["extra.weight"] = torch.zeros(2)
  sd.pop("model.norm.weight")
  save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "other" / "model.safetensors")
  before = dir_digest(tmp_path)
  jm, _, _ = hf_run  # hidden 32, tied embeddings
  kept = dict(jm.params)
  with pytest.raises(TorchOnTpuError) as err:
    checkpoint.import_safetensors(jm, tmp_path / "other")
  msg = str(err.value)
  assert "1 missing: model.norm.weight" in msg
  assert "1 unexpected: extra.weight" in msg  # the untied lm_head is accepted as the tie's other name
  assert "model.embed_tokens.weight is (128, 64) but (128, 32) is expected" in msg
  assert dir_digest(tmp_path) == before
  assert all(jm.params[k] is v for k, v in kept.items())


def test_no_weights_there_is_a_clear_error(tmp_path):
  jm = tot.ShardedModule(build_causal_lm(tiny_hf_config()), abstract=True)
  with pytest.raises(TorchOnTpuError, match="No safetensors weights at"):
    checkpoint.import_safetensors(jm, tmp_path)


# ---- tools/convert.py ---------------------------------------------------------------------------


def test_convert_orbax_to_safetensors_and_back(tmp_path, hf_run):
  convert = h.load_module(TESTS.parent / "tools" / "convert.py")
  jm, state, run = hf_run
  tiny_hf_config().save_pretrained(tmp_path / "cfg")
  args = ["to_safetensors", str(run), str(tmp_path / "st"), "--hf_config", str(tmp_path / "cfg")]
  assert convert.main(args) == 0
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "st")
  expected = jm.state_dict()
  for name, t in model.state_dict().items():
    assert torch.equal(t, expected[name]), name

  assert convert.main(["to_orbax", str(tmp_path / "st"), str(tmp_path / "back"), "--step", "7"]) == 0
  with checkpoint.Checkpointer(tmp_path / "back") as ckpt:
    restored = ckpt.restore(checkpoint.abstract_state({"params": jm.params}))
  assert restored.step == 7
  assert_trees_equal(restored.state["params"], state["params"])

  # The converted checkpoint (original names) restores into a scanned model too.
  scanned = tot.ShardedModule(build_causal_lm(tiny_hf_config()), scan=True, abstract=True)
  with checkpoint.Checkpointer(tmp_path / "back", model=scanned, read_only=True) as ckpt:
    restored = ckpt.restore(checkpoint.abstract_state({"params": scanned.params}), partial=True)
  assert_trees_equal(h.per_layer(scanned, restored.state["params"]), h.per_layer(jm, state["params"]))

  # A checkpoint saved before they kept the original names (a scan=True run's stacked layers) converts the same.
  with checkpoint.Checkpointer(tmp_path / "scanned") as ckpt:
    ckpt.save(7, {"params": restored.state["params"]}, force=True)
  args = ["to_safetensors", str(tmp_path / "scanned"), str(tmp_path / "st2"), "--hf_config"]
  args.append(str(tmp_path / "cfg"))
  assert convert.main(args) == 0
  files = [tmp_path / d / "model.safetensors" for d in ("st", "st2")]
  assert files[0].read_bytes() == files[1].read_bytes()


def test_convert_torchtitan_spec_and_errors(tmp_path, capsys):
  convert = h.load_module(TESTS.parent / "tools" / "convert.py")
  model = convert.build_model("llama3:debugmodel")
  assert "layers.5.attention.qkv_linear.wqkv.weight" in dict(model.named_parameters())
  args = ["to_safetensors", str(tmp_path / "nope"), str(tmp_path / "o"), "--model", "llama3:debugmodel"]
  assert convert.main(args) == 1
  assert "No checkpoint directory at" in capsys.readouterr().err
  assert convert.main(["to_orbax", str(tmp_path), str(tmp_path / "o"), "--model", "gpt9:xl"]) == 1
  assert "'gpt9:xl' is not <family>:<flavor> of torchtitan" in capsys.readouterr().err
  assert convert.main(["to_orbax", str(tmp_path), str(tmp_path / "o"), "--model", "qwen3:debugmdoel"]) == 1
  assert "has no flavor 'debugmdoel'; did you mean 'qwen3:debugmodel'?" in capsys.readouterr().err


def test_convert_names_every_bad_input_in_one_sentence(tmp_path, capsys):
  convert = h.load_module(TESTS.parent / "tools" / "convert.py")
  hf_dir = tmp_path / "hf"
  build_causal_lm(tiny_hf_config(), device="cpu").save_pretrained(hf_dir)
  good = (hf_dir / "model.safetensors").read_bytes()
  capsys.readouterr()  # save_pretrained's progress bar

  def damaged(name, content):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    (d / "model.safetensors").write_bytes(content)
    return d

  header = bytearray(good)
  header[10:20] = b"x" * 10
  index_dir = damaged("index", good)
  (index_dir / "model.safetensors.index.json").write_text("{not json")
  cases = [
    (damaged("truncated", good[: len(good) // 2]), "is not a readable safetensors file (Error while deserializing header"),
    (damaged("header", bytes(header)), "is not a readable safetensors file (Error while deserializing header"),
    (index_dir, "model.safetensors.index.json is not a safetensors index (JSONDecodeError"),
    (tmp_path / "missing", "No weights at"),
    (hf_dir / "config.json", "is not a readable safetensors file"),  # not a safetensors file at all
  ]
  for weights, message in cases:
    args = ["to_orbax", str(weights), str(tmp_path / "out"), "--hf_config", str(hf_dir)]
    assert convert.main(args) == 1, weights
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
  tiny_hf_config(hidden=64).save_pretrained(tmp_path / "other")
  assert convert.main(["to_orbax", str(hf_dir), str(tmp_path / "out"), "--hf_config", str(tmp_path / "other")]) == 1
  assert "do not match the model" in capsys.readouterr().err
