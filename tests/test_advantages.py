"""GAE, lambda-returns and n-step returns against plain-loop NumPy references.

The references walk one stream backwards (GAE, lambda-returns) or forwards
(n-step) over its valid steps, with random terminations, truncations, ragged
padding and scalar or per-step gammas and lambdas; for scalar settings the
lambda-return is also checked against the lambda-weighted mixture of n-step
references. rlax's own test vectors pin the per-step convention, and NaN or
inf planted in every input the math does not use must change nothing.
"""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

import jaxbuf

# ---------------------------------------------------------------- references


def reference_gae(
  rewards, values, terminated, last_value, gamma, gae_lambda, truncated, truncated_values, valid
):
  """One stream `[T]`: the textbook backward loop, skipping padding."""
  gamma = np.broadcast_to(gamma, np.shape(rewards))
  gae_lambda = np.broadcast_to(gae_lambda, np.shape(rewards))
  advantages, returns = np.zeros(len(rewards)), np.zeros(len(rewards))
  next_value, running = last_value, 0.0
  for t in reversed(range(len(rewards))):
    if not valid[t]:
      continue
    if terminated[t]:
      delta = rewards[t] - values[t]
    else:
      bootstrap = truncated_values[t] if truncated[t] else next_value
      delta = rewards[t] + gamma[t] * bootstrap - values[t]
    if terminated[t] or truncated[t]:
      running = delta
    else:
      running = delta + gamma[t] * gae_lambda[t] * running
    advantages[t], returns[t] = running, running + values[t]
    next_value = values[t]
  return advantages, returns


def reference_lambda_loop(
  rewards, values, terminated, last_value, gamma, gae_lambda, truncated, truncated_values, valid
):
  """One stream `[T]`: `G = r + g ((1 - l) V(next) + l G(next))`, backwards."""
  gamma = np.broadcast_to(gamma, np.shape(rewards))
  gae_lambda = np.broadcast_to(gae_lambda, np.shape(rewards))
  returns = np.zeros(len(rewards))
  next_value = next_return = last_value
  for t in reversed(range(len(rewards))):
    if not valid[t]:
      continue
    if terminated[t]:
      returns[t] = rewards[t]
    elif truncated[t]:
      returns[t] = rewards[t] + gamma[t] * truncated_values[t]
    else:
      returns[t] = rewards[t] + gamma[t] * (
        (1 - gae_lambda[t]) * next_value + gae_lambda[t] * next_return
      )
    next_value, next_return = values[t], returns[t]
  return returns


def reference_n_step(
  rewards, values, terminated, last_value, n, gamma, truncated, truncated_values, valid
):
  """One stream `[T]`: sums up to n rewards forwards over the valid steps."""
  gamma = np.broadcast_to(gamma, np.shape(rewards))
  steps = [t for t in range(len(rewards)) if valid[t]]
  returns = np.zeros(len(rewards))
  for position, t in enumerate(steps):
    total, discount = 0.0, 1.0
    for k in range(n):
      if position + k >= len(steps):  # the rollout ended: last_value
        total += discount * last_value
        break
      s = steps[position + k]
      total += discount * rewards[s]
      if terminated[s]:
        break
      discount *= gamma[s]
      if truncated[s]:
        total += discount * truncated_values[s]
        break
    else:  # n steps taken: V(state reached)
      reached = position + n
      total += discount * (values[steps[reached]] if reached < len(steps) else last_value)
    returns[t] = total
  return returns


def reference_lambda_returns(
  rewards, values, terminated, last_value, gamma, gae_lambda, truncated, truncated_values, valid
):
  """One stream `[T]`: `(1 - l) sum_n l^(n-1) G(n)`, G(n) constant past the end."""
  steps = [t for t in range(len(rewards)) if valid[t]]
  returns = np.zeros(len(rewards))
  for position, t in enumerate(steps):
    horizon = 1  # steps until the episode or the rollout ends, this one included
    while (
      position + horizon - 1 < len(steps) - 1
      and not terminated[steps[position + horizon - 1]]
      and not truncated[steps[position + horizon - 1]]
    ):
      horizon += 1
    n_step = [
      reference_n_step(
        rewards, values, terminated, last_value, n, gamma, truncated, truncated_values, valid
      )[t]
      for n in range(1, horizon + 1)
    ]
    returns[t] = (1 - gae_lambda) * sum(
      gae_lambda ** (n - 1) * n_step[n - 1] for n in range(1, horizon)
    ) + gae_lambda ** (horizon - 1) * n_step[-1]
  return returns


