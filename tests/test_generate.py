"""tot.generate: greedy decoding gives eager torch's greedy tokens; top-k is seeded."""

import pytest
import torch

import torch_on_tpu as tot
from tests import helpers as h


@pytest.fixture(scope="module")
def llama():
  torch.manual_seed(0)
  ref = h.hf(device="cpu")
  jm = tot.JittableModule(h.hf(), mesh=tot.make_mesh(fsdp=8))
  jm_state = jm.state_dict()
  ref.load_state_dict(dict(jm_state))
  return jm, ref


def test_greedy_matches_eager_torch(llama):
  jm, ref = llama
  prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
  ids = prompt
  for _ in range(6):
    logits = ref(ids, use_cache=False).logits[:, -1]
    ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
  got = tot.generate(jm, prompt, max_new_tokens=6)
  assert got.dtype == torch.int64 and torch.equal(got, ids)
  assert torch.equal(tot.generate(jm, prompt[0], max_new_tokens=6), ids[0])  # one unbatched prompt


def test_top_k_samples_among_the_k_likeliest_reproducibly(llama):
  jm, _ = llama
  prompt = torch.tensor([[1, 2, 3]])
  first = tot.generate(jm, prompt, max_new_tokens=8, top_k=5, seed=3)
  assert torch.equal(first, tot.generate(jm, prompt, max_new_tokens=8, top_k=5, seed=3))
  assert torch.equal(tot.generate(jm, prompt, max_new_tokens=8, top_k=1, seed=9), tot.generate(jm, prompt, max_new_tokens=8))
  with pytest.raises(tot.TorchOnTpuError, match="max_new_tokens must be a positive integer"):
    tot.generate(jm, prompt, max_new_tokens=0)
