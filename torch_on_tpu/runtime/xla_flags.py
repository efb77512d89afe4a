"""XLA flags torch_on_tpu sets by default, before jax's backend starts.

XLA reads `XLA_FLAGS` once, when the first backend is created, so these are
appended to the environment by the platform start-up, `tot.setup()`, which the
bridge runs on first use (and passed on to the processes it launches). A flag the user already sets in `XLA_FLAGS` is never
touched; none of them changes results, only which kernels run.

- `--xla_cpu_experimental_ynn_fusion_type=` (empty: no YNNPACK fusions). On
  CPU, jax 0.10's default routes every dot through YNNPACK, whose fp32 GEMMs
  ran the train step's matmuls at 0.7–0.75 × MKL's rate on an AVX-512 Xeon;
  XLA's own dot kernels match it, and the 4-layer benchmark step of
  `tools/bench_step.py` drops from about 15 s to 11–12 s
  (CHANGELOG.md). Flags named `xla_cpu_*` do nothing on TPU or GPU.
  `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot` restores jax's default.

The thread pool (`PJRT_NPROC`, set by `simulate_cpu_devices` and at `tot.setup()`
when CPU devices are simulated; a user's own `PJRT_NPROC` or `NPROC` is kept). XLA:CPU runs every
simulated device's program on one shared pool of threads (`tf_XLAEigen`, as
many as devices or CPUs, whichever is more), and a thread that enters a
collective blocks until every device has arrived. XLA's thunk executor runs
independent parts of one device's program at once, so one device can wait in
two collectives together (an all-reduce inside a scan's loop and an all-gather
beside it). With 8 devices on 8 threads, all 8 threads were waiting while the
device still missing from the all-gather had no thread left to arrive on, and
XLA aborted after 40 s ("Termination timeout for all gather ... only 7 of them
arrived"): jax 0.10.2, Muse Glimmer's 2-step recipe run on 8 devices in 3 of 8
fresh runs, DeepSeek-V3 with multi-token prediction on ep=8 in 1 of 2. XLA
orders the collectives of one level of control flow, so a device waits in at
most one per level (`COLLECTIVES_IN_FLIGHT_PER_DEVICE`, 3); with that many
threads per device plus one, a thread is always free: 0 of 6 and 0 of 2 at 25
threads (0 of 14 and 0 of 5 at 32), and Qwen3.5's step loaded from the
persistent cache 2 of 2. Waiting threads take no CPU time, but more threads than that
cost the step time: `tools/bench_step.py --devices=8` ran 5.5 s per step at 8
and at 25 threads, 5.9-6.4 s at 32. (`--xla_cpu_enable_concurrency_optimized_scheduler=false`,
our default before this was understood, only changed which programs ran into it:
Muse Glimmer's failures above ran with it off, so it is left at XLA's default.)

`compile_options(platform)` are per-program options for the programs we
compile (`jax.jit(compiler_options=...)`); unlike XLA_FLAGS they hold whenever
jax's backend started. They guard correctness:

- `xla_disable_hlo_passes=scatter_expander` (CPU, GPU). The pass turns a
  scatter with few indices into dynamic-slice / select / dynamic-update-slice.
  When the SPMD partitioner has sharded the scattered dim, the start index is
  out of range on every shard but the owner's, and XLA's algebraic simplifier
  then folds `dynamic-slice(dynamic-slice(x, a), b)` into one slice at
  `clamp(a) + b` without clamping `b` (openxla/xla#49121, jax-ml/jax#40849), so
  the "unchanged" row written back on the other shards is read from the wrong
  place. Seen as `grad.at[padding_idx].set(0)` on a sharded embedding table
  moving the pad token's gradient onto the first row of every other shard.
  Without the pass the scatter stays a scatter, which XLA partitions and runs
  correctly; the cost is nil (a scatter of a few rows). Not applied on TPU,
  whose compiler is not open to check the pass names against.
- `xla_allow_excess_precision=false` (every platform; `EXCESS_PRECISION`). XLA's
  default lets a fusion keep a bf16 intermediate in fp32 instead of rounding it
  where the program says; torch rounds after every op. With it allowed, the
  backward of `silu(a) * b` in bf16 matched torch eager bit for bit in 75% of
  elements, without it in 100% (`tools/bf16_sweep.py`; docs/precision.md has the
  model-level figures and the cost).

And one that only changes speed and memory, on TPU:

- `xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000` (TPU; `COLLECTIVE_MATMUL = False`,
  recipes' `--collective_matmul`). Left to itself the TPU compiler runs each large matmul with a
  sharded operand as a "collective matmul": a loop that passes blocks of an operand or of the
  partial result round the ring, one matmul per block, to hide each transfer behind compute.
  For FSDP's step that moved about twice the bytes FSDP needs: Llama 3.1 8B on v6e-8 (batch
  8 × 8192, remat full) sent 79.9 GiB a chip per step, 2.04× FSDP's ideal, and read 903 GB of
  HBM with 12.6 GiB of temporaries; with whole all-gathers before the matmuls and whole
  reduce-scatters after them, which the latency-hiding scheduler overlaps with neighbouring
  layers, 38.2 GiB (0.97×), 501 GB and 11.2 GiB, a 0.72 s roofline step instead of 0.84
  (CHANGELOG.md, "Collective matmuls off on TPU"). MaxText's tuned Trillium recipes set
  the same threshold (its `DISABLE_COLLECTIVE_MATMUL`). A threshold or windowed-einsum flag the
  user puts in `LIBTPU_INIT_ARGS` is left to rule.
"""

