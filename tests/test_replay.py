"""Item replay, both kinds: storage, ring order, sampling statistics, errors.

tests/test_conformance.py runs the checks every kind shares (jit, vmap, scan,
cond, one trace, a bad add leaving the state intact).
"""

import dataclasses
import inspect
import os
import pydoc
import re

import chex
import flax.struct
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import optax
import pytest
import scipy.stats

import jaxbuf
from jaxbuf._src.core import sum_tree
from tests import devices
from tests.reference import ReferenceReplay

CAPACITY = 8
AUTO = jax.sharding.AxisType.Auto  # GSPMD propagates shardings through the ops
# Eager checks raise JAX's (private) FailedCheckError, checkified ones a
# ValueError from err.throw(); the message is what identifies the check.
CHECK_FAILED = Exception
MAKERS = {
  "uniform": lambda: jaxbuf.uniform_replay(CAPACITY),
  "prioritized": lambda: jaxbuf.prioritized_replay(CAPACITY, alpha=0.7, beta=0.5),
}
# Shared across tests so that each shape compiles once per session.
KINDS = {name: make() for name, make in MAKERS.items()}


@flax.struct.dataclass
class Transition:
  obs: jax.Array  # uint8 [3, 2]: image-like
  action: jax.Array  # int32 []
  reward: jax.Array  # float32 []
  done: jax.Array  # bool []
  extras: tuple  # (float32 [2], {"a": int8 []})


def example_item() -> Transition:
  return Transition(
    obs=jnp.zeros((3, 2), jnp.uint8),
    action=jnp.int32(0),
    reward=jnp.float32(0),
    done=jnp.bool_(False),
    extras=(jnp.zeros(2, jnp.float32), {"a": jnp.int8(0)}),
  )


def make_items(start: int, batch: int) -> Transition:
  """Items whose every leaf encodes its serial number, for exact checks."""
  serial = np.arange(start, start + batch)
  return Transition(
    obs=jnp.asarray(np.broadcast_to((serial % 256)[:, None, None], (batch, 3, 2)), jnp.uint8),
    action=jnp.asarray(serial, jnp.int32),
    reward=jnp.asarray(serial, jnp.float32) / 2,
    done=jnp.asarray(serial % 2 == 0),
    extras=(
      jnp.asarray(np.stack([serial, -serial], 1), jnp.float32),
      {"a": jnp.asarray(serial % 100, jnp.int8)},
    ),
  )


@pytest.fixture(params=sorted(KINDS))
def kind(request):
  return request.param


def fresh(kind_name):
  buffer = KINDS[kind_name]
  return buffer, buffer.init(example_item())


# --- Storage and ring order ---------------------------------------------------


def test_init_preallocates_each_leaf_with_its_dtype(kind):
  _, state = fresh(kind)
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state.storage)
  assert shapes.obs == ((CAPACITY, 3, 2), jnp.uint8)
  assert shapes.action == ((CAPACITY,), jnp.int32)
  assert shapes.done == ((CAPACITY,), jnp.bool_)
  assert shapes.extras[1]["a"] == ((CAPACITY,), jnp.int8)
  assert state.size.dtype == jnp.int32 and int(state.size) == 0


@pytest.mark.parametrize(
  "batches", [[3, 3, 3], [CAPACITY], [CAPACITY + 5], [1, 2 * CAPACITY + 3, 2], [5, 7, 11]]
)
def test_add_keeps_the_newest_items_in_ring_order(kind, batches):
  buffer, state = fresh(kind)
  reference = ReferenceReplay(CAPACITY)
  serial = 0
  for batch in batches:
    state = buffer.add(state, make_items(serial, batch))
    reference.add(list(range(serial, serial + batch)))
    serial += batch
  held = np.asarray(state.storage.action)
  for slot in range(reference.size):
    assert held[slot] == reference.storage[slot]
  assert int(state.size) == reference.size
  assert int(state.insert_position) == reference.insert_position
  assert int(state.add_count) == reference.add_count


def test_clear_empties_without_reallocating(kind):
  buffer, state = fresh(kind)
  state = buffer.add(state, make_items(0, 5))
  storage_shapes = jax.tree.map(jnp.shape, state.storage)
  state = buffer.clear(state)
  assert int(state.size) == 0 and int(state.insert_position) == 0
  assert jax.tree.map(jnp.shape, state.storage) == storage_shapes
  assert not bool(buffer.can_sample(state, 1))
  state = buffer.add(state, make_items(100, 2))
  batch = buffer.sample(state, jax.random.key(0), 64)
  assert set(np.asarray(batch.items.action)) <= {100, 101}


