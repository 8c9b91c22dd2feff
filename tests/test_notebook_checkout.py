"""A notebook that imports examples/ says so when opened outside the checkout.

The workflow notebooks import `examples/` (which ships with the repository,
not with the package), found by walking up from the working directory. A
notebook copied out of the checkout used to die there with a bare
`StopIteration`; it now raises a `FileNotFoundError` naming what it needs.
"""

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
FINDS_THE_CHECKOUT = re.compile(
  r"^repository = next\(.*?^sys\.path\.insert\(0, str\(repository\)\)$", re.DOTALL | re.MULTILINE
)


def checkout_lookup(path: pathlib.Path) -> str | None:
  """The notebook's code that finds the checkout, or None if it has none."""
  for cell in json.loads(path.read_text())["cells"]:
    if cell["cell_type"] == "code":
      found = FINDS_THE_CHECKOUT.search("".join(cell["source"]))
      if found:
        return found.group(0)
  return None


NOTEBOOKS = sorted(path for path in (ROOT / "notebooks").glob("*.ipynb") if checkout_lookup(path))


def test_the_notebooks_that_import_examples_are_found():
  assert len(NOTEBOOKS) >= 11


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_outside_the_checkout_it_says_what_it_needs(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  with pytest.raises(FileNotFoundError, match=r"examples/\w+\.py, which ships with the jaxbuf"):
    exec(checkout_lookup(path), {"pathlib": pathlib, "sys": sys})  # noqa: S102


@pytest.mark.parametrize("path", NOTEBOOKS[:1], ids=lambda path: path.stem)
def test_inside_the_checkout_it_finds_it(path, monkeypatch):
  monkeypatch.chdir(ROOT / "notebooks")
  monkeypatch.setattr(sys, "path", list(sys.path))
  namespace = {"pathlib": pathlib, "sys": sys}
  exec(checkout_lookup(path), namespace)  # noqa: S102
  assert namespace["repository"] == ROOT.resolve() and sys.path[0] == str(ROOT.resolve())
