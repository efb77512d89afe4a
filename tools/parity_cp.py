"""Context parallelism parity: each model at cp > 1 against the same model at cp = 1.

    python tools/parity_cp.py                       # the whole matrix (a few minutes on CPU)
    python tools/parity_cp.py --models=titan --meshes=fsdp2xcp4 --scan=false

Models (tiny, CPU): torchtitan's Llama 3 debugmodel cut to 2 layers with flex
attention over packed documents (`flex_masks(positions)`); HF Llama and Qwen3
(SDPA) with left padding (an `attention_mask` with zeros at the start of some
rows), and Qwen3 without padding (`qwen3_causal`). HF's masks reach the kernel
as a causal flag with segment ids (transformers' mask interface), so HF calls
run zig-zag with K/V gathered, as torchtitan's do without the ring. Meshes on 8 simulated devices: cp=8, fsdp=2 x cp=4, fsdp=2 x tp=2 x cp=2,
each against fsdp=8 (cp=1) from the same initial weights. Measured: the
forward's logits, the losses of 5 AdamW steps and the trained weights, as
‖Δ‖/‖ref‖ (targets: forward 1e-5, losses and weights 1e-4); then the state
trained at cp > 1 continues at cp = 1 (a checkpoint's resume across meshes)
and its next loss is compared with the reference's.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

MESHES = {"cp8": dict(cp=8), "fsdp2xcp4": dict(fsdp=2, cp=4), "fsdp2xtp2xcp2": dict(fsdp=2, tp=2, cp=2)}
MODELS = ("titan", "llama", "qwen3", "qwen3_causal")
REFERENCE = dict(fsdp=8)
BATCH, SEQ, STEPS = 8, 64, 5
FORWARD_TOL, TRAIN_TOL = 1e-5, 1e-4


def rel(a, b) -> float:
  import numpy as np

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def build(name: str):
  """(a CPU model with fixed initial weights, its call inputs, the labels)."""
  import torch

  from torch_on_tpu.models import torchtitan as titan
  from torch_on_tpu.models.hf import build_causal_lm

  tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
  torch.manual_seed(0)
  if name == "titan":
    model = titan.build_llama3("debugmodel", max_seq_len=SEQ, device="cpu")
    model.layers = torch.nn.ModuleDict({k: model.layers[k] for k in ("0", "1")})
    documents = [[10, 54], [64], [5, 11, 48], [39, 25]] * (BATCH // 4)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    return model, (tokens, positions, titan.flex_masks(positions)), tokens
  import transformers

  common = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2 * SEQ,
  )
  config = transformers.LlamaConfig(**common) if name == "llama" else transformers.Qwen3Config(head_dim=16, **common)
  config._attn_implementation = "sdpa"
  model = build_causal_lm(config, device="cpu")
  if name.endswith("_causal"):
    return model, {"input_ids": tokens, "use_cache": False}, tokens
  mask = torch.ones(BATCH, SEQ, dtype=torch.long)
  mask[1, :7] = 0  # left padding
  mask[3, :20] = 0
  return model, {"input_ids": tokens, "attention_mask": mask, "use_cache": False}, tokens


def loss_fn(outputs, labels):
  import torch.nn.functional as F

  logits = outputs.logits if hasattr(outputs, "logits") else outputs
  return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train(model, inputs, labels, axes: dict, *, scan: bool) -> dict:
  """The logits, the losses of STEPS steps, the trained weights, the step and its compile
  report on a mesh; for the reference also `next`, the loss of one step more."""
  import numpy as np
  import optax

  import torch_on_tpu as tot

  sharding = "fsdp_tp" if axes.get("tp", 1) > 1 else "fsdp"
  jm = tot.ShardedModule(copy.deepcopy(model), mesh=tot.make_mesh(**axes), sharding=sharding, attention="xla", scan=scan)
  out = jm(*inputs) if isinstance(inputs, tuple) else jm(**inputs)
  logits = tot.to_cpu(out.logits if hasattr(out, "logits") else out).numpy()
  step = tot.make_train_step(jm, loss_fn, optax.adamw(1e-2))
  losses = [float(step(inputs, labels)) for _ in range(STEPS)]
  weights = {k: np.asarray(v) for k, v in jm.state_dict().items()}
  result = dict(logits=logits, losses=losses, weights=weights, step=step, report=step.last_compile)
  if axes == REFERENCE:
    result["next"] = float(step(inputs, labels))
  return result


def compare(name: str, mesh: str, *, scan: bool, reference=None) -> dict:
  """One cell of the matrix: the errors of `name` on `mesh` against cp=1."""
  model, inputs, labels = build(name)
  start = time.perf_counter()
  ref = reference or train(model, inputs, labels, REFERENCE, scan=scan)
  got = train(model, inputs, labels, MESHES[mesh], scan=scan)
  # Resume across meshes: the state trained at cp > 1 continues at cp = 1 (the reference's
  # step, whose own state is not needed again).
  ref["step"].state = got["step"].state
  resumed = float(ref["step"](inputs, labels))
  return dict(
    model=name, mesh=mesh, scan=scan,
    forward=rel(got["logits"], ref["logits"]),
    losses=max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
    weights=max(rel(got["weights"][k], ref["weights"][k]) for k in ref["weights"]),
    resumed_loss=abs(resumed - ref["next"]) / abs(ref["next"]),
    attention=", ".join(got["report"].attention_splits),
    seconds=time.perf_counter() - start,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--meshes", default=",".join(MESHES))
  parser.add_argument("--scan", default="both", choices=("both", "true", "false"))
  args = parser.parse_args(argv)

  from torch_on_tpu.runtime import xla_flags

  xla_flags.simulate_cpu_devices(8, replace=False)
  import torch_on_tpu as tot

  tot.setup()
  scans = {"both": (False, True), "true": (True,), "false": (False,)}[args.scan]
  failed = False
  print(f"{'model':7} {'mesh':14} {'scan':5} {'forward':>9} {'losses':>9} {'weights':>9} {'resumed':>9}  attention")
  for name in args.models.split(","):
    for scan in scans:
      model, inputs, labels = build(name)
      reference = train(model, inputs, labels, REFERENCE, scan=scan)
      for mesh in args.meshes.split(","):
        r = compare(name, mesh, scan=scan, reference=reference)
        ok = r["forward"] <= FORWARD_TOL and max(r["losses"], r["weights"], r["resumed_loss"]) <= TRAIN_TOL
        failed |= not ok
        print(
          f"{name:7} {mesh:14} {str(scan):5} {r['forward']:9.1e} {r['losses']:9.1e} {r['weights']:9.1e} "
          f"{r['resumed_loss']:9.1e}  {r['attention']}{'' if ok else '  FAIL'}",
          flush=True,
        )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
