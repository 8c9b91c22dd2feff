"""PPO on a gymnax environment with jaxbuf rollouts, GAE and minibatches, jitted.

Shape key: K seeds, T rollout length, N envs, M minibatches, L sequence
length, E sequences per minibatch, A actions, H hidden size.

One PPO update is one pure function: T steps of N vmapped environments
written into a `jaxbuf.rollout_buffer`, `jaxbuf.compute_gae`, then epochs of
shuffled minibatches, each an optax step. Updates are chained with `lax.scan`
and K seeds train at once with `vmap`. With `--recurrent gru` or `lstm` the
policy carries a flax recurrent state; the update then cuts each env's column
into sequences of L steps (`jaxbuf.sequence_chunks`) and re-runs the policy
from the hidden state stored at each sequence's first step.

  python examples/ppo.py                       # the demo: 5e5 steps, one seed
  python examples/ppo.py --num-seeds 4 --plot ppo.png   # the learning bar
  python examples/ppo.py --recurrent gru       # a GRU policy, sequence minibatches

Truncation: gymnax resets inside `env.step`; the observation it replaced is
`info["final_observation"]`. A step cut off by the time limit (CartPole-v1:
500 steps) is stored as `truncated` with `truncated_value` = V(that final
observation), so GAE bootstraps from it instead of treating the time limit
as a failure. A step both terminated and truncated counts as terminated.
"""

import dataclasses
import pathlib
import sys
from typing import Any

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

import jaxbuf

from examples import training  # noqa: E402

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config(training.GymnaxConfig):
  """Hyperparameters; each field is also a command-line flag (the shared
  ones in examples/training.py)."""

  num_envs: int = 4  # N
  num_steps: int = 128  # T, steps per env per update
  update_epochs: int = 4
  num_minibatches: int = 4  # M
  learning_rate: float = 2.5e-4  # annealed linearly to 0
  gamma: float = 0.99
  gae_lambda: float = 0.95
  clip_eps: float = 0.2
  entropy_coef: float = 0.01
  value_coef: float = 0.5
  max_grad_norm: float = 0.5
  hidden_size: int = 64
  recurrent: str = "none"  # "none", "gru" or "lstm"
  sequence_length: int = 32  # L, recurrent minibatch sequences


class ActorCritic(nn.Module):
  """Separate tanh MLPs: observations `[..., D]` -> logits `[..., A]`, value `[...]`."""

  num_actions: int
  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
    actor = nn.tanh(nn.Dense(self.hidden_size)(obs))
    actor = nn.tanh(nn.Dense(self.hidden_size)(actor))
    logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(actor)
    critic = nn.tanh(nn.Dense(self.hidden_size)(obs))
    critic = nn.tanh(nn.Dense(self.hidden_size)(critic))
    value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic)
    return logits, value[..., 0]


class RecurrentActorCritic(nn.Module):
  """One step of a GRU/LSTM policy for E streams.

  `(hidden, obs [E, D], episode_start [E]) -> (hidden, logits [E, A],
  value [E])`. The hidden state is zeroed where an episode starts, so a
  stored hidden state can be fed back as-is when re-running a sequence.
  """

  num_actions: int
  hidden_size: int
  cell: str

  def initial_hidden(self, num_streams: int) -> PyTree:
    zeros = jnp.zeros((num_streams, self.hidden_size), jnp.float32)
    return zeros if self.cell == "gru" else (zeros, zeros)  # LSTM: (c, h)

  @nn.compact
  def __call__(self, hidden, obs, episode_start):
    hidden = jax.tree.map(lambda h: jnp.where(episode_start[:, None], jnp.zeros_like(h), h), hidden)
    features = nn.tanh(nn.Dense(self.hidden_size)(obs))
    cell = (
      nn.GRUCell(self.hidden_size) if self.cell == "gru" else nn.OptimizedLSTMCell(self.hidden_size)
    )
    hidden, features = cell(hidden, features)
    actor = nn.tanh(nn.Dense(self.hidden_size)(features))
    logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(actor)
    critic = nn.tanh(nn.Dense(self.hidden_size)(features))
    value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic)
    return hidden, logits, value[..., 0]


@flax.struct.dataclass
class RunnerState:
  """Everything one seed's training carries from one update to the next."""

  params: PyTree
  opt_state: PyTree
  rollout_state: jaxbuf.RolloutState
  env_state: PyTree  # gymnax state, each leaf [N, ...]
  obs: jax.Array  # [N, *obs_shape], float32
  hidden: PyTree  # recurrent state [N, H] (LSTM: a pair); () if none
  episode_start: jax.Array  # [N], bool: obs is the first of an episode
  episode_returns: jax.Array  # [N], float32: return so far of each running episode
  key: jax.Array  # shape=(), a typed PRNG key


