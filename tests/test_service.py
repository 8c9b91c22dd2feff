"""The replay service (issue 43): host threads around one buffer state.

Every wait here has a timeout (`JOIN` seconds for a thread, the service's
own `timeout=` for a blocking call), so a deadlock fails a test instead of
hanging the suite. Threads hand their exceptions back through a list: an
exception escaping a thread would be a warning, and warnings are errors.
"""

import math
import pathlib
import threading

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf

JOIN = 60.0  # seconds any test waits for a thread


def run_threads(targets):
  """Runs each callable in its own thread; returns the exceptions raised."""
  errors: list = []

  def wrapped(target):
    try:
      target()
    except BaseException as error:  # pylint: disable=broad-exception-caught
      errors.append(error)

  threads = [threading.Thread(target=wrapped, args=(target,)) for target in targets]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(JOIN)
    assert not thread.is_alive(), "a thread did not finish: deadlock?"
  return errors


def items_service(capacity=1024, limiter=None):
  buffer = jaxbuf.uniform_replay(capacity)
  state = buffer.init({"x": np.float32(0), "actor": np.int32(0)})
  return jaxbuf.ReplayService(buffer, state, rate_limiter=limiter)


def items(values, actor):
  values = np.asarray(values, np.float32)
  return {"x": values, "actor": np.full(len(values), actor, np.int32)}


# Rate limiters ---------------------------------------------------------------


def test_limiters_have_reverbs_meaning():
  counts = jaxbuf.RateCounts
  min_size = jaxbuf.MinSize(10)
  assert not min_size.can_sample(counts(9, 0), 1)
  assert min_size.can_sample(counts(10, 10**6), 10**6)
  assert min_size.can_insert(counts(10**6, 0), 10**6)
  ratio = jaxbuf.SampleToInsertRatio(2.0, min_size=4, error_buffer=8.0)  # window 8 +- 8
  assert ratio.can_insert(counts(4, 0), 0) and ratio.can_insert(counts(7, 0), 1)  # 8*2 = 16
  assert not ratio.can_insert(counts(8, 0), 1)  # 18 > 16
  assert ratio.can_sample(counts(4, 0), 8) and not ratio.can_sample(counts(4, 0), 9)
  assert not ratio.can_sample(counts(3, 0), 1)  # below min_size
  queue = jaxbuf.Queue(3)
  assert queue.can_insert(counts(2, 0), 1) and not queue.can_insert(counts(3, 0), 1)
  assert queue.can_sample(counts(3, 1), 2) and not queue.can_sample(counts(3, 1), 3)


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda: jaxbuf.SampleToInsertRatio(math.nan, 1, 10.0), "samples_per_insert"),
    (lambda: jaxbuf.SampleToInsertRatio(-1.0, 1, 10.0), "samples_per_insert"),
    (lambda: jaxbuf.SampleToInsertRatio(0.0, 1, 10.0), "samples_per_insert"),
    (lambda: jaxbuf.SampleToInsertRatio(math.inf, 1, 10.0), "samples_per_insert"),
    (lambda: jaxbuf.SampleToInsertRatio(1.0, 1, math.nan), "error_buffer"),
    (lambda: jaxbuf.SampleToInsertRatio(1.0, 0, 10.0), "min_size"),
    (lambda: jaxbuf.SampleToInsertRatio(4.0, 1, 3.0), "can block each other forever"),
    (lambda: jaxbuf.MinSize(0), "min_size"),
    (lambda: jaxbuf.Queue(0), "max_size"),
  ],
)
def test_limiters_refuse_bad_and_unsatisfiable_settings(make, message):
  with pytest.raises(ValueError, match=message):
    make()


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
  ratio=st.sampled_from([0.25, 1.0, 2.0, 3.0, 16.0]),
  min_size=st.integers(1, 20),
  error_buffer=st.floats(1.0, 200.0),
  insert_units=st.integers(1, 8),
  sample_rows=st.integers(1, 64),
  choices=st.lists(st.booleans(), min_size=1, max_size=300),
)
def test_sizes_the_limiter_accepts_never_block_both_sides(
  ratio, min_size, error_buffer, insert_units, sample_rows, choices
):
  """Any interleaving of inserts of `insert_units` and samples of
  `sample_rows` that `check_sizes` accepts always leaves a move: the side
  chosen runs if allowed, else the other must be (never both blocked)."""
  try:
    limiter = jaxbuf.SampleToInsertRatio(ratio, min_size, max(error_buffer, ratio))
    limiter.check_sizes(insert_units, sample_rows)
  except ValueError:
    return
  counts = jaxbuf.RateCounts(0, 0)
  for insert_first in choices:
    can_insert = limiter.can_insert(counts, insert_units)
    can_sample = limiter.can_sample(counts, sample_rows)
    assert can_insert or can_sample, (limiter, counts)
    if can_insert and (insert_first or not can_sample):
      counts = counts._replace(inserts=counts.inserts + insert_units)
    else:
      counts = counts._replace(samples=counts.samples + sample_rows)
    if counts.inserts >= min_size:  # the diff stays inside the window
      diff = counts.inserts * ratio - counts.samples
      assert limiter.min_diff <= diff <= limiter.max_diff + insert_units * ratio


