"""GAE, lambda-returns and n-step returns against plain-loop NumPy references.

The references walk one stream backwards (GAE) or forwards (n-step) over its
valid steps, with random terminations, truncations and ragged padding; the
lambda-return reference is built independently as the lambda-weighted mixture
of n-step references.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

import jaxbuf

# ---------------------------------------------------------------- references


def reference_gae(rewards, values, terminated, last_value, gamma, gae_lambda,
                  truncated, truncated_values, valid):
  """One stream `[T]`: the textbook backward loop, skipping padding."""
  advantages = np.zeros(len(rewards))
  next_value, running = last_value, 0.0
  for t in reversed(range(len(rewards))):
    if not valid[t]:
      continue
    if terminated[t]:
      bootstrap = 0.0
    elif truncated[t]:
      bootstrap = truncated_values[t]
    else:
      bootstrap = next_value
    delta = rewards[t] + gamma * bootstrap - values[t]
    ends = terminated[t] or truncated[t]
    running = delta + (0.0 if ends else gamma * gae_lambda * running)
    advantages[t] = running
    next_value = values[t]
  return advantages, advantages + np.where(valid, values, 0.0)


def reference_n_step(rewards, values, terminated, last_value, n, gamma,
                     truncated, truncated_values, valid):
  """One stream `[T]`: sums up to n rewards forwards over the valid steps."""
  steps = [t for t in range(len(rewards)) if valid[t]]
  returns = np.array(values, np.float64)
  for position, t in enumerate(steps):
    total, discount = 0.0, 1.0
    for k in range(n):
      if position + k >= len(steps):      # the rollout ended: last_value
        total += discount * last_value
        break
      s = steps[position + k]
      total += discount * rewards[s]
      discount *= gamma
      if terminated[s]:
        break
      if truncated[s]:
        total += discount * truncated_values[s]
        break
    else:                                  # n steps taken: V(state reached)
      reached = position + n
      total += discount * (values[steps[reached]] if reached < len(steps)
                           else last_value)
    returns[t] = total
  return returns


def reference_lambda_returns(rewards, values, terminated, last_value, gamma,
                             gae_lambda, truncated, truncated_values, valid):
  """One stream `[T]`: `(1 - l) sum_n l^(n-1) G(n)`, G(n) constant past the end."""
  steps = [t for t in range(len(rewards)) if valid[t]]
  returns = np.array(values, np.float64)
  for position, t in enumerate(steps):
    horizon = 1   # steps until the episode or the rollout ends, this one included
    while (position + horizon - 1 < len(steps) - 1
           and not terminated[steps[position + horizon - 1]]
           and not truncated[steps[position + horizon - 1]]):
      horizon += 1
    n_step = [reference_n_step(rewards, values, terminated, last_value, n,
                               gamma, truncated, truncated_values, valid)[t]
              for n in range(1, horizon + 1)]
    returns[t] = ((1 - gae_lambda) * sum(gae_lambda ** (n - 1) * n_step[n - 1]
                                          for n in range(1, horizon))
                  + gae_lambda ** (horizon - 1) * n_step[-1])
  return returns


def per_stream(reference, rollout, *settings):
  """Applies a one-stream reference to every column of a `[T, N]` rollout."""
  results = [reference(rollout["rewards"][:, n], rollout["values"][:, n],
                       rollout["terminated"][:, n], rollout["last_value"][n],
                       *settings, rollout["truncated"][:, n],
                       rollout["truncated_values"][:, n], rollout["valid"][:, n])
             for n in range(rollout["values"].shape[1])]
  if isinstance(results[0], tuple):
    return tuple(np.stack(parts, axis=1) for parts in zip(*results))
  return np.stack(results, axis=1)


def random_rollout(seed, num_steps, num_envs, *, end_probability=0.15,
                   valid_kind="all"):
  """Random float32 `[T, N]` rollout; padding holds NaN so leaks show."""
  rng = np.random.default_rng(seed)
  shape = (num_steps, num_envs)
  if valid_kind == "all":
    valid = np.ones(shape, bool)
  elif valid_kind == "prefix":
    counts = rng.integers(0, num_steps + 1, num_envs)
    valid = np.arange(num_steps)[:, None] < counts[None, :]
  else:
    valid = rng.random(shape) < 0.7
  rollout = dict(
      rewards=rng.normal(size=shape).astype(np.float32),
      values=rng.normal(size=shape).astype(np.float32),
      terminated=rng.random(shape) < end_probability,
      truncated=rng.random(shape) < end_probability,
      truncated_values=rng.normal(size=shape).astype(np.float32),
      last_value=rng.normal(size=num_envs).astype(np.float32),
      valid=valid)
  for name in ("rewards", "values", "truncated_values"):
    rollout[name] = np.where(valid, rollout[name], np.nan).astype(np.float32)
  return rollout


def call(function, rollout, **kwargs):
  return function(rollout["rewards"], rollout["values"], rollout["terminated"],
                  rollout["last_value"], truncated=rollout["truncated"],
                  truncated_values=rollout["truncated_values"],
                  valid=(None if isinstance(rollout["valid"], np.ndarray)
                         and rollout["valid"].all() else rollout["valid"]),
                  **kwargs)


# One compiled program per (shape, setting) keeps the hypothesis runs fast.
jit_gae = jax.jit(jaxbuf.compute_gae,
                  static_argnames=("associative",))
jit_lambda = jax.jit(jaxbuf.lambda_returns, static_argnames=("associative",))
jit_n_step = jax.jit(jaxbuf.n_step_returns, static_argnames=("n",))

rollouts = st.builds(
    random_rollout, seed=st.integers(0, 2**32 - 1),
    num_steps=st.sampled_from([1, 9]), num_envs=st.just(3),
    end_probability=st.sampled_from([0.0, 0.15, 0.5]),
    valid_kind=st.sampled_from(["all", "prefix", "random"]))
gammas = st.sampled_from([0.0, 0.5, 0.99, 1.0])
lambdas = st.sampled_from([0.0, 0.5, 0.95, 1.0])

# ------------------------------------------------------------------ GAE


@hypothesis.given(rollouts, gammas, lambdas, st.booleans())
def test_gae_matches_reference(rollout, gamma, gae_lambda, associative):
  advantages, returns = call(jit_gae, rollout, gamma=gamma,
                             gae_lambda=gae_lambda, associative=associative)
  expected_advantages, expected_returns = per_stream(
      reference_gae, rollout, gamma, gae_lambda)
  valid = rollout["valid"]
  np.testing.assert_allclose(advantages, expected_advantages, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.where(valid, returns, 0.0), expected_returns,
                             rtol=1e-5, atol=1e-5)
  # Padding: advantage 0, return = value (the NaN written there).
  assert np.all(np.asarray(advantages)[~valid] == 0.0)
  assert np.all(np.isfinite(np.asarray(advantages)))


@hypothesis.given(rollouts, gammas, lambdas, st.booleans())
def test_lambda_returns_match_mixture_of_n_step_returns(rollout, gamma,
                                                         gae_lambda, associative):
  returns = call(jit_lambda, rollout, gamma=gamma, gae_lambda=gae_lambda,
                 associative=associative)
  expected = per_stream(reference_lambda_returns, rollout, gamma, gae_lambda)
  valid = rollout["valid"]
  np.testing.assert_allclose(np.where(valid, returns, 0.0),
                             np.where(valid, expected, 0.0), rtol=1e-4, atol=1e-4)
  _, gae_returns = call(jit_gae, rollout, gamma=gamma, gae_lambda=gae_lambda)
  np.testing.assert_allclose(np.where(valid, returns, 0.0),
                             np.where(valid, gae_returns, 0.0), rtol=1e-4,
                             atol=1e-4)


@hypothesis.given(rollouts, gammas, st.sampled_from([1, 2, 3, 5]))
def test_n_step_returns_match_reference(rollout, gamma, n):
  returns = call(jit_n_step, rollout, gamma=gamma, n=n)
  expected = per_stream(reference_n_step, rollout, n, gamma)
  valid = rollout["valid"]
  np.testing.assert_allclose(np.where(valid, returns, 0.0),
                             np.where(valid, expected, 0.0), rtol=1e-5, atol=1e-5)


def test_n_step_with_horizon_beyond_rollout_is_the_monte_carlo_return():
  rollout = random_rollout(3, 9, 4, valid_kind="prefix")
  long = call(jit_n_step, rollout, gamma=0.9, n=12)
  exact = call(jit_lambda, rollout, gamma=0.9, gae_lambda=1.0)
  valid = rollout["valid"]
  np.testing.assert_allclose(np.where(valid, long, 0.0),
                             np.where(valid, exact, 0.0), rtol=1e-5, atol=1e-5)


def test_termination_wins_over_truncation():
  ones = jnp.ones(2)
  kwargs = dict(gamma=0.5, gae_lambda=0.9, truncated=jnp.array([True, False]),
                truncated_values=jnp.array([100.0, 0.0]))
  both, _ = jaxbuf.compute_gae(ones, ones, jnp.array([True, False]),
                               jnp.float32(0.0), **kwargs)
  terminated_only, _ = jaxbuf.compute_gae(ones, ones, jnp.array([True, False]),
                                          jnp.float32(0.0), gamma=0.5,
                                          gae_lambda=0.9)
  np.testing.assert_array_equal(both, terminated_only)
  assert both[0] == 0.0   # r - V, nothing bootstrapped


def test_truncation_bootstraps_from_final_observation_value():
  # Step 0 is truncated; the next stored value belongs to a new episode.
  advantages, _ = jaxbuf.compute_gae(
      jnp.array([1.0, 0.0]), jnp.array([0.0, -50.0]), jnp.zeros(2, bool),
      jnp.float32(0.0), gamma=0.5, gae_lambda=1.0,
      truncated=jnp.array([True, False]),
      truncated_values=jnp.array([4.0, 0.0]))
  assert advantages[0] == 1.0 + 0.5 * 4.0


def test_matches_rlax_without_truncation():
  rollout = random_rollout(1, 33, 5)
  gamma, gae_lambda = 0.97, 0.9
  discounts = gamma * (1.0 - rollout["terminated"].astype(np.float32))
  bootstrap = np.concatenate([rollout["values"], rollout["last_value"][None]])
  expected = jax.jit(jax.vmap(rlax.truncated_generalized_advantage_estimation,
                              in_axes=(1, 1, None, 1), out_axes=1))(
                          rollout["rewards"], discounts, gae_lambda, bootstrap)
  for associative in (False, True):
    advantages, _ = jit_gae(
        rollout["rewards"], rollout["values"], rollout["terminated"],
        rollout["last_value"], gamma=gamma, gae_lambda=gae_lambda,
        associative=associative)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
  lambda_expected = jax.jit(jax.vmap(rlax.lambda_returns,
                                     in_axes=(1, 1, 1, None), out_axes=1))(
                                         rollout["rewards"], discounts,
                                         bootstrap[1:], gae_lambda)
  np.testing.assert_allclose(
      jit_lambda(rollout["rewards"], rollout["values"], rollout["terminated"],
                 rollout["last_value"], gamma=gamma, gae_lambda=gae_lambda),
      lambda_expected, rtol=1e-5, atol=1e-5)
  n_step_expected = jax.jit(jax.vmap(
      functools.partial(rlax.n_step_bootstrapped_returns, n=4),
      in_axes=(1, 1, 1), out_axes=1))(rollout["rewards"], discounts,
                                      bootstrap[1:])
  np.testing.assert_allclose(
      jit_n_step(rollout["rewards"], rollout["values"], rollout["terminated"],
                 rollout["last_value"], n=4, gamma=gamma),
      n_step_expected, rtol=1e-5, atol=1e-5)


def test_associative_equals_sequential_over_a_long_horizon():
  rollout = random_rollout(2, 1024, 8, end_probability=0.004,
                           valid_kind="random")
  kwargs = dict(gamma=0.999, gae_lambda=0.98)
  sequential = call(jit_gae, rollout, associative=False, **kwargs)
  parallel = call(jit_gae, rollout, associative=True, **kwargs)
  for a, b in zip(sequential, parallel):
    valid = rollout["valid"]
    a, b = np.where(valid, a, 0.0), np.where(valid, b, 0.0)
    scale = np.max(np.abs(a))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale)


# -------------------------------------------------- composability and shapes


def test_trailing_batch_shape_equals_per_column_calls():
  rollout = random_rollout(4, 10, 6, valid_kind="prefix")
  reshaped = {k: v.reshape(v.shape[:-1] + (2, 3)) for k, v in rollout.items()}
  advantages, _ = call(jaxbuf.compute_gae, reshaped, gamma=0.9, gae_lambda=0.8)
  flat, _ = call(jaxbuf.compute_gae, rollout, gamma=0.9, gae_lambda=0.8)
  assert advantages.shape == (10, 2, 3)
  np.testing.assert_array_equal(advantages.reshape(10, 6), flat)


def test_vmap_over_envs_equals_batched_call():
  rollout = random_rollout(5, 12, 4, valid_kind="random")
  batched = call(jaxbuf.compute_gae, rollout, gamma=0.9, gae_lambda=0.8)

  def one_stream(rewards, values, terminated, last_value, truncated,
                 truncated_values, valid):
    return jaxbuf.compute_gae(rewards, values, terminated, last_value,
                              gamma=0.9, gae_lambda=0.8, truncated=truncated,
                              truncated_values=truncated_values, valid=valid)

  names = ("rewards", "values", "terminated", "last_value", "truncated",
           "truncated_values", "valid")
  mapped = jax.vmap(one_stream, in_axes=(1, 1, 1, 0, 1, 1, 1), out_axes=1)(
      *(rollout[name] for name in names))
  for a, b in zip(batched, mapped):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_inside_scan_and_cond_with_traced_gamma_and_no_recompilation():
  rollouts = [random_rollout(seed, 8, 3) for seed in range(4)]
  stacked = {k: np.stack([r[k] for r in rollouts]) for k in rollouts[0]}

  @jax.jit
  def many(stacked, gamma):
    def body(carry, rollout):
      advantages, _ = jax.lax.cond(
          gamma > 0.5,
          lambda: call(jaxbuf.compute_gae, rollout, gamma=gamma, gae_lambda=0.9),
          lambda: call(jaxbuf.compute_gae, rollout, gamma=gamma, gae_lambda=0.9,
                       associative=True))
      return carry + advantages.sum(), advantages
    return jax.lax.scan(body, 0.0, stacked)

  _, scanned = many(stacked, 0.95)
  _, scanned_low = many(stacked, 0.3)
  assert many._cache_size() == 1
  for i, rollout in enumerate(rollouts):
    for gamma, result in ((0.95, scanned), (0.3, scanned_low)):
      expected, _ = per_stream(reference_gae, rollout, gamma, 0.9)
      np.testing.assert_allclose(result[i], expected, rtol=1e-5, atol=1e-5)


def test_gradients_are_stopped():
  rollout = random_rollout(6, 5, 2)

  def loss(values, last_value):
    advantages, returns = jaxbuf.compute_gae(
        rollout["rewards"], values, rollout["terminated"], last_value,
        gamma=0.9, gae_lambda=0.9)
    return (advantages.sum() + returns.sum()
            + jaxbuf.lambda_returns(rollout["rewards"], values,
                                    rollout["terminated"], last_value,
                                    gamma=0.9, gae_lambda=0.9).sum())

  value_grad, last_grad = jax.grad(loss, argnums=(0, 1))(
      jnp.asarray(rollout["values"]), jnp.asarray(rollout["last_value"]))
  assert not np.any(value_grad) and not np.any(last_grad)


def test_shape_and_type_errors_are_raised_while_tracing():
  values = jnp.zeros((4, 2))
  done = jnp.zeros((4, 2), bool)
  with pytest.raises(AssertionError, match="shape"):
    jaxbuf.compute_gae(jnp.zeros((4, 3)), values, done, jnp.zeros(2),
                       gamma=0.9, gae_lambda=0.9)
  with pytest.raises(AssertionError):
    jaxbuf.compute_gae(jnp.zeros((4, 2)), values, done, jnp.zeros(3),
                       gamma=0.9, gae_lambda=0.9)
  with pytest.raises(AssertionError):
    jaxbuf.compute_gae(jnp.zeros((4, 2), jnp.int32), values, done, jnp.zeros(2),
                       gamma=0.9, gae_lambda=0.9)
  with pytest.raises(ValueError, match="together"):
    jaxbuf.compute_gae(values, values, done, jnp.zeros(2), gamma=0.9,
                       gae_lambda=0.9, truncated=done)
  with pytest.raises(AssertionError):
    jaxbuf.compute_gae(values, values, done, jnp.zeros(2), gamma=0.9,
                       gae_lambda=0.9, valid=jnp.ones((4,), bool))
  with pytest.raises(ValueError, match="positive"):
    jaxbuf.n_step_returns(values, values, done, jnp.zeros(2), n=0, gamma=0.9)


# ----------------------------------------------------------- normalization


def test_normalize_advantages_uses_valid_entries_only():
  rng = np.random.default_rng(7)
  advantages = rng.normal(3.0, 2.0, (16, 4)).astype(np.float32)
  valid = rng.random((16, 4)) < 0.6
  advantages[~valid] = 1e6       # padding must not move the statistics
  normalized = np.asarray(jaxbuf.normalize_advantages(advantages, valid))
  kept = advantages[valid]
  np.testing.assert_allclose(normalized[valid],
                             (kept - kept.mean()) / (kept.std() + 1e-8),
                             rtol=1e-5, atol=1e-5)
  assert np.all(normalized[~valid] == 0.0)
  everything = np.asarray(jaxbuf.normalize_advantages(advantages))
  np.testing.assert_allclose(everything.mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(everything.std(), 1.0, rtol=1e-4)


def test_normalize_advantages_with_no_valid_entry_is_zero():
  out = jaxbuf.normalize_advantages(jnp.ones(4), jnp.zeros(4, bool))
  np.testing.assert_array_equal(out, np.zeros(4))


def test_outputs_keep_the_values_dtype():
  rollout = random_rollout(8, 6, 2)
  as_bf16 = {k: (v.astype(jnp.bfloat16) if v.dtype == np.float32 else v)
             for k, v in rollout.items()}
  for associative in (False, True):
    advantages, returns = call(jaxbuf.compute_gae, as_bf16,
                               gamma=jnp.float32(0.9), gae_lambda=0.95,
                               associative=associative)
    assert advantages.dtype == returns.dtype == jnp.bfloat16
    expected, _ = call(jaxbuf.compute_gae, rollout, gamma=0.9, gae_lambda=0.95)
    np.testing.assert_allclose(advantages.astype(np.float32), expected,
                               rtol=0.05, atol=0.05)
