"""The whole episodes a buffer's state holds, in Minari's layout: what
`to_minari` and `to_rlds_steps` write ("Writing back" in
`help(jaxbuf.offline)`)."""

from typing import Any, Iterator

import jax
import numpy as np

from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree
from jaxbuf._src.core.records import Transition
from jaxbuf._src.offline.mapping import Episode, checked_layout, devices_of

_CHECK_BLOCK = 1 << 16


# --- Writing back ----------------------------------------------------------


def _host(tree: PyTree) -> PyTree:
  return jax.tree.map(np.asarray, tree)


def _take(tree: PyTree, rows: np.ndarray) -> PyTree:
  return jax.tree.map(lambda x: x[rows], tree)


def _rows_equal(first: np.ndarray, second: np.ndarray) -> np.ndarray:
  """Whether rows `[M, ...]` are equal bit for bit (NaN == NaN): bool [M]."""

  def as_bytes(x):
    return np.ascontiguousarray(x).reshape(x.shape[0], -1).view(np.uint8)

  return (as_bytes(first) == as_bytes(second)).all(axis=1)


def _item_episodes(state: Any) -> Iterator[Episode]:
  """The episodes of item replay; raises before the first if any is out of
  order ("Writing back" in `help(jaxbuf.offline)`)."""
  storage = _host(state.storage)
  capacity = jax.tree.leaves(storage)[0].shape[0]
  size = int(state.size)
  start = int(state.insert_position) if size == capacity else 0
  order = (start + np.arange(size)) % capacity
  wrapped = int(state.add_count) != size
  ends = (storage.terminated | storage.truncated)[order]
  chained = np.ones(max(size - 1, 0), bool)
  # In blocks, so that the check never gathers a copy of the observations.
  for block in range(0, max(size - 1, 0), _CHECK_BLOCK):
    earlier = order[block : min(block + _CHECK_BLOCK, size - 1)]
    for next_obs, obs in zip(jax.tree.leaves(storage.next_obs), jax.tree.leaves(storage.obs)):
      chained[block : block + earlier.size] &= _rows_equal(
        next_obs[earlier], obs[order[block + 1 : block + 1 + earlier.size]]
      )
  end_positions = np.flatnonzero(ends)
  first_kept = 1 if wrapped else 0
  if end_positions.size > first_kept:
    inside = np.arange(size - 1)
    span = (inside >= (end_positions[first_kept - 1] + 1 if first_kept else 0)) & (
      inside < end_positions[-1]
    )
    broken = np.flatnonzero(span & ~ends[:-1] & ~chained)
    if broken.size:
      earlier, later = order[broken[0]], order[broken[0] + 1]
      raise ValueError(
        f"held_episodes: next_obs of slot {earlier} is not obs of slot {later}, "
        "the next item added, though neither terminated nor truncated: "
        "the items are not in episode order (added from several envs at "
        "once?). Item replay writes back only items added one episode "
        "after another; use sequence replay for several envs."
      )
  return _item_runs(storage, order, end_positions, first_kept)


def _item_runs(
  storage: Transition, order: np.ndarray, end_positions: np.ndarray, first_kept: int
) -> Iterator[Episode]:
  run_start = 0
  for run_index, end in enumerate(end_positions.tolist()):
    rows = order[run_start : end + 1]
    run_start = end + 1
    if run_index < first_kept:
      continue
    items = _take(storage, rows)
    yield Episode(
      observations=jax.tree.map(
        lambda obs, final: np.concatenate([obs, final[-1:]]), items.obs, items.next_obs
      ),
      actions=items.action,
      rewards=items.reward,
      terminations=items.terminated,
      truncations=items.truncated,
    )


def _stream_episodes(state: Any) -> Iterator[Episode]:
  storage = _host(state.storage)
  episode_ends = np.asarray(state.episode_ends)
  num_envs, per_env = episode_ends.shape
  whole_starts = np.asarray(state.oldest_held_starts_an_episode())
  for env in range(num_envs):
    held = int(state.steps_held[env])
    start = (int(state.write_heads[env]) - held) % per_env
    order = (start + np.arange(held)) % per_env
    whole_start = bool(whole_starts[env])
    ends = np.flatnonzero(episode_ends[env, order]).tolist()
    run_start = 0
    for run_index, end in enumerate(ends):
      rows = order[run_start : end + 1]
      run_start = end + 1
      if run_index == 0 and not whole_start:
        continue
      steps = jax.tree.map(lambda x, rows=rows: x[env, rows], storage)
      yield Episode(
        observations=steps.obs,
        actions=jax.tree.map(lambda x: x[:-1], steps.action),
        rewards=steps.reward[:-1],
        terminations=steps.terminated[:-1],
        truncations=steps.truncated[:-1],
      )


def held_episodes(buffer: Buffer, state: Any) -> list[Episode]:
  """The whole episodes a state holds, in Minari's layout (NumPy).

  See "Writing back" in `help(jaxbuf.offline)` for what is written.

  >>> import numpy as np, jaxbuf
  >>> steps = {"observation": np.arange(4, dtype=np.float32),
  ...          "action": np.zeros(4, np.int32), "reward": np.ones(4, np.float32),
  ...          "is_first": np.array([1, 0, 1, 0], bool),
  ...          "is_last": np.array([0, 1, 0, 1], bool),
  ...          "is_terminal": np.array([0, 1, 0, 0], bool)}
  >>> buffer = jaxbuf.sequence_replay(num_envs=1, capacity=8, sequence_length=2)
  >>> state = jaxbuf.from_rlds_steps(
  ...     steps, buffer, buffer.init(jaxbuf.offline_example(steps, buffer)))
  >>> [episode.observations.tolist() for episode in jaxbuf.held_episodes(buffer, state)]
  [[0.0, 1.0], [2.0, 3.0]]
  """
  return list(iterate_held_episodes(buffer, state, what="held_episodes"))


def iterate_held_episodes(buffer: Buffer, state: Any, *, what: str) -> Iterator[Episode]:
  """`held_episodes`, one at a time (errors raised before the first).

  A sharded state is read as the unsharded buffer it stands for (its
  `joined` state, of a host copy)."""
  layout = checked_layout(buffer, state, what=what)
  validation.check_not_donated(state, what=what)
  if devices_of(buffer) is not None:
    state = type(state).joined(jax.device_get(state))
  if layout == "items":
    return _item_episodes(state)
  return _stream_episodes(state)
