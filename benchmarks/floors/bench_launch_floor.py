"""The accelerator's launch floor (issue 41): every variant of every goal, one process.

Shape key: B add batch, S sample size, C capacity, K iterations per loop.

On a GPU a fused iteration moves a few hundred KB: its floor is kernel
launches and dependent latency, not bytes. Each goal below is timed with its
contenders interleaved (jaxbuf under every sum tree kernel variant,
flashbax, bare-array floors), each contender compiled once, ahead of time,
under its variant (`JAXBUF_SUM_TREE_KERNELS` is read while tracing), and its
kernels per iteration counted in the compiled HLO (`hlo_kernels.py`):
launches counted, not guessed.

* items: add 128 + sample 256 (+ update 256 priorities) at C = 1M and 10M:
  jaxbuf prioritized (each variant) and uniform, the uniform floor (bare
  `[C, 84]` array: one `dynamic_update_slice`, `randint`, one gather),
  flashbax's prioritized and flat buffers (`replay_adapters.py`). Goals:
  prioritized <= 2x uniform at 1M, 10M within 1.3x of 1M, >= 15x flashbax;
  uniform <= 1.1x its floor and >= 1.5x flashbax.
* windows: 128 envs add one step, sample 64 windows of 40 (+ update), 1M
  steps, period 20: jaxbuf uniform and prioritized (each variant), the row
  and slice floors, flashbax's trajectory buffers (`sequence_adapters.py`).
  Goals: uniform <= 1.15x the row floor and >= 1.3x flashbax; prioritized
  <= 2x the floor.
* stacks: 8 envs add an 84x84 frame, sample 32 stacks of 4, C = 200k:
  jaxbuf's frame-stack replay against flashbax's stored stacks
  (`bench_frames.py`). Goal: at or below flashbax's time.
* hindsight: K samples of 256 in one scan at C = 1M, HER against item
  replay (`bench_hindsight.py`). Goal: within 1.2x.

A contender that fails to compile (a kernel the backend cannot lower) is
reported n/a with its error; the others go on.

Usage (the device suite's `launch_floor` part runs it):
  python benchmarks/floors/bench_launch_floor.py                  # a GPU, ~3 minutes
  python benchmarks/floors/bench_launch_floor.py --smoke          # tiny, the CPU smoke
  python benchmarks/floors/bench_launch_floor.py --goals windows --json out.json
"""

import argparse
import collections
import dataclasses
import functools
import statistics
from typing import Any, Callable

import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness  # noqa: E402
from benchmarks.common import hlo_kernels  # noqa: E402
from benchmarks.common import replay_adapters as replay  # noqa: E402
from benchmarks.common import sequence_adapters as sequence  # noqa: E402
from benchmarks.peers import bench_frames as frames  # noqa: E402
from benchmarks.peers import bench_hindsight as hindsight  # noqa: E402
import jaxbuf  # noqa: E402
from jaxbuf._src.core import sum_tree  # noqa: E402

GOALS = ("items", "windows", "stacks", "hindsight")
PRIORITIZED_OVER_UNIFORM = 2.0
LARGE_OVER_SMALL = 1.3  # prioritized at 10M / at 1M
PRIORITIZED_VS_FLASHBAX = 15.0
UNIFORM_OVER_FLOOR = 1.1
UNIFORM_VS_FLASHBAX = 1.5
WINDOWS_OVER_ROW_FLOOR = 1.15
WINDOWS_VS_FLASHBAX = 1.3
PRIORITIZED_WINDOWS_OVER_FLOOR = 2.0
STACKS_OVER_FLASHBAX = 1.0
HINDSIGHT_OVER_ITEMS = 1.2


@dataclasses.dataclass(frozen=True)
class Settings:
  capacities: tuple[int, ...]  # items
  steps_per_env: int  # windows
  stack_capacity: int
  hindsight_capacity: int
  iterations: int  # K per timed call (stacks: steps per call)
  repeats: int
  variants: tuple[str, ...] = sum_tree.KERNEL_VARIANTS
  statistic: str = "median"
  # The smoke run leaves flashbax out: the device suite's replay_fused,
  # sequence and frames parts smoke the same adapters, and each contender
  # compiled costs the CI seconds.
  with_flashbax: bool = True


FULL = Settings(
  capacities=(1_000_000, 10_000_000),
  steps_per_env=sequence.LARGE_STEPS_PER_ENV,
  stack_capacity=200_000,
  hindsight_capacity=1_000_000,
  iterations=100,
  repeats=7,
)
SMOKE = Settings(
  capacities=(1024,),
  steps_per_env=sequence.SMALL_STEPS_PER_ENV,
  stack_capacity=800,
  hindsight_capacity=1600,
  iterations=2,
  repeats=1,
  variants=("xla", "pallas"),  # "pallas" runs both kernels
  with_flashbax=False,
)


