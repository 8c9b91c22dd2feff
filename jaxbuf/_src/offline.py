"""Offline datasets: Minari and RLDS episodes in and out of jaxbuf buffers.

Shape key: T transitions in an episode (T + 1 observations), C capacity, N
envs, R = C // N steps per env, K steps per env in one chunk.

Three layouts of one episode, side by side (an episode of T = 2 actions,
observations o0 o1 o2, actions a0 a1, rewards r0 r1, ended by a1):

  Minari (`EpisodeData`): observations [T + 1] = o0 o1 o2; actions, rewards,
    terminations, truncations [T] = a0 a1 / r0 r1 / f t / f f. The final
    observation o2 is the extra observation; `terminations[t]` (or
    `truncations[t]`) says action t ended the episode.
  RLDS (steps): T + 1 steps; step t holds observation o_t, action a_t and the
    reward r_t that followed it; the last step holds o2 with `is_last` True
    and its action and reward are padding. `is_first` marks step 0;
    `is_terminal` is True on the last step when the episode terminated (not
    when it was truncated). RLDS's `discount` is not read: `is_terminal`
    says the same. RLDS cannot say that an episode both terminated and
    was truncated (gymnasium can): written as RLDS, it reads as terminated.
  jaxbuf's stream (sequence replay; `jaxbuf._src.transitions`): the RLDS
    layout, with the termination moved to the step whose action caused it:
    `EpisodeStep` t holds o_t, a_t, r_t, `terminated[t]` and `truncated[t]`
    as Minari's (so a step may say both, as gymnasium may), and step T holds
    o2 with `last` True (the buffer reads episode ends from that leaf, its
    own record of the end); its action, reward and flags are zeros.
  jaxbuf's items (item replay): `Transition` t = (o_t, a_t, r_t, o_{t+1},
    terminated[t], truncated[t]); T items per episode, the final
    observation held as the last item's `next_obs`.

So `from_minari` and `from_rlds_steps` read episodes into one form (Minari's)
and add them to any buffer: the layout, items or streams, is read from the
buffer's kind (`buffer.kind.state_type`, a subclass of `ReplayState` or of
`SequenceReplayState`), never from a list of kind names, so a kind built on
either (episode and hindsight replay on the streams) loads through the same
path. Its state's storage must be a `Transition` or an `EpisodeStep`, made
from `offline_example(...)` or from the user's own example of that form.
A stream kind is called as `buffer.add(state, steps [N, K, ...], mask [N])`,
the sequence replay signature (episode ends from the steps' `last` leaf),
and written back from its state's `episode_ends`, `write_heads`,
`steps_held` and `step_counts`;
a goal-conditioned dataset (a Dict observation space with "observation",
"achieved_goal" and "desired_goal", gymnasium-robotics' layout) gives the
`EpisodeStep.obs` that hindsight replay reads.

Dtypes. The buffer's example decides each leaf's dtype. The dataset's spaces
must give the same structure and shapes, and dtypes equal to the example's
or made equal by JAX (int64 -> int32 and float64 -> float32 with 64-bit mode
off); anything else is a `TypeError` naming the field. Every value is then
converted only if the conversion is exact (a reward of 0.1 in float64 is not
a float32; NaN is no integer): a value that is not kept exactly is a
`ValueError` naming the field, the episode and the step. `round_floats=True`
lets float values round (float64 MuJoCo data into a float32 buffer); the
other checks stay.

Larger than the buffer. The newest episodes are kept whole: episodes are
taken from the last one backwards while they fit (item replay: C
transitions; streams: each episode goes to the env with the most room left,
T + 1 steps, while it fits into R), so a loaded buffer never holds part of an
episode. A newest episode longer than the buffer is a `ValueError`.

Memory. Episodes are read one at a time (Minari's file reopened every 16
episodes, so that h5py's caches stay small) and added in chunks of
`chunk_size` items (`chunk_size // N` steps per env) through `buffer.add`,
which donates the state: the storage is updated in place, so the peak is
the buffer, one chunk and one episode. The state passed in is
consumed, as by `buffer.add`. On bad input the error is raised before the
first add where the metadata already shows it (spaces, lengths, episode
structure), else at the chunk that holds it, and then the half-filled state
is deleted: no partly loaded state is ever returned.

Writing back (`held_episodes`, `to_minari`, `to_rlds_steps`). Streams hold
episodes in order: each env's held steps are cut at its episode ends. The
first run of an env is written only if none of its steps was overwritten
(else its start is lost), and the run after the last end (a running
episode) is not written. With one env the episodes come out in the order
they were added; with N envs, env by env. Item replay holds transitions in
the order they were added; it writes back only when consecutive items chain
(each `next_obs` is the next item's `obs`, bit for bit, until a termination
or truncation), as after `from_minari` or collection from one env: the runs
ending in a termination or truncation become episodes, the first run only
if the ring never wrapped. Items added from several envs at once interleave
and are refused with a `ValueError` naming the slot. Infos, seeds and
episode metadata are not kept.
"""

