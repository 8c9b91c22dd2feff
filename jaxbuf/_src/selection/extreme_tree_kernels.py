"""The max tree's leaf writes and its top-S selection, each as one Pallas kernel.

Shape key: B batch of writes, S number of selections, K branching factor,
P S padded to a power of two (Triton's blocks must be).

On a GPU the XLA forms (`extreme_tree.set_leaves`, `extreme_tree.top`) are
kernels per level, one level after another: a gather and a scatter per level
for a write, a `top_k` and a sort per level for a selection, where the bytes
(S * K floats per level) take microseconds.

* `write_leaves`: one program writes B leaves, then their parents level by
  level, each the largest of its K children, in place (the sum tree's write,
  `sum_tree_kernels.write_leaves`, with a max for the sum).
* `top`: one program runs `extreme_tree.top`'s beam from the root to the
  leaves. At each level the S best of the S * K children of the nodes kept
  (value first, then the lower node) are the children at or above the S-th
  largest value: found bit by bit over an integer key that orders the floats
  (31 counts of the candidates per level, no sort), ties at that value to
  the first in node order (a prefix count), then compacted in node order
  through a scratch buffer. The S leaves found are ranked (value, then
  index) by comparing each with every other, and stored in that order.

Every S best are one set, whatever finds them, so `top` returns what the XLA
beam returns, bit for bit; a max of children is exact in any order, so
`write_leaves` gives the XLA tree bit for bit too. They are lowered by Triton
on a GPU; elsewhere they run in Pallas's interpret mode, which is how the CPU
suite checks them against the XLA forms. `extreme_tree` chooses at trace time.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

NUM_WARPS = 4
# A batch of leaf writes is one program (the sum tree's limit); larger
# batches take the XLA path.
WRITE_BATCH_MAX = 4096
# Leaves ranked against this many others at a time in `top`'s last step:
# a [P, RANK_CHUNK] comparison, small enough for a program's registers.
RANK_CHUNK = 16


def write_leaves(
  levels: tuple[jax.Array, ...],
  indices: jax.Array,
  values: jax.Array,
  write: jax.Array,
  *,
  branching: int,
  interpret: bool,
) -> tuple[jax.Array, ...]:
  """Sets `leaves[indices] = values` where `write`, and every ancestor of a
  written leaf to the largest of its K children, in one kernel, in place.

  Args:
    levels: the max tree's levels bottom-up, each float32.
    indices: int32 `[B]`, B <= `WRITE_BATCH_MAX`; the indices with `write`
      True are distinct.
    values: float32 `[B]`.
    write: bool `[B]`.
    branching: K.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    The levels written.
  """
  batch_size = indices.shape[0]
  assert batch_size <= WRITE_BATCH_MAX and values.shape == write.shape == (batch_size,)
  padded = pl.next_power_of_2(batch_size)
  rows = lambda values: jnp.pad(values, (0, padded - batch_size))
  kernel = functools.partial(
    _write_kernel, num_levels=len(levels), branching=branching, interpret=interpret
  )
  return pl.pallas_call(
    kernel,
    out_shape=tuple(jax.ShapeDtypeStruct(level.shape, level.dtype) for level in levels),
    grid=(1,),
    in_specs=[pl.no_block_spec] * (len(levels) + 3),
    out_specs=tuple(pl.no_block_spec for _ in levels),
    input_output_aliases={position: position for position in range(len(levels))},
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="max_tree_write",
  )(*levels, *_every_lane_stores_what_a_writer_stores(rows(indices), rows(values), rows(write)))


def _every_lane_stores_what_a_writer_stores(
  indices: jax.Array, values: jax.Array, write: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Lanes that write nothing take the first writing lane's index and value,
  and every lane stores (none, if no lane writes): int32 `[B]` indices,
  float32 `[B]` values, int32 `[B]` store flags.

  Then every store to a slot or a parent stores the same value, whichever
  lane's lands last: Pallas's interpreter stores a masked lane's old value
  back, which could undo a writer's store to the same slot.
  """
  first = jnp.argmax(write)
  any_write = jnp.any(write)
  anchor = jnp.where(any_write, indices[first], 0)  # a skipped index may be out of bounds
  stores = jnp.broadcast_to(any_write, write.shape).astype(jnp.int32)
  return jnp.where(write, indices, anchor), jnp.where(write, values, values[first]), stores


