"""Prioritized sequence replay: windows drawn in proportion to priority ** alpha.

Shape key: N envs, R = C // N steps held per env, C capacity, T steps per
env in one add, L sequence_length, S sample size.

The streams, windows, episodes and counters are those of `sequence.py`. A
sum tree has one leaf per window id `n * R + j` (the window starting at slot
j of env n): `(priority + eps) ** alpha` while the window can be sampled,
0 otherwise. A window enters at the running maximum priority when it becomes
complete (its last step is written), and its leaf drops to 0 in the same add
that overwrites its first step. Windows that never start on a multiple of
`period`, or that cross an episode end under `episodes="within"`, keep leaf 0.
Importance weights and stratification are those of `prioritized.py`, with N
the number of sampleable windows. Priority updates follow the rules of every
stream kind (`window_priorities.py`).

The module-level functions take every setting explicitly;
`prioritized_sequence_replay` (`factories.py`) binds them into a `Buffer`.
"""

import functools
from typing import Self, TypeVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxbuf._src.items import prioritized
from jaxbuf._src.streams import sequence
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.streams import window_priorities
from jaxbuf._src.core.base import PyTree, Schedule
from jaxbuf._src.streams.sequence import SequenceReplayState, SequenceSample


@flax.struct.dataclass
class PrioritizedSequenceReplayState(SequenceReplayState):
  """A `SequenceReplayState` whose `window_tree` holds priorities."""

  window_tree: sum_tree.SumTree  # leaves [N * R]: always present here
  max_priority: jax.Array  # shape=(), float32: largest priority + eps seen
  beta_step: jax.Array  # shape=(), int32: update_priorities calls so far
  # (saturating); the step fed to a beta schedule

  def joined(self) -> Self:
    """`SequenceReplayState.joined`, with the devices' shared counters."""
    return (
      super()
      .joined()
      .replace(max_priority=jnp.max(self.max_priority), beta_step=jnp.max(self.beta_step))
    )

  def divided(self, num_devices: int) -> Self:
    """`SequenceReplayState.divided`, every device given the counters."""
    per_device = lambda value: jnp.full((num_devices,), value)
    return (
      super()
      .divided(num_devices)
      .replace(max_priority=per_device(self.max_priority), beta_step=per_device(self.beta_step))
    )


# A prioritized sequence state or a subclass (hindsight, frame stacks).
PrioritizedStateT = TypeVar("PrioritizedStateT", bound=PrioritizedSequenceReplayState)


def init(example_step: PyTree, *, num_envs: int, capacity: int) -> PrioritizedSequenceReplayState:
  """An empty buffer for steps shaped like `example_step` (one env, unbatched)."""
  base = sequence.init(example_step, num_envs=num_envs, capacity=capacity, with_tree=True)
  return PrioritizedSequenceReplayState(
    **{name: getattr(base, name) for name in base.__dataclass_fields__},
    max_priority=jnp.ones((), jnp.float32),
    beta_step=jnp.zeros((), jnp.int32),
  )


def add(
  state: PrioritizedSequenceReplayState,
  steps: PyTree,
  mask: jax.Array | None = None,
  episode_end: jax.Array | None = None,
  final_steps: PyTree | None = None,
  *,
  sequence_length: int,
  period: int,
  within: bool,
  alpha: float,
) -> PrioritizedSequenceReplayState:
  """`sequence.add`; windows completed enter at the running maximum priority.

  Episode ends: the step's own bool `last` leaf when it has one (then
  `episode_end` must not be given), else `episode_end`; final observations
  go in the same add as `final_steps`, written where their `last` is True
  (or, for steps without one, where `episode_end` `[N]` is).
  See `jaxbuf.sequence.add` for the stream convention and an example.
  """
  validation.check_state_kind(state, PrioritizedSequenceReplayState, what="add")
  return sequence.add_stream(
    state,
    steps,
    mask,
    episode_end,
    final_steps,
    write=functools.partial(
      sequence.add_steps,
      sequence_length=sequence_length,
      period=period,
      within=within,
      new_leaf_value=prioritized.capped_leaf_values(state.max_priority, alpha, state.window_tree),
    ),
  )


