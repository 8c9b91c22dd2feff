"""Rollout buffer against a NumPy model of per-env columns, plus its contracts."""

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxbuf

NUM_STEPS, NUM_ENVS = 5, 3
NUM_BLUEPRINTS = 5
# One buffer for the property test, so its jitted add compiles once.
ROLLOUT = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)


def example_step():
  """A factored, recurrent PPO step: every kind of leaf the buffer must hold."""
  return {
    "obs": jnp.zeros((4,), jnp.float32),
    "action": {"slot": jnp.int32(0), "blueprint": jnp.int32(0)},
    "log_prob": {"slot": jnp.float32(0), "blueprint": jnp.float32(0)},
    "action_mask": {"slot": jnp.zeros((3,), bool), "blueprint": jnp.zeros((NUM_BLUEPRINTS,), bool)},
    "value": jnp.float32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
    "truncated": jnp.bool_(False),
    "truncated_value": jnp.float32(0),
    "hidden": [(jnp.zeros((8,)), jnp.zeros((8,))) for _ in range(2)],  # LSTM
  }


def batch_of_steps(seed, num_envs=NUM_ENVS):
  """A random batch `[N, ...]` shaped like `example_step`."""
  rng = np.random.default_rng(seed)

  def draw(leaf):
    shape = (num_envs, *leaf.shape)
    if leaf.dtype == jnp.bool_:
      return rng.random(shape) < 0.5
    if jnp.issubdtype(leaf.dtype, jnp.integer):
      return rng.integers(0, 100, shape).astype(leaf.dtype)
    return rng.normal(size=shape).astype(leaf.dtype)

  return jax.tree.map(draw, example_step())


def test_init_is_time_major_and_keeps_dtypes():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  for leaf, example in zip(jax.tree.leaves(state.data), jax.tree.leaves(example_step())):
    assert leaf.shape == (NUM_STEPS, NUM_ENVS, *example.shape)
    assert leaf.dtype == example.dtype
  assert state.step_counts.dtype == jnp.int32
  assert state.step_counts.shape == (NUM_ENVS,)
  assert state.valid.shape == (NUM_STEPS, NUM_ENVS)
  assert not state.valid.any()


@hypothesis.given(
  st.lists(
    st.one_of(st.none(), st.lists(st.booleans(), min_size=NUM_ENVS, max_size=NUM_ENVS)),
    min_size=1,
    max_size=4 * NUM_STEPS,
  ),
  st.booleans(),
)
def test_ragged_adds_match_a_per_env_model(masks, reset_midway):
  rollout = ROLLOUT
  state = rollout.init(example_step())
  columns = [[] for _ in range(NUM_ENVS)]  # the model: each env's steps
  for call_index, mask in enumerate(masks):
    if reset_midway and call_index == len(masks) // 2:
      state = rollout.reset(state)
      columns = [[] for _ in range(NUM_ENVS)]
    steps = batch_of_steps(call_index)
    writes = [True] * NUM_ENVS if mask is None else mask
    state = rollout.add(state, steps, None if mask is None else jnp.array(mask))
    if any(writes) and all(len(column) == NUM_STEPS for column in columns):
      columns = [[] for _ in range(NUM_ENVS)]  # a full rollout starts over
    for env, writing in enumerate(writes):
      if writing and len(columns[env]) < NUM_STEPS:  # full: a no-op
        columns[env].append(jax.tree.map(lambda x, env=env: x[env], steps))
  np.testing.assert_array_equal(state.step_counts, [len(column) for column in columns])
  expected_valid = np.zeros((NUM_STEPS, NUM_ENVS), bool)
  data = jax.tree.map(np.asarray, state.data)
  for env, column in enumerate(columns):
    expected_valid[: len(column), env] = True
    for t, step in enumerate(column):
      stored = jax.tree.map(lambda x, t=t, env=env: x[t, env], data)
      jax.tree.map(np.testing.assert_array_equal, stored, step)
  np.testing.assert_array_equal(state.valid, expected_valid)


