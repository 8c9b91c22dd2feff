"""Kernels per fused iteration on a GPU or TPU, counted without one (issue 49).

Shape key: B add batch, S sample size, C capacity, K iterations per loop.

XLA compiles for a GPU or TPU target on a machine that has neither (a
deviceless ahead-of-time compile: `jax.experimental.topologies`), and the
program it gives is the optimized one a real card would run, fusions and
all. On a GPU at these sizes a fused iteration's cost is its launches and
their dependent latency, not its bytes, so the count of kernels one
iteration launches is the figure to keep low; it is what this script prints.

Each loop below is a benchmark's fused loop (`lax.scan` of K iterations),
lowered from abstract arguments (`jax.eval_shape` of its state: nothing is
filled or run) placed on one device of the target, compiled, and counted by
`common/hlo_kernels.py` (every fusion, custom call, copy, unfused gather or
scatter of the loop's body is one launch). `memory_analysis()` gives its
argument, output, alias and temporary bytes.

Targets: `h100` (XLA's H100 80GB HBM3 spec, `targets/h100.txtpb`), `h200`
(`targets/h200.txtpb`, written from NVIDIA's published figures: 141 GB,
4.8 TB/s, 132 SMs), both with the jax CUDA plugin; `tpu_v5e` (libtpu's
`v5e:2x2`), informative only: jaxbuf's Pallas kernels are written for
Triton, and a TPU runs the XLA path. Goals (H100):

* prioritized items <= 2x uniform items, at C = 1M; at 10M within 2
  kernels of 1M;
* prioritized windows <= 2x uniform windows;
* every selection rule (queue, heap, keep_best, `max_times_sampled`) <= 3x
  uniform items;
* no kind pays a launch per tree level: each kind with a tree has the same
  count at every depth (`levels`: C from 8**4 to 8**7).

Usage (needs `pip install -e ".[compile-targets]"`; about 10 minutes on 2 cores):
  python benchmarks/device/kernel_counts.py --json benchmarks/results/kernel_counts.json
  python benchmarks/device/kernel_counts.py --targets h100 --groups items selection
  python benchmarks/device/kernel_counts.py --on-device     # the visible device (a GPU run)
  python benchmarks/device/kernel_counts.py --table benchmarks/results/kernel_counts.json
"""

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable

# libtpu takes a lock per process; the counts compile for a TPU beside
# whatever else holds it (the suite's other workers).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "--on-device" not in sys.argv:  # a deviceless compile needs no backend but the CPU
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root
from benchmarks.common import harness  # noqa: E402
from benchmarks.common import hlo_kernels  # noqa: E402
from benchmarks.common import replay_adapters as replay  # noqa: E402
from benchmarks.common import sequence_adapters as sequence  # noqa: E402
from benchmarks.features import bench_selection as selection  # noqa: E402
from benchmarks.peers import bench_frames as frames  # noqa: E402
from benchmarks.peers import bench_hindsight as hindsight  # noqa: E402
import jaxbuf  # noqa: E402

TARGETS_DIR = pathlib.Path(__file__).resolve().parent / "targets"
GPU_TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}
TPU_TARGETS = {"tpu_v5e": "v5e:2x2"}
TARGETS = (*GPU_TARGETS, *TPU_TARGETS)
ITERATIONS = 4
GROUPS = ("items", "windows", "streams", "selection", "levels", "training")
LEVEL_CAPACITIES = (8**4, 8**5, 8**6, 8**7)

PRIORITIZED_OVER_UNIFORM = 2.0
LARGE_MINUS_SMALL = 2
WINDOWS_OVER_UNIFORM = 2.0
SELECTION_OVER_UNIFORM = 3.0


@dataclasses.dataclass(frozen=True)
class Loop:
  """A fused loop `loop(state, key) -> (state, checksum)` of `ITERATIONS`
  iterations over the state `state()` returns (abstract shapes will do)."""

  group: str
  name: str
  state: Callable[[], Any]
  loop: Callable[[Any, Any], Any]
  donate: bool = True  # False for a loop that returns its state untouched


