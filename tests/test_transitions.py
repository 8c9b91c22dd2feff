"""n-step transitions, burn-in split and R2D2 priorities against NumPy loops."""

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

pytestmark = pytest.mark.usefixtures("x64_mode")


# --- The NumPy reference: one window, one position at a time -----------------


def reference_targets(rewards, terminated, last, n, gamma):
  """Plain loops over windows and positions: (rewards, discounts, next, valid)."""
  num_windows, length = rewards.shape
  gamma = np.broadcast_to(np.asarray(gamma, np.float64), rewards.shape)
  positions = length - n
  out_rewards = np.zeros((num_windows, positions))
  out_discounts = np.zeros((num_windows, positions))
  out_next = np.zeros((num_windows, positions), np.int64)
  out_valid = np.zeros((num_windows, positions), bool)
  for s in range(num_windows):
    for t in range(positions):
      out_next[s, t] = t
      if last[s, t]:
        continue
      out_valid[s, t] = True
      total, discount, k = 0.0, 1.0, n
      for j in range(n):
        total += discount * rewards[s, t + j]
        if terminated[s, t + j]:
          discount, k = 0.0, j + 1
          break
        discount *= gamma[s, t + j]
        if last[s, t + j + 1]:
          k = j + 1
          break
      out_rewards[s, t], out_discounts[s, t] = total, discount
      out_next[s, t] = t + k
  return out_rewards, out_discounts, out_next, out_valid


# Hypothesis draws flags and values at fixed shapes, so the jitted helpers
# compile once per n instead of once per example.
NUM_WINDOWS, LENGTH = 4, 7
targets_jit = jax.jit(jaxbuf.n_step_targets, static_argnames="n")
transitions_jit = jax.jit(jaxbuf.n_step_transitions, static_argnames="n")


@st.composite
def windows(draw):
  n = draw(st.sampled_from([1, 2, 3, LENGTH - 1]))
  shape = (NUM_WINDOWS, LENGTH)
  size = NUM_WINDOWS * LENGTH

  def draw_flags():
    return np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(shape)

  last = draw_flags() & draw_flags()
  terminated = draw_flags() & draw_flags() & ~last
  rewards = np.array(
    draw(st.lists(st.integers(-3, 3), min_size=size, max_size=size)), np.float32
  ).reshape(shape)
  # Padding at `last` steps is never read: NaN there must not leak.
  rewards = np.where(last, np.nan, rewards).astype(np.float32)
  if draw(st.booleans()):
    gamma = np.full(shape, draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])), np.float32)
  else:
    gamma = np.array(
      draw(st.lists(st.sampled_from([0.25, 0.5, 1.0]), min_size=size, max_size=size)), np.float32
    ).reshape(shape)
  gamma = np.where(last, np.nan, gamma).astype(np.float32)
  return rewards, terminated, last, n, gamma


@hypothesis.given(windows())
def test_n_step_targets_match_the_numpy_loop(case):
  rewards, terminated, last, n, gamma = case
  got = targets_jit(rewards, terminated, last, n=n, gamma=gamma)
  want = reference_targets(rewards, terminated, last, n, gamma)
  np.testing.assert_allclose(got.rewards, want[0], rtol=1e-6)
  np.testing.assert_allclose(got.discounts, want[1], rtol=1e-6)
  np.testing.assert_array_equal(got.next_index, want[2])
  np.testing.assert_array_equal(got.valid, want[3])
  assert got.rewards.dtype == jnp.float32 and got.next_index.dtype == jnp.int32


