"""Expert parallelism that moves tokens (`parallel.expert_parallel`): each row reaches the device
holding its expert and comes back, dropless, on 8 simulated CPU devices (where the ragged
all-to-all is made from an all-gather; the TPU program's own is in tests/test_tpu_compile.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import torch_on_tpu as tot
from torch_on_tpu.parallel import expert_parallel, mesh as mesh_lib


def test_the_cpus_ragged_all_to_all_is_jaxs_documented_example():
  """`lax.ragged_all_to_all`'s docstring example over an axis of 2, through the gathered form."""
  mesh = tot.make_mesh(ep=2, fsdp=4)
  operand = np.array([[1, 2, 2, 0], [3, 4, 0, 0]], np.float32)[:, :3]
  per_device = dict(
    input_offsets=np.array([[0, 1], [0, 1]], np.int32), send_sizes=np.array([[1, 2], [1, 1]], np.int32),
    output_offsets=np.array([[0, 0], [1, 2]], np.int32), recv_sizes=np.array([[1, 1], [2, 1]], np.int32),
  )

  def body(x, io, ss, oo, rs):
    out = expert_parallel.ragged_all_to_all(x[0], jnp.zeros(4, x.dtype), input_offsets=io[0], send_sizes=ss[0],
                                            output_offsets=oo[0], recv_sizes=rs[0], axes=("ep",))
    return out[None]

  spec = P("ep")
  run = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)
  got = np.asarray(jax.jit(run)(operand, *per_device.values()))
  np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def _exchange_vs_direct(mesh, group, ids):
  """Rows of every device through `exchange` with an expert that scales a row by (its global id
  + 1), against the same product computed in place; values and gradients."""
  experts, top_k = 8, ids.shape[-1]
  devices, tokens, dim = ids.shape[0], ids.shape[1], 4
  x = np.random.default_rng(0).normal(size=(devices, tokens, dim)).astype(np.float32)
  axes = mesh_lib.data_axes(mesh) + tuple(a for a in group if a not in mesh_lib.data_axes(mesh))
  local = experts // mesh_lib.batch_ways(mesh, group)

  def body(x, ids):
    x, ids = x[0], ids[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros(experts, jnp.int32).at[flat].add(1)
    first = jax.lax.axis_index(group) * local if group else 0

    def run_local(rows, sizes, local_ids):
      assert rows.shape[0] == (expert_parallel.receive_rows(tokens * top_k, top_k, local, mesh_lib.batch_ways(mesh, group)) if group else tokens * top_k)
      scale = jnp.where(local_ids < sizes.shape[0], first + local_ids + 1, 0).astype(rows.dtype)
      return rows * scale[:, None]

    out = expert_parallel.exchange(x[order // top_k], counts, run_local, axes=group, top_k=top_k)
    return jnp.zeros_like(out).at[order].set(out)[None]

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * 2, out_specs=P(axes), check_vma=False))
  direct = lambda x: jnp.repeat(x, top_k, axis=1) * (ids.reshape(devices, -1, 1) + 1)  # noqa: E731
  np.testing.assert_allclose(np.asarray(run(x, ids)), np.asarray(direct(x)), rtol=1e-6)
  loss = lambda f: lambda x: (f(x) ** 2).sum()  # noqa: E731
  got, want = jax.grad(loss(lambda x: run(x, ids)))(x), jax.grad(loss(direct))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


LAYOUTS = {"ep=4": (dict(fsdp=2, ep=4), ("ep",)), "ep=2,tp=2": (dict(fsdp=2, ep=2, tp=2), ("ep", "tp")),
           "no ep": (dict(fsdp=8), ())}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("routing", ["random", "all to one device"])
def test_exchange_brings_every_row_to_its_expert_and_back(layout, routing):
  """Random routing, and the worst case: every row of every device to the experts of one device,
  four times what its receive buffer holds (`RECEIVE_BUFFER_ROWS` × its own rows): the rest
  arrives in more rounds, none dropped."""
  axes, group = LAYOUTS[layout]
  mesh = tot.make_mesh(**axes)
  assert mesh_lib.expert_axes(mesh) == group
  ids = np.random.default_rng(1).integers(0, 8, (8, 6, 2)).astype(np.int32)
  if routing != "random":
    ids = ids % 2  # experts 0 and 1: the first device's under every layout
  _exchange_vs_direct(mesh, group, ids)


def test_the_expert_group_is_ep_with_the_cp_and_tp_it_borrows():
  assert mesh_lib.expert_axes(tot.make_mesh(fsdp=8)) == ()
  assert mesh_lib.expert_axes(tot.make_mesh(fsdp=4, ep=1, tp=2)) == ("tp",)
  assert mesh_lib.expert_axes(tot.make_mesh(ep=2, cp=2, tp=2)) == ("ep", "cp", "tp")


@pytest.mark.compile_bound
@pytest.mark.parametrize("mode,group", [("ep_tp_train", ("ep", "tp")), ("ep_pp_train", ("ep",))])
def test_torchtitan_moe_trains_over_ep_with_tp_and_in_pipeline_stages(mode, group, monkeypatch):
  """Qwen3-MoE scanned, 3 AdamW steps against torchtitan's eager trainer with its load balancing:
  experts over ep × tp (torchtitan's expert-parallel group borrowing tp: the tokens split over tp
  inside the MoE), and over ep inside pipeline stages (the layers' token counts carried through
  the ticks). Losses, every weight and the balancing buffers; the experts in fp32 on both sides
  (`fp32_experts`) so the check is exact (the bf16 experts: tools/titan_parity.py)."""
  from tests import helpers as h

  tp = h.titan_parity()
  groups = []
  exchange = expert_parallel.exchange
  monkeypatch.setattr(expert_parallel, "exchange", lambda *a, **k: groups.append(k["axes"]) or exchange(*a, **k))
  spec = "qwen3:debugmodel_moe"
  with tp.fp32_experts():
    ours = tp.check(spec, mode, config=tp.shrink(tp.registry_config(spec), layers=2), steps=3)
  assert ours["losses"] < 1e-5 and ours["weights"] < 1e-4 and ours["buffers"] < 1e-6, ours
  assert groups and set(groups) == {group}, groups  # the tokens went to their experts' devices
