"""Replay peak memory: the fused loop of jaxbuf, flashbax and cpprb at 1M items.

Shape key: B add batch (128), C capacity.

A fresh process per library and kind compiles the fused loop of
`bench_replay_fused.py` (from shapes alone, so the compiler's own memory is
spent before the baseline), then builds a buffer of C items and runs the
loop long enough to wrap the ring once; peak memory minus the memory before
the buffer existed, divided by the storage size C * 84 * 4 bytes. cpprb runs
its own Python loop. On CPU the peak is the process's resident set; on an
accelerator, the device allocator's counters (`harness.PeakMemory`).
`--quick` uses C = 100k, too small to judge: fixed overheads dominate.

Usage:
  .venv/bin/python benchmarks/peers/bench_replay_memory.py           # about a minute
  .venv/bin/python benchmarks/peers/bench_replay_memory.py --quick
"""

import argparse
import json
import math
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
from benchmarks.common import replay_adapters as replay

MEMORY_RATIO = 1.2


def measure_memory(library: str, kind: str, capacity: int) -> dict:
  """Runs in the child: peak memory of building and filling one buffer."""
  adapter = replay.ADAPTERS[library](kind, capacity)
  iterations = math.ceil(capacity / replay.ADD_BATCH) + 1  # wraps the ring
  key = jax.random.key(0)
  if library == "cpprb":
    loop = replay.make_cpprb_loop(adapter, iterations)
  else:
    abstract_state = jax.eval_shape(adapter.init)
    loop = replay.make_fused_loop(adapter, iterations).lower(abstract_state, key).compile()
  # cpprb's storage is host memory whatever JAX's backend.
  memory, seconds = harness.measure_peak(lambda: loop(adapter.init(), key), host=library == "cpprb")
  storage_bytes = capacity * replay.OBS_SIZE * 4
  return dict(
    library=library,
    kind=kind,
    capacity=capacity,
    measured=memory.measured,
    baseline_bytes=memory.baseline,
    peak_bytes=memory.peak,
    peak_was_reset=memory.peak_was_reset,
    storage_bytes=storage_bytes,
    iterations=iterations,
    seconds=seconds,
    ratio=memory.added / storage_bytes,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="C = 100k: a smoke test, too small to judge"
  )
  parser.add_argument("--capacity", type=int, default=None)
  parser.add_argument("--libraries", nargs="+", choices=replay.LIBRARIES, default=replay.LIBRARIES)
  parser.add_argument("--kinds", nargs="+", choices=replay.KINDS, default=replay.KINDS)
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument(
    "--child", nargs=3, metavar=("LIBRARY", "KIND", "CAPACITY"), help=argparse.SUPPRESS
  )
  args = parser.parse_args()
  if args.child:
    library, kind, capacity = args.child
    print(json.dumps(measure_memory(library, kind, int(capacity))))
    return
  capacity = args.capacity or (100_000 if args.quick else 1_000_000)
  machine = harness.print_machine()
  results = []
  for library in args.libraries:
    for kind in args.kinds:
      print(f"memory: {library} {kind}, C={capacity}", flush=True)
      result = harness.run_child(__file__, ["--child", library, kind, str(capacity)])
      results.append(dict(dict(library=library, kind=kind, capacity=capacity), **result))
  verdicts = harness.Verdicts()
  mib = 2**20
  for memory in results:
    name = (
      f"memory ({memory.get('measured', '?')}) {memory['library']} "
      f"{memory['kind']}, C={memory['capacity']}, "
      "(peak - before) / storage"
    )
    if "error" in memory:
      verdicts.info(f"{name}: error {memory['error']}")
      continue
    name += (
      f" = ({memory['peak_bytes'] / mib:.0f} - "
      f"{memory['baseline_bytes'] / mib:.0f} MiB) / "
      f"{memory['storage_bytes'] / mib:.0f} MiB"
    )
    if memory["library"] == "jaxbuf" and memory["capacity"] >= 1_000_000:
      verdicts.judge(name, memory["ratio"], MEMORY_RATIO, higher_is_better=False)
    else:
      verdicts.info(f"{name}: {memory['ratio']:.2f}x")
  verdicts.print("Memory:")
  harness.write_json(args.json, dict(machine=machine, memory=results, verdicts=verdicts.lines))


if __name__ == "__main__":
  main()