def test_a_write_to_a_full_env_is_dropped_while_others_have_room():
  rollout = jaxbuf.rollout_buffer(2, NUM_ENVS)
  state = rollout.init(example_step())
  for seed in range(2):
    state = rollout.add(state, batch_of_steps(seed), jnp.array([True, True, False]))
  before = jax.tree.map(np.asarray, state.data)
  state = rollout.add(state, batch_of_steps(99))  # envs 0 and 1 are full
  np.testing.assert_array_equal(state.step_counts, [2, 2, 1])
  after = jax.tree.map(np.asarray, state.data)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[:, :2], b[:, :2]), before, after)
  np.testing.assert_array_equal(after["obs"][0, 2], batch_of_steps(99)["obs"][2])


def test_a_full_rollout_starts_over_on_the_next_add():
  rollout = jaxbuf.rollout_buffer(2, NUM_ENVS)
  state = rollout.init(example_step())
  for seed in range(2):
    state = rollout.add(state, batch_of_steps(seed))
  assert state.valid.all()
  # A write of nothing changes nothing: the full rollout stays readable.
  state = rollout.add(state, batch_of_steps(7), jnp.zeros(NUM_ENVS, bool))
  np.testing.assert_array_equal(state.step_counts, [2] * NUM_ENVS)
  # Any write starts a new rollout for every env, as reset would.
  state = rollout.add(state, batch_of_steps(8), jnp.array([True, False, True]))
  np.testing.assert_array_equal(state.step_counts, [1, 0, 1])
  np.testing.assert_array_equal(state.data["obs"][0, 0], batch_of_steps(8)["obs"][0])


def test_a_ppo_loop_that_never_resets_trains_on_fresh_data():
  # The trap of issue 9: without reset, later adds were dropped and every
  # update read the first rollout again.
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  step = {
    "obs": jnp.float32(0),
    "reward": jnp.float32(0),
    "value": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }

  @jax.jit
  @chex.assert_max_traces(n=1)
  def update(state, update_index):
    def env_step(state, t):
      obs = jnp.full(NUM_ENVS, 100.0 * update_index + t, jnp.float32)
      return rollout.add(
        state,
        {
          "obs": obs,
          "reward": obs,
          "value": jnp.zeros(NUM_ENVS, jnp.float32),
          "terminated": jnp.zeros(NUM_ENVS, bool),
        },
      ), None

    state, _ = jax.lax.scan(env_step, state, jnp.arange(NUM_STEPS, dtype=jnp.float32))
    data = state.data
    advantages, _ = jaxbuf.compute_gae(
      data["reward"],
      data["value"],
      data["terminated"],
      jnp.zeros(NUM_ENVS),
      gamma=1.0,
      gae_lambda=1.0,
      valid=state.valid,
    )
    return state, data["obs"], advantages

  state = rollout.init(step)
  for update_index in range(3):
    state, seen, advantages = update(state, jnp.float32(update_index))
    expected = 100.0 * update_index + np.arange(NUM_STEPS, dtype=np.float32)
    np.testing.assert_array_equal(seen, np.repeat(expected[:, None], NUM_ENVS, 1))
    np.testing.assert_array_equal(advantages[0], expected.sum())
    np.testing.assert_array_equal(state.step_counts, [NUM_STEPS] * NUM_ENVS)


def test_help_shows_the_real_docstrings():
  for checked in (False, True):
    rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS, checked=checked)
    assert "starts over" in rollout.add.__doc__
    assert "Args:" in rollout.init.__doc__
    assert "partial" not in rollout.add.__doc__


def test_checked_mode_raises_on_a_dropped_write_and_only_then():
  rollout = jaxbuf.rollout_buffer(1, 2, checked=True)
  state = rollout.init({"x": jnp.float32(0)})
  state = rollout.add(state, {"x": jnp.ones(2, jnp.float32)}, jnp.array([True, False]))
  # Env 0 is full and env 1 has room: a write to env 0 would be dropped.
  with pytest.raises(checkify.JaxRuntimeError, match="full"):
    rollout.add(state, {"x": jnp.ones(2, jnp.float32)})
  # Inside a user's jit the check is functionalised with checkify.
  error, _ = jax.jit(checkify.checkify(rollout.add))(state, {"x": jnp.ones(2, jnp.float32)})
  with pytest.raises(checkify.JaxRuntimeError, match="full"):
    error.throw()
  # Env 0 (full) is not writing: no error.
  state = rollout.add(state, {"x": jnp.ones(2, jnp.float32)}, jnp.array([False, True]))
  # Every env full: the next add starts a new rollout, which is no error.
  state = rollout.add(state, {"x": jnp.full(2, 5.0, jnp.float32)})
  np.testing.assert_array_equal(state.step_counts, [1, 1])
  np.testing.assert_array_equal(state.data["x"], [[5.0, 5.0]])


