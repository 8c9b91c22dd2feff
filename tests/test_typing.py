"""jaxbuf as a type checker sees it from a user's script (issue 32).

`tests/typing_user_script.py` must pass mypy with no ignore, and mypy must
flag exactly the mistakes marked in `tests/typing_user_errors.py`. The mypy
tests are marked `typing`, outside the default suite: a first mypy run
reads JAX's annotations (about 20 s of one core), so `.ci/run` runs them
right after `mypy jaxbuf`, whose cache they then share (a few seconds).
"""

import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
USER_SCRIPT = ROOT / "tests" / "typing_user_script.py"
USER_ERRORS = ROOT / "tests" / "typing_user_errors.py"


def _mypy(script: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> str:
  api = pytest.importorskip("mypy.api", reason="mypy is in the [dev] extra")
  # From the checkout's root, so that `import jaxbuf` is this checkout and
  # pyproject.toml's settings and the cache of `mypy jaxbuf` apply.
  monkeypatch.chdir(ROOT)
  stdout, stderr, _ = api.run(
    ["--config-file", str(ROOT / "pyproject.toml"), "--show-error-codes", str(script)]
  )
  return stdout + stderr


def test_user_script_runs():
  runpy.run_path(str(USER_SCRIPT), run_name="__main__")


@pytest.mark.typing
def test_user_script_type_checks_clean(monkeypatch):
  output = _mypy(USER_SCRIPT, monkeypatch)
  assert "Success: no issues found" in output, output


@pytest.mark.typing
def test_mistakes_are_flagged(monkeypatch):
  lines = USER_ERRORS.read_text().splitlines()
  expected = {
    (number, code)
    for number, line in enumerate(lines, 1)
    for code in re.findall(r"# error: \[([a-z-]+)\]", line)
  }
  output = _mypy(USER_ERRORS, monkeypatch)
  found = {
    (int(number), code)
    for number, code in re.findall(
      rf"{USER_ERRORS.name}:(\d+): error: .*\[([a-z-]+)\]$", output, re.MULTILINE
    )
  }
  assert found == expected, output
  # Nothing but those: no error in jaxbuf itself, none elsewhere.
  assert f"Found {len(expected)} errors in 1 file" in output, output