def per_stream(reference, rollout, *settings):
  """Applies a one-stream reference to every column of a `[T, N]` rollout.

  A setting that is an array `[T, N]` (a per-step gamma or lambda) is passed
  column by column; a scalar as it is.
  """

  def column(x, n):
    return x[:, n] if np.ndim(x) == 2 else x

  results = [
    reference(
      rollout["rewards"][:, n],
      rollout["values"][:, n],
      rollout["terminated"][:, n],
      rollout["last_value"][n],
      *(column(setting, n) for setting in settings),
      rollout["truncated"][:, n],
      rollout["truncated_values"][:, n],
      rollout["valid"][:, n],
    )
    for n in range(rollout["values"].shape[1])
  ]
  if isinstance(results[0], tuple):
    return tuple(np.stack(parts, axis=1) for parts in zip(*results))
  return np.stack(results, axis=1)


def random_rollout(seed, num_steps, num_envs, *, end_probability=0.15, valid_kind="all"):
  """Random float32 `[T, N]` rollout; padding holds NaN so leaks show.

  Also draws per-step `gammas` and `lambdas` in [0, 1] (NaN at padding).
  """
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
    gammas=rng.choice([0.0, 0.5, 0.9, 1.0], shape).astype(np.float32),
    lambdas=rng.choice([0.0, 0.3, 0.95, 1.0], shape).astype(np.float32),
    valid=valid,
  )
  for name in ("rewards", "values", "truncated_values", "gammas", "lambdas"):
    rollout[name] = np.where(valid, rollout[name], np.nan).astype(np.float32)
  return rollout


def call(function, rollout, **kwargs):
  return function(
    rollout["rewards"],
    rollout["values"],
    rollout["terminated"],
    rollout["last_value"],
    truncated=rollout["truncated"],
    truncated_values=rollout["truncated_values"],
    valid=(
      None
      if isinstance(rollout["valid"], np.ndarray) and rollout["valid"].all()
      else rollout["valid"]
    ),
    **kwargs,
  )


# One compiled program per (shape, setting) keeps the hypothesis runs fast.
jit_gae = jax.jit(jaxbuf.compute_gae, static_argnames=("associative",))
jit_lambda = jax.jit(jaxbuf.lambda_returns, static_argnames=("associative",))
jit_n_step = jax.jit(jaxbuf.n_step_returns, static_argnames=("n",))

rollouts = st.builds(
  random_rollout,
  seed=st.integers(0, 2**32 - 1),
  num_steps=st.sampled_from([1, 9]),
  num_envs=st.just(3),
  end_probability=st.sampled_from([0.0, 0.15, 0.5]),
  valid_kind=st.sampled_from(["all", "prefix", "random"]),
)
gammas = st.sampled_from([0.0, 0.5, 0.99, 1.0, "per step"])
lambdas = st.sampled_from([0.0, 0.5, 0.95, 1.0, "per step"])


def setting(rollout, value, name):
  """A scalar setting as it is; "per step" picks the rollout's `[T, N]` array."""
  return rollout[name] if value == "per step" else value


def assert_close_at_valid(actual, expected, valid, tolerance=1e-5):
  actual = np.asarray(actual)
  assert np.all(np.isfinite(actual)), "a NaN at padding leaked into a result"
  np.testing.assert_allclose(np.where(valid, actual, 0.0), expected, rtol=tolerance, atol=tolerance)
  np.testing.assert_array_equal(actual[~valid], 0.0)  # padding reads 0


# ------------------------------------------------------------------ GAE


@hypothesis.given(rollouts, gammas, lambdas, st.booleans())
def test_gae_matches_reference(rollout, gamma, gae_lambda, associative):
  gamma = setting(rollout, gamma, "gammas")
  gae_lambda = setting(rollout, gae_lambda, "lambdas")
  advantages, returns = call(
    jit_gae, rollout, gamma=gamma, gae_lambda=gae_lambda, associative=associative
  )
  expected_advantages, expected_returns = per_stream(reference_gae, rollout, gamma, gae_lambda)
  assert_close_at_valid(advantages, expected_advantages, rollout["valid"])
  assert_close_at_valid(returns, expected_returns, rollout["valid"])


@hypothesis.given(rollouts, gammas, lambdas, st.booleans())
def test_lambda_returns_match_reference_and_gae(rollout, gamma, gae_lambda, associative):
  gamma = setting(rollout, gamma, "gammas")
  gae_lambda = setting(rollout, gae_lambda, "lambdas")
  returns = call(jit_lambda, rollout, gamma=gamma, gae_lambda=gae_lambda, associative=associative)
  valid = rollout["valid"]
  assert_close_at_valid(
    returns, per_stream(reference_lambda_loop, rollout, gamma, gae_lambda), valid, 1e-4
  )
  if np.ndim(gamma) == 0 and np.ndim(gae_lambda) == 0:
    # Independently: the lambda-weighted mixture of n-step returns.
    mixture = per_stream(reference_lambda_returns, rollout, gamma, gae_lambda)
    assert_close_at_valid(returns, mixture, valid, 1e-4)
  _, gae_returns = call(jit_gae, rollout, gamma=gamma, gae_lambda=gae_lambda)
  np.testing.assert_allclose(returns, gae_returns, rtol=1e-4, atol=1e-4)


