"""Heap selection on priority: the S largest (or smallest) priorities held.

Shape key: B add batch, S sample size, C capacity.

For self-imitation and best-first replay: a ring of items, each with a
priority (a return, a score) in a max tree beside it (`extreme_tree`;
smallest-first keeps negated priorities in the same tree). `sample` returns
the S items of largest priority (order "max") or smallest ("min"), best
first, deterministic: equal priorities go to the lower slot. The key is
checked and unused. Asking for more than held gives padding rows past the
items held (slot 0's item, weight 0, item id 0, index C: outside the items
held, so `update_priorities` skips it, as for `epoch_batches` padding);
checked mode raises instead. Cost
O(S K log(S K) log_K C): a beam of S nodes down the levels of the tree
(`extreme_tree.top`), never a sort of the buffer.

Items enter at the priorities given to `add`, or, without them, at the
largest priority given so far (1 at first), as prioritized replay's do.
`update_priorities` sets them (signed values are kept: a heap ranks by
value, not magnitude); an update whose index is not held, whose priority is
NaN or infinite, or whose item was overwritten since it was sampled (given
`item_ids`) is skipped, and checked mode raises on the first two.

`take` is `sample` (a heap retires nothing). The order is global, so
`jaxbuf.sharded` refuses these buffers.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxbuf._src.core import kind
from jaxbuf._src.core import ring
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, BufferState, PyTree, ReplaySample, bind
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.selection import extreme_tree

ORDERS = ("max", "min")


@flax.struct.dataclass
class HeapReplayState(ReplayState):
  """A `ReplayState` with a priority per slot in a max tree."""

  heap: extreme_tree.MaxTree  # leaves: priority ("max") or -priority
  # ("min") per slot held, -inf for empty slots
  max_priority: jax.Array  # shape=(), float32: largest priority given, 1 at first

  def joined(self):
    return BufferState.joined(self)  # a global order: not split

  def divided(self, num_devices: int):
    return BufferState.divided(self, num_devices)


def _check_order(order: str, what: str) -> None:
  if order not in ORDERS:
    raise ValueError(f"{what}: order must be one of {ORDERS}, given {order!r}.")


def _signed(priorities: jax.Array, order: str) -> jax.Array:
  return priorities if order == "max" else -priorities


def init(example_item: PyTree, *, capacity: int) -> HeapReplayState:
  """An empty heap buffer for items shaped like `example_item`."""
  validation.check_capacity(capacity)
  return HeapReplayState(
    **ring.init_ring(example_item, capacity),
    heap=extreme_tree.init(capacity),
    max_priority=jnp.ones((), jnp.float32),
  )


def add(
  state: HeapReplayState,
  items: PyTree,
  priorities: jax.Array | None = None,
  *,
  order: str,
  checked: bool = False,
) -> HeapReplayState:
  """Adds `items [B, ...]` in ring order at `priorities [B]` (float), or at
  the largest priority given so far. A NaN or infinite priority is replaced
  by that largest one (checked mode raises)."""
  validation.check_state_kind(state, HeapReplayState, what="add", exact=True)
  added, slots = ring.add_to_ring(state, items)
  batch_size = jax.tree.leaves(items)[0].shape[0]
  if priorities is None:
    given = jnp.full((batch_size,), state.max_priority, jnp.float32)
  else:
    validation.check_shape("priorities", priorities, (batch_size,), what="add", like="items")
    validation.check_floating("priorities", priorities, what="add")
    given = jnp.asarray(priorities, jnp.float32)
    if checked:
      checkify.check(
        jnp.all(jnp.isfinite(given)), "add: priorities must be finite; given {p}", p=given
      )
    given = jnp.where(jnp.isfinite(given), given, state.max_priority)
  kept = given[batch_size - slots.shape[0] :]  # a batch past C keeps its newest C
  return added.replace(
    heap=extreme_tree.set_leaves(state.heap, slots, _signed(kept, order), unique_indices=True),
    max_priority=jnp.maximum(state.max_priority, jnp.max(given)),
  )


def sample(
  state: HeapReplayState, key: jax.Array, batch_size: int, *, order: str, checked: bool = False
) -> ReplaySample:
  """The `batch_size` items of largest ("max") or smallest ("min") priority,
  best first, ties to the lower slot (module notes).

  Returns:
    A `ReplaySample`: items `[S, ...]`, indices int32 `[S]` (C on padding
    rows), weights float32 `[S]` (1, or 0 on padding rows past the items
    held), item_ids uint32 `[S]`.
  """
  validation.check_state_kind(state, HeapReplayState, what="sample", exact=True)
  validation.check_sample_args(state.size, key, batch_size, checked=False)
  _check_order(order, "sample")
  if checked:
    checkify.check(
      state.size >= batch_size,
      "sample: the heap holds {size} items, fewer than batch_size={batch_size}; "
      "guard with can_sample.",
      size=state.size,
      batch_size=jnp.int32(batch_size),
    )
  slots, values = extreme_tree.top(state.heap, batch_size)
  held = values > -jnp.inf
  slots = jnp.where(held, slots, 0)
  return ReplaySample(
    items=ring.gather(state.storage, slots),
    indices=jnp.where(held, slots, ring.capacity_of(state.storage)),
    weights=held.astype(jnp.float32),
    item_ids=jnp.where(held, ring.current_item_ids(state, slots), jnp.uint32(0)),
  )


def update_priorities(
  state: HeapReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  order: str,
  checked: bool = False,
) -> HeapReplayState:
  """Sets the priorities of slots `indices [S]` to `priorities [S]` (module
  notes for what is skipped). Cost O(S K log C)."""
  validation.check_state_kind(state, HeapReplayState, what="update_priorities", exact=True)
  validation.check_priority_update_args(indices, priorities, item_ids)
  indices = jnp.asarray(validation.host_indices(indices))
  priorities = jnp.asarray(priorities, jnp.float32)
  in_range = ring.indices_in_range(indices, state.size)
  finite = jnp.isfinite(priorities)
  if checked:
    checkify.check(
      jnp.all(in_range & finite),
      "update_priorities: indices must point at items held, in [0, size={size}), and "
      "priorities be finite; given {indices}, {priorities}",
      size=state.size,
      indices=indices,
      priorities=priorities,
    )
  valid = in_range & finite
  slots = jnp.where(valid, indices.astype(jnp.int32), 0)
  if item_ids is not None:
    valid &= ring.current_item_ids(state, slots) == item_ids
  return state.replace(
    heap=extreme_tree.set_leaves(state.heap, slots, _signed(priorities, order), valid),
    max_priority=jnp.maximum(
      state.max_priority, jnp.max(jnp.where(valid, priorities, -jnp.inf), initial=-jnp.inf)
    ),
  )


def clear(state: HeapReplayState) -> HeapReplayState:
  """Empties the buffer without reallocating; priorities reset."""
  validation.check_state_kind(state, HeapReplayState, what="clear", exact=True)
  return state.replace(
    insert_position=jnp.zeros_like(state.insert_position),
    size=jnp.zeros_like(state.size),
    heap=jax.tree.map(lambda level: jnp.full_like(level, -jnp.inf), state.heap),
    max_priority=jnp.ones_like(state.max_priority),
  )


def heap_replay(
  capacity: int, *, order: str = "max", checked: bool = False
) -> Buffer[HeapReplayState, ReplaySample]:
  """Item replay that samples the items of largest (or smallest) priority.

  Self-imitation learning (the best returns seen), best-first replay:
  `add(state, items, priorities=None)` gives each item its priority (a
  return, say), `sample(state, key, S)` returns the S best held, best first
  and deterministic (module notes: `help(jaxbuf.heap)`), `update_priorities`
  changes them. The oldest item is overwritten first, as in uniform replay
  (for eviction by value, `keep_best_replay`). `can_sample(state, S)`: at
  least S items held (fewer give weight-0 padding rows).

  Args:
    capacity: C, a Python int.
    order: "max" (largest priorities first) or "min" (smallest first).
    checked: if True, asking for more items than held and non-finite
      priorities raise.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.heap_replay(8)
  >>> state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(5, dtype=jnp.int32),
  ...                    priorities=jnp.array([3.0, 9.0, 1.0, 9.0, 4.0]))
  >>> batch = buffer.sample(state, jax.random.key(0), 3)
  >>> batch.items.tolist(), batch.weights.tolist()
  ([1, 3, 4], [1.0, 1.0, 1.0])
  """
  validation.check_capacity(capacity)
  _check_order(order, "heap_replay")
  return bind(
    init=functools.partial(init, capacity=capacity),
    add=functools.partial(add, order=order, checked=checked),
    sample=functools.partial(sample, order=order, checked=checked),
    update_priorities=functools.partial(update_priorities, order=order, checked=checked),
    can_sample=ring.holds_batch,
    clear=clear,
    kind=kind.Kind(
      name="heap_replay",
      state_type=HeapReplayState,
      exact_type=True,
      settings=kind.settings_of(capacity=capacity, order=order),
      split=None,
    ),
    checked=checked,
  )
