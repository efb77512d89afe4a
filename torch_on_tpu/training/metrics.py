"""What a training run reports: model FLOPs per token, peak FLOP/s, MFU, tokens/s, and
the run log (JSONL, TensorBoard, a PNG plot).

FLOPs per token of a dense decoder, two conventions side by side:

* `torchtitan` (what MFU uses, so numbers compare with torchtitan's):
  `6·N + 12·L·H·Dh·S`, N the parameters that take part in matmuls (all of them
  minus the input embedding, unless it is tied to the output projection), the
  attention term counted for the full S×S score matrix;
* `causal`: the same with the attention term halved, since a causal mask skips
  half of the score matrix (what a kernel that skips masked blocks executes).

MFU = tokens/s × FLOPs per token / (peak FLOP/s per device × devices). Peaks are
the vendors' bf16 dense numbers per jax device; on the CPU they are a measured
fp32 matmul rate of this machine, cached under `~/.cache/torch_on_tpu`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import platform
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import torch

from torch_on_tpu import models
from torch_on_tpu.core import extras, storage
from torch_on_tpu.errors import TorchOnTpuError, first_line

logger = logging.getLogger(__name__)

# ---- FLOPs per token --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
  """Training FLOPs (forward + backward) per token under both conventions."""

  torchtitan: float  # attention counted non-causal; MFU uses this one
  causal: float  # attention term halved
  n_params: int
  n_matmul_params: int


def dense_flops_per_token(
  *,
  n_layers: int,
  n_heads: int,
  head_dim: int,
  seqlen: int,
  n_params: int,
  n_embedding_params: int,
  tied_embeddings: bool = False,
  n_inactive_params: int = 0,
  n_repeated_params: int = 0,
) -> FlopsPerToken:
  """FLOPs per token from explicit numbers (see the module docstring); a MoE's
  `n_inactive_params` (the routed experts a token does not use) count no FLOPs;
  `n_repeated_params` are matmul parameters a token passes through once more (the lm_head
  of each multi-token-prediction depth)."""
  matmul = (n_params if tied_embeddings else n_params - n_embedding_params) - n_inactive_params + n_repeated_params
  # Scores (Q·Kᵀ) and values (P·V): 2 matmuls of L·H·Dh·S multiply-adds per token,
  # ×2 FLOPs per multiply-add, ×3 for forward + backward.
  attention = 12 * n_layers * n_heads * head_dim * seqlen
  return FlopsPerToken(
    torchtitan=float(6 * matmul + attention),
    causal=float(6 * matmul + attention / 2),
    n_params=n_params,
    n_matmul_params=matmul,
  )


def flops_per_token(model, seqlen: int) -> FlopsPerToken:
  """From a torchtitan Llama-style or HF causal LM module (meta is fine) or a ShardedModule."""
  module = getattr(model, "module", model)
  shape = _shape(module)
  params = {id(p): p for p in module.parameters()}
  embeddings = [m.weight for m in module.modules() if isinstance(m, torch.nn.Embedding)]
  tied = any(
    any(p is e for e in embeddings)
    for m in module.modules()
    if not isinstance(m, torch.nn.Embedding)
    for p in m.parameters(recurse=False)
  )
  return dense_flops_per_token(
    n_layers=shape.layers if shape.attention_layers is None else shape.attention_layers,
    n_heads=shape.heads,
    head_dim=shape.head_dim,
    seqlen=seqlen,
    n_params=sum(p.numel() for p in params.values()),
    n_embedding_params=sum(e.numel() for e in embeddings),
    tied_embeddings=tied,
    n_inactive_params=shape.inactive_params,
    n_repeated_params=(shape.predictions - 1) * shape.vocab * shape.dim,
  )


def causal_attention_pairs(seqlen: int, cp: int, *, balanced: bool = True) -> list[int]:
  """(query, key) pairs each of `cp` devices scores under a causal mask, from the chunk
  layout of context parallelism: the sequence in 2·cp chunks, device i computing the
  queries of chunks i and 2·cp-1-i (`balanced`: the zig-zag) or 2i and 2i+1 (contiguous).
  Times 12·layers·heads·head_dim, a device's attention FLOPs of a training step (the
  per-token attention term of the `causal` convention, summed over its queries)."""
  chunk = seqlen // (2 * cp)

  def pairs(c: int) -> int:  # rows c·chunk … (c+1)·chunk-1 each see their position + 1 keys
    return chunk * c * chunk + chunk * (chunk + 1) // 2

  def chunks(i: int) -> tuple[int, int]:
    return (i, 2 * cp - 1 - i) if balanced else (2 * i, 2 * i + 1)

  return [sum(pairs(c) for c in chunks(i)) for i in range(cp)]


def flops_per_token_from_config(config, seqlen: int) -> FlopsPerToken:
  """From a torchtitan model config or an HF `PretrainedConfig` (builds the model on meta)."""
  if hasattr(config, "num_hidden_layers"):
    from torch_on_tpu.models.hf import build_causal_lm

    module = build_causal_lm(config)
  else:
    with torch.device("meta"):
      module = config.build()
  return flops_per_token(module, seqlen)


def _shape(module):
  """The decoder's shape, as its family reads it."""
  shape = models.family_of(module).decoder_shape(module)
  if shape is None:
    raise TorchOnTpuError(
      f"Cannot read layers/heads/head_dim from {type(module).__name__}; call "
      f"metrics.dense_flops_per_token(...) with explicit numbers instead."
    )
  return shape


