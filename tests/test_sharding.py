"""Sharding maps: pattern syntax, precedence, presets, and one-sentence errors."""

import logging

import jax
import pytest
from jax.sharding import PartitionSpec as P

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.parallel import sharding as sh

TENSORS = [
  sh.TensorInfo("tok_embeddings.weight", (2048, 256)),
  sh.TensorInfo("layers.0.attention.wo.weight", (256, 256)),
  sh.TensorInfo("layers.1.attention.wo.weight", (256, 256)),
  sh.TensorInfo("layers.0.attention_norm.weight", (256,)),
  sh.TensorInfo("layers.1.attention_norm.weight", (256,)),
  sh.TensorInfo("layers.0.attention.rope.cache", (64, 8), is_param=False),
]
MODULES = ["tok_embeddings", "layers", "layers.0", "layers.1", "layers.0.attention", "layers.1.attention"]


@pytest.fixture(scope="module")
def mesh():
  return tot.make_mesh(fsdp=4, tp=2)


def resolve(smap, mesh, **kw):
  return sh.resolve(smap, TENSORS, MODULES, mesh, **kw)


def test_star_is_one_component_and_double_star_any(mesh):
  r = resolve({"layers.*.attention.wo.weight": ("fsdp", "tp"), "**.attention_norm.weight": ("tp",)}, mesh)
  assert r.specs["layers.1.attention.wo.weight"] == P("fsdp", "tp")
  assert r.specs["layers.0.attention_norm.weight"] == P("tp")
  assert sh.compile_pattern("layers.*.weight").match("layers.0.attention.weight") is None


def test_most_specific_pattern_wins_and_ties_go_to_the_first(mesh):
  r = resolve(
    {
      "layers.*.attention.wo.weight": ("fsdp", None),
      "layers.1.attention.wo.weight": (None, "tp"),
      "**.wo.weight": (None, None),
    },
    mesh,
  )
  assert r.specs["layers.1.attention.wo.weight"] == P(None, "tp")
  assert r.specs["layers.0.attention.wo.weight"] == P("fsdp", None)
  tie = resolve({"layers.?.attention.wo.weight": ("fsdp", None), "layers.*.attention.wo.weight": ("tp", None)}, mesh)
  assert tie.specs["layers.0.attention.wo.weight"] == P("fsdp", None)


def test_uncovered_params_are_replicated_and_listed_once(mesh, caplog):
  with caplog.at_level(logging.WARNING):
    r = resolve({"tok_embeddings.weight": ("fsdp", "tp")}, mesh)
  assert r.specs["layers.0.attention.wo.weight"] == P(None, None)
  assert "layers.0.attention.rope.cache" not in r.uncovered  # buffers are replicated silently
  assert len(r.uncovered) == 4
  assert sum("covers no pattern for 4 parameters" in m for m in caplog.messages) == 1


def test_strict_makes_uncovered_params_an_error(mesh):
  with pytest.raises(tot.TorchOnTpuError, match="layers.0.attention.wo.weight"):
    resolve({"tok_embeddings.weight": ("fsdp", "tp")}, mesh, strict=True)


def test_pattern_matching_nothing_names_it_and_lists_near_misses(mesh):
  with pytest.raises(tot.TorchOnTpuError) as e:
    resolve({"layers.*.atention.wo.weight": ("fsdp", "tp")}, mesh)
  msg = str(e.value)
  assert "'layers.*.atention.wo.weight'" in msg and "matches no parameter" in msg
  assert "layers.0.attention.wo.weight" in msg  # near miss


def test_spec_rank_mismatch_names_param_shape_spec_and_mesh(mesh):
  with pytest.raises(tot.TorchOnTpuError) as e:
    resolve({"tok_embeddings.weight": ("fsdp",)}, mesh)
  msg = str(e.value)
  for part in ("'tok_embeddings.weight'", "(2048, 256)", "('fsdp',)", "mesh(fsdp=4, tp=2)", "2 dims"):
    assert part in msg


def test_indivisible_dim_names_param_dim_and_axis(mesh):
  tensors = [sh.TensorInfo("w", (6, 256))]
  with pytest.raises(tot.TorchOnTpuError) as e:
    sh.resolve({"w": ("fsdp", None)}, tensors, [], mesh)
  msg = str(e.value)
  assert "'w'" in msg and "(6, 256)" in msg and "dim 0 has size 6" in msg and "fsdp=4" in msg


def test_unknown_axis_names_the_axis_and_the_mesh_axes(mesh):
  with pytest.raises(tot.TorchOnTpuError) as e:
    resolve({"tok_embeddings.weight": ("dp", None)}, mesh)
  msg = str(e.value)
  assert "'tok_embeddings.weight'" in msg and "no axis 'dp'" in msg and "['fsdp', 'tp']" in msg


def test_one_axis_on_two_dims_is_an_error(mesh):
  with pytest.raises(tot.TorchOnTpuError, match="used on two dims"):
    resolve({"tok_embeddings.weight": ("fsdp", "fsdp")}, mesh)


