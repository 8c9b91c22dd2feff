"""DQN on a gymnax environment, uniform or prioritized replay, one jitted program.

Shape key: K seeds, N envs, S sample size, C capacity, A actions.

Every part of the collect-and-train loop runs inside one `lax.scan`: stepping
N environments (vmapped), adding the N transitions to a jaxbuf replay buffer,
sampling, the TD loss, the optax update, the priority update and the target
network copy. Learning is gated by `jaxbuf.cond_update` (a `lax.cond` that
leaves the replay storage out of its select under vmap) on
`buffer.can_sample` and the warm-up length. K seeds train at once with
`vmap`. The host only sees the program between chunks of iterations, to move
the progress bar. The TD
target is Double DQN's by default (`--no-double-q` for the original max).

  python examples/dqn.py                       # the demo: 5e5 steps, one seed
  python examples/dqn.py --replay uniform      # uniform replay instead of PER
  python examples/dqn.py --num-seeds 8 --plot dqn.png   # the learning bar
  python examples/dqn.py --devices 4 --num-envs 12   # data-parallel, 4 devices

Replay is proportional prioritized (beta annealed from 0.4 to 1) by default.
On CartPole-v1 uniform replay reaches returns of 500 too, but not every seed
keeps them: once most episodes last 500 steps, the 10,000 items held (1,000
steps per env) contain few terminations, each drawn with probability
1 / 10,000 per row, and some seeds collapse late in training; prioritized
replay keeps drawing the transitions with large TD errors.
Measured over 8 seeds (`--num-seeds 8`) with exploration ending at epsilon
0.05: uniform final returns 256 to 500 (mean 423), prioritized 469 to 500
(mean 490). For uniform replay a 50k or
100k buffer, a learning rate annealed to 0, or a target network copied
every 2,000 steps left the worst of 8 seeds at 369, 123, 161 and 102.

Exploration ends at epsilon 0.01 (Dopamine's), and the final return is that
of the exploring policy: at 0.05 (CleanRL's), once prioritized batches came
in a random row order, one of 8 seeds ended at 433.8 (497.2 499.8 497.8
497.0 433.8 464.8 487.5 495.1), its greedy policy broken by a random action
every 20 steps.

With prioritized replay the learning rate is annealed linearly to a tenth
of itself over the updates. At a constant rate a single run could still
collapse late: once the strata of a prioritized sample came in a new random
order (a cheaper sort, the same distribution), the demo ended at 221.7 (460
at 460k steps, 134 at 470k) and 8 seeds at 472.6 to 500 (461.3 to 500 with
`--seed 1`). Annealed to 2.5e-5: the demo 500.0, 8 seeds 493.9 to 500
(499.2 to 500 with `--seed 1`); annealed to 0, one of 8 with `--seed 1`
ended at 441.9. Uniform replay keeps the constant rate: annealed to 2.5e-5,
4 seeds ended at 500.0 488.4 292.2 293.9 against 500.0 on each at a constant
rate.

Data-parallel (`--devices D`): one `jaxbuf.sharded` buffer spans a mesh of
D devices (D fake CPU devices when run as a script on a machine without
them). The N envs and each add batch are split over the devices, each device
writing its own envs' transitions to its part of the buffer; the sample is
exact over all devices' items and comes back split over them, so each
device computes the loss of its S / D rows, and the gradient of the mean
loss over the whole batch (averaged across devices by XLA's SPMD
partitioner) updates the replicated network on every device.

Truncation: gymnax resets inside `env.step` and returns the observation after
the reset; the pre-reset observation is `info["final_observation"]`, which is
what each stored transition keeps as `next_obs`. Only `terminated` stops the
bootstrap, so a time limit (CartPole-v1 cuts episodes at 500 steps) is
bootstrapped from the value of the true final observation.
"""

import dataclasses
import os
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):
  # Run as a script: the repository root goes first on the path, before
  # `import jaxbuf`, so `examples` imports as it does from the tests and
  # `jaxbuf` is this checkout's package. Otherwise, run from the folder
  # holding a clone named jaxbuf with that folder on the path (`PYTHONPATH=.`),
  # the clone itself would import as an empty namespace package `jaxbuf`.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

if __name__ == "__main__" and "--devices" in sys.argv and "jax" not in sys.modules:
  # Fake CPU devices must be asked for before JAX starts its backends.
  _count = sys.argv[sys.argv.index("--devices") + 1]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={_count}")

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

import jaxbuf