import itertools
import os
import shutil
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import numpy as np

from jaxbuf._src.base import Buffer, PyTree
from jaxbuf._src.ring import ReplayState
from jaxbuf._src.sequence import SequenceReplayState

DEFAULT_CHUNK_SIZE = 1 << 12
_CHECK_BLOCK = 1 << 16
# Minari's HDF5 file is reopened after this many episodes: h5py's caches of
# an open file grow with every episode read (32 MiB over 1000 episodes read
# through one open file, 4.5 MiB in runs of 16; benchmarks/RESULTS.md).
_EPISODES_PER_OPEN = 16
_EPISODE_FIELDS = ("actions", "rewards", "terminations", "truncations")


class Transition(NamedTuple):
  """An item of item replay loaded from a dataset (unbatched leaves)."""
  obs: PyTree            # the observation space's structure
  action: PyTree         # the action space's structure
  reward: Any            # shape=(), the dataset's reward dtype
  next_obs: PyTree       # like obs: the observation after the action
  terminated: Any        # shape=(), bool: the action ended the episode
  truncated: Any         # shape=(), bool: the episode was cut after it


class EpisodeStep(NamedTuple):
  """A step of a sequence replay stream (the stream convention)."""
  obs: PyTree            # the observation space's structure
  action: PyTree         # zeros on a `last` step
  reward: Any            # shape=(); 0 on a `last` step
  terminated: Any        # shape=(), bool: this step's action ended it
  truncated: Any         # shape=(), bool: cut after this step's action
  last: Any              # shape=(), bool: holds an episode's final obs


class Episode(NamedTuple):
  """One episode in Minari's layout, NumPy leaves."""
  observations: PyTree   # leaves [T + 1, ...]
  actions: PyTree        # leaves [T, ...]
  rewards: np.ndarray    # [T]
  terminations: np.ndarray  # bool [T]
  truncations: np.ndarray   # bool [T]


# --- Reading the buffer's layout from its kind ----------------------------


_FORMS = {"items": Transition, "streams": EpisodeStep}


def _layout_of_kind(buffer: Buffer, *, what: str) -> str:
  """"items" or "streams", from the kind's state type: kinds built on item
  or sequence replay load with no change here."""
  kind = getattr(buffer, "kind", None)
  if kind is None:
    raise TypeError(f"{what}: the buffer has no kind (buffer.kind is None); "
                    "pass a buffer made by a jaxbuf factory.")
  if issubclass(kind.state_type, SequenceReplayState):
    return "streams"
  if issubclass(kind.state_type, ReplayState):
    return "items"
  raise TypeError(
      f"{what}: a {kind.name} buffer (state {kind.state_type.__name__}) "
      "holds neither items (ReplayState) nor per-env streams "
      "(SequenceReplayState); offline datasets load into those.")


def _layout(buffer: Buffer, state: Any, *, what: str) -> str:
  """`_layout_of_kind`, with `state` checked: the kind's, holding the form
  of that layout."""
  layout = _layout_of_kind(buffer, what=what)
  kind = buffer.kind
  if not isinstance(state, kind.state_type):
    raise TypeError(f"{what}: expected a {kind.state_type.__name__} of this "
                    f"{kind.name} buffer, given {type(state).__name__}.")
  form = _FORMS[layout]
  if not isinstance(state.storage, form):
    raise TypeError(
        f"{what}: a {kind.name} state for offline data holds "
        f"jaxbuf.{form.__name__} {'items' if layout == 'items' else 'steps'}"
        f" (given {type(state.storage).__name__}); make it with "
        f"buffer.init(jaxbuf.offline_example(dataset, buffer)).")
  return layout


def _storage_spec(state: Any, layout: str) -> Any:
  """The unbatched shapes and dtypes of one item or step."""
  skip = 1 if layout == "items" else 2
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[skip:], x.dtype),
                      state.storage)


# --- Spaces, dtypes and exact conversion ----------------------------------


def _space_spec(space: Any, name: str) -> PyTree:
  """A gymnasium space as a pytree of `ShapeDtypeStruct` (numpy dtypes)."""
  import gymnasium  # pylint: disable=import-outside-toplevel
  if isinstance(space, gymnasium.spaces.Dict):
    return {key: _space_spec(sub, f"{name}[{key!r}]")
            for key, sub in space.spaces.items()}
  if isinstance(space, gymnasium.spaces.Tuple):
    return tuple(_space_spec(sub, f"{name}[{i}]")
                 for i, sub in enumerate(space.spaces))
  if space.dtype is None or space.shape is None:
    raise TypeError(f"{name}: the space {space} has no fixed shape and dtype; "
                    "only Box, Discrete, MultiDiscrete, MultiBinary and Dict "
                    "or Tuple of them load into a buffer.")
  return jax.ShapeDtypeStruct(tuple(space.shape), np.dtype(space.dtype))


