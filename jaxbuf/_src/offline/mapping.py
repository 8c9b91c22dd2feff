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
  jaxbuf's stream (sequence replay; `jaxbuf._src.streams.transitions`): the RLDS
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
the sequence replay signature (episode ends from the steps' `last` leaf:
the load then checks that each env's steps hold one episode end per
episode added, so a kind whose add ignored `last` is refused rather than
left holding its episodes run together), and written back from its state's
`episode_ends`, `write_heads`, `steps_held` and `step_counts`;
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

Sharded buffers (`jaxbuf.sharded`). The sizes are the unsharded buffer's
(its state's `joined` shapes), and so is what is written back. Streams
split over envs, and each device adds its own envs' steps. Item replay's
D rings are lockstep (each add splits evenly over the devices), so its
chunks are multiples of D rows, ordered so that the unsharded view holds the
items in the order added (device d gets rows d, D + d, 2 D + d, ...); the
newest episodes that fit must then hold a multiple of D transitions, else
a `ValueError` says so before anything is added.

Larger than the buffer. The newest episodes are kept whole: episodes are
taken from the last one backwards while they fit (item replay: C
transitions; streams: each episode goes to the env with the most room left,
T + 1 steps, while it fits into R), so a loaded buffer never holds part of an
episode. A newest episode longer than the buffer is a `ValueError`.

Into a state that holds data. The episodes are added after what the state
holds, but never onto a running episode: a stream of the state whose newest
step is not an episode end (`last`), or item replay whose newest item
neither terminated nor truncated, is a `ValueError` before anything is
added (the dataset's first episode would seem to continue it). Add the
episode's final step first, or load into a fresh `buffer.init` state.

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
first run of an env is written only if its start is held: none of its
steps was overwritten, or (frame-stack, episode and hindsight replay,
which record where episodes start: `oldest_held_starts_an_episode`) the
ring wrapped
exactly at its first step. The run after the last end (a running episode)
is not written. With one env the episodes come out in the order
they were added; with N envs, env by env. Item replay holds transitions in
the order they were added; it writes back only when consecutive items chain
(each `next_obs` is the next item's `obs`, bit for bit, until a termination
or truncation), as after `from_minari` or collection from one env: the runs
ending in a termination or truncation become episodes, the first run only
if the ring never wrapped. Items added from several envs at once interleave
and are refused with a `ValueError` naming the slot. Infos, seeds and
episode metadata are not kept.

Where it lives. This module holds the episode form (`Transition` and
`EpisodeStep`, the item and stream forms, are the core's records,
`core/records.py`, imported here) and the checks and
conversions every reader shares; `loading.py` adds episodes to a
buffer in chunks (the one writer behind both readers), `held_episodes.py`
reads them back from a state, `minari_datasets.py` (`from_minari`,
`to_minari`, `offline_example`) and `rlds_steps.py` (`from_rlds_steps`,
`to_rlds_steps`) are the two formats.
"""

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxbuf._src.core.base import Buffer, PyTree
from jaxbuf._src.core.records import EpisodeStep, Transition
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.storage import placed
from jaxbuf._src.streams.sequence import SequenceReplayState

_EPISODE_FIELDS = ("actions", "rewards", "terminations", "truncations")


class Episode(NamedTuple):
  """One episode in Minari's layout, NumPy leaves."""

  observations: PyTree  # leaves [T + 1, ...]
  actions: PyTree  # leaves [T, ...]
  rewards: np.ndarray  # [T]
  terminations: np.ndarray  # bool [T]
  truncations: np.ndarray  # bool [T]


# --- Reading the buffer's layout from its kind ----------------------------


_FORMS = {"items": Transition, "streams": EpisodeStep}


def layout_of_kind(buffer: Buffer, *, what: str) -> str:
  """ "items" or "streams", from the kind's state type: kinds built on item
  or sequence replay load with no change here."""
  kind = getattr(buffer, "kind", None)
  if kind is None:
    raise TypeError(
      f"{what}: the buffer has no kind (buffer.kind is None); "
      "pass a buffer made by a jaxbuf factory."
    )
  if issubclass(kind.state_type, SequenceReplayState):
    return "streams"
  if issubclass(kind.state_type, ReplayState):
    return "items"
  raise TypeError(
    f"{what}: a {kind.name} buffer (state {kind.state_type.__name__}) "
    "holds neither items (ReplayState) nor per-env streams "
    "(SequenceReplayState); offline datasets load into those."
  )


def checked_layout(buffer: Buffer, state: Any, *, what: str) -> str:
  """`layout_of_kind`, with `state` checked: the kind's, holding the form
  of that layout."""
  layout = layout_of_kind(buffer, what=what)
  kind = buffer.kind
  assert kind is not None  # layout_of_kind refuses a buffer without one
  if not isinstance(state, kind.state_type):
    raise TypeError(
      f"{what}: expected a {kind.state_type.__name__} of this "
      f"{kind.name} buffer, given {type(state).__name__}."
    )
  form = _FORMS[layout]
  if not isinstance(state.storage, form):
    raise TypeError(
      f"{what}: a {kind.name} state for offline data holds "
      f"jaxbuf.{form.__name__} {'items' if layout == 'items' else 'steps'}"
      f" (given {type(state.storage).__name__}); make it with "
      f"buffer.init(jaxbuf.offline_example(dataset, buffer))."
    )
  return layout


def devices_of(buffer: Buffer) -> int | None:
  """D for a `jaxbuf.sharded` buffer (its kind records the devices), else
  None."""
  assert buffer.kind is not None  # layout_of_kind refuses a buffer without one
  return dict(buffer.kind.settings).get("devices")


def unsharded_shapes(buffer: Buffer, state: Any) -> Any:
  """The state's shapes and dtypes as one unsharded buffer's: a sharded
  state is the stack of its D devices' states, and `joined` (traced only,
  nothing copied) says how they make one buffer."""
  if devices_of(buffer) is None:
    return state
  # Shapes without their shardings: the regrouping is traced on one device.
  return jax.eval_shape(
    type(state).joined, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  )


def storage_spec(buffer: Buffer, state: Any, layout: str) -> Any:
  """The unbatched shapes and dtypes of one item or step (a tiered
  buffer's payload leaves as stored, not their row proxies)."""
  skip = 1 if layout == "items" else 2
  return placed.stored_spec(
    buffer,
    jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape[skip:], x.dtype),
      unsharded_shapes(buffer, state).storage,
    ),
  )


