"""Offline datasets: Minari and RLDS episodes in and out of every buffer kind,
checked against a NumPy reference of the episodes, bit for bit."""

import functools
import gc
import os
import warnings

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from tests import devices

minari = pytest.importorskip("minari")
from minari.data_collector import EpisodeBuffer  # noqa: E402

# Tests whose dtypes depend on 64-bit mode run in both (`x64_mode`); the
# others, with 32-bit defaults only, to keep the module's time down.
x64_too = pytest.mark.usefixtures("x64_mode")
pytestmark = [
  # Minari warns about every optional metadata field left out (author,
  # code_permalink, eval_env, ...); these datasets are throwaway.
  pytest.mark.filterwarnings("ignore::UserWarning:minari"),
]


class DictTupleEnv(gymnasium.Env):
  """Dict observations (with a Tuple inside), Tuple actions, episodes that
  terminate at random or are truncated by the TimeLimit around it."""

  observation_space = gymnasium.spaces.Dict(
    {
      "position": gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float32),
      "pair": gymnasium.spaces.Tuple(
        (gymnasium.spaces.Discrete(7), gymnasium.spaces.Box(0, 255, (2,), np.uint8))
      ),
    }
  )
  action_space = gymnasium.spaces.Tuple(
    (gymnasium.spaces.Discrete(3), gymnasium.spaces.Box(-2.0, 2.0, (2,), np.float32))
  )

  def _observation(self):
    return {
      "position": self.np_random.uniform(-1, 1, 3).astype(np.float32),
      "pair": (
        int(self.np_random.integers(7)),
        self.np_random.integers(0, 256, 2).astype(np.uint8),
      ),
    }

  def reset(self, *, seed=None, options=None):
    super().reset(seed=seed)
    return self._observation(), {}

  def step(self, action):
    terminated = bool(self.np_random.random() < 0.15)
    # Rewards a float32 holds exactly, so that they load with 64-bit mode
    # off (float64 data that does not: test_rounding_floats_is_opt_in).
    reward = float(np.float32(self.np_random.normal()))
    return self._observation(), reward, terminated, False, {}


class GoalEnv(gymnasium.Env):
  """gymnasium-robotics' GoalEnv layout in miniature: a point on a plane
  pushed towards a goal; terminated within 0.5 of it, else truncated by the
  TimeLimit around it."""

  observation_space = gymnasium.spaces.Dict(
    {
      "observation": gymnasium.spaces.Box(-4.0, 4.0, (4,), np.float32),
      "achieved_goal": gymnasium.spaces.Box(-4.0, 4.0, (2,), np.float32),
      "desired_goal": gymnasium.spaces.Box(-4.0, 4.0, (2,), np.float32),
    }
  )
  action_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)

  def _observation(self):
    return {
      "observation": np.concatenate([self._position, self._goal]),
      "achieved_goal": self._position.copy(),
      "desired_goal": self._goal.copy(),
    }

  def reset(self, *, seed=None, options=None):
    super().reset(seed=seed)
    self._position = self.np_random.uniform(-1, 1, 2).astype(np.float32)
    self._goal = self.np_random.uniform(-1, 1, 2).astype(np.float32)
    return self._observation(), {}

  def step(self, action):
    self._position = np.clip(self._position + 0.5 * action, -4, 4).astype(np.float32)
    distance = float(np.linalg.norm(self._position - self._goal))
    reward = -float(distance > 0.5)  # goal_reward's, in NumPy
    return self._observation(), reward, distance < 0.5, False, {}


def goal_reward(achieved_goal, desired_goal):
  """The sparse GoalEnv reward: 0 within 0.5 of the goal, else -1, in the
  dtype the loaded rewards have (float64 in 64-bit mode)."""
  distance = jnp.linalg.norm(achieved_goal - desired_goal, axis=-1)
  return -(distance > 0.5).astype(jnp.result_type(float))


def _collect(dataset_id, env, num_episodes, seed):
  """A dataset recorded by Minari's DataCollector with a random policy."""
  env = minari.DataCollector(env)
  env.action_space.seed(seed)
  # A seed per episode: reset without one, the collector draws a fresh
  # random seed to record, and the episodes (with or without a truncation
  # among them) would differ from run to run.
  for episode in range(num_episodes):
    env.reset(seed=1000 * seed + episode)
    done = False
    while not done:
      _, _, terminated, truncated, _ = env.step(env.action_space.sample())
      done = terminated or truncated
  dataset = env.create_dataset(dataset_id, algorithm_name="random")
  env.close()
  # Minari 0.5.4 drops (and at close removes by hand) the TemporaryDirectory
  # objects it wrote into, whose finalizers then warn "Implicitly cleaning
  # up"; collected here, under the caller's warning filter, not in a later
  # test.
  del env
  gc.collect()
  return dataset


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
  previous = os.environ.get("MINARI_DATASETS_PATH")
  os.environ["MINARI_DATASETS_PATH"] = str(tmp_path_factory.mktemp("minari"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    warnings.simplefilter("ignore", ResourceWarning)
    made = {
      "cartpole": _collect(
        "test/cartpole/random-v0", gymnasium.make("CartPole-v1", max_episode_steps=25), 12, 0
      ),
      "dict": _collect(
        "test/dicttuple/random-v0", gymnasium.wrappers.TimeLimit(DictTupleEnv(), 9), 10, 1
      ),
      "goal": _collect("test/goal/random-v0", gymnasium.wrappers.TimeLimit(GoalEnv(), 12), 10, 2),
    }
  yield made
  if previous is None:
    del os.environ["MINARI_DATASETS_PATH"]
  else:
    os.environ["MINARI_DATASETS_PATH"] = previous


def _episodes(dataset):
  return list(dataset.iterate_episodes())


def _held(x):
  """`x` as JAX holds it (int64 -> int32 without x64)."""
  x = np.asarray(x)
  return x.astype(jax.dtypes.canonicalize_dtype(x.dtype))


def _reference_transitions(episodes):
  """Item replay's items, built the obvious way: one per action."""
  rows = []
  for episode in episodes:
    for t in range(len(episode.rewards)):
      at = lambda tree, i: jax.tree.map(lambda x: _held(x[i]), tree)
      rows.append(
        jaxbuf.Transition(
          obs=at(episode.observations, t),
          action=at(episode.actions, t),
          reward=_held(episode.rewards[t]),
          next_obs=at(episode.observations, t + 1),
          terminated=np.bool_(episode.terminations[t]),
          truncated=np.bool_(episode.truncations[t]),
        )
      )
  return jax.tree.map(lambda *xs: np.stack(xs), *rows)


def _reference_stream(episodes):
  """One env's stream: each step, then the final observation flagged last."""
  rows = []
  for episode in episodes:
    num_steps = len(episode.rewards)
    for t in range(num_steps + 1):
      at = lambda tree, i: jax.tree.map(lambda x: _held(x[i]), tree)
      pad = lambda tree: jax.tree.map(lambda x: np.zeros_like(_held(x[0])), tree)
      final = t == num_steps
      rows.append(
        jaxbuf.EpisodeStep(
          obs=at(episode.observations, t),
          action=pad(episode.actions) if final else at(episode.actions, t),
          reward=np.zeros_like(_held(episode.rewards[0])) if final else _held(episode.rewards[t]),
          terminated=np.bool_(False if final else episode.terminations[t]),
          truncated=np.bool_(False if final else episode.truncations[t]),
          last=np.bool_(final),
        )
      )
  return jax.tree.map(lambda *xs: np.stack(xs), *rows)


def _assert_trees_identical(given, expected):
  assert jax.tree.structure(given) == jax.tree.structure(expected)
  for path, a, b in zip(
    [p for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]],
    jax.tree.leaves(given),
    jax.tree.leaves(expected),
  ):
    a, b = np.asarray(a), np.asarray(b)
    name = jax.tree_util.keystr(path)
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), name


