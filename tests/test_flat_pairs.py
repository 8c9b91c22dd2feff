"""flashbax's flat buffer against jaxbuf's storage-once route (`step_pairs`).

The same steps added to `fbx.make_flat_buffer` and to
`jaxbuf.sequence_replay(num_envs, capacity, 2)` must hand out the same set
of transitions (first step, second step, episode flag), which is also the
set a plain model of the streams enumerates: every pair of consecutive held
steps of one env, never the newest step of an env as a first step.
"""

import chex
import flashbax as fbx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

NUM_ENVS, PER_ENV = 3, 6
CAPACITY = NUM_ENVS * PER_ENV
DRAWS = 4104  # every one of the at most 15 pairs shows up: P(miss) < 1e-100
NUM_ADDS = 11  # wraps every env's ring of 6


def env_steps(t):
  """What each env observes at step t: a unique id 100 * env + t, and the
  episode ends (env 1 at t = 3 and 7, env 2 at t = 5)."""
  obs = (100 * np.arange(NUM_ENVS) + t).astype(np.float32)
  done = np.array([False, t in (3, 7), t == 5])
  return obs, done


def model_pairs(num_adds):
  """Every (first obs, second obs, done at first) the buffers can hand out."""
  pairs = set()
  held_from = max(0, num_adds - PER_ENV)
  for env in range(NUM_ENVS):
    for t in range(held_from, num_adds - 1):
      obs, done = env_steps(t)
      pairs.add((float(obs[env]), float(obs[env] + 1), bool(done[env])))
  return pairs


def flashbax_pairs(buffer, state, key):
  # flashbax's sample_batch_size is at most max_length: many draws at once.
  keys = jax.random.split(key, DRAWS // CAPACITY)
  with jax.numpy_rank_promotion("allow"):  # flashbax's sample broadcasts ranks
    experience = buffer.sample(state, keys).experience
  experience = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), experience)
  return set(
    zip(
      experience.first["obs"].tolist(),
      experience.second["obs"].tolist(),
      experience.first["done"].tolist(),
    )
  )


def jaxbuf_pairs(sample):
  pairs = jaxbuf.step_pairs(sample)
  return set(
    zip(
      pairs.first["obs"].tolist(),
      pairs.second["obs"].tolist(),
      (~pairs.same_episode).tolist(),
    )
  )


def step_of(obs):
  return {
    "obs": jnp.asarray(obs),
    "action": jnp.zeros(NUM_ENVS, jnp.int32),
    "reward": jnp.ones(NUM_ENVS, jnp.float32),
  }


EXAMPLE = {"obs": jnp.float32(0), "action": jnp.int32(0), "reward": jnp.float32(0)}


@pytest.fixture(scope="module")
def flat():
  """flashbax's flat buffer, its sample vmapped over keys (`flashbax_pairs`)."""
  buffer = fbx.make_flat_buffer(
    max_length=CAPACITY, min_length=NUM_ENVS, sample_batch_size=CAPACITY, add_batch_size=NUM_ENVS
  )
  return buffer.replace(add=jax.jit(buffer.add), sample=jax.jit(jax.vmap(buffer.sample, (None, 0))))


@pytest.fixture(scope="module")
def prioritised_flat():
  """flashbax's prioritised flat buffer, as `flat`."""
  buffer = fbx.make_prioritised_flat_buffer(
    max_length=CAPACITY, min_length=NUM_ENVS, sample_batch_size=CAPACITY, add_batch_size=NUM_ENVS
  )
  return buffer.replace(add=jax.jit(buffer.add), sample=jax.jit(jax.vmap(buffer.sample, (None, 0))))


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_flashbax_and_jaxbuf_hand_out_the_same_transitions(flat, prioritised_flat, kind):
  """After every add, before and after each ring wraps: the same set
  (flashbax's flat buffer against sequence replay, its prioritised flat
  buffer against prioritized sequence replay, no priority updated)."""
  if kind == "uniform":
    make = jaxbuf.sequence_replay
  else:
    make, flat = jaxbuf.prioritized_sequence_replay, prioritised_flat
  buffer = make(NUM_ENVS, CAPACITY, sequence_length=2)
  state = buffer.init(EXAMPLE)
  fbx_state = flat.init({**EXAMPLE, "done": jnp.bool_(False)})
  key = jax.random.key(0)
  for t in range(NUM_ADDS):
    obs, done = env_steps(t)
    # flashbax keeps `done` in the step; jaxbuf in its episode flags.
    with jax.numpy_rank_promotion("allow"):  # flashbax's add broadcasts ranks
      fbx_state = flat.add(fbx_state, {**step_of(obs), "done": jnp.asarray(done)})
    state = buffer.add(state, step_of(obs), episode_end=done)
    if t == 0:  # one step per env: no pair yet on either side
      assert not bool(buffer.can_sample(state, 1))
      continue
    key, fbx_key = jax.random.split(key)
    sample = buffer.sample(state, jax.random.fold_in(key, t), DRAWS)
    want = model_pairs(t + 1)
    assert jaxbuf_pairs(sample) == want, t
    assert flashbax_pairs(flat, fbx_state, fbx_key) == want, t
    # The newest step of each env is held but starts no pair yet.
    newest = set(obs.tolist())
    assert not newest & {first for first, _, _ in jaxbuf_pairs(sample)}
    assert newest <= {second for _, second, _ in jaxbuf_pairs(sample)}


