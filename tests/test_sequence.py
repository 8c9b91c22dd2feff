"""Sequence replay against a plain NumPy model of per-env streams.

Every stored step carries its absolute id (`env * 1000 + step`), so each
sampled window's contiguity and origin are checked exactly.
"""

import functools
import inspect
import pathlib
import re
from typing import NamedTuple

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import pytest
from scipy import stats

import jaxbuf

NUM_ENVS, CAPACITY, LENGTH = 3, 15, 3
PER_ENV = CAPACITY // NUM_ENVS
ALPHA, BETA, EPS = 0.7, 0.5, 1e-6
STEP = {"id": jnp.int32(0), "obs": jnp.zeros(2, jnp.float32)}


@functools.cache
def make_buffer(prioritized, *args, **settings):
  """One buffer per setting for the whole file: its jitted functions compile
  once per shape, however many tests use it."""
  if prioritized:
    return jaxbuf.prioritized_sequence_replay(*args, **settings)
  return jaxbuf.sequence_replay(*args, **settings)


class ReferenceStreams:
  """Per-env lists of every step ever added; windows enumerated from scratch."""

  def __init__(self, num_envs, per_env, length, *, period, within, prioritized):
    self.num_envs, self.per_env, self.length = num_envs, per_env, length
    self.period, self.within, self.prioritized = period, within, prioritized
    self.counts = [0] * num_envs
    self.held = [0] * num_envs
    self.ends = [[] for _ in range(num_envs)]
    self.priorities = {}  # (env, first step) -> priority + eps
    self.max_priority = 1.0
    self.updates = 0

  def add(self, num_steps, mask, ends):
    for env in range(self.num_envs):
      if not mask[env]:
        continue
      self.ends[env].extend(bool(x) for x in ends[env])
      self.counts[env] += num_steps
      self.held[env] = min(self.held[env] + num_steps, self.per_env)
    windows = self.windows()
    self.priorities = {key: self.priorities.get(key, self.max_priority) for key in windows.values()}

  def clear(self):
    self.held = [0] * self.num_envs
    self.priorities = {}
    self.max_priority = 1.0

  def windows(self):
    """{window id: (env, first step)} of every window that can be sampled."""
    found = {}
    for env in range(self.num_envs):
      count = self.counts[env]
      for first in range(count - self.held[env], count - self.length + 1):
        if first % self.period:
          continue
        if self.within and any(self.ends[env][first : first + self.length - 1]):
          continue
        found[env * self.per_env + first % self.per_env] = (env, first)
    return found

  def leaves(self):
    leaves = np.zeros(self.num_envs * self.per_env)
    for window_id, key in self.windows().items():
      leaves[window_id] = np.float32(self.priorities[key]) ** ALPHA
    return leaves

  def update(self, indices, priorities, item_ids):
    windows = self.windows()
    for index, priority, item_id in zip(indices, priorities, item_ids):
      key = windows.get(int(index))
      if key is None or not np.isfinite(priority):
        continue
      if item_id is not None and key[1] % 2**32 != item_id:
        continue
      # A signed priority counts by its magnitude, as in item replay.
      self.priorities[key] = float(np.float32(abs(priority)) + np.float32(EPS))
      self.max_priority = max(self.max_priority, self.priorities[key])
    self.updates += 1

  def first_episode_mask(self, env, first):
    ends = self.ends[env][first : first + self.length]
    return np.concatenate([[True], np.cumsum(ends[:-1]) == 0])


def make_steps(reference, num_steps):
  """Steps `[N, T]` whose ids continue each env's count."""
  ids = np.array(
    [[env * 1000 + reference.counts[env] + t for t in range(num_steps)] for env in range(NUM_ENVS)],
    np.int32,
  )
  return {"id": ids, "obs": np.repeat(ids[..., None], 2, -1).astype(np.float32)}


def check_sample(sample, reference, batch_size, *, prioritized, num_windows):
  windows = reference.windows()
  assert sample.items["id"].shape == (batch_size, LENGTH)
  for row in range(batch_size):
    env, first = windows[int(sample.indices[row])]
    np.testing.assert_array_equal(sample.items["id"][row], env * 1000 + first + np.arange(LENGTH))
    assert int(sample.item_ids[row]) == first % 2**32
    np.testing.assert_array_equal(sample.mask[row], reference.first_episode_mask(env, first))
  if prioritized:
    leaves = reference.leaves()
    probabilities = leaves[np.asarray(sample.indices)] / leaves.sum()
    raw = (num_windows * probabilities) ** -BETA
    np.testing.assert_allclose(sample.weights, raw / raw.max(), rtol=1e-4)
  else:
    np.testing.assert_array_equal(sample.weights, 1.0)


def check_state(state, reference, *, has_tree):
  windows = reference.windows()
  counts = np.zeros(NUM_ENVS, int)
  for env, _ in windows.values():
    counts[env] += 1
  np.testing.assert_array_equal(state.window_counts, counts)
  np.testing.assert_array_equal(state.steps_held, reference.held)
  if has_tree:
    leaves = np.asarray(state.window_tree.levels[0])[:CAPACITY]
    if reference.prioritized:
      np.testing.assert_allclose(leaves, reference.leaves(), rtol=1e-5)
    else:
      np.testing.assert_array_equal(leaves > 0, reference.leaves() > 0)