def item_loops(capacity: int, suffix: str = "") -> list[Loop]:
  loops = []
  for kind in replay.KINDS:
    adapter = replay.jaxbuf_adapter(kind, capacity)
    loop = replay.make_fused_loop(adapter, ITERATIONS).__wrapped__
    loops.append(Loop("items", f"{kind} items{suffix}", adapter.init, loop))
  return loops


def window_loops(steps_per_env: int = 7840, period: int = 20) -> list[Loop]:
  loops = []
  for kind in ("uniform", "prioritized"):
    adapter = sequence.jaxbuf_adapter(kind, steps_per_env, period)
    loop = sequence.make_fused_loop(adapter, ITERATIONS).__wrapped__
    loops.append(Loop("windows", f"{kind} windows", adapter.init, loop))
  return loops


def sample_only_loop(buffer: Any, batch_size: int) -> Callable:
  """K samples of one state in a scan, summed: the state comes back untouched."""

  def loop(state, key):
    def body(acc, step_key):
      batch = buffer.sample(state, step_key, batch_size)
      return acc + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(batch)), None

    return state, jax.lax.scan(body, jnp.float32(0), jax.random.split(key, ITERATIONS))[0]

  return loop


def stream_loops() -> list[Loop]:
  stacked = frames.jaxbuf_buffer(200_000)
  her_capacity = 1_000_000 - 1_000_000 % hindsight.NUM_ENVS
  her = jaxbuf.hindsight_replay(hindsight.NUM_ENVS, her_capacity, hindsight.reward_fn)
  her_example = {
    "obs": {
      "observation": jnp.zeros(10),
      "achieved_goal": jnp.zeros(3),
      "desired_goal": jnp.zeros(3),
    },
    "action": jnp.zeros(hindsight.ACTION),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }
  episodes = jaxbuf.episode_replay(sequence.NUM_ENVS, sequence.NUM_ENVS * 7840, 40)
  base_obs = jax.random.normal(jax.random.key(1), (sequence.NUM_ENVS, sequence.OBS_SIZE))

  def episode_body(state, key, steps, acc):
    ends = jnp.arange(sequence.NUM_ENVS) % 30 == jnp.int32(steps["reward"][0]) % 30
    state = episodes.add(state, steps, episode_end=ends)
    batch = episodes.sample(state, key, sequence.SAMPLE_BATCH)
    return state, acc + sequence.checksum(batch.items, batch.weights)

  episode_loop = harness.make_fused_loop(
    episode_body, ITERATIONS, lambda step: sequence.env_steps(base_obs, step)
  ).__wrapped__
  return [
    Loop(
      "streams",
      "frame stacks",
      functools.partial(stacked.init, frames.frame_step()),
      frames.stack_loop(stacked, ITERATIONS),
    ),
    Loop(
      "streams",
      "hindsight sample",
      functools.partial(her.init, her_example),
      sample_only_loop(her, replay.SAMPLE_BATCH),
      donate=False,
    ),
    Loop(
      "streams",
      "episodes",
      functools.partial(episodes.init, sequence.example_step()),
      episode_loop,
    ),
  ]


def selection_loops(capacity: int = 1_000_000, suffix: str = "") -> list[Loop]:
  loops = []
  example = jax.tree.map(lambda x: x[0], selection.item_batch(1, 0.0))
  for name, (buffer, body, _) in selection.bodies(capacity).items():
    if name in ("uniform", "prioritized"):
      continue  # the items group's, at the same sizes
    loop = harness.make_fused_loop(
      body, ITERATIONS, lambda step: selection.item_batch(selection.ADD_BATCH, step)
    ).__wrapped__
    loops.append(
      Loop("selection", f"{name}{suffix}", functools.partial(buffer.init, example), loop)
    )
  return loops


def level_loops() -> list[Loop]:
  """Every kind with a tree at each capacity of `LEVEL_CAPACITIES`."""
  loops = []
  for capacity in LEVEL_CAPACITIES:
    suffix = f" C={capacity}"
    for loop in item_loops(capacity, suffix) + selection_loops(capacity, suffix):
      if "uniform items" not in loop.name and "queue" not in loop.name:
        loops.append(dataclasses.replace(loop, group="levels"))
  return loops