def _assert_same_episodes(given, expected):
  """Minari episodes equal bit for bit, dtypes included."""
  assert len(given) == len(expected)
  for a, b in zip(given, expected):
    for field in ("observations", "actions", "rewards", "terminations", "truncations"):
      _assert_trees_identical(getattr(a, field), getattr(b, field))


# One buffer per kind and size for the whole module: its jitted add then
# compiles once per chunk shape, not once per test.
CAPACITY = 512
ITEM_KINDS = {
  "uniform": functools.cache(jaxbuf.uniform_replay),
  "prioritized": functools.cache(jaxbuf.prioritized_replay),
}
STREAM_KINDS = {
  "sequence": functools.cache(
    lambda envs, capacity: jaxbuf.sequence_replay(envs, capacity, sequence_length=2)
  ),
  "prioritized_sequence": functools.cache(
    lambda envs, capacity: jaxbuf.prioritized_sequence_replay(envs, capacity, sequence_length=2)
  ),
  # Pieces of up to 32 steps: every episode here (at most 26 steps with
  # its final observation) is sampled whole.
  "episode": functools.cache(
    lambda envs, capacity: jaxbuf.episode_replay(envs, capacity, max_episode_length=32)
  ),
}


def _load(dataset, buffer, **kwargs):
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  return jaxbuf.from_minari(dataset, buffer, state, **kwargs)


@x64_too
@pytest.mark.parametrize("name", ["cartpole", "dict"])
@pytest.mark.parametrize("kind", ITEM_KINDS)
def test_items_match_the_reference(datasets, name, kind):
  dataset = datasets[name]
  buffer = ITEM_KINDS[kind](CAPACITY)
  state = _load(dataset, buffer, chunk_size=64)  # several chunks
  assert int(state.size) == dataset.total_steps
  held = jax.tree.map(lambda x: np.asarray(x)[: dataset.total_steps], state.storage)
  _assert_trees_identical(held, _reference_transitions(_episodes(dataset)))


@x64_too
@pytest.mark.parametrize("name", ["cartpole", "dict"])
@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_one_stream_matches_the_reference(datasets, name, kind):
  dataset = datasets[name]
  steps = dataset.total_steps + dataset.total_episodes
  buffer = STREAM_KINDS[kind](1, CAPACITY)
  state = _load(dataset, buffer, chunk_size=64)
  reference = _reference_stream(_episodes(dataset))
  held = jax.tree.map(lambda x: np.asarray(x)[0, :steps], state.storage)
  _assert_trees_identical(held, reference)
  assert np.array_equal(np.asarray(state.episode_ends)[0, :steps], reference.last)
  assert bool(buffer.can_sample(state, 4))


@x64_too
@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_several_streams_hold_every_episode_once(datasets, kind):
  dataset = datasets["dict"]
  buffer = STREAM_KINDS[kind](2, CAPACITY)
  state = _load(dataset, buffer, chunk_size=64)
  held = jaxbuf.held_episodes(buffer, state)
  key = lambda episode: _held(episode.rewards).tobytes()
  expected = sorted(_episodes(dataset), key=key)
  got = sorted(held, key=key)
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    _assert_trees_identical(a.observations, jax.tree.map(_held, b.observations))
    _assert_trees_identical(a.truncations, b.truncations)
    _assert_trees_identical(a.terminations, b.terminations)


@x64_too
@pytest.mark.parametrize("name", ["cartpole", "dict"])
@pytest.mark.parametrize("kind", [*ITEM_KINDS, *STREAM_KINDS])
def test_minari_round_trip_is_bit_exact(datasets, name, kind, tmp_path):
  dataset = datasets[name]
  buffer = ITEM_KINDS[kind](CAPACITY) if kind in ITEM_KINDS else STREAM_KINDS[kind](1, CAPACITY)
  state = _load(dataset, buffer, chunk_size=64)
  written = jaxbuf.to_minari(
    f"test/{name}/{kind}-{jax.config.jax_enable_x64:d}-v0",
    buffer,
    state,
    observation_space=dataset.observation_space,
    action_space=dataset.action_space,
  )
  loaded = minari.load_dataset(written.id)
  assert loaded.total_steps == dataset.total_steps
  _assert_same_episodes(_episodes(loaded), _episodes(dataset))


