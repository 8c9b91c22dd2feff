"""Queues: FIFO and LIFO selection that hands each item out exactly once.

Shape key: B add batch, S sample size, C capacity.

A queue is a ring of items (`QueueState`, a `ReplayState`) whose `size`
counts the items not yet handed out: `take` hands out up to S of them in
order (FIFO oldest first, LIFO newest first) and retires them; `sample`
peeks at the same rows and retires nothing. A result has a fixed shape: S
rows, `mask` True on the real ones and `count` of them; the rows past
`count` are padding (weight 0, mask False), so fewer items held than S, or
none, never changes a shape. Checked mode raises on a take or sample of an
empty queue.

An add to a full queue overwrites the oldest items not yet handed out, as a
ring does, and counts each in `dropped` (uint32, modulo 2**32); so do the
items of one add past C (only its newest C are kept).

`oldest_unread` is the same FIFO rule over any item replay state with a
read cursor that the caller keeps (the replay service's queue limiter): the
queue kind's FIFO take is built on it.

The module-level functions take every setting explicitly; `queue_replay`
binds them into a `Buffer`.
"""

import functools
from typing import Self

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxbuf._src.core import kind
from jaxbuf._src.core import ring
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, BufferState, PyTree, ReplaySample, bind
from jaxbuf._src.core.ring import ReplayState

ORDERS = ("fifo", "lifo")


@flax.struct.dataclass
class QueueState(ReplayState):
  """A ring of items waiting to be handed out.

  `size` counts the items not yet handed out (taken items are gone); the
  other ring fields mean what they mean in a `ReplayState`, except that a
  LIFO take also steps `insert_position` and `add_count` back over the
  items it pops (the next add reuses their slots and ids).
  """

  dropped: jax.Array  # shape=(), uint32: items overwritten (or never
  # kept) before being handed out, modulo 2**32

  def joined(self) -> Self:
    return BufferState.joined(self)  # a queue's order is global: not split

  def divided(self, num_devices: int) -> Self:
    return BufferState.divided(self, num_devices)


@flax.struct.dataclass
class QueueSample(ReplaySample):
  """A `ReplaySample` of up to S items in queue order, padded to S rows.

  Rows `[0, count)` are items, in the order handed out; the rest are
  padding: `mask` False, weight 0, index 0, item id 0.
  """

  mask: jax.Array  # bool [S]: True on the rows that are items
  count: jax.Array  # int32 (): how many rows are items, at most S


