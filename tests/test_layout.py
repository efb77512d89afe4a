"""The package's imports point one way, down the data flow (docs/DESIGN.md): no two
modules of torch_on_tpu import each other, directly or through others, counting
the imports made inside functions too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torch_on_tpu"


def _module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
  """The torch_on_tpu modules `path` imports anywhere in its code."""
  name = _module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        found.add(full if full in modules else base)
  return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
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


def test_no_module_of_the_package_imports_itself_through_others():
  paths = sorted(PACKAGE.rglob("*.py"))
  modules = {_module_name(p) for p in paths}
  graph = {_module_name(p): _imports(p, modules) for p in paths}
  assert graph["torch_on_tpu.runtime"], "the walk found no imports: the test would pass vacuously"
  assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