def test_sizes_that_deadlock_are_told_to_every_waiting_caller():
  """SampleToInsertRatio(1, 1, 4), window [-3, 5]: after an add of 4 a
  sample of 8 needs the diff >= 5 and an add of 4 needs it <= 1. One
  thread alone times out (another add, of 1, would let it run); an actor
  and a learner waiting on each other are both told."""
  service = items_service(limiter=jaxbuf.SampleToInsertRatio(1.0, min_size=1, error_buffer=4.0))
  writer = service.writer()
  writer.add(items(range(4), 0), timeout=1.0)
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(0), 8, timeout=0.05)
  raised: list = []

  def learner():
    try:
      service.sample(jax.random.key(0), 8, timeout=10.0)
    except ValueError as error:
      raised.append(error)

  thread = threading.Thread(target=learner)
  thread.start()
  with pytest.raises(ValueError, match="block each other forever") as error:
    writer.add(items(range(4, 8), 0), timeout=10.0)
  thread.join(10.0)
  assert not thread.is_alive() and len(raised) == 1
  assert "samples of [8] rows" in str(error.value) and "error_buffer" in str(error.value)
  assert service.counts == jaxbuf.RateCounts(4, 0)
  service.close()


def test_restored_counts_never_block_both_sides():
  ratio = jaxbuf.SampleToInsertRatio(1.0, min_size=10, error_buffer=2.0)  # window [8, 12]
  stuck = jaxbuf.RateCounts(inserts=20, samples=7)  # diff 13: no insert; and sample? 12 >= 8
  assert ratio.restored(stuck) == stuck  # a sample may run: kept
  narrow = jaxbuf.RateLimiter(1.0, 10, 8.0, 9.0)  # made directly: window [8, 9]
  both = jaxbuf.RateCounts(inserts=20, samples=11)  # diff 9: insert -> 10 > 9; sample -> 8 >= 8
  assert narrow.restored(both) == both
  blocked = jaxbuf.RateLimiter(1.0, 10, 8.0, 8.5)
  counts = jaxbuf.RateCounts(inserts=20, samples=12)  # diff 8: no insert (9 > 8.5), no sample
  assert not blocked.can_insert(counts, 1) and not blocked.can_sample(counts, 1)
  fixed = blocked.restored(counts)
  assert blocked.can_insert(fixed, 1) and fixed.inserts == 20


# Adds and samples --------------------------------------------------------------


def test_concurrent_writers_lose_nothing_and_coalesce():
  service = items_service(capacity=512)
  actors, adds, rows = 4, 30, 3

  def actor(index):
    writer = service.writer()
    for add in range(adds):
      values = index * 1000 + add * rows + np.arange(rows)
      writer.add(items(values, index), policy_version=add, timeout=JOIN)

  assert not run_threads([lambda i=i: actor(i) for i in range(actors)])
  state = service.state
  held = np.asarray(state.storage["x"])[: int(state.size)]
  expected = [i * 1000 + k for i in range(actors) for k in range(adds * rows)]
  assert sorted(held.astype(int).tolist()) == expected
  # Each actor's rows stay in its own order.
  for index in range(actors):
    own = held[np.asarray(state.storage["actor"])[: int(state.size)] == index]
    assert np.all(np.diff(own) > 0)
  assert service.adds == actors * adds
  assert service.device_adds <= service.adds
  assert service.counts.inserts == actors * adds * rows
  service.close()


