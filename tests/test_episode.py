"""Episode replay against a plain NumPy model of per-env streams cut into pieces.

Every stored step carries its absolute id (`env * 1000 + step`), so each
sampled episode's origin, order, padding and completeness are checked exactly.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import pytest
from scipy import stats

import jaxbuf
from tests import devices
from tests.reference import add_random_stream_steps

NUM_ENVS, CAPACITY, MAX_LENGTH = 2, 16, 3
PER_ENV = CAPACITY // NUM_ENVS
STEP = {"id": jnp.int32(0), "obs": jnp.zeros(2, jnp.float32)}


@functools.cache
def make_buffer(weight_by_length=False):
  return jaxbuf.episode_replay(NUM_ENVS, CAPACITY, MAX_LENGTH, weight_by_length=weight_by_length)


class ReferencePieces:
  """Per-env lists of every step ever added; pieces enumerated from scratch."""

  def __init__(self, num_envs, per_env, max_length):
    self.per_env, self.max_length = per_env, max_length
    self.counts = [0] * num_envs
    self.held = [0] * num_envs
    self.ends = [[] for _ in range(num_envs)]
    self.cleared = [0] * num_envs  # the step id a clear restarted from

  def add(self, num_steps, mask, ends):
    for env, stepped in enumerate(mask):
      if stepped:
        self.ends[env].extend(bool(x) for x in ends[env][:num_steps])
        self.counts[env] += num_steps
        self.held[env] = min(self.held[env] + num_steps, self.per_env)

  def clear(self):
    self.held = [0] * len(self.counts)
    self.cleared = list(self.counts)

  def pieces(self):
    """{(env, first step): (length, continues)} of every sampleable piece."""
    found = {}
    for env, count in enumerate(self.counts):
      first, position = self.cleared[env], 0
      for step in range(self.cleared[env], count):
        end = self.ends[env][step]
        if end or position == self.max_length - 1:
          if first >= count - self.held[env]:
            found[(env, first)] = (step - first + 1, not end)
          first, position = step + 1, 0
        else:
          position += 1
    return found


def make_steps(reference, num_steps):
  ids = np.array(
    [
      [env * 1000 + count + t for t in range(num_steps)]
      for env, count in enumerate(reference.counts)
    ],
    np.int32,
  )
  return {"id": ids, "obs": np.repeat(ids[..., None], 2, -1).astype(np.float32)}


def check_sample(sample, reference):
  sample = jax.device_get(sample)  # NumPy rows: no device op per element
  pieces = reference.pieces()
  for row in range(sample.lengths.shape[0]):
    env, first = divmod(int(sample.items["id"][row, 0]), 1000)
    length, continues = pieces[(env, first)]
    assert int(sample.lengths[row]) == length
    assert bool(sample.continues[row]) == continues
    assert int(sample.indices[row]) == env * PER_ENV + first % PER_ENV
    assert int(sample.item_ids[row]) == first
    ids = np.asarray(sample.items["id"][row])
    np.testing.assert_array_equal(ids[:length], env * 1000 + first + np.arange(length))
    np.testing.assert_array_equal(ids[length:], 0)  # zero padding
    np.testing.assert_array_equal(sample.items["obs"][row, length:], 0)
    np.testing.assert_array_equal(sample.mask[row], np.arange(MAX_LENGTH) < length)


def check_leaves(state, reference, weight_by_length):
  """A leaf per piece held (1, or its length), at its first step's id."""
  leaves = np.asarray(state.window_tree.levels[0])[:CAPACITY]
  expected = np.zeros(CAPACITY)
  for (env, first), (length, _) in reference.pieces().items():
    expected[env * PER_ENV + first % PER_ENV] = length if weight_by_length else 1
  np.testing.assert_array_equal(leaves, expected)


OPERATION = st.one_of(
  st.tuples(
    st.just("add"),
    st.sampled_from([0, 2, 5, PER_ENV + 3]),
    st.lists(st.booleans(), min_size=NUM_ENVS, max_size=NUM_ENVS),
    st.integers(0, 2**16),
  ),
  st.tuples(st.just("sample"), st.integers(0, 2**16)),
  st.tuples(st.just("clear")),
)


@pytest.mark.parametrize("weight_by_length", [False, True])
@hypothesis.settings(max_examples=10)
@hypothesis.given(operations=st.lists(OPERATION, min_size=1, max_size=12))
def test_random_operation_sequences_match_the_numpy_model(weight_by_length, operations):
  buffer = make_buffer(weight_by_length)
  reference = ReferencePieces(NUM_ENVS, PER_ENV, MAX_LENGTH)
  state = buffer.init(STEP)
  for operation in operations:
    if operation[0] == "add":
      state = add_random_stream_steps(buffer, state, reference, operation, make_steps)
    elif operation[0] == "sample":
      sample = buffer.sample(state, jax.random.key(operation[1]), 16)
      if reference.pieces():
        check_sample(sample, reference)
        np.testing.assert_array_equal(sample.weights, 1.0)
      else:
        np.testing.assert_array_equal(sample.weights, 0.0)
        np.testing.assert_array_equal(sample.mask, False)
    else:
      state = buffer.clear(state)
      reference.clear()
    check_leaves(state, reference, weight_by_length)
    assert bool(buffer.can_sample(state, 1)) == bool(reference.pieces())


