"""`jaxbuf.VectorEnvRecorder` on real gymnasium vector envs, both autoreset
modes, item and stream kinds.

The proof that no reset is stored as a transition comes from an env of our
own whose observations say where they are, `[env, episode, t, previous
action]`, and which logs every transition it really makes: what a buffer
holds must be exactly that log, no row more, no row less, final
observations, rewards, terminated and truncated included. CartPole checks
the same on a physics env: every stored next observation follows its
observation by CartPole's Euler step, which a reset observation does not.
The exact checks run with and without 64-bit mode (`x64_mode`: int64
actions are held as int32 or int64); the rest in the default mode only.
"""

import inspect

import gymnasium as gym
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import jaxbuf

MODES = {"next_step": AutoresetMode.NEXT_STEP, "same_step": AutoresetMode.SAME_STEP}
TIME_LIMIT = 5
NUM_ENVS = 3


def episode_length(env_id: int, episode: int) -> int:
  """Steps until the env terminates episode `episode`: 1 to 7, so some
  episodes end after one step, some with both flags (at 5), and those
  longer than 5 are truncated by the time limit."""
  return 1 + (3 * episode + env_id) % 7


def expected_reward(episode: int, t: int, action: int) -> float:
  return 100.0 * episode + 10.0 * t + action


class WhereEnv(gym.Env):
  """Observations `[env, episode, t, previous action]` (-1 after a reset);
  `log` holds every transition it makes, as the tuple a stored transition
  must give: (obs, action, reward, next_obs, terminated, truncated)."""

  observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
  action_space = gym.spaces.Discrete(3)

  def __init__(self, env_id: int, time_limit: int = TIME_LIMIT):
    self.env_id = env_id
    self.time_limit = time_limit
    self.episode = -1
    self.t = 0
    self.obs = None
    self.log = []

  def _observation(self, action: int) -> np.ndarray:
    return np.array([self.env_id, self.episode, self.t, action], np.float32)

  def reset(self, *, seed=None, options=None):
    super().reset(seed=seed)
    self.episode += 1
    self.t = 0
    self.obs = self._observation(-1)
    return self.obs, {}

  def step(self, action):
    action = int(action)
    reward = expected_reward(self.episode, self.t, action)
    self.t += 1
    terminated = self.t == episode_length(self.env_id, self.episode)
    next_obs = self._observation(action)
    # The time limit's own flag, as gymnasium's TimeLimit (around this env)
    # will return it.
    truncated = self.t >= self.time_limit
    self.log.append((tuple(self.obs), action, reward, tuple(next_obs), terminated, truncated))
    self.obs = next_obs
    return next_obs, reward, terminated, False, {}


def where_envs(
  mode: AutoresetMode, num_envs: int = NUM_ENVS, time_limit: int = TIME_LIMIT
) -> gym.vector.SyncVectorEnv:
  return gym.vector.SyncVectorEnv(
    [
      lambda i=i: gym.wrappers.TimeLimit(WhereEnv(i, time_limit), time_limit)
      for i in range(num_envs)
    ],
    autoreset_mode=mode,
  )


def logs(envs) -> list[list[tuple]]:
  return [env.unwrapped.log for env in envs.unwrapped.envs]


def started(envs, buffer, seed: int = 0) -> tuple:
  """A recorder of `envs` into `buffer`, reset, and the buffer's empty state."""
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state = buffer.init(recorder.example)
  obs, _ = envs.reset(seed=seed)
  recorder.reset(obs)
  return recorder, state


def run(envs, recorder, state, steps: int, seed: int = 0):
  """Random actions for `steps` vector steps; returns the state and the
  number of episode ends seen."""
  obs, _ = envs.reset(seed=seed)
  envs.action_space.seed(seed)
  recorder.reset(obs)
  ends = 0
  for _ in range(steps):
    actions = envs.action_space.sample()
    next_obs, rewards, terminated, truncated, info = envs.step(actions)
    state = recorder.add(state, actions, next_obs, rewards, terminated, truncated, info)
    ends += int((terminated | truncated).sum())
  return state, ends


def as_tuples(obs, action, reward, next_obs, terminated, truncated):
  return [
    (
      tuple(np.asarray(o, np.float32)),
      int(a),
      float(r),
      tuple(np.asarray(n, np.float32)),
      bool(te),
      bool(tr),
    )
    for o, a, r, n, te, tr in zip(obs, action, reward, next_obs, terminated, truncated, strict=True)
  ]


