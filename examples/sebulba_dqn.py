"""DQN with actor threads and a learner, through `jaxbuf.ReplayService`.

Shape key: N envs (all actors together), S sample size.

The Sebulba / Ape-X layout for environments stepped on the host:

    actor thread 0: envs 0..N/K-1 --writer.add--+
    actor thread 1: envs ...      --writer.add--+--> ReplayService --learn--> learner (main thread)
    ...                                         |    (buffer state,           jitted train step:
    actor thread K-1              --writer.add--+     rate limiter)           sample, TD loss, optax
          ^                                                                       |
          +------------------- params, policy version ----------------------------+

Each actor owns a gymnasium vector env of N / K CartPole envs, acts with the
latest parameters the learner published (jitted epsilon-greedy), and adds
each step through its own writer, tagged with the policy version that acted
(`jaxbuf.VectorEnvRecorder` turns the step into the add). The learner takes
its batch inside its own jitted step (`service.learn`), and a
`jaxbuf.SampleToInsertRatio` holds the replay ratio at the single-thread
loop's (examples/gymnasium_dqn.py: a batch of 128 every 8 env steps, 16
samples per insert), so the two train on the same data budget; here the env
stepping of the actors overlaps the learner's device work.

  python examples/sebulba_dqn.py                      # 2 actors, 5e5 env steps
  python examples/sebulba_dqn.py --num_actors 1 --total_steps 50000
  python examples/sebulba_dqn.py --plot sebulba.png   # returns curve
  python examples/sebulba_dqn.py --envpool            # envpool's C++ CartPole

Network, loss and hyperparameters are examples/gymnasium_dqn.py's.

`--envpool`: each actor steps an envpool of its N / K CartPole envs (C++,
outside the GIL; `pip install jaxbuf[envpool]`, gymnasium's NEXT_STEP
autoreset, whose reset steps the recorder leaves out), seeded by its index.
Gymnasium's CartPole is Python and holds the GIL while it steps, so its
actors and the learner take turns on it; envpool's do not.
"""

import dataclasses
import pathlib
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

if __package__ in (None, ""):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
from examples import gymnasium_dqn  # noqa: E402
from examples import q_learning  # noqa: E402
from examples import training  # noqa: E402

JOIN = 120.0  # seconds to wait for an actor to stop


@dataclasses.dataclass(frozen=True)
class Config(gymnasium_dqn.Config):
  """gymnasium_dqn's flags, and the actors'."""

  num_actors: int = 2  # K actor threads, N / K envs each
  error_buffer: float = 512.0  # the limiter's slack, in sampled rows
  switch_interval: float = 2e-4  # seconds: sys.setswitchinterval while training
  # Faster, but each fell short of the demo's return in one 5e5-step run
  # (benchmarks/RESULTS.md): 4 and 4 reached 319, 1 and 4 reached 400.
  steps_per_add: int = 1  # vector steps an actor gathers per writer.add (fewer, larger adds)
  host_policy: bool = True  # actors act in NumPy (else a jitted act on the learner's device)
  updates_per_learn: int = 1  # U optimizer steps (each its own batch) per service.learn:
  # one dispatch for U updates; the limiter counts U * S rows, the ratio unchanged
  progress: bool = False


class Published:
  """The learner's latest parameters and their version, for the actors.

  One attribute holding a tuple: replaced whole by the learner, read whole
  by the actors (a reference swap is atomic in CPython), so no lock.
  """

  def __init__(self, params: Any):
    self.latest = (params, 0)


class HostPolicy:
  """The actors' epsilon-greedy policy in NumPy, from the published params.

  On the CPU, XLA runs a computation in the thread that calls it, one at a
  time per device: a jitted act would queue behind the learner's step and
  compete for its cores. The network is small (examples/q_learning.py's
  QNetwork: Dense, relu, Dense, relu, Dense), so NumPy acts in tens of
  microseconds, with the parameters copied to the host once per version.
  """

  def __init__(self, config: Config, seed: int):
    self.config = config
    self.rng = np.random.default_rng(seed)
    self.version = -1
    self.layers: list[tuple[np.ndarray, np.ndarray]] = []

  def epsilon(self, iteration: int) -> float:
    """q_learning.epsilon_schedule's linear schedule, in Python."""
    config = self.config
    steps = max(int(config.epsilon_fraction * config.num_iterations), 1)
    done = min(iteration, steps) / steps
    return config.epsilon_start + (config.epsilon_end - config.epsilon_start) * done

  def __call__(self, params: Any, version: int, obs: np.ndarray, iteration: int) -> np.ndarray:
    if version != self.version:
      dense = jax.device_get(params["params"])
      self.layers = [(dense[f"Dense_{i}"]["kernel"], dense[f"Dense_{i}"]["bias"]) for i in range(3)]
      self.version = version
    x = np.asarray(obs, np.float32).reshape(len(obs), -1)
    for i, (kernel, bias) in enumerate(self.layers):
      x = x @ kernel + bias
      if i < len(self.layers) - 1:
        x = np.maximum(x, 0)
    greedy = x.argmax(axis=-1)
    explore = self.rng.random(len(obs)) < self.epsilon(iteration)
    return np.where(explore, self.rng.integers(0, x.shape[-1], len(obs)), greedy)


