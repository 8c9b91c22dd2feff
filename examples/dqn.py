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
the reset; the pre-reset observation is `info["final_observation"]`
(`EnvStep.final_obs`), which is what each stored transition keeps as
`next_obs`. Only `terminated` stops the bootstrap, so a time limit
(CartPole-v1 cuts episodes at 500 steps) is bootstrapped from the value of
the true final observation.
"""

import dataclasses
import functools
import os
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

if __name__ == "__main__" and "--devices" in sys.argv and "jax" not in sys.modules:
  # Fake CPU devices must be asked for before JAX starts its backends.
  _count = sys.argv[sys.argv.index("--devices") + 1]
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_count}"
  )

import jax
import jax.numpy as jnp

import jaxbuf

from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402

# examples/gymnasium_dqn.py and benchmarks/features/bench_loops.py use `dqn.QNetwork`;
# the quickstart notebook plots with `dqn.learning_curve`.
from examples.q_learning import QNetwork  # noqa: E402, F401
from examples.training import learning_curve  # noqa: E402, F401


@dataclasses.dataclass(frozen=True)
class Config(q_learning.ReplayConfig, q_learning.QLearningConfig, training.GymnaxConfig):
  """Hyperparameters; each field is also a command-line flag (the shared
  ones in examples/training.py and examples/q_learning.py)."""

  replay: str = "prioritized"  # or "uniform": see the module docstring
  learning_rate_end: float = -1.0  # -1: 10% of learning_rate with
  # prioritized replay, constant with uniform
  epsilon_end: float = 0.01  # see the module notes
  double_q: bool = True  # Double DQN target (--no-double-q: max)
  devices: int = 1  # D > 1: data-parallel over D devices


def final_learning_rate(config: Config) -> float:
  """`learning_rate_end`, or its default for the replay (module notes)."""
  if config.learning_rate_end >= 0:
    return config.learning_rate_end
  return config.learning_rate * (0.1 if config.replay == "prioritized" else 1.0)


class Transition(NamedTuple):
  """One replay item; `next_obs` is the observation before any auto-reset."""

  obs: jax.Array  # [*obs_shape], float32
  action: jax.Array  # (), int32
  reward: jax.Array  # (), float32
  next_obs: jax.Array  # [*obs_shape], float32
  terminated: jax.Array  # (), bool: true end of episode, no bootstrap


def split_over(config: Config, buffer: jaxbuf.Buffer):
  """`(buffer, place)`: for `--devices D`, the buffer sharded over D devices
  and `place(tree)`, which splits a tree of `[N, ...]` leaves over them."""
  if config.devices == 1:
    return buffer, lambda tree: tree  # one device: nothing to place
  if config.devices > jax.device_count():
    raise ValueError(f"--devices {config.devices}: only {jax.device_count()} devices are visible.")
  if config.num_envs % config.devices or config.batch_size % config.devices:
    raise ValueError(
      f"--devices {config.devices}: --num-envs ({config.num_envs}) and "
      f"--batch-size ({config.batch_size}) must divide by it, each device "
      "stepping its share of the envs and learning from its share of "
      "the batch; e.g. --num-envs 12 for 4 devices."
    )
  # Auto axes: XLA's partitioner propagates the envs' split through the
  # network and inserts the gradient all-reduce.
  mesh = jax.make_mesh(
    (config.devices,),
    ("data",),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[: config.devices],
  )
  envs_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  return jaxbuf.sharded(buffer, mesh, axis="data"), (
    lambda tree: jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: envs_split, tree))
  )


def make_trainer(config: Config) -> training.Trainer:
  """Builds `init(key) -> state` and `step(state) -> (state, metrics)`."""
  envs = training.make_vector_env(config.env_name, config.time_limit, config.num_envs)
  network = QNetwork(envs.num_actions, config.hidden_size)
  buffer, place = split_over(
    config,
    q_learning.replay_buffer(
      config,
      functools.partial(jaxbuf.uniform_replay, config.buffer_size),
      functools.partial(jaxbuf.prioritized_replay, config.buffer_size),
    ),
  )
  optimizer = q_learning.make_optimizer(config, final_learning_rate(config))

  def placed(state: q_learning.EnvLearnerState) -> q_learning.EnvLearnerState:
    # The same layout at every step, so the compiled chunk that takes the
    # first state takes all the later ones.
    env_state, obs, episode_returns = place((state.env_state, state.obs, state.episode_returns))
    return state.replace(env_state=env_state, obs=obs, episode_returns=episode_returns)

  def init(key: jax.Array) -> q_learning.EnvLearnerState:
    key, network_key, reset_key = jax.random.split(key, 3)
    obs, env_state = envs.reset(reset_key)
    example = Transition(
      obs=obs[0],
      action=jnp.int32(0),
      reward=jnp.float32(0),
      next_obs=obs[0],
      terminated=jnp.bool_(False),
    )
    return placed(
      q_learning.EnvLearnerState.start(
        key,
        network.init(network_key, obs[0]),
        optimizer,
        buffer.init(example),
        env_state=env_state,
        obs=obs,
        episode_returns=jnp.zeros(config.num_envs, jnp.float32),
      )
    )

  def td_loss(params, target_params, sample: jaxbuf.ReplaySample):
    batch = sample.items
    q_taken = q_learning.q_of(
      network.apply(params, batch.obs),  # [S]
      batch.action,
    )
    next_q_values = network.apply(target_params, batch.next_obs)  # [S, A]
    if config.double_q:
      # On CartPole-v1 with uniform replay, 4-seed runs with the plain max
      # ended at a mean return of 362, with this 491 (before the library's
      # exact index draws changed the random stream).
      next_q = q_learning.double_q(network.apply(params, batch.next_obs), next_q_values)
    else:
      next_q = next_q_values.max(axis=-1)
    bootstrap = config.gamma * (1.0 - batch.terminated.astype(jnp.float32))
    target = jax.lax.stop_gradient(batch.reward + bootstrap * next_q)
    td_error = q_taken - target
    # Importance weights are all 1 for uniform replay. A squared error, as in
    # PureJaxRL: with a Huber loss, Q-values on CartPole ran away here.
    loss = jnp.mean(sample.weights * 0.5 * td_error**2)
    return loss, td_error

  def collect(state, actions, env_key):
    step = envs.step(env_key, state.env_state, actions)
    buffer_state = buffer.add(
      state.buffer_state,
      Transition(
        obs=state.obs,
        action=actions,
        reward=step.reward,
        next_obs=step.final_obs,
        terminated=step.terminated,
      ),
    )
    state, episode_ended, episode_returns = state.stepped(buffer_state, step)
    return placed(state), episode_ended, episode_returns

  return q_learning.make_trainer(
    config,
    buffer=buffer,
    optimizer=optimizer,
    td_loss=td_loss,
    init=init,
    q_values=lambda params, state: network.apply(params, state.obs),
    collect=collect,
    title=f"DQN ({config.replay} replay), {config.env_name}",
  )


def train(config: Config, *, show_progress: bool = True) -> dict[str, Any]:
  """Trains `config.num_seeds` seeds at once; `training.train`'s dict, an
  iteration per vectorized env step."""
  return training.train(make_trainer(config), config, show_progress)


def main(argv: list[str] | None = None) -> None:
  training.main(argv, Config, train, __doc__.split("\n")[0])


if __name__ == "__main__":
  main()