def stored_transitions(buffer, state) -> list[tuple]:
  """Every transition a buffer holds: item rows, or the whole episodes of a
  stream kind (`held_episodes`) as one-step transitions."""
  if buffer.kind.name in ("uniform_replay", "prioritized_replay"):
    return as_tuples(*(leaf[: int(state.size)] for leaf in jax.device_get(state.storage)))
  return [
    t
    for episode in jaxbuf.held_episodes(buffer, state)
    for t in as_tuples(
      episode.observations[:-1],
      episode.actions,
      episode.rewards,
      episode.observations[1:],
      episode.terminations,
      episode.truncations,
    )
  ]


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_items_are_exactly_the_envs_transitions(mode, kind):
  envs = where_envs(MODES[mode])
  buffer = jaxbuf.uniform_replay(1000) if kind == "uniform" else jaxbuf.prioritized_replay(1000)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  assert recorder.autoreset_mode == MODES[mode]
  state, ends = run(envs, recorder, buffer.init(recorder.example), 60)
  stored = jax.device_get(state.storage)
  size = int(state.size)
  got = as_tuples(*(leaf[:size] for leaf in stored))
  made = [t for log in logs(envs) for t in log]
  # The same transitions, each once: nothing missing, no reset, and with
  # the true final observation, reward and both flags.
  assert sorted(got) == sorted(made)
  assert ends > 10
  assert any(t[4] and not t[5] for t in got)  # terminated only
  assert any(t[5] and not t[4] for t in got)  # truncated only
  assert any(t[4] and t[5] for t in got)  # both
  for obs, action, reward, next_obs, terminated, truncated in got:
    env, episode, t, _ = obs
    assert next_obs == (env, episode, t + 1, action)
    assert reward == expected_reward(episode, t, action)
    assert terminated == (t + 1 == episode_length(int(env), int(episode)))
    assert truncated == (t + 1 >= TIME_LIMIT)
  envs.close()


STREAM_KINDS = {
  "sequence": lambda: jaxbuf.sequence_replay(NUM_ENVS, NUM_ENVS * 200, 2),
  "prioritized_sequence": lambda: jaxbuf.prioritized_sequence_replay(NUM_ENVS, NUM_ENVS * 200, 2),
  "episode": lambda: jaxbuf.episode_replay(NUM_ENVS, NUM_ENVS * 200, 8),
}


def final_steps_taken(buffer: jaxbuf.Buffer) -> None:
  """Skips a test of a stream kind whose add does not take final_steps yet
  (issue 32 gives every stream kind the one add sequence replay has)."""
  if "final_steps" not in inspect.signature(buffer.add).parameters:
    pytest.skip(f"{buffer.kind.name}'s add takes no final_steps yet")


# One buffer per number of envs for all examples, so that each add shape
# compiles once.
PROPERTY_BUFFERS = {num_envs: jaxbuf.uniform_replay(512) for num_envs in range(1, 5)}


@hypothesis.given(
  mode=st.sampled_from(list(MODES.values())),
  num_envs=st.integers(1, 4),
  time_limit=st.integers(1, 8),
  steps=st.integers(0, 25),
  seed=st.integers(0, 2**16),
  partial_reset_at=st.one_of(st.none(), st.integers(0, 25)),
)
@hypothesis.settings(max_examples=25)
def test_any_run_stores_exactly_the_envs_transitions(
  mode, num_envs, time_limit, steps, seed, partial_reset_at
):
  """Any mode, number of envs, time limit and run length, with or without
  a partial reset (gymnasium's reset_mask) on the way: the items held are
  the env's log, each transition once."""
  envs = where_envs(mode, num_envs, time_limit)
  buffer = PROPERTY_BUFFERS[num_envs]
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state = buffer.init(recorder.example)
  rng = np.random.default_rng(seed)
  obs, _ = envs.reset(seed=seed)
  recorder.reset(obs)
  for step in range(steps):
    if step == partial_reset_at:
      mask = rng.random(num_envs) < 0.5
      mask[rng.integers(num_envs)] = True  # gymnasium needs one env reset
      obs, _ = envs.reset(options={"reset_mask": mask})
      recorder.reset(obs, reset_mask=mask)
    actions = rng.integers(0, 3, num_envs)
    state = recorder.add(state, actions, *envs.step(actions))
  got = as_tuples(*(leaf[: int(state.size)] for leaf in jax.device_get(state.storage)))
  assert sorted(got) == sorted(t for log in logs(envs) for t in log)
  envs.close()


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_streams_hold_exactly_the_envs_episodes(mode, kind):
  envs = where_envs(MODES[mode])
  buffer = STREAM_KINDS[kind]()
  final_steps_taken(buffer)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state, _ = run(envs, recorder, buffer.init(recorder.example), 60)
  held = jaxbuf.held_episodes(buffer, state)
  got = stored_transitions(buffer, state)
  # Every episode that ended, whole, in order, env by env; the running
  # ones are not written back.
  made = []
  for log in logs(envs):
    ended = max(i for i, t in enumerate(log) if t[4] or t[5])
    made += log[: ended + 1]
  assert got == made
  assert len(held) > 10
  envs.close()


