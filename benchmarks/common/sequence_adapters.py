"""The sequence benchmarks' common ground: one step, one adapter per library.

Shape key: N envs (128), T steps held per env, C = N * T capacity in steps,
L window length (40), S windows sampled (64), K iterations.

Every library stores the same env step, `obs` float32 `[84]`, `action`
int32, `reward` float32 and `terminated` bool, as N streams, and does the
same work per iteration: add one step for each of the N envs, sample S
windows of L consecutive steps (and, prioritized, set S new priorities,
computed from the sampled windows as a learner's sequence TD errors are).

Two floors, no library in either: bare arrays doing only the add and the
window read, no validity, episodes, counters or priorities.

* `floor_rows`: bare `[N, R, ...]` arrays; the add writes the N new rows at a
  shared write head by index (`at[:, head].set`), the sample gathers S x L
  single rows by flat index with each env's ring wrapped (`at[rows].get`).
  This is the access pattern jaxbuf's sequence replay used up to issue 36
  (one row per index): it says what that pattern costs, not what reading
  windows must cost.
* `floor_slices`: bare `[N, R, ...]` arrays; the add is one
  `dynamic_update_slice` of the N new rows at the shared write head, the
  sample reads S windows as S contiguous `dynamic_slice`s of L rows,
  vmapped, starts drawn in `[0, R - L]` so none wraps. The cheapest way
  the same bytes can be read as windows: the floor a window read is held to.

Used by `bench_sequence.py` (fused loops, add alone, peak memory) and
`probe_sequence_floor.py` (why the floor is where it is).
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import harness
import jaxbuf

NUM_ENVS = 128
OBS_SIZE = 84
SEQUENCE_LENGTH = 40
SAMPLE_BATCH = 64
ALPHA = 0.6
BETA = 0.4
LIBRARIES = ("jaxbuf", "flashbax", "floor_rows", "floor_slices")
FLOORS = ("floor_rows", "floor_slices")
KINDS = ("uniform", "prioritized")
# Steps held per env: 7840 (C = 1,003,520) and 80 (C = 10,240), multiples
# of every period and window length here, so no library rounds them.
LARGE_STEPS_PER_ENV = 7840
SMALL_STEPS_PER_ENV = 80


def example_step() -> dict[str, jax.Array]:
  return {
    "obs": jnp.zeros(OBS_SIZE, jnp.float32),
    "action": jnp.zeros((), jnp.int32),
    "reward": jnp.zeros((), jnp.float32),
    "terminated": jnp.zeros((), jnp.bool_),
  }


def step_bytes() -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(example_step()))


def env_steps(base_obs: jax.Array, offset) -> dict[str, jax.Array]:
  """One step for each of the N envs, `obs [N, 84]`, the others `[N]`."""
  return {
    "obs": base_obs + offset,
    "action": jnp.full((NUM_ENVS,), 1, jnp.int32),
    "reward": jnp.full((NUM_ENVS,), 0.5, jnp.float32),
    "terminated": jnp.zeros((NUM_ENVS,), jnp.bool_),
  }


def checksum(windows: dict[str, jax.Array], weights) -> jax.Array:
  """Everything sampled flows into this sum, so no gather can be skipped."""
  return (
    jnp.sum(windows["obs"])
    + jnp.sum(windows["reward"])
    + jnp.sum(windows["action"]).astype(jnp.float32)
    + jnp.sum(windows["terminated"]).astype(jnp.float32)
    + jnp.sum(weights)
  )


def stand_in_td_errors(windows: dict[str, jax.Array]) -> jax.Array:
  """`[S]` priorities from the sampled windows `obs [S, L, 84]`."""
  return jnp.abs(windows["obs"][:, 0, 0]) + 0.01


# ---------------------------------------------------------------------------
# One adapter per library and kind: the same operations behind one interface.


@dataclasses.dataclass
class Adapter:
  library: str
  kind: str
  init: Callable[[], Any]
  # (state, chunk with leaves [N, T', ...]) -> state; jitted, donated
  add_chunk: Callable[[Any, Any], Any]
  # (state, key, steps [N, ...], acc) -> (state, acc); traced in the loop
  fused_body: Callable[[Any, Any, Any, Any], Any]
  add_step: Callable[[Any, Any], Any]  # traced: one step per env


def jaxbuf_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  capacity = NUM_ENVS * steps_per_env
  if kind == "uniform":
    buffer = jaxbuf.sequence_replay(NUM_ENVS, capacity, SEQUENCE_LENGTH, period=period)
  else:
    buffer = jaxbuf.prioritized_sequence_replay(
      NUM_ENVS, capacity, SEQUENCE_LENGTH, period=period, alpha=ALPHA, beta=BETA
    )

  def fused_body(state, key, steps, acc):
    state = buffer.add(state, steps)
    batch = buffer.sample(state, key, SAMPLE_BATCH)
    acc = acc + checksum(batch.items, batch.weights)
    if kind == "prioritized":
      state = buffer.update_priorities(
        state, batch.indices, stand_in_td_errors(batch.items), batch.item_ids
      )
    return state, acc

  return Adapter(
    library="jaxbuf",
    kind=kind,
    init=lambda: buffer.init(example_step()),
    add_chunk=buffer.add,
    fused_body=fused_body,
    add_step=buffer.add,
  )


def flashbax_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  import flashbax  # pylint: disable=import-outside-toplevel

  settings = dict(
    add_batch_size=NUM_ENVS,
    sample_batch_size=SAMPLE_BATCH,
    sample_sequence_length=SEQUENCE_LENGTH,
    period=period,
    min_length_time_axis=SEQUENCE_LENGTH,
    max_length_time_axis=steps_per_env,
  )
  if kind == "uniform":
    buffer = flashbax.make_trajectory_buffer(**settings)
  else:
    device = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
    buffer = flashbax.make_prioritised_trajectory_buffer(
      priority_exponent=ALPHA, device=device, **settings
    )

  def add_step(state, steps):
    # flashbax adds [N, T, ...]: one step per env is T = 1.
    return buffer.add(state, jax.tree.map(lambda x: x[:, None], steps))

  def fused_body(state, key, steps, acc):
    state = add_step(state, steps)
    batch = buffer.sample(state, key)
    weights = batch.probabilities if kind == "prioritized" else jnp.zeros((), jnp.float32)
    acc = acc + checksum(batch.experience, weights)
    if kind == "prioritized":
      state = buffer.set_priorities(state, batch.indices, stand_in_td_errors(batch.experience))
    return state, acc

  return Adapter(
    library="flashbax",
    kind=kind,
    init=lambda: buffer.init(example_step()),
    add_chunk=jax.jit(buffer.add, donate_argnums=0),
    fused_body=fused_body,
    add_step=add_step,
  )


def _floor_init(steps_per_env: int) -> Callable[[], Any]:
  def init():
    return {
      "storage": jax.tree.map(
        lambda x: jnp.zeros((NUM_ENVS, steps_per_env) + x.shape, x.dtype), example_step()
      ),
      "head": jnp.zeros((), jnp.int32),
    }

  return init


def _floor_add_chunk(steps_per_env: int) -> Callable[[Any, Any], Any]:
  """Fills a floor's arrays (not timed): the chunk at the shared head."""

  def add_chunk(state, chunk):
    length = jax.tree.leaves(chunk)[0].shape[1]
    slots = (state["head"] + jnp.arange(length)) % steps_per_env
    storage = jax.tree.map(
      lambda column, rows: column.at[:, slots].set(rows), state["storage"], chunk
    )
    return {"storage": storage, "head": (state["head"] + length) % steps_per_env}

  return jax.jit(add_chunk, donate_argnums=0)


