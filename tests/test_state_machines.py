"""Hypothesis state machines: every buffer kind against its NumPy model.

One machine, run once per kind (`HARNESSES`: the 8 replay kinds of
`jaxbuf/__init__.py`, one setting each), interleaves `add` (single steps,
chunks, batches that wrap the ring, ragged env masks, episode ends), `sample`,
`update_priorities` (NaN, negative, out-of-range and stale entries), a save
and load round trip, and, for the kinds `jaxbuf.sharded` splits, a regroup
through a checkpoint over D devices (sampled and updated there) and back.
After every step the state is compared with the kind's NumPy model: items
held, sizes, counters, every sum-tree leaf; every sampled row is one the
model says can be sampled (the right item, never an unwritten or
overwritten slot, never across an episode boundary, goals and frames from
the row's own episode).

The models and their row checks are the kinds' own test files' (the
references those files drive with hypothesis operation lists); this file
adds the operations they lack: checkpoints and regrouping, in any order
with the rest. Shapes are fixed per kind so each bound function compiles
once, and a program holds at most 3 checkpoints: about 30 s of CPU for the
8 kinds, half that at `pytest -n 2`.
"""

import pathlib
import tempfile

import chex
import hypothesis
from hypothesis import stateful
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from tests import devices
from tests import test_episode
from tests import test_frames
from tests import test_hindsight
from tests import test_sequence
from tests.reference import ReferencePriorities
from tests.reference import ReferenceReplay
from tests.reference import add_random_stream_steps

SAMPLE_SIZE = 6  # divides by the 2 or 3 devices a kind is regrouped over
SETTINGS = hypothesis.settings(max_examples=5, stateful_step_count=10, deadline=None)


def mesh_of(num_devices):
  return jax.make_mesh((num_devices,), ("data",), devices=jax.devices()[:num_devices])


def bad_update(sample, seed, num_ids):
  """Priorities for `sample`'s rows: signed, some NaN, some ids out of range."""
  rng = np.random.default_rng(seed)
  size = len(sample.indices)
  priorities = rng.uniform(-3, 3, size).astype(np.float32)
  priorities[rng.random(size) < 0.2] = np.nan
  indices = np.asarray(sample.indices).copy()
  indices[rng.random(size) < 0.2] = num_ids + 1
  return indices, priorities


# --- Item replay -------------------------------------------------------------------

ITEM = {"serial": jnp.int32(0), "obs": jnp.zeros(2, jnp.float32)}
ITEM_CAPACITY, ITEM_ALPHA, ITEM_BETA = 8, 0.7, 0.5


