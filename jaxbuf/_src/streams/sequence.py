"""Sequence replay: per-env streams of steps, sampled as fixed-length windows.

Why one module of this size: the window bookkeeping (`window_counts`, the
windows each add starts, completes or breaks) is one invariant. `add` keeps
it and sampling reads it, both through the same window arithmetic
(`steps_ago`, `windows_valid`, `window_item_ids`), which the kinds built on
these streams (prioritized sequence, episode, frame-stack and hindsight
replay) call as `sequence.*` too. Cutting the add path from the reads would
put one invariant in two rooms, and the window arithmetic can leave neither:
it is defined on this module's state and both halves call it. What only
uses the windows is elsewhere: the priority update rules every stream kind
shares (`window_priorities.py`; `valid_priority_updates` here applies them
to window ids), the split over devices (`device_split.py`) and the factory
(`factories.py`). The parts come in reading order: state, window
arithmetic, the add path, reads and sample, priority updates, then `add`,
`can_sample` and `clear`.

Shape key: N envs, R = C // N steps held per env, C capacity (steps over all
envs), T steps per env in one add, L sequence_length, S sample size.

Each env writes its own ring of R steps, so envs may step raggedly (`add`'s
`mask`). A window is L consecutive steps of one env, in add order, all
currently held: it never crosses the write head and never reads an unwritten
slot, also where it wraps the physical array. Window starts fall on absolute
step ids that are multiples of `period` (each env counts its own steps).

A window is named by the slot of its first step: window id `w = n * R + j`
for env n and slot j. `item_ids` are the absolute step id of the first step,
modulo 2**32, so a priority update for a window whose first step has since
been overwritten is recognised as stale.

Episodes. One flag marks the last step of an episode: the step's own bool
`last` leaf when the step has one (a dm_env-style stream, where it flags the
step holding the final observation; final observations are added with
`add(..., final_steps=...)`), else `add(..., episode_end=...)` (bool `[N]`
or `[N, T]`). With `episodes="cross"` (the default) windows may run across an
episode end, and `SequenceSample.mask` `[S, L]` marks the steps that belong to
the window's first episode. With `episodes="within"` a window with an episode
end before its last step is never sampled (probability 0, prioritized too):
an episode of exactly L steps gives one window, a shorter one none.

Counters never overflow: the write head is kept modulo R, the steps held
saturate at R, the phase of the step count is kept modulo `period`, and the
step counts that give `item_ids` are uint32 and wrap modulo 2**32 as item
replay's `add_count` does (an overwritten window passes for fresh only if a
multiple of 2**32 steps of its env were added between a sample and its
update).

Writes touch the N * min(T, R) rows written, plus the window bookkeeping of
at most N * min(2T, R) windows (those whose first or last step is written;
N * min(T + L - 1, R) when T >= L - 1), so under
`jax.jit(..., donate_argnums=0)` the storage is updated in place whatever the
capacity.

The module-level functions take every setting explicitly;
`sequence_replay` (`factories.py`) binds them into a `Buffer`.
"""

import functools
from typing import Any, Callable, NamedTuple, Self, TypeVar, cast

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.core import random
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.streams import window_priorities
from jaxbuf._src.core.base import BufferState, PyTree, ReplaySample

EPISODE_MODES = ("cross", "within")


@flax.struct.dataclass
class SequenceSample(ReplaySample):
  """A batch of windows: a `ReplaySample` with a mask of each first episode.

  A row is a window: `indices` its window id (`env * R + slot` of its first
  step), `item_ids` its first step's id. `mask` means what it means in
  `EpisodeSample`: True on the steps of the episode the row was drawn for,
  False on steps a per-step loss must not read.
  """

  mask: jax.Array  # bool [S, L]: True up to and including the first episode
  # end in the window (all True under episodes="within");
  # all False when no window was held (weight 0)