def training_loops() -> list[Loop]:
  from examples import dqn  # pylint: disable=import-outside-toplevel
  from examples import ppo  # pylint: disable=import-outside-toplevel

  loops = []
  for name, module, config in (
    ("DQN prioritized", dqn, dqn.Config(replay="prioritized")),
    ("DQN uniform", dqn, dqn.Config(replay="uniform")),
    ("PPO", ppo, ppo.Config()),
  ):
    trainer = module.make_trainer(config)

    def loop(state, key, step=trainer.step):
      del key
      return jax.lax.scan(lambda carry, _: step(carry), state, None, length=ITERATIONS)

    loops.append(Loop("training", name, functools.partial(trainer.init, jax.random.key(0)), loop))
  return loops


LOOP_GROUPS: dict[str, Callable[[], list[Loop]]] = {
  "items": lambda: item_loops(1_000_000) + item_loops(10_000_000, ", 10M"),
  "windows": window_loops,
  "streams": stream_loops,
  "selection": selection_loops,
  "levels": level_loops,
  "training": training_loops,
}


# ---------------------------------------------------------------- targets


def target_device(target: str) -> jax.Device:
  """One device of `target`, for a deviceless compile (or the visible one)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  if target == "device":
    return jax.devices()[0]
  if target in GPU_TARGETS:
    spec = (TARGETS_DIR / GPU_TARGETS[target]).read_text()
    topology = topologies.get_topology_desc(platform="cuda", target_config=spec, topology="1x1x1")
  else:
    topology = topologies.get_topology_desc(topology_name=TPU_TARGETS[target], platform="tpu")
  return topology.devices[0]


def placed(tree: Any, device: jax.Device) -> Any:
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def count(loop: Loop, device: jax.Device) -> dict[str, Any]:
  """Kernels per iteration and bytes of `loop` compiled for `device`."""
  start = time.perf_counter()
  state = placed(jax.eval_shape(loop.state), device)
  key = placed(jax.eval_shape(lambda: jax.random.key(0)), device)
  compiled = jax.jit(loop.loop, donate_argnums=0 if loop.donate else ()).lower(state, key).compile()
  memory = compiled.memory_analysis()
  return dict(
    kernels=hlo_kernels.kernels_per_iteration(compiled.as_text(), ITERATIONS),
    argument_bytes=memory.argument_size_in_bytes,
    output_bytes=memory.output_size_in_bytes,
    alias_bytes=memory.alias_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    compile_seconds=round(time.perf_counter() - start, 2),
  )


def count_all(targets: tuple[str, ...], groups: tuple[str, ...]) -> dict[str, dict[str, Any]]:
  """target -> loop name -> `count`'s figures (or the error)."""
  loops = [loop for group in groups for loop in LOOP_GROUPS[group]()]
  results: dict[str, dict[str, Any]] = {}
  for target in targets:
    try:
      device = target_device(target)
    except Exception as error:  # pylint: disable=broad-except
      results[target] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
      print(f"{target}: no target ({results[target]['error']})", flush=True)
      continue
    results[target] = {}
    for loop in loops:
      try:
        figures = count(loop, device)
      except Exception as error:  # pylint: disable=broad-except
        lines = str(error).strip().splitlines()
        figures = {"error": f"{type(error).__name__}: {lines[0] if lines else ''}"}
      results[target][loop.name] = dict(group=loop.group, **figures)
      shown = figures.get("kernels", figures.get("error"))
      print(f"{target:8} {loop.group:10} {loop.name:44} {shown}", flush=True)
  return results


# ---------------------------------------------------------------- goals