def _held_dtype(dtype: Any) -> np.dtype:
  """The dtype JAX holds data of `dtype` in (int64 -> int32 without x64)."""
  return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def _check_spec(name: str, given: PyTree, expected: PyTree, *,
                dtypes: bool = True) -> None:
  """Structure, shapes and dtypes of `given` (a dataset's) against the
  buffer's `expected`; raises naming the field."""
  given_paths = jax.tree_util.tree_flatten_with_path(given)
  expected_paths = jax.tree_util.tree_flatten_with_path(expected)
  if given_paths[1] != expected_paths[1]:
    raise ValueError(
        f"{name}: the dataset's structure {given_paths[1]} does not match the "
        f"buffer's example {expected_paths[1]}.")
  for (path, leaf), (_, want) in zip(given_paths[0], expected_paths[0]):
    field = name + jax.tree_util.keystr(path)
    if tuple(leaf.shape) != tuple(want.shape):
      raise ValueError(f"{field}: the dataset's shape {tuple(leaf.shape)} does "
                       f"not match the buffer's {tuple(want.shape)}.")
    if dtypes and np.dtype(want.dtype) not in (np.dtype(leaf.dtype),
                                               _held_dtype(leaf.dtype)):
      raise TypeError(
          f"{field}: the dataset's dtype {np.dtype(leaf.dtype)} is not the "
          f"buffer's {np.dtype(want.dtype)} (nor what JAX holds it as, "
          f"{_held_dtype(leaf.dtype)}); make the buffer's example with "
          "jaxbuf.offline_example.")


def _exact(field: str, values: Any, dtype: np.dtype, where: str, *,
           round_floats: bool = False) -> np.ndarray:
  """`values` as `dtype`, or `ValueError` naming the first value not kept.

  With `round_floats`, float values may be rounded to a float `dtype`.
  """
  values = np.asarray(values)
  if values.dtype == dtype:
    return values
  if values.dtype.kind not in "biuf":
    raise TypeError(f"{field}: {where} holds {values.dtype} data, the buffer "
                    f"{dtype}.")
  if round_floats and values.dtype.kind == "f" and dtype.kind == "f":
    return values.astype(dtype)
  with np.errstate(all="ignore"):
    converted = values.astype(dtype)
    back = converted.astype(values.dtype)
  same = back == values
  if values.dtype.kind == "f" and dtype.kind == "f":
    same |= np.isnan(values) & np.isnan(back)
  if not same.all():
    step = int(np.argwhere(~same)[0][0])
    bad = np.asarray(values[step])[~np.asarray(same[step])].flat[0].item()
    if values.dtype.kind == "f" and dtype.kind in "biu" and not np.isfinite(bad):
      raise ValueError(f"{field}: {bad} at step {step} of {where}, where the "
                       f"dtype is {dtype}.")
    hint = (" (round_floats=True rounds floats)"
            if values.dtype.kind == dtype.kind == "f" else "")
    raise ValueError(f"{field}: {bad} at step {step} of {where} is not kept "
                     f"exactly as {dtype}{hint}.")
  return converted


def _length(field: str, tree: PyTree, where: str) -> int:
  """The common leading length of `tree`'s leaves, or `ValueError`."""
  lengths = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(f"{field}{jax.tree_util.keystr(path)}: {where} holds a "
                       "scalar, expected one value per step.")
    lengths[field + jax.tree_util.keystr(path)] = shape[0]
  if len(set(lengths.values())) > 1:
    raise ValueError(f"{where}: inconsistent lengths {lengths}.")
  return next(iter(lengths.values()))


def checked_episode(episode: Episode, spec: Any, where: str, *,
                    round_floats: bool = False) -> Episode:
  """`episode` checked (lengths, flags) and converted exactly to `spec`'s
  dtypes (a `Transition` or `EpisodeStep` of `ShapeDtypeStruct`s)."""
  num_observations = _length("observations", episode.observations, where)
  lengths = {"observations": num_observations}
  for field in _EPISODE_FIELDS:
    lengths[field] = _length(field, getattr(episode, field), where)
  num_steps = lengths["actions"]
  if num_steps < 1 or any(
      lengths[field] != num_steps for field in _EPISODE_FIELDS) or (
          num_observations != num_steps + 1):
    raise ValueError(
        f"{where}: inconsistent lengths {lengths}; an episode of T >= 1 "
        "steps has T + 1 observations and T actions, rewards, terminations "
        "and truncations.")

  def converted(field, tree, want):
    # Dtypes are not compared here: each value is converted exactly below.
    _check_spec(field, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], np.asarray(x).dtype),
        tree), want, dtypes=False)
    return jax.tree_util.tree_map_with_path(
        lambda path, x, w: _exact(field + jax.tree_util.keystr(path), x,
                                  np.dtype(w.dtype), where,
                                  round_floats=round_floats), tree, want)

  terminations = _exact("terminations", episode.terminations, np.dtype(bool),
                        where)
  truncations = _exact("truncations", episode.truncations, np.dtype(bool),
                       where)
  ends = terminations | truncations
  if ends[:-1].any():
    step = int(np.argwhere(ends[:-1])[0][0])
    raise ValueError(f"terminations/truncations: {where} ends at step {step} "
                     f"of {num_steps}; only its last step may end it.")
  if not ends[-1]:
    raise ValueError(
        f"terminations/truncations: {where} ends with neither a termination "
        "nor a truncation on its last step; mark an episode cut short as "
        "truncated.")
  return Episode(
      observations=converted("observations", episode.observations, spec.obs),
      actions=converted("actions", episode.actions, spec.action),
      rewards=_exact("rewards", episode.rewards, np.dtype(spec.reward.dtype),
                     where, round_floats=round_floats),
      terminations=terminations, truncations=truncations)


