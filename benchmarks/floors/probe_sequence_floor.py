"""Why sequence replay at 1M steps runs at the memory floor on XLA:CPU.

Two probes behind the analysis in RESULTS.md (bench_sequence.py is the
benchmark; this only explains its floor):

* gather: the S = 64 windows of L = 40 steps of obs [84] float32 that a
  sample reads, gathered in every form XLA offers, from a 1M-step array
  (330 MB) and a 10k-step one (3.4 MB, cache-resident), against one
  contiguous slice of the same bytes. Each form feeds a sum, K = 200 draws in
  one jitted scan; microseconds per draw, median of 7 interleaved repeats.
* add: one step for each of N = 128 envs, for bare arrays (bench_sequence's
  two floors: rows written by index, and one `dynamic_update_slice`) and
  jaxbuf's sequence replays, at 10k, 100k and 1M steps held.

Usage: .venv/bin/python benchmarks/floors/probe_sequence_floor.py
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common import harness
from benchmarks.common import sequence_adapters as sequence
from jaxbuf._src.core import random

# bench_sequence's shapes: the probes explain its floor.
NUM_ENVS, OBS_SIZE = sequence.NUM_ENVS, sequence.OBS_SIZE
LENGTH, BATCH = sequence.SEQUENCE_LENGTH, sequence.SAMPLE_BATCH
DRAWS = 200


def random_windows(key: jax.Array, per_env: int) -> tuple[jax.Array, jax.Array]:
  """Envs and start slots of S windows, int32 `[S]` each."""
  env_key, start_key = jax.random.split(key)
  return (
    jax.random.randint(env_key, (BATCH,), 0, NUM_ENVS),
    jax.random.randint(start_key, (BATCH,), 0, per_env),
  )


def flat_rows(storage, key):
  """jaxbuf's form: S * L row indices into `[N * R, F]`, the ring wrapped,
  computed once (`computed_once`) rather than in the gather."""
  per_env = storage.shape[1]
  envs, starts = random_windows(key, per_env)

  def rows():
    offsets = (starts[:, None] + jnp.arange(LENGTH)[None, :]) % per_env
    return (envs[:, None] * per_env + offsets).reshape(-1)

  rows = random.computed_once(rows, envs[0])
  return storage.reshape(-1, OBS_SIZE).at[rows].get(mode="promise_in_bounds")


def window_slices(padded, key):
  """`vmap(dynamic_slice)`: every window contiguous in a ring padded by L - 1."""
  envs, starts = random_windows(key, padded.shape[1] - LENGTH + 1)
  return jax.vmap(
    lambda env, start: jax.lax.dynamic_slice(padded, (env, start, 0), (1, LENGTH, OBS_SIZE))[0]
  )(envs, starts)


def flat_slices(padded, key):
  """One 1-D slice of L * F floats per window from the padded ring."""
  per_env = padded.shape[1]
  envs, starts = random_windows(key, per_env - LENGTH + 1)
  flat = padded.reshape(-1)
  return jax.vmap(
    lambda env, start: jax.lax.dynamic_slice(
      flat, ((env * per_env + start) * OBS_SIZE,), (LENGTH * OBS_SIZE,)
    )
  )(envs, starts)


def window_gather(padded, key):
  """One gather of S slices of L rows from `[N * (R + L - 1), F]`, starts
  promised in bounds: no clamp per start, as `dynamic_slice` does."""
  per_env = padded.shape[1]
  envs, starts = random_windows(key, per_env - LENGTH + 1)
  return jax.lax.gather(
    padded.reshape(-1, OBS_SIZE),
    (envs * per_env + starts)[:, None],
    jax.lax.GatherDimensionNumbers(
      offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,)
    ),
    (LENGTH, OBS_SIZE),
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


def slice_loop(padded, key):
  """A `fori_loop` of S dynamic slices into the output."""
  envs, starts = random_windows(key, padded.shape[1] - LENGTH + 1)

  def copy(i, out):
    window = jax.lax.dynamic_slice(padded, (envs[i], starts[i], 0), (1, LENGTH, OBS_SIZE))
    return jax.lax.dynamic_update_slice(out, window, (i, 0, 0))

  return jax.lax.fori_loop(0, BATCH, copy, jnp.zeros((BATCH, LENGTH, OBS_SIZE), padded.dtype))


def contiguous(storage, key):
  """The same bytes as one slice: the bandwidth bound."""
  envs, _ = random_windows(key, 1)
  rows = storage.reshape(-1, OBS_SIZE)
  start = envs[0] * (rows.shape[0] // NUM_ENVS - BATCH * LENGTH)
  return jax.lax.dynamic_slice(rows, (start, 0), (BATCH * LENGTH, OBS_SIZE))


def timed_draws(form, storage):
  def run(key):
    def draw(acc, draw_key):
      return acc + jnp.sum(form(storage, draw_key)), None

    return jax.lax.scan(draw, jnp.float32(0), jax.random.split(key, DRAWS))[0]

  compiled = jax.jit(run)
  return lambda: compiled(jax.random.key(0))


def probe_gather(per_env: int) -> dict[str, float]:
  rng = np.random.default_rng(0)
  storage = jnp.asarray(rng.normal(size=(NUM_ENVS, per_env, OBS_SIZE)), jnp.float32)
  padded = jnp.concatenate([storage, storage[:, : LENGTH - 1]], axis=1)
  calls = {
    "flat rows (jaxbuf)": timed_draws(flat_rows, storage),
    "window slices, padded": timed_draws(window_slices, padded),
    "1-D slices, padded": timed_draws(flat_slices, padded),
    "window gather, padded": timed_draws(window_gather, padded),
    "fori_loop of slices": timed_draws(slice_loop, padded),
  }
  if per_env * NUM_ENVS > 2 * BATCH * LENGTH * NUM_ENVS:
    calls["one contiguous slice"] = timed_draws(contiguous, storage)
  seconds = harness.time_interleaved(calls, repeats=7, warmup=2)
  return {name: value / DRAWS for name, value in seconds.items()}


def main():
  harness.print_machine(("jax", "jaxlib", "numpy"))
  for per_env in (sequence.LARGE_STEPS_PER_ENV, sequence.SMALL_STEPS_PER_ENV):
    print(
      f"\ngather of {BATCH} x {LENGTH} x {OBS_SIZE} float32 from "
      f"{NUM_ENVS * per_env:,} steps, us per draw:"
    )
    for name, seconds in probe_gather(per_env).items():
      print(f"  {name:24s}{seconds * 1e6:8.1f}")
  print("\nadd of one step per env, us (period 20):")
  for per_env in (80, 800, sequence.LARGE_STEPS_PER_ENV):
    row = {
      (library, kind): sequence.time_add_only(library, kind, per_env, 20, iterations=200, repeats=5)
      for library, kind in (
        ("floor_rows", "uniform"),
        ("floor_slices", "uniform"),
        ("jaxbuf", "uniform"),
        ("jaxbuf", "prioritized"),
      )
    }
    print(
      f"  C={NUM_ENVS * per_env:>9,}: "
      + ", ".join(
        f"{library} {kind} {seconds * 1e6:.1f}" for (library, kind), seconds in row.items()
      )
    )


if __name__ == "__main__":
  main()
