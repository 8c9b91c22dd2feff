"""Sequence replay: jaxbuf vs flashbax's trajectory buffers, one process.

Shape key: N envs (128), T steps held per env, C = N * T capacity in steps,
L window length (40), P period (20 and 1), S windows sampled (64),
K iterations.

Every library stores the same env step, `obs` float32 `[84]`, `action`
int32, `reward` float32 and `terminated` bool, as N streams, and does the
same work per iteration: add one step for each of the N envs, sample S
windows of L consecutive steps (and, prioritized, set S new priorities,
computed from the sampled windows as a learner's sequence TD errors are).

* fused: K iterations in one jitted `lax.scan`, the state donated; time per
  iteration, median of the repeats, the libraries interleaved. The carry
  sums every sampled step, so no gather can be dropped as dead code.
  flashbax is called through its public API (`fbx.make_trajectory_buffer`,
  `fbx.make_prioritised_trajectory_buffer`), jaxbuf through
  `jaxbuf.sequence_replay` and `jaxbuf.prioritized_sequence_replay`.
  Two floors, bare arrays and no library (`sequence_adapters.py`):
  `floor_rows` gathers the S x L rows one flat index each, the ring
  wrapped (the access pattern jaxbuf used up to issue 36); `floor_slices`
  writes the step with one `dynamic_update_slice` and reads the S windows
  as S contiguous `dynamic_slice`s, vmapped. The targets are against
  `floor_slices`, the cheapest read of the same bytes as windows.
* fused add only: jaxbuf's add alone in a donated scan at C about 10k and
  about 1M: the add must cost the rows written, not the capacity.
* memory: a fresh process per library and kind compiles the fused loop from
  shapes, then builds a buffer of C steps and runs the loop until the ring
  has wrapped; peak memory minus the memory before the buffer existed,
  divided by the step storage (C times the bytes of one step).
* bytes per transition: every array of a jaxbuf state (storage, counters,
  sum tree), from shapes alone, divided by the transitions it holds; a
  sequence buffer holds each `obs` once, item replay of transitions stores
  `obs` and `next_obs`.

The same env step and adapters as `probe_sequence_floor.py`:
`sequence_adapters.py`.

`--against REVISION` adds jaxbuf as it was at that git revision
(`common/revisions.py`), timed interleaved with today's.

Usage:
  .venv/bin/python benchmarks/peers/bench_sequence.py           # several minutes
  .venv/bin/python benchmarks/peers/bench_sequence.py --libraries jaxbuf floor_slices \
    --no-memory --against d471062
  .venv/bin/python benchmarks/peers/bench_sequence.py --quick   # smoke run
  # on a loaded shared machine: short loops, many repeats, their minimum
  taskset -c 0 .venv/bin/python benchmarks/peers/bench_sequence.py --periods 20 \
      --no-memory --iterations 10 --repeats 100 --statistic min
"""

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
from benchmarks.common import revisions
import jaxbuf
from benchmarks.common import sequence_adapters as sequence

# Targets against the contiguous-slice floor (issue 36): the floor does no
# priority work, so prioritized replay is allowed the sum tree's descent and
# update above it. The flashbax ratio is a target for prioritized replay
# only.
TARGET_FLOOR = "floor_slices"
VS_FLOOR = {"uniform": 1.1, "prioritized": 1.5}
PRIORITIZED_VS_FLASHBAX = 3.0
ADD_SCALING = 1.5
MEMORY_RATIO = 1.2
BYTES_PER_TRANSITION_RATIO = 0.55


@dataclasses.dataclass
class Settings:
  steps_per_env: int
  periods: tuple[int, ...]
  iterations: int
  repeats: int
  libraries: tuple[str, ...] = sequence.LIBRARIES
  kinds: tuple[str, ...] = sequence.KINDS
  memory: bool = True
  statistic: str = "median"


STATISTICS = {"median": statistics.median, "min": min}


FULL = Settings(
  steps_per_env=sequence.LARGE_STEPS_PER_ENV, periods=(20, 1), iterations=200, repeats=5
)
QUICK = Settings(
  steps_per_env=sequence.SMALL_STEPS_PER_ENV, periods=(20,), iterations=20, repeats=2, memory=False
)


