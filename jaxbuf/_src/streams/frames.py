"""Frame-stack replay: pixel transitions whose frames are stored once.

Why one module of this size: it holds one rule, which stored frames make up
a transition's two stacks (its own episode's, padded, never another's). The
add path keeps each transition's sampleability by that rule (its leaf in the
sum tree, from `episode_positions`) and the gather reads stacks by it; the
two halves and the uniform and prioritized variant of each function stay
together so the rule is read and changed in one place. What does not apply
the rule is elsewhere: the stream underneath is sequence replay's
(`sequence.py`), the priority update rules are those every stream kind
shares (`window_priorities.py`), and the factories and the split over
devices, which bind and place these functions, are in `factories.py` and
`device_split.py`.

Shape key: N envs, R = C // N steps held per env, C capacity (steps over all
envs), T steps per env in one add, K num_stack, n n_step, S sample size.

Storage. Each env's experience is one stream of steps (sequence replay's
per-env rings, `sequence.py`), in the stream convention of `transitions.py`:
step i holds `obs[i]` (one frame, not a stack), `action[i]`, `reward[i]` and
`terminated[i]`; an episode's final observation gets a step of its own
(action and reward padding), flagged by the step's `last` leaf or `add(...,
episode_end=...)`, and given in the add of its episode's last step as
`add(..., final_steps=...)`. So each frame is stored once: never K times,
never again as a next observation. Beside each step the buffer keeps one byte, its position in its
episode saturated at K - 1 (`episode_positions`), so a sample knows how many
of the K - 1 frames before a step belong to its episode. For 84x84 uint8
frames a step costs 7056 bytes of frame, the user's action, reward and
terminated, 2 bytes of flags and position, and about 4.6 bytes of sum tree.

Transitions. Transition t (a step that is not an episode's final step) has
the n-step reward and discount of `n_step_transitions` (a termination stops
the sum with discount 0; an episode's final step stops it and the target
bootstraps from that step, the TRUE final observation). Its `obs` stacks the
frames of steps t - K + 1 .. t, its `next_obs` those of t' - K + 1 .. t'
(t' = t + k, k <= n), oldest first. A frame before its stack's episode's
first step is padding: zeros (`pad="zeros"`) or that first step's frame
(`pad="first"`, gymnasium's FrameStack after reset); never a frame of
another episode, of an overwritten or of an unwritten slot.

Which transitions can be sampled. Transition t of env n is sampleable while
the steps its n-step target reads are held, t .. t + k: k = n, or the
distance to its episode's final step when that comes first (so an
episode's last transitions are sampleable as soon as its final step is
written, whether or not the env steps again; the newest steps of an
episode still running wait for n more steps), and so are the frames of its
own episode before it that its stack needs (`min(position, K - 1)` of
them). The first steps of an episode need no frames before them, so they
are sampleable as soon as their target's steps are held, also as the very
first steps of a stream and right after a wrap of the ring; only the at
most K - 1 oldest steps of an env,
whose episode started before the oldest frame held, have lost part of their
stack and are not sampled. A sum tree has a leaf per transition id `n * R +
j` (the step in slot j of env n): 1 (uniform) or `(priority + eps) **
alpha` (prioritized) while sampleable, else 0, kept by every `add` for the
transitions it completes or breaks, O(N (T + n + K) log C).

Sampling gathers, for each of the S transitions, the n + 1 small step
records its n-step target reads, then the 2K frames of its two stacks in one
gather from the storage (zeros for padding frames), so the cost follows S
and K, not the capacity. Only the leaves named by `stack_keys` are stacked
(every leaf of `obs` by default); other leaves of `obs` come from steps t
and t' alone, unstacked.

The module-level functions take every setting explicitly;
`frame_stack_replay` and `prioritized_frame_stack_replay` (`factories.py`)
bind them into a `Buffer`.
"""

import collections.abc
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.items import prioritized
from jaxbuf._src.streams import episode_starts
from jaxbuf._src.streams import prioritized_sequence
from jaxbuf._src.core import random
from jaxbuf._src.streams import sequence
from jaxbuf._src.core import sum_tree
from jaxbuf._src.streams import transitions
from jaxbuf._src.core import validation
from jaxbuf._src.streams import window_priorities
from jaxbuf._src.core.base import PyTree, ReplaySample, Schedule
from jaxbuf._src.streams.prioritized_sequence import PrioritizedSequenceReplayState