CONFIGS = {
  # name: (prioritized, period, episodes)
  "uniform-cross-period1": (False, 1, "cross"),
  "uniform-within-period2": (False, 2, "within"),
  "prioritized-within-period1": (True, 1, "within"),
  "prioritized-cross-period4": (True, 4, "cross"),
}
BUFFERS = {
  name: (
    make_buffer(
      True,
      NUM_ENVS,
      CAPACITY,
      LENGTH,
      period=period,
      alpha=ALPHA,
      beta=BETA,
      eps=EPS,
      episodes=episodes,
    )
    if prioritized
    else make_buffer(False, NUM_ENVS, CAPACITY, LENGTH, period=period, episodes=episodes)
  )
  for name, (prioritized, period, episodes) in CONFIGS.items()
}

OPERATION = st.one_of(
  st.tuples(
    st.just("add"),
    st.sampled_from([0, 2, PER_ENV + 3]),
    st.lists(st.booleans(), min_size=NUM_ENVS, max_size=NUM_ENVS),
    st.integers(0, 2**16),
  ),
  st.tuples(st.just("sample"), st.integers(0, 2**16)),
  st.tuples(st.just("update"), st.integers(0, 2**16), st.booleans()),
  st.tuples(st.just("clear")),
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@hypothesis.settings(max_examples=12)
@hypothesis.given(operations=st.lists(OPERATION, min_size=1, max_size=14))
def test_random_operation_sequences_match_the_numpy_model(name, operations):
  prioritized, period, episodes = CONFIGS[name]
  buffer = BUFFERS[name]
  reference = ReferenceStreams(
    NUM_ENVS, PER_ENV, LENGTH, period=period, within=episodes == "within", prioritized=prioritized
  )
  has_tree = prioritized or episodes == "within"
  state = buffer.init(STEP)
  last_sample = None
  for operation in operations:
    if operation[0] == "add":
      _, num_steps, mask, seed = operation
      rng = np.random.default_rng(seed)
      # 0 stands for one step per env, [N, ...] without a time axis.
      length = max(num_steps, 1)
      steps = make_steps(reference, length)
      ends = rng.random((NUM_ENVS, length)) < 0.3
      if num_steps == 0:
        steps = jax.tree.map(lambda x: x[:, 0], steps)
        state = buffer.add(state, steps, mask=np.array(mask), episode_end=ends[:, 0])
      else:
        state = buffer.add(state, steps, mask=np.array(mask), episode_end=ends)
      reference.add(length, mask, ends)
    elif operation[0] == "sample":
      if reference.windows():
        last_sample = buffer.sample(state, jax.random.key(operation[1]), 6)
        check_sample(
          last_sample, reference, 6, prioritized=prioritized, num_windows=len(reference.windows())
        )
      else:
        empty = buffer.sample(state, jax.random.key(operation[1]), 6)
        np.testing.assert_array_equal(empty.weights, 0.0)
        assert not bool(buffer.can_sample(state, 6))
    elif operation[0] == "update" and last_sample is not None:
      _, seed, with_ids = operation
      rng = np.random.default_rng(seed)
      priorities = rng.uniform(-3, 3, 6).astype(np.float32)
      priorities[rng.random(6) < 0.2] = np.nan
      indices = np.asarray(last_sample.indices).copy()
      indices[rng.random(6) < 0.2] = CAPACITY + 1
      item_ids = np.asarray(last_sample.item_ids) if with_ids else None
      state = buffer.update_priorities(state, indices, priorities, item_ids)
      reference.update(indices, priorities, [None] * 6 if item_ids is None else item_ids)
    elif operation[0] == "clear":
      state = buffer.clear(state)
      reference.clear()
    check_state(state, reference, has_tree=has_tree)
    assert bool(buffer.can_sample(state, 1)) == bool(reference.windows())
    if prioritized:
      assert float(state.max_priority) == pytest.approx(reference.max_priority)


@pytest.mark.parametrize("period", [1, LENGTH - 1, LENGTH, LENGTH + 2])
def test_windows_around_the_wrap_match_the_model_for_every_period(period):
  """Counts L-1, R, R+1, R+L-1 and several wraps, with a ragged second env."""
  buffers = {
    "uniform": jaxbuf.sequence_replay(2, 2 * PER_ENV, LENGTH, period=period),
    "prioritized": jaxbuf.prioritized_sequence_replay(
      2, 2 * PER_ENV, LENGTH, period=period, alpha=ALPHA
    ),
  }
  for count in [LENGTH - 1, PER_ENV, PER_ENV + 1, PER_ENV + LENGTH - 1, 3 * PER_ENV + 2]:
    states = {kind: b.init(STEP) for kind, b in buffers.items()}
    ids = np.zeros(2, int)
    for t in range(count):
      mask = np.array([True, t % 3 != 1])  # env 1 skips every third step
      steps = {
        "id": (np.array([0, 1000]) + ids).astype(np.int32),
        "obs": np.zeros((2, 2), np.float32),
      }
      ids += mask
      states = {kind: buffers[kind].add(s, steps, mask=mask) for kind, s in states.items()}
    expected = set()
    for env in range(2):
      for first in range(max(0, ids[env] - PER_ENV), ids[env] - LENGTH + 1):
        if first % period == 0:
          expected.add(env * PER_ENV + first % PER_ENV)
    leaves = np.asarray(states["prioritized"].window_tree.levels[0])
    assert set(np.flatnonzero(leaves)) == expected, (count, period)
    np.testing.assert_array_equal(states["uniform"].window_counts.sum(), len(expected))
    if not expected:
      continue
    sample = buffers["uniform"].sample(states["uniform"], jax.random.key(count), 256)
    assert set(np.asarray(sample.indices)) == expected
    window = np.asarray(sample.items["id"])
    np.testing.assert_array_equal(np.diff(window, axis=1), 1)
    assert np.all(window[:, 0] % 1000 % period == 0)
    np.testing.assert_array_equal(
      window[:, 0] % 1000 % PER_ENV + window[:, 0] // 1000 * PER_ENV, sample.indices
    )


def _ragged_state(buffer):
  """Env 0: 9 steps (wrapped), env 1: 4, env 2: 1 (no window), env 3: none."""
  state = buffer.init(STEP)
  for t in range(9):
    mask = np.array([True, t < 4, t < 1, False])
    steps = {"id": np.full(4, t, np.int32), "obs": np.zeros((4, 2), np.float32)}
    state = buffer.add(state, steps, mask=mask)
  return state


def test_uniform_windows_are_equally_likely_with_ragged_envs():
  buffer = jaxbuf.sequence_replay(4, 24, LENGTH)
  state = _ragged_state(buffer)
  indices = np.concatenate(
    [np.asarray(buffer.sample(state, jax.random.key(seed), 4096).indices) for seed in range(4)]
  )
  # Env 0 holds steps 3..8 (4 windows), env 1 steps 0..3 (2 windows).
  expected = {0 * 6 + s % 6 for s in range(3, 7)} | {6 + s for s in range(2)}
  assert set(indices) == expected
  observed = np.array([np.sum(indices == w) for w in sorted(expected)])
  assert stats.chisquare(observed).pvalue > 1e-3


def test_uniform_within_episodes_is_equally_likely():
  buffer = jaxbuf.sequence_replay(2, 16, LENGTH, episodes="within")
  state = buffer.init(STEP)
  ends = np.zeros((2, 8), bool)
  ends[0, 3] = True
  state = buffer.add(
    state,
    {"id": np.zeros((2, 8), np.int32), "obs": np.zeros((2, 8, 2), np.float32)},
    episode_end=ends,
  )
  # Env 0: starts 0, 1 (end at step 3 is last), 4, 5; env 1: starts 0..5.
  expected = [0, 1, 4, 5] + [8 + s for s in range(6)]
  indices = np.asarray(buffer.sample(state, jax.random.key(1), 10_000).indices)
  assert sorted(set(indices)) == expected
  observed = np.array([np.sum(indices == w) for w in expected])
  assert stats.chisquare(observed).pvalue > 1e-3


def test_prioritized_frequencies_follow_priority_to_the_alpha():
  buffer = jaxbuf.prioritized_sequence_replay(4, 24, LENGTH, alpha=ALPHA)
  state = _ragged_state(buffer)
  windows = np.array([3 % 6, 4, 5, 0, 6, 7])
  priorities = np.array([0.5, 1.0, 2.0, 4.0, 0.25, 3.0], np.float32)
  state = buffer.update_priorities(state, windows, priorities)
  counts = np.zeros(24)
  for seed in range(4):
    sample = buffer.sample(state, jax.random.key(seed), 4096)
    np.add.at(counts, np.asarray(sample.indices), 1)
  mass = (priorities + EPS) ** ALPHA
  assert set(np.flatnonzero(counts)) == set(windows)
  pvalue = stats.chisquare(counts[windows], mass / mass.sum() * counts.sum())
  assert pvalue.pvalue > 1e-3


# --- Episodes: the hard cases, one named test each ------------------------------


def _episode_buffer(kind):
  return make_buffer(kind == "prioritized", 1, 8, 3, episodes="within")


def _add_ids(buffer, state, ids, ends):
  ids = np.asarray(ids, np.int32)[None]
  return buffer.add(
    state,
    {"id": ids, "obs": np.zeros((*ids.shape, 2), np.float32)},
    episode_end=np.asarray(ends, bool)[None],
  )


def _sampleable(state):
  return set(np.flatnonzero(np.asarray(state.window_tree.levels[0])[:8]))


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_within_an_episode_shorter_than_the_window_is_never_sampled(kind):
  buffer = _episode_buffer(kind)
  # Episodes of 2, 3 and 2 steps, then one running.
  state = _add_ids(buffer, buffer.init(STEP), range(7), [0, 1, 0, 0, 1, 0, 1])
  assert _sampleable(state) == {2}
  sample = buffer.sample(state, jax.random.key(0), 64)
  np.testing.assert_array_equal(sample.items["id"], [[2, 3, 4]] * 64)


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_within_an_episode_of_exactly_the_window_length_is_sampled(kind):
  buffer = _episode_buffer(kind)
  state = _add_ids(buffer, buffer.init(STEP), range(3), [0, 0, 1])
  assert _sampleable(state) == {0}
  np.testing.assert_array_equal(state.window_counts, [1])


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_within_an_episode_spanning_the_physical_wrap(kind):
  buffer = _episode_buffer(kind)
  # 6 steps of one episode, then an episode of 5 written at slots 6, 7, 0, 1, 2.
  state = _add_ids(buffer, buffer.init(STEP), range(6), [0] * 5 + [1])
  state = _add_ids(buffer, state, range(6, 11), [0] * 4 + [1])
  # Steps 3..10 held; windows 3 (3,4,5) and 6, 7, 8 (slots 6, 7, 0).
  assert _sampleable(state) == {3, 6, 7, 0}
  ids = np.asarray(buffer.sample(state, jax.random.key(0), 64).items["id"])
  assert {tuple(row) for row in ids} == {(3, 4, 5), (6, 7, 8), (7, 8, 9), (8, 9, 10)}


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_within_an_episode_running_at_the_write_head(kind):
  buffer = _episode_buffer(kind)
  state = _add_ids(buffer, buffer.init(STEP), range(5), [0, 1, 0, 0, 0])
  # The running episode 2, 3, 4 gives one window; none reads past step 4.
  assert _sampleable(state) == {2}
  state = _add_ids(buffer, state, [5], [0])
  assert _sampleable(state) == {2, 3}


def test_cross_episodes_mask_marks_the_first_episode():
  buffer = jaxbuf.sequence_replay(1, 8, 4)
  state = _add_ids(buffer, buffer.init(STEP), range(6), [0, 1, 0, 0, 1, 0])
  sample = buffer.sample(state, jax.random.key(0), 64)
  for ids, mask in zip(np.asarray(sample.items["id"]), np.asarray(sample.mask)):
    first_end = {0: 1, 1: 1, 2: 4}[ids[0]]
    np.testing.assert_array_equal(mask, ids <= first_end)


# --- Priorities: entry, overwrite, stale ids ----------------------------------


def test_a_window_enters_at_max_priority_and_leaves_when_its_first_step_goes():
  buffer = make_buffer(True, 1, 4, 2, alpha=1.0)
  state = _add_ids(buffer, buffer.init(STEP), range(3), [0, 0, 0])
  state = buffer.update_priorities(state, np.array([0]), np.array([5.0], np.float32))
  leaves = np.asarray(state.window_tree.levels[0])[:4]
  np.testing.assert_allclose(leaves, [5.0, 1.0, 0, 0], rtol=1e-5)
  # Step 3 completes window 2 at the max priority; step 4 overwrites slot 0.
  state = _add_ids(buffer, state, [3, 4], [0, 0])
  leaves = np.asarray(state.window_tree.levels[0])[:4]
  np.testing.assert_allclose(leaves, [0, 1.0, 5.0, 5.0], rtol=1e-5)


def test_stale_and_invalid_priority_updates_are_skipped():
  buffer = make_buffer(True, 1, 4, 2, alpha=1.0)
  state = _add_ids(buffer, buffer.init(STEP), range(3), [0, 0, 0])
  sample = buffer.sample(state, jax.random.key(0), 16)
  state = _add_ids(buffer, state, range(3, 7), [0, 0, 0, 0])  # all overwritten
  before = np.asarray(state.window_tree.levels[0]).copy()
  state = buffer.update_priorities(
    state, sample.indices, np.full(16, 7.0, np.float32), sample.item_ids
  )
  np.testing.assert_array_equal(state.window_tree.levels[0], before)
  # Without ids the update lands on the window there now, if it is held:
  # steps 3..6 sit in slots 3, 0, 1, 2, so slot 2 (step 6, the newest)
  # starts no complete window and stays at 0.
  state = buffer.update_priorities(state, np.array([2, 0]), np.array([7.0, 7.0], np.float32))
  leaves = np.asarray(state.window_tree.levels[0])[:4]
  np.testing.assert_allclose(leaves, [7.0, 1.0, 0, 1.0], rtol=1e-5)


def test_item_ids_wrap_with_the_uint32_step_counts():
  buffer = make_buffer(True, 1, 4, 2, alpha=1.0)
  state = buffer.init(STEP)
  state = state.replace(step_counts=jnp.array([2**32 - 2], jnp.uint32))
  state = _add_ids(buffer, state, range(4), [0] * 4)
  sample = buffer.sample(state, jax.random.key(0), 16)
  expected = (np.asarray(sample.items["id"])[:, 0].astype(np.int64) + 2**32 - 2) % 2**32
  np.testing.assert_array_equal(sample.item_ids, expected.astype(np.uint32))
  state = buffer.update_priorities(
    state, sample.indices, np.full(16, 3.0, np.float32), sample.item_ids
  )
  assert float(state.max_priority) == pytest.approx(3.0)


def test_counters_stay_bounded_over_many_steps_in_a_scan():
  buffer = jaxbuf.sequence_replay(2, 10, 3, period=3)
  state = buffer.init(STEP)
  steps = {"id": jnp.zeros((2, 7), jnp.int32), "obs": jnp.zeros((2, 7, 2), jnp.float32)}

  def body(state, _):
    return jaxbuf.sequence.add(state, steps, sequence_length=3, period=3, within=False), None

  state, _ = jax.lax.scan(body, state, None, length=10_000)
  np.testing.assert_array_equal(state.write_heads, 70_000 % 5)
  np.testing.assert_array_equal(state.period_phases, 70_000 % 3)
  np.testing.assert_array_equal(state.steps_held, 5)
  # Steps 69995..69999 held; starts 69996 (and 69999 incomplete).
  np.testing.assert_array_equal(state.window_counts, 1)


# --- Composition: jit, donation, vmap, scan, cond, devices, checkpoints -------


@pytest.mark.parametrize("prioritized", [False, True])
def test_add_writes_in_place_under_donation(prioritized):
  buffer = (
    jaxbuf.prioritized_sequence_replay(4, 40_000, 8, period=4, episodes="within")
    if prioritized
    else jaxbuf.sequence_replay(4, 40_000, 8)
  )
  step = {"obs": jnp.zeros(64, jnp.float32)}
  state = jax.eval_shape(buffer.init, step)
  steps = {"obs": jax.ShapeDtypeStruct((4, 2, 64), jnp.float32)}
  module = jaxbuf.prioritized_sequence if prioritized else jaxbuf.sequence
  settings = dict(sequence_length=8, period=4, within=prioritized)
  if prioritized:
    settings["alpha"] = 0.6
  compiled = (
    jax.jit(lambda s, x: module.add(s, x, **settings), donate_argnums=0)
    .lower(state, steps)
    .compile()
  )
  storage_bytes = 40_000 * 64 * 4
  memory = compiled.memory_analysis()
  if memory is None:
    pytest.skip("no memory analysis on this backend")
  # No copy of the storage: temporaries far below it.
  assert memory.temp_size_in_bytes < storage_bytes / 20, memory


def test_vmapped_states_sharded_over_devices_and_checkpoint_round_trip(tmp_path):
  buffer = jaxbuf.prioritized_sequence_replay(2, 12, 3)
  num = jax.device_count()
  mesh = jax.make_mesh((num,), ("data",))
  states = jax.vmap(lambda _: buffer.init(STEP))(jnp.arange(num))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  states = jax.device_put(states, sharding)
  steps = jax.device_put(
    {"id": jnp.ones((num, 2, 5), jnp.int32), "obs": jnp.ones((num, 2, 5, 2), jnp.float32)}, sharding
  )
  add = jax.jit(
    jax.vmap(
      lambda s, x: jaxbuf.prioritized_sequence.add(
        s, x, sequence_length=3, period=1, within=False, alpha=0.6
      )
    )
  )
  with jax.set_mesh(mesh):
    states = add(states, steps)
  assert states.storage["obs"].sharding.spec[0] == "data"
  np.testing.assert_array_equal(states.window_counts, [[3, 3]] * num)
  jaxbuf.save(tmp_path / "ckpt", states)
  loaded = jaxbuf.load(tmp_path / "ckpt", like=states)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(states)):
    np.testing.assert_array_equal(got, want)
  single = buffer.add(
    buffer.init(STEP), {"id": jnp.ones((2, 5), jnp.int32), "obs": jnp.ones((2, 5, 2), jnp.float32)}
  )
  jaxbuf.save(tmp_path / "one", single)
  other = jaxbuf.prioritized_sequence_replay(3, 12, 3).init(STEP)
  with pytest.raises(ValueError, match="num_envs mismatch"):
    jaxbuf.load(tmp_path / "one", like=other)
  other = jaxbuf.prioritized_sequence_replay(2, 16, 3).init(STEP)
  with pytest.raises(ValueError, match="capacity mismatch"):
    jaxbuf.load(tmp_path / "one", like=other)


