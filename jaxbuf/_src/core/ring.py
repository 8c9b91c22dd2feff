"""Ring-ordered storage and its counters: a pytree of preallocated `[C, ...]` arrays.

Shape key: B add batch, S sample size, C capacity.

Writes touch only the rows they fill, so under `jax.jit(..., donate_argnums=0)`
XLA updates the storage in place whatever the capacity.
"""

import functools
from typing import Any, Callable, Self, TypeVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.core import kind
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import BufferState, PyTree, ReplaySample


def capacity_of(storage: PyTree) -> int:
  """The capacity C, read from the storage's leading axis (never stored twice)."""
  return jax.tree_util.tree_leaves(storage)[0].shape[0]


def init_storage(example_item: PyTree, capacity: int) -> PyTree:
  """Zeros `[C, *leaf.shape]` for each leaf, keeping each leaf's dtype."""
  return jax.tree.map(
    lambda leaf: jnp.zeros((capacity, *jnp.shape(leaf)), jnp.result_type(leaf)), example_item
  )


def item_spec(storage: PyTree) -> PyTree:
  """The unbatched item shapes and dtypes, as `jax.ShapeDtypeStruct` values."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), storage)


def write(
  storage: PyTree, items: PyTree, insert_position: jax.Array, batch_size: int
) -> tuple[PyTree, jax.Array]:
  """Writes `items [B, ...]` in ring order from `insert_position`.

  A batch larger than C keeps its newest C items. The older ones are dropped
  by a static slice rather than written and overwritten: XLA gives duplicate
  scatter indices no defined order, so every written slot is written once.

  Returns:
    The new storage and the slots written, int32 `[min(B, C)]`.
  """
  capacity = capacity_of(storage)
  kept = min(batch_size, capacity)
  dropped = batch_size - kept
  items = jax.tree.map(lambda x: x[dropped:], items)
  start = (insert_position + dropped % capacity) % capacity
  slots = (start + jnp.arange(kept, dtype=jnp.int32)) % capacity
  storage = jax.tree.map(
    lambda column, new: column.at[slots].set(new, unique_indices=True, mode="promise_in_bounds"),
    storage,
    items,
  )
  return storage, slots


def gather(storage: PyTree, indices: jax.Array) -> PyTree:
  """Rows `indices [S]` of every leaf: `[S, ...]`."""
  return jax.tree.map(lambda column: column.at[indices].get(mode="promise_in_bounds"), storage)


@flax.struct.dataclass
class ReplayState(BufferState):
  """A ring buffer of items. Every field is an array; nothing is static."""

  storage: PyTree  # each leaf [C, *item_shape], the item's own dtype
  insert_position: jax.Array  # shape=(), int32: the slot the next item goes to
  size: jax.Array  # shape=(), int32: items held, at most C
  add_count: jax.Array  # shape=(), uint32: items ever added, modulo 2**32

  def buffer_dims(self) -> dict[str, Any]:
    # The scalar counters have exactly the vmapped axes, if any.
    batch_shape = np.shape(self.insert_position)
    storage = jax.tree_util.tree_leaves(self.storage)[0]
    return {
      "vmapped buffers": list(batch_shape),
      "capacity": int(np.shape(storage)[len(batch_shape)]),
    }

  def joined(self) -> Self:
    """D lockstep rings of L slots (every add splits evenly over the
    devices, so their slots and sizes agree) as one ring of D * L: local
    slot j of device d becomes slot j * D + d, oldest first as before.
    `add_count` is the devices' sum (see `divided`)."""
    num_devices = self.insert_position.shape[0]
    for name in ("insert_position", "size"):
      require_equal_on_every_device(getattr(self, name), name)
    return self.replace(
      storage=jax.tree.map(
        lambda leaf: jnp.swapaxes(leaf, 0, 1).reshape((-1,) + leaf.shape[2:]), self.storage
      ),
      insert_position=self.insert_position[0] * num_devices,
      size=self.size[0] * num_devices,
      add_count=jnp.sum(self.add_count, dtype=jnp.uint32),
    )

  def divided(self, num_devices: int) -> Self:
    """The inverse of `joined`: slot s to local slot s // D of device s % D.

    A full ring is first turned so its oldest item is slot 0; a ring not
    full must hold a multiple of D items, so that the D rings stay lockstep.
    `add_count` (items ever added, mod 2**32) need not divide by D: device d
    counts `add_count // D`, plus 1 for the first `add_count % D` devices,
    so that `joined` gives it back exactly (each device's count only dates
    its own slots, for `current_item_ids`).
    """
    capacity = capacity_of(self.storage)
    validation.check_divides(capacity, num_devices, "capacity", "load")
    full = self.size == capacity
    if is_concrete(self.size) and not bool(full) and int(self.size) % num_devices:
      raise ValueError(
        f"load: the state holds {int(self.size)} items, which do not split "
        f"evenly over {num_devices} devices (each device's ring must hold "
        f"as many); add items up to a multiple of {num_devices}, or load "
        f"it over a number of devices that divides {int(self.size)}."
      )
    turn = jnp.where(full, self.insert_position, 0)
    spread = lambda leaf: jnp.swapaxes(
      jnp.roll(leaf, -turn, axis=0).reshape(
        (capacity // num_devices, num_devices) + leaf.shape[1:]
      ),
      0,
      1,
    )
    per_device = lambda value: jnp.full((num_devices,), value)
    return self.replace(
      storage=jax.tree.map(spread, self.storage),
      insert_position=per_device(jnp.where(full, 0, self.insert_position) // num_devices),
      size=per_device(self.size // num_devices),
      add_count=self.add_count // jnp.uint32(num_devices)
      + (
        jnp.arange(num_devices, dtype=jnp.uint32) < self.add_count % jnp.uint32(num_devices)
      ).astype(jnp.uint32),
    )


def is_concrete(value: Any) -> bool:
  """Whether `value` holds data (not a tracer under jit or eval_shape)."""
  return not isinstance(value, jax.core.Tracer)


def require_equal_on_every_device(value: jax.Array, name: str) -> None:
  """Raises unless a counter `[D]` is the same on every device."""
  if is_concrete(value) and np.unique(np.asarray(value)).size > 1:
    raise ValueError(
      f"load: the devices' {name} differ ({np.asarray(value).tolist()}); "
      f"a state made by a jaxbuf.sharded buffer keeps them equal, so this "
      f"one cannot be regrouped exactly."
    )


def init_ring(example_item: PyTree, capacity: int) -> dict[str, Any]:
  """The `ReplayState` fields of an empty buffer, as keyword arguments."""
  return dict(
    storage=init_storage(example_item, capacity),
    insert_position=jnp.zeros((), jnp.int32),
    size=jnp.zeros((), jnp.int32),
    add_count=jnp.zeros((), jnp.uint32),
  )


# A ring state or a subclass (prioritized): what the ring helpers return.
RingStateT = TypeVar("RingStateT", bound=ReplayState)


def add_to_ring(state: RingStateT, items: PyTree) -> tuple[RingStateT, jax.Array]:
  """Validates `items [B, ...]` against the storage and writes them in ring order.

  Returns:
    The new state and the slots written, int32 `[min(B, C)]`.
  """
  (batch_size,) = validation.check_batched_leaves(item_spec(state.storage), items, what="add")
  validation.check_host_integers(items, what="add")
  items = jax.tree.map(jnp.asarray, items)
  capacity = capacity_of(state.storage)
  storage, slots = write(state.storage, items, state.insert_position, batch_size)
  return state.replace(
    storage=storage,
    insert_position=(state.insert_position + batch_size % capacity) % capacity,
    size=jnp.minimum(state.size + min(batch_size, capacity), capacity),
    add_count=state.add_count + jnp.uint32(batch_size % 2**32),
  ), slots


def current_item_ids(state: ReplayState, indices: jax.Array) -> jax.Array:
  """Which write (counting from 0, modulo 2**32) filled each slot, uint32 `[S]`.

  Writes are contiguous in ring order, so slot s holds the item written
  `(insert_position - 1 - s) mod C` writes before the newest one.
  """
  capacity = capacity_of(state.storage)
  writes_since = (state.insert_position - 1 - indices) % capacity
  return state.add_count - jnp.uint32(1) - writes_since.astype(jnp.uint32)


def indices_in_range(indices: jax.Array, size: jax.Array) -> jax.Array:
  """`0 <= indices < size` without wrapping, for every integer dtype: bool `[S]`.

  Compared in a dtype that holds both: a cast of int64 2**32 + 3 (or uint32
  2**32 - 1) to int32 first would make it 3 (or -1) and let it pass.
  `size` is below 2**30, so it fits every unsigned dtype of 32 bits or more.
  """
  dtype = indices.dtype
  if dtype.itemsize < 4 or (dtype.itemsize == 4 and dtype.kind == "i"):
    indices = indices.astype(jnp.int32)  # int8..int32, uint8, uint16: exact
  else:
    size = size.astype(dtype)
  in_range = indices < size
  if dtype.kind == "i":
    in_range &= indices >= 0
  return in_range


def valid_priority_updates(
  state: ReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None,
  *,
  checked: bool,
) -> jax.Array:
  """Which updates apply: bool `[S]`. Validates shapes while tracing.

  An update applies when its index points at an item held, its priority is
  finite, and (given `item_ids`) the slot still holds the item that was
  sampled. A negative priority applies too: its magnitude is used (a signed
  TD error, passed as it is, means `|TD error|`; skipping it would leave the
  item at the maximum priority and sample it far more often). Checked mode
  raises on an index outside the items held, and on a priority that is not
  finite or is negative.
  """
  validation.check_priority_update_args(indices, priorities, item_ids)
  in_range = indices_in_range(indices, state.size)
  finite = jnp.isfinite(priorities)
  if checked:
    checkify.check(
      jnp.all(in_range),
      "update_priorities: indices must point at items held, in [0, size={size}); given {indices}",
      size=state.size,
      indices=indices,
    )
    checkify.check(
      jnp.all(finite & (priorities >= 0)),
      "update_priorities: "
      "priorities must be finite and non-negative (pass "
      "|TD error|); given {priorities}",
      priorities=priorities,
    )
  valid = in_range & finite
  if item_ids is not None:
    # Only in-range indices are used, so the cast cannot matter.
    valid &= current_item_ids(state, indices.astype(jnp.int32)) == item_ids
  return valid


def can_sample(state: ReplayState, batch_size: int) -> jax.Array:
  """Whether `sample(state, key, batch_size)` draws only held items: bool
  `()`, true once one item is held (sampling is with replacement, so one
  item serves any `batch_size`; `batch_size` is checked all the same). Not
  a warm-up: wait for data with `state.size >= min_size`."""
  validation.check_batch_size(batch_size, what="can_sample")
  return state.size > 0


def can_sample_without_repeats(state: ReplayState, batch_size: int) -> jax.Array:
  """`can_sample` of a kind whose sample never repeats an item and pads the
  rows past the items held (a queue, a heap): whether at least `batch_size`
  items are held, bool `()`."""
  validation.check_batch_size(batch_size, what="can_sample")
  return state.size >= batch_size


def _check_items_to_split(state: ReplayState, arguments: tuple, num_devices: int) -> None:
  """Items `[B, ...]` checked against the whole buffer's item, B by D."""
  (items,) = arguments
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), state.storage)
  (batch_size,) = validation.check_batched_leaves(spec, items, what="add")
  validation.check_host_integers(items, what="add")
  validation.check_divides(batch_size, num_devices, "the add batch B", "add")


def split_over_devices(
  num_devices: int,
  *,
  capacity: int,
  init: Callable,
  add: Callable,
  sample: Callable,
  update_priorities: Callable | None,
  clear: Callable,
  beta: Any,
  stratified: bool,
  masses: Callable | None,
) -> kind.Split:
  """Item replay split over D devices: capacity in blocks of L = C / D.

  Global slot `g` is local slot `g % L` of device `g // L`; items held fill
  local slots 0..size-1, so the rank-th item held is slot rank.
  """
  validation.check_divides(capacity, num_devices, "capacity", "sharded")
  return kind.Split(
    init=functools.partial(init, capacity=capacity // num_devices),
    add=add,
    add_arguments=kind.add_arguments_of(add),
    check_add=_check_items_to_split,
    sample=sample,
    update_priorities=update_priorities,
    clear=clear,
    local_counter=lambda state: state.size,
    counter_shape=(),
    ids_per_device=lambda state: jax.tree_util.tree_leaves(state.storage)[0].shape[1],
    held=lambda state: state.size,
    # Sampling is with replacement: one item serves any batch size.
    enough=lambda held, batch_size: held > 0,
    masses=masses,
    at_rank=lambda local, ranks: ranks,
    rows=lambda local, slots, key: gather(local.storage, slots),
    item_ids=current_item_ids,
    as_sample=lambda rows, indices, weights, item_ids, drawn: ReplaySample(
      items=rows, indices=indices, weights=weights, item_ids=item_ids
    ),
    check_update=None,
    beta=beta,
    stratified=stratified,
    uniform_when_massless=True,
  )
