"""Rollout buffer against a NumPy model of per-env columns, plus its contracts."""

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
      "action_mask": {"slot": jnp.zeros((3,), bool),
                      "blueprint": jnp.zeros((NUM_BLUEPRINTS,), bool)},
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
  for leaf, example in zip(jax.tree.leaves(state.data),
                           jax.tree.leaves(example_step())):
    assert leaf.shape == (NUM_STEPS, NUM_ENVS, *example.shape)
    assert leaf.dtype == example.dtype
  assert state.step_counts.dtype == jnp.int32
  assert state.step_counts.shape == (NUM_ENVS,)
  assert state.valid.shape == (NUM_STEPS, NUM_ENVS)
  assert not state.valid.any()


@hypothesis.given(st.lists(st.one_of(st.none(),
                                     st.lists(st.booleans(), min_size=NUM_ENVS,
                                              max_size=NUM_ENVS)),
                           min_size=1, max_size=3 * NUM_STEPS),
                  st.booleans())
def test_ragged_adds_match_a_per_env_model(masks, reset_midway):
  rollout = ROLLOUT
  state = rollout.init(example_step())
  columns = [[] for _ in range(NUM_ENVS)]   # the model: each env's steps
  for call_index, mask in enumerate(masks):
    if reset_midway and call_index == len(masks) // 2:
      state = rollout.reset(state)
      columns = [[] for _ in range(NUM_ENVS)]
    steps = batch_of_steps(call_index)
    writes = [True] * NUM_ENVS if mask is None else mask
    state = rollout.add(state, steps,
                        None if mask is None else jnp.array(mask))
    for env, writing in enumerate(writes):
      if writing and len(columns[env]) < NUM_STEPS:   # full: a no-op
        columns[env].append(jax.tree.map(lambda x, env=env: x[env], steps))
  np.testing.assert_array_equal(state.step_counts,
                                [len(column) for column in columns])
  expected_valid = np.zeros((NUM_STEPS, NUM_ENVS), bool)
  data = jax.tree.map(np.asarray, state.data)
  for env, column in enumerate(columns):
    expected_valid[:len(column), env] = True
    for t, step in enumerate(column):
      stored = jax.tree.map(lambda x, t=t, env=env: x[t, env], data)
      jax.tree.map(np.testing.assert_array_equal, stored, step)
  np.testing.assert_array_equal(state.valid, expected_valid)


def test_writing_past_num_steps_leaves_every_column_unchanged():
  rollout = jaxbuf.rollout_buffer(2, NUM_ENVS)
  state = rollout.init(example_step())
  for seed in range(2):
    state = rollout.add(state, batch_of_steps(seed))
  before = jax.tree.map(np.asarray, state.data)
  state = rollout.add(state, batch_of_steps(99))
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, state.data))
  np.testing.assert_array_equal(state.step_counts, [2] * NUM_ENVS)


def test_checked_mode_raises_on_overflow_and_only_then():
  rollout = jaxbuf.rollout_buffer(1, 2, checked=True)
  state = rollout.init({"x": jnp.float32(0)})
  state = rollout.add(state, {"x": jnp.ones(2)}, jnp.array([True, False]))
  # Env 1 still has room; env 0 (full) is not writing: no error.
  state = rollout.add(state, {"x": jnp.ones(2)}, jnp.array([False, True]))
  with pytest.raises(checkify.JaxRuntimeError, match="full"):
    rollout.add(state, {"x": jnp.ones(2)})
  # Inside a user's jit the check is functionalised with checkify.
  error, _ = jax.jit(checkify.checkify(rollout.add))(state, {"x": jnp.ones(2)})
  with pytest.raises(checkify.JaxRuntimeError, match="full"):
    error.throw()


def test_reset_keeps_storage_and_restarts_positions():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.add(rollout.init(example_step()), batch_of_steps(0))
  stored = np.asarray(state.data["obs"])
  state = rollout.reset(state)
  np.testing.assert_array_equal(state.step_counts, [0] * NUM_ENVS)
  np.testing.assert_array_equal(state.data["obs"], stored)
  state = rollout.add(state, batch_of_steps(1))
  np.testing.assert_array_equal(state.data["obs"][0],
                                batch_of_steps(1)["obs"])


