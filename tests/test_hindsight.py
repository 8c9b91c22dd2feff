"""Hindsight replay against a plain NumPy model of per-env episode streams.

Every stored step carries its absolute id: observation and achieved goal
`env * 1000 + step`, desired goal `-1 - id`, reward `id + 0.25`. A sampled
row names its transition (obs) and, relabelled, the step its goal came
from (desired goal), so the goal contract of DESIGN.md is checked exactly.
"""

import collections
import functools

import chex
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

NUM_ENVS, CAPACITY = 2, 16
PER_ENV = CAPACITY // NUM_ENVS


def reward_fn(achieved_goal, desired_goal):
  return -jnp.any(achieved_goal != desired_goal, axis=-1).astype(jnp.float32)


def goal_step(goal_size=1):
  goal = jnp.zeros(goal_size, jnp.float32)
  return {
    "obs": {"observation": goal, "achieved_goal": goal, "desired_goal": goal},
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }


STEP = goal_step()


@functools.cache
def make_buffer(strategy, relabel_fraction=1.0, prioritized=False, **kwargs):
  return jaxbuf.hindsight_replay(
    NUM_ENVS,
    CAPACITY,
    reward_fn,
    strategy=strategy,
    relabel_fraction=relabel_fraction,
    prioritized=prioritized,
    **kwargs,
  )


class ReferenceStreams:
  """Per-env lists of every step ever added; episodes enumerated from scratch."""

  def __init__(self, num_envs, per_env):
    self.per_env = per_env
    self.counts = [0] * num_envs
    self.held = [0] * num_envs
    self.ends = [[] for _ in range(num_envs)]
    self.starts = [set([0]) for _ in range(num_envs)]  # episode first steps

  def add(self, num_steps, mask, ends):
    for env, stepped in enumerate(mask):
      if not stepped:
        continue
      for t in range(num_steps):
        if self.ends[env] and self.ends[env][-1]:
          self.starts[env].add(self.counts[env])
        self.ends[env].append(bool(ends[env][t]))
        self.counts[env] += 1
      self.held[env] = min(self.held[env] + num_steps, self.per_env)

  def clear(self):
    for env in range(len(self.counts)):
      self.held[env] = 0
      self.starts[env].add(self.counts[env])

  def transitions(self):
    """{(env, step)} of every transition that can be sampled."""
    found = set()
    for env, count in enumerate(self.counts):
      for step in range(count - self.held[env], count - 1):
        if not self.ends[env][step]:
          found.add((env, step))
    return found

  def allowed_goals(self, env, step, strategy):
    """The steps whose achieved goal may relabel transition `step`."""
    count = self.counts[env]
    first = max(s for s in self.starts[env] if s <= step)
    last = step + 1
    while last < count - 1 and not self.ends[env][last]:
      last += 1
    oldest = max(first, count - self.held[env])
    if strategy == "future":
      return set(range(step + 1, last + 1))
    if strategy == "final":
      return {last}
    return set(range(oldest + 1, last + 1))


def make_steps(reference, num_steps):
  ids = np.array(
    [
      [env * 1000 + count + t for t in range(num_steps)]
      for env, count in enumerate(reference.counts)
    ],
    np.float32,
  )
  goal = ids[..., None]
  return {
    "obs": {"observation": goal, "achieved_goal": goal, "desired_goal": -1 - goal},
    "action": ids.astype(np.int32),
    "reward": ids + 0.25,
    "terminated": np.zeros(ids.shape, bool),
  }