def oldest_unread(
  state: ReplayState, read_count: jax.Array, batch_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The slots of the oldest items not yet read, for a FIFO reader.

  `read_count` counts the items the reader has handed out, the way
  `state.add_count` counts the items added (uint32, modulo 2**32): items
  `read_count, read_count + 1, ...` (by add order) are read next. Items
  overwritten before being read are skipped: when `add_count - read_count`
  exceeds `size`, the oldest `add_count - read_count - size` were
  overwritten, and the read goes on from the oldest item held. The number
  skipped (dropped) by a call is `new_read_count - read_count - mask.sum()`.
  A `read_count` more than 2**32 - C items behind (or ahead of) `add_count`
  is read as if every held item were unread. Cost O(S).

  Args:
    state: a `ReplayState` (or a subclass), whose `size` items are held.
    read_count: integer scalar, the items read so far (uint32 modulo 2**32).
    batch_size: S, a Python int.

  Returns:
    `(slots, mask, new_read_count)`: slots int32 `[S]`, oldest first, 0
    past the items read; mask bool `[S]`, True for the `min(S, unread held)`
    rows read; new_read_count uint32 `()`, `read_count` past the skipped and
    the read items.

  >>> import jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(4)
  >>> state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(6, dtype=jnp.int32))
  >>> slots, mask, read = jaxbuf.queue.oldest_unread(state, jnp.uint32(1), 3)
  >>> state.storage[slots].tolist(), mask.tolist(), int(read)  # 1 was overwritten
  ([2, 3, 4], [True, True, True], 5)
  """
  validation.check_state_kind(state, ReplayState, what="oldest_unread")
  validation.check_batch_size(batch_size, what="oldest_unread")
  read_count = jnp.asarray(read_count)
  if read_count.shape or not jnp.issubdtype(read_count.dtype, jnp.integer):
    raise TypeError(
      f"oldest_unread: read_count must be an integer scalar (uint32, counted "
      f"as add_count is), given {validation.describe(read_count)}."
    )
  capacity = ring.capacity_of(state.storage)
  unread = state.add_count - read_count.astype(jnp.uint32)
  live = jnp.minimum(unread, state.size.astype(jnp.uint32)).astype(jnp.int32)
  count = jnp.minimum(live, batch_size)
  rows = jnp.arange(batch_size, dtype=jnp.int32)
  mask = rows < count
  slots = jnp.where(mask, (state.insert_position - live + rows) % capacity, 0)
  new_read_count = state.add_count - live.astype(jnp.uint32) + count.astype(jnp.uint32)
  return slots.astype(jnp.int32), mask, new_read_count


def _newest_unread(state: QueueState, batch_size: int) -> tuple[jax.Array, jax.Array]:
  """LIFO: the slots of the newest S items held, newest first, and a mask."""
  capacity = ring.capacity_of(state.storage)
  rows = jnp.arange(batch_size, dtype=jnp.int32)
  mask = rows < state.size
  return jnp.where(mask, (state.insert_position - 1 - rows) % capacity, 0), mask


def init(example_item: PyTree, *, capacity: int) -> QueueState:
  """An empty queue for items shaped like `example_item` (unbatched).

  Args:
    example_item: any pytree of arrays (or `jax.ShapeDtypeStruct` values).
    capacity: C, the number of items waiting before an add drops the oldest.
  """
  validation.check_capacity(capacity)
  return QueueState(**ring.init_ring(example_item, capacity), dropped=jnp.zeros((), jnp.uint32))


def add(state: QueueState, items: PyTree) -> QueueState:
  """Adds `items [B, ...]` at the back of the queue.

  A full queue overwrites its oldest items not yet handed out (whichever
  the order), and counts each in `dropped`; so are the oldest B - C items of
  a batch larger than C, which are never kept.
  """
  validation.check_state_kind(state, QueueState, what="add", exact=True)
  added, _ = ring.add_to_ring(state, items)
  batch_size = jax.tree.leaves(items)[0].shape[0]
  # Waiting before, plus added, less waiting after (modulo 2**32).
  lost = (state.size - added.size).astype(jnp.uint32) + jnp.uint32(batch_size % 2**32)
  return added.replace(dropped=state.dropped + lost)


def _check_order(order: str, what: str) -> None:
  if order not in ORDERS:
    raise ValueError(f"{what}: order must be one of {ORDERS}, given {order!r}.")


def _next_rows(state: QueueState, batch_size: int, order: str) -> tuple[jax.Array, jax.Array]:
  """The slots and mask of the rows `take` hands out next."""
  if order == "fifo":
    slots, mask, _ = oldest_unread(
      state, state.add_count - state.size.astype(jnp.uint32), batch_size
    )
    return slots, mask
  return _newest_unread(state, batch_size)


def _queue_sample(state: QueueState, slots: jax.Array, mask: jax.Array) -> QueueSample:
  return QueueSample(
    items=ring.gather(state.storage, slots),
    indices=slots,
    weights=mask.astype(jnp.float32),
    item_ids=jnp.where(mask, ring.current_item_ids(state, slots), jnp.uint32(0)),
    mask=mask,
    count=jnp.sum(mask, dtype=jnp.int32),
  )


def sample(
  state: QueueState, key: jax.Array, batch_size: int, *, order: str, checked: bool = False
) -> QueueSample:
  """The rows `take` would hand out next, without handing them out (a peek).

  Args:
    state: a `QueueState`.
    key: a PRNG key, checked and unused (a queue's order is not random).
    batch_size: S, a Python int.
    order: "fifo" (oldest first) or "lifo" (newest first).
    checked: if True, an empty queue raises.

  Returns:
    A `QueueSample`: items `[S, ...]`, indices int32 `[S]`, weights float32
    `[S]` (1 on items, 0 on padding), item_ids uint32 `[S]`, mask bool
    `[S]`, count int32 `()`.
  """
  validation.check_state_kind(state, QueueState, what="sample", exact=True)
  validation.check_sample_args(state.size, key, batch_size, checked=False)
  _check_order(order, "sample")
  if checked:
    checkify.check(
      state.size > 0, "sample: the queue is empty; add items first (guard with can_sample)."
    )
  return _queue_sample(state, *_next_rows(state, batch_size, order))


def take(
  state: QueueState, key: jax.Array, batch_size: int, *, order: str, checked: bool = False
) -> tuple[QueueState, QueueSample]:
  """Hands out up to S items in queue order, each once: `sample`'s rows,
  and the state without them. Cost O(S).

  Args:
    state, key, batch_size, order: as for `sample`.
    checked: if True, an empty queue raises.

  Returns:
    `(state, sample)`: the queue without the `sample.count` items handed
    out, and the `QueueSample` `sample` gives.
  """
  validation.check_state_kind(state, QueueState, what="take", exact=True)
  validation.check_key(key, what="take")
  validation.check_batch_size(batch_size, what="take")
  _check_order(order, "take")
  if checked:
    checkify.check(
      state.size > 0, "take: the queue is empty; add items first (guard with can_sample)."
    )
  slots, mask = _next_rows(state, batch_size, order)
  batch = _queue_sample(state, slots, mask)
  state = state.replace(size=state.size - batch.count)
  if order == "lifo":  # popped from the back: their slots and ids are free
    capacity = ring.capacity_of(state.storage)
    state = state.replace(
      insert_position=(state.insert_position - batch.count) % capacity,
      add_count=state.add_count - batch.count.astype(jnp.uint32),
    )
  return state, batch


def update_priorities(
  state: QueueState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
) -> QueueState:
  """The identity (a queue keeps no priorities); shapes still validated."""
  validation.check_state_kind(state, QueueState, what="update_priorities", exact=True)
  validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def clear(state: QueueState) -> QueueState:
  """Empties the queue (items waiting are discarded, not counted as
  dropped) without reallocating its storage."""
  validation.check_state_kind(state, QueueState, what="clear", exact=True)
  return state.replace(
    insert_position=jnp.zeros_like(state.insert_position), size=jnp.zeros_like(state.size)
  )


def queue_replay(
  capacity: int, *, order: str = "fifo", checked: bool = False
) -> Buffer[QueueState, QueueSample]:
  """A queue of up to `capacity` items, each handed out once, in order.

  IMPALA-style trajectory queues, on-policy hand-offs, curricula. `take`
  hands out up to `batch_size` items (FIFO: oldest first; LIFO: newest
  first) and returns the queue without them; `sample` peeks at the same
  rows. Results have a fixed shape, `mask` and `count` saying which rows
  are items. `can_sample(state, S)`: at least S items waiting. An add to a
  full queue overwrites the oldest items waiting and counts them in
  `state.dropped`. `state.size` counts the items waiting.

  Not splittable over devices (`jaxbuf.sharded` refuses it: a queue's order
  is global); a `jaxbuf.mixture` part (its `take` routes to the queue's).

  Args:
    capacity: C, a Python int.
    order: "fifo" or "lifo".
    checked: if True, a take or sample of an empty queue raises (the
      functions are then left unjitted, as for `uniform_replay`).

  Returns:
    A `Buffer[QueueState, QueueSample]`; `take` is jitted with the state
    donated.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> queue = jaxbuf.queue_replay(8)
  >>> state = queue.add(queue.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32))
  >>> state, batch = queue.take(state, jax.random.key(0), 2)
  >>> batch.items.tolist(), int(batch.count)
  ([0, 1], 2)
  >>> state, batch = queue.take(state, jax.random.key(0), 2)
  >>> batch.items.tolist(), batch.mask.tolist(), batch.weights.tolist()
  ([2, 0], [True, False], [1.0, 0.0])
  """
  validation.check_capacity(capacity)
  _check_order(order, "queue_replay")
  return bind(
    init=functools.partial(init, capacity=capacity),
    add=add,
    sample=functools.partial(sample, order=order, checked=checked),
    update_priorities=update_priorities,
    can_sample=ring.can_sample_without_repeats,
    clear=clear,
    take=functools.partial(take, order=order, checked=checked),
    kind=kind.Kind(
      name="queue_replay",
      state_type=QueueState,
      exact_type=True,
      settings=kind.settings_of(capacity=capacity, order=order),
      split=None,
    ),
    checked=checked,
    jit_update_priorities=False,
  )
