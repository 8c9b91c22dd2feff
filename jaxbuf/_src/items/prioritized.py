"""Proportional prioritized replay (Schaul et al., 2016) over a sum tree.

Shape key: B add batch, S sample size, C capacity.

Item i is drawn with probability `p_i ** alpha / sum_j p_j ** alpha`, where
`p_i = priority_i + eps`. Importance weights are `(N * P(i)) ** -beta` divided
by the largest in the sample, so the largest weight is 1. New items enter at
the running maximum priority, so each is likely to be seen at least once.

The module-level functions take every setting explicitly;
`prioritized_replay` binds them into a `Buffer`.
"""

import functools
from typing import Any, Self
import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxbuf._src.core import kind
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import ring
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree, ReplaySample, Schedule, bind
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.storage import placed
from jaxbuf._src.storage import tiers


_INT32_MAX = jnp.iinfo(jnp.int32).max


@flax.struct.dataclass
class PrioritizedReplayState(ReplayState):
  """A `ReplayState` with priorities. Fields below add to the ring's."""

  sum_tree: sum_tree.SumTree  # leaves: (priority + eps) ** alpha per slot, 0 if empty
  max_priority: jax.Array  # shape=(), float32: largest priority + eps seen
  beta_step: jax.Array  # shape=(), int32: update_priorities calls so far
  # (saturating); the step fed to a beta schedule

  def joined(self) -> Self:
    """`ReplayState.joined`, each leaf's priority moved with its item."""
    num_devices, per_device = (
      self.insert_position.shape[0],
      ring.capacity_of(jax.tree.map(lambda leaf: leaf[0], self.storage)),
    )
    ring.require_equal_on_every_device(self.beta_step, "beta_step")
    leaves = sum_tree.leaves(self.sum_tree)[:, :per_device]
    return (
      super()
      .joined()
      .replace(
        sum_tree=sum_tree.from_leaves(jnp.swapaxes(leaves, 0, 1).reshape(num_devices * per_device)),
        max_priority=jnp.max(self.max_priority),
        beta_step=self.beta_step[0],
      )
    )

  def divided(self, num_devices: int) -> Self:
    """`ReplayState.divided`, each leaf's priority moved with its item."""
    capacity = ring.capacity_of(self.storage)
    turn = jnp.where(self.size == capacity, self.insert_position, 0)
    leaves = jnp.roll(sum_tree.leaves(self.sum_tree)[:capacity], -turn)
    per_device = lambda value: jnp.full((num_devices,), value)
    return (
      super()
      .divided(num_devices)
      .replace(
        sum_tree=jax.vmap(sum_tree.from_leaves)(
          jnp.swapaxes(leaves.reshape(capacity // num_devices, num_devices), 0, 1)
        ),
        max_priority=per_device(self.max_priority),
        beta_step=per_device(self.beta_step),
      )
    )


def init(example_item: PyTree, *, capacity: int) -> PrioritizedReplayState:
  """An empty prioritized buffer for items shaped like `example_item`."""
  validation.check_capacity(capacity)
  return PrioritizedReplayState(
    **ring.init_ring(example_item, capacity),
    sum_tree=sum_tree.init(capacity),
    max_priority=jnp.ones((), jnp.float32),
    beta_step=jnp.zeros((), jnp.int32),
  )


def capped_leaf_values(priorities: jax.Array, alpha: float, tree: sum_tree.SumTree) -> jax.Array:
  """`priorities ** alpha` as leaf values the tree can hold (`sum_tree.capped`)."""
  return sum_tree.capped(priorities**alpha, tree)


def add(state: PrioritizedReplayState, items: PyTree, *, alpha: float) -> PrioritizedReplayState:
  """Adds `items [B, ...]` in ring order at the running maximum priority."""
  validation.check_state_kind(state, PrioritizedReplayState, what="add")
  state, slots = ring.add_to_ring(state, items)
  tree, _ = sum_tree.write_leaves(
    state.sum_tree,
    slots,
    state.max_priority,
    unique_indices=True,
    leaf_values=lambda priority: capped_leaf_values(priority, alpha, state.sum_tree),
  )
  return state.replace(sum_tree=tree)


def beta_at(beta: float | Schedule, step: jax.Array, *, checked: bool = False) -> jax.Array:
  """`beta`, or the schedule's value at `step`: float32 `()`.

  A schedule value that is NaN, infinite or negative would make every
  importance weight NaN or meaningless; it is replaced by 1 (full correction),
  and in checked mode it raises.
  """
  value = jnp.asarray(beta(step) if callable(beta) else beta, jnp.float32)
  usable = jnp.isfinite(value) & (value >= 0)
  if checked:
    checkify.check(
      usable,
      "sample: the beta schedule returned {beta} at "
      "step {step}; beta must be finite and non-negative.",
      beta=value,
      step=step,
    )
  return jnp.where(usable, value, 1.0)


def sample(
  state: PrioritizedReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  beta: float | Schedule,
  stratified: bool = True,
  checked: bool = False,
) -> ReplaySample:
  """Draws `batch_size` items in proportion to `priority ** alpha`.

  With `stratified`, `[0, total)` is cut into S equal strata and one target is
  drawn in each: the same marginal probabilities, less variance. The strata
  come in a random order, so every position of the batch (and any prefix or
  block of rows) is distributed as the whole batch is. Should every priority underflow to zero,
  sampling falls back to uniform over the items held with weights 1; on an
  empty buffer it returns slot 0 with weight 0 (checked mode raises).

  Returns:
    A `ReplaySample`: items `[S, ...]`, indices int32 `[S]`, weights float32
    `[S]` (largest 1), item_ids uint32 `[S]`.
  """
  validation.check_state_kind(state, PrioritizedReplayState, what="sample")
  validation.check_sample_args(state.size, key, batch_size, checked=checked)
  # One draw serves the descent and the uniform fallback of an all-zero
  # tree (every priority underflowed): no cond, which on a GPU would copy
  # its predicate to the host.
  drawn = sum_tree.draw_leaves(
    state.sum_tree, key, batch_size, stratified=stratified, fallback_size=state.size
  )
  has_mass = drawn.total > 0
  indices = drawn.indices
  # (N * P(i)) ** -beta over its largest in the sample is
  # (smallest leaf drawn / leaf i) ** beta: N and the total cancel.
  beta_now = beta_at(beta, state.beta_step, checked=checked)
  weights = jnp.where(
    has_mass,
    (drawn.smallest / jnp.where(has_mass, drawn.values, 1.0)) ** beta_now,
    (state.size > 0).astype(jnp.float32),
  )
  return ReplaySample(
    items=ring.gather(state.storage, indices),
    indices=indices,
    weights=weights,
    item_ids=ring.current_item_ids(state, indices),
  )


def update_priorities(
  state: PrioritizedReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  alpha: float,
  eps: float,
  checked: bool = False,
) -> PrioritizedReplayState:
  """Sets the priorities of slots `indices [S]` to `|priorities [S]| + eps`.

  The magnitude is what proportional prioritization ranks by, so signed TD
  errors may be passed as they are: -2 and 2 give the same priority.
  Duplicate indices: the last valid occurrence wins. Updates whose index is
  not an item held, whose priority is NaN or infinite, or (given `item_ids`,
  e.g. `sample.item_ids`) whose slot was overwritten since it was sampled,
  are skipped and leave that slot as it was; checked mode raises on the
  first two, and on a negative priority. Leaf values are capped
  (`capped_leaf_values`) so that the total stays finite. Cost O(S log C).
  """
  validation.check_state_kind(state, PrioritizedReplayState, what="update_priorities")
  return updated_priorities(
    state, indices, priorities, item_ids, alpha=alpha, eps=eps, checked=checked
  )


def updated_priorities(
  state: PrioritizedReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  alpha: float,
  eps: float,
  checked: bool = False,
  kept_out: jax.Array | None = None,
) -> PrioritizedReplayState:
  """`update_priorities`, leaving the leaves of entries with `kept_out`
  (bool `[S]`) as they are; their priorities still count toward the running
  maximum (a budgeted buffer's retired items, which stay retired)."""
  indices = jnp.asarray(validation.host_indices(indices))
  priorities = jnp.asarray(priorities)
  valid = ring.valid_priority_updates(state, indices, priorities, item_ids, checked=checked)
  indices = indices.astype(jnp.int32)
  new_priorities = jnp.where(valid, jnp.abs(priorities.astype(jnp.float32)) + eps, 0.0)
  # The leaves, from the priorities, and the running maximum come from the
  # write (one kernel on a GPU); an empty update leaves the maximum as it is.
  tree, max_priority = sum_tree.write_leaves(
    state.sum_tree,
    indices,
    new_priorities,
    valid if kept_out is None else valid & ~kept_out,
    largest_of=(state.max_priority, new_priorities),
    leaf_values=lambda priority: capped_leaf_values(priority, alpha, state.sum_tree),
  )
  return state.replace(
    sum_tree=tree,
    max_priority=max_priority,
    beta_step=jnp.minimum(state.beta_step, _INT32_MAX - 1) + 1,
  )


def clear(state: PrioritizedReplayState) -> PrioritizedReplayState:
  """Empties the buffer without reallocating; priorities reset, beta_step kept."""
  validation.check_state_kind(state, PrioritizedReplayState, what="clear")
  return state.replace(
    insert_position=jnp.zeros_like(state.insert_position),
    size=jnp.zeros_like(state.size),
    sum_tree=jax.tree.map(jnp.zeros_like, state.sum_tree),
    max_priority=jnp.ones_like(state.max_priority),
  )


def prioritized_replay(
  capacity: int,
  *,
  alpha: float = 0.6,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  stratified: bool = True,
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[PrioritizedReplayState, ReplaySample]:
  """A proportional prioritized replay buffer holding up to `capacity` items.

  Args:
    capacity: C, a Python int.
    alpha: priority exponent; 0 is uniform.
    beta: importance-weight exponent, a float or a schedule `step -> beta`
      (an optax schedule works) evaluated at `state.beta_step`, the number of
      `update_priorities` calls so far (one per learner step).
    eps: added to every priority so that none is zero.
    stratified: draw one target per equal stratum of the total priority.
    checked: as for `uniform_replay`.
    storage: where the payload leaves live: "device" (the default), "host"
      (pinned host memory) or `jaxbuf.disk(directory)` (files); bookkeeping
      stays on the device. See docs/guides/storage.md.

  Returns:
    A `Buffer` with the same functions as `uniform_replay`'s.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.prioritized_replay(1000, alpha=0.6, beta=0.4)
  >>> state = buffer.init({"obs": jnp.zeros(4)})
  >>> state = buffer.add(state, {"obs": jnp.ones((8, 4))})
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> state = buffer.update_priorities(state, batch.indices,
  ...                                  jnp.array([0.1, 2.0, 0.5, 1.0]),
  ...                                  batch.item_ids)
  >>> float(batch.weights.max())
  1.0
  """
  validation.check_capacity(capacity)
  validation.check_bool(stratified, "stratified", what="prioritized_replay")
  validation.check_hyperparameter(alpha, "alpha")
  validation.check_hyperparameter(eps, "eps", positive=True)
  if not callable(beta):
    validation.check_hyperparameter(beta, "beta (or a schedule)")
  bound_add = functools.partial(add, alpha=alpha)
  split = functools.partial(
    ring.split_over_devices,
    capacity=capacity,
    init=init,
    add=bound_add,
    sample=functools.partial(sample, beta=beta, stratified=stratified),
    update_priorities=functools.partial(update_priorities, alpha=alpha, eps=eps),
    clear=clear,
    beta=beta,
    stratified=stratified,
    masses=lambda local: local.sum_tree,
  )
  buffer = bind(
    init=functools.partial(init, capacity=capacity),
    add=bound_add,
    sample=functools.partial(sample, beta=beta, stratified=stratified, checked=checked),
    update_priorities=functools.partial(update_priorities, alpha=alpha, eps=eps, checked=checked),
    can_sample=ring.can_sample,
    clear=clear,
    kind=kind.Kind(
      name="prioritized_replay",
      state_type=PrioritizedReplayState,
      exact_type=False,
      settings=kind.settings_of(capacity=capacity, alpha=float(alpha), eps=float(eps)),
      split=split,
    ),
    checked=checked,
  )
  return placed.place(buffer, storage, kind_name="prioritized_replay", layout=tiers.ITEMS)
