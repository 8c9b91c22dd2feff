"""Replay fused loops: jaxbuf, flashbax and cpprb side by side, one process.

Shape key: B add batch (128), S sample size (256), C capacity, K iterations.

One iteration is add B items + sample S (+ set S new priorities, computed
from the sampled items, for prioritized replay), inside one jitted
`lax.scan` of K iterations with the state donated; time per iteration,
median of the repeats, the libraries interleaved. The carry sums every
sampled item, so no work can be dropped as dead code. cpprb has no fused
mode: its figure is its own Python loop. "fused: add only" is jaxbuf's add
alone in a donated scan: its device time, with no dispatch, at each capacity.

The same item and adapters as `bench_replay_calls.py` (one call at a time
from Python) and `bench_replay_memory.py` (peak memory of this loop):
`replay_adapters.py`.

Nothing here is device specific: run it where JAX sees a GPU and the JAX
libraries run there (cpprb stays on the host). On a small shared CPU machine
`taskset -c 0 .venv/bin/python benchmarks/peers/bench_replay_fused.py` runs every
library on one core, which shows the work without the thread-pool hand-offs.

`--against REVISION` adds jaxbuf as it was at that git revision
(`common/revisions.py`), timed interleaved with today's: before and after in
one run.

Usage:
  .venv/bin/python benchmarks/peers/bench_replay_fused.py           # several minutes
  .venv/bin/python benchmarks/peers/bench_replay_fused.py --libraries jaxbuf --against d471062
  .venv/bin/python benchmarks/peers/bench_replay_fused.py --quick   # seconds
"""

import pathlib
import sys
import argparse
import dataclasses

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
from benchmarks.common import replay_adapters as replay
from benchmarks.common import revisions

PRIORITIZED_VS_FLASHBAX = 10.0
PRIORITIZED_VS_CPPRB = 3.0
PRIORITIZED_OVER_UNIFORM = 1.6  # jaxbuf's own prioritized / uniform time, at 1M
UNIFORM_VS_FLASHBAX = 1.5
UNIFORM_VS_CPPRB = 1.0


@dataclasses.dataclass
class Settings:
  capacities: tuple[int, ...]
  iterations: int  # K, per timed fused call
  repeats: int
  libraries: tuple[str, ...] = replay.LIBRARIES
  kinds: tuple[str, ...] = replay.KINDS


FULL = Settings(capacities=(10_000, 100_000, 1_000_000), iterations=200, repeats=5)
QUICK = Settings(capacities=(10_000,), iterations=20, repeats=2)


def time_fused_add_only(capacity: int, kind: str, iterations: int, repeats: int) -> float:
  """jaxbuf add alone in a donated scan: its device time, no dispatch."""
  adapter = replay.jaxbuf_adapter(kind, capacity)
  base_obs = jax.random.normal(jax.random.key(1), (replay.ADD_BATCH, replay.OBS_SIZE))
  loop = harness.make_add_loop(adapter.add, iterations, lambda step: base_obs + step)
  return harness.time_add_loop(loop, adapter.init(), iterations=iterations, repeats=repeats)


def run_benchmark(settings: Settings) -> dict:
  results = dict(machine=harness.print_machine(), rows=[])
  for capacity in settings.capacities:
    for kind in settings.kinds:
      print(f"C={capacity} {kind}: filling", flush=True)
      adapters = {
        library: replay.ADAPTERS[library](kind, capacity) for library in settings.libraries
      }
      states = replay.fill_states(adapters, capacity)
      print(f"C={capacity} {kind}: fused", flush=True)
      loops = {
        library: replay.make_loop(adapter, settings.iterations)
        for library, adapter in adapters.items()
      }
      fused = harness.time_fused_loops(
        loops, states, iterations=settings.iterations, repeats=settings.repeats
      )
      results["rows"].append(dict(capacity=capacity, kind=kind, mode="fused", seconds=fused))
      del states, loops, adapters
      if "jaxbuf" in settings.libraries:
        add_only = time_fused_add_only(capacity, kind, settings.iterations, settings.repeats)
        results["rows"].append(
          dict(capacity=capacity, kind=kind, mode="fused: add only", seconds={"jaxbuf": add_only})
        )
  results["load_average_after"] = harness.print_load_average_after()
  results["verdicts"] = report(results, settings)
  return results


