"""The conformance suite: every buffer kind, through its `jaxbuf.Buffer`.

Each kind is made by its public factory and driven by the same checks
(STYLE.md, convention 8): every function keeps the state's structure, shapes
and dtypes; runs under `jit` as it does eagerly; under `vmap` over many
states as one at a time; inside `lax.scan` as in a Python loop; inside
`lax.cond`; compiles once (traced once inside a jitted step, no new program
for the bound functions' second and later calls); and a bad add raises while
tracing, naming the leaf, and leaves the state intact. What is particular to
a kind (its sampling law, its windows, episodes, stacks or relabelling)
stays in that kind's own file.
"""

import functools
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
STEP = {"obs": {"observation": jnp.zeros(2, jnp.float32),
                "achieved_goal": jnp.zeros(1, jnp.float32),
                "desired_goal": jnp.zeros(1, jnp.float32)},
        "action": jnp.int32(0), "reward": jnp.float32(0),
        "terminated": jnp.bool_(False)}


class Kind(NamedTuple):
  buffer: jaxbuf.Buffer
  streams: bool           # adds [N, T, ...] with episode ends, else [B, ...]


KINDS = {
    "uniform": Kind(jaxbuf.uniform_replay(CAPACITY), False),
    "prioritized": Kind(jaxbuf.prioritized_replay(CAPACITY, alpha=0.7,
                                                  beta=0.5), False),
    "sequence": Kind(jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 2), True),
    "prioritized_sequence": Kind(jaxbuf.prioritized_sequence_replay(
        NUM_ENVS, CAPACITY, 2, alpha=0.7), True),
    "frame_stack": Kind(jaxbuf.frame_stack_replay(
        NUM_ENVS, CAPACITY, 2, n_step=2), True),
    "prioritized_frame_stack": Kind(jaxbuf.prioritized_frame_stack_replay(
        NUM_ENVS, CAPACITY, 2, n_step=2), True),
    "hindsight": Kind(jaxbuf.hindsight_replay(NUM_ENVS, CAPACITY, reward_fn),
                      True),
    "prioritized_hindsight": Kind(jaxbuf.hindsight_replay(
        NUM_ENVS, CAPACITY, reward_fn, prioritized=True), True),
    "episode": Kind(jaxbuf.episode_replay(NUM_ENVS, CAPACITY, CHUNK), True),
}

pytestmark = pytest.mark.parametrize("name", sorted(KINDS))


def chunk(t: Any) -> dict:
  """The data of add number `t` (an int or a traced int32): item kinds get
  `[BATCH, ...]`, stream kinds `[N, CHUNK, ...]`, each chunk an episode."""
  serial = t * 10 + jnp.arange(NUM_ENVS * CHUNK).reshape(NUM_ENVS, CHUNK)
  serial = serial.astype(jnp.float32)
  goal = jnp.mod(serial, 2.0)[..., None]
  return {"obs": {"observation": jnp.stack([serial, -serial], -1),
                  "achieved_goal": goal, "desired_goal": 1.0 - goal},
          "action": serial.astype(jnp.int32) % 3,
          "reward": serial / 2,
          "terminated": jnp.zeros(serial.shape, bool)}


def add_arguments(name: str, data: dict) -> tuple[dict, dict]:
  """`add`'s data and keywords for `chunk`'s data: the first BATCH rows for
  item kinds, the streams with an episode end at their last step else."""
  if KINDS[name].streams:
    ends = np.zeros((NUM_ENVS, CHUNK), bool)
    ends[:, -1] = True
    return data, {"episode_end": ends}
  return jax.tree.map(lambda x: x.reshape((NUM_ENVS * CHUNK,) + x.shape[2:])
                      [:BATCH], data), {}


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
  return buffer.update_priorities(state, sample.indices, priorities,
                                  sample.item_ids), sample


def snapshot(tree) -> list[np.ndarray]:
  return [np.asarray(leaf).copy() for leaf in jax.tree.leaves(tree)]


