"""A max tree beside the sum tree: the largest leaf in O(K log_K C).

Shape key: B batch of writes, S number of selections, C number of leaves,
K branching factor (`sum_tree.BRANCHING`).

The levels are laid out as the sum tree's (`sum_tree.level_sizes`), each
parent the largest of its K children; padding and empty leaves hold -inf.
A smallest-first order is the same tree over negated values. Ties between
equal leaves go to the lowest leaf index (the first child of largest value
at every level), so every selection is deterministic.
"""

import flax.struct
import jax
import jax.numpy as jnp

from jaxbuf._src.core import sum_tree

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
  tree: MaxTree, indices: jax.Array, values: jax.Array, valid: jax.Array | None = None
) -> MaxTree:
  """Sets `leaves[indices] = values` (float32, finite or -inf) where `valid`,
  the last valid occurrence of a duplicate index winning, and recomputes
  their ancestors. Cost O(B K log_K C)."""
  indices = jnp.asarray(indices, jnp.int32)
  values = jnp.asarray(values, jnp.float32)
  if valid is None:
    valid = jnp.ones(indices.shape, bool)
  levels = list(tree.levels)
  # The sum tree's marker pass resolves duplicates: each marked slot is then
  # overwritten by its last writer (markers exceed every finite leaf).
  marked, write = sum_tree.claim_last_writes(levels[0], indices, valid)
  levels[0] = marked.at[jnp.where(write, indices, marked.shape[0])].set(values, mode="drop")
  node = indices
  for depth in range(1, len(levels)):
    node = node // K
    children = levels[depth - 1].reshape(-1, K)[node]
    levels[depth] = (
      levels[depth]
      .at[jnp.where(valid, node, levels[depth].shape[0])]
      .set(jnp.max(children, axis=1), mode="drop")
    )
  return MaxTree(tuple(levels))


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

  The tree is only read: leaves already selected are left out through a
  small overlay per level (the nodes on their paths and their values
  without them, at most S per level; a node's value only falls as leaves
  are left out, so the smallest entry for a node is its current one). Cost
  O(S^2 K log_K C) elementwise and O(S K log_K C) reads, nothing O(C).

  Returns:
    int32 `[S]` indices and float32 `[S]` values; past the leaves that are
    not empty the values are -inf (the indices then mean nothing).
  """
  levels = tree.levels[:-1]
  if not levels:  # a single leaf, which is also the root
    first = jnp.arange(count) == 0
    return jnp.zeros(count, jnp.int32), jnp.where(first, tree.levels[0][0], -jnp.inf)
  child_position = jnp.arange(K, dtype=jnp.int32)

  def read(overlay, depth, nodes):
    """Values of `nodes [K]` at `depth`, the selected leaves left out."""
    overlay_nodes, overlay_values = overlay[depth]
    matched = overlay_nodes[None, :] == nodes[:, None]
    patched = jnp.min(jnp.where(matched, overlay_values[None, :], jnp.inf), axis=1)
    return jnp.minimum(levels[depth][nodes], patched)

  def select(overlay, step):
    node = jnp.zeros((), jnp.int32)
    for depth in reversed(range(len(levels))):
      values = read(overlay, depth, node * K + child_position)
      child = jnp.argmax(values).astype(jnp.int32)
      node, value = node * K + child, values[child]
    leaf = node
    overlay = list(overlay)
    nodes, values = overlay[0]
    overlay[0] = (nodes.at[step].set(leaf), values.at[step].set(-jnp.inf))
    for depth in range(1, len(levels)):
      node = node // K
      children = read(overlay, depth - 1, node * K + child_position)
      nodes, values = overlay[depth]
      overlay[depth] = (nodes.at[step].set(node), values.at[step].set(jnp.max(children)))
    return tuple(overlay), (leaf, value)

  empty = tuple((jnp.full(count, -1, jnp.int32), jnp.zeros(count, jnp.float32)) for _ in levels)
  _, (indices, values) = jax.lax.scan(select, empty, jnp.arange(count))
  return indices, values
