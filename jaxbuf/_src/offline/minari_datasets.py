"""Minari datasets in and out of jaxbuf buffers: `from_minari`,
`to_minari` and the example item or step for `buffer.init`,
`offline_example` (of RLDS steps too). The mapping of Minari's episodes onto
jaxbuf's items and streams is in `help(jaxbuf.offline)`."""

import itertools
import os
import shutil
from typing import Any, Callable, Generator

import jax
import numpy as np

from jaxbuf._src.core.base import Buffer, PyTree
from jaxbuf._src.offline.mapping import Episode, check_spec, checked_layout, exact
from jaxbuf._src.offline.mapping import example_of, layout_of_kind, storage_spec
from jaxbuf._src.offline.held_episodes import iterate_held_episodes
from jaxbuf._src.offline.loading import DEFAULT_CHUNK_SIZE, load_episodes
from jaxbuf._src.offline.rlds_steps import row_spec, step_arrays

# Minari's HDF5 file is reopened after this many episodes: h5py's caches of
# an open file grow with every episode read (32 MiB over 1000 episodes read
# through one open file, 4.5 MiB in runs of 16; benchmarks/RESULTS.md).
_EPISODES_PER_OPEN = 16


# --- Minari ----------------------------------------------------------------


def _open_minari(dataset: Any, *, what: str) -> Any:
  """A `MinariDataset`, given one or its id."""
  try:
    import minari  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(f"{what} needs minari: pip install 'jaxbuf[offline]'") from error
  if isinstance(dataset, minari.MinariDataset):
    return dataset
  if not isinstance(dataset, (str, os.PathLike)):
    raise TypeError(
      f"{what}: expected a minari.MinariDataset or a dataset id, given {type(dataset).__name__}."
    )
  try:
    return minari.load_dataset(str(dataset))
  except FileNotFoundError as error:
    root = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
    raise FileNotFoundError(
      f"{what}: no Minari dataset {str(dataset)!r} under {root} (MINARI_DATASETS_PATH): {error}"
    ) from None
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise ValueError(f"{what}: Minari could not open dataset {str(dataset)!r}: {error}") from error


def _minari_lengths(dataset: Any) -> list[int]:
  indices = [int(i) for i in dataset.episode_indices]
  return [
    int(metadata["total_steps"]) for metadata in dataset.storage.get_episode_metadata(indices)
  ]


def episode_reader(dataset: Any) -> Callable[[list[int]], Generator[Episode, None, None]]:
  episode_ids = [int(i) for i in dataset.episode_indices]

  def read(indices):
    ids = [episode_ids[i] for i in indices]
    for data in itertools.chain.from_iterable(
      dataset.storage.get_episodes(ids[start : start + _EPISODES_PER_OPEN])
      for start in range(0, len(ids), _EPISODES_PER_OPEN)
    ):
      yield Episode(
        observations=data["observations"],
        actions=data["actions"],
        rewards=data["rewards"],
        terminations=data["terminations"],
        truncations=data["truncations"],
      )

  return read


def _space_spec(space: Any, name: str) -> PyTree:
  """A gymnasium space as a pytree of `ShapeDtypeStruct` (numpy dtypes)."""
  import gymnasium  # pylint: disable=import-outside-toplevel

  if isinstance(space, gymnasium.spaces.Dict):
    return {key: _space_spec(sub, f"{name}[{key!r}]") for key, sub in space.spaces.items()}
  if isinstance(space, gymnasium.spaces.Tuple):
    return tuple(_space_spec(sub, f"{name}[{i}]") for i, sub in enumerate(space.spaces))
  if space.dtype is None or space.shape is None:
    raise TypeError(
      f"{name}: the space {space} has no fixed shape and dtype; "
      "only Box, Discrete, MultiDiscrete, MultiBinary and Dict "
      "or Tuple of them load into a buffer."
    )
  return jax.ShapeDtypeStruct(tuple(space.shape), np.dtype(space.dtype))


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
  layout = layout_of_kind(buffer, what=what)
  if isinstance(dataset, dict):
    steps = step_arrays(dataset, what=what)
    spec = row_spec(steps)
    return example_of(spec["observation"], spec["action"], steps["reward"].dtype, layout)
  dataset = _open_minari(dataset, what=what)
  # No space gives the rewards' dtype (Minari keeps gymnasium's Python float
  # rewards as float64): the first episode's is taken.
  reward_dtype: Any = np.float64
  if len(dataset.episode_indices):
    first = episode_reader(dataset)([0])
    reward_dtype = np.asarray(next(first).rewards).dtype
    first.close()  # closes Minari's HDF5 file now
  return example_of(
    _space_spec(dataset.observation_space, "observations"),
    _space_spec(dataset.action_space, "actions"),
    reward_dtype,
    layout,
  )


