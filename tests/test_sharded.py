"""`jaxbuf.sharded`: one replay buffer split over the 4 fake CPU devices."""

import functools
from typing import NamedTuple

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jaxbuf
from tests import devices

devices.skip_module_unless(4)

D = 4
CAPACITY = 32  # 8 slots per device
LOCAL = CAPACITY // D
ALPHA, BETA, EPS = 0.7, 0.5, 1e-6
AUTO = jax.sharding.AxisType.Auto
P = jax.sharding.PartitionSpec
COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "collective-permute",
  "all-to-all",
  "reduce-scatter",
  "ragged-all-to-all",
)


def example_item():
  return {"obs": jnp.zeros(3, jnp.float32), "action": jnp.int32(0)}


def make_items(start, count):
  serial = np.arange(start, start + count)
  return {
    "obs": np.repeat(serial[:, None], 3, axis=1).astype(np.float32),
    "action": serial.astype(np.int32),
  }


def base(kind, **settings):
  if kind == "uniform":
    return jaxbuf.uniform_replay(CAPACITY)
  return jaxbuf.prioritized_replay(CAPACITY, alpha=ALPHA, beta=BETA, eps=EPS, **settings)


# One device's part as an unsharded buffer; made once, so each shape compiles once.
LOCAL_BUFFERS = {
  "uniform": jaxbuf.uniform_replay(LOCAL),
  "prioritized": jaxbuf.prioritized_replay(LOCAL, alpha=ALPHA, beta=BETA, eps=EPS),
}


def local_buffer(kind):
  return LOCAL_BUFFERS[kind]


MESH = jax.make_mesh((D,), ("data",))  # Explicit axes, the jax 0.10 default
AUTO_MESH = jax.make_mesh((D,), ("data",), axis_types=(AUTO,))
# Made once per setting: each new buffer compiles afresh.
BUFFERS = {
  (kind, sampling, batch): jaxbuf.sharded(base(kind), MESH, sampling=sampling, batch=batch)
  for kind in ("uniform", "prioritized")
  for sampling in ("global", "local")
  for batch in ("sharded", "replicated")
}


def contents(state):
  """A state's arrays and their structure, without the settings it records
  (a local buffer's differ from the sharded buffer's: capacity, devices)."""
  return state.replace(settings=())


def stacked(states):
  """D local states as one sharded state (what the sharded init lays out),
  recording no settings, so any sharded buffer of its kind accepts it."""
  stack = contents(jax.tree.map(lambda *xs: jnp.stack(xs), *states))
  return jax.device_put(stack, jax.sharding.NamedSharding(MESH, P("data")))


def uneven_state(kind, fills=(5, 0, 8, 3), seed=0):
  """Per-device fills and priorities no sharded add would produce alone."""
  rng = np.random.default_rng(seed)
  buffer = local_buffer(kind)
  states, serial = [], 0
  for fill in fills:
    state = buffer.init(example_item())
    if fill:
      # More than fit, so the ring has wrapped on a full device.
      count = fill + (3 if fill == LOCAL else 0)
      state = buffer.add(state, make_items(serial, count))
      serial += count
      if kind == "prioritized":
        state = buffer.update_priorities(
          state, jnp.arange(fill), jnp.asarray(rng.gamma(0.5, 2.0, fill), jnp.float32)
        )
    states.append(state)
  # The sharded buffers of `kind` record these settings (stratified, which
  # only shapes a sample, is not among them).
  settings = jaxbuf.sharded(base(kind), MESH).kind.settings
  return stacked(states).replace(settings=settings)


def expected_probabilities(kind, state):
  """P(global slot) for one unsharded buffer holding the same items."""
  sizes = np.asarray(state.size)
  held = (np.arange(LOCAL)[None, :] < sizes[:, None]).reshape(-1)
  if kind == "uniform":
    return held / held.sum()
  leaves = np.asarray(state.sum_tree.levels[0], np.float64)[:, :LOCAL].reshape(-1)
  return np.where(held, leaves, 0) / leaves[held].sum()


def draw_many(buffer, state, key, batch_size, batches):
  keys = jax.random.split(key, batches)
  return jax.jit(lambda s, ks: jax.lax.map(lambda k: buffer.sample(s, k, batch_size), ks))(
    state, keys
  )


def chi_square_p(counts, probabilities):
  held = probabilities > 0
  assert counts[~held].sum() == 0, "an empty slot was sampled"
  expected = probabilities[held] / probabilities[held].sum() * counts.sum()
  return scipy.stats.chisquare(counts[held], expected).pvalue


# --- Layout and local adds --------------------------------------------------------


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_state_is_the_stack_of_the_devices_local_states(kind):
  buffer = BUFFERS[(kind, "global", "sharded")]
  state = buffer.init(example_item())
  assert state.storage["obs"].shape == (D, LOCAL, 3)
  for leaf in jax.tree.leaves(state):
    assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(MESH, P("data")), leaf.ndim)
    assert [s.data.shape[0] for s in leaf.addressable_shards] == [1] * D
  reference = [local_buffer(kind).init(example_item()) for _ in range(D)]
  for step in range(5):  # 5 * 8 rows: each device's ring wraps
    items = make_items(8 * step, 8)
    state = buffer.add(state, items)
    reference = [
      local_buffer(kind).add(reference[d], jax.tree.map(lambda x: x[2 * d : 2 * d + 2], items))
      for d in range(D)
    ]
  chex.assert_trees_all_equal(jax.device_get(contents(state)), jax.device_get(stacked(reference)))


@pytest.mark.parametrize("mesh", [MESH, AUTO_MESH], ids=["explicit", "auto"])
@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_add_moves_nothing_between_devices(kind, mesh):
  buffer = jaxbuf.sharded(base(kind), mesh)
  state = buffer.init(example_item())
  items = make_items(0, 8)
  hlo = jax.jit(buffer.add).lower(state, items).compile().as_text()
  for name in COLLECTIVES:
    assert name not in hlo, name
  # Items already split over the axis: each device's rows are its block.
  placed = jax.device_put(items, jax.sharding.NamedSharding(mesh, P("data")))
  state = buffer.add(state, placed)
  np.testing.assert_array_equal(
    np.asarray(state.storage["action"])[:, :2], np.arange(8).reshape(D, 2)
  )


# --- Exact global sampling --------------------------------------------------------


@pytest.mark.parametrize(
  "kind, stratified", [("uniform", None), ("prioritized", True), ("prioritized", False)]
)
def test_global_sampling_matches_one_unsharded_buffer(kind, stratified):
  """Chi-square over uneven per-device fills and priorities; p > 1e-3."""
  buffer = jaxbuf.sharded(
    base(kind, **({} if kind == "uniform" else {"stratified": stratified})), MESH
  )
  state = uneven_state(kind)
  probabilities = expected_probabilities(kind, state)
  samples = draw_many(buffer, state, jax.random.key(3), 32, 400)
  indices = np.asarray(samples.indices).reshape(-1)
  counts = np.bincount(indices, minlength=CAPACITY)
  assert chi_square_p(counts, probabilities) > 1e-3
  # Rows, item ids and weights are those of the slots drawn.
  storage = np.asarray(state.storage["action"]).reshape(-1)
  np.testing.assert_array_equal(np.asarray(samples.items["action"]).reshape(-1), storage[indices])
  if kind == "prioritized":
    held = int(np.asarray(state.size).sum())
    weights = (held * probabilities[np.asarray(samples.indices)]) ** -BETA
    weights /= weights.max(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(samples.weights), weights, rtol=1e-5)


