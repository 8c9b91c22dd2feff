"""Frame-stack replay against a plain NumPy model of per-env frame streams.

Every stored frame carries its absolute id (`env * 10000 + step + 1`, so 0 is
only ever padding), so each sampled stack is checked frame by frame: the
right frames, oldest first, padding exactly before the episode's first step.
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

NUM_ENVS, PER_ENV = 3, 8
CAPACITY = NUM_ENVS * PER_ENV
ALPHA, BETA, EPS, GAMMA = 0.7, 0.5, 1e-6, 0.9
STEP = {
  "obs": {"frame": jnp.zeros(2, jnp.int32), "tag": jnp.int32(0)},
  "action": jnp.int32(0),
  "reward": jnp.float32(0),
  "terminated": jnp.bool_(False),
}


@functools.cache
def make_buffer(prioritized, *args, **settings):
  """One buffer per setting for the whole file: each compiles once per shape."""
  if prioritized:
    return jaxbuf.prioritized_frame_stack_replay(*args, **settings)
  return jaxbuf.frame_stack_replay(*args, **settings)


class ReferenceFrames:
  """Per-env lists of every step ever added; transitions from scratch."""

  def __init__(self, num_envs, per_env, num_stack, n_step, *, pad, prioritized):
    self.num_envs, self.per_env = num_envs, per_env
    self.num_stack, self.n_step, self.pad = num_stack, n_step, pad
    self.prioritized = prioritized
    self.held = [0] * num_envs
    self.steps = [[] for _ in range(num_envs)]  # (end, reward, terminated)
    self.priorities = {}
    self.max_priority = 1.0

  def count(self, env):
    return len(self.steps[env])

  def frame(self, env, step):
    return env * 10000 + step + 1

  def add(self, mask, ends, rewards, terminated):
    for env in range(self.num_envs):
      if not mask[env]:
        continue
      for end, reward, term in zip(ends[env], rewards[env], terminated[env]):
        self.steps[env].append((bool(end), float(reward), bool(term)))
      self.held[env] = min(self.held[env] + len(ends[env]), self.per_env)
    self.priorities = {
      key: self.priorities.get(key, self.max_priority) for key in self.transitions().values()
    }

  def clear(self):
    self.held = [0] * self.num_envs
    self.priorities = {}
    self.max_priority = 1.0

  def episode_first(self, env, step):
    first = step
    while first > 0 and not self.steps[env][first - 1][0]:
      first -= 1
    return first

  def transitions(self):
    """{transition id: (env, step)} of every sampleable transition."""
    found = {}
    for env in range(self.num_envs):
      count, oldest = self.count(env), self.count(env) - self.held[env]
      for step in range(oldest, count):
        if self.steps[env][step][0]:
          continue
        # The target reads n steps, or up to its episode's final step.
        horizon = next(
          (j for j in range(1, self.n_step) if step + j < count and self.steps[env][step + j][0]),
          self.n_step,
        )
        if step + horizon >= count:
          continue
        history = min(step - self.episode_first(env, step), self.num_stack - 1)
        if step - history < oldest:
          continue
        found[env * self.per_env + step % self.per_env] = (env, step)
    return found

  def stack(self, env, step, first):
    frames = []
    for back in range(self.num_stack - 1, -1, -1):
      source = step - back
      if source >= first:
        frames.append(self.frame(env, source))
      else:
        frames.append(self.frame(env, first) if self.pad == "first" else 0)
    return frames

  def transition(self, env, step):
    """(obs stack, next stack, reward, discount, next step)."""
    reward, discount = 0.0, 1.0
    taken = self.n_step
    for offset in range(self.n_step):
      _, step_reward, term = self.steps[env][step + offset]
      reward += discount * step_reward
      if term:
        discount, taken = 0.0, offset + 1
        break
      discount *= GAMMA
      if self.steps[env][step + offset + 1][0]:
        taken = offset + 1
        break
    first = self.episode_first(env, step)
    return (
      self.stack(env, step, first),
      self.stack(env, step + taken, first),
      reward,
      discount,
      step + taken,
    )

  def leaves(self):
    leaves = np.zeros(self.num_envs * self.per_env)
    for transition_id, key in self.transitions().items():
      leaves[transition_id] = np.float32(self.priorities[key]) ** ALPHA if self.prioritized else 1.0
    return leaves

  def update(self, indices, priorities, item_ids):
    transitions = self.transitions()
    for index, priority, item_id in zip(indices, priorities, item_ids):
      key = transitions.get(int(index))
      if key is None or not np.isfinite(priority):
        continue
      if item_id is not None and key[1] % 2**32 != item_id:
        continue
      self.priorities[key] = float(np.float32(abs(priority)) + np.float32(EPS))
      self.max_priority = max(self.max_priority, self.priorities[key])


def make_steps(reference, length, rng):
  """Steps `[N, T]` whose frames continue each env's count."""
  ids = np.array(
    [
      [reference.frame(env, reference.count(env) + t) for t in range(length)]
      for env in range(reference.num_envs)
    ],
    np.int32,
  )
  ends = rng.random(ids.shape) < 0.25
  terminated = rng.random(ids.shape) < 0.15
  rewards = rng.integers(0, 4, ids.shape).astype(np.float32)
  steps = {
    "obs": {"frame": np.repeat(ids[..., None], 2, -1), "tag": ids},
    "action": ids,
    "reward": rewards,
    "terminated": terminated,
  }
  return steps, ends


