"""What every benchmark script shares: the machine, timing, memory, tables.

Each script prints `machine_lines()` first, so every figure it prints carries
the machine, the library versions, the load and the command that produced it.

* Timing: `time_interleaved` calls several thunks round-robin, one call each
  per repeat, so a change in the load of a shared machine hits every
  contender alike, and returns the median seconds per call of each after
  warm-up calls (compilation). `time_call` is the one-thunk case;
  `carrying` makes the thunk of a loop whose state is donated.
* Fused loops: `make_fused_loop` runs K iterations of a body (add, sample,
  update) in one jitted, donated `lax.scan`; `make_add_loop` K adds alone.
  `time_fused_loops` and `time_add_loop` time them per iteration.
* Memory: the peak of a block of work, measured where the data lives: the
  device allocator's counters on an accelerator, the process's resident set
  (with the kernel's peak counter reset where allowed) on CPU. Run it in a
  fresh process (`run_child`) so earlier work does not hide the peak;
  `measure_peak` times one call under it.
* Tables: fixed-width columns, `microseconds` and `ratio` formatting, and
  `Verdicts`, the PASS/FAIL/info lines that judge figures against targets.
* Variants: `sum_tree_kernels` traces what it wraps under one sum tree kernel
  variant (`JAXBUF_SUM_TREE_KERNELS`), so one process compiles and times
  every variant.
* Settings and results: `override` applies the command line's overrides to
  a settings dataclass, `write_json` saves the results.
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from jaxbuf._src.core import sum_tree

PACKAGES = (
  "jax",
  "jaxlib",
  "numpy",
  "flax",
  "optax",
  "chex",
  "gymnax",
  "flashbax",
  "cpprb",
  "rlax",
  "orbax-checkpoint",
)


def block(tree):
  """Waits for every array in `tree`; returns it."""
  return jax.block_until_ready(tree)


# ---------------------------------------------------------------- machine


def _command_output(command: Sequence[str]) -> str:
  try:
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip()
  except OSError:
    return ""


def cpu_name() -> str:
  for line in _command_output(["lscpu"]).splitlines():
    if line.startswith("Model name"):
      return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


def versions(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
  found = {}
  for package in packages:
    try:
      found[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      found[package] = "not installed"
  return found


def load_average() -> str:
  return " ".join(f"{value:.2f}" for value in os.getloadavg())


def print_load_average_after() -> str:
  """Prints and returns the load average at the end of a run."""
  load = load_average()
  print(f"\nload average at the end: {load}\n")
  return load


def machine_description(packages: Sequence[str] = PACKAGES) -> dict[str, Any]:
  """CPU, cores, JAX backend and devices, Python and package versions, load."""
  device = jax.devices()[0]
  return dict(
    cpu=cpu_name(),
    cores=os.cpu_count(),
    backend=jax.default_backend(),
    device_kind=device.device_kind,
    devices=[str(d) for d in jax.devices()],
    python=platform.python_version(),
    versions=versions(packages),
    load_average=load_average(),
    date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    command=" ".join(shlex.quote(a) for a in sys.argv),
  )


def machine_lines(machine: dict[str, Any]) -> list[str]:
  return [
    f"machine: {machine['cpu']}, {machine['cores']} cores; backend "
    f"{machine['backend']} ({machine['device_kind']}), "
    f"{len(machine['devices'])} device(s)",
    f"python {machine['python']}, "
    + ", ".join(
      f"{name} {version}"
      for name, version in machine["versions"].items()
      if version != "not installed"
    ),
    f"date {machine['date']}; load average (1, 5, 15 min) at start: {machine['load_average']}",
    f"command: {machine['command']}",
  ]


def print_machine(packages: Sequence[str] = PACKAGES) -> dict[str, Any]:
  """Prints and returns `machine_description`."""
  machine = machine_description(packages)
  for line in machine_lines(machine):
    print(line, flush=True)
  return machine


# ---------------------------------------------------------------- timing


def time_interleaved(
  calls: dict[str, Callable[[], Any]],
  *,
  repeats: int,
  warmup: int = 1,
  number: int = 1,
  statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
  """Median seconds per call of each thunk, the thunks interleaved.

  Args:
    calls: name -> thunk; each call's result is waited for (`block`).
    repeats: timed rounds; each round times every thunk once, in order.
    warmup: untimed rounds first (compilation; a state that comes back with
      other types than it went in, say weak types, compiles again on the
      second call).
    number: calls per timed sample; the sample is divided by it.
    statistic: what summarises the repeats; `min` on a loaded shared
      machine, where most repeats are slowed by other work and the least
      disturbed one is the figure.

  Returns:
    name -> median (or `statistic`) over the repeats of (seconds per call).
  """
  for _ in range(warmup):
    for call in calls.values():
      block(call())
  samples = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      for _ in range(number):
        result = call()
      block(result)
      samples[name].append((time.perf_counter() - start) / number)
  return {name: statistic(values) for name, values in samples.items()}


def time_call(call: Callable[[], Any], *, repeats: int, warmup: int = 1, number: int = 1) -> float:
  """Median seconds per call of one thunk (see `time_interleaved`)."""
  return time_interleaved({"call": call}, repeats=repeats, warmup=warmup, number=number)["call"]


def carrying(step: Callable[[Any], tuple[Any, Any]], state: Any) -> Callable[[], Any]:
  """A thunk for `time_interleaved` that runs `step` on a carried state.

  `step(state) -> (state, result)` donates the state it is given, so each
  call keeps the state returned for the next; the thunk returns `result`,
  what the timer waits for.
  """
  holder = [state]

  def call():
    holder[0], result = step(holder[0])
    return result

  return call


# ---------------------------------------------------------------- fused loops


def make_fused_loop(
  body: Callable[[Any, Any, Any, jax.Array], Any],
  iterations: int,
  inputs: Callable[[jax.Array], Any],
) -> Callable:
  """`(state, key) -> (state, checksum)`: K iterations in one donated jit.

  Iteration `step` (float32, 0 to K - 1) calls `body(state, key, inputs(step),
  checksum) -> (state, checksum)` with its own key; the checksum starts at
  float32 zero and should sum everything sampled, so no work is dead code.
  """

  def loop(state, key):
    def iteration(carry, step_and_key):
      state, acc = carry
      step, step_key = step_and_key
      state, acc = body(state, step_key, inputs(step), acc)
      return (state, acc), None

    # Every iteration's key from one call before the loop: on CPU each call to
    # the generator is a loop of small kernels, which would otherwise be timed
    # as part of every library's iteration.
    step_keys = jax.random.split(key, iterations)
    (state, acc), _ = jax.lax.scan(
      iteration,
      (state, jnp.zeros((), jnp.float32)),
      (jnp.arange(iterations, dtype=jnp.float32), step_keys),
    )
    return state, acc

  return jax.jit(loop, donate_argnums=0)


def make_add_loop(
  add: Callable[[Any, Any], Any], iterations: int, inputs: Callable[[jax.Array], Any]
) -> Callable:
  """`state -> state`: K calls of `add(state, inputs(step))`, `step`
  float32 0 to K - 1, in one donated jit: the add's device time alone."""

  def loop(state):
    def iteration(state, step):
      return add(state, inputs(step)), None

    return jax.lax.scan(iteration, state, jnp.arange(iterations, dtype=jnp.float32))[0]

  return jax.jit(loop, donate_argnums=0)