def test_done_kept_in_the_step_gives_the_same_pairs(flat):
  """The one-line port keeps flashbax's step as it is (`done` in it)."""
  buffer = jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, sequence_length=2)
  state = buffer.init({**EXAMPLE, "done": jnp.bool_(False)})
  for t in range(NUM_ADDS):
    obs, done = env_steps(t)
    state = buffer.add(state, {**step_of(obs), "done": jnp.asarray(done)})
  pairs = jaxbuf.step_pairs(buffer.sample(state, jax.random.key(1), DRAWS))
  got = set(
    zip(pairs.first["obs"].tolist(), pairs.second["obs"].tolist(), pairs.first["done"].tolist())
  )
  assert got == model_pairs(NUM_ADDS)
  assert bool(jnp.all(pairs.same_episode))  # no episode_end given: none flagged


def test_pairs_are_drawn_uniformly():
  """Each of the 15 held pairs is equally likely (chi-square, fixed seed)."""
  scipy_stats = pytest.importorskip("scipy.stats")
  buffer = jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, sequence_length=2)
  state = buffer.init(EXAMPLE)
  for t in range(NUM_ADDS):
    obs, done = env_steps(t)
    state = buffer.add(state, step_of(obs), episode_end=done)
  firsts = jaxbuf.step_pairs(buffer.sample(state, jax.random.key(2), DRAWS)).first["obs"]
  values, counts = np.unique(np.asarray(firsts), return_counts=True)
  assert len(values) == NUM_ENVS * (PER_ENV - 1)
  assert scipy_stats.chisquare(counts).pvalue > 1e-3


def test_the_route_holds_flashbax_bytes_per_step(flat):
  """Each step costs the same bytes: the step without `done` plus jaxbuf's
  one-byte episode flag, against flashbax's step with `done` (a bool)."""
  fbx_state = jax.eval_shape(flat.init, {**EXAMPLE, "done": jnp.bool_(False)})
  state = jax.eval_shape(jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 2).init, EXAMPLE)

  def per_step(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)) / CAPACITY

  assert per_step(fbx_state.experience) == per_step(state.storage) + per_step(state.episode_ends)


def test_step_pairs_under_jit_vmap_scan_and_cond_without_retracing():
  buffer = jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, sequence_length=2)
  state = buffer.init(EXAMPLE)
  for t in range(4):
    obs, done = env_steps(t)
    state = buffer.add(state, step_of(obs), episode_end=done)
  sample = buffer.sample(state, jax.random.key(3), 8)
  eager = jaxbuf.step_pairs(sample)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def jitted(sample):
    return jaxbuf.step_pairs(sample)

  chex.clear_trace_counter()
  for _ in range(2):
    chex.assert_trees_all_equal(jitted(sample), eager)
  stacked = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), sample)
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], jax.vmap(jitted)(stacked)), eager)
  scanned = jax.lax.scan(lambda carry, s: (carry, jitted(s)), 0, stacked)[1]
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], scanned), eager)
  flipped = jax.jit(
    lambda flip: jax.lax.cond(
      flip, lambda: jitted(jax.tree.map(lambda x: x[::-1], sample)), lambda: jitted(sample)
    )
  )
  chex.assert_trees_all_equal(flipped(False), eager)

  # The whole route inside one jitted step: add, sample, pair.
  @jax.jit
  def step(state, obs, done, key):
    state = buffer.add(state, step_of(obs), episode_end=done)
    return state, jaxbuf.step_pairs(buffer.sample(state, key, 8))

  obs, done = env_steps(4)
  _, pairs = step(state, obs, done, jax.random.key(4))
  assert bool(jnp.all(pairs.second["obs"] == pairs.first["obs"] + 1))


def test_an_empty_buffer_pairs_nothing_with_weight_zero():
  buffer = jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, sequence_length=2)
  state = buffer.add(buffer.init(EXAMPLE), step_of(env_steps(0)[0]))  # no window yet
  sample = buffer.sample(state, jax.random.key(5), 4)
  pairs = jaxbuf.step_pairs(sample)
  assert not bool(jnp.any(pairs.same_episode)) and not bool(jnp.any(sample.weights))


def test_bad_windows_raise_naming_what_to_change():
  buffer = jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, sequence_length=3)
  state = buffer.init(EXAMPLE)
  for t in range(3):
    state = buffer.add(state, step_of(env_steps(t)[0]))
  sample = buffer.sample(state, jax.random.key(6), 4)
  with pytest.raises(ValueError, match=r"leaf \['action'\].*\(4, 3\).*sequence_length=2"):
    jaxbuf.step_pairs(sample)
  with pytest.raises(TypeError, match="pass the whole sample, not its items"):
    jaxbuf.step_pairs(sample.items)