def test_action_mask_with_wrong_number_of_actions_names_the_leaf():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  steps = batch_of_steps(0)
  steps["action_mask"]["blueprint"] = jnp.ones((NUM_ENVS, NUM_BLUEPRINTS + 1),
                                               bool)
  with pytest.raises(ValueError, match=r"\['action_mask'\]\['blueprint'\].*"
                     r"\(3, 6\).*\(3, 5\)"):
    rollout.add(state, steps)


def test_hidden_state_with_an_extra_batch_axis_names_the_leaf():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  steps = batch_of_steps(0)
  h, c = steps["hidden"][1]
  steps["hidden"][1] = (h[:, None], c)      # [N, 1, 8]: a torch-style batch=1
  with pytest.raises(ValueError, match=r"\['hidden'\]\[1\]\[0\].*\(3, 1, 8\)"):
    rollout.add(state, steps)


def test_other_mistakes_fail_while_tracing():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  state = rollout.init(example_step())
  steps = batch_of_steps(0)
  with pytest.raises(TypeError, match=r"\['reward'\].*int32"):
    rollout.add(state, {**steps, "reward": jnp.zeros(NUM_ENVS, jnp.int32)})
  with pytest.raises(TypeError, match="missing leaves"):
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
  assert old.step_counts.is_deleted()     # donated: updated in place
  assert rollout.add._cache_size() == 2   # one for mask=None, one with a mask
  np.testing.assert_array_equal(state.step_counts, [2, 2, 3])


def test_collect_in_scan_then_cond_between_add_and_reset():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  steps_over_time = jax.tree.map(
      lambda *xs: jnp.stack(xs), *[batch_of_steps(t) for t in range(NUM_STEPS)])

  @jax.jit
  def collect(state, flag):
    def body(state, steps):
      return rollout.add(state, steps), None
    state, _ = jax.lax.scan(body, state, steps_over_time)
    return jax.lax.cond(flag, rollout.reset,
                        lambda s: rollout.add(s, batch_of_steps(7)), state)

  state = collect(rollout.init(example_step()), False)
  jax.tree.map(np.testing.assert_array_equal, state.data, steps_over_time)
  assert state.valid.all()
  state = collect(state, True)
  assert not state.valid.any()


def test_vmap_over_independent_rollouts():
  rollout = jaxbuf.rollout_buffer(NUM_STEPS, NUM_ENVS)
  num_seeds = 4
  states = jax.vmap(lambda _: rollout.init(example_step()))(jnp.arange(num_seeds))
  steps = jax.tree.map(lambda *xs: jnp.stack(xs),
                       *[batch_of_steps(seed) for seed in range(num_seeds)])
  masks = jnp.array([[True, False, True]] * 2 + [[False, False, True]] * 2)
  states = jax.vmap(rollout.add)(states, steps, masks)
  np.testing.assert_array_equal(states.step_counts, masks.astype(np.int32))
  np.testing.assert_array_equal(states.data["obs"][2, 0, 2],
                                steps["obs"][2, 2])


def test_ragged_rollout_feeds_gae_with_its_valid_mask():
  rollout = jaxbuf.rollout_buffer(4, 2)
  state = rollout.init({"reward": jnp.float32(0), "value": jnp.float32(0),
                        "terminated": jnp.bool_(False)})
  for mask in ([True, True], [True, False], [True, False]):
    state = rollout.add(state, {"reward": jnp.ones(2), "value": jnp.zeros(2),
                                "terminated": jnp.zeros(2, bool)},
                        jnp.array(mask))
  advantages, _ = jaxbuf.compute_gae(
      state.data["reward"], state.data["value"], state.data["terminated"],
      jnp.zeros(2), gamma=1.0, gae_lambda=1.0, valid=state.valid)
  np.testing.assert_array_equal(advantages, [[3, 1], [2, 0], [1, 0], [0, 0]])