class ItemHarness:
  """uniform_replay / prioritized_replay: items are serial numbers."""

  example = ITEM
  add_sizes = (2, 5)
  devices = 2

  def __init__(self, prioritized):
    self.prioritized = prioritized
    self.buffer = (
      jaxbuf.prioritized_replay(ITEM_CAPACITY, alpha=ITEM_ALPHA, beta=ITEM_BETA)
      if prioritized
      else jaxbuf.uniform_replay(ITEM_CAPACITY)
    )
    self.sharded = jaxbuf.sharded(self.buffer, mesh_of(self.devices))

  def reference(self):
    model = ReferenceReplay(ITEM_CAPACITY, alpha=ITEM_ALPHA)
    model.serial = 0
    return model

  def add(self, state, reference, size_index, seed):
    del seed
    size = self.add_sizes[size_index]
    serials = np.arange(reference.serial, reference.serial + size, dtype=np.int32)
    reference.serial += size
    reference.add(serials.tolist())
    return self.buffer.add(
      state, {"serial": serials, "obs": np.stack([serials, -serials], 1).astype(np.float32)}
    )

  def sampleable(self, reference):
    return reference.size > 0

  def check_sample(self, sample, reference, *, sharded=False):
    """Rows by their serials: held, with the model's weight for that item.
    A sharded sample numbers slots its own way, so slots are checked
    unsharded only."""
    serials = np.asarray(sample.items["serial"])
    held = reference.storage[: reference.size]
    slots = np.array([held.index(serial) for serial in serials])
    np.testing.assert_array_equal(sample.items["obs"], np.stack([serials, -serials], 1))
    if not sharded:
      np.testing.assert_array_equal(sample.indices, slots)
      np.testing.assert_array_equal(sample.item_ids, reference.ids[slots] % 2**32)
    if self.prioritized:
      np.testing.assert_allclose(sample.weights, reference.weights(slots, ITEM_BETA), rtol=1e-4)
    else:
      np.testing.assert_array_equal(sample.weights, 1.0)

  def update(self, buffer, state, reference, sample, seed, with_ids):
    indices, priorities = bad_update(sample, seed, ITEM_CAPACITY)
    item_ids = np.asarray(sample.item_ids) if with_ids else None
    state = buffer.update_priorities(state, indices, priorities, item_ids)
    if buffer is self.sharded:
      # The model's slots of the sampled items; the ids are all current.
      held = reference.storage[: reference.size]
      serials = np.asarray(sample.items["serial"])
      indices = np.where(
        indices < ITEM_CAPACITY, [held.index(serial) for serial in serials], indices
      )
      item_ids = None
    reference.update_priorities(indices, priorities, item_ids)
    return state

  def check_state(self, state, reference):
    size = reference.size
    assert int(state.size) == size
    assert int(state.insert_position) == reference.insert_position
    assert int(state.add_count) == reference.add_count % 2**32
    np.testing.assert_array_equal(
      np.asarray(state.storage["serial"])[:size], reference.storage[:size]
    )
    if self.prioritized:
      leaves = np.asarray(state.sum_tree.levels[0])[:ITEM_CAPACITY]
      held = np.arange(ITEM_CAPACITY) < size
      np.testing.assert_allclose(leaves[held], reference.priorities[held] ** ITEM_ALPHA, rtol=1e-5)
      assert np.all(leaves[~held] == 0)
      assert float(state.max_priority) == pytest.approx(reference.max_priority)
      assert int(state.beta_step) == reference.updates

  def splits_evenly(self, reference):
    return reference.size == ITEM_CAPACITY or reference.size % self.devices == 0

  def regrouped(self, reference):
    """A regroup turns a full ring so that its oldest item is slot 0."""
    reference.turn()


# --- Stream kinds: the models of their own test files -------------------------------


class StreamHarness:
  """What every stream kind shares: adds of one step `[N]` (size 0) or
  chunks `[N, T]`, with a random env mask and episode ends."""

  def add(self, state, reference, size_index, seed):
    num_steps = self.add_sizes[size_index]
    rng = np.random.default_rng(seed)
    mask = rng.random(self.num_envs) < 0.8
    return self.add_steps(state, reference, num_steps, mask, seed)

  def add_steps(self, state, reference, num_steps, mask, seed):
    return add_random_stream_steps(
      self.buffer, state, reference, ("add", num_steps, list(mask), seed), self.make_steps
    )

  def splits_evenly(self, reference):
    del reference
    return True  # envs move whole

  def regrouped(self, reference):
    del reference  # window ids and every counter are kept


class SequenceHarness(StreamHarness):
  """sequence_replay / prioritized_sequence_replay (`tests/test_sequence.py`)."""

  example = test_sequence.STEP
  num_envs = test_sequence.NUM_ENVS
  devices = test_sequence.NUM_ENVS
  make_steps = staticmethod(test_sequence.make_steps)

  def __init__(self, config):
    self.config = config
    self.prioritized, self.period, episodes = test_sequence.CONFIGS[config]
    self.within = episodes == "within"
    self.buffer = test_sequence.BUFFERS[config]
    self.sharded = jaxbuf.sharded(self.buffer, mesh_of(self.devices))
    self.add_sizes = (0, 3)

  def reference(self):
    return test_sequence.ReferenceStreams(
      self.num_envs,
      test_sequence.PER_ENV,
      test_sequence.LENGTH,
      period=self.period,
      within=self.within,
      prioritized=self.prioritized,
    )

  def sampleable(self, reference):
    return bool(reference.windows())

  def check_sample(self, sample, reference, *, sharded=False):
    del sharded  # window ids are the unsharded buffer's
    test_sequence.check_sample(
      sample,
      reference,
      SAMPLE_SIZE,
      prioritized=self.prioritized,
      num_windows=len(reference.windows()),
    )

  def update(self, buffer, state, reference, sample, seed, with_ids):
    indices, priorities = bad_update(sample, seed, test_sequence.CAPACITY)
    item_ids = np.asarray(sample.item_ids) if with_ids else None
    state = buffer.update_priorities(state, indices, priorities, item_ids)
    reference.update(indices, priorities, [None] * len(indices) if item_ids is None else item_ids)
    return state

  def check_state(self, state, reference):
    test_sequence.check_state(state, reference, has_tree=self.prioritized or self.within)
    if self.prioritized:
      assert float(state.max_priority) == pytest.approx(reference.max_priority)
      assert int(state.beta_step) == reference.updates


