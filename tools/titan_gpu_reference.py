"""A torchtitan model against torchtitan as it runs on a GPU: the whole-model reference the CPU cannot give.

    .venv/bin/python tools/titan_gpu_reference.py make .gpu/gpt_oss gpt_oss:debugmodel   # here (minutes)
    python3 tools/titan_gpu_reference.py run .gpu/gpt_oss                              # on a CUDA machine
    .venv/bin/python tools/titan_gpu_reference.py compare .gpu/gpt_oss                 # here: the table

gpt-oss runs varlen attention by default, which needs FlashAttention (no CPU kernel), and
its router's fp32 autocast is a CUDA behaviour; on the CPU, `tools/titan_parity.py`
compares it with a stand-in (flex attention computed densely, the autocast emulated).
This tool closes that gap. `make` builds the family's small config (`titan_parity.shrink`)
and its initial state through the bridge, then records four runs from that state, each a
forward and 5 AdamW steps on the same packed batches (`titan_parity.Run`, with the first
step's gradients for the eager ones): the bridge (8 simulated CPU devices, fsdp), the CPU
eager reference, the second, more exact one, and the reference with attention's backward
as torch's varlen computes it (`REFERENCES`). `run` needs only torch, torchtitan and a GPU
(no jax, nothing of the bridge): it loads the same state into torchtitan's model on CUDA
and records the same run twice, as torchtitan's trainer runs it (its configured attention,
varlen's FlashAttention for gpt-oss; CUDA's autocast; bf16 mixed precision where
`titan_parity.PRECISION` says) and with flex attention compiled by torch; on a torch older
than torchtitan wants it says what it had to bridge (`import_family`,
`keywords_for_this_torch`). `compare` prints every run against the GPU's varlen run.
Figures and what they showed: docs/torchtitan.md, "Against torchtitan on a GPU".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

STEPS = 5
# Two layers (gpt-oss: one sliding-window, one full): each run's trained tensors then fit the
# 16 MiB files a lent GPU machine sends back, in two pieces.
LAYERS = 2
# The CPU's eager references (titan_parity.EagerReference): the reference, the spread's second
# one, and the reference with attention's backward as torch's varlen attention computes it.
REFERENCES = {"cpu_eager": {}, "cpu_exact": {"exact": True}, "cpu_eager_varlen_backward": {"lse_gradient": False}}


def titan_parity():
  """tools/titan_parity.py (its references, `Run`, `compare`), loaded once."""
  if "titan_parity" not in sys.modules:
    spec = importlib.util.spec_from_file_location("titan_parity", Path(__file__).with_name("titan_parity.py"))
    sys.modules["titan_parity"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["titan_parity"])
  return sys.modules["titan_parity"]


def batches_digest(tp) -> str:
  """The packed batches every run reads, hashed: the GPU's torch must draw the same ones."""
  import hashlib

  digest = hashlib.sha256()
  for seed in range(STEPS):
    for t in tp.packed_batch(seed=seed):
      digest.update(t.numpy().tobytes())
  return digest.hexdigest()


def save_run(directory: Path, name: str, run) -> None:
  import safetensors.torch
  import torch

  outputs = run.forward if isinstance(run.forward, list) else [run.forward]
  tensors = {f"forward.{i}": o.float().contiguous() for i, o in enumerate(outputs)}
  tensors.update({f"tensor.{n}": torch.as_tensor(t).detach().contiguous() for n, t in run.tensors.items()})
  tensors.update({f"grad.{n}": g.contiguous() for n, g in run.grads.items()})
  safetensors.torch.save_file(tensors, directory / f"{name}.safetensors")
  (directory / f"{name}.json").write_text(json.dumps({"losses": run.losses, "forwards": len(outputs)}))


def load_run(tp, directory: Path, name: str):
  import safetensors.torch

  tensors = safetensors.torch.load_file(directory / f"{name}.safetensors")
  meta = json.loads((directory / f"{name}.json").read_text())
  forward = [tensors[f"forward.{i}"] for i in range(meta["forwards"])]
  return tp.Run(
    forward=forward if len(forward) > 1 else forward[0],
    losses=meta["losses"],
    tensors={n.removeprefix("tensor."): t for n, t in tensors.items() if n.startswith("tensor.")},
    grads={n.removeprefix("grad."): t for n, t in tensors.items() if n.startswith("grad.")},
  )


def config_of(tp, meta):
  return tp.shrink(tp.registry_config(meta["spec"]), layers=meta["layers"], round_robin=meta["round_robin"])


