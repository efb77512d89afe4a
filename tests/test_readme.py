"""The README's snippets run as written, so they cannot rot."""

import math
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def snippet(name: str) -> str:
  match = re.search(rf"<!-- readme-test: {name} -->\s*```python\n(.*?)```", README.read_text(), re.S)
  assert match, f"README has no snippet marked 'readme-test: {name}'"
  return match.group(1)


@pytest.mark.parametrize("name", ["hf", "torchtitan"])
def test_three_line_snippet_trains(name):
  scope = {}
  exec(compile(snippet(name), f"README.md:{name}", "exec"), scope)
  first = float(scope["loss"])
  second = float(scope["step"](*_same_batch(name, scope)))
  assert math.isfinite(first) and second < first  # a real update on the same batch lowers the loss
  params = scope["model"].params
  assert any(len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated for a in params.values())
  if name == "torchtitan":
    assert "layers.0.attention.wo.weight" in scope["torch_state"]


def _same_batch(name, scope):
  tokens = scope["tokens"]
  if name == "hf":
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]
  return {"tokens": tokens[:, :-1], "attention_masks": scope["flex_masks"]()}, tokens[:, 1:]