def test_each_devices_block_of_a_stratified_batch_is_a_fair_sample():
  """Rotated strata: device d's rows are drawn from the whole distribution.

  In stratum order, block d of a sharded batch would always come from the
  d-th quarter of the global total, mostly device d's own items.
  """
  buffer = jaxbuf.sharded(base("prioritized", stratified=True), MESH)
  state = uneven_state("prioritized")
  probabilities = expected_probabilities("prioritized", state)
  samples = draw_many(buffer, state, jax.random.key(5), 32, 2000)
  blocks = np.asarray(samples.indices).reshape(2000, D, 32 // D)
  for d in range(D):
    # One row per batch: the rows of one batch come from neighbouring
    # strata, so they are not independent draws, but batches are.
    counts = np.bincount(blocks[:, d, 0], minlength=CAPACITY)
    assert chi_square_p(counts, probabilities) > 1e-3, d


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_sharded_and_replicated_batches_are_the_same_batch(kind):
  state = uneven_state(kind)
  key = jax.random.key(4)
  split = BUFFERS[(kind, "global", "sharded")].sample(state, key, 8)
  whole = BUFFERS[(kind, "global", "replicated")].sample(state, key, 8)
  chex.assert_trees_all_equal(jax.device_get(split), jax.device_get(whole))
  rows = split.items["obs"]
  assert rows.sharding.is_equivalent_to(jax.sharding.NamedSharding(MESH, P("data")), 2)
  for shard in rows.addressable_shards:  # device d holds rows [2d, 2d + 2)
    d = shard.device.id
    np.testing.assert_array_equal(shard.data, np.asarray(rows)[2 * d : 2 * d + 2])
  assert whole.items["obs"].sharding.is_fully_replicated


def test_items_travel_bit_exact():
  item = {
    "f": jnp.float32(0),
    "h": jnp.float16(0),
    "b": jnp.bool_(False),
    "i": jnp.int8(0),
    "u": jnp.uint16(0),
  }
  values = {
    "f": np.array([-0.0, np.nan, np.inf, 1e-45] * 2, np.float32),
    "h": np.array([-0.0, 1, 2, 3] * 2, np.float16),
    "b": np.array([True, False] * 4),
    "i": np.arange(-4, 4, dtype=np.int8),
    "u": np.arange(65528, 65536, dtype=np.uint16),
  }
  values["f"][1] = np.frombuffer(np.uint32(0x7FC12345).tobytes(), np.float32)[0]
  for batch in ("sharded", "replicated"):
    buffer = jaxbuf.sharded(jaxbuf.uniform_replay(8), MESH, batch=batch)
    state = buffer.add(buffer.init(item), values)
    got = buffer.sample(state, jax.random.key(0), 16)
    for name, column in values.items():
      want = column.reshape(D, 2)[np.asarray(got.indices) // 2, np.asarray(got.indices) % 2]
      np.testing.assert_array_equal(np.asarray(got.items[name]).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_empty_and_all_zero_priorities(kind):
  buffer = BUFFERS[(kind, "global", "sharded")]
  empty = buffer.init(example_item())
  got = buffer.sample(empty, jax.random.key(0), 8)
  np.testing.assert_array_equal(np.asarray(got.weights), 0)
  np.testing.assert_array_equal(np.asarray(got.indices), 0)
  assert not buffer.can_sample(empty, 4)
  if kind == "prioritized":  # every leaf underflows: uniform over items held
    state = uneven_state(kind)
    state = state.replace(sum_tree=jax.tree.map(jnp.zeros_like, state.sum_tree))
    samples = draw_many(buffer, state, jax.random.key(1), 32, 200)
    counts = np.bincount(np.asarray(samples.indices).reshape(-1), minlength=CAPACITY)
    assert chi_square_p(counts, expected_probabilities("uniform", state)) > 1e-3
    np.testing.assert_array_equal(np.asarray(samples.weights), 1)


# --- Local sampling -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_local_sampling_draws_each_block_from_its_own_device(kind):
  buffer = BUFFERS[(kind, "local", "sharded")]
  state = uneven_state(kind, fills=(5, 2, 8, 3))
  samples = draw_many(buffer, state, jax.random.key(5), 32, 200)
  indices = np.asarray(samples.indices)  # [200, 32]
  owner = indices // LOCAL
  np.testing.assert_array_equal(owner, np.repeat(np.arange(D), 8)[None, :] + 0 * owner)
  # Every device holds an item: any batch can be drawn (with replacement).
  assert buffer.can_sample(state, 8) and buffer.can_sample(state, 12)
  assert not buffer.can_sample(uneven_state(kind, fills=(5, 0, 8, 3)), 8)
  probabilities = expected_probabilities(kind, state).reshape(D, LOCAL)
  for d in range(D):  # within a device: its own distribution
    counts = np.bincount(indices[:, 8 * d : 8 * d + 8].reshape(-1) - d * LOCAL, minlength=LOCAL)
    assert chi_square_p(counts, probabilities[d] / probabilities[d].sum()) > 1e-3


# --- Priority updates routed to their owners ----------------------------------------


class Reference:
  """A NumPy model of D local rings behind global slots."""

  def __init__(self):
    self.size = np.zeros(D, int)
    self.position = np.zeros(D, int)
    self.count = np.zeros(D, int)
    self.ids = np.zeros((D, LOCAL), np.uint32)
    self.leaves = np.zeros((D, LOCAL))
    self.max_priority = 1.0

  def add(self, batch):
    for d in range(D):
      for _ in range(batch // D):
        slot = self.position[d]
        self.ids[d, slot] = self.count[d]
        self.leaves[d, slot] = self.max_priority**ALPHA
        self.position[d] = (slot + 1) % LOCAL
        self.count[d] += 1
        self.size[d] = min(self.size[d] + 1, LOCAL)

  def update(self, indices, priorities, item_ids):
    for index, priority, item_id in zip(indices, priorities, item_ids):
      d, slot = divmod(int(index), LOCAL)
      if not (
        0 <= index < CAPACITY
        and slot < self.size[d]
        and np.isfinite(priority)
        and priority >= 0
        and self.ids[d, slot] == item_id
      ):
        continue
      self.leaves[d, slot] = (np.float32(priority) + EPS) ** ALPHA
      self.max_priority = max(self.max_priority, float(np.float32(priority) + EPS))


OPERATIONS = st.lists(
  st.one_of(
    st.tuples(st.just("add"), st.sampled_from([4, 8, 12])),
    st.tuples(
      st.just("update"),
      st.lists(
        st.tuples(
          st.integers(-2, CAPACITY + 2),
          st.sampled_from([0.0, 0.5, 2.0, 7.0, np.nan, -1.0, np.inf]),
          st.booleans(),
        ),
        min_size=8,
        max_size=8,
      ),
    ),
  ),
  min_size=1,
  max_size=8,
)


@hypothesis.settings(max_examples=15)
@hypothesis.given(OPERATIONS)
def test_updates_reach_their_owner_as_in_a_numpy_model(operations):
  buffer = BUFFERS[("prioritized", "global", "sharded")]
  state = buffer.init(example_item())
  model = Reference()
  serial = 0
  for name, argument in operations:
    if name == "add":
      state = buffer.add(state, make_items(serial, argument))
      model.add(argument)
      serial += argument
    else:
      indices = np.array([i for i, _, _ in argument], np.int32)
      priorities = np.array([p for _, p, _ in argument], np.float32)
      # Half the updates carry the slot's current item id, half a stale one.
      d, slot = np.divmod(np.clip(indices, 0, CAPACITY - 1), LOCAL)
      ids = model.ids[d, slot] + np.array(
        [0 if fresh else 1 for _, _, fresh in argument], np.uint32
      )
      state = buffer.update_priorities(state, indices, priorities, ids)
      model.update(indices, priorities, ids)
  leaves = np.asarray(state.sum_tree.levels[0])[:, :LOCAL]
  held = np.arange(LOCAL)[None, :] < model.size[:, None]
  np.testing.assert_allclose(np.where(held, leaves, 0), np.where(held, model.leaves, 0), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state.max_priority), model.max_priority, rtol=1e-6)
  totals = np.asarray(state.sum_tree.levels[-1])[:, 0]
  np.testing.assert_allclose(totals, leaves.sum(axis=1), rtol=1e-5)


def test_update_from_a_sharded_sample_round_trips():
  buffer = BUFFERS[("prioritized", "global", "sharded")]
  state = buffer.add(buffer.init(example_item()), make_items(0, 16))
  sample = buffer.sample(state, jax.random.key(2), 8)
  state = buffer.update_priorities(
    state, sample.indices, jnp.arange(8, dtype=jnp.float32) + 10, sample.item_ids
  )
  leaves = np.asarray(state.sum_tree.levels[0])[:, :LOCAL].reshape(-1)
  indices = np.asarray(sample.indices)
  last = {int(i): 10.0 + n for n, i in enumerate(indices)}
  for index, priority in last.items():
    np.testing.assert_allclose(leaves[index], (priority + EPS) ** ALPHA, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(state.max_priority), 17 + EPS)


# --- Composition: jit with donation, scan, cond, no retrace -------------------------


def add_sample_update(buffer, state, items, key, batch_size=8):
  """One collect-and-learn step: add, sample, and (behind a `lax.cond` on
  `can_sample`) update the sampled priorities."""
  state = buffer.add(state, items)
  sample = buffer.sample(state, key, batch_size)
  state = jax.lax.cond(
    buffer.can_sample(state, batch_size),
    lambda s: buffer.update_priorities(s, sample.indices, sample.weights + 1, sample.item_ids),
    lambda s: s,
    state,
  )
  return state, sample


@pytest.mark.parametrize(
  "kind, batch, mesh",
  [
    ("uniform", "sharded", MESH),
    ("uniform", "replicated", AUTO_MESH),
    ("prioritized", "replicated", MESH),
    ("prioritized", "sharded", AUTO_MESH),
  ],
  ids=[
    "uniform-sharded-explicit",
    "uniform-replicated-auto",
    "prioritized-replicated-explicit",
    "prioritized-sharded-auto",
  ],
)
def test_inside_a_jitted_scan_with_donation_and_no_retrace(kind, batch, mesh):
  buffer = jaxbuf.sharded(base(kind), mesh, batch=batch)
  chex.clear_trace_counter()  # counts by code location, across parameters

  @chex.assert_max_traces(n=1)
  def steps(state, items, key):
    def step(state, inputs):
      state, sample = add_sample_update(buffer, state, *inputs)
      return state, sample.indices

    return jax.lax.scan(step, state, (items, jax.random.split(key, 3)))

  donated = jax.jit(steps, donate_argnums=0)
  items = jax.tree.map(lambda x: x.reshape(3, 4, *x.shape[1:]), make_items(0, 12))
  state = buffer.init(example_item())
  state, indices = donated(state, items, jax.random.key(0))
  state, _ = donated(state, items, jax.random.key(1))
  assert indices.shape == (3, 8)
  np.testing.assert_array_equal(np.asarray(state.size), 6)
  # Every index drawn points at an item held (6 per device after 2 calls).
  assert np.all(np.asarray(indices) % LOCAL < 3)


@pytest.mark.parametrize("mesh", [MESH, AUTO_MESH], ids=["explicit", "auto"])
def test_vmap_over_many_sharded_states_matches_one_at_a_time(mesh):
  buffer = jaxbuf.sharded(base("prioritized"), mesh)
  keys = jax.random.split(jax.random.key(7), 3)
  items = jax.tree.map(lambda x: x.reshape(3, 8, *x.shape[1:]), make_items(0, 24))

  def step(state, items, key):
    state = buffer.add(state, items)
    sample = buffer.sample(state, key, 8)
    return buffer.update_priorities(
      state, sample.indices, sample.indices.astype(jnp.float32), sample.item_ids
    ), sample

  states = jax.vmap(lambda _: buffer.init(example_item()))(jnp.arange(3))
  states, samples = jax.jit(jax.vmap(step))(states, items, keys)
  assert states.storage["obs"].shape == (3, D, LOCAL, 3)
  for v in range(3):
    state, sample = jax.jit(step)(
      buffer.init(example_item()), jax.tree.map(lambda x: x[v], items), keys[v]
    )
    chex.assert_trees_all_equal(
      jax.device_get(jax.tree.map(lambda x: x[v], (states, samples))),
      jax.device_get((state, sample)),
    )


# --- Bad input ----------------------------------------------------------------------


def test_bad_settings_raise():
  with pytest.raises(ValueError, match="capacity 30 does not divide by the 4"):
    jaxbuf.sharded(jaxbuf.uniform_replay(30), MESH)
  with pytest.raises(ValueError, match="axis 'model' is not an axis"):
    jaxbuf.sharded(jaxbuf.uniform_replay(32), MESH, axis="model")
  with pytest.raises(ValueError, match="sampling must be one of"):
    jaxbuf.sharded(jaxbuf.uniform_replay(32), MESH, sampling="nearby")
  with pytest.raises(ValueError, match="batch must be one of"):
    jaxbuf.sharded(jaxbuf.uniform_replay(32), MESH, batch="split")
  with pytest.raises(ValueError, match="checked buffers"):
    jaxbuf.sharded(jaxbuf.uniform_replay(32, checked=True), MESH)
  with pytest.raises(TypeError, match="must be a jaxbuf.Buffer, given Rollout"):
    jaxbuf.sharded(jaxbuf.rollout_buffer(num_steps=4, num_envs=4), MESH)
  with pytest.raises(
    TypeError,
    match=r"kind \(unknown\) cannot be split "
    "over devices",
  ):
    jaxbuf.sharded(jaxbuf.Buffer(*[example_item] * 6), MESH)


def snapshot(state):
  return jax.tree.map(lambda x: np.asarray(x).copy(), state)


@pytest.mark.parametrize(
  "call, error, words",
  [
    (lambda b, s: b.add(s, make_items(0, 6)), ValueError, ["add batch B 6", "4 devices"]),
    (
      lambda b, s: b.add(s, {"obs": np.zeros((8, 2), np.float32), "action": np.zeros(8, np.int32)}),
      ValueError,
      ["['obs']"],
    ),
    (lambda b, s: b.sample(s, jax.random.key(0), 6), ValueError, ["batch_size 6"]),
    (lambda b, s: b.can_sample(s, 6), ValueError, ["batch_size 6"]),
    (
      lambda b, s: b.sample(
        jaxbuf.prioritized_replay(32).init(example_item()), jax.random.key(0), 8
      ),
      ValueError,
      ["expected a sharded state"],
    ),
    (
      lambda b, s: b.update_priorities(s, np.zeros(4, np.int32), np.zeros(5, np.float32)),
      ValueError,
      ["update_priorities"],
    ),
    (
      lambda b, s: PLAIN.sample(s, jax.random.key(0), 8),
      TypeError,
      ["sample", "stack of 4 states", "jaxbuf.sharded"],
    ),
    (lambda b, s: PLAIN.add(s, make_items(0, 4)), TypeError, ["add", "stack of 4 states"]),
    (
      lambda b, s: PLAIN.update_priorities(s, np.zeros(4, np.int32), np.ones(4, np.float32)),
      TypeError,
      ["update_priorities", "stack of 4 states"],
    ),
    (
      lambda b, s: PLAIN.update_priorities(
        PLAIN.add(PLAIN.init(example_item()), make_items(0, 8)),
        b.sample(s, jax.random.key(0), 8).indices,
        np.ones(8, np.float32),
      ),
      TypeError,
      ["update_priorities", "spread over 4 devices", "sharded buffer's sample"],
    ),
  ],
  ids=[
    "add-batch",
    "add-leaf",
    "sample-batch",
    "can-sample",
    "unsharded",
    "update-shapes",
    "plain-sample-of-sharded-state",
    "plain-add-of-sharded-state",
    "plain-update-of-sharded-state",
    "sharded-indices-to-plain-update",
  ],
)
def test_bad_arguments_raise_and_leave_the_state_intact(call, error, words):
  buffer = BUFFERS[("prioritized", "global", "sharded")]
  state = buffer.add(buffer.init(example_item()), make_items(0, 8))
  before = snapshot(state)
  with pytest.raises(error) as raised:
    call(buffer, state)
  for word in words:
    assert word in str(raised.value)
  chex.assert_trees_all_equal(snapshot(state), before)


PLAIN = base("prioritized")


@pytest.mark.parametrize("mesh", [MESH, AUTO_MESH], ids=["explicit", "auto"])
def test_an_abstract_like_keeps_the_split(tmp_path, mesh):
  """`like=jax.eval_shape(buffer.init, ...)` (no allocation) kept no
  sharding: the state came back on device 0 and the next sample failed
  ("incompatible devices")."""
  buffer = jaxbuf.sharded(base("prioritized"), mesh)
  state = buffer.add(buffer.init(example_item()), make_items(0, 8))
  jaxbuf.save(tmp_path / "abstract", state)
  like = jax.eval_shape(buffer.init, example_item())
  assert all(
    leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data")), leaf.ndim)
    for leaf in jax.tree.leaves(like)
  )
  restored = jaxbuf.load(tmp_path / "abstract", like=like)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  key = jax.random.key(3)
  chex.assert_trees_all_equal(
    jax.device_get(buffer.sample(restored, key, 8)), jax.device_get(buffer.sample(state, key, 8))
  )


def test_minibatches_cut_from_a_sample_under_explicit_axes():
  """Slicing rows of a split batch is a ShardingTypeError under Explicit
  axes; the documented way (reshard whole, or `batch="replicated"`) cuts
  the same rows."""
  buffer = BUFFERS[("prioritized", "global", "sharded")]
  state = buffer.add(buffer.init(example_item()), make_items(0, 8))
  batch = buffer.sample(state, jax.random.key(0), 8)
  with pytest.raises(Exception) as raised:
    batch.indices[:3]  # pylint: disable=pointless-statement
  assert type(raised.value).__name__ == "ShardingTypeError"
  whole = jax.sharding.reshard(batch, jax.sharding.NamedSharding(MESH, P()))
  minibatch = jax.tree.map(lambda x: x[:3], whole)
  np.testing.assert_array_equal(minibatch.indices, np.asarray(batch.indices)[:3])
  in_jit = jax.jit(
    lambda b: jax.tree.map(
      lambda x: x[:3], jax.sharding.reshard(b, jax.sharding.NamedSharding(MESH, P()))
    )
  )(batch)
  chex.assert_trees_all_equal(jax.device_get(in_jit), jax.device_get(minibatch))
  replicated = BUFFERS[("prioritized", "global", "replicated")].sample(state, jax.random.key(0), 8)
  np.testing.assert_array_equal(replicated.indices[:3], minibatch.indices)


def _equal_neighbours(rows):
  return int(np.sum(rows[1:] == rows[:-1]))


def test_global_stratified_rows_come_in_random_order():
  """32 ids of equal mass, 256 draws: in stratum order (rotated or not)
  rows came in strips of 8 of one id (224 equal neighbours), so each
  device's block held 8 ids; in random order about 8. (Items and windows
  share the global draw.)"""
  buffer = jaxbuf.sharded(jaxbuf.prioritized_replay(32), MESH)
  state = buffer.add(buffer.init(example_item()), make_items(0, 32))
  rows = np.asarray(buffer.sample(state, jax.random.key(0), 256).indices)
  assert len(set(rows.tolist())) == 32
  assert _equal_neighbours(rows) < 25, rows[:16]
  for block in rows.reshape(D, -1):
    assert len(set(block.tolist())) > 20


def test_clear_empties_every_device():
  buffer = BUFFERS[("prioritized", "global", "sharded")]
  state = buffer.add(buffer.init(example_item()), make_items(0, 8))
  state = buffer.update_priorities(state, np.array([0, 9]), np.array([5.0, 3.0]))
  state = buffer.clear(state)
  np.testing.assert_array_equal(np.asarray(state.size), 0)
  np.testing.assert_array_equal(np.asarray(state.sum_tree.levels[-1]), 0)
  np.testing.assert_array_equal(np.asarray(state.max_priority), 1)


def test_save_and_load_keep_the_split_bit_exact(tmp_path):
  buffer = BUFFERS[("prioritized", "global", "sharded")]
  state = uneven_state("prioritized")
  jaxbuf.save(tmp_path / "sharded", state)
  restored = jaxbuf.load(tmp_path / "sharded", like=buffer.init(example_item()))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  key = jax.random.key(6)
  chex.assert_trees_all_equal(
    jax.device_get(buffer.sample(restored, key, 8)), jax.device_get(buffer.sample(state, key, 8))
  )


# --- Sequence replay, sharded over envs ---------------------------------------------
#
# 8 envs of 6 steps, 2 envs (12 window ids) per device. Every stored step
# carries its absolute id `env * 1000 + step`, so a window's contiguity and
# origin are read off its values.

SEQ_ENVS, SEQ_PER_ENV, SEQ_LENGTH = 8, 6, 3
SEQ_CAPACITY = SEQ_ENVS * SEQ_PER_ENV
SEQ_WINDOWS = SEQ_ENVS // D * SEQ_PER_ENV  # window ids per device
SEQ_KINDS = [
  (prioritized, episodes) for prioritized in (False, True) for episodes in ("cross", "within")
]
SEQ_IDS = [f"{'prioritized' if p else 'uniform'}-{e}" for p, e in SEQ_KINDS]


def example_step():
  return {"id": jnp.int32(0), "obs": jnp.zeros(2, jnp.float32)}


@functools.cache
def sequence_buffer(prioritized, episodes, period=1):
  """The unsharded buffer; one per setting, so each compiles once."""
  settings = dict(period=period, episodes=episodes)
  if prioritized:
    return jaxbuf.prioritized_sequence_replay(
      SEQ_ENVS, SEQ_CAPACITY, SEQ_LENGTH, alpha=ALPHA, beta=BETA, eps=EPS, **settings
    )
  return jaxbuf.sequence_replay(SEQ_ENVS, SEQ_CAPACITY, SEQ_LENGTH, **settings)


@functools.cache
def sharded_sequence(
  prioritized, episodes, sampling="global", batch="sharded", mesh=MESH, period=1
):
  return jaxbuf.sharded(
    sequence_buffer(prioritized, episodes, period), mesh, sampling=sampling, batch=batch
  )


class StepIds:
  """Per-env step counters: the values an env's next steps carry."""

  def __init__(self):
    self.counts = np.zeros(SEQ_ENVS, np.int64)

  def steps(self, mask, length=None):
    chunk = 1 if length is None else length
    ids = np.arange(SEQ_ENVS)[:, None] * 1000 + self.counts[:, None] + np.arange(chunk)[None, :]
    self.counts += chunk * np.asarray(mask)
    ids = ids[:, 0] if length is None else ids
    return {
      "id": ids.astype(np.int32),
      "obs": np.repeat(ids[..., None], 2, axis=-1).astype(np.float32),
    }


def ragged_adds(seed=0, rounds=6, rates=(0.7, 0.15, 0.5, 1.0)):
  """Adds of single steps and chunks; per-device step rates differ (by
  default device 1 steps rarely, device 3 always) and episodes end at
  random."""
  rng = np.random.default_rng(seed)
  rates = np.repeat(rates, SEQ_ENVS // D)
  ids, adds = StepIds(), []
  for round_ in range(rounds):
    mask = rng.random(SEQ_ENVS) < rates
    length = None if round_ % 2 else 2
    shape = (SEQ_ENVS,) if length is None else (SEQ_ENVS, length)
    adds.append((ids.steps(mask, length), mask, rng.random(shape) < 0.15))
  return adds


def fill(buffer, adds, state=None):
  state = buffer.init(example_step()) if state is None else state
  for steps, mask, episode_end in adds:
    state = buffer.add(state, steps, mask, episode_end)
  return state


def as_unsharded(state):
  """A sharded sequence state's per-env arrays, devices joined: `[N, ...]`."""
  join = lambda x: np.asarray(x).reshape(-1, *np.shape(x)[2:])
  return {
    "storage": jax.tree.map(join, state.storage),
    **{
      name: join(getattr(state, name))
      for name in (
        "episode_ends",
        "write_heads",
        "steps_held",
        "step_counts",
        "period_phases",
        "window_counts",
      )
    },
  }


def tree_leaves(state):
  """Window masses `[N * R]`: the unsharded tree's, or the devices' joined."""
  leaves = np.asarray(state.window_tree.levels[0])
  if leaves.ndim == 1:
    return leaves[:SEQ_CAPACITY]
  return leaves[:, :SEQ_WINDOWS].reshape(-1)


def set_random_priorities(buffers_and_states, seed):
  """The same priority update, from the host, applied to every buffer."""
  rng = np.random.default_rng(seed)
  indices = rng.permutation(SEQ_CAPACITY).astype(np.int32)
  priorities = rng.gamma(0.5, 2.0, SEQ_CAPACITY).astype(np.float32)
  return [
    buffer.update_priorities(state, indices, priorities) for buffer, state in buffers_and_states
  ]


@pytest.mark.parametrize("prioritized, episodes", SEQ_KINDS, ids=SEQ_IDS)
def test_sequence_state_is_the_unsharded_buffer_split_over_envs(prioritized, episodes):
  buffer = sharded_sequence(prioritized, episodes)
  state = fill(buffer, ragged_adds())
  assert state.storage["obs"].shape == (D, SEQ_ENVS // D, SEQ_PER_ENV, 2)
  for leaf in jax.tree.leaves(state):
    assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(MESH, P("data")), leaf.ndim)
  whole = fill(sequence_buffer(prioritized, episodes), ragged_adds())
  chex.assert_trees_all_equal(
    as_unsharded(state), as_unsharded(jax.tree.map(lambda x: x[None], whole))
  )
  window_counts = np.asarray(state.window_counts).sum(axis=1)
  assert window_counts[1] < window_counts[3]  # uneven fills, as meant
  if prioritized or episodes == "within":
    np.testing.assert_array_equal(tree_leaves(state), tree_leaves(whole))


@pytest.mark.parametrize("mesh", [MESH, AUTO_MESH], ids=["explicit", "auto"])
@pytest.mark.parametrize(
  "prioritized, episodes",
  [(False, "cross"), (True, "within")],
  ids=["uniform-cross", "prioritized-within"],
)
def test_sequence_add_moves_nothing_between_devices(prioritized, episodes, mesh):
  buffer = jaxbuf.sharded(sequence_buffer(prioritized, episodes), mesh)
  state = buffer.init(example_step())
  ids = StepIds()
  mask = np.ones(SEQ_ENVS, bool)
  for length, ends in ((None, np.zeros(SEQ_ENVS, bool)), (4, np.zeros((SEQ_ENVS, 4), bool))):
    hlo = jax.jit(buffer.add).lower(state, ids.steps(mask, length), mask, ends).compile().as_text()
    for name in COLLECTIVES:
      assert name not in hlo, name
  # Steps already split over the axis: each device's envs are its block.
  placed = jax.device_put(StepIds().steps(mask), jax.sharding.NamedSharding(mesh, P("data")))
  state = buffer.add(state, placed)
  np.testing.assert_array_equal(
    np.asarray(state.storage["id"])[:, :, 0], (np.arange(SEQ_ENVS) * 1000).reshape(D, -1)
  )


@pytest.mark.parametrize("prioritized, episodes", SEQ_KINDS, ids=SEQ_IDS)
def test_sequence_global_sampling_matches_one_unsharded_buffer(prioritized, episodes):
  """Chi-square of window frequencies against the unsharded buffer's P(window)
  over uneven per-device fills (and priorities); p > 1e-3, fixed seeds."""
  buffer = sharded_sequence(prioritized, episodes)
  whole_buffer = sequence_buffer(prioritized, episodes)
  state, whole = fill(buffer, ragged_adds()), fill(whole_buffer, ragged_adds())
  if prioritized:
    state, whole = set_random_priorities([(buffer, state), (whole_buffer, whole)], seed=1)
  settings = dict(sequence_length=SEQ_LENGTH, period=1, within=episodes == "within")
  window_ids = jnp.arange(SEQ_CAPACITY)
  valid = np.asarray(jaxbuf.sequence.window_ids_valid(whole, window_ids, **settings))
  masses = tree_leaves(whole).astype(np.float64) if prioritized else valid
  probabilities = masses / masses.sum()
  samples = draw_many(buffer, state, jax.random.key(3), 32, 400)
  indices = np.asarray(samples.indices)
  counts = np.bincount(indices.reshape(-1), minlength=SEQ_CAPACITY)
  assert not counts[~valid].any(), "a window that cannot be sampled was drawn"
  assert chi_square_p(counts, probabilities) > 1e-3
  # Rows, masks and item ids are those of the windows drawn, read from the
  # unsharded buffer; windows are contiguous steps of the env their id names.
  flat = indices.reshape(-1)
  items, mask = jaxbuf.sequence.gather_windows(whole, jnp.asarray(flat), sequence_length=SEQ_LENGTH)
  step_ids = np.asarray(samples.items["id"]).reshape(-1, SEQ_LENGTH)
  np.testing.assert_array_equal(step_ids, np.asarray(items["id"]))
  np.testing.assert_array_equal(
    np.asarray(samples.items["obs"]).reshape(-1, SEQ_LENGTH, 2), np.asarray(items["obs"])
  )
  np.testing.assert_array_equal(np.asarray(samples.mask).reshape(-1, SEQ_LENGTH), np.asarray(mask))
  np.testing.assert_array_equal(np.diff(step_ids, axis=1), 1)
  np.testing.assert_array_equal(step_ids[:, 0] // 1000, flat // SEQ_PER_ENV)
  np.testing.assert_array_equal(np.asarray(samples.item_ids).reshape(-1), step_ids[:, 0] % 1000)
  if prioritized:
    held = valid.sum()
    weights = (held * probabilities[indices]) ** -BETA
    weights /= weights.max(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(samples.weights), weights, rtol=1e-5)
  else:
    np.testing.assert_array_equal(np.asarray(samples.weights), 1)
  if episodes == "cross" and not prioritized:
    # Ranked env by env as the unsharded buffer ranks them: the same windows.
    key = jax.random.key(9)
    np.testing.assert_array_equal(
      np.asarray(buffer.sample(state, key, 32).indices),
      np.asarray(whole_buffer.sample(whole, key, 32).indices),
    )


@pytest.mark.parametrize(
  "prioritized, episodes",
  [(False, "within"), (True, "cross")],
  ids=["uniform-within", "prioritized-cross"],
)
def test_sequence_batch_layouts_and_local_sampling(prioritized, episodes):
  state = fill(sharded_sequence(prioritized, episodes), ragged_adds())
  key = jax.random.key(4)
  split = sharded_sequence(prioritized, episodes).sample(state, key, 8)
  whole = sharded_sequence(prioritized, episodes, batch="replicated").sample(state, key, 8)
  chex.assert_trees_all_equal(jax.device_get(split), jax.device_get(whole))
  assert isinstance(split, jaxbuf.SequenceSample)
  assert split.items["obs"].shape == (8, SEQ_LENGTH, 2)
  assert split.mask.sharding.is_equivalent_to(jax.sharding.NamedSharding(MESH, P("data")), 2)
  assert whole.mask.sharding.is_fully_replicated
  # Local: block d (2 windows) from device d's own envs, each window valid;
  # it needs a window on every device.
  local = sharded_sequence(prioritized, episodes, sampling="local")
  assert np.asarray(state.window_counts).sum(axis=1).min() == 0
  assert not local.can_sample(state, 8)
  state = fill(local, ragged_adds(rates=(0.7, 0.5, 0.5, 1.0)))
  assert np.asarray(state.window_counts).sum(axis=1).min() > 0
  assert local.can_sample(state, 8)
  samples = draw_many(local, state, jax.random.key(5), 8, 50)
  owners = np.asarray(samples.indices) // SEQ_WINDOWS
  np.testing.assert_array_equal(owners, np.broadcast_to(np.repeat(np.arange(D), 2), owners.shape))
  step_ids = np.asarray(samples.items["id"])
  np.testing.assert_array_equal(np.diff(step_ids, axis=-1), 1)
  np.testing.assert_array_equal(
    step_ids[..., 0] // 1000, np.asarray(samples.indices) // SEQ_PER_ENV
  )
  empty = local.init(example_step())
  assert not local.can_sample(empty, 8)
  assert not sharded_sequence(prioritized, episodes).can_sample(empty, 8)


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("episodes", ["cross", "within"])
def test_sequence_updates_reach_their_owner_as_in_the_unsharded_buffer(episodes):
  """Host updates with ids out of range, NaN, inf, negative priorities and
  stale item ids, interleaved with ragged adds: the same leaves, maximum and
  beta step as one unsharded buffer given the same calls."""
  buffer, whole_buffer = (sharded_sequence(True, episodes), sequence_buffer(True, episodes))
  state = whole = None
  rng = np.random.default_rng(2)
  adds = ragged_adds(seed=3, rounds=8)
  for round_ in range(4):
    adds_now = adds[2 * round_ : 2 * round_ + 2]
    state = fill(buffer, adds_now, state)
    whole = fill(whole_buffer, adds_now, whole)
    indices = rng.integers(-2, SEQ_CAPACITY + 2, 12)
    priorities = rng.choice([0.0, 0.5, 2.0, 7.0 + round_, np.nan, -3.0, np.inf], 12)
    item_ids = np.asarray(
      jaxbuf.sequence.window_item_ids(
        whole, jnp.asarray(np.clip(indices, 0, SEQ_CAPACITY - 1), jnp.int32)
      )
    )
    item_ids = item_ids + (rng.random(12) < 0.3).astype(np.uint32)  # stale
    state = buffer.update_priorities(state, indices, priorities, item_ids)
    whole = whole_buffer.update_priorities(whole, indices, priorities, item_ids)
  np.testing.assert_array_equal(tree_leaves(state), tree_leaves(whole))
  np.testing.assert_array_equal(np.asarray(state.max_priority), np.asarray(whole.max_priority))
  np.testing.assert_array_equal(np.asarray(state.beta_step), np.asarray(whole.beta_step))
  totals = np.asarray(state.window_tree.levels[-1])[:, 0]
  np.testing.assert_allclose(totals, tree_leaves(state).reshape(D, -1).sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize(
  "prioritized, episodes, batch, mesh",
  [(False, "within", "sharded", MESH), (True, "cross", "replicated", AUTO_MESH)],
  ids=["uniform-within-sharded-explicit", "prioritized-cross-replicated-auto"],
)
def test_sequence_inside_a_jitted_scan_with_donation_and_no_retrace(
  prioritized, episodes, batch, mesh
):
  buffer = sharded_sequence(prioritized, episodes, batch=batch, mesh=mesh)
  chex.clear_trace_counter()

  @chex.assert_max_traces(n=1)
  def steps(state, chunks, key):
    def step(state, inputs):
      state, sample = add_sample_update(buffer, state, *inputs)
      return state, (sample.indices, sample.items["id"])

    return jax.lax.scan(step, state, (chunks, jax.random.split(key, 3)))

  donated = jax.jit(steps, donate_argnums=0)
  ids = StepIds()
  chunks = [ids.steps(np.ones(SEQ_ENVS, bool), 2) for _ in range(6)]
  stack = lambda part: jax.tree.map(lambda *xs: np.stack(xs), *part)
  state = buffer.init(example_step())
  state, _ = donated(state, stack(chunks[:3]), jax.random.key(0))
  state, (indices, step_ids) = donated(state, stack(chunks[3:]), jax.random.key(1))
  assert indices.shape == (3, 8)
  np.testing.assert_array_equal(np.asarray(state.steps_held), SEQ_PER_ENV)
  np.testing.assert_array_equal(np.diff(np.asarray(step_ids), axis=-1), 1)
  np.testing.assert_array_equal(
    np.asarray(step_ids)[..., 0] // 1000, np.asarray(indices) // SEQ_PER_ENV
  )


def test_sequence_vmap_over_many_sharded_states_matches_one_at_a_time():
  buffer = sharded_sequence(True, "cross")
  keys = jax.random.split(jax.random.key(7), 3)
  ids = StepIds()
  chunks = [ids.steps(np.ones(SEQ_ENVS, bool), 4) for _ in range(3)]
  chunks = jax.tree.map(lambda *xs: np.stack(xs), *chunks)

  def step(state, chunk, key):
    state = buffer.add(state, chunk)
    sample = buffer.sample(state, key, 8)
    return buffer.update_priorities(
      state, sample.indices, sample.indices.astype(jnp.float32), sample.item_ids
    ), sample

  states = jax.vmap(lambda _: buffer.init(example_step()))(jnp.arange(3))
  states, samples = jax.jit(jax.vmap(step))(states, chunks, keys)
  assert states.storage["obs"].shape == (3, D, SEQ_ENVS // D, SEQ_PER_ENV, 2)
  for v in range(3):
    state, sample = jax.jit(step)(
      buffer.init(example_step()), jax.tree.map(lambda x: x[v], chunks), keys[v]
    )
    chex.assert_trees_all_equal(
      jax.device_get(jax.tree.map(lambda x: x[v], (states, samples))),
      jax.device_get((state, sample)),
    )


def test_sequence_save_and_load_keep_the_split_bit_exact(tmp_path):
  buffer = sharded_sequence(True, "within")
  state = fill(buffer, ragged_adds())
  (state,) = set_random_priorities([(buffer, state)], seed=4)
  jaxbuf.save(tmp_path / "sequence", state)
  restored = jaxbuf.load(tmp_path / "sequence", like=buffer.init(example_step()))
  assert type(restored) is type(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  key = jax.random.key(6)
  chex.assert_trees_all_equal(
    jax.device_get(buffer.sample(restored, key, 8)), jax.device_get(buffer.sample(state, key, 8))
  )


def test_sequence_num_envs_must_divide_by_the_devices():
  with pytest.raises(
    ValueError,
    match=r"num_envs 6 does not divide by the 4 "
    r"devices.*nearest valid num_envs: 4 or 8, with "
    r"capacity num_envs \* 5",
  ):
    jaxbuf.sharded(jaxbuf.sequence_replay(6, 30, 3), MESH)
  with pytest.raises(ValueError, match="nearest valid num_envs: 4,"):
    jaxbuf.sharded(jaxbuf.prioritized_sequence_replay(2, 8, 2), MESH)
  with pytest.raises(ValueError, match="checked buffers"):
    jaxbuf.sharded(jaxbuf.sequence_replay(8, 48, 3, checked=True), MESH)


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize(
  "call, error, words",
  [
    (
      lambda b, s: b.add(s, {"id": np.zeros(6, np.int32), "obs": np.zeros((6, 2), np.float32)}),
      ValueError,
      ["['id']", "(6,)", f"expected ({SEQ_ENVS},)"],
    ),
    (
      lambda b, s: b.add(
        s, {"id": np.zeros(SEQ_ENVS, np.int32), "obs": np.zeros((SEQ_ENVS, 3), np.float32)}
      ),
      ValueError,
      ["['obs']"],
    ),
    (
      lambda b, s: b.add(s, StepIds().steps(np.ones(SEQ_ENVS, bool)), np.ones(4, bool)),
      ValueError,
      ["mask", f"({SEQ_ENVS},)"],
    ),
    (
      lambda b, s: b.add(
        s, StepIds().steps(np.ones(SEQ_ENVS, bool), 2), None, np.zeros((SEQ_ENVS, 2), np.int32)
      ),
      TypeError,
      ["episode_end", "bool"],
    ),
    (lambda b, s: b.sample(s, jax.random.key(0), 6), ValueError, ["batch_size 6"]),
    (
      lambda b, s: b.sample(
        sequence_buffer(True, "cross").init(example_step()), jax.random.key(0), 8
      ),
      ValueError,
      ["expected a sharded state"],
    ),
    (
      lambda b, s: b.sample(
        BUFFERS[("prioritized", "global", "sharded")].init(example_item()), jax.random.key(0), 8
      ),
      TypeError,
      ["PrioritizedSequenceReplayState"],
    ),
    (
      lambda b, s: b.update_priorities(s, np.zeros(4, np.int32), np.zeros(5, np.float32)),
      ValueError,
      ["update_priorities"],
    ),
    (
      lambda b, s: sequence_buffer(True, "cross").sample(s, jax.random.key(0), 8),
      TypeError,
      ["stack of 4 states"],
    ),
  ],
  ids=[
    "add-num-envs",
    "add-leaf",
    "add-mask",
    "add-episode-end",
    "sample-batch",
    "unsharded",
    "item-state",
    "update-shapes",
    "plain-sample-of-sharded-state",
  ],
)
def test_sequence_bad_arguments_raise_and_leave_the_state_intact(call, error, words):
  buffer = sharded_sequence(True, "cross")
  state = fill(buffer, ragged_adds(rounds=2))
  before = snapshot(state)
  with pytest.raises(error) as raised:
    call(buffer, state)
  for word in words:
    assert word in str(raised.value), str(raised.value)
  chex.assert_trees_all_equal(snapshot(state), before)


# --- One device ------------------------------------------------------------------

ONE_DEVICE_MESH = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])


def no_collectives(compiled_text):
  return not any(f"{op}(" in compiled_text or f"{op}-start(" in compiled_text for op in COLLECTIVES)


@pytest.mark.parametrize(
  "kind", ["uniform", "prioritized", "uniform-sequence", "prioritized-sequence"]
)
@pytest.mark.parametrize("batch", ["sharded", "replicated"])
def test_one_device_gives_the_unsharded_buffers_batches(kind, batch):
  """Over one device, sharded is the plain buffer: same state, same batch for
  the same key, same updates; and no collective in `sample` (sharded batch)
  or `update_priorities`, since XLA:CPU keeps collectives of one participant
  (a rendezvous each)."""
  if kind.endswith("sequence"):
    plain = sequence_buffer(kind.startswith("prioritized"), "cross")
    adds = ragged_adds()
    fill_plain = lambda buffer: fill(buffer, adds)
    batch_size = 8
  else:
    plain = base(kind)
    fill_plain = lambda buffer: buffer.add(
      buffer.add(buffer.init(example_item()), make_items(0, 20)), make_items(20, 17)
    )
    batch_size = 16
  buffer = jaxbuf.sharded(plain, ONE_DEVICE_MESH, batch=batch)
  state, expected = fill_plain(buffer), fill_plain(plain)
  chex.assert_trees_all_equal(
    jax.device_get(contents(jax.tree.map(lambda x: x[0], state))),
    jax.device_get(contents(expected)),
  )
  key = jax.random.key(7)
  drawn, expected_draw = (
    buffer.sample(state, key, batch_size),
    plain.sample(expected, key, batch_size),
  )
  chex.assert_trees_all_equal(jax.device_get(drawn), jax.device_get(expected_draw))
  priorities = jnp.arange(1, batch_size + 1, dtype=jnp.float32)
  state = buffer.update_priorities(state, drawn.indices, priorities, drawn.item_ids)
  expected = plain.update_priorities(
    expected, expected_draw.indices, priorities, expected_draw.item_ids
  )
  chex.assert_trees_all_equal(
    jax.device_get(contents(jax.tree.map(lambda x: x[0], state))),
    jax.device_get(contents(expected)),
  )
  update_text = (
    jax.jit(buffer.update_priorities)
    .lower(state, drawn.indices, priorities, drawn.item_ids)
    .compile()
    .as_text()
  )
  assert no_collectives(update_text)
  if batch == "sharded":
    sample_text = (
      jax.jit(lambda s, k: buffer.sample(s, k, batch_size)).lower(state, key).compile().as_text()
    )
    assert no_collectives(sample_text)


@pytest.mark.parametrize("kind", ["prioritized", "prioritized-sequence"])
def test_updates_pass_the_storage_through_for_cond_update(kind):
  """A learner step (sample + update) of a sharded buffer inside
  `jaxbuf.cond_update`: the storage is recognised as passed through (no
  ValueError), and the result is `lax.cond`'s."""
  if kind == "prioritized":
    buffer = BUFFERS[("prioritized", "global", "sharded")]
    state = buffer.add(buffer.init(example_item()), make_items(0, 20))
  else:
    buffer = sharded_sequence(True, "cross")
    state = fill(buffer, ragged_adds())

  def learn(state, key):
    batch = buffer.sample(state, key, 8)
    return buffer.update_priorities(state, batch.indices, jnp.arange(1.0, 9.0), batch.item_ids)

  def skip(state, key):
    del key
    return state

  key = jax.random.key(2)
  for learning in (True, False):
    chex.assert_trees_all_equal(
      jax.device_get(
        jax.jit(lambda s, k: jaxbuf.cond_update(learning, learn, skip, s, k))(state, key)
      ),
      jax.device_get(jax.jit(lambda s, k: jax.lax.cond(learning, learn, skip, s, k))(state, key)),
    )


# --- Resharding on load (issue 23) -----------------------------------------------

TWO_DEVICE_MESH = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])


def held_items_and_leaves(state):
  """{action: (obs row, leaf or None)} of every item an item state holds,
  stacked or not: what must survive a regrouping exactly."""
  size = np.asarray(state.size).reshape(-1)
  obs = np.asarray(state.storage["obs"]).reshape(size.shape[0], -1, 3)
  actions = np.asarray(state.storage["action"]).reshape(size.shape[0], -1)
  leaves = None
  if hasattr(state, "sum_tree"):
    leaves = np.asarray(state.sum_tree.levels[0]).reshape(size.shape[0], -1)
  held = {}
  for device, count in enumerate(size):
    for slot in range(count):
      leaf = None if leaves is None else float(leaves[device, slot])
      held[int(actions[device, slot])] = (obs[device, slot].tolist(), leaf)
  return held


def item_probabilities(held):
  leaves = {action: leaf for action, (_, leaf) in held.items()}
  if None in leaves.values():
    return {action: 1 / len(leaves) for action in leaves}
  total = sum(leaves.values())
  return {action: leaf / total for action, leaf in leaves.items()}


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_item_checkpoints_reshard_exactly_between_device_counts(kind, tmp_path):
  four = BUFFERS[(kind, "global", "sharded")]
  state = four.init(example_item())
  for start in range(0, 44, 4):  # 44 items in a capacity of 32: wrapped
    state = four.add(state, make_items(start, 4))
    drawn = four.sample(state, jax.random.key(start), 4)
    state = four.update_priorities(
      state, drawn.indices, jnp.arange(1.0, 5.0) * (start + 1), drawn.item_ids
    )
  jaxbuf.save(tmp_path / "four", state)
  held = held_items_and_leaves(state)
  assert len(held) == CAPACITY

  targets = {
    "unsharded": base(kind),
    "two": jaxbuf.sharded(base(kind), TWO_DEVICE_MESH),
    "one": jaxbuf.sharded(base(kind), ONE_DEVICE_MESH),
    "four": four,
  }
  for name, buffer in targets.items():
    like = buffer.init(example_item())
    restored = jaxbuf.load(tmp_path / "four", like=like)
    assert restored.settings == like.settings, name
    assert held_items_and_leaves(restored) == held, name
    if kind == "prioritized":
      np.testing.assert_array_equal(np.max(restored.max_priority), np.max(state.max_priority))
      np.testing.assert_array_equal(np.ravel(restored.beta_step)[0], np.ravel(state.beta_step)[0])
    # It is a working state of its buffer: sample, update, add, and draw in
    # proportion to the same leaves.
    drawn = buffer.sample(restored, jax.random.key(1), 8)
    assert set(np.asarray(drawn.items["action"]).tolist()) <= set(held)
    restored = buffer.update_priorities(restored, drawn.indices, jnp.ones(8), drawn.item_ids)
    restored = buffer.add(restored, make_items(100, 4))
    assert int(np.sum(restored.size)) == CAPACITY
    # Saved again and loaded back over four devices: the same items.
    jaxbuf.save(tmp_path / name, restored)
    back = jaxbuf.load(tmp_path / name, like=four.init(example_item()))
    assert held_items_and_leaves(back) == held_items_and_leaves(restored)


def test_item_regrouping_keeps_the_sampling_distribution(tmp_path):
  four = BUFFERS[("prioritized", "global", "sharded")]
  state = uneven_priorities_state(four)
  jaxbuf.save(tmp_path / "four", state)
  plain = base("prioritized")
  restored = jaxbuf.load(tmp_path / "four", like=plain.init(example_item()))
  expected = item_probabilities(held_items_and_leaves(state))
  assert item_probabilities(held_items_and_leaves(restored)) == pytest.approx(expected, rel=1e-6)
  counts = np.zeros(CAPACITY + 100)
  batches = draw_many(plain, restored, jax.random.key(3), 64, 200)
  np.add.at(counts, np.asarray(batches.items["action"]).reshape(-1), 1)
  probabilities = np.zeros_like(counts)
  for action, probability in expected.items():
    probabilities[action] = probability
  assert chi_square_p(counts, probabilities) > 1e-3


def uneven_priorities_state(buffer):
  state = buffer.add(buffer.init(example_item()), make_items(0, 24))
  indices = jnp.arange(0, 32, dtype=jnp.int32)
  return buffer.update_priorities(state, indices, (jnp.arange(32.0) % 7) ** 2 + 0.5)


def test_an_unsharded_ring_that_does_not_split_evenly_says_why(tmp_path):
  plain = base("prioritized")
  state = plain.add(plain.init(example_item()), make_items(0, 5))
  jaxbuf.save(tmp_path / "five", state)
  like = BUFFERS[("prioritized", "global", "sharded")].init(example_item())
  with pytest.raises(ValueError, match="holds 5 items, which do not split evenly over 4 devices"):
    jaxbuf.load(tmp_path / "five", like=like)
  plain = base("prioritized")
  state = plain.add(plain.init(example_item()), make_items(0, 8))
  jaxbuf.save(tmp_path / "eight", state)
  restored = jaxbuf.load(tmp_path / "eight", like=like)
  assert held_items_and_leaves(restored) == held_items_and_leaves(state)


def test_a_sharded_checkpoint_of_another_capacity_names_the_capacity(tmp_path):
  """Into a plain state of another capacity, the error spoke of stacks of
  states "as made under jax.vmap" to a user who never vmapped."""
  sharded = BUFFERS[("prioritized", "global", "sharded")]
  jaxbuf.save(tmp_path / "sharded", sharded.add(sharded.init(example_item()), make_items(0, 8)))
  like = jaxbuf.prioritized_replay(2 * CAPACITY).init(example_item())
  with pytest.raises(
    ValueError, match=(rf"capacity: the checkpoint has {CAPACITY}, `like` has {2 * CAPACITY}")
  ) as raised:
    jaxbuf.load(tmp_path / "sharded", like=like)
  assert "vmap" not in str(raised.value)
  assert int(like.add_count) == 0  # `like` untouched, still usable
  restored = jaxbuf.load(tmp_path / "sharded", like=base("prioritized").init(example_item()))
  assert int(restored.add_count) == 8


def test_a_regrouped_ring_keeps_its_add_count(tmp_path):
  """9 items in a ring of 8 over 2 devices and back: add_count stays 9 (it
  came back as 8, so offline export took the partly overwritten oldest
  episode for a whole one); the devices count 5 and 4."""
  plain = jaxbuf.prioritized_replay(8)
  state = plain.add(plain.init(example_item()), make_items(0, 9))
  jaxbuf.save(tmp_path / "nine", state)
  two = jaxbuf.sharded(plain, TWO_DEVICE_MESH)
  spread = jaxbuf.load(tmp_path / "nine", like=two.init(example_item()))
  np.testing.assert_array_equal(spread.add_count, [5, 4])
  spread = two.add(spread, make_items(9, 2))
  jaxbuf.save(tmp_path / "spread", spread)
  back = jaxbuf.load(tmp_path / "spread", like=plain.init(example_item()))
  assert int(back.add_count) == 11
  assert held_items_and_leaves(back) == held_items_and_leaves(spread)
  drawn = plain.sample(back, jax.random.key(0), 8)
  np.testing.assert_array_equal(drawn.item_ids, drawn.items["action"])


def frame_step():
  return {
    "obs": jnp.int32(0),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }


@pytest.mark.parametrize(
  "make",
  [
    lambda: jaxbuf.frame_stack_replay(4, 32, 3),
    lambda: jaxbuf.prioritized_frame_stack_replay(4, 32, 3),
    lambda: jaxbuf.episode_replay(4, 32, 3),
  ],
  ids=["frame_stack", "prioritized_frame_stack", "episode"],
)
def test_kinds_with_per_env_fields_of_their_own_reshard_exactly(make, tmp_path):
  """Frame-stack (`episode_positions`, `next_positions`) and episode replay
  (`piece_lengths`, `piece_positions`) move those fields with their env (a
  regroup was "shape mismatch at leaf .episode_positions")."""
  plain = make()
  ids = np.arange(4)[:, None] * 100 + np.arange(7)[None]
  steps = {
    "obs": ids.astype(np.int32),
    "action": ids.astype(np.int32),
    "reward": np.ones(ids.shape, np.float32),
    "terminated": np.zeros(ids.shape, bool),
  }
  ends = np.random.default_rng(0).random(ids.shape) < 0.3
  state = plain.add(plain.init(frame_step()), steps, episode_end=ends)
  jaxbuf.save(tmp_path / "plain", state)
  two = jaxbuf.sharded(plain, TWO_DEVICE_MESH)
  spread = jaxbuf.load(tmp_path / "plain", like=two.init(frame_step()))
  np.testing.assert_array_equal(spread.episode_ends.shape, (2, 2, 8))
  assert np.all(np.asarray(two.sample(spread, jax.random.key(3), 8).weights) > 0)
  jaxbuf.save(tmp_path / "two", spread)
  back = jaxbuf.load(tmp_path / "two", like=plain.init(frame_step()))
  chex.assert_trees_all_equal(jax.device_get(back), jax.device_get(state))


@pytest.mark.parametrize("prioritized, episodes", SEQ_KINDS, ids=SEQ_IDS)
def test_sequence_checkpoints_reshard_exactly(prioritized, episodes, tmp_path):
  adds = ragged_adds()
  four = sharded_sequence(prioritized, episodes)
  state = fill(four, adds)
  jaxbuf.save(tmp_path / "four", state)
  # Sharded over envs, so the unsharded buffer fed the same adds is exactly
  # the regrouped state, bit for bit, its sum tree included.
  plain = sequence_buffer(prioritized, episodes)
  expected = fill(plain, adds)
  restored = jaxbuf.load(tmp_path / "four", like=plain.init(example_step()))
  chex.assert_trees_all_equal(
    jax.device_get(contents(restored)), jax.device_get(contents(expected))
  )
  two = jaxbuf.sharded(plain, TWO_DEVICE_MESH)
  over_two = jaxbuf.load(tmp_path / "four", like=two.init(example_step()))
  assert over_two.storage["obs"].shape[:2] == (2, SEQ_ENVS // 2)
  # Each of the two devices holds the envs the unsharded buffer holds there.
  chex.assert_trees_all_equal(
    as_unsharded(over_two), as_unsharded(jax.tree.map(lambda x: x[None], jax.device_get(expected)))
  )
  weights = np.asarray(two.sample(over_two, jax.random.key(5), 8).weights)
  assert weights.max() == 1
  jaxbuf.save(tmp_path / "unsharded", expected)
  back = jaxbuf.load(tmp_path / "unsharded", like=four.init(example_step()))
  chex.assert_trees_all_equal(jax.device_get(contents(back)), jax.device_get(contents(state)))


def test_sequence_final_steps_empty_masks_and_empty_updates():
  """The sharded buffer reads episode ends and final steps as the unsharded
  one does; a sample with no window has an all-False mask; an update with
  zero entries changes nothing but `beta_step` (was "zero-size array to
  reduction operation max")."""

  class Step(NamedTuple):
    id: jax.Array
    last: jax.Array

  plain = jaxbuf.prioritized_sequence_replay(SEQ_ENVS, SEQ_CAPACITY, SEQ_LENGTH)
  buffer = jaxbuf.sharded(plain, MESH)
  example = Step(jnp.int32(0), jnp.bool_(False))
  ended = np.arange(SEQ_ENVS) % 3 == 0
  no = np.zeros(SEQ_ENVS, bool)
  states = []
  for each in (buffer, plain):
    state = each.init(example)
    empty = each.sample(state, jax.random.key(0), 8)
    assert not np.any(empty.mask) and not np.any(empty.weights)
    for t in range(3):
      state = each.add(
        state,
        Step(np.full(SEQ_ENVS, t, np.int32), no),
        final_steps=Step(np.full(SEQ_ENVS, 100 + t, np.int32), ended & (t == 1)),
      )
    states.append(contents(state).replace(max_priority=None, beta_step=None, window_tree=None))
  chex.assert_trees_all_equal(
    jax.device_get(jax.tree.map(lambda x: x.reshape((SEQ_ENVS,) + x.shape[2:]), states[0])),
    jax.device_get(states[1]),
  )
  state = buffer.add(
    buffer.init(example), Step(np.zeros((SEQ_ENVS, 4), np.int32), np.zeros((SEQ_ENVS, 4), bool))
  )
  before = snapshot(state)
  with pytest.raises(ValueError, match="one priority per window.*r2d2_priorities"):
    buffer.update_priorities(state, np.zeros(4, np.int32), np.ones((4, SEQ_LENGTH), np.float32))
  chex.assert_trees_all_equal(snapshot(state), before)
  expected = snapshot(state.replace(beta_step=state.beta_step + 1))
  updated = buffer.update_priorities(state, np.zeros(0, np.int32), np.zeros(0, np.float32))
  chex.assert_trees_all_equal(snapshot(updated), expected)