# --- Bad input: raises, names the problem, leaves the state intact ------------


def snapshot(state):
  return [np.asarray(x).copy() for x in jax.tree.leaves(state)]


def assert_raises_leaving_state_intact(call, state, error, words):
  before = snapshot(state)
  with pytest.raises(error) as raised:
    call(state)
  for word in words:
    assert word in str(raised.value), (word, str(raised.value))
  for got, want in zip(snapshot(state), before):
    np.testing.assert_array_equal(got, want)


SEQUENCE = make_buffer(False, NUM_ENVS, CAPACITY, LENGTH, period=1, episodes="cross")
PRIORITIZED = jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, LENGTH)


def _chunk(num_envs=NUM_ENVS, length=2):
  return {
    "id": np.zeros((num_envs, length), np.int32),
    "obs": np.zeros((num_envs, length, 2), np.float32),
  }


SEQUENCE_RAISES = {
  # row id: (call(buffer, state), error, words in the message)
  "seq-add-wrong-num-envs": (
    lambda b, s: b.add(s, _chunk(num_envs=2)),
    ValueError,
    ["['id']", "(2, 2)", "(3, 2)"],
  ),
  "seq-add-wrong-rank": (
    lambda b, s: b.add(s, {"id": np.zeros((3, 2, 2), np.int32), "obs": np.zeros((3, 2, 2, 2))}),
    ValueError,
    ["['id']", "(3, 2, 2)", "chunk"],
  ),
  "seq-add-chunk-rank-mismatch": (
    lambda b, s: b.add(s, {"id": np.zeros((3, 2), np.int32), "obs": np.zeros((3, 2), np.float32)}),
    ValueError,
    ["['obs']", "(3, 2)"],
  ),
  "seq-add-wrong-dtype": (
    lambda b, s: b.add(
      s, {"id": np.zeros((3, 2), np.float32), "obs": np.zeros((3, 2, 2), np.float32)}
    ),
    TypeError,
    ["['id']", "float32", "int32"],
  ),
  "seq-add-mask-wrong-shape": (
    lambda b, s: b.add(s, _chunk(), mask=np.ones(2, bool)),
    ValueError,
    ["mask", "(2,)", "(3,)"],
  ),
  "seq-add-episode-end-wrong-shape": (
    lambda b, s: b.add(s, _chunk(), episode_end=np.ones(3, bool)),
    ValueError,
    ["episode_end", "(3,)", "(3, 2)"],
  ),
  "seq-add-mask-not-bool": (
    lambda b, s: b.add(s, _chunk(), mask=np.ones(3, np.int32)),
    TypeError,
    ["mask", "bool"],
  ),
  "seq-sample-batch-size-zero": (
    lambda b, s: b.sample(s, jax.random.key(0), 0),
    ValueError,
    ["batch_size", "positive"],
  ),
  "seq-update-float-indices": (
    lambda b, s: b.update_priorities(s, np.array([0.0]), np.array([1.0])),
    TypeError,
    ["indices", "integers"],
  ),
  "seq-state-of-another-kind": (
    lambda b, s: (PRIORITIZED if b is SEQUENCE else SEQUENCE).sample(s, jax.random.key(0), 2),
    TypeError,
    ["sample", "expected a"],
  ),
  "seq-update-item-ids-wrong-dtype": (
    lambda b, s: b.update_priorities(
      s, np.array([0]), np.array([1.0], np.float32), np.array([0], np.int32)
    ),
    TypeError,
    ["item_ids", "uint32"],
  ),
  "seq-update-per-step-priorities": (
    lambda b, s: b.update_priorities(s, np.array([0, 1]), np.ones((2, LENGTH), np.float32)),
    ValueError,
    ["(2, 3)", "one priority per window", "(2,)", "jaxbuf.r2d2_priorities"],
  ),
  "seq-add-final-steps-without-last": (
    lambda b, s: b.add(s, _chunk(), final_steps=_chunk(length=1)),
    TypeError,
    ["final_steps", "`last`"],
  ),
  "seq-sample-bound-setting": (
    lambda b, s: b.sample(s, jax.random.key(0), 2, sequence_length=LENGTH + 1),
    TypeError,
    ["sequence_length", "setting of the buffer"],
  ),
}


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
@pytest.mark.parametrize("row", sorted(SEQUENCE_RAISES))
def test_bad_sequence_input_raises_and_the_state_survives(row, kind):
  call, error, words = SEQUENCE_RAISES[row]
  buffer = SEQUENCE if kind == "uniform" else PRIORITIZED
  state = buffer.add(buffer.init(STEP), _chunk(length=4))
  assert_raises_leaving_state_intact(lambda s: call(buffer, s), state, error, words)
  assert int(jnp.sum(buffer.add(state, _chunk()).window_counts)) > 0


