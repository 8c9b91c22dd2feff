"""The quickstart notebook's text agrees with its sections and the API.

The notebook itself runs under nbmake (`pytest --nbmake notebooks/`); these
tests read its text, which nbmake cannot check.
"""

import json
import pathlib
import re

import jaxbuf

NOTEBOOK = pathlib.Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"
NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()


def markdown_cells() -> list[str]:
  cells = json.loads(NOTEBOOK.read_text())["cells"]
  return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown"]


def test_intro_lists_every_section():
  intro, *rest = markdown_cells()
  listed = re.findall(r"^(\d+)\. ", intro, re.MULTILINE)
  sections = [
    match.group(1) for cell in rest for match in re.finditer(r"^## (\d+)\. ", cell, re.MULTILINE)
  ]
  assert len(sections) >= 7
  assert listed == sections


def test_counts_and_names_the_functions_of_a_buffer():
  text = "\n".join(markdown_cells())
  counted = re.search(r"the same (\w+) functions([^.]*)", text)
  assert counted, "the notebook no longer says how many functions"
  # `kind` is the buffer's description (jaxbuf._src.core.kind), not a function.
  functions = [name for name in jaxbuf.Buffer._fields if name != "kind"]
  assert counted.group(1) == NUMBER_WORDS[len(functions)]
  for name in functions:
    assert f"`{name}`" in counted.group(2)