def _random_windows(key: jax.Array, num_starts: int) -> tuple[jax.Array, jax.Array]:
  """Envs and start slots of S windows, int32 `[S]` each."""
  env_key, start_key = jax.random.split(key)
  return (
    jax.random.randint(env_key, (SAMPLE_BATCH,), 0, NUM_ENVS),
    jax.random.randint(start_key, (SAMPLE_BATCH,), 0, num_starts),
  )


def floor_rows_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  """The row-gather floor: jaxbuf's old access pattern, with no library.

  Bare `[N, R, ...]` arrays and one write head shared by all envs: the add
  writes the N new rows by index, the sample gathers the S x L rows of S
  windows at random (env, start) one row per flat index, the ring wrapped,
  into the same checksum. `kind` and `period` change nothing.
  """
  del kind, period

  def add_step(state, steps):
    storage = jax.tree.map(
      lambda column, row: column.at[:, state["head"]].set(row), state["storage"], steps
    )
    return {"storage": storage, "head": (state["head"] + 1) % steps_per_env}

  def fused_body(state, key, steps, acc):
    state = add_step(state, steps)
    envs, starts = _random_windows(key, steps_per_env)
    offsets = starts[:, None] + jnp.arange(SEQUENCE_LENGTH)[None, :]
    rows = (envs[:, None] * steps_per_env + offsets % steps_per_env).reshape(-1)
    windows = jax.tree.map(
      lambda column: (
        column.reshape((-1,) + column.shape[2:])
        .at[rows]
        .get(mode="promise_in_bounds")
        .reshape((SAMPLE_BATCH, SEQUENCE_LENGTH) + column.shape[2:])
      ),
      state["storage"],
    )
    return state, acc + checksum(windows, jnp.zeros((), jnp.float32))

  return Adapter(
    library="floor_rows",
    kind="floor",
    init=_floor_init(steps_per_env),
    add_chunk=_floor_add_chunk(steps_per_env),
    fused_body=fused_body,
    add_step=add_step,
  )


