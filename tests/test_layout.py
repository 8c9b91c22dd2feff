"""The package's layout: the modules of `jaxbuf._src` import one another
downward only (types at the bottom, checks above them, buffers above those,
sharding and I/O on top), so no import cycle, however deep (issue 19).

The modules are grouped by concept into subpackages of `jaxbuf._src`
(issue 31), and the layers are those subpackages: `LAYERS` lists them from
the bottom up, and a module imports only from its own subpackage or from one
in a lower layer. Modules are named by their dotted path relative to
`jaxbuf._src` (`core.base`, `checkpoint.saving`, `sharded`); a subpackage's
`__init__` by the subpackage's name.

The graph is read from the source with `ast`, without importing anything,
and counts every import of a `jaxbuf` module, also one inside a function: an
import moved into a function hides a cycle from Python, not from a reader.
"""

import ast
import pathlib

import jaxbuf

PACKAGE = pathlib.Path(jaxbuf.__file__).parent
SRC = PACKAGE / "_src"

# The subpackages (and top-level modules) of `jaxbuf._src`, bottom layer
# first: kinds, types, random bits, checks, the binding and the storage every
# buffer shares; the storage tiers (payload in host memory or files, around
# any kind's bound functions); the buffers of items and on-policy rollouts;
# the stream buffers (which build on prioritized items); the selection and
# eviction rules (queues, sample budgets, heaps, keep-the-best), which build
# on item and episode replay; sharding, checkpoints,
# offline datasets and mixtures of any buffers above them; host loops (which
# write the offline forms) on top of those, the replay service (threads
# around one buffer state, which takes the recorder's steps) above, and the
# fleet (the service served to Ray actors in other processes, `jaxbuf.ray`)
# on top. The package `jaxbuf` is above them all.
LAYERS = (
  ("core",),
  ("storage",),
  ("items", "onpolicy"),
  ("streams",),
  ("selection",),
  ("sharded", "checkpoint", "offline", "mixture"),
  ("host",),
  ("service",),
  ("fleet",),
)


def _source_files() -> dict[str, pathlib.Path]:
  """Each module of `jaxbuf._src`, by dotted name relative to `_src` -> its file."""
  files = {}
  for path in SRC.rglob("*.py"):
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    if parts:  # `_src/__init__.py` itself holds nothing
      files[".".join(parts)] = path
  return files


def _module_names() -> set[str]:
  return set(_source_files())


def _src_module(parts: list[str], modules: set[str]) -> str | None:
  """The module of `jaxbuf._src` that the dotted `parts` (after `_src`)
  name, or the longest prefix of them that is one."""
  for end in range(len(parts), 0, -1):
    name = ".".join(parts[:end])
    if name in modules:
      return name
  return None


def _imported(tree: ast.AST, modules: set[str], package: list[str]) -> set[str]:
  """The `jaxbuf._src` modules a parsed file imports; "jaxbuf" for the
  package itself (its `__init__` imports every public module). `package`:
  the dotted parts of the file's own package below `jaxbuf._src`, for
  relative imports."""
  found = set()

  def add_from(parts: list[str], names: list[str]) -> None:
    # `from <parts> import <names>`, `parts` below `jaxbuf._src`: each name
    # is a submodule, or else a name of the module `parts` itself.
    for name in names:
      if ".".join(parts + [name]) in modules:
        found.add(".".join(parts + [name]))
      else:
        module = _src_module(parts, modules)
        if module:
          found.add(module)

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[:2] == ["jaxbuf", "_src"] and len(parts) > 2:
          module = _src_module(parts[2:], modules)
          if module:
            found.add(module)
        elif parts[0] == "jaxbuf":
          found.add("jaxbuf")
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      parts = node.module.split(".")
      if parts[:2] == ["jaxbuf", "_src"]:
        add_from(parts[2:], [alias.name for alias in node.names])
      elif parts[0] == "jaxbuf":
        found.add("jaxbuf")
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
      # Relative: `from . import x`, `from ..core import y` inside `_src`.
      base = package[: len(package) - (node.level - 1)]
      parts = base + (node.module.split(".") if node.module else [])
      add_from(parts, [alias.name for alias in node.names])
  return found


