"""DQN with envpool actor processes feeding one learner through Ray (`jaxbuf.ray`).

Shape key: N envs (all actors together), K actor processes, S sample size.

    actor process 0:   envpool (N/K envs) --add(chunk)--+
    actor process 1:   envpool (N/K envs) --add(chunk)--+--> served ReplayService --learn--> learner
    ...                                                 |    (the learner's process:       (jitted)
    actor process K-1: envpool (N/K envs) --add(chunk)--+     buffer state, limiter)            |
          ^                                                                                     |
          +------- served.params(): the latest params, one ray.put per publish -----------------+

The learner's process holds the `jaxbuf.ReplayService` and serves it with
`jaxbuf.ray.serve`; each actor is a Ray actor (its own process, here on the
same machine; on a cluster, on any host) that steps an envpool of CartPole
envs (C++, outside the GIL), acts in NumPy with the latest parameters it
read (`served.params`), and adds `steps_per_add` vector steps at a time
through its remote writer, tagged with the policy version that acted. A
`jaxbuf.SampleToInsertRatio` holds the replay ratio at the single-thread
loop's (examples/gymnasium_dqn.py: a batch of 128 every 8 env steps, 16
samples per insert) across processes: an actor's add waits while the
learner is behind, as an actor thread's would. The learner publishes its
parameters every `publish_every` learns (`served.publish`: copied to the
host and put in Ray's object store once, whatever the number of actors).

  python examples/ray_dqn.py                       # 2 actor processes, 5e5 env steps
  python examples/ray_dqn.py --num-actors 1 --total-steps 50000
  python examples/ray_dqn.py --ray-address auto    # join a running cluster (`ray start`)

It prints the final mean return (the episodes that ended in the last 10% of
env steps) and whether it reached CartPole's 475. Network, loss and
hyperparameters are examples/gymnasium_dqn.py's; the learner's step and the
host policy are examples/sebulba_dqn.py's. On a cluster of several hosts,
install jaxbuf[ray,envpool] on each and ship this folder with the job
(`ray job submit --working-dir .`): the actors import `examples`.
"""

import dataclasses
import os
import pathlib
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import ray

if __package__ in (None, ""):
  # Run as a script: the repository root first, before `import jaxbuf`
  # (examples/README.md says why).
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import jaxbuf  # noqa: E402  pylint: disable=wrong-import-position
import jaxbuf.ray  # noqa: E402
from examples import gymnasium_dqn  # noqa: E402
from examples import q_learning  # noqa: E402
from examples import sebulba_dqn  # noqa: E402
from examples import training  # noqa: E402

JOIN = 120.0  # seconds to wait for an actor (its start, its last add, its end)
ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Config(sebulba_dqn.Config):
  """sebulba_dqn's flags, and the processes'."""

  num_actors: int = 1  # K actor processes, N / K envs each
  envpool: bool = True  # envpool's C++ CartPole (gymnasium's also works: --no-envpool)
  steps_per_add: int = 16  # vector steps per remote add: one chunk, one round trip
  updates_per_learn: int = 1  # U optimizer steps per learn (4: faster; one 5e5 run reached 449)
  publish_every: int = 4  # learns between parameter publishes
  max_in_flight: int = 1  # chunks an actor's add may leave unacknowledged (steps while one travels)
  actor_cpus: float = 1.0  # Ray CPUs each actor asks for (spreads them over hosts)
  ray_address: str = ""  # "": start a local cluster here; "auto": join a running one


def samples_per_insert(config: Config) -> float:
  return sebulba_dqn.samples_per_insert(config)


def make_service(config: Config, agent: gymnasium_dqn.Agent) -> jaxbuf.ReplayService:
  """sebulba_dqn's service, its limiter's slack widened to hold a chunk's
  worth of samples and a learn's rows on either side of the target (else
  the service refuses the sizes: they could block each other forever)."""
  chunk = config.steps_per_add * config.num_envs // config.num_actors
  slack = 2.0 * (chunk * samples_per_insert(config) + config.updates_per_learn * config.batch_size)
  return sebulba_dqn.make_service(
    dataclasses.replace(config, error_buffer=max(config.error_buffer, slack)), agent
  )


class EnvActor:
  """An actor process: steps its envpool, acts, adds chunks remotely.

  Made with `ray.remote` in `train` (so importing this module starts
  nothing); `run` returns when the learner closes the service.
  """

  def __init__(self, config: Config, index: int):
    self.config = config
    self.index = index
    per_actor = config.num_envs // config.num_actors
    actor_config = dataclasses.replace(config, num_envs=per_actor, seed=config.seed + index)
    self.envs = gymnasium_dqn.make_envs(actor_config)
    # The buffer is made only for its kind: the recorder writes its items.
    self.buffer = gymnasium_dqn.make_agent(actor_config, self.envs).buffer
    self.policy = sebulba_dqn.HostPolicy(config, config.seed + 1000 + index)

  def ready(self) -> int:
    return os.getpid()

  def run(self, served: jaxbuf.ray.Served) -> dict[str, Any]:
    """Steps until the service is closed; the episodes' returns, by env
    step, and the steps taken. An actor counts global env steps as its own
    times K (the others step at about its rate), for epsilon and returns."""
    config = self.config
    envs, recorder = self.envs, jaxbuf.VectorEnvRecorder(self.envs, self.buffer)
    obs = gymnasium_dqn.reset(envs, config, config.seed + self.index)
    recorder.reset(obs)
    returns = training.EpisodeReturns(envs.num_envs)
    dtype = envs.single_action_space.dtype
    latest = served.params(timeout=JOIN)  # the learner's first parameters
    if latest is None:
      raise TimeoutError(f"actor {self.index}: no parameters published within {JOIN} s.")
    params, version = latest
    steps = 0
    writer = served.writer(timeout=JOIN, max_in_flight=config.max_in_flight)
    try:
      while True:
        newer = served.params(newer_than=version, timeout=0)
        if newer is not None:
          params, version = newer
        chunk = []
        for _ in range(config.steps_per_add):
          global_steps = steps * config.num_actors
          iteration = global_steps // config.num_envs
          actions = self.policy(params, version, obs, iteration).astype(dtype)
          obs, rewards, terminated, truncated, info = envs.step(actions)
          returns.record(global_steps, rewards, terminated | truncated)
          recorded = recorder.record(actions, obs, rewards, terminated, truncated, info).items
          if recorded is not None:
            chunk.append(recorded)
          steps += envs.num_envs
        if chunk:
          items = jax.tree.map(lambda *rows: np.concatenate(rows), *chunk)
          writer.add(items, policy_version=version, timeout=JOIN)
    except jaxbuf.ServiceClosed:
      pass  # the learner has its steps
    finally:
      envs.close()
    return dict(ended=returns.ended, steps=steps)


