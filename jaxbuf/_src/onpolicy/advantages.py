"""Advantage and return estimation over time-major rollouts.

Shape key: T time (axis 0), N envs; `...` is any trailing batch shape, so the
same function serves one stream `[T]`, a rollout `[T, N]` or `[T, N, agents]`.

Every function reads one rollout the same way:

* `rewards[t]`, `values[t] = V(s_t)`; `last_value = V(s_T)`, the value of the
  observation after the last step.
* `gamma` (and `gae_lambda`): a scalar, or one value per step `[T, ...]`
  (rlax's `discount_t`, `lambda_t`: options, variable time steps, per-env
  discounts). `gamma[t]` discounts what follows step t; `gae_lambda[t]` mixes
  step t's bootstrap with the later steps' estimate.
* `terminated[t]`: the episode truly ended after step t. Nothing is
  bootstrapped and the trace is cut.
* `truncated[t]`: the episode was cut off (time limit) after step t. The step
  bootstraps from `truncated_values[t]`, the value of the final observation
  (the one an auto-resetting env replaced), and the trace is cut. When both
  flags are set, termination wins.
* `valid[t]` (optional, from ragged collection): False marks padding. Padding
  steps are skipped as if absent: they contribute nothing, and a valid step's
  successor is the next valid step of its stream, or `last_value` when there
  is none. At padding steps every output is 0.

Values the math does not use are never read: a bootstrap after a
termination (including `last_value` when the last step terminated),
`truncated_values` at steps that were not truncated, anything at padding
(rewards, values, per-step gammas and lambdas), and any term whose weight is
0 (`gamma = 0`, the `(1 - lambda)` term at `lambda = 1`, the later steps
after a cut). They may hold NaN or inf (stale data from an earlier rollout,
a value head evaluated on a terminal observation): each is dropped by a
select (`jnp.where`), never multiplied by zero, so it cannot reach a result.

The outputs are targets: gradients are stopped (`jax.lax.stop_gradient`), so
a loss that differentiates through `values` does not also differentiate
through its own target.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbuf._src.core import validation

Numeric = Any


class _Rollout(NamedTuple):
  """Validated inputs in canonical dtypes, gradients stopped (trace-time only)."""

  rewards: jax.Array  # [T, ...], values' dtype
  values: jax.Array  # [T, ...] float
  terminated: jax.Array  # [T, ...] bool
  last_value: jax.Array  # [...], values' dtype
  truncated: jax.Array | None  # [T, ...] bool
  truncated_values: jax.Array | None  # [T, ...], values' dtype
  valid: jax.Array | None  # [T, ...] bool


def _validated(
  what, rewards, values, terminated, last_value, truncated, truncated_values, valid
) -> _Rollout:
  """Checks shapes and dtypes while tracing; messages name the argument."""
  validation.check_floating("values", values, what=what)
  shape = tuple(np.shape(values))
  if not shape:
    raise ValueError(f"{what}: values must have a time axis, shape [T, ...]; given shape {shape}.")
  validation.check_floating("rewards", rewards, what=what)
  validation.check_shape("rewards", rewards, shape, what=what, like="values")
  validation.check_flags("terminated", terminated, what=what)
  validation.check_shape("terminated", terminated, shape, what=what, like="values")
  validation.check_floating("last_value", last_value, what=what)
  validation.check_shape(
    "last_value", last_value, shape[1:], what=what, like="values[0] (no time axis)"
  )
  if (truncated is None) != (truncated_values is None):
    raise ValueError(
      f"{what}: pass truncated and truncated_values together "
      "(a truncated step needs the value to bootstrap from)."
    )
  if truncated is not None:
    validation.check_flags("truncated", truncated, what=what)
    validation.check_shape("truncated", truncated, shape, what=what, like="values")
    validation.check_floating("truncated_values", truncated_values, what=what)
    validation.check_shape("truncated_values", truncated_values, shape, what=what, like="values")
  if valid is not None:
    validation.check_flags("valid", valid, what=what)
    validation.check_shape("valid", valid, shape, what=what, like="values")
  values = jnp.asarray(values)
  dtype = values.dtype

  def as_float(x):
    return None if x is None else lax.stop_gradient(jnp.asarray(x).astype(dtype))

  def as_bool(flags):
    return None if flags is None else jnp.asarray(flags).astype(bool)

  return _Rollout(
    rewards=as_float(rewards),
    values=lax.stop_gradient(values),
    terminated=as_bool(terminated),
    last_value=as_float(last_value),
    truncated=as_bool(truncated),
    truncated_values=as_float(truncated_values),
    valid=as_bool(valid),
  )


def _hyperparameter(what: str, name: str, value: Numeric, rollout: _Rollout) -> jax.Array:
  """A scalar or a per-step `[T, ...]` array, in the values' dtype."""
  validation.check_scalar_or_shape(name, value, rollout.values.shape, what=what, like="values")
  return lax.stop_gradient(jnp.asarray(value).astype(rollout.values.dtype))


