"""Keep-the-best eviction: item replay that evicts its lowest-valued items.

Shape key: B add batch, S sample size, C capacity.

`add(state, items, values)` gives each item a value (a return, a reward, a
score). After the add the buffer holds the C highest-valued of the items it
held and the batch (all of them while they fit). Among equal values, items
held stay before batch items, earlier batch items before later ones, and of
held items the one in the lower slot is evicted first. Items not kept and
items evicted are counted in `dropped` (uint32, modulo 2**32). A value that
is NaN or infinite is refused in checked mode; otherwise its item is not
kept (and counted in `dropped`).

The values of the items held sit in a max tree of negated values
(`extreme_tree`): an add reads the B lowest held (`extreme_tree.top`, a beam
of B nodes down the levels), ranks them with the batch (a sort of 2B) and
writes the batch items kept into the empty slots, then the evicted ones:
O(B K log(B K) log_K C), never a pass over the buffer. Items held fill slots `[0, size)`;
`sample` draws uniformly from them, as uniform replay does (pair with
`jaxbuf.mixture` for other proportions); `take` is `sample`. `item_ids`
count the items offered to `add` (mod 2**32), each slot keeping the id of
the item in it. The order is global, so `jaxbuf.sharded` refuses these
buffers.
"""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.core import kind
from jaxbuf._src.core import random
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import ring
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, BufferState, PyTree, ReplaySample, bind
from jaxbuf._src.selection import extreme_tree
from jaxbuf._src.selection import keep_best_kernels


@flax.struct.dataclass
class KeepBestState(BufferState):
  """Items kept by value. Every field is an array; nothing is static."""

  storage: PyTree  # each leaf [C, *item_shape]
  lowest_first: extreme_tree.MaxTree  # leaves: -value per slot held, -inf empty
  size: jax.Array  # shape=(), int32: items held, in slots [0, size)
  add_count: jax.Array  # shape=(), uint32: items offered to add, modulo 2**32
  item_ids: jax.Array  # uint32 [C]: which offered item each slot holds
  dropped: jax.Array  # shape=(), uint32: items not kept or evicted, mod 2**32

  def buffer_dims(self) -> dict[str, Any]:
    batch_shape = np.shape(self.size)
    return {
      "vmapped buffers": list(batch_shape),
      "capacity": int(np.shape(self.item_ids)[len(batch_shape)]),
    }


def init(example_item: PyTree, *, capacity: int) -> KeepBestState:
  """An empty buffer for items shaped like `example_item` (unbatched)."""
  validation.check_capacity(capacity)
  return KeepBestState(
    storage=ring.init_storage(example_item, capacity),
    lowest_first=extreme_tree.init(capacity),
    size=jnp.zeros((), jnp.int32),
    add_count=jnp.zeros((), jnp.uint32),
    item_ids=jnp.zeros((capacity,), jnp.uint32),
    dropped=jnp.zeros((), jnp.uint32),
  )


def add(
  state: KeepBestState, items: PyTree, values: jax.Array, *, checked: bool = False
) -> KeepBestState:
  """Adds `items [B, ...]` with `values` float `[B]`, keeping the C highest
  valued of the items held and the batch (module notes). Cost
  O(B K log(B K) log_K C) for the B lowest held, and a sort of 2B."""
  validation.check_state_kind(state, KeepBestState, what="add", exact=True)
  (batch_size,) = validation.check_batched_leaves(ring.item_spec(state.storage), items, what="add")
  validation.check_host_integers(items, what="add")
  validation.check_shape("values", values, (batch_size,), what="add", like="items")
  validation.check_floating("values", values, what="add")
  values = jnp.asarray(values, jnp.float32)
  if checked:
    checkify.check(
      jnp.all(jnp.isfinite(values)), "add: values must be finite; given {values}", values=values
    )
  capacity = ring.capacity_of(state.storage)
  positions = jnp.arange(batch_size, dtype=jnp.int32)
  # The B lowest held (empty slots are not in the tree's ranking): the only
  # held items a batch of B can evict.
  held_slots, negated = extreme_tree.top(state.lowest_first, batch_size)
  operands = (values, held_slots, negated, state.size)
  if batch_size > keep_best_kernels.BATCH_MAX:
    slots, kept, evicted = choose_slots(*operands, capacity=capacity)
  else:
    slots, kept, evicted = sum_tree.choose_kernel(
      functools.partial(choose_slots, capacity=capacity),
      functools.partial(keep_best_kernels.choose_slots, capacity=capacity),
      *operands,
      kernel_variants=("pallas",),
    )
  storage = jax.tree.map(
    lambda column, new: column.at[slots].set(jnp.asarray(new), mode="drop"), state.storage, items
  )
  num_kept = jnp.sum(kept, dtype=jnp.int32)
  num_evicted = jnp.sum(evicted, dtype=jnp.int32)
  return state.replace(
    storage=storage,
    lowest_first=extreme_tree.set_leaves(
      state.lowest_first, jnp.minimum(slots, capacity - 1), -values, kept, unique_indices=True
    ),
    size=state.size + num_kept - num_evicted,
    add_count=state.add_count + jnp.uint32(batch_size % 2**32),
    item_ids=state.item_ids.at[slots].set(
      state.add_count + positions.astype(jnp.uint32), mode="drop"
    ),
    dropped=state.dropped + (batch_size - num_kept + num_evicted).astype(jnp.uint32),
  )


