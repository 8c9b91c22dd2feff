"""Hindsight experience replay (Andrychowicz et al. 2017) over per-env streams.

Why one module of this size: it holds one rule, where a transition's goal
may come from (its own env and episode, after it, never an overwritten or
unwritten step). The episode bookkeeping that add keeps, the goal draw of
each strategy and the relabelled sample all read that bookkeeping, so they
stay together. The split over devices places these functions without a
rule of its own (`device_split.py`: envs whole on a device, so a goal is
drawn where its steps are), and the stream underneath is sequence replay's
(`sequence.py`), not repeated.

Shape key: N envs, R = C // N steps held per env, C capacity (steps over all
envs), T steps per env in one add, S sample size.

Storage. The steps are sequence replay's per-env streams (`sequence.py`), in
the stream convention of `transitions.py`: step i holds `obs[i]` (a
gymnasium-robotics GoalEnv dict of "observation", "achieved_goal",
"desired_goal"), `action[i]`, `reward[i]` and `terminated[i]`; an episode's
final observation gets a step of its own, flagged by the step's `last`
leaf (or `add(..., episode_end=...)` for steps without one), whose action
and reward are padding. Each observation is
stored once: transition t is the window of the two steps t, t + 1 of one env
(sequence replay with `sequence_length=2, episodes="within"`), so it is held
while both steps are, and a step flagged `episode_end` starts none.
The window tree has a leaf per transition: 1 for uniform replay (which
draws pairs of held steps without it, and needs it only for the rare row
whose candidates all start at a final observation: `uniform_transition_ids`),
`(priority + eps) ** alpha` for prioritized replay (`prioritized_sequence.py`).

Episodes. Each step also stores its episode's key (the env's episode count
modulo R: the at most R episodes with a held step have distinct keys) and the
absolute id of its episode's first step; a table indexed by key holds the id
of each ended episode's last step. The episode still running at the write head
has no last step yet: its transitions are sampleable, with the steps held so
far. Step ids are uint32 and wrap modulo 2**32, as `item_ids` do.

Goals. A sampled transition t of an episode whose transitions t0..T-1 are
held (t0 > 0 when its first steps were overwritten) is relabelled with
probability `relabel_fraction`: its new desired goal is
`next_obs["achieved_goal"]` of transition t' (the "achieved_goal" of step
t' + 1), t' uniform over t..T-1 ("future"), t' = T - 1 ("final") or t'
uniform over t0..T-1 ("episode"), drawn exactly (64 random bits scaled to
the span, `random.scale_to_span`). So the goal step lies in the same env and
episode, between the transition's next step and the episode's last held
step: never another episode, an overwritten or an unwritten slot.

Writes touch the N * min(T, R) rows written and their windows, as sequence
replay's. A sample reads S transitions' steps and next steps (next
observations without their desired goal, which the transition's replaces)
and S goal achieved goals, at rows computed once from one call to the
generator (`gather_steps`); nothing it computes has the capacity's size.

Devices. `jaxbuf.sharded` splits the envs over devices in blocks of N / D,
each env whole with its episode bookkeeping (`device_split.hindsight_split`),
so every step a transition's goal may come from is on the transition's
device: that device draws the goal, with the key `jaxbuf.sharded` hands to a
kind's `Split.rows`, and the rewards are recomputed once the rows are joined.

The module-level functions take every setting explicitly;
`hindsight_replay` (`factories.py`) binds them into a `Buffer`.
"""

import collections.abc
import inspect
import functools
import math
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.items import prioritized
from jaxbuf._src.streams import prioritized_sequence
from jaxbuf._src.core import random
from jaxbuf._src.streams import sequence
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import PyTree, ReplaySample, Schedule
from jaxbuf._src.streams.prioritized_sequence import PrioritizedSequenceReplayState

STRATEGIES = ("future", "final", "episode")
GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
STEP_FIELDS = ("obs", "action", "reward", "terminated")
# A transition is the window of its step and the next one, never across an
# episode end.
TRANSITION_WINDOWS: dict[str, Any] = dict(sequence_length=2, period=1, within=True)
_WINDOW_SIZES: dict[str, Any] = dict(sequence_length=2, period=1, episodes="within")
# Uniform draws: pairs of steps drawn per row before the tree is needed.
CANDIDATES = 3