# --- The rows of an episode, and chunks of rows ----------------------------


def _rows(episode: Episode, layout: str) -> PyTree:
  """An episode as `Transition` items `[T, ...]` or `EpisodeStep`s
  `[T + 1, ...]` (views where possible)."""
  if layout == "items":
    return Transition(
        obs=jax.tree.map(lambda x: x[:-1], episode.observations),
        action=episode.actions, reward=episode.rewards,
        next_obs=jax.tree.map(lambda x: x[1:], episode.observations),
        terminated=episode.terminations, truncated=episode.truncations)
  num_steps = episode.rewards.shape[0]

  def padded(x):
    return np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])

  return EpisodeStep(
      obs=episode.observations,
      action=jax.tree.map(padded, episode.actions),
      reward=padded(episode.rewards),
      terminated=padded(episode.terminations),
      truncated=padded(episode.truncations),
      last=np.arange(num_steps + 1) == num_steps)


class _RowReader:
  """Rows of a sequence of episodes, read one episode at a time."""

  def __init__(self, episodes: Iterator[Episode], layout: str):
    self._episodes = episodes
    self._layout = layout
    self._rows = None
    self._offset = 0

  def take(self, out: list[np.ndarray]) -> None:
    """Fills `out` (arrays `[count, ...]`, one per leaf) with the next rows."""
    count = out[0].shape[0]
    filled = 0
    while filled < count:
      if self._rows is None or self._offset == len(self._rows[0]):
        self._rows = jax.tree.leaves(_rows(next(self._episodes), self._layout))
        self._offset = 0
      moved = min(count - filled, len(self._rows[0]) - self._offset)
      for leaf, rows in zip(out, self._rows):
        leaf[filled:filled + moved] = rows[self._offset:self._offset + moved]
      filled += moved
      self._offset += moved


def _parts(count: int, largest: int) -> list[int]:
  """`count` as full chunks of `largest` and the remainder: the adds compile
  for two shapes per load."""
  return [largest] * (count // largest) + [count % largest] * bool(
      count % largest)


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


def _newest_streams(lengths: Sequence[int], num_envs: int,
                    per_env: int) -> list[list[int]]:
  """For each env the episode indices it gets, oldest first: the newest
  episodes, each to the env with the most room, while one fits."""
  used = [0] * num_envs
  assigned = [[] for _ in range(num_envs)]
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
    raise ImportError("progress=True needs tqdm: pip install "
                      "'jaxbuf[offline]'") from error
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


def load_episodes(read: Callable[[list[int]], Iterator[Episode]],
                  lengths: Sequence[int], buffer: Buffer, state: Any, *,
                  names: Callable[[int], str], chunk_size: int,
                  progress: bool, round_floats: bool, what: str) -> Any:
  """Adds the newest episodes that fit to `state`, in chunks.

  Args:
    read: episode indices -> their `Episode`s, in that order.
    lengths: T of every episode, oldest first.
    buffer, state: the buffer and its state (consumed).
    names: episode index -> how errors name it.
    chunk_size, progress, round_floats: as for `from_minari`.
    what: the caller's name, for errors.
  """
  layout = _layout(buffer, state, what=what)
  spec = _storage_spec(state, layout)
  if not lengths:
    raise ValueError(f"{what}: the dataset holds no episodes.")
  if layout == "items":
    capacity = jax.tree.leaves(state.storage)[0].shape[0]
    kept = _newest_items(lengths, capacity)
    groups = [kept]
    room = f"capacity {capacity} transitions"
  else:
    num_envs, per_env = state.episode_ends.shape
    groups = _newest_streams(lengths, num_envs, per_env)
    kept = [index for group in groups for index in group]
    room = f"{per_env} steps per env ({num_envs} envs)"
  if not kept:
    raise ValueError(
        f"{what}: the newest episode ({names(len(lengths) - 1)}, "
        f"{lengths[-1]} transitions) does not fit the buffer ({room}); "
        "make the buffer larger.")

  def reader(indices):
    return _RowReader((checked_episode(episode, spec, names(index),
                                       round_floats=round_floats)
                       for index, episode in zip(indices, read(indices))),
                      layout)

  readers = [reader(group) for group in groups]
  total = sum(lengths[index] + (layout == "streams") for index in kept)
  bar = _progress_bar(total, progress, what)
  try:
    if layout == "items":
      # One chunk, refilled: each add has run before the next fill (`_added`).
      chunk = [np.empty((min(chunk_size, total), *leaf.shape), leaf.dtype)
               for leaf in jax.tree.leaves(spec)]
      for count in _parts(total, chunk_size):
        rows = [leaf[:count] for leaf in chunk]
        readers[0].take(rows)
        state = _added(buffer.add(state, jax.tree.unflatten(
            jax.tree.structure(spec), rows)))
        if bar is not None:
          bar.update(count)
    else:
      state = _add_streams(buffer, state, readers, groups, lengths, spec,
                           _chunk_size_per_env(chunk_size, len(groups)), bar)
  except BaseException:
    _deleted(state)
    raise
  finally:
    if bar is not None:
      bar.close()
  return state


