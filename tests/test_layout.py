"""The package's layout: the modules of `jaxbuf._src` import one another
downward only (types at the bottom, checks above them, buffers above those,
sharding and I/O on top), so no import cycle, however deep (issue 19).

The graph is read from the source with `ast`, without importing anything,
and counts every import of a `jaxbuf` module, also one inside a function: an
import moved into a function hides a cycle from Python, not from a reader.
"""

import ast
import pathlib

import jaxbuf

PACKAGE = pathlib.Path(jaxbuf.__file__).parent
SRC = PACKAGE / "_src"


def _module_names() -> set[str]:
  return {path.stem for path in SRC.glob("*.py") if path.stem != "__init__"}


def _imported(tree: ast.AST, modules: set[str]) -> set[str]:
  """The `jaxbuf._src` modules a parsed file imports; "jaxbuf" for the
  package itself (its `__init__` imports every public module)."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[:2] == ["jaxbuf", "_src"] and len(parts) > 2:
          found.add(parts[2])
        elif parts[0] == "jaxbuf":
          found.add("jaxbuf")
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      parts = node.module.split(".")
      if parts[:2] == ["jaxbuf", "_src"] and len(parts) > 2:
        found.add(parts[2])
      elif parts == ["jaxbuf", "_src"]:
        found.update(alias.name for alias in node.names if alias.name in modules)
      elif parts[0] == "jaxbuf":
        found.add("jaxbuf")
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
      # Relative: `from . import x` or `from .x import y` inside `_src`.
      if node.module:
        found.add(node.module.split(".")[0])
      else:
        found.update(alias.name for alias in node.names if alias.name in modules)
  return found


def import_graph() -> dict[str, set[str]]:
  """Each module of `jaxbuf._src` (and "jaxbuf") -> the ones it imports."""
  modules = _module_names()
  files = {name: SRC / f"{name}.py" for name in modules}
  files["jaxbuf"] = PACKAGE / "__init__.py"
  return {name: _imported(ast.parse(path.read_text(), str(path)), modules)
          for name, path in files.items()}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of `graph` as the modules along it, first one repeated at the
  end (`[a, b, a]`), or None. Depth first, in sorted order, so the same
  graph always names the same cycle."""
  done, path, on_path = set(), [], {}

  def visit(node: str) -> list[str] | None:
    on_path[node] = len(path)
    path.append(node)
    for target in sorted(graph.get(node, ())):
      if target in on_path:
        return path[on_path[target]:] + [target]
      if target not in done:
        cycle = visit(target)
        if cycle:
          return cycle
    path.pop()
    del on_path[node]
    done.add(node)
    return None

  for start in sorted(graph):
    if start not in done:
      cycle = visit(start)
      if cycle:
        return cycle
  return None


def test_the_cycle_finder_names_a_cycle_and_passes_a_tree():
  assert first_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
  assert first_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
  assert first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert first_cycle({"z": {"x"}, "x": {"y"}, "y": {"x"}}) == ["x", "y", "x"]
  assert first_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_graph_is_read_from_every_module():
  graph = import_graph()
  assert set(graph) == _module_names() | {"jaxbuf"}
  # The edges that hold the I/O rooms on top of the rest.
  assert {"checkpoint_files", "checkpoint_layout"} <= graph["checkpoint"]
  assert {"checkpoint", "sharded"} <= graph["jaxbuf"]


def test_jaxbuf_src_imports_have_no_cycle():
  cycle = first_cycle(import_graph())
  assert cycle is None, (
      "import cycle among jaxbuf._src modules: " + " -> ".join(cycle)
      + "; move what both sides need into a module below them.")


MODULE_LINES = 600


def test_a_module_past_600_lines_says_why_it_is_one_module():
  """Rooms a newcomer can hold in their head (issue 19): a module longer
  than ~600 lines opens its docstring with the reason it stays one room."""
  unexplained = []
  for path in sorted(SRC.glob("*.py")):
    source = path.read_text()
    if source.count("\n") > MODULE_LINES:
      docstring = ast.get_docstring(ast.parse(source)) or ""
      if "Why one module of this size" not in docstring:
        unexplained.append(f"{path.name} ({source.count(chr(10))} lines)")
  assert not unexplained, (
      f"modules over {MODULE_LINES} lines without a 'Why one module of this "
      f"size' paragraph at the top of their docstring: {unexplained}")