def make(directory: Path, spec: str, round_robin: bool) -> int:
  import safetensors.torch
  import torch

  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  tp = titan_parity()
  directory.mkdir(parents=True, exist_ok=True)
  meta = {"spec": spec, "round_robin": round_robin, "layers": LAYERS, "precision": tp.precision_of(spec),
          "batches": batches_digest(tp), "eps": tp.EPS}
  config = config_of(tp, meta)
  jm = tp.wrap(config, "train")
  state = tp.all_tensors(jm)
  safetensors.torch.save_file({n: torch.as_tensor(t).contiguous() for n, t in state.items()}, directory / "state.safetensors")
  precision = meta["precision"]
  save_run(directory, "bridge", tp.run_bridge(jm, precision, forward=True, steps=STEPS, mtp=False))
  for name, options in REFERENCES.items():
    reference = tp.EagerReference(tp.flex_config(config), state, precision=precision, **options)
    save_run(directory, name, tp.run_reference(reference, forward=True, steps=STEPS))
  (directory / "meta.json").write_text(json.dumps(meta, indent=1))
  print(f"wrote {directory}: the state and the bridge's and the CPU references' runs; next, on a GPU: "
        f"python3 tools/titan_gpu_reference.py run {directory}")
  return 0


def import_family(spec: str) -> list[str]:
  """Imports torchtitan's package for `spec`. torchtitan 0.3.0 wants a newer torch than some
  GPU images hold (2.11 lacks names its FSDP and parallelism modules import at load time); a
  name torch lacks is given a placeholder class, and the names so given are returned. Only
  torchtitan's parallelize code reads them, which this tool never calls: the model, its
  attention, MoE and optimizer hooks run on torch's own code."""
  import importlib
  import re
  import types

  placeholder = lambda name: type(name, (), {"__init__": lambda self, *a, **k: None})  # noqa: E731
  placeholders = []
  name = spec.split(":")[0]
  for _ in range(32):
    before = set(sys.modules)
    try:
      importlib.import_module(f"torchtitan.models.{name}")
      importlib.import_module("torchtitan.components.optimizer")
      return placeholders
    except ImportError as e:
      name_missing = re.match(r"cannot import name '(\w+)' from '(torch[\w.]*)'", str(e))
      module_missing = re.match(r"No module named '(torch\.[\w.]+)'", str(e))
      if name_missing and name_missing.group(2) in sys.modules:
        setattr(sys.modules[name_missing.group(2)], name_missing.group(1), placeholder(name_missing.group(1)))
        placeholders.append(f"{name_missing.group(2)}.{name_missing.group(1)}")
      elif module_missing:
        module = types.ModuleType(module_missing.group(1))
        module.__getattr__ = lambda attr: placeholder(attr) if not attr.startswith("__") else object.__getattribute__(module, attr)
        sys.modules[module_missing.group(1)] = module
        placeholders.append(module_missing.group(1))
      else:
        raise
      for loaded in set(sys.modules) - before:  # torchtitan's half-imported modules, tried again
        if loaded.split(".")[0] in ("torchtitan", "spmd_types"):
          del sys.modules[loaded]
  raise RuntimeError(f"torchtitan still fails to import after placeholders for {placeholders}")


def flash_attention_available() -> str:
  """The FlashAttention torchtitan's varlen attention runs here. On Hopper torchtitan asks for
  FA3 (the `flash_attn_interface` package); where that is not installed, torch's built-in
  FlashAttention-2, torchtitan's own choice below Hopper."""
  import importlib.util

  from torchtitan.tools import utils

  chosen = utils.get_cuda_flash_attention_impl()
  if chosen == "FA3" and importlib.util.find_spec("flash_attn_interface") is None:
    utils.get_cuda_flash_attention_impl = lambda: None
    return "FA2 (torch's built-in: torchtitan's FA3 needs flash_attn_interface, not installed)"
  return chosen or "FA2 (torch's built-in)"


def keywords_for_this_torch(dropped: set) -> None:
  """torchtitan 0.3.0 calls torch's attention functions with keywords newer than some torch
  releases (2.11: `varlen_attn`'s `num_splits`, FA3's split-k switch, and `enable_gqa`, where
  FlashAttention-2 reads the grouping from the head counts anyway; `create_block_mask`'s
  `separate_full_blocks`, which only asks for what 2.11 always does): those this torch's
  function does not take are dropped, and named in `dropped`."""
  import inspect

  from torch.nn.attention.flex_attention import create_block_mask
  from torchtitan.models.common import attention

  def dropping(function, accepted):
    def call(*args, **kwargs):
      for name in [k for k in kwargs if k not in accepted]:
        dropped.add(name)
        del kwargs[name]
      return function(*args, **kwargs)

    return call

  attention.varlen_attn = dropping(attention.varlen_attn, inspect.signature(attention.varlen_attn).parameters)
  attention._compiled_create_block_mask = dropping(
    attention._compiled_create_block_mask, inspect.signature(create_block_mask).parameters
  )