# --- Dtypes and exact conversion ------------------------------------------


def held_dtype(dtype: Any) -> np.dtype:
  """The dtype JAX holds data of `dtype` in (int64 -> int32 without x64)."""
  return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def check_spec(name: str, given: PyTree, expected: PyTree, *, dtypes: bool = True) -> None:
  """Structure, shapes and dtypes of `given` (a dataset's) against the
  buffer's `expected`; raises naming the field."""
  given_paths: Any = jax.tree_util.tree_flatten_with_path(given)
  expected_paths = jax.tree_util.tree_flatten_with_path(expected)
  if given_paths[1] != expected_paths[1]:
    raise ValueError(
      f"{name}: the dataset's structure {given_paths[1]} does not match the "
      f"buffer's example {expected_paths[1]}."
    )
  for (path, leaf), (_, want) in zip(given_paths[0], expected_paths[0]):
    field = name + jax.tree_util.keystr(path)
    if tuple(leaf.shape) != tuple(want.shape):
      raise ValueError(
        f"{field}: the dataset's shape {tuple(leaf.shape)} does "
        f"not match the buffer's {tuple(want.shape)}."
      )
    if dtypes and np.dtype(want.dtype) not in (np.dtype(leaf.dtype), held_dtype(leaf.dtype)):
      raise TypeError(
        f"{field}: the dataset's dtype {np.dtype(leaf.dtype)} is not the "
        f"buffer's {np.dtype(want.dtype)} (nor what JAX holds it as, "
        f"{held_dtype(leaf.dtype)}); make the buffer's example with "
        "jaxbuf.offline_example."
      )


def exact(
  field: str, values: Any, dtype: np.dtype, where: str, *, round_floats: bool = False
) -> np.ndarray:
  """`values` as `dtype`, or `ValueError` naming the first value not kept.

  With `round_floats`, float values may be rounded to a float `dtype`.
  """
  values = np.asarray(values)
  if values.dtype == dtype:
    return values
  if values.dtype.kind not in "biuf":
    raise TypeError(f"{field}: {where} holds {values.dtype} data, the buffer {dtype}.")
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
      raise ValueError(f"{field}: {bad} at step {step} of {where}, where the dtype is {dtype}.")
    hint = " (round_floats=True rounds floats)" if values.dtype.kind == dtype.kind == "f" else ""
    raise ValueError(
      f"{field}: {bad} at step {step} of {where} is not kept exactly as {dtype}{hint}."
    )
  return converted