def test_terminations_and_truncations_are_kept_apart(datasets):
  episodes = _episodes(datasets["cartpole"])
  assert any(e.terminations[-1] for e in episodes)
  assert any(e.truncations[-1] and not e.terminations[-1] for e in episodes)
  buffer = STREAM_KINDS["sequence"](1, CAPACITY)
  state = _load(datasets["cartpole"], buffer, chunk_size=64)
  steps = jax.tree.map(np.asarray, state.storage)
  lasts = np.flatnonzero(steps.last[0])
  assert lasts.size == len(episodes)
  for episode, last in zip(episodes, lasts):
    # The flags sit on the step whose action ended the episode; the step
    # after it holds the true final observation.
    assert steps.terminated[0, last - 1] == episode.terminations[-1]
    assert steps.truncated[0, last - 1] == episode.truncations[-1]
    assert np.array_equal(steps.obs[0, last], episode.observations[-1])
  # An n-step target bootstraps from a truncated episode's final observation
  # and not from a terminated one's.
  truncated_end = next(
    last
    for episode, last in zip(episodes, lasts)
    if episode.truncations[-1] and not episode.terminations[-1]
  )
  window = slice(truncated_end - 2, truncated_end + 1)
  targets = jaxbuf.n_step_targets(
    steps.reward[None, 0, window].astype(np.float32),
    steps.terminated[None, 0, window],
    steps.last[None, 0, window],
    n=2,
    gamma=0.5,
  )
  assert targets.discounts.tolist() == [[0.25]]
  assert targets.next_index.tolist() == [[2]]


@pytest.mark.parametrize("kind", ["uniform", "sequence"])
def test_a_dataset_larger_than_the_buffer_keeps_its_newest_whole_episodes(datasets, kind):
  dataset = datasets["cartpole"]
  episodes = _episodes(dataset)
  lengths = [len(e.rewards) for e in episodes]
  capacity = sum(lengths[-4:]) + lengths[-5] - 1  # room for 4, not 5
  if kind == "uniform":
    buffer = jaxbuf.uniform_replay(capacity)
  else:
    buffer = jaxbuf.sequence_replay(1, capacity + 4, sequence_length=2)
  state = _load(dataset, buffer, chunk_size=8, progress=True)
  held = jaxbuf.held_episodes(buffer, state)
  assert len(held) == 4
  for a, b in zip(held, episodes[-4:]):
    _assert_trees_identical(a.observations, _held(b.observations))
    _assert_trees_identical(a.actions, _held(b.actions))


def _as_held(episode):
  """A Minari episode as `held_episodes` gives it: JAX's dtypes."""
  return jaxbuf.Episode(
    *(jax.tree.map(_held, getattr(episode, field)) for field in jaxbuf.Episode._fields)
  )


def _by_rewards(episodes):
  """Episodes in an order that does not depend on the env each was in (the
  random rewards differ between episodes)."""
  return sorted(episodes, key=lambda episode: _held(episode.rewards).tobytes())


def _identical(given, expected):
  return jax.tree.structure(given) == jax.tree.structure(expected) and all(
    np.asarray(a).dtype == np.asarray(b).dtype
    and np.asarray(a).shape == np.asarray(b).shape
    and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(expected))
  )


def test_episode_replay_samples_the_loaded_episodes_whole(datasets):
  dataset = datasets["dict"]
  buffer = STREAM_KINDS["episode"](1, CAPACITY)
  state = _load(dataset, buffer, chunk_size=64)
  streams = [_reference_stream([episode]) for episode in _episodes(dataset)]
  sample = buffer.sample(state, jax.random.key(0), 128)
  items = jax.tree.map(np.asarray, sample.items)
  lengths = np.asarray(sample.lengths)
  drawn = set()
  for row, length in enumerate(lengths.tolist()):
    piece = jax.tree.map(lambda x, row=row, length=length: x[row, :length], items)
    matches = [i for i, stream in enumerate(streams) if _identical(piece, stream)]
    assert len(matches) == 1, row
    drawn.update(matches)
  assert drawn == set(range(len(streams)))
  assert not np.asarray(sample.continues).any()
  assert np.array_equal(np.asarray(sample.mask), np.arange(32)[None] < lengths[:, None])


def test_hindsight_replay_holds_the_goal_episodes_exactly(datasets):
  dataset = datasets["goal"]
  episodes = _episodes(dataset)
  assert any(e.terminations[-1] for e in episodes)
  assert any(e.truncations[-1] for e in episodes)
  buffer = jaxbuf.hindsight_replay(1, CAPACITY, goal_reward)
  state = _load(dataset, buffer, chunk_size=64)
  steps = dataset.total_steps + dataset.total_episodes
  _assert_trees_identical(
    jax.tree.map(lambda x: np.asarray(x)[0, :steps], state.storage), _reference_stream(episodes)
  )
  # Transitions (t, t + 1) of one episode; goals relabelled from it.
  transitions = {}
  for number, episode in enumerate(episodes):
    for t in range(len(episode.rewards)):
      transitions[
        episode.observations["observation"][t].tobytes(),
        episode.observations["observation"][t + 1].tobytes(),
      ] = number
  sample = buffer.sample(state, jax.random.key(0), 256)
  items = jax.tree.map(np.asarray, sample.items)
  for row in range(256):
    number = transitions[
      items.obs["observation"][row].tobytes(), items.next_obs["observation"][row].tobytes()
    ]
    if sample.relabelled[row]:
      goals = episodes[number].observations["achieved_goal"]
      assert any(np.array_equal(items.obs["desired_goal"][row], goal) for goal in goals)
  written = jaxbuf.to_minari(
    "test/goal/hindsight-v0",
    buffer,
    state,
    observation_space=dataset.observation_space,
    action_space=dataset.action_space,
  )
  _assert_same_episodes(_episodes(minari.load_dataset(written.id)), episodes)


# A jaxbuf.sharded buffer over the 4 CPU devices of the test session
# (conftest.py).
MESH = devices.mesh(4)


