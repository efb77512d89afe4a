"""tools/plan_calibration.py: what each cell's plan is held to, and how the table says it."""

from pathlib import Path

import pytest

from tests import helpers as h

GiB = 2**30
TOOLS = Path(__file__).parent.parent / "tools"


@pytest.fixture
def calibration(monkeypatch):
  monkeypatch.syspath_prepend(str(TOOLS))  # the script imports its neighbour bench_tpu, as run from tools/
  return h.load_module(TOOLS / "plan_calibration.py")


def cell(plan, arguments, temporaries, compiler_peak, host=0.0):
  return {"tpu": dict(plan=plan * GiB, plan_host=host * GiB, arguments=arguments * GiB, temporaries=temporaries * GiB,
                      compiler_peak=compiler_peak * GiB if compiler_peak else None, host=host * GiB, hbm=31.25 * GiB)}


def test_a_cell_that_offloads_is_held_to_the_lower_bound_of_the_chips_peak(calibration):
  """The compiler's peak counts host memory: Llama 3 8B at offload_dots on v6e-8 read 32.85 GiB,
  its arguments (11.35) plus all 21.5 GiB on the host, over an allocation of 28.19 GiB."""
  results = {
    ("8B", "v6e-8", "fsdp", "full"): cell(19.98, 11.35, 12.62, 20.88),
    ("8B", "v6e-8", "fsdp", "offload_dots"): cell(22.00, 11.35, 16.85, 32.85, host=21.5),
    ("8B", "v6e-8", "fsdp", "maxtext_offload"): cell(18.64, 11.35, 12.33, 18.54, host=7.0),
    ("8B", "v6e-8", "fsdp", "auto"): {"tpu": {**cell(43.5, 11.2, 44.08, None)["tpu"], "refused": True}},
  }
  held = {remat: calibration.yardstick(sides["tpu"]) for (_, _, _, remat), sides in results.items()}
  assert held["full"] == 20.88 * GiB  # no host memory: the compiler's peak itself
  assert held["offload_dots"] == (11.35 + 16.85) * GiB  # the allocation, below the peak that counts the host
  assert held["maxtext_offload"] == 18.54 * GiB  # the peak, below the allocation
  assert held["auto"] is None  # refused: no schedule to hold the plan to
  rows = dict(zip(("full", "offload_dots", "maxtext_offload", "auto"), calibration.table(results).splitlines()[2:]))
  assert "| 20.88 | 0.96 |" in rows["full"]
  assert "| 32.85 (host counted) | 0.78 (outside 10%) of the allocation, the chip's bound |" in rows["offload_dots"]
  assert "| 18.54 (host counted) | 1.01 of the peak, the chip's bound |" in rows["maxtext_offload"]
  assert "- (no schedule)" in rows["auto"]