def _write_kernel(*refs: Any, num_levels: int, branching: int, interpret: bool) -> None:
  indices_ref, values_ref, write_ref = refs[num_levels : num_levels + 3]
  levels = refs[num_levels + 3 :]  # the outputs, aliased to the inputs
  write = write_ref[...] != 0
  node = indices_ref[...]
  pallas_triton.store(levels[0].at[node], values_ref[...], mask=write)
  for depth in range(num_levels - 1):
    if not interpret:  # the interpreter runs one lane after another
      pallas_triton.debug_barrier()
    node = node // branching
    first = node * branching
    largest = pallas_triton.load(levels[depth].at[first])
    for position in range(1, branching):
      largest = jnp.maximum(largest, pallas_triton.load(levels[depth].at[first + position]))
    pallas_triton.store(levels[depth + 1].at[node], largest, mask=write)


def top(
  levels_top_down: tuple[jax.Array, ...], *, count: int, branching: int, interpret: bool
) -> tuple[jax.Array, jax.Array]:
  """The `count` largest leaves, largest first, ties to the lower index, in
  one kernel; the tree is only read.

  Args:
    levels_top_down: the max tree's levels below the root, the root's
      children first, the leaves last; each float32 `[K * m]`, no NaN.
    count: S.
    branching: K.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    int32 `[S]` indices and float32 `[S]` values, as `extreme_tree.top`
    returns them: past the leaves that are not empty, index 0 and -inf.
  """
  padded = max(pl.next_power_of_2(count), RANK_CHUNK)
  kernel = functools.partial(
    _top_kernel,
    num_levels=len(levels_top_down),
    count=count,
    branching=branching,
    interpret=interpret,
  )
  indices, values, _, _ = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded,), jnp.float32),
      # Scratch: nodes kept (and a region for lanes that store nothing), keys.
      jax.ShapeDtypeStruct((2 * padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded,), jnp.int32),
    ),
    grid=(1,),
    in_specs=[pl.no_block_spec] * len(levels_top_down),
    out_specs=tuple(pl.no_block_spec for _ in range(4)),
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="max_tree_top",
  )(*levels_top_down)
  return indices[:count], values[:count]


