"""DQN on a gymnasium vector env stepped from a Python loop, CleanRL-style.

Shape key: N envs, S sample size, A actions.

Most environments (MuJoCo, Atari, anything written in NumPy) step on the
host. This script trains a DQN on `gymnasium`'s CartPole-v1 (N = 4 envs,
CleanRL's network and hyperparameters) in two ways:

* The recipe (default): ONE jitted call per vectorized env step, with the
  loop state donated. It takes the host batch of N transitions (NumPy) and
  the new observations, and does `buffer.add`, the learner update when due
  (`buffer.sample`, the TD loss, optax, `buffer.update_priorities`, gated by
  `jaxbuf.cond_update`) and the next epsilon-greedy actions. The PRNG key
  lives in the loop state and is split inside the call, so Python never
  calls `jax.random` per step, and the only host sync is reading the
  actions back for `envs.step`.
* `--natural`: the loop a new user writes. `buffer.add` from NumPy,
  `buffer.sample(state, key, S, step=iteration)` (one key and the loop
  counter, folded inside the call: no `jax.random.split` from Python),
  a jitted learner, `buffer.update_priorities`.

  python examples/gymnasium_dqn.py                  # the recipe, 5e5 env steps
  python examples/gymnasium_dqn.py --natural        # plain calls
  python examples/gymnasium_dqn.py --replay prioritized
  python examples/gymnasium_dqn.py --plot gymnasium_dqn.png  # returns curve
  python examples/gymnasium_dqn.py --envpool        # envpool's C++ CartPole

Autoreset: `jaxbuf.VectorEnvRecorder` turns each env step into the add, in
either of gymnasium's autoreset modes, so no reset is stored as a
transition and `next_obs` is the true final observation where an episode
ended. The env here resets within the same step (`AutoresetMode.SAME_STEP`),
so every env step is a transition and the jitted step sees N of them each
time (with gymnasium's default, NEXT_STEP, the step after an episode end is
a reset the recorder leaves out). Only `terminated` stops the bootstrap:
CartPole-v1's 500-step time limit is bootstrapped.

The TD target is CleanRL's (the target network's max) with a squared error,
gradients clipped at norm 10; the network is examples/dqn.py's (120, 84).

`--envpool` steps envpool's CartPole-v1 (C++, `pip install jaxbuf[envpool]`)
instead of gymnasium's: the same dynamics, 500-step limit and gymnasium
API, in gymnasium's default NEXT_STEP autoreset mode, whose reset steps the
recorder leaves out (so the jitted step sees fewer than N transitions now
and then: one compilation per count).
"""

import dataclasses
import functools
import pathlib
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402
from examples.q_learning import QNetwork  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config(q_learning.ReplayConfig, q_learning.QLearningConfig):
  """Hyperparameters (CleanRL's dqn.py); each field is also a flag (the
  shared ones in examples/q_learning.py)."""

  env_id: str = "CartPole-v1"
  total_steps: int = 500_000  # env steps, all envs together
  num_envs: int = 4  # N
  seed: int = 0
  natural: bool = False  # plain add / sample / learner calls
  envpool: bool = False  # envpool's C++ envs (NEXT_STEP autoreset) instead of gymnasium's
  envpool_threads: int = 1  # threads of each envpool (1: fastest for a few CartPoles)
  train_frequency: int = 8  # env steps per learner update
  progress: bool = True  # the tqdm bar


class Agent(NamedTuple):
  """The pure parts both loops share, settings bound."""

  buffer: jaxbuf.Buffer
  network: QNetwork
  optimizer: optax.GradientTransformation
  example: jaxbuf.Transition  # one unbatched item, NumPy
  td_loss: Callable  # params, target, sample -> loss, td
  act: Callable  # params, obs [N, ...], key, iteration
  iterations: int  # vectorized env steps
  learning_starts: int  # iterations
  train_period: int  # iterations between updates
  target_period: int  # iterations between target copies