@hypothesis.given(windows())
def test_n_step_transitions_read_next_obs_from_the_window(case):
  rewards, terminated, last, n, gamma = case
  # Observations are (window, step) ids, so every gather is checked exactly.
  obs = {
    "id": np.arange(NUM_WINDOWS * LENGTH, dtype=np.int32).reshape(NUM_WINDOWS, LENGTH),
    "pixels": np.arange(NUM_WINDOWS * LENGTH * 6, dtype=np.uint8).reshape(
      NUM_WINDOWS, LENGTH, 2, 3
    ),
  }
  actions = obs["id"] % 3
  got = transitions_jit(obs, actions, rewards, terminated, last, n=n, gamma=gamma)
  want_rewards, want_discounts, want_next, want_valid = reference_targets(
    rewards, terminated, last, n, gamma
  )
  rows = np.arange(NUM_WINDOWS)
  np.testing.assert_array_equal(got.obs["id"], obs["id"][:, 0])
  np.testing.assert_array_equal(got.next_obs["id"], obs["id"][rows, want_next[:, 0]])
  np.testing.assert_array_equal(got.next_obs["pixels"], obs["pixels"][rows, want_next[:, 0]])
  assert got.next_obs["pixels"].dtype == jnp.uint8
  np.testing.assert_array_equal(got.action, actions[:, 0])
  np.testing.assert_allclose(got.reward, want_rewards[:, 0], rtol=1e-6)
  np.testing.assert_allclose(got.discount, want_discounts[:, 0], rtol=1e-6)
  np.testing.assert_array_equal(got.valid, want_valid[:, 0])


# --- Named cases -------------------------------------------------------------


def one_window(length, *, last_at=(), terminated_at=()):
  rewards = np.arange(1, length + 1, dtype=np.float32)[None]
  last = np.zeros((1, length), bool)
  terminated = np.zeros((1, length), bool)
  last[0, list(last_at)] = True
  terminated[0, list(terminated_at)] = True
  obs = np.arange(length, dtype=np.float32)[None] * 10
  return obs, rewards, terminated, last


def test_truncation_right_at_n_bootstraps_from_the_final_observation():
  # Steps 0..2 act, step 3 holds the final observation of a truncated
  # episode, step 4 is the reset observation of the next episode.
  obs, rewards, terminated, last = one_window(5, last_at=[3])
  got = jaxbuf.n_step_transitions(obs, obs, rewards, terminated, last, n=3, gamma=0.5)
  assert got.next_obs.tolist() == [30.0]  # the final obs, not 40 (reset)
  assert got.discount.tolist() == [0.125]  # truncation bootstraps
  assert got.reward.tolist() == [1 + 0.5 * 2 + 0.25 * 3]
  assert got.valid.tolist() == [True]


def test_truncation_before_n_stops_the_sum_and_bootstraps():
  obs, rewards, terminated, last = one_window(5, last_at=[2])
  got = jaxbuf.n_step_transitions(obs, obs, rewards, terminated, last, n=4, gamma=0.5)
  assert got.next_obs.tolist() == [20.0]
  assert got.discount.tolist() == [0.25]
  assert got.reward.tolist() == [1 + 0.5 * 2]


def test_termination_at_the_first_step_has_one_reward_and_no_bootstrap():
  obs, rewards, terminated, last = one_window(4, last_at=[1], terminated_at=[0])
  got = jaxbuf.n_step_transitions(obs, obs, rewards, terminated, last, n=3, gamma=0.9)
  assert got.reward.tolist() == [1.0]
  assert got.discount.tolist() == [0.0]
  assert got.next_obs.tolist() == [10.0]


def test_termination_cuts_the_sum_without_a_final_step():
  # Without the optional final step of a terminated episode, the reward of
  # the next episode's first step must not enter the sum.
  obs, rewards, terminated, last = one_window(4, terminated_at=[1])
  got = jaxbuf.n_step_transitions(obs, obs, rewards, terminated, last, n=3, gamma=0.5)
  assert got.reward.tolist() == [1 + 0.5 * 2]
  assert got.discount.tolist() == [0.0]


def test_n_equal_to_window_length_minus_one_uses_the_whole_window():
  obs, rewards, terminated, last = one_window(6)
  got = jaxbuf.n_step_transitions(obs, obs, rewards, terminated, last, n=5, gamma=1.0)
  assert got.next_obs.tolist() == [50.0]
  assert got.reward.tolist() == [15.0]
  assert got.discount.tolist() == [1.0]
  targets = jaxbuf.n_step_targets(rewards, terminated, last, n=5, gamma=1.0)
  assert targets.rewards.shape == (1, 1)


