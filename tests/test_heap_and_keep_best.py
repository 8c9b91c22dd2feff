"""Heap selection (`jaxbuf.heap_replay`) and keep-the-best eviction
(`jaxbuf.keep_best_replay`), against plain Python models under hypothesis
operation sequences; bad input leaves the state intact."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from jaxbuf._src.selection import extreme_tree

CAPACITY = 6
KEY = jax.random.key(0)
SETTINGS = hypothesis.settings(max_examples=10, deadline=None)
HEAPS = {order: jaxbuf.heap_replay(CAPACITY, order=order) for order in ("max", "min")}
KEEP_BEST = jaxbuf.keep_best_replay(CAPACITY)
# Few distinct values, so that ties are common.
VALUES = st.lists(st.sampled_from([-2.0, 0.0, 1.0, 1.0, 3.0]), min_size=3, max_size=3)


def expected_top(priorities: dict, count: int, order: str) -> list:
  """Slots of the `count` best priorities, best first, ties to the lower slot."""
  sign = -1 if order == "max" else 1
  return sorted(priorities, key=lambda slot: (sign * priorities[slot], slot))[:count]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["max", "min"])
@SETTINGS
@hypothesis.given(
  operations=st.lists(
    st.tuples(st.sampled_from(["add", "update", "sample"]), VALUES), min_size=1, max_size=8
  )
)
def test_heap_selects_as_a_sort_of_the_held_priorities(order, operations):
  check_heap(order, operations)


@pytest.mark.parametrize("order", ["max", "min"])
def test_heap_on_a_fixed_sequence(order):
  check_heap(
    order,
    [
      ("add", [1.0, 3.0, 1.0]),
      ("update", [0.0, -2.0, 3.0]),
      ("add", [3.0, 0.0, 1.0]),
      ("add", [-2.0, 3.0, 3.0]),
      ("sample", [0.0, 0.0, 0.0]),
    ],
  )


def check_heap(order, operations):
  buffer, priorities, position = HEAPS[order], {}, 0
  state = buffer.init(jnp.int32(0))
  for operation, values in operations:
    if operation == "add":
      state = buffer.add(state, jnp.arange(3, dtype=jnp.int32), priorities=jnp.asarray(values))
      for value in values:
        priorities[position] = value
        position = (position + 1) % CAPACITY
    elif operation == "update":
      slots = [0, 2, 0]  # a duplicate: the last valid one wins
      state = buffer.update_priorities(state, jnp.asarray(slots), jnp.asarray(values))
      for slot, value in zip(slots, values):
        if slot in priorities:
          priorities[slot] = value
    for count in (2, CAPACITY + 1):
      batch = buffer.sample(state, KEY, count)
      want = expected_top(priorities, count, order)
      held = np.asarray(batch.weights) > 0
      assert held.tolist() == [k < len(want) for k in range(count)]
      assert np.asarray(batch.indices)[held].tolist() == want
      assert (np.asarray(batch.indices)[~held] == CAPACITY).all()


@pytest.mark.slow  # the fixed heap sequences check the tie rule by default
def test_max_tree_top_matches_a_sort_at_a_larger_capacity():
  rng = np.random.default_rng(0)
  values = rng.integers(0, 50, 3000).astype(np.float32)
  tree = extreme_tree.set_leaves(extreme_tree.init(3000), jnp.arange(3000), jnp.asarray(values))
  indices, top = jax.jit(extreme_tree.top, static_argnums=1)(tree, 40)
  want = sorted(range(3000), key=lambda k: (-values[k], k))[:40]
  assert np.asarray(indices).tolist() == want
  np.testing.assert_array_equal(top, values[want])


def test_a_heap_asked_for_too_much_pads_or_raises_when_checked(tmp_path):
  checked = jaxbuf.heap_replay(CAPACITY, checked=True)
  state = checked.add(checked.init(jnp.int32(0)), jnp.arange(2, dtype=jnp.int32))
  with pytest.raises(Exception, match="fewer than batch_size"):
    checked.sample(state, KEY, 3)
  with pytest.raises(Exception, match="must be finite"):
    checked.add(state, jnp.arange(1, dtype=jnp.int32), priorities=jnp.array([jnp.nan]))
  assert int(state.size) == 2
  with pytest.raises(ValueError, match="order must be one of"):
    jaxbuf.heap_replay(4, order="median")
  jaxbuf.save(str(tmp_path / "heap"), state)
  restored = jaxbuf.load(str(tmp_path / "heap"), like=jax.eval_shape(checked.init, jnp.int32(0)))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)


class ReferenceKeepBest:
  """Slots of (value, item); a batch competes with the items held at once."""

  def __init__(self, capacity: int):
    self.capacity, self.slots, self.dropped, self.offered = capacity, [], 0, 0

  @property
  def held(self) -> list:
    return list(self.slots)

  def add(self, values: list) -> None:
    first = self.offered
    self.offered += len(values)
    new = [(value, first + k, k) for k, value in enumerate(values) if np.isfinite(value)]
    self.dropped += len(values) - len(new)
    # Worst first: value; batch items before held; later batch items
    # before earlier; lower slots before higher.
    ranked = sorted(
      [(value, 0, -k, ("new", (value, item))) for value, item, k in new]
      + [(value, 1, slot, ("held", slot)) for slot, (value, _) in enumerate(self.slots)]
    )
    surplus = max(0, len(self.slots) + len(new) - self.capacity)
    losers = [entry[3] for entry in ranked[:surplus]]
    self.dropped += surplus
    evicted = [where for kind, where in losers if kind == "held"]
    free = list(range(len(self.slots), self.capacity)) + evicted
    for value, item, _ in new:
      if ("new", (value, item)) in losers:
        continue
      slot = free.pop(0)
      if slot < len(self.slots):
        self.slots[slot] = (value, item)
      else:
        self.slots.append((value, item))


@pytest.mark.slow
@SETTINGS
@hypothesis.given(
  batches=st.lists(
    st.lists(st.sampled_from([-1.0, 0.0, 2.0, 2.0, 5.0, float("nan")]), min_size=2, max_size=2),
    min_size=1,
    max_size=8,
  )
)
def test_keep_best_keeps_what_the_reference_keeps(batches):
  check_keep_best(batches)


def test_keep_best_on_a_fixed_sequence():
  nan = float("nan")
  check_keep_best(
    [[2.0, 5.0], [-1.0, 2.0], [0.0, nan], [5.0, 2.0], [2.0, 2.0], [-1.0, 5.0], [5.0, 0.0]]
  )


def check_keep_best(batches):
  state, model = KEEP_BEST.init(jnp.int32(0)), ReferenceKeepBest(CAPACITY)
  for values in batches:
    items = jnp.arange(model.offered, model.offered + 2, dtype=jnp.int32)
    state = KEEP_BEST.add(state, items, jnp.asarray(values, jnp.float32))
    model.add(values)
    size = int(state.size)
    held = sorted(
      zip(
        np.asarray(jaxbuf.keep_best.values_held(state))[:size].tolist(),
        np.asarray(state.storage)[:size].tolist(),
      )
    )
    assert held == sorted(model.held)
    assert int(state.dropped) == model.dropped
    np.testing.assert_array_equal(
      np.asarray(state.item_ids)[:size], np.asarray(state.storage)[:size]
    )
  batch = KEEP_BEST.sample(state, KEY, 4)
  assert set(np.asarray(batch.items).tolist()) <= {item for _, item in model.held}


def test_keep_best_refuses_bad_values_and_is_saved_exactly(tmp_path):
  checked = jaxbuf.keep_best_replay(CAPACITY, checked=True)
  state = checked.add(checked.init(jnp.int32(0)), jnp.arange(2, dtype=jnp.int32), jnp.ones(2))
  for bad in (jnp.inf, jnp.nan):
    with pytest.raises(Exception, match="values must be finite"):
      checked.add(state, jnp.arange(1, dtype=jnp.int32), jnp.array([bad]))
  with pytest.raises(ValueError, match="values"):
    checked.add(state, jnp.arange(2, dtype=jnp.int32), jnp.ones(3))
  assert int(state.size) == 2
  with pytest.raises(TypeError, match="cannot be split"):
    jaxbuf.sharded(KEEP_BEST, jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]))
  jaxbuf.save(str(tmp_path / "best"), state)
  restored = jaxbuf.load(str(tmp_path / "best"), like=jax.eval_shape(checked.init, jnp.int32(0)))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)