def test_reset_keeps_storage_and_restarts_positions():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.add(rollout.init(example_step()), batch_of_steps(0))
  stored = np.asarray(state.data["obs"])
  state = rollout.reset(state)
  np.testing.assert_array_equal(state.step_counts, [0] * NUM_ENVS)
  np.testing.assert_array_equal(state.data["obs"], stored)
  state = rollout.add(state, batch_of_steps(1))
  np.testing.assert_array_equal(state.data["obs"][0], batch_of_steps(1)["obs"])


def test_action_mask_with_wrong_number_of_actions_names_the_leaf():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  steps = batch_of_steps(0)
  steps["action_mask"]["blueprint"] = jnp.ones((NUM_ENVS, NUM_BLUEPRINTS + 1), bool)
  with pytest.raises(
    ValueError,
    match=r"\['action_mask'\]\['blueprint'\].*"
    r"\(3, 6\).*\(3, 5\)",
  ):
    rollout.add(state, steps)


def test_hidden_state_with_an_extra_batch_axis_names_the_leaf():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  steps = batch_of_steps(0)
  h, c = steps["hidden"][1]
  steps["hidden"][1] = (h[:, None], c)  # [N, 1, 8]: a torch-style batch=1
  with pytest.raises(ValueError, match=r"\['hidden'\]\[1\]\[0\].*\(3, 1, 8\)"):
    rollout.add(state, steps)


def test_other_mistakes_fail_while_tracing():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  steps = batch_of_steps(0)
  with pytest.raises(TypeError, match=r"\['reward'\].*int32"):
    rollout.add(state, {**steps, "reward": jnp.zeros(NUM_ENVS, jnp.int32)})
  with pytest.raises(TypeError, match=r"missing leaves \['value'\]\.(\n|$)"):
    rollout.add(state, {k: v for k, v in steps.items() if k != "value"})
  with pytest.raises(ValueError, match=r"has shape \(2,"):
    rollout.add(state, jax.tree.map(lambda x: x[:2], steps))
  with pytest.raises(ValueError, match="mask has shape"):
    rollout.add(state, steps, jnp.ones(NUM_ENVS + 1, bool))
  with pytest.raises(TypeError, match="mask must be bool"):
    rollout.add(state, steps, jnp.ones(NUM_ENVS, jnp.int32))
  with pytest.raises(TypeError, match="num_steps"):
    jaxbuf.rollout_buffer(5.0, 2)
  with pytest.raises(ValueError, match="num_envs"):
    jaxbuf.rollout_buffer(5, 0)
  with pytest.raises(ValueError, match="2\\*\\*31"):
    jaxbuf.rollout_buffer(2**20, 2**11)


def test_add_is_jitted_with_donation_and_does_not_recompile():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  state = rollout.add(state, batch_of_steps(0))
  old = state
  state = rollout.add(state, batch_of_steps(1), jnp.array([True, False, True]))
  state = rollout.add(state, batch_of_steps(2), jnp.array([False, True, True]))
  assert old.step_counts.is_deleted()  # donated: updated in place
  assert rollout.add._cache_size() == 2  # one for mask=None, one with a mask
  np.testing.assert_array_equal(state.step_counts, [2, 2, 3])


