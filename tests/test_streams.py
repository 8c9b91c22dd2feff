"""The stream convention across every stream kind (issue 32): `final_steps`
in the same add means, byte for byte, the two-add masked form; the bound
functions show only what a caller passes; `help(jaxbuf.streams)` holds for
every kind."""

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from tests import devices

NUM_ENVS, CAPACITY, NUM_STEPS = 3, 3 * 8, 10


class Step(NamedTuple):
  obs: dict
  action: jax.Array
  reward: jax.Array
  terminated: jax.Array
  last: jax.Array


def reward_fn(achieved_goal, desired_goal):
  return -jnp.any(achieved_goal != desired_goal, axis=-1).astype(jnp.float32)


# Every stream kind, small; sequence windows long enough to hold final steps.
KINDS = {
  "sequence": lambda: jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 3),
  "prioritized_sequence": lambda: jaxbuf.prioritized_sequence_replay(
    NUM_ENVS, CAPACITY, 3, episodes="within"
  ),
  "frame_stack": lambda: jaxbuf.frame_stack_replay(NUM_ENVS, CAPACITY, 2, n_step=3),
  "prioritized_frame_stack": lambda: jaxbuf.prioritized_frame_stack_replay(
    NUM_ENVS, CAPACITY, 2, n_step=2
  ),
  "hindsight": lambda: jaxbuf.hindsight_replay(NUM_ENVS, CAPACITY, reward_fn),
  "prioritized_hindsight": lambda: jaxbuf.hindsight_replay(
    NUM_ENVS, CAPACITY, reward_fn, prioritized=True
  ),
  "episode": lambda: jaxbuf.episode_replay(NUM_ENVS, CAPACITY, 4),
}
MODULE_ADDS = {
  "sequence": (jaxbuf.sequence.add, dict(sequence_length=3, period=1, within=False)),
  "frame_stack": (jaxbuf.frames.add, dict(num_stack=2, n_step=3)),
  "hindsight": (jaxbuf.hindsight.add, dict(alpha=None)),
  "episode": (jaxbuf.episode.add, dict(max_episode_length=4, weight_by_length=False)),
}
BUFFERS = {}


def buffer_of(name):
  if name not in BUFFERS:
    BUFFERS[name] = KINDS[name]()
  return BUFFERS[name]


def example_step():
  goal = jnp.zeros(2, jnp.float32)
  return Step(
    obs={"observation": goal, "achieved_goal": goal, "desired_goal": goal},
    action=jnp.int32(0),
    reward=jnp.float32(0),
    terminated=jnp.bool_(False),
    last=jnp.bool_(False),
  )


def without_last(step):
  """The step as a dict without a `last` leaf (episode ends by argument)."""
  return {name: value for name, value in step._asdict().items() if name != "last"}


def vector_steps(seed):
  """A vector env's collect loop: for each step t, the steps of every env,
  its final steps (observations `500 + id`) and which envs ended / stepped."""
  rng = np.random.default_rng(seed)
  ids = (np.arange(NUM_ENVS)[:, None] * 1000 + np.arange(NUM_STEPS)[None, :]).astype(np.float32)
  ended = rng.random((NUM_STEPS, NUM_ENVS)) < 0.35
  stepped = rng.random((NUM_STEPS, NUM_ENVS)) < 0.8
  no = np.zeros((NUM_STEPS, NUM_ENVS), bool)

  def steps(values, last):
    obs = np.broadcast_to(values.T[..., None], (NUM_STEPS, NUM_ENVS, 2))
    return Step(
      obs={"observation": obs, "achieved_goal": obs, "desired_goal": -obs},
      action=values.T.astype(np.int32),
      reward=values.T / 7,
      terminated=rng.random((NUM_STEPS, NUM_ENVS)) < 0.1,
      last=last,
    )

  return steps(ids, no), steps(ids + 500, ended), ended, stepped


def one_add(buffer, state, step, final, ended, stepped, with_last):
  if with_last:
    return buffer.add(state, step, stepped, final_steps=final)
  return buffer.add(
    state, without_last(step), stepped, episode_end=ended, final_steps=without_last(final)
  )


def two_adds(buffer, state, step, final, ended, stepped, with_last):
  """The two-add masked form, the final steps masked to the envs that ended
  and stepped."""
  if with_last:
    state = buffer.add(state, step, stepped)
    return buffer.add(state, final, ended & stepped)
  state = buffer.add(state, without_last(step), stepped)
  return buffer.add(state, without_last(final), ended & stepped, episode_end=ended)