@devices.needs(4)
@pytest.mark.parametrize("kind", ["sequence", "episode"])
def test_sharded_stream_buffers_hold_the_episodes_exactly(datasets, kind):
  dataset = datasets["dict"]
  buffer = jaxbuf.sharded(STREAM_KINDS[kind](4, 4 * 64), MESH)
  state = _load(dataset, buffer, chunk_size=64)
  for leaf in jax.tree.leaves(state.storage):
    assert len(leaf.sharding.device_set) == 4
  expected = _by_rewards(_episodes(dataset))
  held = _by_rewards(jaxbuf.held_episodes(buffer, state))
  _assert_same_episodes(held, [_as_held(episode) for episode in expected])
  assert buffer.sample(state, jax.random.key(0), 8).items.reward.shape[0] == 8
  written = jaxbuf.to_minari(
    f"test/dict/sharded-{kind}-v0",
    buffer,
    state,
    observation_space=dataset.observation_space,
    action_space=dataset.action_space,
  )
  _assert_same_episodes(_by_rewards(_episodes(minari.load_dataset(written.id))), expected)


@devices.needs(4)
def test_sharded_item_replay_holds_the_newest_episodes_exactly(datasets):
  dataset = datasets["dict"]
  episodes = _episodes(dataset)
  lengths = [len(e.rewards) for e in episodes]
  newest = lambda count: sum(lengths[-count:])
  # The 4 devices' rings are lockstep: the newest episodes that fit must
  # hold a multiple of 4 transitions.
  count = next(k for k in range(len(lengths), 0, -1) if newest(k) % 4 == 0)
  buffer = jaxbuf.sharded(jaxbuf.uniform_replay(newest(count)), MESH)
  state = _load(dataset, buffer, chunk_size=8)
  joined = type(state).joined(jax.device_get(state))
  _assert_trees_identical(
    jax.tree.map(np.asarray, joined.storage), _reference_transitions(episodes[-count:])
  )
  _assert_same_episodes(
    jaxbuf.held_episodes(buffer, state), [_as_held(e) for e in episodes[-count:]]
  )
  written = jaxbuf.to_minari(
    "test/dict/sharded-uniform-v0",
    buffer,
    state,
    observation_space=dataset.observation_space,
    action_space=dataset.action_space,
  )
  _assert_same_episodes(_episodes(minari.load_dataset(written.id)), episodes[-count:])
  # Room for episodes that do not split evenly (and not for one more):
  # refused before anything is added.
  count = next(
    k for k in range(1, len(lengths)) if newest(k) % 4 and lengths[-k - 1] > -newest(k) % 4
  )
  buffer = jaxbuf.sharded(jaxbuf.uniform_replay(newest(count) + -newest(count) % 4), MESH)
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  with pytest.raises(
    ValueError,
    match=f"loads a multiple of 4 transitions; the newest episodes that fit hold {newest(count)}",
  ):
    jaxbuf.from_minari(dataset, buffer, state)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_a_stream_kind_that_ignores_the_last_leaf_is_refused(datasets):
  inner = STREAM_KINDS["sequence"](1, CAPACITY)

  def add_without_ends(state, steps, mask=None):
    # As a kind whose add does not read `last`: no episode end recorded.
    return inner.add(state, steps._replace(last=np.zeros_like(steps.last)), mask)

  buffer = inner._replace(add=add_without_ends)
  state = buffer.init(jaxbuf.offline_example(datasets["dict"], buffer))
  with pytest.raises(
    ValueError,
    match="recorded 0 episode ends in the .* "
    "steps written to env 0, where 10 episodes were added: "
    "its add does not read the steps' `last` leaf",
  ):
    jaxbuf.from_minari(datasets["dict"], buffer, state)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))


@x64_too
def test_rlds_steps_round_trip_and_match_minari(datasets):
  episodes = _episodes(datasets["dict"])
  steps = {
    "observation": jax.tree.map(
      lambda *xs: np.concatenate(xs), *[e.observations for e in episodes]
    ),
    "action": jax.tree.map(
      lambda *xs: np.concatenate(xs),
      *[
        jax.tree.map(lambda x: np.concatenate([x, np.zeros_like(x[:1])]), e.actions)
        for e in episodes
      ],
    ),
    "reward": np.concatenate([np.append(e.rewards, 0.0) for e in episodes]),
    "is_first": np.concatenate([np.arange(len(e.rewards) + 1) == 0 for e in episodes]),
    "is_last": np.concatenate([np.arange(len(e.rewards) + 1) == len(e.rewards) for e in episodes]),
    "is_terminal": np.concatenate(
      [np.append(np.zeros(len(e.rewards), bool), e.terminations[-1]) for e in episodes]
    ),
    "discount": np.ones(sum(len(e.rewards) + 1 for e in episodes)),
  }
  for buffer in (ITEM_KINDS["uniform"](CAPACITY), STREAM_KINDS["sequence"](1, CAPACITY)):
    state = jaxbuf.from_rlds_steps(
      steps, buffer, buffer.init(jaxbuf.offline_example(steps, buffer)), chunk_size=64
    )
    from_minari = _load(datasets["dict"], buffer, chunk_size=64).storage
    # RLDS has no word for an episode both terminated and truncated (a
    # termination on the TimeLimit's step): it reads as terminated.
    from_minari = from_minari._replace(truncated=from_minari.truncated & ~from_minari.terminated)
    _assert_trees_identical(state.storage, from_minari)
    back = jaxbuf.to_rlds_steps(buffer, state)
    expected = {
      key: jax.tree.map(_held, value) for key, value in steps.items() if key != "discount"
    }
    _assert_trees_identical(back, expected)


def test_item_replay_refuses_items_out_of_episode_order():
  buffer = jaxbuf.uniform_replay(8)
  item = jaxbuf.Transition(
    obs=np.zeros(2, np.float32),
    action=np.int32(0),
    reward=np.float32(0),
    next_obs=np.zeros(2, np.float32),
    terminated=np.bool_(False),
    truncated=np.bool_(False),
  )
  state = buffer.init(item)
  # Two envs stepping together: obs 0 -> 1 and obs 10 -> 11, interleaved.
  obs = np.array([[0, 0], [10, 10], [1, 1], [11, 11]], np.float32)
  state = buffer.add(
    state,
    item._replace(
      obs=obs,
      next_obs=obs + 1,
      action=np.zeros(4, np.int32),
      reward=np.zeros(4, np.float32),
      terminated=np.array([0, 0, 1, 1], bool),
      truncated=np.zeros(4, bool),
    ),
  )
  with pytest.raises(ValueError, match="not in episode order"):
    jaxbuf.held_episodes(buffer, state)


