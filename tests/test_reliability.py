"""Reliability: checked mode, stale priority updates, counters, long-run numerics,
and the bad-input table of RELIABILITY.md (one test id per row).
"""

import math
import pathlib
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import optax
import pytest

import jaxbuf
from jaxbuf._src.items import prioritized
from jaxbuf._src.core import sum_tree
from tests.reference import ReferenceReplay

CAPACITY = 8
INT32_MAX = 2**31 - 1
# Eager checked calls raise JaxRuntimeError (JAX keeps the class private; its
# public base is Exception); the message identifies the check.
CHECK_FAILED = Exception
UNIFORM = jaxbuf.uniform_replay(CAPACITY)
PRIORITIZED = jaxbuf.prioritized_replay(CAPACITY, alpha=0.7, beta=0.5)
CHECKED = {
  "uniform": jaxbuf.uniform_replay(CAPACITY, checked=True),
  "prioritized": jaxbuf.prioritized_replay(CAPACITY, alpha=0.7, beta=0.5, checked=True),
}
LONG_RUN = jaxbuf.prioritized_replay(100_003, alpha=1.0)
SMALL_TREE = jaxbuf.prioritized_replay(70)
SMALL_TREE_FULL = SMALL_TREE.add(SMALL_TREE.init(jnp.int32(0)), jnp.arange(70, dtype=jnp.int32))


def snapshot(state):
  """Every leaf as raw bytes (NaN payloads compare exactly); a host copy."""
  return jax.tree.map(lambda x: np.asarray(x).reshape(-1).view(np.uint8).copy(), state)


def assert_same(state, before):
  for got, want in zip(jax.tree.leaves(snapshot(state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(got, want)


def assert_raises_leaving_state_intact(call, owner, state, error, words):
  """`call(owner, state)` raises `error` naming every word; `state` unchanged."""
  before = snapshot(state)
  with pytest.raises(error) as raised:
    call(owner, state)
  for word in words:
    assert word in str(raised.value)
  assert_same(state, before)


def example_item():
  return {"obs": jnp.zeros(3, jnp.float32), "action": jnp.int32(0), "reward": jnp.float32(0)}


def make_items(start, count):
  serial = np.arange(start, start + count)
  return {
    "obs": np.repeat(serial[:, None], 3, axis=1).astype(np.float32),
    "action": serial.astype(np.int32),
    "reward": serial.astype(np.float32) / 2,
  }


def filled(buffer, count=5):
  return buffer.add(buffer.init(example_item()), make_items(0, count))


def leaves_of(state):
  return np.asarray(sum_tree.leaves(state.sum_tree))


# --- Checked mode: every run-time violation raises, eagerly and under jit --------

# Made once: each new buffer has new jitted functions, compiled afresh.
SHORT_ROLLOUTS = {
  checked: jaxbuf.rollout_buffer(num_steps=2, num_envs=3, checked=checked)
  for checked in (False, True)
}
ROLLOUT = jaxbuf.rollout_buffer(num_steps=4, num_envs=3)


def _rollout_full(checked):
  rollout = SHORT_ROLLOUTS[checked]
  state = rollout.init(jnp.zeros(2))
  for _ in range(2):
    state = rollout.add(state, jnp.ones((3, 2)), mask=jnp.array([True, False, True]))
  return rollout, state


VIOLATIONS = {
  # name: (kind, call(buffer, state), words in the message)
  "sample empty uniform": (
    "uniform",
    lambda b, s: b.sample(b.clear(s), jax.random.key(0), 4),
    "empty",
  ),
  "sample empty prioritized": (
    "prioritized",
    lambda b, s: b.sample(b.clear(s), jax.random.key(0), 4),
    "empty",
  ),
  "NaN priority": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([0, 1]), jnp.array([1.0, jnp.nan])),
    "finite",
  ),
  "inf priority": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([jnp.inf])),
    "finite",
  ),
  "negative priority": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([-0.5])),
    "non-negative",
  ),
  "index at an empty slot": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([6]), jnp.array([1.0])),
    "items held",
  ),
  "index past capacity": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([CAPACITY + 3]), jnp.array([1.0])),
    "items held",
  ),
  "negative index": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([-1]), jnp.array([1.0])),
    "items held",
  ),
  "uint32 index 2**32-1": (
    "prioritized",
    lambda b, s: b.update_priorities(s, jnp.array([2**32 - 1], jnp.uint32), jnp.array([1.0])),
    "items held",
  ),
  "uniform NaN priority": (
    "uniform",
    lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([jnp.nan])),
    "finite",
  ),
}


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_checked_mode_raises_eagerly_and_leaves_the_state_intact(name):
  kind, call, words = VIOLATIONS[name]
  buffer = CHECKED[kind]
  state = filled(buffer)
  before = snapshot(state)
  with pytest.raises(CHECK_FAILED, match=words) as raised:
    call(buffer, state)
  assert type(raised.value).__name__ == "JaxRuntimeError"
  assert_same(state, before)


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_default_mode_has_a_documented_harmless_outcome(name):
  kind, call, _ = VIOLATIONS[name]
  buffer = UNIFORM if kind == "uniform" else PRIORITIZED
  state = filled(buffer)
  before = snapshot(state)
  result = call(buffer, state)
  if isinstance(result, jaxbuf.ReplaySample):
    # Sampling an empty buffer: slot 0 with weight 0, so a weighted loss ignores it.
    np.testing.assert_array_equal(np.asarray(result.indices), 0)
    np.testing.assert_array_equal(np.asarray(result.weights), 0.0)
    return
  if kind == "prioritized":
    assert int(result.beta_step) == 1  # the call still counts as a schedule step
    result = result.replace(beta_step=jnp.int32(0))
    if name == "NaN priority":  # the valid entry of the batch applies
      applied = PRIORITIZED.update_priorities(filled(PRIORITIZED), jnp.array([0]), jnp.array([1.0]))
      before = snapshot(applied.replace(beta_step=jnp.int32(0)))
    if name == "negative priority":  # its magnitude applies, as |TD error|
      applied = PRIORITIZED.update_priorities(filled(PRIORITIZED), jnp.array([0]), jnp.array([0.5]))
      before = snapshot(applied.replace(beta_step=jnp.int32(0)))
  assert_same(result, before)


def test_checked_rollout_raises_on_writes_past_num_steps():
  rollout, state = _rollout_full(checked=True)
  before = snapshot(state)
  with pytest.raises(CHECK_FAILED, match="full") as raised:
    rollout.add(state, jnp.ones((3, 2)), mask=jnp.array([False, True, True]))
  assert type(raised.value).__name__ == "JaxRuntimeError"
  assert_same(state, before)
  # Default mode: the write to a full env is dropped, the others land.
  rollout, state = _rollout_full(checked=False)
  state = rollout.add(state, jnp.full((3, 2), 9.0), mask=jnp.array([True, True, False]))
  np.testing.assert_array_equal(np.asarray(state.step_counts), [2, 1, 2])
  np.testing.assert_array_equal(np.asarray(state.data[:, :, 0]), [[1, 9, 1], [1, 0, 1]])


def test_checked_mode_inside_jit_and_scan_needs_checkify():
  buffer = CHECKED["prioritized"]

  def train(state, priorities):
    def step(state, priority):
      batch = buffer.sample(state, jax.random.key(0), 4)
      return buffer.update_priorities(
        state, batch.indices, jnp.full((4,), priority), batch.item_ids
      ), None

    return jax.lax.scan(step, state, priorities)[0]

  checked_train = jax.jit(checkify.checkify(train))
  state = filled(buffer)
  error, trained = checked_train(state, jnp.array([1.0, 2.0, 3.0]))
  assert error.get() is None
  assert int(trained.beta_step) == 3
  error, _ = checked_train(state, jnp.array([1.0, jnp.nan, 3.0]))
  with pytest.raises(ValueError, match="finite"):
    error.throw()
  # Staged without checkify, the check cannot run: JAX says so while tracing.
  with pytest.raises(ValueError, match="checkify"):
    jax.jit(train)(state, jnp.array([1.0]))
  rollout, full = _rollout_full(checked=True)
  error, _ = jax.jit(checkify.checkify(rollout.add))(full, jnp.ones((3, 2)))
  with pytest.raises(ValueError, match="full"):
    error.throw()