def test_a_pattern_naming_only_modules_is_an_activation_rule(mesh):
  r = resolve({"layers.*": ("fsdp", None, None), "tok_embeddings.weight": ("fsdp", None)}, mesh)
  assert r.activations == {"layers.*": P("fsdp", None, None)}
  with pytest.raises(tot.TorchOnTpuError, match="no axis 'sp'"):
    resolve({"layers.*": ("sp", None, None)}, mesh)


def test_fsdp_preset_shards_the_largest_divisible_dim(mesh):
  r = resolve("fsdp", mesh)
  assert r.specs["tok_embeddings.weight"] == P("fsdp", None)
  assert r.specs["layers.0.attention_norm.weight"] == P(None)  # under FSDP_MIN_ELEMENTS
  odd = sh.resolve("fsdp", [sh.TensorInfo("w", (250, 4096))], [], mesh)
  assert odd.specs["w"] == P(None, "fsdp")  # 250 is not divisible by 4: next largest dim


def test_fsdp_preset_splits_stacked_experts_on_their_expert_dim(mesh):
  """Whole experts a device: the gather concatenates on the major dim, in the layout the grouped
  kernels read (tests/test_tpu_compile.py checks the copy it saves)."""
  experts = [sh.TensorInfo("layers.0.moe.experts.w1", (8, 128, 2048)), sh.TensorInfo("layers.0.moe.experts.w2", (6, 2048, 128)),
             sh.TensorInfo("layers.0.moe.router.gate.weight", (8, 2048))]
  r = sh.resolve("fsdp", experts, [], mesh)
  assert r.specs["layers.0.moe.experts.w1"] == P("fsdp", None, None)
  assert r.specs["layers.0.moe.experts.w2"] == P(None, "fsdp", None)  # 6 experts over 4: the largest dim
  assert r.specs["layers.0.moe.router.gate.weight"] == P(None, "fsdp")  # not an expert tensor
  named = sh.resolve("fsdp", experts, [], mesh, experts=["layers.0.moe.experts.w2"])  # the family's list wins
  assert named.specs["layers.0.moe.experts.w1"] == P(None, None, "fsdp")


def test_replicated_preset_and_unknown_preset(mesh):
  assert set(resolve("replicated", mesh).specs.values()) <= {P(None, None), P(None)}
  with pytest.raises(tot.TorchOnTpuError, match="Unknown sharding preset 'fsd'"):
    resolve("fsd", mesh)


def test_fsdp_preset_needs_an_fsdp_axis():
  with pytest.raises(tot.TorchOnTpuError, match="needs an 'fsdp' mesh axis"):
    resolve("fsdp", tot.make_mesh(dp=8))


def test_errors_surface_through_the_jittable_module_naming_the_parameter():
  with pytest.raises(tot.TorchOnTpuError, match="'layers.0.attention.wo.weight'"):
    tot.ShardedModule(
      h.titan(), mesh=tot.make_mesh(fsdp=8), sharding={"layers.0.attention.wo.weight": ("fsdp",)}
    )


@pytest.mark.parametrize("scan", [False, True])
def test_activation_rule_pins_every_layers_output(scan):
  jm = tot.ShardedModule(
    h.titan(), mesh=tot.make_mesh(fsdp=4, tp=2), sharding={"layers.*": (None, None, "tp")}, scan=scan
  )
  tokens, _ = h.random_batch(2048)
  lowered = jax.jit(lambda p, b, t: h.jax_view(jm.functional_call(p, b, h.torch_view(t)))).lower(
    jm.params, jm.buffers, jm.place(tokens)
  )
  pins = lowered.as_text().count("sdy.sharding_constraint")
  assert pins >= (1 if scan else 6)  # once in the scan body, or once per unrolled layer


def test_activation_rule_of_the_wrong_rank_names_module_and_shape():
  jm = tot.ShardedModule(h.titan(), mesh=tot.make_mesh(fsdp=8), sharding={"layers.*": ("fsdp", None)})
  tokens, _ = h.random_batch(2048)
  with pytest.raises(tot.TorchOnTpuError, match="module 'layers.0' outputs shape"):
    jm(tokens)


def test_make_mesh_errors():
  with pytest.raises(tot.TorchOnTpuError, match="needs 6 devices but 8") as info:
    tot.make_mesh(fsdp=3, tp=2)
  # on CPU devices, how to simulate the count the mesh needs (from Python: XLA's own flag)
  assert str(info.value).endswith("or simulate 6 CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=6 before jax starts.")
  with pytest.raises(tot.TorchOnTpuError, match="only one axis"):
    tot.make_mesh(fsdp=-1, tp=-1)
  with pytest.raises(tot.TorchOnTpuError, match="does not divide"):
    tot.make_mesh(fsdp=-1, tp=3)
  mesh = tot.make_mesh(fsdp=-1, tp=2)
  assert dict(mesh.shape) == {"fsdp": 4, "tp": 2}