class HindsightTransition(NamedTuple):
  """One-step transitions, the goal maybe relabelled.

  `discount` means what it means in every jaxbuf transition
  (`FrameStackTransition`, `NStepTransitions`): the factor of the bootstrap,
  `target = reward + discount * Q(next_obs, ...)`, with gamma already in it
  (rlax's `discount_t`); do not multiply by gamma again. The sample's
  `indices` are transition ids (`env * R + slot` of step t), its
  `item_ids` step t's id.
  """

  obs: PyTree  # GoalEnv dict, leaves [S, ...]
  action: PyTree  # leaves [S, ...]
  reward: jax.Array  # [S], the stored reward's dtype
  discount: jax.Array  # [S], the reward's dtype: gamma, or 0 where the
  # transition terminated the episode
  next_obs: PyTree  # GoalEnv dict, leaves [S, ...]; the same desired_goal


@flax.struct.dataclass
class HindsightSample(ReplaySample):
  """A `ReplaySample` of `HindsightTransition` items, with the relabelled rows."""

  relabelled: jax.Array  # bool [S]: the row carries a hindsight goal


@flax.struct.dataclass
class HindsightReplayState(PrioritizedSequenceReplayState):
  """Per-env streams of steps with their episodes. Arrays only.

  `max_priority` and `beta_step` stay at 1 and 0 without priorities.
  """

  episode_keys: jax.Array  # int32 [N, R]: each step's episode count mod R
  episode_firsts: jax.Array  # uint32 [N, R]: each step's episode's first
  # step id (mod 2**32)
  episode_lasts: jax.Array  # uint32 [N, R]: by episode key, the id of the
  # episode's last step, once it ended
  current_keys: jax.Array  # int32 [N]: key of each env's newest episode
  current_firsts: jax.Array  # uint32 [N]: first step id of that episode
  episode_running: jax.Array  # bool [N]: the next step continues it

  def per_env_fields(self) -> tuple[str, ...]:
    """The sequence fields and each env's episode bookkeeping, which
    `joined` and `divided` move with its steps."""
    return super().per_env_fields() + _EPISODE_FIELDS

  def oldest_held_starts_an_episode(self) -> jax.Array:
    """Also where the ring wrapped at an episode's start: the oldest held
    step's id is its episode's first step id."""
    oldest_id = self.step_counts - self.steps_held.astype(jnp.uint32)
    first = jnp.take_along_axis(self.episode_firsts, self.oldest_held_slots()[:, None], axis=1)
    return super().oldest_held_starts_an_episode() | (
      (first[:, 0] == oldest_id) & (self.steps_held > 0)
    )


# The episode fields, one row per env `[N, ...]`.
_EPISODE_FIELDS = (
  "episode_keys",
  "episode_firsts",
  "episode_lasts",
  "current_keys",
  "current_firsts",
  "episode_running",
)


def _field(tree: Any, name: str) -> Any:
  if isinstance(tree, collections.abc.Mapping):
    return tree[name]
  return getattr(tree, name)


def check_step(example_step: PyTree) -> None:
  """Raises naming what is missing from a step of the GoalEnv stream."""
  for name in STEP_FIELDS:
    try:
      _field(example_step, name)
    except (KeyError, AttributeError):
      raise ValueError(
        f"hindsight_replay: the step has no field {name!r}; a step holds "
        f"{STEP_FIELDS} (obs a dict of {GOAL_KEYS})."
      ) from None
  obs = _field(example_step, "obs")
  if not isinstance(obs, collections.abc.Mapping) or any(key not in obs for key in GOAL_KEYS):
    given = sorted(obs) if isinstance(obs, collections.abc.Mapping) else (type(obs).__name__)
    raise ValueError(
      f"hindsight_replay: step obs must be a dict with keys "
      f"{GOAL_KEYS} (the GoalEnv layout), given {given}."
    )
  achieved = jax.tree.map(jnp.shape, obs["achieved_goal"])
  desired = jax.tree.map(jnp.shape, obs["desired_goal"])
  dtypes = [
    jax.tree.map(lambda leaf: str(validation.canonical_dtype(leaf)), obs[key])
    for key in ("achieved_goal", "desired_goal")
  ]
  if achieved != desired or dtypes[0] != dtypes[1]:
    raise ValueError(
      "hindsight_replay: obs['achieved_goal'] and "
      "obs['desired_goal'] must have the same shapes and "
      f"dtypes, given shapes {achieved} and {desired}, dtypes "
      f"{dtypes[0]} and {dtypes[1]}."
    )
  validation.check_reward_and_terminated(
    _field(example_step, "reward"), _field(example_step, "terminated"), what="hindsight_replay"
  )