STEP_FIELDS = ("obs", "action", "reward", "terminated")
PAD_MODES = ("zeros", "first")
MAX_NUM_STACK = 256  # positions are stored as uint8


class FrameStackTransition(NamedTuple):
  """n-step transitions with stacked observations.

  `discount` means what it means in every jaxbuf transition
  (`NStepTransitions`, `HindsightTransition`): the factor of the bootstrap,
  `target = reward + discount * V(next_obs)`, with gamma already in it
  (rlax's `discount_t`). The sample's `indices` are transition ids
  (`env * R + slot` of step t), its `item_ids` step t's id.
  """

  obs: PyTree  # leaves [S, ...]; stacked leaves with K inserted at
  # stack_axis, oldest frame first
  action: PyTree  # leaves [S, ...]
  reward: jax.Array  # [S]: n-step discounted reward, the reward's dtype
  discount: jax.Array  # [S], the reward's dtype: gamma^k for the k <= n
  # steps summed, 0 after a termination
  next_obs: PyTree  # like obs: the stack at step t + k (k <= n)


@flax.struct.dataclass
class FrameStackReplayState(PrioritizedSequenceReplayState):
  """Per-env streams of single frames. Arrays only.

  `window_tree` holds a leaf per transition id, `window_counts` the
  transitions sampleable per env; `max_priority` and `beta_step` stay at 1
  and 0 without priorities.
  """

  episode_positions: jax.Array  # uint8 [N, R]: each step's index in its
  # episode, saturated at K - 1
  next_positions: jax.Array  # int32 [N]: the index the next step of each
  # env will have, saturated at K - 1

  def per_env_fields(self) -> tuple[str, ...]:
    return super().per_env_fields() + ("episode_positions", "next_positions")

  def oldest_held_starts_an_episode(self) -> jax.Array:
    """Also where the ring wrapped at an episode's start: the oldest held
    step's position in its episode is 0."""
    return super().oldest_held_starts_an_episode() | episode_starts.oldest_held_is_first(
      self, self.episode_positions
    )


def _field(tree: Any, name: str) -> Any:
  if isinstance(tree, collections.abc.Mapping):
    return tree[name]
  return getattr(tree, name)


def _stacked_mask(obs: PyTree, stack_keys: tuple[str, ...] | None) -> PyTree:
  """A bool per leaf of `obs`: whether it is stacked."""
  if stack_keys is None:
    return jax.tree.map(lambda _: True, obs)
  names = (
    list(obs) if isinstance(obs, collections.abc.Mapping) else list(getattr(obs, "_fields", ()))
  )
  missing = [key for key in stack_keys if key not in names]
  if missing:
    raise ValueError(
      f"stack_keys names {missing}, which obs does not have; obs "
      f"{'has the keys ' + str(names) if names else 'is not a dict or NamedTuple'}"
      f" (stack_keys=None stacks every leaf)."
    )
  if isinstance(obs, collections.abc.Mapping):
    mapping_type: Any = type(obs)  # a dict, or a Mapping made from one
    return mapping_type(
      {key: jax.tree.map(lambda _, k=key: k in stack_keys, value) for key, value in obs.items()}
    )
  return type(obs)(
    **{key: jax.tree.map(lambda _, k=key: k in stack_keys, getattr(obs, key)) for key in names}
  )


def check_step(
  example_step: PyTree, *, stack_keys: tuple[str, ...] | None, stack_axis: int
) -> None:
  """Raises naming what is wrong with a step of the frame stream."""
  for name in STEP_FIELDS:
    try:
      _field(example_step, name)
    except (KeyError, AttributeError, TypeError):
      raise ValueError(
        f"frame_stack_replay: the step has no field {name!r}; a step holds "
        f"{STEP_FIELDS} (a dict or a NamedTuple)."
      ) from None
  validation.check_reward_and_terminated(
    _field(example_step, "reward"), _field(example_step, "terminated"), what="frame_stack_replay"
  )
  obs = _field(example_step, "obs")
  stacked = _stacked_mask(obs, stack_keys)
  for (path, leaf), is_stacked in zip(
    jax.tree_util.tree_flatten_with_path(obs)[0], jax.tree.leaves(stacked)
  ):
    rank = np.ndim(leaf)
    if is_stacked and not -(rank + 1) <= stack_axis <= rank:
      raise ValueError(
        f"stack_axis {stack_axis} is out of range for obs leaf "
        f"{jax.tree_util.keystr(path) or '<root>'} of shape "
        f"{np.shape(leaf)}: the stack axis goes in [{-(rank + 1)}, {rank}]."
      )


