"""A deterministic slice of tools/op_sweep.py (PyTorch's op_db through the public API).

The whole sweep (every float32 op, forward and backward) is `python tools/op_sweep.py`;
here: the ops whose lowering this project fixed or added (each must be exact, or refused
where torch's own behaviour is not reproduced), and every 50th op of the sorted list,
none of which may answer wrongly without an error.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

_spec = importlib.util.spec_from_file_location("op_sweep", Path(__file__).parent.parent / "tools" / "op_sweep.py")
op_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_sweep)

# op → expected (forward, backward) verdicts; None: no backward samples.
FIXED = {
  "polygamma.polygamma_n_1": ("exact", "exact"),  # jax's zeta is wrong for negative arguments
  "digamma": ("exact", "exact"),  # its gradient is the trigamma above
  "i0": ("exact", "exact"),
  "special.log_ndtr": ("exact", "exact"),  # NaN gradient through torch's where-formula
  "nn.functional.elu": ("exact", "exact"),  # exp, not expm1 + 1, in the gradient
  "norm": ("exact", "exact"),  # ord=0 is a float count
  "linalg.norm.subgradients_at_zero": ("exact", "exact"),
  "nn.functional.pdist": ("exact", "exact"),
  "torch.ops.aten._safe_softmax.default": ("exact", "exact"),
  "linalg.eigvalsh": ("exact", "exact"),  # one triangle
  "linalg.pinv.hermitian": ("exact", "exact"),
  "cholesky_inverse": ("exact", "exact"),
  "native_layer_norm": ("exact", "exact"),  # saved statistics carry no gradient
  "as_strided_scatter": ("exact", "refused"),  # torch's input gradient is not the derivative
  "arange": ("exact", None),  # made inside the forward on the CPU
  "signal.windows.hann": ("exact", None),
  "eye": ("exact", None),
  "nonzero": ("refused", None),  # data-dependent size: one sentence naming nonzero_static
  "masked_select": ("refused", "refused"),
  "ldexp": ("exact", "exact"),
  "nonzero_static": ("exact", None),
  "narrow": ("exact", "exact"),
  "combinations": ("exact", "exact"),
  "nn.functional.max_unpool2d": ("exact", "exact"),
  "index_reduce.mean": ("exact", "exact"),
  "index_add": ("exact", "exact"),  # lowered with torch's dtype check
  "searchsorted": ("exact", None),  # side, sorter and N-d sequences
  "nn.functional.cosine_similarity": ("exact", "exact"),  # it formats a traced tensor
  "as_strided.partial_views": ("refused", "refused"),  # storage_offset=0 on a view: the base's elements
}

_ALL = [op_sweep.op_key(op) for op in op_sweep.float32_ops()]
EVERY_50TH = [name for name in _ALL[::50] if name not in FIXED]


@pytest.fixture(scope="module")
def bridge():
  return op_sweep.Bridge()


def _verdicts(bridge, name, samples):
  (op,) = [o for o in op_sweep.float32_ops([name]) if op_sweep.op_key(o) == name]
  with op_sweep._unfixed_seeds():
    result = op_sweep.sweep_op(bridge, op, ["forward", "backward"], samples=samples, timeout=300)
  return {mode: result.get(mode) for mode in ("forward", "backward")}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_a_fixed_op_is_exact_or_refused_in_one_sentence(bridge, name):
  got = _verdicts(bridge, name, samples=2)
  for mode, want in zip(("forward", "backward"), FIXED[name]):
    outcome = got[mode]
    assert (outcome.verdict if outcome else None) == want, (mode, outcome)
    if want == "refused":
      assert outcome.detail.count(". ") == 0 and outcome.detail.endswith("."), outcome.detail


# Samples past the first few where the sweep over every sample found a wrong answer (op, mode,
# sample indices in op_db's order): each is now exact.
LATER_SAMPLES = [
  ("_native_batch_norm_legit", "backward", [9]),  # no running stats: its saved statistics carry no gradient
  ("cdist", "forward", [242, 246]),  # p = ∞ (torchax's torch.cdist raised |Δ| to the power p)
  ("cdist", "backward", [242]),
  ("grid_sampler_3d", "forward", [21]),  # reflection padding: `&` at the dispatcher is bitwise
  ("grid_sampler_3d", "backward", [21]),
  ("index_reduce.mean", "backward", [5, 7]),  # rows no index hits: no 0/0 in the gradient
  ("_segment_reduce.offsets", "backward", [42, 43]),  # empty segments, rows outside every segment
  ("_segment_reduce.lengths", "backward", [42]),
  ("linalg.lstsq", "backward", [31, 33]),  # torch's gradient (pinv's), none through the singular values
  ("linalg.svd", "forward", [185, 188]),  # singular vectors compared up to sign (and complement basis)
  ("linalg.svd", "backward", [202]),  # full_matrices: the vectors past the k-th carry no gradient (torch's)
  ("svd", "backward", [206]),
  ("searchsorted", "forward", [221]),  # empty sequence and values
  ("native_group_norm", "forward", [13]),  # empty input: [N, group] statistics
  ("nonzero_static", "forward", [57]),  # empty input: all fill_value
  ("repeat_interleave", "forward", [4]),  # output_size=
  ("max_pool2d_with_indices_backward", "forward", [1139, 1150]),  # dilation: scattered by the indices
  ("as_strided.partial_views", "forward", [0, 2]),  # a view's own storage offset, and one inside it
  ("as_strided.partial_views", "backward", [0, 2]),
]


@pytest.mark.parametrize("name, mode, indices", LATER_SAMPLES, ids=[f"{n}-{m}" for n, m, _ in LATER_SAMPLES])
def test_a_later_sample_the_whole_sweep_found_wrong_is_exact(bridge, name, mode, indices):
  (op,) = [o for o in op_sweep.float32_ops([name]) if op_sweep.op_key(o) == name]
  runner = op_sweep.run_forward if mode == "forward" else op_sweep.run_backward
  with op_sweep._unfixed_seeds():
    samples = op_sweep.samples_of(op, max(indices) + 1, requires_grad=mode == "backward")
    for i in indices:
      outcome = runner(bridge, op, samples[i], 300)
      assert outcome is not None and outcome.verdict == "exact", (i, outcome)


@pytest.mark.parametrize("name", EVERY_50TH)
def test_no_op_of_the_slice_answers_wrongly(bridge, name):
  for mode, outcome in _verdicts(bridge, name, samples=1).items():
    assert outcome is None or outcome.verdict != "wrong", (mode, outcome)


def test_the_sweep_tells_a_wrong_answer_from_rounding():
  import torch

  want = torch.tensor([1.0, 2.0, 3.0])
  assert op_sweep.compare(want + 1e-7, want) is None
  assert "rel err" in op_sweep.compare(want * 1.001, want)
  assert "dtype" in op_sweep.compare(want.int(), want)
  assert "NaN" in op_sweep.compare(torch.tensor([float("nan"), 2.0, 3.0]), want)
  ok, _ = op_sweep.rounding_only([want * (1 + 3e-5)], [want * (1 + 2e-5)], [want.double()])
  assert ok  # as far from float64 as torch's own float32 result
  ok, _ = op_sweep.rounding_only([want * (1 + 3e-4)], [want * (1 + 2e-5)], [want.double()])
  assert not ok


class _Strided(torch.nn.Module):
  def __init__(self, offset):
    super().__init__()
    self.offset = offset

  def forward(self, x):
    return torch.as_strided(x, (2, 2), (1, 2), self.offset)


class _Doubled(torch.nn.Module):
  def forward(self, x):
    return x * 2


def test_as_strided_within_the_tensor_is_torchs_and_past_it_is_refused():
  """Within the tensor's own elements, torch's values; past them torch reads the storage the
  tensor is a view of (or raises), which the program does not hold: one sentence, where
  torchax clamped the index (a view's elements 10..13 read as four copies of its last)."""
  import jax

  import torch_on_tpu as tot

  x = torch.arange(20.0)[:10]
  jm = tot.ShardedModule(_Strided(3), mesh=tot.make_mesh(fsdp=1, devices=jax.devices()[:1]))
  assert torch.equal(tot.to_cpu(jm(x)), torch.as_strided(x, (2, 2), (1, 2), 3))
  jm = tot.ShardedModule(_Strided(10), mesh=tot.make_mesh(fsdp=1, devices=jax.devices()[:1]))
  with pytest.raises(tot.TorchOnTpuError, match=r"reads storage position 10, which is not one of the 10 elements") as info:
    jm(x)
  assert str(info.value).count(". ") == 0


def test_as_strided_on_a_view_reads_its_storage_as_torch_does():
  """An input torch holds as a view (a slice with a storage offset, a transposed tensor), a CPU
  model's parameter that is one, or a slice the model takes: read by its storage offset and
  strides, as torch reads it; a position outside the view (the base's elements) is refused, where
  it read the view's own."""
  import jax

  import torch_on_tpu as tot

  mesh = tot.make_mesh(fsdp=1, devices=jax.devices()[:1])
  base = torch.arange(20.0)
  view, transposed = base[5:15], base.reshape(4, 5).t()
  for offset in (None, 7, 10):
    assert torch.equal(tot.to_cpu(tot.ShardedModule(_Strided(offset), mesh=mesh)(view)), torch.as_strided(view, (2, 2), (1, 2), offset))
  assert torch.equal(tot.to_cpu(tot.ShardedModule(_Strided(None), mesh=mesh)(transposed)), torch.as_strided(transposed, (2, 2), (1, 2)))
  with pytest.raises(tot.TorchOnTpuError, match=r"storage_offset 0 reads storage position 0, which is not one of the 10 elements"):
    tot.ShardedModule(_Strided(0), mesh=mesh)(view)
  jm = tot.ShardedModule(_Strided(6), mesh=mesh)  # the program depends on the view's offset: one per offset
  for start in (5, 3):
    assert torch.equal(tot.to_cpu(jm(base[start:start + 10])), torch.as_strided(base[start:start + 10], (2, 2), (1, 2), 6))
  assert len(jm._compiled) == 2
  jm = tot.ShardedModule(_Doubled(), mesh=mesh)  # one that reads no storage: one program for every slice
  for start in (5, 3, 0):
    assert torch.equal(tot.to_cpu(jm(base[start:start + 10])), base[start:start + 10] * 2)
  assert len(jm._compiled) == 1

  class Held(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.w = torch.nn.Parameter(base[5:15])

    def forward(self):
      return torch.as_strided(self.w, (2, 2), (1, 2), 9)

  assert torch.equal(tot.to_cpu(tot.ShardedModule(Held(), mesh=mesh)()), torch.as_strided(base[5:15], (2, 2), (1, 2), 9))

  class Sliced(torch.nn.Module):  # a slice the model takes itself
    def forward(self, x):
      return torch.as_strided(x[1:, 2:], (2, 2), (1, 5), 8)

  grid = torch.arange(20.0).reshape(4, 5)
  assert torch.equal(tot.to_cpu(tot.ShardedModule(Sliced(), mesh=mesh)(grid)), Sliced()(grid))


def test_repeat_interleave_with_an_output_size_that_is_not_the_sum_raises_as_torch_does():
  import jax

  import torch_on_tpu as tot

  class Repeat(torch.nn.Module):
    def forward(self, x, repeats):
      return x.repeat_interleave(repeats, dim=0, output_size=5)

  x, repeats = torch.arange(3.0), torch.tensor([1, 2, 3])
  with pytest.raises(RuntimeError):
    Repeat()(x, repeats)  # torch: the sum is 6
  jm = tot.ShardedModule(Repeat(), mesh=tot.make_mesh(jax.devices()[:1], fsdp=1))
  with pytest.raises(tot.TorchOnTpuError, match="output_size=5, which is not the sum of its repeats"):
    tot.to_cpu(jm(x, repeats))
  assert torch.equal(tot.to_cpu(jm(x, torch.tensor([1, 2, 2]))), Repeat()(x, torch.tensor([1, 2, 2])))

  class Function(torch.nn.Module):
    def forward(self, x, repeats):
      return torch.repeat_interleave(x, repeats, dim=0, output_size=5)

  jm = tot.ShardedModule(Function(), mesh=tot.make_mesh(jax.devices()[:1], fsdp=1))
  with pytest.raises(tot.TorchOnTpuError, match="output_size=5, which is not the sum of its repeats"):
    tot.to_cpu(jm(x, repeats))