@dataclasses.dataclass
class Contender:
  """One timed loop: `loop(state, key) -> (state, checksum)`, K iterations,
  traced under the sum tree kernel `variant` (None: the backend's default)."""

  name: str
  init: Callable[[], Any]  # -> the filled state
  loop: Callable[[Any, Any], Any]
  variant: str | None = None
  donate: bool = True  # False for a loop that returns its state untouched


# ---------------------------------------------------------------- timing


def time_contenders(
  contenders: list[Contender], settings: Settings, iterations: int
) -> dict[str, dict[str, Any]]:
  """name -> seconds per iteration and kernels per iteration, or the error."""
  results: dict[str, dict[str, Any]] = {}
  calls = {}
  key = jax.random.key(0)
  for contender in contenders:
    try:
      state = contender.init()
      with harness.sum_tree_kernels(contender.variant):
        compiled = (
          jax.jit(contender.loop, donate_argnums=0 if contender.donate else ())
          .lower(state, key)
          .compile()
        )
    except Exception as error:  # pylint: disable=broad-except
      message = str(error).strip().splitlines()
      results[contender.name] = dict(
        error=f"{type(error).__name__}: {message[0] if message else ''}"
      )
      continue
    kernels = hlo_kernels.kernels_per_iteration(compiled.as_text(), iterations)
    results[contender.name] = dict(kernels=kernels)
    calls[contender.name] = harness.carrying(
      lambda state, compiled=compiled: compiled(state, key), state
    )
  statistic = min if settings.statistic == "min" else statistics.median
  seconds = harness.time_interleaved(calls, repeats=settings.repeats, warmup=2, statistic=statistic)
  for name, value in seconds.items():
    results[name]["seconds"] = value / iterations
  return results


def variant_name(kind: str, variant: str) -> str:
  return f"jaxbuf {kind} ({variant})"


# ---------------------------------------------------------------- goals


def items_goal(settings: Settings, capacity: int) -> list[Contender]:
  fill_obs = lambda: jax.random.normal(jax.random.key(0), (capacity, replay.OBS_SIZE))

  def adapted(adapter: replay.Adapter) -> tuple[Callable[[], Any], Callable]:
    init = lambda: jax.block_until_ready(adapter.fill(adapter.init(), fill_obs()))
    return init, replay.make_fused_loop(adapter, settings.iterations).__wrapped__

  contenders = []
  for variant in settings.variants:
    init, loop = adapted(replay.jaxbuf_adapter("prioritized", capacity))
    contenders.append(Contender(variant_name("prioritized", variant), init, loop, variant))
  for library, kind in (
    ("jaxbuf", "uniform"),
    ("flashbax", "prioritized"),
    ("flashbax", "uniform"),
  ):
    if library == "flashbax" and not settings.with_flashbax:
      continue
    init, loop = adapted(replay.ADAPTERS[library](kind, capacity))
    contenders.append(Contender(f"{library} {kind}", init, loop))
  contenders.append(
    Contender("uniform floor", lambda: (fill_obs(), jnp.int32(0)), uniform_floor_loop(settings))
  )
  return contenders


def uniform_floor_loop(settings: Settings) -> Callable:
  """Bare arrays: a ring `[C, 84]` and its write position; one
  `dynamic_update_slice` of B rows, `randint`, one gather of S rows."""
  base_obs = jax.random.normal(jax.random.key(1), (replay.ADD_BATCH, replay.OBS_SIZE))

  def body(state, key, obs, acc):
    storage, position = state
    capacity = storage.shape[0]
    storage = jax.lax.dynamic_update_slice(storage, obs, (position, 0))
    position = (position + replay.ADD_BATCH) % (capacity - replay.ADD_BATCH + 1)
    rows = jax.random.randint(key, (replay.SAMPLE_BATCH,), 0, capacity)
    sampled = storage.at[rows].get(mode="promise_in_bounds")
    return (storage, position), acc + jnp.sum(sampled)

  return harness.make_fused_loop(
    body, settings.iterations, lambda step: base_obs + step
  ).__wrapped__


def windows_goal(settings: Settings) -> list[Contender]:
  period = 20

  def adapted(library: str, kind: str) -> tuple[Callable[[], Any], Callable]:
    adapter = sequence.ADAPTERS[library](kind, settings.steps_per_env, period)
    init = lambda: sequence.fill(adapter, settings.steps_per_env)
    return init, sequence.make_fused_loop(adapter, settings.iterations).__wrapped__

  contenders = []
  for variant in settings.variants:
    init, loop = adapted("jaxbuf", "prioritized")
    contenders.append(Contender(variant_name("prioritized", variant), init, loop, variant))
  for library, kind in (
    ("jaxbuf", "uniform"),
    ("flashbax", "uniform"),
    ("flashbax", "prioritized"),
    ("floor_rows", "uniform"),
    ("floor_slices", "uniform"),
  ):
    if library == "flashbax" and not settings.with_flashbax:
      continue
    init, loop = adapted(library, kind)
    name = library if library.startswith("floor") else f"{library} {kind}"
    contenders.append(Contender(name, init, loop))
  return contenders