def check_settings(
  num_envs: Any,
  capacity: Any,
  num_stack: Any,
  n_step: Any,
  gamma: Any = 0.99,
  pad: Any = "zeros",
  stack_axis: Any = -1,
  stack_keys: Any = None,
) -> None:
  """Raises naming the setting; a capacity is never rounded silently."""
  validation.check_positive_int(num_stack, "num_stack")
  validation.check_positive_int(n_step, "n_step")
  if num_stack > MAX_NUM_STACK:
    raise ValueError(f"num_stack must be at most {MAX_NUM_STACK}, given {num_stack}.")
  sequence.check_sizes(num_envs, capacity, 1, 1)
  per_env = capacity // num_envs
  if per_env < num_stack + n_step:
    raise ValueError(
      f"capacity {capacity} holds {per_env} steps per env; a stacked "
      f"n-step transition reads num_stack + n_step = {num_stack + n_step}: "
      f"use capacity >= {(num_stack + n_step) * num_envs}."
    )
  validation.check_hyperparameter(gamma, "gamma")
  if float(gamma) > 1:
    raise ValueError(f"gamma must be in [0, 1], given {gamma}.")
  if pad not in PAD_MODES:
    raise ValueError(f"pad must be one of {PAD_MODES}, given {pad!r}.")
  validation.check_python_int(stack_axis, "stack_axis")
  if stack_keys is not None and (
    isinstance(stack_keys, str) or not all(isinstance(key, str) for key in stack_keys)
  ):
    raise TypeError(f"stack_keys must be None or a tuple of key names, given {stack_keys!r}.")


