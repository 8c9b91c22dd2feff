"""The documentation's code runs, and its API reference lists every public name.

Every ```python block of a page under docs/ runs, the blocks of one page in
order in one namespace (a guide builds its example up block by block).
Code that is shown but not run (another library's code that needs PyTorch,
which the test extra does not install) is written as a ```{code-block}
directive instead, so the difference is visible in the source.

Every transition a page stores through a jaxbuf buffer is checked: its next
observation is the true one (`tests/stored_transitions.py`), so a snippet
that stores `next_obs = obs`, or a stale next observation, fails here.
"""

import importlib
import pathlib
import re
import textwrap
import warnings

import jax
import pytest

import jaxbuf
from tests.stored_transitions import TransitionRecorder

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


def run_blocks(blocks: list[str], where: str) -> None:
  namespace = {"__name__": "__docs__"}
  with jax.numpy_rank_promotion("allow"), warnings.catch_warnings():
    # docs/guides/ray.md starts a Ray cluster in this process, which ran
    # JAX before: JAX warns on any fork, and Ray forks only to exec its
    # processes at once.
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    for block in blocks:
      exec(compile(block, where, "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda page: str(page.relative_to(DOCS)))
def test_page_code_runs_and_stores_true_transitions(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # files a page writes stay in a scratch folder
  monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
  recorder = TransitionRecorder().patched(monkeypatch)
  run_blocks(python_blocks(page), str(page))
  recorder.check()


# What docs/migration/flashbax.md once showed: flashbax's flat buffer ported
# to item replay with the observation stored again as next_obs.
NEXT_OBS_IS_OBS = """
import jax, jax.numpy as jnp, jaxbuf
step = {"obs": jnp.zeros(4), "action": jnp.int32(0), "reward": jnp.float32(0)}
steps = jax.tree.map(lambda x: jnp.arange(8 * x.size, dtype=x.dtype).reshape(8, *x.shape), step)
item = {**step, "next_obs": step["obs"]}
buffer = jaxbuf.uniform_replay(1000)
state = buffer.add(buffer.init(item), {**steps, "next_obs": steps["obs"]})
"""

# An env loop that stores the observation before last as next_obs.
STALE_NEXT_OBS = """
import jax.numpy as jnp, jaxbuf
buffer = jaxbuf.uniform_replay(100)
state = buffer.init({"obs": jnp.zeros(2), "next_obs": jnp.zeros(2)})
obs = previous = jnp.zeros((3, 2))
for t in range(4):
  next_obs = obs + 1  # what the env returns
  state = buffer.add(state, {"obs": obs, "next_obs": previous if t == 2 else next_obs})
  previous, obs = obs, next_obs
"""

TRUE_NEXT_OBS_IN_A_JIT = """
import jax, jax.numpy as jnp, jaxbuf
buffer = jaxbuf.uniform_replay(100)
state = buffer.init({"obs": jnp.zeros(2), "next_obs": jnp.zeros(2), "done": jnp.bool_(False)})
add = jax.jit(buffer.add)
obs = jnp.zeros((3, 2))
for t in range(3):
  done = jnp.array([False, t == 1, False])
  next_obs = jnp.where(done[:, None], -1.0, obs + 1)  # -1: the true final observation
  state = add(state, {"obs": obs, "next_obs": next_obs, "done": done})
  obs = jnp.where(done[:, None], 0.0, next_obs)  # reset where the episode ended
"""


@pytest.mark.parametrize(
  "snippet, problem",
  [
    (NEXT_OBS_IS_OBS, "every stored next observation equals its observation"),
    (NEXT_OBS_IS_OBS.replace("buffer.add(", "jax.jit(buffer.add)("), "equals its observation"),
    (STALE_NEXT_OBS, r"rows \[0, 1, 2\] did not end their episode"),
  ],
  ids=["next_obs_is_obs", "next_obs_is_obs_in_a_jit", "stale_next_obs"],
)
def test_the_transition_check_fails_wrong_snippets(snippet, problem, monkeypatch):
  recorder = TransitionRecorder().patched(monkeypatch)
  run_blocks([snippet], "<snippet>")
  assert recorder.transitions_added()
  with pytest.raises(AssertionError, match=problem):
    recorder.check()


def test_the_transition_check_passes_a_true_loop_with_episode_ends(monkeypatch):
  recorder = TransitionRecorder().patched(monkeypatch)
  run_blocks([TRUE_NEXT_OBS_IN_A_JIT, STALE_NEXT_OBS.replace("t == 2", "False")], "<snippet>")
  assert recorder.transitions_added() == 9 + 12
  recorder.check()