def assert_same_state(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
    other = got
    for key in path:
      other = (
        other[key.key]
        if isinstance(key, jax.tree_util.DictKey)
        else getattr(other, key.name)
        if hasattr(key, "name")
        else other[key.idx]
      )
    assert np.asarray(other).tobytes() == np.asarray(leaf).tobytes(), jax.tree_util.keystr(path)


def init(buffer, with_last):
  step = example_step()
  return buffer.init(step if with_last else without_last(step))


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("with_last", [True, False], ids=["last", "episode_end"])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_final_steps_equal_the_two_add_masked_form_under_scan(name, with_last):
  """Inside a jitted scan of a collect loop with ragged envs: the one-add
  form and the two masked adds give the same state, byte for byte."""
  buffer = buffer_of(name)
  steps, finals, ended, stepped = vector_steps(seed=len(name))

  def collect(add):
    def body(state, inputs):
      return add(buffer, state, *inputs, with_last), None

    return jax.jit(lambda state: jax.lax.scan(body, state, (steps, finals, ended, stepped))[0])

  got = collect(one_add)(init(buffer, with_last))
  want = collect(two_adds)(init(buffer, with_last))
  assert_same_state(got, want)
  # The loop wrote something sampleable, and the final observations where
  # their env ended: each ended env holds its 500 + id observation.
  assert bool(buffer.can_sample(got, 4))
  observation = np.asarray(
    got.storage["obs"]["observation"]
    if isinstance(got.storage, dict)
    else got.storage.obs["observation"]
  )[..., 0]
  for env in range(NUM_ENVS):
    newest = int(got.write_heads[env]) - 1
    t = np.flatnonzero(stepped[:, env])[-1]
    expected = env * 1000 + t + (500 if ended[t, env] else 0)
    assert observation[env, newest % (CAPACITY // NUM_ENVS)] == expected


@pytest.mark.usefixtures("x64_mode")
@pytest.mark.parametrize("name", sorted(MODULE_ADDS))
def test_module_adds_take_final_steps_under_vmap(name):
  """`jaxbuf.<kind>.add` with every setting explicit, vmapped over a batch
  of two buffers, equals the two masked adds."""
  module_add, settings = MODULE_ADDS[name]
  buffer = buffer_of(name)
  steps, finals, ended, stepped = vector_steps(seed=7)
  states = jax.vmap(lambda _: init(buffer, True))(jnp.arange(2))
  pair = lambda tree: jax.tree.map(lambda x: np.stack([x[0], x[1]]), tree)
  step, final = pair(steps), pair(finals)
  add = lambda *args, **kwargs: module_add(*args, **kwargs, **settings)
  got = jax.jit(jax.vmap(lambda s, x, f, m: add(s, x, m, final_steps=f)))(
    states, step, final, stepped[:2]
  )
  want = jax.jit(jax.vmap(lambda s, x, f, m: add(add(s, x, m), f, f.last & m)))(
    states, step, final, stepped[:2]
  )
  assert_same_state(got, want)


def snapshot(state):
  return [np.asarray(leaf).copy() for leaf in jax.tree.leaves(state)]


def bad_adds():
  steps, finals, _, _ = vector_steps(seed=1)
  step, final = jax.tree.map(lambda x: x[0], (steps, finals))
  chunk = jax.tree.map(lambda x: np.stack([x, x], axis=1), final)
  short_obs = final._replace(obs={**final.obs, "observation": np.zeros((NUM_ENVS, 3), np.float32)})
  ends = np.zeros(NUM_ENVS, bool)
  return {
    "a chunk of final steps": (
      lambda b, s: b.add(s, step, final_steps=chunk),
      ValueError,
      ["final_steps", "one step per env", f"[{NUM_ENVS}, 2, ...]"],
    ),
    "a final step leaf of the wrong shape": (
      lambda b, s: b.add(s, step, final_steps=short_obs),
      ValueError,
      ["['observation']", "(3, 3)", "final_steps"],
    ),
    "final steps of another structure": (
      lambda b, s: b.add(s, step, final_steps=final.obs),
      (TypeError, ValueError),
      ["final_steps"],
    ),
    "no flag says which envs ended": (
      lambda b, s: b.add(s, without_last(step), final_steps=without_last(final)),
      TypeError,
      ["final_steps", "`last`", "episode_end"],
    ),
    "episode_end of a chunk with final steps": (
      lambda b, s: b.add(
        s,
        jax.tree.map(lambda x: np.stack([x, x], axis=1), without_last(step)),
        episode_end=np.zeros((NUM_ENVS, 2), bool),
        final_steps=without_last(final),
      ),
      ValueError,
      ["episode_end", f"[{NUM_ENVS}]", "(3, 2)", "`last`"],
    ),
    "episode_end beside a last leaf": (
      lambda b, s: b.add(s, step, episode_end=ends, final_steps=final),
      TypeError,
      ["`last`", "do not pass episode_end"],
    ),
    "a mask of the wrong shape": (
      lambda b, s: b.add(s, step, np.ones(NUM_ENVS + 1, bool), final_steps=final),
      ValueError,
      ["mask", f"({NUM_ENVS + 1},)", f"({NUM_ENVS},)"],
    ),
  }


@pytest.mark.parametrize("row", sorted(bad_adds()))
@pytest.mark.parametrize("name", sorted(KINDS))
def test_bad_final_steps_raise_naming_the_leaf_and_leave_the_state(name, row):
  buffer = buffer_of(name)
  call, error, words = bad_adds()[row]
  with_last = row != "no flag says which envs ended" and "chunk with" not in row
  state = init(buffer, with_last)
  before = snapshot(state)
  with pytest.raises(error) as raised:
    call(buffer, state)
  for word in words:
    assert word in str(raised.value), (word, str(raised.value))
  for got, want in zip(snapshot(state), before):
    np.testing.assert_array_equal(got, want)


# --- The bound functions show only the call's own parameters -----------------

ALL_KINDS = {
  **KINDS,
  "uniform": lambda: jaxbuf.uniform_replay(8),
  "prioritized": lambda: jaxbuf.prioritized_replay(8),
}
OWN_PARAMETERS = {
  "init": ["example_step"],
  "add": ["state", "steps", "mask", "episode_end", "final_steps"],
  "sample": ["state", "key", "batch_size", "step"],
  "update_priorities": ["state", "indices", "priorities", "item_ids"],
  "can_sample": ["state", "batch_size"],
  "clear": ["state"],
}
ITEM_PARAMETERS = {"init": ["example_item"], "add": ["state", "items"]}


@pytest.mark.parametrize("name", sorted(ALL_KINDS))
def test_bound_functions_show_only_their_own_parameters(name):
  """`inspect.signature` and `help()` of a buffer's functions list what a
  caller passes, never the settings bound when the buffer was made, neither
  in the signature nor in the docstring's Args."""
  buffer = ALL_KINDS[name]() if name not in KINDS else buffer_of(name)
  for field, own in OWN_PARAMETERS.items():
    if name in ("uniform", "prioritized"):
      own = ITEM_PARAMETERS.get(field, own)
    function = getattr(buffer, field)
    assert list(inspect.signature(function).parameters) == own, field
    doc = inspect.getdoc(function) or ""
    args = doc.split("Args:")[1].split("\n\n")[0] if "Args:" in doc else ""
    listed = {
      line.split(":")[0].strip()
      for line in args.splitlines()[1:]
      if line.startswith("  ") and not line.startswith("    ")
    }
    named = {word.strip() for entry in listed for word in entry.split(",")}
    assert named <= set(own), (field, named - set(own))


SHARDED_KINDS = {
  "frame_stack": lambda: jaxbuf.frame_stack_replay(4, 4 * 8, 2, n_step=2),
  "hindsight": lambda: jaxbuf.hindsight_replay(4, 4 * 8, reward_fn),
  "episode": lambda: jaxbuf.episode_replay(4, 4 * 8, 4),
}


@devices.needs(2)
@pytest.mark.parametrize("name", sorted(SHARDED_KINDS))
def test_sharded_adds_take_final_steps_as_the_unsharded_buffer(name):
  """Split over two devices (envs in blocks), `final_steps` writes what the
  two masked adds write, and each env's stream is the unsharded one's."""
  plain = SHARDED_KINDS[name]()
  buffer = jaxbuf.sharded(plain, devices.mesh(2))
  rng = np.random.default_rng(3)
  ended = rng.random((4, 4)) < 0.5
  storages = []
  for each, add in ((buffer, one_add), (buffer, two_adds), (plain, one_add)):
    state = each.init(example_step())
    for t in range(4):
      ids = np.arange(4, dtype=np.float32) * 1000 + t
      step, final = (
        Step(
          obs={
            "observation": np.stack([v, v], -1),
            "achieved_goal": np.stack([v, v], -1),
            "desired_goal": np.stack([-v, -v], -1),
          },
          action=v.astype(np.int32),
          reward=v / 7,
          terminated=np.zeros(4, bool),
          last=last,
        )
        for v, last in ((ids, np.zeros(4, bool)), (ids + 500, ended[t]))
      )
      state = add(each, state, step, final, ended[t], np.ones(4, bool), True)
    storages.append(jax.device_get(state.storage))
  assert_same_state(storages[1], storages[0])
  assert_same_state(jax.tree.map(lambda x: x.reshape((4,) + x.shape[2:]), storages[0]), storages[2])
