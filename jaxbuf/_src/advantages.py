"""Advantage and return estimation over time-major rollouts.

Shape key: T time (axis 0), N envs; `...` is any trailing batch shape, so the
same function serves one stream `[T]`, a rollout `[T, N]` or `[T, N, agents]`.

Every function reads one rollout the same way:

* `rewards[t]`, `values[t] = V(s_t)`; `last_value = V(s_T)`, the value of the
  observation after the last step.
* `terminated[t]`: the episode truly ended after step t. Nothing is
  bootstrapped and the trace is cut.
* `truncated[t]`: the episode was cut off (time limit) after step t. The step
  bootstraps from `truncated_values[t]`, the value of the final observation
  (the one an auto-resetting env replaced), and the trace is cut. When both
  flags are set, termination wins.
* `valid[t]` (optional, from ragged collection): False marks padding. Padding
  steps are skipped as if absent: they contribute nothing, their stored
  values (stale data from an earlier rollout, possibly non-finite) are never
  read, and a valid step's successor is the next valid step of its stream, or
  `last_value` when there is none. At padding steps advantages are 0 and
  returns equal `values`.

The outputs are targets: gradients are stopped (`jax.lax.stop_gradient`), so
a loss that differentiates through `values` does not also differentiate
through its own target.
"""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax

Numeric = Any


class _Rollout(NamedTuple):
  """Validated inputs in canonical dtypes, gradients stopped (trace-time only)."""
  rewards: jax.Array                   # [T, ...], values' dtype
  values: jax.Array                    # [T, ...] float
  terminated: jax.Array                # [T, ...] bool
  last_value: jax.Array                # [...], values' dtype
  truncated: jax.Array | None          # [T, ...] bool
  truncated_values: jax.Array | None   # [T, ...], values' dtype
  valid: jax.Array | None              # [T, ...] bool


def _validated(name, rewards, values, terminated, last_value, truncated,
               truncated_values, valid) -> _Rollout:
  """Checks shapes and dtypes while tracing (chex static asserts cost nothing)."""
  rewards, values = jnp.asarray(rewards), jnp.asarray(values)
  last_value = jnp.asarray(last_value)
  if values.ndim < 1:
    raise ValueError(f"{name}: values must have a time axis, shape [T, ...]; "
                     f"given shape {values.shape}.")
  chex.assert_type([rewards, values, last_value], float)
  chex.assert_equal_shape([rewards, values, terminated])
  chex.assert_shape(last_value, values.shape[1:])
  if (truncated is None) != (truncated_values is None):
    raise ValueError(f"{name}: pass truncated and truncated_values together "
                     "(a truncated step needs the value to bootstrap from).")
  if truncated is not None:
    chex.assert_equal_shape([values, truncated, truncated_values])
    chex.assert_type(truncated_values, float)
  if valid is not None:
    chex.assert_equal_shape([values, valid])
  dtype = values.dtype

  def as_bool(flags):
    return None if flags is None else jnp.asarray(flags).astype(bool)

  return _Rollout(
      rewards=lax.stop_gradient(rewards.astype(dtype)),
      values=lax.stop_gradient(values),
      terminated=as_bool(terminated),
      last_value=lax.stop_gradient(last_value.astype(dtype)),
      truncated=as_bool(truncated),
      truncated_values=(
          None if truncated_values is None
          else lax.stop_gradient(jnp.asarray(truncated_values).astype(dtype))),
      valid=as_bool(valid))


def _as_dtype(rollout: _Rollout, *scalars: Numeric) -> tuple[jax.Array, ...]:
  """Discounts and lambdas in the values' dtype, so outputs keep that dtype."""
  for scalar in scalars:
    chex.assert_rank(scalar, 0)
  return tuple(jnp.asarray(scalar, rollout.values.dtype) for scalar in scalars)


def _cut(rollout: _Rollout) -> jax.Array:
  """Whether the trace ends after each step: bool `[T, ...]`."""
  return (rollout.terminated if rollout.truncated is None
          else rollout.terminated | rollout.truncated)


def _next_values(rollout: _Rollout, *, associative: bool) -> jax.Array:
  """V of each step's successor (next valid step, else `last_value`): `[T, ...]`."""
  if rollout.valid is None:
    return jnp.concatenate([rollout.values[1:], rollout.last_value[None]])
  # first_valid[t] = V of the first valid step at or after t; its shift is
  # the successor's value. Padding values never enter the arithmetic.
  first_valid = _reverse_linear_scan(
      jnp.where(rollout.valid, 0.0, 1.0).astype(rollout.values.dtype),
      jnp.where(rollout.valid, rollout.values, 0.0),
      rollout.last_value, associative=associative)
  return jnp.concatenate([first_valid[1:], rollout.last_value[None]])