def _add_streams(buffer: Buffer, state: Any, readers: list[_RowReader],
                 groups: list[list[int]], lengths: Sequence[int], spec: Any,
                 per_chunk: int, bar: Any) -> Any:
  """Each env's stream in chunks `[N, K, ...]`; an env with fewer steps left
  is masked out. Parts of each env go in the same order as its stream."""
  num_envs = len(groups)
  treedef = jax.tree.structure(spec)
  parts = [_parts(sum(lengths[i] + 1 for i in group), per_chunk)
           for group in groups]
  # One chunk, refilled (see load_episodes); rows of envs masked out are
  # never written to the buffer.
  chunk = [np.zeros((num_envs, per_chunk, *leaf.shape), leaf.dtype)
           for leaf in jax.tree.leaves(spec)]
  position = 0
  while any(position < len(env_parts) for env_parts in parts):
    # Envs whose part at this position has the same size add together.
    sizes = sorted({env_parts[position] for env_parts in parts
                    if position < len(env_parts)}, reverse=True)
    for size in sizes:
      envs = [n for n in range(num_envs)
              if position < len(parts[n]) and parts[n][position] == size]
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


# --- Minari ----------------------------------------------------------------


def _open_minari(dataset: Any, *, what: str) -> Any:
  """A `MinariDataset`, given one or its id."""
  try:
    import minari  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(f"{what} needs minari: pip install "
                      "'jaxbuf[offline]'") from error
  if isinstance(dataset, minari.MinariDataset):
    return dataset
  if not isinstance(dataset, (str, os.PathLike)):
    raise TypeError(f"{what}: expected a minari.MinariDataset or a dataset "
                    f"id, given {type(dataset).__name__}.")
  try:
    return minari.load_dataset(str(dataset))
  except FileNotFoundError as error:
    root = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
    raise FileNotFoundError(
        f"{what}: no Minari dataset {str(dataset)!r} under {root} "
        f"(MINARI_DATASETS_PATH): {error}") from None
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise ValueError(f"{what}: Minari could not open dataset "
                     f"{str(dataset)!r}: {error}") from error


def _minari_lengths(dataset: Any) -> list[int]:
  indices = [int(i) for i in dataset.episode_indices]
  return [int(metadata["total_steps"]) for metadata in
          dataset.storage.get_episode_metadata(indices)]


def _minari_reader(dataset: Any) -> Callable[[list[int]], Iterator[Episode]]:
  episode_ids = [int(i) for i in dataset.episode_indices]

  def read(indices):
    ids = [episode_ids[i] for i in indices]
    for data in itertools.chain.from_iterable(
        dataset.storage.get_episodes(ids[start:start + _EPISODES_PER_OPEN])
        for start in range(0, len(ids), _EPISODES_PER_OPEN)):
      yield Episode(
          observations=data["observations"], actions=data["actions"],
          rewards=data["rewards"], terminations=data["terminations"],
          truncations=data["truncations"])
  return read


def _example(observation_spec: PyTree, action_spec: PyTree,
             reward_dtype: Any, layout: str) -> Any:
  def zeros(spec):
    return jax.tree.map(
        lambda x: np.zeros(x.shape, _held_dtype(x.dtype)), spec)
  flag = np.zeros((), bool)
  reward = np.zeros((), _held_dtype(reward_dtype))
  if layout == "items":
    return Transition(obs=zeros(observation_spec), action=zeros(action_spec),
                      reward=reward, next_obs=zeros(observation_spec),
                      terminated=flag, truncated=flag)
  return EpisodeStep(obs=zeros(observation_spec), action=zeros(action_spec),
                     reward=reward, terminated=flag, truncated=flag, last=flag)


