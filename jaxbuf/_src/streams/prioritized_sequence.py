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
the number of sampleable windows.

The module-level functions take every setting explicitly;
`prioritized_sequence_replay` binds them into a `Buffer`.
"""

import functools
from typing import Any, Self, TypeVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxbuf._src.core import kind
from jaxbuf._src.items import prioritized
from jaxbuf._src.streams import sequence
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree, Schedule, bind
from jaxbuf._src.streams.sequence import SequenceReplayState, SequenceSample

_INT32_MAX = jnp.iinfo(jnp.int32).max


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
  return with_window_priorities(state, indices, priorities, valid, alpha=alpha, eps=eps)


def with_window_priorities(
  state: PyTree,
  indices: jax.Array,
  priorities: jax.Array,
  valid: jax.Array,
  *,
  alpha: float,
  eps: float,
) -> PyTree:
  """`state` with windows `indices [S]` at `|priorities [S]| + eps` where
  `valid [S]`: its window tree, running maximum and beta step updated (for
  every kind whose state holds those three, frame stacks included)."""
  indices = jnp.asarray(indices).astype(jnp.int32)
  new_priorities = jnp.where(valid, jnp.abs(jnp.asarray(priorities).astype(jnp.float32)) + eps, 0.0)
  return state.replace(
    window_tree=sum_tree.set_leaves(
      state.window_tree,
      jnp.where(valid, indices, 0),
      prioritized.capped_leaf_values(new_priorities, alpha, state.window_tree),
      valid,
    ),
    # `initial`: an empty update leaves the maximum as it is.
    max_priority=jnp.maximum(state.max_priority, jnp.max(new_priorities, initial=0.0)),
    beta_step=jnp.minimum(state.beta_step, _INT32_MAX - 1) + 1,
  )


def clear(state: PrioritizedStateT) -> PrioritizedStateT:
  """Empties the buffer; priorities reset, beta_step and step counts kept."""
  validation.check_state_kind(state, PrioritizedSequenceReplayState, what="clear")
  return sequence.clear(state).replace(max_priority=jnp.ones_like(state.max_priority))


def prioritized_sequence_replay(
  num_envs: int,
  capacity: int,
  sequence_length: int,
  *,
  period: int = 1,
  alpha: float = 0.6,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  episodes: str = "cross",
  stratified: bool = True,
  checked: bool = False,
) -> Buffer[PrioritizedSequenceReplayState, SequenceSample]:
  """A prioritized replay buffer of per-env streams, sampled as windows.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs, capacity, sequence_length, period, episodes: as for
      `sequence_replay`, which also describes the stream: the step's `last`
      leaf marks episode ends (the step holding an episode's final
      observation, added as `add(..., final_steps=...)`; `terminated` sits
      on the step whose action ended the episode).
    alpha, beta, eps, stratified: as for `prioritized_replay`; N in the
      importance weights is the number of windows that can be sampled.
    checked: as for `uniform_replay`.

  Returns:
    A `Buffer` with the same functions as `sequence_replay`'s; pass
    `sample.indices` and `sample.item_ids` to `update_priorities`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.prioritized_sequence_replay(
  ...     num_envs=2, capacity=16, sequence_length=3, period=2)
  >>> state = buffer.init({"obs": jnp.zeros(4)})
  >>> state = buffer.add(state, {"obs": jnp.ones((2, 6, 4))})  # a chunk of 6
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> state = buffer.update_priorities(state, batch.indices,
  ...                                  jnp.array([0.1, 2.0, 0.5, 1.0]),
  ...                                  batch.item_ids)
  >>> batch.items["obs"].shape, float(batch.weights.max())
  ((4, 3, 4), 1.0)
  """
  sequence.check_sizes(num_envs, capacity, sequence_length, period, episodes)
  validation.check_bool(stratified, "stratified", what="prioritized_sequence_replay")
  validation.check_hyperparameter(alpha, "alpha")
  validation.check_hyperparameter(eps, "eps", positive=True)
  if not callable(beta):
    validation.check_hyperparameter(beta, "beta")
  settings: dict[str, Any] = dict(
    sequence_length=sequence_length, period=period, within=episodes == "within"
  )
  bound_add = functools.partial(add, **settings, alpha=alpha)
  split = functools.partial(
    sequence.split_over_devices,
    num_envs=num_envs,
    capacity=capacity,
    init=init,
    add=bound_add,
    sample=functools.partial(
      sample, sequence_length=sequence_length, beta=beta, stratified=stratified
    ),
    update_priorities=functools.partial(update_priorities, **settings, alpha=alpha, eps=eps),
    clear=clear,
    beta=beta,
    stratified=stratified,
    **settings,
  )
  return bind(
    init=functools.partial(init, num_envs=num_envs, capacity=capacity),
    add=bound_add,
    sample=functools.partial(
      sample, sequence_length=sequence_length, beta=beta, stratified=stratified, checked=checked
    ),
    update_priorities=functools.partial(
      update_priorities, **settings, alpha=alpha, eps=eps, checked=checked
    ),
    can_sample=sequence.can_sample,
    clear=clear,
    kind=kind.Kind(
      name="prioritized_sequence_replay",
      state_type=PrioritizedSequenceReplayState,
      exact_type=True,
      settings=sequence.window_settings(
        num_envs, capacity, sequence_length, period, episodes, alpha=float(alpha), eps=float(eps)
      ),
      split=split,
    ),
    checked=checked,
  )
