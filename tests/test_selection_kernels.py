"""The selection rules' Pallas kernels (`extreme_tree_kernels.py`, run here
in Pallas's interpret mode) against their XLA forms, bit for bit, on random
states with ties, empty and full trees and duplicate writes; the buffers
built on them under both forms; and the kernels' Triton lowering for a GPU,
checked on the CPU (lowering needs no GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from jaxbuf._src.core import sum_tree
from jaxbuf._src.selection import extreme_tree
from jaxbuf._src.selection import extreme_tree_kernels
from jaxbuf._src.selection import keep_best
from jaxbuf._src.selection import keep_best_kernels


def _run(monkeypatch, variant, function, *args):
  """`function(*args)` jitted afresh under `variant` (read while tracing)."""
  monkeypatch.setenv(sum_tree.KERNEL_VARIANT_VARIABLE, variant)
  return jax.jit(function)(*args)


def _assert_same(got, expected):
  for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(leaf, want)
    assert leaf.dtype == want.dtype


def _random_writes(rng, capacity, batch_size, distinct_values):
  indices = rng.integers(0, capacity, batch_size).astype(np.int32)
  # Few distinct values: ties everywhere, -0 among them; some leaves emptied.
  values = rng.choice(np.float32([-3.0, -0.0, 0.0, 1.5, 2.0, 7.0, -np.inf]), batch_size)
  if not distinct_values:
    values = rng.normal(size=batch_size).astype(np.float32)
  return indices, values, rng.random(batch_size) < 0.8


@pytest.mark.parametrize(
  "capacity, batch_size, count",
  [
    (5, 7, 3),  # one level below the root, duplicates
    (600, 300, 100),  # three levels, S not a power of two
    (5000, 128, 256),  # five levels, S = 256 as the benchmarks ask
    (70, 40, 128),  # more asked than leaves: padding rows
  ],
)
@pytest.mark.parametrize("distinct_values", [True, False])
def test_max_tree_kernels_give_the_xla_tree_and_top_bit_for_bit(
  monkeypatch, capacity, batch_size, count, distinct_values
):
  rng = np.random.default_rng(capacity + count)
  tree = extreme_tree.init(capacity)
  write = lambda tree, indices, values, valid: extreme_tree.set_leaves(tree, indices, values, valid)
  top = lambda tree: extreme_tree.top(tree, count)
  for _ in range(3):  # writes over writes: leaves raised, lowered, emptied
    arguments = (
      tree,
      *map(jnp.asarray, _random_writes(rng, capacity, batch_size, distinct_values)),
    )
    xla = _run(monkeypatch, "xla", write, *arguments)
    _assert_same(_run(monkeypatch, "pallas", write, *arguments), xla)
    tree = xla
    _assert_same(_run(monkeypatch, "pallas", top, tree), _run(monkeypatch, "xla", top, tree))
  leaves = np.asarray(extreme_tree.leaves(tree))
  indices, values = _run(monkeypatch, "pallas", top, tree)
  # Against a sort of the leaves: value first, then the lower index.
  expected = sorted(range(capacity), key=lambda slot: (-leaves[slot], slot))[:count]
  expected = [slot for slot in expected if leaves[slot] > -np.inf]
  np.testing.assert_array_equal(np.asarray(indices)[: len(expected)], expected)
  assert np.all(np.asarray(values)[len(expected) :] == -np.inf)
  assert np.all(np.asarray(indices)[len(expected) :] == 0)


def test_max_tree_kernels_on_empty_and_full_trees_and_skipped_writes(monkeypatch):
  capacity = 512  # 8**3: every level full
  empty = extreme_tree.init(capacity)
  top = lambda tree: extreme_tree.top(tree, 64)
  _assert_same(_run(monkeypatch, "pallas", top, empty), _run(monkeypatch, "xla", top, empty))
  slots = jnp.arange(capacity, dtype=jnp.int32)
  full = extreme_tree.set_leaves(empty, slots, jnp.float32(slots % 5))
  _assert_same(_run(monkeypatch, "pallas", top, full), _run(monkeypatch, "xla", top, full))
  # A batch with no valid write leaves the tree; skipped writes may point
  # out of bounds and must not undo a valid one to the same slot.
  write = lambda tree, indices, values, valid: extreme_tree.set_leaves(tree, indices, values, valid)
  indices = jnp.asarray([0, 0, 10**6, 0, 7], jnp.int32)
  values = jnp.asarray([9.0, 8.0, 9.0, 9.0, -1.0], jnp.float32)
  for valid in ([False] * 5, [False, True, False, False, True]):
    arguments = (full, indices, values, jnp.asarray(valid))
    _assert_same(
      _run(monkeypatch, "pallas", write, *arguments), _run(monkeypatch, "xla", write, *arguments)
    )
  unchanged = _run(monkeypatch, "pallas", write, full, indices, values, jnp.zeros(5, bool))
  _assert_same(unchanged, full)


def test_a_negative_zero_is_stored_as_positive_zero():
  tree = extreme_tree.set_leaves(extreme_tree.init(16), jnp.asarray([3, 4]), jnp.float32([-0.0, 0]))
  assert not np.any(np.signbit(np.asarray(extreme_tree.leaves(tree))[[3, 4]]))


def test_order_keys_order_the_floats():
  values = np.float32([-np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, np.inf])
  keys = np.asarray(extreme_tree_kernels.order_keys(jnp.asarray(values)))
  assert np.all(np.diff(keys) > 0)
  assert keys[0] == extreme_tree_kernels._LOWEST_KEY


def _heap_and_keep_best_steps():
  heap = jaxbuf.heap_replay(300, order="min")
  keep = jaxbuf.keep_best_replay(300)
  example = {"obs": jnp.zeros(2, jnp.float32)}

  def step(states, key, items, values):
    heap_state, keep_state = states
    heap_state = heap.add(heap_state, items, priorities=values)
    batch = heap.sample(heap_state, key, 32)
    heap_state = heap.update_priorities(
      heap_state, batch.indices, jnp.round(batch.items["obs"][:, 0]) % 3.0, batch.item_ids
    )
    keep_state = keep.add(keep_state, items, values)
    kept = keep.sample(keep_state, key, 32)
    return (heap_state, keep_state), (batch, kept)

  return (heap.init(example), keep.init(example)), step


def test_heap_and_keep_best_are_the_same_under_the_kernels_also_vmapped_and_scanned(monkeypatch):
  states, step = _heap_and_keep_best_steps()
  rng = np.random.default_rng(5)
  batches = [
    (
      {"obs": jnp.asarray(rng.integers(0, 9, (2, 100, 2)), jnp.float32)},
      jnp.asarray(rng.integers(0, 4, (2, 100)), jnp.float32),  # ties
    )
    for _ in range(5)
  ]
  states = jax.tree.map(lambda leaf: jnp.stack([leaf, leaf]), states)
  keys = jax.random.split(jax.random.key(3), 2)

  def run(states):
    outputs = []
    for items, values in batches:  # the buffers fill, then evict
      states, output = jax.vmap(step)(states, keys, items, values)
      outputs.append(output)
    return states, outputs

  _assert_same(_run(monkeypatch, "pallas", run, states), _run(monkeypatch, "xla", run, states))

  def scanned(states):
    items = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[batch for batch in batches])
    return jax.lax.scan(lambda states, batch: jax.vmap(step)(states, keys, *batch), states, items)

  _assert_same(
    _run(monkeypatch, "pallas", scanned, states), _run(monkeypatch, "xla", scanned, states)
  )


def test_the_max_tree_kernels_lower_for_a_gpu_as_one_triton_call_each():
  tree = extreme_tree.init(40_000)
  indices = jnp.arange(200, dtype=jnp.int32)

  def write_and_top(levels, indices):
    written = extreme_tree_kernels.write_leaves(
      levels,
      indices,
      jnp.ones(200, jnp.float32),
      indices >= 0,
      branching=sum_tree.BRANCHING,
      interpret=False,
    )
    return extreme_tree_kernels.top(
      tuple(reversed(written[:-1])), count=256, branching=sum_tree.BRANCHING, interpret=False
    )

  try:
    lowered = jax.jit(write_and_top).trace(tree.levels, indices).lower(lowering_platforms=("cuda",))
  except (NotImplementedError, RuntimeError, ImportError) as error:  # no Triton bindings
    pytest.skip(f"Triton lowering unavailable here: {error}")
  text = lowered.as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert 'name = "max_tree_write"' in text and 'name = "max_tree_top"' in text


@pytest.mark.parametrize(
  "capacity, held_count, batch_size",
  [
    (6, 0, 3),  # an empty buffer
    (6, 4, 5),  # fills, then evicts
    (300, 300, 100),  # full: every kept item evicts one
    (300, 299, 128),  # one empty slot, S a power of two
    (40, 40, 70),  # a batch larger than the buffer
  ],
)
def test_keep_best_choice_kernel_gives_the_xla_choice_bit_for_bit(
  monkeypatch, capacity, held_count, batch_size
):
  rng = np.random.default_rng(capacity + batch_size)
  tree = extreme_tree.init(capacity)
  held_values = rng.choice(np.float32([-1.0, 0.0, 2.0, 5.0]), held_count)
  tree = extreme_tree.set_leaves(tree, jnp.arange(held_count), -jnp.asarray(held_values))
  choose = lambda *operands: keep_best.choose_slots(*operands, capacity=capacity)
  kernel = lambda *operands: keep_best_kernels.choose_slots(
    *operands, capacity=capacity, interpret=True
  )
  for _ in range(3):
    values = rng.choice(np.float32([-1.0, -0.0, 0.0, 2.0, 5.0, 9.0, np.nan, np.inf]), batch_size)
    held_slots, negated = extreme_tree.top(tree, batch_size)
    operands = (jnp.asarray(values), held_slots, negated, jnp.int32(held_count))
    expected = jax.jit(choose)(*operands)
    _assert_same(jax.jit(kernel)(*operands), expected)
    assert int(jnp.sum(expected[1])) <= batch_size  # something is kept or not, each once


@pytest.mark.parametrize("alpha", [None, 0.6])
@pytest.mark.parametrize(
  "capacity, fill, batch_size",
  [
    (300, 300, 64),  # the pool suffices
    (300, 40, 64),  # few items live: rows in sequence, then padding
    (50, 10, 16),  # fewer live than asked from the first take
  ],
)
def test_budget_draw_kernel_gives_the_xla_takes_bit_for_bit(
  monkeypatch, alpha, capacity, fill, batch_size
):
  if alpha is None:
    buffer = jaxbuf.uniform_replay(capacity, max_times_sampled=2)
  else:
    buffer = jaxbuf.prioritized_replay(capacity, alpha=alpha, max_times_sampled=2)
  state = buffer.init({"obs": jnp.zeros(2)})
  state = buffer.add(state, {"obs": jnp.arange(fill * 2.0).reshape(fill, 2)})

  def takes(state, key):
    batches = []
    for step in range(3):  # budgets spent within and across takes
      state, batch = buffer.take(state, jax.random.fold_in(key, step), batch_size)
      if alpha is not None:
        state = buffer.update_priorities(
          state, batch.indices, batch.items["obs"][:, 0] % 5 + 0.5, batch.item_ids
        )
      batches.append(batch)
    return state, batches

  key = jax.random.key(fill)
  _assert_same(
    _run(monkeypatch, "pallas", takes, state, key), _run(monkeypatch, "xla", takes, state, key)
  )
  states = jax.tree.map(lambda leaf: jnp.stack([leaf, leaf]), state)
  keys = jax.random.split(key, 2)
  _assert_same(
    _run(monkeypatch, "pallas", jax.vmap(takes), states, keys),
    _run(monkeypatch, "xla", jax.vmap(takes), states, keys),
  )