def test_can_sample_is_true_once_one_item_is_held(kind):
  # Sampling is with replacement: one item serves any batch size. A warm-up
  # is `state.size >= min_size`, not can_sample.
  buffer, state = fresh(kind)
  assert not bool(buffer.can_sample(state, 1))
  state = buffer.add(state, make_items(0, 1))
  assert bool(buffer.can_sample(state, 1)) and bool(buffer.can_sample(state, 64))
  assert buffer.can_sample(state, 3).dtype == jnp.bool_
  batch = buffer.sample(state, jax.random.key(0), 64)
  assert set(np.asarray(batch.items.action)) == {0}


# --- Sampling -------------------------------------------------------------------


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_sample_returns_only_items_held(kind, make_key):
  buffer, state = fresh(kind)
  state = buffer.add(state, make_items(0, 5))
  batch = buffer.sample(state, make_key(1), 256)
  indices = np.asarray(batch.indices)
  assert batch.indices.dtype == jnp.int32 and batch.weights.dtype == jnp.float32
  assert indices.min() >= 0 and indices.max() < 5
  np.testing.assert_array_equal(np.asarray(batch.items.action), indices)
  np.testing.assert_array_equal(np.asarray(batch.item_ids), indices)
  assert float(batch.weights.max()) == 1.0


def test_sampling_an_empty_buffer_returns_zero_weights(kind):
  buffer, state = fresh(kind)
  batch = buffer.sample(state, jax.random.key(0), 4)
  np.testing.assert_array_equal(np.asarray(batch.indices), 0)
  np.testing.assert_array_equal(np.asarray(batch.weights), 0.0)


@pytest.mark.usefixtures("x64_mode")  # same behaviour with x64 on
def test_uniform_sampling_is_uniform_over_items_held():
  """Chi-square over 7 held slots of 8; seed fixed, reject at p < 1e-3."""
  buffer = KINDS["uniform"]
  state = buffer.add(buffer.init(example_item()), make_items(0, 7))
  keys = jax.random.split(jax.random.key(2), 200)
  indices = jax.vmap(lambda k: buffer.sample(state, k, 256).indices)(keys)
  counts = np.bincount(np.asarray(indices).ravel(), minlength=CAPACITY)
  assert counts[7] == 0
  assert scipy.stats.chisquare(counts[:7]).pvalue > 1e-3


@pytest.mark.parametrize("stratified", [True, False])
def test_prioritized_sampling_follows_priority_power_alpha(stratified):
  """Draw frequencies vs p_i^alpha / sum_j p_j^alpha; chi-square, p > 1e-3."""
  capacity, alpha = 10, 0.6
  buffer = jaxbuf.prioritized_replay(capacity, alpha=alpha, stratified=stratified)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(capacity))
  priorities = np.array([0.1, 1, 2, 3, 4, 5, 0.5, 8, 0.0, 10], np.float32)
  state = buffer.update_priorities(state, jnp.arange(capacity), priorities)
  keys = jax.random.split(jax.random.key(3), 400)
  indices = jax.vmap(lambda k: buffer.sample(state, k, 128).indices)(keys)
  counts = np.bincount(np.asarray(indices).ravel(), minlength=capacity)
  expected = (priorities.astype(np.float64) + 1e-6) ** alpha
  expected = expected / expected.sum() * counts.sum()
  assert scipy.stats.chisquare(counts, expected).pvalue > 1e-3


def test_prioritized_weights_are_exact():
  capacity, alpha, beta = 16, 0.7, 0.5
  buffer = jaxbuf.prioritized_replay(capacity, alpha=alpha, beta=beta)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(12))
  reference = ReferenceReplay(capacity, alpha=alpha)
  reference.add(list(range(12)))
  priorities = np.linspace(0.05, 3.0, 12).astype(np.float32)
  state = buffer.update_priorities(state, jnp.arange(12), priorities)
  reference.update_priorities(range(12), priorities)
  batch = buffer.sample(state, jax.random.key(4), 64)
  np.testing.assert_allclose(
    np.asarray(batch.weights), reference.weights(np.asarray(batch.indices), beta), rtol=2e-5
  )


def test_beta_schedule_reads_the_step_counter_in_the_state():
  schedule = optax.linear_schedule(0.4, 1.0, transition_steps=10)
  buffer = jaxbuf.prioritized_replay(16, alpha=1.0, beta=schedule)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(16))
  reference = ReferenceReplay(16, alpha=1.0)
  reference.add(list(range(16)))
  priorities = np.arange(1, 17, dtype=np.float32)
  for _ in range(4):
    state = buffer.update_priorities(state, jnp.arange(16), priorities)
    reference.update_priorities(range(16), priorities)
  assert int(state.beta_step) == 4
  batch = buffer.sample(state, jax.random.key(5), 32)
  np.testing.assert_allclose(
    np.asarray(batch.weights),
    reference.weights(np.asarray(batch.indices), float(schedule(4))),
    rtol=2e-5,
  )


# --- Priority updates -----------------------------------------------------------