class FramesHarness(StreamHarness):
  """frame_stack_replay / prioritized_frame_stack_replay (`tests/test_frames.py`)."""

  example = test_frames.STEP
  num_envs = test_frames.NUM_ENVS
  devices = test_frames.NUM_ENVS

  def __init__(self, config):
    self.config = config
    (self.prioritized, self.num_stack, self.n_step, self.pad) = test_frames.CONFIGS[config]
    self.buffer = test_frames.config_buffer(config)
    self.sharded = jaxbuf.sharded(self.buffer, mesh_of(self.devices))
    self.add_sizes = (0, 3)

  def reference(self):
    return test_frames.ReferenceFrames(
      self.num_envs,
      test_frames.PER_ENV,
      self.num_stack,
      self.n_step,
      pad=self.pad,
      prioritized=self.prioritized,
    )

  def add_steps(self, state, reference, num_steps, mask, seed):
    length = max(num_steps, 1)
    steps, ends = test_frames.make_steps(reference, length, np.random.default_rng(seed))
    if num_steps == 0:  # one step per env, [N, ...] without a time axis
      state = self.buffer.add(
        state, jax.tree.map(lambda x: x[:, 0], steps), mask=mask, episode_end=ends[:, 0]
      )
    else:
      state = self.buffer.add(state, steps, mask=mask, episode_end=ends)
    reference.add(mask, ends, steps["reward"], steps["terminated"])
    return state

  def sampleable(self, reference):
    return bool(reference.transitions())

  def check_sample(self, sample, reference, *, sharded=False):
    del sharded  # transition ids are the unsharded buffer's
    test_frames.check_sample(sample, reference, SAMPLE_SIZE)

  def update(self, buffer, state, reference, sample, seed, with_ids):
    indices, priorities = bad_update(sample, seed, test_frames.CAPACITY)
    item_ids = np.asarray(sample.item_ids) if with_ids else None
    state = buffer.update_priorities(state, indices, priorities, item_ids)
    if self.prioritized:
      reference.update(indices, priorities, [None] * len(indices) if item_ids is None else item_ids)
    return state

  def check_state(self, state, reference):
    test_frames.check_state(state, reference)
    if self.prioritized:
      assert float(state.max_priority) == pytest.approx(reference.max_priority)


class EpisodeHarness(StreamHarness):
  """episode_replay (`tests/test_episode.py`): whole pieces of episodes."""

  example = test_episode.STEP
  num_envs = test_episode.NUM_ENVS
  devices = test_episode.NUM_ENVS
  prioritized = False
  make_steps = staticmethod(test_episode.make_steps)

  def __init__(self, weight_by_length):
    self.weight_by_length = weight_by_length
    self.buffer = test_episode.make_buffer(weight_by_length)
    self.sharded = jaxbuf.sharded(self.buffer, mesh_of(self.devices))
    self.add_sizes = (0, 3)

  def reference(self):
    return test_episode.ReferencePieces(
      self.num_envs, test_episode.PER_ENV, test_episode.MAX_LENGTH
    )

  def sampleable(self, reference):
    return bool(reference.pieces())

  def check_sample(self, sample, reference, *, sharded=False):
    del sharded  # piece ids are the unsharded buffer's
    test_episode.check_sample(sample, reference)
    np.testing.assert_array_equal(sample.weights, 1.0)

  def check_state(self, state, reference):
    test_episode.check_leaves(state, reference, self.weight_by_length)


