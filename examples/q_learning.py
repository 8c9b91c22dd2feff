"""What the Q-learning examples share: flags, network, exploration, the learner.

Shape key: N envs, S sample size, A actions.

A Q-learning example writes its replay buffer, its Q-values, its TD loss and
its `collect` (step the envs with the given actions, add to the buffer);
`make_trainer` wraps them in the same step: epsilon-greedy actions,
collect, then, once the buffer can sample and the warm-up is over, one
learner update (`buffer.sample`, the loss, optax,
`buffer.update_priorities`) gated by `jaxbuf.cond_update`, and the target
network copied every `target_update_interval` env steps.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

import jaxbuf

from examples import training

PyTree = Any


@dataclasses.dataclass(frozen=True)
class QLearningConfig:
  """The flags of a Q-learning example, beside its `training.RunConfig`."""

  buffer_size: int = 10_000
  batch_size: int = 128
  learning_starts: int = 10_000  # env steps of pure collection first
  learning_rate: float = 2.5e-4
  learning_rate_end: float = -1.0  # annealed linearly to this over the
  # updates; -1: constant
  gamma: float = 0.99
  target_update_interval: int = 500  # env steps between target network copies
  epsilon_start: float = 1.0
  epsilon_end: float = 0.05
  epsilon_fraction: float = 0.5  # of total_steps spent annealing epsilon
  max_grad_norm: float = 10.0
  hidden_size: int = 120

  # The same counts in iterations, one vectorized step of num_envs env steps.
  @property
  def num_iterations(self) -> int:
    return self.total_steps // self.num_envs

  @property
  def learning_starts_iterations(self) -> int:
    return self.learning_starts // self.num_envs

  @property
  def num_updates(self) -> int:
    return max(self.num_iterations - self.learning_starts_iterations, 1)

  @property
  def target_period(self) -> int:
    return max(self.target_update_interval // self.num_envs, 1)


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """The flags of a choice between uniform and prioritized replay."""

  replay: str = "uniform"  # or "prioritized"
  alpha: float = 0.6  # prioritized replay only
  beta_start: float = 0.4  # annealed to 1 over the updates
  priority_eps: float = 1e-6


class QNetwork(nn.Module):
  """An MLP from observations `[..., *obs_shape]` to Q-values `[..., A]`."""

  num_actions: int
  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array) -> jax.Array:
    x = obs.reshape(obs.shape[: obs.ndim - 1] + (-1,))
    x = nn.relu(nn.Dense(self.hidden_size)(x))
    # 120 then 84 units by default, PureJaxRL's CartPole network.
    x = nn.relu(nn.Dense(self.hidden_size * 7 // 10)(x))
    return nn.Dense(self.num_actions)(x)


class LearnerState(flax.struct.PyTreeNode):
  """What every Q-learning example carries; each adds its env's fields."""

  params: PyTree
  target_params: PyTree
  opt_state: PyTree
  buffer_state: PyTree
  iteration: jax.Array  # shape=(), int32: vectorized env steps taken
  key: jax.Array  # shape=(), a typed PRNG key

  @classmethod
  def start(
    cls,
    key: jax.Array,
    params: PyTree,
    optimizer: optax.GradientTransformation,
    buffer_state: PyTree,
    **env_fields,
  ) -> "LearnerState":
    """A state before the first step: the target network equal to `params`."""
    return cls(
      params=params,
      target_params=params,
      opt_state=optimizer.init(params),
      buffer_state=buffer_state,
      iteration=jnp.zeros((), jnp.int32),
      key=key,
      **env_fields,
    )