def time_fused_loops(
  loops: dict[str, Callable],
  states: dict[str, Any],
  *,
  iterations: int,
  repeats: int,
  warmup: int = 2,
  statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
  """Median (or `statistic`) seconds per iteration of each `make_fused_loop`
  loop (or one with its signature), interleaved, each on its own donated
  state."""
  key = jax.random.key(0)
  calls = {
    name: carrying(lambda state, loop=loop: loop(state, key), states[name])
    for name, loop in loops.items()
  }
  seconds = time_interleaved(calls, repeats=repeats, warmup=warmup, statistic=statistic)
  return {name: value / iterations for name, value in seconds.items()}


def time_add_loop(
  loop: Callable, state: Any, *, iterations: int, repeats: int, warmup: int = 2
) -> float:
  """Median seconds per iteration of a `make_add_loop` loop, the state
  donated."""

  def run(state):
    state = loop(state)
    return state, state

  return time_call(carrying(run, state), repeats=repeats, warmup=warmup) / iterations


# ---------------------------------------------------------------- memory


def resident_bytes() -> int:
  with open("/proc/self/statm") as statm:
    return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_resident() -> bool:
  """Resets the kernel's peak-RSS counter (VmHWM); False if not allowed."""
  try:
    with open("/proc/self/clear_refs", "w") as clear_refs:
      clear_refs.write("5")
    return True
  except OSError:
    return False


def peak_resident_bytes() -> int:
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class PeakMemory:
  """Peak memory of the work done between `start()` and `stop()`.

  On an accelerator the arrays live in device memory and the allocator's
  counters are read; on CPU (or when the device keeps no counters) the
  process's resident set is; `host=True` reads the resident set always (a
  host library such as cpprb). `baseline` is what was in use at `start()`;
  `peak - baseline` is what the work added at its worst.
  """

  host: bool = False
  measured: str = ""
  baseline: int = 0
  peak: int = 0
  peak_was_reset: bool = False

  def start(self) -> "PeakMemory":
    block(jax.numpy.zeros(()))
    stats = self._device_stats()
    if stats is not None:
      self.measured = "device memory"
      self.baseline = stats["bytes_in_use"]
      # The allocator's peak cannot be reset: the work must exceed it.
      self.peak_was_reset = False
    else:
      self.measured = "host RSS"
      self.baseline = resident_bytes()
      self.peak_was_reset = reset_peak_resident()
    return self

  def stop(self) -> "PeakMemory":
    stats = self._device_stats()
    self.peak = stats["peak_bytes_in_use"] if stats is not None else peak_resident_bytes()
    return self

  @property
  def added(self) -> int:
    return self.peak - self.baseline

  def _device_stats(self) -> dict[str, int] | None:
    if self.host or jax.default_backend() == "cpu":
      return None
    stats = jax.devices()[0].memory_stats() or {}
    return stats if "peak_bytes_in_use" in stats else None


def measure_peak(call: Callable[[], Any], *, host: bool = False) -> tuple[PeakMemory, float]:
  """Peak memory (`PeakMemory`) and seconds of one call, its result waited
  for; the result is dropped only after the peak is read."""
  memory = PeakMemory(host=host).start()
  start = time.perf_counter()
  result = block(call())
  seconds = time.perf_counter() - start
  memory.stop()
  del result
  return memory, seconds


def run_child(script: str, arguments: Sequence[str], timeout: float = 1800) -> dict[str, Any]:
  """Runs `python script *arguments` in a fresh process; parses the JSON
  object on its last stdout line, or returns {"error": [last stderr line]}."""
  completed = subprocess.run(
    [sys.executable, os.path.abspath(script), *arguments],
    capture_output=True,
    text=True,
    check=False,
    timeout=timeout,
  )
  if completed.returncode != 0:
    return {"error": completed.stderr.strip().splitlines()[-1:]}
  return json.loads(completed.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- tables


def microseconds(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
  if not numerator or not denominator:
    return None
  return numerator / denominator


def ratio_text(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}x"


def print_table(columns: Sequence[tuple[str, int]], rows: Sequence[Sequence[Any]]) -> None:
  """Fixed-width table: `columns` are (title, width), a negative width
  left-aligns; each row holds one value per column (str() is applied)."""

  def line(values):
    return " ".join(
      f"{str(value):<{-width}}" if width < 0 else f"{str(value):>{width}}"
      for value, (_, width) in zip(values, columns, strict=True)
    )

  header = line([title for title, _ in columns])
  print(header)
  print("-" * len(header))
  for row in rows:
    print(line(row))


class Verdicts:
  """PASS/FAIL lines for figures with a target, info lines for the rest."""

  def __init__(self):
    self.lines: list[str] = []

  def judge(
    self,
    name: str,
    value: float | None,
    target: float,
    *,
    higher_is_better: bool = True,
    unit: str = "x",
  ) -> None:
    if value is None:
      verdict, shown = "n/a ", "n/a"
    else:
      passed = value >= target if higher_is_better else value <= target
      verdict, shown = ("PASS" if passed else "FAIL"), f"{value:.2f}{unit}"
    bound = ">=" if higher_is_better else "<="
    self.lines.append(f"{verdict}  {name}: {shown} (target {bound} {target:g}{unit})")

  def info(self, text: str) -> None:
    self.lines.append(f"info  {text}")

  def print(self, title: str) -> None:
    print(f"\n{title}")
    for line in self.lines:
      print("  " + line)


# ---------------------------------------------------------------- variants


@contextlib.contextmanager
def sum_tree_kernels(variant: str | None) -> Iterator[None]:
  """`JAXBUF_SUM_TREE_KERNELS` set to `variant` (None: unset) inside: a
  function jitted and compiled there keeps that variant."""
  saved = os.environ.pop(sum_tree.KERNEL_VARIANT_VARIABLE, None)
  if variant is not None:
    os.environ[sum_tree.KERNEL_VARIANT_VARIABLE] = variant
  try:
    yield
  finally:
    os.environ.pop(sum_tree.KERNEL_VARIANT_VARIABLE, None)
    if saved is not None:
      os.environ[sum_tree.KERNEL_VARIANT_VARIABLE] = saved


# ---------------------------------------------------------------- settings


def override(settings: Any, args: Any, names: Sequence[str]) -> Any:
  """`settings` (a dataclass) with each of `names` the command line gave
  (`args.<name>`, a list) replaced by it, as a tuple."""
  for name in names:
    if getattr(args, name):
      settings = dataclasses.replace(settings, **{name: tuple(getattr(args, name))})
  return settings


def write_json(path: str | None, results: Any) -> None:
  """Writes `results` to `path` (the `--json` argument), if one was given."""
  if path:
    with open(path, "w") as output:
      json.dump(results, output, indent=1, default=str)