def report(results: dict, settings: Settings) -> list[str]:
  harness.print_table(
    replay.REPLAY_COLUMNS, [replay.replay_table_row(row) for row in results["rows"]]
  )
  verdicts = harness.Verdicts()
  targets = {
    ("uniform", "flashbax"): UNIFORM_VS_FLASHBAX,
    ("uniform", "cpprb"): UNIFORM_VS_CPPRB,
    ("prioritized", "flashbax"): PRIORITIZED_VS_FLASHBAX,
    ("prioritized", "cpprb"): PRIORITIZED_VS_CPPRB,
  }
  for row in results["rows"]:
    if row["mode"] != "fused":
      continue
    times = row["seconds"]
    for peer in ("flashbax", "cpprb"):
      if peer in times and "jaxbuf" in times:
        verdicts.judge(
          f"{row['kind']} fused, C={row['capacity']}, {peer}/jaxbuf",
          harness.ratio(times[peer], times["jaxbuf"]),
          targets[(row["kind"], peer)],
        )
  for row in results["rows"]:
    verdicts.info(
      f"{row['kind']} {row['mode']}, C={row['capacity']}: "
      + ", ".join(
        f"{library} {harness.microseconds(seconds)} us"
        for library, seconds in row["seconds"].items()
      )
      + " per iteration"
    )
  fused = {
    (row["capacity"], row["kind"]): row["seconds"].get("jaxbuf")
    for row in results["rows"]
    if row["mode"] == "fused"
  }
  for capacity in settings.capacities:
    uniform, prioritized = (fused.get((capacity, kind)) for kind in ("uniform", "prioritized"))
    if uniform and prioritized:
      name = f"jaxbuf prioritized / uniform fused, C={capacity}"
      ratio = prioritized / uniform
      if capacity == 1_000_000:
        verdicts.judge(name, ratio, PRIORITIZED_OVER_UNIFORM, higher_is_better=False)
      else:
        verdicts.info(f"{name}: {ratio:.2f}x")
  add_only = {
    (row["capacity"], row["kind"]): row["seconds"]["jaxbuf"]
    for row in results["rows"]
    if row["mode"] == "fused: add only"
  }
  smallest, largest = min(settings.capacities), max(settings.capacities)
  for kind in settings.kinds:
    if largest > smallest and (largest, kind) in add_only:
      # Device time alone: at 10k the storage sits in cache, at 1M each add
      # writes 43 KB of cold memory; a copy would be 1000x, not 2x.
      verdicts.info(
        f"jaxbuf {kind} fused add, C={largest} / C={smallest}: "
        f"{add_only[(largest, kind)] / add_only[(smallest, kind)]:.2f}x "
        "(no dispatch; cache effects, not copies)"
      )
  for row in results["rows"]:
    times = row["seconds"]
    for name in times:
      if name.startswith("jaxbuf@") and times.get("jaxbuf"):
        verdicts.info(
          f"{row['kind']} {row['mode']}, C={row['capacity']}, {name}/jaxbuf: "
          f"{harness.ratio_text(harness.ratio(times[name], times['jaxbuf']))} "
          f"({harness.microseconds(times[name])} us before, "
          f"{harness.microseconds(times['jaxbuf'])} us now)"
        )
  verdicts.print("Targets (ratios are library time / jaxbuf time, so higher is better):")
  return verdicts.lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and few repeats: a smoke test"
  )
  replay.add_common_arguments(parser)
  parser.add_argument(
    "--against",
    metavar="REVISION",
    help="also time jaxbuf as it was at this git revision (jaxbuf@REVISION), interleaved",
  )
  args = parser.parse_args()
  settings = harness.override(
    QUICK if args.quick else FULL, args, ("capacities", "libraries", "kinds")
  )
  if args.against:
    name = revisions.contender_name(args.against)
    old = revisions.jaxbuf_at(args.against)
    replay.ADAPTERS[name] = revisions.against(replay, old, replay.jaxbuf_adapter)
    settings = dataclasses.replace(settings, libraries=(*settings.libraries, name))
  harness.write_json(args.json, run_benchmark(settings))


if __name__ == "__main__":
  main()