# --- Stale priority updates --------------------------------------------------------


@pytest.mark.parametrize("overwrite", [3, CAPACITY - 1, CAPACITY + 5])
def test_updates_for_overwritten_slots_are_skipped(overwrite):
  state = filled(PRIORITIZED, CAPACITY)
  reference = ReferenceReplay(CAPACITY, alpha=0.7)
  reference.add(list(range(CAPACITY)))
  batch = PRIORITIZED.sample(state, jax.random.key(1), 16)
  indices, item_ids = np.asarray(batch.indices), np.asarray(batch.item_ids)
  np.testing.assert_array_equal(item_ids, reference.ids[indices])
  # A large add between sample and update overwrites some sampled slots.
  state = PRIORITIZED.add(state, make_items(100, overwrite))
  reference.add(list(range(100, 100 + overwrite)))
  priorities = np.linspace(0.5, 8.0, 16).astype(np.float32)
  state = PRIORITIZED.update_priorities(state, batch.indices, priorities, batch.item_ids)
  reference.update_priorities(indices, priorities, item_ids)
  overwritten = reference.ids[indices] != item_ids
  assert overwritten.any() and (overwrite >= CAPACITY or not overwritten.all())
  np.testing.assert_allclose(leaves_of(state)[:CAPACITY], reference.priorities**0.7, rtol=1e-5)
  # New items keep the priority they entered with (the running maximum).
  fresh = reference.ids >= 100
  np.testing.assert_allclose(leaves_of(state)[:CAPACITY][fresh], 1.0, rtol=1e-6)


def test_without_item_ids_the_update_lands_on_whatever_the_slot_holds():
  state = filled(PRIORITIZED, CAPACITY)
  batch = PRIORITIZED.sample(state, jax.random.key(2), 1)
  state = PRIORITIZED.add(state, make_items(100, CAPACITY))  # overwrite all
  state = PRIORITIZED.update_priorities(state, batch.indices, jnp.array([4.0]))
  assert leaves_of(state)[int(batch.indices[0])] == pytest.approx((4.0 + 1e-6) ** 0.7, rel=1e-6)


def test_item_ids_stay_stale_across_clear_and_refill():
  state = filled(PRIORITIZED, 4)
  batch = PRIORITIZED.sample(state, jax.random.key(3), 8)
  state = PRIORITIZED.add(PRIORITIZED.clear(state), make_items(50, 4))
  before = leaves_of(state)
  state = PRIORITIZED.update_priorities(state, batch.indices, jnp.full((8,), 9.0), batch.item_ids)
  np.testing.assert_array_equal(leaves_of(state), before)
  assert np.all(np.asarray(PRIORITIZED.sample(state, jax.random.key(4), 8).item_ids) >= 4)


# --- Counters: no overflow -------------------------------------------------------


@pytest.mark.parametrize("start", [2**31 - 3, 2**32 - 3])
def test_counters_past_2_to_the_31_and_the_uint32_wrap(start):
  """Simulates more than 2**31 (and 2**32) adds by starting the counters there."""
  state = filled(PRIORITIZED, CAPACITY)
  state = state.replace(add_count=jnp.uint32(start), insert_position=jnp.int32(5))
  reference = ReferenceReplay(CAPACITY, alpha=0.7)
  reference.add(list(range(CAPACITY)))
  reference.ids = start - 1 - (5 - 1 - np.arange(CAPACITY)) % CAPACITY
  reference.insert_position, reference.add_count = 5, start
  serial = 1000
  for _ in range(4):
    batch = PRIORITIZED.sample(state, jax.random.key(serial), 6)
    np.testing.assert_array_equal(
      np.asarray(batch.item_ids, np.int64), reference.ids[np.asarray(batch.indices)] % 2**32
    )
    state = PRIORITIZED.add(state, make_items(serial, 3))
    reference.add(list(range(serial, serial + 3)))
    serial += 3
    priorities = np.full(6, float(serial % 7), np.float32)
    state = PRIORITIZED.update_priorities(state, batch.indices, priorities, batch.item_ids)
    reference.update_priorities(
      np.asarray(batch.indices), priorities, np.asarray(batch.item_ids, np.int64)
    )
    assert int(state.insert_position) == reference.insert_position
    np.testing.assert_allclose(leaves_of(state)[:CAPACITY], reference.priorities**0.7, rtol=1e-5)
  assert int(state.add_count) == (start + 12) % 2**32
  assert int(state.size) == CAPACITY
  np.testing.assert_array_equal(
    np.asarray(state.storage["action"]), [reference.storage[i] for i in range(CAPACITY)]
  )


def test_beta_step_saturates_and_the_schedule_still_works():
  schedule = optax.linear_schedule(0.4, 1.0, transition_steps=10**6)
  buffer = jaxbuf.prioritized_replay(CAPACITY, beta=schedule)
  state = filled(buffer).replace(beta_step=jnp.int32(INT32_MAX - 2))
  for _ in range(4):
    state = buffer.update_priorities(state, jnp.array([0, 1]), jnp.array([1.0, 3.0]))
  assert int(state.beta_step) == INT32_MAX
  weights = np.asarray(buffer.sample(state, jax.random.key(0), 64).weights)
  assert np.all(np.isfinite(weights)) and 1 - 1e-6 <= weights.max() <= 1


def test_ring_counters_after_many_adds_in_a_scan():
  capacity, batch, steps = 10, 7, 10_000
  buffer = jaxbuf.uniform_replay(capacity)
  state = buffer.init(jnp.int32(0))
  state = jax.jit(
    lambda s: jax.lax.scan(
      lambda s, t: (buffer.add(s, t * batch + jnp.arange(batch, dtype=jnp.int32)), None),
      s,
      jnp.arange(steps, dtype=jnp.int32),
    )[0]
  )(state)
  total = steps * batch
  assert (int(state.insert_position), int(state.size), int(state.add_count)) == (
    total % capacity,
    capacity,
    total,
  )
  expected = np.arange(total - capacity, total)
  np.testing.assert_array_equal(np.sort(np.asarray(state.storage)), expected)


# --- Long-run numerics -------------------------------------------------------------