def import_graph() -> dict[str, set[str]]:
  """Each module of `jaxbuf._src` (and "jaxbuf") -> the ones it imports."""
  modules = _module_names()
  graph = {}
  for name, path in _source_files().items():
    package = name.split(".")
    if path.name != "__init__.py":
      package = package[:-1]
    graph[name] = _imported(ast.parse(path.read_text(), str(path)), modules, package)
  path = PACKAGE / "__init__.py"
  graph["jaxbuf"] = _imported(ast.parse(path.read_text(), str(path)), modules, [])
  return graph


def layer_of(module: str) -> int:
  """The index in `LAYERS` of the subpackage holding `module`; "jaxbuf" is
  above every layer."""
  if module == "jaxbuf":
    return len(LAYERS)
  top = module.split(".")[0]
  for index, layer in enumerate(LAYERS):
    if top in layer:
      return index
  raise AssertionError(
    f"jaxbuf._src.{top} is in no layer of tests/test_layout.py's LAYERS: "
    "add it to the layer it belongs to."
  )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
  """Every import of a module of another subpackage that is not in a lower
  layer, as `importer -> imported`, sorted."""
  return sorted(
    f"{importer} -> {target}"
    for importer, targets in graph.items()
    for target in targets
    if target.split(".")[0] != importer.split(".")[0] and layer_of(target) >= layer_of(importer)
  )


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
        return path[on_path[target] :] + [target]
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
  assert {"checkpoint.files", "checkpoint.layout"} <= graph["checkpoint.saving"]
  assert {"checkpoint.saving", "sharded"} <= graph["jaxbuf"]
  # The stream kinds' splits over devices read the kinds' functions, and the
  # factories bind both: the splits above the kinds, the factories on top.
  assert {"streams.sequence", "streams.hindsight"} <= graph["streams.device_split"]
  assert {"streams.device_split", "streams.sequence"} <= graph["streams.factories"]
  assert "streams.window_priorities" in graph["streams.sequence"]


def test_jaxbuf_src_imports_have_no_cycle():
  cycle = first_cycle(import_graph())
  assert cycle is None, (
    "import cycle among jaxbuf._src modules: "
    + " -> ".join(cycle)
    + "; move what both sides need into a module below them."
  )


def test_every_subpackage_is_in_a_layer_and_imports_only_downward():
  graph = import_graph()
  for module in graph:
    layer_of(module)
  upward = upward_imports(graph)
  assert not upward, (
    "imports of a subpackage of jaxbuf._src that is not in a lower layer "
    f"(tests/test_layout.py's LAYERS): {upward}; move what both need "
    "into a lower layer."
  )


def test_the_layer_check_names_an_upward_import():
  assert (
    upward_imports(
      {"core.base": {"core.kind"}, "items.uniform": {"core.base"}, "jaxbuf": {"offline.mapping"}}
    )
    == []
  )
  assert upward_imports(
    {"core.base": {"items.uniform"}, "items.uniform": {"onpolicy.rollout"}}
  ) == ["core.base -> items.uniform", "items.uniform -> onpolicy.rollout"]


MODULE_LINES = 600


def test_a_module_past_600_lines_says_why_it_is_one_module():
  """Rooms a newcomer can hold in their head (issue 19): a module longer
  than ~600 lines opens its docstring with the reason it stays one room."""
  unexplained = []
  for path in sorted(SRC.rglob("*.py")):
    source = path.read_text()
    if source.count("\n") > MODULE_LINES:
      docstring = ast.get_docstring(ast.parse(source)) or ""
      if "Why one module of this size" not in docstring:
        unexplained.append(f"{path.relative_to(SRC)} ({source.count(chr(10))} lines)")
  assert not unexplained, (
    f"modules over {MODULE_LINES} lines without a 'Why one module of this "
    f"size' paragraph at the top of their docstring: {unexplained}"
  )