SETTINGS = {
  "seq-capacity-not-multiple-of-num-envs": (
    lambda: jaxbuf.sequence_replay(4, 30, 2),
    ValueError,
    ["capacity 30", "num_envs 4", "28 or 32"],
  ),
  "seq-sequence-longer-than-per-env": (
    lambda: jaxbuf.prioritized_sequence_replay(4, 32, 9),
    ValueError,
    ["sequence_length 9", "8", "36"],
  ),
  "seq-period-zero": (
    lambda: jaxbuf.sequence_replay(2, 8, 2, period=0),
    ValueError,
    ["period", "positive"],
  ),
  "seq-period-float": (
    lambda: jaxbuf.sequence_replay(2, 8, 2, period=1.5),
    TypeError,
    ["period", "int"],
  ),
  "seq-alpha-inf": (
    lambda: jaxbuf.prioritized_sequence_replay(2, 8, 2, alpha=float("inf")),
    ValueError,
    ["alpha", "finite"],
  ),
  "seq-eps-nan": (
    lambda: jaxbuf.prioritized_sequence_replay(2, 8, 2, eps=float("nan")),
    ValueError,
    ["eps", "finite"],
  ),
  "seq-episodes-unknown": (
    lambda: jaxbuf.sequence_replay(2, 8, 2, episodes="none"),
    ValueError,
    ["episodes", "within"],
  ),
}