def test_ten_million_updates_spanning_twelve_decades_do_not_drift():
  """10^7 priority updates, priorities log-uniform in [1e-6, 1e6], alpha=1.

  Stated bound: |root - exact sum of the float32 leaves| <= 1e-5 * exact sum.
  Each parent is recomputed from its K=8 children, never adjusted by deltas,
  so the error is that of one float32 summation tree of depth 4: at most about
  4 * 31 * 2**-24 = 7.4e-6 relative, whatever the number of updates.
  """
  capacity, batch = 100_003, 4096
  steps = -(-(10**7) // batch)
  state = LONG_RUN.add(LONG_RUN.init(jnp.int8(0)), jnp.zeros(capacity, jnp.int8))

  def step(state, key):
    index_key, priority_key = jax.random.split(key)
    indices = jax.random.randint(index_key, (batch,), 0, capacity)
    priorities = 10.0 ** jax.random.uniform(priority_key, (batch,), minval=-6.0, maxval=6.0)
    return prioritized.update_priorities(state, indices, priorities, alpha=1.0, eps=1e-6), None

  keys = jax.random.split(jax.random.key(0), steps)
  state = jax.jit(lambda s: jax.lax.scan(step, s, keys)[0])(state)
  assert steps * batch >= 10**7 and int(state.beta_step) == steps
  leaves = np.asarray(sum_tree.leaves(state.sum_tree), np.float64)
  exact = math.fsum(leaves)
  root = float(sum_tree.total(state.sum_tree))
  assert abs(root - exact) <= 1e-5 * exact
  assert leaves[:capacity].min() >= 1e-6 and np.all(leaves[capacity:] == 0)
  assert leaves.max() > 1e5 and leaves.min() < 1e-5  # the span was exercised
  # Every node equals the sum of its children (no drift at any level).
  for child, parent in zip(state.sum_tree.levels[:-1], state.sum_tree.levels[1:]):
    sums = np.asarray(child, np.float64).reshape(-1, sum_tree.BRANCHING).sum(axis=1)
    np.testing.assert_allclose(np.asarray(parent)[: sums.size], sums, rtol=4e-6)
  batch_ = LONG_RUN.sample(state, jax.random.key(1), 4096)
  indices = np.asarray(batch_.indices)
  assert indices.min() >= 0 and indices.max() < capacity
  assert np.all(np.isfinite(np.asarray(batch_.weights)))


LEAF_VALUES = [0.0, 1e-45, 1e-40, 1.2e-38, 1e-30, 1.0, 3e5, 1e30]


@hypothesis.given(
  size=st.integers(1, 70),
  pattern=st.lists(st.sampled_from(LEAF_VALUES), min_size=70, max_size=70),
  seed=st.integers(0, 2**16),
)
def test_sampling_returns_only_items_held_whatever_the_leaf_values(size, pattern, seed):
  """Zeros, denormals (XLA on CPU flushes them to zero), single nonzero leaves.

  The leaves are written straight into the tree, so any value can be tried.
  """
  values = np.where(np.arange(70) < size, np.asarray(pattern, np.float32), 0)
  state = SMALL_TREE_FULL.replace(
    size=jnp.int32(size),
    insert_position=jnp.int32(size % 70),
    sum_tree=sum_tree.set_leaves(sum_tree.init(70), jnp.arange(70), jnp.asarray(values)),
  )
  batch = SMALL_TREE.sample(state, jax.random.key(seed), 64)
  indices, weights = np.asarray(batch.indices), np.asarray(batch.weights)
  assert indices.min() >= 0 and indices.max() < size
  np.testing.assert_array_equal(np.asarray(batch.items), indices)
  assert np.all(np.isfinite(weights)) and 1 - 1e-6 <= weights.max() <= 1
  normal = values >= np.finfo(np.float32).tiny
  if normal.any():  # mass to sample from: a zero leaf never comes out
    assert np.all(values[indices] > 0)
  if normal.sum() == 1 and (values > 0).sum() == 1:
    np.testing.assert_array_equal(indices, np.flatnonzero(normal)[0])


@pytest.mark.parametrize("slot", [0, 37, 69])
@pytest.mark.parametrize("value", [1.2e-38, 1.0, 1e30])
def test_a_single_nonzero_leaf_is_all_that_is_sampled(slot, value):
  values = np.zeros(70, np.float32)
  values[slot] = value
  state = SMALL_TREE_FULL.replace(
    sum_tree=sum_tree.set_leaves(sum_tree.init(70), jnp.arange(70), jnp.asarray(values))
  )
  batch = SMALL_TREE.sample(state, jax.random.key(slot), 64)
  np.testing.assert_array_equal(np.asarray(batch.indices), slot)
  np.testing.assert_allclose(np.asarray(batch.weights), 1.0, rtol=1e-6)


@pytest.mark.parametrize("alpha", [8.0, 30.0])
def test_priorities_that_underflow_fall_back_to_uniform(alpha):
  """(p + eps) ** alpha below float32's range: every leaf is 0, sampling is uniform."""
  buffer = jaxbuf.prioritized_replay(CAPACITY, alpha=alpha)
  state = buffer.add(buffer.init(example_item()), make_items(0, 6))
  state = buffer.update_priorities(state, jnp.arange(6), jnp.zeros(6))
  assert float(sum_tree.total(state.sum_tree)) == 0.0
  batch = buffer.sample(state, jax.random.key(0), 600)
  counts = np.bincount(np.asarray(batch.indices), minlength=CAPACITY)
  assert counts[6:].sum() == 0 and counts[:6].min() > 60  # binomial(600, 1/6) > 60
  np.testing.assert_array_equal(np.asarray(batch.weights), 1.0)


# --- The bad-input table (RELIABILITY.md): one row id per case ----------------------


def _with(**leaves):
  return {**make_items(10, 2), **leaves}


RAISES = {
  # row id: (call(buffer, state), error, words in the message)
  "add-wrong-leaf-shape": (
    lambda b, s: b.add(s, _with(obs=np.zeros((2, 4), np.float32))),
    ValueError,
    ["['obs']", "(2, 4)", "(3,)"],
  ),
  "add-unbatched-item": (
    lambda b, s: b.add(s, example_item()),
    ValueError,
    ["items have no batch axis", "leaf ['action'] has shape ()", "the item shape", "items[None]"],
  ),
  # The odd leaf out is blamed, whichever comes first in the tree.
  "add-ragged-batch": (
    lambda b, s: b.add(s, _with(action=np.zeros(3, np.int32))),
    ValueError,
    [
      "leaf ['action'] has shape (3,)",
      "expected (2,)",
      "like the other leaves ['obs'], ['reward']",
    ],
  ),
  "add-ragged-batch-first-leaf": (
    lambda b, s: b.add(
      s,
      _with(
        action=np.zeros(2, np.int32),
        obs=np.zeros((3, 3), np.float32),
        reward=np.zeros(2, np.float32),
      ),
    ),
    ValueError,
    ["leaf ['obs'] has shape (3, 3)", "expected (2, 3)"],
  ),
  "add-ragged-batch-no-majority": (
    lambda b, s: b.add(s, _with(action=np.zeros(3, np.int32), reward=np.zeros(4, np.float32))),
    ValueError,
    ["leaves disagree on the batch shape", "['action'] (3,)", "['obs'] (2,)", "['reward'] (4,)"],
  ),
  # One line, not one entry per number in the list.
  "add-python-list-leaf": (
    lambda b, s: b.add(s, _with(obs=[[1.0, 2.0, 3.0]] * 2)),
    TypeError,
    ["leaf ['obs'] is a Python list of length 2", "pass an array"],
  ),
  "add-wrong-dtype": (
    lambda b, s: b.add(s, _with(action=np.zeros(2, np.float32))),
    TypeError,
    ["['action']", "float32", "int32"],
  ),
  "add-missing-leaf": (
    lambda b, s: b.add(s, {"obs": make_items(0, 2)["obs"]}),
    TypeError,
    ["missing leaves", "['action']", "['reward']"],
  ),
  "add-extra-leaf": (
    lambda b, s: b.add(s, _with(done=np.zeros(2, bool))),
    TypeError,
    ["unexpected leaves", "['done']"],
  ),
  "add-wrong-container": (
    lambda b, s: b.add(s, tuple(make_items(0, 2).values())),
    TypeError,
    ["tree structure"],
  ),
  "sample-batch-size-zero": (
    lambda b, s: b.sample(s, jax.random.key(0), 0),
    ValueError,
    ["batch_size must be positive"],
  ),
  "sample-batch-size-float": (
    lambda b, s: b.sample(s, jax.random.key(0), 4.0),
    TypeError,
    ["batch_size must be a Python int"],
  ),
  "sample-int-seed-as-key": (
    lambda b, s: b.sample(s, 0, 4),
    TypeError,
    ["key must be jax.random.key"],
  ),
  "sample-uint32-key-wrong-shape": (
    lambda b, s: b.sample(s, jnp.zeros(3, jnp.uint32), 4),
    TypeError,
    ["key must be", "(3,)"],
  ),
  "sample-float-key": (
    lambda b, s: b.sample(s, jnp.array([1.0, 2.0], jnp.float32), 4),
    TypeError,
    ["key must be", "float32"],
  ),
  "sample-batched-keys": (
    lambda b, s: b.sample(s, jax.random.split(jax.random.key(0), 2), 4),
    ValueError,
    ["single key", "vmap"],
  ),
  # JAX's own error would be "Non-hashable static arguments".
  "sample-batch-size-jnp-array": (
    lambda b, s: b.sample(s, jax.random.key(0), jnp.int32(4)),
    TypeError,
    ["sample: batch_size must be a Python int", "an array of dtype int32", "known while tracing"],
  ),
  "sample-batch-size-traced": (
    lambda b, s: jax.jit(lambda n: b.sample(s, jax.random.key(0), n))(4),
    TypeError,
    ["sample: batch_size must be a Python int", "a traced int"],
  ),
  "sample-traced-int-as-key": (
    lambda b, s: jax.jit(lambda k: b.sample(s, k, 4))(jnp.int32(3)),
    TypeError,
    ["key must be jax.random.key", "int32", "shape ()"],
  ),
  "can-sample-batch-size-jnp-array": (
    lambda b, s: b.can_sample(s, jnp.int32(2)),
    TypeError,
    ["can_sample: batch_size must be a Python int"],
  ),
  "can-sample-batch-size-zero": (
    lambda b, s: b.can_sample(s, 0),
    ValueError,
    ["batch_size must be positive"],
  ),
  "update-float-indices": (
    lambda b, s: b.update_priorities(s, jnp.array([0.0]), jnp.array([1.0])),
    TypeError,
    ["indices must be integers"],
  ),
  "update-2d-indices": (
    lambda b, s: b.update_priorities(s, jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2))),
    ValueError,
    ["[S]"],
  ),
  "update-length-mismatch": (
    lambda b, s: b.update_priorities(s, jnp.array([0, 1]), jnp.array([1.0])),
    ValueError,
    ["one per index"],
  ),
  "update-integer-priorities": (
    lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([1])),
    TypeError,
    ["floating point"],
  ),
  "update-item-ids-wrong-dtype": (
    lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([1.0]), jnp.array([0])),
    TypeError,
    ["item_ids must be uint32"],
  ),
  "update-item-ids-wrong-shape": (
    lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([1.0]), jnp.zeros(2, jnp.uint32)),
    ValueError,
    ["item_ids have shape (2,)"],
  ),
}


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
@pytest.mark.parametrize("row", sorted(RAISES))
def test_bad_input_raises_and_the_state_survives(row, kind):
  call, error, words = RAISES[row]
  buffer = UNIFORM if kind == "uniform" else PRIORITIZED
  state = filled(buffer)
  # The error comes while tracing, before the donating call runs: the state
  # passed in is intact and still usable.
  assert_raises_leaving_state_intact(call, buffer, state, error, words)
  assert int(buffer.add(state, make_items(5, 1)).size) == 6


