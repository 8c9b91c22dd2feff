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
carried through unchanged), the baseline on the same masked task;
`--replay uniform` draws windows uniformly (`jaxbuf.sequence_replay`).

  python examples/r2d2.py --num-seeds 4 --plot r2d2.png
  python examples/r2d2.py --network mlp --num-seeds 4
"""

import dataclasses
import functools
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxbuf

from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config(q_learning.ReplayConfig, q_learning.QLearningConfig, training.GymnaxConfig):
  """Hyperparameters; each field is also a command-line flag (the shared
  ones in examples/training.py and examples/q_learning.py)."""

  network: str = "gru"  # "gru" or "mlp" (the baseline)
  replay: str = "prioritized"  # or "uniform"
  buffer_size: int = 20_000  # stream steps over all envs
  sequence_length: int = 20  # L
  period: int = 10  # windows overlap by L - period steps
  burn_in: int = 5  # B
  n_step: int = 3
  batch_size: int = 32  # S windows: S * P trained positions
  learning_rate: float = 1e-3
  target_update_interval: int = 1_000
  eta: float = 0.9
  hidden_size: int = 64


class Step(NamedTuple):
  """One stream step; at a `last` step only obs and hidden are meaningful."""

  obs: jax.Array  # [2], float32: position and angle only
  action: jax.Array  # (), int32
  reward: jax.Array  # (), float32
  terminated: jax.Array  # (), bool
  last: jax.Array  # (), bool: obs is an episode's final observation
  hidden: jax.Array  # [H], float32: the state fed to the network at obs


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


class RunnerState(q_learning.EnvLearnerState):
  hidden: jax.Array  # [N, H]: zero at each episode's first step


def make_trainer(config: Config) -> training.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`."""
  if config.network not in ("gru", "mlp"):
    raise ValueError(f"--network must be gru or mlp, given {config.network!r}.")
  envs = training.make_vector_env(
    config.env_name, config.time_limit, config.num_envs, observe=training.position_and_angle
  )
  network = QNetwork(envs.num_actions, config.hidden_size, recurrent=config.network == "gru")
  stream = (config.num_envs, config.buffer_size, config.sequence_length)
  buffer = q_learning.replay_buffer(
    config,
    functools.partial(jaxbuf.sequence_replay, *stream, period=config.period),
    functools.partial(jaxbuf.prioritized_sequence_replay, *stream, period=config.period),
  )
  optimizer = q_learning.make_optimizer(config)

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    hidden = jnp.zeros((config.num_envs, config.hidden_size), jnp.float32)
    example = Step(
      obs=obs[0],
      action=jnp.int32(0),
      reward=jnp.float32(0),
      terminated=jnp.bool_(False),
      last=jnp.bool_(False),
      hidden=hidden[0],
    )
    return RunnerState.start(
      key,
      network.init(network_key, hidden[0], obs[0]),
      optimizer,
      buffer.init(example),
      env_state=env_state,
      obs=obs,
      hidden=hidden,
      episode_returns=jnp.zeros(config.num_envs, jnp.float32),
    )

  def unroll(params, hidden, steps):
    """Q-values `[S, T, A]` and the final hidden state from `hidden [S, H]`."""

    def one_step(hidden, inputs):
      obs, reset = inputs
      hidden = jnp.where(reset[:, None], 0.0, hidden)
      return network.apply(params, hidden, obs)

    hidden, q_values = jax.lax.scan(
      one_step, hidden, (jnp.swapaxes(steps["obs"], 0, 1), jnp.swapaxes(steps["reset"], 0, 1))
    )
    return jnp.swapaxes(q_values, 0, 1), hidden

  def td_loss(params, target_params, sample):
    window = sample.items  # [S, L, ...]
    # The step after a final observation starts a new episode: zero state.
    reset = jnp.concatenate([jnp.zeros_like(window.last[:, :1]), window.last[:, :-1]], axis=1)
    inputs = {"obs": window.obs, "reset": reset}
    burn, trained = jaxbuf.burn_in_split(inputs, config.burn_in)
    _, hidden = unroll(params, window.hidden[:, 0], burn)
    q_values, _ = unroll(params, jax.lax.stop_gradient(hidden), trained)
    target_q, _ = unroll(target_params, window.hidden[:, 0], inputs)
    target_q = target_q[:, config.burn_in :]  # [S, L - B, A]
    _, steps = jaxbuf.burn_in_split(window, config.burn_in)
    targets = jaxbuf.n_step_targets(
      steps.reward, steps.terminated, steps.last, n=config.n_step, gamma=config.gamma
    )
    positions = targets.rewards.shape[1]  # P
    at_next = lambda q: jnp.take_along_axis(q, targets.next_index[..., None], axis=1)  # [S, P, A]
    next_q = q_learning.double_q(at_next(q_values), at_next(target_q))
    target = jax.lax.stop_gradient(targets.rewards + targets.discounts * next_q)
    q_taken = q_learning.q_of(q_values[:, :positions], steps.action[:, :positions])
    td_error = jnp.where(targets.valid, q_taken - target, 0.0)  # [S, P]
    loss = jnp.sum(sample.weights[:, None] * 0.5 * td_error**2) / jnp.maximum(
      jnp.sum(targets.valid), 1
    )
    return loss, (td_error, targets.valid)

  def act(params, state):
    return network.apply(params, state.hidden, state.obs)

  def collect(state, actions, env_key):
    # The state the network moved to acting (the same call as `act`'s).
    next_hidden, _ = act(state.params, state)
    step = envs.step(env_key, state.env_state, actions)
    no = jnp.zeros(config.num_envs, bool)
    buffer_state = buffer.add(
      state.buffer_state,
      Step(
        obs=state.obs,
        action=actions,
        reward=step.reward,
        terminated=step.terminated,
        last=no,
        hidden=state.hidden,
      ),
      final_steps=Step(
        obs=step.final_obs,
        action=jnp.zeros_like(actions),
        reward=jnp.zeros_like(step.reward),
        terminated=no,
        last=step.ended,
        hidden=next_hidden,
      ),
    )
    return state.stepped(
      buffer_state, step, hidden=jnp.where(step.ended[:, None], 0.0, next_hidden)
    )

  return q_learning.make_trainer(
    config,
    buffer=buffer,
    optimizer=optimizer,
    td_loss=td_loss,
    init=init,
    q_values=lambda params, state: act(params, state)[1],
    collect=collect,
    title=f"{config.network} Q-network, CartPole-v1 without velocities",
    priorities=lambda aux: jaxbuf.r2d2_priorities(*aux, eta=config.eta),
  )


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `training.train`'s dict, an
  iteration per vectorized env step of the recurrent agent."""
  return training.train(make_trainer(config), config, show_progress)


def main(argv: list[str] | None = None) -> None:
  training.main(argv, Config, train, __doc__.split("\n")[0])


if __name__ == "__main__":
  main()