from __future__ import annotations

import logging
import os

from torch_on_tpu.runtime import libtpu

logger = logging.getLogger(__name__)

DEFAULTS = {"--xla_cpu_experimental_ynn_fusion_type": ""}

# The most collectives one simulated device may wait in at once: one per level of
# control flow holding collectives (the program, a scan over layers, the pipeline's
# loop around that scan). XLA:CPU's pool gets this many threads per device plus one,
# so some thread is always free (module docstring).
COLLECTIVES_IN_FLIGHT_PER_DEVICE = 3


_COMPILE_OPTIONS = {
  "cpu": {"xla_disable_hlo_passes": "scatter_expander"},
  "gpu": {"xla_disable_hlo_passes": "scatter_expander"},
}

# Whether XLA may skip bf16/fp16 roundings the program asks for (XLA's default: yes).
# False rounds where torch rounds; set True to trade that for fewer converts.
EXCESS_PRECISION = False

# Whether the TPU compiler may run sharded matmuls as collective matmuls (windowed einsums; its
# default: yes). False gathers and reduce-scatters whole, as FSDP's ideal counts (module docstring).
COLLECTIVE_MATMUL = False
_NO_COLLECTIVE_MATMUL = {"xla_jf_spmd_threshold_for_windowed_einsum_mib": "1000000"}
# LIBTPU_INIT_ARGS flags by which a user decides collective matmuls themselves.
_COLLECTIVE_MATMUL_FLAGS = ("--xla_jf_spmd_threshold_for_windowed_einsum_mib", "--xla_tpu_enable_windowed_einsum_for_")


def compile_options(platform: str) -> dict[str, str | bool]:
  """The per-program XLA options for programs compiled for `platform` (a device's `.platform`)."""
  options = dict(_COMPILE_OPTIONS.get(platform, {}))
  options["xla_allow_excess_precision"] = EXCESS_PRECISION
  user_decides = any(f.startswith(_COLLECTIVE_MATMUL_FLAGS) for f in os.environ.get("LIBTPU_INIT_ARGS", "").split())
  if platform == "tpu" and not COLLECTIVE_MATMUL and not user_decides:
    options.update(_NO_COLLECTIVE_MATMUL)
  return options


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_cpu_devices(flags: str, count: int, *, replace: bool = True) -> str:
  """`flags` asking XLA's CPU backend for `count` simulated devices; a count `flags`
  already asks for is replaced, or kept when `replace=False`."""
  kept = flags.split()
  if any(f.startswith(DEVICE_COUNT_FLAG) for f in kept) and not replace:
    return flags
  kept = [f for f in kept if not f.startswith(DEVICE_COUNT_FLAG)]
  return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={count}"])