@hypothesis.given(rollouts, gammas, st.sampled_from([1, 2, 3, 5]))
def test_n_step_returns_match_reference(rollout, gamma, n):
  gamma = setting(rollout, gamma, "gammas")
  returns = call(jit_n_step, rollout, gamma=gamma, n=n)
  expected = per_stream(reference_n_step, rollout, n, gamma)
  assert_close_at_valid(returns, expected, rollout["valid"])


def test_n_step_with_horizon_beyond_rollout_is_the_monte_carlo_return():
  rollout = random_rollout(3, 9, 4, valid_kind="prefix")
  long = call(jit_n_step, rollout, gamma=0.9, n=12)
  exact = call(jit_lambda, rollout, gamma=0.9, gae_lambda=1.0)
  np.testing.assert_allclose(long, exact, rtol=1e-5, atol=1e-5)


def test_termination_wins_over_truncation():
  ones = jnp.ones(2)
  kwargs = dict(
    gamma=0.5,
    gae_lambda=0.9,
    truncated=jnp.array([True, False]),
    truncated_values=jnp.array([100.0, 0.0]),
  )
  both, _ = jaxbuf.compute_gae(ones, ones, jnp.array([True, False]), jnp.float32(0.0), **kwargs)
  terminated_only, _ = jaxbuf.compute_gae(
    ones, ones, jnp.array([True, False]), jnp.float32(0.0), gamma=0.5, gae_lambda=0.9
  )
  np.testing.assert_array_equal(both, terminated_only)
  assert both[0] == 0.0  # r - V, nothing bootstrapped


def test_truncation_bootstraps_from_final_observation_value():
  # Step 0 is truncated; the next stored value belongs to a new episode.
  advantages, _ = jaxbuf.compute_gae(
    jnp.array([1.0, 0.0]),
    jnp.array([0.0, -50.0]),
    jnp.zeros(2, bool),
    jnp.float32(0.0),
    gamma=0.5,
    gae_lambda=1.0,
    truncated=jnp.array([True, False]),
    truncated_values=jnp.array([4.0, 0.0]),
  )
  assert advantages[0] == 1.0 + 0.5 * 4.0


# ------------------------------------------------------------ against rlax


def rlax_rollout(r_t, discount_t, v_t):
  """rlax's `(r_t, discount_t, v_t)`, v_t[t] = V(s_{t+1}), in our layout `[T, B]`.

  Our values[t] = V(s_t): rlax's v_t shifted by one, with V(s_0) (which no
  return reads) set to NaN; last_value = v_t[-1]; no terminations, since a
  discount of 0 already stops the bootstrap.
  """
  r_t, discount_t, v_t = (np.asarray(x, np.float32).T for x in (r_t, discount_t, v_t))
  values = np.concatenate([np.full_like(v_t[:1], np.nan), v_t[:-1]])
  return (r_t, values, np.zeros(r_t.shape, bool), v_t[-1]), discount_t


# rlax/_src/multistep_test.py: LambdaReturnsTest, DiscountedReturnsTest,
# NStepBootstrappedReturnsTest (two streams of five steps each).
RLAX_R_T = [[1.0, 0.0, -1.0, 0.0, 1.0], [0.5, 0.8, -0.7, 0.0, 2.1]]
RLAX_DISCOUNT_T = [[0.5, 0.9, 1.0, 0.5, 0.8], [0.9, 0.5, 0.3, 0.8, 0.7]]
RLAX_V_T = [[3.0, 1.0, 5.0, -5.0, 3.0], [-1.7, 1.2, 2.3, 2.2, 2.7]]
RLAX_LAMBDA_RETURNS_075 = [
  [1.6460547, 0.72281253, 0.7375001, 0.6500001, 3.4],
  [0.7866317, 0.9913063, 0.1101501, 2.834, 3.99],
]
RLAX_DISCOUNTED_RETURNS = [
  [1.315, 0.63000005, 0.70000005, 1.7, 3.4],
  [1.33592, 0.9288, 0.2576, 3.192, 3.9899998],
]
RLAX_N_STEP = {
  3: [[2.8, -3.15, 0.7, 1.7, 3.4], [1.2155, 0.714, 0.2576, 3.192, 3.99]],
  5: [[1.315, 0.63, 0.7, 1.7, 3.4], [1.33592, 0.9288, 0.2576, 3.192, 3.99]],
  7: [[1.315, 0.63, 0.7, 1.7, 3.4], [1.33592, 0.9288, 0.2576, 3.192, 3.99]],
}
# TruncatedGeneralizedAdvantageEstimationTest: values carry V(s_T) last.
RLAX_GAE_R_T = [[0.0, 0.0, 1.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0, 1.0]]
RLAX_GAE_VALUES = [[1.0, 4.0, -3.0, -2.0, -1.0, -1.0], [-3.0, -2.0, -1.0, 0.0, 5.0, -1.0]]
RLAX_GAE_DISCOUNT_T = [[0.99, 0.99, 0.99, 0.99, 0.99], [0.9, 0.9, 0.9, 0.0, 0.9]]
RLAX_GAE = {
  1.0: [[-1.45118, -4.4557, 2.5396, 0.5249, -0.49], [3.0, 2.0, 1.0, 0.0, -4.9]],
  0.7: [[-0.676979, -5.248167, 2.4846, 0.6704, -0.49], [2.2899, 1.73, 1.0, 0.0, -4.9]],
  0.4: [[0.56731, -6.042, 2.3431, 0.815, -0.49], [1.725, 1.46, 1.0, 0.0, -4.9]],
}