def _check_two_goal_arguments(name: str, function: Callable) -> None:
  """Raises `TypeError` unless `function` can be called with two positional
  arguments, `(achieved_goal, desired_goal)`; a function whose signature
  cannot be read passes."""
  try:
    parameters = list(inspect.signature(function).parameters.values())
  except (TypeError, ValueError):
    return
  positional = [
    parameter
    for parameter in parameters
    if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
  ]
  required = [parameter.name for parameter in positional if parameter.default is parameter.empty]
  required += [
    parameter.name
    for parameter in parameters
    if parameter.kind is parameter.KEYWORD_ONLY and parameter.default is parameter.empty
  ]
  takes_more = any(parameter.kind is parameter.VAR_POSITIONAL for parameter in parameters)
  if len(required) > 2 or (len(positional) < 2 and not takes_more):
    raise TypeError(
      f"{name} is called as {name}(achieved_goal, desired_goal), on goal "
      f"leaves [S, ...] under jit, and returns one value per row; given a "
      f"function of ({', '.join(parameter.name for parameter in parameters)}). "
      "A gymnasium-robotics compute_reward(achieved_goal, desired_goal, info) "
      "is not called with an info (HER's goals have none): pass a function of "
      "the two goals written with jax.numpy, e.g. lambda achieved, desired: "
      "-(jnp.linalg.norm(achieved - desired, axis=-1) > 0.05).astype(jnp.float32)."
    )


def check_settings(
  num_envs: Any,
  capacity: Any,
  reward_fn: Any,
  strategy: Any,
  relabel_fraction: Any,
  terminated_fn: Any = None,
  gamma: Any = 0.99,
) -> None:
  """Raises naming the setting."""
  validation.check_hyperparameter(gamma, "gamma")
  if float(gamma) > 1:
    raise ValueError(f"gamma must be in [0, 1], given {gamma}.")
  validation.check_positive_int(num_envs, "num_envs")
  validation.check_capacity(capacity)
  if capacity % num_envs == 0 and capacity // num_envs < 2:
    raise ValueError(
      f"capacity {capacity} holds {capacity // num_envs} step per env; a "
      f"transition needs 2 steps: use capacity >= {2 * num_envs}."
    )
  sequence.check_sizes(num_envs, capacity, **_WINDOW_SIZES)
  if not callable(reward_fn):
    raise TypeError(
      f"reward_fn must be callable (achieved_goal, "
      f"desired_goal) -> reward, given "
      f"{type(reward_fn).__name__}."
    )
  if terminated_fn is not None and not callable(terminated_fn):
    raise TypeError(
      f"terminated_fn must be callable or None, given {type(terminated_fn).__name__}."
    )
  _check_two_goal_arguments("reward_fn", reward_fn)
  if terminated_fn is not None:
    _check_two_goal_arguments("terminated_fn", terminated_fn)
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, given {strategy!r}.")
  try:
    fraction = float(relabel_fraction)
  except (TypeError, ValueError):
    raise TypeError(
      f"relabel_fraction must be a real number in [0, 1], given {type(relabel_fraction).__name__}."
    ) from None
  if isinstance(relabel_fraction, bool) or not (math.isfinite(fraction) and 0 <= fraction <= 1):
    raise ValueError(f"relabel_fraction must be in [0, 1], given {relabel_fraction}.")


