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
  python examples/her_bitflip.py --replay prioritized  # prioritized HER

`episode_statistics` at the end samples whole episodes from
`jaxbuf.episode_replay` and computes their success and length statistics.
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
import optax

import jaxbuf

from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config(q_learning.ReplayConfig, q_learning.QLearningConfig, training.RunConfig):
  """Hyperparameters; each field is also a command-line flag (the shared
  ones in examples/training.py and examples/q_learning.py)."""

  num_bits: int = 40
  relabel_fraction: float = 0.8  # 0: plain DQN on the same loop
  strategy: str = "future"
  total_steps: int = 320_000  # env steps per seed
  num_seeds: int = 4
  num_envs: int = 16
  greedy_envs: int = 4  # envs acting greedily: the success rate
  buffer_size: int = 160_000  # stream steps over all envs
  learning_starts: int = 1_000
  learning_rate: float = 1e-3
  gamma: float = 0.98
  target_update_interval: int = 800  # env steps
  # The other envs explore at a constant epsilon.
  epsilon_start: float = 0.2
  epsilon_end: float = 0.2
  hidden_size: int = 256
  num_chunks: int = 20


class Step(NamedTuple):
  """One stream step; at a final-observation step only `obs` is meaningful."""

  obs: dict  # "observation", "achieved_goal", "desired_goal": [B]
  action: jax.Array  # (), int32: the bit flipped at obs
  reward: jax.Array  # (), float32: the reward that followed
  terminated: jax.Array  # (), bool: that action reached the goal


class RunnerState(q_learning.LearnerState):
  bits: jax.Array  # [N, B] float32: each env's state
  goals: jax.Array  # [N, B] float32
  episode_steps: jax.Array  # [N] int32


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