def test_new_items_enter_at_the_running_maximum_priority():
  buffer = jaxbuf.prioritized_replay(8, alpha=1.0)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(4))
  state = buffer.update_priorities(state, jnp.array([0, 1]), jnp.array([5.0, 0.5]))
  state = buffer.add(state, jnp.zeros(2))
  leaves = np.asarray(state.sum_tree.levels[0])
  np.testing.assert_allclose(leaves[:6], [5, 0.5, 1, 1, 5, 5], rtol=1e-5)
  assert float(state.max_priority) == pytest.approx(5.0)


def test_duplicate_indices_keep_the_last_and_tree_stays_consistent():
  buffer = jaxbuf.prioritized_replay(8, alpha=1.0, eps=1e-6)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(8))
  state = buffer.update_priorities(
    state, jnp.array([2, 2, 5, 2, 5]), jnp.array([1.0, 2.0, 3.0, 4.0, 0.5])
  )
  leaves = np.asarray(state.sum_tree.levels[0])
  assert leaves[2] == np.float32(4.0) + np.float32(1e-6)
  assert leaves[5] == np.float32(0.5) + np.float32(1e-6)
  assert float(state.sum_tree.levels[-1][0]) == pytest.approx(leaves.sum(), rel=1e-6)


def test_uniform_update_priorities_is_the_identity():
  buffer, state = fresh("uniform")
  state = buffer.add(state, make_items(0, 4))
  before = jax.tree.map(np.asarray, state)
  state = buffer.update_priorities(state, jnp.array([0, 1]), jnp.array([3.0, 4.0]))
  chex.assert_trees_all_equal(before, jax.tree.map(np.asarray, state))


# --- The NumPy model, driven by hypothesis ----------------------------------------

operations = st.lists(
  st.one_of(
    st.tuples(st.just("add"), st.sampled_from([1, 3, CAPACITY + 3])),
    st.tuples(st.just("sample"), st.integers(0, 2**16)),
    st.tuples(
      st.just("update"),
      st.lists(
        st.tuples(
          st.integers(-2, CAPACITY + 1), st.sampled_from([0.0, 0.3, 2.0, 7.5, -1.0, np.nan, np.inf])
        ),
        min_size=4,
        max_size=4,
      ),
    ),
    st.tuples(st.just("clear"), st.none()),
  ),
  min_size=1,
  max_size=12,
)


@hypothesis.given(ops=operations)
def test_random_operation_sequences_match_the_numpy_model(ops):
  buffer = KINDS["prioritized"]
  state = buffer.init(example_item())
  reference = ReferenceReplay(CAPACITY, alpha=0.7)
  serial = 0
  for name, argument in ops:
    if name == "add":
      state = buffer.add(state, make_items(serial, argument))
      reference.add(list(range(serial, serial + argument)))
      serial += argument
    elif name == "sample":
      batch = buffer.sample(state, jax.random.key(argument), 16)
      indices = np.asarray(batch.indices)
      if reference.size:
        assert indices.max() < reference.size
        np.testing.assert_array_equal(
          np.asarray(batch.items.action), [reference.storage[i] for i in indices]
        )
        np.testing.assert_allclose(
          np.asarray(batch.weights), reference.weights(indices, 0.5), rtol=1e-4
        )
      else:
        np.testing.assert_array_equal(np.asarray(batch.weights), 0.0)
    elif name == "update":
      indices = np.array([i for i, _ in argument], np.int32)
      priorities = np.array([p for _, p in argument], np.float32)
      state = buffer.update_priorities(state, indices, priorities)
      reference.update_priorities(indices, priorities)
    else:
      state = buffer.clear(state)
      reference.clear()
    assert int(state.size) == reference.size
    assert int(state.insert_position) == reference.insert_position
    leaves = np.asarray(state.sum_tree.levels[0])[:CAPACITY]
    held = np.arange(CAPACITY) < reference.size
    np.testing.assert_allclose(leaves[held], reference.priorities[held] ** 0.7, rtol=1e-5)
    assert np.all(leaves[~held] == 0)
    assert np.isfinite(float(state.sum_tree.levels[-1][0]))
    assert float(state.max_priority) == pytest.approx(reference.max_priority, rel=1e-6)


# --- Errors at trace time; state intact ---------------------------------------------
# The bad-input table is tests/test_reliability.py (RAISES, SETTINGS, one row
# per case, both kinds); here only what its flat dict item cannot show:
# leaf paths inside dataclasses and nested containers.


