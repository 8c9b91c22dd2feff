"""n-step DQN on sequence replay: observations stored once, one jitted program.

Shape key: K seeds, N envs, S sample size, L = n + 1 window length, A actions.

The replay buffer holds each env's stream of steps (`jaxbuf.sequence_replay`)
instead of `(obs, action, reward, next_obs)` items, so every observation is
stored once; a sampled window of n + 1 steps gives the n-step transition of
its first step (`jaxbuf.n_step_transitions`), `next_obs` read from the window.

Truncation: when an episode ends, the stream gets one extra step holding
gymnax's `info["final_observation"]`, flagged `last` (its action and reward
are padding). A transition stops at a `last` step and bootstraps from it,
the true final observation; SB3's `optimize_memory_usage` bootstraps from the
reset observation there instead (SB3 #934). A termination stops it with
discount 0. Each collect step is one add: the step of every env, and as
`final_steps` the final observations, written by the envs whose final step
is flagged `last` (the buffer reads episode ends from that flag).

  python examples/nstep_dqn.py                        # n = 3, one seed
  python examples/nstep_dqn.py --num-seeds 4 --plot nstep_dqn.png
  python examples/nstep_dqn.py --replay prioritized   # prioritized windows

The loop (learning gated by `jaxbuf.cond_update`, target copies, K seeds vmapped) is
that of examples/dqn.py; only the replay and the TD target differ.
"""

import dataclasses
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/dqn.py says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxbuf

from examples import common  # noqa: E402
from examples.dqn import QNetwork  # noqa: E402

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""
  env_name: str = "CartPole-v1"
  time_limit: int = 0                 # episode step limit; 0 keeps the env's own
  replay: str = "uniform"             # "uniform" or "prioritized"
  n_step: int = 3
  total_steps: int = 500_000          # env steps per seed
  num_seeds: int = 1
  seed: int = 0
  num_envs: int = 10
  buffer_size: int = 10_000           # stream steps over all envs
  batch_size: int = 128
  learning_starts: int = 10_000
  # Half of examples/dqn.py's: n-step targets move further per update. With
  # 2.5e-4, 4 seeds reached 500 by mid-training, then two fell back (final
  # mean 362.4); with 1.25e-4 the final mean was 496.5.
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
  """One stream step; at a `last` step only `obs` is meaningful."""
  obs: jax.Array         # [*obs_shape], float32
  action: jax.Array      # (), int32: taken at obs
  reward: jax.Array      # (), float32: the reward that followed
  terminated: jax.Array  # (), bool: that action truly ended the episode
  last: jax.Array        # (), bool: obs is an episode's final observation


class Transition(NamedTuple):
  """The item of one-step replay with `next_obs`, for the memory comparison."""
  obs: jax.Array
  action: jax.Array
  reward: jax.Array
  next_obs: jax.Array
  terminated: jax.Array


@flax.struct.dataclass
class RunnerState:
  params: PyTree
  target_params: PyTree
  opt_state: PyTree
  buffer_state: PyTree
  env_state: PyTree            # gymnax state, leaves [N, ...]
  obs: jax.Array               # [N, *obs_shape]
  episode_returns: jax.Array   # [N], float32
  iteration: jax.Array         # shape=(), int32
  key: jax.Array



def bytes_per_step(example: PyTree) -> int:
  return sum(np.dtype(leaf.dtype).itemsize * int(np.prod(leaf.shape))
             for leaf in jax.tree.leaves(example))