def check_sample(sample, reference, strategy, relabel_fraction, per_env=PER_ENV):
  sample = jax.device_get(sample)  # NumPy rows: no device op per element
  transitions = reference.transitions()
  items = sample.items
  obs_ids = np.asarray(items.obs["observation"][:, 0]).astype(int)
  next_ids = np.asarray(items.next_obs["observation"][:, 0]).astype(int)
  goals = np.asarray(items.obs["desired_goal"][:, 0])
  np.testing.assert_array_equal(goals, items.next_obs["desired_goal"][:, 0])
  np.testing.assert_array_equal(next_ids, obs_ids + 1)
  relabelled = np.asarray(sample.relabelled)
  if relabel_fraction == 0:
    assert not relabelled.any()
  if relabel_fraction == 1:
    assert relabelled.all()
  for row, obs_id in enumerate(obs_ids):
    env, step = divmod(obs_id, 1000)
    assert (env, step) in transitions
    assert int(sample.indices[row]) == env * per_env + step % per_env
    assert int(sample.item_ids[row]) == step
    assert int(items.action[row]) == obs_id
    if relabelled[row]:
      goal_env, goal = divmod(int(goals[row]), 1000)
      assert goal_env == env
      assert goal in reference.allowed_goals(env, step, strategy), (step, goal, strategy)
      assert float(items.reward[row]) == -float(goal != step + 1)
    else:
      assert goals[row] == -1 - obs_id
      assert float(items.reward[row]) == obs_id + 0.25
    # gamma (the default 0.99): the factor of the bootstrap, as in every kind
    assert items.discount[row] == np.asarray(0.99, items.discount.dtype)


OPERATION = st.one_of(
  st.tuples(
    st.just("add"),
    st.sampled_from([0, 1, 3, PER_ENV + 3]),
    st.lists(st.booleans(), min_size=NUM_ENVS, max_size=NUM_ENVS),
    st.integers(0, 2**16),
  ),
  st.tuples(st.just("sample"), st.integers(0, 2**16)),
  st.tuples(st.just("clear")),
)


@pytest.mark.parametrize(
  "strategy,relabel_fraction,prioritized",
  [("future", 1.0, False), ("final", 0.5, False), ("episode", 1.0, True), ("future", 0.0, True)],
)
@hypothesis.settings(max_examples=8)
@hypothesis.given(operations=st.lists(OPERATION, min_size=1, max_size=12))
def test_random_operation_sequences_draw_goals_only_from_allowed_steps(
  strategy, relabel_fraction, prioritized, operations
):
  buffer = make_buffer(strategy, relabel_fraction, prioritized)
  reference = ReferenceStreams(NUM_ENVS, PER_ENV)
  state = buffer.init(STEP)
  for operation in operations:
    if operation[0] == "add":
      state = add_random_stream_steps(buffer, state, reference, operation, make_steps)
    elif operation[0] == "sample":
      sample = buffer.sample(state, jax.random.key(operation[1]), 32)
      if reference.transitions():
        check_sample(sample, reference, strategy, relabel_fraction)
        assert set(np.asarray(sample.weights) > 0) == {True}
      else:
        np.testing.assert_array_equal(sample.weights, 0.0)
    else:
      state = buffer.clear(state)
      reference.clear()
    assert bool(buffer.can_sample(state, 1)) == bool(reference.transitions())
    assert int(jnp.sum(state.window_counts)) == len(reference.transitions())


def _one_episode_state(buffer, lengths, running):
  """One env: finished episodes of `lengths` transitions, then a running
  one of `running` transitions; returns the state and the reference."""
  reference = ReferenceStreams(1, 64)
  state = buffer.init(STEP)
  for length in lengths:
    ends = np.zeros((1, length + 1), bool)
    ends[0, -1] = True
    steps = make_steps(reference, length + 1)
    state = buffer.add(state, steps, episode_end=ends)
    reference.add(length + 1, [True], ends)
  ends = np.zeros((1, running + 1), bool)
  steps = make_steps(reference, running + 1)
  state = buffer.add(state, steps, episode_end=ends)
  reference.add(running + 1, [True], ends)
  return state, reference


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_goal_steps_follow_the_strategy_chi_square(strategy):
  buffer = jaxbuf.hindsight_replay(1, 64, reward_fn, strategy=strategy, relabel_fraction=1.0)
  # Episode of 5 transitions (steps 0..5), then a running one of 3 (6..9).
  state, reference = _one_episode_state(buffer, [5], 3)
  transitions = sorted(reference.transitions())
  expected = {}
  for _, step in transitions:
    allowed = reference.allowed_goals(0, step, strategy)
    for goal in allowed:
      expected[(step, goal)] = 1 / len(transitions) / len(allowed)
  sample = buffer.sample(state, jax.random.key(7), 40_000)
  steps = np.asarray(sample.items.obs["observation"][:, 0]).astype(int)
  goals = np.asarray(sample.items.obs["desired_goal"][:, 0]).astype(int)
  pairs = list(zip(steps.tolist(), goals.tolist()))
  assert set(pairs) == set(expected)
  keys = sorted(expected)
  observed = np.array([pairs.count(k) for k in keys])
  wanted = np.array([expected[k] for k in keys]) * len(pairs)
  # Fixed seed; the test fails for a correct sampler with probability 1e-4.
  assert stats.chisquare(observed, wanted).pvalue > 1e-4