def test_version_lag_and_max_version_lag():
  service = items_service(capacity=64)
  writer = service.writer()
  for version in range(8):
    writer.add(items(np.full(4, version), 0), policy_version=version)
  sample = service.sample(jax.random.key(0), 256, timeout=1.0)
  versions = np.asarray(sample.batch.items["x"]).astype(int)
  np.testing.assert_array_equal(np.asarray(sample.version_lag), 7 - versions)
  assert sample.version_lag.dtype == jnp.int32
  recent = service.sample(jax.random.key(1), 256, timeout=1.0, max_version_lag=2)
  drawn = np.asarray(recent.batch.items["x"]).astype(int)
  assert set(drawn.tolist()) == {5, 6, 7}  # only eligible rows, each of them drawn
  # Uniform among the 12 eligible rows: each version's count ~ Binomial(256, 1/3);
  # 5 standard deviations (about 7.5 rows each) is a fixed-seed bound.
  counts = np.bincount(drawn - 5, minlength=3)
  assert np.all(np.abs(counts - 256 / 3) < 5 * math.sqrt(256 * (1 / 3) * (2 / 3)))
  with pytest.raises(ValueError, match="max_version_lag"):
    service.sample(jax.random.key(1), 4, max_version_lag=-1)
  service.close()


def test_stream_writers_own_env_rows_and_keep_streams_contiguous():
  buffer = jaxbuf.sequence_replay(4, 64, 2)
  example = {"obs": np.float32(0), "last": np.bool_(False)}
  service = jaxbuf.ReplayService(buffer, buffer.init(example))
  writers = [service.writer(envs=[0, 2]), service.writer(envs=[1, 3])]
  with pytest.raises(ValueError, match="belong to another writer"):
    service.writer(envs=[3])
  steps = 12

  def actor(index):
    writer = writers[index]
    for t in range(steps):
      obs = np.float32(t) + 100 * writer.envs.astype(np.float32)
      ended = np.full(2, t % 5 == 4)
      final = {"obs": obs + 0.5, "last": ended}
      writer.add(
        {"obs": obs, "last": np.zeros(2, bool)},
        policy_version=index,
        timeout=JOIN,
        final_steps=final,
      )

  assert not run_threads([lambda i=i: actor(i) for i in range(2)])
  state = service.state
  obs = np.asarray(state.storage["obs"])
  for env in range(4):
    stream = [100 * env + t for t in range(steps)]
    for end in (4, 9):  # a final step after the steps of t = 4 and t = 9
      stream.insert(stream.index(100 * env + end) + 1, 100 * env + end + 0.5)
    np.testing.assert_array_equal(obs[env, : len(stream)], stream)
  lags = service.sample(jax.random.key(0), 64, timeout=1.0)
  envs = np.asarray(lags.batch.indices) // 16  # R = C // N = 64 // 4
  np.testing.assert_array_equal(np.asarray(lags.version_lag), 1 - envs % 2)
  service.close()


def test_a_vector_env_recorder_feeds_a_writer():
  gym = pytest.importorskip("gymnasium")
  envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
  buffer = jaxbuf.uniform_replay(256)
  recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  service = jaxbuf.ReplayService(buffer, buffer.init(recorder.example))
  writer = service.writer()
  obs, _ = envs.reset(seed=0)
  recorder.reset(obs)
  for _ in range(20):
    actions = envs.action_space.sample()
    writer.add(recorder.record(actions, *envs.step(actions)), policy_version=1)
  assert 30 <= service.counts.inserts <= 40  # reset steps are left out
  assert int(service.state.size) == service.counts.inserts
  envs.close()
  service.close()