def start_ray(config: Config) -> bool:
  """Starts (or joins) a Ray cluster unless one is running here; whether
  this call started it. Local: the checkout first on the workers' path, so
  they import this `jaxbuf` and `examples`."""
  if ray.is_initialized():
    return False
  with warnings.catch_warnings():
    # JAX warns that a fork of its multithreaded process may deadlock; Ray
    # forks only to exec its own processes at once (subprocess.Popen).
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    _init(config)
  return True


def _init(config: Config) -> None:
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  runtime_env = {"env_vars": {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}}
  if config.ray_address:
    ray.init(address=config.ray_address, runtime_env=runtime_env, log_to_driver=False)
  else:
    cpus = max(2, int(np.ceil(config.num_actors * config.actor_cpus)))
    ray.init(
      address="local",
      num_cpus=cpus,
      include_dashboard=False,
      runtime_env=runtime_env,
      log_to_driver=False,
    )


def train(config: Config) -> dict[str, Any]:
  """Trains one agent; returns what sebulba_dqn.train returns, and
  "updates" (optimizer steps) and "updates_per_second"."""
  if config.num_envs % config.num_actors:
    raise ValueError(f"num_envs {config.num_envs} must divide by num_actors {config.num_actors}.")
  started = start_ray(config)
  envs = gymnasium_dqn.make_envs(config)
  agent = gymnasium_dqn.make_agent(config, envs)
  obs = gymnasium_dqn.reset(envs, config, config.seed)
  envs.close()
  service = make_service(config, agent)
  served = jaxbuf.ray.serve(service)
  key, network_key = jax.random.split(jax.random.key(config.seed))
  params = agent.network.init(network_key, obs[0])
  learner = q_learning.LearnerState.start(key, params, agent.optimizer, jnp.zeros(()))
  train_step = sebulba_dqn.make_train_step(config, agent)
  remote = ray.remote(num_cpus=config.actor_cpus)(EnvActor)
  actors = [remote.remote(config, index) for index in range(config.num_actors)]
  ray.get([actor.ready.remote() for actor in actors], timeout=JOIN)
  try:
    served.publish(params, version=0)
    running = [actor.run.remote(served) for actor in actors]

    def publish(learner: q_learning.LearnerState, update: int) -> None:
      if update % config.publish_every == 0:
        served.publish(learner.params, version=update)

    def stopped() -> bool:  # an actor ended (failed): its error is raised below
      return bool(ray.wait(running, timeout=0)[0])

    start = time.perf_counter()
    with served:  # an exception here closes it, and the actors stop
      sebulba_dqn.learn_until_done(config, service, train_step, learner, key, stopped, publish)
      seconds = time.perf_counter() - start
    results = ray.get(running, timeout=JOIN)
  finally:
    for actor in actors:
      ray.kill(actor)
    if started:
      ray.shutdown()
  counts = service.counts
  returns = training.EpisodeReturns(1)
  returns.ended = sorted(sum((result["ended"] for result in results), []))
  return dict(
    final_mean_return=returns.mean_since(int(counts.inserts * 0.9)),
    steps_per_second=counts.inserts / seconds,
    env_steps=counts.inserts,
    episode_returns=returns,
    samples_per_insert=counts.samples / max(counts.inserts - config.learning_starts, 1),
    target_samples_per_insert=samples_per_insert(config),
    device_adds=service.device_adds,
    adds=service.adds,
    updates=counts.samples // config.batch_size,
    updates_per_second=counts.samples / config.batch_size / seconds,
  )


def main(argv: list[str] | None = None) -> None:
  config, plot = training.parse_config(Config, __doc__.split("\n")[0], argv)
  result = train(config)
  if plot:
    result["episode_returns"].plot(plot, f"DQN, {config.num_actors} Ray actor processes")
  print(
    f"env steps per second: {result['steps_per_second']:,.0f} ({config.num_actors} actor "
    f"processes, {config.num_envs} envs, {result['env_steps']:,} env steps); learner updates "
    f"per second: {result['updates_per_second']:,.0f}; samples per insert "
    f"{result['samples_per_insert']:.2f} (target {result['target_samples_per_insert']:.2f}); "
    f"{result['adds']:,} adds in {result['device_adds']:,} device calls"
  )
  solved = result["final_mean_return"] >= 475
  print(f"CartPole solved (final mean return >= 475): {'yes' if solved else 'no'}")
  print(f"final mean return: {result['final_mean_return']:.1f}")


if __name__ == "__main__":
  main()
