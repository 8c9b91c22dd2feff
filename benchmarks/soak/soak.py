"""Soak: resident memory and caches stay flat over long runs of every kind.

Issue 35's soak. For every replay kind (uniform, prioritized, sequence,
prioritized sequence, episode, frame-stack with and without priorities,
hindsight with and without priorities), in one process:

* host calls: `add` of NumPy steps, `sample`, and `update_priorities` from
  the sample's NumPy indices, one after another from Python, as a notebook
  loop makes them (`--host-calls` calls in all, a third each);
* jitted iterations: add + sample + update in one donated `lax.scan` of
  `--scan-length` iterations (`harness.make_fused_loop`), called until
  `--jitted-iterations` have run.

After a warm-up (the first `--warmup` of each phase: compilation, the
allocator's pools), the resident set (`/proc/self/statm`) is read
`--readings` times; the verdict is PASS when the largest reading is within
5% of the first. Alongside, what would show a cache that grows with calls:
the number of live JAX arrays and each jitted function's compiled-program
cache, before and after, which must not grow after the warm-up.

The issue's sizes are the defaults (10^6 host calls and 10^7 jitted
iterations per kind: hours on a shared CPU); `--quick` runs 3 * 10^4 host
calls and 10^6 iterations per kind, enough to see a leak of a few bytes per
call (10^6 iterations x 8 bytes = 8 MB against a ~400 MB process).

Run: python benchmarks/soak/soak.py [--quick] [--kinds uniform sequence ...]
     [--json results.json]
"""

import argparse
import gc
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf

NUM_ENVS = 4
CAPACITY = 1024
BATCH = 32


def _reward(achieved, desired):
  return -jnp.abs(achieved - desired).sum(-1)


KINDS = {
  "uniform": lambda: jaxbuf.uniform_replay(CAPACITY),
  "prioritized": lambda: jaxbuf.prioritized_replay(CAPACITY),
  "sequence": lambda: jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 4),
  "prioritized_sequence": lambda: jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, 4),
  "episode": lambda: jaxbuf.episode_replay(NUM_ENVS, CAPACITY, 16),
  "frame_stack": lambda: jaxbuf.frame_stack_replay(NUM_ENVS, CAPACITY, 4),
  "prioritized_frame_stack": lambda: jaxbuf.prioritized_frame_stack_replay(NUM_ENVS, CAPACITY, 4),
  "hindsight": lambda: jaxbuf.hindsight_replay(NUM_ENVS, CAPACITY, _reward),
  "prioritized_hindsight": lambda: jaxbuf.hindsight_replay(
    NUM_ENVS, CAPACITY, _reward, prioritized=True
  ),
}
ITEM_KINDS = ("uniform", "prioritized")


def example_step() -> dict:
  """One step every kind takes: goals for hindsight, a frame for stacks."""
  goal = np.zeros(2, np.float32)
  return {
    "obs": {"observation": np.zeros(8, np.float32), "achieved_goal": goal, "desired_goal": goal},
    "action": np.int32(0),
    "reward": np.float32(0),
    "terminated": np.bool_(False),
  }


def batch_of(kind: str, step, numpy=np) -> tuple[dict, dict]:
  """The steps of call `step` (one per env, or a batch of items) and the
  add's keywords, every 50th ending each env's episode: NumPy arrays from
  the host, or (`numpy=jnp`, `step` traced) inside the jitted loop."""
  leading = (BATCH,) if kind in ITEM_KINDS else (NUM_ENVS,)
  steps = jax.tree.map(lambda x: numpy.full(leading + x.shape, step % 100, x.dtype), example_step())
  if kind in ITEM_KINDS:
    return steps, {}
  return steps, {"episode_end": numpy.full(NUM_ENVS, step % 50 == 49)}


def jitted_body(buffer, kind: str):
  """add + sample + update, for `harness.make_fused_loop`."""
  inputs = lambda step: batch_of(kind, step, jnp)

  def body(state, key, batch, acc):
    steps, keywords = batch
    state = buffer.add(state, steps, **keywords)
    sample = buffer.sample(state, key, BATCH)
    priorities = jnp.abs(sample.weights) + 1.0
    state = buffer.update_priorities(state, sample.indices, priorities, sample.item_ids)
    return state, acc + jnp.sum(sample.weights)

  return body, inputs


def cache_sizes(buffer) -> dict[str, int]:
  """Compiled programs held by each of the buffer's jitted functions."""
  sizes = {}
  for name in ("add", "sample", "update_priorities"):
    function = getattr(buffer, name)
    for candidate in (
      function,
      getattr(function, "jitted", None),
      getattr(function, "__wrapped__", None),
    ):
      size = getattr(candidate, "_cache_size", None)
      if size is not None:
        sizes[name] = size()
        break
  return sizes