def _skipped(indices, priorities):
  """A prioritized update whose entries are all skipped: only beta_step moves."""

  def check():
    state = filled(PRIORITIZED)
    before = snapshot(state.replace(beta_step=jnp.int32(1)))
    state = PRIORITIZED.update_priorities(
      state, jnp.asarray(indices), jnp.asarray(priorities, jnp.float32)
    )
    assert_same(state, before)
    assert np.isfinite(float(sum_tree.total(state.sum_tree)))

  return check


def _magnitudes_apply(indices, priorities):
  """Signed priorities (TD errors) set the priority of their magnitude."""

  def check():
    signed = PRIORITIZED.update_priorities(
      filled(PRIORITIZED), jnp.asarray(indices), jnp.asarray(priorities, jnp.float32)
    )
    magnitudes = PRIORITIZED.update_priorities(
      filled(PRIORITIZED), jnp.asarray(indices), jnp.abs(jnp.asarray(priorities, jnp.float32))
    )
    assert_same(signed, snapshot(magnitudes))
    np.testing.assert_allclose(
      leaves_of(signed)[indices],
      (np.abs(np.float32(priorities)) + np.float32(1e-6)) ** 0.7,
      rtol=1e-6,
    )

  return check


def _add_outcome(items, expected_obs, size, add_count):
  def check():
    if jax.config.jax_enable_x64 and any(
      np.asarray(leaf).dtype == np.float64 for leaf in jax.tree.leaves(items)
    ):
      # With x64 on, float64 data is float64 to JAX too: refused, not cast.
      for buffer in (UNIFORM, PRIORITIZED):
        assert_raises_leaving_state_intact(
          lambda b, s: b.add(s, items), buffer, filled(buffer), TypeError, ["float64", "float32"]
        )
      return
    for buffer in (UNIFORM, PRIORITIZED):
      state = buffer.add(filled(buffer), items)
      np.testing.assert_array_equal(np.asarray(state.storage["obs"]), expected_obs)
      assert (int(state.size), int(state.add_count)) == (size, add_count)
      assert state.storage["obs"].dtype == jnp.float32

  return check


def _stored_obs(first, count):
  """Storage obs after `filled` (items 0..4) then items first..first+count-1."""
  reference = ReferenceReplay(CAPACITY)
  reference.add(list(range(5)) + list(range(first, first + count)))
  obs = np.zeros((CAPACITY, 3), np.float32)
  for slot, serial in enumerate(reference.storage):
    if serial is not None:
      obs[slot] = serial
  return obs


def _empty_sample():
  for buffer in (UNIFORM, PRIORITIZED):
    batch = buffer.sample(buffer.clear(filled(buffer)), jax.random.key(0), 4)
    np.testing.assert_array_equal(np.asarray(batch.indices), 0)
    np.testing.assert_array_equal(np.asarray(batch.weights), 0.0)
    assert not bool(buffer.can_sample(buffer.clear(filled(buffer)), 1))


def _oversized_sample():
  for buffer in (UNIFORM, PRIORITIZED):
    batch = buffer.sample(filled(buffer, 2), jax.random.key(0), 64)
    assert set(np.asarray(batch.indices).tolist()) == {0, 1}  # with replacement


def _nan_items():
  state = PRIORITIZED.add(filled(PRIORITIZED), _with(obs=np.full((2, 3), np.nan, np.float32)))
  assert np.isnan(np.asarray(state.storage["obs"])[5:7]).all()
  assert float(sum_tree.total(state.sum_tree)) == pytest.approx(7.0)


def _huge_finite_priority():
  buffer = jaxbuf.prioritized_replay(CAPACITY, alpha=1.0)
  state = buffer.add(buffer.init(example_item()), make_items(0, CAPACITY))
  state = buffer.update_priorities(state, jnp.arange(4), jnp.full(4, 3e38))
  state = buffer.add(state, make_items(8, 2))  # enters at the (huge) max priority
  total = float(sum_tree.total(state.sum_tree))
  assert np.isfinite(total)
  batch = buffer.sample(state, jax.random.key(0), 64)
  weights = np.asarray(batch.weights)
  assert np.all(np.isfinite(weights)) and 1 - 1e-6 <= weights.max() <= 1
  assert set(np.asarray(batch.indices).tolist()) <= {0, 1, 2, 3}


def _duplicate_indices():
  state = PRIORITIZED.update_priorities(
    filled(PRIORITIZED), jnp.array([2, 2, 2]), jnp.array([3.0, 5.0, jnp.nan])
  )
  assert leaves_of(state)[2] == pytest.approx((5.0 + 1e-6) ** 0.7, rel=1e-6)