def offline_example(dataset: Any, buffer: Buffer) -> Any:
  """The example item or step for `buffer.init`, shaped by `dataset`.

  Args:
    dataset: a `minari.MinariDataset` or its id, or RLDS steps (a dict of
      NumPy arrays, see `from_rlds_steps`).
    buffer: an item replay buffer (gives a `Transition`) or a sequence
      replay buffer (gives an `EpisodeStep`).

  Returns:
    Zeros with the dataset's shapes and dtypes, as JAX holds them.

  >>> import numpy as np, jaxbuf
  >>> steps = {"observation": np.zeros((3, 2), np.float32),
  ...          "action": np.zeros(3, np.int32), "reward": np.zeros(3),
  ...          "is_first": np.array([1, 0, 0], bool),
  ...          "is_last": np.array([0, 0, 1], bool),
  ...          "is_terminal": np.array([0, 0, 1], bool)}
  >>> example = jaxbuf.offline_example(steps, jaxbuf.uniform_replay(8))
  >>> example.obs.shape, example.action.dtype, type(example).__name__
  ((2,), dtype('int32'), 'Transition')
  """
  what = "offline_example"
  layout = _layout_of_kind(buffer, what=what)
  if isinstance(dataset, dict):
    steps = _rlds_step_arrays(dataset, what=what)
    spec = _row_spec(steps)
    return _example(spec["observation"], spec["action"],
                    steps["reward"].dtype, layout)
  dataset = _open_minari(dataset, what=what)
  # No space gives the rewards' dtype (Minari keeps gymnasium's Python float
  # rewards as float64): the first episode's is taken.
  reward_dtype = np.float64
  if len(dataset.episode_indices):
    first = _minari_reader(dataset)([0])
    reward_dtype = np.asarray(next(first).rewards).dtype
    first.close()  # closes Minari's HDF5 file now
  return _example(_space_spec(dataset.observation_space, "observations"),
                  _space_spec(dataset.action_space, "actions"), reward_dtype,
                  layout)


def from_minari(dataset: Any, buffer: Buffer, state: Any, *,
                chunk_size: int = DEFAULT_CHUNK_SIZE,
                progress: bool = False, round_floats: bool = False) -> Any:
  """Adds a Minari dataset's newest episodes that fit to `state`.

  See the module docstring (`help(jaxbuf.offline)`) for the
  mapping of Minari's episodes onto items and streams, dtypes and memory.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    dataset: a `minari.MinariDataset` (a filtered one too: its episodes, in
      its order) or a dataset id for `minari.load_dataset`.
    buffer: any item replay or sequence replay buffer.
    state: its state, from `buffer.init(jaxbuf.offline_example(dataset,
      buffer))`; consumed (donated), as by `buffer.add`.
    chunk_size: items added per call (over all envs for streams).
    progress: show a tqdm progress bar.
    round_floats: let float values be rounded to the buffer's float dtypes
      (float64 data into float32 with 64-bit mode off); by default a value
      not kept exactly is an error. Integers, flags and NaN where an integer
      is due are always checked.

  Returns:
    The state holding the episodes, oldest first.

  Raises:
    FileNotFoundError: no dataset with that id.
    TypeError / ValueError: the dataset does not match the buffer's example
      (naming the field), or an episode is malformed (naming the field and
      the episode). No partly loaded state is returned.
  """
  what = "from_minari"
  dataset = _open_minari(dataset, what=what)
  layout = _layout(buffer, state, what=what)
  spec = _storage_spec(state, layout)
  _check_spec("observations", _space_spec(dataset.observation_space,
                                          "observations"), spec.obs)
  _check_spec("actions", _space_spec(dataset.action_space, "actions"),
              spec.action)
  episode_ids = [int(i) for i in dataset.episode_indices]
  return load_episodes(
      _minari_reader(dataset), _minari_lengths(dataset), buffer, state,
      names=lambda index: f"episode {episode_ids[index]} of {dataset.id}",
      chunk_size=chunk_size, progress=progress, round_floats=round_floats,
      what=what)


# --- RLDS ------------------------------------------------------------------

_RLDS_FLAGS = ("is_first", "is_last", "is_terminal")


def _rlds_step_arrays(steps: Any, *, what: str) -> dict[str, Any]:
  if not isinstance(steps, dict):
    raise TypeError(f"{what}: expected RLDS steps as a dict of NumPy arrays "
                    f"(observation, action, reward, is_first, is_last, "
                    f"is_terminal), given {type(steps).__name__}.")
  missing = [field for field in ("observation", "action", "reward",
                                 *_RLDS_FLAGS) if field not in steps]
  if missing:
    raise ValueError(f"{what}: RLDS steps lack {missing}.")
  steps = dict(steps)
  for field in ("reward", *_RLDS_FLAGS):
    steps[field] = np.asarray(steps[field])
  num_steps = _length("steps", {field: steps[field] for field in
                                ("observation", "action", "reward",
                                 *_RLDS_FLAGS)}, "the RLDS steps")
  del num_steps
  for field in _RLDS_FLAGS:
    steps[field] = _exact(field, steps[field], np.dtype(bool), "the RLDS steps")
  return steps