def make_buffer(config: Config) -> jaxbuf.Buffer:
  window = config.n_step + 1
  if config.replay == "uniform":
    return jaxbuf.sequence_replay(config.num_envs, config.buffer_size, window)
  if config.replay == "prioritized":
    num_iterations = config.total_steps // config.num_envs
    num_updates = max(num_iterations
                      - config.learning_starts // config.num_envs, 1)
    return jaxbuf.prioritized_sequence_replay(
        config.num_envs, config.buffer_size, window, alpha=config.alpha,
        eps=config.priority_eps,
        beta=optax.linear_schedule(config.beta_start, 1.0, num_updates))
  raise ValueError(f"--replay must be uniform or prioritized, given "
                   f"{config.replay!r}.")


def make_trainer(config: Config) -> common.Trainer:
  """Builds `init(key) -> RunnerState` and `step(state) -> (state, metrics)`."""
  envs = common.make_vector_env(config.env_name, config.time_limit,
                                config.num_envs)
  num_actions = envs.num_actions
  network = QNetwork(num_actions, config.hidden_size)
  num_iterations = config.total_steps // config.num_envs
  epsilon_schedule = optax.linear_schedule(
      config.epsilon_start, config.epsilon_end,
      transition_steps=int(config.epsilon_fraction * num_iterations))
  buffer = make_buffer(config)
  optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                          optax.adam(config.learning_rate))
  target_period = max(config.target_update_interval // config.num_envs, 1)
  learning_starts = config.learning_starts // config.num_envs

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    params = network.init(network_key, obs[0])
    example = Step(obs=obs[0], action=jnp.int32(0), reward=jnp.float32(0),
                   terminated=jnp.bool_(False), last=jnp.bool_(False))
    return RunnerState(
        params=params, target_params=params, opt_state=optimizer.init(params),
        buffer_state=buffer.init(example), env_state=env_state, obs=obs,
        episode_returns=jnp.zeros(config.num_envs, jnp.float32),
        iteration=jnp.zeros((), jnp.int32), key=key)

  def td_loss(params, target_params, sample: jaxbuf.ReplaySample):
    window = sample.items                                  # leaves [S, L, ...]
    batch = jaxbuf.n_step_transitions(
        window.obs, window.action, window.reward, window.terminated,
        window.last, n=config.n_step, gamma=config.gamma)
    q_values = network.apply(params, batch.obs)            # [S, A]
    q_taken = jnp.take_along_axis(q_values, batch.action[:, None],
                                  axis=-1)[:, 0]
    # Double DQN, as examples/dqn.py.
    next_actions = network.apply(params, batch.next_obs).argmax(axis=-1)
    next_q = jnp.take_along_axis(network.apply(target_params, batch.next_obs),
                                 next_actions[:, None], axis=-1)[:, 0]
    target = jax.lax.stop_gradient(batch.reward + batch.discount * next_q)
    # Windows starting at a final-observation step hold no transition.
    td_error = jnp.where(batch.valid, q_taken - target, 0.0)
    loss = (jnp.sum(sample.weights * 0.5 * td_error ** 2)
            / jnp.maximum(jnp.sum(batch.valid), 1))
    return loss, td_error

  learn = common.td_learner(buffer, optimizer, td_loss, config.batch_size)

  def step(state: RunnerState
           ) -> tuple[RunnerState, common.QLearningMetrics]:
    key, explore_key, action_key, env_key, learn_key = jax.random.split(
        state.key, 5)
    actions = common.epsilon_greedy(
        explore_key, action_key, network.apply(state.params, state.obs),
        epsilon_schedule(state.iteration))
    next_obs, env_state, rewards, terminated, truncated, info = envs.step(
        env_key, state.env_state, actions)
    rewards = rewards.astype(jnp.float32)
    episode_ended = terminated | truncated
    no = jnp.zeros(config.num_envs, bool)
    # The final observation, once, as its own step of the envs that ended.
    buffer_state = buffer.add(state.buffer_state, Step(
        obs=state.obs, action=actions, reward=rewards, terminated=terminated,
        last=no), final_steps=Step(
            obs=info["final_observation"], action=jnp.zeros_like(actions),
            reward=jnp.zeros_like(rewards), terminated=no, last=episode_ended))
    episode_returns = state.episode_returns + rewards
    state = state.replace(
        buffer_state=buffer_state, env_state=env_state, obs=next_obs,
        episode_returns=jnp.where(episode_ended, 0.0, episode_returns),
        iteration=state.iteration + 1, key=key)

    should_learn = (buffer.can_sample(buffer_state, config.batch_size)
                    & (state.iteration >= learning_starts))
    state, loss = common.learn_when(should_learn, learn, state, learn_key,
                                    target_period=target_period)
    return state, common.episode_metrics(episode_ended, episode_returns,
                                         loss)

  return common.Trainer(init=init, step=step)


def memory_per_transition(config: Config, episodes_per_step: float,
                          obs_shape: tuple[int, ...] = (4,),
                          obs_dtype: Any = jnp.float32) -> dict[str, float]:
  """Storage bytes per transition held: the stream vs one-step items.

  The stream holds 1 + `episodes_per_step` steps per transition (each
  episode adds its final-observation step); the item buffer one
  `Transition` with `next_obs`.
  """
  obs = jax.ShapeDtypeStruct(obs_shape, obs_dtype)
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
  stream = bytes_per_step(Step(obs, scalar(jnp.int32), scalar(jnp.float32),
                               scalar(jnp.bool_), scalar(jnp.bool_)))
  # The buffer's own per-step episode flag (one bool) counts too.
  stream = (stream + 1) * (1.0 + episodes_per_step)
  items = bytes_per_step(Transition(obs, scalar(jnp.int32), scalar(jnp.float32),
                                    obs, scalar(jnp.bool_)))
  return dict(stream=stream, items=float(items), ratio=stream / items)


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `common.train_in_chunks`'s dict."""
  result = common.train_in_chunks(
      make_trainer(config),
      num_iterations=config.total_steps // config.num_envs,
      env_steps_per_iteration=config.num_envs, num_chunks=config.num_chunks,
      num_seeds=config.num_seeds, seed=config.seed,
      description=f"{config.n_step}-step DQN, {config.replay} sequences",
      show_progress=show_progress)
  episodes_per_step = (result["episodes_ended"].sum()
                       / (result["env_steps_per_seed"] * config.num_seeds))
  result["memory"] = memory_per_transition(config, float(episodes_per_step))
  return result


def main(argv: list[str] | None = None) -> None:
  def report(config: Config) -> dict[str, Any]:
    result = train(config)
    memory = result["memory"]
    print(f"bytes per transition held: stream {memory['stream']:.1f} "
          f"(final-observation steps included), items with next_obs "
          f"{memory['items']:.0f}: {memory['ratio']:.2f}x")
    return result

  common.main(argv, config_type=Config, train=report,
              description=__doc__.split("\n")[0],
              plot_title=lambda config: (f"{config.n_step}-step DQN "
                                         f"({config.replay} sequence replay), "
                                         f"{config.env_name}"),
              plot_color="tab:green")


if __name__ == "__main__":
  main()