def test_a_window_starting_at_a_final_step_is_invalid_and_reads_no_padding():
  obs, rewards, terminated, last = one_window(4, last_at=[0])
  rewards[0, 0] = np.nan
  got = jaxbuf.n_step_transitions(
    obs, obs, rewards, terminated, last, n=2, gamma=np.full((1, 4), np.nan, np.float32)
  )
  assert got.valid.tolist() == [False]
  assert got.reward.tolist() == [0.0] and got.discount.tolist() == [0.0]


def test_per_step_gamma_multiplies_the_discounts_of_the_steps_taken():
  obs, rewards, terminated, last = one_window(4)
  gamma = np.array([[0.5, 0.25, 1.0, 0.0]], np.float32)
  got = jaxbuf.n_step_transitions(obs, obs, rewards, terminated, last, n=3, gamma=gamma)
  assert got.reward.tolist() == [1 + 0.5 * 2 + 0.125 * 3]
  assert got.discount.tolist() == [0.125]


def test_stream_with_auto_reset_gives_the_true_final_observation():
  """A dm_env-style stream built as the examples build it from gymnax.

  Episodes of lengths 3, 2 (truncated) and 4 (terminated): each ordinary
  step is followed, when its episode ends, by a `last` step holding the
  final observation. Every transition's next observation is the successor
  of its observation within the same episode.
  """
  episodes = [(3, False), (2, False), (4, True)]
  obs, rewards, terminated, last, episode_of = [], [], [], [], []
  for number, (length, ends_by_termination) in enumerate(episodes):
    for step in range(length):
      obs.append(100 * number + step)
      rewards.append(1.0)
      terminated.append(ends_by_termination and step == length - 1)
      last.append(False)
      episode_of.append(number)
    obs.append(100 * number + length)  # the final observation
    rewards.append(np.nan)
    terminated.append(False)
    last.append(True)
    episode_of.append(number)
  arrays = [np.array(x)[None] for x in (obs, rewards, terminated, last)]
  obs, rewards, terminated, last = arrays
  rewards = rewards.astype(np.float32)
  n = 3
  targets = jaxbuf.n_step_targets(rewards, terminated, last, n=n, gamma=1.0)
  for t in range(obs.shape[1] - n):
    if last[0, t]:
      assert not targets.valid[0, t]
      continue
    following = obs[0, targets.next_index[0, t]]
    steps = int(targets.next_index[0, t]) - t
    assert following == obs[0, t] + steps  # same episode, k later
    assert targets.rewards[0, t] == steps
    assert steps == n or last[0, t + steps] or terminated[0, t + steps - 1]
    assert targets.discounts[0, t] == (0.0 if terminated[0, t + steps - 1] else 1.0)


# --- Composition: jit, vmap, scan, cond, no retrace -------------------------


def _batch(num_windows=3, length=5):
  rng = np.random.default_rng(0)
  return (
    rng.normal(size=(num_windows, length, 2)).astype(np.float32),
    rng.integers(0, 3, (num_windows, length)).astype(np.int32),
    rng.normal(size=(num_windows, length)).astype(np.float32),
    rng.random((num_windows, length)) < 0.2,
    rng.random((num_windows, length)) < 0.2,
  )


def test_transitions_under_jit_vmap_scan_and_cond_without_retracing():
  obs, actions, rewards, terminated, last = _batch()
  eager = jaxbuf.n_step_transitions(obs, actions, rewards, terminated, last, n=2, gamma=0.9)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def jitted(obs, actions, rewards, terminated, last):
    return jaxbuf.n_step_transitions(obs, actions, rewards, terminated, last, n=2, gamma=0.9)

  chex.clear_trace_counter()
  for _ in range(2):
    chex.assert_trees_all_close(jitted(obs, actions, rewards, terminated, last), eager)

  stacked = [np.stack([x, x[::-1]]) for x in (obs, actions, rewards, terminated, last)]
  batched = jax.vmap(jitted)(*stacked)
  chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], batched), eager)

  def body(carry, inputs):
    return carry, jitted(*inputs)

  _, scanned = jax.lax.scan(body, 0, stacked)
  chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], scanned), eager)

  def branch(flip):
    return jax.lax.cond(
      flip,
      lambda: jitted(*[x[::-1] for x in (obs, actions, rewards, terminated, last)]),
      lambda: jitted(obs, actions, rewards, terminated, last),
    )

  chex.assert_trees_all_close(jax.jit(branch)(False), eager)


