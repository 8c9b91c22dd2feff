"""DQN + hindsight experience replay on bit flipping, one jitted program.

Shape key: K seeds, N envs, S sample size, B bits (the goal shape), A = B
actions.

Bit flipping (Andrychowicz et al. 2017, section 3.1): the state is B bits,
action i flips bit i, the goal is B random bits, the reward is -1 until the
state equals the goal (then 0 and the episode terminates), and an episode
lasts at most B steps. A random policy reaches a 40-bit goal with
probability about 2**-40, so DQN alone never sees a reward; with HER each
transition is also replayed with goals the agent did reach
(`jaxbuf.hindsight_replay`, strategy "future").

The env is pure JAX, written here; the observation is the GoalEnv dict
(`observation`, `achieved_goal`, `desired_goal`). Each env's stream follows
`transitions.py`: one step per env step, then the final observation of the
envs whose episode ended, as its own step flagged `episode_end`. The
Q-network reads the observation and the (maybe relabelled) desired goal.

Of the N envs, the first `greedy_envs` act greedily; their episodes' success
rate is the number printed (as "final mean return", the last 10% of
training), the others explore with epsilon-greedy actions.

  python examples/her_bitflip.py                       # 40 bits, 4 seeds
  python examples/her_bitflip.py --relabel-fraction 0  # DQN alone: fails

`episode_statistics` at the end samples whole episodes from
`jaxbuf.episode_replay` and computes their success and length statistics.
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


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""
  num_bits: int = 40
  relabel_fraction: float = 0.8       # 0: plain DQN on the same loop
  strategy: str = "future"
  total_steps: int = 320_000          # env steps per seed
  num_seeds: int = 4
  seed: int = 0
  num_envs: int = 16
  greedy_envs: int = 4                # envs acting greedily: the success rate
  buffer_size: int = 160_000          # stream steps over all envs
  batch_size: int = 128
  learning_starts: int = 1_000
  learning_rate: float = 1e-3
  gamma: float = 0.98
  target_update_interval: int = 800   # env steps
  epsilon: float = 0.2
  max_grad_norm: float = 10.0
  hidden_size: int = 256
  num_chunks: int = 20


class Step(NamedTuple):
  """One stream step; at a final-observation step only `obs` is meaningful."""
  obs: dict            # "observation", "achieved_goal", "desired_goal": [B]
  action: jax.Array    # (), int32: the bit flipped at obs
  reward: jax.Array    # (), float32: the reward that followed
  terminated: jax.Array  # (), bool: that action reached the goal


@flax.struct.dataclass
class RunnerState:
  params: PyTree
  target_params: PyTree
  opt_state: PyTree
  buffer_state: PyTree
  bits: jax.Array             # [N, B] float32: each env's state
  goals: jax.Array            # [N, B] float32
  episode_steps: jax.Array    # [N] int32
  iteration: jax.Array        # shape=(), int32
  key: jax.Array


def goal_reward(achieved_goal: jax.Array, desired_goal: jax.Array) -> jax.Array:
  """0 where the goal `[..., B]` is reached, else -1: float32 `[...]`."""
  return -jnp.any(achieved_goal != desired_goal, axis=-1).astype(jnp.float32)


def goal_reached(achieved_goal: jax.Array, desired_goal: jax.Array) -> jax.Array:
  return jnp.all(achieved_goal == desired_goal, axis=-1)


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return jax.random.bernoulli(key, 0.5, shape).astype(jnp.float32)


def goal_obs(bits: jax.Array, goals: jax.Array) -> dict:
  return {"observation": bits, "achieved_goal": bits, "desired_goal": goals}


def q_input(obs: dict) -> jax.Array:
  return jnp.concatenate([obs["observation"], obs["desired_goal"]], axis=-1)


def make_trainer(config: Config) -> common.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`."""
  num_envs, num_bits = config.num_envs, config.num_bits
  network = QNetwork(num_bits, config.hidden_size)
  buffer = jaxbuf.hindsight_replay(
      num_envs, config.buffer_size, goal_reward, strategy=config.strategy,
      relabel_fraction=config.relabel_fraction, terminated_fn=goal_reached)
  optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                          optax.adam(config.learning_rate))
  target_period = max(config.target_update_interval // num_envs, 1)
  learning_starts = config.learning_starts // num_envs
  greedy = jnp.arange(num_envs) < config.greedy_envs

  def init(key: jax.Array) -> RunnerState:
    key, network_key, bits_key, goals_key = jax.random.split(key, 4)
    bits = random_bits(bits_key, (num_envs, num_bits))
    goals = random_bits(goals_key, (num_envs, num_bits))
    params = network.init(network_key, q_input(goal_obs(bits, goals))[0])
    example = Step(obs=goal_obs(bits[0], goals[0]), action=jnp.int32(0),
                   reward=jnp.float32(0), terminated=jnp.bool_(False))
    return RunnerState(
        params=params, target_params=params, opt_state=optimizer.init(params),
        buffer_state=buffer.init(example), bits=bits, goals=goals,
        episode_steps=jnp.zeros(num_envs, jnp.int32),
        iteration=jnp.zeros((), jnp.int32), key=key)

  def td_loss(params, target_params, sample: jaxbuf.HindsightSample):
    batch = sample.items
    q_values = network.apply(params, q_input(batch.obs))           # [S, A]
    q_taken = jnp.take_along_axis(q_values, batch.action[:, None],
                                  axis=-1)[:, 0]
    next_q = network.apply(target_params, q_input(batch.next_obs)).max(-1)
    target = batch.reward + config.gamma * batch.discount * next_q
    # Returns lie in [-1 / (1 - gamma), 0] (the HER paper clips likewise).
    target = jax.lax.stop_gradient(
        jnp.clip(target, -1.0 / (1.0 - config.gamma), 0.0))
    td_error = q_taken - target
    return jnp.mean(optax.huber_loss(td_error)), td_error

  learn = common.td_learner(buffer, optimizer, td_loss, config.batch_size)

  def step(state: RunnerState
           ) -> tuple[RunnerState, common.QLearningMetrics]:
    key, explore_key, action_key, reset_key, learn_key = jax.random.split(
        state.key, 5)
    obs = goal_obs(state.bits, state.goals)
    actions = common.epsilon_greedy(
        explore_key, action_key, network.apply(state.params, q_input(obs)),
        jnp.where(greedy, 0.0, config.epsilon))
    next_bits = jnp.where(
        jax.nn.one_hot(actions, num_bits, dtype=bool), 1.0 - state.bits,
        state.bits)
    terminated = goal_reached(next_bits, state.goals)
    rewards = goal_reward(next_bits, state.goals)
    episode_steps = state.episode_steps + 1
    ended = terminated | (episode_steps >= num_bits)
    buffer_state = buffer.add(state.buffer_state, Step(
        obs=obs, action=actions, reward=rewards, terminated=terminated))
    # The final observation, once, as its own step of the envs that ended.
    buffer_state = buffer.add(buffer_state, Step(
        obs=goal_obs(next_bits, state.goals), action=jnp.zeros_like(actions),
        reward=jnp.zeros_like(rewards), terminated=jnp.zeros_like(terminated)),
        mask=ended, episode_end=jnp.ones(num_envs, bool))
    bits_key, goals_key = jax.random.split(reset_key)
    reset = ended[:, None]
    state = state.replace(
        buffer_state=buffer_state,
        bits=jnp.where(reset, random_bits(bits_key, next_bits.shape),
                       next_bits),
        goals=jnp.where(reset, random_bits(goals_key, next_bits.shape),
                        state.goals),
        episode_steps=jnp.where(ended, 0, episode_steps),
        iteration=state.iteration + 1, key=key)
    should_learn = (buffer.can_sample(buffer_state, config.batch_size)
                    & (state.iteration >= learning_starts))
    state, loss = common.learn_when(should_learn, learn, state, learn_key,
                                    target_period=target_period)
    # The greedy envs' successes, as "returns" of 0 or 1 per episode.
    return state, common.episode_metrics(ended & greedy,
                                         terminated.astype(jnp.float32), loss)

  return common.Trainer(init=init, step=step)


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `common.train_in_chunks`'s dict,
  whose returns are the greedy envs' successes (0 or 1 per episode)."""
  return common.train_in_chunks(
      make_trainer(config),
      num_iterations=config.total_steps // config.num_envs,
      env_steps_per_iteration=config.num_envs, num_chunks=config.num_chunks,
      num_seeds=config.num_seeds, seed=config.seed,
      description=(f"DQN + HER ({config.strategy}, relabel "
                   f"{config.relabel_fraction}), {config.num_bits} bits"),
      show_progress=show_progress)


class EpisodeStatistics(NamedTuple):
  """Per-episode statistics of a sample of whole episodes."""
  success_rate: jax.Array   # (), float32: episodes that reached their goal
  mean_length: jax.Array    # (), float32: steps per episode
  mean_return: jax.Array    # (), float32: undiscounted return


def episode_statistics(num_bits: int, num_episodes: int, key: jax.Array, *,
                       batch_size: int = 64) -> EpisodeStatistics:
  """Runs a random policy on `num_bits` bits, keeps the episodes in
  `jaxbuf.episode_replay` and computes statistics over a sample of them.

  Whole episodes come back padded to `num_bits + 1` steps (the actions and
  the final observation), with `mask` and `lengths`; the return is the
  masked sum of the rewards, excluding the final-observation step.
  """
  num_envs = 4
  max_length = num_bits + 1
  buffer = jaxbuf.episode_replay(num_envs, num_envs * max_length * 8,
                                 max_length)
  zeros = jnp.zeros(num_bits, jnp.float32)
  example = Step(obs=goal_obs(zeros, zeros),
                 action=jnp.int32(0), reward=jnp.float32(0),
                 terminated=jnp.bool_(False))

  def run(key):
    state = buffer.init(example)

    def env_step(carry, key):
      state, bits, goals, steps = carry
      action_key, bits_key, goals_key = jax.random.split(key, 3)
      actions = jax.random.randint(action_key, (num_envs,), 0, num_bits,
                                   jnp.int32)
      next_bits = jnp.where(jax.nn.one_hot(actions, num_bits, dtype=bool),
                            1.0 - bits, bits)
      terminated = goal_reached(next_bits, goals)
      ended = terminated | (steps + 1 >= num_bits)
      state = buffer.add(state, Step(goal_obs(bits, goals), actions,
                                     goal_reward(next_bits, goals), terminated))
      state = buffer.add(state, Step(
          goal_obs(next_bits, goals), jnp.zeros_like(actions),
          jnp.zeros(num_envs, jnp.float32), jnp.zeros(num_envs, bool)),
                         mask=ended, episode_end=jnp.ones(num_envs, bool))
      reset = ended[:, None]
      bits = jnp.where(reset, random_bits(bits_key, bits.shape), next_bits)
      goals = jnp.where(reset, random_bits(goals_key, goals.shape), goals)
      return (state, bits, goals, jnp.where(ended, 0, steps + 1)), None

    start_key, steps_key, sample_key = jax.random.split(key, 3)
    bits = random_bits(start_key, (2, num_envs, num_bits))
    carry = (state, bits[0], bits[1], jnp.zeros(num_envs, jnp.int32))
    (state, *_), _ = jax.lax.scan(
        env_step, carry, jax.random.split(steps_key, num_episodes * num_bits
                                          // num_envs))
    sample = buffer.sample(state, sample_key, batch_size)
    episodes = sample.items
    # The last step of a piece holds the final observation (padding reward).
    transition = sample.mask & (jnp.arange(max_length)[None, :]
                                < sample.lengths[:, None] - 1)
    returns = jnp.sum(jnp.where(transition, episodes.reward, 0.0), axis=1)
    success = jnp.any(episodes.terminated & transition, axis=1)
    return EpisodeStatistics(
        success_rate=jnp.mean(success.astype(jnp.float32)),
        mean_length=jnp.mean((sample.lengths - 1).astype(jnp.float32)),
        mean_return=jnp.mean(returns))

  return jax.jit(run)(key)


def main(argv: list[str] | None = None) -> None:
  def report(config: Config) -> dict[str, Any]:
    result = train(config)
    print("success rate per seed (greedy envs, last 10%): "
          + " ".join(f"{r:.3f}" for r in result["final_returns"]))
    statistics = episode_statistics(min(config.num_bits, 8), 64,
                                    jax.random.key(config.seed))
    print(f"random policy on {min(config.num_bits, 8)} bits, episodes from "
          f"episode_replay: success {float(statistics.success_rate):.2f}, "
          f"mean length {float(statistics.mean_length):.1f}, mean return "
          f"{float(statistics.mean_return):.1f}")
    return result

  common.main(argv, config_type=Config, train=report,
              description=__doc__.split("\n")[0],
              plot_title=lambda config: (
                  f"DQN + HER, {config.num_bits}-bit flipping "
                  f"(relabel {config.relabel_fraction})"),
              plot_color="tab:purple")


if __name__ == "__main__":
  main()