def check_sample(sample, reference, batch_size):
  transitions = reference.transitions()
  items = jax.device_get(sample.items)
  assert items.obs["frame"].shape == (batch_size, 2, reference.num_stack)
  for row in range(batch_size):
    env, step = transitions[int(sample.indices[row])]
    obs, next_obs, reward, discount, next_step = reference.transition(env, step)
    for column in range(2):
      np.testing.assert_array_equal(items.obs["frame"][row, column], obs)
      np.testing.assert_array_equal(items.next_obs["frame"][row, column], next_obs)
    assert items.obs["tag"][row] == reference.frame(env, step)
    assert items.next_obs["tag"][row] == reference.frame(env, next_step)
    assert items.action[row] == reference.frame(env, step)
    np.testing.assert_allclose(items.reward[row], reward, rtol=1e-6)
    np.testing.assert_allclose(items.discount[row], discount, rtol=1e-6)
    assert int(sample.item_ids[row]) == step % 2**32
  if reference.prioritized:
    leaves = reference.leaves()
    probabilities = leaves[np.asarray(sample.indices)] / leaves.sum()
    raw = (len(transitions) * probabilities) ** -BETA
    np.testing.assert_allclose(sample.weights, raw / raw.max(), rtol=1e-4)
  else:
    np.testing.assert_array_equal(sample.weights, 1.0)


def check_state(state, reference):
  counts = np.zeros(reference.num_envs, int)
  for env, _ in reference.transitions().values():
    counts[env] += 1
  np.testing.assert_array_equal(state.window_counts, counts)
  leaves = np.asarray(state.window_tree.levels[0])[:CAPACITY]
  np.testing.assert_allclose(leaves, reference.leaves(), rtol=1e-5)


CONFIGS = {
  # name: (prioritized, num_stack, n_step, pad)
  "uniform-stack3-n1-zeros": (False, 3, 1, "zeros"),
  "prioritized-stack4-n2-first": (True, 4, 2, "first"),
  "uniform-stack2-n3-first": (False, 2, 3, "first"),
}


def config_buffer(name):
  prioritized, num_stack, n_step, pad = CONFIGS[name]
  settings = dict(n_step=n_step, gamma=GAMMA, pad=pad, stack_keys=("frame",), stack_axis=-1)
  if prioritized:
    settings.update(alpha=ALPHA, beta=BETA, eps=EPS)
  return make_buffer(prioritized, NUM_ENVS, CAPACITY, num_stack, **settings)