class HindsightHarness(StreamHarness):
  """hindsight_replay, prioritized (`tests/test_hindsight.py`): the model's
  goals, and priorities per transition (`ReferencePriorities`)."""

  example = test_hindsight.STEP
  num_envs = test_hindsight.NUM_ENVS
  make_steps = staticmethod(test_hindsight.make_steps)
  prioritized = True
  sharded = None  # hindsight replay does not split over devices
  strategy, relabel_fraction = "future", 0.5
  alpha, beta, eps = 0.6, 0.4, 1e-6  # the factory's defaults

  def __init__(self):
    self.buffer = test_hindsight.make_buffer(self.strategy, self.relabel_fraction, True)
    self.add_sizes = (0, 3)

  def reference(self):
    reference = test_hindsight.ReferenceStreams(self.num_envs, test_hindsight.PER_ENV)
    reference.priorities = ReferencePriorities(self.eps)
    return reference

  def ids(self, reference):
    """{transition id: (env, step)} of every transition that can be sampled."""
    return {
      env * test_hindsight.PER_ENV + step % test_hindsight.PER_ENV: (env, step)
      for env, step in reference.transitions()
    }

  def add_steps(self, state, reference, num_steps, mask, seed):
    state = super().add_steps(state, reference, num_steps, mask, seed)
    reference.priorities.refresh(self.ids(reference).values())
    return state

  def sampleable(self, reference):
    return bool(reference.transitions())

  def check_sample(self, sample, reference, *, sharded=False):
    del sharded
    test_hindsight.check_sample(sample, reference, self.strategy, self.relabel_fraction)
    leaves = self.leaves(reference)
    probabilities = leaves[np.asarray(sample.indices)] / leaves.sum()
    raw = (len(reference.transitions()) * probabilities) ** -self.beta
    np.testing.assert_allclose(sample.weights, raw / raw.max(), rtol=1e-4)

  def update(self, buffer, state, reference, sample, seed, with_ids):
    indices, priorities = bad_update(sample, seed, test_hindsight.CAPACITY)
    item_ids = np.asarray(sample.item_ids) if with_ids else None
    state = buffer.update_priorities(state, indices, priorities, item_ids)
    reference.priorities.update(self.ids(reference), indices, priorities, item_ids)
    return state

  def leaves(self, reference):
    leaves = np.zeros(test_hindsight.CAPACITY)
    for transition_id, key in self.ids(reference).items():
      leaves[transition_id] = np.float32(reference.priorities.of[key]) ** self.alpha
    return leaves

  def check_state(self, state, reference):
    assert int(jnp.sum(state.window_counts)) == len(reference.transitions())
    np.testing.assert_allclose(
      np.asarray(state.window_tree.levels[0])[: test_hindsight.CAPACITY],
      self.leaves(reference),
      rtol=1e-5,
    )
    assert float(state.max_priority) == pytest.approx(reference.priorities.max_priority)


# The kinds, each with the settings its machine runs (jaxbuf/__init__.py names).
HARNESSES = {
  "uniform_replay": lambda: ItemHarness(False),
  "prioritized_replay": lambda: ItemHarness(True),
  "sequence_replay": lambda: SequenceHarness("uniform-within-period2"),
  "prioritized_sequence_replay": lambda: SequenceHarness("prioritized-cross-period4"),
  "episode_replay": lambda: EpisodeHarness(True),
  "hindsight_replay": HindsightHarness,
  "frame_stack_replay": lambda: FramesHarness("uniform-stack3-n1-zeros"),
  "prioritized_frame_stack_replay": lambda: FramesHarness("prioritized-stack4-n2-first"),
}