def common_length(field: str, tree: PyTree, where: str) -> int:
  """The common leading length of `tree`'s leaves, or `ValueError`."""
  lengths = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
        f"{field}{jax.tree_util.keystr(path)}: {where} holds a scalar, expected one value per step."
      )
    lengths[field + jax.tree_util.keystr(path)] = shape[0]
  if len(set(lengths.values())) > 1:
    raise ValueError(f"{where}: inconsistent lengths {lengths}.")
  return next(iter(lengths.values()))


def checked_episode(
  episode: Episode, spec: Any, where: str, *, round_floats: bool = False
) -> Episode:
  """`episode` checked (lengths, flags) and converted exactly to `spec`'s
  dtypes (a `Transition` or `EpisodeStep` of `ShapeDtypeStruct`s)."""
  num_observations = common_length("observations", episode.observations, where)
  lengths = {"observations": num_observations}
  for field in _EPISODE_FIELDS:
    lengths[field] = common_length(field, getattr(episode, field), where)
  num_steps = lengths["actions"]
  if (
    num_steps < 1
    or any(lengths[field] != num_steps for field in _EPISODE_FIELDS)
    or (num_observations != num_steps + 1)
  ):
    raise ValueError(
      f"{where}: inconsistent lengths {lengths}; an episode of T >= 1 "
      "steps has T + 1 observations and T actions, rewards, terminations "
      "and truncations."
    )

  def converted(field, tree, want):
    # Dtypes are not compared here: each value is converted exactly below.
    check_spec(
      field,
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], np.asarray(x).dtype), tree),
      want,
      dtypes=False,
    )
    return jax.tree_util.tree_map_with_path(
      lambda path, x, w: exact(
        field + jax.tree_util.keystr(path), x, np.dtype(w.dtype), where, round_floats=round_floats
      ),
      tree,
      want,
    )

  terminations = exact("terminations", episode.terminations, np.dtype(bool), where)
  truncations = exact("truncations", episode.truncations, np.dtype(bool), where)
  ends = terminations | truncations
  if ends[:-1].any():
    step = int(np.argwhere(ends[:-1])[0][0])
    raise ValueError(
      f"terminations/truncations: {where} ends at step {step} "
      f"of {num_steps}; only its last step may end it."
    )
  if not ends[-1]:
    raise ValueError(
      f"terminations/truncations: {where} ends with neither a termination "
      "nor a truncation on its last step; mark an episode cut short as "
      "truncated."
    )
  return Episode(
    observations=converted("observations", episode.observations, spec.obs),
    actions=converted("actions", episode.actions, spec.action),
    rewards=exact(
      "rewards", episode.rewards, np.dtype(spec.reward.dtype), where, round_floats=round_floats
    ),
    terminations=terminations,
    truncations=truncations,
  )


# --- The rows of an episode -----------------------------------------------


def episode_rows(episode: Episode, layout: str) -> PyTree:
  """An episode as `Transition` items `[T, ...]` or `EpisodeStep`s
  `[T + 1, ...]` (views where possible)."""
  if layout == "items":
    return Transition(
      obs=jax.tree.map(lambda x: x[:-1], episode.observations),
      action=episode.actions,
      reward=episode.rewards,
      next_obs=jax.tree.map(lambda x: x[1:], episode.observations),
      terminated=episode.terminations,
      truncated=episode.truncations,
    )
  num_steps = episode.rewards.shape[0]

  def padded(x):
    return np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])

  return EpisodeStep(
    obs=episode.observations,
    action=jax.tree.map(padded, episode.actions),
    reward=padded(episode.rewards),
    terminated=padded(episode.terminations),
    truncated=padded(episode.truncations),
    last=np.arange(num_steps + 1) == num_steps,
  )


def example_of(
  observation_spec: PyTree, action_spec: PyTree, reward_dtype: Any, layout: str
) -> Any:
  def zeros(spec):
    return jax.tree.map(lambda x: np.zeros(x.shape, held_dtype(x.dtype)), spec)

  flag = np.zeros((), bool)
  reward = np.zeros((), held_dtype(reward_dtype))
  if layout == "items":
    return Transition(
      obs=zeros(observation_spec),
      action=zeros(action_spec),
      reward=reward,
      next_obs=zeros(observation_spec),
      terminated=flag,
      truncated=flag,
    )
  return EpisodeStep(
    obs=zeros(observation_spec),
    action=zeros(action_spec),
    reward=reward,
    terminated=flag,
    truncated=flag,
    last=flag,
  )
