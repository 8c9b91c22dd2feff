"""The sum tree's descent and its leaf writes, each as one Pallas kernel.

Shape key: S number of descents, B batch of writes, K branching factor, R
redraws per target.

On a GPU the XLA forms (`sum_tree.find_prefix_sums_and_leaves`,
`sum_tree.set_leaves`) are several kernels per level, one level after
another: at 1M leaves, 7 levels of dependent launches, where the bytes read
(S * K floats per level, the top levels in L2) take a few microseconds.

* `descend`: each program takes a block of targets, reads the K children of
  its node at every level as K gathers from the level in memory, and keeps
  the targets, nodes and children in registers from the root to the leaves.
  The arithmetic is the XLA descent's, operation for operation (the children
  as K columns instead of an `[S, K]` row each; prefix sums by the same
  shifted adds; picks by selects where XLA sums one nonzero term with zeros,
  which is exact), so both return the same leaves and values, bit for bit.
* `write_leaves`: one program writes B leaves, then their parents level by
  level (each parent the sum of its K children, never adjusted by a delta),
  in place.

They are lowered by Triton on a GPU (the compiler parameters below);
elsewhere they run only in Pallas's interpret mode, which is how the CPU
suite checks them against the XLA path. `sum_tree` chooses at trace time.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

# Targets per program: a power of two, as Triton's blocks must be. At S = 256
# that is 2 programs of 4 warps each; more, smaller programs spread the
# dependent chain of gathers over more of the GPU's multiprocessors.
BLOCK = 128
NUM_WARPS = 4


def descend(
  levels_top_down: tuple[jax.Array, ...],
  targets: jax.Array,
  redraws: jax.Array,
  *,
  branching: int,
  levels_per_target: int,
  interpret: bool,
) -> tuple[jax.Array, jax.Array]:
  """The leaf each target falls in, and that leaf's value, in one kernel.

  Args:
    levels_top_down: the tree's levels below the root, the root's children
      first, the leaves last; each float32 `[K * m]`.
    targets: float32 `[S]`, in `[0, total)`.
    redraws: float32 `[R, S]` uniforms in `[0, 1)`: every `levels_per_target`
      levels the target becomes `redraws[r] * (value of the node reached)`.
    branching: K.
    levels_per_target: levels descended per target or redraw.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    int32 `[S]` leaf indices and float32 `[S]` their values, as
    `sum_tree.find_prefix_sums_and_leaves` returns them.
  """
  batch_size = targets.shape[0]
  block = min(BLOCK, pl.next_power_of_2(batch_size))
  padded = pl.cdiv(batch_size, block) * block
  # Padding rows descend from target 0 like any other and are cut off below.
  rows = lambda values: jnp.pad(values, (0, padded - batch_size))
  redraw_rows = [rows(redraw) for redraw in redraws]
  per_block = pl.BlockSpec((block,), lambda i: (i,))
  kernel = functools.partial(
    _descent_kernel,
    num_levels=len(levels_top_down),
    num_redraws=len(redraw_rows),
    branching=branching,
    levels_per_target=levels_per_target,
  )
  nodes, values = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded,), jnp.float32),
    ),
    grid=(padded // block,),
    in_specs=[pl.no_block_spec] * len(levels_top_down) + [per_block] * (1 + len(redraw_rows)),
    out_specs=(per_block, per_block),
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="sum_tree_descent",
  )(*levels_top_down, rows(targets), *redraw_rows)
  return nodes[:batch_size], values[:batch_size]


def _descent_kernel(
  *refs: Any, num_levels: int, num_redraws: int, branching: int, levels_per_target: int
) -> None:
  level_refs = refs[:num_levels]
  targets = refs[num_levels][...]
  redraw_refs = refs[num_levels + 1 : num_levels + 1 + num_redraws]
  nodes_ref, values_ref = refs[-2:]
  node = jnp.zeros(targets.shape, jnp.int32)
  children: list[jax.Array] = []  # K columns [block]: set by each level
  child = node  # [block]: likewise
  for depth, level_ref in enumerate(level_refs):
    if depth and depth % levels_per_target == 0:
      targets = redraw_refs[depth // levels_per_target - 1][...] * _pick(children, child)
    first = node * branching
    children = [level_ref[first + position] for position in range(branching)]
    prefix = _prefix_sums(children)
    # The scores of `sum_tree.find_prefix_sums_and_leaves`: the first
    # positive child past the target, else the last positive child, else 0.
    last = 2 * branching - 1
    score = jnp.full(targets.shape, last, jnp.int32)
    for position in range(branching):
      passed = jnp.where(prefix[position] > targets, position, last - position)
      score = jnp.minimum(score, jnp.where(children[position] > 0, passed, last).astype(jnp.int32))
    child = jnp.where(score < branching, score, last - score).astype(jnp.int32)
    targets = targets - _pick(prefix, child - 1)
    node = first + child
  nodes_ref[...] = node
  values_ref[...] = _pick(children, child)


def _prefix_sums(columns: list[jax.Array]) -> list[jax.Array]:
  """Inclusive prefix sums over K columns, by `sum_tree.row_prefix_sums`'s
  shifted adds (the same additions in the same order)."""
  prefix = list(columns)
  shift = 1
  while shift < len(columns):
    prefix = [
      value + prefix[position - shift] if position >= shift else value
      for position, value in enumerate(prefix)
    ]
    shift *= 2
  return prefix


def _pick(columns: list[jax.Array], position: jax.Array) -> jax.Array:
  """`columns[position]` per row, 0 where `position` is outside `[0, K)`."""
  picked = jnp.zeros(position.shape, jnp.float32)
  for index, column in enumerate(columns):
    picked = jnp.where(position == index, column, picked)
  return picked


# A batch of leaf writes is one program: its lanes write the leaves, then
# each level's parents, a barrier between levels so every lane reads the
# children its siblings wrote. Larger batches (a fill) take the XLA path.
WRITE_BATCH_MAX = 4096


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
  written leaf to the sum of its K children, in one kernel, in place.

  Args:
    levels: the tree's levels bottom-up, each float32 (`sum_tree.SumTree`).
    indices: int32 `[B]`, B <= `WRITE_BATCH_MAX`; the indices with `write`
      True are distinct.
    values: float32 `[B]`.
    write: bool `[B]`.
    branching: K.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    The levels written. A parent's K children are summed first to last, as
    XLA's CPU reduction does; a GPU's XLA reduction may order them
    otherwise, so a parent can differ from the XLA path's by a rounding.
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
    name="sum_tree_write",
  )(*levels, *_every_lane_stores_what_a_writer_stores(rows(indices), rows(values), rows(write)))


def _every_lane_stores_what_a_writer_stores(
  indices: jax.Array, values: jax.Array, write: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Lanes that write nothing take the first writing lane's index and value,
  and every lane stores (none, if no lane writes): int32 `[B]` indices,
  float32 `[B]` values, int32 `[B]` store flags.

  Then every store to a slot or a parent stores the same value, whichever
  lane's lands last. A masked-off lane cannot simply be sent to slot 0:
  Pallas's interpreter stores a masked lane's old value back, which could
  undo a writer's store to the same slot.
  """
  first = jnp.argmax(write)
  any_write = jnp.any(write)
  # With no writer, every lane reads (not stores) along leaf 0's path: an
  # index of a skipped write may be out of bounds.
  anchor = jnp.where(any_write, indices[first], 0)
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
    total = pallas_triton.load(levels[depth].at[first])
    for position in range(1, branching):
      total = total + pallas_triton.load(levels[depth].at[first + position])
    pallas_triton.store(levels[depth + 1].at[node], total, mask=write)