# ---- peak FLOP/s --------------------------------------------------------------------------

# bf16 dense peak FLOP/s per *jax device*, matched as substrings of `device_kind`,
# most specific first. Sources: Google Cloud TPU system-architecture pages
# (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e, tpu7x) and NVIDIA's H100 / H200
# datasheets (dense = half of the "with sparsity" figure).
PEAK_BF16_FLOPS = (
  ("TPU v4", 275e12),  # per chip; one megacore device per chip
  ("TPU v5 lite", 197e12),  # v5e
  ("TPU v5e", 197e12),
  ("TPU v5p", 459e12),  # per chip; one megacore device per chip
  ("TPU v5", 459e12),  # v5p reports "TPU v5"
  ("TPU v6 lite", 918e12),  # v6e (Trillium)
  ("TPU v6e", 918e12),
  ("TPU7x", 2307e12 / 2),  # Ironwood: 2307 per chip, two TensorCores = two devices per chip
  ("TPU v7", 2307e12 / 2),
  ("H100 PCIe", 756e12),
  ("H100 NVL", 835e12),
  ("H100", 989e12),  # SXM
  ("H200 NVL", 835e12),
  ("H200", 989e12),  # SXM
)


def peak_flops_per_device(device: jax.Device | None = None, *, refresh: bool = False) -> float | None:
  """The table's number for the device kind; on CPU the measured host rate shared
  by its simulated devices (`refresh` measures it again); None for an unknown accelerator."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return cpu_matmul_peak(refresh=refresh) / max(1, len(jax.local_devices(backend="cpu")))
  return peak_flops_for_kind(device.device_kind)


def peak_flops_for_kind(kind: str) -> float | None:
  """The table's bf16 dense peak for a device name (jax's `device_kind`, or
  `torch.cuda.get_device_name()`); None when the table does not know it."""
  for needle, flops in PEAK_BF16_FLOPS:
    if needle.lower() in kind.lower():
      return flops
  return None


def peak_flops(devices=None, *, refresh: bool = False) -> float | None:
  """Peak FLOP/s of all (global) devices together."""
  devices = list(devices if devices is not None else jax.devices())
  per_device = peak_flops_per_device(devices[0], refresh=refresh)
  return None if per_device is None else per_device * len(devices)


def cache_dir() -> pathlib.Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "torch_on_tpu"


def cpu_matmul_peak(*, refresh: bool = False, size: int = 2048, repeats: int = 5) -> float:
  """fp32 FLOP/s of a jitted square matmul on this host, measured once and cached.

  The cache key names the CPU model, the core count and the jax version, so a
  different machine (or XLA) measures again. Other load on the host can only
  make a measurement low, so the cache keeps the best one ever measured.
  """
  key = f"{_cpu_model()}|{os.cpu_count()} cores|jax {jax.__version__}|n={size}"
  path = cache_dir() / "cpu_matmul_peak.json"
  cached = {}
  if path.exists():
    try:
      cached = json.loads(path.read_text())
    except ValueError:
      cached = {}
  if not refresh and key in cached:
    return float(cached[key])
  flops = max(measure_matmul_flops(size=size, repeats=repeats), float(cached.get(key, 0.0)))
  cached[key] = flops
  tmp = path.with_suffix(".tmp")
  with storage.cache_write("the measured CPU peak", path, partial=tmp, elsewhere="set XDG_CACHE_HOME elsewhere"):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(cached, indent=1))
    tmp.replace(path)
  return flops


def measure_matmul_flops(*, size: int = 2048, repeats: int = 5, device=None) -> float:
  """Best-of-`repeats` FLOP/s of one jitted fp32 `size`×`size` matmul on one device."""
  device = device or jax.local_devices(backend="cpu")[0]
  keys = jax.random.split(jax.random.PRNGKey(0))
  a, b = (jax.device_put(jax.random.normal(k, (size, size), jnp.float32), device) for k in keys)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


def _cpu_model() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s (None without a peak)."""
  if not peak:
    return None
  return tokens_per_second * flops_per_token / peak


# ---- the run log --------------------------------------------------------------------------