def _bootstrap_values(rollout: _Rollout, next_values: jax.Array,
                      gamma: Numeric) -> jax.Array:
  """`gamma * V(next state)`, 0 after termination: `[T, ...]`."""
  if rollout.truncated is not None:
    next_values = jnp.where(rollout.truncated, rollout.truncated_values,
                            next_values)
  return jnp.where(rollout.terminated, 0.0, gamma * next_values)


def _at_valid(rollout: _Rollout, estimates: jax.Array,
              padding: jax.Array | float) -> jax.Array:
  """`estimates` where valid, `padding` elsewhere."""
  if rollout.valid is None:
    return estimates
  return jnp.where(rollout.valid, estimates, padding)


def _compose_affine(later, earlier):
  """The affine map `earlier ∘ later`, each map as `(decay, increment)`.

  Step t is the map x -> increment[t] + decay[t] * x. `lax.associative_scan`
  with reverse=True passes the composition of the later steps first.
  """
  later_decay, later_increment = later
  earlier_decay, earlier_increment = earlier
  return (earlier_decay * later_decay,
          earlier_increment + earlier_decay * later_increment)


def _affine_step(next_x, decay_and_increment):
  decay, increment = decay_and_increment
  x = increment + decay * next_x
  return x, x


def _reverse_linear_scan(decay: jax.Array, increment: jax.Array,
                         final: jax.Array, *, associative: bool) -> jax.Array:
  """`x[t] = increment[t] + decay[t] * x[t + 1]` for t < T, with `x[T] = final`.

  The step functions live at module level so that eager calls hit JAX's
  compilation cache instead of recompiling a fresh closure every time.

  Args:
    decay, increment: `[T, ...]`.
    final: `[...]`.
    associative: evaluate with `lax.associative_scan` (O(log T) depth, about
      twice the arithmetic) instead of a sequential reverse `lax.scan`.

  Returns:
    x `[T, ...]`.
  """
  if associative:
    total_decay, total_increment = lax.associative_scan(
        _compose_affine, (decay, increment), reverse=True)
    return total_increment + total_decay * final[None]
  _, xs = lax.scan(_affine_step, final, (decay, increment), reverse=True)
  return xs