def init(example_step: PyTree, *, num_envs: int, capacity: int) -> HindsightReplayState:
  """An empty buffer for steps shaped like `example_step` (one env, unbatched).

  Args:
    example_step: a pytree with fields obs (a dict of "observation",
      "achieved_goal", "desired_goal"), action, reward (float scalar) and
      terminated (bool scalar): arrays or `jax.ShapeDtypeStruct` values.
    num_envs: N.
    capacity: C, steps over all envs, a multiple of N.
  """
  check_step(example_step)
  base = prioritized_sequence.init(example_step, num_envs=num_envs, capacity=capacity)
  per_env = capacity // num_envs
  return HindsightReplayState(
    **{name: getattr(base, name) for name in base.__dataclass_fields__},
    episode_keys=jnp.zeros((num_envs, per_env), jnp.int32),
    episode_firsts=jnp.zeros((num_envs, per_env), jnp.uint32),
    episode_lasts=jnp.zeros((num_envs, per_env), jnp.uint32),
    current_keys=jnp.zeros((num_envs,), jnp.int32),
    current_firsts=jnp.zeros((num_envs,), jnp.uint32),
    episode_running=jnp.zeros((num_envs,), bool),
  )


def record_episodes(
  state: HindsightReplayState,
  written: HindsightReplayState,
  mask: jax.Array,
  episode_end: jax.Array,
) -> HindsightReplayState:
  """`written` (`state` after its steps were written) with their episodes.

  Args:
    state: the buffer before the add.
    written: the buffer after `sequence.add_steps`.
    mask: bool `[N]`, the envs that stepped.
    episode_end: bool `[N, T]`, the chunk's episode ends.
  """
  num_envs, per_env = sequence.num_envs_of(state), sequence.steps_per_env(state)
  length = episode_end.shape[1]
  # The chunk's newest steps are the ones written (`add_steps`).
  chunk = sequence.chunk_slots(state, length, mask)
  dropped = chunk.dropped
  positions = jnp.arange(length, dtype=jnp.int32)[None, :]
  # A step starts an episode when the step before it ended one; the chunk's
  # first step, when no episode is running.
  starts = jnp.concatenate([~state.episode_running[:, None], episode_end[:, :-1]], axis=1)
  keys = (state.current_keys[:, None] + jnp.cumsum(starts, axis=1, dtype=jnp.int32)) % per_env
  ids = state.step_counts[:, None] + positions.astype(jnp.uint32)
  latest_start = jax.lax.cummax(jnp.where(starts, positions, -1), axis=1)
  firsts = jnp.where(
    latest_start >= 0,
    state.step_counts[:, None] + latest_start.astype(jnp.uint32),
    state.current_firsts[:, None],
  )
  write = chunk.write
  envs = jnp.arange(num_envs, dtype=jnp.int32)[:, None]
  # The kept steps' episodes are consecutive, at most R: distinct keys.
  end_rows = jnp.where(mask[:, None] & episode_end[:, dropped:], envs, num_envs)
  return written.replace(
    episode_keys=write(state.episode_keys, keys),
    episode_firsts=write(state.episode_firsts, firsts),
    episode_lasts=state.episode_lasts.at[end_rows, keys[:, dropped:]].set(
      ids[:, dropped:], mode="drop", unique_indices=True
    ),
    current_keys=jnp.where(mask, keys[:, -1], state.current_keys),
    current_firsts=jnp.where(mask, firsts[:, -1], state.current_firsts),
    episode_running=jnp.where(mask, ~episode_end[:, -1], state.episode_running),
  )


def write_steps(
  state: HindsightReplayState,
  steps: PyTree,
  mask: jax.Array | None,
  episode_end: jax.Array | None,
  *,
  new_leaf_value: jax.Array,
) -> HindsightReplayState:
  """Writes steps (`[N, ...]` or `[N, T, ...]`, T >= 1, episode ends
  resolved) as `sequence.add_steps` does, then records their episodes."""
  steps, mask, episode_end = sequence.chunked_add_args(state, steps, mask, episode_end)
  written = sequence.add_steps(
    state, steps, mask, episode_end, **TRANSITION_WINDOWS, new_leaf_value=new_leaf_value
  )
  return record_episodes(state, written, mask, episode_end)