@pytest.mark.parametrize("associative", [False, True])
def test_lambda_and_discounted_returns_on_rlax_vectors(associative):
  inputs, discount_t = rlax_rollout(RLAX_R_T, RLAX_DISCOUNT_T, RLAX_V_T)
  for gae_lambda, expected in ((0.75, RLAX_LAMBDA_RETURNS_075), (1.0, RLAX_DISCOUNTED_RETURNS)):
    returns = jaxbuf.lambda_returns(
      *inputs, gamma=discount_t, gae_lambda=gae_lambda, associative=associative
    )
    np.testing.assert_allclose(returns, np.asarray(expected).T, rtol=1e-5)
    # The same lambda as a per-step array.
    returns = jaxbuf.lambda_returns(
      *inputs,
      gamma=discount_t,
      gae_lambda=np.full_like(discount_t, gae_lambda),
      associative=associative,
    )
    np.testing.assert_allclose(returns, np.asarray(expected).T, rtol=1e-5)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_n_step_returns_on_rlax_vectors(n):
  inputs, discount_t = rlax_rollout(RLAX_R_T, RLAX_DISCOUNT_T, RLAX_V_T)
  returns = jaxbuf.n_step_returns(*inputs, n=n, gamma=discount_t)
  np.testing.assert_allclose(returns, np.asarray(RLAX_N_STEP[n]).T, rtol=1e-5)


@pytest.mark.parametrize("associative", [False, True])
def test_gae_on_rlax_vectors_with_scalar_and_array_lambda(associative):
  r_t = np.asarray(RLAX_GAE_R_T, np.float32).T
  values = np.asarray(RLAX_GAE_VALUES, np.float32).T
  discount_t = np.asarray(RLAX_GAE_DISCOUNT_T, np.float32).T
  terminated = np.zeros(r_t.shape, bool)
  for gae_lambda, expected in RLAX_GAE.items():
    for as_array in (False, True):
      lambdas = np.full_like(r_t, gae_lambda) if as_array else gae_lambda
      advantages, returns = jaxbuf.compute_gae(
        r_t,
        values[:-1],
        terminated,
        values[-1],
        gamma=discount_t,
        gae_lambda=lambdas,
        associative=associative,
      )
      np.testing.assert_allclose(advantages, np.asarray(expected).T, atol=1e-3)
      np.testing.assert_allclose(returns, advantages + values[:-1], rtol=1e-6)


def test_matches_rlax_on_random_rollouts_with_per_step_settings():
  rollout = random_rollout(1, 33, 5)
  discounts = rollout["gammas"] * (1.0 - rollout["terminated"].astype(np.float32))
  bootstrap = np.concatenate([rollout["values"], rollout["last_value"][None]])
  lambdas = rollout["lambdas"]
  expected = jax.jit(
    jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=1, out_axes=1)
  )(rollout["rewards"], discounts, lambdas, bootstrap)
  lambda_expected = jax.jit(jax.vmap(rlax.lambda_returns, in_axes=1, out_axes=1))(
    rollout["rewards"], discounts, bootstrap[1:], lambdas
  )
  n_step_expected = jax.jit(
    jax.vmap(
      functools.partial(rlax.n_step_bootstrapped_returns, n=4), in_axes=(1, 1, 1), out_axes=1
    )
  )(rollout["rewards"], discounts, bootstrap[1:])
  arguments = (rollout["rewards"], rollout["values"], rollout["terminated"], rollout["last_value"])
  for associative in (False, True):
    advantages, _ = jit_gae(
      *arguments, gamma=rollout["gammas"], gae_lambda=lambdas, associative=associative
    )
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      jit_lambda(*arguments, gamma=rollout["gammas"], gae_lambda=lambdas, associative=associative),
      lambda_expected,
      rtol=1e-5,
      atol=1e-5,
    )
  np.testing.assert_allclose(
    jit_n_step(*arguments, n=4, gamma=rollout["gammas"]), n_step_expected, rtol=1e-5, atol=1e-5
  )


