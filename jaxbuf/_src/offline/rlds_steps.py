"""RLDS steps (NumPy arrays in the RLDS layout, no TensorFlow) in and out of
jaxbuf buffers: `from_rlds_steps`, `to_rlds_steps`. The mapping of RLDS's
`is_first` / `is_last` / `is_terminal` steps onto jaxbuf's items and streams
is in `help(jaxbuf.offline)`."""

from typing import Any, Callable, Iterator

import jax
import numpy as np

from jaxbuf._src.core.base import Buffer
from jaxbuf._src.offline.mapping import Episode, check_spec, checked_layout
from jaxbuf._src.offline.mapping import common_length, episode_rows, exact, storage_spec
from jaxbuf._src.offline.held_episodes import iterate_held_episodes
from jaxbuf._src.offline.loading import DEFAULT_CHUNK_SIZE, load_episodes


# --- RLDS ------------------------------------------------------------------

_RLDS_FLAGS = ("is_first", "is_last", "is_terminal")


def step_arrays(steps: Any, *, what: str) -> dict[str, Any]:
  if not isinstance(steps, dict):
    raise TypeError(
      f"{what}: expected RLDS steps as a dict of NumPy arrays "
      f"(observation, action, reward, is_first, is_last, "
      f"is_terminal), given {type(steps).__name__}."
    )
  missing = [
    field for field in ("observation", "action", "reward", *_RLDS_FLAGS) if field not in steps
  ]
  if missing:
    raise ValueError(f"{what}: RLDS steps lack {missing}.")
  steps = dict(steps)
  for field in ("reward", *_RLDS_FLAGS):
    steps[field] = np.asarray(steps[field])
  num_steps = common_length(
    "steps",
    {field: steps[field] for field in ("observation", "action", "reward", *_RLDS_FLAGS)},
    "the RLDS steps",
  )
  del num_steps
  for field in ("reward", *_RLDS_FLAGS):
    # Known before the first add: a [T, 1] reward would fail in NumPy's
    # broadcast at the first chunk, after the state was consumed.
    if steps[field].ndim != 1:
      raise ValueError(
        f"{what}: {field} has shape {steps[field].shape}; "
        "RLDS steps hold one scalar per step, shape (T,) "
        f"(squeeze it: {field}[:, 0]). Nothing was added."
      )
  for field in _RLDS_FLAGS:
    steps[field] = exact(field, steps[field], np.dtype(bool), "the RLDS steps")
  return steps


def row_spec(steps: dict[str, Any]) -> dict[str, Any]:
  return {
    field: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], np.asarray(x).dtype), steps[field]
    )
    for field in ("observation", "action")
  }


def _rlds_bounds(steps: dict[str, Any], *, what: str) -> list[tuple[int, int]]:
  """`(first, last)` step of each episode; raises on broken flags."""
  is_first, is_last = steps["is_first"], steps["is_last"]
  firsts = np.flatnonzero(is_first)
  lasts = np.flatnonzero(is_last)
  if not is_first.size:
    return []
  if not is_first[0]:
    raise ValueError(f"{what}: is_first: step 0 does not start an episode.")
  if not is_last[-1]:
    raise ValueError(
      f"{what}: is_last: the last step ({is_last.size - 1}) "
      "does not end an episode (an unfinished episode)."
    )
  if firsts.size != lasts.size or np.any(firsts[1:] != lasts[:-1] + 1):
    raise ValueError(
      f"{what}: is_first/is_last: episodes must alternate, "
      f"one is_last before each is_first; is_first at "
      f"{firsts[:8].tolist()}, is_last at {lasts[:8].tolist()}."
    )
  terminal = np.flatnonzero(steps["is_terminal"] & ~is_last)
  if terminal.size:
    raise ValueError(f"{what}: is_terminal: step {terminal[0]} is terminal but not is_last.")
  return list(zip(firsts.tolist(), lasts.tolist()))


def _rlds_reader(
  steps: dict[str, Any], bounds: list[tuple[int, int]]
) -> Callable[[list[int]], Iterator[Episode]]:
  def read(indices):
    for index in indices:
      first, last = bounds[index]
      terminal = bool(steps["is_terminal"][last])
      num_steps = last - first
      flags = np.zeros(num_steps, bool)
      terminations, truncations = flags.copy(), flags.copy()
      if num_steps:
        terminations[-1], truncations[-1] = terminal, not terminal
      yield Episode(
        observations=jax.tree.map(lambda x: x[first : last + 1], steps["observation"]),
        actions=jax.tree.map(lambda x: x[first:last], steps["action"]),
        rewards=steps["reward"][first:last],
        terminations=terminations,
        truncations=truncations,
      )

  return read