def test_relabel_fraction_binomial():
  # Fractions 0 and 1 are exact: checked in the random operation sequences.
  buffer = jaxbuf.hindsight_replay(1, 64, reward_fn, relabel_fraction=0.3)
  state, _ = _one_episode_state(buffer, [5], 3)
  count = int(jnp.sum(buffer.sample(state, jax.random.key(3), 8_192).relabelled))
  # Fixed seed; a correct sampler fails with probability 1e-4.
  assert stats.binomtest(count, 8_192, 0.3).pvalue > 1e-4


def test_episode_strategy_after_the_episode_start_was_overwritten():
  buffer = jaxbuf.hindsight_replay(1, 6, reward_fn, strategy="episode", relabel_fraction=1.0)
  # One running episode of 9 steps; steps 3..8 held.
  state, reference = _one_episode_state(buffer, [], 8)
  reference.per_env = 6
  reference.held = [6]
  sample = buffer.sample(state, jax.random.key(0), 2000)
  goals = set(np.asarray(sample.items.obs["desired_goal"][:, 0]).astype(int))
  assert goals == {4, 5, 6, 7, 8} == reference.allowed_goals(0, 3, "episode")


def test_the_running_episode_is_sampled_and_its_final_goal_is_the_newest():
  buffer = jaxbuf.hindsight_replay(1, 64, reward_fn, strategy="final", relabel_fraction=1.0)
  state, _ = _one_episode_state(buffer, [2], 2)  # steps 0..2 | 3..5 running
  sample = buffer.sample(state, jax.random.key(0), 500)
  pairs = set(
    zip(
      np.asarray(sample.items.obs["observation"][:, 0]).astype(int),
      np.asarray(sample.items.obs["desired_goal"][:, 0]).astype(int),
    )
  )
  assert pairs == {(0, 2), (1, 2), (3, 5), (4, 5)}


@pytest.mark.usefixtures("x64_mode")
def test_terminated_fn_sets_relabelled_discounts():
  reached = lambda achieved, desired: jnp.all(achieved == desired, axis=-1)
  buffer = jaxbuf.hindsight_replay(
    1, 64, reward_fn, strategy="future", relabel_fraction=0.5, terminated_fn=reached, gamma=0.5
  )
  state, _ = _one_episode_state(buffer, [4], 3)
  sample = buffer.sample(state, jax.random.key(1), 512)
  items = sample.items
  hit = np.asarray(items.next_obs["achieved_goal"][:, 0] == items.obs["desired_goal"][:, 0])
  relabelled = np.asarray(sample.relabelled)
  # gamma where the relabelled goal was not reached, 0 where it was.
  np.testing.assert_array_equal(items.discount[relabelled], 0.5 * ~hit[relabelled])
  np.testing.assert_array_equal(items.reward[relabelled], -(~hit[relabelled]).astype(np.float32))
  np.testing.assert_array_equal(items.discount[~relabelled], 0.5)


def test_prioritized_transitions_follow_priorities():
  buffer = jaxbuf.hindsight_replay(1, 64, reward_fn, prioritized=True, alpha=1.0)
  state, reference = _one_episode_state(buffer, [3], 2)
  ids = np.array([step for _, step in sorted(reference.transitions())])
  priorities = np.arange(1, len(ids) + 1, dtype=np.float32)
  state = buffer.update_priorities(state, ids, priorities)
  sample = buffer.sample(state, jax.random.key(2), 20_000)
  counts = np.array([np.sum(np.asarray(sample.indices) == i) for i in ids])
  assert counts.sum() == 20_000
  expected = priorities.astype(np.float64) / priorities.sum() * 20_000
  assert stats.chisquare(counts, expected).pvalue > 1e-4


