"""Frame-stacked n-step DQN on CartPole with its velocities hidden, one program.

Shape key: K seeds, N envs, S sample size, F num_stack, A actions.

The agent sees the cart position and the pole angle only (a POMDP: one
observation cannot tell which way the pole is falling). As in the Atari DQN
family, it acts on a stack of the last F observations, and the replay buffer
(`jaxbuf.frame_stack_replay`) stores each observation once in each env's
stream and builds the stacks of `obs` and `next_obs` at sample time;
observations before an episode's first step are that first observation
repeated (`pad="first"`, gymnasium's FrameStack after reset), never ones
of the previous episode. The actor keeps the same stack for the envs it
steps, padded the same way, so the network sees the same inputs acting and
learning.

Truncation: when an episode ends, the stream gets one extra step holding
gymnax's `info["final_observation"]`, flagged with `episode_end` (its action
and reward are padding); a transition stops there and bootstraps from the
true final observation's stack. A termination stops it with discount 0.

  python examples/frame_stack_dqn.py --num-seeds 4                # F = 4
  python examples/frame_stack_dqn.py --num-seeds 4 --num-stack 1  # no stack
  python examples/frame_stack_dqn.py --replay prioritized
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

import jax
import jax.numpy as jnp

import jaxbuf

from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402

VELOCITY_SCALE = 50.0  # 1 / tau, gymnax CartPole's 0.02 s time step


@dataclasses.dataclass(frozen=True)
class Config(q_learning.ReplayConfig, q_learning.QLearningConfig, training.GymnaxConfig):
  """Hyperparameters; each field is also a command-line flag (the shared
  ones in examples/training.py and examples/q_learning.py)."""

  num_stack: int = 4
  pad: str = "first"  # "first" or "zeros"
  n_step: int = 3
  buffer_size: int = 10_000  # stream steps over all envs
  learning_rate: float = 1.25e-4
  # At a constant learning rate, a seed that had reached 480 fell back to
  # 260 in the last 5% of training.
  learning_rate_end: float = 0.0


class Step(NamedTuple):
  """One stream step: a single observation, never a stack."""

  obs: jax.Array  # [2], float32: position and angle
  action: jax.Array  # (), int32: taken at obs
  reward: jax.Array  # (), float32: the reward that followed
  terminated: jax.Array  # (), bool: that action truly ended the episode


def new_stacks(obs: jax.Array, num_stack: int) -> jax.Array:
  """`[N, 2] -> [N, 2, F]`: an episode's first observation, repeated."""
  return jnp.repeat(obs[..., None], num_stack, axis=-1)


def pushed(stack: jax.Array, obs: jax.Array) -> jax.Array:
  """The stack with `obs [N, 2]` as its newest frame."""
  return jnp.concatenate([stack[..., 1:], obs[..., None]], axis=-1)


def flat(stack: jax.Array) -> jax.Array:
  """`[..., 2, F] -> [..., 4F - 2]`, the network's input: the frames and the
  differences of consecutive ones, scaled to velocities.

  The differences are a fixed linear map of the stack (they add no
  information, and none with F = 1); they spare the small MLP learning
  weights of 1 / tau from steps of about 0.01.
  """
  differences = jnp.diff(stack, axis=-1) * VELOCITY_SCALE
  return jnp.concatenate(
    [stack.reshape(stack.shape[:-2] + (-1,)), differences.reshape(stack.shape[:-2] + (-1,))],
    axis=-1,
  )


def make_trainer(config: Config) -> training.Trainer:
  """Builds `init(key) -> state` and `step(state) -> (state, metrics)`; the
  state's `obs` `[N, 2, F]` holds the actor's stacks, oldest frame first."""
  envs = training.make_vector_env(
    config.env_name, config.time_limit, config.num_envs, observe=training.position_and_angle
  )
  network = q_learning.QNetwork(envs.num_actions, config.hidden_size)
  stream = dict(
    num_envs=config.num_envs,
    capacity=config.buffer_size,
    num_stack=config.num_stack,
    n_step=config.n_step,
    gamma=config.gamma,
    pad=config.pad,
  )
  buffer = q_learning.replay_buffer(
    config,
    functools.partial(jaxbuf.frame_stack_replay, **stream),
    functools.partial(jaxbuf.prioritized_frame_stack_replay, **stream),
  )
  optimizer = q_learning.make_optimizer(config)

  def init(key: jax.Array) -> q_learning.EnvLearnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    stack = new_stacks(obs, config.num_stack)
    example = Step(
      obs=obs[0], action=jnp.int32(0), reward=jnp.float32(0), terminated=jnp.bool_(False)
    )
    return q_learning.EnvLearnerState.start(
      key,
      network.init(network_key, flat(stack[0])),
      optimizer,
      buffer.init(example),
      env_state=env_state,
      obs=stack,
      episode_returns=jnp.zeros(config.num_envs, jnp.float32),
    )

  def td_loss(params, target_params, sample: jaxbuf.ReplaySample):
    batch = sample.items  # FrameStackTransition
    obs, next_obs = flat(batch.obs), flat(batch.next_obs)  # [S, 4F - 2]
    q_taken = q_learning.q_of(network.apply(params, obs), batch.action)
    next_q = q_learning.double_q(
      network.apply(params, next_obs), network.apply(target_params, next_obs)
    )
    target = jax.lax.stop_gradient(batch.reward + batch.discount * next_q)
    td_error = q_taken - target
    loss = jnp.mean(sample.weights * 0.5 * td_error**2)
    return loss, td_error

  def collect(state, actions, env_key):
    step = envs.step(env_key, state.env_state, actions)
    buffer_state = buffer.add(
      state.buffer_state,
      Step(obs=state.obs[..., -1], action=actions, reward=step.reward, terminated=step.terminated),
    )
    # The final observation, once, as its own step of the envs that ended.
    buffer_state = buffer.add(
      buffer_state,
      Step(
        obs=step.final_obs,
        action=jnp.zeros_like(actions),
        reward=jnp.zeros_like(step.reward),
        terminated=jnp.zeros_like(step.terminated),
      ),
      mask=step.ended,
      episode_end=jnp.ones_like(step.ended),
    )
    stack = jnp.where(
      step.ended[:, None, None], new_stacks(step.obs, config.num_stack), pushed(state.obs, step.obs)
    )
    return state.stepped(buffer_state, step, obs=stack)

  return q_learning.make_trainer(
    config,
    buffer=buffer,
    optimizer=optimizer,
    td_loss=td_loss,
    init=init,
    q_values=lambda params, state: network.apply(params, flat(state.obs)),
    collect=collect,
    title=(
      f"{config.n_step}-step DQN, {config.num_stack} stacked frames, CartPole-v1 without velocities"
    ),
  )


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `training.train`'s dict, an
  iteration per vectorized env step of the stacking agent."""
  return training.train(make_trainer(config), config, show_progress)


def main(argv: list[str] | None = None) -> None:
  training.main(argv, Config, train, __doc__.split("\n")[0])


if __name__ == "__main__":
  main()