# ---------------------------------------------------------------- measures


def time_fused(settings: Settings, kind: str, period: int) -> dict[str, float]:
  adapters = {
    library: sequence.ADAPTERS[library](kind, settings.steps_per_env, period)
    for library in settings.libraries
  }
  states = {
    library: sequence.fill(adapter, settings.steps_per_env) for library, adapter in adapters.items()
  }
  loops = {
    library: sequence.make_fused_loop(adapter, settings.iterations)
    for library, adapter in adapters.items()
  }
  return harness.time_fused_loops(
    loops,
    states,
    iterations=settings.iterations,
    repeats=settings.repeats,
    statistic=STATISTICS[settings.statistic],
  )


def measure_memory(library: str, kind: str, steps_per_env: int, period: int) -> dict:
  """Runs in the child: peak memory of building and wrapping one buffer."""
  adapter = sequence.ADAPTERS[library](kind, steps_per_env, period)
  # One step per env each: the ring wraps.
  iterations = steps_per_env + sequence.SEQUENCE_LENGTH
  key = jax.random.key(0)
  loop = (
    sequence.make_fused_loop(adapter, iterations).lower(jax.eval_shape(adapter.init), key).compile()
  )
  memory, seconds = harness.measure_peak(lambda: loop(adapter.init(), key))
  storage_bytes = sequence.NUM_ENVS * steps_per_env * sequence.step_bytes()
  return dict(
    library=library,
    kind=kind,
    measured=memory.measured,
    baseline_bytes=memory.baseline,
    peak_bytes=memory.peak,
    storage_bytes=storage_bytes,
    seconds=seconds,
    ratio=memory.added / storage_bytes,
  )


def state_bytes(make_state: Callable[[], Any]) -> int:
  return sum(
    math.prod(leaf.shape) * leaf.dtype.itemsize
    for leaf in jax.tree.leaves(jax.eval_shape(make_state))
  )


def bytes_per_transition(kind: str, steps_per_env: int, period: int) -> dict[str, float]:
  """jaxbuf state bytes per transition held: sequence vs item replay."""
  capacity = sequence.NUM_ENVS * steps_per_env
  windows = sequence.jaxbuf_adapter(kind, steps_per_env, period)
  transition = dict(sequence.example_step(), next_obs=jnp.zeros(sequence.OBS_SIZE, jnp.float32))
  if kind == "uniform":
    items = jaxbuf.uniform_replay(capacity)
  else:
    items = jaxbuf.prioritized_replay(capacity, alpha=sequence.ALPHA, beta=sequence.BETA)
  return {
    "sequence": state_bytes(windows.init) / capacity,
    "item": state_bytes(lambda: items.init(transition)) / capacity,
  }


# ---------------------------------------------------------------- report


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="C = 10k, one period, few repeats: a smoke run"
  )
  parser.add_argument("--libraries", nargs="+", choices=sequence.LIBRARIES)
  parser.add_argument(
    "--statistic",
    choices=("median", "min"),
    default="median",
    help="over the interleaved repeats: min on a loaded shared machine",
  )
  parser.add_argument("--kinds", nargs="+", choices=sequence.KINDS)
  parser.add_argument("--periods", nargs="+", type=int)
  parser.add_argument("--iterations", type=int, help="K, iterations per fused loop")
  parser.add_argument("--repeats", type=int, help="interleaved repeats (more on a loaded machine)")
  parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument(
    "--against",
    metavar="REVISION",
    help="also time jaxbuf as it was at this git revision (jaxbuf@REVISION), interleaved",
  )
  parser.add_argument(
    "--child",
    nargs=4,
    metavar=("LIBRARY", "KIND", "STEPS_PER_ENV", "PERIOD"),
    help=argparse.SUPPRESS,
  )
  args = parser.parse_args()
  if args.child:
    library, kind, steps_per_env, period = args.child
    print(json.dumps(measure_memory(library, kind, int(steps_per_env), int(period))))
    return
  settings = harness.override(
    QUICK if args.quick else FULL, args, ("libraries", "kinds", "periods")
  )
  for name in ("iterations", "repeats", "statistic"):
    if getattr(args, name):
      settings = dataclasses.replace(settings, **{name: getattr(args, name)})
  if args.no_memory:
    settings = dataclasses.replace(settings, memory=False)
  if args.against:
    name = revisions.contender_name(args.against)
    old = revisions.jaxbuf_at(args.against)
    sequence.ADAPTERS[name] = revisions.against(sequence, old, sequence.jaxbuf_adapter)
    settings = dataclasses.replace(settings, libraries=(*settings.libraries, name))
  harness.write_json(args.json, run(settings))