def test_save_and_load_round_trip(tmp_path):
  buffer = make_buffer("future")
  reference = ReferenceStreams(NUM_ENVS, PER_ENV)
  ends = np.zeros((NUM_ENVS, 5), bool)
  ends[:, 2] = True
  state = buffer.add(buffer.init(STEP), make_steps(reference, 5), episode_end=ends)
  jaxbuf.save(tmp_path / "her", state)
  loaded = jaxbuf.load(tmp_path / "her", like=buffer.init(STEP))
  assert type(loaded) is type(state)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)
  key = jax.random.key(0)
  np.testing.assert_array_equal(
    buffer.sample(loaded, key, 8).items.reward, buffer.sample(state, key, 8).items.reward
  )


def snapshot(state):
  return [np.asarray(x).copy() for x in jax.tree.leaves(state)]


SETTINGS = {
  "her-strategy-unknown": (
    lambda: jaxbuf.hindsight_replay(2, 8, reward_fn, strategy="last"),
    ValueError,
    ["strategy", "future"],
  ),
  "her-fraction-above-one": (
    lambda: jaxbuf.hindsight_replay(2, 8, reward_fn, relabel_fraction=1.5),
    ValueError,
    ["relabel_fraction", "[0, 1]", "1.5"],
  ),
  "her-fraction-nan": (
    lambda: jaxbuf.hindsight_replay(2, 8, reward_fn, relabel_fraction=float("nan")),
    ValueError,
    ["relabel_fraction"],
  ),
  "her-fraction-string": (
    lambda: jaxbuf.hindsight_replay(2, 8, reward_fn, relabel_fraction="half"),
    TypeError,
    ["relabel_fraction"],
  ),
  "her-reward-fn-not-callable": (
    lambda: jaxbuf.hindsight_replay(2, 8, 1.0),
    TypeError,
    ["reward_fn", "callable"],
  ),
  "her-one-step-per-env": (
    lambda: jaxbuf.hindsight_replay(4, 4, reward_fn),
    ValueError,
    ["capacity 4", "2 steps", "8"],
  ),
  "her-capacity-not-multiple": (
    lambda: jaxbuf.hindsight_replay(4, 30, reward_fn),
    ValueError,
    ["capacity 30", "28 or 32"],
  ),
  "her-obs-not-goal-dict": (
    lambda: make_buffer("future").init({**STEP, "obs": jnp.zeros(3)}),
    ValueError,
    ["obs", "desired_goal"],
  ),
  "her-step-without-reward": (
    lambda: make_buffer("future").init(
      {key: value for key, value in STEP.items() if key != "reward"}
    ),
    ValueError,
    ["'reward'"],
  ),
}


@pytest.mark.parametrize("row", sorted(SETTINGS))
def test_bad_settings_raise_naming_the_argument(row):
  make, error, words = SETTINGS[row]
  with pytest.raises(error) as raised:
    make()
  for word in words:
    assert word in str(raised.value), (word, str(raised.value))


@pytest.mark.parametrize(
  "name,bad_fn,words",
  [
    (
      "shape",
      lambda a, d: jnp.zeros((a.shape[0], 1), jnp.float32),
      ["reward_fn", "(32, 1)", "(32,)"],
    ),
    ("dtype", lambda a, d: jnp.zeros(a.shape[0], jnp.int32), ["reward_fn", "int32", "float32"]),
  ],
)
def test_reward_fn_of_the_wrong_shape_or_dtype_raises_state_intact(name, bad_fn, words):
  del name
  buffer = jaxbuf.hindsight_replay(1, 64, bad_fn)
  good = jaxbuf.hindsight_replay(1, 64, reward_fn)
  state, _ = _one_episode_state(good, [3], 2)
  before = snapshot(state)
  with pytest.raises(ValueError) as raised:
    buffer.sample(state, jax.random.key(0), 32)
  for word in words:
    assert word in str(raised.value), (word, str(raised.value))
  for got, want in zip(snapshot(state), before):
    np.testing.assert_array_equal(got, want)
  assert good.sample(state, jax.random.key(0), 32).items.reward.shape == (32,)