OPERATION = st.one_of(
  st.tuples(
    st.just("add"),
    st.sampled_from([0, 0, 2, 5, PER_ENV + 3]),
    st.lists(st.booleans(), min_size=NUM_ENVS, max_size=NUM_ENVS),
    st.integers(0, 2**16),
  ),
  st.tuples(st.just("sample"), st.integers(0, 2**16)),
  st.tuples(st.just("update"), st.integers(0, 2**16), st.booleans()),
  st.tuples(st.just("clear")),
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@hypothesis.settings(max_examples=10)
@hypothesis.given(operations=st.lists(OPERATION, min_size=1, max_size=16))
def test_random_operation_sequences_match_the_numpy_model(name, operations):
  prioritized, num_stack, n_step, pad = CONFIGS[name]
  buffer = config_buffer(name)
  reference = ReferenceFrames(
    NUM_ENVS, PER_ENV, num_stack, n_step, pad=pad, prioritized=prioritized
  )
  state = buffer.init(STEP)
  last_sample = None
  for operation in operations:
    if operation[0] == "add":
      _, num_steps, mask, seed = operation
      rng = np.random.default_rng(seed)
      length = max(num_steps, 1)
      steps, ends = make_steps(reference, length, rng)
      mask = np.array(mask)
      if num_steps == 0:  # one step per env, [N, ...] without a time axis
        state = buffer.add(
          state, jax.tree.map(lambda x: x[:, 0], steps), mask=mask, episode_end=ends[:, 0]
        )
      else:
        state = buffer.add(state, steps, mask=mask, episode_end=ends)
      reference.add(mask, ends, steps["reward"], steps["terminated"])
    elif operation[0] == "sample":
      sample = buffer.sample(state, jax.random.key(operation[1]), 8)
      if reference.transitions():
        check_sample(sample, reference, 8)
        last_sample = sample
      else:
        np.testing.assert_array_equal(sample.weights, 0.0)
    elif operation[0] == "update" and last_sample is not None:
      _, seed, with_ids = operation
      rng = np.random.default_rng(seed)
      priorities = rng.uniform(-3, 3, 8).astype(np.float32)
      priorities[rng.random(8) < 0.2] = np.nan
      indices = np.asarray(last_sample.indices).copy()
      indices[rng.random(8) < 0.2] = CAPACITY + 1
      item_ids = np.asarray(last_sample.item_ids) if with_ids else None
      state = buffer.update_priorities(state, indices, priorities, item_ids)
      if prioritized:
        reference.update(indices, priorities, [None] * 8 if item_ids is None else item_ids)
    elif operation[0] == "clear":
      state = buffer.clear(state)
      reference.clear()
    check_state(state, reference)
    assert bool(buffer.can_sample(state, 1)) == bool(reference.transitions())
    if prioritized:
      assert float(state.max_priority) == pytest.approx(reference.max_priority)


def _one_env(buffer, state, frames, ends, terminated=None):
  """Adds steps `frames` (ids) to a one-env buffer of the STEP layout."""
  frames = np.asarray(frames, np.int32)[None]
  terminated = (
    np.zeros(frames.shape, bool) if terminated is None else np.asarray(terminated, bool)[None]
  )
  return buffer.add(
    state,
    {
      "obs": {"frame": np.repeat(frames[..., None], 2, -1), "tag": frames},
      "action": frames,
      "reward": np.ones(frames.shape, np.float32),
      "terminated": terminated,
    },
    episode_end=np.asarray(ends, bool)[None],
  )


def _sampled(buffer, state, size=256):
  sample = buffer.sample(state, jax.random.key(0), size)
  return {
    (tuple(o[0]), tuple(n[0]))
    for o, n in zip(
      np.asarray(sample.items.obs["frame"]), np.asarray(sample.items.next_obs["frame"])
    )
  }


@pytest.mark.parametrize("pad", ["zeros", "first"])
def test_first_steps_of_episodes_are_padded_never_from_another_episode(pad):
  buffer = make_buffer(False, 1, 8, 3, pad=pad, stack_keys=("frame",))
  # Episode 1..3 (3 is its final observation), then 4..6 running.
  state = _one_env(buffer, buffer.init(STEP), [1, 2, 3, 4, 5, 6], [0, 0, 1, 0, 0, 0])
  p = (lambda first: first) if pad == "first" else (lambda first: 0)
  assert _sampled(buffer, state) == {
    ((p(1), p(1), 1), (p(1), 1, 2)),
    ((p(1), 1, 2), (1, 2, 3)),
    ((p(4), p(4), 4), (p(4), 4, 5)),
    ((p(4), 4, 5), (4, 5, 6)),
  }


def test_stacks_across_the_physical_wrap_and_after_history_is_overwritten():
  buffer = make_buffer(False, 1, 8, 3, pad="zeros", stack_keys=("frame",))
  # One episode of 11 steps in 8 slots: steps 4..11 held, written at slots
  # 3..7, 0..2. Transitions 4 and 5 lost frames 2, 3 of their stacks; 6..10
  # are whole, some across the wrap.
  state = _one_env(buffer, buffer.init(STEP), range(1, 12), [0] * 11)
  assert _sampled(buffer, state) == {((s - 2, s - 1, s), (s - 1, s, s + 1)) for s in range(6, 11)}
  # A new episode starting in the oldest history is whole at once.
  state = _one_env(buffer, buffer.init(STEP), range(1, 12), [0, 0, 0, 1] + [0] * 7)
  assert ((0, 0, 5), (0, 5, 6)) in _sampled(buffer, state)


def test_a_truncated_transition_bootstraps_from_the_final_observation():
  buffer = make_buffer(False, 1, 16, 2, n_step=3, gamma=0.5, stack_keys=("frame",))
  # 1, 2 then the final observation 3 (truncation), then a new episode 4, 5,
  # 6 whose step 5 terminates.
  state = _one_env(
    buffer,
    buffer.init(STEP),
    [1, 2, 3, 4, 5, 6, 7, 8],
    [0, 0, 1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1, 0, 0, 0],
  )
  sample = buffer.sample(state, jax.random.key(1), 256)
  rows = {
    int(t): (tuple(n), float(r), float(d))
    for t, n, r, d in zip(
      np.asarray(sample.items.obs["tag"]),
      np.asarray(sample.items.next_obs["frame"])[:, 0],
      np.asarray(sample.items.reward),
      np.asarray(sample.items.discount),
    )
  }
  assert rows[1] == ((2, 3), 1.5, 0.25)  # truncated at 3: bootstrap from it
  assert rows[2] == ((2, 3), 1.0, 0.5)
  assert rows[4] == ((5, 6), 1.5, 0.0)  # terminated by step 5's action
  assert rows[5] == ((5, 6), 1.0, 0.0)
  assert 3 not in rows  # a final observation starts no transition


def test_an_episodes_last_transitions_need_only_its_final_step():
  """Issue 32: with n > 1 an episode's last n - 1 transitions waited for n - 1
  steps of the next episode, although the final step written completes
  their targets; an env that stopped stepping never had them sampled."""
  buffer = make_buffer(False, 1, 16, 2, n_step=3, gamma=0.5, stack_keys=("frame",))
  # 1, 2, 3 then the final observation 4; the env steps no more.
  state = _one_env(buffer, buffer.init(STEP), [1, 2, 3, 4], [0, 0, 0, 1])
  assert int(state.window_counts[0]) == 3
  sample = buffer.sample(state, jax.random.key(0), 256)
  rows = {
    int(t): (int(n), float(r), float(d))
    for t, n, r, d in zip(
      np.asarray(sample.items.obs["tag"]),
      np.asarray(sample.items.next_obs["tag"]),
      np.asarray(sample.items.reward),
      np.asarray(sample.items.discount),
    )
  }
  assert rows == {1: (4, 1.75, 0.125), 2: (4, 1.5, 0.25), 3: (4, 1.0, 0.5)}
  # Episode 5..16 (16 final), then 17, 18 running: steps 3..18 held (3 lost
  # its stack's frame 2). The newest steps of a running episode still wait
  # for n more steps: 18 is not completed by the flag of step 4, which an
  # older lap left two slots past it.
  state = _one_env(buffer, state, range(5, 17), [0] * 11 + [1])
  state = _one_env(buffer, state, [17, 18], [0, 0])
  tags = set(np.asarray(buffer.sample(state, jax.random.key(1), 512).items.obs["tag"]).tolist())
  assert tags == set(range(5, 16))
  assert int(state.window_counts[0]) == 11


def test_stack_axis_and_unstacked_leaves():
  pixels = {"pixels": jnp.zeros((3, 5), jnp.uint8), "velocity": jnp.zeros(2)}
  step = {
    "obs": pixels,
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }
  for axis, shape in [(-1, (3, 5, 4)), (1, (3, 4, 5))]:
    buffer = jaxbuf.frame_stack_replay(2, 16, 4, stack_keys=("pixels",), stack_axis=axis)
    chunk = jax.tree.map(lambda x: jnp.ones((2, 5, *x.shape), x.dtype), step)
    items = jax.jit(
      lambda chunk: buffer.sample(buffer.add(buffer.init(step), chunk), jax.random.key(0), 7).items
    )(chunk)
    assert items.obs["pixels"].shape == (7, *shape)
    assert items.next_obs["velocity"].shape == (7, 2)


# --- Sampling distributions (fixed seeds; chi-square p > 1e-3) ----------------


def _ragged(buffer):
  """Env 0 wrapped with an episode end, env 1 short, env 2 nothing."""
  state = buffer.init(STEP)
  for t in range(13):
    mask = np.array([True, t < 4, False])
    steps = {
      "obs": {"frame": np.full((3, 2), t + 1, np.int32), "tag": np.full(3, t + 1, np.int32)},
      "action": np.zeros(3, np.int32),
      "reward": np.zeros(3, np.float32),
      "terminated": np.zeros(3, bool),
    }
    state = buffer.add(state, steps, mask=mask, episode_end=np.array([t == 7, False, False]))
  return state


def test_uniform_transitions_are_equally_likely():
  buffer = make_buffer(False, NUM_ENVS, CAPACITY, 3, stack_keys=("frame",))
  state = _ragged(buffer)
  held = np.flatnonzero(np.asarray(state.window_tree.levels[0])[:CAPACITY])
  indices = np.asarray(buffer.sample(state, jax.random.key(3), 20_000).indices)
  assert set(indices) == set(held)
  observed = np.array([np.sum(indices == i) for i in held])
  assert stats.chisquare(observed).pvalue > 1e-3


def test_prioritized_frequencies_follow_priority_to_the_alpha():
  buffer = make_buffer(True, NUM_ENVS, CAPACITY, 3, alpha=ALPHA, stack_keys=("frame",))
  state = _ragged(buffer)
  held = np.flatnonzero(np.asarray(state.window_tree.levels[0])[:CAPACITY])
  priorities = np.linspace(0.25, 4.0, held.size).astype(np.float32)
  state = buffer.update_priorities(state, held, priorities)
  indices = np.asarray(buffer.sample(state, jax.random.key(4), 20_000).indices)
  counts = np.array([np.sum(indices == i) for i in held])
  mass = (priorities + EPS) ** ALPHA
  assert stats.chisquare(counts, mass / mass.sum() * counts.sum()).pvalue > 1e-3


# --- Composition: jit, vmap, scan, cond, devices, checkpoints ------------------


def _chunk(num_envs, length, start=1):
  frames = (
    np.arange(length, dtype=np.int32)[None, :]
    + start
    + 100 * np.arange(num_envs, dtype=np.int32)[:, None]
  )
  return {
    "obs": {"frame": np.repeat(frames[..., None], 2, -1), "tag": frames},
    "action": frames,
    "reward": np.ones(frames.shape, np.float32),
    "terminated": np.zeros(frames.shape, bool),
  }


@devices.needs(4)
@pytest.mark.parametrize("prioritized", [True])
def test_sharded_over_four_devices_samples_whole_transitions(prioritized):
  mesh = jax.make_mesh((4,), ("data",))
  settings = dict(n_step=2, gamma=GAMMA, stack_keys=("frame",))
  buffer = make_buffer(prioritized, 8, 64, 3, **settings)
  sharded = jaxbuf.sharded(buffer, mesh)
  state = sharded.init(STEP)
  assert state.storage["obs"]["frame"].shape == (4, 2, 8, 2)
  unsharded = buffer.init(STEP)
  for start in (1, 6):
    ends = np.zeros((8, 5), bool)
    ends[::3, 2] = True
    state = sharded.add(state, _chunk(8, 5, start), episode_end=ends)
    unsharded = buffer.add(unsharded, _chunk(8, 5, start), episode_end=ends)
  sample = sharded.sample(state, jax.random.key(0), 64)
  whole = buffer.sample(unsharded, jax.random.key(0), 64)
  # Each row is the unsharded buffer's transition of the same global id.
  by_id = dict(
    zip(np.asarray(whole.indices).tolist(), np.asarray(whole.items.obs["frame"]).tolist())
  )
  unsharded_all = buffer.sample(unsharded, jax.random.key(1), 2048)
  by_id.update(
    zip(
      np.asarray(unsharded_all.indices).tolist(),
      np.asarray(unsharded_all.items.obs["frame"]).tolist(),
    )
  )
  for index, frames in zip(
    np.asarray(sample.indices).tolist(), np.asarray(sample.items.obs["frame"]).tolist()
  ):
    assert by_id[index] == frames
  np.testing.assert_array_equal(
    np.asarray(state.window_counts).reshape(-1), unsharded.window_counts
  )
  state = sharded.update_priorities(state, sample.indices, jnp.full(64, 2.0), sample.item_ids)
  if prioritized:
    assert float(state.max_priority.max()) == pytest.approx(2.0 + 1e-6)


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
  buffer = make_buffer(True, NUM_ENVS, CAPACITY, 3, stack_keys=("frame",))
  state = buffer.add(buffer.init(STEP), _chunk(NUM_ENVS, 11))
  sample = buffer.sample(state, jax.random.key(0), 8)
  state = buffer.update_priorities(state, sample.indices, jnp.arange(8.0), sample.item_ids)
  jaxbuf.save(tmp_path / "ckpt", state)
  loaded = jaxbuf.load(tmp_path / "ckpt", like=buffer.init(STEP))
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  again = buffer.sample(loaded, jax.random.key(5), 8)
  want = buffer.sample(state, jax.random.key(5), 8)
  for got, expected in zip(jax.tree.leaves(again), jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, expected)
  other = make_buffer(True, NUM_ENVS, CAPACITY, 4, stack_keys=("frame",))
  with pytest.raises(ValueError, match="num_stack"):
    jaxbuf.load(tmp_path / "ckpt", like=other.init(STEP))


def test_add_writes_in_place_under_donation():
  step = {
    "obs": jnp.zeros((84, 84), jnp.uint8),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }
  capacity = 4 * 4096
  state = jax.eval_shape(functools.partial(jaxbuf.frames.init, num_envs=4, capacity=capacity), step)
  steps = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype), step)
  compiled = (
    jax.jit(lambda s, x: jaxbuf.frames.add(s, x, num_stack=4, n_step=3), donate_argnums=0)
    .lower(state, steps)
    .compile()
  )
  memory = compiled.memory_analysis()
  if memory is None:
    pytest.skip("no memory analysis on this backend")
  assert memory.temp_size_in_bytes < capacity * 84 * 84 / 20, memory


