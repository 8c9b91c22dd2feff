"""Sphinx configuration of jaxbuf's documentation.

Build from the repository root (what `.ci/run` runs):

    sphinx-build -W -n --keep-going -b html docs docs/_build/html

`-n` (nitpicky) makes every unresolved cross-reference a warning and `-W` makes
warnings errors, so a renamed function or a broken reference fails the build.
"""

import ast
import inspect
import os
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jaxbuf  # noqa: E402
import jaxbuf.ray  # noqa: E402  (the optional extra [ray]: documented too)

project = "jaxbuf"
author = "the jaxbuf authors"
copyright = "2026, the jaxbuf authors"  # noqa: A001
release = version = jaxbuf.__version__

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
  "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]

templates_path = ["_templates"]
html_theme = "sphinx_book_theme"
html_title = "jaxbuf"
html_static_path = ["_static"]
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
}

# Docstrings are Google style, with `name` in single backticks for code.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# A docstring's "Attributes:" section as fields of its class, not a second
# description of attributes that `:members:` already documents
# (VectorEnvRecorder.example, set in __init__).
napoleon_use_ivar = True
default_role = "code"

autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"undoc-members": False}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Show the aliases by name in signatures rather than what they stand for
# (`Any`, a `Callable`).
autodoc_type_aliases = {"PyTree": "jaxbuf.PyTree", "Schedule": "jaxbuf.Schedule"}

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# The test suite executes notebooks/quickstart.ipynb (nbmake) and every
# ```python block of these pages (tests/test_docs.py), so by default the build
# shows the notebook's stored outputs without running it again (about 30 s
# on 2 cores). JAXBUF_DOCS_EXECUTE=1 executes it during the build instead.
nb_execution_mode = "force" if os.environ.get("JAXBUF_DOCS_EXECUTE") else "off"
nb_execution_timeout = 300
nb_execution_raise_on_error = True

# jaxbuf's modules of module-level functions (`jaxbuf.uniform`, ...) are
# attributes of the package, not importable submodules. Registering them under
# their public names lets autodoc document `jaxbuf.uniform.add` as such.
MODULE_ALIASES = (
  "uniform",
  "prioritized",
  "rollout",
  "sequence",
  "prioritized_sequence",
  "hindsight",
  "episode",
  "frames",
  "streams",
  "offline",
)
for _name in MODULE_ALIASES:
  sys.modules[f"jaxbuf.{_name}"] = getattr(jaxbuf, _name)

# No inventory can be fetched while building (CI reaches PyPI only, so
# intersphinx is off). References to these outside types in signatures and
# docstrings stay plain text instead of links; every other unresolved
# reference still fails the build.
nitpick_ignore_regex = [
  # JAX's public types: jax.Array, jax.ShapeDtypeStruct, jax.sharding.*.
  ("py:class", r"jax\.[A-Za-z_.]+"),
  ("py:class", r"jaxlib\.[A-Za-z_.]+"),
  # NumPy's arrays and dtypes.
  ("py:class", r"numpy\.[A-Za-z_.]+"),
  ("py:class", r"np\.[A-Za-z_.]+"),
  # flax.struct dataclasses' generated members, chex and optax types.
  ("py:class", r"flax\.[A-Za-z_.]+"),
  ("py:class", r"chex\.[A-Za-z_.]+"),
  ("py:class", r"optax\.[A-Za-z_.]+"),
  # The gymnasium spaces and Minari datasets the host-loop and offline
  # functions take (optional dependencies).
  ("py:class", r"gymnasium\.[A-Za-z_.]+"),
  ("py:class", r"minari\.[A-Za-z_.]+"),
  # Standard-library types spelt by module path in annotations.
  ("py:class", r"(os|pathlib|collections\.abc|typing|types)\.[A-Za-z_.]+"),
]
# Private types that appear only as the annotation of a state's field (the
# sum tree of prioritized kinds) or of `Buffer.kind` (the description
# `jaxbuf.sharded` and checkpoints read): users never build them, so the
# reference names them without documenting them.
nitpick_ignore = [
  ("py:class", "jaxbuf._src.core.sum_tree.SumTree"),
  ("py:class", "jaxbuf._src.selection.extreme_tree.MaxTree"),
  ("py:class", "jaxbuf._src.core.kind.Kind"),
]
# The Protocols that type a buffer's bound functions (`Buffer.init` is an
# `InitFn`, `rollout_buffer`'s add a `RolloutAddFn`) and the type variables
# that carry each kind's state and sample types through them: they exist for
# type checkers (jaxbuf ships py.typed), users never name them, and each
# function's own page documents what it takes and returns.
nitpick_ignore_regex.append(
  (
    "py:class",
    r"jaxbuf\._src\.core\.base\.(InitFn|AddFn|SampleFn|"
    r"UpdatePrioritiesFn|CanSampleFn|ClearFn|TakeFn|StateT|SampleT)",
  )
)
nitpick_ignore_regex.append(("py:class", r"jaxbuf\._src\.onpolicy\.rollout\.RolloutAddFn"))
nitpick_ignore_regex.append(
  (
    "py:class",
    r"jaxbuf\._src\.streams\.(prioritized_)?sequence\."
    r"(PrioritizedStateT|SequenceStateT)",
  )
)