# --- Bad input ---------------------------------------------------------------


def _write(name, episodes, observation_space, action_space):
  """A Minari dataset of `episodes` (dicts), one per name and 64-bit mode."""
  return minari.create_dataset_from_buffers(
    f"test/bad/{name}{64 if jax.config.jax_enable_x64 else 32}-v0",
    [EpisodeBuffer(**episode) for episode in episodes],
    observation_space=observation_space,
    action_space=action_space,
  )


def _box(shape):
  return gymnasium.spaces.Box(-1.0, 1.0, shape, np.float32)


def _episode(num_steps, *, actions=None, observations=None):
  return dict(
    observations=(
      np.zeros((num_steps + 1, 3), np.float32) if observations is None else observations
    ),
    actions=(np.zeros(num_steps, np.int64) if actions is None else actions),
    rewards=np.ones(num_steps),
    terminations=np.arange(num_steps) == num_steps - 1,
    truncations=np.zeros(num_steps, bool),
  )


def _assert_refused_and_deleted(dataset, buffer, match, **kwargs):
  """`from_minari` raises `match`, and the donated, half-filled state is
  gone: nothing half-loaded survives."""
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  with pytest.raises(ValueError, match=match):
    jaxbuf.from_minari(dataset, buffer, state, **kwargs)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_spaces_that_do_not_match_the_example_are_refused(datasets):
  dataset = datasets["cartpole"]
  buffer = jaxbuf.uniform_replay(64)
  wrong_shape = jaxbuf.Transition(
    obs=np.zeros(5, np.float32),
    action=np.int32(0),
    reward=np.float32(0),
    next_obs=np.zeros(5, np.float32),
    terminated=np.bool_(False),
    truncated=np.bool_(False),
  )
  with pytest.raises(ValueError, match=r"observations: .*shape \(4,\).*\(5,\)"):
    jaxbuf.from_minari(dataset, buffer, buffer.init(wrong_shape))
  wrong_dtype = wrong_shape._replace(obs=np.zeros(4, np.float16), next_obs=np.zeros(4, np.float16))
  with pytest.raises(TypeError, match="observations: .*float32.*float16"):
    jaxbuf.from_minari(dataset, buffer, buffer.init(wrong_dtype))
  with pytest.raises(ValueError, match="structure"):
    jaxbuf.from_minari(
      datasets["dict"], buffer, buffer.init(jaxbuf.offline_example(dataset, buffer))
    )
  with pytest.raises(TypeError, match="jaxbuf.Transition"):
    jaxbuf.from_minari(dataset, buffer, buffer.init({"obs": np.zeros(4)}))


def test_inconsistent_lengths_are_refused(datasets):
  del datasets  # sets MINARI_DATASETS_PATH
  dataset = _write(
    "lengths",
    [_episode(3), _episode(4, actions=np.zeros(3, np.int64))],
    _box((3,)),
    gymnasium.spaces.Discrete(2),
  )
  _assert_refused_and_deleted(
    dataset, jaxbuf.uniform_replay(64), "episode 1 of .*inconsistent lengths.*'actions': 3"
  )


@x64_too
def test_nan_where_the_dtype_says_integer_is_refused(datasets):
  del datasets  # sets MINARI_DATASETS_PATH
  actions = np.array([0.0, np.nan, 1.0])
  dataset = _write(
    "nan", [_episode(2), _episode(3, actions=actions)], _box((3,)), gymnasium.spaces.Discrete(2)
  )
  _assert_refused_and_deleted(
    dataset,
    jaxbuf.sequence_replay(1, 64, sequence_length=2),
    r"actions: nan at step 1 of episode 1 of .*, where the dtype is int",
    chunk_size=2,
  )


@x64_too
def test_a_value_not_kept_exactly_is_refused(datasets):
  del datasets  # sets MINARI_DATASETS_PATH
  dataset = _write(
    "big", [_episode(2, actions=np.array([0, 2**40]))], _box((3,)), gymnasium.spaces.Discrete(2)
  )
  buffer = jaxbuf.uniform_replay(8)
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  if jax.config.jax_enable_x64:
    assert int(jaxbuf.from_minari(dataset, buffer, state).storage.action[1]) == 2**40
  else:
    with pytest.raises(ValueError, match="actions: .* at step 1 .* int32"):
      jaxbuf.from_minari(dataset, buffer, state)


def test_an_episode_end_in_the_middle_is_refused(datasets):
  del datasets  # sets MINARI_DATASETS_PATH
  episode = _episode(3)
  episode["truncations"] = np.array([False, True, False])
  dataset = _write("middle", [episode], _box((3,)), gymnasium.spaces.Discrete(2))
  _assert_refused_and_deleted(dataset, jaxbuf.uniform_replay(8), "ends at step 1 of 3")


def test_an_episode_without_an_end_is_refused(datasets):
  del datasets  # sets MINARI_DATASETS_PATH
  episode = dict(_episode(3), terminations=np.zeros(3, bool))
  dataset = _write("noend", [episode], _box((3,)), gymnasium.spaces.Discrete(2))
  _assert_refused_and_deleted(
    dataset,
    jaxbuf.uniform_replay(8),
    "episode 0 of .* ends with neither a termination nor a truncation on its last step",
  )


@pytest.mark.parametrize("chunk_size", [0, 2.5])
def test_a_bad_chunk_size_is_refused(datasets, chunk_size):
  buffer = ITEM_KINDS["uniform"](CAPACITY)
  state = buffer.init(jaxbuf.offline_example(datasets["cartpole"], buffer))
  with pytest.raises(ValueError, match="chunk_size must be a positive int"):
    jaxbuf.from_minari(datasets["cartpole"], buffer, state, chunk_size=chunk_size)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_a_buffer_that_holds_no_items_or_streams_is_refused(datasets):
  with pytest.raises(TypeError, match="offline_example: the buffer has no kind"):
    jaxbuf.offline_example(datasets["cartpole"], jaxbuf.rollout_buffer(4, 2))