def _three_episodes(buffer):
  """Env 0: episodes of 1, 3 and 2 steps; env 1: one of 2, then a running
  one of 4, whose first 3 steps are a complete piece (M = 3)."""
  ends = np.array([[1, 0, 0, 1, 0, 1], [0, 1, 0, 0, 0, 0]], bool)
  ids = np.array([np.arange(6), 1000 + np.arange(6)], np.int32)
  return buffer.add(
    buffer.init(STEP), {"id": ids, "obs": np.zeros((2, 6, 2), np.float32)}, episode_end=ends
  )


@pytest.mark.parametrize("weight_by_length", [False, True])
def test_episodes_are_drawn_uniformly_or_by_length_chi_square(weight_by_length):
  buffer = make_buffer(weight_by_length)
  state = _three_episodes(buffer)
  firsts = [0, 1, 4, 1000, 1002]
  lengths = np.array([1, 3, 2, 2, 3])
  sample = buffer.sample(state, jax.random.key(5), 20_000)
  drawn = np.asarray(sample.items["id"][:, 0])
  assert set(drawn) == set(firsts)
  observed = np.array([np.sum(drawn == f) for f in firsts])
  mass = lengths if weight_by_length else np.ones(5)
  # Fixed seed; a correct sampler fails with probability 1e-4.
  assert stats.chisquare(observed, mass / mass.sum() * 20_000).pvalue > 1e-4


def test_long_episodes_are_split_into_pieces_of_max_length():
  buffer = jaxbuf.episode_replay(1, 16, 3)
  ends = np.zeros((1, 8), bool)
  ends[0, 6] = True  # an episode of 7 steps, then a running one
  state = buffer.add(
    buffer.init(STEP),
    {"id": np.arange(8, dtype=np.int32)[None], "obs": np.zeros((1, 8, 2), np.float32)},
    episode_end=ends,
  )
  sample = buffer.sample(state, jax.random.key(0), 256)
  pieces = {
    (int(row[0]), int(length), bool(continues))
    for row, length, continues in zip(
      np.asarray(sample.items["id"]), sample.lengths, sample.continues
    )
  }
  assert pieces == {(0, 3, True), (3, 3, True), (6, 1, False)}


def test_a_partly_overwritten_episode_is_never_returned():
  buffer = jaxbuf.episode_replay(1, 6, 4)
  ends = np.array([[0, 0, 0, 1, 0, 1, 0, 0]], bool)  # 0..3 | 4..5 | 6..7
  state = buffer.add(
    buffer.init(STEP),
    {"id": np.arange(8, dtype=np.int32)[None], "obs": np.zeros((1, 8, 2), np.float32)},
    episode_end=ends,
  )
  # Steps 2..7 held: the first episode lost steps 0 and 1.
  sample = buffer.sample(state, jax.random.key(0), 256)
  np.testing.assert_array_equal(sample.items["id"][:, :2], [[4, 5]] * 256)
  np.testing.assert_array_equal(sample.lengths, 2)


def test_an_empty_buffer_samples_weight_zero_and_checked_mode_raises():
  buffer = make_buffer()
  state = buffer.add(
    buffer.init(STEP), {"id": np.zeros((2, 2), np.int32), "obs": np.zeros((2, 2, 2), np.float32)}
  )
  empty = buffer.sample(state, jax.random.key(0), 4)
  np.testing.assert_array_equal(empty.weights, 0.0)
  np.testing.assert_array_equal(empty.lengths, 0)
  assert not bool(buffer.can_sample(state, 4))
  checked = jaxbuf.episode_replay(NUM_ENVS, CAPACITY, MAX_LENGTH, checked=True)
  error, _ = jax.jit(checkify.checkify(lambda s, k: checked.sample(s, k, 4)))(
    state, jax.random.key(0)
  )
  with pytest.raises(ValueError, match="no complete episode"):
    error.throw()


def test_save_and_load_round_trip(tmp_path):
  buffer = make_buffer()
  state = _three_episodes(buffer)
  jaxbuf.save(tmp_path / "episodes", state)
  loaded = jaxbuf.load(tmp_path / "episodes", like=buffer.init(STEP))
  assert type(loaded) is type(state)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)
  other = jaxbuf.episode_replay(NUM_ENVS, 2 * CAPACITY, MAX_LENGTH).init(STEP)
  with pytest.raises(ValueError, match="capacity mismatch"):
    jaxbuf.load(tmp_path / "episodes", like=other)


SETTINGS = {
  "episode-max-length-above-per-env": (
    lambda: jaxbuf.episode_replay(2, 8, 5),
    ValueError,
    ["max_episode_length 5", "4", "10"],
  ),
  "episode-max-length-zero": (
    lambda: jaxbuf.episode_replay(2, 8, 0),
    ValueError,
    ["max_episode_length", "positive"],
  ),
  "episode-capacity-not-multiple": (
    lambda: jaxbuf.episode_replay(4, 30, 2),
    ValueError,
    ["capacity 30", "28 or 32"],
  ),
}