def add(
  state: HindsightReplayState,
  steps: PyTree,
  mask: jax.Array | None = None,
  episode_end: jax.Array | None = None,
  final_steps: PyTree | None = None,
  *,
  alpha: float | None,
) -> HindsightReplayState:
  """Adds one step per env (`[N, ...]`) or a chunk (`[N, T, ...]`), and the
  final observations of the envs whose episode ended (`final_steps`).

  The same add as `jaxbuf.sequence.add` (one code path,
  `sequence.add_stream`); steps follow the stream convention,
  `help(jaxbuf.streams)`.

  Args:
    state: the buffer.
    steps: leaves `[N, *step_shape]` or `[N, T, *step_shape]`, checked
      while tracing as for `sequence.add`.
    mask: bool `[N]`, the envs that stepped (the others write nothing,
      final steps included); None for all.
    episode_end: for steps without a `last` leaf. Without `final_steps`:
      bool `[N]` for one step per env, `[N, T]` for a chunk, True on the
      step holding an episode's final observation. With `final_steps`:
      bool `[N]`, the envs whose episode ended after their last step in
      `steps`. None for none.
    final_steps: steps like `steps`, one per env `[N, ...]`: each env whose
      episode ended (its final step's `last`, else `episode_end`) writes its
      final step after its steps; the same state, byte for byte, as a
      second add of them masked to those envs. None for none.
    alpha: the priority exponent, None without priorities.
  """
  validation.check_state_kind(state, HindsightReplayState, what="add")
  new_leaf_value = (
    jnp.float32(1.0)
    if alpha is None
    else prioritized.capped_leaf_values(state.max_priority, alpha, state.window_tree)
  )
  return sequence.add_stream(
    state,
    steps,
    mask,
    episode_end,
    final_steps,
    write=functools.partial(write_steps, new_leaf_value=new_leaf_value),
  )


def goal_steps_ago(
  state: HindsightReplayState,
  window_ids: jax.Array,
  higher_bits: jax.Array,
  lower_bits: jax.Array,
  *,
  strategy: str,
) -> jax.Array:
  """For transitions `window_ids [S]`, a goal step drawn by `strategy`: how
  many steps before its env's newest it lies, int32 `[S]`.

  The goal step of transition t' is t' + 1, so the draw is over steps
  t + 1..E ("future"), E ("final") or t0 + 1..E ("episode"), E the
  episode's last held step, t0 its first held transition; `higher_bits`,
  `lower_bits` uint32 `[S]` are the random words (`random.scale_to_span`).
  """
  per_env = sequence.steps_per_env(state)
  envs, slots = window_ids // per_env, window_ids % per_env
  transition_ago = sequence.steps_ago(state, envs, slots)
  keys = state.episode_keys[envs, slots]
  newest = state.step_counts[envs] - jnp.uint32(1)
  running = state.episode_running[envs] & (keys == state.current_keys[envs])
  last_ago = jnp.where(running, 0, (newest - state.episode_lasts[envs, keys]).astype(jnp.int32))
  if strategy == "final":
    return last_ago
  if strategy == "future":
    latest_ago = transition_ago - 1
  else:
    first_ago = jnp.minimum(
      newest - state.episode_firsts[envs, slots], (state.steps_held[envs] - 1).astype(jnp.uint32)
    ).astype(jnp.int32)
    latest_ago = first_ago - 1
  # At least 1 for a sampleable transition; an empty buffer's garbage row
  # still draws in range.
  span = jnp.maximum(latest_ago - last_ago + 1, 1).astype(jnp.uint32)
  return last_ago + random.scale_to_span(higher_bits, lower_bits, span).astype(jnp.int32)


_TRACER_ERRORS = (
  jax.errors.TracerArrayConversionError,
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerBoolConversionError,
  jax.errors.TracerIntegerConversionError,
)


def _traced_call(name: str, function: Callable, achieved: PyTree, desired: PyTree) -> Any:
  """`function(achieved, desired)`, its tracer errors (NumPy, `float()`, a
  Python `if` on a goal) explained: it runs while `sample` is traced."""
  try:
    return function(achieved, desired)
  except _TRACER_ERRORS as error:
    raise TypeError(
      f"sample: {name} runs under jit, on traced achieved_goal and "
      f"desired_goal leaves [S, ...]: write it with jax.numpy (jnp.linalg."
      f"norm, jnp.where), not NumPy, float() or a Python if on the goals. "
      f"JAX said: {type(error).__name__}: "
      f"{str(error).splitlines()[0]}"
    ) from error