@pytest.mark.parametrize(
  "corrupt, error, words",
  [
    (lambda t: t.replace(obs=t.obs[:, :2]), ValueError, [".obs", "(3, 2, 2)"]),
    (lambda t: t.replace(extras=(t.extras[0],)), TypeError, ["missing leaves", ".extras[1]['a']"]),
    # Five leaves have 3 items, one has 2: that one is named.
    (
      lambda t: t.replace(reward=t.reward[:2]),
      ValueError,
      ["leaf .reward has shape (2,)", "expected (3,)"],
    ),
  ],
)
def test_bad_items_name_the_leaf_path_inside_dataclasses(kind, corrupt, error, words):
  buffer, state = fresh(kind)
  state = buffer.add(state, make_items(0, 3))
  before = jax.tree.map(np.asarray, state)
  with pytest.raises(error) as raised:
    buffer.add(state, corrupt(make_items(3, 3)))
  for word in words:
    assert word in str(raised.value)
  chex.assert_trees_all_equal(before, jax.tree.map(np.asarray, state))
  buffer.add(state, make_items(3, 3))  # the state is still usable


def test_checked_mode_raises_on_empty_sample_and_bad_priorities():
  buffer = jaxbuf.prioritized_replay(8, checked=True)
  state = buffer.init(jnp.zeros(()))
  with pytest.raises(CHECK_FAILED, match="empty"):
    buffer.sample(state, jax.random.key(0), 2)
  state = buffer.add(state, jnp.zeros(3))
  with pytest.raises(CHECK_FAILED, match="finite"):
    buffer.update_priorities(state, jnp.array([0]), jnp.array([jnp.nan]))
  with pytest.raises(CHECK_FAILED, match="items held"):
    buffer.update_priorities(state, jnp.array([5]), jnp.array([1.0]))
  step = jax.jit(checkify.checkify(lambda s, k: buffer.sample(s, k, 2)))
  error, _ = step(buffer.clear(state), jax.random.key(0))
  with pytest.raises(ValueError, match="empty"):
    error.throw()


# --- Donation and devices (jit, vmap, scan, cond: tests/test_conformance.py) ---


def test_python_loop_add_updates_the_storage_in_place(kind):
  buffer, state = fresh(kind)
  state = buffer.add(state, make_items(0, 2))
  pointer = state.storage.obs.unsafe_buffer_pointer()
  for i in range(3):
    old = state
    state = buffer.add(state, make_items(2 + i, 1))
    assert old.storage.obs.is_deleted()
  assert state.storage.obs.unsafe_buffer_pointer() == pointer


def vmapped_step(buffer):
  """Add, sample 4 and update priorities, vmapped over a batch of buffers."""

  def step(states, items, keys):
    states = jax.vmap(buffer.add)(states, items)
    samples = jax.vmap(lambda s, k: buffer.sample(s, k, 4))(states, keys)
    states = jax.vmap(buffer.update_priorities)(
      states, samples.indices, samples.weights + 1, samples.item_ids
    )
    return states, samples

  return step


@devices.needs(4)
def test_buffers_sharded_over_four_devices(kind):
  assert jax.device_count() == 4
  buffer, _ = fresh(kind)
  mesh = jax.make_mesh((4,), ("buffers",), axis_types=(AUTO,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("buffers"))
  states = jax.vmap(lambda _: buffer.init(example_item()))(jnp.arange(8))
  states = jax.device_put(states, sharding)
  items = jax.tree.map(lambda *xs: jnp.stack(xs), *[make_items(b, 3) for b in range(8)])
  keys = jax.random.split(jax.random.key(8), 8)
  items, keys = jax.device_put((items, keys), sharding)

  states, samples = jax.jit(vmapped_step(buffer))(states, items, keys)
  assert states.storage.obs.sharding.is_equivalent_to(sharding, 3)
  np.testing.assert_array_equal(
    np.asarray(samples.items.action), np.asarray(samples.indices) + np.arange(8)[:, None]
  )


@devices.needs(4)
def test_buffers_per_device_inside_shard_map(kind):
  """Each device steps its own buffers inside `shard_map`, as in a data-
  parallel learner; results equal the same steps run unsharded."""
  buffer, _ = fresh(kind)
  mesh = jax.make_mesh((4,), ("devices",), axis_types=(AUTO,))
  spec = jax.sharding.PartitionSpec("devices")
  states = jax.vmap(lambda _: buffer.init(example_item()))(jnp.arange(8))
  items = jax.tree.map(lambda *xs: jnp.stack(xs), *[make_items(b, 3) for b in range(8)])
  keys = jax.random.split(jax.random.key(9), 8)

  step = vmapped_step(buffer)
  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
  states_sharded, samples_sharded = sharded(states, items, keys)
  states_plain, samples_plain = jax.jit(step)(states, items, keys)
  chex.assert_trees_all_equal(samples_sharded, samples_plain)
  chex.assert_trees_all_equal(states_sharded, states_plain)


@devices.needs(4)
@pytest.mark.usefixtures("x64_mode")  # same behaviour with x64 on
def test_one_buffer_with_storage_sharded_over_capacity(kind):
  capacity = 16
  buffer = (jaxbuf.uniform_replay if kind == "uniform" else jaxbuf.prioritized_replay)(capacity)
  mesh = jax.make_mesh((4,), ("slots",), axis_types=(AUTO,))
  state = buffer.init(jnp.zeros(5, jnp.float32))
  row_sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("slots"))
  state = state.replace(storage=jax.device_put(state.storage, row_sharded))
  for start in range(0, 40, 6):
    rows = jnp.arange(start, start + 6, dtype=jnp.float32)
    state = buffer.add(state, jnp.broadcast_to(rows[:, None], (6, 5)))
  assert state.storage.sharding.is_equivalent_to(row_sharded, 2)
  batch = buffer.sample(state, jax.random.key(0), 32)
  np.testing.assert_array_equal(
    np.asarray(batch.items[:, 0]), np.asarray(state.storage[batch.indices, 0])
  )
  assert np.asarray(batch.items[:, 0]).min() >= 42 - capacity