def _reuse_donated_state():
  """Every bound function given a consumed state says which state to use."""
  for buffer in (UNIFORM, PRIORITIZED):
    state = filled(buffer)
    newer = buffer.add(state, make_items(5, 1))
    calls = {
      "add": lambda: buffer.add(state, make_items(6, 1)),
      "sample": lambda: buffer.sample(state, jax.random.key(0), 2),
      "can_sample": lambda: buffer.can_sample(state, 2),
      "clear": lambda: buffer.clear(state),
    }
    if buffer is PRIORITIZED:  # uniform's update reads no array
      calls["update_priorities"] = lambda: buffer.update_priorities(
        state, jnp.array([0]), jnp.array([1.0])
      )
    for name, call in calls.items():
      with pytest.raises(
        ValueError,
        match=f"^{name}: the state passed in was "
        "donated to an earlier call.*Use the state that call "
        "returned",
      ):
        call()
    assert int(newer.size) == 6
    assert int(buffer.add(newer, make_items(6, 1)).size) == 7


OUTCOMES = {
  "add-float64-numpy": _add_outcome(
    _with(obs=np.full((2, 3), 7.0, np.float64)),
    np.where(
      np.arange(CAPACITY)[:, None] < 5,
      _stored_obs(10, 2),
      np.where(np.arange(CAPACITY)[:, None] < 7, 7.0, 0.0),
    ),
    7,
    7,
  ),
  "add-empty-batch": _add_outcome(make_items(10, 0), _stored_obs(10, 0), 5, 5),
  "add-batch-larger-than-capacity": _add_outcome(
    make_items(10, CAPACITY + 5), _stored_obs(10, CAPACITY + 5), CAPACITY, 5 + CAPACITY + 5
  ),
  "add-nan-items": _nan_items,
  "sample-empty-buffer": _empty_sample,
  "sample-batch-larger-than-size": _oversized_sample,
  "update-nan-priority": _skipped([0, 3], [np.nan, np.nan]),
  "update-inf-priority": _skipped([0], [np.inf]),
  "update-negative-priority": _magnitudes_apply([0, 1, 3], [-1.0, -1e-30, -2.5]),
  "update-index-at-empty-slot": _skipped([5, 7], [1.0, 2.0]),
  "update-index-past-capacity": _skipped([CAPACITY, 2**30], [1.0, 2.0]),
  "update-negative-index": _skipped([-1, -CAPACITY], [1.0, 2.0]),
  "update-uint32-index-wrap": _skipped(np.array([2**32 - 1, 2**31], np.uint32), [1.0, 2.0]),
  "update-huge-finite-priority": _huge_finite_priority,
  "update-duplicate-indices": _duplicate_indices,
  "reuse-donated-state": _reuse_donated_state,
}


@pytest.mark.parametrize("row", sorted(OUTCOMES))
def test_bad_input_has_its_documented_outcome(row):
  OUTCOMES[row]()


SETTINGS = {
  "capacity-zero": (lambda: jaxbuf.uniform_replay(0), ValueError, "[1, 2**30)"),
  "capacity-too-large": (lambda: jaxbuf.uniform_replay(2**30), ValueError, "[1, 2**30)"),
  "capacity-float": (lambda: jaxbuf.prioritized_replay(2.5), TypeError, "Python int"),
  "capacity-bool": (lambda: jaxbuf.uniform_replay(True), TypeError, "Python int"),
  "alpha-negative": (lambda: jaxbuf.prioritized_replay(8, alpha=-1.0), ValueError, "alpha"),
  "eps-zero": (lambda: jaxbuf.prioritized_replay(8, eps=0.0), ValueError, "eps"),
  "beta-negative": (lambda: jaxbuf.prioritized_replay(8, beta=-0.1), ValueError, "beta"),
  "alpha-inf": (
    lambda: jaxbuf.prioritized_replay(8, alpha=math.inf),
    ValueError,
    "alpha must be finite",
  ),
  "alpha-nan": (
    lambda: jaxbuf.prioritized_replay(8, alpha=math.nan),
    ValueError,
    "alpha must be finite",
  ),
  "beta-inf": (
    lambda: jaxbuf.prioritized_replay(8, beta=math.inf),
    ValueError,
    "beta (or a schedule) must be finite",
  ),
  "eps-inf": (
    lambda: jaxbuf.prioritized_replay(8, eps=math.inf),
    ValueError,
    "eps must be finite and positive",
  ),
  "eps-nan": (
    lambda: jaxbuf.prioritized_replay(8, eps=np.float32("nan")),
    ValueError,
    "eps must be finite and positive",
  ),
  "num-steps-zero": (lambda: jaxbuf.rollout_buffer(0, 4), ValueError, "num_steps"),
  "num-envs-float": (lambda: jaxbuf.rollout_buffer(4, 2.0), TypeError, "num_envs"),
}


@pytest.mark.parametrize("row", sorted(SETTINGS))
def test_bad_settings_raise_when_the_buffer_is_made(row):
  make, error, words = SETTINGS[row]
  with pytest.raises(error, match=re.escape(words)):
    make()


ROLLOUT_RAISES = {
  "rollout-wrong-num-envs": (
    lambda r, s: r.add(s, jnp.ones((2, 2))),
    ValueError,
    ["(2, 2)", "(3, 2)"],
  ),
  "rollout-wrong-dtype": (
    lambda r, s: r.add(s, jnp.ones((3, 2), jnp.int32)),
    TypeError,
    ["int32", "expected float"],
  ),
  "rollout-mask-wrong-shape": (
    lambda r, s: r.add(s, jnp.ones((3, 2)), mask=jnp.ones(2, bool)),
    ValueError,
    ["mask", "(3,)"],
  ),
  "rollout-mask-not-bool": (
    lambda r, s: r.add(s, jnp.ones((3, 2)), mask=jnp.ones(3, jnp.int32)),
    TypeError,
    ["mask must be bool"],
  ),
}


@pytest.mark.parametrize("row", sorted(ROLLOUT_RAISES))
def test_bad_rollout_input_raises_and_the_state_survives(row):
  call, error, words = ROLLOUT_RAISES[row]
  rollout = ROLLOUT
  state = rollout.add(rollout.init(jnp.zeros(2)), jnp.ones((3, 2)))
  assert_raises_leaving_state_intact(call, rollout, state, error, words)
  assert rollout.add(state, jnp.ones((3, 2))).step_counts.tolist() == [2, 2, 2]


# --- Random operation sequences, bad ones included, against the NumPy model ----------

BAD_ADDS = sorted(row for row in RAISES if row.startswith("add-"))
BAD_SAMPLES = sorted(row for row in RAISES if row.startswith("sample-"))
PRIORITY_VALUES = [0.0, 0.3, 2.0, 7.5, 3e38, -1.0, np.nan, np.inf]

operations = st.lists(
  st.one_of(
    st.tuples(st.just("add"), st.sampled_from([1, 3, CAPACITY + 3])),
    st.tuples(st.just("bad add"), st.sampled_from(BAD_ADDS)),
    st.tuples(st.just("sample"), st.integers(0, 2**16)),
    st.tuples(st.just("bad sample"), st.sampled_from(BAD_SAMPLES)),
    st.tuples(
      st.just("update"),
      st.lists(
        st.tuples(st.integers(-2, CAPACITY + 1), st.sampled_from(PRIORITY_VALUES)),
        min_size=4,
        max_size=4,
      ),
    ),
    st.tuples(st.just("update sampled"), st.sampled_from(PRIORITY_VALUES)),
    # The stale case: sample, add (overwriting some sampled slots once
    # the ring is full), then update the sample's priorities.
    st.tuples(
      st.just("sample, add, update sampled"),
      st.tuples(
        st.integers(0, 2**16),
        st.sampled_from([1, 3, CAPACITY + 3]),
        st.sampled_from(PRIORITY_VALUES),
      ),
    ),
    st.tuples(st.just("clear"), st.none()),
  ),
  min_size=1,
  max_size=14,
)