def _checked_output(name: str, value: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  if np.shape(value) != shape or validation.canonical_dtype(value) != dtype:
    raise ValueError(
      f"sample: {name} returned shape {np.shape(value)} dtype "
      f"{validation.canonical_dtype(value)}, expected shape {shape} dtype "
      f"{np.dtype(dtype)} (one per row, like the stored "
      f"{'reward' if name == 'reward_fn' else 'terminated'}); it is called "
      "on achieved_goal and desired_goal leaves [S, ...]."
    )
  return value


def uniform_transition_ids(
  state: HindsightReplayState, words: jax.Array, tree_key: jax.Array
) -> jax.Array:
  """Transition ids drawn uniformly over the transitions held: int32 `[S]`.

  Each row takes the first of `CANDIDATES` pairs of consecutive held steps
  drawn uniformly (`sequence.window_ids_at_ranks`, no tree) whose first step
  is no episode's final observation; the rare row with none descends the
  window tree instead, in a `lax.cond` taken only then. The result is exact:
  a row is a given transition with probability
  `(1 + q + ... + q**(k-1)) / W + q**k / V = 1 / V` (W pairs, V = W(1 - q)
  transitions, q the share of pairs that start at a final observation,
  k = `CANDIDATES`). With episodes of 50 steps (q = 1/51), about 1 batch of
  256 in 500 takes the tree.

  Args:
    state: the buffer.
    words: uint32 `[2 * CANDIDATES, S]` random words.
    tree_key: the key of the tree's draw, if it is needed.
  """
  per_env = sequence.steps_per_env(state)
  batch_size = words.shape[1]
  pairs = state.replace(window_counts=jnp.maximum(state.steps_held - 1, 0))

  def candidates():
    higher_bits, lower_bits = words.reshape(2, CANDIDATES * batch_size)
    span = jnp.maximum(jnp.sum(pairs.window_counts), 1).astype(jnp.uint32)
    ranks = random.scale_to_span(higher_bits, lower_bits, span).astype(jnp.int32)
    return sequence.window_ids_at_ranks(pairs, ranks, sequence_length=2, period=1).reshape(
      CANDIDATES, batch_size
    )

  drawn = random.computed_once(candidates, state.steps_held[0])
  starts_transition = ~state.episode_ends[drawn // per_env, drawn % per_env]
  first = jnp.argmax(starts_transition, axis=0)
  chosen = jnp.take_along_axis(drawn, first[None], axis=0)[0]
  found = jnp.any(starts_transition, axis=0)

  def redraw(chosen):
    from_tree, _ = sum_tree.sample_leaves(state.window_tree, tree_key, batch_size, stratified=False)
    return jnp.where(found, chosen, from_tree)

  return jax.lax.cond(jnp.all(found), lambda chosen: chosen, redraw, chosen)


class TransitionSteps(NamedTuple):
  """What a sample reads from the storage for transitions `[S]`: their steps
  and each one's hindsight goal, before the goals are applied
  (`relabelled_transitions`). Computed where the steps are held (on the
  owning device, under `jaxbuf.sharded`)."""

  obs: PyTree  # GoalEnv dict of the transition's step, leaves [S, ...]
  next_obs: PyTree  # the same dict of the next step, less "desired_goal"
  action: PyTree  # leaves [S, ...]
  reward: jax.Array  # [S], the stored reward
  terminated: jax.Array  # bool [S], the stored flag
  goal: PyTree  # "achieved_goal" of the goal step, leaves [S, ...]
  relabelled: jax.Array  # bool [S]: the row takes `goal` as its desired goal


def transition_rows(
  state: HindsightReplayState,
  window_ids: jax.Array,
  higher_bits: jax.Array,
  lower_bits: jax.Array,
  *,
  strategy: str,
) -> jax.Array:
  """Rows of the flattened storage `[N * R, ...]` that transitions
  `window_ids [S]` read: int32 `[3, S]`, each transition's step, next step
  and goal step (`goal_steps_ago`, with the random words given)."""
  per_env = sequence.steps_per_env(state)
  envs = window_ids // per_env
  at_end = window_ids % per_env == per_env - 1
  goal_slots = (
    state.write_heads[envs]
    - 1
    - goal_steps_ago(state, window_ids, higher_bits, lower_bits, strategy=strategy)
  ) % per_env
  return jnp.stack(
    [window_ids, window_ids + jnp.where(at_end, 1 - per_env, 1), envs * per_env + goal_slots]
  )


def gather_steps(
  state: HindsightReplayState,
  window_ids: jax.Array,
  words: jax.Array,
  *,
  strategy: str,
  relabel_fraction: float,
) -> TransitionSteps:
  """The steps and hindsight goals of transitions `window_ids [S]`.

  `words`: uint32 `[3, S]` random words, two for the goal step and one for
  whether the row is relabelled. The row numbers are computed once, before
  the gathers: fused into them, XLA would redo the goal draw for every
  element of every gathered row (`random.computed_once`).
  """
  higher_bits, lower_bits, relabel_bits = words
  num_rows = sequence.num_envs_of(state) * sequence.steps_per_env(state)
  rows = random.computed_once(
    lambda: transition_rows(state, window_ids, higher_bits, lower_bits, strategy=strategy),
    window_ids[0],
  )
  step_rows, next_rows, goal_rows = rows

  def gather(tree, at):
    return jax.tree.map(
      lambda column: (
        column.reshape((num_rows,) + column.shape[2:]).at[at].get(mode="promise_in_bounds")
      ),
      tree,
    )

  obs = dict(_field(state.storage, "obs"))
  # P(bits < threshold) = threshold / 2**32: the fraction to within 2**-32.
  if relabel_fraction >= 1:
    relabelled = jnp.ones(window_ids.shape, bool)
  else:
    relabelled = relabel_bits < np.uint32(int(relabel_fraction * 2**32))
  return TransitionSteps(
    obs=gather(obs, step_rows),
    next_obs=gather({key: value for key, value in obs.items() if key != "desired_goal"}, next_rows),
    action=gather(_field(state.storage, "action"), step_rows),
    reward=gather(_field(state.storage, "reward"), step_rows),
    terminated=gather(_field(state.storage, "terminated"), step_rows),
    goal=gather(obs["achieved_goal"], goal_rows),
    relabelled=relabelled,
  )


def relabelled_transitions(
  steps: TransitionSteps, *, reward_fn: Callable, terminated_fn: Callable | None, gamma: Any
) -> HindsightTransition:
  """Transitions from their steps, the relabelled rows given their goal:
  obs and next_obs carry it as "desired_goal", the reward is recomputed by
  `reward_fn` and, given `terminated_fn`, the discount by it (gamma, 0
  where terminated).

  Returns:
    `HindsightTransition` with `[S, ...]` leaves.
  """
  relabelled = steps.relabelled
  rows = lambda leaf: relabelled.reshape((-1,) + (1,) * (leaf.ndim - 1))
  desired = jax.tree.map(
    lambda goal, given: jnp.where(rows(goal), goal, given), steps.goal, steps.obs["desired_goal"]
  )
  next_obs = {**steps.next_obs, "desired_goal": desired}
  reward = _checked_output(
    "reward_fn",
    _traced_call("reward_fn", reward_fn, next_obs["achieved_goal"], desired),
    steps.reward.shape,
    steps.reward.dtype,
  )
  terminated = steps.terminated
  if terminated_fn is not None:
    terminated = jnp.where(
      relabelled,
      _checked_output(
        "terminated_fn",
        _traced_call("terminated_fn", terminated_fn, next_obs["achieved_goal"], desired),
        terminated.shape,
        jnp.bool_,
      ),
      terminated,
    )
  return HindsightTransition(
    obs={**steps.obs, "desired_goal": desired},
    action=steps.action,
    reward=jnp.where(relabelled, reward, steps.reward),
    discount=jnp.where(
      terminated, jnp.zeros((), steps.reward.dtype), jnp.asarray(gamma, steps.reward.dtype)
    ),
    next_obs=next_obs,
  )


def check_sample(
  state: HindsightReplayState, key: jax.Array, batch_size: int, *, checked: bool
) -> jax.Array:
  """Validates a sample's arguments; returns the transitions held, int32 `()`."""
  validation.check_state_kind(state, HindsightReplayState, what="sample")
  validation.check_key(key, what="sample")
  validation.check_batch_size(batch_size, what="sample")
  total = jnp.sum(state.window_counts)
  if checked:
    checkify.check(
      total > 0,
      "sample: the buffer holds no transition (two "
      "consecutive steps of one episode); add steps before "
      "sampling (guard with can_sample).",
    )
  return total


def sample(
  state: HindsightReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  reward_fn: Callable,
  strategy: str,
  relabel_fraction: float,
  terminated_fn: Callable | None = None,
  gamma: Any = 0.99,
  priorities: bool = False,
  beta: float | Schedule = 0.4,
  stratified: bool = True,
  checked: bool = False,
) -> HindsightSample:
  """Draws `batch_size` transitions and relabels a `relabel_fraction` of them.

  Transitions are drawn uniformly (or, with `priorities`, in proportion to
  `(priority + eps) ** alpha`, as `prioritized_sequence.sample`), with
  replacement. A relabelled row's obs and next_obs carry the hindsight goal
  as "desired_goal", its reward is `reward_fn(next_obs["achieved_goal"],
  desired_goal)` and, given `terminated_fn`, its discount is 0 where
  `terminated_fn` of the same is True. Every row's discount is the factor
  of its bootstrap: `gamma`, 0 where the transition terminated. With no
  transition held it returns transition 0 (whatever its slots hold) with
  weight 0; checked mode raises.

  Returns:
    A `HindsightSample`: items a `HindsightTransition` `[S, ...]`, indices
    int32 `[S]` (transition ids for `update_priorities`), weights float32
    `[S]`, item_ids uint32 `[S]`, relabelled bool `[S]`.
  """
  total = check_sample(state, key, batch_size, checked=checked)
  # Two keys by the unrolled hash (`random.fold_in`), not `jax.random.split`,
  # which on CPU is a loop of small kernels; and one call to the generator.
  draw_key, bits_key = random.fold_in(key, 0), random.fold_in(key, 1)
  # The words kept in a buffer (`random.computed_once`): fused, the hash was
  # recomputed for each of the N envs a rank is compared with, and for each
  # bookkeeping read of the goal draw (100 us of a 200 us sample at 1M).
  if priorities:
    window_ids, weights, _ = prioritized_sequence.draw_by_priority(
      state, draw_key, batch_size, total, beta=beta, stratified=stratified
    )
    words = random.computed_once(lambda: random.random_bits(bits_key, (3, batch_size)), total)
  else:
    words = random.computed_once(
      lambda: random.random_bits(bits_key, (2 * CANDIDATES + 3, batch_size)), total
    )
    window_ids = jnp.where(
      total > 0, uniform_transition_ids(state, words[: 2 * CANDIDATES], draw_key), 0
    )
    weights = jnp.full((batch_size,), total > 0, jnp.float32)
    words = words[2 * CANDIDATES :]
  steps = gather_steps(
    state, window_ids, words, strategy=strategy, relabel_fraction=relabel_fraction
  )
  return HindsightSample(
    items=relabelled_transitions(
      steps, reward_fn=reward_fn, terminated_fn=terminated_fn, gamma=gamma
    ),
    indices=window_ids,
    weights=weights,
    item_ids=sequence.window_item_ids(state, window_ids),
    relabelled=steps.relabelled,
  )


def update_priorities(
  state: HindsightReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  alpha: float | None,
  eps: float,
  checked: bool = False,
) -> HindsightReplayState:
  """Sets transition priorities (`prioritized_sequence.update_priorities`);
  without priorities (`alpha` None) the identity, arguments validated alike."""
  validation.check_state_kind(state, HindsightReplayState, what="update_priorities")
  if alpha is not None:
    return prioritized_sequence.update_priorities(
      state,
      indices,
      priorities,
      item_ids,
      **TRANSITION_WINDOWS,
      alpha=alpha,
      eps=eps,
      checked=checked,
    )
  if checked:
    sequence.valid_priority_updates(
      state, indices, priorities, item_ids, **TRANSITION_WINDOWS, checked=True
    )
  else:
    validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def clear(state: HindsightReplayState) -> HindsightReplayState:
  """Empties the buffer; the next step added starts an episode."""
  validation.check_state_kind(state, HindsightReplayState, what="clear")
  return prioritized_sequence.clear(state).replace(
    episode_running=jnp.zeros_like(state.episode_running)
  )