def order_keys(values: jax.Array) -> jax.Array:
  """int32 keys in the order of the float32 `values` (no NaN; -0 below +0)."""
  bits = jax.lax.bitcast_convert_type(values, jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


# order_keys(-inf), as a constant: Triton cannot bitcast one.
_LOWEST_KEY = int(np.float32(-np.inf).view(np.int32) ^ np.int32(0x7FFFFFFF))


def _count_at_least(keys: list[jax.Array], threshold: jax.Array) -> jax.Array:
  total = jnp.zeros(keys[0].shape, jnp.int32)
  for column in keys:
    total = total + (column >= threshold).astype(jnp.int32)
  return jnp.sum(total, dtype=jnp.int32)


def _kth_largest_key(keys: list[jax.Array], count: int) -> jax.Array:
  """The largest t with at least `count` keys >= t: the count-th largest key.

  Built bit by bit, the sign bit first (keys >= 0), then bits 30 to 0.
  """
  threshold = jnp.where(
    _count_at_least(keys, jnp.int32(0)) >= count, jnp.int32(0), jnp.int32(-(2**31))
  )

  def next_bit(_, carry):
    threshold, bit = carry
    trial = threshold | bit
    threshold = jnp.where(_count_at_least(keys, trial) >= count, trial, threshold)
    return threshold, jax.lax.shift_right_logical(bit, jnp.int32(1))

  threshold, _ = jax.lax.fori_loop(0, 31, next_bit, (threshold, jnp.int32(2**30)))
  return threshold


def _exclusive_prefix(flags: list[jax.Array]) -> list[jax.Array]:
  """For K int32 columns of flags over P parents (child j of parent p at
  p * K + j), how many flags come before each in that order."""
  per_parent = functools.reduce(jnp.add, flags)
  before = jax.lax.cumsum(per_parent, axis=0) - per_parent
  result = []
  for column in flags:
    result.append(before)
    before = before + column
  return result


def _barrier(interpret: bool) -> None:
  if not interpret:  # the interpreter runs one lane after another
    pallas_triton.debug_barrier()


def _top_kernel(*refs: Any, num_levels: int, count: int, branching: int, interpret: bool) -> None:
  level_refs = refs[:num_levels]
  indices_ref, values_ref, nodes_ref, keys_ref = refs[num_levels:]
  padded = indices_ref.shape[0]
  lanes = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
  nodes = jnp.where(lanes == 0, 0, -1).astype(jnp.int32)  # the root alone, then padding
  for level_ref in level_refs:
    real = nodes >= 0
    first = jnp.maximum(nodes, 0) * branching
    values = [
      jnp.where(real, level_ref[first + position], -jnp.inf) for position in range(branching)
    ]
    keys = [order_keys(column) for column in values]
    threshold = _kth_largest_key(keys, count)
    above = [(column > threshold).astype(jnp.int32) for column in keys]
    num_above = jnp.sum(functools.reduce(jnp.add, above), dtype=jnp.int32)
    equal = [(column == threshold).astype(jnp.int32) for column in keys]
    equal_before = _exclusive_prefix(equal)
    chosen = [
      ((above[position] + equal[position] * (equal_before[position] < count - num_above)) > 0)
      & (values[position] > -jnp.inf)
      for position in range(branching)
    ]
    # Compacted in node order: parents are, and so are each one's children.
    slots = _exclusive_prefix([column.astype(jnp.int32) for column in chosen])
    nodes_ref[lanes] = jnp.full((padded,), -1, jnp.int32)
    _barrier(interpret)
    for position in range(branching):
      # A lane that stores nothing aims past the kept nodes, where no lane
      # stores (the interpreter writes a masked lane's old value back).
      target = jnp.where(chosen[position], slots[position], padded + lanes)
      pallas_triton.store(
        nodes_ref.at[target], (first + position).astype(jnp.int32), mask=chosen[position]
      )
    _barrier(interpret)
    nodes = nodes_ref[lanes]
    _barrier(interpret)
  # The leaves kept, in index order: rank each by value, then index.
  real = nodes >= 0
  leaf_values = jnp.where(real, level_refs[-1][jnp.maximum(nodes, 0)], -jnp.inf)
  leaf_keys = jnp.where(real, order_keys(leaf_values), _LOWEST_KEY)
  keys_ref[lanes] = leaf_keys
  _barrier(interpret)
  rank = jnp.zeros((padded,), jnp.int32)
  for start in range(0, padded, RANK_CHUNK):
    others = keys_ref[pl.ds(start, RANK_CHUNK)][None, :]
    other_lanes = start + jax.lax.broadcasted_iota(jnp.int32, (1, RANK_CHUNK), 1)
    mine = leaf_keys[:, None]
    better = (others > mine) | ((others == mine) & (other_lanes < lanes[:, None]))
    rank = rank + jnp.sum(better.astype(jnp.int32), axis=1, dtype=jnp.int32)
  # Leaves kept fill lanes [0, n) and rank among themselves; padding keeps
  # its lane, so every lane stores to a distinct position.
  rank = jnp.where(real, rank, lanes)
  indices_ref[rank] = jnp.where(real, nodes, 0).astype(jnp.int32)
  values_ref[rank] = leaf_values