class EnvLearnerState(LearnerState):
  """A `LearnerState` with N vmapped gymnax envs."""

  env_state: PyTree  # gymnax state, each leaf [N, ...]
  obs: jax.Array  # [N, ...], float32: what the agent acts on
  episode_returns: jax.Array  # [N], float32: return so far of each running episode

  def stepped(
    self, buffer_state: PyTree, step: training.EnvStep, **fields
  ) -> tuple["EnvLearnerState", jax.Array, jax.Array]:
    """The state after `step` (its `obs` unless `fields` has another), and
    `collect`'s `episode_ended` and `episode_returns` (the latter zeroed in
    the state where an episode ended)."""
    episode_returns = self.episode_returns + step.reward
    fields = dict(dict(obs=step.obs), **fields)
    return (
      self.replace(
        buffer_state=buffer_state,
        env_state=step.env_state,
        episode_returns=jnp.where(step.ended, 0.0, episode_returns),
        **fields,
      ),
      step.ended,
      episode_returns,
    )


def replay_buffer(
  config: ReplayConfig,
  uniform: Callable[..., jaxbuf.Buffer],
  prioritized: Callable[..., jaxbuf.Buffer],
) -> jaxbuf.Buffer:
  """`uniform()` or, for `--replay prioritized`, `prioritized(alpha=, eps=,
  beta=)` with beta annealed linearly from `beta_start` to 1 over the updates.

  `uniform` and `prioritized` are a kind's factories with its own arguments
  bound, e.g. `functools.partial(jaxbuf.sequence_replay, N, C, L)`.
  """
  if config.replay == "uniform":
    return uniform()
  if config.replay == "prioritized":
    return prioritized(
      alpha=config.alpha,
      eps=config.priority_eps,
      beta=optax.linear_schedule(config.beta_start, 1.0, config.num_updates),
    )
  raise ValueError(f"--replay must be uniform or prioritized, given {config.replay!r}.")


def make_optimizer(
  config: QLearningConfig, learning_rate_end: float | None = None
) -> optax.GradientTransformation:
  """Adam after clipping the gradient norm; the rate annealed linearly to
  `learning_rate_end` (default `config.learning_rate_end`) over the updates,
  unless that is negative."""
  end = config.learning_rate_end if learning_rate_end is None else learning_rate_end
  learning_rate = (
    config.learning_rate
    if end < 0
    else optax.linear_schedule(config.learning_rate, end, config.num_updates)
  )
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(learning_rate))


def epsilon_schedule(config: QLearningConfig) -> optax.Schedule:
  """Epsilon from `epsilon_start` to `epsilon_end` over the first
  `epsilon_fraction` of the iterations."""
  return optax.linear_schedule(
    config.epsilon_start,
    config.epsilon_end,
    transition_steps=max(int(config.epsilon_fraction * config.num_iterations), 1),
  )


def epsilon_greedy(
  explore_key: jax.Array, action_key: jax.Array, q_values: jax.Array, epsilon: jax.Array
) -> jax.Array:
  """Actions int32 `[N]` from `q_values [N, A]`: uniform with probability
  `epsilon`, else the greedy one."""
  greedy = q_values.argmax(axis=-1)
  random_actions = jax.random.randint(action_key, greedy.shape, 0, q_values.shape[-1])
  explore = jax.random.uniform(explore_key, greedy.shape) < epsilon
  return jnp.where(explore, random_actions, greedy).astype(jnp.int32)


def q_of(q_values: jax.Array, actions: jax.Array) -> jax.Array:
  """`q_values [..., A]` of `actions [...]`: `[...]`."""
  return jnp.take_along_axis(q_values, actions[..., None], axis=-1)[..., 0]


def double_q(online_next_q: jax.Array, target_next_q: jax.Array) -> jax.Array:
  """Double DQN's next value `[...]`: the online network picks the next
  action, the target network values it (less overestimation than the max)."""
  return q_of(target_next_q, online_next_q.argmax(axis=-1))


