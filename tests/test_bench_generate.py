"""tools/bench_generate.py: runs end to end on a tiny model; the three programs agree."""

from pathlib import Path

from tests import helpers as h

SCRIPT = Path(__file__).parent.parent / "tools" / "bench_generate.py"


def test_bench_generate_prints_the_three_rows_and_same_tokens(capsys):
  bench = h.load_module(SCRIPT)
  assert bench.main(["--layers=1", "--dim=32", "--vocab=64", "--prompt=3", "--new=4", "--runs=1"]) == 0
  out = capsys.readouterr().out
  for row in ("| KV cache |", "| full forward |", "| eager torch (model.generate) |", "same tokens: True"):
    assert row in out