def jitted_add(buffer: jaxbuf.Buffer) -> tuple:
  """A jitted `recorded.add_to(buffer, state)` and the list of its traces."""
  traces = []

  @jax.jit
  def add(state, recorded):
    traces.append(recorded)
    return recorded.add_to(buffer, state)

  return add, traces


@pytest.mark.parametrize("mode", MODES)
def test_streams_add_with_one_compilation_and_items_with_at_most_n(mode):
  """Stream adds have fixed shapes; item adds drop NEXT_STEP's reset rows,
  so each add batch size is one compilation, at most N of them."""
  for buffer in (jaxbuf.sequence_replay(NUM_ENVS, NUM_ENVS * 64, 2), jaxbuf.uniform_replay(256)):
    envs = where_envs(MODES[mode])
    recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
    add, traces = jitted_add(buffer)
    state = buffer.init(recorder.example)
    obs, _ = envs.reset(seed=1)
    recorder.reset(obs)
    for _ in range(40):
      actions = envs.action_space.sample()
      state = add(state, recorder.record(actions, *envs.step(actions)))
    streams = isinstance(recorder.example, jaxbuf.EpisodeStep)
    if streams or mode == "same_step":
      assert len(traces) == 1
    else:
      assert 1 < len(traces) <= NUM_ENVS + 1  # + 1: a step of only resets
    envs.close()


def cartpole_envs(mode: AutoresetMode, num_envs: int = 4):
  return gym.vector.SyncVectorEnv(
    [lambda: gym.make("CartPole-v1", max_episode_steps=15)] * num_envs, autoreset_mode=mode
  )


def check_cartpole_transitions(obs, next_obs, terminated):
  # CartPole's Euler step (tau = 0.02): true of every real transition, the
  # final one included, and not of a reset observation.
  np.testing.assert_allclose(next_obs[:, 0], obs[:, 0] + 0.02 * obs[:, 1], atol=1e-6)
  np.testing.assert_allclose(next_obs[:, 2], obs[:, 2] + 0.02 * obs[:, 3], atol=1e-6)
  fell = (np.abs(next_obs[:, 0]) > 2.4) | (np.abs(next_obs[:, 2]) > 12 * 2 * np.pi / 360)
  np.testing.assert_array_equal(terminated, fell)


@pytest.mark.parametrize("mode", MODES)
def test_cartpole_items(mode):
  envs = cartpole_envs(MODES[mode])
  buffer = jaxbuf.uniform_replay(2000)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  steps = 150
  state, ends = run(envs, recorder, buffer.init(recorder.example), steps)
  items = jax.device_get(state.storage)
  size = int(state.size)
  items = jax.tree.map(lambda leaf: leaf[:size], items)
  check_cartpole_transitions(items.obs, items.next_obs, items.terminated)
  assert items.terminated.any() and items.truncated.any()
  if mode == "same_step":
    assert size == steps * 4
  else:  # one reset step per episode end, but for ends on the last step
    assert steps * 4 - ends <= size < steps * 4 - ends + 4
  envs.close()