def _record_step(line: str) -> float:
  """The step of one metrics.jsonl line; a torn last line (a killed run) counts as after every step."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf


def _tensorboard_writer(directory: pathlib.Path):
  """A TensorBoard writer, or None (said once) where the `logging` extra is not installed."""
  if importlib.util.find_spec("tensorboard") is None:
    logger.info(
      "TensorBoard scalars are off (metrics.jsonl is written): pip install 'torch_on_tpu[logging]' for them."
    )
    return None
  from torch.utils.tensorboard import SummaryWriter

  return SummaryWriter(str(directory))


def start_wandb(log_dir, project: str, name: str | None = None, config: Mapping | None = None):
  """A Weights & Biases run writing under `log_dir/wandb`, the same run again when the run resumes
  (its id is the log directory's). wandb's own setting of where it goes: `WANDB_MODE=offline`
  keeps it on disk for `wandb sync`. Started before a long compile, a missing login is said then."""
  wandb = extras.require("wandb", "--wandb_project (Weights & Biases logging)")
  log_dir = pathlib.Path(log_dir)
  log_dir.mkdir(parents=True, exist_ok=True)
  run_id = hashlib.sha1(str(log_dir.resolve()).encode()).hexdigest()[:16]
  try:
    return wandb.init(
      project=project, name=name, id=run_id, resume="allow", dir=str(log_dir), config=dict(config or {}),
      settings=wandb.Settings(silent=True, console="off"),
    )
  except Exception as e:  # noqa: BLE001 (wandb's own errors: no API key, no network, a bad project)
    raise TorchOnTpuError(
      f"Weights & Biases could not start run {run_id} of project {project!r} ({first_line(e)}); run `wandb login`, "
      f"or set WANDB_MODE=offline to keep the run under {log_dir / 'wandb'} for `wandb sync`."
    ) from None


class RunLog:
  """Per-step scalars to `metrics.jsonl`, TensorBoard and (asked for) Weights & Biases under
  `log_dir`, and a PNG plot.

  Create it on process 0 only; every method is cheap and synchronous.
  `start_step` is the step the run starts (or resumed) at: records of later
  steps, left by a run that went further before it was resumed from an earlier
  checkpoint, move to `metrics.jsonl.after-<start_step>`, so `metrics.jsonl`
  keeps one record per step.
  """

  def __init__(self, log_dir, start_step: int = 0, wandb=None):
    self.log_dir = pathlib.Path(log_dir)
    self.jsonl_path = self.log_dir / "metrics.jsonl"
    with self._writing("the metrics log", self.jsonl_path):
      self.log_dir.mkdir(parents=True, exist_ok=True)
      self._drop_records_after(start_step)
      self._jsonl = self.jsonl_path.open("a")
    with self._writing("the TensorBoard scalars", self.log_dir / "tensorboard"):
      self._tb = _tensorboard_writer(self.log_dir / "tensorboard")
    # wandb's keyword arguments (project, and name and config if given), or a run `start_wandb` started
    self._wandb = start_wandb(self.log_dir, **wandb) if isinstance(wandb, Mapping) else wandb
    storage.quiet_thread_tracebacks()  # the writer thread's copy of a fault
    self.history: list[dict] = []

  @staticmethod
  def _writing(what: str, path):
    """A full disk (or a read-only one) under the log directory, named in one sentence."""
    return storage.writing(what, path, elsewhere="pass another --log_dir")

  def _drop_records_after(self, step: int) -> None:
    if not self.jsonl_path.exists():
      return
    lines = self.jsonl_path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _record_step(line) <= step]
    if len(kept) == len(lines):
      return
    self.jsonl_path.rename(self.jsonl_path.with_name(f"{self.jsonl_path.name}.after-{step}"))
    tmp = self.jsonl_path.with_name(f".{self.jsonl_path.name}.tmp")
    tmp.write_text("".join(kept))
    tmp.rename(self.jsonl_path)

  def log(self, step: int, values: Mapping[str, float | None]) -> None:
    record = {"step": step, **{k: v for k, v in values.items() if v is not None}}
    self.history.append(record)
    with self._writing("the metrics log", self.jsonl_path):
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
    if self._tb is not None:
      with self._tensorboard():
        for name, value in record.items():
          if name != "step":
            self._tb.add_scalar(name, value, step)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)

  @contextlib.contextmanager
  def _tensorboard(self):
    """A storage fault of the TensorBoard writer: its thread is stopped before the sentence."""
    try:
      with self._writing("the TensorBoard scalars", self.log_dir / "tensorboard"):
        yield
    except TorchOnTpuError:
      tb, self._tb = self._tb, None
      with contextlib.suppress(Exception):
        tb.close()
      raise

  @property
  def can_plot(self) -> bool:
    """matplotlib (the `logging` extra) is installed."""
    return importlib.util.find_spec("matplotlib") is not None

  def plot(self, path=None) -> pathlib.Path:
    """Loss and tokens/s per step, side by side, as a PNG."""
    matplotlib = extras.require("matplotlib", "The training plot (RunLog.plot)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(path or self.log_dir / "training.png")
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    train = [r for r in self.history if "loss" in r]
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    evals = [r for r in self.history if "eval_loss" in r]
    if evals:
      ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    speed = [r for r in self.history if "tokens_per_second" in r]
    ax_tps.plot([r["step"] for r in speed], [r["tokens_per_second"] for r in speed])
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")  # the plot appears whole or not at all
    try:
      with self._writing("the training plot", path):
        fig.savefig(partial, dpi=100)
        partial.replace(path)
    finally:
      plt.close(fig)
      partial.unlink(missing_ok=True)
    return path

  def close(self) -> None:
    with self._writing("the metrics log", self.jsonl_path):
      self._jsonl.close()
    if self._tb is not None:
      with self._tensorboard():
        self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()