def test_fused_step_needs_no_host_transfer_or_callback(kind):
  buffer, state = fresh(kind)
  state = buffer.add(state, make_items(0, 4))
  items = make_items(4, 2)
  key = jax.random.key(0)

  def step(state, key, items):
    state = buffer.add(state, items)
    batch = buffer.sample(state, key, 4)
    loss = jnp.mean(batch.weights * batch.items.reward)
    state = buffer.update_priorities(
      state, batch.indices, jnp.abs(batch.items.reward), batch.item_ids
    )
    return state, loss

  jitted = jax.jit(step, donate_argnums=0)
  assert "callback" not in jitted.lower(state, key, items).as_text()
  state, key, items = jax.device_put((state, key, items))
  with jax.transfer_guard("disallow"):
    state, loss = jitted(state, key, items)
    state, loss = jitted(state, key, items)
  assert int(state.size) == 8 and loss.shape == ()


def test_dataclass_items_round_trip(kind):
  buffer, state = fresh(kind)
  state = buffer.add(state, make_items(40, 2))
  batch = buffer.sample(state, jax.random.key(0), 3)
  assert isinstance(batch.items, Transition)
  assert dataclasses.fields(batch.items)[0].name == "obs"
  assert batch.items.obs.dtype == jnp.uint8


def test_computed_once_returns_the_computation_whatever_the_guard():
  compute = lambda: jnp.arange(5) * 3
  run = jax.jit(lambda guard: jaxbuf._src.core.random.computed_once(compute, guard))
  for guard in (7, 0, -2):  # a negative guard only costs a second trip
    np.testing.assert_array_equal(run(jnp.int32(guard)), np.arange(5) * 3)
  doubled = jax.vmap(lambda guard, x: jaxbuf._src.core.random.computed_once(lambda: x * 2, guard))(
    jnp.array([0, 5, -1]), jnp.arange(3)
  )
  assert doubled.tolist() == [0, 2, 4]


def _fused_computations_with(text: str, opcode: str) -> list[str]:
  """The bodies of the compiled module's computations that contain `opcode`."""
  bodies = text.split("\n\n")
  return [body for body in bodies if f" {opcode}(" in body]


@pytest.mark.skipif(
  jax.default_backend() != "cpu"
  or jaxbuf._src.core.random.plain_random()
  or os.environ.get(sum_tree.KERNEL_VARIANT_VARIABLE, "xla") != "xla",
  reason="computed_once is a CPU trick (off elsewhere, and "
  "with JAXBUF_PLAIN_RANDOM=1); reads the CPU program text of the XLA path",
)
@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_sampled_rows_are_gathered_with_indices_computed_once(kind):
  """No gather recomputes the random draw: XLA had fused it into the storage
  gather, redoing the hash and remainders for every element of every row.
  (Prioritized indices come out of a `lax.cond`, which has always kept them
  apart; the case guards that.)"""
  buffer = {"uniform": jaxbuf.uniform_replay, "prioritized": jaxbuf.prioritized_replay}[kind](1000)
  state = buffer.init({"obs": jnp.zeros(84)})

  # One leaf, and only its rows used (as in a loss): nothing else would keep
  # the indices in a buffer of their own.
  def sum_of_rows(state, key):
    return buffer.sample(state, key, 64).items["obs"].sum()

  text = jax.jit(sum_of_rows).lower(state, jax.random.key(0)).compile().as_text()
  gathers = _fused_computations_with(text, "gather")
  assert gathers
  for body in gathers:
    assert " remainder(" not in body and " xor(" not in body, body


