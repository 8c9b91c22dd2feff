"""The replay benchmarks' common ground: one item, one adapter per library.

Shape key: B add batch (128), S sample size (256), C capacity, K iterations.

Every library stores the same item, `obs` float32 `[84]`, and does the same
work per iteration: add B items, sample S, and (prioritized) set S new
priorities. In the fused and cpprb loops the priorities are computed from the
sampled items, as a learner's TD errors are.

Used by `bench_replay_fused.py` (fused loops), `bench_replay_calls.py`
(calls from a Python loop) and `bench_replay_memory.py` (peak memory).
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import harness
import jaxbuf
from benchmarks.common.harness import microseconds
from benchmarks.common.harness import ratio
from benchmarks.common.harness import ratio_text

OBS_SIZE = 84
ADD_BATCH = 128
SAMPLE_BATCH = 256
ALPHA = 0.6
BETA = 0.4
LIBRARIES = ("jaxbuf", "flashbax", "cpprb")
KINDS = ("uniform", "prioritized")


# ---------------------------------------------------------------------------
# One adapter per library and kind: the same operations behind one interface.
# `state` is a JAX pytree for the JAX libraries and the cpprb buffer object.


@dataclasses.dataclass
class Adapter:
  library: str
  kind: str
  capacity: int  # what the library actually holds
  init: Callable[[], Any]
  fill: Callable[[Any, np.ndarray], Any]  # adds C items at once
  add: Callable[[Any, Any], Any]  # state, obs [B, 84]
  sample: Callable[[Any, Any], Any]  # state, key -> sample
  update: Callable[[Any, Any, Any], Any]  # state, sample, priorities
  fused_body: Callable | None = None  # (state, key, obs, acc) -> ...
  to_device: Callable[[np.ndarray], Any] = jnp.asarray


def sample_checksum(obs, weights):
  """Everything sampled flows into this sum, so no gather can be skipped."""
  return jnp.sum(obs) + jnp.sum(weights)


def stand_in_td_errors(obs):
  """New priorities computed from the sampled items, as a learner's TD errors
  are; no random draw, whose cost would belong to the benchmark, not the
  buffer. `obs [S, 84]` -> float32 `[S]` in [0.01, ~4]."""
  return jnp.abs(obs[:, 0]) + 0.01


def jaxbuf_adapter(kind: str, capacity: int) -> Adapter:
  # Inside the fused loop the raw module functions (public, every setting
  # explicit) are called, as in a user's own jitted step; the bound
  # `buffer` functions are the per-call path, jitted and donated.
  if kind == "uniform":
    buffer = jaxbuf.uniform_replay(capacity)
    raw_add, raw_sample = jaxbuf.uniform.add, jaxbuf.uniform.sample
    raw_update = jaxbuf.uniform.update_priorities
  else:
    buffer = jaxbuf.prioritized_replay(capacity, alpha=ALPHA, beta=BETA)
    raw_add = functools.partial(jaxbuf.prioritized.add, alpha=ALPHA)
    raw_sample = functools.partial(jaxbuf.prioritized.sample, beta=BETA)
    raw_update = functools.partial(jaxbuf.prioritized.update_priorities, alpha=ALPHA, eps=1e-6)

  def fused_body(state, key, obs, acc):
    state = raw_add(state, {"obs": obs})
    batch = raw_sample(state, key, SAMPLE_BATCH)
    acc = acc + sample_checksum(batch.items["obs"], batch.weights)
    if kind == "prioritized":
      priorities = stand_in_td_errors(batch.items["obs"])
      state = raw_update(state, batch.indices, priorities, batch.item_ids)
    return state, acc

  return Adapter(
    library="jaxbuf",
    kind=kind,
    capacity=capacity,
    init=lambda: buffer.init({"obs": jnp.zeros(OBS_SIZE, jnp.float32)}),
    fill=lambda state, obs: buffer.add(state, {"obs": jnp.asarray(obs)}),
    add=lambda state, obs: buffer.add(state, {"obs": obs}),
    sample=lambda state, key: buffer.sample(state, key, SAMPLE_BATCH),
    update=lambda state, batch, priorities: buffer.update_priorities(
      state, batch.indices, priorities, batch.item_ids
    ),
    fused_body=fused_body,
  )


def flashbax_adapter(kind: str, capacity: int) -> Adapter:
  import flashbax  # pylint: disable=import-outside-toplevel

  # Flashbax stores [B, C // B, ...] and adds one time step of B items per
  # call; a second buffer over the same state adds whole sequences, to fill.
  settings = dict(
    max_length=capacity,
    min_length=SAMPLE_BATCH,
    sample_batch_size=SAMPLE_BATCH,
    add_batch_size=ADD_BATCH,
  )
  if kind == "uniform":
    make = flashbax.make_flat_buffer
  else:
    device = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")
    make = functools.partial(
      flashbax.make_prioritised_flat_buffer, priority_exponent=ALPHA, device=device
    )
  buffer = make(add_sequences=False, **settings)
  sequence_buffer = make(add_sequences=True, **settings)
  time_axis = capacity // ADD_BATCH
  # Flashbax's README jits its functions this way, add with the state donated.
  add = jax.jit(buffer.add, donate_argnums=0)
  sample = jax.jit(buffer.sample)
  fill = jax.jit(sequence_buffer.add, donate_argnums=0)
  set_priorities = (
    jax.jit(buffer.set_priorities, donate_argnums=0) if kind == "prioritized" else None
  )

  def fill_state(state, obs):
    obs = jnp.asarray(obs[: ADD_BATCH * time_axis]).reshape(ADD_BATCH, time_axis, OBS_SIZE)
    return fill(state, {"obs": obs})

  def fused_body(state, key, obs, acc):
    state = buffer.add(state, {"obs": obs})
    batch = buffer.sample(state, key)
    weights = batch.probabilities if kind == "prioritized" else jnp.zeros((), jnp.float32)
    acc = acc + sample_checksum(batch.experience.first["obs"], weights)
    if kind == "prioritized":
      priorities = stand_in_td_errors(batch.experience.first["obs"])
      state = buffer.set_priorities(state, batch.indices, priorities)
    return state, acc

  def update(state, batch, priorities):
    if set_priorities is None:
      return state
    return set_priorities(state, batch.indices, priorities)

  return Adapter(
    library="flashbax",
    kind=kind,
    capacity=ADD_BATCH * time_axis,
    init=lambda: buffer.init({"obs": jnp.zeros(OBS_SIZE, jnp.float32)}),
    fill=fill_state,
    add=lambda state, obs: add(state, {"obs": obs}),
    sample=sample,
    update=update,
    fused_body=fused_body,
  )


def cpprb_adapter(kind: str, capacity: int) -> Adapter:
  import cpprb  # pylint: disable=import-outside-toplevel

  env_dict = {"obs": {"shape": OBS_SIZE, "dtype": np.float32}}

  def init():
    if kind == "uniform":
      return cpprb.ReplayBuffer(capacity, env_dict)
    return cpprb.PrioritizedReplayBuffer(capacity, env_dict, alpha=ALPHA)

  def add(buffer, obs):
    buffer.add(obs=obs)
    return buffer

  def sample(buffer, key):
    del key  # cpprb draws from its own generator
    if kind == "uniform":
      return buffer.sample(SAMPLE_BATCH)
    return buffer.sample(SAMPLE_BATCH, beta=BETA)

  def update(buffer, batch, priorities):
    if kind == "prioritized":
      buffer.update_priorities(batch["indexes"], priorities)
    return buffer

  return Adapter(
    library="cpprb",
    kind=kind,
    capacity=capacity,
    init=init,
    fill=add,
    add=add,
    sample=sample,
    update=update,
    to_device=np.asarray,
  )


ADAPTERS = {"jaxbuf": jaxbuf_adapter, "flashbax": flashbax_adapter, "cpprb": cpprb_adapter}


def make_fused_loop(adapter: Adapter, iterations: int) -> Callable:
  """`(state, key) -> (state, checksum)`: K iterations in one donated jit."""
  base_obs = jax.random.normal(jax.random.key(1), (ADD_BATCH, OBS_SIZE))
  return harness.make_fused_loop(adapter.fused_body, iterations, lambda step: base_obs + step)


def make_cpprb_loop(adapter: Adapter, iterations: int) -> Callable:
  obs = np.random.default_rng(1).normal(size=(ADD_BATCH, OBS_SIZE)).astype(np.float32)

  def loop(buffer, key):
    acc = 0.0
    for _ in range(iterations):
      adapter.add(buffer, obs)
      batch = adapter.sample(buffer, key)
      acc += float(batch["obs"].sum())
      adapter.update(buffer, batch, np.abs(batch["obs"][:, 0]) + 0.01)
    return buffer, acc

  return loop


def make_loop(adapter: Adapter, iterations: int) -> Callable:
  """The adapter's fused loop, or cpprb's Python loop (no fused mode)."""
  if adapter.library == "cpprb":
    return make_cpprb_loop(adapter, iterations)
  return make_fused_loop(adapter, iterations)


def fill_states(adapters: dict[str, Adapter], capacity: int) -> dict[str, Any]:
  """Each library's buffer, full: C random items added at once."""
  fill_obs = np.random.default_rng(0).normal(size=(capacity, OBS_SIZE)).astype(np.float32)
  return {
    library: jax.block_until_ready(adapter.fill(adapter.init(), fill_obs))
    for library, adapter in adapters.items()
  }


def add_common_arguments(parser) -> None:
  parser.add_argument("--capacities", type=int, nargs="+", help="override the capacities")
  parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, help="override the libraries")
  parser.add_argument("--kinds", nargs="+", choices=KINDS, help="override the buffer kinds")
  parser.add_argument("--json", help="also write the results to this file")


REPLAY_COLUMNS = (
  ("capacity", 9),
  ("kind", -11),
  ("mode", -24),
  ("jaxbuf us", 10),
  ("flashbax us", 11),
  ("cpprb us", 9),
  ("fbx/jaxbuf", 10),
  ("cpprb/jaxbuf", 12),
)


def replay_table_row(row: dict) -> list:
  """One printed row of `REPLAY_COLUMNS`; ratios are peer / jaxbuf time."""
  times = row["seconds"]
  return [
    row["capacity"],
    row["kind"],
    row["mode"],
    microseconds(times.get("jaxbuf")),
    microseconds(times.get("flashbax")),
    microseconds(times.get("cpprb")),
    ratio_text(ratio(times.get("flashbax"), times.get("jaxbuf"))),
    ratio_text(ratio(times.get("cpprb"), times.get("jaxbuf"))),
  ]
