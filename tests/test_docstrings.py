"""Inline markup in the public docstrings renders as written.

The API pages render docstrings as reStructuredText, where `x` is code only
when its backticks stand where reStructuredText recognises them: an opening
backtick after a space or an opening bracket, a closing one before a space or
punctuation. A closing backtick glued to a letter (`Buffer`s) is no end, so
the code runs on to the next backtick and half a sentence renders as code. This
checks every paragraph of every public docstring for a backtick that does not
open or close where expected, and for one left open at the paragraph's end.
"""

import inspect
import pathlib
import re
import types

import jaxbuf

API = pathlib.Path(__file__).parent.parent / "docs" / "api"

# reStructuredText's inline markup recognition rules, for single backticks.
BEFORE_START = set(" \n'\"([{<-/:")
AFTER_END = set(" \n'\")]}>-/:.,;!?\\_")


def unbalanced(paragraph: str) -> str | None:
  """The first misplaced backtick of `paragraph`, with its context; None if
  every backtick opens and closes as reStructuredText reads it."""
  text = re.sub(r"``.*?``", "x", paragraph, flags=re.DOTALL)  # inline literals
  opened = None
  for position, character in enumerate(text):
    if character != "`":
      continue
    before = text[position - 1] if position else " "
    after = text[position + 1] if position + 1 < len(text) else " "
    context = text[max(0, position - 30) : position + 30]
    if opened is None:
      if before not in BEFORE_START or after.isspace():
        return f"a backtick that opens nothing: ...{context}..."
      opened = position
    else:
      if before.isspace() or after not in AFTER_END:
        return f"a closing backtick reStructuredText does not see: ...{context}..."
      opened = None
  if opened is not None:
    return f"a backtick left open: ...{text[opened : opened + 60]}..."
  return None


def paragraphs(doc: str) -> list[str]:
  """The prose paragraphs of a docstring: doctest lines and the literal
  blocks after a `::` are code, not markup."""
  found, literal = [], False
  for paragraph in re.split(r"\n\s*\n", doc):
    lines = [
      line for line in paragraph.splitlines() if not line.lstrip().startswith((">>>", "..."))
    ]
    indented = all(line.startswith(" ") for line in lines if line.strip())
    if literal and indented:
      continue
    literal = paragraph.rstrip().endswith("::")
    found.append("\n".join(lines))
  return found


def public_objects() -> dict[str, object]:
  """Every object the API pages document: the public names, the members
  their classes show, and the module functions named by auto* directives."""
  found: dict[str, object] = {}

  def visit(path: str, obj: object) -> None:
    if path in found:
      return
    found[path] = obj
    if inspect.isclass(obj):
      for name, member in vars(obj).items():
        if name.startswith("_"):
          continue
        if isinstance(member, property):
          member = member.fget
        if inspect.isfunction(member) or inspect.isclass(member) or callable(member):
          visit(f"{path}.{name}", member)

  for name in jaxbuf.__all__:
    visit(f"jaxbuf.{name}", getattr(jaxbuf, name))
  for page in API.glob("*.md"):
    for dotted in re.findall(r"^\.\. auto\w+:: (jaxbuf\.[\w.]+)", page.read_text(), re.M):
      obj: object = jaxbuf
      for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
      visit(dotted, obj)
  return {
    path: obj
    for path, obj in found.items()
    if isinstance(obj, (type, types.ModuleType)) or callable(obj)
  }


def test_the_check_finds_the_markup_that_runs_on():
  assert unbalanced("K `jaxbuf.Buffer` objects, `sample` and `add`.") is None
  assert unbalanced("see :func:`jaxbuf.mixture` (`x`), `a`/`b`.") is None
  assert "does not see" in unbalanced("K `jaxbuf.Buffer`s of any kind, `sample` then")
  assert "left open" in unbalanced("a `sample of a sentence")
  assert "opens nothing" in unbalanced("x` alone")


def test_every_public_docstring_has_balanced_backticks():
  objects = public_objects()
  assert len(objects) > 100  # the walk found the API, not a corner of it
  problems = [
    f"{path}: {problem}"
    for path, obj in sorted(objects.items())
    for problem in map(unbalanced, paragraphs(inspect.getdoc(obj) or ""))
    if problem
  ]
  assert not problems, "\n".join(problems)
