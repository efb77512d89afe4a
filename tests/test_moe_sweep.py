"""A slice of tools/moe_sweep.py (every MoE family × expert layout against eager torch): rows the
other MoE tests do not cover, HF Qwen3-Next's hybrid stack with its experts over ep × tp, and an HF
MoE model trained inside pipeline stages with its experts over ep. Forward, 5 AdamW steps' losses
and trained weights within the tolerances the sweep states, the tokens sent to their experts'
devices over the layout's expert-parallel group; and the layouts it does not run refused for the
reason its table gives."""

import pytest

from tests import helpers as h
from torch_on_tpu.parallel import expert_parallel

pytestmark = pytest.mark.compile_bound  # its time is XLA:CPU compiling (conftest)

sweep = h.load_module("tools/moe_sweep.py")


@pytest.mark.parametrize("family,layout,group", [("qwen3_next", "ep_tp", ("ep", "tp")), ("olmoe", "pp", ("ep",))])
def test_an_hf_moe_family_matches_torch_on_a_layout(family, layout, group, monkeypatch):
  groups = []
  exchange = expert_parallel.exchange
  monkeypatch.setattr(expert_parallel, "exchange", lambda *a, **k: groups.append(k["axes"]) or exchange(*a, **k))
  result = sweep.row(family, layout)
  assert result["verdict"] == "pass", result
  assert all(result[k] <= limit for k, limit in sweep.HF_TOL.items()), result
  assert 0 < result["weights"]  # trained, and not trivially equal
  assert groups and set(groups) == {group}, groups
  assert sweep.table_row(family, layout, result).startswith(f"| HF {family} | {layout} (")


@pytest.mark.parametrize("family", sorted({f for f, _ in sweep.NOT_RUN}))
def test_a_row_the_sweep_does_not_run_is_refused_for_its_reason(family):
  """HF's mixed layer_types under pp: refused for the kinds, with three whole periods of them, not for the tiny stack's length."""
  import torch_on_tpu as tot
  from tests import test_moe

  types = {**test_moe.FAMILIES, **test_moe.HYBRID}[family]().layer_types
  model = test_moe.build(family, output_router_logits=False, num_hidden_layers=6, layer_types=types * 3)
  with pytest.raises(tot.TorchOnTpuError, match=r"different inputs every 2 layers; train this model without pp"):
    tot.ShardedModule(model, mesh=tot.make_mesh(**sweep.LAYOUTS["pp"][0]), sharding="ep", scan=True)
