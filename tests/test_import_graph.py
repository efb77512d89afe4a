"""torch_on_tpu's modules import each other one way, down the layers: no cycles, and no
folder importing a folder above it (`LAYERS`, the table in docs/DESIGN.md).

The graph counts every import statement in a module, at the top or inside a
function (a deferred import is still a dependency; deferring it only hides a
cycle). A package's `__init__` that re-exports its submodules is a facade: an
import of one submodule does not count as an import of its siblings.
"""

import ast
from pathlib import Path

PACKAGE = "torch_on_tpu"
ROOT = Path(__file__).parent.parent / PACKAGE

# The package's folders (and its one top-level module besides the facade), bottom to top: each
# imports only its own layer and those below it. The facade `torch_on_tpu/__init__.py`, the
# public API, stands above them all.
LAYERS = ("errors", "core", "lowering", "runtime", "parallel", "models", "attention", "wrapper", "training", "io")


def _module_names() -> dict[str, Path]:
  names = {}
  for path in ROOT.rglob("*.py"):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    names[".".join(parts)] = path
  return names


def _resolve(name: str, modules) -> str | None:
  """The deepest module of ours that `name` (a dotted path, maybe ending in an attribute) is."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def import_graph() -> dict[str, set[str]]:
  """module → the modules of the package it imports (anywhere in its body)."""
  modules = _module_names()
  graph = {}
  for name, path in modules.items():
    is_package = path.name == "__init__.py"
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          base = name if is_package else name.rpartition(".")[0]
          for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
          source = f"{base}.{node.module}" if node.module else base
        else:
          source = node.module or ""
        targets = [f"{source}.{a.name}" for a in node.names]
      for target in targets:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
          resolved = _resolve(target, modules)
          if resolved and resolved != name:
            edges.add(resolved)
    graph[name] = edges
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def _facade_free(graph):
  """Edges into a package's facade `__init__` from its own submodules are dropped: the
  facade imports them, they never need it (they import the sibling they mean)."""
  return {
    v: {w for w in ws if not v.startswith(w + ".")} for v, ws in graph.items()
  }


def test_the_package_imports_form_no_cycle():
  found = cycles(_facade_free(import_graph()))
  assert not found, "import cycles: " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_checker_sees_a_cycle_through_a_function_level_import():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert cycles(graph) == [["a", "b", "c"]]
  real = import_graph()
  # the graph reads function bodies: runtime's start-up imports the lowerings inside setup().
  assert "torch_on_tpu.lowering.aten" in real["torch_on_tpu.runtime.startup"]


def layer(module: str) -> int:
  """Where `module` stands in `LAYERS` (the facade: above them all)."""
  parts = module.split(".")
  return len(LAYERS) if len(parts) == 1 else LAYERS.index(parts[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
  return sorted(f"{v} → {w}" for v, ws in graph.items() for w in ws if layer(w) > layer(v))


def test_every_folder_of_the_package_is_a_layer():
  entries = {p.stem for p in ROOT.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
  assert entries - {"__init__"} == set(LAYERS), "add the new folder to LAYERS and to docs/DESIGN.md's table"


def test_no_layer_imports_a_layer_above_it():
  found = upward_imports(import_graph())
  assert not found, "imports up the layers: " + "; ".join(found)


def test_the_layer_check_sees_an_upward_import():
  graph = {"torch_on_tpu.core.extras": {"torch_on_tpu.training.step"}, "torch_on_tpu.io.export": {"torch_on_tpu.core.extras"}}
  assert upward_imports(graph) == ["torch_on_tpu.core.extras → torch_on_tpu.training.step"]
