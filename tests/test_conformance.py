"""The conformance suite: every buffer kind, through its `jaxbuf.Buffer`.

Each kind is made by its public factory and driven by the same checks
(STYLE.md, convention 8): every function keeps the state's structure, shapes
and dtypes; a jitted `lax.scan` of a step `vmap`ped over many states, with
the priority update and a clear under `lax.cond`, traced once and run twice,
ends where eager calls on each state one at a time end, and the bound
functions compile no new program after their first calls; a bad add raises
while tracing, naming the leaf, and leaves the state intact. The checks share
one compiled program per kind, so that every kind costs about what one of
the per-kind copies they replace did. What is particular to a kind (its
sampling law, its windows, episodes, stacks or relabelling) stays in that
kind's own file.
"""

import functools
import re
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

NUM_ENVS, CAPACITY, BATCH, CHUNK = 2, 16, 4, 3
SAMPLE = 4


def reward_fn(achieved_goal, desired_goal):
  return -jnp.any(achieved_goal != desired_goal, axis=-1).astype(jnp.float32)


# One step (or item) layout every kind takes: a GoalEnv observation dict, as
# hindsight replay needs, which the others store as any pytree.
STEP = {
  "obs": {
    "observation": jnp.zeros(2, jnp.float32),
    "achieved_goal": jnp.zeros(1, jnp.float32),
    "desired_goal": jnp.zeros(1, jnp.float32),
  },
  "action": jnp.int32(0),
  "reward": jnp.float32(0),
  "terminated": jnp.bool_(False),
}


class Kind(NamedTuple):
  buffer: jaxbuf.Buffer
  streams: bool  # adds [N, T, ...] with episode ends, else [B, ...]
  values: bool = False  # add takes a value per item (keep-the-best)
  repeats: bool = True  # a sample may repeat a unit; else it pads past those held


KINDS = {
  "uniform": Kind(jaxbuf.uniform_replay(CAPACITY), False),
  "prioritized": Kind(jaxbuf.prioritized_replay(CAPACITY, alpha=0.7, beta=0.5), False),
  "sequence": Kind(jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 2), True),
  "prioritized_sequence": Kind(
    jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, 2, alpha=0.7), True
  ),
  "frame_stack": Kind(jaxbuf.frame_stack_replay(NUM_ENVS, CAPACITY, 2, n_step=2), True),
  "prioritized_frame_stack": Kind(
    jaxbuf.prioritized_frame_stack_replay(NUM_ENVS, CAPACITY, 2, n_step=2), True
  ),
  "hindsight": Kind(jaxbuf.hindsight_replay(NUM_ENVS, CAPACITY, reward_fn), True),
  "prioritized_hindsight": Kind(
    jaxbuf.hindsight_replay(NUM_ENVS, CAPACITY, reward_fn, prioritized=True), True
  ),
  "episode": Kind(jaxbuf.episode_replay(NUM_ENVS, CAPACITY, CHUNK), True),
  # Selection and eviction rules (issue 42).
  "queue": Kind(jaxbuf.queue_replay(CAPACITY), False, repeats=False),
  "uniform_budget": Kind(
    jaxbuf.uniform_replay(CAPACITY, max_times_sampled=2), False, repeats=False
  ),
  "heap": Kind(jaxbuf.heap_replay(CAPACITY), False, repeats=False),
  "keep_best": Kind(jaxbuf.keep_best_replay(CAPACITY), False, values=True),
}

every_kind = pytest.mark.parametrize("name", sorted(KINDS))
NUM_STATES, NUM_STEPS = 3, 4


def chunk(t: Any) -> dict:
  """The data of add number `t` (an int or a traced int32): item kinds get
  `[BATCH, ...]`, stream kinds `[N, CHUNK, ...]`, each chunk an episode."""
  serial = t * 10 + jnp.arange(NUM_ENVS * CHUNK).reshape(NUM_ENVS, CHUNK)
  serial = serial.astype(jnp.float32)
  goal = jnp.mod(serial, 2.0)[..., None]
  return {
    "obs": {
      "observation": jnp.stack([serial, -serial], -1),
      "achieved_goal": goal,
      "desired_goal": 1.0 - goal,
    },
    "action": serial.astype(jnp.int32) % 3,
    "reward": serial / 2,
    "terminated": jnp.zeros(serial.shape, bool),
  }


def add_arguments(name: str, data: dict) -> tuple[dict, dict]:
  """`add`'s data and keywords for `chunk`'s data: the first BATCH rows for
  item kinds, the streams with an episode end at their last step else."""
  if KINDS[name].streams:
    ends = np.zeros((NUM_ENVS, CHUNK), bool)
    ends[:, -1] = True
    return data, {"episode_end": ends}
  items = jax.tree.map(lambda x: x.reshape((NUM_ENVS * CHUNK,) + x.shape[2:])[:BATCH], data)
  return items, ({"values": items["reward"]} if KINDS[name].values else {})


