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
import pathlib
import sys
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

if __package__ in (None, ""):
  # Run as a script: the checkout goes first on the path before `import
  # jaxbuf`, as in examples/dqn.py (from the folder holding a clone named
  # jaxbuf, the clone would import as an empty namespace package).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
from examples import common  # noqa: E402
from examples.dqn import QNetwork  # noqa: E402

PyTree = Any
OBSERVED = (0, 2)  # cart position and pole angle: the velocities are hidden
VELOCITY_SCALE = 50.0  # 1 / tau, gymnax CartPole's 0.02 s time step


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""
  env_name: str = "CartPole-v1"
  time_limit: int = 0                 # episode step limit; 0 keeps the env's own
  replay: str = "uniform"             # "uniform" or "prioritized"
  num_stack: int = 4
  pad: str = "first"                  # "first" or "zeros"
  n_step: int = 3
  total_steps: int = 500_000          # env steps per seed
  num_seeds: int = 1
  seed: int = 0
  num_envs: int = 10
  buffer_size: int = 10_000           # stream steps over all envs
  batch_size: int = 128
  learning_starts: int = 10_000
  learning_rate: float = 1.25e-4
  gamma: float = 0.99
  target_update_interval: int = 500
  epsilon_start: float = 1.0
  epsilon_end: float = 0.05
  epsilon_fraction: float = 0.5
  alpha: float = 0.6
  beta_start: float = 0.4
  priority_eps: float = 1e-6
  max_grad_norm: float = 10.0
  hidden_size: int = 120
  num_chunks: int = 50


class Step(NamedTuple):
  """One stream step: a single observation, never a stack."""
  obs: jax.Array         # [2], float32: position and angle
  action: jax.Array      # (), int32: taken at obs
  reward: jax.Array      # (), float32: the reward that followed
  terminated: jax.Array  # (), bool: that action truly ended the episode


@flax.struct.dataclass
class RunnerState:
  params: PyTree
  target_params: PyTree
  opt_state: PyTree
  buffer_state: PyTree
  env_state: PyTree            # gymnax state, leaves [N, ...]
  stack: jax.Array             # [N, 2, F]: the actor's stacks, oldest first
  episode_returns: jax.Array   # [N], float32
  iteration: jax.Array         # shape=(), int32
  key: jax.Array


def observe(full_obs: jax.Array) -> jax.Array:
  return full_obs[..., jnp.array(OBSERVED)]


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
  return jnp.concatenate([stack.reshape(stack.shape[:-2] + (-1,)),
                          differences.reshape(stack.shape[:-2] + (-1,))],
                         axis=-1)


