"""Compile-only TPU targets: slice names, libtpu kept quiet, and meshes of the devices a slice has.

The compile matrix (each mode's step built by the real TPU compiler) is tests/test_tpu_compile.py.
"""

import subprocess
import sys

import pytest

import torch_on_tpu as tot
from tests import helpers as h
from torch_on_tpu.errors import TorchOnTpuError
from torch_on_tpu.parallel import collectives, targets
from torch_on_tpu.runtime import libtpu


@pytest.mark.parametrize("name,topology,chips,slices", [
  ("v6e-8", "v6e:2x4", 8, 1), ("v6e-256", "v6e:16x16", 256, 1), ("v5e-16", "v5e:4x4", 16, 1),
  ("v5p-8", "v5p:2x2x1", 4, 1), ("v5p-16", "v5p:2x2x2", 8, 1), ("v5p-1024", "v5p:8x8x8", 512, 1),
  ("v4-32", "v4:2x2x4", 16, 1), ("2xv6e-256", "v6e:16x16", 512, 2), ("v6e:4x8", "v6e:4x8", 32, 1),
  ("v5litepod-4", "v5e:2x2", 4, 1),
])
def test_slice_names_mean_what_cloud_tpu_names_mean(name, topology, chips, slices):
  target = targets.parse(name)
  assert (target.topology, target.chips, target.slices) == (topology, chips, slices)


@pytest.mark.parametrize("name,says", [
  ("v6e-7", "counts chips in a power of two"),
  ("v5p-6", "counts TensorCores, two per chip"),
  ("v9-8", "does not know; use one of v4, v5e, v5p, v6e, tpu7x"),
  ("tpu", "is not a TPU slice name"),
  ("v6e:2x2x2", "is not 2 numbers joined by 'x'"),
])
def test_a_name_that_is_no_slice_is_one_sentence(name, says):
  with pytest.raises(TorchOnTpuError, match=says):
    targets.parse(name)


def test_libtpu_is_answered_only_where_no_chips_are_and_the_user_said_nothing(monkeypatch):
  environ = {"TPU_WORKER_HOSTNAMES": "mine"}
  monkeypatch.setattr(libtpu, "tpu_chips_visible", lambda: False)
  libtpu.quiet_without_chips(environ)
  assert environ["TPU_WORKER_HOSTNAMES"] == "mine"  # the user's own value kept
  assert environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1" and environ["TPU_SKIP_MDS_QUERY"] == "1"
  on_a_tpu = {}
  monkeypatch.setattr(libtpu, "tpu_chips_visible", lambda: True)
  libtpu.quiet_without_chips(on_a_tpu)
  assert on_a_tpu == {}


def test_a_target_mesh_is_the_slices_compile_only_devices():
  mesh = tot.make_mesh(target="v5p-8", fsdp=2, tp=2)
  assert dict(mesh.shape) == {"fsdp": 2, "tp": 2}
  assert {d.platform for d in mesh.devices.flat} == {"tpu"} and mesh.devices.flat[0].device_kind == "TPU v5"
  assert targets.target_of(mesh.devices.flat).name == "v5p-8"
  with pytest.raises(TorchOnTpuError, match="devices= or target=, not both"):
    tot.make_mesh(devices=mesh.devices.flat, target="v5p-8")


@pytest.mark.parametrize("target,axes", [("v6e-16", dict(fsdp=-1, cp=2)), ("v6e-256", dict(fsdp=-1, ep=8)),
                                         ("v5p-64", dict(fsdp=4, ep=2, cp=2, tp=2))])
def test_an_axis_no_whole_torus_axis_fits_splits_one(target, axes):
  """jax maps mesh axes onto whole physical torus axes and refused these (cp=2 on a 4x4 v6e slice:
  "Failed to find assignment for logical_axis_index 1 of size 2"); every device once, each axis
  its size."""
  mesh = tot.make_mesh(target=target, **axes)
  chips = targets.parse(target).chips * targets.parse(target).generation.devices_per_chip
  assert all(mesh.shape[a] == n for a, n in axes.items() if n != -1) and mesh.size == chips
  assert len({d.id for d in mesh.devices.flat}) == chips