def samples_per_insert(config: Config) -> float:
  """The single-thread loop's replay ratio: S rows every train period."""
  train_period = max(config.train_frequency // config.num_envs, 1) * config.num_envs
  return config.batch_size / train_period


def make_service(config: Config, agent: gymnasium_dqn.Agent) -> jaxbuf.ReplayService:
  # Room for a learn's U * S rows and an add on either side of the target.
  error_buffer = max(config.error_buffer, 2.0 * config.updates_per_learn * config.batch_size)
  limiter = jaxbuf.SampleToInsertRatio(
    samples_per_insert(config), min_size=config.learning_starts, error_buffer=error_buffer
  )
  return jaxbuf.ReplayService(agent.buffer, agent.buffer.init(agent.example), rate_limiter=limiter)


def actor(
  index: int,
  config: Config,
  agent: gymnasium_dqn.Agent,
  service: jaxbuf.ReplayService,
  published: Published,
  returns: training.EpisodeReturns,
) -> None:
  """Steps N / K envs until the service has `total_steps` or is closed."""
  per_actor = config.num_envs // config.num_actors
  envs = gymnasium_dqn.make_envs(
    dataclasses.replace(config, num_envs=per_actor, seed=config.seed + index)
  )
  recorder = jaxbuf.VectorEnvRecorder(envs, agent.buffer)
  writer = service.writer()
  act = jax.jit(agent.act)
  host_policy = HostPolicy(config, config.seed + 1000 + index)
  key = jax.random.key(config.seed + 1000 + index)
  obs = gymnasium_dqn.reset(envs, config, config.seed + index)
  recorder.reset(obs)
  dtype = envs.single_action_space.dtype
  step = 0
  chunk: list[tuple[Any, int]] = []  # recorded steps not yet added, and their versions
  try:
    while (inserts := service.counts.inserts) < config.total_steps:
      params, version = published.latest
      iteration = inserts // config.num_envs  # epsilon follows all actors' steps
      if config.host_policy:
        actions = host_policy(params, version, obs, iteration).astype(dtype)
      else:
        actions = np.asarray(act(params, obs, jax.random.fold_in(key, step), iteration))
        actions = actions.astype(dtype)
      obs, rewards, terminated, truncated, info = envs.step(actions)
      returns.record(inserts, rewards, terminated | truncated)
      recorded = recorder.record(actions, obs, rewards, terminated, truncated, info).items
      if recorded is not None:
        chunk.append((recorded, version))
      if len(chunk) == config.steps_per_add:
        # Tagged with the oldest policy that acted in it (the lag is not understated).
        items = jax.tree.map(lambda *rows: np.concatenate(rows), *[i for i, _ in chunk])
        writer.add(items, policy_version=chunk[0][1], timeout=JOIN)
        chunk = []
      step += 1
  except jaxbuf.ServiceClosed:
    pass  # the learner finished (or failed: it raises that itself)
  finally:
    envs.close()


def make_train_step(config: Config, agent: gymnasium_dqn.Agent):
  """`train_step(buffer_state, learner, key) -> (buffer_state, (learner,
  loss))`, jitted: `updates_per_learn` samples and updates in a scan (one
  dispatch for all: the learner thread's GIL time is what the actors
  compete for), the target copied every `target_period` updates' worth of
  env steps."""
  learn = q_learning.td_learner(agent.buffer, agent.optimizer, agent.td_loss, config.batch_size)
  # An update per batch_size / samples_per_insert env steps (8 by default).
  target_updates = config.target_update_interval * samples_per_insert(config) / config.batch_size

  def one_update(carry, key):
    buffer_state, learner = carry
    learner = learner.replace(buffer_state=buffer_state)
    params, opt_state, buffer_state, loss = learn(learner, key)
    learner = learner.replace(
      params=params,
      opt_state=opt_state,
      buffer_state=jnp.zeros(()),
      iteration=learner.iteration + 1,
      target_params=optax.periodic_update(
        params, learner.target_params, learner.iteration + 1, max(int(target_updates), 1)
      ),
    )
    return (buffer_state, learner), loss

  @jax.jit
  def train_step(buffer_state, learner: q_learning.LearnerState, key):
    keys = jax.random.split(key, config.updates_per_learn)
    (buffer_state, learner), losses = jax.lax.scan(one_update, (buffer_state, learner), keys)
    return buffer_state, (learner, losses[-1])

  return train_step


def learn_until_done(
  config: Config,
  service: jaxbuf.ReplayService,
  train_step: Any,
  learner: q_learning.LearnerState,
  key: jax.Array,
  stopped: Any,
  publish: Any,
) -> q_learning.LearnerState:
  """The learner's loop: `service.learn` until `total_steps` units are
  inserted, or until `stopped()` while the limiter holds it back;
  `publish(learner, update)` after each learn. Returns the learner."""
  update = 0
  while service.counts.inserts < config.total_steps:
    try:
      learner, _ = service.learn(
        train_step,
        config.updates_per_learn * config.batch_size,
        learner,
        jax.random.fold_in(key, update),
        timeout=1.0,
      )
    except TimeoutError:
      if stopped():
        break
      continue
    update += 1
    publish(learner, update)
  return learner


def train(config: Config) -> dict[str, Any]:
  """Trains one agent; returns what gymnasium_dqn.train returns, and
  "samples_per_insert" (achieved), "target_samples_per_insert",
  "device_adds" and "adds"."""
  if config.num_envs % config.num_actors:
    raise ValueError(f"num_envs {config.num_envs} must divide by num_actors {config.num_actors}.")
  envs = gymnasium_dqn.make_envs(config)
  agent = gymnasium_dqn.make_agent(config, envs)
  obs = gymnasium_dqn.reset(envs, config, config.seed)
  envs.close()
  service = make_service(config, agent)
  key, network_key = jax.random.split(jax.random.key(config.seed))
  params = agent.network.init(network_key, obs[0])
  learner = q_learning.LearnerState.start(key, params, agent.optimizer, jnp.zeros(()))
  published = Published(params)
  returns = training.EpisodeReturns(config.num_envs // config.num_actors)
  all_returns = [
    training.EpisodeReturns(config.num_envs // config.num_actors) for _ in range(config.num_actors)
  ]
  train_step = make_train_step(config, agent)
  threads = [
    threading.Thread(target=actor, args=(i, config, agent, service, published, all_returns[i]))
    for i in range(config.num_actors)
  ]
  # The learner thread needs the GIL for a moment per update, and the
  # actors hold it for most of their steps: at CPython's default switch
  # interval (5 ms) a waiting learner may wait that long per hand-over. A
  # shorter one hands it over sooner (1,958 -> 2,063 env steps/s over 3e4
  # steps on the shared 2-core machine: within its noise).
  switch_interval = sys.getswitchinterval()
  sys.setswitchinterval(config.switch_interval)
  start = time.perf_counter()
  with service:  # an exception here closes it, and the actors stop
    for thread in threads:
      thread.start()

    def publish(learner: q_learning.LearnerState, update: int) -> None:
      # Published once computed: an actor acting on parameters still being
      # computed would wait for the learner's step, and not overlap it.
      published.latest = (jax.block_until_ready(learner.params), update)

    def stopped() -> bool:  # the actors stopped (the total reached while waiting)
      return not any(thread.is_alive() for thread in threads)

    learner = learn_until_done(config, service, train_step, learner, key, stopped, publish)
  for thread in threads:
    thread.join(JOIN)
  seconds = time.perf_counter() - start
  sys.setswitchinterval(switch_interval)
  counts = service.counts
  returns.ended = sorted(sum((r.ended for r in all_returns), []))
  return dict(
    final_mean_return=returns.mean_since(int(counts.inserts * 0.9)),
    steps_per_second=counts.inserts / seconds,
    env_steps=counts.inserts,
    episode_returns=returns,
    samples_per_insert=counts.samples / max(counts.inserts - config.learning_starts, 1),
    target_samples_per_insert=samples_per_insert(config),
    device_adds=service.device_adds,
    adds=service.adds,
  )


def main(argv: list[str] | None = None) -> None:
  config, plot = training.parse_config(Config, __doc__.split("\n")[0], argv)
  result = train(config)
  if plot:
    result["episode_returns"].plot(plot, f"Sebulba DQN on gymnasium {config.env_id}")
  print(
    f"env steps per second: {result['steps_per_second']:,.0f} ({config.num_actors} actors, "
    f"{config.num_envs} envs, {result['env_steps']:,} env steps); samples per insert "
    f"{result['samples_per_insert']:.2f} (target {result['target_samples_per_insert']:.2f}); "
    f"{result['adds']:,} adds in {result['device_adds']:,} device calls; "
    f"final mean return: {result['final_mean_return']:.1f}"
  )


if __name__ == "__main__":
  main()
