"""Actor fleets on envpool CartPole (issue 51): the single-thread fused
recipe against the threaded service and Ray actor processes, and the cost
of a remote add.

* Fleets: DQN on envpool's CartPole-v1 (C++, stepped outside the GIL), 4
  envs, a batch of 128 every 8 env steps (16 samples per insert), run to
  `--total-steps`:
  (a) `single`: examples/gymnasium_dqn.py's recipe with `--envpool` (one
      jitted call per vector step: add, learn when due, act);
  (b) `threaded Kx`: examples/sebulba_dqn.py with `--envpool` (K actor
      threads, the learner in the main thread, `SampleToInsertRatio` at
      16), U optimizer steps per learn and S vector steps per add;
  (c) `ray Kx`: examples/ray_dqn.py (K actor processes through
      `jaxbuf.ray`, the same learner and limiter).
  Each: env steps per second and learner updates per second (compilation
  included; a warm-up run of each first fills JAX's persistent compilation
  cache, so later runs load their programs), samples per insert achieved
  against the target (goal: within 1%), and the final mean return.
* Kills (`--parts kills --kills 1000`, a slow run): remote writers killed
  mid-add, each one's log of chunks sent and acknowledged checked against
  the state every 50 kills (acknowledged inserts lost: goal 0).
* Remote add: `writer.add` of a CartPole chunk (64 transitions, inline; and
  4096, through Ray's object store) from a Ray actor process, with 0 and 1
  chunks in flight, against a local `writer.add` of the same items: time
  per add (the median of `--adds` adds after a warm-up) and the bytes of
  its arrays and of its pickle.

The last line is `fleet/single R`: the best fleet's env steps per second
over the single-thread recipe's, same machine, one run.

Usage:
  python benchmarks/features/bench_fleet.py [--total-steps 500000] [--adds 300]
  python benchmarks/features/bench_fleet.py --parts remote_add
"""

import argparse
import dataclasses
import os
import pathlib
import pickle
import signal
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
# One persistent cache of compiled programs for the runs of this process:
# each run makes its own jitted functions, which would compile again.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="bench-fleet-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import ray  # noqa: E402

from benchmarks.common import harness  # noqa: E402
import jaxbuf  # noqa: E402
import jaxbuf.ray  # noqa: E402
from examples import gymnasium_dqn  # noqa: E402
from examples import ray_dqn  # noqa: E402
from examples import sebulba_dqn  # noqa: E402

PACKAGES = harness.PACKAGES + ("ray", "envpool")
WAIT = 600.0  # s: the longest any remote call here is waited for