def run(directory: Path) -> int:
  import safetensors.torch
  import torch

  tp = titan_parity()
  meta = json.loads((directory / "meta.json").read_text())
  placeholders = import_family(meta["spec"])
  if placeholders:
    print(f"torch {torch.__version__} lacks what torchtitan imports at load time: placeholders for {placeholders}")
  if batches_digest(tp) != meta["batches"]:
    print("titan_gpu_reference: this torch draws other packed batches than the machine that made "
          f"{directory}; the runs would not be comparable.", file=sys.stderr)
    return 1
  tp.EPS = meta["eps"]
  state = safetensors.torch.load_file(directory / "state.safetensors")
  config = config_of(tp, meta)
  environment = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "placeholders": placeholders,
                 "flash_attention": flash_attention_available()}
  print(f"varlen attention runs {environment['flash_attention']}", flush=True)
  dropped = set()
  keywords_for_this_torch(dropped)
  for name, attention_config in (("cuda_native", config), ("cuda_flex", tp.flex_config(config))):
    try:
      reference = tp.EagerReference(attention_config, state, precision=meta["precision"], device="cuda")
      kinds = sorted({type(m).__name__ for m in reference.model.modules() if "Attention" in type(m).__name__})
      save_run(directory, name, tp.run_reference(reference, forward=True, steps=STEPS))
    except Exception as e:  # noqa: BLE001 (flex needs a torch as new as torchtitan's: say so, keep the other run)
      if name == "cuda_native":
        raise
      print(f"{name}: not run on torch {torch.__version__}: {type(e).__name__}: {str(e).splitlines()[0]}")
      continue
    environment[name] = kinds
    environment["keywords_dropped"] = sorted(dropped)
    (directory / "cuda.json").write_text(json.dumps(environment, indent=1))
    print(f"{name}: attention modules {kinds}", flush=True)
  return 0


def compare(directory: Path) -> int:
  tp = titan_parity()
  meta = json.loads((directory / "meta.json").read_text())
  environment = json.loads((directory / "cuda.json").read_text())
  params = {n for n, _ in tp.build(config_of(tp, meta)).named_parameters()}  # the other tensors are buffers
  print(f"{meta['spec']} ({'round-robin' if meta['round_robin'] else 'learned'} routing, {meta['precision']} "
        f"compute), ‖Δ‖/‖ref‖ against torchtitan on {environment['device']} (torch {environment['torch']}, "
        f"{'/'.join(environment['cuda_native'])}), forward and {STEPS} AdamW steps:")
  print("| run | forward | losses | first step's gradients | weights | buffers |\n|---|---|---|---|---|---|")
  rows = (("the bridge (8 CPU devices, fsdp)", "bridge", "cuda_native"),
          ("CPU eager reference (flex, dense)", "cpu_eager", "cuda_native"),
          ("CPU exact reference (fp64 linears, P in fp32)", "cpu_exact", "cuda_native"),
          ("CPU eager reference, log-sum-exp gradient dropped as varlen's backward drops it",
           "cpu_eager_varlen_backward", "cuda_native"),
          ("GPU, flex attention compiled", "cuda_flex", "cuda_native"),
          ("spread: CPU exact against CPU eager", "cpu_exact", "cpu_eager"))
  for label, name, against in rows:
    if not (directory / f"{name}.json").exists():
      continue
    r = tp.compare(load_run(tp, directory, name), load_run(tp, directory, against), params)
    cells = [f"{r[k]:.1e}" if k in r else "—" for k in ("forward", "losses", "grads", "weights", "buffers")]
    print(f"| {label} | {' | '.join(cells)} |")
  return 0


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  m = sub.add_parser("make", help="here: the state, the bridge's run and the CPU references'")
  m.add_argument("directory", type=Path)
  m.add_argument("spec", nargs="?", default="gpt_oss:debugmodel")
  m.add_argument("--round_robin", action="store_true", help="torchtitan's round-robin routing (titan_parity.shrink)")
  for name in ("run", "compare"):
    sub.add_parser(name).add_argument("directory", type=Path)
  return p.parse_args(argv)


# What each step reads from the directory, and which step writes it.
NEEDS = {
  "run": {"meta.json": "make", "state.safetensors": "make"},
  "compare": {"meta.json": "make", "bridge.json": "make", "cuda.json": "run", "cuda_native.json": "run"},
}


def problem(command: str, directory: Path) -> str | None:
  """One sentence on why `command` cannot run on `directory`, or None."""
  for name, step in NEEDS.get(command, {}).items():
    if not (directory / name).is_file():
      return (f"titan_gpu_reference {command}: {directory} has no {name}; run "
              f"'titan_gpu_reference.py {step} {directory}' first{' (on a GPU machine)' if step == 'run' else ''}.")
  if command == "run":
    import torch

    if not torch.cuda.is_available():
      return "titan_gpu_reference run: this torch sees no CUDA GPU; run it on a GPU machine."
  return None


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.command == "make":
    return make(args.directory, args.spec, args.round_robin)
  why = problem(args.command, args.directory)
  if why:
    print(why, file=sys.stderr)
    return 2
  return {"run": run, "compare": compare}[args.command](args.directory)


if __name__ == "__main__":
  sys.exit(main())
