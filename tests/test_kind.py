"""The kind protocol: states record their buffer's settings, every function
refuses a state made with others (also from a checkpoint), and the record
is what `jaxbuf.sharded` reads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

NUM_ENVS, CAPACITY = 4, 64


def sequence(**settings):
  return jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, **settings)


def prioritized_sequence(**settings):
  return jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, **settings)


# (made with, used with, the setting named, its two values in the message).
# The first three are the probes of issue 26: each sampled broken windows
# (49%, 18%, 20%) before states recorded their settings.
MISMATCHES = {
  "sequence_length": (
    functools.partial(sequence, sequence_length=3),
    functools.partial(sequence, sequence_length=6),
    "sequence_length: state 3, buffer 6",
  ),
  "period": (
    functools.partial(sequence, sequence_length=3, period=1),
    functools.partial(sequence, sequence_length=3, period=4),
    "period: state 1, buffer 4",
  ),
  "episodes": (
    functools.partial(sequence, sequence_length=3),
    functools.partial(sequence, sequence_length=3, episodes="within"),
    "episodes: state 'cross', buffer 'within'",
  ),
  "alpha": (
    functools.partial(jaxbuf.prioritized_replay, CAPACITY, alpha=0.6),
    functools.partial(jaxbuf.prioritized_replay, CAPACITY, alpha=1.0),
    "alpha: state 0.6, buffer 1.0",
  ),
  "eps": (
    functools.partial(prioritized_sequence, sequence_length=2, eps=1e-6),
    functools.partial(prioritized_sequence, sequence_length=2, eps=1e-3),
    "eps: state 1e-06, buffer 0.001",
  ),
}


def example_step():
  return {"obs": jnp.zeros(3, jnp.float32), "step": jnp.int32(0)}


def filled(buffer, steps=12):
  state = buffer.init(example_step())
  if "sequence" in buffer.kind.name:
    chunk = {
      "obs": jnp.ones((NUM_ENVS, steps, 3), jnp.float32),
      "step": jnp.tile(jnp.arange(steps, dtype=jnp.int32), (NUM_ENVS, 1)),
    }
  else:
    chunk = {"obs": jnp.ones((steps, 3), jnp.float32), "step": jnp.arange(steps, dtype=jnp.int32)}
  return buffer.add(state, chunk), chunk


def snapshot(state):
  return [np.asarray(leaf).copy() for leaf in jax.tree.leaves(state)]


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_every_function_refuses_a_state_made_with_other_settings(name):
  make, other, difference = MISMATCHES[name]
  state, chunk = filled(make())
  before = snapshot(state)
  buffer = other()
  calls = {
    "add": lambda: buffer.add(state, chunk),
    "sample": lambda: buffer.sample(state, jax.random.key(0), 4),
    "update_priorities": lambda: buffer.update_priorities(
      state, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.float32)
    ),
    "can_sample": lambda: buffer.can_sample(state, 4),
    "clear": lambda: buffer.clear(state),
    # Inside the user's own jit the check runs while tracing.
    "jitted sample": lambda: jax.jit(lambda s: buffer.sample(s, jax.random.key(0), 4))(state),
  }
  for what, call in calls.items():
    with pytest.raises(ValueError) as raised:
      call()
    message = str(raised.value)
    assert message.startswith(what.split()[-1] + ":"), message
    assert difference in message, message
    for got, want in zip(snapshot(state), before):
      np.testing.assert_array_equal(got, want)


def test_the_same_settings_from_another_buffer_are_accepted():
  state, _ = filled(sequence(sequence_length=3, period=2))
  again = sequence(sequence_length=3, period=2)
  assert bool(again.can_sample(state, 4))
  assert again.sample(state, jax.random.key(0), 4).items["obs"].shape == (4, 3, 3)


def test_a_state_made_by_a_module_init_is_refused_by_every_bound_kind():
  """Row `module-init-state-refused`: a state from a module's `init` records
  no settings (a module init does not take them all), and a bound buffer
  cannot check it: every kind's bound functions refuse it, naming the
  settings (a stack-of-3 buffer added to `jaxbuf.frames.init`'s state and a
  stack-of-2 one sampled it, with no error); the module functions take it."""
  state = jaxbuf.prioritized.init(example_step(), capacity=CAPACITY)
  assert state.settings == ()
  buffer = jaxbuf.prioritized_replay(CAPACITY, alpha=0.9)
  with pytest.raises(ValueError, match=r"add: this state records no settings .*\(alpha 0.9"):
    buffer.add(state, filled(buffer)[1])
  state = jaxbuf.prioritized.add(state, filled(buffer)[1], alpha=0.9)
  assert int(state.size) == 12
  step = {
    "obs": jnp.zeros((), jnp.float32),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }
  made = {
    "uniform_replay": jaxbuf.uniform.init(step, capacity=8),
    "prioritized_replay": jaxbuf.prioritized.init(step, capacity=8),
    "sequence_replay": jaxbuf.sequence.init(step, num_envs=1, capacity=8, with_tree=False),
    "prioritized_sequence_replay": jaxbuf.prioritized_sequence.init(step, num_envs=1, capacity=8),
    "episode_replay": jaxbuf.episode.init(step, num_envs=1, capacity=8),
    "frame_stack_replay": jaxbuf.frames.init(step, num_envs=1, capacity=8),
  }
  buffers = {
    "uniform_replay": jaxbuf.uniform_replay(8),
    "prioritized_replay": jaxbuf.prioritized_replay(8),
    "sequence_replay": jaxbuf.sequence_replay(1, 8, 2),
    "prioritized_sequence_replay": jaxbuf.prioritized_sequence_replay(1, 8, 2),
    "episode_replay": jaxbuf.episode_replay(1, 8, 4),
    "frame_stack_replay": jaxbuf.frame_stack_replay(1, 8, 3),
  }
  for name, bare in made.items():
    buffer = buffers[name]
    for call in (
      lambda: buffer.sample(bare, jax.random.key(0), 2),
      lambda: buffer.can_sample(bare, 2),
      lambda: buffer.clear(bare),
      lambda: jax.jit(buffer.sample, static_argnums=2)(bare, jax.random.key(0), 2),
    ):
      with pytest.raises(ValueError, match=f"records no settings .* this {name} buffer"):
        call()


def test_settings_are_static_and_survive_jit_vmap_scan_and_cond():
  buffer = jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, 3, period=2, alpha=0.7)
  state, chunk = filled(buffer)
  assert dict(state.settings) == {
    "alpha": 0.7,
    "capacity": CAPACITY,
    "episodes": "cross",
    "eps": 1e-6,
    "num_envs": NUM_ENVS,
    "period": 2,
    "sequence_length": 3,
  }
  # Static: part of the tree structure, no leaf, no cost in a jitted step.
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(state.replace(settings=())))
  many = jax.vmap(lambda _: buffer.init(example_step()))(jnp.arange(3))
  assert many.settings == state.settings

  def step(state, key):
    state = jax.lax.cond(key[0] > 0, lambda s: buffer.add(s, chunk), lambda s: s, state)
    return state, buffer.sample(state, jax.random.key(0), 2).weights

  scanned, _ = jax.jit(lambda s: jax.lax.scan(step, s, jnp.arange(4)[:, None]))(state)
  assert scanned.settings == state.settings


def test_load_refuses_a_checkpoint_of_other_settings(tmp_path):
  # Issue 23: loading these silently sampled unwritten slots (length 4 -> 8)
  # and 0.6's distribution under alpha 1.0.
  short = sequence(sequence_length=4)
  state, _ = filled(short, steps=10)
  jaxbuf.save(tmp_path / "short", state)
  longer = sequence(sequence_length=8)
  with pytest.raises(
    ValueError,
    match=r"sequence_length: the checkpoint has "
    r"4, `like` has 8",
  ):
    jaxbuf.load(tmp_path / "short", like=longer.init(example_step()))
  restored = jaxbuf.load(tmp_path / "short", like=short.init(example_step()))
  assert restored.settings == state.settings

  make, other, _ = MISMATCHES["alpha"]
  state, _ = filled(make())
  jaxbuf.save(tmp_path / "alpha", state)
  with pytest.raises(
    ValueError,
    match=r"alpha: the checkpoint has 0\.6, "
    r"`like` has 1\.0",
  ):
    jaxbuf.load(tmp_path / "alpha", like=other().init(example_step()))
  # The no-allocation form keeps the settings too.
  like = jax.eval_shape(other().init, example_step())
  with pytest.raises(ValueError, match="alpha: the checkpoint has 0.6"):
    jaxbuf.load(tmp_path / "alpha", like=like)


def test_the_settings_a_checkpoint_recorded_survive_any_like(tmp_path):
  """Issue 35: a `like` from the module-level `jaxbuf.frames.init` records no
  settings; the state came back with none, and a stack-3 buffer sampled a
  stack-2 checkpoint as (0, 2, 3) where (1, 2, 3) is right."""
  step = {
    "obs": jnp.zeros((), jnp.float32),
    "action": jnp.int32(0),
    "reward": jnp.float32(0),
    "terminated": jnp.bool_(False),
  }
  two, three = (jaxbuf.frame_stack_replay(1, 8, stack) for stack in (2, 3))
  chunk = {
    **jax.tree.map(lambda x: jnp.zeros((1, 4) + x.shape, x.dtype), step),
    "obs": jnp.arange(4, dtype=jnp.float32)[None],
  }
  state = two.add(two.init(step), chunk)
  jaxbuf.save(tmp_path / "two", state)
  for like in (
    jaxbuf.frames.init(step, num_envs=1, capacity=8),
    jax.eval_shape(functools.partial(jaxbuf.frames.init, num_envs=1, capacity=8), step),
  ):
    assert like.settings == ()
    restored = jaxbuf.load(tmp_path / "two", like=like)
    assert restored.settings == state.settings
    with pytest.raises(ValueError, match=r"num_stack: state 2, buffer 3"):
      three.sample(restored, jax.random.key(0), 4)
    two.sample(restored, jax.random.key(0), 4)
  # A module-level state saved and loaded still records none.
  bare = jaxbuf.frames.init(step, num_envs=1, capacity=8)
  jaxbuf.save(tmp_path / "bare", bare)
  assert jaxbuf.load(tmp_path / "bare", like=bare).settings == ()


def test_every_factory_describes_its_kind():
  kinds = {
    "uniform_replay": jaxbuf.uniform_replay(8),
    "prioritized_replay": jaxbuf.prioritized_replay(8),
    "sequence_replay": jaxbuf.sequence_replay(2, 8, 2),
    "prioritized_sequence_replay": jaxbuf.prioritized_sequence_replay(2, 8, 2),
  }
  for name, buffer in kinds.items():
    assert buffer.kind.name == name
    state = buffer.init(example_step())
    assert isinstance(state, buffer.kind.state_type)
    assert state.settings == buffer.kind.settings
    assert buffer.kind.split is not None
    assert not buffer.kind.checked
  assert jaxbuf.uniform_replay(8, checked=True).kind.checked