def run_against_the_model(buffer, ops, *, checked):
  """Applies `ops` to jaxbuf and the model; checks they agree after each one.

  Bad operations must raise (trace-time errors in both modes; run-time
  violations in checked mode) and leave the state exactly as it was.
  """
  state = buffer.init(example_item())
  reference = ReferenceReplay(CAPACITY, alpha=0.7)
  serial, last_sample = 0, None
  primitive_ops = []
  for name, argument in ops:
    if name == "sample, add, update sampled":
      primitive_ops += list(zip(name.split(", "), argument))
    else:
      primitive_ops.append((name, argument))
  for name, argument in primitive_ops:
    before = snapshot(state)
    if name == "add":
      state = buffer.add(state, make_items(serial, argument))
      reference.add(list(range(serial, serial + argument)))
      serial += argument
    elif name in ("bad add", "bad sample"):
      call, error, _ = RAISES[argument]
      with pytest.raises(error):
        call(buffer, state)
      assert_same(state, before)
    elif name == "sample":
      if checked and reference.size == 0:
        with pytest.raises(CHECK_FAILED, match="empty"):
          buffer.sample(state, jax.random.key(argument), 16)
        continue
      batch = buffer.sample(state, jax.random.key(argument), 16)
      indices = np.asarray(batch.indices)
      if reference.size:
        assert 0 <= indices.min() and indices.max() < reference.size
        np.testing.assert_array_equal(
          np.asarray(batch.items["action"]), [reference.storage[i] for i in indices]
        )
        np.testing.assert_array_equal(
          np.asarray(batch.item_ids, np.int64), reference.ids[indices] % 2**32
        )
        np.testing.assert_allclose(
          np.asarray(batch.weights), reference.weights(indices, 0.5), rtol=1e-4
        )
        last_sample = (indices, np.asarray(batch.item_ids, np.int64))
      else:
        np.testing.assert_array_equal(np.asarray(batch.weights), 0.0)
    elif name == "clear":
      state = buffer.clear(state)
      reference.clear()
    else:
      if name == "update":
        indices = np.array([i for i, _ in argument], np.int32)
        priorities = np.array([p for _, p in argument], np.float32)
        item_ids = None
      elif last_sample is None:
        continue
      else:
        indices, item_ids = last_sample
        priorities = np.full(indices.shape, argument, np.float32)
      invalid = ~(
        (indices >= 0) & (indices < reference.size) & np.isfinite(priorities) & (priorities >= 0)
      )
      call = lambda: buffer.update_priorities(
        state, indices, priorities, None if item_ids is None else item_ids.astype(np.uint32)
      )
      if checked and invalid.any():
        with pytest.raises(CHECK_FAILED, match="items held|finite"):
          call()
        assert_same(state, before)
      else:
        state = call()
        reference.update_priorities(indices, priorities, item_ids)
    assert (int(state.size), int(state.insert_position), int(state.add_count)) == (
      reference.size,
      reference.insert_position,
      reference.add_count % 2**32,
    )
    held = np.arange(CAPACITY) < reference.size
    np.testing.assert_array_equal(
      np.asarray(state.storage["action"])[held], np.asarray(reference.storage, object)[held]
    )
    leaves = leaves_of(state)[:CAPACITY]
    np.testing.assert_allclose(leaves[held], reference.priorities[held] ** 0.7, rtol=1e-5)
    assert np.all(leaves[~held] == 0) and np.all(leaves_of(state)[CAPACITY:] == 0)
    assert np.isfinite(float(sum_tree.total(state.sum_tree)))
    assert float(state.max_priority) == pytest.approx(reference.max_priority, rel=1e-6)


@hypothesis.given(ops=operations)
def test_random_sequences_with_bad_operations_match_the_model(ops):
  run_against_the_model(PRIORITIZED, ops, checked=False)


@hypothesis.settings(max_examples=10)
@hypothesis.given(ops=operations)
def test_random_sequences_in_checked_mode_raise_on_bad_operations(ops):
  run_against_the_model(CHECKED["prioritized"], ops, checked=True)


def test_reliability_md_lists_every_row_and_names_real_tests():
  root = pathlib.Path(__file__).parents[1]
  text = (root / "RELIABILITY.md").read_text()
  listed = set()
  for line in text.splitlines():
    if line.startswith("| `"):
      listed.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
  rows = set(RAISES) | set(OUTCOMES) | set(SETTINGS) | set(ROLLOUT_RAISES)
  assert rows <= listed, sorted(rows - listed)
  for name in VIOLATIONS:
    assert f"`{name}`" in text
  sources = "".join(path.read_text() for path in sorted((root / "tests").glob("test_*.py")))
  for test in set(re.findall(r"\b(test_\w+)(?!\.py)\b", text)):
    assert f"def {test}(" in sources, test


# --- Integers, hyperparameters and buffer kinds (issue 12) -----------------------

WIDTHS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def _out_of_range_values(dtype):
  """Values of `dtype` that point at no item of a 5-item, 8-slot buffer."""
  limits = np.iinfo(dtype)
  values = {
    5,
    CAPACITY,
    int(limits.max),
    int(limits.min),
    2**31,
    2**31 + 2,
    2**32 + 3,
    2**40 + 1,
    -1,
    -(2**31),
    -(2**32) + 2,
  }
  return sorted(v for v in values if limits.min <= v <= limits.max and not 0 <= v < 5)


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "jax"])
@pytest.mark.parametrize("dtype", WIDTHS, ids=lambda d: np.dtype(d).name)
def test_indices_out_of_range_are_skipped_at_every_integer_width(dtype, host):
  """Out of range is out of range in every dtype, wide values never wrap onto
  a real slot: skipped by default, raised in checked mode."""
  values = _out_of_range_values(dtype)
  indices = np.array(values, dtype)
  if not host:
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
      pytest.skip("JAX has no such array with 64-bit mode off")
    indices = jnp.asarray(indices)
  priorities = np.full(len(values), 9.0, np.float32)
  state = filled(PRIORITIZED)
  before = leaves_of(state).copy()
  state = PRIORITIZED.update_priorities(state, indices, priorities)
  np.testing.assert_array_equal(leaves_of(state), before)
  assert float(state.max_priority) == 1.0
  checked = CHECKED["prioritized"]
  for value in values:
    one = np.array([value], dtype) if host else jnp.asarray(np.array([value], dtype))
    with pytest.raises(CHECK_FAILED, match="items held"):
      checked.update_priorities(filled(checked), one, priorities[:1])
  # In range, every width writes the slot it names.
  state = PRIORITIZED.update_priorities(state, np.array([4], dtype), np.array([9.0], np.float32))
  assert leaves_of(state)[4] > before[4]


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
@pytest.mark.parametrize("checked", [False, True])
def test_host_integers_that_do_not_fit_raise_naming_the_leaf(kind, checked):
  buffer = CHECKED[kind] if checked else {"uniform": UNIFORM, "prioritized": PRIORITIZED}[kind]
  state = filled(buffer)
  items = make_items(5, 2)
  # In range: int64 NumPy data is accepted with x64 off (JAX reads it as
  # int32, as it reads float64 as float32), and refused by dtype with x64 on.
  items["action"] = np.array([7, -7], np.int64)
  if jax.config.jax_enable_x64:
    assert_raises_leaving_state_intact(
      lambda b, s: b.add(s, items), buffer, state, TypeError, ["['action']", "int64"]
    )
  else:
    stored = buffer.add(filled(buffer), items)
    np.testing.assert_array_equal(np.asarray(stored.storage["action"])[5:7], [7, -7])
  for bad in (2**40, 2**31, -(2**31) - 1):
    items["action"] = np.array([1, bad], np.int64)
    words = ["['action']"] + ([] if jax.config.jax_enable_x64 else [str(bad), "int32"])
    error = TypeError if jax.config.jax_enable_x64 else ValueError
    assert_raises_leaving_state_intact(lambda b, s: b.add(s, items), buffer, state, error, words)