@pytest.mark.parametrize("row", sorted(SETTINGS))
def test_bad_sequence_settings_raise_when_the_buffer_is_made(row):
  make, error, words = SETTINGS[row]
  with pytest.raises(error) as raised:
    make()
  for word in words:
    assert word in str(raised.value), (word, str(raised.value))


def test_empty_sample_and_bad_priorities_default_and_checked():
  state = PRIORITIZED.add(PRIORITIZED.init(STEP), _chunk(length=4))
  empty = PRIORITIZED.sample(PRIORITIZED.clear(state), jax.random.key(0), 4)
  np.testing.assert_array_equal(empty.weights, 0.0)
  state = PRIORITIZED.add(PRIORITIZED.init(STEP), _chunk(length=4))
  before = np.asarray(state.window_tree.levels[0]).copy()
  # NaN, ids outside [0, C) at any integer width (2**32 + 1 must not wrap to
  # window 1) are skipped; a negative priority applies by its magnitude.
  state = PRIORITIZED.update_priorities(
    state,
    np.array([0, 1, CAPACITY, -1, 2**32 + 1], np.int64),
    np.array([np.nan, -2.0, 1.0, 1.0, 9.0], np.float32),
  )
  expected = before.copy()
  expected[1] = (2.0 + 1e-6) ** 0.6
  np.testing.assert_allclose(state.window_tree.levels[0], expected, rtol=1e-6)
  # Checked mode, staged under jit with checkify (eager checked calls run op
  # by op and cost seconds each).
  checked = jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, LENGTH, checked=True)
  state = jax.jit(checked.add)(checked.init(STEP), _chunk(length=1))

  def run(function, *args):
    error, _ = jax.jit(checkify.checkify(function))(state, *args)
    with pytest.raises(ValueError) as raised:
      error.throw()
    return str(raised.value)

  assert "no complete window" in run(lambda s, k: checked.sample(s, k, 4), jax.random.key(0))
  assert "finite" in run(
    lambda s, p: checked.update_priorities(s, jnp.array([0]), p), jnp.array([np.nan], jnp.float32)
  )
  assert "window ids" in run(
    lambda s, i: checked.update_priorities(s, i, jnp.array([1.0])), jnp.array([CAPACITY])
  )


