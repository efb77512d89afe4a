"""torchtitan's Qwen3.5 imports flash-linear-attention, which the project does not install (where it
is, transformers calls its CUDA kernels for every Qwen3.5 on CPU too): after `import torch_on_tpu`
the import passes on stand-ins that nothing else sees, and transformers keeps its own torch code."""

import subprocess
import sys

SCRIPT = """
import importlib.util, sys
import torch, torch_on_tpu
assert importlib.util.find_spec("fla") is None, "fla-core is installed"
import torchtitan.models.qwen3_5.model as titan
assert not [m for m in sys.modules if m == "fla" or m.startswith("fla.")]
assert importlib.util.find_spec("fla") is None
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
rule = hf.torch_chunk_gated_delta_rule
print("transformers binds a package:", dict(zip(rule.__code__.co_freevars, rule.__closure__))["is_new_implementation"].cell_contents)
kernel = titan.GatedDeltaKernel(titan.GatedDeltaKernel.Config())
x = torch.ones(1, 4, 2, 8)
try:
  kernel(x, x, x, -torch.ones(1, 4, 2), torch.ones(1, 4, 2))
except RuntimeError as e:
  print(e)
"""


def test_torchtitans_qwen3_5_imports_without_fla_and_says_so_when_run_eagerly():
  done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == [
    "transformers binds a package: False",
    "torchtitan's Qwen3.5 called flash-linear-attention's chunk_gated_delta_rule in eager torch, and fla-core is "
    "not installed: run the model through tot.ShardedModule (which computes its Gated DeltaNet itself), or on a "
    "CUDA machine pip install fla-core==0.6.0.",
  ], done.stdout