def ppo_loss(
  logits: jax.Array, values: jax.Array, minibatch: dict[str, Any], config: Config
) -> jax.Array:
  """The clipped PPO objective over any batch shape `[...]`; logits `[..., A]`."""
  log_probs = jax.nn.log_softmax(logits)
  action_log_probs = jnp.take_along_axis(log_probs, minibatch["action"][..., None], axis=-1)[..., 0]
  advantages = jaxbuf.normalize_advantages(minibatch["advantage"])
  ratio = jnp.exp(action_log_probs - minibatch["log_prob"])
  clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)
  policy_loss = -jnp.mean(jnp.minimum(ratio * advantages, clipped_ratio * advantages))
  clipped_values = minibatch["value"] + jnp.clip(
    values - minibatch["value"], -config.clip_eps, config.clip_eps
  )
  value_loss = 0.5 * jnp.mean(
    jnp.maximum((values - minibatch["return"]) ** 2, (clipped_values - minibatch["return"]) ** 2)
  )
  entropy = -jnp.mean(jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1))
  return policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy


def training_batch(
  rollout: dict[str, jax.Array], last_value: jax.Array, config: Config
) -> dict[str, jax.Array]:
  """GAE advantages and returns for a rollout, with the inputs `ppo_loss` reads.

  Args:
    rollout: "obs", "action", "log_prob", "value", "reward", "terminated",
      "truncated" and "truncated_value", each `[T, N, ...]`.
    last_value: `[N]`, V of the observation after the rollout's last step.
    config: gamma and gae_lambda.

  Returns:
    "obs", "action", "log_prob", "value", "advantage" and "return", each
    `[T, N, ...]`.
  """
  advantages, returns = jaxbuf.compute_gae(
    rollout["reward"],
    rollout["value"],
    rollout["terminated"],
    last_value,
    gamma=config.gamma,
    gae_lambda=config.gae_lambda,
    truncated=rollout["truncated"],
    truncated_values=rollout["truncated_value"],
  )
  return dict(
    obs=rollout["obs"],
    action=rollout["action"],
    log_prob=rollout["log_prob"],
    value=rollout["value"],
    advantage=advantages,
    **{"return": returns},
  )


