"""`max_times_sampled=N` on item replay (`jaxbuf.budget`), against a plain
Python model of each item's draws under hypothesis operation sequences;
bad input and refused combinations leave the state intact."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

CAPACITY = 6
SETTINGS = hypothesis.settings(max_examples=12, deadline=None)
BUFFERS = {
  ("uniform", 1): jaxbuf.uniform_replay(CAPACITY, max_times_sampled=1),
  ("uniform", 2): jaxbuf.uniform_replay(CAPACITY, max_times_sampled=2),
  ("prioritized", 2): jaxbuf.prioritized_replay(CAPACITY, max_times_sampled=2, alpha=0.7),
}


class ReferenceBudget:
  """Each held item's value and draws left, in ring order."""

  def __init__(self, capacity: int, budget: int):
    self.capacity, self.budget = capacity, budget
    self.held: list = []  # [value, draws left], oldest first

  def add(self, items: list) -> None:
    for item in items:
      self.held.append([item, self.budget])
      self.held = self.held[-self.capacity :]

  def live(self) -> int:
    return sum(left > 0 for _, left in self.held)

  def draws_left(self) -> int:
    return sum(left for _, left in self.held)

  def draw(self, value: int) -> bool:
    """Counts a draw of `value`; False if it was not live."""
    for entry in self.held:
      if entry[0] == value and entry[1] > 0:
        entry[1] -= 1
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(BUFFERS))
@SETTINGS
@hypothesis.given(
  operations=st.lists(
    st.tuples(st.sampled_from(["add", "take", "peek"]), st.sampled_from([1, 4])),
    min_size=1,
    max_size=10,
  ),
  seed=st.integers(0, 2**16),
)
def test_a_budget_retires_items_as_the_reference_counts_them(which, operations, seed):
  check_budget(which, operations, seed)


@pytest.mark.parametrize(
  "which",
  # Uniform with N = 2 runs in the conformance suite too: slow here.
  [
    pytest.param(which, marks=[pytest.mark.slow] * (which == ("uniform", 2)))
    for which in sorted(BUFFERS)
  ],
)
def test_a_budget_on_a_fixed_sequence(which):
  operations = [("add", 4), ("take", 4), ("peek", 1), ("add", 4), ("take", 4), ("take", 4)]
  check_budget(which, operations, 3)


def check_budget(which, operations, seed):
  buffer, model = BUFFERS[which], ReferenceBudget(CAPACITY, which[1])
  state, serial, key = buffer.init(jnp.int32(0)), 0, jax.random.key(seed)
  for step, (operation, count) in enumerate(operations):
    if operation == "add":
      items = list(range(serial, serial + count))
      serial += count
      state = buffer.add(state, jnp.asarray(items, jnp.int32))
      model.add(items)
    else:
      peek = buffer.sample(state, key, count, step=step)
      if operation == "take":
        state, batch = buffer.take(state, key, count, step=step)
        np.testing.assert_array_equal(batch.indices, peek.indices)  # the same draw
        drawn = np.asarray(batch.weights) > 0
        # Each row spends one draw of a live item: rows are items while any
        # budget is left, then padding.
        np.testing.assert_array_equal(drawn, np.arange(count) < min(count, model.draws_left()))
        for value in np.asarray(batch.items)[drawn]:
          assert model.draw(int(value)), (value, model.held)
        if which[1] == 1:
          assert len(set(np.asarray(batch.items)[drawn].tolist())) == drawn.sum()
    assert int(state.live) == model.live()
    assert int(state.size) == len(model.held)
    assert bool(buffer.can_sample(state, 2)) == (model.live() >= 2)


def test_without_replacement_every_item_once_then_padding():
  buffer = jaxbuf.uniform_replay(16, max_times_sampled=1)
  state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(10, dtype=jnp.int32))
  state, first = buffer.take(state, jax.random.key(1), 6)
  state, second = buffer.take(state, jax.random.key(2), 6)
  rows = np.concatenate([first.items, second.items])[
    np.concatenate([first.weights, second.weights]) > 0
  ]
  assert sorted(rows.tolist()) == list(range(10))
  assert np.asarray(second.weights).tolist() == [1.0] * 4 + [0.0] * 2
  assert int(state.live) == 0 and int(state.size) == 10
  assert not bool(buffer.can_sample(state, 1))
  _, empty = buffer.take(state, jax.random.key(3), 3)
  assert not np.asarray(empty.weights).any()