@pytest.mark.parametrize("mode", MODES)
def test_cartpole_sequence_windows(mode):
  envs = cartpole_envs(MODES[mode])
  buffer = jaxbuf.sequence_replay(4, 4 * 200, 2)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state, _ = run(envs, recorder, buffer.init(recorder.example), 150)
  sample = buffer.sample(state, jax.random.key(0), 512)
  steps = jax.device_get(sample.items)
  # A window of two steps is a transition where its first step is not an
  # episode's final step: the second then holds the next observation.
  is_transition = ~steps.last[:, 0]
  assert is_transition.sum() > 300 and (~is_transition).any()
  check_cartpole_transitions(
    steps.obs[is_transition, 0], steps.obs[is_transition, 1], steps.terminated[is_transition, 0]
  )
  np.testing.assert_array_equal(
    steps.last[is_transition, 1],
    steps.terminated[is_transition, 0] | steps.truncated[is_transition, 0],
  )
  envs.close()


@pytest.mark.parametrize("mode", MODES)
def test_frame_stacks_are_the_envs_frames(mode):
  """Both stacks of every sampled transition hold frames of its own episode,
  oldest first, zeros before its first step; the newest frames are one real
  transition of the env, with its reward and a discount of 0 exactly after
  a termination."""
  num_stack, gamma = 3, 0.5
  buffer = jaxbuf.frame_stack_replay(NUM_ENVS, NUM_ENVS * 64, num_stack, gamma=gamma)
  final_steps_taken(buffer)
  envs = where_envs(MODES[mode])
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state, _ = run(envs, recorder, buffer.init(recorder.example), 40)
  batch = jax.device_get(buffer.sample(state, jax.random.key(0), 256).items)
  obs = np.moveaxis(batch.obs, -1, 1)  # [S, K, 4], oldest first
  next_obs = np.moveaxis(batch.next_obs, -1, 1)
  env, episode, t, _ = obs[:, -1].T
  np.testing.assert_array_equal(next_obs[:, -1].T, [env, episode, t + 1, batch.action])
  np.testing.assert_array_equal(batch.reward, expected_reward(episode, t, batch.action))
  terminated = t + 1 == episode_length(env.astype(int), episode.astype(int))
  assert terminated.any() and not terminated.all()
  np.testing.assert_array_equal(batch.discount, np.where(terminated, 0.0, gamma))
  for stack, newest in ((obs, t), (next_obs, t + 1)):
    for k in range(num_stack):
      frame_t = newest - (num_stack - 1 - k)
      before = frame_t < 0
      np.testing.assert_array_equal(stack[before, k], 0)
      np.testing.assert_array_equal(
        stack[~before, k, :3], np.stack([env, episode, frame_t], axis=1)[~before]
      )
  envs.close()


def test_same_seed_gives_the_same_transitions_in_both_modes():
  """The modes differ only in when the reset happens: same seed, same
  actions, the same items in the same order."""
  stored = []
  for mode in MODES.values():
    envs = cartpole_envs(mode, num_envs=1)
    buffer = jaxbuf.uniform_replay(1000)
    recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
    state = buffer.init(recorder.example)
    obs, _ = envs.reset(seed=3)
    recorder.reset(obs)
    rng = np.random.default_rng(0)
    resetting = False
    while int(state.size) < 100:
      # A reset step ignores its action: draw none for it, so both modes
      # see the same actions on their real steps.
      actions = np.zeros(1, np.int64) if resetting else rng.integers(0, 2, 1)
      step = envs.step(actions)
      state = recorder.add(state, actions, *step)
      resetting = mode == AutoresetMode.NEXT_STEP and bool(step[2] | step[3])
    stored.append(jax.device_get(state.storage))
    envs.close()
  for same_step, next_step in zip(
    jax.tree.leaves(stored[0]), jax.tree.leaves(stored[1]), strict=True
  ):
    np.testing.assert_array_equal(same_step, next_step)


def test_dict_observations_and_copy_false():
  """A Dict space's final observations are restored leaf by leaf, and an
  env returning one shared array (copy=False) does not alias the stored
  observations."""

  def make():
    return gym.wrappers.TransformObservation(
      gym.make("CartPole-v1", max_episode_steps=6),
      lambda obs: {"x": obs[:2], "theta": obs[2:]},
      gym.spaces.Dict(
        {
          "x": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
          "theta": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
        }
      ),
    )

  for mode in MODES.values():
    envs = gym.vector.SyncVectorEnv([make] * 2, autoreset_mode=mode, copy=False)
    buffer = jaxbuf.uniform_replay(500)
    recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
    state, ends = run(envs, recorder, buffer.init(recorder.example), 40)
    size = int(state.size)
    items = jax.tree.map(lambda leaf, size=size: leaf[:size], jax.device_get(state.storage))
    assert ends > 5
    check_cartpole_transitions(
      np.concatenate([items.obs["x"], items.obs["theta"]], axis=1),
      np.concatenate([items.next_obs["x"], items.next_obs["theta"]], axis=1),
      items.terminated,
    )
    envs.close()