def make_trainer(config: Config) -> training.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`.

  One `step` is one PPO update: T * N env steps, GAE, then
  `update_epochs * num_minibatches` gradient steps.
  """
  envs = training.make_vector_env(config.env_name, config.time_limit, config.num_envs)
  num_actions = envs.num_actions
  num_updates = config.total_steps // (config.num_steps * config.num_envs)
  recurrent = config.recurrent != "none"
  if config.recurrent not in ("none", "gru", "lstm"):
    raise ValueError(f"--recurrent must be none, gru or lstm, given {config.recurrent!r}.")
  if recurrent:
    network = RecurrentActorCritic(num_actions, config.hidden_size, config.recurrent)

    def policy(params, hidden, obs, episode_start):
      return network.apply(params, hidden, obs, episode_start)
  else:
    network = ActorCritic(num_actions, config.hidden_size)

    def policy(params, hidden, obs, episode_start):
      del episode_start
      return (hidden, *network.apply(params, obs))

  learning_rate = optax.linear_schedule(
    config.learning_rate,
    0.0,
    transition_steps=max(num_updates, 1) * config.update_epochs * config.num_minibatches,
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(config.max_grad_norm), optax.adam(learning_rate, eps=1e-5)
  )
  rollout = jaxbuf.rollout_buffer(config.num_steps, config.num_envs)

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    episode_start = jnp.ones((config.num_envs,), bool)
    if recurrent:
      hidden = network.initial_hidden(config.num_envs)
      params = network.init(network_key, hidden, obs, episode_start)
    else:
      hidden = ()
      params = network.init(network_key, obs)
    example_step = dict(
      obs=obs[0],
      action=jnp.int32(0),
      log_prob=jnp.float32(0),
      value=jnp.float32(0),
      reward=jnp.float32(0),
      terminated=jnp.bool_(False),
      truncated=jnp.bool_(False),
      truncated_value=jnp.float32(0),
      episode_start=jnp.bool_(False),
      hidden=jax.tree.map(lambda h: h[0], hidden),
    )
    return RunnerState(
      params=params,
      opt_state=optimizer.init(params),
      rollout_state=rollout.init(example_step),
      env_state=env_state,
      obs=obs,
      hidden=hidden,
      episode_start=episode_start,
      episode_returns=jnp.zeros((config.num_envs,), jnp.float32),
      key=key,
    )

  def env_step(state: RunnerState, _) -> tuple[RunnerState, training.Metrics]:
    key, action_key, env_key = jax.random.split(state.key, 3)
    next_hidden, logits, value = policy(state.params, state.hidden, state.obs, state.episode_start)
    action = jax.random.categorical(action_key, logits).astype(jnp.int32)
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
    step = envs.step(env_key, state.env_state, action)
    # V(final observation) for steps cut by the time limit: the observation
    # the auto-reset replaced, seen with the hidden state this step produced.
    _, _, truncated_value = policy(
      state.params, next_hidden, step.final_obs, jnp.zeros_like(state.episode_start)
    )
    rollout_state = rollout.add(
      state.rollout_state,
      dict(
        obs=state.obs,
        action=action,
        log_prob=log_prob,
        value=value,
        reward=step.reward,
        terminated=step.terminated,
        truncated=step.truncated,
        truncated_value=truncated_value,
        episode_start=state.episode_start,
        hidden=state.hidden,
      ),
    )
    episode_returns = state.episode_returns + step.reward
    state = state.replace(
      rollout_state=rollout_state,
      env_state=step.env_state,
      obs=step.obs,
      hidden=next_hidden,
      episode_start=step.ended,
      episode_returns=jnp.where(step.ended, 0.0, episode_returns),
      key=key,
    )
    return state, training.episode_metrics(step.ended, episode_returns, jnp.zeros((), jnp.float32))

  def minibatch_loss(params, minibatch) -> jax.Array:
    if not recurrent:
      logits, values = network.apply(params, minibatch["obs"])
      return ppo_loss(logits, values, minibatch, config)
    sequences, initial_hidden = minibatch  # [L, E, ...], [E, H]

    def unroll(hidden, inputs):
      obs, episode_start = inputs
      hidden, logits, value = network.apply(params, hidden, obs, episode_start)
      return hidden, (logits, value)

    _, (logits, values) = jax.lax.scan(
      unroll, initial_hidden, (sequences["obs"], sequences["episode_start"])
    )
    return ppo_loss(logits, values, sequences, config)

  def gradient_step(carry, minibatch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(minibatch_loss)(params, minibatch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def step(state: RunnerState) -> tuple[RunnerState, training.Metrics]:
    # No rollout.reset: the rollout read by the previous update is full, so
    # its first add here starts a new one.
    state, step_metrics = jax.lax.scan(env_step, state, None, length=config.num_steps)
    data = state.rollout_state.data  # leaves [T, N, ...]
    _, _, last_value = policy(state.params, state.hidden, state.obs, state.episode_start)
    # episode_start: a recurrent unroll zeroes its hidden state there.
    batch = dict(training_batch(data, last_value, config), episode_start=data["episode_start"])

    def epoch(params_and_opt_state, key):
      if recurrent:
        chunks = jaxbuf.sequence_chunks(
          key,
          batch,
          data["hidden"],
          chunk_length=config.sequence_length,
          num_minibatches=config.num_minibatches,
        )
        minibatches = (chunks.data, chunks.initial_hidden)
      else:
        minibatches = jaxbuf.shuffled_minibatches(
          key, batch, num_minibatches=config.num_minibatches
        )
      return jax.lax.scan(gradient_step, params_and_opt_state, minibatches)

    key, epochs_key = jax.random.split(state.key)
    (params, opt_state), losses = jax.lax.scan(
      epoch, (state.params, state.opt_state), jax.random.split(epochs_key, config.update_epochs)
    )
    state = state.replace(params=params, opt_state=opt_state, key=key)
    return state, training.Metrics(
      returns_sum=step_metrics.returns_sum.sum(),
      episodes_ended=step_metrics.episodes_ended.sum(),
      loss=losses.mean(),
    )

  return training.Trainer(
    init=init,
    step=step,
    env_steps_per_iteration=config.num_steps * config.num_envs,
    title=("PPO" if config.recurrent == "none" else f"PPO-{config.recurrent.upper()}")
    + f", {config.env_name}",
  )


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `training.train`'s dict, an
  iteration per PPO update of T * N env steps."""
  return training.train(make_trainer(config), config, show_progress)


def main(argv: list[str] | None = None) -> None:
  training.main(argv, Config, train, __doc__.split("\n")[0])


if __name__ == "__main__":
  main()