def _check_associative(what: str, associative: Any) -> None:
  if not isinstance(associative, bool):
    raise TypeError(
      f"{what}: associative must be a Python bool (it picks the "
      f"program), given {type(associative).__name__}."
    )


def _weighted(weight: jax.Array, x: jax.Array) -> jax.Array:
  """`weight * x`, but 0 where the weight is 0: a term weighted 0 is never read.

  `0 * nan` is nan; the select keeps an unused NaN or inf out of the result.
  """
  return jnp.where(weight == 0, 0.0, weight * x)


def _cut(rollout: _Rollout) -> jax.Array:
  """Whether the trace ends after each step: bool `[T, ...]`."""
  return rollout.terminated if rollout.truncated is None else rollout.terminated | rollout.truncated


def _next_values(rollout: _Rollout, *, associative: bool) -> jax.Array:
  """V of each step's successor (next valid step, else `last_value`): `[T, ...]`."""
  if rollout.valid is None:
    return jnp.concatenate([rollout.values[1:], rollout.last_value[None]])
  # first_valid[t] = V of the first valid step at or after t; its shift is
  # the successor's value. Padding values never enter the arithmetic.
  first_valid = _reverse_linear_scan(
    jnp.where(rollout.valid, 0.0, 1.0).astype(rollout.values.dtype),
    jnp.where(rollout.valid, rollout.values, 0.0),
    rollout.last_value,
    associative=associative,
  )
  return jnp.concatenate([first_valid[1:], rollout.last_value[None]])


def _bootstrap_values(rollout: _Rollout, next_values: jax.Array, gamma: jax.Array) -> jax.Array:
  """`gamma * V(next state)`, exactly 0 after termination: `[T, ...]`."""
  if rollout.truncated is not None:
    assert rollout.truncated_values is not None  # given together (_validated)
    next_values = jnp.where(rollout.truncated, rollout.truncated_values, next_values)
  return _weighted(jnp.where(rollout.terminated, 0.0, gamma), next_values)


def _at_valid(rollout: _Rollout, estimates: jax.Array) -> jax.Array:
  """`estimates` where valid, 0 at padding."""
  if rollout.valid is None:
    return estimates
  return jnp.where(rollout.valid, estimates, 0.0)


def _compose_affine(later, earlier):
  """The affine map `earlier ∘ later`, each map as `(decay, increment)`.

  Step t is the map x -> increment[t] + decay[t] * x. `lax.associative_scan`
  with reverse=True passes the composition of the later steps first. A zero
  decay reads nothing of the later maps.
  """
  later_decay, later_increment = later
  earlier_decay, earlier_increment = earlier
  return (
    _weighted(earlier_decay, later_decay),
    earlier_increment + _weighted(earlier_decay, later_increment),
  )


def _affine_step(next_x, decay_and_increment):
  decay, increment = decay_and_increment
  x = increment + _weighted(decay, next_x)
  return x, x