# --- What the recorder refuses ------------------------------------------------


def test_refuses_the_disabled_mode():
  envs = where_envs(AutoresetMode.DISABLED)
  with pytest.raises(ValueError, match="autoreset mode is .*DISABLED.*caller resets"):
    jaxbuf.VectorEnvRecorder(envs, jaxbuf.uniform_replay(8))


class Relabelled(gym.vector.VectorWrapper):
  """A vector env whose metadata says what we like."""

  def __init__(self, env, metadata):
    super().__init__(env)
    self.metadata = metadata


def test_an_env_without_a_mode_needs_one_given():
  envs = Relabelled(where_envs(AutoresetMode.NEXT_STEP), {})
  buffer = jaxbuf.uniform_replay(64)
  with pytest.raises(ValueError, match="metadata names no autoreset_mode"):
    jaxbuf.VectorEnvRecorder(envs, buffer)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer, autoreset_mode=AutoresetMode.NEXT_STEP)
  state, _ = run(envs, recorder, buffer.init(recorder.example), 20)
  assert int(state.size) == sum(map(len, logs(envs)))
  with pytest.raises(
    ValueError,
    match="autoreset_mode=.*SAME_STEP was given, but the env's metadata says .*NEXT_STEP",
  ):
    jaxbuf.VectorEnvRecorder(where_envs(AutoresetMode.NEXT_STEP), buffer, autoreset_mode="SameStep")


def test_a_same_step_env_labelled_next_step_is_refused():
  envs = Relabelled(
    where_envs(AutoresetMode.SAME_STEP), {"autoreset_mode": AutoresetMode.NEXT_STEP}
  )
  buffer = jaxbuf.uniform_replay(64)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  with pytest.raises(ValueError, match="info holds final_obs, which only"):
    run(envs, recorder, buffer.init(recorder.example), 20)


def test_same_step_without_the_final_observation_is_refused():
  envs = where_envs(AutoresetMode.SAME_STEP)
  buffer = jaxbuf.sequence_replay(NUM_ENVS, NUM_ENVS * 8, 2)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  obs, _ = envs.reset(seed=0)
  recorder.reset(obs)
  actions = np.zeros(NUM_ENVS, np.int64)
  next_obs, rewards, terminated, truncated, _ = envs.step(actions)
  assert terminated[0]  # env 0's first episode is one step long
  with pytest.raises(ValueError, match="env 0 ended its episode, but info has no final_obs"):
    recorder.record(actions, next_obs, rewards, terminated, truncated, {})


def test_an_end_on_a_reset_step_is_refused():
  envs = where_envs(AutoresetMode.NEXT_STEP)
  recorder = jaxbuf.VectorEnvRecorder(envs, jaxbuf.uniform_replay(8))
  recorder.reset(np.zeros((NUM_ENVS, 4), np.float32))
  step = (
    np.zeros(NUM_ENVS, np.int64),
    np.zeros((NUM_ENVS, 4), np.float32),
    np.zeros(NUM_ENVS),
    np.array([False, True, False]),
    np.zeros(NUM_ENVS, bool),
    {},
  )
  recorder.record(*step)
  with pytest.raises(ValueError, match="env 1 ended its episode on the step after an episode end"):
    recorder.record(*step)


def test_misuse_is_refused_with_its_reason():
  envs = where_envs(AutoresetMode.NEXT_STEP)
  recorder = jaxbuf.VectorEnvRecorder(envs, jaxbuf.uniform_replay(8))
  step = (
    np.zeros(NUM_ENVS, np.int64),
    np.zeros((NUM_ENVS, 4), np.float32),
    np.zeros(NUM_ENVS),
    np.zeros(NUM_ENVS, bool),
    np.zeros(NUM_ENVS, bool),
    {},
  )
  with pytest.raises(RuntimeError, match=r"call reset\(obs\)"):
    recorder.record(*step)
  recorder.reset(np.zeros((NUM_ENVS, 4), np.float32))
  with pytest.raises(
    ValueError,
    match=r"terminated must be bool \[3\], "
    r"given int64 \[3\]",
  ):
    recorder.record(*step[:3], np.zeros(NUM_ENVS, np.int64), *step[4:])
  with pytest.raises(TypeError, match="holds neither items .* given a RolloutBuffer"):
    jaxbuf.VectorEnvRecorder(envs, jaxbuf.rollout_buffer(4, NUM_ENVS))
  # A sharded item buffer is refused whatever its device count: one device
  # (all a single-GPU machine shows) is enough to build it.
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="sharded item replay"):
    jaxbuf.VectorEnvRecorder(envs, jaxbuf.sharded(jaxbuf.uniform_replay(8), mesh, axis="data"))