def fleets(total_steps: int, warm_up: bool) -> dict[str, dict]:
  """Each configuration's result dict (see the module docstring)."""
  common = dict(total_steps=total_steps, learning_starts=min(10_000, total_steps // 5))
  common.update(envpool=True)
  configs = {
    "single": (gymnasium_dqn.train, gymnasium_dqn.Config(progress=False, **common)),
    "threaded 1x (U=4, S=4)": (
      sebulba_dqn.train,
      sebulba_dqn.Config(num_actors=1, updates_per_learn=4, steps_per_add=4, **common),
    ),
    "threaded 2x (U=4, S=4)": (
      sebulba_dqn.train,
      sebulba_dqn.Config(num_actors=2, updates_per_learn=4, steps_per_add=4, **common),
    ),
    "threaded 1x (U=1, S=1)": (sebulba_dqn.train, sebulba_dqn.Config(num_actors=1, **common)),
    "ray 1x": (ray_dqn.train, ray_dqn.Config(num_actors=1, **common)),
    "ray 2x": (ray_dqn.train, ray_dqn.Config(num_actors=2, **common)),
  }
  results = {}
  for name, (train, config) in configs.items():
    if warm_up:
      small = min(total_steps, 2 * common["learning_starts"] + 4000)
      train(dataclasses.replace(config, total_steps=small))
    start = time.perf_counter()
    result = train(config)
    result["seconds"] = time.perf_counter() - start
    result["config"] = config
    if name == "single":
      # The recipe learns every train period once learning starts: its
      # updates, and its inserts (env steps less NEXT_STEP's reset steps,
      # one per ended episode, which the recorder leaves out).
      agent_iterations = config.total_steps // config.num_envs
      period = max(config.train_frequency // config.num_envs, 1)
      starts = config.learning_starts // config.num_envs
      updates = len(range(starts + (-starts) % period, agent_iterations + 1, period))
      inserts = result["env_steps"] - len(result["episode_returns"].ended)
      result["updates"] = updates
      result["updates_per_second"] = updates * result["steps_per_second"] / result["env_steps"]
      result["samples_per_insert"] = (
        updates * config.batch_size / max(inserts - config.learning_starts, 1)
      )
      result["target_samples_per_insert"] = sebulba_dqn.samples_per_insert(config)
    elif "updates_per_second" not in result:
      seconds = result["env_steps"] / result["steps_per_second"]
      result["updates_per_second"] = result["samples_per_insert"] * (
        result["env_steps"] - config.learning_starts
      ) / config.batch_size / seconds  # fmt: skip
    results[name] = result
    load = harness.load_average()
    print(f"info  ran {name} ({result['seconds']:.0f} s); load average {load}", flush=True)
  return results


def transitions(rows: int) -> dict:
  rng = np.random.default_rng(0)
  return dict(
    obs=rng.normal(size=(rows, 4)).astype(np.float32),
    action=rng.integers(0, 2, rows).astype(np.int32),
    reward=np.ones(rows, np.float32),
    next_obs=rng.normal(size=(rows, 4)).astype(np.float32),
    terminated=np.zeros(rows, bool),
    truncated=np.zeros(rows, bool),
  )


@ray.remote(num_cpus=0)
class Adder:
  """A remote writer timing its own adds."""

  def ready(self) -> int:
    return os.getpid()

  def time_adds(self, served, rows: int, adds: int, in_flight: int) -> dict:
    items = transitions(rows)
    writer = served.writer(max_in_flight=in_flight, timeout=WAIT)
    for _ in range(10):
      writer.add(items, timeout=WAIT)
    writer.flush()
    seconds = []
    for _ in range(adds):
      start = time.perf_counter()
      writer.add(items, timeout=WAIT)
      seconds.append(time.perf_counter() - start)
    writer.flush()
    writer.close()
    payload = dict(items=items, mask=None, episode_end=None, final_steps=None)
    return dict(
      seconds=statistics.median(seconds),
      bytes=writer.last_add_bytes,
      pickled=len(pickle.dumps(payload, protocol=5)),
    )


def remote_add(adds: int) -> list[tuple]:
  """Rows of (what, us per add, array bytes, pickled bytes)."""
  rows = []
  for size in (64, 4096):
    items = transitions(size)
    buffer = jaxbuf.uniform_replay(2**20)
    service = jaxbuf.ReplayService(buffer, buffer.init(jax_tree_first(items)))
    writer = service.writer()
    for _ in range(10):
      writer.add(items)
    seconds = []
    for _ in range(adds):
      start = time.perf_counter()
      writer.add(items)
      seconds.append(time.perf_counter() - start)
    rows.append((f"local writer.add of {size}", statistics.median(seconds), None, None))
    served = jaxbuf.ray.serve(service)
    adder = Adder.remote()
    ray.get(adder.ready.remote(), timeout=WAIT)
    for in_flight in (0, 1):
      result = ray.get(adder.time_adds.remote(served, size, adds, in_flight), timeout=WAIT)
      what = f"remote add of {size}, {in_flight} in flight"
      rows.append((what, result["seconds"], result["bytes"], result["pickled"]))
    ray.kill(adder)
    served.close()
  return rows


@ray.remote(num_cpus=0)
class Killed:
  """A remote writer adding chunks of unique ids until it is killed, each
  chunk logged before it is sent and once acknowledged (unbuffered, so the
  log survives a SIGKILL)."""

  def pid(self) -> int:
    return os.getpid()

  def add_until_killed(self, served, first_id: int, rows: int, log_path: str, in_flight: int):
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    writer = served.writer(timeout=WAIT, max_in_flight=in_flight)
    index = 0
    try:
      while True:
        os.write(log, f"send {index}\n".encode())
        ids = np.arange(first_id + index * rows, first_id + (index + 1) * rows, dtype=np.int32)
        writer.add({"id": ids}, timeout=WAIT)
        if index >= in_flight:
          os.write(log, f"ack {index - in_flight}\n".encode())
        index += 1
    except jaxbuf.ServiceClosed:
      return index
    finally:
      os.close(log)


def logged(path: pathlib.Path) -> tuple[set, set]:
  lines = path.read_text().split("\n") if path.exists() else []
  sent = {int(line.split()[1]) for line in lines if line.startswith("send")}
  acked = {int(line.split()[1]) for line in lines if line.startswith("ack")}
  return acked, sent - acked


def kills(count: int, folder: pathlib.Path, seed: int = 0) -> None:
  """`count` writers killed mid-add (ray.kill and SIGKILL in turn, 0 or 1
  chunks in flight, random chunk sizes and moments), each log checked
  against the service's state every 50 kills: acknowledged inserts lost,
  chunks held in part, ids held twice or never sent (all must be 0)."""
  rng = np.random.default_rng(seed)
  buffer = jaxbuf.uniform_replay(2**23)
  service = jaxbuf.ReplayService(buffer, buffer.init({"id": np.int32(0)}))
  served = jaxbuf.ray.serve(service)
  runs = []
  start = time.perf_counter()
  # The next writers' processes start while this one adds (a process and
  # its imports take seconds; the kills do not wait for them one by one).
  starting = [Killed.remote() for _ in range(2)]
  for index in range(count):
    first_id, rows, in_flight = 4096 * index, int(rng.integers(1, 65)), index % 2
    log = folder / f"killed{index}.log"
    runs.append((first_id, rows, log, in_flight))
    actor = starting.pop(0)
    starting.append(Killed.remote())
    pid = ray.get(actor.pid.remote(), timeout=WAIT)  # asked first: it adds from then on
    actor.add_until_killed.remote(served, first_id, rows, str(log), in_flight)
    deadline = time.monotonic() + WAIT
    while not logged(log)[0]:
      if time.monotonic() > deadline:
        raise TimeoutError(f"writer {index}: no add acknowledged within {WAIT} s")
      time.sleep(0.02)
    time.sleep(float(rng.uniform(0.0, 0.1)))
    if index % 4 < 2:
      ray.kill(actor)
    else:
      os.kill(pid, signal.SIGKILL)
    if (index + 1) % 50 == 0 or index + 1 == count:
      # Read once the dead writer's last chunk is settled (taken or
      # dropped): no writer adds now, so the counts stop moving.
      settled = time.monotonic() + WAIT
      before = service.counts
      while time.monotonic() < settled:
        time.sleep(1.0)
        if service.counts == before:
          break
        before = service.counts
      state = service.state
      ids = np.asarray(state.storage["id"])[: int(state.size)]
      held = set(ids.tolist())
      lost = partial = 0
      expected = set()
      acked_chunks = acked_ids = 0
      for first, size, path, _ in runs:
        acked, unacked = logged(path)
        for chunk in acked:
          chunk_ids = set(range(first + chunk * size, first + (chunk + 1) * size))
          lost += len(chunk_ids - held)
          expected |= chunk_ids
          acked_chunks, acked_ids = acked_chunks + 1, acked_ids + size
        for chunk in unacked:
          chunk_ids = set(range(first + chunk * size, first + (chunk + 1) * size))
          part = chunk_ids & held
          partial += part not in (set(), chunk_ids)
          expected |= part
      print(
        f"info  kills {index + 1}: {acked_chunks} chunks ({acked_ids} inserts) acknowledged, "
        f"acknowledged inserts lost {lost}, chunks held in part {partial}, ids twice "
        f"{len(ids) - len(held)}, ids never sent {len(held - expected)}, counted "
        f"{service.counts.inserts} for {len(ids)} held; {time.perf_counter() - start:.0f} s, "
        f"load average {harness.load_average()}",
        flush=True,
      )
  for actor in starting:
    ray.kill(actor)
  served.close()


def jax_tree_first(items: dict) -> dict:
  return {name: leaf[0] for name, leaf in items.items()}


def start_ray() -> None:
  root = pathlib.Path(__file__).resolve().parents[2]
  path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)  # Ray forks to exec
    ray.init(
      address="local",
      num_cpus=2,
      include_dashboard=False,
      log_to_driver=False,
      runtime_env={"env_vars": {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}},
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--total-steps", type=int, default=500_000)
  parser.add_argument("--adds", type=int, default=300)
  parser.add_argument("--no-warm-up", action="store_true")
  parser.add_argument("--kills", type=int, default=1000)
  parser.add_argument("--parts", nargs="+", default=["remote_add", "fleets"])  # also "kills"
  args = parser.parse_args()
  harness.print_machine(PACKAGES)
  start_ray()
  if "remote_add" in args.parts:
    harness.print_table(
      [("call", -34), ("us per add", 11), ("array bytes", 12), ("pickled bytes", 14)],
      [
        (what, harness.microseconds(seconds), size or "-", pickled or "-")
        for what, seconds, size, pickled in remote_add(args.adds)
      ],
    )
  if "kills" in args.parts:
    with tempfile.TemporaryDirectory() as folder:
      kills(args.kills, pathlib.Path(folder))
  if "fleets" in args.parts:
    results = fleets(args.total_steps, not args.no_warm_up)
    single = results["single"]["steps_per_second"]
    rows = []
    for name, result in results.items():
      achieved, target = result["samples_per_insert"], result["target_samples_per_insert"]
      rows.append(
        (
          name,
          f"{result['steps_per_second']:,.0f}",
          f"{result['updates_per_second']:,.0f}",
          f"{result['steps_per_second'] / single:.2f}",
          f"{achieved:.3f} / {target:.0f} ({100 * abs(achieved - target) / target:.2f}%)",
          f"{result['final_mean_return']:.1f}",
        )
      )
    harness.print_table(
      [
        ("fleet", -24),
        ("env steps/s", 12),
        ("updates/s", 10),
        ("x single", 9),
        ("samples/insert (off)", 22),
        ("final return", 13),
      ],
      rows,
    )
    print(f"info  {args.total_steps} env steps each, 4 envs; goal: threaded >= 1.5x single")
    print(f"load average at end: {harness.load_average()}")
    best = max(r["steps_per_second"] for name, r in results.items() if name != "single")
    print(f"fleet/single {best / single:.2f}")
  else:
    print(f"load average at end: {harness.load_average()}")
  ray.shutdown()


if __name__ == "__main__":
  main()