# --- Bad input: raises, names the argument, leaves the state intact -----------


def snapshot(state):
  return [np.asarray(x).copy() for x in jax.tree.leaves(state)]


BAD_SETTINGS = {
  "num_stack": (lambda: jaxbuf.frame_stack_replay(2, 16, 0), ValueError),
  "n_step": (lambda: jaxbuf.frame_stack_replay(2, 16, 4, n_step=0), ValueError),
  "capacity": (lambda: jaxbuf.frame_stack_replay(2, 12, 4, n_step=3), ValueError),
  "pad": (lambda: jaxbuf.frame_stack_replay(2, 16, 4, pad="edge"), ValueError),
  "gamma": (lambda: jaxbuf.frame_stack_replay(2, 16, 4, gamma=1.5), ValueError),
  "stack_keys": (lambda: jaxbuf.frame_stack_replay(2, 16, 4, stack_keys="frame"), TypeError),
  "alpha": (lambda: jaxbuf.prioritized_frame_stack_replay(2, 16, 4, alpha=-1), ValueError),
}


@pytest.mark.parametrize("name", sorted(BAD_SETTINGS))
def test_bad_settings_raise_naming_the_argument(name):
  make, error = BAD_SETTINGS[name]
  with pytest.raises(error, match=name):
    make()