def test_associative_equals_sequential_over_a_long_horizon():
  rollout = random_rollout(2, 1024, 8, end_probability=0.004, valid_kind="random")
  kwargs = dict(gamma=0.999, gae_lambda=0.98)
  sequential = call(jit_gae, rollout, associative=False, **kwargs)
  parallel = call(jit_gae, rollout, associative=True, **kwargs)
  for a, b in zip(sequential, parallel):
    scale = np.max(np.abs(a))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale)


# ---------------------------------------------- values that must not be read


def unread_rollout():
  """A `[T=6, N=4]` rollout whose every stream ends in a way that reads nothing.

  env 0 terminates at its last step, env 1 is truncated there, env 2 has two
  padding steps after a terminated last valid step, env 3 has padding in the
  middle; terminations and truncations inside every stream.
  """
  rollout = random_rollout(12, 6, 4, end_probability=0.0)
  terminated = np.zeros((6, 4), bool)
  truncated = np.zeros((6, 4), bool)
  terminated[[1, 5], 0] = True
  truncated[[2, 5], 1] = True
  terminated[[0, 3], 2] = True
  truncated[1, 2] = True
  terminated[4, 3] = True
  truncated[[0, 4], 3] = True  # step 4: both flags, termination wins
  valid = np.ones((6, 4), bool)
  valid[4:, 2] = False
  valid[[1, 2], 3] = False
  rollout.update(terminated=terminated, truncated=truncated, valid=valid)
  for name in ("rewards", "values", "truncated_values", "gammas", "lambdas"):
    rollout[name] = np.where(valid, np.nan_to_num(rollout[name], nan=0.5), 0.0).astype(np.float32)
  return rollout


def cut_after(rollout):
  return rollout["terminated"] | rollout["truncated"]


def last_valid(rollout):
  """bool `[N]`: the stream's last valid step ends its episode."""
  valid = rollout["valid"]
  last = valid.shape[0] - 1 - np.argmax(valid[::-1], axis=0)
  return cut_after(rollout)[last, np.arange(valid.shape[1])]


def after(mask):
  """`[T, N]`: the step right after each True (values read as V(next))."""
  return np.concatenate([np.zeros_like(mask[:1]), mask[:-1]])


# place: (which entries of which input are never read, for which functions)
ALL = ("gae", "gae-associative", "lambda", "lambda-associative", "n-step")
UNREAD = {
  "last_value after a terminated or truncated last step": (
    "last_value",
    lambda r: last_valid(r),
    ALL,
  ),
  "truncated_values where not truncated": (
    "truncated_values",
    lambda r: ~r["truncated"] | r["terminated"],
    ALL,
  ),
  "padding rewards": ("rewards", lambda r: ~r["valid"], ALL),
  "padding values": ("values", lambda r: ~r["valid"], ALL),
  "padding per-step gamma": ("gammas", lambda r: ~r["valid"], ALL),
  "padding per-step lambda": ("lambdas", lambda r: ~r["valid"], ALL[:4]),
  "per-step gamma at terminated steps": ("gammas", lambda r: r["terminated"], ALL),
  "per-step lambda at cut steps": ("lambdas", cut_after, ALL[:4]),
  "value of the step after a termination (a new episode's first)": (
    "values",
    lambda r: after(r["terminated"]) & r["valid"],
    ("lambda", "lambda-associative", "n-step"),
  ),
  "values[0], never a successor": (
    "values",
    lambda r: np.arange(6)[:, None] == np.zeros((1, 4)),
    ("lambda", "lambda-associative", "n-step"),
  ),
}


def evaluate(function, rollout, *, per_step):
  gamma = rollout["gammas"] if per_step else 0.9
  gae_lambda = rollout["lambdas"] if per_step else 0.8
  if function.startswith("gae"):
    return call(
      jit_gae,
      rollout,
      gamma=gamma,
      gae_lambda=gae_lambda,
      associative=function.endswith("associative"),
    )
  if function.startswith("lambda"):
    return (
      call(
        jit_lambda,
        rollout,
        gamma=gamma,
        gae_lambda=gae_lambda,
        associative=function.endswith("associative"),
      ),
    )
  return (call(jit_n_step, rollout, gamma=gamma, n=3),)


