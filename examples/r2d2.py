"""R2D2-style recurrent Q-learning on a partially observed CartPole, one program.

Shape key: K seeds, N envs, S windows per batch, L window length, B burn-in,
P = L - B - n trained positions, H hidden size, A actions.

CartPole with its two velocities hidden (the agent sees cart position and
pole angle only) cannot be solved from one observation; a GRU can infer the
velocities from the last few. As in R2D2 (Kapturowski et al., 2019):

* the stream stores, at every step, the hidden state the network was fed
  there, so each sampled window starts from its stored state. Per step is
  the simple choice (any period, any burn-in) but not the small one: with
  these defaults the buffer state takes 279.6 bytes per step against 49.2
  were the state kept once per window start (period 10) and 23.6 without
  it (keeping it once per start needs `period`-aligned storage inside the
  buffer, which sequence replay does not offer); bfloat16 halves it;
* `jaxbuf.burn_in_split`: the first B steps only refresh that state under
  the current parameters (no gradient), the rest are trained on;
* n-step double-Q targets at every trained position
  (`jaxbuf.n_step_targets`), from Q-values of one unroll of each network;
* windows drawn by `jaxbuf.prioritized_sequence_replay`, their priorities
  `jaxbuf.r2d2_priorities` (eta max|td| + (1 - eta) mean|td|).

Episode ends follow examples/nstep_dqn.py: one extra stream step holds the
final observation (flagged `last`); inside a window the hidden state is
reset after a `last` step, as it was during collection. `--network mlp`
runs the same loop with a feed-forward Q-network (the hidden state is
carried through unchanged), the baseline on the same masked task.

  python examples/r2d2.py --num-seeds 4 --plot r2d2.png
  python examples/r2d2.py --network mlp --num-seeds 4
"""

import dataclasses
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/dqn.py says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

import jaxbuf

from examples import common  # noqa: E402

PyTree = Any
# CartPole's observation is (x, x_dot, theta, theta_dot): keep x and theta.
OBSERVED = (0, 2)


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""
  env_name: str = "CartPole-v1"
  time_limit: int = 0
  network: str = "gru"                # "gru" or "mlp" (the baseline)
  total_steps: int = 500_000
  num_seeds: int = 1
  seed: int = 0
  num_envs: int = 10
  buffer_size: int = 20_000           # stream steps over all envs
  sequence_length: int = 20           # L
  period: int = 10                    # windows overlap by L - period steps
  burn_in: int = 5                    # B
  n_step: int = 3
  batch_size: int = 32                # S windows: S * P trained positions
  learning_starts: int = 10_000
  learning_rate: float = 1e-3
  gamma: float = 0.99
  target_update_interval: int = 1_000
  epsilon_start: float = 1.0
  epsilon_end: float = 0.05
  epsilon_fraction: float = 0.5
  alpha: float = 0.6
  beta_start: float = 0.4
  eta: float = 0.9
  max_grad_norm: float = 10.0
  hidden_size: int = 64
  num_chunks: int = 50


class Step(NamedTuple):
  """One stream step; at a `last` step only obs and hidden are meaningful."""
  obs: jax.Array         # [2], float32: position and angle only
  action: jax.Array      # (), int32
  reward: jax.Array      # (), float32
  terminated: jax.Array  # (), bool
  last: jax.Array        # (), bool: obs is an episode's final observation
  hidden: jax.Array      # [H], float32: the state fed to the network at obs


class QNetwork(nn.Module):
  """One step: `(hidden [..., H], obs [..., 2]) -> (hidden, Q [..., A])`."""
  num_actions: int
  hidden_size: int
  recurrent: bool

  @nn.compact
  def __call__(self, hidden: jax.Array, obs: jax.Array):
    x = nn.relu(nn.Dense(self.hidden_size)(obs))
    if self.recurrent:
      hidden, x = nn.GRUCell(self.hidden_size)(hidden, x)
    else:
      x = nn.relu(nn.Dense(self.hidden_size)(x))
    x = nn.relu(nn.Dense(self.hidden_size)(x))
    return hidden, nn.Dense(self.num_actions)(x)