def test_writing_a_state_without_a_whole_episode_is_refused(datasets):
  dataset = datasets["cartpole"]
  buffer = STREAM_KINDS["sequence"](1, CAPACITY)
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  with pytest.raises(ValueError, match="to_minari: the state holds no whole episode to write"):
    jaxbuf.to_minari(
      "test/bad/empty-v0",
      buffer,
      state,
      observation_space=dataset.observation_space,
      action_space=dataset.action_space,
    )
  assert "test/bad/empty-v0" not in minari.list_local_datasets()
  with pytest.raises(ValueError, match="to_rlds_steps: the state holds no whole episode"):
    jaxbuf.to_rlds_steps(buffer, state)


def test_a_missing_dataset_is_named(tmp_path, monkeypatch):
  monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
  buffer = jaxbuf.uniform_replay(8)
  with pytest.raises(FileNotFoundError, match="no Minari dataset 'test/missing-v0'"):
    jaxbuf.from_minari("test/missing-v0", buffer, None)


def test_a_buffer_too_small_for_the_newest_episode_is_refused(datasets):
  buffer = jaxbuf.uniform_replay(3)
  state = buffer.init(jaxbuf.offline_example(datasets["cartpole"], buffer))
  with pytest.raises(ValueError, match="newest episode .* does not fit"):
    jaxbuf.from_minari(datasets["cartpole"], buffer, state)


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda s: s.update(is_first=np.zeros(4, bool)), "is_first: step 0"),
    (lambda s: s.update(is_last=np.array([0, 0, 0, 0], bool)), "is_last"),
    (lambda s: s.update(is_terminal=np.array([1, 0, 0, 1], bool)), "is_terminal: step 0"),
    (lambda s: s.update(reward=np.zeros(3)), "inconsistent lengths"),
    (lambda s: s.pop("is_last"), r"lack \['is_last'\]"),
    (
      lambda s: s.update({key: value[:0] for key, value in s.items()}),
      "the dataset holds no episodes",
    ),
  ],
)
def test_broken_rlds_steps_are_refused(change, message):
  steps = {
    "observation": np.zeros((4, 2), np.float32),
    "action": np.zeros(4, np.int32),
    "reward": np.zeros(4, np.float32),
    "is_first": np.array([1, 0, 1, 0], bool),
    "is_last": np.array([0, 1, 0, 1], bool),
    "is_terminal": np.array([0, 1, 0, 0], bool),
  }
  buffer = jaxbuf.uniform_replay(8)
  state = buffer.init(jaxbuf.offline_example(steps, buffer))
  change(steps)
  with pytest.raises(ValueError, match=message):
    jaxbuf.from_rlds_steps(steps, buffer, state)


@x64_too
def test_rounding_floats_is_opt_in(datasets):
  del datasets  # sets MINARI_DATASETS_PATH
  rewards = np.array([0.1, 0.2])
  episode = dict(_episode(2), rewards=rewards)
  dataset = _write("round", [episode], _box((3,)), gymnasium.spaces.Discrete(2))
  buffer = jaxbuf.uniform_replay(8)
  example = jaxbuf.offline_example(dataset, buffer)
  if jax.config.jax_enable_x64:
    state = jaxbuf.from_minari(dataset, buffer, buffer.init(example))
    assert np.asarray(state.storage.reward)[:2].tolist() == [0.1, 0.2]
    return
  with pytest.raises(
    ValueError, match="rewards: .*0.1.* at step 0 .* not kept exactly as float32.*round_floats=True"
  ):
    jaxbuf.from_minari(dataset, buffer, buffer.init(example))
  state = jaxbuf.from_minari(dataset, buffer, buffer.init(example), round_floats=True)
  assert np.asarray(state.storage.reward)[:2].tolist() == (rewards.astype(np.float32).tolist())


def test_writing_refuses_an_existing_id_and_leaves_nothing_half_written(datasets):
  dataset = datasets["cartpole"]
  buffer = ITEM_KINDS["uniform"](CAPACITY)
  state = _load(dataset, buffer, chunk_size=64)
  with pytest.raises(FileExistsError, match="exists already"):
    jaxbuf.to_minari(
      dataset.id,
      buffer,
      state,
      observation_space=dataset.observation_space,
      action_space=dataset.action_space,
    )
  assert minari.load_dataset(dataset.id).total_steps == dataset.total_steps
  # Actions beyond the space's dtype (int8) fail at the first episode.
  dataset_id = f"test/bad/write{64 if jax.config.jax_enable_x64 else 32}-v0"
  state = state.replace(storage=state.storage._replace(action=state.storage.action * 0 + 300))
  with pytest.raises(
    ValueError, match="actions: 300 at step 0 of episode 0 of the state is not kept exactly as int8"
  ):
    jaxbuf.to_minari(
      dataset_id,
      buffer,
      state,
      observation_space=dataset.observation_space,
      action_space=gymnasium.spaces.Discrete(2, dtype=np.int8),
    )
  assert dataset_id not in minari.list_local_datasets()


# --- Issue 35: loading into a state that holds data, writing back all of it ---


def _goal_obs(values):
  values = np.asarray(values, np.float32)[:, None]
  return {"observation": values, "achieved_goal": values, "desired_goal": values}


def _rlds(episodes):
  """RLDS steps of episodes given as lists of observations (each ended by a
  termination), obs dicts in the GoalEnv layout."""
  observations = [value for episode in episodes for value in episode]
  firsts = [step == 0 for episode in episodes for step in range(len(episode))]
  lasts = [step == len(episode) - 1 for episode in episodes for step in range(len(episode))]
  count = len(observations)
  return {
    "observation": _goal_obs(observations),
    "action": np.zeros(count, np.int32),
    "reward": np.zeros(count, np.float32),
    "is_first": np.array(firsts),
    "is_last": np.array(lasts),
    "is_terminal": np.array(lasts),
  }