@pytest.mark.parametrize("beta", [math.nan, math.inf, -0.5])
def test_a_beta_schedule_value_that_is_not_usable(beta):
  """Checked mode raises; unchecked, weights use beta = 1 (stay finite)."""
  schedule = lambda step: jnp.float32(beta) + 0.0 * step
  checked = jaxbuf.prioritized_replay(CAPACITY, beta=schedule, checked=True)
  state = filled(checked)
  state = checked.update_priorities(state, jnp.arange(5), jnp.arange(1.0, 6.0, dtype=jnp.float32))
  with pytest.raises(CHECK_FAILED, match="beta schedule returned"):
    checked.sample(state, jax.random.key(0), 16)
  default = jaxbuf.prioritized_replay(CAPACITY, beta=schedule)
  full = jaxbuf.prioritized_replay(CAPACITY, beta=1.0)
  state = default.update_priorities(
    filled(default), jnp.arange(5), jnp.arange(1.0, 6.0, dtype=jnp.float32)
  )
  ours = default.sample(state, jax.random.key(1), 16)
  reference = full.sample(state, jax.random.key(1), 16)
  assert np.all(np.isfinite(ours.weights))
  np.testing.assert_array_equal(ours.weights, reference.weights)


KIND_CALLS = {
  "add": lambda b, s: b.add(s, make_items(0, 2)),
  "sample": lambda b, s: b.sample(s, jax.random.key(0), 2),
  "update_priorities": lambda b, s: b.update_priorities(s, jnp.array([0]), jnp.array([1.0])),
  "clear": lambda b, s: b.clear(s),
}


@pytest.mark.parametrize("call", sorted(KIND_CALLS))
@pytest.mark.parametrize("owner, other", [("uniform", "prioritized"), ("prioritized", "uniform")])
def test_a_state_of_another_kind_is_a_type_error_naming_both(owner, other, call):
  buffers = {"uniform": UNIFORM, "prioritized": PRIORITIZED}
  state = filled(buffers[other])
  names = {"uniform": "ReplayState", "prioritized": "PrioritizedReplayState"}
  assert_raises_leaving_state_intact(
    KIND_CALLS[call],
    buffers[owner],
    state,
    TypeError,
    [call, f"expected a {names[owner]}", f"given a {names[other]}"],
  )


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
@pytest.mark.parametrize("checked", [False, True])
def test_an_empty_batch_of_priority_updates_changes_nothing(kind, checked):
  buffer = CHECKED[kind] if checked else {"uniform": UNIFORM, "prioritized": PRIORITIZED}[kind]
  state = filled(buffer)
  before = snapshot(state)
  state = buffer.update_priorities(
    state, jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.float32), jnp.zeros(0, jnp.uint32)
  )
  changed = [
    leaf
    for leaf, (was, now) in enumerate(
      zip(jax.tree.leaves(before), jax.tree.leaves(snapshot(state)))
    )
    if not np.array_equal(was, now)
  ]
  if kind == "prioritized":  # only beta_step counts the (empty) update
    assert int(state.beta_step) == 1
    assert len(changed) == 1
  else:
    assert not changed


# --- Issue 35: flags, settings through checkpoints, raw errors ------------------


def _goal_distance(achieved, desired):
  return -jnp.abs(achieved - desired).sum(-1)


BOOL_SETTINGS = {
  "uniform_replay-checked": lambda flag: jaxbuf.uniform_replay(8, checked=flag),
  "prioritized_replay-checked": lambda flag: jaxbuf.prioritized_replay(8, checked=flag),
  "prioritized_replay-stratified": lambda flag: jaxbuf.prioritized_replay(8, stratified=flag),
  "sequence_replay-checked": lambda flag: jaxbuf.sequence_replay(1, 8, 2, checked=flag),
  "prioritized_sequence_replay-stratified": lambda flag: jaxbuf.prioritized_sequence_replay(
    1, 8, 2, stratified=flag
  ),
  "prioritized_sequence_replay-checked": lambda flag: jaxbuf.prioritized_sequence_replay(
    1, 8, 2, checked=flag
  ),
  "episode_replay-weight_by_length": lambda flag: jaxbuf.episode_replay(
    1, 8, 4, weight_by_length=flag
  ),
  "episode_replay-checked": lambda flag: jaxbuf.episode_replay(1, 8, 4, checked=flag),
  "hindsight_replay-prioritized": lambda flag: jaxbuf.hindsight_replay(
    1, 8, _goal_distance, prioritized=flag
  ),
  "hindsight_replay-stratified": lambda flag: jaxbuf.hindsight_replay(
    1, 8, _goal_distance, prioritized=True, stratified=flag
  ),
  "hindsight_replay-checked": lambda flag: jaxbuf.hindsight_replay(
    1, 8, _goal_distance, checked=flag
  ),
  "frame_stack_replay-checked": lambda flag: jaxbuf.frame_stack_replay(1, 8, 2, checked=flag),
  "prioritized_frame_stack_replay-stratified": lambda flag: jaxbuf.prioritized_frame_stack_replay(
    1, 8, 2, stratified=flag
  ),
  "prioritized_frame_stack_replay-checked": lambda flag: jaxbuf.prioritized_frame_stack_replay(
    1, 8, 2, checked=flag
  ),
  "rollout_buffer-checked": lambda flag: jaxbuf.rollout_buffer(2, 2, checked=flag),
}


@pytest.mark.parametrize("setting", sorted(BOOL_SETTINGS))
def test_every_bool_setting_refuses_what_is_not_a_bool(setting):
  """ "False" was read as True (drawn by length, prioritized)."""
  factory, name = setting.split("-")
  make = BOOL_SETTINGS[setting]
  for flag in (False, True, np.bool_(True)):
    make(flag)
  for given, shown in (
    ("False", "str 'False'"),
    (0, "int 0"),
    (None, "NoneType"),
    (jnp.bool_(True), "an array of dtype bool"),
  ):
    with pytest.raises(TypeError) as raised:
      make(given)
    assert str(raised.value).startswith(
      f"{factory}: {name} must be a bool (True or False), given {shown}"
    ), (given, str(raised.value))


GOAL_STEP = {
  "obs": {
    "observation": jnp.zeros(1, jnp.float32),
    "achieved_goal": jnp.zeros(1, jnp.float32),
    "desired_goal": jnp.zeros(1, jnp.float32),
  },
  "action": jnp.int32(0),
  "reward": jnp.float32(0),
  "terminated": jnp.bool_(False),
}
STREAM_KINDS = {
  "sequence": lambda: jaxbuf.sequence_replay(2, 8, 2),
  "prioritized_sequence": lambda: jaxbuf.prioritized_sequence_replay(2, 8, 2),
  "episode": lambda: jaxbuf.episode_replay(2, 8, 2),
  "frame_stack": lambda: jaxbuf.frame_stack_replay(2, 8, 2),
  "prioritized_frame_stack": lambda: jaxbuf.prioritized_frame_stack_replay(2, 8, 2),
  "hindsight": lambda: jaxbuf.hindsight_replay(2, 8, _goal_distance),
  "prioritized_hindsight": lambda: jaxbuf.hindsight_replay(2, 8, _goal_distance, prioritized=True),
}


def _chunk(length, start=1):
  return jax.tree.map(lambda x: jnp.full((2, length) + x.shape, start, x.dtype), GOAL_STEP)


@pytest.mark.parametrize("kind", sorted(STREAM_KINDS))
def test_an_empty_chunk_adds_nothing_to_every_stream_kind(kind):
  """Was `IndexError: index is out of bounds for axis 1 with size 0` for
  hindsight, episode and frame-stack replay."""
  buffer = STREAM_KINDS[kind]()
  state = buffer.add(buffer.init(GOAL_STEP), _chunk(3))
  before = snapshot(state)
  assert_same(jax.jit(buffer.add)(state, _chunk(0)), before)
  assert_same(buffer.add(state, _chunk(0)), before)  # donated: consumed