def test_bad_steps_raise_at_init_naming_what_is_wrong():
  buffer = jaxbuf.frame_stack_replay(2, 16, 4, stack_keys=("frame",))
  with pytest.raises(ValueError, match="'terminated'"):
    buffer.init({key: value for key, value in STEP.items() if key != "terminated"})
  with pytest.raises(ValueError, match="reward must be a float"):
    buffer.init({**STEP, "reward": jnp.int32(0)})
  with pytest.raises(ValueError, match=r"stack_keys names \['pixels'\]"):
    jaxbuf.frame_stack_replay(2, 16, 4, stack_keys=("pixels",)).init(STEP)
  with pytest.raises(ValueError, match="stack_axis 3 is out of range"):
    jaxbuf.frame_stack_replay(2, 16, 4, stack_axis=3).init(STEP)


def test_bad_adds_and_states_raise_leaving_the_state_intact():
  buffer = make_buffer(False, NUM_ENVS, CAPACITY, 3, stack_keys=("frame",))
  state = buffer.add(buffer.init(STEP), _chunk(NUM_ENVS, 4))
  before = snapshot(state)
  calls = {
    "(3, 4)": lambda: buffer.add(state, jax.tree.map(lambda x: x[:2], _chunk(NUM_ENVS, 4))),
    "episode_end": lambda: buffer.add(
      state, _chunk(NUM_ENVS, 4), episode_end=np.ones(NUM_ENVS, bool)
    ),
    "mask": lambda: buffer.add(state, _chunk(NUM_ENVS, 4), mask=np.ones(NUM_ENVS, np.int32)),
    "num_stack: state 3, buffer 4": lambda: make_buffer(
      False, NUM_ENVS, CAPACITY, 4, stack_keys=("frame",)
    ).sample(state, jax.random.key(0), 2),
    "expected a FrameStackReplayState": lambda: jaxbuf.frames.sample(
      jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 2).init(STEP),
      jax.random.key(0),
      2,
      num_stack=3,
      n_step=1,
      gamma=0.9,
      pad="zeros",
      stack_keys=None,
      stack_axis=-1,
    ),
  }
  for words, call in calls.items():
    with pytest.raises((ValueError, TypeError)) as raised:
      call()
    assert words in str(raised.value), (words, str(raised.value))
    for got, want in zip(snapshot(state), before):
      np.testing.assert_array_equal(got, want)


