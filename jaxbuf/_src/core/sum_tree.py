"""A pure-JAX sum tree: batched priority writes and prefix-sum descents.

Why one module of this size: it is one data structure, whose draws, descents
and writes read and write the same level layout, and whose XLA forms are the
twins, operation for operation, of the kernels in `sum_tree_kernels.py`.

Shape key: B batch of writes, S number of descents, C number of leaves,
K branching factor.

Each node has K = 8 children, so C = 1M leaves need 7 levels: a write or a
descent costs O(B * K * log_K C) and is a few gathers, scatters and small
elementwise kernels per level, whichever the capacity. On CPU, K = 8 measured
fastest for a 256-sample descent at 1M leaves (18 us, against 26 for K = 4,
57 for K = 16 and 79 for K = 32): wider nodes do more arithmetic per level
than they save in levels.

Parents are always recomputed from their children, never adjusted by deltas,
so the root cannot drift away from the sum of the leaves however many updates
it sees.

Levels are stored bottom-up: `levels[0]` holds the leaves (padded with zeros
to a multiple of K), `levels[-1]` holds the root alone. Each level below the
root has length `K * len(next level without padding)`, so `level.reshape(-1, K)`
lines up every parent's children in one row.

Draws, descents and writes have Pallas kernels beside the XLA operations
(`sum_tree_kernels.py`), chosen when a program is lowered, by the platform
it is lowered for (`choose_kernel`, `BACKEND_KERNELS`): on a GPU the XLA
form is a chain of dependent launches, several per level, where the bytes
take microseconds; a draw (`draw_leaves`: random targets, strata order,
descent, fallback and smallest value) and a write (`write_leaves`:
duplicates resolved, leaves, parents and a running maximum) are one kernel
each there. Variants: "xla", the levels as XLA operations; "pallas_descent",
the draw and descent kernels alone; "pallas", those and the write kernel.
The CPU uses "xla" and CUDA "pallas"; the environment variable
`JAXBUF_SUM_TREE_KERNELS` forces one everywhere (on a CPU the kernels then
run in Pallas's interpret mode: slow, for tests, which check every kernel
against its XLA twin bit for bit).
"""

import functools
import math
from typing import Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from jaxbuf._src.core import random
from jaxbuf._src.core import sum_tree_kernels

# The kernel choice, named here too: benchmarks and tests set the variant
# through `sum_tree`.
from jaxbuf._src.core.kernel_choice import BACKEND_KERNELS as BACKEND_KERNELS
from jaxbuf._src.core.kernel_choice import KERNEL_VARIANT_VARIABLE as KERNEL_VARIANT_VARIABLE
from jaxbuf._src.core.kernel_choice import KERNEL_VARIANTS as KERNEL_VARIANTS
from jaxbuf._src.core.kernel_choice import choose_kernel as choose_kernel
from jaxbuf._src.core.kernel_choice import forced_kernel_variant as forced_kernel_variant
from jaxbuf._src.core.kernel_choice import kernel_variant as kernel_variant
from jaxbuf._src.core.kernel_choice import _in_manual_mesh

BRANCHING = 8


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
  return SumTree(tuple(jnp.zeros(size, jnp.float32) for size in level_sizes(num_leaves)))


def from_leaves(values: jax.Array) -> SumTree:
  """The tree over leaves `values [C]` (float32, each below the limit).

  Each parent is the sum of its K children, as `set_leaves` computes it, so
  the tree is the one that writing every leaf would give.
  """
  sizes = level_sizes(values.shape[0])
  levels = [jnp.zeros(sizes[0], jnp.float32).at[: values.shape[0]].set(values.astype(jnp.float32))]
  for size in sizes[1:]:
    sums = levels[-1].reshape(-1, BRANCHING).sum(axis=1)
    levels.append(jnp.zeros(size, jnp.float32).at[: sums.shape[0]].set(sums))
  return SumTree(tuple(levels))


def total(tree: SumTree) -> jax.Array:
  """The root: the sum of all leaves, float32 `()`."""
  return tree.levels[-1][0]


def leaves(tree: SumTree) -> jax.Array:
  """The leaf values, float32 `[C padded to a multiple of K]`."""
  return tree.levels[0]


DENSE_LEVEL_MAX = 2**12  # children summed whole; measured best at K = 8