def make_envs(config: Config) -> gym.vector.VectorEnv:
  """N synchronous envs that reset an ended episode in the same step (or,
  `config.envpool`, envpool's N envs: a gymnasium VectorEnv that resets on
  the next step)."""
  if config.envpool:
    import envpool  # pylint: disable=import-outside-toplevel  (an optional extra)

    with warnings.catch_warnings():
      # envpool's spaces, made on first use (and kept): gymnasium warns that
      # their float64 bounds become float32.
      warnings.simplefilter("ignore", UserWarning)
      envs = envpool.make(
        config.env_id,
        env_type="gymnasium",
        num_envs=config.num_envs,
        seed=config.seed,  # envpool seeds at make, not at reset
        num_threads=config.envpool_threads,
      )
      _ = (envs.single_observation_space, envs.single_action_space)
      return envs
  return gym.make_vec(
    config.env_id,
    num_envs=config.num_envs,
    vectorization_mode="sync",
    vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
  )


def reset(envs: gym.vector.VectorEnv, config: Config, seed: int) -> Any:
  """`envs.reset(seed=seed)`'s observations (envpool: seeded by make_envs)."""
  obs, _ = envs.reset() if config.envpool else envs.reset(seed=seed)
  return obs


def make_agent(
  config: Config, envs: gym.vector.VectorEnv, buffer: jaxbuf.Buffer | None = None
) -> Agent:
  """The buffer (unless given), network, optimizer, loss and policy."""
  if buffer is None:
    buffer = q_learning.replay_buffer(
      config,
      functools.partial(jaxbuf.uniform_replay, config.buffer_size),
      functools.partial(jaxbuf.prioritized_replay, config.buffer_size),
    )
  network = QNetwork(int(envs.single_action_space.n), config.hidden_size)
  epsilon = q_learning.epsilon_schedule(config)

  def td_loss(params, target_params, sample: jaxbuf.ReplaySample):
    batch = sample.items
    q_taken = q_learning.q_of(network.apply(params, batch.obs), batch.action.astype(jnp.int32))
    next_q = network.apply(target_params, batch.next_obs).max(axis=-1)
    bootstrap = config.gamma * (1.0 - batch.terminated.astype(jnp.float32))
    target = jax.lax.stop_gradient(batch.reward + bootstrap * next_q)
    td_error = q_taken - target
    return jnp.mean(sample.weights * 0.5 * td_error**2), td_error

  def act(params, obs, key, iteration):
    explore_key, action_key = jax.random.split(key)
    return q_learning.epsilon_greedy(
      explore_key, action_key, network.apply(params, obs), epsilon(iteration)
    )

  return Agent(
    buffer=buffer,
    network=network,
    optimizer=q_learning.make_optimizer(config),
    example=jaxbuf.VectorEnvRecorder(envs, buffer).example,
    td_loss=td_loss,
    act=act,
    iterations=config.num_iterations,
    learning_starts=config.learning_starts_iterations,
    train_period=max(config.train_frequency // config.num_envs, 1),
    target_period=config.target_period,
  )


def make_recipe_step(config: Config, agent: Agent) -> tuple[Callable, Callable]:
  """`start(key, obs) -> (state, actions)` and the donated, jitted
  `step(state, recorded, obs) -> (state, actions [N])`."""
  learn = q_learning.td_learner(agent.buffer, agent.optimizer, agent.td_loss, config.batch_size)

  def start(key, obs):
    key, network_key, act_key = jax.random.split(key, 3)
    params = agent.network.init(network_key, obs[0])
    # The key lives in the state and is split inside the step.
    state = q_learning.LearnerState.start(
      key, params, agent.optimizer, agent.buffer.init(agent.example)
    )
    return state, agent.act(params, obs, act_key, state.iteration)

  def step(state: q_learning.LearnerState, recorded: jaxbuf.RecordedStep, obs):
    key, learn_key, act_key = jax.random.split(state.key, 3)
    state = state.replace(
      buffer_state=recorded.add_to(agent.buffer, state.buffer_state),
      iteration=state.iteration + 1,
      key=key,
    )
    should_learn = (
      agent.buffer.can_sample(state.buffer_state, config.batch_size)
      & (state.iteration >= agent.learning_starts)
      & (state.iteration % agent.train_period == 0)
    )
    state, _ = q_learning.learn_when(
      should_learn, learn, state, learn_key, target_period=agent.target_period
    )
    return state, agent.act(state.params, obs, act_key, state.iteration)

  return jax.jit(start), jax.jit(step, donate_argnums=0)


def train(config: Config, *, buffer: jaxbuf.Buffer | None = None) -> dict[str, Any]:
  """Trains one agent; returns "final_mean_return" (episodes ended in the
  last 10% of env steps), "steps_per_second" (compilation included),
  "env_steps" and "episode_returns" (a `training.EpisodeReturns`)."""
  envs = make_envs(config)
  agent = make_agent(config, envs, buffer)
  recorder = jaxbuf.VectorEnvRecorder(envs, agent.buffer)
  returns = training.EpisodeReturns(config.num_envs)
  obs = reset(envs, config, config.seed)
  recorder.reset(obs)
  key = jax.random.key(config.seed)
  action_dtype = envs.single_action_space.dtype
  progress = tqdm.tqdm(
    total=agent.iterations * config.num_envs,
    unit=" env steps",
    unit_scale=True,
    disable=not config.progress,
    desc="DQN " + ("natural" if config.natural else "recipe"),
  )
  loop = (natural_loop if config.natural else recipe_loop)(config, agent, key, obs)
  actions = next(loop)
  start = time.perf_counter()
  for iteration in range(agent.iterations):
    actions = np.asarray(actions).astype(action_dtype)
    next_obs, rewards, terminated, truncated, info = envs.step(actions)
    returns.record(iteration * config.num_envs, rewards, terminated | truncated)
    actions = loop.send(
      (recorder.record(actions, next_obs, rewards, terminated, truncated, info), next_obs)
    )
    if iteration % 500 == 499:
      recent = returns.mean_since((iteration - 5000) * config.num_envs)
      progress.update(500 * config.num_envs)
      progress.set_postfix(mean_return=f"{recent:.1f}")
  np.asarray(actions)
  seconds = time.perf_counter() - start
  progress.close()
  envs.close()
  env_steps = agent.iterations * config.num_envs
  return dict(
    final_mean_return=returns.mean_since(int(env_steps * 0.9)),
    steps_per_second=env_steps / seconds,
    env_steps=env_steps,
    episode_returns=returns,
  )


def recipe_loop(config: Config, agent: Agent, key: jax.Array, obs: np.ndarray):
  """A generator of actions [N]: the first for `obs`, then one for each
  `(recorded, obs)` sent: a `jaxbuf.RecordedStep` and the new
  observations after it."""
  start, step = make_recipe_step(config, agent)
  state, actions = start(key, obs)
  while True:
    recorded, obs = yield actions
    state, actions = step(state, recorded, obs)


def natural_loop(config: Config, agent: Agent, key: jax.Array, obs: np.ndarray):
  """As `recipe_loop`, with the plain calls: one jitted call per function.

  One key for acting and one for sampling serve every step: the step is
  folded into them inside the calls.
  """
  buffer = agent.buffer

  @jax.jit
  def act(params, obs, key, iteration):
    return agent.act(params, obs, jax.random.fold_in(key, iteration), iteration)

  @jax.jit
  def learn(params, target_params, opt_state, sample):
    (_, td_errors), grads = jax.value_and_grad(agent.td_loss, has_aux=True)(
      params, target_params, sample
    )
    updates, opt_state = agent.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.abs(td_errors)

  network_key, act_key, sample_key = jax.random.split(key, 3)
  params = target_params = agent.network.init(network_key, obs[0])
  opt_state = agent.optimizer.init(params)
  buffer_state = buffer.init(agent.example)
  iteration = 0
  while True:
    recorded, obs = yield act(params, obs, act_key, iteration)
    buffer_state = recorded.add_to(buffer, buffer_state)
    iteration += 1
    if iteration >= agent.learning_starts and iteration % agent.train_period == 0:
      sample = buffer.sample(buffer_state, sample_key, config.batch_size, step=iteration)
      params, opt_state, priorities = learn(params, target_params, opt_state, sample)
      buffer_state = buffer.update_priorities(
        buffer_state, sample.indices, priorities, sample.item_ids
      )
    if iteration % agent.target_period == 0:
      target_params = params


def main(argv: list[str] | None = None) -> None:
  config, plot = training.parse_config(Config, __doc__.split("\n")[0], argv)
  result = train(config)
  if plot:
    result["episode_returns"].plot(
      plot,
      f"DQN on gymnasium {config.env_id}, "
      f"{'natural calls' if config.natural else 'the recipe'} "
      f"({config.replay} replay)",
    )
  print(
    f"env steps per second: {result['steps_per_second']:,.0f} "
    f"({config.num_envs} envs, {result['env_steps']:,} env steps, "
    f"compilation included)"
  )
  print(f"final mean return: {result['final_mean_return']:.1f}")


if __name__ == "__main__":
  main()