def run(settings: Settings) -> dict:
  machine = harness.print_machine(("jax", "jaxlib", "numpy", "flashbax"))
  capacity = sequence.NUM_ENVS * settings.steps_per_env
  print(
    f"N={sequence.NUM_ENVS} envs, C={capacity:,} steps, "
    f"L={sequence.SEQUENCE_LENGTH}, S={sequence.SAMPLE_BATCH} windows, "
    f"K={settings.iterations}; step: obs [{sequence.OBS_SIZE}] float32, "
    "action int32, reward float32, terminated bool "
    f"({sequence.step_bytes()} bytes)",
    flush=True,
  )
  results = dict(machine=machine, rows=[], add_only={}, memory=[], bytes_per_transition={})
  verdicts = harness.Verdicts()
  for period in settings.periods:
    for kind in settings.kinds:
      print(f"fused: {kind}, period {period}", flush=True)
      seconds = time_fused(settings, kind, period)
      results["rows"].append(dict(kind=kind, period=period, seconds=seconds))
      verdicts.info(
        f"{kind} fused, period {period}, C={capacity:,}: "
        + ", ".join(
          f"{library} {harness.microseconds(value)} us" for library, value in seconds.items()
        )
        + " per iteration"
      )
      for floor in sequence.FLOORS:
        if "jaxbuf" not in seconds or floor not in seconds:
          continue
        name = f"{kind} fused, period {period}, C={capacity:,}, jaxbuf/{floor}"
        ratio = harness.ratio(seconds["jaxbuf"], seconds[floor])
        if floor == TARGET_FLOOR:
          verdicts.judge(name, ratio, VS_FLOOR[kind], higher_is_better=False)
        else:
          verdicts.info(f"{name}: {harness.ratio_text(ratio)}")
      for before in [library for library in seconds if library.startswith("jaxbuf@")]:
        verdicts.info(
          f"{kind} fused, period {period}, C={capacity:,}, {before}/jaxbuf: "
          f"{harness.ratio_text(harness.ratio(seconds[before], seconds.get('jaxbuf')))}"
        )
      if "jaxbuf" in seconds and "flashbax" in seconds:
        name = f"{kind} fused, period {period}, C={capacity:,}, flashbax/jaxbuf"
        ratio = harness.ratio(seconds["flashbax"], seconds["jaxbuf"])
        if kind == "prioritized":
          verdicts.judge(name, ratio, PRIORITIZED_VS_FLASHBAX)
        else:
          verdicts.info(f"{name}: {harness.ratio_text(ratio)}")
      if {"jaxbuf", "flashbax", TARGET_FLOOR} <= set(seconds):
        floor = seconds[TARGET_FLOOR]
        above = {library: seconds[library] - floor for library in ("jaxbuf", "flashbax")}
        verdicts.info(
          f"{kind} fused, period {period}, time above the slice floor "
          f"({floor * 1e6:.1f} us): jaxbuf {above['jaxbuf'] * 1e6:.1f} us, "
          f"flashbax {above['flashbax'] * 1e6:.1f} us"
        )
  period = settings.periods[0]
  small_capacity = sequence.NUM_ENVS * sequence.SMALL_STEPS_PER_ENV
  if "jaxbuf" in settings.libraries:
    for kind in settings.kinds:
      print(f"add only: {kind}", flush=True)
      small, large = (
        sequence.time_add_only("jaxbuf", kind, steps, period, settings.iterations, settings.repeats)
        for steps in (sequence.SMALL_STEPS_PER_ENV, settings.steps_per_env)
      )
      results["add_only"][kind] = dict(small=small, large=large)
      floors = [floor for floor in sequence.FLOORS if floor in settings.libraries]
      for floor in floors if kind == settings.kinds[0] else ():
        # The same ratio for bare arrays: what the memory hierarchy alone
        # charges for writing rows into 330 MB instead of a cached 3.4 MB.
        floor_small, floor_large = (
          sequence.time_add_only(floor, kind, steps, period, settings.iterations, settings.repeats)
          for steps in (sequence.SMALL_STEPS_PER_ENV, settings.steps_per_env)
        )
        results["add_only"][floor] = dict(small=floor_small, large=floor_large)
        verdicts.info(
          f"{floor} (bare arrays) add, C={capacity:,} / C="
          f"{small_capacity:,} ({floor_large * 1e6:.1f} / "
          f"{floor_small * 1e6:.1f} us): "
          f"{harness.ratio_text(harness.ratio(floor_large, floor_small))}"
        )
      verdicts.judge(
        f"jaxbuf {kind} fused add, C={capacity:,} / "
        f"C={small_capacity:,} ({large * 1e6:.1f} / "
        f"{small * 1e6:.1f} us)",
        harness.ratio(large, small),
        ADD_SCALING,
        higher_is_better=False,
      )
      per_transition = bytes_per_transition(kind, settings.steps_per_env, period)
      results["bytes_per_transition"][kind] = per_transition
      verdicts.judge(
        f"jaxbuf {kind} bytes per transition, sequence / item replay with "
        f"next_obs ({per_transition['sequence']:.1f} / "
        f"{per_transition['item']:.1f} B)",
        per_transition["sequence"] / per_transition["item"],
        BYTES_PER_TRANSITION_RATIO,
        higher_is_better=False,
      )
  memory_libraries = [
    library
    for library in settings.libraries
    if library not in sequence.FLOORS and not library.startswith("jaxbuf@")
  ]
  for library in memory_libraries if settings.memory else ():
    for kind in settings.kinds:
      print(f"memory: {library} {kind}", flush=True)
      memory = dict(
        dict(library=library, kind=kind),
        **harness.run_child(
          __file__, ["--child", library, kind, str(settings.steps_per_env), str(period)]
        ),
      )
      results["memory"].append(memory)
      name = (
        f"memory ({memory.get('measured', '?')}) {library} {kind}, "
        f"C={capacity:,}, (peak - before) / step storage"
      )
      if "error" in memory:
        verdicts.info(f"{name}: error {memory['error']}")
      elif library == "jaxbuf":
        mib = 2**20
        verdicts.judge(
          f"{name} = ({memory['peak_bytes'] / mib:.0f} - "
          f"{memory['baseline_bytes'] / mib:.0f} MiB) / "
          f"{memory['storage_bytes'] / mib:.0f} MiB",
          memory["ratio"],
          MEMORY_RATIO,
          higher_is_better=False,
        )
      else:
        verdicts.info(f"{name}: {memory['ratio']:.2f}x")
  results["load_average_after"] = harness.print_load_average_after()
  harness.print_table(
    (
      ("kind", -11),
      ("period", 6),
      ("jaxbuf us", 10),
      ("flashbax us", 11),
      ("rows floor us", 13),
      ("slices floor us", 15),
      ("jaxbuf/slices", 13),
      ("fbx/jaxbuf", 10),
    ),
    [
      [
        row["kind"],
        row["period"],
        harness.microseconds(row["seconds"].get("jaxbuf")),
        harness.microseconds(row["seconds"].get("flashbax")),
        harness.microseconds(row["seconds"].get("floor_rows")),
        harness.microseconds(row["seconds"].get("floor_slices")),
        harness.ratio_text(
          harness.ratio(row["seconds"].get("jaxbuf"), row["seconds"].get("floor_slices"))
        ),
        harness.ratio_text(
          harness.ratio(row["seconds"].get("flashbax"), row["seconds"].get("jaxbuf"))
        ),
      ]
      for row in results["rows"]
    ],
  )
  verdicts.print("Targets (time ratios are flashbax / jaxbuf, higher is better):")
  results["verdicts"] = verdicts.lines
  return results


if __name__ == "__main__":
  main()