def add(name: str, state, t):
  data, keywords = add_arguments(name, chunk(t))
  return KINDS[name].buffer.add(state, data, **keywords)


def filled(name: str, adds: int = 2):
  """A state after `adds` adds. A fresh one each time: the bound functions
  donate the state they are given when called from Python."""
  state = KINDS[name].buffer.init(STEP)
  for t in range(adds):
    state = add(name, state, t)
  return state


def learn(name: str, state, key):
  """sample, then update_priorities with new priorities: `(state, sample)`."""
  buffer = KINDS[name].buffer
  sample = buffer.sample(state, key, SAMPLE)
  priorities = sample.weights + jnp.arange(SAMPLE, dtype=jnp.float32)
  return buffer.update_priorities(state, sample.indices, priorities, sample.item_ids), sample


def snapshot(tree) -> list[np.ndarray]:
  return [np.asarray(leaf).copy() for leaf in jax.tree.leaves(tree)]


def assert_trees_equal(got, want):
  """Equal structure and integer leaves, float leaves to float32 rounding
  (a jitted program may fuse what eager calls round one by one)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=1e-6)


def one_step(name: str, state, serial, key, clear):
  """add, sample, the priority update under `lax.cond` (once the buffer can
  sample), then a clear under `lax.cond`: `(state, sample indices)`."""
  buffer = KINDS[name].buffer
  state = add(name, state, serial)
  sample = buffer.sample(state, key, SAMPLE)
  priorities = sample.weights + jnp.arange(SAMPLE, dtype=jnp.float32)
  state = jax.lax.cond(
    buffer.can_sample(state, SAMPLE),
    lambda s: buffer.update_priorities(s, sample.indices, priorities, sample.item_ids),
    lambda s: s,
    state,
  )
  return jax.lax.cond(clear, buffer.clear, lambda s: s, state), sample.indices


def eager_step(name: str, state, data, key, clear):
  """`one_step` as a user writes it in Python, with the bound functions."""
  buffer = KINDS[name].buffer
  state = buffer.add(state, data[0], **data[1])
  sample = buffer.sample(state, key, SAMPLE)
  priorities = sample.weights + jnp.arange(SAMPLE, dtype=jnp.float32)
  if bool(buffer.can_sample(state, SAMPLE)):
    state = buffer.update_priorities(state, sample.indices, priorities, sample.item_ids)
  return (buffer.clear(state) if clear else state), sample.indices


@every_kind
def test_every_function_keeps_structure_shapes_and_dtypes(name):
  buffer = KINDS[name].buffer
  state = jax.eval_shape(lambda: filled(name))
  key = jax.random.key(0)
  sample = jax.eval_shape(lambda s: buffer.sample(s, key, SAMPLE), state)
  taken, taken_sample = jax.eval_shape(lambda s: buffer.take(s, key, SAMPLE), state)
  chex.assert_trees_all_equal_shapes_and_dtypes(taken_sample, sample)
  for after in (
    taken,
    jax.eval_shape(functools.partial(add, name), state, 5),
    jax.eval_shape(lambda s: learn(name, s, key)[0], state),
    jax.eval_shape(buffer.clear, state),
  ):
    chex.assert_trees_all_equal_shapes_and_dtypes(after, state)
    assert jax.tree.structure(after) == jax.tree.structure(state)
  assert sample.indices.shape == sample.weights.shape == (SAMPLE,)
  assert sample.weights.dtype == jnp.float32


def check_jit_vmap_scan_cond_and_one_compilation(name: str):
  buffer = KINDS[name].buffer
  serials = np.arange(2 * NUM_STEPS)[:, None] * 10 + np.arange(NUM_STATES)
  keys = jax.random.split(jax.random.key(7), (2 * NUM_STEPS, NUM_STATES))
  clears = np.zeros((2 * NUM_STEPS, NUM_STATES), bool)
  clears[1, 0] = True  # one state starts over: both branches of the cond
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(states, serials, keys, clears):
    def body(states, inputs):
      return jax.vmap(functools.partial(one_step, name))(states, *inputs)

    return jax.lax.scan(body, states, (serials, keys, clears))

  states = jax.vmap(lambda _: buffer.init(STEP))(jnp.arange(NUM_STATES))
  # Run twice, with other inputs: the second call is not traced again.
  half = lambda x, i: x[i * NUM_STEPS : (i + 1) * NUM_STEPS]
  states, first = run(states, half(serials, 0), half(keys, 0), half(clears, 0))
  states, second = run(states, half(serials, 1), half(keys, 1), half(clears, 1))
  indices = np.concatenate([first, second])
  assert bool(jax.vmap(lambda s: buffer.can_sample(s, SAMPLE))(states).all())

  # Each state alone, eagerly. Its data are made first: eager array ops
  # compile programs of their own, which the listener below would hear.
  data = [[add_arguments(name, chunk(int(serial))) for serial in row] for row in serials]
  key_rows = [list(row) for row in keys]
  events = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event in (
      "/jax/core/compile/jaxpr_trace_duration",
      "/jax/core/compile/backend_compile_duration",
    ):
      events.append(event)

  def eagerly(k):
    state = buffer.init(STEP)
    for t in range(2 * NUM_STEPS):
      state, sample_indices = eager_step(name, state, data[t][k], key_rows[t][k], clears[t, k])
      np.testing.assert_array_equal(sample_indices, indices[t, k])
    return state

  alone = [eagerly(0)]  # every bound function runs, compiling its program
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    alone += [eagerly(k) for k in range(1, NUM_STATES)]
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  for k, state in enumerate(alone):
    assert_trees_equal(jax.tree.map(lambda x, k=k: x[k], states), state)
  assert not events, events


# The bound add donates its state; traced under vmap it has nothing to reuse.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@every_kind
def test_jit_vmap_scan_and_cond_match_eager_calls_compiling_once(name):
  check_jit_vmap_scan_cond_and_one_compilation(name)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("name", ["uniform", "prioritized"])
def test_the_same_with_x64_on(name):
  with jax.enable_x64(True):
    check_jit_vmap_scan_cond_and_one_compilation(name)


@every_kind
def test_a_bad_add_raises_naming_the_leaf_and_leaves_the_state_intact(name):
  buffer = KINDS[name].buffer
  state = filled(name)
  before = snapshot(state)
  data, keywords = add_arguments(name, chunk(2))
  reward = data["reward"]
  for bad in ("shape", "dtype", "missing"):
    wrong = dict(
      data,
      reward={
        "shape": jnp.zeros(reward.shape + (2,), reward.dtype),
        "dtype": reward.astype(jnp.int32),
      }.get(bad),
    )
    if bad == "missing":
      del wrong["reward"]
    with pytest.raises((ValueError, TypeError)) as raised:
      buffer.add(state, wrong, **keywords)
    if bad != "missing":
      assert "reward" in str(raised.value), str(raised.value)
    for got, want in zip(snapshot(state), before):
      np.testing.assert_array_equal(got, want)
  # Still usable: the next add and learner step as on an untouched state.
  assert_trees_equal(
    learn(name, add(name, state, 2), jax.random.key(5)),
    learn(name, add(name, filled(name), 2), jax.random.key(5)),
  )


@every_kind
def test_can_sample_means_one_held_unit_whatever_the_batch_size(name):
  """One meaning on every kind: `sample(state, key, batch_size)` draws only
  held data. A kind that samples with replacement is true once one unit
  (item, window, piece, transition) is held, whatever the batch size; one
  that never repeats an item and pads past those held (queue, heap, a
  budget) once `batch_size` are held. A warm-up is a test of its own on the
  state: `state.size` (item kinds) or `state.steps_held.sum()` (stream
  kinds) counts what was added."""
  buffer = KINDS[name].buffer
  empty = buffer.init(STEP)
  for batch_size in (1, 64):
    assert not bool(buffer.can_sample(empty, batch_size))
  state = filled(name, adds=1)
  held = state.steps_held.sum() if KINDS[name].streams else state.size
  assert int(held) == (NUM_ENVS * CHUNK if KINDS[name].streams else BATCH)
  for batch_size in (1, BATCH, BATCH + 1, 64):
    ready = buffer.can_sample(state, batch_size)
    assert ready.shape == () and ready.dtype == jnp.bool_
    assert bool(ready) == (KINDS[name].repeats or batch_size <= BATCH), batch_size
  with pytest.raises(ValueError, match="can_sample: batch_size must be positive, given 0"):
    buffer.can_sample(state, 0)


@pytest.mark.parametrize("name", ["prioritized", "episode"])  # one path, checked by every kind
def test_jitting_sample_without_a_static_batch_size_names_the_fix(name):
  buffer = KINDS[name].buffer
  state, key = filled(name, adds=1), jax.random.key(0)
  fix = 'jax.jit(buffer.sample, static_argnames="batch_size")'
  with pytest.raises(TypeError, match=re.escape(fix)):
    jax.jit(buffer.sample)(state, key, SAMPLE)
  with pytest.raises(TypeError, match=re.escape(fix.replace("sample", "can_sample", 1))):
    jax.jit(buffer.can_sample)(state, SAMPLE)
  # The fix works, positionally too, and draws what the buffer's own call draws.
  jitted = jax.jit(buffer.sample, static_argnames="batch_size")
  chex.assert_trees_all_equal(jitted(state, key, SAMPLE), buffer.sample(state, key, SAMPLE))