def init(
  example_step: PyTree,
  *,
  num_envs: int,
  capacity: int,
  stack_keys: tuple[str, ...] | None = None,
  stack_axis: int = -1,
) -> FrameStackReplayState:
  """An empty buffer for steps shaped like `example_step` (one env, unbatched).

  Args:
    example_step: a dict or NamedTuple with fields obs (any pytree: one
      frame, not a stack), action, reward (float scalar) and terminated
      (bool scalar): arrays or `jax.ShapeDtypeStruct` values.
    num_envs: N.
    capacity: C, steps over all envs, a multiple of N.
    stack_keys: checked against `obs`, as `stack_axis` is (see
      `frame_stack_replay`).
  """
  check_step(example_step, stack_keys=stack_keys, stack_axis=stack_axis)
  base = prioritized_sequence.init(example_step, num_envs=num_envs, capacity=capacity)
  return FrameStackReplayState(
    **{name: getattr(base, name) for name in base.__dataclass_fields__},
    episode_positions=jnp.zeros((num_envs, capacity // num_envs), jnp.uint8),
    next_positions=jnp.zeros((num_envs,), jnp.int32),
  )


def transitions_valid(
  state: FrameStackReplayState, envs: jax.Array, slots: jax.Array, *, n_step: int
) -> jax.Array:
  """Whether the transition at each `(env, slot)` can be sampled: bool.

  The steps its n-step target reads are held (its step and the n after
  it, or fewer when its episode's final step comes first: that final step
  completes the target, and no later step of the env is needed), its step
  is no episode's final step, and the frames of its episode its stack
  reads are held.
  """
  ago = sequence.steps_ago(state, envs, slots)
  history = state.episode_positions[envs, slots].astype(jnp.int32)
  complete = ago >= n_step
  if n_step > 1:
    # Step t + j is held when j <= ago; a slot beyond the write head holds
    # an older lap's flag, which must not count.
    ahead = jnp.arange(1, n_step, dtype=jnp.int32).reshape((1,) * slots.ndim + (-1,))
    ends = state.episode_ends[
      envs[..., None], (slots[..., None] + ahead) % sequence.steps_per_env(state)
    ]
    complete |= jnp.any(ends & (ahead <= ago[..., None]), axis=-1)
  return complete & (ago + history < state.steps_held[envs]) & ~state.episode_ends[envs, slots]


def transition_ids_valid(state: FrameStackReplayState, ids: jax.Array, *, n_step: int) -> jax.Array:
  """`transitions_valid` for ids `[S]` (any ints; out of range is False)."""
  per_env = sequence.steps_per_env(state)
  ids = ids.astype(jnp.int32)
  in_range = (ids >= 0) & (ids < sequence.num_envs_of(state) * per_env)
  safe = jnp.where(in_range, ids, 0)
  return in_range & transitions_valid(state, safe // per_env, safe % per_env, n_step=n_step)


def add_steps(
  state: FrameStackReplayState,
  steps: PyTree,
  mask: jax.Array | None,
  episode_end: jax.Array | None,
  *,
  num_stack: int,
  n_step: int,
  new_leaf_value: jax.Array,
) -> FrameStackReplayState:
  """Writes steps and updates the transitions they complete or break.

  Args:
    state: the buffer.
    steps: leaves `[N, ...]` or `[N, T, ...]`, T >= 1 (`sequence.add_stream`
      writes an empty chunk as nothing).
    mask: bool `[N]`, the envs that stepped; None for all.
    episode_end: bool `[N]` or `[N, T]` like `steps`; None for no ends.
    num_stack, n_step: the buffer's settings.
    new_leaf_value: the tree leaf of a transition that becomes sampleable.
  """
  num_envs, per_env = sequence.num_envs_of(state), sequence.steps_per_env(state)
  steps, mask, episode_end = sequence.chunked_add_args(state, steps, mask, episode_end)
  positions, after = episode_starts.episode_positions_of(
    state.next_positions, episode_end, saturate_at=num_stack - 1
  )
  new_state, chunk = sequence.write_chunk(
    state, steps, mask, episode_end, episode_positions=positions.astype(jnp.uint8)
  )
  kept = chunk.kept
  new_state = new_state.replace(next_positions=jnp.where(mask, after, state.next_positions))
  # Transitions that can change, by steps ago after the write: those written
  # (0..K'-1), those whose j-th next step was written for a j <= n (a final
  # step completes a target early: 1..n+K'-1), and the K - 1 oldest, whose
  # history the write may have overwritten. Every other keeps its steps,
  # its history and its validity.
  touched_ago = np.unique(
    np.concatenate([np.arange(n_step + kept), per_env - 1 - np.arange(num_stack - 1)])
  )
  touched_ago = touched_ago[(touched_ago >= 0) & (touched_ago < per_env)]
  touched_slots = (
    new_state.write_heads[:, None] - 1 - jnp.asarray(touched_ago, jnp.int32)[None, :]
  ) % per_env
  envs = jnp.broadcast_to(jnp.arange(num_envs, dtype=jnp.int32)[:, None], touched_slots.shape)
  before = transitions_valid(state, envs, touched_slots, n_step=n_step)
  after_valid = transitions_valid(new_state, envs, touched_slots, n_step=n_step)
  change = jnp.sum(after_valid, axis=1, dtype=jnp.int32) - jnp.sum(before, axis=1, dtype=jnp.int32)
  # A rewritten slot holds a new transition: its leaf is set whenever either
  # is sampleable. Another keeps its leaf (its priority) unless it became
  # sampleable or stopped being so.
  rewritten = jnp.asarray(touched_ago < kept)[None, :]
  changed = mask[:, None] & jnp.where(rewritten, before | after_valid, before != after_valid)
  leaves = jnp.where(after_valid, new_leaf_value, 0.0).astype(jnp.float32)
  return new_state.replace(
    window_counts=state.window_counts + jnp.where(mask, change, 0),
    window_tree=sum_tree.set_leaves(
      state.window_tree,
      (envs * per_env + touched_slots).reshape(-1),
      leaves.reshape(-1),
      changed.reshape(-1),
      unique_indices=True,
    ),
  )


def add(
  state: FrameStackReplayState,
  steps: PyTree,
  mask: jax.Array | None = None,
  episode_end: jax.Array | None = None,
  final_steps: PyTree | None = None,
  *,
  num_stack: int,
  n_step: int,
) -> FrameStackReplayState:
  """Adds one step per env (`[N, ...]`) or a chunk (`[N, T, ...]`), and the
  final observations of the envs whose episode ended (`final_steps`).

  The same add as `jaxbuf.sequence.add` (one code path,
  `sequence.add_stream`); steps follow the stream convention,
  `help(jaxbuf.streams)`.

  Args:
    state: the buffer.
    steps: the step pytree with leaves `[N, *step_shape]` or `[N, T,
      *step_shape]` (obs a single frame per step); T may exceed R (the newest
      R steps are kept). Shapes, dtypes and structure are checked while
      tracing; no value is cast.
    mask: bool `[N]`, the envs that stepped (the others write nothing,
      final steps included); None for all.
    episode_end: for steps without a `last` leaf (which marks the ends
      itself; both at once is a `TypeError`). Without `final_steps`: bool
      `[N]` for one step per env, `[N, T]` for a chunk, True on each
      episode's final step (the one holding its final observation; the next
      step of that env starts an episode). With `final_steps`: bool `[N]`,
      the envs whose episode ended after their last step in `steps`. None
      for none.
    final_steps: steps like `steps`, one per env `[N, ...]`: each env whose
      episode ended (its final step's `last`, else `episode_end`) writes its
      final step after its steps, flagged as the episode's end; the same
      state, byte for byte, as a second add of them masked to those envs.
      None for none.
    num_stack, n_step: the buffer's settings.
  """
  validation.check_state_kind(state, FrameStackReplayState, what="add", exact=True)
  return sequence.add_stream(
    state,
    steps,
    mask,
    episode_end,
    final_steps,
    write=functools.partial(
      add_steps, num_stack=num_stack, n_step=n_step, new_leaf_value=jnp.float32(1.0)
    ),
  )


def prioritized_add(
  state: FrameStackReplayState,
  steps: PyTree,
  mask: jax.Array | None = None,
  episode_end: jax.Array | None = None,
  final_steps: PyTree | None = None,
  *,
  num_stack: int,
  n_step: int,
  alpha: float,
) -> FrameStackReplayState:
  """`add`; transitions completed enter at the running maximum priority."""
  validation.check_state_kind(state, FrameStackReplayState, what="add", exact=True)
  return sequence.add_stream(
    state,
    steps,
    mask,
    episode_end,
    final_steps,
    write=functools.partial(
      add_steps,
      num_stack=num_stack,
      n_step=n_step,
      new_leaf_value=prioritized.capped_leaf_values(state.max_priority, alpha, state.window_tree),
    ),
  )


def _move_stack_axis(leaf: jax.Array, stack_axis: int) -> jax.Array:
  """`[S, K, *frame]` -> the stack at `stack_axis` of each `[*frame]`."""
  rank = leaf.ndim - 2
  return jnp.moveaxis(leaf, 1, 1 + stack_axis % (rank + 1))


def gather_transitions(
  state: FrameStackReplayState,
  ids: jax.Array,
  *,
  num_stack: int,
  n_step: int,
  gamma: Any,
  pad: str,
  stack_keys: tuple[str, ...] | None,
  stack_axis: int,
) -> FrameStackTransition:
  """The stacked n-step transitions of ids `[S]` (each a sampleable one)."""
  per_env = sequence.steps_per_env(state)
  num_rows = sequence.num_envs_of(state) * per_env
  ids = ids.astype(jnp.int32)
  env_firsts = ids - ids % per_env
  slots = ids % per_env

  def rows_at(offsets):
    """Flat rows of the steps `offsets` (int32 `[S, M]`) after each step."""
    return env_firsts[:, None] + (slots[:, None] + offsets) % per_env

  def flat(column):
    return column.reshape((num_rows,) + column.shape[2:])

  step = lambda name: _field(state.storage, name)
  ahead = rows_at(jnp.arange(n_step + 1, dtype=jnp.int32)[None, :])
  take = lambda column, rows: flat(column).at[rows].get(mode="promise_in_bounds")
  rewards = take(step("reward"), ahead)
  targets = transitions.n_step_targets(
    rewards,
    take(step("terminated"), ahead),
    take(state.episode_ends, ahead),
    n=n_step,
    gamma=jnp.asarray(gamma, rewards.dtype),
  )
  next_offsets = targets.next_index[:, 0]
  positions = take(state.episode_positions, ahead).astype(jnp.int32)
  next_positions = jnp.take_along_axis(positions, next_offsets[:, None], axis=1)[:, 0]

  def stack_offsets(anchor, position):
    """Offsets `[S, K]` of a stack's frames, oldest first, and which are real."""
    back = jnp.arange(num_stack - 1, -1, -1, dtype=jnp.int32)[None, :]
    real = back <= position[:, None]
    if pad == "first":
      back = jnp.minimum(back, position[:, None])
    return anchor[:, None] - back, real

  def frame_rows():
    obs_offsets, _ = stack_offsets(jnp.zeros_like(next_offsets), positions[:, 0])
    next_stack, _ = stack_offsets(next_offsets, next_positions)
    return rows_at(jnp.concatenate([obs_offsets, next_stack], axis=1))

  # Kept out of the gathers' fusion, as sequence.gather_windows does.
  stack_rows = random.computed_once(frame_rows, ids[0])
  _, obs_real = stack_offsets(jnp.zeros_like(next_offsets), positions[:, 0])
  _, next_real = stack_offsets(next_offsets, next_positions)
  real = jnp.concatenate([obs_real, next_real], axis=1)
  single_rows = rows_at(jnp.stack([jnp.zeros_like(next_offsets), next_offsets], axis=1))

  def gather_obs(leaf, is_stacked):
    if not is_stacked:
      both = take(leaf, single_rows)
      return both[:, 0], both[:, 1]
    frames = take(leaf, stack_rows)
    if pad == "zeros":
      shown = real.reshape(real.shape + (1,) * (frames.ndim - 2))
      frames = jnp.where(shown, frames, jnp.zeros((), frames.dtype))
    return (
      _move_stack_axis(frames[:, :num_stack], stack_axis),
      _move_stack_axis(frames[:, num_stack:], stack_axis),
    )

  obs_column = step("obs")
  leaves, structure = jax.tree.flatten(obs_column)
  pairs = [
    gather_obs(leaf, is_stacked)
    for leaf, is_stacked in zip(leaves, jax.tree.leaves(_stacked_mask(obs_column, stack_keys)))
  ]
  obs = jax.tree.unflatten(structure, [pair[0] for pair in pairs])
  next_obs = jax.tree.unflatten(structure, [pair[1] for pair in pairs])
  action = jax.tree.map(lambda leaf: take(leaf, ahead[:, 0]), step("action"))
  return FrameStackTransition(
    obs=obs,
    action=action,
    reward=targets.rewards[:, 0],
    discount=targets.discounts[:, 0],
    next_obs=next_obs,
  )


def transition_item_ids(state: FrameStackReplayState, ids: jax.Array) -> jax.Array:
  """The absolute step id of each transition's step, modulo 2**32: uint32."""
  return sequence.window_item_ids(state, ids)


def _transitions_sample(
  state: FrameStackReplayState, ids: jax.Array, weights: jax.Array, **gather_settings: Any
) -> ReplaySample:
  """The sample of transitions `ids [S]` with `weights [S]`, uniform or
  prioritized: their stacked transitions, ids and item ids."""
  return ReplaySample(
    items=gather_transitions(state, ids, **gather_settings),
    indices=ids,
    weights=weights,
    item_ids=transition_item_ids(state, ids),
  )


def _check_sample(
  state: FrameStackReplayState, key: jax.Array, batch_size: int, *, checked: bool
) -> jax.Array:
  total = jnp.sum(state.window_counts)
  validation.check_key(key, what="sample")
  validation.check_batch_size(batch_size, what="sample")
  if checked:
    checkify.check(
      total > 0,
      "sample: the buffer holds no sampleable "
      "transition; add steps before sampling (guard with "
      "can_sample).",
    )
  return total


def sample(
  state: FrameStackReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  num_stack: int,
  n_step: int,
  gamma: Any,
  pad: str,
  stack_keys: tuple[str, ...] | None,
  stack_axis: int,
  checked: bool = False,
) -> ReplaySample:
  """Draws `batch_size` transitions uniformly, with replacement.

  With no sampleable transition it returns transition 0 (whatever its slots
  hold) with weight 0; checked mode raises instead.

  Returns:
    A `ReplaySample`: items a `FrameStackTransition` `[S, ...]`, indices
    int32 `[S]` (transition ids `n * R + j`), weights float32 `[S]` (1, or 0
    when empty), item_ids uint32 `[S]`.
  """
  validation.check_state_kind(state, FrameStackReplayState, what="sample", exact=True)
  total = _check_sample(state, key, batch_size, checked=checked)
  found, _ = sum_tree.sample_leaves(state.window_tree, key, batch_size, stratified=False)
  ids = jnp.where(total > 0, found, 0)
  weights = jnp.full((batch_size,), total > 0, jnp.float32)
  return _transitions_sample(
    state,
    ids,
    weights,
    num_stack=num_stack,
    n_step=n_step,
    gamma=gamma,
    pad=pad,
    stack_keys=stack_keys,
    stack_axis=stack_axis,
  )


def prioritized_sample(
  state: FrameStackReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  num_stack: int,
  n_step: int,
  gamma: Any,
  pad: str,
  stack_keys: tuple[str, ...] | None,
  stack_axis: int,
  beta: float | Schedule,
  stratified: bool = True,
  checked: bool = False,
) -> ReplaySample:
  """Draws `batch_size` transitions in proportion to `(priority + eps) ** alpha`.

  Importance weights `(N P(i)) ** -beta`, N the sampleable transitions,
  normalised so the largest is 1; stratification as `prioritized_replay`'s.
  With nothing sampleable (or every leaf underflowed) it returns transition
  0 with weight 0; checked mode raises when nothing is sampleable.
  """
  validation.check_state_kind(state, FrameStackReplayState, what="sample", exact=True)
  num_held = _check_sample(state, key, batch_size, checked=checked)
  ids, weights, _ = prioritized_sequence.draw_by_priority(
    state, key, batch_size, num_held, beta=beta, stratified=stratified
  )
  return _transitions_sample(
    state,
    ids,
    weights,
    num_stack=num_stack,
    n_step=n_step,
    gamma=gamma,
    pad=pad,
    stack_keys=stack_keys,
    stack_axis=stack_axis,
  )


def valid_priority_updates(
  state: FrameStackReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None,
  *,
  n_step: int,
  checked: bool,
) -> jax.Array:
  """Which updates apply: bool `[S]`, the rules of every stream kind
  (`window_priorities.valid_updates`) for transition ids. Reads no storage
  leaf."""
  return window_priorities.valid_updates(
    indices,
    priorities,
    item_ids,
    num_ids=sequence.num_envs_of(state) * sequence.steps_per_env(state),
    ids_valid=functools.partial(transition_ids_valid, state, n_step=n_step),
    item_ids_of=functools.partial(transition_item_ids, state),
    id_name="transition ids",
    checked=checked,
  )


def update_priorities(
  state: FrameStackReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  n_step: int,
  checked: bool = False,
) -> FrameStackReplayState:
  """The identity: uniform replay keeps no priorities (arguments validated
  as for prioritized replay, so switching kinds surfaces no new errors)."""
  validation.check_state_kind(state, FrameStackReplayState, what="update_priorities", exact=True)
  if checked:
    valid_priority_updates(state, indices, priorities, item_ids, n_step=n_step, checked=True)
  else:
    validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def prioritized_update_priorities(
  state: FrameStackReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  n_step: int,
  alpha: float,
  eps: float,
  checked: bool = False,
) -> FrameStackReplayState:
  """Sets the priorities of transitions `indices [S]` to `|priorities| + eps`.

  Skips, duplicates and checked mode as `prioritized_sequence_replay`'s
  (an id naming no sampleable transition, a priority not finite, a
  transition overwritten since it was sampled). Cost O(S log C).
  """
  validation.check_state_kind(state, FrameStackReplayState, what="update_priorities", exact=True)
  valid = valid_priority_updates(
    state, indices, priorities, item_ids, n_step=n_step, checked=checked
  )
  return window_priorities.with_window_priorities(
    state, indices, priorities, valid, alpha=alpha, eps=eps
  )


def can_sample(state: FrameStackReplayState, batch_size: int) -> jax.Array:
  """Whether `sample(state, key, batch_size)` draws only held transitions:
  bool `()`, true once one transition with its whole stack is held
  (sampling is with replacement, so one serves any `batch_size`;
  `batch_size` is checked all the same). Not a warm-up: wait for data with
  `state.steps_held.sum() >= min_steps`."""
  validation.check_batch_size(batch_size, what="can_sample")
  return jnp.sum(state.window_counts) > 0


def clear(state: FrameStackReplayState) -> FrameStackReplayState:
  """Empties the buffer without reallocating or zeroing its storage.

  Step counts and each env's position in its running episode go on: the
  next steps' stacks would read frames that are gone, so (as after an
  overwrite) a transition whose stack needs them is not sampled.
  """
  validation.check_state_kind(state, FrameStackReplayState, what="clear", exact=True)
  return prioritized_sequence.clear(state)