@pytest.mark.parametrize("write", ["numpy", "float"])
@pytest.mark.parametrize("function", ["reward_fn", "terminated_fn"])
def test_a_goal_function_written_with_numpy_is_told_to_use_jax_numpy(function, write):
  """Were JAX's raw tracer errors (TracerArrayConversionError,
  ConcretizationTypeError)."""
  bad = {
    "numpy": lambda a, d: np.linalg.norm(a - d, axis=-1) > 0.5,
    "float": lambda a, d: float(a[0, 0]) > 0.5,
  }[write]
  if function == "reward_fn":
    buffer = jaxbuf.hindsight_replay(2, 8, lambda a, d: -bad(a, d).astype(np.float32))
  else:
    buffer = jaxbuf.hindsight_replay(2, 8, _goal_distance, terminated_fn=bad)
  state = buffer.add(buffer.init(GOAL_STEP), _chunk(3))
  with pytest.raises(
    TypeError,
    match=rf"sample: {function} runs under jit, on "
    r"traced achieved_goal and desired_goal leaves \[S, \.\.\.\]: "
    r"write it with jax.numpy .*JAX said: \w+Error",
  ):
    buffer.sample(state, jax.random.key(0), 4)


def test_goals_of_other_dtypes_are_named_by_their_dtypes():
  step = {**GOAL_STEP, "obs": {**GOAL_STEP["obs"], "desired_goal": jnp.zeros(1, jnp.int32)}}
  with pytest.raises(
    ValueError,
    match=r"must have the same shapes and dtypes, "
    r"given shapes \(1,\) and \(1,\), dtypes float32 and int32",
  ):
    jaxbuf.hindsight_replay(1, 8, _goal_distance).init(step)


@pytest.mark.parametrize("call", ["add", "sample", "can_sample", "clear"])
def test_a_frame_stack_state_given_to_prioritized_sequence_replay_is_another_kind(call):
  """Was "this state was made by a buffer with other settings"."""
  frames = jaxbuf.prioritized_frame_stack_replay(2, 8, 2)
  sequences = jaxbuf.prioritized_sequence_replay(2, 8, 2)
  state = frames.add(frames.init(GOAL_STEP), _chunk(3))
  calls = {
    "add": lambda b, s: b.add(s, _chunk(1)),
    "sample": lambda b, s: b.sample(s, jax.random.key(0), 2),
    "can_sample": lambda b, s: b.can_sample(s, 2),
    "clear": lambda b, s: b.clear(s),
  }
  assert_raises_leaving_state_intact(
    calls[call],
    sequences,
    state,
    TypeError,
    [
      f"{call}: expected a PrioritizedSequenceReplayState, given a "
      "FrameStackReplayState; pass each buffer's state to its own functions"
    ],
  )


def test_r2d2_priorities_of_windows_without_steps_are_zero():
  """[S, 0] TD errors raised NumPy's "zero-size array to reduction operation"."""
  for td_errors in (jnp.zeros((3, 0)), np.zeros((3, 0), np.float32)):
    assert jaxbuf.r2d2_priorities(td_errors).tolist() == [0.0] * 3
    assert jax.jit(jaxbuf.r2d2_priorities)(td_errors).tolist() == [0.0] * 3
  assert jaxbuf.r2d2_priorities(jnp.zeros((0, 0))).shape == (0,)


@pytest.mark.parametrize("gamma", [1.5, -0.1, np.float32(2.0), jnp.float32(1.5)])
def test_a_concrete_gamma_outside_0_1_is_refused(gamma):
  """A traced gamma cannot be read while tracing: documented in
  `help(jaxbuf.n_step_targets)` (a traced 1.5 discounts two steps by 2.25)."""
  rewards = jnp.ones((1, 4))
  flags = jnp.zeros((1, 4), bool)
  call = lambda r: jaxbuf.n_step_targets(r, flags, flags, n=2, gamma=gamma)
  for targets in (call, jax.jit(call)):  # closed over: concrete in the jit
    with pytest.raises(
      ValueError,
      match=r"n_step_targets: gamma must be in "
      r"\[0, 1\], given",
    ):
      targets(rewards)
  traced = jax.jit(lambda g: jaxbuf.n_step_targets(rewards, flags, flags, n=2, gamma=g).discounts)(
    1.5
  )
  assert traced.tolist() == [[2.25, 2.25]]
  assert "a traced 1.5 discounts two steps by 2.25" in " ".join(
    jaxbuf.n_step_targets.__doc__.split()
  )


def test_flags_of_numbers_other_than_0_and_1_are_refused():
  """terminated=0.5 was read as True. Traced flags cannot be read while
  tracing (every nonzero value is True there)."""
  rewards = jnp.ones((1, 4))
  flags = jnp.zeros((1, 4), bool)
  half = np.array([[0, 0.5, 0, 0]], np.float32)
  with pytest.raises(
    ValueError,
    match=r"n_step_targets: terminated holds 0.5 at "
    r"index \(0, 1\); flags are bool or 0/1 numbers",
  ):
    jaxbuf.n_step_targets(rewards, half, flags, n=2, gamma=0.9)
  with pytest.raises(
    ValueError,
    match=r"compute_gae: terminated holds 0.5 at "
    r"index \(1,\)",
  ):
    jaxbuf.compute_gae(jnp.ones(4), jnp.ones(4), half[0], jnp.float32(0), gamma=0.9, gae_lambda=0.9)
  ones = np.array([[0, 1, 0, 0]], np.float32)
  assert (
    jaxbuf.n_step_targets(rewards, ones, flags, n=2, gamma=0.9).discounts
    == jaxbuf.n_step_targets(rewards, ones.astype(bool), flags, n=2, gamma=0.9).discounts
  ).all()


# One per factory that binds a stream add (the prioritized frame-stack and
# hindsight kinds share their factory with the plain ones).
@pytest.mark.parametrize(
  "kind", ["sequence", "prioritized_sequence", "episode", "frame_stack", "hindsight"]
)
def test_a_final_step_after_a_step_flagged_last_is_refused(kind):
  """Row `stream-two-final-steps`: steps flagged `last` themselves, passed
  with `final_steps=` flagged `last` for the same env, were two final steps
  in a row, accepted. Flags that can be read (host arrays; the add's checks
  before its jit) are refused, state intact; traced ones are not written
  twice (the second final step is dropped), eagerly under the user's jit."""
  buffer = STREAM_KINDS[kind]()
  example = {**GOAL_STEP, "last": jnp.bool_(False)}
  state = buffer.init(example)
  steps = jax.tree.map(lambda x: np.zeros((2,) + x.shape, x.dtype), example)
  steps["last"] = np.array([True, False])
  final_steps = jax.tree.map(np.copy, steps)
  final_steps["last"] = np.array([True, True])
  before = snapshot(state)
  with pytest.raises(ValueError, match=r"add: env 0's last step .* two final steps in a row"):
    buffer.add(state, steps, final_steps=final_steps)
  assert_same(state, before)
  # One end per env is taken: env 0's end in the steps, env 1's in final_steps.
  final_steps["last"] = np.array([False, True])
  state = buffer.add(state, steps, final_steps=final_steps)
  np.testing.assert_array_equal(state.steps_held, [1, 2])
  # Under the user's jit the flags are traced: env 0's second final step is
  # not written.
  final_steps["last"] = np.array([True, True])
  traced = jax.jit(buffer.add)(buffer.init(example), steps, final_steps=final_steps)
  np.testing.assert_array_equal(traced.steps_held, [1, 2])