@pytest.mark.parametrize("poison", [np.nan, -np.inf], ids=["nan", "-inf"])
@pytest.mark.parametrize("function", ALL)
@pytest.mark.parametrize("place", sorted(UNREAD))
def test_values_that_are_never_read_cannot_leak(place, function, poison):
  name, where, functions = UNREAD[place]
  if function not in functions:
    pytest.skip(f"{place} is read by {function}")
  per_step = name in ("gammas", "lambdas")
  clean = unread_rollout()
  mask = where(clean)
  assert mask.any()  # the place exists in this rollout
  poisoned = dict(clean)
  poisoned[name] = np.where(mask, poison, clean[name]).astype(np.float32)
  expected = evaluate(function, clean, per_step=per_step)
  for result, reference in zip(evaluate(function, poisoned, per_step=per_step), expected):
    assert np.all(np.isfinite(np.asarray(result))), place
    np.testing.assert_array_equal(result, reference)


def test_lambda_returns_ignore_a_nan_last_value_after_termination():
  # issue 12: 0 * NaN made every return NaN; compute_gae agreed on finite ones.
  rewards, values = jnp.ones(4), jnp.zeros(4)
  terminated = jnp.array([False, False, False, True])
  for associative in (False, True):
    returns = jaxbuf.lambda_returns(
      rewards,
      values,
      terminated,
      jnp.float32(jnp.nan),
      gamma=0.9,
      gae_lambda=0.95,
      associative=associative,
    )
    _, gae_returns = jaxbuf.compute_gae(
      rewards,
      values,
      terminated,
      jnp.float32(jnp.nan),
      gamma=0.9,
      gae_lambda=0.95,
      associative=associative,
    )
    assert np.all(np.isfinite(returns))
    np.testing.assert_allclose(returns, gae_returns, rtol=1e-6)


def test_zero_weights_read_nothing():
  rollout = random_rollout(13, 7, 3, end_probability=0.2)
  poisoned = dict(rollout, values=np.full_like(rollout["values"], np.nan))
  # gamma = 0: returns are the rewards, values never read.
  for function in (jit_lambda, functools.partial(jit_n_step, n=2)):
    kwargs = {} if function is not jit_lambda else dict(gae_lambda=0.5)
    np.testing.assert_array_equal(call(function, poisoned, gamma=0.0, **kwargs), rollout["rewards"])
  # lambda = 1: Monte Carlo returns, values never read.
  np.testing.assert_array_equal(
    call(jit_lambda, poisoned, gamma=0.9, gae_lambda=1.0),
    call(jit_lambda, rollout, gamma=0.9, gae_lambda=1.0),
  )


# -------------------------------------------------- composability and shapes


def test_trailing_batch_shape_equals_per_column_calls():
  rollout = random_rollout(4, 10, 6, valid_kind="prefix")
  reshaped = {k: v.reshape(v.shape[:-1] + (2, 3)) for k, v in rollout.items()}
  advantages, _ = call(jaxbuf.compute_gae, reshaped, gamma=0.9, gae_lambda=0.8)
  flat, _ = call(jaxbuf.compute_gae, rollout, gamma=0.9, gae_lambda=0.8)
  assert advantages.shape == (10, 2, 3)
  np.testing.assert_array_equal(advantages.reshape(10, 6), flat)


def test_vmap_over_envs_with_per_env_gamma_equals_batched_call():
  rollout = random_rollout(5, 12, 4, valid_kind="random")
  gamma = np.array([0.5, 0.9, 0.99, 1.0], np.float32)  # one discount per env
  batched = call(jaxbuf.compute_gae, rollout, gamma=np.broadcast_to(gamma, (12, 4)), gae_lambda=0.8)

  def one_stream(
    rewards, values, terminated, last_value, truncated, truncated_values, valid, gamma
  ):
    return jaxbuf.compute_gae(
      rewards,
      values,
      terminated,
      last_value,
      gamma=gamma,
      gae_lambda=0.8,
      truncated=truncated,
      truncated_values=truncated_values,
      valid=valid,
    )

  names = (
    "rewards",
    "values",
    "terminated",
    "last_value",
    "truncated",
    "truncated_values",
    "valid",
  )
  mapped = jax.vmap(one_stream, in_axes=(1, 1, 1, 0, 1, 1, 1, 0), out_axes=1)(
    *(rollout[name] for name in names), gamma
  )
  for a, b in zip(batched, mapped):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_inside_scan_and_cond_with_traced_gamma_and_no_recompilation():
  rollouts = [random_rollout(seed, 8, 3) for seed in range(4)]
  stacked = {k: np.stack([r[k] for r in rollouts]) for k in rollouts[0]}

  @jax.jit
  @chex.assert_max_traces(n=1)
  def many(stacked, gamma):
    def body(carry, rollout):
      advantages, _ = jax.lax.cond(
        gamma > 0.5,
        lambda: call(jaxbuf.compute_gae, rollout, gamma=gamma, gae_lambda=0.9),
        lambda: call(jaxbuf.compute_gae, rollout, gamma=gamma, gae_lambda=0.9, associative=True),
      )
      per_step = jaxbuf.lambda_returns(
        rollout["rewards"],
        rollout["values"],
        rollout["terminated"],
        rollout["last_value"],
        gamma=rollout["gammas"],
        gae_lambda=0.9,
      )
      return carry + advantages.sum(), (advantages, per_step)

    return jax.lax.scan(body, 0.0, stacked)

  _, (scanned, lambda_scanned) = many(stacked, 0.95)
  _, (scanned_low, _) = many(stacked, 0.3)  # a second call: no retrace
  for i, rollout in enumerate(rollouts):
    for gamma, result in ((0.95, scanned), (0.3, scanned_low)):
      expected, _ = per_stream(reference_gae, rollout, gamma, 0.9)
      np.testing.assert_allclose(result[i], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      lambda_scanned[i],
      per_stream(
        reference_lambda_loop,
        {**rollout, "truncated": np.zeros((8, 3), bool)},
        rollout["gammas"],
        0.9,
      ),
      rtol=1e-5,
      atol=1e-5,
    )