@pytest.mark.parametrize("row", sorted(SETTINGS))
def test_bad_settings_raise_naming_the_argument(row):
  make, error, words = SETTINGS[row]
  with pytest.raises(error) as raised:
    make()
  for word in words:
    assert word in str(raised.value), (word, str(raised.value))


def test_bad_add_raises_and_the_state_survives():
  buffer = make_buffer()
  state = _three_episodes(buffer)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
  with pytest.raises(ValueError, match="episode_end"):
    buffer.add(
      state,
      {"id": np.zeros((2, 3), np.int32), "obs": np.zeros((2, 3, 2), np.float32)},
      episode_end=np.zeros(2, bool),
    )
  with pytest.raises(TypeError, match="float32"):
    buffer.add(state, {"id": np.zeros((2, 3), np.float32), "obs": np.zeros((2, 3, 2), np.float32)})
  for got, want in zip(jax.tree.leaves(state), before):
    np.testing.assert_array_equal(got, want)


@devices.needs(4)
@pytest.mark.parametrize("weight_by_length", [False, True])
def test_sharded_over_four_devices_samples_as_the_unsharded_buffer(weight_by_length, tmp_path):
  """Envs split over 4 fake CPU devices (conftest): each piece comes whole
  from the device holding its env, with the probability of the NumPy model
  (chi-square, fixed seed, p > 1e-4); local sampling and save/load work."""
  num_envs, capacity = 4, 32
  mesh = jax.make_mesh((4,), ("data",))
  whole_buffer = jaxbuf.episode_replay(
    num_envs, capacity, MAX_LENGTH, weight_by_length=weight_by_length
  )
  buffer = jaxbuf.sharded(whole_buffer, mesh, axis="data")
  rng = np.random.default_rng(0)
  ids = (np.arange(num_envs)[:, None] * 1000 + np.arange(7)[None, :]).astype(np.int32)
  ends = rng.random((num_envs, 7)) < 0.4
  steps = {"id": ids, "obs": np.repeat(ids[..., None], 2, -1).astype(np.float32)}
  state = buffer.add(buffer.init(STEP), steps, episode_end=ends)
  reference = ReferencePieces(num_envs, capacity // num_envs, MAX_LENGTH)
  reference.add(7, [True] * num_envs, ends)
  pieces = reference.pieces()
  sample = jax.device_get(buffer.sample(state, jax.random.key(1), 4096))
  firsts = [(env, first) for env, first in zip(*divmod(np.asarray(sample.items["id"][:, 0]), 1000))]
  assert set(firsts) == set(pieces)
  for row in range(64):
    length, continues = pieces[firsts[row]]
    assert sample.lengths[row] == length and sample.continues[row] == continues
    np.testing.assert_array_equal(np.diff(sample.items["id"][row, :length]), 1)
  keys = sorted(pieces)
  mass = np.array([pieces[key][0] if weight_by_length else 1.0 for key in keys])
  observed = np.array([firsts.count(key) for key in keys])
  assert stats.chisquare(observed, mass / mass.sum() * 4096).pvalue > 1e-4
  np.testing.assert_array_equal(sample.weights, 1.0)
  local = jaxbuf.sharded(whole_buffer, mesh, axis="data", sampling="local")
  assert local.sample(state, jax.random.key(2), 8).lengths.shape == (8,)
  jaxbuf.save(tmp_path / "sharded", state)
  loaded = jaxbuf.load(tmp_path / "sharded", like=buffer.init(STEP))
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)


def test_a_last_leaf_marks_the_episode_ends():
  """The stream convention (`help(jaxbuf.streams)`): a step's `last` leaf is
  its episode-end flag, read as `episode_end` would be (it was ignored, and
  episodes loaded by `jaxbuf.from_minari` ran together); both at once is a
  `TypeError`."""
  buffer = make_buffer()
  ends = np.array([[False, True, False, False, True], [True, False, False, False, True]])
  ids = np.arange(10, dtype=np.int32).reshape(2, 5)
  obs = np.zeros((2, 5, 2), np.float32)
  with_leaf = buffer.add(
    buffer.init({**STEP, "last": jnp.bool_(False)}), {"id": ids, "obs": obs, "last": ends}
  )
  with_flag = buffer.add(buffer.init(STEP), {"id": ids, "obs": obs}, episode_end=ends)
  for field in ("episode_ends", "piece_lengths", "piece_positions"):
    np.testing.assert_array_equal(getattr(with_leaf, field), getattr(with_flag, field))
  np.testing.assert_array_equal(with_leaf.window_tree.levels[0], with_flag.window_tree.levels[0])
  with pytest.raises(TypeError, match="do not pass episode_end too"):
    buffer.add(with_leaf, {"id": ids, "obs": obs, "last": ends}, episode_end=ends)