def make_trainer(config: Config) -> training.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`.

  The metrics' returns are the greedy envs' successes (0 or 1 an episode).
  """
  num_envs, num_bits = config.num_envs, config.num_bits
  network = q_learning.QNetwork(num_bits, config.hidden_size)
  hindsight = functools.partial(
    jaxbuf.hindsight_replay,
    num_envs,
    config.buffer_size,
    goal_reward,
    strategy=config.strategy,
    relabel_fraction=config.relabel_fraction,
    terminated_fn=goal_reached,
    gamma=config.gamma,
  )
  buffer = q_learning.replay_buffer(
    config, hindsight, functools.partial(hindsight, prioritized=True)
  )
  optimizer = q_learning.make_optimizer(config)
  greedy = jnp.arange(num_envs) < config.greedy_envs
  epsilon = q_learning.epsilon_schedule(config)

  def init(key: jax.Array) -> RunnerState:
    key, network_key, bits_key, goals_key = jax.random.split(key, 4)
    bits = random_bits(bits_key, (num_envs, num_bits))
    goals = random_bits(goals_key, (num_envs, num_bits))
    example = Step(
      obs=goal_obs(bits[0], goals[0]),
      action=jnp.int32(0),
      reward=jnp.float32(0),
      terminated=jnp.bool_(False),
    )
    return RunnerState.start(
      key,
      network.init(network_key, q_input(goal_obs(bits, goals))[0]),
      optimizer,
      buffer.init(example),
      bits=bits,
      goals=goals,
      episode_steps=jnp.zeros(num_envs, jnp.int32),
    )

  def td_loss(params, target_params, sample: jaxbuf.HindsightSample):
    batch = sample.items
    q_taken = q_learning.q_of(network.apply(params, q_input(batch.obs)), batch.action)
    next_q = network.apply(target_params, q_input(batch.next_obs)).max(-1)
    # discount is gamma, 0 where the goal was reached (terminated).
    target = batch.reward + batch.discount * next_q
    # Returns lie in [-1 / (1 - gamma), 0] (the HER paper clips likewise).
    target = jax.lax.stop_gradient(jnp.clip(target, -1.0 / (1.0 - config.gamma), 0.0))
    td_error = q_taken - target
    return jnp.mean(sample.weights * optax.huber_loss(td_error)), td_error

  def collect(state, actions, reset_key):
    obs = goal_obs(state.bits, state.goals)
    next_bits = jnp.where(
      jax.nn.one_hot(actions, num_bits, dtype=bool), 1.0 - state.bits, state.bits
    )
    terminated = goal_reached(next_bits, state.goals)
    rewards = goal_reward(next_bits, state.goals)
    episode_steps = state.episode_steps + 1
    ended = terminated | (episode_steps >= num_bits)
    buffer_state = buffer.add(
      state.buffer_state, Step(obs=obs, action=actions, reward=rewards, terminated=terminated)
    )
    # The final observation, once, as its own step of the envs that ended.
    buffer_state = buffer.add(
      buffer_state,
      Step(
        obs=goal_obs(next_bits, state.goals),
        action=jnp.zeros_like(actions),
        reward=jnp.zeros_like(rewards),
        terminated=jnp.zeros_like(terminated),
      ),
      mask=ended,
      episode_end=jnp.ones(num_envs, bool),
    )
    bits_key, goals_key = jax.random.split(reset_key)
    reset = ended[:, None]
    state = state.replace(
      buffer_state=buffer_state,
      bits=jnp.where(reset, random_bits(bits_key, next_bits.shape), next_bits),
      goals=jnp.where(reset, random_bits(goals_key, next_bits.shape), state.goals),
      episode_steps=jnp.where(ended, 0, episode_steps),
    )
    # The greedy envs' successes, as "returns" of 0 or 1 per episode.
    return state, ended & greedy, terminated.astype(jnp.float32)

  return q_learning.make_trainer(
    config,
    buffer=buffer,
    optimizer=optimizer,
    td_loss=td_loss,
    init=init,
    q_values=lambda params, state: network.apply(
      params, q_input(goal_obs(state.bits, state.goals))
    ),
    collect=collect,
    epsilon=lambda iteration: jnp.where(greedy, 0.0, epsilon(iteration)),
    title=(
      f"DQN + HER ({config.strategy}, relabel "
      f"{config.relabel_fraction}), {config.num_bits}-bit flipping"
    ),
  )


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `training.train`'s dict,
  whose returns are the greedy envs' successes (0 or 1 per episode)."""
  return training.train(make_trainer(config), config, show_progress)


class EpisodeStatistics(NamedTuple):
  """Per-episode statistics of a sample of whole episodes."""

  success_rate: jax.Array  # (), float32: episodes that reached their goal
  mean_length: jax.Array  # (), float32: steps per episode
  mean_return: jax.Array  # (), float32: undiscounted return


def episode_statistics(
  num_bits: int, num_episodes: int, key: jax.Array, *, batch_size: int = 64
) -> EpisodeStatistics:
  """Runs a random policy on `num_bits` bits, keeps the episodes in
  `jaxbuf.episode_replay` and computes statistics over a sample of them.

  Whole episodes come back padded to `num_bits + 1` steps (the actions and
  the final observation), with `mask` and `lengths`; the return is the
  masked sum of the rewards, excluding the final-observation step.
  """
  num_envs = 4
  max_length = num_bits + 1
  buffer = jaxbuf.episode_replay(num_envs, num_envs * max_length * 8, max_length)
  zeros = jnp.zeros(num_bits, jnp.float32)
  example = Step(
    obs=goal_obs(zeros, zeros),
    action=jnp.int32(0),
    reward=jnp.float32(0),
    terminated=jnp.bool_(False),
  )

  def run(key):
    state = buffer.init(example)

    def env_step(carry, key):
      state, bits, goals, steps = carry
      action_key, bits_key, goals_key = jax.random.split(key, 3)
      actions = jax.random.randint(action_key, (num_envs,), 0, num_bits, jnp.int32)
      next_bits = jnp.where(jax.nn.one_hot(actions, num_bits, dtype=bool), 1.0 - bits, bits)
      terminated = goal_reached(next_bits, goals)
      ended = terminated | (steps + 1 >= num_bits)
      state = buffer.add(
        state, Step(goal_obs(bits, goals), actions, goal_reward(next_bits, goals), terminated)
      )
      state = buffer.add(
        state,
        Step(
          goal_obs(next_bits, goals),
          jnp.zeros_like(actions),
          jnp.zeros(num_envs, jnp.float32),
          jnp.zeros(num_envs, bool),
        ),
        mask=ended,
        episode_end=jnp.ones(num_envs, bool),
      )
      reset = ended[:, None]
      bits = jnp.where(reset, random_bits(bits_key, bits.shape), next_bits)
      goals = jnp.where(reset, random_bits(goals_key, goals.shape), goals)
      return (state, bits, goals, jnp.where(ended, 0, steps + 1)), None

    start_key, steps_key, sample_key = jax.random.split(key, 3)
    bits = random_bits(start_key, (2, num_envs, num_bits))
    carry = (state, bits[0], bits[1], jnp.zeros(num_envs, jnp.int32))
    (state, *_), _ = jax.lax.scan(
      env_step, carry, jax.random.split(steps_key, num_episodes * num_bits // num_envs)
    )
    sample = buffer.sample(state, sample_key, batch_size)
    episodes = sample.items
    # The last step of a piece holds the final observation (padding reward).
    transition = sample.mask & (jnp.arange(max_length)[None, :] < sample.lengths[:, None] - 1)
    returns = jnp.sum(jnp.where(transition, episodes.reward, 0.0), axis=1)
    success = jnp.any(episodes.terminated & transition, axis=1)
    return EpisodeStatistics(
      success_rate=jnp.mean(success.astype(jnp.float32)),
      mean_length=jnp.mean((sample.lengths - 1).astype(jnp.float32)),
      mean_return=jnp.mean(returns),
    )

  return jax.jit(run)(key)


def report(config: Config, result: dict[str, Any]) -> None:
  print(
    "success rate per seed (greedy envs, last 10%): "
    + " ".join(f"{r:.3f}" for r in result["final_returns"])
  )
  num_bits = min(config.num_bits, 8)
  statistics = episode_statistics(num_bits, 64, jax.random.key(config.seed))
  print(
    f"random policy on {num_bits} bits, episodes from episode_replay: "
    f"success {float(statistics.success_rate):.2f}, mean length "
    f"{float(statistics.mean_length):.1f}, mean return "
    f"{float(statistics.mean_return):.1f}"
  )


def main(argv: list[str] | None = None) -> None:
  training.main(argv, Config, train, __doc__.split("\n")[0], report)


if __name__ == "__main__":
  main()