def test_per_step_settings_on_several_devices():
  devices = jax.devices()
  rollout = random_rollout(9, 8, 4 * len(devices))
  mesh = jax.make_mesh((len(devices),), ("envs",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "envs"))
  sharded = {k: (jax.device_put(v, sharding) if np.ndim(v) == 2 else v) for k, v in rollout.items()}
  advantages, _ = call(jit_gae, sharded, gamma=sharded["gammas"], gae_lambda=sharded["lambdas"])
  expected, _ = per_stream(reference_gae, rollout, rollout["gammas"], rollout["lambdas"])
  np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)


def test_gradients_are_stopped():
  rollout = random_rollout(6, 5, 2)

  def loss(values, last_value, gammas):
    advantages, returns = jaxbuf.compute_gae(
      rollout["rewards"], values, rollout["terminated"], last_value, gamma=gammas, gae_lambda=0.9
    )
    return (
      advantages.sum()
      + returns.sum()
      + jaxbuf.lambda_returns(
        rollout["rewards"], values, rollout["terminated"], last_value, gamma=0.9, gae_lambda=0.9
      ).sum()
    )

  grads = jax.grad(loss, argnums=(0, 1, 2))(
    jnp.asarray(rollout["values"]),
    jnp.asarray(rollout["last_value"]),
    jnp.asarray(rollout["gammas"]),
  )
  assert not any(np.any(grad) for grad in grads)


# ------------------------------------------------------------ error contract

VALUES = np.zeros((4, 2), np.float32)
DONE = np.zeros((4, 2), bool)
LAST = np.zeros(2, np.float32)


def gae(**changes):
  kwargs = dict(
    rewards=VALUES, values=VALUES, terminated=DONE, last_value=LAST, gamma=0.9, gae_lambda=0.9
  )
  kwargs.update(changes)
  return lambda: jaxbuf.compute_gae(**kwargs)


