"""Per-call cost of the plain calls a Python loop makes, from NumPy data.

A 4-env CartPole transition batch (obs and next_obs float32 [4, 4], action
int64 [4], reward float32 [4], terminated bool [4]) into a uniform buffer of
10,000: `buffer.add` from NumPy; `buffer.sample` of 128 with a fresh key
from `jax.random.split` against `step=`; and the floor of any jitted add, a
donated identity on the same state. Dispatch only: results are not waited
for, as a loop that goes on to the env step does not wait; the last call's
result is, so queued work is counted. Microseconds per call, the median of
interleaved repeats of `--calls` calls each.

Usage:
  python benchmarks/features/bench_host_calls.py [--calls 2000] [--repeats 7]
"""

import argparse
import inspect
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  harness.print_machine()
  buffer = jaxbuf.uniform_replay(10_000)
  example = dict(
    obs=np.zeros(4, np.float32),
    action=np.int64(0),
    reward=np.float32(0),
    next_obs=np.zeros(4, np.float32),
    terminated=np.bool_(False),
  )
  rng = np.random.default_rng(0)
  items = dict(
    obs=rng.normal(size=(4, 4)).astype(np.float32),
    action=rng.integers(0, 2, 4),
    reward=np.ones(4, np.float32),
    next_obs=rng.normal(size=(4, 4)).astype(np.float32),
    terminated=np.zeros(4, bool),
  )
  holder = {"state": buffer.add(buffer.init(example), dict(items, action=np.zeros(4, np.int64)))}
  key = jax.random.key(0)
  identity = jax.jit(lambda state: state, donate_argnums=0)

  def add():
    holder["state"] = buffer.add(holder["state"], items)
    return holder["state"]

  def floor():
    holder["state"] = identity(holder["state"])
    return holder["state"]

  def sample_split():
    holder["key"], sample_key = jax.random.split(holder.get("key", key))
    return buffer.sample(holder["state"], sample_key, 128)

  counter = iter(range(10**9))

  def sample_step():
    return buffer.sample(holder["state"], key, 128, step=next(counter))

  calls = {
    "add from NumPy": add,
    "jitted identity on the state (floor)": floor,
    "split + sample": sample_split,
    "sample(step=)": sample_step,
  }
  if "step" not in inspect.signature(buffer.sample).parameters:
    del calls["sample(step=)"]  # a jaxbuf from before step=, for comparison
  seconds = harness.time_interleaved(calls, repeats=args.repeats, warmup=2, number=args.calls)
  harness.print_table(
    [("call", -38), ("us per call", 12)],
    [(name, harness.microseconds(value)) for name, value in seconds.items()],
  )
  for name, value in seconds.items():
    print(f"info  {name}: {harness.microseconds(value)} us per call ({jax.default_backend()})")
  print(f"load average at end: {harness.load_average()}")


if __name__ == "__main__":
  main()
