"""Keep-the-best's choice of what an add keeps and where, as one Pallas kernel.

Shape key: B add batch, C capacity, P B padded to a power of two (Triton's
blocks must be).

`keep_best.add` ranks the batch with the B lowest items held (a sort of 2B
candidates), drops the lowest, and gives each batch item kept a free slot
(the empty ones, then those evicted: a `nonzero` and prefix sums). On a GPU
that is a sort, scatters, prefix sums and gathers, each a launch.
`choose_slots` does it in one program: each candidate's place in the sort is
the count of candidates before it in the sort's order (value, group,
secondary key, then position, as the stable sort breaks ties), compared a
block of others at a time; the free slots usable are compacted in order
through a scratch buffer, and the r-th batch item kept reads the r-th. All
of it is integer counting, so the kernel returns what the XLA form
(`keep_best.choose_slots`) returns, bit for bit. Lowered by Triton on a GPU;
elsewhere it runs in Pallas's interpret mode (tests).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from jaxbuf._src.selection import extreme_tree_kernels

NUM_WARPS = 4
# Candidates compared with this many others at a time: a [2P, RANK_CHUNK]
# comparison, small enough for a program's registers.
RANK_CHUNK = 16
# Larger batches (a fill) take the XLA path: the ranking is O(B^2).
BATCH_MAX = 1024


def choose_slots(
  values: jax.Array,
  held_slots: jax.Array,
  negated: jax.Array,
  size: jax.Array,
  *,
  capacity: int,
  interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """What an add keeps and where, in one kernel (`keep_best.choose_slots`).

  Args:
    values: float32 `[B]`, the batch's values, B <= `BATCH_MAX`.
    held_slots: int32 `[B]`, the slots of the B lowest held.
    negated: float32 `[B]`, their negated values (-inf past those held).
    size: int32 `()`, items held.
    capacity: C.
    interpret: run in Pallas's interpret mode (any backend; slow).

  Returns:
    int32 `[B]` slots (C for batch items not kept), bool `[B]` kept (batch
    items), bool `[B]` evicted (of the held candidates).
  """
  batch_size = values.shape[0]
  assert batch_size <= BATCH_MAX
  padded = max(pl.next_power_of_2(batch_size), RANK_CHUNK)
  rows = lambda array: jnp.pad(array, (0, padded - batch_size))
  kernel = functools.partial(
    _choose_kernel, batch_size=batch_size, capacity=capacity, interpret=interpret
  )
  scratch = jax.ShapeDtypeStruct((2 * padded,), jnp.int32)
  slots, kept, evicted, *_ = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      jax.ShapeDtypeStruct((padded,), jnp.int32),
      # Scratch: the candidates' sort keys, and the free slots compacted
      # (with a region for lanes that store nothing).
      scratch,
      scratch,
      scratch,
      scratch,
      jax.ShapeDtypeStruct((4 * padded,), jnp.int32),
    ),
    grid=(1,),
    in_specs=[pl.no_block_spec] * 4,
    out_specs=tuple(pl.no_block_spec for _ in range(8)),
    interpret=interpret,
    compiler_params=pallas_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    name="keep_best_choose",
  )(
    rows(values.astype(jnp.float32)),
    rows(held_slots.astype(jnp.int32)),
    jnp.pad(negated.astype(jnp.float32), (0, padded - batch_size), constant_values=-jnp.inf),
    jnp.broadcast_to(jnp.asarray(size, jnp.int32), (padded,)),
  )
  return slots[:batch_size], kept[:batch_size] != 0, evicted[:batch_size] != 0


def _barrier(interpret: bool) -> None:
  if not interpret:  # the interpreter runs one lane after another
    pallas_triton.debug_barrier()


def _value_keys(values: jax.Array) -> jax.Array:
  """`extreme_tree_kernels.order_keys` with -0 as +0: the sort compares floats."""
  return extreme_tree_kernels.order_keys(jnp.where(values == 0, 0.0, values))


def _choose_kernel(*refs: Any, batch_size: int, capacity: int, interpret: bool) -> None:
  values_ref, held_slots_ref, negated_ref, size_ref = refs[:4]
  slots_ref, kept_ref, evicted_ref = refs[4:7]
  key_refs = refs[7:11]  # value, group, secondary, position: [2P] each
  free_ref = refs[11]
  padded = values_ref.shape[0]
  lanes = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
  in_batch = lanes < batch_size
  size = size_ref[lanes]
  values = values_ref[lanes]
  held_slots = held_slots_ref[lanes]
  negated = negated_ref[lanes]
  finite = in_batch & (jnp.abs(values) < jnp.inf)
  held = in_batch & (negated > -jnp.inf)
  # Candidates (batch in lanes [0, P), held in [P, 2P)), worst first: value,
  # then batch items before held ones, later batch items before earlier
  # ones, lower slots first; lanes past B last of all.
  inf_key = _value_keys(jnp.full((padded,), jnp.inf, jnp.float32))
  halves = (
    (
      jnp.where(
        in_batch,
        jnp.where(
          finite, _value_keys(values), _value_keys(jnp.full((padded,), -jnp.inf, jnp.float32))
        ),
        inf_key,
      ),
      jnp.where(in_batch, jnp.where(finite, 0, -1), 2),
      -lanes,
      lanes,
    ),
    (
      jnp.where(held, _value_keys(-negated), inf_key),
      jnp.where(in_batch, 1, 2),
      held_slots,
      padded + lanes,
    ),
  )
  for half, keys in enumerate(halves):
    for key_ref, key in zip(key_refs, keys, strict=True):
      key_ref[half * padded + lanes] = key.astype(jnp.int32)
  _barrier(interpret)
  num_finite = jnp.sum(finite.astype(jnp.int32), dtype=jnp.int32)
  size_scalar = jnp.max(size)
  surplus = jnp.maximum(size_scalar + num_finite - capacity, 0)
  num_dropped = surplus + batch_size - num_finite
  dropped = []
  for keys in halves:
    place = jnp.zeros((padded,), jnp.int32)
    for start in range(0, 2 * padded, RANK_CHUNK):
      before = jnp.zeros((padded, RANK_CHUNK), bool)
      # Lexicographic, from the last key (the position) to the first.
      for key_ref, key in reversed(list(zip(key_refs, keys, strict=True))):
        others = key_ref[pl.ds(start, RANK_CHUNK)][None, :]
        mine = key.astype(jnp.int32)[:, None]
        before = (others < mine) | ((others == mine) & before)
      place = place + jnp.sum(before.astype(jnp.int32), axis=1, dtype=jnp.int32)
    dropped.append(place < num_dropped)
  kept = in_batch & ~dropped[0]
  evicted = dropped[1] & held
  # Free slots in order: the empty ones past `size`, then those evicted.
  empty_slots = size + lanes
  usable = (in_batch & (empty_slots < capacity), evicted)
  free = (empty_slots, held_slots)
  counts = [column.astype(jnp.int32) for column in usable]
  before = jax.lax.cumsum(counts[0], axis=0) - counts[0]
  positions = (
    before,
    jax.lax.cumsum(counts[1], axis=0) - counts[1] + jnp.sum(counts[0], dtype=jnp.int32),
  )
  for half in range(2):
    # A lane that stores nothing aims past the free slots, where no lane
    # stores (the interpreter writes a masked lane's old value back).
    target = jnp.where(usable[half], positions[half], 2 * padded + half * padded + lanes)
    pallas_triton.store(free_ref.at[target], free[half].astype(jnp.int32), mask=usable[half])
  _barrier(interpret)
  kept_count = kept.astype(jnp.int32)
  rank = jax.lax.cumsum(kept_count, axis=0) - kept_count
  slots_ref[lanes] = jnp.where(kept, free_ref[jnp.where(kept, rank, 0)], capacity).astype(jnp.int32)
  kept_ref[lanes] = kept_count
  evicted_ref[lanes] = evicted.astype(jnp.int32)