def from_minari(
  dataset: Any,
  buffer: Buffer,
  state: Any,
  *,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  progress: bool = False,
  round_floats: bool = False,
) -> Any:
  """Adds a Minari dataset's newest episodes that fit to `state`.

  See `help(jaxbuf.offline)` for the
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
    TypeError: the dataset does not match the buffer's example (naming the
      field); no partly loaded state is returned.
    ValueError: as for `TypeError`, or an episode is malformed (naming the
      field and the episode).

  A dataset of one episode (T = 3 actions, T + 1 observations), recorded
  here with Minari:

  >>> import gymnasium, minari, numpy as np, jaxbuf
  >>> from minari.data_collector import EpisodeBuffer
  >>> episode = EpisodeBuffer(
  ...     observations=np.arange(4, dtype=np.float32)[:, None],
  ...     actions=np.array([0, 1, 0]), rewards=np.array([1.0, 0.5, 2.0]),
  ...     terminations=np.array([False, False, True]),
  ...     truncations=np.zeros(3, bool))
  >>> dataset = minari.create_dataset_from_buffers(
  ...     "demo/line-v0", [episode],
  ...     observation_space=gymnasium.spaces.Box(0, 9, (1,), np.float32),
  ...     action_space=gymnasium.spaces.Discrete(2))
  >>> buffer = jaxbuf.uniform_replay(8)
  >>> state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  >>> state = jaxbuf.from_minari(dataset, buffer, state)
  >>> int(state.size), state.storage.next_obs[:3, 0].tolist()
  (3, [1.0, 2.0, 3.0])
  >>> state.storage.terminated[:3].tolist(), state.storage.reward[:3].tolist()
  ([False, False, True], [1.0, 0.5, 2.0])
  """
  what = "from_minari"
  dataset = _open_minari(dataset, what=what)
  layout = checked_layout(buffer, state, what=what)
  spec = storage_spec(buffer, state, layout)
  check_spec("observations", _space_spec(dataset.observation_space, "observations"), spec.obs)
  check_spec("actions", _space_spec(dataset.action_space, "actions"), spec.action)
  episode_ids = [int(i) for i in dataset.episode_indices]
  return load_episodes(
    episode_reader(dataset),
    _minari_lengths(dataset),
    buffer,
    state,
    names=lambda index: f"episode {episode_ids[index]} of {dataset.id}",
    chunk_size=chunk_size,
    progress=progress,
    round_floats=round_floats,
    what=what,
  )


def _check_in_space(values: PyTree, space: Any, field: str, where: str) -> None:
  """Raises `ValueError` naming the first step whose value `space` does not
  contain (a Minari dataset whose own `space.contains` fails for its data).

  Args:
    values: one episode's values, leaves `[T, ...]` in the space's dtypes,
      nested as the space (`_space_spec`).
  """
  import gymnasium  # pylint: disable=import-outside-toplevel

  spaces = gymnasium.spaces
  if isinstance(space, spaces.Dict):
    for key, subspace in space.spaces.items():
      _check_in_space(values[key], subspace, f"{field}[{key!r}]", where)
    return
  if isinstance(space, spaces.Tuple):
    for index, subspace in enumerate(space.spaces):
      _check_in_space(values[index], subspace, f"{field}[{index}]", where)
    return
  values = np.asarray(values)
  per_step = lambda inside: inside.reshape(len(values), -1).all(axis=1)
  if isinstance(space, spaces.Box):
    inside = per_step((values >= space.low) & (values <= space.high))
  elif isinstance(space, spaces.Discrete):
    start = int(space.start)
    inside = (values >= start) & (values < start + int(space.n))
  elif isinstance(space, spaces.MultiDiscrete):
    inside = per_step((values >= space.start) & (values < space.start + space.nvec))
  elif isinstance(space, spaces.MultiBinary):
    inside = per_step((values == 0) | (values == 1))
  else:
    inside = np.array([space.contains(value) for value in values], bool)
  if not inside.all():
    step = int(np.argmin(inside))
    raise ValueError(
      f"{field}: {values[step].tolist()!r} at step {step} of "
      f"{where} is not in the space {space}; Minari's "
      "`space.contains` would be False for it. Pass the spaces "
      "the data was collected in."
    )