def test_partial_reset_keeps_the_pending_reset_steps():
  """gymnasium's reset_mask: the envs reset start afresh; an env not reset
  whose episode ended still spends its next step on the reset."""
  envs = where_envs(AutoresetMode.NEXT_STEP)
  buffer = jaxbuf.uniform_replay(256)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state = buffer.init(recorder.example)
  obs, _ = envs.reset(seed=0)
  recorder.reset(obs)
  actions = np.zeros(NUM_ENVS, np.int64)
  for _ in range(2):  # env 0 ends at its first step, env 1 at its second
    state = recorder.add(state, actions, *envs.step(actions))
  mask = np.array([True, False, True])
  obs, _ = envs.reset(options={"reset_mask": mask})
  recorder.reset(obs, reset_mask=mask)
  for _ in range(6):
    state = recorder.add(state, actions, *envs.step(actions))
  got = as_tuples(*(leaf[: int(state.size)] for leaf in jax.device_get(state.storage)))
  assert sorted(got) == sorted(t for log in logs(envs) for t in log)


# --- The ported loops the docs show -------------------------------------------


def test_the_ported_cleanrl_loop_runs():
  """CleanRL's dqn.py loop with jaxbuf, as the host-loop docs show it (their
  sizes here cut down): the recorder in place of `real_next_obs` and
  `rb.add`, `buffer.sample(..., step=)` in place of `rb.sample`."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  total_steps, learning_starts, batch_size = 300, 100, 32
  envs = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
  buffer = jaxbuf.uniform_replay(10_000)  # rb = ReplayBuffer(...)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  state = buffer.init(recorder.example)  # a jaxbuf.Transition of zeros
  network = nn.Sequential([nn.Dense(120), nn.relu, nn.Dense(84), nn.relu, nn.Dense(2)])
  optimizer = optax.adam(2.5e-4)

  @jax.jit
  def update(params, target_params, opt_state, batch):
    def loss(params):
      q = network.apply(params, batch.obs)
      q_taken = jnp.take_along_axis(q, batch.action[:, None], -1)[:, 0]
      next_q = network.apply(target_params, batch.next_obs).max(-1)
      target = batch.reward + 0.99 * next_q * (1.0 - batch.terminated)
      return jnp.mean((q_taken - jax.lax.stop_gradient(target)) ** 2)

    updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state)
    return optax.apply_updates(params, updates), opt_state

  q_values = jax.jit(network.apply)
  obs, _ = envs.reset(seed=0)
  recorder.reset(obs)
  params = target_params = network.init(jax.random.key(0), obs)
  opt_state = optimizer.init(params)
  sample_key, rng = jax.random.key(1), np.random.default_rng(0)
  for global_step in range(total_steps):
    if rng.random() < 0.1:
      actions = envs.action_space.sample()
    else:
      actions = np.asarray(q_values(params, obs).argmax(-1))
    next_obs, rewards, terminations, truncations, infos = envs.step(actions)
    # rb.add(obs, real_next_obs, actions, rewards, terminations, infos):
    state = recorder.add(state, actions, next_obs, rewards, terminations, truncations, infos)
    obs = next_obs
    if global_step > learning_starts and global_step % 4 == 0:
      # data = rb.sample(batch_size):
      batch = buffer.sample(state, sample_key, batch_size, step=global_step).items
      params, opt_state = update(params, target_params, opt_state, batch)
    if global_step % 100 == 0:
      target_params = params
  envs.close()
  assert 0 < int(state.size) <= 4 * total_steps
  assert np.isfinite(jax.tree.leaves(params)[0]).all()


# --- Reliability round 5 (issue 45): refused steps, mid-episode resets -------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["uniform", "sequence"])
def test_a_refused_step_leaves_the_recorder_as_it_was(mode, kind):
  """Row `recorder-refused-step`: float actions for a Discrete space make
  the buffer's add raise; the same step passed again, corrected, is stored
  as the env made it (every env's obs used to become that step's next
  observation)."""
  envs = where_envs(MODES[mode])
  buffer = jaxbuf.uniform_replay(256) if kind == "uniform" else STREAM_KINDS[kind]()
  recorder, state = started(envs, buffer)
  rng = np.random.default_rng(0)
  refused = 0
  for step in range(30):
    actions = rng.integers(0, 3, NUM_ENVS)
    result = envs.step(actions)
    if step % 4 == 1:
      try:
        # A NEXT_STEP step of only resets adds nothing, so nothing refuses it.
        state = recorder.add(state, actions.astype(np.float32), *result)
        continue
      except TypeError:
        refused += 1
    state = recorder.add(state, actions, *result)
  assert refused
  made = [t for log in logs(envs) for t in log]
  got = stored_transitions(buffer, state)
  assert got and set(got) <= set(made)
  if kind == "uniform":
    assert sorted(got) == sorted(made)
  envs.close()


class GoalWhereEnv(gym.ObservationWrapper):
  """WhereEnv's observation as a GoalEnv dict: the achieved goal is
  `[env, episode, t]`, the desired one `[env, episode, -1]`, so a relabelled
  goal names the episode it was taken from."""

  def __init__(self, env):
    super().__init__(env)
    goal = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    self.observation_space = gym.spaces.Dict(
      {"observation": env.observation_space, "achieved_goal": goal, "desired_goal": goal}
    )

  def observation(self, observation):
    desired = np.array([observation[0], observation[1], -1], np.float32)
    return {"observation": observation, "achieved_goal": observation[:3], "desired_goal": desired}


def goal_where_envs(mode: AutoresetMode) -> gym.vector.SyncVectorEnv:
  return gym.vector.SyncVectorEnv(
    [
      lambda i=i: GoalWhereEnv(gym.wrappers.TimeLimit(WhereEnv(i, 50), 50)) for i in range(NUM_ENVS)
    ],
    autoreset_mode=mode,
  )


def goal_reward(achieved, desired):
  return -jax.numpy.any(achieved != desired, axis=-1).astype(jax.numpy.float32)


def assert_one_episode_until_its_end(obs, last):
  """Windows `[S, L, 4]` of WhereEnv observations: consecutive steps belong
  to one (env, episode) unless the first of them is flagged `last`."""
  where = obs[..., :2]
  same = np.all(where[:, 1:] == where[:, :-1], axis=-1)
  crossing = ~same & ~last[:, :-1]
  assert not crossing.any(), f"{crossing.any(axis=1).sum()} windows join two episodes"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("partial", [True, False], ids=["reset_mask", "full_reset"])
def test_a_mid_episode_reset_ends_the_abandoned_episode(mode, partial):
  """Row `recorder-mid-episode-reset`: an env reset mid-episode (gymnasium's
  reset_mask, or a full reset) ends its abandoned episode in the stream at
  the observation it reached, as a truncation: sampled windows, n-step
  transitions, frame stacks and hindsight goals never join it to the next
  (39 of 512 windows did for one env reset, 127 for a full reset)."""
  time_limit = 50  # long episodes, so that the reset abandons them
  reset_mask = np.array([False, True, False]) if partial else None
  buffers = {
    "sequence": jaxbuf.sequence_replay(NUM_ENVS, NUM_ENVS * 64, 4),
    "frames": jaxbuf.frame_stack_replay(NUM_ENVS, NUM_ENVS * 64, 3),
    "hindsight": jaxbuf.hindsight_replay(NUM_ENVS, NUM_ENVS * 64, goal_reward),
  }
  for name, buffer in buffers.items():
    envs = (
      goal_where_envs(MODES[mode])
      if name == "hindsight"
      else where_envs(MODES[mode], time_limit=time_limit)
    )
    recorder, state = started(envs, buffer)
    actions = np.zeros(NUM_ENVS, np.int64)
    for step in range(24):
      if step in (5, 13):
        options = None if reset_mask is None else {"reset_mask": reset_mask}
        obs, _ = envs.reset(options=options)
        recorder.reset(obs, reset_mask=reset_mask)
      state = recorder.add(state, actions, *envs.step(actions))
    sample = jax.device_get(buffer.sample(state, jax.random.key(1), 512))
    items = sample.items
    if name == "sequence":
      assert_one_episode_until_its_end(items.obs, items.last)
      transitions = jaxbuf.n_step_transitions(
        items.obs, items.action, items.reward, items.terminated, items.last, n=3, gamma=0.9
      )
      valid = np.asarray(transitions.valid)
      np.testing.assert_array_equal(
        np.asarray(transitions.next_obs)[valid, :2], items.obs[valid, 0, :2]
      )
      # The abandoned episodes end as truncations: the final step holds
      # the observation the env reached, and the step before bootstraps.
      ended = items.last[:, 1:] & ~items.terminated[:, :-1]
      assert ended.any()
    elif name == "frames":
      for stack in (items.obs, items.next_obs):
        frames = np.moveaxis(stack, -1, 1)  # [S, K, 4], oldest first
        newest = frames[:, -1, :2]
        real = frames[..., 2] >= 0
        real &= np.any(frames != 0, axis=-1)
        for k in range(frames.shape[1]):
          np.testing.assert_array_equal(frames[real[:, k], k, :2], newest[real[:, k]])
      np.testing.assert_array_equal(items.next_obs[:, :2, -1], items.obs[:, :2, -1])
    else:
      goals = items.obs["desired_goal"]
      np.testing.assert_array_equal(goals[:, :2], items.obs["observation"][:, :2])
      np.testing.assert_array_equal(items.next_obs["observation"][:, :2], goals[:, :2])
      assert sample.relabelled.any()
    envs.close()


def test_info_none_and_malformed_final_observations_are_named():
  """Row `recorder-bad-info`: info None (read as {}); under SAME_STEP a Dict
  final observation lacking a key or with a leaf of another shape names the
  env and the leaf, and writes nothing (a missing key used to shift the
  leaves into the wrong ones)."""
  envs = where_envs(AutoresetMode.NEXT_STEP)
  buffer = jaxbuf.uniform_replay(64)
  recorder, state = started(envs, buffer)
  actions = np.zeros(NUM_ENVS, np.int64)
  next_obs, rewards, terminated, truncated, _ = envs.step(actions)
  state = recorder.add(state, actions, next_obs, rewards, terminated, truncated, None)
  assert int(state.size) == NUM_ENVS
  with pytest.raises(TypeError, match="info must be the dict"):
    recorder.add(state, actions, next_obs, rewards, terminated, truncated, [])
  envs.close()

  envs = goal_where_envs(AutoresetMode.SAME_STEP)
  buffer = jaxbuf.hindsight_replay(NUM_ENVS, NUM_ENVS * 64, goal_reward)
  recorder, state = started(envs, buffer)
  next_obs, rewards, terminated, _, _ = envs.step(actions)
  ended = np.ones(NUM_ENVS, np.bool_)
  final = {key: np.array(value[0]) for key, value in next_obs.items()}
  lacking = dict(final)
  del lacking["achieved_goal"]
  reshaped = dict(final, desired_goal=np.zeros(2, np.float32))
  for bad, words in ((lacking, "has the leaves"), (reshaped, "['desired_goal']")):
    bad_info = {
      "final_obs": np.array([bad] * NUM_ENVS, dtype=object),
      "_final_obs": ended,
    }
    with pytest.raises(ValueError, match="env 0") as raised:
      recorder.add(state, actions, next_obs, rewards, terminated, ended, bad_info)
    assert words in str(raised.value)
  envs.close()


def test_a_skipped_reset_step_is_refused_where_its_reward_shows_it():
  """Row `recorder-skipped-step`: under NEXT_STEP the step after an episode
  end is the reset (reward 0); a real step there (its reward not 0) means
  the reset step was never recorded, and is refused rather than dropped."""
  envs = where_envs(AutoresetMode.NEXT_STEP)
  buffer = jaxbuf.uniform_replay(64)
  recorder, state = started(envs, buffer)
  actions = np.ones(NUM_ENVS, np.int64)
  state = recorder.add(state, actions, *envs.step(actions))  # env 0 ends
  envs.step(actions)  # the reset step, not recorded
  with pytest.raises(ValueError, match="env 0 got reward .* was every step recorded"):
    recorder.add(state, actions, *envs.step(actions))
  envs.close()