def test_several_slices_put_the_first_axis_across_them():
  mesh = tot.make_mesh(target="2xv5e-4", dp=2, fsdp=-1)
  first = mesh.devices[0]
  assert {d.slice_index for d in first.flat} == {0} and {d.slice_index for d in mesh.devices[1].flat} == {1}
  with pytest.raises(TorchOnTpuError, match="must be a multiple of 2"):
    tot.make_mesh(target="2xv5e-4", tp=1, fsdp=-1)
  # an axis that splits a physical torus axis (2 of a 16x16 slice's 16), as 405B's fsdp x cp needs
  mesh = tot.make_mesh(target="2xv6e-256", fsdp=256, cp=2)
  assert dict(mesh.shape) == {"fsdp": 256, "cp": 2} and {d.slice_index for d in mesh.devices[:128].flat} == {0}


def test_a_process_using_libtpu_prints_none_of_its_start_up_lines():
  code = (
    "import torch_on_tpu as tot, jax\n"
    "tot.setup(); jax.devices()\n"
    "print(len(tot.make_mesh(target='v6e-8').devices.flat))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=h.env_without_libtpu_answers())
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "8"
  assert not h.libtpu_start_up_lines(out.stderr) and "libtpu" not in out.stderr, out.stderr


def test_collectives_are_read_from_tpu_hlo():
  """A Mosaic kernel's config spans lines that start with "}}" (the computation goes on), a loop's
  trip count is its condition's constant (with a TPU layout), and the TPU compiler's all-reduce +
  slice fusion moves what a reduce-scatter moves."""
  hlo = "\n".join([
    "%cond (p: (s32[], bf16[8])) -> pred[] {",
    "  %c = s32[]{:T(128)} constant(16)",
    "  %i = s32[]{:T(128)} get-tuple-element(%p), index=0",
    "  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT",
    "}",
    "%body (p: (s32[], bf16[8])) -> (s32[], bf16[8]) {",
    "  %x = bf16[8]{0:T(128)} get-tuple-element(%p), index=1",
    "  %ag = bf16[64]{0:T(128)} all-gather(%x), replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}",
    "  ROOT %t = (s32[], bf16[8]) tuple(%i, %x)",
    "}",
    "%all-reduce-scatter.1 (input.1: f32[1024,256]) -> f32[128,256] {",
    "  %input.1 = f32[1024,256]{1,0:T(8,128)} parameter(0)",
    "  %all-reduce.2 = f32[1024,256]{1,0:T(8,128)} all-reduce(%input.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
    "  ROOT %dynamic-slice.3 = f32[128,256]{1,0:T(8,128)} dynamic-slice(%all-reduce.2, %p, %z), dynamic_slice_sizes={128,256}",
    "}",
    "",
    "ENTRY %main (p.1: f32[1024,256], p.2: bf16[32,256]) -> f32[128,256] {",
    '  %custom-call.1 = bf16[8,256]{1,0} custom-call(%p.2), custom_call_target="tpu_custom_call", backend_config={"a":"{',
    '}}", "b": 1}',
    "  %all-gather.1 = bf16[256,256]{1,0:T(8,128)} all-gather(%p.2), replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}",
    "  %w = (s32[]{:T(128)}, bf16[8]{0:T(128)}) while(%t0), condition=%cond, body=%body",
    "  ROOT %fusion.1 = f32[128,256]{1,0:T(8,128)} fusion(%p.1), kind=kCustom, calls=%all-reduce-scatter.1",
    "}",
  ])
  found = collectives.collective_bytes(hlo).by_kind
  in_loop = 16 * 64 * 2 * 7 // 8  # the loop's trip count read from its condition's constant (a TPU layout on it)
  assert found == {"all-gather": 256 * 256 * 2 * 7 // 8 + in_loop, "reduce-scatter": 128 * 256 * 4 * 7}
