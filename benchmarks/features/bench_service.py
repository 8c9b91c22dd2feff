"""The replay service (issue 43): its cost per call, its coalescing, and
the Sebulba example against the single-thread host loop.

* Per call: `writer.add` of a 4-env CartPole transition batch (NumPy) and
  `service.sample` of 128, against the bare `buffer.add` / `buffer.sample`
  (dispatch only, the last result waited for), microseconds per call, the
  median of interleaved repeats (harness.time_interleaved).
* Coalescing: K threads each adding `--adds` batches of 4 as fast as they
  can; adds taken, device calls made, adds per second.
* A slow env: an env step of `--delay` seconds outside the GIL (a
  simulator in C), one thread doing everything against actor threads and a
  learner, the same service and learner step (`slow_env`).
* The example: examples/sebulba_dqn.py (K actor threads, the learner in
  the main thread, SampleToInsertRatio at 16 samples per insert) against
  examples/gymnasium_dqn.py's single-thread recipe at the same replay ratio
  (a batch of 128 every 8 env steps), env steps per second over
  `--total-steps` (compilation included in both), and the samples per
  insert the limiter achieved.

Usage:
  python benchmarks/features/bench_service.py [--calls 1000] [--adds 2000] [--total-steps 30000]
"""

import argparse
import pathlib
import sys
import threading
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness  # noqa: E402
import jaxbuf  # noqa: E402
from examples import gymnasium_dqn  # noqa: E402
from examples import sebulba_dqn  # noqa: E402


def transitions(rng: np.random.Generator) -> dict:
  return dict(
    obs=rng.normal(size=(4, 4)).astype(np.float32),
    action=rng.integers(0, 2, 4).astype(np.int32),
    reward=np.ones(4, np.float32),
    next_obs=rng.normal(size=(4, 4)).astype(np.float32),
    terminated=np.zeros(4, bool),
  )


def per_call(calls: int, repeats: int) -> dict:
  rng = np.random.default_rng(0)
  items = transitions(rng)
  example = jax.tree.map(lambda leaf: leaf[0], items)
  buffer = jaxbuf.uniform_replay(10_000)
  holder = {"state": buffer.add(buffer.init(example), items)}
  service = jaxbuf.ReplayService(buffer, buffer.add(buffer.init(example), items))
  writer = service.writer()
  key = jax.random.key(0)
  counter = iter(range(10**9))

  def bare_add():
    holder["state"] = buffer.add(holder["state"], items)
    return holder["state"]

  def service_add():
    writer.add(items)
    return service.counts

  def bare_sample():
    return buffer.sample(holder["state"], key, 128, step=next(counter))

  def service_sample():
    return service.sample(jax.random.fold_in(key, next(counter)), 128).batch

  def bare_split_sample():
    return buffer.sample(holder["state"], jax.random.fold_in(key, next(counter)), 128)

  seconds = harness.time_interleaved(
    {
      "buffer.add (bare)": bare_add,
      "writer.add": service_add,
      "buffer.sample(fold_in key) (bare)": bare_split_sample,
      "buffer.sample(step=) (bare)": bare_sample,
      "service.sample": service_sample,
    },
    repeats=repeats,
    warmup=2,
    number=calls,
  )
  service.close()
  return seconds


def coalescing(threads: int, adds: int) -> dict:
  rng = np.random.default_rng(0)
  items = transitions(rng)
  buffer = jaxbuf.uniform_replay(100_000)
  service = jaxbuf.ReplayService(buffer, buffer.init(jax.tree.map(lambda leaf: leaf[0], items)))
  service.writer().add(items)  # compiled once before timing

  def actor():
    writer = service.writer()
    for _ in range(adds):
      writer.add(items)

  workers = [threading.Thread(target=actor) for _ in range(threads)]
  start = time.perf_counter()
  for worker in workers:
    worker.start()
  for worker in workers:
    worker.join()
  jax.block_until_ready(service.state)
  seconds = time.perf_counter() - start
  result = dict(adds=service.adds - 1, device_adds=service.device_adds - 1, seconds=seconds)
  service.close()
  return result