@flax.struct.dataclass
class SequenceReplayState(BufferState):
  """Per-env rings of steps. Every field is an array; nothing is static."""

  storage: PyTree  # each leaf [N, R, *step_shape], the step's dtype
  episode_ends: jax.Array  # bool [N, R]: the step ended an episode
  write_heads: jax.Array  # int32 [N]: the slot each env writes next, < R
  steps_held: jax.Array  # int32 [N]: steps held per env, at most R
  step_counts: jax.Array  # uint32 [N]: steps ever added per env, mod 2**32
  period_phases: jax.Array  # int32 [N]: steps ever added per env, mod period
  window_counts: jax.Array  # int32 [N]: windows that can be sampled per env
  window_tree: sum_tree.SumTree | None  # leaves [N * R]: mass per window id;
  # None for uniform cross-episode replay

  def buffer_dims(self) -> dict[str, Any]:
    # write_heads has the vmapped axes, then N.
    batch_shape = np.shape(self.write_heads)[:-1]
    num_envs = int(np.shape(self.write_heads)[-1])
    per_env = int(np.shape(self.episode_ends)[-1])
    return {
      "vmapped buffers": list(batch_shape),
      "num_envs": num_envs,
      "capacity": num_envs * per_env,
    }

  def per_env_fields(self) -> tuple[str, ...]:
    """The fields with one row per env, `[N, ...]`, besides the storage:
    `joined` and `divided` move them with their env. A kind whose state adds
    such fields extends this."""
    return _PER_ENV_FIELDS

  def oldest_held_starts_an_episode(self) -> jax.Array:
    """bool `[N]`: each env's oldest held step is the first of its episode,
    so the episode it starts is held whole (what `held_episodes` writes).

    Known here only while no step of the env was overwritten; a kind that
    records where episodes start extends this to a ring that wrapped
    exactly at an episode's start.
    """
    return self.step_counts == self.steps_held.astype(jnp.uint32)

  def oldest_held_slots(self) -> jax.Array:
    """int32 `[N]`: the slot of each env's oldest held step."""
    return (self.write_heads - self.steps_held) % self.episode_ends.shape[-1]

  def joined(self) -> Self:
    """D devices' blocks of N / D envs as one buffer of N envs: each env's
    ring, counters and window masses move whole, so window `g` of the
    result is window `g` of the sharded buffer's numbering."""
    merge = lambda leaf: leaf.reshape((-1,) + leaf.shape[2:])
    per_device = self.episode_ends.shape[1] * self.episode_ends.shape[2]
    return self.replace(
      **{name: merge(getattr(self, name)) for name in self.per_env_fields()},
      storage=jax.tree.map(merge, self.storage),
      window_tree=None
      if self.window_tree is None
      else sum_tree.from_leaves(sum_tree.leaves(self.window_tree)[:, :per_device].reshape(-1)),
    )

  def divided(self, num_devices: int) -> Self:
    """The inverse of `joined`: envs in blocks of N / D."""
    num_envs, per_env = self.episode_ends.shape
    if num_envs % num_devices:
      raise ValueError(
        f"load: the state's {num_envs} envs do not split over "
        f"{num_devices} devices (each device holds whole envs); load it "
        f"over a number of devices that divides {num_envs}."
      )
    split = lambda leaf: leaf.reshape((num_devices, num_envs // num_devices) + leaf.shape[1:])
    window_tree = None
    if self.window_tree is not None:
      leaves = sum_tree.leaves(self.window_tree)[: num_envs * per_env]
      window_tree = jax.vmap(sum_tree.from_leaves)(leaves.reshape(num_devices, -1))
    return self.replace(
      **{name: split(getattr(self, name)) for name in self.per_env_fields()},
      storage=jax.tree.map(split, self.storage),
      window_tree=window_tree,
    )


# A sequence state or a subclass: what the helpers every stream kind
# shares return.
SequenceStateT = TypeVar("SequenceStateT", bound=SequenceReplayState)

# The fields with one row per env, `[N, ...]`.
_PER_ENV_FIELDS = (
  "episode_ends",
  "write_heads",
  "steps_held",
  "step_counts",
  "period_phases",
  "window_counts",
)


def steps_per_env(state: SequenceReplayState) -> int:
  """R, read from the storage (a Python int, static under jit)."""
  return state.episode_ends.shape[1]


def num_envs_of(state: SequenceReplayState) -> int:
  return state.episode_ends.shape[0]


def step_spec(state: SequenceReplayState) -> PyTree:
  """The unbatched step shapes and dtypes, as `jax.ShapeDtypeStruct` values."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), state.storage)


def check_sizes(
  num_envs: Any, capacity: Any, sequence_length: Any, period: Any, episodes: Any = "cross"
) -> None:
  """Raises naming the setting; a capacity is never rounded silently."""
  validation.check_positive_int(num_envs, "num_envs")
  validation.check_capacity(capacity)
  validation.check_positive_int(sequence_length, "sequence_length")
  validation.check_positive_int(period, "period")
  if capacity % num_envs:
    below = capacity - capacity % num_envs
    above = below + num_envs
    nearest = f"{below} or {above}" if below else f"{above}"
    raise ValueError(
      f"capacity {capacity} is not a multiple of num_envs {num_envs}; each "
      f"env holds capacity // num_envs steps. Nearest valid capacities: "
      f"{nearest}."
    )
  per_env = capacity // num_envs
  if sequence_length > per_env:
    raise ValueError(
      f"sequence_length {sequence_length} exceeds the steps held per env, "
      f"capacity // num_envs = {per_env}; use capacity >= "
      f"{sequence_length * num_envs} or a shorter sequence."
    )
  if period >= 2**30:
    raise ValueError(f"period must be below 2**30, given {period}.")
  if episodes not in EPISODE_MODES:
    raise ValueError(f"episodes must be one of {EPISODE_MODES}, given {episodes!r}.")


def init(
  example_step: PyTree, *, num_envs: int, capacity: int, with_tree: bool
) -> SequenceReplayState:
  """An empty buffer for steps shaped like `example_step` (one env, unbatched).

  Args:
    example_step: any pytree of arrays (or `jax.ShapeDtypeStruct` values).
    num_envs: N.
    capacity: C, steps over all envs, a multiple of N.
    with_tree: keep a sum tree over window ids (prioritized replay, or
      uniform replay within episodes).
  """
  check_sizes(num_envs, capacity, 1, 1)
  per_env = capacity // num_envs
  # Separate arrays: a donated state must not hold one buffer twice.
  zeros = lambda: jnp.zeros((num_envs,), jnp.int32)
  return SequenceReplayState(
    storage=jax.tree.map(
      lambda leaf: jnp.zeros((num_envs, per_env, *jnp.shape(leaf)), jnp.result_type(leaf)),
      example_step,
    ),
    episode_ends=jnp.zeros((num_envs, per_env), bool),
    write_heads=zeros(),
    steps_held=zeros(),
    step_counts=jnp.zeros((num_envs,), jnp.uint32),
    period_phases=zeros(),
    window_counts=zeros(),
    window_tree=sum_tree.init(capacity) if with_tree else None,
  )


def steps_ago(state: SequenceReplayState, envs: jax.Array, slots: jax.Array) -> jax.Array:
  """How many steps before the newest of its env each slot's step was added."""
  per_env = steps_per_env(state)
  return (state.write_heads[envs] - 1 - slots) % per_env


def windows_valid(
  state: SequenceReplayState,
  envs: jax.Array,
  slots: jax.Array,
  *,
  sequence_length: int,
  period: int,
  within: bool,
) -> jax.Array:
  """Whether the window starting at each `(env, slot)` can be sampled: bool.

  All its L steps are held (the first at most `steps_held - 1` steps ago, the
  last at least 0), its first step's id is a multiple of `period`, and, with
  `within`, no episode ends before its last step.
  """
  ago = steps_ago(state, envs, slots)
  valid = (
    (ago >= sequence_length - 1)
    & (ago < state.steps_held[envs])
    & ((state.period_phases[envs] - 1 - ago) % period == 0)
  )
  if within and sequence_length > 1:
    offsets = jnp.arange(sequence_length - 1, dtype=jnp.int32).reshape((1,) * slots.ndim + (-1,))
    inner = (slots[..., None] + offsets) % steps_per_env(state)
    ends = state.episode_ends[envs[..., None], inner]
    valid &= ~jnp.any(ends, axis=-1)
  return valid


def window_ids_valid(
  state: SequenceReplayState,
  window_ids: jax.Array,
  *,
  sequence_length: int,
  period: int,
  within: bool,
) -> jax.Array:
  """`windows_valid` for window ids `[S]` (any ints; out of range is False)."""
  per_env = steps_per_env(state)
  window_ids = window_ids.astype(jnp.int32)
  in_range = (window_ids >= 0) & (window_ids < num_envs_of(state) * per_env)
  safe = jnp.where(in_range, window_ids, 0)
  return in_range & windows_valid(
    state,
    safe // per_env,
    safe % per_env,
    sequence_length=sequence_length,
    period=period,
    within=within,
  )


def window_item_ids(state: SequenceReplayState, window_ids: jax.Array) -> jax.Array:
  """The absolute step id of each window's first step, modulo 2**32: uint32."""
  per_env = steps_per_env(state)
  envs, slots = window_ids // per_env, window_ids % per_env
  ago = steps_ago(state, envs, slots)
  return state.step_counts[envs] - jnp.uint32(1) - ago.astype(jnp.uint32)


def _check_flags(name: str, value: Any, shape: tuple[int, ...]) -> None:
  if tuple(np.shape(value)) != shape:
    raise ValueError(
      f"add: {name} has shape {tuple(np.shape(value))}, "
      f"expected {shape}, one flag per env"
      f"{' and step' if len(shape) == 2 else ''}."
    )
  if validation.canonical_dtype(value) != jnp.bool_:
    raise TypeError(f"add: {name} must be bool, given dtype {validation.canonical_dtype(value)}.")


def _chunk_length(state: SequenceReplayState, steps: PyTree) -> int | None:
  """T for a chunk `[N, T, ...]`, None for one step `[N, ...]`; checks shapes."""
  spec = step_spec(state)
  num_envs = num_envs_of(state)
  validation.check_same_structure(spec, steps, what="add")
  ((path, first),) = jax.tree_util.tree_flatten_with_path(steps)[0][:1]
  step_rank = len(jax.tree_util.tree_leaves(spec)[0].shape)
  extra = np.ndim(first) - step_rank
  if extra not in (1, 2):
    raise ValueError(
      f"add: leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
      f"{np.shape(first)}; expected one step per env ({num_envs}, ...) or a "
      f"chunk ({num_envs}, T, ...) before the step shape "
      f"{jax.tree_util.tree_leaves(spec)[0].shape}."
    )
  batch_shape: tuple[int, ...] = (num_envs,) if extra == 1 else (num_envs, np.shape(first)[1])
  validation.check_batched_leaves(spec, steps, what="add", batch_shape=batch_shape)
  return None if extra == 1 else batch_shape[1]


def last_flags(steps: PyTree) -> Any:
  """The steps' own `last` leaf (a top-level field or key named `last`), or
  None when the step has none. Raises `TypeError` unless it is bool."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(steps)[0]:
    key = path[0] if len(path) == 1 else None
    if (isinstance(key, jax.tree_util.GetAttrKey) and key.name == "last") or (
      isinstance(key, jax.tree_util.DictKey) and key.key == "last"
    ):
      if validation.canonical_dtype(leaf) != jnp.bool_:
        raise TypeError(
          f"add: the step's `last` leaf marks episode ends and must be bool, "
          f"given dtype {validation.canonical_dtype(leaf)}."
        )
      return leaf
  return None


def episode_ends_of(steps: PyTree, episode_end: jax.Array | None) -> Any:
  """The one episode-end flag of an add: the steps' own `last` leaf when
  they carry one (the stream convention, `help(jaxbuf.streams)`), else
  `episode_end`. Both at once is a `TypeError`: two flags could disagree."""
  last = last_flags(steps)
  if last is None:
    return episode_end
  if episode_end is not None:
    raise TypeError(
      "add: the steps carry a `last` leaf, which marks episode ends; "
      "episode_end is read from it, so do not pass episode_end too."
    )
  return jnp.asarray(last)


def _write_unless_empty(
  write: Callable[..., SequenceStateT],
  state: SequenceStateT,
  steps: PyTree,
  mask: jax.Array | None,
  episode_end: jax.Array | None,
) -> SequenceStateT:
  """`write(state, steps, mask, episode_end)`, except for an empty chunk
  `[N, 0, ...]`: its arguments are checked as a write checks them, and
  `state` comes back as it was (no step written, no window changed)."""
  if _chunk_length(state, steps) == 0:
    chunked_add_args(state, steps, mask, episode_end)
    return state
  return write(state, steps, mask, episode_end)


def add_stream(
  state: SequenceStateT,
  steps: PyTree,
  mask: jax.Array | None,
  episode_end: jax.Array | None,
  final_steps: PyTree | None,
  *,
  write: Callable[..., SequenceStateT],
) -> SequenceStateT:
  """One add of a stream kind: the steps, then the final observations of
  the envs whose episode ended, `final_steps`, each kind writing with its
  own `write(state, steps, mask, episode_end)` (`add_steps` here; frame,
  hindsight and episode replay keep their bookkeeping in theirs). Every
  stream kind's `add` comes through here, so `final_steps` means the same
  in all of them.

  One flag says which envs write a final step. With a `last` leaf in the
  step it is the final step's own `last` (the stream convention); the
  steps' episode ends are read from theirs, and `episode_end` given as well
  is a `TypeError` (two flags could disagree). Without one, `episode_end`
  bool `[N]` names the envs whose episode ended after their last step in
  `steps`. Either way the result is, byte for byte, the two-add masked form

      state = add(state, steps, mask)   # ends inside them: their `last`
      state = add(state, final_steps, ended & mask)  # `last` says ended;
      # without one: add(state, final_steps, ended & mask, episode_end=ended)

  with `ended` that flag; only the second add can be forgotten or
  mis-masked, and here it cannot.

  An empty chunk of steps `[N, 0, ...]` writes nothing
  (`_write_unless_empty`), so no kind's `write` is given one.
  """
  write = functools.partial(_write_unless_empty, write)
  if final_steps is None:
    return write(state, steps, mask, episode_ends_of(steps, episode_end))
  num_envs = num_envs_of(state)
  if last_flags(steps) is None:
    if episode_end is None:
      raise TypeError(
        "add: final_steps need a flag saying which envs' episode ended, "
        "and only those write their final observation: a `last` leaf in "
        "the step (a bool field named `last`), or, for steps without "
        f"one, episode_end bool [{num_envs}]."
      )
    if np.ndim(episode_end) != 1:
      raise ValueError(
        f"add: with final_steps and steps without a `last` leaf, "
        f"episode_end is bool [{num_envs}], the envs whose episode ended "
        f"after their last step in `steps` (they write their final step, "
        f"flagged as the episode's end); given shape "
        f"{tuple(np.shape(episode_end))}. Episode ends inside a chunk need "
        f"a `last` leaf in the step."
      )
    _check_flags("episode_end", episode_end, (num_envs,))
    ended, steps_end = jnp.asarray(episode_end), None
  else:
    steps_end = episode_ends_of(steps, episode_end)
    ended = None
  try:
    final_chunk = _chunk_length(state, final_steps)
  except (TypeError, ValueError) as error:
    raise type(error)(f"{error} (in final_steps)") from None
  if final_chunk is not None:
    raise ValueError(
      f"add: final_steps hold one step per env, [{num_envs}, ...]: the "
      f"final observation of each env whose episode ended after its last "
      f"step in `steps`; given a chunk [{num_envs}, {final_chunk}, ...]."
    )
  if ended is None:
    ended = jnp.asarray(last_flags(final_steps))
  if mask is not None:
    _check_flags("mask", mask, (num_envs,))
    ended &= jnp.asarray(mask)
  check_one_final_step(steps, mask, None, final_steps)
  if steps_end is not None and np.shape(steps_end)[-1:] != (0,):
    # A final step after a step flagged `last` (a final step already) would
    # be a second final step in a row: not written. Concrete flags were
    # refused above; traced ones cannot be read while tracing.
    newest_end = steps_end if np.ndim(steps_end) == 1 else steps_end[:, -1]
    ended &= ~jnp.asarray(newest_end)
  state = write(state, steps, mask, steps_end)
  return write(state, final_steps, ended, ended)


def check_one_final_step(
  steps: PyTree,
  mask: Any = None,
  episode_end: Any = None,
  final_steps: PyTree | None = None,
  *_: Any,
) -> None:
  """Refuses, where the flags can be read (NumPy or concrete arrays, before
  a jit), a final step given for an env whose last step in `steps` is
  flagged `last` already: two final steps in a row. `add`'s arguments after
  the state, in order (a bound add calls it on the host)."""
  del episode_end  # steps with a `last` leaf take none
  if final_steps is None:
    return
  last, final_last = last_flags(steps), last_flags(final_steps)
  flags = [last, final_last] + ([] if mask is None else [mask])
  if last is None or final_last is None:
    return
  if any(isinstance(flag, jax.core.Tracer) for flag in flags):
    return
  last = np.asarray(last)
  if last.ndim == 2 and last.shape[1] == 0:
    return
  newest, final_last = (last if last.ndim == 1 else last[:, -1]), np.asarray(final_last)
  if newest.shape != final_last.shape or np.shape(mask) not in ((), newest.shape):
    return  # misshapen: the add's own checks name it
  both = newest & final_last
  if mask is not None:
    both &= np.asarray(mask)
  if both.any():
    env = int(np.flatnonzero(both)[0])
    raise ValueError(
      f"add: env {env}'s last step in `steps` is flagged `last` (it holds "
      "an episode's final observation already), and final_steps gives it "
      "another final step (`last` True there too): two final steps in a "
      "row. Flag each episode's end once: either the step holding the final "
      "observation in `steps`, or (the stream convention) that observation "
      "in final_steps, with `last` False in `steps`."
    )


def chunked_add_args(
  state: SequenceReplayState, steps: PyTree, mask: jax.Array | None, episode_end: jax.Array | None
) -> tuple[PyTree, jax.Array, jax.Array]:
  """`add`'s arguments as a chunk: `(steps [N, T, ...], mask [N],
  episode_end [N, T])`, T = 1 for one step per env; checks their shapes."""
  num_envs = num_envs_of(state)
  chunk = _chunk_length(state, steps)
  steps = jax.tree.map(jnp.asarray, steps)
  if chunk is None:
    steps = jax.tree.map(lambda x: x[:, None], steps)
  length = 1 if chunk is None else chunk
  if episode_end is None:
    episode_end = jnp.zeros((num_envs, length), bool)
  else:
    _check_flags("episode_end", episode_end, (num_envs,) if chunk is None else (num_envs, length))
    episode_end = jnp.asarray(episode_end).reshape(num_envs, length)
  if mask is None:
    mask = jnp.ones((num_envs,), bool)
  else:
    _check_flags("mask", mask, (num_envs,))
    mask = jnp.asarray(mask)
  return steps, mask, episode_end


class ChunkSlots(NamedTuple):
  """Where the steps of a chunk of T steps per env go in the ring.

  A chunk longer than R keeps its newest `kept` = min(T, R) steps; the older
  `dropped` ones are never written, so each written slot is written once
  (scatters with duplicate indices have no defined order).
  """

  kept: int
  dropped: int
  slots: jax.Array  # int32 [N, kept], the ring slots of the kept steps
  rows: jax.Array  # int32 [N, kept], the env, or N for an env masked out

  def write(self, column: jax.Array, chunk: jax.Array) -> jax.Array:
    """`column [N, R, ...]` with the kept steps of `chunk [N, T, ...]`
    written; envs masked out are dropped."""
    return column.at[self.rows, self.slots].set(
      chunk[:, self.dropped :], mode="drop", unique_indices=True
    )


def chunk_slots(state: SequenceReplayState, length: int, mask: jax.Array) -> ChunkSlots:
  """The slots and rows of a chunk of `length` steps per env, `mask [N]`
  the envs that stepped (`state.write_heads` as before the chunk)."""
  num_envs, per_env = num_envs_of(state), steps_per_env(state)
  kept = min(length, per_env)
  dropped = length - kept
  slots = (
    state.write_heads[:, None] + dropped % per_env + jnp.arange(kept, dtype=jnp.int32)[None, :]
  ) % per_env
  rows = jnp.broadcast_to(
    jnp.where(mask, jnp.arange(num_envs, dtype=jnp.int32), num_envs)[:, None], slots.shape
  )
  return ChunkSlots(kept=kept, dropped=dropped, slots=slots, rows=rows)


def write_chunk(
  state: SequenceStateT,
  steps: PyTree,
  mask: jax.Array,
  episode_end: jax.Array,
  **columns: jax.Array,
) -> tuple[SequenceStateT, ChunkSlots]:
  """Writes a chunk's steps, episode ends and per-step `columns` (fields of
  `state` shaped `[N, R]`, given `[N, T]`), and advances each env that
  stepped: write head, steps held, step count. Every kind built on the
  per-env rings writes its steps here.

  Args:
    state: the buffer.
    steps: leaves `[N, T, ...]`; mask: bool `[N]`; episode_end: bool
      `[N, T]` (`chunked_add_args`).
    **columns: more per-step fields to write, by name.

  Returns:
    The state written, and where the chunk went.
  """
  per_env = steps_per_env(state)
  length = episode_end.shape[1]
  chunk = chunk_slots(state, length, mask)
  return state.replace(
    storage=jax.tree.map(chunk.write, state.storage, steps),
    episode_ends=chunk.write(state.episode_ends, episode_end),
    **{name: chunk.write(getattr(state, name), value) for name, value in columns.items()},
    write_heads=jnp.where(
      mask, (state.write_heads + length % per_env) % per_env, state.write_heads
    ),
    steps_held=jnp.where(
      mask, jnp.minimum(state.steps_held + chunk.kept, per_env), state.steps_held
    ),
    step_counts=jnp.where(mask, state.step_counts + jnp.uint32(length % 2**32), state.step_counts),
  ), chunk


def add_steps(
  state: SequenceStateT,
  steps: PyTree,
  mask: jax.Array | None,
  episode_end: jax.Array | None,
  *,
  sequence_length: int,
  period: int,
  within: bool,
  new_leaf_value: jax.Array | None,
  **columns: jax.Array,
) -> SequenceStateT:
  """Writes steps and updates the windows they complete or break.

  Args:
    state: the buffer.
    steps: leaves `[N, ...]` or `[N, T, ...]`.
    mask: bool `[N]`, the envs that stepped; None for all.
    episode_end: bool `[N]` or `[N, T]` like `steps`; None for no ends.
    sequence_length, period, within: the buffer's settings.
    new_leaf_value: the tree leaf of a window that becomes sampleable
      (ignored without a tree).
    **columns: more per-step fields to write (`write_chunk`).
  """
  num_envs, per_env = num_envs_of(state), steps_per_env(state)
  steps, mask, episode_end = chunked_add_args(state, steps, mask, episode_end)
  length = episode_end.shape[1]
  new_state, chunk = write_chunk(state, steps, mask, episode_end, **columns)
  kept = chunk.kept
  new_state = new_state.replace(
    period_phases=jnp.where(
      mask, (state.period_phases + length % period) % period, state.period_phases
    )
  )
  # Only windows whose first or last step was written can change: starts
  # 0..K-1 steps ago (first step written) and L-1..L+K-2 steps ago (last step
  # written). Starts in between end past the newest step, before and after.
  # Every other window keeps its steps and its validity.
  span = kept + sequence_length - 1
  if span <= 2 * kept or span >= per_env:
    touched_ago = np.arange(min(span, per_env))
  else:
    touched_ago = np.concatenate([np.arange(kept), sequence_length - 1 + np.arange(kept)])
  touched_slots = (
    new_state.write_heads[:, None] - 1 - jnp.asarray(touched_ago, jnp.int32)[None, :]
  ) % per_env
  envs = jnp.broadcast_to(jnp.arange(num_envs, dtype=jnp.int32)[:, None], touched_slots.shape)
  settings: dict[str, Any] = dict(sequence_length=sequence_length, period=period, within=within)
  before = windows_valid(state, envs, touched_slots, **settings)
  after = windows_valid(new_state, envs, touched_slots, **settings)
  change = jnp.sum(after, axis=1, dtype=jnp.int32) - jnp.sum(before, axis=1, dtype=jnp.int32)
  new_state = new_state.replace(window_counts=state.window_counts + jnp.where(mask, change, 0))
  if state.window_tree is not None:
    assert new_leaf_value is not None  # given by every kind that keeps a tree
    leaves = jnp.where(after, new_leaf_value, 0.0).astype(jnp.float32)
    # A window that can be sampled neither before nor after keeps its leaf,
    # 0 already (the leaf of every window that cannot be sampled is 0). Its
    # write is skipped: at a large capacity each write costs cache misses on
    # every sparse level of the tree, and with period P only about 2 / P of
    # the touched windows change.
    changed = mask[:, None] & (before | after)
    new_state = new_state.replace(
      window_tree=sum_tree.set_leaves(
        state.window_tree,
        (envs * per_env + touched_slots).reshape(-1),
        leaves.reshape(-1),
        changed.reshape(-1),
        unique_indices=True,
      )
    )
  return new_state


def window_rows(
  state: SequenceReplayState, window_ids: jax.Array, *, sequence_length: int
) -> jax.Array:
  """The rows of windows `[S]` in the storage seen flat as `[N * R, ...]`:
  int32 `[S * L]`, window by window, each env's ring wrapped."""
  per_env = steps_per_env(state)
  starts = window_ids.astype(jnp.int32)
  firsts = starts - starts % per_env
  offsets = (starts % per_env)[:, None] + jnp.arange(sequence_length, dtype=jnp.int32)[None, :]
  # The env's ring: offsets past its end wrap to its first slot.
  wrapped = jnp.where(offsets >= per_env, offsets - per_env, offsets)
  return (firsts[:, None] + wrapped).reshape(-1)


def gather_windows(
  state: SequenceReplayState,
  window_ids: jax.Array,
  *,
  sequence_length: int,
  flat_rows: jax.Array | None = None,
) -> tuple[PyTree, jax.Array]:
  """Items `[S, L, ...]` of windows `[S]` and their first-episode mask `[S, L]`.

  One gather of S * L rows from each leaf seen flat as `[N * R, ...]`. The
  row indices (`window_rows`) are computed once (`random.computed_once`),
  not inside the gather: fused there, their divisions and remainders were
  redone for every element of every gathered row. A caller that computed
  them in its own `computed_once` passes them as `flat_rows`.
  """
  per_env = steps_per_env(state)
  num_rows = num_envs_of(state) * per_env
  num_windows = window_ids.shape[0]
  if flat_rows is None:
    flat_rows = random.computed_once(
      lambda: window_rows(state, window_ids, sequence_length=sequence_length), window_ids[0]
    )
  gather = lambda column: (
    column.reshape((num_rows,) + column.shape[2:])
    .at[flat_rows]
    .get(mode="promise_in_bounds")
    .reshape((num_windows, sequence_length) + column.shape[2:])
  )
  items = jax.tree.map(gather, state.storage)
  ends = gather(state.episode_ends)
  # A step belongs to the first episode if no episode ended before it.
  ended_before = jnp.cumsum(ends, axis=1, dtype=jnp.int32) - ends
  return items, ended_before == 0


def check_sample(
  state: SequenceReplayState, key: jax.Array, batch_size: int, *, checked: bool
) -> jax.Array:
  """Validates a sample's arguments; returns the number of windows, int32 `()`."""
  total = jnp.sum(state.window_counts)
  validation.check_key(key, what="sample")
  validation.check_batch_size(batch_size, what="sample")
  if checked:
    checkify.check(
      total > 0,
      "sample: the buffer holds no complete window; "
      "add steps before sampling (guard with can_sample).",
    )
  return total


def first_window_offsets(
  state: SequenceReplayState, *, sequence_length: int, period: int
) -> jax.Array:
  """Per env, how many steps ago its newest sampleable window starts: int32 `[N]`.

  The starts are the `ago >= L - 1` with `ago = phase - 1 (mod period)`;
  without episodes they are this one and every `period` steps before it.
  """
  residue = (state.period_phases - 1) % period
  return sequence_length - 1 + (residue - (sequence_length - 1)) % period


def uniform_windows(
  state: SequenceReplayState,
  key: jax.Array,
  batch_size: int,
  total: jax.Array,
  *,
  sequence_length: int,
  period: int,
  within: bool,
) -> tuple[jax.Array, jax.Array]:
  """Window ids drawn uniformly over every sampleable window, int32 `[S]`,
  and their storage rows, int32 `[S * L]` (`window_rows`).

  Across episodes the windows of env n are every `period`-th start from
  `first_window_offsets`, so one integer drawn exactly in `[0, total)` (64
  random bits scaled by `random.scale_to_span`) picks an env by the prefix
  sums of `window_counts` and a start within it: O(S log N), no tree. The
  draw and the rows are computed in one `random.computed_once`: as two (the
  draw's, then the rows' in `gather_windows`) the second loop waited on the
  first: a sample of 128 windows of 2 at 10k steps, 3 buffers vmapped, took
  28 us rather than 17 on a 2-core CPU (benchmarks/RESULTS.md, "PureJaxRL's
  fused DQN"). Within episodes the windows are irregular, and a sum tree
  with leaf 1 per window is descended instead (float32 counts are exact
  below 2**24 windows).
  """
  if within:
    assert state.window_tree is not None  # kept within episodes (init)
    found, _ = sum_tree.sample_leaves(state.window_tree, key, batch_size, stratified=False)
    window_ids = jnp.where(total > 0, found, 0)
    rows = random.computed_once(
      lambda: window_rows(state, window_ids, sequence_length=sequence_length), window_ids[0]
    )
    return window_ids, rows

  def draw():
    higher_bits, lower_bits = random.random_bits(key, (2, batch_size))
    span = jnp.maximum(total, 1).astype(jnp.uint32)
    ranks = random.scale_to_span(higher_bits, lower_bits, span).astype(jnp.int32)
    window_ids = window_ids_at_ranks(state, ranks, sequence_length=sequence_length, period=period)
    window_ids = jnp.where(total > 0, window_ids, 0)
    return window_ids, window_rows(state, window_ids, sequence_length=sequence_length)

  # computed_once keeps any pytree (its loop carries one); typed for arrays.
  return cast(tuple[jax.Array, jax.Array], random.computed_once(draw, total))


def window_ids_at_ranks(
  state: SequenceReplayState, ranks: jax.Array, *, sequence_length: int, period: int
) -> jax.Array:
  """The `ranks [S]`-th sampleable windows, across episodes: int32 `[S]`.

  Windows are ranked env by env, newest first within an env: every
  `period`-th start from `first_window_offsets`. A rank past the windows held
  gives some window id in range.
  """
  per_env = steps_per_env(state)
  ends = jnp.cumsum(state.window_counts, dtype=jnp.int32)
  # searchsorted(ends, ranks, side="right") as one count over [S, N]: N is
  # small, and a binary search is a loop of log N dependent steps.
  envs = jnp.minimum(
    jnp.sum(ends[None, :] <= ranks[:, None], axis=1, dtype=jnp.int32), num_envs_of(state) - 1
  )
  within_env = ranks - (ends[envs] - state.window_counts[envs])
  ago = (
    first_window_offsets(state, sequence_length=sequence_length, period=period)[envs]
    + within_env * period
  )
  return envs * per_env + (state.write_heads[envs] - 1 - ago) % per_env


def sample(
  state: SequenceReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  sequence_length: int,
  period: int,
  within: bool,
  checked: bool = False,
) -> SequenceSample:
  """Draws `batch_size` windows uniformly, with replacement.

  Every sampleable window (env, start) is equally likely, whatever the envs'
  step counts. With no complete window held it returns window 0 (whatever
  its slots hold) with weight 0 and `mask` all False, so a loss weighted
  by either reads nothing; checked mode raises instead.

  Returns:
    A `SequenceSample`: items `[S, L, ...]`, indices int32 `[S]` (window
    ids), weights float32 `[S]` (1, or 0 when empty), item_ids uint32 `[S]`,
    mask bool `[S, L]`.
  """
  validation.check_state_kind(state, SequenceReplayState, what="sample", exact=True)
  total = check_sample(state, key, batch_size, checked=checked)
  window_ids, rows = uniform_windows(
    state, key, batch_size, total, sequence_length=sequence_length, period=period, within=within
  )
  items, mask = gather_windows(state, window_ids, sequence_length=sequence_length, flat_rows=rows)
  return SequenceSample(
    items=items,
    indices=window_ids,
    weights=jnp.full((batch_size,), total > 0, jnp.float32),
    item_ids=window_item_ids(state, window_ids),
    mask=mask & (total > 0),
  )


def valid_priority_updates(
  state: SequenceReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None,
  *,
  sequence_length: int,
  period: int,
  within: bool,
  checked: bool,
) -> jax.Array:
  """Which updates of window priorities apply: bool `[S]`. Validates shapes
  while tracing.

  An update applies when its window id is in `[0, C)` and names a window that
  can be sampled now, its priority is finite, and (given `item_ids`) the
  window still starts at the step that was sampled; the rules of every
  stream kind, `window_priorities.valid_updates`, for window ids.
  """
  window_priorities.check_window_priorities(indices, priorities)
  return window_priorities.valid_updates(
    indices,
    priorities,
    item_ids,
    num_ids=num_envs_of(state) * steps_per_env(state),
    ids_valid=functools.partial(
      window_ids_valid, state, sequence_length=sequence_length, period=period, within=within
    ),
    item_ids_of=functools.partial(window_item_ids, state),
    id_name="window ids",
    checked=checked,
  )


def update_priorities(
  state: SequenceReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  sequence_length: int,
  period: int,
  within: bool,
  checked: bool = False,
) -> SequenceReplayState:
  """The identity: uniform replay keeps no priorities.

  Arguments are validated as for prioritized sequence replay (shapes while
  tracing; values in checked mode), so switching kinds surfaces no new errors.
  """
  validation.check_state_kind(state, SequenceReplayState, what="update_priorities", exact=True)
  window_priorities.check_window_priorities(indices, priorities)
  if checked:
    valid_priority_updates(
      state,
      indices,
      priorities,
      item_ids,
      sequence_length=sequence_length,
      period=period,
      within=within,
      checked=True,
    )
  else:
    validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def add(
  state: SequenceReplayState,
  steps: PyTree,
  mask: jax.Array | None = None,
  episode_end: jax.Array | None = None,
  final_steps: PyTree | None = None,
  *,
  sequence_length: int,
  period: int,
  within: bool,
) -> SequenceReplayState:
  """Adds one step per env (`[N, ...]`) or a chunk (`[N, T, ...]`).

  Episode ends have one flag. A step with a bool field (or dict key) named
  `last` carries its own: `last` True marks a step that holds an episode's
  final observation (the dm_env / RLDS stream of `jaxbuf.n_step_transitions`:
  step i holds `obs[i]`, `action[i]`, the `reward[i]` that followed and
  `terminated[i]`, True when that action ended the episode; an episode that
  ended, terminated or truncated, gets one more step holding its final
  observation, flagged `last`, whose action, reward and `terminated` are
  padding). The buffer reads episode ends from that leaf, and `episode_end`
  must not be given too. Steps without a `last` leaf mark ends with
  `episode_end`.

  The final observations of a vectorized env (gymnax's
  `info["final_observation"]`) go in the same add, as `final_steps`; env n
  writes its final step after its step exactly when the final step's own
  `last` is True, so no mask can be forgotten::

      state = buffer.add(state, Step(obs, action, reward, terminated,
                                     last=no_env),
                         final_steps=Step(info["final_observation"],
                                          padding_action, 0.0, no_env,
                                          last=terminated | truncated))

  Final observations given in a separate plain `add` instead are a step of
  every env not masked out, which no buffer can tell from an env step: an
  env whose episode did not end would store one step too many. Give them as
  `final_steps`.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    state: the buffer.
    steps: leaves `[N, *step_shape]` or `[N, T, *step_shape]`; T may exceed
      R (the newest R steps are kept). Shapes, dtypes and structure are
      checked while tracing; no value is cast.
    mask: bool `[N]` (a list or NumPy array works too), the envs that
      stepped (the others write nothing, final steps included, and keep
      their counts); None for all.
    episode_end: for steps without a `last` leaf. Without `final_steps`:
      bool `[N]` for one step per env, `[N, T]` for a chunk, True on the
      last step of an episode. With `final_steps`: bool `[N]`, the envs
      whose episode ended after their last step in `steps`. None for none.
    final_steps: steps like `steps` with one step per env, `[N, ...]`: each
      env whose episode ended (its final step's `last`, else `episode_end`)
      writes its final step after its steps; the same state, byte for byte,
      as a second add of them masked to those envs (`add_stream`). None for
      none.
    sequence_length, period, within: the buffer's settings.
  """
  validation.check_state_kind(state, SequenceReplayState, what="add", exact=True)
  return add_stream(
    state,
    steps,
    mask,
    episode_end,
    final_steps,
    write=functools.partial(
      add_steps,
      sequence_length=sequence_length,
      period=period,
      within=within,
      new_leaf_value=jnp.float32(1.0),
    ),
  )


def can_sample(state: SequenceReplayState, batch_size: int) -> jax.Array:
  """Whether `sample(state, key, batch_size)` draws only held windows: bool
  `()`, true once one complete window is held (hindsight replay: one
  transition with its next step; sampling is with
  replacement, so one window serves any `batch_size`; `batch_size` is
  checked all the same). Not a warm-up: wait for data with
  `state.steps_held.sum() >= min_steps`."""
  validation.check_batch_size(batch_size, what="can_sample")
  return jnp.sum(state.window_counts) > 0


def clear(state: SequenceStateT) -> SequenceStateT:
  """Empties the buffer without reallocating or zeroing its storage.

  The step counts go on (and with them `item_ids` and the period phases), so
  a priority update sampled before the clear is recognised as stale.
  """
  validation.check_state_kind(state, SequenceReplayState, what="clear")
  cleared = state.replace(
    steps_held=jnp.zeros_like(state.steps_held), window_counts=jnp.zeros_like(state.window_counts)
  )
  if state.window_tree is not None:
    cleared = cleared.replace(window_tree=jax.tree.map(jnp.zeros_like, state.window_tree))
  return cleared
