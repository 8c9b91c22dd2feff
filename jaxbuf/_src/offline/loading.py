"""Adding episodes to any buffer kind in chunks: the one writer behind
`from_minari` and `from_rlds_steps`.

Shape key: T transitions in an episode, C capacity, N envs, R = C // N steps
per env, K steps per env in one chunk. The mapping of episodes onto items and
streams, which episodes are kept and the memory this takes are described
in `help(jaxbuf.offline)`.
"""

from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer
from jaxbuf._src.offline.mapping import Episode, checked_episode, checked_layout
from jaxbuf._src.offline.mapping import devices_of, episode_rows, storage_spec
from jaxbuf._src.offline.mapping import unsharded_shapes

DEFAULT_CHUNK_SIZE = 1 << 12


class _RowReader:
  """Rows of a sequence of episodes, read one episode at a time."""

  def __init__(self, episodes: Iterator[Episode], layout: str):
    self._episodes = episodes
    self._layout = layout
    self._rows: list[Any] | None = None
    self._offset = 0

  def take(self, out: list[np.ndarray]) -> None:
    """Fills `out` (arrays `[count, ...]`, one per leaf) with the next rows."""
    count = out[0].shape[0]
    filled = 0
    while filled < count:
      if self._rows is None or self._offset == len(self._rows[0]):
        self._rows = jax.tree.leaves(episode_rows(next(self._episodes), self._layout))
        self._offset = 0
      moved = min(count - filled, len(self._rows[0]) - self._offset)
      for leaf, rows in zip(out, self._rows):
        leaf[filled : filled + moved] = rows[self._offset : self._offset + moved]
      filled += moved
      self._offset += moved