def make_buffer(config: Config) -> jaxbuf.Buffer:
  settings = dict(n_step=config.n_step, gamma=config.gamma, pad=config.pad)
  if config.replay == "uniform":
    return jaxbuf.frame_stack_replay(config.num_envs, config.buffer_size,
                                     config.num_stack, **settings)
  if config.replay == "prioritized":
    num_iterations = config.total_steps // config.num_envs
    num_updates = max(num_iterations
                      - config.learning_starts // config.num_envs, 1)
    return jaxbuf.prioritized_frame_stack_replay(
        config.num_envs, config.buffer_size, config.num_stack, **settings,
        alpha=config.alpha, eps=config.priority_eps,
        beta=optax.linear_schedule(config.beta_start, 1.0, num_updates))
  raise ValueError(f"--replay must be uniform or prioritized, given "
                   f"{config.replay!r}.")


def make_trainer(config: Config) -> common.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`."""
  envs = common.make_vector_env(config.env_name, config.time_limit,
                                config.num_envs)
  network = QNetwork(envs.num_actions, config.hidden_size)
  num_iterations = config.total_steps // config.num_envs
  epsilon_schedule = optax.linear_schedule(
      config.epsilon_start, config.epsilon_end,
      transition_steps=int(config.epsilon_fraction * num_iterations))
  buffer = make_buffer(config)
  # The learning rate decays linearly to 0: at a constant one, a seed that
  # had reached 480 fell back to 260 in the last 5% of training.
  num_updates = max(num_iterations - config.learning_starts // config.num_envs,
                    1)
  optimizer = optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adam(optax.linear_schedule(config.learning_rate, 0.0,
                                       num_updates)))
  target_period = max(config.target_update_interval // config.num_envs, 1)
  learning_starts = config.learning_starts // config.num_envs

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    stack = new_stacks(observe(obs), config.num_stack)
    params = network.init(network_key, flat(stack[0]))
    example = Step(obs=observe(obs[0]), action=jnp.int32(0),
                   reward=jnp.float32(0), terminated=jnp.bool_(False))
    return RunnerState(
        params=params, target_params=params, opt_state=optimizer.init(params),
        buffer_state=buffer.init(example), env_state=env_state, stack=stack,
        episode_returns=jnp.zeros(config.num_envs, jnp.float32),
        iteration=jnp.zeros((), jnp.int32), key=key)

  def td_loss(params, target_params, sample: jaxbuf.ReplaySample):
    batch = sample.items                                   # FrameStackTransition
    obs, next_obs = flat(batch.obs), flat(batch.next_obs)  # [S, 2F]
    q_values = network.apply(params, obs)                  # [S, A]
    q_taken = jnp.take_along_axis(q_values, batch.action[:, None],
                                  axis=-1)[:, 0]
    next_actions = network.apply(params, next_obs).argmax(axis=-1)
    next_q = jnp.take_along_axis(network.apply(target_params, next_obs),
                                 next_actions[:, None], axis=-1)[:, 0]
    target = jax.lax.stop_gradient(batch.reward + batch.discount * next_q)
    td_error = q_taken - target
    loss = jnp.mean(sample.weights * 0.5 * td_error ** 2)
    return loss, td_error

  learn = common.td_learner(buffer, optimizer, td_loss, config.batch_size)

  def step(state: RunnerState
           ) -> tuple[RunnerState, common.QLearningMetrics]:
    key, explore_key, action_key, env_key, learn_key = jax.random.split(
        state.key, 5)
    actions = common.epsilon_greedy(
        explore_key, action_key,
        network.apply(state.params, flat(state.stack)),
        epsilon_schedule(state.iteration))
    next_obs, env_state, rewards, terminated, truncated, info = envs.step(
        env_key, state.env_state, actions)
    rewards = rewards.astype(jnp.float32)
    episode_ended = terminated | truncated
    no = jnp.zeros(config.num_envs, bool)
    buffer_state = buffer.add(state.buffer_state, Step(
        obs=state.stack[..., -1], action=actions, reward=rewards,
        terminated=terminated))
    # The final observation, once, as its own step of the envs that ended.
    buffer_state = buffer.add(buffer_state, Step(
        obs=observe(info["final_observation"]), action=jnp.zeros_like(actions),
        reward=jnp.zeros_like(rewards), terminated=no),
        mask=episode_ended, episode_end=~no)
    observed = observe(next_obs)
    stack = jnp.where(episode_ended[:, None, None],
                      new_stacks(observed, config.num_stack),
                      pushed(state.stack, observed))
    episode_returns = state.episode_returns + rewards
    state = state.replace(
        buffer_state=buffer_state, env_state=env_state, stack=stack,
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
      description=(f"{config.n_step}-step DQN, {config.num_stack} stacked "
                   f"frames, velocities hidden"),
      show_progress=show_progress)


def main(argv: list[str] | None = None) -> None:
  common.main(argv, config_type=Config, train=train,
              description=__doc__.split("\n")[0],
              plot_title=lambda config: (
                  f"DQN, {config.num_stack} stacked frames, CartPole-v1 "
                  f"without velocities"),
              plot_color="tab:orange")


if __name__ == "__main__":
  main()
