"""n-step transitions and recurrent-agent helpers over sampled windows.

Shape key: S windows (the sample size), L window length, P = L - n positions
with a full n-step horizon inside the window, T trained steps.

Sequence replay stores each env's experience as one stream of steps, so an
observation is stored once and a transition's next observation is read from
the stream, k steps later. The stream convention (what a step holds, where
`terminated` and `last` go, the gymnax and gymnasium recipes) has one home:
`help(jaxbuf.streams)`.

A transition from step t then runs until the first of: n steps, a
termination (the reward sum stops and the discount is 0), or a `last` step
(a truncation: the sum stops and the target bootstraps from that step's
observation, the TRUE final observation, not the reset one; SB3's
`optimize_memory_usage` bootstraps from the reset observation, SB3 #934,
cleanrl #460). A step flagged `last` starts no transition (`valid` False).
Every step a transition reads lies inside the window, and the buffer only
returns windows of held steps, so no unwritten slot is ever read. A
termination cuts the sum even without a `last` step (the discount is 0
whatever follows), so streams that skip the final step of terminated
episodes stay correct; truncations need it.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core import validation
from jaxbuf._src.core.base import PyTree

Numeric = Any


class NStepTargets(NamedTuple):
  """What each window position needs for an n-step target `[S, P]`.

  The target of position t is `rewards[:, t] + discounts[:, t] *
  V(window step next_index[:, t])`.
  """

  rewards: jax.Array  # [S, P]: discounted reward sum over the k <= n steps
  discounts: jax.Array  # [S, P]: product of the k discounts; 0 if terminated
  next_index: jax.Array  # int32 [S, P]: window position of the next observation
  valid: jax.Array  # bool [S, P]: False where position t is a `last` step


class NStepTransitions(NamedTuple):
  """Transitions from the first step of each window, next_obs read from it.

  `discount` means what it means in every jaxbuf transition
  (`FrameStackTransition`, `HindsightTransition`): the factor of the
  bootstrap, `target = reward + discount * V(next_obs)`, with gamma already
  in it (rlax's `discount_t`).
  """

  obs: PyTree  # leaves [S, ...]
  action: PyTree  # leaves [S, ...]
  reward: jax.Array  # [S]: n-step discounted reward
  discount: jax.Array  # [S]: gamma^k for the k <= n steps summed, 0 after
  # a termination
  next_obs: PyTree  # leaves [S, ...]: obs k steps later (k <= n)
  valid: jax.Array  # bool [S]: False if the first step is a `last` step;
  # give it zero loss weight


def _check_n(n: Any, window_length: int, *, what: str) -> None:
  validation.check_positive_int(n, "n", prefix=f"{what}: ")
  if window_length < n + 1:
    raise ValueError(
      f"{what}: windows of L = {window_length} steps are too "
      f"short for n = {n}: an n-step transition needs L >= "
      f"n + 1 = {n + 1} (the n steps and the next "
      "observation); sample longer windows or lower n."
    )


def _check_window_leaves(name: str, tree: PyTree, shape: tuple[int, ...], *, what: str) -> None:
  """Every leaf of `tree` starts with the `[S, L]` of `rewards`."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves:
    raise ValueError(f"{what}: {name} has no leaves.")
  for path, leaf in leaves:
    leaf_shape = tuple(np.shape(leaf))
    if leaf_shape[:2] != tuple(shape):
      raise ValueError(
        f"{what}: {name} leaf {jax.tree_util.keystr(path) or '<root>'} has "
        f"shape {leaf_shape}, expected [S, L, ...] = {tuple(shape)} + ... "
        "like rewards."
      )


def n_step_targets(
  rewards: jax.Array, terminated: jax.Array, last: jax.Array, *, n: int, gamma: Numeric
) -> NStepTargets:
  """n-step reward sums, discounts and bootstrap positions inside windows.

  For every position t < P = L - n of each window: k is n, or fewer when
  the episode ends first (`terminated[t + k - 1]` or `last[t + k]`);
  `rewards_out = sum_{j<k} (prod_{m<j} gamma[t+m]) rewards[t+j]`,
  `discounts = prod_{j<k} gamma[t+j]` (0 if the episode terminated) and
  `next_index = t + k`. Padding at `last` steps (rewards, gamma) is never
  read, so NaN there does not leak.

  The stream (dm_env / RLDS, as `jaxbuf.sequence_replay` stores it): step
  i holds `obs[i]`, the action taken there, `rewards[i]`, the reward that
  followed, and `terminated[i]`, True when that action truly ended the
  episode (no bootstrap). An episode that ended, terminated or truncated by
  a time limit, gets one more step holding its final observation, with
  `last` True; its action, reward and `terminated` are padding, never read.
  Give it to the buffer as `add(..., final_steps=...)`; the buffer reads
  episode ends from the same `last` leaf.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    rewards: `[S, L]` float, the reward after each step's action.
    terminated: `[S, L]` bool (or 0/1 numbers), on the step whose action
      ended the episode (not on the final-observation step after it).
    last: `[S, L]` bool (or 0/1): the step holds an episode's final
      observation (the extra step after the episode's last action).
    n: a positive Python int, with L >= n + 1.
    gamma: discount in [0, 1], a scalar or `[S, L]` per step (rlax's
      `discount_t`: gamma[t] discounts what follows step t). A concrete
      scalar outside [0, 1] is a `ValueError`; a traced one (computed inside
      your jit) and per-step arrays (whose padding may hold anything) cannot
      be read while tracing and are used as given: a traced 1.5 discounts
      two steps by 2.25. Check them yourself, e.g. with
      `checkify.check(gamma <= 1, ...)`.

  Returns:
    `NStepTargets` with `[S, P]` leaves; rewards and discounts in `rewards`'
    dtype.

  >>> import jax.numpy as jnp, jaxbuf
  >>> targets = jaxbuf.n_step_targets(
  ...     jnp.ones((1, 4)), terminated=jnp.zeros((1, 4), bool),
  ...     last=jnp.array([[False, False, True, False]]), n=2, gamma=0.5)
  >>> targets.rewards.tolist(), targets.discounts.tolist()
  ([[1.5, 1.0]], [[0.25, 0.5]])
  >>> targets.next_index.tolist(), targets.valid.tolist()
  ([[2, 2]], [[True, True]])
  """
  what = "n_step_targets"
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(f"{what}: rewards must have shape [S, L], given {rewards.shape}.")
  validation.check_floating("rewards", rewards, what=what)
  shape = rewards.shape
  validation.check_flags("terminated", terminated, what=what)
  validation.check_shape("terminated", terminated, shape, what=what, like="rewards")
  validation.check_flags("last", last, what=what)
  validation.check_shape("last", last, shape, what=what, like="rewards")
  validation.check_scalar_or_shape("gamma", gamma, shape, what=what, like="rewards")
  _check_n(n, shape[1], what=what)
  dtype = rewards.dtype
  terminated = jnp.asarray(terminated).astype(bool)
  last = jnp.asarray(last).astype(bool)
  gamma = jnp.broadcast_to(jnp.asarray(gamma).astype(dtype), shape)
  num_positions = shape[1] - n

  def at(array, offset):
    return array[:, offset : offset + num_positions]

  alive = ~at(last, 0)
  valid = alive
  reward_sum = jnp.zeros((shape[0], num_positions), dtype)
  discount = jnp.ones((shape[0], num_positions), dtype)
  steps = jnp.full((shape[0], num_positions), n, jnp.int32)
  for offset in range(n):
    # `where`, not a product with `alive`: padding may hold NaN.
    reward_sum = jnp.where(alive, reward_sum + discount * at(rewards, offset), reward_sum)
    terminated_here = at(terminated, offset)
    discount = jnp.where(
      alive, jnp.where(terminated_here, 0.0, discount * at(gamma, offset)), discount
    )
    ended = terminated_here | at(last, offset + 1)
    steps = jnp.where(alive & ended, offset + 1, steps)
    alive = alive & ~ended
  positions = jax.lax.broadcasted_iota(jnp.int32, steps.shape, 1)
  return NStepTargets(
    rewards=jnp.where(valid, reward_sum, 0.0),
    discounts=jnp.where(valid, discount, 0.0),
    next_index=jnp.where(valid, positions + steps, positions),
    valid=valid,
  )


def n_step_transitions(
  obs: PyTree,
  action: PyTree,
  rewards: jax.Array,
  terminated: jax.Array,
  last: jax.Array,
  *,
  n: int,
  gamma: Numeric,
) -> NStepTransitions:
  """The n-step transition from the first step of each sampled window.

  `next_obs` is the window's observation `k <= n` steps after the first, read
  from the stream (observations are stored once): a truncated episode
  bootstraps from its true final observation and a terminated one has
  discount 0.

  Where the flags go: `terminated` on the step whose action ended the
  episode; `last` on the extra step after an ended episode (terminated or
  truncated) that holds its final observation, added to the buffer as
  `add(..., final_steps=...)` (details in `n_step_targets`).

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    obs: pytree of `[S, L, ...]` leaves (the window's observations).
    action: pytree of `[S, L, ...]` leaves; only step 0 is returned.
    rewards, terminated, last, n, gamma: as for `n_step_targets`.

  Returns:
    `NStepTransitions` with `[S, ...]` leaves; weight the loss by `valid`.

  >>> import jax.numpy as jnp, jaxbuf
  >>> window = {"obs": jnp.arange(4.0).reshape(1, 4), "action": jnp.zeros((1, 4), int),
  ...           "reward": jnp.ones((1, 4)), "terminated": jnp.zeros((1, 4), bool),
  ...           "last": jnp.array([[False, True, False, False]])}
  >>> t = jaxbuf.n_step_transitions(
  ...     window["obs"], window["action"], window["reward"], window["terminated"],
  ...     window["last"], n=3, gamma=0.5)
  >>> t.reward.tolist(), t.discount.tolist(), t.next_obs.tolist()  # truncated at 1
  ([1.0], [0.5], [1.0])
  """
  what = "n_step_transitions"
  targets = n_step_targets(rewards, terminated, last, n=n, gamma=gamma)
  shape = tuple(np.shape(rewards))
  _check_window_leaves("obs", obs, shape, what=what)
  _check_window_leaves("action", action, shape, what=what)
  next_index = targets.next_index[:, 0]

  def next_of(leaf):
    leaf = jnp.asarray(leaf)
    index = jnp.reshape(next_index, (shape[0], 1) + (1,) * (leaf.ndim - 2))
    return jnp.take_along_axis(leaf, index, axis=1, mode="promise_in_bounds")[:, 0]

  return NStepTransitions(
    obs=jax.tree.map(lambda leaf: jnp.asarray(leaf)[:, 0], obs),
    action=jax.tree.map(lambda leaf: jnp.asarray(leaf)[:, 0], action),
    reward=targets.rewards[:, 0],
    discount=targets.discounts[:, 0],
    next_obs=jax.tree.map(next_of, obs),
    valid=targets.valid[:, 0],
  )


def burn_in_split(window: PyTree, burn_in: int) -> tuple[PyTree, PyTree]:
  """Splits windows `[S, L, ...]` into burn-in `[S, B, ...]` and trained `[S, L - B, ...]`.

  R2D2 (Kapturowski et al., 2019) replays the stored hidden state of each
  window's first step, then runs the network over the first B steps without
  training on them, so the hidden state it trains from is one computed by
  the current parameters.

  Args:
    window: pytree of `[S, L, ...]` leaves (a sample's `items`).
    burn_in: B, a Python int with 0 <= B < L.

  Returns:
    `(burn_in_steps, trained_steps)`, pytrees like `window`.

  >>> import jax.numpy as jnp, jaxbuf
  >>> burn, train = jaxbuf.burn_in_split({"obs": jnp.zeros((2, 10, 3))}, 4)
  >>> burn["obs"].shape, train["obs"].shape
  ((2, 4, 3), (2, 6, 3))
  """
  what = "burn_in_split"
  validation.check_python_int(burn_in, "burn_in", prefix=f"{what}: ")
  leaves = jax.tree_util.tree_flatten_with_path(window)[0]
  if not leaves:
    raise ValueError(f"{what}: the window has no leaves.")
  first_path, first = leaves[0]
  shape = tuple(np.shape(first))[:2]
  if len(shape) != 2:
    raise ValueError(
      f"{what}: leaf {jax.tree_util.keystr(first_path)} has "
      f"shape {np.shape(first)}, expected [S, L, ...]."
    )
  _check_window_leaves("window", window, shape, what=what)
  if not 0 <= burn_in < shape[1]:
    raise ValueError(f"{what}: burn_in must be in [0, L) = [0, {shape[1]}), given {burn_in}.")
  return (
    jax.tree.map(lambda leaf: jnp.asarray(leaf)[:, :burn_in], window),
    jax.tree.map(lambda leaf: jnp.asarray(leaf)[:, burn_in:], window),
  )


def r2d2_priorities(
  td_errors: jax.Array, mask: jax.Array | None = None, *, eta: Numeric = 0.9
) -> jax.Array:
  """R2D2's sequence priority: `eta * max|td| + (1 - eta) * mean|td|` per window.

  Both the max and the mean run over the valid steps only; a window with no
  valid step gets priority 0 (the buffer's `eps` keeps it drawable). Invalid
  steps may hold NaN: they are never read.

  Args:
    td_errors: `[S, T]` float.
    mask: `[S, T]` bool (or 0/1), or None when every step is valid.
    eta: in [0, 1], a float or scalar array.

  Returns:
    `[S]` in `td_errors`' dtype, gradients stopped.

  >>> import jax.numpy as jnp, jaxbuf
  >>> jaxbuf.r2d2_priorities(jnp.array([[1.0, -3.0, 100.0]]),
  ...                        jnp.array([[True, True, False]]), eta=0.5).tolist()
  [2.5]
  """
  what = "r2d2_priorities"
  td_errors = jnp.asarray(td_errors)
  if td_errors.ndim != 2:
    raise ValueError(f"{what}: td_errors must have shape [S, T], given {td_errors.shape}.")
  validation.check_floating("td_errors", td_errors, what=what)
  if mask is None:
    mask = jnp.ones(td_errors.shape, bool)
  validation.check_flags("mask", mask, what=what)
  validation.check_shape("mask", mask, td_errors.shape, what=what, like="td_errors")
  validation.check_scalar_or_shape("eta", eta, (), what=what, like="a scalar")
  mask = jnp.asarray(mask).astype(bool)
  magnitudes = jnp.where(mask, jnp.abs(jax.lax.stop_gradient(td_errors)), 0.0)
  count = jnp.sum(mask, axis=1)
  mean = jnp.sum(magnitudes, axis=1) / jnp.maximum(count, 1).astype(td_errors.dtype)
  eta = jnp.asarray(eta).astype(td_errors.dtype)
  # Magnitudes are >= 0, so 0 is the max of none: windows of T = 0 steps
  # ([S, 0]) get priority 0, as windows with no valid step.
  return eta * jnp.max(magnitudes, axis=1, initial=0.0) + (1 - eta) * mean