class BufferMachine(stateful.RuleBasedStateMachine):
  """One buffer and its model; `harness` says how the kind is driven."""

  def __init__(self, harness, directory):
    super().__init__()
    self.harness = harness
    self.directory = pathlib.Path(directory)
    self.state = harness.buffer.init(harness.example)
    self.reference = harness.reference()
    self.last_sample = None
    self.checkpoints = 0

  def abstract_like(self, buffer):
    return jax.eval_shape(buffer.init, self.harness.example)

  def sample_and_check(self, buffer, state, seed, *, sharded):
    # On the host: a sharded sample's rows are split over the devices.
    sample = jax.device_get(buffer.sample(state, jax.random.key(seed), SAMPLE_SIZE))
    if self.harness.sampleable(self.reference):
      self.harness.check_sample(sample, self.reference, sharded=sharded)
      return sample
    np.testing.assert_array_equal(sample.weights, 0.0)
    return None

  @stateful.rule(size_index=st.integers(0, 1), seed=st.integers(0, 2**16))
  def add(self, size_index, seed):
    self.state = self.harness.add(self.state, self.reference, size_index, seed)
    self.last_sample = None  # its ids may be stale now; updates test that too

  @stateful.rule(seed=st.integers(0, 2**16))
  def sample(self, seed):
    self.last_sample = self.sample_and_check(self.harness.buffer, self.state, seed, sharded=False)

  @stateful.precondition(lambda self: self.harness.prioritized and self.last_sample is not None)
  @stateful.rule(seed=st.integers(0, 2**16), with_ids=st.booleans())
  def update_priorities(self, seed, with_ids):
    self.state = self.harness.update(
      self.harness.buffer, self.state, self.reference, self.last_sample, seed, with_ids
    )

  def few_checkpoints(self):
    """Checkpoints cost the most (files, orbax): at most 3 per program, at
    any point of it."""
    return self.checkpoints < 3

  @stateful.precondition(few_checkpoints)
  @stateful.rule()
  def save_and_load(self):
    """A round trip into an abstract `like` (no allocation) is bit-exact;
    the same path is overwritten each time."""
    self.checkpoints += 1
    path = self.directory / "checkpoint"
    jaxbuf.save(path, self.state)
    loaded = jaxbuf.load(path, like=self.abstract_like(self.harness.buffer))
    chex.assert_trees_all_equal(jax.device_get(loaded), jax.device_get(self.state))
    self.state = loaded

  @stateful.precondition(lambda self: self.harness.sharded is not None and self.few_checkpoints())
  @stateful.rule(seed=st.integers(0, 2**16), update=st.booleans(), with_ids=st.booleans())
  def regroup_over_devices_and_back(self, seed, update, with_ids):
    """Saved unsharded, loaded over D devices, sampled (and updated) there
    against the same model, saved and loaded back unsharded."""
    self.checkpoints += 1
    harness = self.harness
    path = self.directory / "regroup"
    jaxbuf.save(path, self.state)
    like = self.abstract_like(harness.sharded)
    if not harness.splits_evenly(self.reference):
      with pytest.raises(ValueError, match="do not split evenly over"):
        jaxbuf.load(path, like=like)
      return
    spread = jaxbuf.load(path, like=like)
    assert spread.settings == like.settings
    sample = self.sample_and_check(harness.sharded, spread, seed, sharded=True)
    if update and harness.prioritized and sample is not None:
      spread = harness.update(harness.sharded, spread, self.reference, sample, seed, with_ids)
    jaxbuf.save(path, spread)
    self.state = jaxbuf.load(path, like=self.abstract_like(harness.buffer))
    harness.regrouped(self.reference)
    self.last_sample = None  # slots are numbered anew

  @stateful.invariant()
  def matches_the_model(self):
    self.harness.check_state(self.state, self.reference)
    assert bool(self.harness.buffer.can_sample(self.state, 1)) == (
      self.harness.sampleable(self.reference)
    )


@devices.needs(4)  # the checkpoints regroup each kind over 2 to 4 devices
@pytest.mark.parametrize("kind", sorted(HARNESSES))
def test_random_programs_match_the_numpy_model(kind):
  harness = HARNESSES[kind]()
  with tempfile.TemporaryDirectory() as directory:
    stateful.run_state_machine_as_test(lambda: BufferMachine(harness, directory), settings=SETTINGS)
