"""Ring-ordered storage: a pytree of preallocated `[C, ...]` arrays.

Shape key: B add batch, S sample size, C capacity.

Writes touch only the rows they fill, so under `jax.jit(..., donate_argnums=0)`
XLA updates the storage in place whatever the capacity.
"""

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def capacity_of(storage: PyTree) -> int:
  """The capacity C, read from the storage's leading axis (never stored twice)."""
  return jax.tree_util.tree_leaves(storage)[0].shape[0]


def init_storage(example_item: PyTree, capacity: int) -> PyTree:
  """Zeros `[C, *leaf.shape]` for each leaf, keeping each leaf's dtype."""
  return jax.tree.map(
      lambda leaf: jnp.zeros((capacity, *jnp.shape(leaf)), jnp.result_type(leaf)),
      example_item)


def item_spec(storage: PyTree) -> PyTree:
  """The unbatched item shapes and dtypes, as `jax.ShapeDtypeStruct`s."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), storage)


def write(storage: PyTree, items: PyTree, insert_position: jax.Array,
          batch_size: int) -> tuple[PyTree, jax.Array]:
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
      lambda column, new: column.at[slots].set(
          new, unique_indices=True, mode="promise_in_bounds"),
      storage, items)
  return storage, slots


def gather(storage: PyTree, indices: jax.Array) -> PyTree:
  """Rows `indices [S]` of every leaf: `[S, ...]`."""
  return jax.tree.map(
      lambda column: column.at[indices].get(mode="promise_in_bounds"), storage)