def test_bad_add_raises_and_the_state_survives():
  buffer = make_buffer("future")
  state = buffer.add(
    buffer.init(STEP), jax.tree.map(lambda x: jnp.zeros((NUM_ENVS, 3) + x.shape, x.dtype), STEP)
  )
  before = snapshot(state)
  bad = jax.tree.map(lambda x: jnp.zeros((NUM_ENVS, 3) + x.shape, x.dtype), goal_step(goal_size=2))
  with pytest.raises(ValueError, match="achieved_goal"):
    buffer.add(state, bad)
  with pytest.raises(ValueError, match="episode_end"):
    buffer.add(
      state,
      jax.tree.map(lambda x: jnp.zeros((NUM_ENVS, 3) + x.shape, x.dtype), STEP),
      episode_end=jnp.zeros(NUM_ENVS, bool),
    )
  for got, want in zip(snapshot(state), before):
    np.testing.assert_array_equal(got, want)


def test_checked_mode_raises_on_an_empty_sample():
  checked = jaxbuf.hindsight_replay(1, 8, reward_fn, checked=True)
  state = checked.add(
    checked.init(STEP), jax.tree.map(lambda x: jnp.zeros((1,) + x.shape, x.dtype), STEP)
  )
  error, _ = jax.jit(checkify.checkify(lambda s, k: checked.sample(s, k, 4)))(
    state, jax.random.key(0)
  )
  with pytest.raises(ValueError, match="no transition"):
    error.throw()
  empty = jaxbuf.hindsight_replay(1, 8, reward_fn).sample(state, jax.random.key(0), 4)
  np.testing.assert_array_equal(empty.weights, 0.0)


def test_the_kind_records_the_settings_its_bookkeeping_depends_on():
  buffer = jaxbuf.hindsight_replay(2, 16, reward_fn, prioritized=True, alpha=0.7)
  state = buffer.init(STEP)
  assert buffer.kind.name == "hindsight_replay"
  assert isinstance(state, buffer.kind.state_type)
  assert dict(state.settings) == {
    "num_envs": 2,
    "capacity": 16,
    "prioritized": True,
    "alpha": 0.7,
    "eps": 1e-6,
  }
  # The strategy and fraction shape samples only: a state serves any.
  other = jaxbuf.hindsight_replay(
    2, 16, reward_fn, strategy="final", relabel_fraction=0.1, prioritized=True, alpha=0.7
  )
  assert other.can_sample(state, 1).shape == ()
  with pytest.raises(ValueError, match="prioritized: state True, buffer False"):
    make_buffer("future").can_sample(state, 1)


# --- Under jaxbuf.sharded: 8 envs of 6 steps over 4 devices, 2 envs each ------------

SHARDED_ENVS, SHARDED_PER_ENV = 8, 6
MESH = devices.mesh(4)


@functools.cache
def unsharded_buffer(strategy, relabel_fraction, prioritized):
  return jaxbuf.hindsight_replay(
    SHARDED_ENVS,
    SHARDED_ENVS * SHARDED_PER_ENV,
    reward_fn,
    strategy=strategy,
    relabel_fraction=relabel_fraction,
    prioritized=prioritized,
  )


@functools.cache
def sharded_buffer(strategy, relabel_fraction, prioritized, batch="sharded", sampling="global"):
  return jaxbuf.sharded(
    unsharded_buffer(strategy, relabel_fraction, prioritized), MESH, batch=batch, sampling=sampling
  )