def stacks_goal(settings: Settings) -> list[Contender]:
  # Frame-stack replay draws its transitions from a sum tree too (leaf 1
  # per sampleable transition) and writes it in every add. A buffer per
  # contender: a buffer's functions are jitted, and keep the variant of
  # their first trace.
  contenders = []
  for variant in settings.variants:
    stacked = frames.jaxbuf_buffer(settings.stack_capacity)
    contenders.append(
      Contender(
        variant_name("stacks", variant),
        functools.partial(stacked.init, frames.frame_step()),
        frames.stack_loop(stacked, settings.iterations),
        variant,
      )
    )
  if settings.with_flashbax:
    stored = frames.flashbax_buffer(settings.stack_capacity)
    contenders.append(
      Contender(
        "flashbax stored stacks",
        lambda: stored.init(frames.stacked_item()),
        frames.stored_stack_loop(stored, settings.iterations),
      )
    )
  return contenders


def hindsight_goal(settings: Settings) -> list[Contender]:
  capacity = settings.hindsight_capacity - settings.hindsight_capacity % hindsight.NUM_ENVS

  def sample_loop(buffer) -> Callable:
    def loop(state, key):
      def body(acc, step_key):
        batch = buffer.sample(state, step_key, replay.SAMPLE_BATCH)
        leaves = jax.tree.leaves(batch)
        return acc + sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves), None

      keys = jax.random.split(key, settings.iterations)
      return state, jax.lax.scan(body, jnp.float32(0), keys)[0]

    return loop

  _, her_held = hindsight.her_state(capacity)
  items, items_held = hindsight.item_state(capacity)
  # HER descends its sum tree only to redraw a rare transition that starts
  # no episode step; each variant is timed all the same. Sampling leaves the
  # state as it was: nothing to donate (a donated state handed back
  # untouched would be deleted).
  return [
    Contender(
      variant_name("hindsight sample", variant),
      lambda: her_held,
      # A buffer per variant (see `stacks_goal`), over the same state.
      sample_loop(jaxbuf.hindsight_replay(hindsight.NUM_ENVS, capacity, hindsight.reward_fn)),
      variant,
      donate=False,
    )
    for variant in settings.variants
  ] + [Contender("jaxbuf item sample", lambda: items_held, sample_loop(items), donate=False)]


# ---------------------------------------------------------------- verdicts


def judge_items(
  verdicts: harness.Verdicts, by_capacity: dict[int, dict], settings: Settings
) -> None:
  seconds = {
    capacity: {name: row.get("seconds") for name, row in rows.items()}
    for capacity, rows in by_capacity.items()
  }
  small, large = min(seconds), max(seconds)
  for capacity, times in seconds.items():
    uniform = times.get("jaxbuf uniform")
    for variant in settings.variants:
      prioritized = times.get(variant_name("prioritized", variant))
      name = f"items C={capacity:,}, prioritized ({variant})"
      if capacity == small:
        verdicts.judge(
          f"{name} / uniform",
          harness.ratio(prioritized, uniform),
          PRIORITIZED_OVER_UNIFORM,
          higher_is_better=False,
        )
      verdicts.judge(
        f"{name}, flashbax/jaxbuf",
        harness.ratio(times.get("flashbax prioritized"), prioritized),
        PRIORITIZED_VS_FLASHBAX,
      )
      if capacity == large and large > small:
        verdicts.judge(
          f"items prioritized ({variant}), C={large:,} / C={small:,}",
          harness.ratio(prioritized, seconds[small].get(variant_name("prioritized", variant))),
          LARGE_OVER_SMALL,
          higher_is_better=False,
        )
    verdicts.judge(
      f"items C={capacity:,}, uniform / floor",
      harness.ratio(uniform, times.get("uniform floor")),
      UNIFORM_OVER_FLOOR,
      higher_is_better=False,
    )
    verdicts.judge(
      f"items C={capacity:,}, uniform, flashbax/jaxbuf",
      harness.ratio(times.get("flashbax uniform"), uniform),
      UNIFORM_VS_FLASHBAX,
    )