def slow_env(steps: int, delay: float, actors: int) -> dict:
  """A host env whose step takes `delay` seconds outside the GIL (a
  simulator in C), 4 envs, a learner of 3 dense layers on batches of 128 at
  16 samples per insert: env steps per second of one thread doing it all
  (step, add, learn when the limiter allows) against `actors` actor threads
  and the learner in the main thread. The same service calls in both."""
  rng = np.random.default_rng(0)
  items = transitions(rng)
  buffer = jaxbuf.uniform_replay(100_000)
  weights = [jax.numpy.ones((4, 256)), jax.numpy.ones((256, 256)), jax.numpy.ones((256, 2))]

  @jax.jit
  def train_step(state, weights, key):
    batch = buffer.sample(state, key, 128)

    def loss(weights):
      hidden = batch.items["obs"]
      for layer in weights:
        hidden = jax.numpy.tanh(hidden @ layer)
      return jax.numpy.mean(hidden**2)

    grads = jax.grad(loss)(weights)
    return state, [w - 1e-3 * g for w, g in zip(weights, grads)]

  def run(threaded: bool) -> float:
    example = jax.tree.map(lambda leaf: leaf[0], items)
    limiter = jaxbuf.SampleToInsertRatio(16.0, min_size=512, error_buffer=1024.0)
    service = jaxbuf.ReplayService(buffer, buffer.init(example), rate_limiter=limiter)
    holder = {"weights": weights, "updates": 0}

    def learn_once(timeout):
      holder["weights"] = service.learn(
        train_step, 128, holder["weights"], jax.random.key(holder["updates"]), timeout=timeout
      )
      jax.block_until_ready(holder["weights"])
      holder["updates"] += 1

    def act(count):
      writer = service.writer()
      for _ in range(count):
        time.sleep(delay)  # the env's step, the GIL released
        writer.add(items, timeout=60)

    start = time.perf_counter()
    if threaded:
      workers = [threading.Thread(target=act, args=(steps // actors,)) for _ in range(actors)]
      for worker in workers:
        worker.start()
      while any(worker.is_alive() for worker in workers):
        try:
          learn_once(0.05)
        except TimeoutError:
          pass
      for worker in workers:
        worker.join()
    else:
      writer = service.writer()
      for _ in range(steps):
        time.sleep(delay)
        writer.add(items, timeout=60)
        while limiter.can_sample(service.counts, 128):
          learn_once(None)
    seconds = time.perf_counter() - start
    service.close()
    return 4 * steps / seconds

  run(False)  # compiles
  return dict(single=run(False), threaded=run(True))


def example(total_steps: int, num_actors: int, **settings) -> dict:
  common = dict(total_steps=total_steps, learning_starts=min(10_000, total_steps // 5))
  single = gymnasium_dqn.train(gymnasium_dqn.Config(progress=False, **common))
  threaded = sebulba_dqn.train(sebulba_dqn.Config(num_actors=num_actors, **common, **settings))
  return dict(single=single, threaded=threaded)


def sebulba_settings(**settings) -> str:
  """The example's settings that shape its speed, for the printed record."""
  config = sebulba_dqn.Config(**settings)
  names = ("num_envs", "batch_size", "train_frequency", "updates_per_learn", "host_policy")
  names += ("steps_per_add",)
  names += ("switch_interval", "error_buffer")
  return ", ".join(f"{name}={getattr(config, name)}" for name in names)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=1000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--adds", type=int, default=2000)
  parser.add_argument("--total-steps", type=int, default=30_000)
  parser.add_argument("--actors", type=int, default=2)
  parser.add_argument("--delay", type=float, default=0.002)
  parser.add_argument("--slow-steps", type=int, default=1000)
  # The example's defaults unless given (4 and 4: faster; see its Config).
  parser.add_argument("--updates-per-learn", type=int, default=None)
  parser.add_argument("--steps-per-add", type=int, default=None)
  parser.add_argument("--parts", nargs="+", default=["calls", "coalescing", "slow_env", "example"])
  args = parser.parse_args()
  harness.print_machine()
  if "calls" in args.parts:
    seconds = per_call(args.calls, args.repeats)
    harness.print_table(
      [("call", -36), ("us per call", 12)],
      [(name, harness.microseconds(value)) for name, value in seconds.items()],
    )
  if "coalescing" in args.parts:
    for threads in (1, 2, 4):
      result = coalescing(threads, args.adds)
      print(
        f"info  {threads} writer threads x {args.adds} adds of 4: {result['adds']} adds in "
        f"{result['device_adds']} device calls ({result['adds'] / result['device_adds']:.2f} "
        f"adds per call), {result['adds'] / result['seconds']:,.0f} adds/s"
      )
  if "slow_env" in args.parts:
    result = slow_env(args.slow_steps, args.delay, args.actors)
    print(
      f"info  env step of {1e3 * args.delay:.1f} ms outside the GIL, {args.slow_steps} vector "
      f"steps of 4: one thread {result['single']:,.0f} env steps/s; {args.actors} actor threads "
      f"+ learner {result['threaded']:,.0f}: {result['threaded'] / result['single']:.2f}x"
    )
  if "example" in args.parts:
    given = dict(updates_per_learn=args.updates_per_learn, steps_per_add=args.steps_per_add)
    settings = {name: value for name, value in given.items() if value is not None}
    result = example(args.total_steps, args.actors, **settings)
    single, threaded = result["single"], result["threaded"]
    print(
      f"info  {args.total_steps} env steps, 4 envs: single-thread recipe "
      f"{single['steps_per_second']:,.0f} env steps/s; sebulba ({args.actors} actors) "
      f"{threaded['steps_per_second']:,.0f} env steps/s: "
      f"{threaded['steps_per_second'] / single['steps_per_second']:.2f}x (goal >= 1.5x); "
      f"sebulba's config: {sebulba_settings(**settings)}"
    )
    achieved, target = threaded["samples_per_insert"], threaded["target_samples_per_insert"]
    print(
      f"info  samples per insert achieved {achieved:.3f}, target {target:.3f}: "
      f"{100 * abs(achieved - target) / target:.2f}% off (goal <= 5%); "
      f"{threaded['adds']} adds in {threaded['device_adds']} device calls"
    )
  print(f"load average at end: {harness.load_average()}")


if __name__ == "__main__":
  main()