def _parts(count: int, largest: int) -> list[int]:
  """`count` as full chunks of `largest` and the remainder: the adds compile
  for two shapes per load."""
  return [largest] * (count // largest) + [count % largest] * bool(count % largest)


def _chunk_size_per_env(chunk_size: int, num_envs: int) -> int:
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, given {chunk_size!r}.")
  return max(1, chunk_size // num_envs)


# --- Choosing the episodes that fit ---------------------------------------


def _newest_items(lengths: Sequence[int], capacity: int) -> list[int]:
  """Indices of the newest episodes whose transitions fit, oldest first."""
  kept, total = [], 0
  for index in range(len(lengths) - 1, -1, -1):
    if total + lengths[index] > capacity:
      break
    kept.append(index)
    total += lengths[index]
  return kept[::-1]


def _newest_streams(lengths: Sequence[int], num_envs: int, per_env: int) -> list[list[int]]:
  """For each env the episode indices it gets, oldest first: the newest
  episodes, each to the env with the most room, while one fits."""
  used = [0] * num_envs
  assigned: list[list[int]] = [[] for _ in range(num_envs)]
  for index in range(len(lengths) - 1, -1, -1):
    env = min(range(num_envs), key=lambda n: used[n])
    if used[env] + lengths[index] + 1 > per_env:
      break
    used[env] += lengths[index] + 1
    assigned[env].append(index)
  return [episodes[::-1] for episodes in assigned]


# --- Loading ---------------------------------------------------------------


def _progress_bar(total: int, enabled: bool, description: str) -> Any:
  if not enabled:
    return None
  try:
    import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError("progress=True needs tqdm: pip install 'jaxbuf[offline]'") from error
  return tqdm.tqdm(total=total, desc=description, unit="step")


def _added(state: Any) -> Any:
  """`state` once its add has run: without the wait, asynchronous dispatch
  lets the reader queue chunk after chunk, each held until its add runs."""
  return jax.block_until_ready(state)


def _deleted(state: Any) -> None:
  """Deletes a half-filled state's arrays, so it cannot pass for loaded."""
  for leaf in jax.tree.leaves(state):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()


def load_episodes(
  read: Callable[[list[int]], Iterator[Episode]],
  lengths: Sequence[int],
  buffer: Buffer,
  state: Any,
  *,
  names: Callable[[int], str],
  chunk_size: int,
  progress: bool,
  round_floats: bool,
  what: str,
) -> Any:
  """Adds the newest episodes that fit to `state`, in chunks.

  Args:
    read: episode indices -> their `Episode`s, in that order.
    lengths: T of every episode, oldest first.
    buffer, state: the buffer and its state (consumed).
    names: episode index -> how errors name it.
    chunk_size, progress, round_floats: as for `from_minari`.
    what: the caller's name, for errors.
  """
  for name, flag in (("progress", progress), ("round_floats", round_floats)):
    validation.check_bool(flag, name, what=what)
  layout = checked_layout(buffer, state, what=what)
  assert buffer.kind is not None  # checked_layout refuses a buffer without one
  validation.check_not_donated(state, what=what)
  spec = storage_spec(buffer, state, layout)
  shapes = unsharded_shapes(buffer, state)
  num_devices = devices_of(buffer) or 1
  per_add = _chunk_size_per_env(chunk_size, num_devices) * num_devices
  if not lengths:
    raise ValueError(f"{what}: the dataset holds no episodes.")
  _check_no_running_episode(buffer, state, layout, what=what)
  if layout == "items":
    capacity = jax.tree.leaves(shapes.storage)[0].shape[0]
    kept = _newest_items(lengths, capacity)
    groups = [kept]
    room = f"capacity {capacity} transitions"
  else:
    num_envs, per_env = shapes.episode_ends.shape
    groups = _newest_streams(lengths, num_envs, per_env)
    kept = [index for group in groups for index in group]
    room = f"{per_env} steps per env ({num_envs} envs)"
  if not kept:
    raise ValueError(
      f"{what}: the newest episode ({names(len(lengths) - 1)}, "
      f"{lengths[-1]} transitions) does not fit the buffer ({room}); "
      "make the buffer larger."
    )

  def reader(indices):
    return _RowReader(
      (
        checked_episode(episode, spec, names(index), round_floats=round_floats)
        for index, episode in zip(indices, read(indices))
      ),
      layout,
    )

  readers = [reader(group) for group in groups]
  total = sum(lengths[index] + (layout == "streams") for index in kept)
  if layout == "items" and total % num_devices:
    raise ValueError(
      f"{what}: a {buffer.kind.name} buffer keeps its {num_devices} "
      f"devices' rings in lockstep (each add splits evenly over them), so "
      f"it loads a multiple of {num_devices} transitions; the newest "
      f"episodes that fit hold {total}. Load into the unsharded buffer, "
      "or into a sharded sequence replay buffer (split over envs)."
    )
  bar = _progress_bar(total, progress, what)
  try:
    if layout == "items":
      # One chunk, refilled: each add has run before the next fill (`_added`).
      chunk = [
        np.empty((min(per_add, total), *leaf.shape), leaf.dtype) for leaf in jax.tree.leaves(spec)
      ]
      for count in _parts(total, per_add):
        rows = [leaf[:count] for leaf in chunk]
        readers[0].take(rows)
        state = _added(
          buffer.add(
            state,
            jax.tree.unflatten(
              jax.tree.structure(spec), [_in_device_blocks(leaf, num_devices) for leaf in rows]
            ),
          )
        )
        if bar is not None:
          bar.update(count)
    else:
      state = _add_streams(
        buffer,
        state,
        readers,
        groups,
        lengths,
        spec,
        _chunk_size_per_env(chunk_size, len(groups)),
        bar,
      )
      _check_episode_ends(buffer, state, groups, lengths, what=what)
  except Exception as error:
    _deleted(state)
    consumed = (
      f"The state passed to {what} was consumed (its arrays are "
      "deleted, so no partly loaded state can pass for loaded): "
      "make a new one with buffer.init."
    )
    if type(error) in (ValueError, TypeError):
      raise type(error)(f"{error} {consumed}").with_traceback(error.__traceback__) from None
    error.add_note(consumed)
    raise
  except BaseException:
    _deleted(state)
    raise
  finally:
    if bar is not None:
      bar.close()
  return state


def _check_no_running_episode(buffer: Buffer, state: Any, layout: str, *, what: str) -> None:
  """Raises `ValueError` if `state` holds an episode that has not ended.

  The dataset's first episode would continue it: stream kinds would sample
  windows, stacks and goals across the two, and write them back as one
  episode; item replay would write back neither. Only the small per-env
  arrays (item replay: the two flags) are read to the host.
  """
  if layout == "items":
    flags = state.replace(
      storage=state.storage._replace(obs=None, action=None, reward=None, next_obs=None)
    )
    if devices_of(buffer) is not None:
      flags = type(flags).joined(jax.device_get(flags))
    size = int(flags.size)
    if not size:
      return
    capacity = flags.storage.terminated.shape[0]
    newest = (int(flags.insert_position) - 1) % capacity
    ends = np.asarray(flags.storage.terminated) | np.asarray(flags.storage.truncated)
    if ends[newest]:
      return
    order = (newest - np.arange(size)) % capacity
    running = int(np.argmax(ends[order])) if ends[order].any() else size
    raise ValueError(
      f"{what}: the state's newest item (slot {newest}) neither terminated "
      f"nor truncated: it holds a running episode ({running} items since "
      "the last end), which the dataset's first episode would seem to "
      "continue, so neither could be written back whole. Add the rest of "
      "that episode first (up to a termination or truncation), or load "
      "into a fresh state (buffer.init); nothing was added."
    )
  num_envs = int(np.prod(state.write_heads.shape))
  ends = np.asarray(jax.device_get(state.episode_ends)).reshape(num_envs, -1)
  heads = np.asarray(jax.device_get(state.write_heads)).reshape(num_envs)
  held = np.asarray(jax.device_get(state.steps_held)).reshape(num_envs)
  per_env = ends.shape[1]
  for env in range(num_envs):
    newest = (heads[env] - 1 - np.arange(held[env])) % per_env
    if held[env] and not ends[env, newest[0]]:
      running = int(np.argmax(ends[env, newest])) if ends[env, newest].any() else int(held[env])
      raise ValueError(
        f"{what}: env {env} of the state holds a running episode ({running} "
        "steps since its last episode end); the dataset's first episode "
        "would be glued onto it (windows, frame stacks and hindsight goals "
        "across the two, written back as one episode). Add its final step "
        "first (`last` True, or episode_end), or load into a fresh state "
        "(buffer.init); nothing was added."
      )


def _in_device_blocks(rows: np.ndarray, num_devices: int) -> np.ndarray:
  """Rows `[k D, ...]` in the order added, reordered for a sharded add:
  device d writes the d-th block of k rows into its next k local slots, and
  the unsharded view (`ReplayState.joined`) puts local slot j of device d at
  slot j D + d, so the d-th block is rows d, D + d, 2 D + d, ..."""
  if num_devices == 1:
    return rows
  return np.ascontiguousarray(
    rows.reshape(-1, num_devices, *rows.shape[1:]).swapaxes(0, 1)
  ).reshape(rows.shape)


def _add_streams(
  buffer: Buffer,
  state: Any,
  readers: list[_RowReader],
  groups: list[list[int]],
  lengths: Sequence[int],
  spec: Any,
  per_chunk: int,
  bar: Any,
) -> Any:
  """Each env's stream in chunks `[N, K, ...]`; an env with fewer steps left
  is masked out. Parts of each env go in the same order as its stream."""
  num_envs = len(groups)
  treedef = jax.tree.structure(spec)
  parts = [_parts(sum(lengths[i] + 1 for i in group), per_chunk) for group in groups]
  # One chunk, refilled (see load_episodes); rows of envs masked out are
  # never written to the buffer.
  chunk = [
    np.zeros((num_envs, per_chunk, *leaf.shape), leaf.dtype) for leaf in jax.tree.leaves(spec)
  ]
  position = 0
  while any(position < len(env_parts) for env_parts in parts):
    # Envs whose part at this position has the same size add together.
    sizes = sorted(
      {env_parts[position] for env_parts in parts if position < len(env_parts)}, reverse=True
    )
    for size in sizes:
      envs = [n for n in range(num_envs) if position < len(parts[n]) and parts[n][position] == size]
      leaves = [leaf[:, :size] for leaf in chunk]
      for env in envs:
        readers[env].take([leaf[env] for leaf in leaves])
      steps = jax.tree.unflatten(treedef, leaves)
      mask = np.isin(np.arange(num_envs), envs)
      state = _added(buffer.add(state, steps, mask))
      if bar is not None:
        bar.update(size * len(envs))
    position += 1
  return state


def _check_episode_ends(
  buffer: Buffer, state: Any, groups: list[list[int]], lengths: Sequence[int], *, what: str
) -> None:
  """Raises unless each env's steps just written hold one episode end per
  episode added: a kind whose add ignored the steps' `last` leaf (the
  stream convention) would hold them run together, as one episode."""
  assert buffer.kind is not None  # checked_layout refuses a buffer without one
  num_envs = len(groups)
  # A sharded state holds envs in blocks over the devices: [D, N / D, ...].
  ends = np.asarray(jax.device_get(state.episode_ends)).reshape(num_envs, -1)
  heads = np.asarray(jax.device_get(state.write_heads)).reshape(num_envs)
  per_env = ends.shape[1]
  for env, group in enumerate(groups):
    written = sum(lengths[index] + 1 for index in group)
    # The ring's slots written last, as at most two slices (no index array
    # as long as the buffer).
    start = (int(heads[env]) - written) % per_env
    recorded = np.count_nonzero(ends[env, start : start + written]) + np.count_nonzero(
      ends[env, : max(start + written - per_env, 0)]
    )
    if recorded != len(group):
      raise ValueError(
        f"{what}: the {buffer.kind.name} buffer recorded {recorded} episode "
        f"ends in the {written} steps written to env {env}, where "
        f"{len(group)} episodes were added: its add does not read the "
        "steps' `last` leaf (the stream convention, help(jaxbuf.streams)), "
        "so the episodes would run together."
      )
