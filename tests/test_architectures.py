"""More HF causal-LM architectures, unmodified, at the same parity as Llama.

Each runs through the generic path (nothing Llama-specific): logits within
1e-5 and cross-entropy grads within 1e-4 of eager torch (‖Δ‖/‖ref‖, fp32), and
the scanned layer stack equal to the unscanned one within 1e-6.
"""

import pytest

import torch_on_tpu as tot
from tests import helpers as h

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

CASES = [
  ("qwen2", dict(fsdp=8), "fsdp"),
  ("qwen2", dict(fsdp=4, tp=2), "fsdp_tp"),
  ("gemma", dict(fsdp=8), "fsdp"),
  ("gemma", dict(fsdp=4, tp=2), "fsdp_tp"),
  ("phi3", dict(fsdp=8), "fsdp"),
  ("phi3", dict(fsdp=4, tp=2), "fsdp_tp"),
  ("gpt2", dict(fsdp=8), "fsdp"),
]


@pytest.mark.parametrize("arch,mesh_axes,sharding", CASES, ids=[f"{a}-{s}" for a, _, s in CASES])
def test_architecture_matches_eager_and_scan_matches_loop(arch, mesh_axes, sharding):
  builder = lambda device="meta": h.hf(arch, device=device)  # noqa: E731
  mesh = tot.make_mesh(**mesh_axes)
  jm = tot.ShardedModule(builder(), mesh=mesh, sharding=sharding)
  ref = h.reference(jm, builder)
  kwargs = {"use_cache": False}
  tokens, labels = h.random_batch(256)
  ref_logits, ref_loss, ref_grads = h.torch_loss_and_grads(ref, tokens, labels, kwargs)

  logits = tot.to_cpu(jm(tokens, **kwargs).logits)
  assert h.rel(logits, ref_logits) < 1e-5
  loss, grads = h.jax_loss_and_grads(jm, tokens, labels, kwargs)
  assert h.rel(loss, ref_loss) < 1e-5
  worst = max((h.rel(grads[n], ref_grads[n]), n) for n in ref_grads)
  assert worst[0] < 1e-4, worst

  scanned = tot.ShardedModule(builder(), mesh=mesh, sharding=sharding, scan=True)
  assert scanned._layout is not None
  scanned_logits = tot.to_cpu(scanned(tokens, **kwargs).logits)
  assert h.rel(scanned_logits, logits) < 1e-6
  _, scanned_grads = h.jax_loss_and_grads(scanned, tokens, labels, kwargs)
  scanned_grads = h.per_layer(scanned, scanned_grads)
  worst = max((h.rel(scanned_grads[n], grads[n]), n) for n in grads)
  assert worst[0] < 1e-6, worst


def test_gpt2_has_no_fsdp_tp_map_and_says_so():
  with pytest.raises(tot.TorchOnTpuError, match="No 'fsdp_tp' map is known for GPT2LMHeadModel"):
    tot.ShardedModule(h.hf("gpt2"), mesh=tot.make_mesh(fsdp=4, tp=2), sharding="fsdp_tp")
