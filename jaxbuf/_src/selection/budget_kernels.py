"""A budgeted take's draws (`budget.take`) as one Pallas kernel.

Shape key: S sample size, C capacity, K branching factor, L levels of the
sum tree, P 2S padded to a power of two, Q S padded likewise.

`budget._draws` accepts draws from a pool of 2S (a sort of the pool, prefix
sums, a `nonzero`), and when fewer than S are accepted continues in
sequence, row after row, over the tree with the call's retirements kept in
an overlay beside it (a `lax.cond` around a `lax.scan`, each step several
kernels per level). On a GPU that is a chain of dependent launches, and the
conditional reads its predicate on the host.

`draw_rows` does both in one program. The pool: each draw's rank among the
draws of its item is a count of the earlier draws of the same slot (a block
of others at a time, no sort), acceptance and the first S accepted are
prefix counts, and the accepted rows are compacted through a scratch buffer.
The rows after them run in a loop inside the kernel (no iterations when the
pool sufficed), each step `sequence_step`: the XLA form runs the same
function, so the arithmetic is the same operation for operation and the
rows are the same, bit for bit. Lowered by Triton on a GPU; elsewhere it
runs in Pallas's interpret mode (tests).
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

NUM_WARPS = 4
# Pool draws compared with this many others at a time when ranked.
RANK_CHUNK = 16


def sequence_step(
  step: jax.Array,
  carry: tuple[Any, ...],
  *,
  load: Callable[[int, jax.Array], jax.Array],
  times_sampled_at: Callable[[jax.Array], jax.Array],
  uniform_at: Callable[[jax.Array, int], jax.Array],
  num_levels: int,
  branching: int,
  max_times_sampled: int,
  count: jax.Array,
  given_slots: jax.Array,
  given_retired: jax.Array,
) -> tuple[Any, ...]:
  """Row `step` of a take drawn from the items live after the rows before.

  Rows below `count` were accepted from the pool (`given_slots`,
  `given_retired`) and are taken as they are; later rows descend the tree,
  one child per level in proportion to its value less what this call
  retired. The retirements sit in an overlay per level: up to S nodes, each
  with its value after them, lowered by one subtraction per retirement in
  row order (so the result does not depend on how a sum is ordered).

  Args:
    step: int32 `()`, the row.
    carry: per level the overlay's nodes (int32, -1 unused) and values;
      then the slots drawn so far (-1 where none), and the rows' slots,
      drawn flags (int32), retired flags (int32), leaf values and live masses, each `[S]`.
    load: `load(level, node)`, a node's value in the tree as stored.
    times_sampled_at: a slot's takes before this call.
    uniform_at: `uniform_at(step, level)`, the row's uniform for a level.
    num_levels: L.
    branching: K.
    max_times_sampled: N.
    count: int32 `()`, rows accepted from the pool.
    given_slots: int32 `[S]`, their slots (0 past `count`).
    given_retired: bool `[S]`, whether each retired its item.

  Returns:
    The carry with row `step` drawn.
  """
  overlay, (drawn_slots, slots, drawn, retired, values, masses) = (
    carry[: 2 * num_levels],
    carry[2 * num_levels :],
  )
  lanes = jax.lax.broadcasted_iota(jnp.int32, drawn_slots.shape, 0)

  def any_of(flags):  # Triton lowers no reduce_or
    return jnp.max(flags.astype(jnp.int32)) > 0

  def read(level, node):
    matched = overlay[2 * level] == node
    patched = jnp.max(jnp.where(matched, overlay[2 * level + 1], -jnp.inf))
    return jnp.where(any_of(matched), patched, load(level, node))

  def at(vector):
    return jnp.sum(jnp.where(lanes == step, vector, 0), dtype=vector.dtype)

  mass = read(num_levels - 1, jnp.int32(0))
  node = jnp.int32(0)
  for level in reversed(range(num_levels - 1)):
    first = node * branching
    children = [jnp.maximum(read(level, first + position), 0.0) for position in range(branching)]
    prefix = [children[0]]
    for child_value in children[1:]:
      prefix.append(prefix[-1] + child_value)
    target = uniform_at(step, level) * prefix[-1]
    # The first positive child whose prefix passes the target; failing that
    # (rounding), the last positive child; with none, the last child.
    chosen = jnp.int32(branching)
    last_positive = jnp.int32(branching - 1)
    for position in reversed(range(branching)):
      passed = (prefix[position] > target) & (children[position] > 0)
      chosen = jnp.where(passed, position, chosen)
    for position in range(branching):
      last_positive = jnp.where(children[position] > 0, position, last_positive)
    node = first + jnp.where(chosen < branching, chosen, last_positive)
  is_given = step < count
  node = jnp.where(is_given, at(given_slots), node)
  value = read(0, node)
  is_drawn = is_given | ((mass > 0) & (value > 0))
  slot = jnp.where(is_drawn, node, 0)
  earlier = jnp.sum(((drawn_slots == slot) & (lanes < step)).astype(jnp.int32), dtype=jnp.int32)
  spends = is_drawn & (times_sampled_at(slot) + earlier + 1 >= max_times_sampled)
  spends = jnp.where(is_given, at(given_retired.astype(jnp.int32)) != 0, spends)
  updated = []
  for level in range(num_levels):
    nodes, patched = overlay[2 * level], overlay[2 * level + 1]
    ancestor = slot // branching**level
    matched = nodes == ancestor
    fresh = (lanes == step) & spends & ~any_of(matched)
    patched = jnp.where(matched & spends, patched - value, patched)
    patched = jnp.where(fresh, load(level, ancestor) - value, patched)
    updated += [jnp.where(fresh, ancestor, nodes), patched]
  row = lanes == step
  return (
    *updated,
    jnp.where(row, jnp.where(is_drawn, slot, -1), drawn_slots),
    jnp.where(row, slot, slots),
    jnp.where(row, is_drawn.astype(jnp.int32), drawn),
    jnp.where(row, spends.astype(jnp.int32), retired),
    jnp.where(row, jnp.where(is_given, 1.0, value), values),
    jnp.where(row, jnp.where(is_given, 1.0, mass), masses),
  )


# float32's smallest normal, as a Python float: a kernel takes no NumPy scalar.
TINY = float(jnp.finfo(jnp.float32).tiny)


def pool_shares(pool_values: jax.Array, mass: jax.Array, spends: jax.Array) -> jax.Array:
  """Each pool draw's share of the live mass it was drawn from: its leaf over
  the total less what the accepted draws before it retired, float32 `[P]`."""
  spent = jnp.where(spends, pool_values, 0.0)
  retired_before = jax.lax.cumsum(spent, axis=0) - spent
  return pool_values / jnp.maximum(mass - retired_before, TINY)


def row_shares(
  given_shares: jax.Array,
  count: jax.Array,
  drawn: jax.Array,
  row_values: jax.Array,
  row_masses: jax.Array,
) -> jax.Array:
  """Each row's share: the pool's for the `count` rows it gave
  (`given_shares`), else the leaf over the live mass it was drawn from
  (1 where nothing was drawn), float32 `[S]`."""
  lanes = jax.lax.broadcasted_iota(jnp.int32, given_shares.shape, 0)
  in_sequence = jnp.where(drawn, row_values / jnp.where(row_masses > 0, row_masses, 1.0), 1.0)
  return jnp.where(lanes < count, given_shares, in_sequence)


def initial_carry(
  num_rows: int, num_levels: int, count: jax.Array, given_slots: jax.Array, given_retired: jax.Array
) -> tuple[jax.Array, ...]:
  """`sequence_step`'s carry before row 0: an empty overlay, the pool's rows."""
  lanes = jax.lax.broadcasted_iota(jnp.int32, (num_rows,), 0)
  overlay = []
  for _ in range(num_levels):
    overlay += [jnp.full((num_rows,), -1, jnp.int32), jnp.zeros((num_rows,), jnp.float32)]
  ones = jnp.ones((num_rows,), jnp.float32)
  return (
    *overlay,
    jnp.full((num_rows,), -1, jnp.int32),
    given_slots,
    (lanes < count).astype(jnp.int32),
    given_retired.astype(jnp.int32),
    ones,
    ones,
  )


def draw_rows(
  levels: tuple[jax.Array, ...],
  times_sampled: jax.Array,
  pool_found: jax.Array,
  pool_values: jax.Array,
  uniforms: jax.Array,
  *,
  batch_size: int,
  max_times_sampled: int,
  branching: int,
  interpret: bool,
) -> tuple[jax.Array, ...]:
  """`budget.draw_rows` in one kernel (module notes).

  Args:
    levels: the sum tree's levels bottom-up.
    times_sampled: int32 `[C]`.
    pool_found: int32 `[2S]`, the pool's slots.
    pool_values: float32 `[2S]`, their leaves.
    uniforms: float32 `[S, D]`, D = max(L - 1, 1), for rows in sequence.
    batch_size: S.
    max_times_sampled: N.
    branching: K.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    As `budget.draw_rows`.
  """
  pool = pool_found.shape[0]
  pool_padded = max(pl.next_power_of_2(pool), RANK_CHUNK)
  rows_padded = pl.next_power_of_2(batch_size)
  pad = lambda array, size: jnp.pad(array, (0, size - array.shape[0]))
  kernel = functools.partial(
    _draw_kernel,
    num_levels=len(levels),
    batch_size=batch_size,
    max_times_sampled=max_times_sampled,
    branching=branching,
    depth=uniforms.shape[1],
    interpret=interpret,
  )
  int_rows = jax.ShapeDtypeStruct((rows_padded,), jnp.int32)
  float_rows = jax.ShapeDtypeStruct((rows_padded,), jnp.float32)
  slots, drawn, retired, shares, retired_count, *_ = pl.pallas_call(
    kernel,
    out_shape=(
      int_rows,
      int_rows,
      int_rows,
      float_rows,
      int_rows,
      # Scratch: the spends, the pool's shares, the accepted pool draws
      # compacted (with a region for lanes that store nothing).
      jax.ShapeDtypeStruct((pool_padded,), jnp.int32),
      jax.ShapeDtypeStruct((pool_padded,), jnp.float32),
      jax.ShapeDtypeStruct((rows_padded + pool_padded,), jnp.int32),
    ),
    grid=(1,),
    in_specs=[pl.no_block_spec] * (len(levels) + 4),
    out_specs=tuple(pl.no_block_spec for _ in range(8)),
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="budget_draws",
  )(
    *levels,
    times_sampled.astype(jnp.int32),
    pad(pool_found.astype(jnp.int32), pool_padded),
    pad(pool_values.astype(jnp.float32), pool_padded),
    uniforms.astype(jnp.float32).reshape(-1),
  )
  rows_of = lambda array: array[:batch_size]
  return (
    rows_of(slots),
    rows_of(drawn) != 0,
    rows_of(retired) != 0,
    rows_of(shares),
    retired_count[0],
  )


def _barrier(interpret: bool) -> None:
  if not interpret:  # the interpreter runs one lane after another
    pallas_triton.debug_barrier()


def _draw_kernel(
  *refs: Any,
  num_levels: int,
  batch_size: int,
  max_times_sampled: int,
  branching: int,
  depth: int,
  interpret: bool,
) -> None:
  level_refs = refs[:num_levels]
  times_ref, found_ref, values_ref, uniforms_ref = refs[num_levels : num_levels + 4]
  outputs = refs[num_levels + 4 :]
  slots_ref, drawn_ref, retired_ref, shares_ref, retired_count_ref = outputs[:5]
  spends_ref, pool_shares_ref, compacted_ref = outputs[5:]
  pool_padded = found_ref.shape[0]
  rows_padded = slots_ref.shape[0]
  pool_lanes = jax.lax.broadcasted_iota(jnp.int32, (pool_padded,), 0)
  lanes = jax.lax.broadcasted_iota(jnp.int32, (rows_padded,), 0)
  # The pool: its valid draws (of a positive leaf, from a tree with mass,
  # others slot 0), and each draw's rank among the earlier draws of its slot.
  mass = jnp.max(level_refs[-1][jnp.zeros((pool_padded,), jnp.int32)])
  pool_values = values_ref[pool_lanes]
  valid = (mass > 0) & (pool_values > 0)
  found = jnp.where(valid, found_ref[pool_lanes], 0)
  rank = jnp.zeros((pool_padded,), jnp.int32)
  for start in range(0, pool_padded, RANK_CHUNK):
    others = jnp.where(
      (mass > 0) & (values_ref[pl.ds(start, RANK_CHUNK)] > 0),
      found_ref[pl.ds(start, RANK_CHUNK)],
      0,
    )[None, :]
    other_lanes = start + jax.lax.broadcasted_iota(jnp.int32, (1, RANK_CHUNK), 1)
    earlier = (others == found[:, None]) & (other_lanes < pool_lanes[:, None])
    rank = rank + jnp.sum(earlier.astype(jnp.int32), axis=1, dtype=jnp.int32)
  budget_left = max_times_sampled - times_ref[found]
  accepted = (valid & (rank < budget_left)).astype(jnp.int32)
  accepted_before = jax.lax.cumsum(accepted, axis=0)
  picked = (accepted != 0) & (accepted_before <= batch_size)
  spends = picked & (rank == budget_left - 1)
  count = jnp.sum(picked.astype(jnp.int32), dtype=jnp.int32)
  spends_ref[pool_lanes] = spends.astype(jnp.int32)
  pool_shares_ref[pool_lanes] = pool_shares(pool_values, mass, spends)
  compacted_ref[lanes] = jnp.zeros((rows_padded,), jnp.int32)
  _barrier(interpret)
  # A lane that stores nothing aims past the rows, where no lane stores
  # (the interpreter writes a masked lane's old value back).
  target = jnp.where(picked, accepted_before - 1, rows_padded + pool_lanes)
  pallas_triton.store(compacted_ref.at[target], pool_lanes, mask=picked)
  _barrier(interpret)
  rows = compacted_ref[lanes]
  kept = lanes < count
  given_slots = jnp.where(kept, found_ref[rows], 0)  # accepted draws are valid
  # Integer flags: Pallas's Triton lowering of a loop mistypes bool values
  # read from outside it.
  given_retired = (kept & (spends_ref[rows] != 0)).astype(jnp.int32)
  step = functools.partial(
    sequence_step,
    load=lambda level, node: level_refs[level][node],
    times_sampled_at=lambda slot: times_ref[slot],
    uniform_at=lambda row, level: uniforms_ref[row * depth + level],
    num_levels=num_levels,
    branching=branching,
    max_times_sampled=max_times_sampled,
    count=count,
    given_slots=given_slots,
    given_retired=given_retired,
  )
  carry = initial_carry(rows_padded, num_levels, count, given_slots, given_retired)
  # In sequence only when the pool held fewer than S accepted draws.
  stop = batch_size * (count < batch_size).astype(jnp.int32)
  # A fori loop with its bound in the state: Pallas's Triton lowering of a
  # general while loop (or one whose condition reads a value from outside
  # it) mistypes its values.
  _, _, carry = jax.lax.while_loop(
    lambda state: state[0] < state[1],
    lambda state: (state[0] + 1, state[1], step(state[0], state[2])),
    (jnp.int32(0), stop, carry),
  )
  slots, drawn, retired, values, masses = carry[2 * num_levels + 1 :]
  slots_ref[lanes] = slots
  drawn_ref[lanes] = drawn
  retired_ref[lanes] = retired
  shares_ref[lanes] = row_shares(pool_shares_ref[rows], count, drawn != 0, values, masses)
  retired_count_ref[lanes] = jnp.broadcast_to(
    jnp.sum(jnp.where(lanes < batch_size, retired, 0), dtype=jnp.int32), (rows_padded,)
  )