from examples import common  # noqa: E402
# The quickstart notebook plots with `dqn.learning_curve`.
from examples.common import learning_curve  # noqa: E402, F401

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters; each field is also a command-line flag."""
  env_name: str = "CartPole-v1"
  time_limit: int = 0                 # episode step limit; 0 keeps the env's own
  replay: str = "prioritized"         # or "uniform": see the module docstring
  total_steps: int = 500_000          # env steps per seed
  num_seeds: int = 1                  # K seeds trained at once with vmap
  seed: int = 0
  num_envs: int = 10                  # N; one learner update per N env steps
  buffer_size: int = 10_000
  batch_size: int = 128
  learning_starts: int = 10_000       # env steps of pure collection first
  learning_rate: float = 2.5e-4
  learning_rate_end: float = -1.0     # annealed linearly to this over the
                                      # updates; -1: 10% of learning_rate with
                                      # prioritized replay, constant with uniform
  double_q: bool = True               # Double DQN target (--no-double-q: max)
  gamma: float = 0.99
  target_update_interval: int = 500   # env steps between target network copies
  epsilon_start: float = 1.0
  epsilon_end: float = 0.01            # see the module notes
  epsilon_fraction: float = 0.5       # of total_steps spent annealing epsilon
  alpha: float = 0.6                  # prioritized replay only
  beta_start: float = 0.4             # annealed to 1 over training
  priority_eps: float = 1e-6
  max_grad_norm: float = 10.0
  hidden_size: int = 120
  num_chunks: int = 50                # progress-bar updates (one jitted call each)
  devices: int = 1                    # D > 1: data-parallel over D devices


def final_learning_rate(config: Config) -> float:
  """`learning_rate_end`, or its default for the replay (module notes)."""
  if config.learning_rate_end >= 0:
    return config.learning_rate_end
  return config.learning_rate * (0.1 if config.replay == "prioritized" else 1.0)


class Transition(NamedTuple):
  """One replay item; `next_obs` is the observation before any auto-reset."""
  obs: jax.Array         # [*obs_shape], float32
  action: jax.Array      # (), int32
  reward: jax.Array      # (), float32
  next_obs: jax.Array    # [*obs_shape], float32
  terminated: jax.Array  # (), bool: true end of episode, no bootstrap


class QNetwork(nn.Module):
  """An MLP from observations `[..., *obs_shape]` to Q-values `[..., A]`."""
  num_actions: int
  hidden_size: int

  @nn.compact
  def __call__(self, obs: jax.Array) -> jax.Array:
    x = obs.reshape(obs.shape[:obs.ndim - 1] + (-1,))
    x = nn.relu(nn.Dense(self.hidden_size)(x))
    # 120 then 84 units by default, PureJaxRL's CartPole network.
    x = nn.relu(nn.Dense(self.hidden_size * 7 // 10)(x))
    return nn.Dense(self.num_actions)(x)


@flax.struct.dataclass
class RunnerState:
  """Everything one seed's training carries from one iteration to the next."""
  params: PyTree
  target_params: PyTree
  opt_state: PyTree
  buffer_state: jaxbuf.ReplayState
  env_state: PyTree       # gymnax state, each leaf [N, ...]
  obs: jax.Array          # [N, *obs_shape], float32
  episode_returns: jax.Array  # [N], float32: return so far of each running episode
  iteration: jax.Array    # shape=(), int32: vectorized env steps taken
  key: jax.Array          # shape=(), a typed PRNG key



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
  num_updates = max(num_iterations - config.learning_starts // config.num_envs, 1)
  if config.replay == "uniform":
    buffer = jaxbuf.uniform_replay(config.buffer_size)
  elif config.replay == "prioritized":
    buffer = jaxbuf.prioritized_replay(
        config.buffer_size, alpha=config.alpha, eps=config.priority_eps,
        beta=optax.linear_schedule(config.beta_start, 1.0, num_updates))
  else:
    raise ValueError(f"--replay must be uniform or prioritized, given "
                     f"{config.replay!r}.")
  split_over_devices = lambda tree: tree  # one device: nothing to place
  if config.devices > 1:
    if config.devices > jax.device_count():
      raise ValueError(f"--devices {config.devices}: only "
                       f"{jax.device_count()} devices are visible.")
    if config.num_envs % config.devices or config.batch_size % config.devices:
      raise ValueError(
          f"--devices {config.devices}: --num-envs ({config.num_envs}) and "
          f"--batch-size ({config.batch_size}) must divide by it, each device "
          "stepping its share of the envs and learning from its share of "
          "the batch; e.g. --num-envs 12 for 4 devices.")
    # Auto axes: XLA's partitioner propagates the envs' split through the
    # network and inserts the gradient all-reduce.
    mesh = jax.make_mesh((config.devices,), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:config.devices])
    buffer = jaxbuf.sharded(buffer, mesh, axis="data")
    envs_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    split_over_devices = lambda tree: jax.lax.with_sharding_constraint(
        tree, jax.tree.map(lambda _: envs_split, tree))
  optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                          optax.adam(optax.linear_schedule(
                              config.learning_rate,
                              final_learning_rate(config), num_updates)))
  target_period = max(config.target_update_interval // config.num_envs, 1)
  learning_starts = config.learning_starts // config.num_envs

  def init(key: jax.Array) -> RunnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    params = network.init(network_key, obs[0])
    example = Transition(obs=obs[0], action=jnp.int32(0),
                         reward=jnp.float32(0), next_obs=obs[0],
                         terminated=jnp.bool_(False))
    # The same layout as every step's output, so the compiled chunk that
    # takes the first state takes all the later ones.
    env_state, obs, episode_returns = split_over_devices(
        (env_state, obs, jnp.zeros(config.num_envs, jnp.float32)))
    return RunnerState(
        params=params, target_params=params, opt_state=optimizer.init(params),
        buffer_state=buffer.init(example), env_state=env_state, obs=obs,
        episode_returns=episode_returns,
        iteration=jnp.zeros((), jnp.int32), key=key)

  def td_loss(params, target_params, sample: jaxbuf.ReplaySample):
    batch = sample.items
    q_values = network.apply(params, batch.obs)                    # [S, A]
    q_taken = jnp.take_along_axis(q_values, batch.action[:, None], axis=-1)[:, 0]
    next_q_values = network.apply(target_params, batch.next_obs)   # [S, A]
    if config.double_q:
      # The online network picks the next action, the target network values
      # it: less overestimation. On CartPole-v1 with uniform replay, 4-seed
      # runs with the plain max ended at a mean return of 362, with this 491
      # (before the library's exact index draws changed the random stream).
      next_actions = network.apply(params, batch.next_obs).argmax(axis=-1)
      next_q = jnp.take_along_axis(next_q_values, next_actions[:, None],
                                   axis=-1)[:, 0]
    else:
      next_q = next_q_values.max(axis=-1)
    bootstrap = config.gamma * (1.0 - batch.terminated.astype(jnp.float32))
    target = jax.lax.stop_gradient(batch.reward + bootstrap * next_q)
    td_error = q_taken - target
    # Importance weights are all 1 for uniform replay. A squared error, as in
    # PureJaxRL: with a Huber loss, Q-values on CartPole ran away here.
    loss = jnp.mean(sample.weights * 0.5 * td_error ** 2)
    return loss, td_error

  # Learning samples and updates priorities but never writes the replay
  # storage, so `common.learn_when` keeps the storage out of the select that
  # a vmapped cond becomes (a copy of every seed's buffer per step).
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
    buffer_state = buffer.add(state.buffer_state, Transition(
        obs=state.obs, action=actions, reward=rewards,
        next_obs=info["final_observation"], terminated=terminated))
    episode_returns = state.episode_returns + rewards
    episode_ended = terminated | truncated
    env_state, next_obs, next_returns = split_over_devices(
        (env_state, next_obs, jnp.where(episode_ended, 0.0, episode_returns)))
    state = state.replace(
        buffer_state=buffer_state, env_state=env_state, obs=next_obs,
        episode_returns=next_returns,
        iteration=state.iteration + 1, key=key)

    should_learn = (buffer.can_sample(buffer_state, config.batch_size)
                    & (state.iteration >= learning_starts))
    state, loss = common.learn_when(should_learn, learn, state, learn_key,
                                    target_period=target_period)
    return state, common.episode_metrics(episode_ended, episode_returns,
                                         loss)

  return common.Trainer(init=init, step=step)


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; returns metrics and timings.

  Returns:
    `common.train_in_chunks`'s dict, with an iteration per vectorized env
    step: "returns_sum" and "episodes_ended" `[K, I]`, "final_returns"
    `[K]`, "final_mean_return", "steps_per_second", ...
  """
  return common.train_in_chunks(
      make_trainer(config),
      num_iterations=config.total_steps // config.num_envs,
      env_steps_per_iteration=config.num_envs, num_chunks=config.num_chunks,
      num_seeds=config.num_seeds, seed=config.seed,
      description=f"DQN {config.replay}", show_progress=show_progress)


def main(argv: list[str] | None = None) -> None:
  common.main(argv, config_type=Config, train=train,
              description=__doc__.split("\n")[0],
              plot_title=lambda config: (f"DQN ({config.replay} replay), "
                                         f"{config.env_name}"),
              plot_color="tab:blue")


if __name__ == "__main__":
  main()