HELD_DATA_KINDS = {  # capacity -> a buffer of one env
  "sequence": lambda capacity=16: jaxbuf.sequence_replay(1, capacity, 2),
  "prioritized_sequence": lambda capacity=16: jaxbuf.prioritized_sequence_replay(1, capacity, 2),
  "episode": lambda capacity=16: jaxbuf.episode_replay(1, capacity, 4),
  "frame_stack": lambda capacity=16: jaxbuf.frame_stack_replay(1, capacity, 2),
  "hindsight": lambda capacity=16: jaxbuf.hindsight_replay(
    1, capacity, lambda a, d: -jnp.abs(a - d).sum(-1).astype(jnp.float32)
  ),
}
DATASET = _rlds([[10, 11, 12, 13, 14], [15, 16, 17, 18]])


def _user_steps(buffer, state, values, *, last):
  """The user's own steps of one env, obs `values`, `last` on the final one
  when `last`."""
  count = len(values)
  return buffer.add(
    state,
    jaxbuf.EpisodeStep(
      obs=jax.tree.map(lambda x: x[None], _goal_obs(values)),
      action=np.zeros((1, count), np.int32),
      reward=np.zeros((1, count), np.float32),
      terminated=np.zeros((1, count), bool),
      truncated=np.zeros((1, count), bool),
      last=(np.arange(count) == count - 1)[None] & last,
    ),
  )


@pytest.mark.parametrize("kind", sorted(HELD_DATA_KINDS))
def test_loading_into_a_stream_with_a_running_episode_is_refused(kind):
  """The dataset's first episode was glued onto the user's running one
  ([-1, -2, -3, 10, 11, 12, 13] written back as one episode)."""
  buffer = HELD_DATA_KINDS[kind]()
  state = buffer.init(jaxbuf.offline_example(DATASET, buffer))
  state = _user_steps(buffer, state, [-1, -2, -3], last=False)
  before = jax.tree.map(np.array, state)
  with pytest.raises(
    ValueError,
    match=r"from_rlds_steps: env 0 of the state "
    r"holds a running episode \(3 steps since its last episode "
    r"end\); .* Add its final step first .*nothing was added",
  ):
    jaxbuf.from_rlds_steps(DATASET, buffer, state)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(got), want)
  # Ended by its final step, the user's episode and the dataset's stay apart.
  state = _user_steps(buffer, state, [-4], last=True)
  state = jaxbuf.from_rlds_steps(DATASET, buffer, state)
  written = [
    episode.observations["observation"][:, 0].tolist()
    for episode in jaxbuf.held_episodes(buffer, state)
  ]
  assert written == [[-1, -2, -3, -4], [10, 11, 12, 13, 14], [15, 16, 17, 18]]


def _user_items(buffer, state, values, *, ended):
  count = len(values) - 1
  obs = _goal_obs(values)
  return buffer.add(
    state,
    jaxbuf.Transition(
      obs=jax.tree.map(lambda x: x[:-1], obs),
      action=np.zeros(count, np.int32),
      reward=np.zeros(count, np.float32),
      next_obs=jax.tree.map(lambda x: x[1:], obs),
      terminated=(np.arange(count) == count - 1) & ended,
      truncated=np.zeros(count, bool),
    ),
  )


def test_loading_into_items_with_a_running_episode_is_refused():
  """7 transitions in 2 episodes into a uniform_replay(8) holding 2 of the
  user's items: the ring wrapped onto a user item, and the dataset's whole
  first episode (10..14) was dropped on writing back."""
  buffer = jaxbuf.uniform_replay(8)
  state = buffer.init(jaxbuf.offline_example(DATASET, buffer))
  state = _user_items(buffer, state, [-1, -2, -3], ended=False)
  with pytest.raises(
    ValueError,
    match=r"from_rlds_steps: the state's newest item "
    r"\(slot 1\) neither terminated nor truncated: it holds a "
    r"running episode \(2 items since the last end\)",
  ):
    jaxbuf.from_rlds_steps(DATASET, buffer, state)
  assert int(state.size) == 2
  # The user's episode ended: the ring wraps onto its first item, and every
  # whole episode it holds is written back.
  state = _user_items(
    buffer, buffer.init(jaxbuf.offline_example(DATASET, buffer)), [-1, -2, -3], ended=True
  )
  state = jaxbuf.from_rlds_steps(DATASET, buffer, state)
  assert int(state.add_count) == 9
  written = [
    episode.observations["observation"][:, 0].tolist()
    for episode in jaxbuf.held_episodes(buffer, state)
  ]
  assert written == [[10, 11, 12, 13, 14], [15, 16, 17, 18]]


def test_writing_values_outside_the_spaces_is_refused(datasets):
  """Actions 0..2 were written under Discrete(2), observations 100..105
  under Box(-1, 1): Minari's own `contains` is False for them."""
  del datasets  # sets MINARI_DATASETS_PATH
  steps = {
    "observation": np.arange(100, 106, dtype=np.float32)[:, None],
    "action": np.array([0, 1, 2, 0, 0, 0], np.int32),
    "reward": np.zeros(6, np.float32),
    "is_first": np.array([1, 0, 0, 0, 0, 0], bool),
    "is_last": np.array([0, 0, 0, 0, 0, 1], bool),
    "is_terminal": np.array([0, 0, 0, 0, 0, 1], bool),
  }
  buffer = jaxbuf.sequence_replay(1, 16, 2)
  state = jaxbuf.from_rlds_steps(steps, buffer, buffer.init(jaxbuf.offline_example(steps, buffer)))
  dataset_id = f"test/bad/spaces{64 if jax.config.jax_enable_x64 else 32}-v0"
  cases = [
    (
      _box((1,)),
      gymnasium.spaces.Discrete(3),
      r"observations: \[100.0\] at step 0 of episode 0 of the state is not in "
      r"the space Box\(-1.0, 1.0, \(1,\), float32\)",
    ),
    (
      gymnasium.spaces.Box(0, 200, (1,), np.float32),
      gymnasium.spaces.Discrete(2),
      r"actions: 2 at step 2 of episode 0 of the state is not in the space "
      r"Discrete\(2\)",
    ),
  ]
  for observation_space, action_space, match in cases:
    with pytest.raises(ValueError, match=match):
      jaxbuf.to_minari(
        dataset_id, buffer, state, observation_space=observation_space, action_space=action_space
      )
    assert dataset_id not in minari.list_local_datasets()
  written = jaxbuf.to_minari(
    dataset_id,
    buffer,
    state,
    observation_space=gymnasium.spaces.Box(100, 105, (1,), np.float32),
    action_space=gymnasium.spaces.Discrete(3),
  )
  episode = next(written.iterate_episodes())
  assert all(written.observation_space.contains(o) for o in episode.observations)
  assert all(written.action_space.contains(a) for a in episode.actions)