def test_draws_are_uniform_over_live_items():
  """Fixed seed: the first row of 4000 takes from 8 live items (one of 10
  retired twice over), each within 5 sigma of 1/8."""
  buffer = jaxbuf.uniform_replay(16, max_times_sampled=1)
  state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(10, dtype=jnp.int32))
  state, _ = buffer.take(state, jax.random.key(0), 2)
  keys = jax.random.split(jax.random.key(5), 4000)
  rows = jax.vmap(lambda key: buffer.sample(state, key, 1).items[0])(keys)
  counts = np.bincount(np.asarray(rows), minlength=10)
  retired = [i for i in range(10) if counts[i] == 0]
  assert len(retired) == 2
  share = counts[[i for i in range(10) if i not in retired]] / 4000
  assert np.all(np.abs(share - 1 / 8) < 5 * np.sqrt(1 / 8 * 7 / 8 / 4000)), share


def test_retired_items_stay_retired_after_a_priority_update(tmp_path):
  buffer = BUFFERS[("prioritized", 2)]
  state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32))
  for seed in range(3):
    state, batch = buffer.take(state, jax.random.key(seed), 2)
  retired = np.flatnonzero(np.asarray(state.times_sampled)[:3] >= 2)
  assert len(retired) == 3 - int(state.live) and len(retired)
  state = buffer.update_priorities(state, jnp.arange(3), jnp.full(3, 5.0))
  leaves = np.asarray(jaxbuf.prioritized.sum_tree.leaves(state.sum_tree))
  assert (leaves[retired] == 0).all() and int(state.live) == 3 - len(retired)
  jaxbuf.save(str(tmp_path / "budget"), state)
  restored = jaxbuf.load(str(tmp_path / "budget"), like=jax.eval_shape(buffer.init, jnp.int32(0)))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)


def test_bad_budgets_and_refused_combinations():
  for bad in (0, -1):
    with pytest.raises(ValueError, match="max_times_sampled"):
      jaxbuf.uniform_replay(8, max_times_sampled=bad)
  for bad in (1.5, True):
    with pytest.raises(TypeError, match="max_times_sampled"):
      jaxbuf.prioritized_replay(8, max_times_sampled=bad)
  with pytest.raises(TypeError, match="cannot be combined with storage"):
    jaxbuf.uniform_replay(8, max_times_sampled=1, storage="host")
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  with pytest.raises(TypeError, match="cannot be split"):
    jaxbuf.sharded(jaxbuf.uniform_replay(8, max_times_sampled=1), mesh)
  checked = jaxbuf.uniform_replay(8, max_times_sampled=1, checked=True)
  state = checked.init(jnp.int32(0))
  with pytest.raises(Exception, match="no live item"):
    checked.take(state, jax.random.key(0), 2)
  assert int(state.live) == 0


@pytest.mark.slow  # Mixture.take is checked by default in test_queue.py
def test_a_budgeted_part_of_a_mixture_counts_its_takes():
  budgeted, plain = jaxbuf.uniform_replay(8, max_times_sampled=1), jaxbuf.uniform_replay(8)
  mix = jaxbuf.mixture([budgeted, plain], [1, 1])
  states = [
    budgeted.add(budgeted.init(jnp.int32(0)), jnp.arange(4, dtype=jnp.int32)),
    plain.add(plain.init(jnp.int32(0)), jnp.arange(4, dtype=jnp.int32)),
  ]
  states, _ = mix.take(states, jax.random.key(0), 4)
  assert int(states[0].live) == 2 and int(states[1].size) == 4


def test_prioritized_draws_without_replacement_are_successive_sampling():
  """Fixed seed, 20000 takes of 3 from priorities 1..4 with N = 1: row 0 is
  item i with probability p_i / 10, row 1 given row 0 = 3 is p_j / 6 (the
  pool of draws and its sequential continuation both), each within 5 sigma."""
  buffer = jaxbuf.prioritized_replay(64, max_times_sampled=1, alpha=1.0)
  state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(4, dtype=jnp.int32))
  state = buffer.update_priorities(state, jnp.arange(4), jnp.array([1.0, 2.0, 3.0, 4.0]))
  keys = jax.random.split(jax.random.key(0), 20000)
  rows = np.asarray(jax.vmap(lambda key: buffer.sample(state, key, 3).items)(keys))
  for drawn, want in (
    (rows[:, 0], np.array([1, 2, 3, 4]) / 10),
    (rows[rows[:, 0] == 3, 1], np.array([1, 2, 3, 0]) / 6),
  ):
    share = np.bincount(drawn, minlength=4) / len(drawn)
    sigma = np.sqrt(want * (1 - want) / len(drawn))
    assert np.all(np.abs(share - want) <= 5 * sigma + 1e-12), (share, want)