# Duplicate writes are resolved in the leaf level itself: every valid write
# first scatter-maxes a marker above LEAF_VALUE_LIMIT which grows with its
# batch position, so each slot ends up holding its last writer's marker
# (floats 2**127 * (1 + i * 2**-23) are exact and distinct for i < 2**23,
# hence MARKED_BATCH_MAX). Every marked slot is then overwritten by its last
# writer's value. That is a scatter-max and a gather of B elements, in place,
# where a [B, B] comparison or a sort of the batch measured 10 to 50 times
# slower on CPU. It needs every leaf, written or already there, below the
# limit and not NaN: such a leaf would win the scatter-max and keep later
# writes to its slot out. (`capped` keeps them so.)
LEAF_VALUE_LIMIT = 2.0**127
MARKED_BATCH_MAX = 2**23


def capped(values: jax.Array, tree: SumTree) -> jax.Array:
  """`values` capped at `float32 max / (2 * leaves)`, the tree's leaf invariant.

  Finite leaves can still overflow the total (two leaves of 3e38 sum to inf,
  and every importance weight becomes NaN); under the cap no sum of leaves
  can. The cap is also below `LEAF_VALUE_LIMIT`, which `set_leaves` needs.
  """
  cap = jnp.finfo(jnp.float32).max / (2 * leaves(tree).shape[0])
  return jnp.minimum(values, cap)


