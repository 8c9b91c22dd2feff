"""The README's code runs as written, each block on its own, and every
transition it stores through a jaxbuf buffer has its true next observation
(`tests/stored_transitions.py`)."""

import pathlib
import re

import jax
import pytest

from tests.stored_transitions import TransitionRecorder

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def run_block(block: str) -> dict:
  namespace = {}
  with jax.numpy_rank_promotion("allow"):
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
  return namespace


def test_readme_has_runnable_blocks():
  assert len(BLOCKS) >= 3


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.split("\n")[0][:40])
def test_readme_python_block_runs(block, monkeypatch):
  recorder = TransitionRecorder().patched(monkeypatch)
  namespace = run_block(block)
  recorder.check()
  if "def train_step" in block:  # the jitted train step: 3 adds of 8 items
    assert int(namespace["state"].size) == 24
    assert int(namespace["state"].beta_step) == 3