def test_capacity_one_holds_the_newest_item(kind):
  buffer = (
    jaxbuf.uniform_replay(1)
    if kind == "uniform"
    else jaxbuf.prioritized_replay(1, alpha=0.7, beta=0.5)
  )
  state = buffer.add(buffer.init(example_item()), make_items(0, 3))
  batch = buffer.sample(state, jax.random.key(0), 4)
  assert batch.indices.tolist() == [0, 0, 0, 0]
  assert batch.items.action.tolist() == [2, 2, 2, 2]
  np.testing.assert_array_equal(batch.weights, np.ones(4))
  state = buffer.update_priorities(
    state, batch.indices, jnp.array([1.0, 2.0, 3.0, 4.0]), batch.item_ids
  )
  assert int(state.size) == 1
  if kind == "prioritized":  # duplicates: the last update wins
    np.testing.assert_allclose(
      jaxbuf._src.core.sum_tree.total(state.sum_tree), (4.0 + 1e-6) ** 0.7, rtol=1e-6
    )


# --- First-hour traps (issue 9) -------------------------------------------------

RAW_MODULES = {"uniform": jaxbuf.uniform, "prioritized": jaxbuf.prioritized}
BOUND = ("add", "sample", "update_priorities", "can_sample", "clear")


@pytest.mark.parametrize("checked", [False, True])
def test_help_shows_each_functions_own_docstring_and_signature(kind, checked):
  buffer = (
    KINDS[kind]
    if not checked
    else {
      "uniform": jaxbuf.uniform_replay(CAPACITY, checked=True),
      "prioritized": jaxbuf.prioritized_replay(CAPACITY, checked=True),
    }[kind]
  )
  for name in BOUND:
    function = getattr(buffer, name)
    raw = getattr(RAW_MODULES[kind], name, None) or getattr(jaxbuf._src.core.ring, name)
    # The raw docstring less the Args entries of the buffer's bound settings
    # (tests/test_streams.py checks which go): the same summary.
    assert function.__doc__.splitlines()[0] == raw.__doc__.splitlines()[0], name
    assert function.__name__ == name
    assert inspect.unwrap(function) is raw
    text = pydoc.render_doc(function)
    assert raw.__doc__.splitlines()[0] in text and "partial" not in text, name
  # Bound settings leave the signature, and passing one again (a jitted
  # sample would trace it; checked=True there would stage checks jit cannot
  # run) is a TypeError naming it; what the caller passes stays.
  parameters = inspect.signature(buffer.sample).parameters
  # `step` is the caller's too: a loop counter folded into the key.
  assert list(parameters) == ["state", "key", "batch_size", "step"]
  with pytest.raises(TypeError, match="checked is a setting of the buffer"):
    buffer.sample(buffer.init(example_item()), jax.random.key(0), 4, checked=not checked)
  assert "Returns:" in buffer.sample.__doc__ and "[S]" in buffer.sample.__doc__
  if not checked:  # the jitted function's own tools stay reachable
    state = buffer.add(buffer.init(example_item()), make_items(0, 3))
    assert "gather" in buffer.sample.lower(state, jax.random.key(0), 4).as_text()


def test_signed_priorities_sample_like_their_magnitudes():
  """TD errors passed with their sign: -x and x give one priority, and the
  draw frequencies follow |p|^alpha (chi-square, p > 1e-3). Skipping the
  negatives, as before, left those items at the maximum priority."""
  capacity, alpha = 8, 0.8
  buffer = jaxbuf.prioritized_replay(capacity, alpha=alpha)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(capacity))
  signed = np.array([-4.0, 0.5, -0.25, 2.0, -1.0, 3.0, -0.1, 1.0], np.float32)
  with_sign = buffer.update_priorities(state, jnp.arange(capacity), signed)
  magnitudes = buffer.update_priorities(
    buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(capacity)),
    jnp.arange(capacity),
    np.abs(signed),
  )
  np.testing.assert_array_equal(with_sign.sum_tree.levels[0], magnitudes.sum_tree.levels[0])
  keys = jax.random.split(jax.random.key(12), 200)
  indices = jax.vmap(lambda k: buffer.sample(with_sign, k, 128).indices)(keys)
  counts = np.bincount(np.asarray(indices).ravel(), minlength=capacity)
  expected = (np.abs(signed).astype(np.float64) + 1e-6) ** alpha
  expected = expected / expected.sum() * counts.sum()
  assert scipy.stats.chisquare(counts, expected).pvalue > 1e-3


def test_a_prefix_of_a_stratified_batch_is_distributed_like_the_whole():
  """Strata used to come in slot order: position 0 always came from the
  lowest slots, and with few items the batch hardly depended on the key.
  Position 0, and the first quarter, over many keys: chi-square against the
  priorities (p > 1e-3); the batch differs between keys."""
  capacity, alpha = 5, 1.0
  buffer = jaxbuf.prioritized_replay(capacity, alpha=alpha)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(capacity))
  priorities = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
  state = buffer.update_priorities(state, jnp.arange(capacity), priorities)
  keys = jax.random.split(jax.random.key(13), 2000)
  indices = np.asarray(jax.vmap(lambda k: buffer.sample(state, k, 8).indices)(keys))
  expected = (priorities.astype(np.float64) + 1e-6) ** alpha
  expected = expected / expected.sum()
  for prefix in (indices[:, 0], indices[:, :2].ravel()):
    counts = np.bincount(prefix, minlength=capacity)
    assert scipy.stats.chisquare(counts, expected * counts.sum()).pvalue > 1e-3
  assert len({tuple(row) for row in indices[:50].tolist()}) > 10