# Single steps and chunks (9 > 6 overwrite), envs masked off, episode ends
# at random: episodes overwritten at their start, ended and running ones.
RAGGED_ADDS = [
  ("add", length, mask, seed)
  for seed, (length, mask) in enumerate(
    [
      (3, [True] * 8),
      (0, [True, False] * 4),
      (9, [True] * 6 + [False] * 2),
      (1, [False] * 8),
      (0, [True] * 8),
      (3, [False, True] * 4),
    ]
  )
]


def fill_both(sharded, unsharded):
  """The same adds to a sharded and an unsharded buffer, and their model."""
  reference = ReferenceStreams(SHARDED_ENVS, SHARDED_PER_ENV)
  copy = ReferenceStreams(SHARDED_ENVS, SHARDED_PER_ENV)
  state, whole = sharded.init(STEP), unsharded.init(STEP)
  for operation in RAGGED_ADDS:
    state = add_random_stream_steps(sharded, state, reference, operation, make_steps)
    whole = add_random_stream_steps(unsharded, whole, copy, operation, make_steps)
  return state, whole, reference


def contents(state):
  return jax.device_get(state.replace(settings=()))


# Two settings, shared by the tests below so that each compiles once.
@devices.needs(4)
@pytest.mark.parametrize("strategy,prioritized", [("future", False), ("episode", True)])
def test_sharded_state_splits_envs_and_goals_stay_in_their_episode(strategy, prioritized):
  buffer = sharded_buffer(strategy, 1.0, prioritized)
  state, whole, reference = fill_both(buffer, unsharded_buffer(strategy, 1.0, prioritized))
  assert state.episode_keys.shape == (4, 2, SHARDED_PER_ENV)
  # Each device holds its envs' steps and episode bookkeeping whole.
  chex.assert_trees_all_equal(contents(jax.device_get(state).joined()), contents(whole))
  for seed in range(3):
    check_sample(
      buffer.sample(state, jax.random.key(seed), 32),
      reference,
      strategy,
      1.0,
      per_env=SHARDED_PER_ENV,
    )
  if strategy == "future":
    # Local sampling: block d (8 rows) from device d's own envs.
    local = sharded_buffer(strategy, 1.0, prioritized, "replicated", "local")
    drawn = local.sample(state, jax.random.key(5), 32)
    check_sample(drawn, reference, strategy, 1.0, per_env=SHARDED_PER_ENV)
    owners = np.asarray(drawn.indices) // (2 * SHARDED_PER_ENV)
    np.testing.assert_array_equal(owners, np.repeat(np.arange(4), 8))


@devices.needs(4)
def test_sharded_sampling_matches_the_unsharded_buffer():
  """Two-sample chi-square over (transition, goal) pairs between 12,800
  rows of each buffer holding the same steps: the sharded draw (the window
  trees' masses over devices, goals drawn by the owner) against the
  unsharded one (candidate pairs, `uniform_transition_ids`); fixed keys,
  p > 1e-3. (The prioritized draw is the sequence kinds', `test_sharded`.)"""
  buffer = sharded_buffer("future", 1.0, False)
  unsharded = unsharded_buffer("future", 1.0, False)
  state, whole, _ = fill_both(buffer, unsharded)
  keys = jax.random.split(jax.random.key(11), 200)
  counts = []
  for each, held in ((buffer, state), (unsharded, whole)):
    rows = jax.jit(lambda s, ks, each=each: jax.lax.map(lambda k: each.sample(s, k, 64), ks))(
      held, keys
    )
    steps = np.asarray(rows.items.obs["observation"]).reshape(-1).astype(int)
    goals = np.asarray(rows.items.obs["desired_goal"]).reshape(-1).astype(int)
    assert np.all(rows.relabelled)
    counts.append(collections.Counter(zip(steps.tolist(), goals.tolist())))
  categories = sorted(set(counts[0]) | set(counts[1]))
  table = np.array([[count[c] for c in categories] for count in counts])
  assert table.shape[1] > 30
  assert stats.chi2_contingency(table).pvalue > 1e-3