def td_learner(
  buffer: jaxbuf.Buffer,
  optimizer: optax.GradientTransformation,
  td_loss: Callable,
  batch_size: int,
  priorities: Callable = jnp.abs,
) -> Callable:
  """A Q-learning example's learner step, `learn(state, key)` for `learn_when`.

  `td_loss(params, target_params, sample) -> (loss, aux)`; the sampled
  items' new priorities are `priorities(aux)` (float32 `[S]`). Returns
  `(params, opt_state, buffer_state, loss)`: one optimizer step on a sample
  of `batch_size`, and its priorities updated.
  """

  def learn(state: LearnerState, key: jax.Array):
    sample = buffer.sample(state.buffer_state, key, batch_size)
    (loss, aux), grads = jax.value_and_grad(td_loss, has_aux=True)(
      state.params, state.target_params, sample
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    buffer_state = buffer.update_priorities(
      state.buffer_state, sample.indices, priorities(aux), sample.item_ids
    )
    return (optax.apply_updates(state.params, updates), opt_state, buffer_state, loss)

  return learn


def learn_when(
  should_learn: jax.Array,
  learn: Callable,
  state: LearnerState,
  key: jax.Array,
  *,
  target_period: int,
) -> tuple[LearnerState, jax.Array]:
  """One learner step if `should_learn`: `(state, loss)`.

  `learn(state, key)` returns `(params, opt_state, buffer_state, loss)`; it
  may sample and update priorities but never adds. The gate is
  `jaxbuf.cond_update`: vmapped over seeds whose predicates differ, a
  `lax.cond` is a select over every output, and a select over the replay
  storage would copy every seed's buffer at every step; the storage, which
  both branches pass through, is left out of it. Then the target network is
  copied every `target_period` iterations.
  """

  def skip(state, key):
    del key
    return (state.params, state.opt_state, state.buffer_state, jnp.zeros((), jnp.float32))

  params, opt_state, buffer_state, loss = jaxbuf.cond_update(should_learn, learn, skip, state, key)
  return state.replace(
    params=params,
    opt_state=opt_state,
    buffer_state=buffer_state,
    target_params=optax.periodic_update(
      params, state.target_params, state.iteration, target_period
    ),
  ), loss


def make_trainer(
  config: QLearningConfig,
  *,
  buffer: jaxbuf.Buffer,
  optimizer: optax.GradientTransformation,
  td_loss: Callable,
  init: Callable,
  q_values: Callable,
  collect: Callable,
  title: str,
  epsilon: optax.Schedule | None = None,
  priorities: Callable = jnp.abs,
) -> training.Trainer:
  """The `training.Trainer` of a Q-learning example.

  Args:
    config: the example's flags.
    buffer: its replay buffer.
    optimizer: from `make_optimizer`.
    td_loss: `(params, target_params, sample) -> (loss, aux)`.
    init: `key -> state`, a `LearnerState` with the example's env fields.
    q_values: `(params, state) -> [N, A]`, what the actor acts on.
    collect: one vectorized env step, `(state, actions [N], env_key) ->
      (state, episode_ended [N], episode_returns [N])`: steps the envs and
      adds to the buffer; the returns are those of the episodes so far,
      read where `episode_ended`.
    title: the progress bar's and the plot's.
    epsilon: `iteration -> epsilon`, `()` or `[N]`; by default
      `epsilon_schedule(config)`.
    priorities: `aux -> [S]`, the sampled items' new priorities.
  """
  learn = td_learner(buffer, optimizer, td_loss, config.batch_size, priorities)
  epsilon = epsilon or epsilon_schedule(config)

  def step(state: LearnerState) -> tuple[LearnerState, training.Metrics]:
    key, explore_key, action_key, env_key, learn_key = jax.random.split(state.key, 5)
    actions = epsilon_greedy(
      explore_key, action_key, q_values(state.params, state), epsilon(state.iteration)
    )
    state, episode_ended, episode_returns = collect(state, actions, env_key)
    state = state.replace(iteration=state.iteration + 1, key=key)
    # Learning samples and updates priorities but never writes the replay
    # storage, so `learn_when` keeps the storage out of the select that a
    # vmapped cond becomes (a copy of every seed's buffer per step).
    should_learn = buffer.can_sample(state.buffer_state, config.batch_size) & (
      state.iteration >= config.learning_starts_iterations
    )
    state, loss = learn_when(
      should_learn, learn, state, learn_key, target_period=config.target_period
    )
    return state, training.episode_metrics(episode_ended, episode_returns, loss)

  return training.Trainer(
    init=init, step=step, env_steps_per_iteration=config.num_envs, title=title
  )