def choose_slots(
  values: jax.Array,
  held_slots: jax.Array,
  negated: jax.Array,
  size: jax.Array,
  *,
  capacity: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """What an add keeps and where (the XLA form of `keep_best_kernels`').

  Args:
    values: float32 `[B]`, the batch's values.
    held_slots: int32 `[B]`, the slots of the B lowest held.
    negated: float32 `[B]`, their negated values (-inf past those held).
    size: int32 `()`, items held.
    capacity: C.

  Returns:
    int32 `[B]` slots (C for batch items not kept), bool `[B]` kept (batch
    items), bool `[B]` evicted (of the held candidates).
  """
  batch_size = values.shape[0]
  finite = jnp.isfinite(values)
  positions = jnp.arange(batch_size, dtype=jnp.int32)
  held = negated > -jnp.inf
  # Candidates, worst first: value, then batch items before held ones, later
  # batch items before earlier ones, lower slots before higher ones.
  value = jnp.concatenate([jnp.where(finite, values, -jnp.inf), jnp.where(held, -negated, jnp.inf)])
  group = jnp.concatenate([jnp.where(finite, 0, -1), jnp.ones(batch_size, jnp.int32)])
  secondary = jnp.concatenate([-positions, held_slots])
  order = jnp.lexsort((secondary, group, value))
  num_finite = jnp.sum(finite, dtype=jnp.int32)
  surplus = jnp.maximum(size + num_finite - capacity, 0)
  dropped = (
    jnp.zeros(2 * batch_size, bool)
    .at[order]
    .set(jnp.arange(2 * batch_size) < surplus + batch_size - num_finite, unique_indices=True)
  )
  kept = ~dropped[:batch_size]
  evicted = dropped[batch_size:] & held
  # Free slots, in order: the empty ones past `size`, then those evicted.
  empty_slots = size + positions
  free = jnp.concatenate([empty_slots, held_slots])
  usable = jnp.concatenate([empty_slots < capacity, evicted])
  (free_at,) = jnp.nonzero(usable, size=batch_size, fill_value=0)
  slots = jnp.where(kept, free[free_at[jnp.cumsum(kept) - 1]], capacity)
  return slots, kept, evicted


def sample(
  state: KeepBestState, key: jax.Array, batch_size: int, *, checked: bool = False
) -> ReplaySample:
  """Draws `batch_size` items uniformly, with replacement, from those held
  (an empty buffer: slot 0 with weight 0; checked mode raises)."""
  validation.check_state_kind(state, KeepBestState, what="sample", exact=True)
  validation.check_sample_args(state.size, key, batch_size, checked=checked)
  indices = random.uniform_indices(key, state.size, batch_size)
  return ReplaySample(
    items=ring.gather(state.storage, indices),
    indices=indices,
    weights=jnp.full((batch_size,), state.size > 0, jnp.float32),
    item_ids=state.item_ids[indices],
  )


def values_held(state: KeepBestState) -> jax.Array:
  """The value of each slot's item, float32 `[C]`; +inf in the slots past
  `size`, which hold no item. A read of the tree's leaves, for inspection."""
  capacity = ring.capacity_of(state.storage)
  return -extreme_tree.leaves(state.lowest_first)[:capacity]


def update_priorities(
  state: KeepBestState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
) -> KeepBestState:
  """The identity (values are given at add); shapes still validated."""
  validation.check_state_kind(state, KeepBestState, what="update_priorities", exact=True)
  validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def clear(state: KeepBestState) -> KeepBestState:
  """Empties the buffer without reallocating its storage."""
  validation.check_state_kind(state, KeepBestState, what="clear", exact=True)
  return state.replace(
    size=jnp.zeros_like(state.size),
    lowest_first=jax.tree.map(lambda level: jnp.full_like(level, -jnp.inf), state.lowest_first),
  )


def can_sample(state: KeepBestState, batch_size: int) -> jax.Array:
  """Whether `sample(state, key, batch_size)` draws only held items: bool
  `()`, true once one item is held (sampling is with replacement), as for
  every kind that samples with replacement (`jaxbuf.Buffer`)."""
  validation.check_batch_size(batch_size, what="can_sample")
  return state.size > 0


def keep_best_replay(
  capacity: int, *, checked: bool = False
) -> Buffer[KeepBestState, ReplaySample]:
  """Item replay that keeps the `capacity` highest-valued items offered.

  `add(state, items, values)`: each item with a value (float `[B]`); the
  buffer then holds the C highest-valued of the items held and the batch
  (`help(jaxbuf.keep_best)` for ties). Sampling is
  uniform over the items held. TorchRL's `TensorDictMaxValueWriter`; the
  best trajectories for self-imitation or a GFlowNet reward buffer.

  Args:
    capacity: C, a Python int.
    checked: if True, NaN or infinite values raise (otherwise their items
      are not kept, and counted in `state.dropped`).

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.keep_best_replay(3)
  >>> state = buffer.init(jnp.int32(0))
  >>> state = buffer.add(state, jnp.arange(5, dtype=jnp.int32),
  ...                    jnp.array([5.0, 1.0, 7.0, 3.0, 0.5]))
  >>> sorted(state.storage.tolist()), int(state.dropped)
  ([0, 2, 3], 2)
  """
  validation.check_capacity(capacity)
  return bind(
    init=functools.partial(init, capacity=capacity),
    add=functools.partial(add, checked=checked),
    sample=functools.partial(sample, checked=checked),
    update_priorities=update_priorities,
    can_sample=can_sample,
    clear=clear,
    kind=kind.Kind(
      name="keep_best_replay",
      state_type=KeepBestState,
      exact_type=True,
      settings=kind.settings_of(capacity=capacity),
      split=None,
    ),
    checked=checked,
    jit_update_priorities=False,
  )