def simulate_cpu_devices(count: int, environ=os.environ, *, replace: bool = True, cpu_only: bool = False) -> None:
  """Sets `environ` up for `count` simulated CPU devices (how sharding runs without
  accelerators), with threads enough for their collectives (`with_thread_headroom`: jax
  code run before `tot.setup()` gets them too); `cpu_only` also keeps jax off any
  GPU/TPU. Before jax starts."""
  environ["XLA_FLAGS"] = with_cpu_devices(environ.get("XLA_FLAGS", ""), count, replace=replace)
  with_thread_headroom(environ)
  libtpu.quiet_without_chips(environ)
  if cpu_only:
    environ["JAX_PLATFORMS"] = "cpu"


def _names(flags: str) -> set[str]:
  return {f.split("=", 1)[0] for f in flags.split()}


def with_defaults(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) plus every default it does not set itself."""
  present = _names(flags)
  added = [f"{name}={value}" for name, value in DEFAULTS.items() if name not in present]
  return " ".join([*flags.split(), *added])


def simulated_device_count(flags: str) -> int:
  """How many CPU devices `flags` (an XLA_FLAGS value) asks XLA to simulate (1: none asked)."""
  counts = [f.split("=", 1)[1] for f in flags.split() if f.startswith(f"{DEVICE_COUNT_FLAG}=")]
  if not counts:
    return 1
  if not counts[-1].isdigit():
    from torch_on_tpu.errors import TorchOnTpuError  # here: the launcher reads this module without torch

    raise TorchOnTpuError(f"XLA_FLAGS sets {DEVICE_COUNT_FLAG}={counts[-1]}; give a whole number of devices, e.g. =8.")
  return int(counts[-1])


def with_thread_headroom(environ) -> None:
  """Sets `PJRT_NPROC` to `COLLECTIVES_IN_FLIGHT_PER_DEVICE` threads per simulated CPU
  device plus one (never fewer than the CPUs this process may use), unless the user
  sized the pool (`PJRT_NPROC` or `NPROC`) or no devices are simulated."""
  count = simulated_device_count(environ.get("XLA_FLAGS", ""))
  if count > 1 and not {"PJRT_NPROC", "NPROC"} & environ.keys():
    threads = COLLECTIVES_IN_FLIGHT_PER_DEVICE * count + 1
    environ["PJRT_NPROC"] = str(max(len(os.sched_getaffinity(0)), threads))


def apply_defaults(environ=os.environ) -> None:
  """Adds the defaults to `environ["XLA_FLAGS"]`, sizes XLA:CPU's thread pool for the
  simulated devices (`with_thread_headroom`) and quiets libtpu where no TPU chips are
  (`libtpu.quiet_without_chips`); says so if jax already started."""
  libtpu.quiet_without_chips(environ)
  current = environ.get("XLA_FLAGS", "")
  updated = with_defaults(current)
  pool = environ.get("PJRT_NPROC")
  with_thread_headroom(environ)
  if updated == current and environ.get("PJRT_NPROC") == pool:
    return
  environ["XLA_FLAGS"] = updated
  from torch_on_tpu.core import _compat  # here, not at the top: the launcher reads DEFAULTS without torch

  if _compat.backend_started():
    logger.info(
      "jax started its backend before torch_on_tpu's platform start-up, so this process runs "
      "without torch_on_tpu's default XLA flags (%s) and thread pool size (PJRT_NPROC); call "
      "tot.setup() first, or set them in the environment.",
      ", ".join(DEFAULTS),
    )