def test_recorders_feed_stream_writers_of_their_own_envs():
  gym = pytest.importorskip("gymnasium")
  buffer = jaxbuf.sequence_replay(4, 256, 2)

  def make_envs():
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=5)] * 2)

  example = jaxbuf.VectorEnvRecorder(make_envs(), buffer).example
  service = jaxbuf.ReplayService(buffer, buffer.init(example))

  def actor(index):
    envs = make_envs()
    recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
    writer = service.writer(envs=[2 * index, 2 * index + 1])
    obs, _ = envs.reset(seed=index)
    recorder.reset(obs)
    for _ in range(12):
      actions = envs.action_space.sample()
      writer.add(recorder.record(actions, *envs.step(actions)), policy_version=index, timeout=JOIN)
    envs.close()

  assert not run_threads([lambda i=i: actor(i) for i in range(2)])
  state = service.state
  # Episodes of 5 steps (12 vector steps: 2 episodes, 2 reset steps not
  # stored): each env's stream holds 5 steps, then the final observation
  # flagged last, twice.
  last = np.asarray(state.storage.last)
  for env in range(4):
    assert int(state.steps_held[env]) == 12  # 2 x (5 steps + the final one)
    np.testing.assert_array_equal(np.flatnonzero(last[env, :12]), [5, 11])
  service.close()


def test_prioritized_updates_and_a_jitted_learner_step():
  buffer = jaxbuf.prioritized_replay(64)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.float32(0)))
  service.writer().add(np.arange(16, dtype=np.float32))
  sample = service.sample(jax.random.key(0), 8, timeout=1.0)
  service.update_priorities(sample, np.full(8, 5.0, np.float32))

  @jax.jit
  def train_step(state, key):
    batch = buffer.sample(state, key, 4)
    state = buffer.update_priorities(state, batch.indices, batch.items + 1, batch.item_ids)
    return state, jnp.mean(batch.items)

  loss = service.learn(train_step, 4, jax.random.key(1), timeout=1.0)
  assert np.isfinite(float(loss))
  assert service.counts.samples == 12
  service.close()


def test_checkpoint_restores_state_counts_and_versions(tmp_path):
  limiter = jaxbuf.SampleToInsertRatio(1.0, min_size=4, error_buffer=16.0)
  service = items_service(capacity=32, limiter=limiter)
  writer = service.writer()
  writer.add(items(range(8), 0), policy_version=3)
  writer.add(items(range(8, 12), 0), policy_version=5)
  service.sample(jax.random.key(0), 6, timeout=1.0)
  service.checkpoint(tmp_path / "ckpt")
  like = service.state
  restored = jaxbuf.ReplayService.restore(
    tmp_path / "ckpt", service.buffer, like, rate_limiter=limiter
  )
  assert restored.counts == jaxbuf.RateCounts(12, 6)
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(like), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  lag = restored.sample(jax.random.key(1), 16, timeout=1.0)
  np.testing.assert_array_equal(
    np.asarray(lag.version_lag), np.where(np.asarray(lag.batch.items["x"]) < 8, 2, 0)
  )
  restored.writer().add(items([1.0], 0), timeout=1.0)  # not blocked
  service.close()
  restored.close()


def test_queue_hands_out_every_item_once_in_order():
  service = items_service(capacity=16, limiter=jaxbuf.Queue(8))
  adds, batch = 40, 4

  def actor():
    writer = service.writer()
    for add in range(adds):
      writer.add(items([add], 0), policy_version=add, timeout=JOIN)

  taken: list = []

  def learner():
    for step in range(adds // batch):
      sample = service.sample(jax.random.key(step), batch, timeout=JOIN)
      assert np.all(np.asarray(sample.batch.mask))
      taken.extend(np.asarray(sample.batch.items["x"]).astype(int).tolist())
      unread = service.counts.inserts - service.counts.samples
      assert 0 <= unread <= 8  # inserts wait while 8 are unread

  assert not run_threads([actor, learner])
  assert taken == list(range(adds))  # FIFO, each exactly once
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(0), 1, timeout=0.05)  # nothing unread
  service.close()
  with pytest.raises(ValueError, match="overwrite unread items"):
    items_service(capacity=4, limiter=jaxbuf.Queue(8))


