"""The documentation's code runs, and its API reference lists every public name.

Every ```python block of a page under docs/ runs, the blocks of one page in
order in one namespace (a guide builds its example up block by block).
Code that is shown but not run (another library's code that needs PyTorch,
which the test extra does not install) is written as a ```{code-block}
directive instead, so the difference is visible in the source.
"""

import importlib
import pathlib
import re
import textwrap
import warnings

import jax
import pytest

import jaxbuf

DOCS = pathlib.Path(__file__).parent.parent / "docs"
API = DOCS / "api"
PAGES = sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)
# A fence may be indented (a block inside a list item); its code then is too.
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)


def python_blocks(page: pathlib.Path) -> list[str]:
  return [textwrap.dedent(code) for _, code in BLOCK.findall(page.read_text())]


PAGES_WITH_CODE = [page for page in PAGES if python_blocks(page)]


def referenced_names() -> set[str]:
  """Names the API pages document: autosummary entries, auto* directives;
  those of the submodule `jaxbuf.ray` (its own `__all__`, never imported
  by `import jaxbuf`) as "ray.NAME", under `.. currentmodule:: jaxbuf.ray`."""
  names = set()
  for page in API.glob("*.md"):
    lines = page.read_text().splitlines()
    in_summary = False
    prefix = ""
    for line in lines:
      stripped = line.strip()
      module = re.match(r"\.\. currentmodule:: (\S+)", stripped)
      if module:
        prefix = "ray." if module.group(1) == "jaxbuf.ray" else ""
      if stripped.startswith(".. autosummary::"):
        in_summary = True
        continue
      if in_summary:
        if not stripped or stripped.startswith(":"):
          continue
        if line.startswith("   ") and re.fullmatch(r"[A-Za-z_]\w*", stripped):
          names.add(prefix + stripped)
          continue
        in_summary = False
      match = re.match(r"\.\. auto\w+:: jaxbuf\.(ray\.\w+|\w+)", stripped)
      if match:
        names.add(match.group(1))
  return names


def public_names() -> set[str]:
  """`jaxbuf.__all__`, and `jaxbuf.ray.__all__` as "ray.NAME"."""
  served = importlib.import_module("jaxbuf.ray")  # the optional extra: imported here only
  return set(jaxbuf.__all__) | {f"ray.{name}" for name in served.__all__}


def test_every_public_name_is_in_the_api_reference():
  missing = sorted(public_names() - referenced_names())
  assert not missing, (
    f"public names without an entry in docs/api/*.md: {missing}; add each "
    "to the autosummary list of its group"
  )


def test_the_api_reference_names_only_public_names():
  unknown = sorted(referenced_names() - public_names())
  assert not unknown, (
    f"docs/api/*.md lists names not in jaxbuf.__all__ (nor jaxbuf.ray.__all__): {unknown}"
  )


def test_every_python_fence_is_run():
  """No ```python fence escapes the extraction (an info string after the
  language, a fence closed at another indent): shown code is run code."""
  for page in PAGES:
    fences = re.findall(r"^ *```python", page.read_text(), re.MULTILINE)
    assert len(fences) == len(python_blocks(page)), page


def test_docs_have_runnable_code():
  assert len(PAGES_WITH_CODE) >= 10


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda page: str(page.relative_to(DOCS)))
def test_page_code_runs(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # files a page writes stay in a scratch folder
  monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
  namespace = {"__name__": "__docs__"}
  with jax.numpy_rank_promotion("allow"), warnings.catch_warnings():
    # docs/guides/ray.md starts a Ray cluster in this process, which ran
    # JAX before: JAX warns on any fork, and Ray forks only to exec its
    # processes at once.
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    for block in python_blocks(page):
      exec(compile(block, str(page), "exec"), namespace)  # noqa: S102