def test_reliability_md_lists_every_sequence_row():
  text = (pathlib.Path(__file__).parents[1] / "RELIABILITY.md").read_text()
  listed = set()
  for line in text.splitlines():
    if line.startswith("| `seq-"):
      listed.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
  assert set(SEQUENCE_RAISES) | set(SETTINGS) <= listed
  source = pathlib.Path(__file__).read_text()
  section = text.split("## Sequence replay")[1].split("\n## ")[0]
  for test in set(re.findall(r"\b(test_\w+)(?!\.py)\b", section)):
    assert f"def {test}(" in source, test


# --- Issue 18: one episode-end flag, safe defaults, clear errors -------------


class LastStep(NamedTuple):
  obs: jax.Array  # ()
  terminated: jax.Array
  last: jax.Array


LAST_STEP = LastStep(jnp.int32(0), jnp.bool_(False), jnp.bool_(False))


def _collect(buffer, num_steps, ended_at, *, final_steps=True):
  """A vectorized-env loop of `num_steps` steps; `ended_at[t]` bool [N]: the
  envs whose episode ended after step t. Step obs are `env * 1000 + t`, final
  observations `env * 1000 + 500 + t`."""
  num_envs = ended_at.shape[1]
  state = buffer.init(LAST_STEP)
  no = np.zeros(num_envs, bool)
  envs = np.arange(num_envs) * 1000
  for t in range(num_steps):
    step = LastStep(jnp.asarray(envs + t, jnp.int32), jnp.asarray(no), jnp.asarray(no))
    final = LastStep(
      jnp.asarray(envs + 500 + t, jnp.int32), jnp.asarray(no), jnp.asarray(ended_at[t])
    )
    if final_steps:
      state = buffer.add(state, step, final_steps=final)
    else:  # the streams the two masked adds used to make, by hand
      state = buffer.add(state, step)
      state = buffer.add(state, final, mask=ended_at[t])
  return state