def test_stratified_rows_come_in_random_order():
  """In stratum order, rotated or not, 256 draws over 32 items of equal
  priority came in strips: rows 8k..8k+7 one item (224 equal neighbours),
  so a minibatch cut from a sample held few items. In random order about
  255 / 32 = 8."""
  buffer = jaxbuf.prioritized_replay(32)
  state = buffer.add(buffer.init(jnp.zeros(())), jnp.zeros(32))
  rows = np.asarray(buffer.sample(state, jax.random.key(0), 256).indices)
  assert len(set(rows.tolist())) == 32  # still one draw per stratum
  assert np.sum(rows[1:] == rows[:-1]) < 25, rows[:16]
  assert all(len(set(block.tolist())) > 20 for block in rows.reshape(4, 64))


EPOCH_BUFFERS = {
  (kind, capacity): (
    jaxbuf.uniform_replay(capacity) if kind == "uniform" else jaxbuf.prioritized_replay(capacity)
  )
  for kind in KINDS
  for capacity in (1, 5)
}


EPOCH_BATCHES = jax.jit(jaxbuf.epoch_batches, static_argnames="batch_size")


def _epoch_case(kind, capacity, added):
  buffer = EPOCH_BUFFERS.get((kind, capacity), KINDS[kind])
  state = buffer.init(example_item())
  if added:
    state = buffer.add(state, make_items(100, added))
  return buffer, state


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
  capacity=st.sampled_from([1, 5, CAPACITY]),
  added=st.integers(0, 12),
  batch_size=st.sampled_from([1, 3, 9]),
  seed=st.integers(0, 2**16),
  kind=st.sampled_from(sorted(KINDS)),
)
def test_an_epoch_holds_every_item_exactly_once(capacity, added, batch_size, seed, kind):
  buffer, state = _epoch_case(kind, capacity, added)
  epoch = EPOCH_BATCHES(state, jax.random.key(seed), batch_size)
  num_batches = -(-capacity // batch_size)
  assert epoch.indices.shape == epoch.weights.shape == (num_batches, batch_size)
  assert epoch.items.obs.shape == (num_batches, batch_size, 3, 2)
  size = min(added, capacity)
  held = np.asarray(epoch.weights).ravel() > 0
  # The items held, each once, first in batch-major order; then padding.
  assert held.tolist() == [True] * size + [False] * (held.size - size)
  indices = np.asarray(epoch.indices).ravel()
  assert sorted(indices[held].tolist()) == list(range(size))
  assert np.all(indices[~held] == capacity)
  newest = list(range(100 + added - size, 100 + added))
  assert sorted(np.asarray(epoch.items.action).ravel()[held].tolist()) == newest
  # Item ids count writes: the item added n-th (from 0) has id n.
  ids = np.asarray(epoch.item_ids).ravel()[held]
  actions = np.asarray(epoch.items.action).ravel()[held]
  np.testing.assert_array_equal(ids, actions - 100)
  assert epoch.item_ids.dtype == jnp.uint32
  del buffer


def test_epoch_order_is_uniform_and_composes_with_jit_vmap_and_scan():
  """Where item 0 lands, over 1400 keys: uniform over the 7 positions held
  (chi-square, p > 1e-3). vmapped over states, each epoch is its own; in a
  scan the batches come out one by one; no retrace on the second call."""
  buffer, state = _epoch_case("uniform", CAPACITY, 7)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def first_positions(keys):
    epochs = jax.vmap(lambda k: jaxbuf.epoch_batches(state, k, 3))(keys)
    flat = epochs.indices.reshape(keys.shape[0], -1)
    return jnp.argmax(flat == 0, axis=1)

  positions = np.concatenate(
    [np.asarray(first_positions(keys)) for keys in jax.random.split(jax.random.key(14), (2, 700))]
  )
  counts = np.bincount(positions, minlength=9)
  assert counts[7:].sum() == 0
  assert scipy.stats.chisquare(counts[:7]).pvalue > 1e-3

  def weighted_sum(total, batch):
    return total + jnp.sum(batch.weights * batch.items.reward), None

  epoch = jaxbuf.epoch_batches(state, jax.random.key(1), 3)
  total, _ = jax.lax.scan(weighted_sum, jnp.float32(0), epoch)
  assert float(total) == pytest.approx(sum(range(100, 107)) / 2)
  emptied = buffer.clear(jax.tree.map(jnp.copy, state))  # clear donates
  states = jax.tree.map(lambda *xs: jnp.stack(xs), state, emptied)
  both = jax.vmap(jaxbuf.epoch_batches, in_axes=(0, None, None))(states, jax.random.key(2), 3)
  assert np.asarray(both.weights.sum(axis=(1, 2))).tolist() == [7.0, 0.0]


def _learn_and_skip(buffer, gradient_steps, reward=lambda items: items.reward):
  """A learning branch as in DQN: `gradient_steps` samples and priority
  updates in a scan (several learner steps per env step), and a skip."""

  def learn(state, key):
    def one(state, key):
      batch = buffer.sample(state, key, 4)
      state = buffer.update_priorities(
        state, batch.indices, reward(batch.items) - 10.0, batch.item_ids
      )
      return state, reward(batch.items).sum()

    state, losses = jax.lax.scan(one, state, jax.random.split(key, gradient_steps))
    return state, losses.sum()

  def skip(state, key):
    del key
    return state, jnp.zeros((), jnp.float32)

  return learn, skip


def test_cond_update_equals_lax_cond_under_vmap(kind):
  buffer, state = fresh(kind)
  learn, skip = _learn_and_skip(buffer, 2)
  states = jax.tree.map(
    lambda *xs: jnp.stack(xs),
    *[buffer.add(buffer.init(example_item()), make_items(10 * b, 5)) for b in range(3)],
  )
  state = buffer.add(state, make_items(0, 5))
  keys = jax.random.split(jax.random.key(15), 3)
  learning = jnp.array([True, False, True])
  ours = jax.jit(jax.vmap(lambda p, s, k: jaxbuf.cond_update(p, learn, skip, s, k)))(
    learning, states, keys
  )
  theirs = jax.vmap(lambda p, s, k: jax.lax.cond(p, learn, skip, s, k))(learning, states, keys)
  chex.assert_trees_all_equal(ours, theirs)
  for predicate in (True, False):  # unbatched predicate: a real branch
    chex.assert_trees_all_equal(
      jaxbuf.cond_update(predicate, learn, skip, state, keys[0]),
      jax.lax.cond(predicate, learn, skip, state, keys[0]),
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads the CPU compiler's program text")
@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_cond_update_keeps_the_storage_out_of_the_select(kind):
  """Learning gated per seed (vmapped predicate), with two gradient steps in
  a scan: after the loop, lax.cond selects the prioritized storage
  f32[4,2047,...] (a copy of every seed's buffer per step; XLA cannot see
  that the loop returns it unchanged); cond_update selects and copies
  nothing of that size. (Uniform replay's identity update lets JAX forward
  the storage itself.) Read from the compiled program; capacity 2047 so
  that no other array has the storage's shape."""
  buffer = jaxbuf.uniform_replay(2047) if kind == "uniform" else jaxbuf.prioritized_replay(2047)
  item = {"obs": jnp.zeros(16, jnp.float32), "reward": jnp.float32(0)}
  states = jax.tree.map(lambda x: jnp.stack([x] * 4), buffer.init(item))
  learn, skip = _learn_and_skip(
    buffer, 2, reward=lambda items: items["reward"] + items["obs"].sum(-1)
  )

  def copies_of_storage(cond):
    def step(states, items, keys, learning):
      states = jax.vmap(buffer.add)(states, items)
      return jax.vmap(lambda p, s, k: cond(p, learn, skip, s, k))(learning, states, keys)

    text = (
      jax.jit(step, donate_argnums=0)
      .lower(
        states,
        {"obs": jnp.ones((4, 8, 16), jnp.float32), "reward": jnp.ones((4, 8), jnp.float32)},
        jax.random.split(jax.random.key(0), 4),
        jnp.array([True, False, True, True]),
      )
      .compile()
      .as_text()
    )
    storage = r"= f32\[4,2047(,16)?\]\{[^}]*\} "
    return [
      line
      for line in text.splitlines()
      if re.search(storage + r"(select|copy)\(", line)
      or re.search(r"select\S* " + storage + r"fusion\(", line)
    ]

  if kind == "prioritized":
    assert copies_of_storage(jax.lax.cond)  # the trap, so the test can fail
  assert not copies_of_storage(jaxbuf.cond_update)


def test_cond_update_refuses_a_branch_that_writes_the_storage(kind):
  buffer, state = fresh(kind)
  add = lambda s: buffer.add(s, make_items(0, 2))
  with pytest.raises(
    ValueError,
    match=r"true_fun returns output.*storage.*add "
    "outside the cond",
  ):
    jaxbuf.cond_update(True, add, lambda s: s, state)
  with pytest.raises(TypeError):  # branches that differ: lax.cond's message
    jaxbuf.cond_update(True, lambda s: s.size, lambda s: s.size * 1.0, state)
