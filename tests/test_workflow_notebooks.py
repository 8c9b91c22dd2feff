"""The workflow notebooks of notebooks/: small in the suite, shown in the docs.

nbmake runs every notebook of notebooks/ (pyproject's testpaths); these tests
check what it cannot: that each workflow notebook has the small mode the suite
runs it in, that the outputs it stores (shown by the docs, which do not
execute it) come from a whole run at full size, and that the docs list it.
"""

import json
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted(
  path for path in (ROOT / "notebooks").glob("*.ipynb") if path.name != "quickstart.ipynb"
)
SMALL_MODE = 'SMALL = os.environ.get("JAXBUF_NOTEBOOK_SMALL") == "1"'
# Stored outputs stay small: PNG figures at a modest dpi, short text.
MAX_BYTES = 400_000


def cells(path: pathlib.Path) -> list[dict]:
  return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
  return "".join(cell["source"])


def test_there_is_one_notebook_per_workflow():
  assert len(NOTEBOOKS) >= 11


def test_the_suite_runs_the_notebooks_small():
  # conftest.py sets it; the kernels nbmake starts inherit it.
  assert os.environ.get("JAXBUF_NOTEBOOK_SMALL") == "1"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_reads_the_small_mode_in_its_first_code_cell(path):
  first = next(cell for cell in cells(path) if cell["cell_type"] == "code")
  assert SMALL_MODE in source(first)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_stores_the_outputs_of_one_whole_run_at_full_size(path):
  code = [cell for cell in cells(path) if cell["cell_type"] == "code"]
  assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1))
  outputs = [output for cell in code for output in cell["outputs"]]
  assert not [output for output in outputs if output["output_type"] == "error"]
  text = "".join("".join(output.get("text", "")) for output in outputs)
  assert "small mode: False" in text
  assert any("image/png" in output.get("data", {}) for output in outputs)
  assert path.stat().st_size < MAX_BYTES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_intro_lists_every_section(path):
  markdown = [source(cell) for cell in cells(path) if cell["cell_type"] == "markdown"]
  listed = re.findall(r"^(\d+)\. ", markdown[0], re.MULTILINE)
  sections = [m.group(1) for text in markdown[1:] for m in re.finditer(r"^## (\d+)\. ", text, re.M)]
  assert sections and listed == sections


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_is_shown_in_the_docs(path):
  shown = ROOT / "docs" / "notebooks" / path.name
  # A link, so the docs show the very file the suite runs.
  assert shown.is_symlink() and shown.resolve() == path.resolve()
  assert f"notebooks/{path.stem}\n" in (ROOT / "docs" / "index.md").read_text()
