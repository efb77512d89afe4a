"""Shared pieces of the parity tests: tiny models, an eager CPU reference, ‖Δ‖/‖ref‖."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import jax
import numpy as np
import torch
import torch.nn.functional as F
import transformers

import torch_on_tpu as tot  # noqa: F401
from torch_on_tpu.core import _compat
from torch_on_tpu.models.hf import build_causal_lm  # noqa: F401 (tests use h.build_causal_lm)
from torch_on_tpu.models.torchtitan import build_llama3

torchax = _compat.import_torchax()
from torchax.interop import jax_view, torch_view  # noqa: E402

SEQ = 16
# What libtpu prints when it starts on a machine without TPU chips, unless answered (runtime.libtpu).
LIBTPU_START_UP = ("could not determine TPU", "Failed to find host bounds", "TPU_WORKER_HOSTNAMES")


def libtpu_start_up_lines(output: str) -> list[str]:
  """The lines of `output` that are libtpu's start-up noise (none, where we start it quietly)."""
  return [line for line in output.splitlines() if any(n in line for n in LIBTPU_START_UP)]


def env_without_libtpu_answers() -> dict:
  """This process's environment less the answers to libtpu's questions that pytest's set-up gave:
  what a user's shell has, for a subprocess that must answer them itself."""
  from torch_on_tpu.runtime import libtpu

  return {k: v for k, v in os.environ.items() if k not in libtpu._WITHOUT_CHIPS}
BATCH = 8


@functools.cache
def titan_parity():
  """tools/titan_parity.py, loaded once: the eager torchtitan references the tests share."""
  return load_module("tools/titan_parity.py")


def load_module(path):
  """A script (tools/*.py) imported as a module, without running its main."""
  spec = importlib.util.spec_from_file_location(Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def rel(a, b) -> float:
  a = np.asarray(a, dtype=np.float64)
  b = np.asarray(b, dtype=np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_holds_and_computes(jm, state: dict, model) -> None:
  """`jm` holds exactly `state` (every name, every value) and computes what the torch `model`
  does with it: fp32 logits of a torchtitan Llama 3 on random tokens, ‖Δ‖/‖ref‖ < 1e-5."""
  loaded = jm.state_dict()
  assert sorted(loaded) == sorted(state)
  assert all(torch.equal(loaded[k], state[k]) for k in state), [k for k in state if not torch.equal(loaded[k], state[k])][:3]
  model.load_state_dict(state)
  tokens = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(2))
  with torch.no_grad():
    assert rel(jm(tokens), model(tokens)) < 1e-5


def no_wandb_login(monkeypatch, home) -> None:
  """A process where Weights & Biases finds no login: no key, no ~/.netrc, no earlier run's settings."""
  import wandb

  wandb.teardown()  # wandb keeps the settings of an earlier run in this process (an offline one)
  for var in ("WANDB_MODE", "WANDB_API_KEY"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))


def titan(device="meta", **kw):
  """torchtitan's own Llama 3 debugmodel (6 layers, dim 256, vocab 2048), SDPA attention."""
  return build_llama3("debugmodel", attention="sdpa", max_seq_len=SEQ, device=device, **kw)


def hf_config(arch: str = "llama"):
  common = dict(vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
  configs = {
    "llama": lambda: transformers.LlamaConfig(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common
    ),
    "qwen2": lambda: transformers.Qwen2Config(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common
    ),
    "gemma": lambda: transformers.GemmaConfig(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, **common
    ),
    "phi3": lambda: transformers.Phi3Config(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      pad_token_id=0, **common
    ),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256),
  }
  config = configs[arch]()
  config._attn_implementation = "sdpa"
  return config


def hf(arch="llama", device="meta"):
  model = build_causal_lm(hf_config(arch), device=device)
  model.eval()  # dropout off: parity against eager needs the same function
  return model


def vocab_of(model) -> int:
  config = getattr(model, "config", None)
  return getattr(config, "vocab_size", 2048)


def call_kwargs(model) -> dict:
  return {"use_cache": False} if hasattr(model, "config") and hasattr(model.config, "use_cache") else {}


def logits_of(out):
  return out.logits if hasattr(out, "logits") else out


def reference(jm, builder):
  """The same weights in a plain eager CPU torch model."""
  ref = builder(device="cpu")
  ref.load_state_dict(dict(jm.state_dict()), strict=True)
  ref.eval()
  return ref


def torch_loss_and_grads(ref, tokens, labels, kwargs):
  ref.zero_grad()
  logits = logits_of(ref(tokens, **kwargs))
  loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
  loss.backward()
  grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
  return logits.detach(), loss.detach(), grads


def jax_loss_and_grads(jm, tokens, labels, kwargs):
  """Cross-entropy grads through the ShardedModule, keyed like `named_parameters()`."""

  def loss_fn(params, tokens, labels):
    out = jm.functional_call(params, jm.buffers, torch_view(tokens), **kwargs)
    logits = logits_of(out)
    with torchax.default_env():
      loss = F.cross_entropy(logits.flatten(0, 1).float(), torch_view(labels).flatten())
    return jax_view(loss)

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(jm.params, jm.place(tokens), jm.place(labels))
  return loss, grads


def per_layer(jm, stored: dict) -> dict:
  """A dict keyed like `jm.params` (maybe stacked) → numpy arrays by original per-layer name."""
  return {n: np.asarray(v) for n, v in titan_parity().per_layer(jm, stored).items()}


def random_batch(vocab, batch=BATCH, seq=SEQ, seed=0):
  g = torch.Generator().manual_seed(seed)
  tokens = torch.randint(0, vocab, (batch, seq), generator=g)
  labels = torch.randint(0, vocab, (batch, seq), generator=g)
  return tokens, labels


class eager_torchtitan:  # noqa: N801 (a context manager, named for what it does)
  """While active, torchtitan's models run in eager CPU torch as its own code says, with
  its compiled pieces (BlockMask builder, flex attention) swapped for eager torch's: the
  reference the bridge is compared with. Also selects a SPMD backend that needs no mesh, and
  runs torch on one thread: on the shared 2-core machine, two OpenMP threads spin-waiting on
  each other made these tiny models' eager steps 50 × slower (8 s a step instead of 0.16 s)."""

  def __enter__(self):
    from torch.nn.attention import flex_attention as flex
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention

    self._saved = (
      attention.__dict__["_compiled_create_block_mask"],
      attention.FlexAttention.__dict__["_compiled_flex_attn"],
      dist_utils.get_spmd_backend(),
      torch.get_num_threads(),
    )
    attention._compiled_create_block_mask = flex.create_block_mask
    attention.FlexAttention._compiled_flex_attn = titan_parity().dense_flex_attention
    dist_utils.set_spmd_backend("partial_dtensor")
    torch.set_num_threads(1)
    return self

  def __exit__(self, *exc):
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention

    create, flex_attn, backend, threads = self._saved
    attention._compiled_create_block_mask = create
    attention.FlexAttention._compiled_flex_attn = flex_attn
    dist_utils.set_spmd_backend(backend)
    torch.set_num_threads(threads)
