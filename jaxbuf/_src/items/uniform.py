"""Uniform replay: every item held is equally likely to be sampled.

Shape key: B add batch, S sample size, C capacity.

The module-level functions take every setting explicitly; `uniform_replay`
binds them into a `Buffer`.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxbuf._src.core import kind
from jaxbuf._src.core import random
from jaxbuf._src.core import ring
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree, ReplaySample, bind
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.storage import placed
from jaxbuf._src.storage import tiers


def init(example_item: PyTree, *, capacity: int) -> ReplayState:
  """An empty buffer for items shaped like `example_item` (unbatched).

  Args:
    example_item: any pytree of arrays (or `jax.ShapeDtypeStruct` values); only
      shapes and dtypes are read.
    capacity: C, the number of items held before the oldest is overwritten.

  Returns:
    A `ReplayState` with storage `[C, *leaf.shape]`, each leaf's dtype kept.
  """
  validation.check_capacity(capacity)
  return ReplayState(**ring.init_ring(example_item, capacity))


def add(state: ReplayState, items: PyTree) -> ReplayState:
  """Adds `items [B, ...]` in ring order, overwriting the oldest first.

  B may exceed C: the newest C items are kept. Shapes, dtypes and structure
  are checked while tracing; no value is cast.
  """
  validation.check_state_kind(state, ReplayState, what="add", exact=True)
  state, _ = ring.add_to_ring(state, items)
  return state


def sample(
  state: ReplayState, key: jax.Array, batch_size: int, *, checked: bool = False
) -> ReplaySample:
  """Draws `batch_size` items uniformly, with replacement, from those held.

  Sampling an empty buffer returns slot 0 (whatever it holds) with weight 0, so
  a weighted loss ignores it; in checked mode it raises instead.

  Returns:
    A `ReplaySample`: items `[S, ...]`, indices int32 `[S]`, weights float32
    `[S]` (1, or 0 when empty), item_ids uint32 `[S]`.
  """
  validation.check_state_kind(state, ReplayState, what="sample", exact=True)
  validation.check_sample_args(state.size, key, batch_size, checked=checked)
  indices = random.uniform_indices(key, state.size, batch_size)
  weights = jnp.full((batch_size,), state.size > 0, jnp.float32)
  return ReplaySample(
    items=ring.gather(state.storage, indices),
    indices=indices,
    weights=weights,
    item_ids=ring.current_item_ids(state, indices),
  )


def sample_eligible(
  state: ReplayState, key: jax.Array, batch_size: int, eligible: jax.Array
) -> ReplaySample:
  """Draws `batch_size` items uniformly, with replacement, from those held
  that are `eligible`.

  The replay service's `max_version_lag` draws with it (eligible: the slots
  whose policy version is recent enough). Exact in integers: a uniform
  count in `[0, E)` located by a search of the eligible counts' running sum,
  so an ineligible slot is never drawn; O(C) per call. With no eligible
  item held, slot 0 comes back with weight 0, as from an empty buffer.

  Args:
    state: an item replay state.
    key: a PRNG key.
    batch_size: S, a Python int.
    eligible: bool `[C]`, the slots that may be drawn.

  Returns:
    A `ReplaySample` as `sample` returns it.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(4)
  >>> state = buffer.add(buffer.init(jnp.float32(0)), jnp.arange(4.0))
  >>> eligible = jnp.array([False, False, True, True])
  >>> batch = jaxbuf.uniform.sample_eligible(state, jax.random.key(0), 8, eligible)
  >>> bool(jnp.all(batch.items >= 2))
  True
  """
  # Exact: a queue's or heap's state is a ReplayState too, but a uniform
  # draw from it would neither hand its items out nor follow its order.
  validation.check_state_kind(state, ReplayState, what="sample_eligible", exact=True)
  validation.check_sample_args(state.size, key, batch_size, checked=False)
  capacity = ring.capacity_of(state.storage)
  if jnp.shape(eligible) != (capacity,):
    raise ValueError(
      f"sample_eligible: eligible must be bool [{capacity}]; given {jnp.shape(eligible)}."
    )
  held = jnp.arange(capacity) < state.size
  counts = jnp.cumsum((held & eligible).astype(jnp.int32))
  total = counts[-1]
  draws = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1))
  indices = jnp.minimum(jnp.searchsorted(counts, draws, side="right"), capacity - 1)
  indices = jnp.where(total > 0, indices, 0).astype(jnp.int32)
  return ReplaySample(
    items=ring.gather(state.storage, indices),
    indices=indices,
    weights=jnp.full((batch_size,), total > 0, jnp.float32),
    item_ids=ring.current_item_ids(state, indices),
  )


def epoch_batches(state: ReplayState, key: jax.Array, batch_size: int) -> ReplaySample:
  """Every item held exactly once, in a random order: batches `[M, S, ...]`.

  Sampling without replacement, for a pass over the buffer (offline RL,
  evaluation): the items held, in a uniformly random permutation, cut into
  M = ceil(C / S) batches of S. Shapes depend on the capacity only, so the
  result scans and vmaps; positions past the items held are padding, marked
  by weight 0. Works on the state of either item replay kind (prioritized
  priorities play no part in a pass).

  The items are gathered all at once: M * S rows, a copy of the storage.
  For a buffer too large for that, gather inside your scan from
  `epoch.indices` instead (`jax.tree.map(lambda x: x[indices], state.storage)`).

  Args:
    state: a `ReplayState` (or `PrioritizedReplayState`).
    key: a PRNG key.
    batch_size: S, a Python int.

  Returns:
    A `ReplaySample` whose leaves have a leading axis M: items `[M, S, ...]`;
    indices int32 `[M, S]`, each slot holding an item once, padding C
    (outside the items held, so `update_priorities` skips it, though checked
    mode raises: mask it out); weights float32 `[M, S]`, 1 for an item and 0
    for padding; item_ids uint32 `[M, S]`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(10)
  >>> state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(7, dtype=jnp.int32))
  >>> epoch = jaxbuf.epoch_batches(state, jax.random.key(0), 4)
  >>> epoch.items.shape, epoch.weights.sum().item()
  ((3, 4), 7.0)
  >>> sorted(epoch.items[epoch.weights > 0].tolist())
  [0, 1, 2, 3, 4, 5, 6]
  """
  validation.check_state_kind(state, ReplayState, what="epoch_batches")
  validation.check_key(key, what="epoch_batches")
  validation.check_batch_size(batch_size, what="epoch_batches")
  capacity = ring.capacity_of(state.storage)
  num_batches = -(-capacity // batch_size)
  order = random.permutation_of_first(key, capacity, state.size)
  order = jnp.pad(order, (0, num_batches * batch_size - capacity))
  held = jnp.arange(order.shape[0], dtype=jnp.int32) < state.size
  slots = jnp.where(held, order, 0)
  indices = jnp.where(held, order, capacity)
  return jax.tree.map(
    lambda leaf: leaf.reshape(num_batches, batch_size, *leaf.shape[1:]),
    ReplaySample(
      items=ring.gather(state.storage, slots),
      indices=indices,
      weights=held.astype(jnp.float32),
      item_ids=jnp.where(held, ring.current_item_ids(state, slots), jnp.uint32(0)),
    ),
  )


def update_priorities(
  state: ReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  checked: bool = False,
) -> ReplayState:
  """The identity: uniform replay keeps no priorities.

  Arguments are still validated as for prioritized replay (shapes while
  tracing; values in checked mode), so switching buffer kinds surfaces no new
  errors. Unchecked, only shapes and dtypes are read, so the bound function
  needs no jit and a Python-loop call costs no dispatch.
  """
  validation.check_state_kind(state, ReplayState, what="update_priorities", exact=True)
  if checked:
    ring.valid_priority_updates(
      state,
      jnp.asarray(validation.host_indices(indices)),
      jnp.asarray(priorities),
      item_ids,
      checked=True,
    )
  else:
    validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def clear(state: ReplayState) -> ReplayState:
  """Empties the buffer without reallocating or zeroing its storage."""
  validation.check_state_kind(state, ReplayState, what="clear", exact=True)
  return state.replace(
    insert_position=jnp.zeros_like(state.insert_position), size=jnp.zeros_like(state.size)
  )


def uniform_replay(
  capacity: int, *, checked: bool = False, storage: Any = "device"
) -> Buffer[ReplayState, ReplaySample]:
  """A uniform replay buffer holding up to `capacity` items.

  Args:
    capacity: C, a Python int.
    checked: if True, run-time violations (sampling an empty buffer, indices
      outside the items held, non-finite or negative priorities) raise; the
      functions are then left unjitted, and inside your own jit you wrap the
      step in `jax.experimental.checkify.checkify`.
    storage: where the payload leaves live: "device" (the default), "host"
      (pinned host memory) or `jaxbuf.disk(directory)` (files); bookkeeping
      stays on the device. See docs/guides/storage.md.

  Returns:
    A `Buffer`. By default `add` and `clear` are jitted with the state
    donated: the state you pass in is consumed (updated in place) and you use
    the one returned. `update_priorities` checks its arguments' shapes and
    returns the state as it is.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(1000)
  >>> state = buffer.init({"obs": jnp.zeros(4), "action": jnp.int32(0)})
  >>> state = buffer.add(state, {"obs": jnp.ones((8, 4)),
  ...                            "action": jnp.arange(8, dtype=jnp.int32)})
  >>> batch = buffer.sample(state, jax.random.key(0), 16)
  >>> batch.items["obs"].shape, int(state.size)
  ((16, 4), 8)
  """
  validation.check_capacity(capacity)
  split = functools.partial(
    ring.split_over_devices,
    capacity=capacity,
    init=init,
    add=add,
    sample=sample,
    update_priorities=None,
    clear=clear,
    beta=None,
    stratified=False,
    masses=None,
  )
  buffer = bind(
    init=functools.partial(init, capacity=capacity),
    add=add,
    sample=functools.partial(sample, checked=checked),
    update_priorities=functools.partial(update_priorities, checked=checked),
    can_sample=ring.can_sample,
    clear=clear,
    kind=kind.Kind(
      name="uniform_replay",
      state_type=ReplayState,
      exact_type=True,
      settings=kind.settings_of(capacity=capacity),
      split=split,
    ),
    checked=checked,
    # The identity with shape checks: a jitted call would only add dispatch.
    jit_update_priorities=False,
  )
  return placed.place(buffer, storage, kind_name="uniform_replay", layout=tiers.ITEMS)