def test_r2d2_priorities_and_burn_in_under_jit_vmap_scan_and_cond():
  rng = np.random.default_rng(1)
  td = rng.normal(size=(2, 4, 6)).astype(np.float32)
  mask = rng.random((2, 4, 6)) < 0.7
  eager = jaxbuf.r2d2_priorities(td[0], mask[0])

  @jax.jit
  @chex.assert_max_traces(n=1)
  def priorities(td, mask):
    return jaxbuf.r2d2_priorities(td, mask, eta=0.9)

  chex.clear_trace_counter()
  for _ in range(2):
    np.testing.assert_allclose(priorities(td[0], mask[0]), eager, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(priorities)(td, mask)[0], eager, rtol=1e-6)
  scanned = jax.lax.scan(lambda c, x: (c, priorities(*x)), 0, (td, mask))[1]
  np.testing.assert_allclose(scanned[0], eager, rtol=1e-6)
  picked = jax.jit(
    lambda p: jax.lax.cond(
      p, lambda: priorities(td[1], mask[1]), lambda: priorities(td[0], mask[0])
    )
  )(False)
  np.testing.assert_allclose(picked, eager, rtol=1e-6)

  split = jax.jit(lambda w: jaxbuf.burn_in_split(w, 2))
  burn, trained = jax.vmap(split)({"td": td})
  np.testing.assert_array_equal(burn["td"], td[:, :, :2])
  np.testing.assert_array_equal(trained["td"], td[:, :, 2:])


