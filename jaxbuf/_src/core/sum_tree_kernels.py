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
from typing import Any, Callable

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
  node, value = _descend(
    level_refs,
    targets,
    lambda redraw: redraw_refs[redraw - 1][...],
    branching=branching,
    levels_per_target=levels_per_target,
  )
  nodes_ref[...] = node
  values_ref[...] = value


def _descend(
  level_refs: Any,
  targets: jax.Array,
  redraw_at: Callable[[int], jax.Array],
  *,
  branching: int,
  levels_per_target: int,
) -> tuple[jax.Array, jax.Array]:
  """Each lane's descent from the root's children to a leaf: its node and
  value. Every `levels_per_target` levels the target becomes `redraw_at(r)`
  (uniforms, r from 1) times the value of the node reached. The arithmetic of
  `sum_tree.find_prefix_sums_and_leaves`, operation for operation."""
  node = jnp.zeros(targets.shape, jnp.int32)
  children: list[jax.Array] = []  # K columns [lanes]: set by each level
  child = node  # [lanes]: likewise
  for depth, level_ref in enumerate(level_refs):
    if depth and depth % levels_per_target == 0:
      targets = redraw_at(depth // levels_per_target) * _pick(children, child)
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
  return node, _pick(children, child)


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


# A draw is one program: its lanes rank the order bits against each other
# (the strata order) and reduce the smallest leaf drawn, so every target of
# the batch sits in the one program. RANK_CHUNK lanes of keys are compared at
# a time ([S, RANK_CHUNK] in registers). Larger batches take the XLA path.
DRAW_BATCH_MAX = 1024
RANK_CHUNK = 32


def draw(
  levels_top_down: tuple[jax.Array, ...],
  bits: jax.Array,
  fallback_size: jax.Array,
  *,
  branching: int,
  levels_per_target: int,
  stratified: bool,
  interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`sum_tree.draw_leaves` from its random bits, in one kernel: the targets
  (strata ranked in the kernel), the descent, the uniform fallback of an
  empty tree, and the smallest leaf drawn.

  Args:
    levels_top_down: every level, the root first, the leaves last.
    bits: uint32 `[3 + R, S]`, `sum_tree.draw_bits`'s rows, S <= `DRAW_BATCH_MAX`.
    fallback_size: int32 `()`: with a zero total, leaves are drawn uniformly
      from `[0, fallback_size)` (leaf 0 if it is 0).
    branching, levels_per_target: the tree's.
    stratified: one target per stratum, strata ordered by the ranks of the
      order bits (`random.rank_keys`).
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    int32 `[S]` leaves, float32 `[S]` their values, float32 `()` the smallest
    value drawn and float32 `()` the total, as `sum_tree.draw_leaves`
    computes them.
  """
  num_rows, batch_size = bits.shape
  assert batch_size <= DRAW_BATCH_MAX, batch_size
  padded = max(RANK_CHUNK, pl.next_power_of_2(batch_size))
  # One array, row after row (a reshape, not a copy, where S is a power of
  # two): rows passed apart would each be sliced out by a kernel of its own.
  bit_rows = jnp.pad(bits, ((0, 0), (0, padded - batch_size))).reshape(num_rows * padded)
  kernel = functools.partial(
    _draw_kernel,
    num_levels=len(levels_top_down),
    num_rows=num_rows,
    batch_size=batch_size,
    branching=branching,
    levels_per_target=levels_per_target,
    stratified=stratified,
  )
  nodes, values, smallest, total = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded,), jnp.float32),
      jax.ShapeDtypeStruct((padded,), jnp.float32),
      jax.ShapeDtypeStruct((padded,), jnp.float32),
    ),
    grid=(1,),
    in_specs=[pl.no_block_spec] * (len(levels_top_down) + 2),
    out_specs=(pl.no_block_spec,) * 4,
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="sum_tree_draw",
  )(*levels_top_down, jnp.reshape(fallback_size.astype(jnp.int32), (1,)), bit_rows)
  return nodes[:batch_size], values[:batch_size], smallest[0], total[0]


def uniform_of(bits: jax.Array) -> jax.Array:
  """`random.uniform_from_bits`, exactly: the top 23 bits times 2**-23."""
  return (bits >> 9).astype(jnp.float32) * (2.0**-23)


def scale_to_span(higher: jax.Array, lower: jax.Array, span: jax.Array) -> jax.Array:
  """`random.scale_to_span`, with Python constants (Triton takes no NumPy
  scalars), uint32 `[S]`."""
  mask, sixteen = 0xFFFF, 16

  def multiply_high(a, b):
    a_low, a_high = a & mask, a >> sixteen
    b_low, b_high = b & mask, b >> sixteen
    low_low = a_low * b_low
    middle = a_high * b_low + (low_low >> sixteen)
    other_middle = a_low * b_high + (middle & mask)
    return a_high * b_high + (middle >> sixteen) + (other_middle >> sixteen), a * b

  high_of_high, low_of_high = multiply_high(higher, span)
  carry_source, _ = multiply_high(lower, span)
  low_word = low_of_high + carry_source
  return high_of_high + (low_word < low_of_high).astype(jnp.uint32)


def _draw_kernel(
  *refs: Any,
  num_levels: int,
  num_rows: int,
  batch_size: int,
  branching: int,
  levels_per_target: int,
  stratified: bool,
) -> None:
  root_ref, level_refs = refs[0], refs[1:num_levels]
  fallback_size_ref, bits_ref = refs[num_levels], refs[num_levels + 1]
  nodes_ref, values_ref, smallest_ref, total_ref = refs[-4:]
  padded = nodes_ref.shape[0]
  row = lambda index: bits_ref[pl.ds(index * padded, padded)]
  lanes = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
  zeros = jnp.zeros((padded,), jnp.int32)
  total = root_ref[zeros]
  uniforms = uniform_of(row(0))
  if stratified:
    ranks = _ranks(bits_ref, (num_rows - 2) * padded, padded, batch_size)
    targets = (ranks.astype(jnp.float32) + uniforms) * (total / batch_size)
  else:
    targets = uniforms * total
  node, values = _descend(
    level_refs,
    targets,
    lambda redraw: uniform_of(row(redraw)),
    branching=branching,
    levels_per_target=levels_per_target,
  )
  span = jnp.maximum(fallback_size_ref[zeros], 1).astype(jnp.uint32)
  fallback = scale_to_span(row(0), row(num_rows - 1), span).astype(jnp.int32)
  has_mass = total > 0
  nodes_ref[...] = jnp.where(has_mass, node, fallback)
  values_ref[...] = jnp.where(has_mass, values, 0.0)
  drawn = jnp.where(lanes < batch_size, jnp.where(has_mass, values, 0.0), jnp.inf)
  smallest_ref[...] = jnp.broadcast_to(jnp.min(drawn), (padded,))
  total_ref[...] = total


def _ranks(bits_ref: Any, offset: int, padded: int, batch_size: int) -> jax.Array:
  """`random.rank_keys` of the `batch_size` order bits at `bits_ref[offset:]`:
  int32 `[P]`, each lane's count of keys below its own, the keys packed with
  the lane's index (`random.short_permutation`'s packing) so none tie."""
  index_bits = max(1, (batch_size - 1).bit_length())
  packed = lambda bits, index: ((bits >> index_bits) << index_bits) | index
  lanes = jax.lax.broadcasted_iota(jnp.uint32, (padded,), 0)
  own = packed(bits_ref[pl.ds(offset, padded)], lanes)
  ranks = jnp.zeros((padded,), jnp.int32)
  for start in range(0, batch_size, RANK_CHUNK):
    chunk = start + jax.lax.broadcasted_iota(jnp.uint32, (RANK_CHUNK,), 0)
    others = packed(bits_ref[pl.ds(offset + start, RANK_CHUNK)], chunk)
    below = (others[None, :] < own[:, None]) & (chunk[None, :] < batch_size)
    ranks = ranks + jnp.sum(below.astype(jnp.int32), axis=1)
  return ranks


# A batch of leaf writes is one program: its lanes write the leaves, then
# each level's parents, a barrier between levels so every lane reads the
# children its siblings wrote. Larger batches (a fill) take the XLA path.
WRITE_BATCH_MAX = 4096


def write_leaves(
  levels: tuple[jax.Array, ...],
  indices: jax.Array,
  values: jax.Array,
  valid: jax.Array | None,
  largest_of: tuple[jax.Array, jax.Array] | None,
  *,
  branching: int,
  unique_indices: bool,
  leaf_values: Callable[[jax.Array], jax.Array] | None,
  interpret: bool,
) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
  """`sum_tree.set_leaves` in one kernel, in place: `leaves[indices] = values`
  where `valid` (None: every write; the last valid write of an index wins,
  resolved in the kernel unless `unique_indices`), and every ancestor of a
  written leaf set to the sum of its K children.

  Args:
    levels: the tree's levels bottom-up, each float32 (`sum_tree.SumTree`).
    indices: int32 `[B]`, B <= `WRITE_BATCH_MAX`.
    values: float32 `[B]`, or `()`: one value for every write.
    valid: bool `[B]`, or None.
    largest_of: (float32 `()` a running largest, float32 `[B]` candidates),
      or None: the kernel also returns the largest of the running value and
      the candidates (a priority buffer's running maximum priority).
    branching: K.
    unique_indices: the valid indices are distinct (ring slots).
    leaf_values: an elementwise function the kernel applies to `values`
      before writing them (None: none), so that what computes the leaves
      runs in the kernel instead of a launch of its own.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    The levels written, and the new running largest (None without
    `largest_of`). A parent's K children are summed first to last, as XLA's
    CPU reduction does; a GPU's XLA reduction may order them otherwise, so a
    parent can differ from the XLA path's by a rounding.
  """
  batch_size = indices.shape[0]
  assert batch_size <= WRITE_BATCH_MAX and values.shape in ((batch_size,), ())
  padded = max(RANK_CHUNK, pl.next_power_of_2(batch_size))
  rows = lambda values: jnp.pad(values, (0, padded - batch_size))
  values = values.astype(jnp.float32)
  operands = [
    rows(indices.astype(jnp.int32)),
    jnp.reshape(values, (1,)) if values.shape == () else rows(values),
  ]
  if valid is not None:
    operands.append(rows(valid.astype(jnp.int32)))
  out_shape = [jax.ShapeDtypeStruct(level.shape, level.dtype) for level in levels]
  if largest_of is not None:
    running, candidates = largest_of
    operands += [jnp.reshape(running.astype(jnp.float32), (1,)), rows(candidates)]
    out_shape.append(jax.ShapeDtypeStruct((1,), jnp.float32))
  kernel = functools.partial(
    _write_kernel,
    num_levels=len(levels),
    branching=branching,
    batch_size=batch_size,
    has_valid=valid is not None,
    one_value=values.shape == (),
    leaf_values=leaf_values,
    tracks_largest=largest_of is not None,
    unique_indices=unique_indices,
    interpret=interpret,
  )
  written = pl.pallas_call(
    kernel,
    out_shape=tuple(out_shape),
    grid=(1,),
    in_specs=[pl.no_block_spec] * (len(levels) + len(operands)),
    out_specs=tuple(pl.no_block_spec for _ in out_shape),
    # The levels written in place, and the running largest too (a loop's
    # carry: an output of its own would be copied into it).
    input_output_aliases={
      **{position: position for position in range(len(levels))},
      **({len(levels) + len(operands) - 2: len(levels)} if largest_of is not None else {}),
    },
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="sum_tree_write",
  )(*levels, *operands)
  if largest_of is None:
    return tuple(written), None
  return tuple(written[:-1]), written[-1][0]


def _last_writes(indices_ref: Any, valid: jax.Array, valid_ref: Any, batch_size: int) -> jax.Array:
  """bool `[P]`: lane i is `valid` and no later valid lane has its index
  (`valid_ref`: the valid flags as int32, or None if every lane is)."""
  padded = indices_ref.shape[0]
  lanes = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
  indices = indices_ref[...]
  superseded = jnp.zeros((padded,), jnp.int32)
  for start in range(0, batch_size, RANK_CHUNK):
    chunk = start + jax.lax.broadcasted_iota(jnp.int32, (RANK_CHUNK,), 0)
    later = (
      (chunk[None, :] > lanes[:, None])
      & (chunk[None, :] < batch_size)
      & (indices_ref[pl.ds(start, RANK_CHUNK)][None, :] == indices[:, None])
    )
    if valid_ref is not None:
      later = later & (valid_ref[pl.ds(start, RANK_CHUNK)][None, :] != 0)
    superseded = jnp.maximum(superseded, jnp.max(later.astype(jnp.int32), axis=1))
  return valid & (superseded == 0)


def _write_kernel(
  *refs: Any,
  num_levels: int,
  branching: int,
  batch_size: int,
  has_valid: bool,
  one_value: bool,
  leaf_values: Callable[[jax.Array], jax.Array] | None,
  tracks_largest: bool,
  unique_indices: bool,
  interpret: bool,
) -> None:
  inputs = list(refs[num_levels:])
  indices_ref, values_ref = inputs.pop(0), inputs.pop(0)
  valid_ref = inputs.pop(0) if has_valid else None
  if tracks_largest:
    running_ref, candidates_ref = inputs.pop(0), inputs.pop(0)
    levels, largest_ref = inputs[:-1], inputs[-1]  # the outputs: levels aliased to the inputs
  else:
    levels = inputs
  padded = indices_ref.shape[0]
  lanes = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
  valid = lanes < batch_size
  if valid_ref is not None:
    valid = valid & (valid_ref[...] != 0)
  write = valid if unique_indices else _last_writes(indices_ref, valid, valid_ref, batch_size)
  if tracks_largest:
    candidates = jnp.where(lanes < batch_size, candidates_ref[...], 0.0)
    largest_ref[...] = jnp.maximum(running_ref[...], jnp.max(candidates, keepdims=True))
  # Lanes that write nothing store what the first writing lane stores, and
  # every lane stores (none, if no lane writes): then every store to a slot
  # or a parent stores the same value, whichever lane's lands last. A
  # masked-off lane cannot simply be sent to slot 0: Pallas's interpreter
  # stores a masked lane's old value back, which could undo a writer's store
  # to the same slot. With no writer, every lane reads along leaf 0's path
  # (an index of a skipped write may be out of bounds).
  first = jnp.min(jnp.where(write, lanes, padded))
  stores = jnp.broadcast_to(first < padded, (padded,))
  anchor = jnp.broadcast_to(jnp.minimum(first, padded - 1), (padded,))
  node = jnp.where(write, indices_ref[...], jnp.where(stores, indices_ref[anchor], 0))
  if one_value:
    values = values_ref[jnp.zeros((padded,), jnp.int32)]
  else:
    values = jnp.where(write, values_ref[...], values_ref[anchor])
  if leaf_values is not None:
    values = leaf_values(values)
  pallas_triton.store(levels[0].at[node], values, mask=stores)
  for depth in range(num_levels - 1):
    if not interpret:  # the interpreter runs one lane after another
      pallas_triton.debug_barrier()
    node = node // branching
    first_child = node * branching
    total = pallas_triton.load(levels[depth].at[first_child])
    for position in range(1, branching):
      total = total + pallas_triton.load(levels[depth].at[first_child + position])
    pallas_triton.store(levels[depth + 1].at[node], total, mask=stores)