def test_collect_in_scan_then_cond_between_add_and_reset():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  steps_over_time = jax.tree.map(
    lambda *xs: jnp.stack(xs), *[batch_of_steps(t) for t in range(NUM_STEPS)]
  )

  @jax.jit
  def collect(state, flag):
    def body(state, steps):
      return rollout.add(state, steps), None

    state, _ = jax.lax.scan(body, state, steps_over_time)
    return jax.lax.cond(flag, rollout.reset, lambda s: rollout.add(s, batch_of_steps(7)), state)

  state = collect(rollout.init(example_step()), True)
  jax.tree.map(np.testing.assert_array_equal, state.data, steps_over_time)
  assert not state.valid.any()
  # The other branch adds to the full rollout: a new one starts at row 0.
  state = collect(state, False)
  np.testing.assert_array_equal(state.step_counts, [1] * NUM_ENVS)
  jax.tree.map(
    np.testing.assert_array_equal, jax.tree.map(lambda x: x[0], state.data), batch_of_steps(7)
  )
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.tree.map(lambda x: x[1:], state.data),
    jax.tree.map(lambda x: x[1:], steps_over_time),
  )


def test_vmap_over_independent_rollouts():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  num_seeds = 4
  states = jax.vmap(lambda _: rollout.init(example_step()))(jnp.arange(num_seeds))
  steps = jax.tree.map(
    lambda *xs: jnp.stack(xs), *[batch_of_steps(seed) for seed in range(num_seeds)]
  )
  masks = jnp.array([[True, False, True]] * 2 + [[False, False, True]] * 2)
  states = jax.vmap(rollout.add)(states, steps, masks)
  np.testing.assert_array_equal(states.step_counts, masks.astype(np.int32))
  np.testing.assert_array_equal(states.data["obs"][2, 0, 2], steps["obs"][2, 2])
  # Fill seeds 0 and 1 (not 2 and 3): only those start over on the next add.
  fill = jnp.array([[True] * 3] * 2 + [[False, True, True]] * 2)
  for _ in range(NUM_STEPS):
    states = jax.vmap(rollout.add)(states, steps, fill)
  np.testing.assert_array_equal(states.step_counts, [[5, 5, 5]] * 2 + [[0, 5, 5]] * 2)
  states = jax.vmap(rollout.add)(states, steps, masks)
  np.testing.assert_array_equal(states.step_counts, [[1, 0, 1]] * 2 + [[0, 5, 5]] * 2)


def test_ragged_rollout_feeds_gae_with_its_valid_mask():
  rollout = jaxbuf.rollout_buffer(4, 2)
  state = rollout.init(
    {"reward": jnp.float32(0), "value": jnp.float32(0), "terminated": jnp.bool_(False)}
  )
  for mask in ([True, True], [True, False], [True, False]):
    state = rollout.add(
      state,
      {
        "reward": jnp.ones(2, jnp.float32),
        "value": jnp.zeros(2, jnp.float32),
        "terminated": jnp.zeros(2, bool),
      },
      jnp.array(mask),
    )
  advantages, _ = jaxbuf.compute_gae(
    state.data["reward"],
    state.data["value"],
    state.data["terminated"],
    jnp.zeros(2, jnp.float32),
    gamma=1.0,
    gae_lambda=1.0,
    valid=state.valid,
  )
  np.testing.assert_array_equal(advantages, [[3, 1], [2, 0], [1, 0], [0, 0]])


@pytest.mark.parametrize("checked", [False, True])
def test_a_list_or_numpy_mask_works_as_an_array_mask(checked):
  """A list mask reached the jitted add as one leaf per entry: a raw
  TracerArrayConversionError."""
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, 3, checked=checked)
  steps = {"obs": jnp.arange(6.0).reshape(3, 2)}
  wanted = rollout.add(
    rollout.init({"obs": jnp.zeros(2)}), steps, mask=jnp.array([True, False, True])
  )
  for mask in ([True, False, True], (True, False, True), np.array([True, False, True])):
    got = rollout.add(rollout.init({"obs": jnp.zeros(2)}), steps, mask=mask)
    chex.assert_trees_all_equal(got, wanted)
  state = rollout.init({"obs": jnp.zeros(2)})
  with pytest.raises(TypeError, match="mask must be bool"):
    rollout.add(state, steps, mask=[1, 0, 1])
  assert state.step_counts.tolist() == [0, 0, 0]  # refused, not consumed