def _public_name(target: str) -> str | None:
  """`jaxbuf.X` for a private path `jaxbuf._src....X` of a public name X."""
  if not target.startswith("jaxbuf._src."):
    return None
  name = target.rsplit(".", 1)[-1]
  if target.startswith("jaxbuf._src.fleet.") and name in jaxbuf.ray.__all__:
    return f"jaxbuf.ray.{name}"  # the optional submodule's names
  return f"jaxbuf.{name}" if name in jaxbuf.__all__ else None


def _resolve_private_paths(app, env, node, contnode):
  """Resolves annotations that name a public class by its private path.

  Signatures carry the defining module (`jaxbuf._src.core.base.Buffer`);
  the reference documents each name once, under its public path
  (`jaxbuf.Buffer`), so a reference to the private path is sent there.
  """
  if node.get("refdomain") != "py":
    return None
  public = _public_name(node.get("reftarget", ""))
  if public is None:
    return None
  domain = env.get_domain("py")
  return domain.resolve_xref(
    env, node.get("refdoc"), app.builder, node["reftype"], public, node, contnode
  )


def field_comments(cls: type) -> list[tuple[str, str, str]]:
  """`(name, annotation, comment)` of each field of a jaxbuf record class
  (a flax dataclass or a NamedTuple), base classes' fields first: jaxbuf
  documents a field by the comment after it in the class body (and the
  comment lines under it), which autodoc does not read."""
  fields: dict[str, tuple[str, str, str]] = {}
  for klass in reversed(cls.__mro__):
    if not klass.__module__.startswith("jaxbuf"):
      continue
    try:
      lines, _ = inspect.getsourcelines(klass)
    except (OSError, TypeError):
      continue
    source = textwrap.dedent("".join(lines))
    source_lines = source.splitlines()
    (node,) = ast.parse(source).body
    for statement in node.body:
      if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
        continue
      line = source_lines[statement.lineno - 1]
      comment = [line.split("#", 1)[1].strip()] if "#" in line else []
      for following in source_lines[statement.end_lineno :]:
        if not following.strip().startswith("#"):
          break
        comment.append(following.strip()[1:].strip())
      annotation = ast.get_source_segment(source, statement.annotation) or ""
      fields[statement.target.id] = (statement.target.id, annotation, " ".join(comment))
  return list(fields.values())


def _escaped(text: str) -> str:
  """A comment as reStructuredText prose: `*` and `|` are literal there."""
  return text.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")


def _resolved(path: str) -> object | None:
  """The object at a dotted path under `jaxbuf`, or None."""
  obj: object = jaxbuf
  for part in path.split(".")[1:]:
    obj = getattr(obj, part, None)
    if obj is None:
      return None
  return obj


def _list_fields(app, what, name, obj, options, lines):
  """Lists the fields of jaxbuf's state and record classes, with their
  comments, at the end of the class's page (the page shows no fields else)."""
  del app, options
  if what in ("attribute", "property") and re.fullmatch(
    r"Alias for field number \d+", " ".join(lines).strip()
  ):
    # A NamedTuple's field: its comment instead of Python's placeholder.
    owner_path, field = name.rsplit(".", 1)
    owner = _resolved(owner_path)
    comments = {found: comment for found, _, comment in field_comments(owner)} if owner else {}
    if comments.get(field):
      lines[:] = [_escaped(comments[field])]
    return
  if what != "class" or not getattr(obj, "__module__", "").startswith("jaxbuf"):
    return
  if not hasattr(obj, "__dataclass_fields__"):  # NamedTuples: their fields are members
    return
  fields = [field for field in field_comments(obj) if field[2]]
  if not fields:
    return
  lines += ["", ".. rubric:: Fields", ""]
  for field, annotation, comment in fields:
    lines.append(f"* ``{field}`` (``{annotation}``): {_escaped(comment)}")
  lines.append("")


def setup(app):
  app.connect("missing-reference", _resolve_private_paths)
  app.connect("autodoc-process-docstring", _list_fields)