def claim_last_writes(
  leaf_level: jax.Array, indices: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Marks, for each distinct valid index, its last valid occurrence.

  Args:
    leaf_level: float32 `[C]`, every value below `LEAF_VALUE_LIMIT`.
    indices: int32 `[B]` in `[0, C)`, `B <= MARKED_BATCH_MAX`.
    valid: bool `[B]`.

  Returns:
    The leaf level with markers in the slots of valid writes (each must be
    overwritten by the caller), and bool `[B]`: True where `valid[i]` and no
    later valid write has the same index.
  """
  batch_size = indices.shape[0]
  assert batch_size <= MARKED_BATCH_MAX, batch_size
  markers = LEAF_VALUE_LIMIT * (1 + jnp.arange(batch_size, dtype=jnp.float32) * 2.0**-23)
  leaf_level = leaf_level.at[jnp.where(valid, indices, leaf_level.shape[0])].max(
    markers, mode="drop"
  )
  last_marker = leaf_level.at[jnp.where(valid, indices, 0)].get(mode="promise_in_bounds")
  return leaf_level, valid & (last_marker == markers)


def set_leaves(
  tree: SumTree,
  indices: jax.Array,
  values: jax.Array,
  valid: jax.Array | None = None,
  *,
  unique_indices: bool = False,
) -> SumTree:
  """Sets `leaves[indices] = values` and recomputes their ancestors.

  Duplicate indices are well defined: the last valid occurrence wins, as if the
  writes were applied one after another. Entries with `valid` False are skipped.

  Args:
    tree: the tree.
    indices: int32 `[B]`, leaf indices in `[0, C)`.
    values: float32 `[B]`, new leaf values, in `[0, LEAF_VALUE_LIMIT)`.
    valid: optional bool `[B]`.
    unique_indices: the caller promises the valid indices are distinct (as
      ring slots are), which skips the duplicate resolution.

  Returns:
    The updated tree. Cost O(B * K * log_K C), plus summing the levels of at
    most `DENSE_LEVEL_MAX` nodes whole.
  """
  return write_leaves(tree, indices, values, valid, unique_indices=unique_indices)[0]


def write_leaves(
  tree: SumTree,
  indices: jax.Array,
  values: jax.Array,
  valid: jax.Array | None = None,
  *,
  unique_indices: bool = False,
  largest_of: tuple[jax.Array, jax.Array] | None = None,
  leaf_values: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[SumTree, jax.Array | None]:
  """`set_leaves`, and with `largest_of = (running, candidates [B])` the
  largest of `running` and of the non-negative `candidates` (else None).

  `values` may be `()`, one value for every write; `leaf_values`, an
  elementwise function, turns `values` into the leaves written (computed in
  the kernel on a GPU, not in a launch of its own).

  On a GPU the writes, their duplicates' resolution and that maximum are one
  kernel (`sum_tree_kernels.write_leaves`), where the XLA operations are a
  few kernels per level.
  """
  indices = jnp.asarray(indices, jnp.int32)
  values = jnp.asarray(values, jnp.float32)
  batch_size = indices.shape[0]
  as_leaves = lambda values: jnp.broadcast_to(
    values if leaf_values is None else leaf_values(values), indices.shape
  )
  if largest_of is not None:
    largest_of = (
      jnp.asarray(largest_of[0], jnp.float32),
      jnp.asarray(largest_of[1], jnp.float32),
    )
  if not unique_indices and batch_size > MARKED_BATCH_MAX:
    # Writes applied chunk after chunk keep the last-occurrence-wins order.
    valid = jnp.ones(indices.shape, bool) if valid is None else valid
    for start in range(0, batch_size, MARKED_BATCH_MAX):
      chunk = slice(start, start + MARKED_BATCH_MAX)
      tree = set_leaves(tree, indices[chunk], as_leaves(values)[chunk], valid[chunk])
    return tree, None if largest_of is None else _largest(*largest_of)
  levels = tuple(tree.levels)
  xla = functools.partial(_write_levels_resolving, unique_indices=unique_indices)
  if len(levels) == 1 or not 0 < batch_size <= sum_tree_kernels.WRITE_BATCH_MAX:
    written, largest = xla(levels, indices, as_leaves(values), valid, largest_of)
  else:
    written, largest = choose_kernel(
      lambda levels, indices, values, valid, largest_of: xla(
        levels, indices, as_leaves(values), valid, largest_of
      ),
      functools.partial(
        sum_tree_kernels.write_leaves,
        branching=BRANCHING,
        unique_indices=unique_indices,
        leaf_values=leaf_values,
      ),
      levels,
      indices,
      values,
      valid,
      largest_of,
      kernel_variants=("pallas",),
    )
  return SumTree(tuple(written)), largest


def _largest(running: jax.Array, candidates: jax.Array) -> jax.Array:
  return jnp.maximum(running, jnp.max(candidates, initial=0.0))


def _write_levels_resolving(
  levels: tuple[jax.Array, ...],
  indices: jax.Array,
  values: jax.Array,
  valid: jax.Array | None,
  largest_of: tuple[jax.Array, jax.Array] | None,
  *,
  unique_indices: bool,
) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
  """`write_leaves` as XLA operations (`sum_tree_kernels.write_leaves`'s
  twin): duplicates resolved (`claim_last_writes`) unless `unique_indices`,
  then `_write_levels`."""
  largest = None if largest_of is None else _largest(*largest_of)
  valid = jnp.ones(indices.shape, bool) if valid is None else valid
  if unique_indices:
    return _write_levels(levels, indices, values, valid), largest
  leaf_level, write = claim_last_writes(levels[0], indices, valid)
  return _write_levels((leaf_level, *levels[1:]), indices, values, write), largest


def _write_levels(
  levels: tuple[jax.Array, ...], indices: jax.Array, values: jax.Array, write: jax.Array
) -> tuple[jax.Array, ...]:
  """`set_leaves`'s writes as XLA operations, level by level: the leaves
  where `write` (distinct indices there), then their ancestors."""
  levels_list = list(levels)
  levels_list[0] = (
    levels_list[0]
    .at[jnp.where(write, indices, levels_list[0].shape[0])]
    .set(values, mode="drop", unique_indices=True)
  )
  # Skipped entries may point anywhere; send them to node 0 so every gather
  # below is in bounds, and drop their scatters.
  node = jnp.where(write, indices, 0)
  for depth in range(len(levels_list) - 1):
    node = node // BRANCHING
    children = levels_list[depth].reshape(-1, BRANCHING)
    parent_level = levels_list[depth + 1]
    if children.size <= DENSE_LEVEL_MAX:
      # A small level is cheaper summed whole, in one kernel, than gathered
      # and scattered B rows at a time; only the lowest levels are not small.
      levels_list[depth + 1] = jax.lax.dynamic_update_slice(
        parent_level, children.sum(axis=1), (0,)
      )
      continue
    sums = children.at[node].get(mode="promise_in_bounds").sum(axis=1)
    # Siblings written in one batch share a parent; each of them writes the
    # same sum of the already-updated children, so the scatter is exact.
    levels_list[depth + 1] = parent_level.at[jnp.where(write, node, parent_level.shape[0])].set(
      sums, mode="drop"
    )
  return tuple(levels_list)


# A float32 target places itself to within about 2**-24 of the total: fine
# among 8**3 = 512 nodes (1/512 of the total is 2**15 of its ulps), not among
# the 2**24 or more leaves of a large tree, where leaves too light for the
# target's precision were never drawn (a sixth of 3 * 2**23 equal leaves).
# So a descent redraws its target, uniformly within the node it has reached,
# every LEVELS_PER_TARGET levels: each stretch of the descent then chooses
# among at most 512 nodes, and the probability of every leaf is its share of
# the total to within a few float32 roundings per stretch, at any capacity.
LEVELS_PER_TARGET = 3


def num_redraws(tree: SumTree) -> int:
  """How many fresh uniforms a descent of `tree` takes per target, R."""
  descent_levels = len(tree.levels) - 1
  return max(0, -(-descent_levels // LEVELS_PER_TARGET) - 1)


class LeafDraw(NamedTuple):
  """Leaves drawn in proportion to their values (`draw_leaves`)."""

  indices: jax.Array  # int32 [S]
  values: jax.Array  # float32 [S]: each leaf's value; 0 where the tree is empty
  smallest: jax.Array  # float32 (): the smallest of `values`
  # float32 (): the tree's total, as the draw read it. Read here rather than
  # from the tree: on a GPU a read of the root beside a later in-place write
  # of the tree would cost a copy of the root, a launch of its own.
  total: jax.Array


def draw_bits(key: jax.Array, batch_size: int, num_redraws: int) -> jax.Array:
  """A draw's random bits, uint32 `[3 + R, S]`, from one call to the generator.

  Row 0 places the targets (it is `random_uniform(key, (S,))`'s bits), rows
  1 to R are the redraws, row R + 1 orders the strata, row R + 2 is the low
  word of the uniform fallback's 64-bit index (row 0 its high word).
  """
  return random.random_bits(key, (3 + num_redraws, batch_size))


def draw_leaves(
  tree: SumTree,
  key: jax.Array,
  batch_size: int,
  *,
  stratified: bool,
  fallback_size: jax.Array | int = 0,
) -> LeafDraw:
  """Draws `batch_size` leaves, leaf i with probability `leaves[i] / total`.

  Should the total be zero, the leaves are drawn uniformly from
  `[0, fallback_size)` instead (leaf 0 if that is 0), with values 0. On a
  GPU the whole draw (targets, strata order, descent, fallback, smallest
  value) is one kernel (`sum_tree_kernels.draw`).

  Args:
    tree: the tree.
    key: a PRNG key.
    batch_size: S.
    stratified: one target in each of S equal strata of `[0, total)`, the
      strata in a uniformly random order (`random_strata_targets`);
      otherwise S independent targets.
    fallback_size: int32, the items to draw among when the total is zero.

  Returns:
    A `LeafDraw`.
  """
  bits = draw_bits(key, batch_size, num_redraws(tree))
  levels_top_down = tuple(reversed(tree.levels))
  fallback_size = jnp.asarray(fallback_size, jnp.int32)
  xla = functools.partial(_draw_levels, stratified=stratified)
  if len(tree.levels) == 1 or not 0 < batch_size <= sum_tree_kernels.DRAW_BATCH_MAX:
    indices, values, smallest, total_read = xla(levels_top_down, bits, fallback_size)
  else:
    indices, values, smallest, total_read = choose_kernel(
      xla,
      functools.partial(
        sum_tree_kernels.draw,
        branching=BRANCHING,
        levels_per_target=LEVELS_PER_TARGET,
        stratified=stratified,
      ),
      levels_top_down,
      bits,
      fallback_size,
      kernel_variants=("pallas_descent", "pallas"),
    )
  return LeafDraw(indices, values, smallest, total_read)


def _draw_levels(
  levels_top_down: tuple[jax.Array, ...],
  bits: jax.Array,
  fallback_size: jax.Array,
  *,
  stratified: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`draw_leaves` as XLA operations (`sum_tree_kernels.draw`'s twin)."""
  batch_size = bits.shape[1]
  total = levels_top_down[0][0]
  uniforms = random.uniform_from_bits(bits[0])
  if stratified:
    targets = random_strata_targets(uniforms, bits[-2], total)
  else:
    targets = uniforms * total
  if len(levels_top_down) == 1:  # a single leaf, which is also the root
    found = jnp.zeros((batch_size,), jnp.int32)
    values = jnp.broadcast_to(total, (batch_size,))
  else:
    found, values = _descend_levels(
      levels_top_down[1:], targets, random.uniform_from_bits(bits[1:-2])
    )
  span = jnp.maximum(fallback_size, 1).astype(jnp.uint32)
  has_mass = total > 0
  # A cond, not a where (the same values): the fallback's indices, an
  # elementwise function of the random bits, would otherwise be fused into
  # a gather of the rows drawn and their hash redone for every element of
  # every row (on CPU, where this path runs).
  # Inside `jax.shard_map` the two differ in how they vary over the mesh,
  # which a cond refuses: a where serves there.
  fallback = lambda: random.scale_to_span(bits[0], bits[-1], span).astype(jnp.int32)
  if _in_manual_mesh(found, bits):
    indices = jnp.where(has_mass, found, fallback())
  else:
    indices = jax.lax.cond(has_mass, lambda: found, fallback)
  values = jnp.where(has_mass, values, 0.0)
  return indices, values, jnp.min(values), total


def sample_leaves(
  tree: SumTree, key: jax.Array, batch_size: int, *, stratified: bool
) -> tuple[jax.Array, jax.Array]:
  """`draw_leaves` with no fallback: int32 `[S]` leaf indices (leaf 0 from an
  empty tree) and float32 `[S]` their leaf values."""
  drawn = draw_leaves(tree, key, batch_size, stratified=stratified)
  return drawn.indices, drawn.values


def draw_targets(
  key: jax.Array, batch_size: int, total_mass: jax.Array, num_redraws: int, *, stratified: bool
) -> tuple[jax.Array, jax.Array]:
  """S descent targets in `[0, total_mass)` and the R redraws they need.

  The rows of `draw_bits`, as `draw_leaves` uses them, so a sharded draw
  (which descends each device's tree) places its targets as one tree would.

  Returns:
    float32 `[S]` targets and float32 `[R, S]` uniforms in `[0, 1)`.
  """
  bits = draw_bits(key, batch_size, num_redraws)
  uniforms = random.uniform_from_bits(bits[: 1 + num_redraws])
  if stratified:
    targets = random_strata_targets(uniforms[0], bits[-2], total_mass)
  else:
    targets = uniforms[0] * total_mass
  return targets, uniforms[1:]


def random_strata_targets(
  uniforms: jax.Array, order_bits: jax.Array, total_mass: jax.Array
) -> jax.Array:
  """One target in each of S equal strata of `[0, total_mass)`, in random order.

  In stratum order, position j of every batch would come from stratum j: a
  prefix of the batch would hold only the low slots. Rotated by an offset,
  each position was a draw from the whole distribution, but neighbouring
  rows still came from neighbouring strata: with 32 items and 256 draws,
  rows came in strips of 8 of one item, so a minibatch cut from a sample
  (or a device's block of a sharded one) was far less varied than it
  looked. The strata are therefore put in a uniformly random order
  (`random.rank_keys`: each stratum at the rank of its random key among
  the batch's, which a GPU kernel counts lane against lane).

  Args:
    uniforms: float32 `[S]` in `[0, 1)`, the position within each stratum.
    order_bits: uint32 `[S]` random bits, independent of `uniforms`; they
      give the order of the strata.
    total_mass: float32 `()`.

  Returns:
    float32 `[S]` targets.
  """
  batch_size = uniforms.shape[0]
  strata = random.rank_keys(order_bits)
  return (strata.astype(jnp.float32) + uniforms) * (total_mass / batch_size)


def find_prefix_sums(
  tree: SumTree, targets: jax.Array, redraws: jax.Array | None = None
) -> jax.Array:
  """For each target, the leaf whose prefix-sum interval contains it.

  Without redraws (trees of at most 8**3 leaves), leaf i is returned for
  targets in `[sum(leaves[:i]), sum(leaves[:i+1]))`, so a target drawn
  uniformly from `[0, total)` returns leaf i with probability
  `leaves[i] / total`. Zero leaves are never returned while the total is
  positive, even for targets at or past the total through rounding.

  Args:
    tree: the tree.
    targets: float32 `[S]`.
    redraws: float32 `[R, S]` uniforms in `[0, 1)`, R = `num_redraws(tree)`.

  Returns:
    int32 `[S]` leaf indices.
  """
  indices, _ = find_prefix_sums_and_leaves(tree, targets, redraws)
  return indices


def row_prefix_sums(rows: jax.Array) -> jax.Array:
  """Inclusive prefix sums along axis 1 of `[S, K]`, in log2(K) shifted adds.

  XLA lowers `jnp.cumsum` to a reduce-window and a matmul with a triangular
  matrix of ones does K times the work; both measured several times slower.
  """
  prefix = rows
  shift = 1
  while shift < rows.shape[1]:
    prefix = prefix + jnp.pad(prefix[:, :-shift], ((0, 0), (shift, 0)))
    shift *= 2
  return prefix


def find_prefix_sums_and_leaves(
  tree: SumTree, targets: jax.Array, redraws: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """`find_prefix_sums`, and the values of the leaves found.

  Every `LEVELS_PER_TARGET` levels below the root, the target is replaced by
  `redraws[r] * (value of the node reached)`: a uniform position within it.

  The values come from the descent's own reads rather than a second gather of
  the leaves: a gather that nothing downstream depends on is unordered with a
  following in-place priority update, and XLA then copies the whole leaf level
  to keep it safe.

  Args:
    tree: the tree.
    targets: float32 `[S]`.
    redraws: float32 `[R, S]` uniforms in `[0, 1)`, R = `num_redraws(tree)`;
      may be None when R is 0.

  Returns:
    int32 `[S]` leaf indices and float32 `[S]` their leaf values.

  Raises:
    ValueError: if `redraws` is missing or not `[R, S]`.
  """
  targets = jnp.asarray(targets, jnp.float32)
  expected = (num_redraws(tree), *targets.shape)
  if redraws is None and expected[0] == 0:
    redraws = jnp.zeros(expected, jnp.float32)
  if redraws is None or tuple(jnp.shape(redraws)) != expected:
    raise ValueError(
      f"find_prefix_sums: a tree of {len(tree.levels)} levels needs redraws "
      f"of shape {expected} (uniforms in [0, 1); see sample_leaves), given "
      f"{None if redraws is None else tuple(jnp.shape(redraws))}."
    )
  node = jnp.zeros(targets.shape, jnp.int32)
  if len(tree.levels) == 1:  # a single leaf, which is also the root
    return node, jnp.broadcast_to(tree.levels[0][0], targets.shape)
  return choose_kernel(
    _descend_levels,
    functools.partial(
      sum_tree_kernels.descend, branching=BRANCHING, levels_per_target=LEVELS_PER_TARGET
    ),
    tuple(reversed(tree.levels[:-1])),
    targets,
    jnp.asarray(redraws, jnp.float32),
    kernel_variants=("pallas_descent", "pallas"),
  )


def _descend_levels(
  levels_top_down: tuple[jax.Array, ...], targets: jax.Array, redraws: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`find_prefix_sums_and_leaves`'s descent as XLA operations, level by level."""
  node = jnp.zeros(targets.shape, jnp.int32)
  child_position = jnp.arange(BRANCHING, dtype=jnp.int32)[None, :]
  child: jax.Array  # [S]: set by each level, read by the next
  children: jax.Array  # [S, K]: likewise
  for depth, level in enumerate(levels_top_down):
    if depth and depth % LEVELS_PER_TARGET == 0:
      node_value = jnp.sum(
        jnp.where(child_position == child[:, None], children, 0.0),  # noqa: F821
        axis=1,
      )
      targets = redraws[depth // LEVELS_PER_TARGET - 1] * node_value
    children = level.reshape(-1, BRANCHING).at[node].get(mode="promise_in_bounds")
    prefix = row_prefix_sums(children)
    # The first positive child whose prefix sum passes the target, scored
    # j < K; failing that (rounding, or a target outside [0, total)), the
    # last positive child, scored 2K - 1 - j; with no positive child at all
    # (an empty tree), child 0. One reduction, and a zero child is never
    # picked, even where rounding left the prefix sums not quite monotonic.
    score = jnp.min(
      jnp.where(
        children > 0,
        jnp.where(prefix > targets[:, None], child_position, 2 * BRANCHING - 1 - child_position),
        2 * BRANCHING - 1,
      ),
      axis=1,
    )
    child = jnp.where(score < BRANCHING, score, 2 * BRANCHING - 1 - score)
    before = jnp.sum(jnp.where(child_position == child[:, None] - 1, prefix, 0.0), axis=1)
    targets = targets - before
    node = node * BRANCHING + child
  leaf_values = jnp.sum(jnp.where(child_position == child[:, None], children, 0.0), axis=1)
  return node, leaf_values