@pytest.mark.parametrize("prioritized", [False, True])
def test_the_steps_last_leaf_is_the_one_episode_end_flag(prioritized):
  """`final_steps` writes a final step exactly where its own `last` is True,
  and episode ends are read from `last`: the streams equal the correct
  hand-masked ones, bit for bit; `episode_end` beside `last` is refused."""
  buffer = make_buffer(prioritized, 4, 4 * 16, 3, episodes="within")
  ended_at = np.random.default_rng(0).random((12, 4)) < 0.3
  state = _collect(buffer, 12, ended_at)
  reference = _collect(buffer, 12, ended_at, final_steps=False)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(state.episode_ends, state.storage.last)
  # Every env's stream: its steps in order, a final step right after each
  # step whose episode ended, and nothing else.
  for env in range(4):
    expected = []
    for t in range(12):
      expected.append(env * 1000 + t)
      if ended_at[t, env]:
        expected.append(env * 1000 + 500 + t)
    held = int(state.steps_held[env])
    order = (int(state.write_heads[env]) - held + np.arange(held)) % 16
    assert np.asarray(state.storage.obs)[env, order].tolist() == expected[-held:]
  # Sampled windows never cross an episode end (episodes="within").
  batch = buffer.sample(state, jax.random.key(1), 64)
  obs = np.asarray(batch.items.obs)
  assert np.all(batch.mask) and np.all(np.asarray(batch.items.last)[:, :-1] == 0)
  assert np.all((obs // 1000) == (obs[:, :1] // 1000))
  # Two flags could disagree: refused, the state intact; a chunk of final
  # steps and a `last` that is not bool too.
  no = jnp.zeros(4, bool)
  step = LastStep(jnp.zeros(4, jnp.int32), no, no)
  assert_raises_leaving_state_intact(
    lambda s: buffer.add(s, step, episode_end=~no),
    state,
    TypeError,
    ["`last`", "do not pass episode_end"],
  )
  chunk = jax.tree.map(lambda x: jnp.stack([x, x], axis=1), step)
  assert_raises_leaving_state_intact(
    lambda s: buffer.add(s, step, final_steps=chunk),
    state,
    ValueError,
    ["final_steps", "one step per env"],
  )
  assert_raises_leaving_state_intact(
    lambda s: buffer.add(s, step._replace(last=jnp.zeros(4, jnp.int32))),
    state,
    TypeError,
    ["`last`", "bool", "int32"],
  )


def test_final_steps_under_jit_scan_and_masks():
  """Inside a scan, with envs that did not step (`mask`): a final step is
  written only by an env that stepped and whose final step is `last`."""
  buffer = make_buffer(False, 3, 3 * 8, 2)
  ended = jnp.array([True, True, False])
  stepped = jnp.array([True, False, True])

  @jax.jit
  def run(state):
    def body(state, t):
      step = LastStep(jnp.full(3, t, jnp.int32), jnp.zeros(3, bool), jnp.zeros(3, bool))
      final = LastStep(jnp.full(3, 100 + t, jnp.int32), jnp.zeros(3, bool), ended)
      return buffer.add(state, step, stepped, final_steps=final), None

    return jax.lax.scan(body, state, jnp.arange(3))[0]

  state = run(buffer.init(LAST_STEP))
  np.testing.assert_array_equal(state.steps_held, [6, 0, 3])
  np.testing.assert_array_equal(state.storage.obs[0, :6], [0, 100, 1, 101, 2, 102])
  np.testing.assert_array_equal(state.storage.last[0, :6], [0, 1] * 3)
  np.testing.assert_array_equal(state.storage.obs[2, :3], [0, 1, 2])


@pytest.mark.parametrize("kind", ["uniform", "within", "prioritized"])
def test_a_sample_with_no_window_has_an_all_false_mask(kind):
  # Buffers other tests compile too.
  buffer = {
    "uniform": SEQUENCE,
    "within": BUFFERS["uniform-within-period2"],
    "prioritized": PRIORITIZED,
  }[kind]
  state = buffer.add(buffer.init(STEP), _chunk(length=LENGTH - 1))
  empty = buffer.sample(state, jax.random.key(0), 4)
  np.testing.assert_array_equal(empty.weights, 0.0)
  assert not np.any(empty.mask)
  full = buffer.sample(buffer.add(state, _chunk(length=1)), jax.random.key(0), 4)
  assert np.all(full.mask) and np.all(full.weights > 0)


def _equal_neighbours(rows):
  return int(np.sum(rows[1:] == rows[:-1]))


def test_prioritized_sequence_rows_come_in_random_order():
  """Stratified draws in stratum order came in strips: 32 windows of equal
  priority, 256 draws, rows 8k..8k+7 one window (224 equal neighbours).
  Random order: about 255 / 32 = 8 equal neighbours."""
  buffer = make_buffer(True, 32, 32 * 4, 2)
  state = buffer.add(buffer.init(STEP), _chunk(num_envs=32, length=2))
  rows = np.asarray(buffer.sample(state, jax.random.key(0), 256).indices)
  assert len(set(rows.tolist())) == 32  # still stratified: every window
  assert _equal_neighbours(rows) < 25, rows[:16]


@pytest.mark.parametrize("checked", [False, True])
def test_lists_and_numpy_arrays_work_as_arrays_do(checked):
  """A list `mask`, `episode_end` or priorities was a TracerArrayConversionError
  (checked mode: "Cannot determine dtype")."""
  buffer = PRIORITIZED
  as_arrays = buffer.add(
    buffer.init(STEP),
    _chunk(length=4),
    np.array([True, False, True]),
    np.array([[False, True, False, False]] * 3),
  )
  if checked:  # an eager checked add runs op by op: only the update here
    under_test = jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, LENGTH, checked=True)
    as_lists = jax.tree.map(jnp.copy, as_arrays)
    with pytest.raises(TypeError, match="mask must be bool, given dtype int"):
      under_test.add(as_lists, _chunk(length=4), [1, 0, 1])
  else:
    under_test = buffer
    as_lists = buffer.add(
      buffer.init(STEP), _chunk(length=4), [True, False, True], [[False, True, False, False]] * 3
    )
  for got, want in zip(jax.tree.leaves(as_lists), jax.tree.leaves(as_arrays)):
    np.testing.assert_array_equal(got, want)
  with_lists = under_test.update_priorities(as_lists, [0, 10], [0.5, 2.0])
  with_arrays = buffer.update_priorities(
    as_arrays, np.array([0, 10]), np.array([0.5, 2.0], np.float32)
  )
  np.testing.assert_array_equal(with_lists.window_tree.levels[0], with_arrays.window_tree.levels[0])
  assert float(with_lists.max_priority) == pytest.approx(2.0 + EPS)


@pytest.mark.parametrize("checked", [False, True])
def test_an_empty_update_of_window_priorities_changes_only_beta_step(checked):
  """Was "zero-size array to reduction operation max"; item replay's
  outcome: nothing changes but `beta_step`, which counts update calls."""
  buffer = (
    PRIORITIZED
    if not checked
    else jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, LENGTH, checked=True)
  )
  state = PRIORITIZED.add(PRIORITIZED.init(STEP), _chunk(length=4))
  before = snapshot(state.replace(beta_step=state.beta_step + 1))
  updated = buffer.update_priorities(
    state, np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.uint32)
  )
  for got, want in zip(snapshot(updated), before):
    np.testing.assert_array_equal(got, want)


def test_sample_signatures_show_only_what_a_caller_passes():
  for buffer in (SEQUENCE, PRIORITIZED):
    assert list(inspect.signature(buffer.sample).parameters) == [
      "state",
      "key",
      "batch_size",
      "step",
    ]
    assert list(inspect.signature(buffer.add).parameters) == [
      "state",
      "steps",
      "mask",
      "episode_end",
      "final_steps",
    ]
    assert "sequence_length" not in str(inspect.signature(buffer.update_priorities))
