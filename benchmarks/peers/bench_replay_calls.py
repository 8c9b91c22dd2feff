"""Replay calls from a Python loop: jaxbuf, flashbax and cpprb, one process.

Shape key: B add batch (128), S sample size (256), C capacity.

Each operation (add B, sample S, update S priorities, and the three in a
row) is called from a plain Python loop with `block_until_ready` after every
call, the way a notebook user calls them; seconds per call, median of the
repeats. The updates reuse one fixed array of random priorities. jaxbuf's
default `buffer.add` is jitted with the state donated; the row "add,
undonated" times a naive `jax.jit(jaxbuf.uniform.add)`, which copies the
whole storage on every call. flashbax's functions are jitted as its README
does, `add` donated.

The same item and adapters as `bench_replay_fused.py`: `replay_adapters.py`.

On CPU, JAX hands each call to a worker thread (asynchronous dispatch);
`--sync-dispatch` (`jax_cpu_enable_async_dispatch=False`) runs it on the
calling thread instead. `--host-batches` uses a host-env loop's sizes
instead (add 4 items, sample and update 128) and judges jaxbuf's per-call
times against cpprb's: sample and update within 1.5x, add within 1.0x. On a
GPU the per-call `add` and prioritized `sample` at the largest capacity are
judged against a 0.1 ms target.

Usage:
  .venv/bin/python benchmarks/peers/bench_replay_calls.py           # several minutes
  .venv/bin/python benchmarks/peers/bench_replay_calls.py --quick   # seconds
"""

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
import jaxbuf
from benchmarks.common import replay_adapters as replay

OPERATIONS = ("add", "sample", "update", "add+sample+update")
ADD_SCALING = 1.5
HOST_ADD_BATCH, HOST_SAMPLE_BATCH = 4, 128
HOST_VS_CPPRB = {"add": 1.0, "sample": 1.5, "update": 1.5}
GPU_CALL_SECONDS = 1e-4


@dataclasses.dataclass
class Settings:
  capacities: tuple[int, ...]
  calls: int  # per timed Python loop
  undonated_calls: int  # the naive add copies C rows per call: fewer calls
  repeats: int
  libraries: tuple[str, ...] = replay.LIBRARIES
  kinds: tuple[str, ...] = replay.KINDS


FULL = Settings(capacities=(10_000, 100_000, 1_000_000), calls=200, undonated_calls=10, repeats=5)
QUICK = Settings(capacities=(10_000,), calls=20, undonated_calls=3, repeats=2)


def time_per_call(adapter: replay.Adapter, state, calls: int, repeats: int):
  """(state, {operation: seconds per call}) from a plain Python loop."""
  rng = np.random.default_rng(3)
  obs = adapter.to_device(rng.normal(size=(replay.ADD_BATCH, replay.OBS_SIZE)).astype(np.float32))
  priorities = adapter.to_device(rng.uniform(0.01, 1.0, replay.SAMPLE_BATCH).astype(np.float32))
  key = jax.random.key(0)
  holder = {"state": state}
  block = harness.block

  def add():
    holder["state"] = block(adapter.add(holder["state"], obs))

  def sample():
    return block(adapter.sample(holder["state"], key))

  fixed_batch = sample()

  def update():
    holder["state"] = block(adapter.update(holder["state"], fixed_batch, priorities))

  def step():
    add()
    batch = sample()
    holder["state"] = block(adapter.update(holder["state"], batch, priorities))

  operations = {"add": add, "sample": sample, "update": update, "add+sample+update": step}
  # Not interleaved: each operation's loop runs alone, as a user's would.
  seconds = {
    name: harness.time_call(operation, repeats=repeats, warmup=3, number=calls)
    for name, operation in operations.items()
  }
  return holder["state"], seconds


def time_undonated_add(state, calls: int, repeats: int) -> float:
  """A naive user's `jax.jit(jaxbuf.uniform.add)`: a full copy per call."""
  naive_add = jax.jit(jaxbuf.uniform.add)
  obs = {"obs": jnp.ones((replay.ADD_BATCH, replay.OBS_SIZE), jnp.float32)}
  holder = {"state": state}

  def add():
    holder["state"] = harness.block(naive_add(holder["state"], obs))

  return harness.time_call(add, repeats=repeats, warmup=1, number=calls)