def test_checked_mode_raises_on_empty_samples_and_bad_priorities():
  buffer = jaxbuf.prioritized_frame_stack_replay(1, 8, 2, checked=True)
  state = buffer.init(STEP)
  sample = jax.jit(checkify.checkify(buffer.sample, errors=checkify.user_checks), static_argnums=2)
  with pytest.raises(Exception, match="no sampleable transition"):
    sample(state, jax.random.key(0), 2)[0].throw()
  state = buffer.add(state, jax.tree.map(lambda x: x[:1], _chunk(1, 4)))
  sample(state, jax.random.key(0), 2)[0].throw()  # held now: no error
  update = jax.jit(checkify.checkify(buffer.update_priorities, errors=checkify.user_checks))
  with pytest.raises(Exception, match="finite and non-negative"):
    update(state, jnp.array([0]), jnp.array([jnp.nan]))[0].throw()


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_last_leaf_marks_the_episode_ends(prioritized):
  """The stream convention (`help(jaxbuf.streams)`): a step's `last` leaf is
  its episode-end flag, read as `episode_end` would be; both at once is a
  `TypeError`."""
  buffer = make_buffer(prioritized, NUM_ENVS, CAPACITY, num_stack=2)
  ends = np.zeros((NUM_ENVS, 6), bool)
  ends[0, 2] = ends[1, 4] = ends[2, 0] = True
  chunk = {
    "obs": {
      "frame": np.arange(NUM_ENVS * 6 * 2, dtype=np.int32).reshape(NUM_ENVS, 6, 2),
      "tag": np.zeros((NUM_ENVS, 6), np.int32),
    },
    "action": np.zeros((NUM_ENVS, 6), np.int32),
    "reward": np.ones((NUM_ENVS, 6), np.float32),
    "terminated": ends,
  }
  with_leaf = buffer.add(buffer.init({**STEP, "last": jnp.bool_(False)}), {**chunk, "last": ends})
  with_flag = buffer.add(buffer.init(STEP), chunk, episode_end=ends)
  for field in ("episode_ends", "episode_positions", "next_positions"):
    np.testing.assert_array_equal(getattr(with_leaf, field), getattr(with_flag, field))
  np.testing.assert_array_equal(with_leaf.window_tree.levels[0], with_flag.window_tree.levels[0])
  with pytest.raises(TypeError, match="do not pass episode_end too"):
    buffer.add(with_leaf, {**chunk, "last": ends}, episode_end=ends)