def _reverse_linear_scan(
  decay: jax.Array, increment: jax.Array, final: jax.Array, *, associative: bool
) -> jax.Array:
  """`x[t] = increment[t] + decay[t] * x[t + 1]` for t < T, with `x[T] = final`.

  Where `decay[t]` is 0, `x[t + 1]` is not read (a NaN there stays out).
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
      _compose_affine, (decay, increment), reverse=True
    )
    return total_increment + _weighted(total_decay, final[None])
  _, xs = lax.scan(_affine_step, final, (decay, increment), reverse=True)
  return xs


def _per_step(x: jax.Array) -> jax.Array | None:
  """A per-step hyperparameter to scan over, or None for a scalar."""
  return x if x.ndim else None


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

  With `d[t] = rewards[t] + gamma[t] * V(next) - values[t]`, where V(next) is
  0 after termination, `truncated_values[t]` after truncation and the next
  (valid) step's value otherwise, `advantages[t] = d[t] + gamma[t] *
  gae_lambda[t] * advantages[t + 1]`, the sum stopping at any termination or
  truncation. See the module docstring for the full conventions, including
  which inputs are never read.

  Args:
    rewards: `[T, ...]` float.
    values: `[T, ...]` float, V(s_t) under the policy that collected the data.
    terminated: `[T, ...]` bool (or 0/1 numbers).
    last_value: `[...]` float, V of the observation after step T - 1 (for a
      ragged rollout, after each stream's last valid step).
    gamma: discount in [0, 1]: a float, a scalar array, or `[T, ...]` per step.
    gae_lambda: the GAE lambda in [0, 1], a scalar or `[T, ...]` per step.
    truncated: `[T, ...]` bool, or None when no episode is ever truncated.
    truncated_values: `[T, ...]` float, read only where `truncated`.
    valid: `[T, ...]` bool, or None when every step is valid (e.g.
      `RolloutState.valid`).
    associative: use a parallel `lax.associative_scan` (O(log T) depth) in
      place of the sequential reverse scan; equal to float32 precision. Meant
      for long horizons on accelerators; on CPU the sequential scan is
      faster (benchmarks/peers/bench_gae.py), and the associative program takes a
      few seconds longer to compile.

  Returns:
    `(advantages, returns)`, both `[T, ...]` in `values`' dtype, gradients
    stopped; `returns = advantages + values` at valid steps, both 0 at
    padding.

  Raises:
    TypeError, ValueError: naming the argument whose dtype or shape is wrong,
      while tracing.

  >>> import jax.numpy as jnp, jaxbuf
  >>> advantages, returns = jaxbuf.compute_gae(
  ...     rewards=jnp.ones(3), values=jnp.zeros(3),
  ...     terminated=jnp.array([False, True, False]), last_value=jnp.float32(10.0),
  ...     gamma=0.5, gae_lambda=1.0)
  >>> advantages.tolist()   # the trace is cut after step 1; step 2 bootstraps
  [1.5, 1.0, 6.0]
  >>> advantages, _ = jaxbuf.compute_gae(   # per-step discounts, rlax-style
  ...     jnp.ones(3), jnp.zeros(3), jnp.zeros(3, bool), jnp.float32(10.0),
  ...     gamma=jnp.array([0.5, 0.0, 1.0]), gae_lambda=1.0)
  >>> advantages.tolist()
  [1.5, 1.0, 11.0]
  """
  what = "compute_gae"
  _check_associative(what, associative)
  rollout = _validated(
    what, rewards, values, terminated, last_value, truncated, truncated_values, valid
  )
  gamma = _hyperparameter(what, "gamma", gamma, rollout)
  gae_lambda = _hyperparameter(what, "gae_lambda", gae_lambda, rollout)
  if not associative:
    return _gae_scan(
      rollout,
      gamma if gamma.ndim == 0 else None,
      gae_lambda if gae_lambda.ndim == 0 else None,
      _per_step(gamma),
      _per_step(gae_lambda),
    )
  next_values = _next_values(rollout, associative=True)
  deltas = rollout.rewards + _bootstrap_values(rollout, next_values, gamma) - rollout.values
  decay = jnp.where(_cut(rollout), 0.0, gamma * gae_lambda).astype(deltas.dtype)
  if rollout.valid is not None:
    # Padding passes the later steps' advantage through unchanged.
    decay = jnp.where(rollout.valid, decay, 1.0).astype(deltas.dtype)
    deltas = jnp.where(rollout.valid, deltas, 0.0)
  advantages = _reverse_linear_scan(
    decay, deltas, jnp.zeros_like(rollout.last_value), associative=True
  )
  return (_at_valid(rollout, advantages), _at_valid(rollout, advantages + rollout.values))