def test_transitions_shard_over_devices():
  devices = jax.devices()
  obs, actions, rewards, terminated, last = _batch(num_windows=len(devices))
  mesh = jax.make_mesh((len(devices),), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  placed = [jax.device_put(x, sharding) for x in (obs, actions, rewards, terminated, last)]
  got = jax.jit(lambda *a: jaxbuf.n_step_transitions(*a, n=3, gamma=0.5))(*placed)
  want = jaxbuf.n_step_transitions(obs, actions, rewards, terminated, last, n=3, gamma=0.5)
  chex.assert_trees_all_close(got, want)


# --- Recurrent helpers against NumPy -----------------------------------------


priorities_jit = jax.jit(jaxbuf.r2d2_priorities)


@hypothesis.given(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.integers(0, 2**16))
def test_r2d2_priorities_match_numpy(eta, seed):
  rng = np.random.default_rng(seed)
  td = rng.normal(size=(NUM_WINDOWS, LENGTH)).astype(np.float32)
  mask = rng.random((NUM_WINDOWS, LENGTH)) < rng.uniform(0.0, 1.0)
  td = np.where(mask, td, np.nan).astype(np.float32)  # never read
  want = np.zeros(NUM_WINDOWS)
  for s in range(NUM_WINDOWS):
    valid = np.abs(td[s][mask[s]])
    if valid.size:
      want[s] = eta * valid.max() + (1 - eta) * valid.mean()
  got = priorities_jit(td, mask, eta=eta)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert got.dtype == jnp.float32
  full = priorities_jit(np.nan_to_num(td), eta=eta)
  magnitudes = np.abs(np.nan_to_num(td))
  np.testing.assert_allclose(
    full, eta * magnitudes.max(1) + (1 - eta) * magnitudes.mean(1), rtol=1e-5, atol=1e-7
  )


def test_r2d2_priorities_stop_gradients():
  grad = jax.grad(lambda td: jaxbuf.r2d2_priorities(td).sum())(jnp.ones((2, 3)))
  np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize("burn_in", [0, 1, LENGTH - 1])
def test_burn_in_split_matches_slicing(burn_in):
  window = {
    "obs": np.arange(NUM_WINDOWS * LENGTH * 2, dtype=np.int32).reshape(NUM_WINDOWS, LENGTH, 2),
    "hidden": (
      np.zeros((NUM_WINDOWS, LENGTH, 3), np.float32),
      np.ones((NUM_WINDOWS, LENGTH), np.int8),
    ),
  }
  burn, trained = jaxbuf.burn_in_split(window, burn_in)
  for got, want in zip(jax.tree.leaves(burn), jax.tree.leaves(window)):
    np.testing.assert_array_equal(got, want[:, :burn_in])
    assert got.dtype == want.dtype
  for got, want in zip(jax.tree.leaves(trained), jax.tree.leaves(window)):
    np.testing.assert_array_equal(got, want[:, burn_in:])
    assert got.dtype == want.dtype


# --- Bad input: clear errors naming the argument -----------------------------


GOOD = dict(
  rewards=np.zeros((2, 4), np.float32),
  terminated=np.zeros((2, 4), bool),
  last=np.zeros((2, 4), bool),
)


@pytest.mark.parametrize(
  "change,error,words",
  [
    (dict(n=4), ValueError, ["L = 4", "n = 4", "L >= n + 1 = 5"]),
    (dict(n=0), ValueError, ["n must be positive"]),
    (dict(n=2.0), TypeError, ["n must be a Python int"]),
    (dict(rewards=np.zeros(4, np.float32)), ValueError, ["rewards", "[S, L]"]),
    (dict(rewards=np.zeros((2, 4), np.int32)), TypeError, ["rewards must be floating"]),
    (
      dict(terminated=np.zeros((2, 3), bool)),
      ValueError,
      ["terminated has shape (2, 3)", "like rewards"],
    ),
    (dict(last=np.zeros((2, 4), np.complex64)), TypeError, ["last must be bool"]),
    (dict(gamma=1.5), ValueError, ["gamma must be in [0, 1]"]),
    (dict(gamma=np.ones((4,))), ValueError, ["gamma has shape (4,)"]),
  ],
)
def test_bad_n_step_arguments_raise_naming_the_argument(change, error, words):
  kwargs = dict(GOOD, n=2, gamma=0.9) | change
  with pytest.raises(error) as raised:
    jaxbuf.n_step_targets(
      kwargs.pop("rewards"), kwargs.pop("terminated"), kwargs.pop("last"), **kwargs
    )
  for word in words:
    assert word in str(raised.value)


def test_bad_window_leaves_and_burn_in_raise_naming_the_leaf():
  with pytest.raises(ValueError, match=r"obs leaf \['pixels'\] has shape"):
    jaxbuf.n_step_transitions(
      {"pixels": np.zeros((2, 3, 5))}, np.zeros((2, 4)), **GOOD, n=1, gamma=0.9
    )
  with pytest.raises(ValueError, match=r"burn_in must be in \[0, L\) = \[0, 4\)"):
    jaxbuf.burn_in_split({"obs": np.zeros((2, 4))}, 4)
  with pytest.raises(TypeError, match="burn_in must be a Python int"):
    jaxbuf.burn_in_split({"obs": np.zeros((2, 4))}, 1.0)
  with pytest.raises(ValueError, match=r"window leaf \['b'\] has shape \(2, 3\)"):
    jaxbuf.burn_in_split({"a": np.zeros((2, 4)), "b": np.zeros((2, 3))}, 1)
  with pytest.raises(ValueError, match=r"mask has shape \(2, 3\)"):
    jaxbuf.r2d2_priorities(np.zeros((2, 4), np.float32), np.zeros((2, 3), bool))
  with pytest.raises(ValueError, match=r"eta must be in \[0, 1\]"):
    jaxbuf.r2d2_priorities(np.zeros((2, 4), np.float32), eta=2.0)