@devices.needs(4)
def test_sharded_save_load_and_reshard(tmp_path):
  buffer = sharded_buffer("episode", 1.0, True)
  unsharded = unsharded_buffer("episode", 1.0, True)
  state, whole, _ = fill_both(buffer, unsharded)
  jaxbuf.save(tmp_path / "four", state)
  restored = jaxbuf.load(tmp_path / "four", like=buffer.init(STEP))
  assert type(restored) is type(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  key = jax.random.key(3)
  chex.assert_trees_all_equal(
    jax.device_get(buffer.sample(restored, key, 8)), jax.device_get(buffer.sample(state, key, 8))
  )
  # Regrouped: over one device it is the unsharded buffer fed the same adds,
  # and back.
  chex.assert_trees_all_equal(
    contents(jaxbuf.load(tmp_path / "four", like=unsharded.init(STEP))), contents(whole)
  )
  jaxbuf.save(tmp_path / "one", whole)
  chex.assert_trees_all_equal(
    contents(jaxbuf.load(tmp_path / "one", like=buffer.init(STEP))), contents(state)
  )


@devices.needs(4)
def test_sharded_inside_a_jitted_scan_with_donation_and_no_retrace():
  buffer = sharded_buffer("episode", 1.0, True)
  chex.clear_trace_counter()
  reference = ReferenceStreams(SHARDED_ENVS, SHARDED_PER_ENV)
  chunks = jax.tree.map(lambda *xs: np.stack(xs), *[make_steps(reference, 2) for _ in range(3)])
  ends = np.zeros((3, SHARDED_ENVS, 2), bool)
  ends[1, :, 1] = True

  @functools.partial(jax.jit, donate_argnums=0)
  @chex.assert_max_traces(n=1)
  def steps(state, chunks, ends, key):
    def step(state, inputs):
      chunk, end, key = inputs
      state = buffer.add(state, chunk, None, end)
      sample = buffer.sample(state, key, 8)
      state = buffer.update_priorities(state, sample.indices, sample.items.reward, sample.item_ids)
      return state, sample.items.obs["observation"][:, 0]

    return jax.lax.scan(step, state, (chunks, ends, jax.random.split(key, 3)))

  state, _ = steps(buffer.init(STEP), chunks, ends, jax.random.key(0))
  state, observed = steps(state, chunks, ends, jax.random.key(1))
  assert observed.shape == (3, 8)
  np.testing.assert_array_equal(np.asarray(state.steps_held), SHARDED_PER_ENV)


def test_gamma_out_of_range_is_refused_when_the_buffer_is_made():
  for gamma in (1.5, float("nan"), -0.1):
    with pytest.raises(ValueError, match="gamma"):
      jaxbuf.hindsight_replay(2, 8, reward_fn, gamma=gamma)


def test_a_compute_reward_of_three_arguments_names_the_expected_signature():
  """Row `her-compute-reward-signature`: a gymnasium-robotics style
  `compute_reward(achieved, desired, info)` as reward_fn got Python's raw
  missing-argument TypeError at the first sample; the factory names the
  signature it calls (HER's goals carry no info). Functions of two goals,
  with a defaulted third argument or *args, are taken."""

  def compute_reward(achieved_goal, desired_goal, info):
    return -jnp.linalg.norm(achieved_goal - desired_goal, axis=-1)

  for name in ("reward_fn", "terminated_fn"):
    arguments = (
      {"reward_fn": compute_reward}
      if name == "reward_fn"
      else {"reward_fn": lambda a, d: a[..., 0], "terminated_fn": compute_reward}
    )
    with pytest.raises(
      TypeError,
      match=rf"{name} is called as {name}\(achieved_goal, desired_goal\).*"
      r"given a function of \(achieved_goal, desired_goal, info\).*compute_reward",
    ):
      jaxbuf.hindsight_replay(2, 16, **arguments)
  with pytest.raises(TypeError, match=r"given a function of \(goal\)"):
    jaxbuf.hindsight_replay(2, 16, lambda goal: goal)
  for fine in (
    lambda achieved, desired, info=None: achieved[..., 0],
    lambda *goals: goals[0][..., 0],
    functools.partial(compute_reward, info=None),
    jnp.subtract,
  ):
    jaxbuf.hindsight_replay(2, 16, fine)