def compute_gae(
    rewards: jax.Array,
    values: jax.Array,
    terminated: jax.Array,
    last_value: jax.Array,
    *,
    gamma: Numeric,
    gae_lambda: Numeric,
    truncated: jax.Array | None = None,
    truncated_values: jax.Array | None = None,
    valid: jax.Array | None = None,
    associative: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Generalized advantage estimation (Schulman et al., 2016) over axis 0.

  With `d[t] = rewards[t] + gamma * V(next) - values[t]`, where V(next) is
  0 after termination, `truncated_values[t]` after truncation and the next
  (valid) step's value otherwise, `advantages[t] = d[t] + gamma * gae_lambda *
  advantages[t + 1]`, the sum stopping at any termination or truncation.
  See the module docstring for the full conventions.

  Args:
    rewards: `[T, ...]` float.
    values: `[T, ...]` float, V(s_t) under the policy that collected the data.
    terminated: `[T, ...]` bool (or 0/1 numbers).
    last_value: `[...]` float, V of the observation after step T - 1 (for a
      ragged rollout, after each stream's last valid step).
    gamma: discount, a float or scalar array.
    gae_lambda: the GAE lambda, a float or scalar array.
    truncated: `[T, ...]` bool, or None when no episode is ever truncated.
    truncated_values: `[T, ...]` float, read only where `truncated`.
    valid: `[T, ...]` bool, or None when every step is valid (e.g.
      `RolloutState.valid`).
    associative: use a parallel `lax.associative_scan` (O(log T) depth) in
      place of the sequential reverse scan; equal to float32 precision. Meant
      for long horizons on accelerators; on CPU the sequential scan is
      faster (benchmarks/bench_gae.py), and the associative program takes a
      few seconds longer to compile.

  Returns:
    `(advantages, returns)`, both `[T, ...]` in `values`' dtype, gradients
    stopped; `returns = advantages + values`.

  >>> import jax.numpy as jnp, jaxbuf
  >>> advantages, returns = jaxbuf.compute_gae(
  ...     rewards=jnp.ones(3), values=jnp.zeros(3),
  ...     terminated=jnp.array([False, True, False]), last_value=jnp.float32(10.0),
  ...     gamma=0.5, gae_lambda=1.0)
  >>> advantages.tolist()   # the trace is cut after step 1; step 2 bootstraps
  [1.5, 1.0, 6.0]
  """
  rollout = _validated("compute_gae", rewards, values, terminated,
                       last_value, truncated, truncated_values, valid)
  gamma, gae_lambda = _as_dtype(rollout, gamma, gae_lambda)
  if not associative:
    return _gae_scan(rollout.rewards, rollout.values, rollout.terminated,
                     rollout.last_value, rollout.truncated,
                     rollout.truncated_values, rollout.valid, gamma, gae_lambda)
  next_values = _next_values(rollout, associative=True)
  deltas = (rollout.rewards + _bootstrap_values(rollout, next_values, gamma)
            - rollout.values)
  decay = jnp.where(_cut(rollout), 0.0, gamma * gae_lambda)
  decay = decay.astype(deltas.dtype)
  if rollout.valid is not None:
    # Padding passes the later steps' advantage through unchanged.
    decay = jnp.where(rollout.valid, decay, 1.0)
    deltas = jnp.where(rollout.valid, deltas, 0.0)
  advantages = _reverse_linear_scan(decay, deltas,
                                    jnp.zeros_like(rollout.last_value),
                                    associative=True)
  advantages = _at_valid(rollout, advantages, 0.0)
  return advantages, advantages + rollout.values


@jax.jit
def _gae_scan(rewards, values, terminated, last_value, truncated,
              truncated_values, valid, gamma, gae_lambda):
  """The sequential GAE: one reverse scan computing everything per step.

  Reading the inputs step by step, with no precomputed `[T, ...]`
  intermediates (next values, deltas, decays), keeps the memory traffic at
  its floor; on CPU this beat both a precomputed-delta scan and any unrolling
  (benchmarks/bench_gae.py). Jitted so that eager calls reuse one compiled
  program; inside a user's jit it compiles into the same program.
  """
  def step(carry, inputs):
    later_advantage, next_value = carry
    reward, value, terminated_t, truncated_t, truncated_value, valid_t = inputs
    if truncated_t is not None:
      bootstrap = jnp.where(truncated_t, truncated_value, next_value)
      cut = terminated_t | truncated_t
    else:
      bootstrap, cut = next_value, terminated_t
    delta = reward + jnp.where(terminated_t, 0.0, gamma * bootstrap) - value
    advantage = delta + jnp.where(cut, 0.0, gamma * gae_lambda) * later_advantage
    if valid_t is None:
      return (advantage, value), (advantage, advantage + value)
    # Padding: emit 0 and pass the later steps' carry through unchanged.
    carry = (jnp.where(valid_t, advantage, later_advantage),
             jnp.where(valid_t, value, next_value))
    advantage = jnp.where(valid_t, advantage, 0.0)
    return carry, (advantage, advantage + value)

  _, (advantages, returns) = lax.scan(
      step, (jnp.zeros_like(last_value), last_value),
      (rewards, values, terminated, truncated, truncated_values, valid),
      reverse=True)
  return advantages, returns


def lambda_returns(
    rewards: jax.Array,
    values: jax.Array,
    terminated: jax.Array,
    last_value: jax.Array,
    *,
    gamma: Numeric,
    gae_lambda: Numeric,
    truncated: jax.Array | None = None,
    truncated_values: jax.Array | None = None,
    valid: jax.Array | None = None,
    associative: bool = False,
) -> jax.Array:
  """TD(lambda) returns: `G[t] = r[t] + gamma ((1 - l) V(next) + l G[t + 1])`.

  The recursion bootstraps from V(next) alone at a truncation (with
  `truncated_values`), from nothing at a termination, and from `last_value`
  after the last (valid) step. Arguments are those of `compute_gae`; with the
  same arguments the result equals `compute_gae(...)[1]` up to rounding. At
  padding steps the result equals `values`.

  Returns:
    `[T, ...]` in `values`' dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.lambda_returns(jnp.ones(3), jnp.zeros(3), jnp.zeros(3, bool),
  ...                       jnp.float32(4.0), gamma=0.5, gae_lambda=1.0).tolist()
  [2.25, 2.5, 3.0]
  """
  rollout = _validated("lambda_returns", rewards, values, terminated,
                       last_value, truncated, truncated_values, valid)
  gamma, gae_lambda = _as_dtype(rollout, gamma, gae_lambda)
  next_values = _next_values(rollout, associative=associative)
  # G[t] = rewards[t] + bootstrap[t] * (1 - lambda) + decay[t] * G[t + 1],
  # where a cut trace takes its whole bootstrap from V(next).
  bootstrap = _bootstrap_values(rollout, next_values, gamma)
  increment = rollout.rewards + jnp.where(_cut(rollout), bootstrap,
                                          (1.0 - gae_lambda) * bootstrap)
  decay = jnp.where(_cut(rollout), 0.0, gamma * gae_lambda)
  decay = decay.astype(increment.dtype)
  if rollout.valid is not None:
    decay = jnp.where(rollout.valid, decay, 1.0)
    increment = jnp.where(rollout.valid, increment, 0.0)
  returns = _reverse_linear_scan(decay, increment, rollout.last_value,
                                 associative=associative)
  return _at_valid(rollout, returns, rollout.values)


def n_step_returns(
    rewards: jax.Array,
    values: jax.Array,
    terminated: jax.Array,
    last_value: jax.Array,
    *,
    n: int,
    gamma: Numeric,
    truncated: jax.Array | None = None,
    truncated_values: jax.Array | None = None,
    valid: jax.Array | None = None,
) -> jax.Array:
  """n-step bootstrapped returns: n discounted rewards, then V of the state reached.

  `G[t] = r[t] + gamma r[t+1] + ... + gamma^(k-1) r[t+k-1] + gamma^k V`, where
  k is n, or fewer when the episode ends first: a termination stops the sum
  with no bootstrap, a truncation bootstraps from `truncated_values`, and the
  end of the rollout bootstraps from `last_value`. With padding, steps are
  counted over the valid steps of each stream. At padding steps the result
  equals `values`.

  Args:
    rewards, values, terminated, last_value, truncated, truncated_values,
      valid: as for `compute_gae`.
    n: a positive Python int.
    gamma: discount, a float or scalar array.

  Returns:
    `[T, ...]` in `values`' dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.n_step_returns(jnp.ones(3), jnp.full(3, 8.0), jnp.zeros(3, bool),
  ...                       jnp.float32(4.0), n=2, gamma=0.5).tolist()
  [3.5, 2.5, 3.0]
  """
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError("n_step_returns: n must be a positive Python int, "
                     f"given {n!r}.")
  rollout = _validated("n_step_returns", rewards, values, terminated,
                       last_value, truncated, truncated_values, valid)
  (gamma,) = _as_dtype(rollout, gamma)
  num_steps = rollout.values.shape[0]
  if rollout.valid is None:
    def successors(x):
      return jnp.concatenate([x[1:], rollout.last_value[None]])
  else:
    # Index of each step's successor: the first valid step after it, or T,
    # which reads `last_value` from the extended array below.
    time = lax.broadcasted_iota(jnp.int32, rollout.valid.shape, 0)
    first_valid = lax.cummin(jnp.where(rollout.valid, time, num_steps), axis=0,
                             reverse=True)
    successor = jnp.concatenate(
        [first_valid[1:], jnp.full_like(first_valid[:1], num_steps)])

    def successors(x):
      extended = jnp.concatenate([x, rollout.last_value[None]])
      return jnp.take_along_axis(extended, successor, axis=0,
                                 mode="promise_in_bounds")

  # After j rounds, returns[t] holds the j-step return from t; one more round
  # prepends a reward and reads the successor's j-step return.
  returns = rollout.values
  for _ in range(n):
    returns = rollout.rewards + _bootstrap_values(rollout, successors(returns),
                                                  gamma)
  return _at_valid(rollout, returns, rollout.values)


def normalize_advantages(advantages: jax.Array, valid: jax.Array | None = None,
                         *, eps: float = 1e-8) -> jax.Array:
  """Advantages shifted to mean 0 and scaled to standard deviation 1.

  The mean and (population, ddof=0) standard deviation are taken over the
  valid entries only, so padding does not bias them. Padding entries come out
  as 0.

  Args:
    advantages: `[T, ...]` float (any shape).
    valid: bool, the same shape, or None when every entry is valid.
    eps: added to the standard deviation, so a constant batch maps to 0.

  Returns:
    The same shape and dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.normalize_advantages(jnp.array([1.0, 3.0, 100.0]),
  ...                             jnp.array([True, True, False])).tolist()
  [-1.0, 1.0, 0.0]
  """
  advantages = lax.stop_gradient(jnp.asarray(advantages))
  chex.assert_type(advantages, float)
  if valid is None:
    valid = jnp.ones(advantages.shape, bool)
  valid = jnp.asarray(valid).astype(bool)
  chex.assert_equal_shape([advantages, valid])
  count = jnp.maximum(jnp.sum(valid, dtype=jnp.int32), 1).astype(advantages.dtype)
  mean = jnp.sum(jnp.where(valid, advantages, 0.0)) / count
  centered = jnp.where(valid, advantages - mean, 0.0)
  std = jnp.sqrt(jnp.sum(centered * centered) / count)
  return centered / (std + eps)
