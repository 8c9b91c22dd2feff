"""A max tree beside the sum tree: the largest leaf in O(K log_K C).

Shape key: B batch of writes, S number of selections, C number of leaves,
K branching factor (`sum_tree.BRANCHING`).

The levels are laid out as the sum tree's (`sum_tree.level_sizes`), each
parent the largest of its K children; padding and empty leaves hold -inf.
A smallest-first order is the same tree over negated values. Ties between
equal leaves go to the lowest leaf index (the first child of largest value
at every level), so every selection is deterministic.

Writes and `top` have Pallas kernels beside the XLA operations
(`extreme_tree_kernels.py`), chosen as the sum tree's are
(`sum_tree.choose_kernel`: the "pallas" variant, on a GPU by default): one
launch each where the XLA forms launch kernels per level. Both forms return
the same, bit for bit. A zero is stored as +0 (a -0 priority too), so the
tree never holds both zeros, whose maximum XLA may take either way.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxbuf._src.core import sum_tree
from jaxbuf._src.selection import extreme_tree_kernels

K = sum_tree.BRANCHING


@flax.struct.dataclass
class MaxTree:
  """Levels bottom-up; `levels[0]` are the leaves, `levels[-1]` the root."""

  levels: tuple[jax.Array, ...]  # each float32; empty leaves -inf


def init(num_leaves: int) -> MaxTree:
  """A tree over `num_leaves` empty (-inf) leaves."""
  return MaxTree(
    tuple(jnp.full(size, -jnp.inf, jnp.float32) for size in sum_tree.level_sizes(num_leaves))
  )


def leaves(tree: MaxTree) -> jax.Array:
  """The leaf values, float32 `[C padded to a multiple of K]`."""
  return tree.levels[0]


def largest(tree: MaxTree) -> jax.Array:
  """The root: the largest leaf, float32 `()` (-inf when all are empty)."""
  return tree.levels[-1][0]


def set_leaves(
  tree: MaxTree,
  indices: jax.Array,
  values: jax.Array,
  valid: jax.Array | None = None,
  *,
  unique_indices: bool = False,
) -> MaxTree:
  """Sets `leaves[indices] = values` (float32, finite or -inf) where `valid`,
  the last valid occurrence of a duplicate index winning, and recomputes
  their ancestors. Cost O(B K log_K C).

  `unique_indices`: the caller promises the valid indices are distinct (ring
  slots, the slots an add fills), which skips the duplicate resolution.
  """
  indices = jnp.asarray(indices, jnp.int32)
  values = jnp.asarray(values, jnp.float32)
  if valid is None:
    valid = jnp.ones(indices.shape, bool)
  values = jnp.where(values == 0, 0.0, values)  # +0 for -0 (module notes)
  levels = list(tree.levels)
  # The sum tree's marker pass resolves duplicates: each marked slot is then
  # overwritten by its last writer (markers exceed every finite leaf).
  if unique_indices:
    write = valid
  else:
    levels[0], write = sum_tree.claim_last_writes(levels[0], indices, valid)
  if len(levels) == 1 or indices.shape[0] > extreme_tree_kernels.WRITE_BATCH_MAX:
    return MaxTree(_write_levels(tuple(levels), indices, values, write))
  written = sum_tree.choose_kernel(
    _write_levels,
    functools.partial(extreme_tree_kernels.write_leaves, branching=K),
    tuple(levels),
    indices,
    values,
    write,
    kernel_variants=("pallas",),
  )
  return MaxTree(tuple(written))


def _write_levels(
  levels: tuple[jax.Array, ...], indices: jax.Array, values: jax.Array, write: jax.Array
) -> tuple[jax.Array, ...]:
  """`set_leaves`'s writes as XLA operations, level by level: the leaves
  where `write` (distinct indices there), then their ancestors."""
  levels_list = list(levels)
  leaf_level = levels_list[0]
  levels_list[0] = leaf_level.at[jnp.where(write, indices, leaf_level.shape[0])].set(
    values, mode="drop"
  )
  node = jnp.where(write, indices, 0)
  for depth in range(1, len(levels_list)):
    node = node // K
    children = levels_list[depth - 1].reshape(-1, K)[node]
    levels_list[depth] = (
      levels_list[depth]
      .at[jnp.where(write, node, levels_list[depth].shape[0])]
      .set(jnp.max(children, axis=1), mode="drop")
    )
  return tuple(levels_list)


def argmax(tree: MaxTree) -> tuple[jax.Array, jax.Array]:
  """The largest leaf, ties to the lowest index: int32 `()` index, float32
  `()` value (-inf when every leaf is empty)."""
  node = jnp.zeros((), jnp.int32)
  for level in reversed(tree.levels[:-1]):
    children = level.reshape(-1, K)[node]
    node = node * K + jnp.argmax(children).astype(jnp.int32)
  return node, tree.levels[0][node]


def top(tree: MaxTree, count: int) -> tuple[jax.Array, jax.Array]:
  """The `count` largest leaves, largest first (ties to the lower index).

  A beam down the levels: at each level, the S nodes of largest value (ties
  to the lower node) among the children of the S kept a level above. The S
  best leaves lie under those S nodes at every level: a node outside them
  holds no leaf better than the S-th best, and node order is leaf order,
  so the tie rule agrees. Each level is one `lax.top_k` over S * K values
  and a sort of S node ids; the tree is only read. Cost O(S K log(S K)
  log_K C), never a sort of the C leaves (S log C selections and sorts of
  S * K values at 1M leaves: 7 levels).

  Returns:
    int32 `[S]` indices and float32 `[S]` values; past the leaves that are
    not empty the values are -inf (the indices then mean nothing).
  """
  if len(tree.levels) == 1:  # a single leaf, which is also the root
    first = jnp.arange(count) == 0
    return jnp.zeros(count, jnp.int32), jnp.where(first, tree.levels[0][0], -jnp.inf)
  return sum_tree.choose_kernel(
    functools.partial(_top_levels, count=count),
    functools.partial(extreme_tree_kernels.top, count=count, branching=K),
    tuple(reversed(tree.levels[:-1])),
    kernel_variants=("pallas_descent", "pallas"),
  )


def _top_levels(
  levels_top_down: tuple[jax.Array, ...], *, count: int
) -> tuple[jax.Array, jax.Array]:
  """`top`'s beam as XLA operations, level by level."""
  # Candidates: the root alone, then padding (-1, never expanded).
  nodes = jnp.where(jnp.arange(count) == 0, 0, -1).astype(jnp.int32)
  child_position = jnp.arange(K, dtype=jnp.int32)
  for depth, level in enumerate(levels_top_down):
    children = (jnp.maximum(nodes, 0)[:, None] * K + child_position[None, :]).reshape(-1)
    values = jnp.where(jnp.repeat(nodes >= 0, K), level[children], -jnp.inf)
    # S * K > S values; `top_k` puts equal values in their order here,
    # which is node order.
    values, chosen = jax.lax.top_k(values, count)
    kept = jnp.where(values > -jnp.inf, children[chosen], -1)
    if depth == len(levels_top_down) - 1:  # the leaves
      return jnp.maximum(kept, 0), values
    # Node order for the next level's ties; padding (-1) is never expanded.
    last = jnp.iinfo(jnp.int32).max
    nodes = jnp.sort(jnp.where(kept >= 0, kept, last))
    nodes = jnp.where(nodes == last, -1, nodes)
  raise AssertionError("unreachable: the loop returns at the leaves")