def from_rlds_steps(
  steps: dict[str, Any],
  buffer: Buffer,
  state: Any,
  *,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  progress: bool = False,
  round_floats: bool = False,
) -> Any:
  """Adds RLDS-layout steps (NumPy, no TensorFlow) to `state`.

  Args:
    steps: a dict of arrays over the steps of consecutive episodes, leading
      axis the step: "observation" and "action" (any pytree of arrays),
      "reward", and bool "is_first", "is_last", "is_terminal" (see
      `help(jaxbuf.offline)`); other keys ("discount", ...) are ignored.
    buffer, state, chunk_size, progress, round_floats: as for
      `from_minari`.

  Returns:
    The state holding the episodes.

  >>> import numpy as np, jaxbuf
  >>> steps = {"observation": np.arange(5, dtype=np.float32)[:, None],
  ...          "action": np.array([1, 0, 0, 1, 0], np.int32),
  ...          "reward": np.array([1., 2., 0., 3., 0.], np.float32),
  ...          "is_first": np.array([1, 0, 0, 1, 0], bool),
  ...          "is_last": np.array([0, 0, 1, 0, 1], bool),
  ...          "is_terminal": np.array([0, 0, 1, 0, 0], bool)}
  >>> buffer = jaxbuf.uniform_replay(8)
  >>> state = buffer.init(jaxbuf.offline_example(steps, buffer))
  >>> state = jaxbuf.from_rlds_steps(steps, buffer, state)
  >>> int(state.size), state.storage.next_obs[:3, 0].tolist()
  (3, [1.0, 2.0, 4.0])
  >>> state.storage.terminated[:3].tolist(), state.storage.truncated[:3].tolist()
  ([False, True, False], [False, False, True])
  """
  what = "from_rlds_steps"
  steps = step_arrays(steps, what=what)
  layout = checked_layout(buffer, state, what=what)
  spec = storage_spec(buffer, state, layout)
  given = row_spec(steps)
  check_spec("observation", given["observation"], spec.obs)
  check_spec("action", given["action"], spec.action)
  bounds = _rlds_bounds(steps, what=what)
  return load_episodes(
    _rlds_reader(steps, bounds),
    [last - first for first, last in bounds],
    buffer,
    state,
    names=lambda index: f"the RLDS episode at steps {bounds[index][0]}..{bounds[index][1]}",
    chunk_size=chunk_size,
    progress=progress,
    round_floats=round_floats,
    what=what,
  )


def to_rlds_steps(buffer: Buffer, state: Any) -> dict[str, Any]:
  """The whole episodes `state` holds as RLDS steps (NumPy, concatenated).

  The inverse of `from_rlds_steps`: keys "observation", "action", "reward",
  "is_first", "is_last", "is_terminal"; the last step of each episode holds
  its final observation, with zero action and reward.

  >>> import numpy as np, jaxbuf
  >>> steps = {"observation": np.arange(3, dtype=np.float32),
  ...          "action": np.zeros(3, np.int32), "reward": np.ones(3, np.float32),
  ...          "is_first": np.array([1, 0, 0], bool),
  ...          "is_last": np.array([0, 0, 1], bool),
  ...          "is_terminal": np.array([0, 0, 1], bool)}
  >>> buffer = jaxbuf.uniform_replay(4)
  >>> state = jaxbuf.from_rlds_steps(
  ...     steps, buffer, buffer.init(jaxbuf.offline_example(steps, buffer)))
  >>> jaxbuf.to_rlds_steps(buffer, state)["reward"].tolist()
  [1.0, 1.0, 0.0]
  """
  held = list(iterate_held_episodes(buffer, state, what="to_rlds_steps"))
  if not held:
    raise ValueError("to_rlds_steps: the state holds no whole episode.")
  parts = [episode_rows(episode, "streams") for episode in held]
  steps = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
  return {
    "observation": steps.obs,
    "action": steps.action,
    "reward": steps.reward,
    "is_first": np.concatenate([np.arange(len(part.last)) == 0 for part in parts]),
    "is_last": steps.last,
    "is_terminal": np.concatenate(
      [np.append(np.zeros(len(part.last) - 1, bool), part.terminated[-2]) for part in parts]
    ),
  }