def judge(results: dict[str, dict[str, Any]], target: str = "h100") -> harness.Verdicts:
  verdicts = harness.Verdicts()
  counts = {name: row.get("kernels") for name, row in results.get(target, {}).items()}
  ratio = lambda a, b: None if counts.get(a) is None or not counts.get(b) else counts[a] / counts[b]
  if "uniform items" in counts:
    verdicts.judge(
      "prioritized items / uniform items (1M)",
      ratio("prioritized items", "uniform items"),
      PRIORITIZED_OVER_UNIFORM,
      higher_is_better=False,
    )
  if counts.get("prioritized items, 10M") is not None and counts.get("prioritized items"):
    verdicts.judge(
      "prioritized items 10M - 1M",
      counts["prioritized items, 10M"] - counts["prioritized items"],
      LARGE_MINUS_SMALL,
      higher_is_better=False,
      unit=" kernels",
    )
  if "uniform windows" in counts:
    verdicts.judge(
      "prioritized windows / uniform windows",
      ratio("prioritized windows", "uniform windows"),
      WINDOWS_OVER_UNIFORM,
      higher_is_better=False,
    )
  uniform = counts.get("uniform items")
  for name, row in results.get(target, {}).items():
    if row["group"] == "selection" and uniform:
      kernels = row.get("kernels")
      verdicts.judge(
        f"{name} / uniform items",
        None if kernels is None else kernels / uniform,
        SELECTION_OVER_UNIFORM,
        higher_is_better=False,
      )
  by_kind: dict[str, set[int]] = {}
  for name, row in results.get(target, {}).items():
    if row["group"] == "levels" and row.get("kernels") is not None:
      by_kind.setdefault(name.rsplit(" C=", 1)[0], set()).add(row["kernels"])
  for kind, seen in by_kind.items():
    verdicts.judge(
      f"{kind}: kernels across C = 8**4 .. 8**7 (max - min)",
      max(seen) - min(seen),
      0,
      higher_is_better=False,
      unit=" kernels",
    )
  return verdicts


def print_table(results: dict[str, dict[str, Any]]) -> None:
  targets = [target for target in results if "error" not in results[target]]
  names = list(dict.fromkeys(name for target in targets for name in results[target]))
  columns = [("loop", 46)] + [(f"{target} kernels", 15) for target in targets]
  if targets:
    columns.append((f"{targets[0]} temp MB", 13))
  rows = []
  for name in names:
    row: list[Any] = [name]
    for target in targets:
      figures = results[target].get(name, {})
      row.append(figures.get("kernels", "error" if "error" in figures else ""))
    first = results[targets[0]].get(name, {}) if targets else {}
    row.append(f"{first['temp_bytes'] / 1e6:.1f}" if "temp_bytes" in first else "")
    rows.append(row)
  harness.print_table(columns, rows)


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
  """The counts as a markdown table (docs/gpu.md, RESULTS.md), levels left out."""
  targets = [target for target in results if "error" not in results[target]]
  names = [
    name
    for name in dict.fromkeys(name for target in targets for name in results[target])
    if results[targets[0]].get(name, {}).get("group") != "levels"
  ]
  header = ["fused loop", *[f"{target} kernels" for target in targets], f"{targets[0]} temp bytes"]
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for name in names:
    counts = [str(results[target].get(name, {}).get("kernels", "error")) for target in targets]
    row = [name, *counts]
    row.append(f"{results[targets[0]].get(name, {}).get('temp_bytes', 0):,}")
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="+", choices=TARGETS, default=TARGETS)
  parser.add_argument("--groups", nargs="+", choices=GROUPS, default=GROUPS)
  parser.add_argument(
    "--on-device", action="store_true", help="count for the visible device instead"
  )
  parser.add_argument("--json", help="write the counts here")
  parser.add_argument(
    "--table", metavar="JSON", help="print the counts a --json run wrote as markdown, and stop"
  )
  args = parser.parse_args(argv)
  if args.table:
    print(markdown_table(json.loads(pathlib.Path(args.table).read_text())["counts"]))
    return
  machine = harness.print_machine(("jax", "jaxlib", "jax-cuda12-plugin", "libtpu", "numpy"))
  targets = ("device",) if args.on_device else tuple(args.targets)
  results = count_all(targets, tuple(args.groups))
  print()
  print_table(results)
  verdicts = judge(results, "device" if args.on_device else "h100")
  verdicts.print("Goals (kernels per iteration, H100 target)")
  if args.json:
    with open(args.json, "w") as output:
      json.dump(
        dict(machine=machine, iterations=ITERATIONS, counts=results, goals=verdicts.lines),
        output,
        indent=1,
        default=str,
      )
  harness.print_load_average_after()


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