def _as_space_dtypes(tree: PyTree, space_spec: PyTree, field: str, where: str) -> PyTree:
  """`tree`'s leaves converted exactly to the space's dtypes."""
  check_spec(
    field,
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree),
    space_spec,
    dtypes=False,
  )
  return jax.tree_util.tree_map_with_path(
    lambda path, x, spec: exact(field + jax.tree_util.keystr(path), x, np.dtype(spec.dtype), where),
    tree,
    space_spec,
  )


def to_minari(
  dataset_id: str,
  buffer: Buffer,
  state: Any,
  *,
  observation_space: Any,
  action_space: Any,
  reward_dtype: Any = np.float64,
  **minari_arguments: Any,
) -> Any:
  """Writes the whole episodes `state` holds as a new Minari dataset.

  Observations and actions are written in the spaces' dtypes (an int32
  action held with 64-bit mode off goes back to a Discrete space's int64),
  rewards in `reward_dtype` (float64, as Minari's `DataCollector` writes
  gymnasium's Python float rewards), images without JPEG encoding (lossless).
  See "Writing back" in `help(jaxbuf.offline)` for which episodes are written.

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
      episode order, or a value does not fit the spaces' dtypes exactly or
      lies outside the spaces (a Box's bounds, a Discrete's n: the first
      such step is named); no partly written dataset is left behind.

  A sequence replay buffer holding one episode (loaded here from RLDS
  steps) written out, and read back by Minari:

  >>> import gymnasium, minari, numpy as np, jaxbuf
  >>> steps = {"observation": np.arange(4, dtype=np.float32)[:, None],
  ...          "action": np.array([0, 1, 0, 0]),
  ...          "reward": np.array([1.0, 0.5, 2.0, 0.0]),
  ...          "is_first": np.array([1, 0, 0, 0], bool),
  ...          "is_last": np.array([0, 0, 0, 1], bool),
  ...          "is_terminal": np.array([0, 0, 0, 1], bool)}
  >>> buffer = jaxbuf.sequence_replay(num_envs=1, capacity=8, sequence_length=2)
  >>> state = jaxbuf.from_rlds_steps(
  ...     steps, buffer, buffer.init(jaxbuf.offline_example(steps, buffer)))
  >>> dataset = jaxbuf.to_minari(
  ...     "demo/line-v0", buffer, state,
  ...     observation_space=gymnasium.spaces.Box(0, 9, (1,), np.float32),
  ...     action_space=gymnasium.spaces.Discrete(2))
  >>> episode = next(minari.load_dataset("demo/line-v0").iterate_episodes())
  >>> episode.observations[:, 0].tolist(), episode.actions.tolist()
  ([0.0, 1.0, 2.0, 3.0], [0, 1, 0])
  >>> episode.terminations.tolist(), episode.truncations.tolist()
  ([False, False, True], [False, False, False])
  """
  what = "to_minari"
  try:
    import minari  # pylint: disable=import-outside-toplevel
    from minari.data_collector import EpisodeBuffer  # pylint: disable=import-outside-toplevel
    from minari.storage import get_dataset_path  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(f"{what} needs minari: pip install 'jaxbuf[offline]'") from error
  observation_spec = _space_spec(observation_space, "observations")
  action_spec = _space_spec(action_space, "actions")
  held = iterate_held_episodes(buffer, state, what=what)
  first = next(held, None)
  if first is None:
    raise ValueError(f"{what}: the state holds no whole episode to write.")

  def written():
    # One episode at a time: Minari writes each as it comes.
    for number, episode in enumerate(itertools.chain([first], held)):
      where = f"episode {number} of the state"
      observations = _as_space_dtypes(episode.observations, observation_spec, "observations", where)
      actions = _as_space_dtypes(episode.actions, action_spec, "actions", where)
      _check_in_space(observations, observation_space, "observations", where)
      _check_in_space(actions, action_space, "actions", where)
      yield EpisodeBuffer(
        observations=observations,
        actions=actions,
        rewards=exact("rewards", episode.rewards, np.dtype(reward_dtype), where),
        terminations=episode.terminations,
        truncations=episode.truncations,
      )

  path = get_dataset_path(dataset_id)
  if path.exists():
    raise FileExistsError(f"{what}: a Minari dataset {dataset_id!r} exists already, at {path}.")
  try:
    return minari.create_dataset_from_buffers(
      dataset_id,
      written(),
      observation_space=observation_space,
      action_space=action_space,
      jpeg_encoding=False,
      **minari_arguments,
    )
  except BaseException:
    # No partly written dataset is left behind under the id.
    if path.exists():
      shutil.rmtree(path)
    raise