def assert_trees_equal(got, want):
  """Equal structure and integer leaves, float leaves to float32 rounding
  (a jitted program may fuse what eager calls round one by one)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf),
                               rtol=1e-6)


def test_every_function_keeps_structure_shapes_and_dtypes(name):
  buffer = KINDS[name].buffer
  state = filled(name)
  sample = buffer.sample(state, jax.random.key(0), SAMPLE)
  for after in (jax.eval_shape(functools.partial(add, name), state, 5),
                jax.eval_shape(lambda s: learn(name, s, jax.random.key(0))[0],
                               state),
                jax.eval_shape(buffer.clear, state)):
    chex.assert_trees_all_equal_shapes_and_dtypes(after, state)
    assert jax.tree.structure(after) == jax.tree.structure(state)
  assert sample.indices.shape == sample.weights.shape == (SAMPLE,)
  assert sample.weights.dtype == jnp.float32


def test_jit_gives_what_eager_calls_give(name):
  buffer = KINDS[name].buffer
  key = jax.random.key(1)
  jitted = jax.jit(lambda s, k: learn(name, add(name, s, 2), k))(
      filled(name), key)
  assert_trees_equal(jitted, learn(name, add(name, filled(name), 2), key))
  assert bool(jax.jit(buffer.can_sample, static_argnums=1)(filled(name),
                                                           SAMPLE))


# The bound add donates its state; traced under vmap it has nothing to reuse.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_vmap_over_many_states_matches_one_at_a_time(name):
  buffer = KINDS[name].buffer
  num_states = 3
  starts = jnp.arange(num_states, dtype=jnp.int32) * 7
  keys = jax.random.split(jax.random.key(2), num_states)

  def one(start, key):
    state = add(name, add(name, buffer.init(STEP), start), start + 1)
    return learn(name, state, key)

  states, samples = jax.vmap(one)(starts, keys)
  assert jax.vmap(lambda s: buffer.can_sample(s, SAMPLE))(states).all()
  for i in range(num_states):
    assert_trees_equal(jax.tree.map(lambda x, i=i: x[i], (states, samples)),
                       one(starts[i], keys[i]))
  assert not jax.vmap(lambda s: buffer.can_sample(s, 1))(
      jax.vmap(buffer.clear)(states)).any()


@pytest.mark.usefixtures("x64_mode")  # the same with x64 on
def test_scan_matches_a_python_loop(name):
  state = KINDS[name].buffer.init(STEP)
  keys = jax.random.split(jax.random.key(3), 6)

  def body(state, inputs):
    t, key = inputs
    state, sample = learn(name, add(name, state, t), key)
    return state, sample.indices

  ts = jnp.arange(6, dtype=jnp.int32)
  scanned = jax.jit(lambda s: jax.lax.scan(body, s, (ts, keys)))(state)
  looped, indices = state, []
  for t, key in zip(ts, keys):
    looped, index = body(looped, (t, key))
    indices.append(index)
  assert_trees_equal(scanned, (looped, jnp.stack(indices)))


def test_every_function_runs_inside_lax_cond(name):
  buffer = KINDS[name].buffer
  state = filled(name)

  @jax.jit
  def step(state, key, learning):
    state = jax.lax.cond(learning & buffer.can_sample(state, SAMPLE),
                         lambda s: learn(name, s, key)[0], lambda s: s, state)
    return jax.lax.cond(learning, lambda s: add(name, s, 9), buffer.clear,
                        state)

  learned = step(state, jax.random.key(4), jnp.bool_(True))
  assert_trees_equal(learned, add(name, learn(name, filled(name),
                                              jax.random.key(4))[0], 9))
  assert not bool(buffer.can_sample(
      step(state, jax.random.key(4), jnp.bool_(False)), 1))


def test_compiles_once(name):
  buffer = KINDS[name].buffer
  state = buffer.init(STEP)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, key, t):
    return learn(name, add(name, state, t), key)[0]

  for t in range(3):
    state = step(state, jax.random.key(t), jnp.int32(t))
  # The bound functions, called from Python: count JAX's trace and compile
  # events, which every new program records, over the second and later calls.
  events = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event in ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/backend_compile_duration"):
      events.append(event)

  # Built before listening: their own ops compile.
  data = [add_arguments(name, chunk(t)) for t in range(6)]
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    def calls(t):
      nonlocal state
      state = buffer.add(state, data[t][0], **data[t][1])
      state, _ = learn(name, state, jax.random.key(t))
      assert bool(buffer.can_sample(state, 1))
      state = buffer.clear(state) if t == 4 else state
    calls(0)
    calls(4)
    assert events  # the first calls compiled: the listener hears them
    events.clear()
    for t in range(1, 5):
      calls(t)
    assert not events, events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("bad", ["shape", "dtype", "missing"])
def test_a_bad_add_raises_naming_the_leaf_and_leaves_the_state_intact(
    name, bad):
  buffer = KINDS[name].buffer
  state = filled(name)
  before = snapshot(state)
  data, keywords = add_arguments(name, chunk(2))
  reward = data["reward"]
  data = dict(data, reward={
      "shape": jnp.zeros(reward.shape + (2,), reward.dtype),
      "dtype": reward.astype(jnp.int32)}.get(bad))
  if bad == "missing":
    del data["reward"]
  with pytest.raises((ValueError, TypeError)) as raised:
    buffer.add(state, data, **keywords)
  if bad != "missing":
    assert "reward" in str(raised.value), str(raised.value)
  for got, want in zip(snapshot(state), before):
    np.testing.assert_array_equal(got, want)
  assert_trees_equal(learn(name, state, jax.random.key(5)),
                     learn(name, filled(name), jax.random.key(5)))