def sample(
  state: PrioritizedSequenceReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  sequence_length: int,
  beta: float | Schedule,
  stratified: bool = True,
  checked: bool = False,
) -> SequenceSample:
  """Draws `batch_size` windows in proportion to `(priority + eps) ** alpha`.

  With `stratified`, one target in each of S equal strata of the total, the
  strata in a random order (any prefix or block of rows is a fair sample).
  With no complete window held, or should every leaf underflow to zero, it
  returns window 0 with weight 0 and `mask` all False; checked mode raises
  when no window is held.

  Returns:
    A `SequenceSample`: items `[S, L, ...]`, indices int32 `[S]` (window
    ids), weights float32 `[S]` (largest 1), item_ids uint32 `[S]`, mask
    bool `[S, L]`.
  """
  validation.check_state_kind(state, PrioritizedSequenceReplayState, what="sample")
  num_windows = sequence.check_sample(state, key, batch_size, checked=checked)
  window_ids, weights, has_mass = draw_by_priority(
    state, key, batch_size, num_windows, beta=beta, stratified=stratified
  )
  items, mask = sequence.gather_windows(state, window_ids, sequence_length=sequence_length)
  return SequenceSample(
    items=items,
    indices=window_ids,
    weights=weights,
    item_ids=sequence.window_item_ids(state, window_ids),
    mask=mask & has_mass,
  )


def draw_by_priority(
  state: PrioritizedSequenceReplayState,
  key: jax.Array,
  batch_size: int,
  num_held: jax.Array,
  *,
  beta: float | Schedule,
  stratified: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Ids `[S]` drawn from `state.window_tree` in proportion to their leaves,
  their importance weights `(N P(i)) ** -beta` normalised to a largest of 1
  (N = `num_held`), and whether the tree holds any mass: bool `()`. With no
  mass, id 0 with weight 0. Shared by the kinds whose tree is over window or
  transition ids (sequence and frame-stack replay)."""
  found, leaf_values = sum_tree.sample_leaves(
    state.window_tree, key, batch_size, stratified=stratified
  )
  total = sum_tree.total(state.window_tree)
  has_mass = total > 0
  log_weights = -prioritized.beta_at(beta, state.beta_step) * jnp.log(
    num_held.astype(jnp.float32) * (leaf_values / total)
  )
  weights = jnp.where(has_mass, jnp.exp(log_weights - jnp.max(log_weights)), 0.0)
  return jnp.where(has_mass, found, 0), weights, has_mass


def update_priorities(
  state: PrioritizedStateT,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  sequence_length: int,
  period: int,
  within: bool,
  alpha: float,
  eps: float,
  checked: bool = False,
) -> PrioritizedStateT:
  """Sets the priorities of windows `indices [S]` to `priorities [S] + eps`.

  Duplicate ids: the last valid occurrence wins. Entries are skipped (the
  window keeps its priority) when the id names no window that can be sampled
  now, the priority is NaN or infinite, or (given `item_ids`, e.g.
  `sample.item_ids`) the window's first step was overwritten since it was
  sampled; a negative priority applies by its magnitude (a signed TD error
  means its absolute value). Checked mode raises on ids outside `[0, C)` and on
  priorities that are not finite or are negative.
  Cost O(S log C).
  """
  validation.check_state_kind(state, PrioritizedSequenceReplayState, what="update_priorities")
  valid = sequence.valid_priority_updates(
    state,
    indices,
    priorities,
    item_ids,
    sequence_length=sequence_length,
    period=period,
    within=within,
    checked=checked,
  )
  return window_priorities.with_window_priorities(
    state, indices, priorities, valid, alpha=alpha, eps=eps
  )


def clear(state: PrioritizedStateT) -> PrioritizedStateT:
  """Empties the buffer; priorities reset, beta_step and step counts kept."""
  validation.check_state_kind(state, PrioritizedSequenceReplayState, what="clear")
  return sequence.clear(state).replace(max_priority=jnp.ones_like(state.max_priority))