def test_a_consuming_buffer_retires_what_the_service_hands_out():
  buffer = jaxbuf.queue_replay(16)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.float32(0)))
  service.writer().add(np.arange(6, dtype=np.float32))
  first = service.sample(jax.random.key(0), 4, timeout=1.0).batch
  with pytest.raises(TimeoutError, match="fewer than 4 live items"):  # 2 left: it would pad
    service.sample(jax.random.key(1), 4, timeout=0.05)
  second = service.sample(jax.random.key(1), 2, timeout=1.0).batch
  np.testing.assert_array_equal(np.asarray(first.items), [0, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(second.items), [4, 5])
  service.close()


# Faults ----------------------------------------------------------------------


def test_adds_and_samples_after_close_raise_service_closed():
  service = items_service()
  writer = service.writer()
  writer.add(items([1.0], 0))
  service.close()
  service.close()  # idempotent
  with pytest.raises(jaxbuf.ServiceClosed):
    writer.add(items([2.0], 0))
  with pytest.raises(jaxbuf.ServiceClosed):
    service.sample(jax.random.key(0), 1)
  with pytest.raises(jaxbuf.ServiceClosed):
    service.writer()


def test_a_wrong_structure_is_refused_at_its_actor_only():
  service = items_service()
  good, bad = service.writer(), service.writer()
  good.add(items([1.0, 2.0], 0))
  before = jax.tree.map(np.asarray, service.state)
  with pytest.raises((TypeError, ValueError)):
    bad.add({"x": np.zeros(2, np.float32)})  # a leaf missing
  with pytest.raises((TypeError, ValueError)):
    bad.add({"x": np.zeros((2, 3), np.float32), "actor": np.zeros(2, np.int32)})  # a shape
  after = jax.tree.map(np.asarray, service.state)
  for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(got, want)
  assert service.counts.inserts == 2
  good.add(items([3.0], 0))
  bad.add(items([4.0], 1))  # the refused writer still works with good items
  assert service.counts.inserts == 4
  service.close()


def test_a_writer_is_refused_from_a_second_thread():
  service = items_service()
  writer = service.writer()
  writer.add(items([1.0], 0))
  errors = run_threads([lambda: writer.add(items([2.0], 0))])
  assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
  assert "belongs to thread" in str(errors[0])
  service.close()


@pytest.mark.parametrize("timeout", [-1.0, math.nan])
def test_negative_and_nan_timeouts_are_refused(timeout):
  service = items_service()
  with pytest.raises(ValueError, match="timeout"):
    service.writer().add(items([1.0], 0), timeout=timeout)
  with pytest.raises(ValueError, match="timeout"):
    service.sample(jax.random.key(0), 1, timeout=timeout)
  assert service.counts == jaxbuf.RateCounts(0, 0)
  service.close()


def test_blocked_calls_time_out():
  service = items_service(limiter=jaxbuf.SampleToInsertRatio(1.0, min_size=2, error_buffer=2.0))
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(0), 1, timeout=0.05)
  writer = service.writer()
  writer.add(items(range(2), 0), timeout=0.05)
  writer.add(items(range(2), 0), timeout=0.05)  # diff 4 = 2 + 2
  with pytest.raises(TimeoutError):
    writer.add(items([0.0], 0), timeout=0.05)
  assert service.counts == jaxbuf.RateCounts(4, 0)
  service.close()


def test_close_wakes_every_blocked_call():
  service = items_service(limiter=jaxbuf.SampleToInsertRatio(1.0, min_size=4, error_buffer=1.0))
  writer = service.writer()
  for value in range(5):
    writer.add(items([value], 0))  # diff 5 = 4 + 1: further inserts wait for samples
  started = threading.Barrier(3, timeout=JOIN)
  blocked_sampler = items_service(limiter=jaxbuf.MinSize(100))

  def blocked_insert():
    started.wait()
    writer2.add(items([9.0], 0), timeout=JOIN)

  def blocked_sample():
    started.wait()
    blocked_sampler.sample(jax.random.key(0), 1, timeout=JOIN)

  writer2 = service.writer()
  closer = threading.Timer(0.2, lambda: (service.close(), blocked_sampler.close()))
  closer.start()
  errors = run_threads([blocked_insert, blocked_sample, started.wait])
  closer.join(JOIN)
  assert len(errors) == 2 and all(isinstance(e, jaxbuf.ServiceClosed) for e in errors)