@pytest.mark.parametrize("kind", sorted(HELD_DATA_KINDS))
def test_a_ring_that_wrapped_at_an_episode_start_writes_that_episode_back(kind):
  """8 steps per env, episodes of 3 steps + final step: the third overwrote
  the first exactly, so the second is held whole. Kinds that record where
  episodes start (frame-stack, hindsight, episode replay) write it back;
  the others cannot tell it from a cut one, and keep only what follows."""
  buffer = HELD_DATA_KINDS[kind](8)
  state = buffer.init(jaxbuf.offline_example(DATASET, buffer))
  for first in (0, 10, 20):
    state = _user_steps(buffer, state, [first, first + 1, first + 2, first + 3], last=True)
  written = [
    episode.observations["observation"][:, 0].tolist()
    for episode in jaxbuf.held_episodes(buffer, state)
  ]
  records_starts = kind in ("frame_stack", "hindsight", "episode")
  assert written == [[10, 11, 12, 13]] * records_starts + [[20, 21, 22, 23]]
  # One step more and the second episode is cut: never written.
  state = _user_steps(buffer, state, [30], last=False)
  written = [
    episode.observations["observation"][:, 0].tolist()
    for episode in jaxbuf.held_episodes(buffer, state)
  ]
  assert written == [[20, 21, 22, 23]]


def test_episode_replay_writes_back_every_whole_episode_it_samples():
  """Row `episode-replay-held-after-wrap`: an episode_replay(1, 10, 5) given
  three 5-step episodes (four transitions and a final step each) holds the
  second and third whole and samples both; held_episodes returned only the
  third. Episode replay now records where episodes start, as frame-stack
  replay does (`streams/episode_starts.py`)."""
  buffer = jaxbuf.episode_replay(1, 10, 5)
  flags = np.zeros((1, 5), bool)
  state = buffer.init(
    jaxbuf.EpisodeStep(*(np.zeros((), dtype) for dtype in [np.float32] * 3 + [bool] * 3))
  )
  for first in (0, 10, 20):
    obs = np.arange(first, first + 5, dtype=np.float32)[None]
    last = np.array([[False] * 4 + [True]])
    zeros = np.zeros((1, 5), np.float32)
    state = buffer.add(state, jaxbuf.EpisodeStep(obs, zeros, zeros, flags, flags, last))
  sampled = np.asarray(buffer.sample(state, jax.random.key(0), 64).items.obs[:, 0])
  assert set(sampled.tolist()) == {10.0, 20.0}
  written = [episode.observations.tolist() for episode in jaxbuf.held_episodes(buffer, state)]
  assert written == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]


@pytest.mark.parametrize("field", ["reward", "is_last"])
def test_rlds_steps_of_another_rank_are_refused_before_the_first_add(field):
  """A reward [T, 1] raised NumPy's "could not broadcast input array from
  shape (3,1) into shape (3,)", with the state passed in deleted."""
  steps = {
    "observation": np.zeros((3, 2), np.float32),
    "action": np.zeros(3, np.int32),
    "reward": np.zeros(3, np.float32),
    "is_first": np.array([1, 0, 0], bool),
    "is_last": np.array([0, 0, 1], bool),
    "is_terminal": np.array([0, 0, 1], bool),
  }
  buffer = jaxbuf.sequence_replay(1, 8, 2)
  state = buffer.init(jaxbuf.offline_example(steps, buffer))
  steps[field] = steps[field][:, None]
  with pytest.raises(
    ValueError,
    match=rf"from_rlds_steps: {field} has shape "
    rf"\(3, 1\); RLDS steps hold one scalar per step",
  ):
    jaxbuf.from_rlds_steps(steps, buffer, state)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_a_load_that_fails_part_way_says_the_state_was_consumed(datasets):
  """A from_minari failing at a chunk consumed the state passed in without a
  word, and the next sample spoke of an "earlier call" that returned
  nothing; held_episodes, to_rlds_steps and to_minari of it raised
  `RuntimeError: Array has been deleted`."""
  del datasets  # sets MINARI_DATASETS_PATH
  # NaN where an integer is due fails in either mode (a float64 reward of
  # 0.1 would load exactly into the float64 rewards of 64-bit mode).
  episodes = [_episode(2), _episode(2, actions=np.array([np.nan, 0.0]))]
  dataset = _write("consumed", episodes, _box((3,)), gymnasium.spaces.Discrete(2))
  buffer = jaxbuf.sequence_replay(1, 16, 2)
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  with pytest.raises(
    ValueError,
    match=r"actions: nan at step 0 of episode 1 .* The state "
    r"passed to from_minari was consumed \(its arrays are "
    r"deleted.*make a new one with buffer.init",
  ):
    jaxbuf.from_minari(dataset, buffer, state, chunk_size=3)
  donated = r"the state passed in was donated to an earlier call.*from_minari"
  with pytest.raises(ValueError, match="sample: " + donated):
    buffer.sample(state, jax.random.key(0), 2)
  for call, name in (
    (lambda: jaxbuf.held_episodes(buffer, state), "held_episodes"),
    (lambda: jaxbuf.to_rlds_steps(buffer, state), "to_rlds_steps"),
    (
      lambda: jaxbuf.to_minari(
        "test/bad/consumed-out-v0",
        buffer,
        state,
        observation_space=_box((3,)),
        action_space=gymnasium.spaces.Discrete(2),
      ),
      "to_minari",
    ),
    (lambda: jaxbuf.from_minari(dataset, buffer, state), "from_minari"),
  ):
    with pytest.raises(ValueError, match=f"{name}: " + donated):
      call()