def run_benchmark(settings: Settings) -> dict:
  results = dict(machine=harness.print_machine(), rows=[])
  for capacity in settings.capacities:
    for kind in settings.kinds:
      print(f"C={capacity} {kind}: filling", flush=True)
      adapters = {
        library: replay.ADAPTERS[library](kind, capacity) for library in settings.libraries
      }
      states = replay.fill_states(adapters, capacity)
      print(f"C={capacity} {kind}: per call", flush=True)
      per_call = {operation: {} for operation in OPERATIONS}
      for library, adapter in adapters.items():
        states[library], seconds = time_per_call(
          adapter, states[library], settings.calls, settings.repeats
        )
        for operation, value in seconds.items():
          per_call[operation][library] = value
      for operation in OPERATIONS:
        results["rows"].append(
          dict(
            capacity=capacity, kind=kind, mode=f"per call: {operation}", seconds=per_call[operation]
          )
        )
      if kind == "uniform" and "jaxbuf" in states:
        undonated = time_undonated_add(states["jaxbuf"], settings.undonated_calls, settings.repeats)
        results["rows"].append(
          dict(
            capacity=capacity,
            kind=kind,
            mode="per call: add, undonated",
            seconds={"jaxbuf": undonated},
          )
        )
      del states, adapters
  results["load_average_after"] = harness.print_load_average_after()
  results["verdicts"] = report(results, settings)
  return results


def report(results: dict, settings: Settings) -> list[str]:
  harness.print_table(
    replay.REPLAY_COLUMNS, [replay.replay_table_row(row) for row in results["rows"]]
  )
  rows = {(row["capacity"], row["kind"], row["mode"]): row["seconds"] for row in results["rows"]}
  verdicts = harness.Verdicts()
  smallest, largest = min(settings.capacities), max(settings.capacities)
  for kind in settings.kinds:
    small = rows.get((smallest, kind, "per call: add"), {}).get("jaxbuf")
    large = rows.get((largest, kind, "per call: add"), {}).get("jaxbuf")
    if largest > smallest and small and large:
      verdicts.judge(
        f"jaxbuf {kind} per-call donated add, C={largest} / C={smallest}",
        large / small,
        ADD_SCALING,
        higher_is_better=False,
      )
  if results["machine"]["backend"] == "gpu":
    for kind, operation in (("uniform", "add"), ("prioritized", "add"), ("prioritized", "sample")):
      seconds = rows.get((largest, kind, f"per call: {operation}"), {}).get("jaxbuf")
      verdicts.judge(
        f"GPU {kind} per call: {operation}, C={largest}, us",
        None if seconds is None else seconds * 1e6,
        GPU_CALL_SECONDS * 1e6,
        higher_is_better=False,
        unit="",
      )
  for capacity in settings.capacities:
    naive = rows.get((capacity, "uniform", "per call: add, undonated"))
    donated = rows.get((capacity, "uniform", "per call: add"))
    if naive and donated and donated.get("jaxbuf"):
      verdicts.info(
        f"jaxbuf naive jax.jit(uniform.add), C={capacity}: "
        f"{naive['jaxbuf'] / donated['jaxbuf']:.0f}x the donated "
        "buffer.add (a full storage copy per call)"
      )
  if replay.ADD_BATCH == HOST_ADD_BATCH:
    for kind in settings.kinds:
      for operation, target in HOST_VS_CPPRB.items():
        seconds = rows.get((largest, kind, f"per call: {operation}"), {})
        if "jaxbuf" in seconds and "cpprb" in seconds:
          verdicts.judge(
            f"host batches, {kind} per call: {operation}, C={largest}, jaxbuf/cpprb",
            seconds["jaxbuf"] / seconds["cpprb"],
            target,
            higher_is_better=False,
          )
  verdicts.print("Targets:")
  return verdicts.lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and few repeats: a smoke test"
  )
  parser.add_argument(
    "--sync-dispatch",
    action="store_true",
    help="jax_cpu_enable_async_dispatch=False: CPU programs run on the calling thread",
  )
  parser.add_argument(
    "--host-batches",
    action="store_true",
    help=f"add {HOST_ADD_BATCH} items, sample and update "
    f"{HOST_SAMPLE_BATCH}, as a host-env loop does",
  )
  replay.add_common_arguments(parser)
  args = parser.parse_args()
  if args.host_batches:
    replay.ADD_BATCH, replay.SAMPLE_BATCH = HOST_ADD_BATCH, HOST_SAMPLE_BATCH
  if args.sync_dispatch:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  settings = harness.override(
    QUICK if args.quick else FULL, args, ("capacities", "libraries", "kinds")
  )
  harness.write_json(args.json, run_benchmark(settings))


if __name__ == "__main__":
  main()