def test_an_exception_inside_the_add_path_leaves_the_state_whole(monkeypatch):
  service = items_service()
  writer = service.writer()
  writer.add(items([1.0, 2.0], 0))
  before = jax.tree.map(np.asarray, service.state)
  real = service._donating_add  # pylint: disable=protected-access

  def dying(*args, **kwargs):
    raise KeyboardInterrupt("actor killed mid-add")

  monkeypatch.setattr(service, "_donating_add", dying)
  errors = run_threads([lambda: service.writer().add(items([3.0], 1))])
  assert len(errors) == 1 and isinstance(errors[0], KeyboardInterrupt)
  monkeypatch.setattr(service, "_donating_add", real)
  for got, want in zip(jax.tree.leaves(service.state), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(np.asarray(got), want)
  assert service.counts.inserts == 2  # the dead add's reservation released
  writer.add(items([4.0], 0), timeout=1.0)  # the others go on
  assert service.counts.inserts == 3
  service.close()


def test_a_learner_exception_keeps_the_state_and_tells_the_actors():
  service = items_service(limiter=jaxbuf.SampleToInsertRatio(1.0, min_size=2, error_buffer=2.0))
  writer = service.writer()
  writer.add(items(range(2), 0))
  writer.add(items(range(2), 0))  # diff 4 = 2 + 2: the next add waits for the learner
  before = jax.tree.map(np.asarray, service.state)

  def failing_step(state):
    raise FloatingPointError("the loss was NaN")

  def learner():
    with service:
      service.learn(failing_step, 2, timeout=1.0)

  def actor():
    writer2 = service.writer()
    writer2.add(items([5.0], 1), timeout=JOIN)

  errors = run_threads([actor, learner])
  kinds = sorted(type(error).__name__ for error in errors)
  assert kinds == ["FloatingPointError", "ServiceClosed"]
  closed = next(e for e in errors if isinstance(e, jaxbuf.ServiceClosed))
  assert isinstance(closed.__cause__, FloatingPointError)
  assert service.counts.samples == 0
  for got, want in zip(jax.tree.leaves(service.state), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(np.asarray(got), want)


def stress(seed, actors, learners, adds):
  """Actors and learners with random sizes and timing; invariants checked."""
  rng = np.random.default_rng(seed)
  limiter = jaxbuf.SampleToInsertRatio(2.0, min_size=8, error_buffer=64.0)
  service = items_service(capacity=4096, limiter=limiter)
  sizes = [rng.integers(1, 5, adds) for _ in range(actors)]
  stop = threading.Event()

  def actor(index):
    writer = service.writer()
    for add, size in enumerate(sizes[index]):
      values = index * 100000 + add * 10 + np.arange(size)
      writer.add(items(values, index), policy_version=add, timeout=JOIN)

  def learner(index):
    key = jax.random.key(index)
    step = 0
    while not stop.is_set():
      try:
        sample = service.sample(key, 4, timeout=0.2)
      except TimeoutError:
        continue
      assert np.all(np.asarray(sample.batch.weights) == 1)
      counts = service.counts
      diff = counts.inserts * 2.0 - counts.samples
      assert limiter.min_diff <= diff or counts.inserts < 8
      key = jax.random.fold_in(key, step)
      step += 1

  learners_done = [
    threading.Thread(target=lambda i=i: errors.extend(run_threads([lambda: learner(i)])))
    for i in range(learners)
  ]
  errors: list = []
  for thread in learners_done:
    thread.start()
  errors += run_threads([lambda i=i: actor(i) for i in range(actors)])
  stop.set()
  for thread in learners_done:
    thread.join(JOIN)
  service.close()
  assert not errors, errors
  total = sum(int(s.sum()) for s in sizes)
  assert service.counts.inserts == total
  held = np.asarray(service.state.storage["x"])[:total]
  assert len(set(held.tolist())) == total  # every unit once: none lost, none doubled


def test_stress_short():
  stress(seed=0, actors=3, learners=2, adds=20)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_stress_long(seed):
  stress(seed=seed, actors=6, learners=3, adds=200)


# Other kinds and the example ---------------------------------------------------


def test_a_mixture_service_adds_to_one_part_and_samples_both():
  offline, online = jaxbuf.uniform_replay(32), jaxbuf.prioritized_replay(32)
  mixture = jaxbuf.mixture([offline, online], [0.5, 0.5])
  states = [offline.add(offline.init(np.float32(0)), np.full(8, -1.0, np.float32))]
  states.append(online.init(np.float32(0)))
  service = jaxbuf.ReplayService(mixture, states)
  with pytest.raises(ValueError, match="part="):
    service.writer()
  writer = service.writer(part=1)
  writer.add(np.arange(4, dtype=np.float32), policy_version=2)
  sample = service.sample(jax.random.key(0), 8, timeout=1.0)
  np.testing.assert_array_equal(np.asarray(sample.batch.source), [0] * 4 + [1] * 4)
  assert np.all(np.asarray(sample.batch.items)[:4] == -1)
  assert np.all(np.asarray(sample.batch.items)[4:] >= 0)
  np.testing.assert_array_equal(np.asarray(sample.version_lag), -1)  # untracked
  service.update_priorities(sample, np.ones(8, np.float32))
  assert int(service.state[1].size) == 4
  service.close()


def test_a_sharded_buffer_behind_the_service():
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (the suite's fake CPU devices)")
  mesh = jax.make_mesh((4,), ("data",))
  buffer = jaxbuf.sharded(jaxbuf.uniform_replay(64), mesh)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.float32(0)))

  def actor(index):
    writer = service.writer()
    for add in range(5):
      writer.add(np.arange(4, dtype=np.float32) + 100 * index + 4 * add, timeout=JOIN)

  assert not run_threads([lambda i=i: actor(i) for i in range(2)])
  sample = service.sample(jax.random.key(0), 8, timeout=1.0)
  assert sample.batch.items.shape == (8,)
  assert int(np.sum(np.asarray(service.state.size))) == 40
  service.close()


def test_the_sebulba_example_runs():
  sebulba_dqn = pytest.importorskip("examples.sebulba_dqn")
  config = sebulba_dqn.Config(
    total_steps=200,
    num_envs=4,
    num_actors=2,
    buffer_size=64,
    batch_size=8,
    learning_starts=16,
    hidden_size=16,
    target_update_interval=8,
    error_buffer=64.0,
  )
  result = sebulba_dqn.train(config)
  assert result["env_steps"] >= 200
  assert abs(result["samples_per_insert"] - result["target_samples_per_insert"]) < 0.5


@pytest.mark.slow
def test_the_sebulba_example_reaches_the_demos_return():
  from examples import sebulba_dqn  # pylint: disable=import-outside-toplevel

  result = sebulba_dqn.train(sebulba_dqn.Config())
  assert result["final_mean_return"] >= 475, result["final_mean_return"]


def resident_megabytes() -> float:
  with open("/proc/self/statm", encoding="ascii") as statm:
    return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
def test_soak_memory_stays_flat():
  """Actors and a learner for many rounds: the resident memory after a warm
  up grows by less than 64 MiB over 20 rounds (the host-side versions, the
  pending lists and the checked signatures are all bounded)."""
  if not pathlib.Path("/proc/self/statm").exists():
    pytest.skip("reads /proc/self/statm")
  limiter = jaxbuf.SampleToInsertRatio(1.0, min_size=64, error_buffer=256.0)
  service = items_service(capacity=2048, limiter=limiter)
  writers_done = threading.Event()

  def actor(index):
    writer = service.writer()
    for add in range(2000):
      writer.add(items(np.arange(4) + add, index), policy_version=add, timeout=JOIN)

  def learner():
    step = 0
    while not writers_done.is_set() or service.counts.samples < service.counts.inserts - 256:
      try:
        service.sample(jax.random.key(step), 32, timeout=0.5, max_version_lag=500)
      except TimeoutError:
        continue
      step += 1
      if step == 100:
        readings.append(resident_megabytes())
    readings.append(resident_megabytes())

  readings: list = []
  learning = threading.Thread(target=lambda: errors.extend(run_threads([learner])))
  errors: list = []
  learning.start()
  errors += run_threads([lambda i=i: actor(i) for i in range(3)])
  writers_done.set()
  learning.join(JOIN)
  service.close()
  assert not errors, errors
  assert readings[-1] - readings[0] < 64, readings