@flax.struct.dataclass
class RunnerState:
  params: PyTree
  target_params: PyTree
  opt_state: PyTree
  buffer_state: PyTree
  env_state: PyTree            # gymnax state, leaves [N, ...]
  obs: jax.Array               # [N, 2]
  hidden: jax.Array            # [N, H]: zero at each episode's first step
  episode_returns: jax.Array   # [N], float32
  iteration: jax.Array         # shape=(), int32
  key: jax.Array



def make_trainer(config: Config) -> common.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`."""
  if config.network not in ("gru", "mlp"):
    raise ValueError(f"--network must be gru or mlp, given {config.network!r}.")
  envs = common.make_vector_env(config.env_name, config.time_limit,
                                config.num_envs)
  num_actions = envs.num_actions
  network = QNetwork(num_actions, config.hidden_size,
                     recurrent=config.network == "gru")
  num_iterations = config.total_steps // config.num_envs
  epsilon_schedule = optax.linear_schedule(
      config.epsilon_start, config.epsilon_end,
      transition_steps=int(config.epsilon_fraction * num_iterations))
  learning_starts = config.learning_starts // config.num_envs
  buffer = jaxbuf.prioritized_sequence_replay(
      config.num_envs, config.buffer_size, config.sequence_length,
      period=config.period, alpha=config.alpha,
      beta=optax.linear_schedule(config.beta_start, 1.0,
                                 max(num_iterations - learning_starts, 1)))
  optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                          optax.adam(config.learning_rate))
  target_period = max(config.target_update_interval // config.num_envs, 1)

  def observe(full_obs):
    return full_obs[..., jnp.array(OBSERVED)]

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    full_obs, env_state = envs.reset(reset_key)
    obs = observe(full_obs)
    hidden = jnp.zeros((config.num_envs, config.hidden_size), jnp.float32)
    params = network.init(network_key, hidden[0], obs[0])
    example = Step(obs=obs[0], action=jnp.int32(0), reward=jnp.float32(0),
                   terminated=jnp.bool_(False), last=jnp.bool_(False),
                   hidden=hidden[0])
    return RunnerState(
        params=params, target_params=params, opt_state=optimizer.init(params),
        buffer_state=buffer.init(example), env_state=env_state, obs=obs,
        hidden=hidden, episode_returns=jnp.zeros(config.num_envs, jnp.float32),
        iteration=jnp.zeros((), jnp.int32), key=key)

  def unroll(params, hidden, steps):
    """Q-values `[S, T, A]` and the final hidden state from `hidden [S, H]`."""
    def one_step(hidden, inputs):
      obs, reset = inputs
      hidden = jnp.where(reset[:, None], 0.0, hidden)
      return network.apply(params, hidden, obs)
    hidden, q_values = jax.lax.scan(
        one_step, hidden, (jnp.swapaxes(steps["obs"], 0, 1),
                           jnp.swapaxes(steps["reset"], 0, 1)))
    return jnp.swapaxes(q_values, 0, 1), hidden

  def td_loss(params, target_params, sample):
    window = sample.items                                   # [S, L, ...]
    # The step after a final observation starts a new episode: zero state.
    reset = jnp.concatenate([jnp.zeros_like(window.last[:, :1]),
                             window.last[:, :-1]], axis=1)
    inputs = {"obs": window.obs, "reset": reset}
    burn, trained = jaxbuf.burn_in_split(inputs, config.burn_in)
    _, hidden = unroll(params, window.hidden[:, 0], burn)
    q_values, _ = unroll(params, jax.lax.stop_gradient(hidden), trained)
    target_q, _ = unroll(target_params, window.hidden[:, 0], inputs)
    target_q = target_q[:, config.burn_in:]                 # [S, L - B, A]
    _, steps = jaxbuf.burn_in_split(window, config.burn_in)
    targets = jaxbuf.n_step_targets(steps.reward, steps.terminated, steps.last,
                                    n=config.n_step, gamma=config.gamma)
    positions = targets.rewards.shape[1]                    # P
    take = lambda q, index: jnp.take_along_axis(q, index[..., None],
                                                axis=-1)[..., 0]
    next_actions = jnp.argmax(
        jnp.take_along_axis(q_values, targets.next_index[..., None], axis=1),
        axis=-1)
    next_q = take(jnp.take_along_axis(target_q, targets.next_index[..., None],
                                      axis=1), next_actions)
    target = jax.lax.stop_gradient(targets.rewards
                                   + targets.discounts * next_q)
    q_taken = take(q_values[:, :positions], steps.action[:, :positions])
    td_error = jnp.where(targets.valid, q_taken - target, 0.0)   # [S, P]
    loss = (jnp.sum(sample.weights[:, None] * 0.5 * td_error ** 2)
            / jnp.maximum(jnp.sum(targets.valid), 1))
    return loss, (td_error, targets.valid)

  learn = common.td_learner(
      buffer, optimizer, td_loss, config.batch_size,
      priorities=lambda aux: jaxbuf.r2d2_priorities(*aux, eta=config.eta))

  def step(state: RunnerState
           ) -> tuple[RunnerState, common.QLearningMetrics]:
    key, explore_key, action_key, env_key, learn_key = jax.random.split(
        state.key, 5)
    next_hidden, q_values = network.apply(state.params, state.hidden,
                                          state.obs)
    actions = common.epsilon_greedy(explore_key, action_key, q_values,
                                    epsilon_schedule(state.iteration))
    full_obs, env_state, rewards, terminated, truncated, info = envs.step(
        env_key, state.env_state, actions)
    rewards = rewards.astype(jnp.float32)
    episode_ended = terminated | truncated
    no = jnp.zeros(config.num_envs, bool)
    buffer_state = buffer.add(state.buffer_state, Step(
        obs=state.obs, action=actions, reward=rewards, terminated=terminated,
        last=no, hidden=state.hidden), final_steps=Step(
            obs=observe(info["final_observation"]),
            action=jnp.zeros_like(actions), reward=jnp.zeros_like(rewards),
            terminated=no, last=episode_ended, hidden=next_hidden))
    episode_returns = state.episode_returns + rewards
    state = state.replace(
        buffer_state=buffer_state, env_state=env_state,
        obs=observe(full_obs),
        hidden=jnp.where(episode_ended[:, None], 0.0, next_hidden),
        episode_returns=jnp.where(episode_ended, 0.0, episode_returns),
        iteration=state.iteration + 1, key=key)

    should_learn = (buffer.can_sample(buffer_state, config.batch_size)
                    & (state.iteration >= learning_starts))
    state, loss = common.learn_when(should_learn, learn, state, learn_key,
                                    target_period=target_period)
    return state, common.episode_metrics(episode_ended, episode_returns,
                                         loss)

  return common.Trainer(init=init, step=step)


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `common.train_in_chunks`'s dict."""
  return common.train_in_chunks(
      make_trainer(config),
      num_iterations=config.total_steps // config.num_envs,
      env_steps_per_iteration=config.num_envs, num_chunks=config.num_chunks,
      num_seeds=config.num_seeds, seed=config.seed,
      description=f"R2D2-style ({config.network}), velocities hidden",
      show_progress=show_progress)


def main(argv: list[str] | None = None) -> None:
  common.main(argv, config_type=Config, train=train,
              description=__doc__.split("\n")[0],
              plot_title=lambda config: (f"{config.network} Q-network, "
                                         "CartPole-v1 without velocities"),
              plot_color="tab:purple")


if __name__ == "__main__":
  main()