def _row_spec(steps: dict[str, Any]) -> dict[str, Any]:
  return {field: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], np.asarray(x).dtype),
      steps[field]) for field in ("observation", "action")}


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
    raise ValueError(f"{what}: is_last: the last step ({is_last.size - 1}) "
                     "does not end an episode (an unfinished episode).")
  if firsts.size != lasts.size or np.any(firsts[1:] != lasts[:-1] + 1):
    raise ValueError(f"{what}: is_first/is_last: episodes must alternate, "
                     f"one is_last before each is_first; is_first at "
                     f"{firsts[:8].tolist()}, is_last at {lasts[:8].tolist()}.")
  terminal = np.flatnonzero(steps["is_terminal"] & ~is_last)
  if terminal.size:
    raise ValueError(f"{what}: is_terminal: step {terminal[0]} is terminal "
                     "but not is_last.")
  return list(zip(firsts.tolist(), lasts.tolist()))


def _rlds_reader(steps: dict[str, Any], bounds: list[tuple[int, int]]
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
          observations=jax.tree.map(lambda x: x[first:last + 1],
                                    steps["observation"]),
          actions=jax.tree.map(lambda x: x[first:last], steps["action"]),
          rewards=steps["reward"][first:last],
          terminations=terminations, truncations=truncations)
  return read


def from_rlds_steps(steps: dict[str, Any], buffer: Buffer, state: Any, *,
                    chunk_size: int = DEFAULT_CHUNK_SIZE,
                    progress: bool = False,
                    round_floats: bool = False) -> Any:
  """Adds RLDS-layout steps (NumPy, no TensorFlow) to `state`.

  Args:
    steps: a dict of arrays over the steps of consecutive episodes, leading
      axis the step: "observation" and "action" (any pytree of arrays),
      "reward", and bool "is_first", "is_last", "is_terminal" (see the
      module docstring); other keys ("discount", ...) are ignored.
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
  steps = _rlds_step_arrays(steps, what=what)
  layout = _layout(buffer, state, what=what)
  spec = _storage_spec(state, layout)
  given = _row_spec(steps)
  _check_spec("observation", given["observation"], spec.obs)
  _check_spec("action", given["action"], spec.action)
  bounds = _rlds_bounds(steps, what=what)
  return load_episodes(
      _rlds_reader(steps, bounds), [last - first for first, last in bounds],
      buffer, state,
      names=lambda index: f"the RLDS episode at steps {bounds[index][0]}.."
      f"{bounds[index][1]}", chunk_size=chunk_size, progress=progress,
      round_floats=round_floats, what=what)


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
  order (see the module docstring)."""
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
    earlier = order[block:min(block + _CHECK_BLOCK, size - 1)]
    for next_obs, obs in zip(jax.tree.leaves(storage.next_obs),
                             jax.tree.leaves(storage.obs)):
      chained[block:block + earlier.size] &= _rows_equal(
          next_obs[earlier], obs[order[block + 1:block + 1 + earlier.size]])
  end_positions = np.flatnonzero(ends)
  first_kept = 1 if wrapped else 0
  if end_positions.size > first_kept:
    inside = np.arange(size - 1)
    span = ((inside >= (end_positions[first_kept - 1] + 1 if first_kept
                        else 0)) & (inside < end_positions[-1]))
    broken = np.flatnonzero(span & ~ends[:-1] & ~chained)
    if broken.size:
      earlier, later = order[broken[0]], order[broken[0] + 1]
      raise ValueError(
          f"held_episodes: next_obs of slot {earlier} is not obs of slot {later}, "
          "the next item added, though neither terminated nor truncated: "
          "the items are not in episode order (added from several envs at "
          "once?). Item replay writes back only items added one episode "
          "after another; use sequence replay for several envs.")
  return _item_runs(storage, order, end_positions, first_kept)


def _item_runs(storage: Transition, order: np.ndarray,
               end_positions: np.ndarray, first_kept: int
               ) -> Iterator[Episode]:
  run_start = 0
  for run_index, end in enumerate(end_positions.tolist()):
    rows = order[run_start:end + 1]
    run_start = end + 1
    if run_index < first_kept:
      continue
    items = _take(storage, rows)
    yield Episode(
        observations=jax.tree.map(
            lambda obs, final: np.concatenate([obs, final[-1:]]),
            items.obs, items.next_obs),
        actions=items.action, rewards=items.reward,
        terminations=items.terminated, truncations=items.truncated)


def _stream_episodes(state: Any) -> Iterator[Episode]:
  storage = _host(state.storage)
  episode_ends = np.asarray(state.episode_ends)
  num_envs, per_env = episode_ends.shape
  for env in range(num_envs):
    held = int(state.steps_held[env])
    start = (int(state.write_heads[env]) - held) % per_env
    order = (start + np.arange(held)) % per_env
    whole_start = int(state.step_counts[env]) == held
    ends = np.flatnonzero(episode_ends[env, order]).tolist()
    run_start = 0
    for run_index, end in enumerate(ends):
      rows = order[run_start:end + 1]
      run_start = end + 1
      if run_index == 0 and not whole_start:
        continue
      steps = jax.tree.map(lambda x, rows=rows: x[env, rows], storage)
      yield Episode(
          observations=steps.obs,
          actions=jax.tree.map(lambda x: x[:-1], steps.action),
          rewards=steps.reward[:-1], terminations=steps.terminated[:-1],
          truncations=steps.truncated[:-1])


