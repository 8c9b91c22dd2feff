"""A pure-JAX sum tree: batched priority writes and prefix-sum descents.

Shape key: B batch of writes, S number of descents, C number of leaves,
K branching factor.

The tree is wide (K = 32 children per node) so that C = 1M leaves need only 4
levels: a write or a descent costs O(B * K * log_K C) and is a handful of
gathers and scatters, whichever the capacity. Parents are always recomputed
from their children, never adjusted by deltas, so the root cannot drift away
from the sum of the leaves however many updates it sees.

Levels are stored bottom-up: `levels[0]` holds the leaves (padded with zeros
to a multiple of K), `levels[-1]` holds the root alone. Each level below the
root has length `K * len(next level without padding)`, so `level.reshape(-1, K)`
lines up every parent's children in one row.
"""

import math

import flax.struct
import jax
import jax.numpy as jnp

BRANCHING = 32


@flax.struct.dataclass
class SumTree:
  """Levels bottom-up; `levels[0]` are the leaves, `levels[-1]` the root."""
  levels: tuple[jax.Array, ...]  # each float32; shapes [K*m_1], [K*m_2], ..., [1]


def level_sizes(num_leaves: int) -> tuple[int, ...]:
  """Padded length of each level for `num_leaves` leaves, bottom-up."""
  sizes = []
  count = num_leaves
  while count > 1:
    parents = math.ceil(count / BRANCHING)
    sizes.append(parents * BRANCHING)
    count = parents
  return (*sizes, 1)


def init(num_leaves: int) -> SumTree:
  """An all-zero tree over `num_leaves` leaves."""
  return SumTree(tuple(jnp.zeros(size, jnp.float32)
                       for size in level_sizes(num_leaves)))


def total(tree: SumTree) -> jax.Array:
  """The root: the sum of all leaves, float32 `()`."""
  return tree.levels[-1][0]


def leaves(tree: SumTree) -> jax.Array:
  """The leaf values, float32 `[C padded to a multiple of K]`."""
  return tree.levels[0]


def last_valid_occurrence(indices: jax.Array, valid: jax.Array) -> jax.Array:
  """Marks, for each distinct valid index, its last valid occurrence.

  Args:
    indices: int `[B]`.
    valid: bool `[B]`.

  Returns:
    bool `[B]`: True where `valid[i]` and no later valid `j` has the same index.
  """
  keys = jnp.where(valid, indices, -1)
  order = jnp.argsort(keys, stable=True)
  sorted_keys = keys[order]
  last_in_run = jnp.append(sorted_keys[1:] != sorted_keys[:-1], True)
  is_last = jnp.zeros_like(last_in_run).at[order].set(last_in_run, unique_indices=True)
  return is_last & valid


def set_leaves(tree: SumTree, indices: jax.Array, values: jax.Array,
               valid: jax.Array | None = None) -> SumTree:
  """Sets `leaves[indices] = values` and recomputes their ancestors.

  Duplicate indices are well defined: the last valid occurrence wins, as if the
  writes were applied one after another. Entries with `valid` False are skipped.

  Args:
    tree: the tree.
    indices: int32 `[B]`, leaf indices in `[0, C)`.
    values: float32 `[B]`, new leaf values (non-negative, finite).
    valid: optional bool `[B]`.

  Returns:
    The updated tree. Cost O(B * K * log_K C).
  """
  indices = jnp.asarray(indices, jnp.int32)
  if valid is None:
    valid = jnp.ones(indices.shape, bool)
  write = last_valid_occurrence(indices, valid)
  levels = list(tree.levels)
  levels[0] = levels[0].at[jnp.where(write, indices, levels[0].shape[0])].set(
      jnp.asarray(values, jnp.float32), mode="drop")
  node = indices
  for depth in range(len(levels) - 1):
    node = node // BRANCHING
    children = levels[depth].reshape(-1, BRANCHING)
    sums = children.at[node].get(mode="fill", fill_value=0).sum(axis=1)
    parent_level = levels[depth + 1]
    # Siblings written in one batch share a parent; each of them writes the
    # same sum of the already-updated children, so the scatter is exact.
    levels[depth + 1] = parent_level.at[
        jnp.where(write, node, parent_level.shape[0])].set(sums, mode="drop")
  return SumTree(tuple(levels))


def find_prefix_sums(tree: SumTree, targets: jax.Array) -> jax.Array:
  """For each target, the leaf whose prefix-sum interval contains it.

  Leaf i is returned for targets in `[sum(leaves[:i]), sum(leaves[:i+1]))`, so
  a target drawn uniformly from `[0, total)` returns leaf i with probability
  `leaves[i] / total`. Zero leaves are never returned while the total is
  positive, even for targets at or past the total through rounding.

  Args:
    tree: the tree.
    targets: float32 `[S]`.

  Returns:
    int32 `[S]` leaf indices.
  """
  targets = jnp.asarray(targets, jnp.float32)
  node = jnp.zeros(targets.shape, jnp.int32)
  for level in reversed(tree.levels[:-1]):
    children = level.reshape(-1, BRANCHING).at[node].get(mode="promise_in_bounds")
    prefix = jnp.cumsum(children, axis=1)
    child = jnp.sum(prefix <= targets[:, None], axis=1, dtype=jnp.int32)
    # Past the last positive child only through rounding: step back onto it.
    last_positive = BRANCHING - 1 - jnp.argmax(children[:, ::-1] > 0, axis=1)
    child = jnp.minimum(child, last_positive.astype(jnp.int32))
    before = jnp.take_along_axis(
        prefix, jnp.maximum(child - 1, 0)[:, None], axis=1)[:, 0]
    targets = targets - jnp.where(child > 0, before, 0.0)
    node = node * BRANCHING + child
  return node