@jax.jit
def _gae_scan(rollout, gamma, gae_lambda, gamma_steps, lambda_steps):
  """The sequential GAE: one reverse scan computing everything per step.

  Reading the inputs step by step, with no precomputed `[T, ...]`
  intermediates (next values, deltas, decays), keeps the memory traffic at
  its floor; on CPU this beat both a precomputed-delta scan and any unrolling
  (benchmarks/peers/bench_gae.py). Jitted so that eager calls reuse one compiled
  program; inside a user's jit it compiles into the same program. A scalar
  hyperparameter comes as `gamma` / `gae_lambda` (its `_steps` None), a
  per-step one as `gamma_steps` / `lambda_steps`, scanned with the rollout.
  """

  def step(carry, inputs):
    later_advantage, next_value = carry
    (reward, value, terminated_t, truncated_t, truncated_value, valid_t, gamma_t, lambda_t) = inputs
    gamma_t = gamma if gamma_t is None else gamma_t
    lambda_t = gae_lambda if lambda_t is None else lambda_t
    if truncated_t is not None:
      bootstrap = jnp.where(truncated_t, truncated_value, next_value)
      cut = terminated_t | truncated_t
    else:
      bootstrap, cut = next_value, terminated_t
    delta = reward + _weighted(jnp.where(terminated_t, 0.0, gamma_t), bootstrap) - value
    advantage = delta + _weighted(jnp.where(cut, 0.0, gamma_t * lambda_t), later_advantage)
    if valid_t is None:
      return (advantage, value), (advantage, advantage + value)
    # Padding: emit 0 and pass the later steps' carry through unchanged.
    carry = (jnp.where(valid_t, advantage, later_advantage), jnp.where(valid_t, value, next_value))
    return carry, (jnp.where(valid_t, advantage, 0.0), jnp.where(valid_t, advantage + value, 0.0))

  _, (advantages, returns) = lax.scan(
    step,
    (jnp.zeros_like(rollout.last_value), rollout.last_value),
    (
      rollout.rewards,
      rollout.values,
      rollout.terminated,
      rollout.truncated,
      rollout.truncated_values,
      rollout.valid,
      gamma_steps,
      lambda_steps,
    ),
    reverse=True,
  )
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
  """TD(lambda) returns: `G[t] = r[t] + gamma[t] ((1 - l[t]) V(next) + l[t] G[t + 1])`.

  The recursion bootstraps from V(next) alone at a truncation (with
  `truncated_values`), from nothing at a termination, and from `last_value`
  after the last (valid) step. Arguments are those of `compute_gae` (gamma
  and gae_lambda scalars or per step); with the same arguments the result
  equals `compute_gae(...)[1]` up to rounding (rlax's `lambda_returns`, with
  `discount_t = gamma * (1 - terminated)` and `v_t` = the next values). At
  padding steps the result is 0.

  Returns:
    `[T, ...]` in `values`' dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.lambda_returns(jnp.ones(3), jnp.zeros(3), jnp.zeros(3, bool),
  ...                       jnp.float32(4.0), gamma=0.5, gae_lambda=1.0).tolist()
  [2.25, 2.5, 3.0]
  """
  what = "lambda_returns"
  _check_associative(what, associative)
  rollout = _validated(
    what, rewards, values, terminated, last_value, truncated, truncated_values, valid
  )
  gamma = _hyperparameter(what, "gamma", gamma, rollout)
  gae_lambda = _hyperparameter(what, "gae_lambda", gae_lambda, rollout)
  next_values = _next_values(rollout, associative=associative)
  # G[t] = rewards[t] + bootstrap[t] * (1 - lambda) + decay[t] * G[t + 1],
  # where a cut trace takes its whole bootstrap from V(next).
  cut = _cut(rollout)
  bootstrap = _bootstrap_values(rollout, next_values, gamma)
  increment = rollout.rewards + _weighted(jnp.where(cut, 1.0, 1.0 - gae_lambda), bootstrap)
  decay = jnp.where(cut, 0.0, gamma * gae_lambda).astype(increment.dtype)
  if rollout.valid is not None:
    decay = jnp.where(rollout.valid, decay, 1.0).astype(increment.dtype)
    increment = jnp.where(rollout.valid, increment, 0.0)
  returns = _reverse_linear_scan(decay, increment, rollout.last_value, associative=associative)
  return _at_valid(rollout, returns)


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

  `G[t] = r[t] + g[t] (r[t+1] + g[t+1] (... + g[t+k-1] V))`, with `g` the
  (scalar or per-step) gamma and k = n, or fewer when the episode ends
  first: a termination stops the sum with no bootstrap, a truncation
  bootstraps from `truncated_values`, and the end of the rollout bootstraps
  from `last_value`. With padding, steps are counted over the valid steps of
  each stream. At padding steps the result is 0.

  Args:
    rewards: as for `compute_gae`, and so are `values`, `terminated`,
      `last_value`, `truncated`, `truncated_values` and `valid`.
    n: a positive Python int.
    gamma: discount in [0, 1], a scalar or `[T, ...]` per step (rlax's
      `discount_t`).

  Returns:
    `[T, ...]` in `values`' dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.n_step_returns(jnp.ones(3), jnp.full(3, 8.0), jnp.zeros(3, bool),
  ...                       jnp.float32(4.0), n=2, gamma=0.5).tolist()
  [3.5, 2.5, 3.0]
  """
  what = "n_step_returns"
  validation.check_positive_int(
    n, "n", prefix=f"{what}: ", reason=" (it sets the number of rounds)"
  )
  rollout = _validated(
    what, rewards, values, terminated, last_value, truncated, truncated_values, valid
  )
  gamma = _hyperparameter(what, "gamma", gamma, rollout)
  num_steps = rollout.values.shape[0]
  if rollout.valid is None:

    def successors(x):
      return jnp.concatenate([x[1:], rollout.last_value[None]])
  else:
    # Index of each step's successor: the first valid step after it, or T,
    # which reads `last_value` from the extended array below.
    time = lax.broadcasted_iota(jnp.int32, rollout.valid.shape, 0)
    first_valid = lax.cummin(jnp.where(rollout.valid, time, num_steps), axis=0, reverse=True)
    successor = jnp.concatenate([first_valid[1:], jnp.full_like(first_valid[:1], num_steps)])

    def successors(x):
      extended = jnp.concatenate([x, rollout.last_value[None]])
      return jnp.take_along_axis(extended, successor, axis=0, mode="promise_in_bounds")

  # After j rounds, returns[t] holds the j-step return from t; one more round
  # prepends a reward and reads the successor's j-step return.
  returns = rollout.values
  for _ in range(n):
    returns = rollout.rewards + _bootstrap_values(rollout, successors(returns), gamma)
  return _at_valid(rollout, returns)


def normalize_advantages(
  advantages: jax.Array, valid: jax.Array | None = None, *, eps: float = 1e-8
) -> jax.Array:
  """Advantages shifted to mean 0 and scaled to standard deviation 1.

  The mean and (population, ddof=0) standard deviation are taken over the
  valid entries only, so padding does not bias them. Padding entries come out
  as 0, whatever they held (NaN included).

  Args:
    advantages: `[T, ...]` float (any shape).
    valid: bool, the same shape, or None when every entry is valid.
    eps: a positive finite float added to the standard deviation, so a
      constant batch maps to 0.

  Returns:
    The same shape and dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.normalize_advantages(jnp.array([1.0, 3.0, 100.0], jnp.float32),
  ...                             jnp.array([True, True, False])).tolist()
  [-1.0, 1.0, 0.0]
  """
  what = "normalize_advantages"
  validation.check_floating("advantages", advantages, what=what)
  if isinstance(eps, bool) or not isinstance(eps, (int, float, np.number)):
    raise TypeError(f"{what}: eps must be a Python float, given {type(eps).__name__}.")
  if not 0 < eps < float("inf"):
    raise ValueError(f"{what}: eps must be positive and finite, given {eps}.")
  advantages = lax.stop_gradient(jnp.asarray(advantages))
  if valid is None:
    valid = jnp.ones(advantages.shape, bool)
  else:
    validation.check_flags("valid", valid, what=what)
    validation.check_shape("valid", valid, advantages.shape, what=what, like="advantages")
  valid = jnp.asarray(valid).astype(bool)
  count = jnp.maximum(jnp.sum(valid, dtype=jnp.int32), 1).astype(advantages.dtype)
  mean = jnp.sum(jnp.where(valid, advantages, 0.0)) / count
  centered = jnp.where(valid, advantages - mean, 0.0)
  std = jnp.sqrt(jnp.sum(centered * centered) / count)
  return centered / (std + eps)
