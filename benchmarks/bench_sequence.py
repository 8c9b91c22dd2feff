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

Usage:
  .venv/bin/python benchmarks/bench_sequence.py           # several minutes
  .venv/bin/python benchmarks/bench_sequence.py --quick   # smoke run
"""

import argparse
import dataclasses
import json
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import harness
import jaxbuf

NUM_ENVS = 128
OBS_SIZE = 84
SEQUENCE_LENGTH = 40
SAMPLE_BATCH = 64
ALPHA = 0.6
BETA = 0.4
LIBRARIES = ("jaxbuf", "flashbax", "floor")
KINDS = ("uniform", "prioritized")
# Steps held per env: 7840 (C = 1,003,520) and 80 (C = 10,240), multiples
# of every period and window length here, so no library rounds them.
LARGE_STEPS_PER_ENV = 7840
SMALL_STEPS_PER_ENV = 80

UNIFORM_VS_FLASHBAX = 2.0
PRIORITIZED_VS_FLASHBAX = 10.0
ADD_SCALING = 1.5
MEMORY_RATIO = 1.2
BYTES_PER_TRANSITION_RATIO = 0.55


@dataclasses.dataclass
class Settings:
  steps_per_env: int
  periods: tuple[int, ...]
  iterations: int
  repeats: int
  libraries: tuple[str, ...] = LIBRARIES
  kinds: tuple[str, ...] = KINDS
  memory: bool = True


FULL = Settings(steps_per_env=LARGE_STEPS_PER_ENV, periods=(20, 1),
                iterations=200, repeats=5)
QUICK = Settings(steps_per_env=SMALL_STEPS_PER_ENV, periods=(20,),
                 iterations=20, repeats=2, memory=False)


def example_step() -> dict[str, jax.Array]:
  return {"obs": jnp.zeros(OBS_SIZE, jnp.float32),
          "action": jnp.zeros((), jnp.int32),
          "reward": jnp.zeros((), jnp.float32),
          "terminated": jnp.zeros((), jnp.bool_)}


def step_bytes() -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(example_step()))


def env_steps(base_obs: jax.Array, offset) -> dict[str, jax.Array]:
  """One step for each of the N envs, `obs [N, 84]`, the others `[N]`."""
  return {"obs": base_obs + offset,
          "action": jnp.full((NUM_ENVS,), 1, jnp.int32),
          "reward": jnp.full((NUM_ENVS,), 0.5, jnp.float32),
          "terminated": jnp.zeros((NUM_ENVS,), jnp.bool_)}


def checksum(windows: dict[str, jax.Array], weights) -> jax.Array:
  """Everything sampled flows into this sum, so no gather can be skipped."""
  return (jnp.sum(windows["obs"]) + jnp.sum(windows["reward"])
          + jnp.sum(windows["action"]).astype(jnp.float32)
          + jnp.sum(windows["terminated"]).astype(jnp.float32)
          + jnp.sum(weights))


def stand_in_td_errors(windows: dict[str, jax.Array]) -> jax.Array:
  """`[S]` priorities from the sampled windows `obs [S, L, 84]`."""
  return jnp.abs(windows["obs"][:, 0, 0]) + 0.01


# ---------------------------------------------------------------- adapters


@dataclasses.dataclass
class Adapter:
  library: str
  kind: str
  init: Callable[[], Any]
  # (state, chunk with leaves [N, T', ...]) -> state; jitted, donated
  add_chunk: Callable[[Any, Any], Any]
  # (state, key, steps [N, ...], acc) -> (state, acc); traced in the loop
  fused_body: Callable[[Any, Any, Any, Any], Any]
  add_step: Callable[[Any, Any], Any]   # traced: one step per env


def jaxbuf_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  capacity = NUM_ENVS * steps_per_env
  if kind == "uniform":
    buffer = jaxbuf.sequence_replay(NUM_ENVS, capacity, SEQUENCE_LENGTH,
                                    period=period)
  else:
    buffer = jaxbuf.prioritized_sequence_replay(
        NUM_ENVS, capacity, SEQUENCE_LENGTH, period=period, alpha=ALPHA,
        beta=BETA)

  def fused_body(state, key, steps, acc):
    state = buffer.add(state, steps)
    batch = buffer.sample(state, key, SAMPLE_BATCH)
    acc = acc + checksum(batch.items, batch.weights)
    if kind == "prioritized":
      state = buffer.update_priorities(state, batch.indices,
                                       stand_in_td_errors(batch.items),
                                       batch.item_ids)
    return state, acc

  return Adapter(library="jaxbuf", kind=kind,
                 init=lambda: buffer.init(example_step()),
                 add_chunk=buffer.add, fused_body=fused_body,
                 add_step=buffer.add)


def flashbax_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  import flashbax  # pylint: disable=import-outside-toplevel
  settings = dict(add_batch_size=NUM_ENVS, sample_batch_size=SAMPLE_BATCH,
                  sample_sequence_length=SEQUENCE_LENGTH, period=period,
                  min_length_time_axis=SEQUENCE_LENGTH,
                  max_length_time_axis=steps_per_env)
  if kind == "uniform":
    buffer = flashbax.make_trajectory_buffer(**settings)
  else:
    device = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
    buffer = flashbax.make_prioritised_trajectory_buffer(
        priority_exponent=ALPHA, device=device, **settings)

  def add_step(state, steps):
    # flashbax adds [N, T, ...]: one step per env is T = 1.
    return buffer.add(state, jax.tree.map(lambda x: x[:, None], steps))

  def fused_body(state, key, steps, acc):
    state = add_step(state, steps)
    batch = buffer.sample(state, key)
    weights = (batch.probabilities if kind == "prioritized"
               else jnp.zeros((), jnp.float32))
    acc = acc + checksum(batch.experience, weights)
    if kind == "prioritized":
      state = buffer.set_priorities(state, batch.indices,
                                    stand_in_td_errors(batch.experience))
    return state, acc

  return Adapter(library="flashbax", kind=kind,
                 init=lambda: buffer.init(example_step()),
                 add_chunk=jax.jit(buffer.add, donate_argnums=0),
                 fused_body=fused_body, add_step=add_step)


def floor_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  """Only the memory traffic any sequence buffer must do: no library.

  Bare `[N, R, ...]` arrays and one write head shared by all envs: the add
  writes the N new rows, the sample gathers S windows of L rows at random
  (env, start), wrapping the ring, into the same checksum. No validity,
  episodes, counters or priorities, so its time is what the fused loop
  costs when the library costs nothing; `kind` and `period` change nothing.
  """
  del kind, period

  def init():
    return {"storage": jax.tree.map(
                lambda x: jnp.zeros((NUM_ENVS, steps_per_env) + x.shape,
                                    x.dtype), example_step()),
            "head": jnp.zeros((), jnp.int32)}

  def add_chunk(state, chunk):
    length = jax.tree.leaves(chunk)[0].shape[1]
    slots = (state["head"] + jnp.arange(length)) % steps_per_env
    storage = jax.tree.map(lambda column, rows: column.at[:, slots].set(rows),
                           state["storage"], chunk)
    return {"storage": storage,
            "head": (state["head"] + length) % steps_per_env}

  def add_step(state, steps):
    storage = jax.tree.map(lambda column, row: column.at[:, state["head"]].set(row),
                           state["storage"], steps)
    return {"storage": storage,
            "head": (state["head"] + 1) % steps_per_env}

  def fused_body(state, key, steps, acc):
    state = add_step(state, steps)
    env_key, start_key = jax.random.split(key)
    envs = jax.random.randint(env_key, (SAMPLE_BATCH,), 0, NUM_ENVS)
    starts = jax.random.randint(start_key, (SAMPLE_BATCH,), 0, steps_per_env)
    offsets = starts[:, None] + jnp.arange(SEQUENCE_LENGTH)[None, :]
    rows = (envs[:, None] * steps_per_env + offsets % steps_per_env).reshape(-1)
    windows = jax.tree.map(
        lambda column: column.reshape((-1,) + column.shape[2:]).at[rows].get(
            mode="promise_in_bounds").reshape(
                (SAMPLE_BATCH, SEQUENCE_LENGTH) + column.shape[2:]),
        state["storage"])
    return state, acc + checksum(windows, jnp.zeros((), jnp.float32))

  return Adapter(library="floor", kind="floor", init=init,
                 add_chunk=jax.jit(add_chunk, donate_argnums=0),
                 fused_body=fused_body, add_step=add_step)


ADAPTERS = {"jaxbuf": jaxbuf_adapter, "flashbax": flashbax_adapter,
            "floor": floor_adapter}


def fill(adapter: Adapter, steps_per_env: int, chunk: int = 980) -> Any:
  """A full buffer: `steps_per_env` steps per env, added in chunks."""
  state = adapter.init()
  rng = np.random.default_rng(0)
  for start in range(0, steps_per_env, chunk):
    length = min(chunk, steps_per_env - start)
    steps = {
        "obs": rng.normal(size=(NUM_ENVS, length, OBS_SIZE)).astype(
            np.float32),
        "action": rng.integers(0, 2, (NUM_ENVS, length), np.int32),
        "reward": np.ones((NUM_ENVS, length), np.float32),
        "terminated": np.zeros((NUM_ENVS, length), bool)}
    state = adapter.add_chunk(state, jax.tree.map(jnp.asarray, steps))
  return harness.block(state)


def make_fused_loop(adapter: Adapter, iterations: int) -> Callable:
  """`(state, key) -> (state, checksum)`: K iterations in one donated jit."""
  base_obs = jax.random.normal(jax.random.key(1), (NUM_ENVS, OBS_SIZE))

  def loop(state, key):
    def iteration(carry, step_and_key):
      state, acc = carry
      step, step_key = step_and_key
      state, acc = adapter.fused_body(state, step_key,
                                      env_steps(base_obs, step), acc)
      return (state, acc), None
    # Every iteration's key from one call before the loop, so no library's
    # iteration times the random number generator.
    step_keys = jax.random.split(key, iterations)
    (state, acc), _ = jax.lax.scan(
        iteration, (state, jnp.zeros((), jnp.float32)),
        (jnp.arange(iterations, dtype=jnp.float32), step_keys))
    return state, acc

  return jax.jit(loop, donate_argnums=0)


def make_add_only_loop(adapter: Adapter, iterations: int) -> Callable:
  base_obs = jax.random.normal(jax.random.key(1), (NUM_ENVS, OBS_SIZE))

  def loop(state):
    def iteration(state, step):
      return adapter.add_step(state, env_steps(base_obs, step)), None
    return jax.lax.scan(iteration, state,
                        jnp.arange(iterations, dtype=jnp.float32))[0]

  return jax.jit(loop, donate_argnums=0)


# ---------------------------------------------------------------- measures


def time_fused(settings: Settings, kind: str, period: int) -> dict[str, float]:
  adapters = {library: ADAPTERS[library](kind, settings.steps_per_env, period)
              for library in settings.libraries}
  states = {library: fill(adapter, settings.steps_per_env)
            for library, adapter in adapters.items()}
  loops = {library: make_fused_loop(adapter, settings.iterations)
           for library, adapter in adapters.items()}
  key = jax.random.key(0)

  def call(library):
    def run():
      states[library], acc = loops[library](states[library], key)
      return acc
    return run

  seconds = harness.time_interleaved(
      {library: call(library) for library in loops},
      repeats=settings.repeats, warmup=2)
  return {library: value / settings.iterations
          for library, value in seconds.items()}


def time_add_only(library: str, kind: str, steps_per_env: int, period: int,
                  iterations: int, repeats: int) -> float:
  adapter = ADAPTERS[library](kind, steps_per_env, period)
  loop = make_add_only_loop(adapter, iterations)
  holder = {"state": fill(adapter, steps_per_env)}

  def run():
    holder["state"] = loop(holder["state"])
    return holder["state"]

  return harness.time_call(run, repeats=repeats, warmup=2) / iterations


def measure_memory(library: str, kind: str, steps_per_env: int,
                   period: int) -> dict:
  """Runs in the child: peak memory of building and wrapping one buffer."""
  adapter = ADAPTERS[library](kind, steps_per_env, period)
  iterations = steps_per_env + SEQUENCE_LENGTH   # one step per env each
  key = jax.random.key(0)
  loop = make_fused_loop(adapter, iterations).lower(
      jax.eval_shape(adapter.init), key).compile()
  memory = harness.PeakMemory().start()
  start = time.perf_counter()
  state, acc = loop(adapter.init(), key)
  harness.block(acc)
  seconds = time.perf_counter() - start
  memory.stop()
  del state
  storage_bytes = NUM_ENVS * steps_per_env * step_bytes()
  return dict(library=library, kind=kind, measured=memory.measured,
              baseline_bytes=memory.baseline, peak_bytes=memory.peak,
              storage_bytes=storage_bytes, seconds=seconds,
              ratio=memory.added / storage_bytes)


def state_bytes(make_state: Callable[[], Any]) -> int:
  return sum(math.prod(leaf.shape) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(jax.eval_shape(make_state)))


def bytes_per_transition(kind: str, steps_per_env: int, period: int
                         ) -> dict[str, float]:
  """jaxbuf state bytes per transition held: sequence vs item replay."""
  capacity = NUM_ENVS * steps_per_env
  sequence = jaxbuf_adapter(kind, steps_per_env, period)
  transition = dict(example_step(), next_obs=jnp.zeros(OBS_SIZE, jnp.float32))
  if kind == "uniform":
    items = jaxbuf.uniform_replay(capacity)
  else:
    items = jaxbuf.prioritized_replay(capacity, alpha=ALPHA, beta=BETA)
  return {"sequence": state_bytes(sequence.init) / capacity,
          "item": state_bytes(lambda: items.init(transition)) / capacity}


# ---------------------------------------------------------------- report


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="C = 10k, one period, few repeats: a smoke run")
  parser.add_argument("--libraries", nargs="+", choices=LIBRARIES)
  parser.add_argument("--kinds", nargs="+", choices=KINDS)
  parser.add_argument("--periods", nargs="+", type=int)
  parser.add_argument("--no-memory", action="store_true",
                      help="skip the memory subprocesses")
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument("--child", nargs=4,
                      metavar=("LIBRARY", "KIND", "STEPS_PER_ENV", "PERIOD"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    library, kind, steps_per_env, period = args.child
    print(json.dumps(measure_memory(library, kind, int(steps_per_env),
                                    int(period))))
    return
  settings = QUICK if args.quick else FULL
  for name in ("libraries", "kinds", "periods"):
    if getattr(args, name):
      settings = dataclasses.replace(settings,
                                     **{name: tuple(getattr(args, name))})
  if args.no_memory:
    settings = dataclasses.replace(settings, memory=False)
  results = run(settings)
  if args.json:
    with open(args.json, "w") as output:
      json.dump(results, output, indent=1, default=str)


def run(settings: Settings) -> dict:
  machine = harness.print_machine(("jax", "jaxlib", "numpy", "flashbax"))
  capacity = NUM_ENVS * settings.steps_per_env
  print(f"N={NUM_ENVS} envs, C={capacity:,} steps, L={SEQUENCE_LENGTH}, "
        f"S={SAMPLE_BATCH} windows, K={settings.iterations}; step: obs "
        f"[{OBS_SIZE}] float32, action int32, reward float32, terminated "
        f"bool ({step_bytes()} bytes)", flush=True)
  results = dict(machine=machine, rows=[], add_only={}, memory=[],
                 bytes_per_transition={})
  verdicts = harness.Verdicts()
  targets = {"uniform": UNIFORM_VS_FLASHBAX,
             "prioritized": PRIORITIZED_VS_FLASHBAX}
  for period in settings.periods:
    for kind in settings.kinds:
      print(f"fused: {kind}, period {period}", flush=True)
      seconds = time_fused(settings, kind, period)
      results["rows"].append(dict(kind=kind, period=period, seconds=seconds))
      if "jaxbuf" in seconds and "flashbax" in seconds:
        verdicts.judge(f"{kind} fused, period {period}, C={capacity:,}, "
                       "flashbax/jaxbuf",
                       harness.ratio(seconds["flashbax"], seconds["jaxbuf"]),
                       targets[kind])
      if len(seconds) == 3:
        above = {library: seconds[library] - seconds["floor"]
                 for library in ("jaxbuf", "flashbax")}
        verdicts.info(
            f"{kind} fused, period {period}, time above the floor (the bare "
            f"add + gather, {seconds['floor'] * 1e6:.1f} us): jaxbuf "
            f"{above['jaxbuf'] * 1e6:.1f} us, flashbax "
            f"{above['flashbax'] * 1e6:.1f} us, flashbax/jaxbuf "
            f"{harness.ratio_text(harness.ratio(above['flashbax'], above['jaxbuf']))}")
  period = settings.periods[0]
  if "jaxbuf" in settings.libraries:
    for kind in settings.kinds:
      print(f"add only: {kind}", flush=True)
      small, large = (time_add_only("jaxbuf", kind, steps, period,
                                    settings.iterations, settings.repeats)
                      for steps in (SMALL_STEPS_PER_ENV,
                                    settings.steps_per_env))
      results["add_only"][kind] = dict(small=small, large=large)
      if "floor" in settings.libraries and kind == settings.kinds[0]:
        # The same ratio for bare arrays: what the memory hierarchy alone
        # charges for writing rows into 330 MB instead of a cached 3.4 MB.
        floor_small, floor_large = (
            time_add_only("floor", kind, steps, period, settings.iterations,
                          settings.repeats)
            for steps in (SMALL_STEPS_PER_ENV, settings.steps_per_env))
        results["add_only"]["floor"] = dict(small=floor_small,
                                            large=floor_large)
        verdicts.info(
            f"floor (bare arrays) add, C={capacity:,} / C="
            f"{NUM_ENVS * SMALL_STEPS_PER_ENV:,} ({floor_large * 1e6:.1f} / "
            f"{floor_small * 1e6:.1f} us): "
            f"{harness.ratio_text(harness.ratio(floor_large, floor_small))}")
      verdicts.judge(
          f"jaxbuf {kind} fused add, C={capacity:,} / "
          f"C={NUM_ENVS * SMALL_STEPS_PER_ENV:,} ({large * 1e6:.1f} / "
          f"{small * 1e6:.1f} us)", harness.ratio(large, small), ADD_SCALING,
          higher_is_better=False)
      per_transition = bytes_per_transition(kind, settings.steps_per_env,
                                            period)
      results["bytes_per_transition"][kind] = per_transition
      verdicts.judge(
          f"jaxbuf {kind} bytes per transition, sequence / item replay with "
          f"next_obs ({per_transition['sequence']:.1f} / "
          f"{per_transition['item']:.1f} B)",
          per_transition["sequence"] / per_transition["item"],
          BYTES_PER_TRANSITION_RATIO, higher_is_better=False)
  memory_libraries = [library for library in settings.libraries
                      if library != "floor"]
  for library in memory_libraries if settings.memory else ():
    for kind in settings.kinds:
      print(f"memory: {library} {kind}", flush=True)
      memory = dict(dict(library=library, kind=kind), **harness.run_child(
          __file__, ["--child", library, kind, str(settings.steps_per_env),
                     str(period)]))
      results["memory"].append(memory)
      name = (f"memory ({memory.get('measured', '?')}) {library} {kind}, "
              f"C={capacity:,}, (peak - before) / step storage")
      if "error" in memory:
        verdicts.info(f"{name}: error {memory['error']}")
      elif library == "jaxbuf":
        mib = 2 ** 20
        verdicts.judge(
            f"{name} = ({memory['peak_bytes'] / mib:.0f} - "
            f"{memory['baseline_bytes'] / mib:.0f} MiB) / "
            f"{memory['storage_bytes'] / mib:.0f} MiB", memory["ratio"],
            MEMORY_RATIO, higher_is_better=False)
      else:
        verdicts.info(f"{name}: {memory['ratio']:.2f}x")
  results["load_average_after"] = harness.load_average()
  print(f"\nload average at the end: {results['load_average_after']}\n")
  harness.print_table(
      (("kind", -11), ("period", 6), ("jaxbuf us", 10), ("flashbax us", 11),
       ("floor us", 9), ("fbx/jaxbuf", 10)),
      [[row["kind"], row["period"],
        harness.microseconds(row["seconds"].get("jaxbuf")),
        harness.microseconds(row["seconds"].get("flashbax")),
        harness.microseconds(row["seconds"].get("floor")),
        harness.ratio_text(harness.ratio(row["seconds"].get("flashbax"),
                                         row["seconds"].get("jaxbuf")))]
       for row in results["rows"]])
  verdicts.print("Targets (time ratios are flashbax / jaxbuf, higher is "
                 "better):")
  results["verdicts"] = verdicts.lines
  return results


if __name__ == "__main__":
  main()