def readings_of(run_part, parts: int, readings: int, warmup: int) -> dict:
  """Runs `run_part()` `parts` times; the resident set and live arrays
  after the warm-up parts and at `readings` points after."""
  marks = set(np.linspace(warmup, parts, readings).round().astype(int).tolist())
  resident, live = [], []
  start = time.perf_counter()
  for part in range(1, parts + 1):
    run_part()
    if part in marks:
      gc.collect()
      resident.append(harness.resident_bytes())
      live.append(len(jax.live_arrays()))
  return {
    "resident_mb": [round(r / 2**20, 1) for r in resident],
    "live_arrays": live,
    "seconds": time.perf_counter() - start,
    "growth": resident[-1] / resident[0] - 1,
    "largest_growth": max(resident) / resident[0] - 1,
  }


def soak(
  kind: str,
  host_calls: int,
  jitted_iterations: int,
  scan_length: int,
  readings: int,
  warmup_fraction: float,
) -> dict:
  buffer = KINDS[kind]()
  holder = {"state": buffer.init(example_step()), "step": 0}

  def host_part():
    # One add, one sample, one update from NumPy: three host calls.
    step = holder["step"]
    steps, keywords = batch_of(kind, step)
    holder["state"] = buffer.add(holder["state"], steps, **keywords)
    sample = buffer.sample(holder["state"], jax.random.key(step), BATCH)
    holder["state"] = buffer.update_priorities(
      holder["state"],
      np.asarray(sample.indices),
      np.abs(np.asarray(sample.weights)) + 1.0,
      np.asarray(sample.item_ids),
    )
    holder["step"] = step + 1

  host_parts = max(host_calls // 3, readings)
  caches_before = None

  def host_with_caches():
    nonlocal caches_before
    host_part()
    if holder["step"] == int(host_parts * warmup_fraction):
      caches_before = cache_sizes(buffer)

  host = readings_of(host_with_caches, host_parts, readings, int(host_parts * warmup_fraction))
  host["caches_after_warmup"] = caches_before
  host["caches_at_end"] = cache_sizes(buffer)

  body, inputs = jitted_body(buffer, kind)
  loop = harness.make_fused_loop(body, scan_length, inputs)
  key = jax.random.key(1)

  def jitted_part():
    holder["state"], acc = loop(holder["state"], key)
    acc.block_until_ready()

  jitted_parts = max(jitted_iterations // scan_length, readings)
  jitted = readings_of(
    jitted_part, jitted_parts, readings, max(1, int(jitted_parts * warmup_fraction))
  )
  jitted["programs"] = loop._cache_size()
  return {
    "host": host,
    "jitted": jitted,
    "host_calls": 3 * host_parts,
    "jitted_iterations": jitted_parts * scan_length,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kinds", nargs="*", default=list(KINDS))
  parser.add_argument("--host-calls", type=int, default=10**6)
  parser.add_argument("--jitted-iterations", type=int, default=10**7)
  parser.add_argument("--scan-length", type=int, default=10**4)
  parser.add_argument("--readings", type=int, default=10)
  parser.add_argument("--warmup", type=float, default=0.1)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json")
  args = parser.parse_args()
  if args.quick:
    args.host_calls, args.jitted_iterations = 3 * 10**4, 10**6
  harness.print_machine()
  results, verdicts = {}, []
  columns = [
    ("kind", 24),
    ("host calls", 11),
    ("host RSS MB", 17),
    ("growth", 7),
    ("live", 9),
    ("jitted it.", 11),
    ("jitted RSS MB", 17),
    ("growth", 7),
    ("live", 9),
    ("s", 6),
  ]
  print("".join(f"{name:>{width}}" for name, width in columns))
  for kind in args.kinds:
    result = soak(
      kind, args.host_calls, args.jitted_iterations, args.scan_length, args.readings, args.warmup
    )
    results[kind] = result
    host, jitted = result["host"], result["jitted"]
    row = [
      kind,
      result["host_calls"],
      f"{host['resident_mb'][0]}->{host['resident_mb'][-1]}",
      f"{100 * host['largest_growth']:+.1f}%",
      f"{host['live_arrays'][0]}->{host['live_arrays'][-1]}",
      result["jitted_iterations"],
      f"{jitted['resident_mb'][0]}->{jitted['resident_mb'][-1]}",
      f"{100 * jitted['largest_growth']:+.1f}%",
      f"{jitted['live_arrays'][0]}->{jitted['live_arrays'][-1]}",
      f"{host['seconds'] + jitted['seconds']:.0f}",
    ]
    print("".join(f"{value!s:>{width}}" for value, (_, width) in zip(row, columns)), flush=True)
    flat = (
      host["largest_growth"] <= 0.05
      and jitted["largest_growth"] <= 0.05
      and host["live_arrays"][-1] <= host["live_arrays"][0]
      and jitted["live_arrays"][-1] <= jitted["live_arrays"][0]
      and host["caches_at_end"] == host["caches_after_warmup"]
      and jitted["programs"] == 1
    )
    verdicts.append(
      f"{'PASS' if flat else 'FAIL'} {kind}: resident set "
      f"within 5% after warm-up, live arrays and compiled "
      f"programs not growing (caches {host['caches_at_end']}, "
      f"scan programs {jitted['programs']})"
    )
  print("\n".join(verdicts))
  harness.print_load_average_after()
  harness.write_json(args.json, results)


if __name__ == "__main__":
  main()
