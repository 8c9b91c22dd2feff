"""The README's code runs as written."""

import pathlib
import re

import jax

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
  assert blocks
  for block in blocks:
    namespace = {}
    with jax.numpy_rank_promotion("allow"):
      exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
  assert int(namespace["state"].size) == 24
  assert int(namespace["state"].beta_step) == 3