# row: (call, error, words the message must contain)
BAD_ARGUMENTS = {
  "rewards-shape": (
    gae(rewards=np.zeros((4, 3), np.float32)),
    ValueError,
    (
      r"compute_gae: rewards has shape \(4, 3\), expected "
      r"\(4, 2\) like values"
    ),
  ),
  "values-no-time-axis": (gae(values=np.float32(0)), ValueError, "values must have a time axis"),
  "last-value-shape": (
    gae(last_value=np.zeros(3, np.float32)),
    ValueError,
    r"last_value has shape \(3,\), expected \(2,\)",
  ),
  "last-value-with-time-axis": (gae(last_value=VALUES), ValueError, "last_value has shape"),
  "integer-rewards": (
    gae(rewards=np.zeros((4, 2), np.int32)),
    TypeError,
    "rewards must be floating point, given dtype int32",
  ),
  "integer-values": (
    gae(values=np.zeros((4, 2), np.int32)),
    TypeError,
    "values must be floating point",
  ),
  "terminated-shape": (
    gae(terminated=np.zeros(4, bool)),
    ValueError,
    r"terminated has shape \(4,\)",
  ),
  "terminated-strings": (
    gae(terminated=np.array([["a"] * 2] * 4)),
    TypeError,
    "terminated must be bool",
  ),
  "truncated-without-values": (gae(truncated=DONE), ValueError, "together"),
  "truncated-values-shape": (
    gae(truncated=DONE, truncated_values=np.zeros(4, np.float32)),
    ValueError,
    "truncated_values has shape",
  ),
  "truncated-values-int": (
    gae(truncated=DONE, truncated_values=np.zeros((4, 2), np.int32)),
    TypeError,
    "truncated_values must be floating",
  ),
  "valid-shape": (
    gae(valid=np.ones(4, bool)),
    ValueError,
    r"valid has shape \(4,\), expected \(4, 2\)",
  ),
  "gamma-shape": (
    gae(gamma=np.full(4, 0.9, np.float32)),
    ValueError,
    (
      r"gamma has shape \(4,\); expected a scalar or one value "
      r"per step, shape \(4, 2\)"
    ),
  ),
  "gamma-bool": (gae(gamma=True), TypeError, "gamma must be a real number"),
  "gamma-above-one": (gae(gamma=1.5), ValueError, r"gamma must be in \[0, 1\], given 1.5"),
  "gamma-nan": (gae(gamma=float("nan")), ValueError, "gamma must be in"),
  "lambda-negative": (gae(gae_lambda=-0.1), ValueError, "gae_lambda must be in"),
  "lambda-shape": (
    gae(gae_lambda=np.zeros((4, 1), np.float32)),
    ValueError,
    "gae_lambda has shape",
  ),
  "associative-not-bool": (gae(associative="yes"), TypeError, "associative must be a Python bool"),
  "lambda-returns-last-value": (
    lambda: jaxbuf.lambda_returns(VALUES, VALUES, DONE, np.zeros(3), gamma=0.9, gae_lambda=0.9),
    ValueError,
    "lambda_returns: last_value has shape",
  ),
  "n-step-zero": (
    lambda: jaxbuf.n_step_returns(VALUES, VALUES, DONE, LAST, n=0, gamma=0.9),
    ValueError,
    "n_step_returns: n must be positive",
  ),
  "n-step-float": (
    lambda: jaxbuf.n_step_returns(VALUES, VALUES, DONE, LAST, n=2.0, gamma=0.9),
    TypeError,
    "n_step_returns: n must be a Python int",
  ),
  "n-step-gamma-shape": (
    lambda: jaxbuf.n_step_returns(VALUES, VALUES, DONE, LAST, n=2, gamma=np.zeros(2, np.float32)),
    ValueError,
    "n_step_returns: gamma has shape",
  ),
  "normalize-int": (
    lambda: jaxbuf.normalize_advantages(np.zeros(3, np.int32)),
    TypeError,
    ("normalize_advantages: advantages must be floating point"),
  ),
  "normalize-valid-shape": (
    lambda: jaxbuf.normalize_advantages(VALUES, np.ones(4, bool)),
    ValueError,
    r"normalize_advantages: valid has shape \(4,\)",
  ),
  "normalize-eps-zero": (
    lambda: jaxbuf.normalize_advantages(VALUES, eps=0.0),
    ValueError,
    "eps must be positive",
  ),
}


@pytest.mark.parametrize("row", sorted(BAD_ARGUMENTS))
def test_bad_arguments_raise_naming_the_argument_while_tracing(row):
  function, error, words = BAD_ARGUMENTS[row]
  with pytest.raises(error, match=words):
    function()
  with pytest.raises(error, match=words):  # the same under jit, while tracing
    jax.jit(function)()


# ----------------------------------------------------------- normalization


def test_normalize_advantages_uses_valid_entries_only():
  rng = np.random.default_rng(7)
  advantages = rng.normal(3.0, 2.0, (16, 4)).astype(np.float32)
  valid = rng.random((16, 4)) < 0.6
  advantages[~valid] = np.nan  # padding must not move the statistics
  normalized = np.asarray(jaxbuf.normalize_advantages(advantages, valid))
  kept = advantages[valid]
  np.testing.assert_allclose(
    normalized[valid], (kept - kept.mean()) / (kept.std() + 1e-8), rtol=1e-5, atol=1e-5
  )
  assert np.all(normalized[~valid] == 0.0)
  advantages[~valid] = 1e6
  everything = np.asarray(jaxbuf.normalize_advantages(advantages))
  np.testing.assert_allclose(everything.mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(everything.std(), 1.0, rtol=1e-4)


def test_normalize_advantages_with_no_valid_entry_is_zero():
  out = jaxbuf.normalize_advantages(jnp.ones(4), jnp.zeros(4, bool))
  np.testing.assert_array_equal(out, np.zeros(4))


def test_outputs_keep_the_values_dtype():
  rollout = random_rollout(8, 6, 2)
  as_bf16 = {
    k: (v.astype(jnp.bfloat16) if v.dtype == np.float32 else v) for k, v in rollout.items()
  }
  for associative in (False, True):
    advantages, returns = call(
      jaxbuf.compute_gae, as_bf16, gamma=jnp.float32(0.9), gae_lambda=0.95, associative=associative
    )
    assert advantages.dtype == returns.dtype == jnp.bfloat16
    expected, _ = call(jaxbuf.compute_gae, rollout, gamma=0.9, gae_lambda=0.95)
    np.testing.assert_allclose(advantages.astype(np.float32), expected, rtol=0.05, atol=0.05)