def floor_slices_adapter(kind: str, steps_per_env: int, period: int) -> Adapter:
  """The contiguous-slice floor: windows read as windows, with no library.

  Bare `[N, R, ...]` arrays and one write head shared by all envs: the add
  is one `dynamic_update_slice` of the N new rows `[N, 1, ...]`, the sample
  reads S windows at random (env, start), start in `[0, R - L]`, each one
  contiguous `dynamic_slice` of L rows, vmapped, into the same checksum.
  `kind` and `period` change nothing.
  """
  del kind, period

  def add_step(state, steps):
    def write(column, row):
      start = (jnp.int32(0), state["head"]) + (jnp.int32(0),) * (row.ndim - 1)
      return jax.lax.dynamic_update_slice(column, row[:, None], start)

    return {
      "storage": jax.tree.map(write, state["storage"], steps),
      "head": (state["head"] + 1) % steps_per_env,
    }

  def fused_body(state, key, steps, acc):
    state = add_step(state, steps)
    envs, starts = _random_windows(key, steps_per_env - SEQUENCE_LENGTH + 1)

    def window(column):
      tail = column.shape[2:]
      return jax.vmap(
        lambda env, start: jax.lax.dynamic_slice(
          column, (env, start) + (0,) * len(tail), (1, SEQUENCE_LENGTH) + tail
        )[0]
      )(envs, starts)

    windows = jax.tree.map(window, state["storage"])
    return state, acc + checksum(windows, jnp.zeros((), jnp.float32))

  return Adapter(
    library="floor_slices",
    kind="floor",
    init=_floor_init(steps_per_env),
    add_chunk=_floor_add_chunk(steps_per_env),
    fused_body=fused_body,
    add_step=add_step,
  )


ADAPTERS = {
  "jaxbuf": jaxbuf_adapter,
  "flashbax": flashbax_adapter,
  "floor_rows": floor_rows_adapter,
  "floor_slices": floor_slices_adapter,
}


def fill(adapter: Adapter, steps_per_env: int, chunk: int = 980) -> Any:
  """A full buffer: `steps_per_env` steps per env, added in chunks."""
  state = adapter.init()
  rng = np.random.default_rng(0)
  for start in range(0, steps_per_env, chunk):
    length = min(chunk, steps_per_env - start)
    steps = {
      "obs": rng.normal(size=(NUM_ENVS, length, OBS_SIZE)).astype(np.float32),
      "action": rng.integers(0, 2, (NUM_ENVS, length), np.int32),
      "reward": np.ones((NUM_ENVS, length), np.float32),
      "terminated": np.zeros((NUM_ENVS, length), bool),
    }
    state = adapter.add_chunk(state, jax.tree.map(jnp.asarray, steps))
  return harness.block(state)


def make_fused_loop(adapter: Adapter, iterations: int) -> Callable:
  """`(state, key) -> (state, checksum)`: K iterations in one donated jit."""
  base_obs = jax.random.normal(jax.random.key(1), (NUM_ENVS, OBS_SIZE))
  return harness.make_fused_loop(
    adapter.fused_body, iterations, lambda step: env_steps(base_obs, step)
  )


def make_add_only_loop(adapter: Adapter, iterations: int) -> Callable:
  """`state -> state`: K adds of one step per env in one donated jit."""
  base_obs = jax.random.normal(jax.random.key(1), (NUM_ENVS, OBS_SIZE))
  return harness.make_add_loop(adapter.add_step, iterations, lambda step: env_steps(base_obs, step))


def time_add_only(
  library: str, kind: str, steps_per_env: int, period: int, iterations: int, repeats: int
) -> float:
  """Seconds per add of one step per env, into a full buffer, in the scan."""
  adapter = ADAPTERS[library](kind, steps_per_env, period)
  return harness.time_add_loop(
    make_add_only_loop(adapter, iterations),
    fill(adapter, steps_per_env),
    iterations=iterations,
    repeats=repeats,
  )