def held_episodes(buffer: Buffer, state: Any) -> list[Episode]:
  """The whole episodes a state holds, in Minari's layout (NumPy).

  See "Writing back" in the module docstring for what is written.

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
  return list(_held_episodes(buffer, state, what="held_episodes"))


def _held_episodes(buffer: Buffer, state: Any, *, what: str
                   ) -> Iterator[Episode]:
  """`held_episodes`, one at a time (errors raised before the first)."""
  if _layout(buffer, state, what=what) == "items":
    return _item_episodes(state)
  return _stream_episodes(state)


def _as_space_dtypes(tree: PyTree, space_spec: PyTree, field: str,
                     where: str) -> PyTree:
  """`tree`'s leaves converted exactly to the space's dtypes."""
  _check_spec(field, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree), space_spec,
              dtypes=False)
  return jax.tree_util.tree_map_with_path(
      lambda path, x, spec: _exact(field + jax.tree_util.keystr(path), x,
                                   np.dtype(spec.dtype), where),
      tree, space_spec)


def to_minari(dataset_id: str, buffer: Buffer, state: Any, *,
              observation_space: Any, action_space: Any,
              reward_dtype: Any = np.float64, **minari_arguments: Any) -> Any:
  """Writes the whole episodes `state` holds as a new Minari dataset.

  Observations and actions are written in the spaces' dtypes (an int32
  action held with 64-bit mode off goes back to a Discrete space's int64),
  rewards in `reward_dtype` (float64, as Minari's `DataCollector` writes
  gymnasium's Python float rewards), images without JPEG encoding (lossless).
  See "Writing back" in the module docstring for which episodes are written.

  Args:
    dataset_id: the new dataset's id, e.g. "cartpole/jaxbuf-v0".
    buffer, state: an item replay or sequence replay buffer and its state.
    observation_space, action_space: the gymnasium spaces to record.
    reward_dtype: the dtype rewards are written in.
    **minari_arguments: passed to `minari.create_dataset_from_buffers`
      (env, algorithm_name, author, description, data_format, ...).

  Returns:
    The new `minari.MinariDataset`.

  Raises:
    FileExistsError: a dataset with that id exists (it is left as it is).
    ValueError: the state holds no whole episode, its items are not in
      episode order, or a value does not fit the spaces' dtypes exactly; no
      partly written dataset is left behind.
  """
  what = "to_minari"
  try:
    import minari  # pylint: disable=import-outside-toplevel
    from minari.data_collector import EpisodeBuffer  # pylint: disable=import-outside-toplevel
    from minari.storage import get_dataset_path  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(f"{what} needs minari: pip install "
                      "'jaxbuf[offline]'") from error
  observation_spec = _space_spec(observation_space, "observations")
  action_spec = _space_spec(action_space, "actions")
  held = _held_episodes(buffer, state, what=what)
  first = next(held, None)
  if first is None:
    raise ValueError(f"{what}: the state holds no whole episode to write.")

  def written():
    # One episode at a time: Minari writes each as it comes.
    for number, episode in enumerate(itertools.chain([first], held)):
      where = f"episode {number} of the state"
      yield EpisodeBuffer(
          observations=_as_space_dtypes(episode.observations,
                                        observation_spec, "observations",
                                        where),
          actions=_as_space_dtypes(episode.actions, action_spec, "actions",
                                   where),
          rewards=_exact("rewards", episode.rewards, np.dtype(reward_dtype),
                         where),
          terminations=episode.terminations,
          truncations=episode.truncations)

  path = get_dataset_path(dataset_id)
  if path.exists():
    raise FileExistsError(f"{what}: a Minari dataset {dataset_id!r} exists "
                          f"already, at {path}.")
  try:
    return minari.create_dataset_from_buffers(
        dataset_id, written(), observation_space=observation_space,
        action_space=action_space, jpeg_encoding=False, **minari_arguments)
  except BaseException:
    # No partly written dataset is left behind under the id.
    if path.exists():
      shutil.rmtree(path)
    raise


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
  held = held_episodes(buffer, state)
  if not held:
    raise ValueError("to_rlds_steps: the state holds no whole episode.")
  parts = [_rows(episode, "streams") for episode in held]
  steps = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
  return {"observation": steps.obs, "action": steps.action,
          "reward": steps.reward,
          "is_first": np.concatenate(
              [np.arange(len(part.last)) == 0 for part in parts]),
          "is_last": steps.last,
          "is_terminal": np.concatenate(
              [np.append(np.zeros(len(part.last) - 1, bool),
                         part.terminated[-2]) for part in parts])}