def judge_windows(verdicts: harness.Verdicts, rows: dict, settings: Settings) -> None:
  times = {name: row.get("seconds") for name, row in rows.items()}
  uniform = times.get("jaxbuf uniform")
  verdicts.judge(
    "windows uniform / row floor",
    harness.ratio(uniform, times.get("floor_rows")),
    WINDOWS_OVER_ROW_FLOOR,
    higher_is_better=False,
  )
  verdicts.judge(
    "windows uniform, flashbax/jaxbuf",
    harness.ratio(times.get("flashbax uniform"), uniform),
    WINDOWS_VS_FLASHBAX,
  )
  for variant in settings.variants:
    verdicts.judge(
      f"windows prioritized ({variant}) / row floor",
      harness.ratio(times.get(variant_name("prioritized", variant)), times.get("floor_rows")),
      PRIORITIZED_WINDOWS_OVER_FLOOR,
      higher_is_better=False,
    )
  verdicts.info(
    "windows uniform / slice floor: "
    + harness.ratio_text(harness.ratio(uniform, times.get("floor_slices")))
  )


def judge_variants_against(
  verdicts: harness.Verdicts, rows: dict, settings: Settings, kind: str, peer: str, target: float
) -> None:
  """Each variant's time of `kind` over `peer`'s, judged `<= target`."""
  for variant in settings.variants:
    times = [rows.get(name, {}).get("seconds") for name in (variant_name(kind, variant), peer)]
    verdicts.judge(
      f"{kind} ({variant}) / {peer}", harness.ratio(*times), target, higher_is_better=False
    )


# ---------------------------------------------------------------- main


def run(settings: Settings, goals: tuple[str, ...]) -> dict:
  machine = harness.print_machine(("jax", "jaxlib", "numpy", "flashbax"))
  print(
    f"sum tree kernel variants: {settings.variants}; backend default: {sum_tree.kernel_variant()}"
  )
  results: dict[str, Any] = dict(machine=machine, settings=dataclasses.asdict(settings), goals={})
  verdicts = harness.Verdicts()
  table = []

  def timed(goal: str, contenders: list[Contender], iterations: int) -> dict:
    print(f"== {goal}", flush=True)
    rows = time_contenders(contenders, settings, iterations)
    results["goals"][goal] = rows
    # Printed as each goal ends, so a run stopped at its budget keeps them.
    for name, row in rows.items():
      table.append((goal, name, harness.microseconds(row.get("seconds")), row.get("kernels", "-")))
      if "error" in row:
        print(f"info  {goal}: {name} n/a, {row['error']}", flush=True)
      else:
        print(
          f"info  {goal}: {name} {harness.microseconds(row['seconds'])} us per iteration, "
          f"{row['kernels']} kernels per iteration",
          flush=True,
        )
    return rows

  if "items" in goals:
    by_capacity = collections.OrderedDict()
    for capacity in settings.capacities:
      by_capacity[capacity] = timed(
        f"items C={capacity:,}", items_goal(settings, capacity), settings.iterations
      )
    judge_items(verdicts, by_capacity, settings)
  if "windows" in goals:
    judge_windows(verdicts, timed("windows", windows_goal(settings), settings.iterations), settings)
  if "stacks" in goals:
    rows = timed("stacks", stacks_goal(settings), settings.iterations)
    judge_variants_against(
      verdicts, rows, settings, "stacks", "flashbax stored stacks", STACKS_OVER_FLASHBAX
    )
  if "hindsight" in goals:
    rows = timed("hindsight", hindsight_goal(settings), settings.iterations)
    judge_variants_against(
      verdicts, rows, settings, "hindsight sample", "jaxbuf item sample", HINDSIGHT_OVER_ITEMS
    )
  print()
  harness.print_table(
    [("goal", -16), ("contender", -30), ("us/iteration", 13), ("kernels", 8)], table
  )
  results["load_average_after"] = harness.print_load_average_after()
  verdicts.print("Targets (issue 41):")
  results["verdicts"] = verdicts.lines
  return results


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes: the CPU smoke run")
  parser.add_argument("--goals", nargs="+", choices=GOALS, default=list(GOALS))
  parser.add_argument("--capacities", nargs="+", type=int, help="items' capacities")
  parser.add_argument("--variants", nargs="+", choices=sum_tree.KERNEL_VARIANTS)
  parser.add_argument("--iterations", type=int)
  parser.add_argument("--repeats", type=int)
  parser.add_argument("--statistic", choices=("median", "min"))
  parser.add_argument("--json", help="also write the results to this file")
  args = parser.parse_args(argv)
  settings = harness.override(SMOKE if args.smoke else FULL, args, ("capacities", "variants"))
  for name in ("iterations", "repeats", "statistic"):
    if getattr(args, name):
      settings = dataclasses.replace(settings, **{name: getattr(args, name)})
  harness.write_json(args.json, run(settings, tuple(args.goals)))


if __name__ == "__main__":
  main()
