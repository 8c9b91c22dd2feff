"""The replay service under concurrency (issue 50): unique ids through many
writer and sampler threads, random sizes and timeouts, close() at a random
moment, and a model that accounts for every id.

Every wait has a timeout (`JOIN` seconds for a thread, the service's own
`timeout=` for a blocking call), so a deadlock fails a test instead of
hanging the suite.
"""

import ctypes
import json
import threading
import time

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from jax.experimental import io_callback

import jaxbuf

from tests.test_service import JOIN, run_threads  # one runner for both files


def queue_service(capacity, max_size):
  buffer = jaxbuf.uniform_replay(capacity)
  return jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)), rate_limiter=jaxbuf.Queue(max_size))


class Model:
  """What the threads saw: the ids each writer had accepted (in order) and
  the ids each sample call returned (per sampler, in call order)."""

  def __init__(self, writers, samplers):
    self.accepted = [[] for _ in range(writers)]
    self.taken = [[] for _ in range(samplers)]

  def check(self, service, closed: bool) -> None:
    accepted = [i for ids in self.accepted for i in ids]
    taken = [i for calls in self.taken for batch in calls for i in batch]
    assert len(set(accepted)) == len(accepted)
    duplicates = (
      sorted({i for i in taken if taken.count(i) > 1}) if len(set(taken)) < len(taken) else []
    )
    assert not duplicates, f"handed out twice: {duplicates[:10]}"
    invented = sorted(set(taken) - set(accepted))
    assert not invented, f"never added: {invented[:10]}"
    unread = sorted(set(accepted) - set(taken))
    counts = service.counts
    assert counts.inserts == len(accepted) and counts.samples == len(taken), counts
    if not closed:
      assert not unread, f"never handed out: {unread[:10]}"
    else:
      # Accepted, not read, because the service closed: they are the newest
      # items held, the ones a next sample would have read, none overwritten.
      state = service.state
      held = np.asarray(state.storage)
      capacity = held.shape[0]
      newest = [
        int(held[(int(state.insert_position) - k - 1) % capacity]) for k in range(len(unread))
      ]
      assert sorted(newest) == unread
    # FIFO per writer: within each sampler's calls, in order, each writer's
    # ids come oldest first.
    for calls in self.taken:
      seen: dict = {}
      for batch in calls:
        for i in batch:
          writer, sequence = divmod(i, 10**6)
          assert sequence > seen.get(writer, -1), (writer, sequence, seen.get(writer))
          seen[writer] = sequence


def queue_stress(
  *, seed, capacity, max_size, writers, adds, samplers, add_sizes, sample_sizes, close_at=None
):
  """`writers` threads each make `adds` adds of random sizes (unique ids:
  writer * 10**6 + sequence), `samplers` threads draw random sizes until
  every id is read or the service closes (after `close_at` accepted adds
  over all writers, if given); random timeouts on both sides."""
  rng = np.random.default_rng(seed)
  service = queue_service(capacity, max_size)
  model = Model(writers, samplers)
  plans = [rng.choice(add_sizes, adds) for _ in range(writers)]
  total = sum(int(p.sum()) for p in plans)
  lock = threading.Lock()
  accepted_adds = [0]
  read = [0]
  done = threading.Event()  # every id read, or a thread failed
  deadline = time.monotonic() + JOIN / 2  # items lost: samplers stop, the model says which

  def writer(index):
    local = np.random.default_rng((seed, index))
    own = service.writer()
    sequence = 0
    for size in plans[index]:
      ids = (index * 10**6 + sequence + np.arange(size)).astype(np.int32)
      while True:
        try:
          own.add(ids, timeout=float(local.uniform(0.0, 0.05)))
          break
        except TimeoutError:
          if time.monotonic() > deadline:  # the samplers stopped
            return
          continue  # not accepted: the same ids again
        except jaxbuf.ServiceClosed:
          return
      model.accepted[index].extend(ids.tolist())
      sequence += int(size)
      with lock:
        accepted_adds[0] += 1
        if close_at is not None and accepted_adds[0] == close_at:
          service.close()

  def sampler(index):
    local = np.random.default_rng((seed, 1000 + index))
    key = jax.random.key(index)
    while not done.is_set() and time.monotonic() < deadline:
      size = int(local.choice(sample_sizes))
      try:
        sample = service.sample(key, size, timeout=float(local.uniform(0.0, 0.05)))
      except TimeoutError:
        with lock:
          if read[0] == total:
            done.set()
        continue
      except jaxbuf.ServiceClosed:
        return
      mask = np.asarray(sample.batch.mask)
      if not mask.all():
        done.set()
        raise AssertionError(f"padding rows handed out: {mask.tolist()}")
      model.taken[index].append(np.asarray(sample.batch.items).tolist())
      with lock:
        read[0] += size
        if read[0] == total:
          done.set()

  errors = run_threads(
    [lambda i=i: writer(i) for i in range(writers)]
    + [lambda i=i: sampler(i) for i in range(samplers)]
  )
  assert not errors, errors
  model.check(service, closed=service.closed)
  service.close()
  return model


# The cases ---------------------------------------------------------------


def test_queue_6_over_8_three_writers_one_sampler_of_3_exactly_once():
  model = queue_stress(
    seed=0, capacity=8, max_size=6, writers=3, adds=20, samplers=1, add_sizes=[2], sample_sizes=[3]
  )
  assert sum(len(batch) for batch in model.taken[0]) == 120


def test_queue_8_over_8_one_writer_two_samplers_of_1_exactly_once():
  model = queue_stress(
    seed=1, capacity=8, max_size=8, writers=1, adds=600, samplers=2, add_sizes=[1], sample_sizes=[1]
  )
  assert sum(len(calls) for calls in model.taken) == 600


# Many writers and samplers, random sizes and timeouts, close at random ------------


@pytest.mark.parametrize("capacity, max_size", [(8, 8), (12, 8), (64, 16)])
def test_queue_stress_every_item_exactly_once(capacity, max_size):
  queue_stress(
    seed=capacity,
    capacity=capacity,
    max_size=max_size,
    writers=8,
    adds=60,
    samplers=4,
    add_sizes=[1, 2, 4],
    sample_sizes=[1, 2, 4],
  )


@pytest.mark.parametrize("seed", [0, 1])
def test_queue_stress_closed_at_a_random_moment_accounts_for_every_item(seed):
  close_at = int(np.random.default_rng(seed).integers(50, 400))
  queue_stress(
    seed=seed,
    capacity=16,
    max_size=12,
    writers=8,
    adds=60,
    samplers=4,
    add_sizes=[1, 2, 4],
    sample_sizes=[1, 2, 4],
    close_at=close_at,
  )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_queue_stress_long(seed):
  rng = np.random.default_rng(seed)
  queue_stress(
    seed=seed,
    capacity=int(rng.choice([16, 24, 32])),
    max_size=16,
    writers=12,
    adds=300,
    samplers=6,
    add_sizes=[1, 2, 3, 4],
    sample_sizes=[1, 2, 3, 4],
    close_at=None if seed % 2 == 0 else int(rng.integers(500, 3000)),
  )


# Refusals only where a deadlock is reachable with the sizes used -------------------


@pytest.mark.parametrize("max_size, size", [(4, 4), (2, 2), (8, 4), (6, 3)])
def test_the_on_policy_queue_adds_b_and_samples_b(max_size, size):
  """Adds of B and samples of B (one rollout in, one out) move the unread
  count in steps of B: it is 0, B, 2B, ..., where one side can always move."""
  service = queue_service(capacity=max_size, max_size=max_size)
  rollouts = 12

  def actor():
    own = service.writer()
    for rollout in range(rollouts):
      own.add(np.full(size, rollout, np.int32), timeout=JOIN)

  taken: list = []

  def learner():
    for step in range(rollouts):
      batch = service.sample(jax.random.key(step), size, timeout=JOIN).batch
      assert np.asarray(batch.mask).all()
      taken.append(np.asarray(batch.items).tolist())

  assert not run_threads([actor, learner])
  assert taken == [[rollout] * size for rollout in range(rollouts)]
  service.close()


def test_a_sample_of_4_then_adds_of_2_run_in_one_thread():
  """Queue(4), samples of 4, adds of 2: the unread count stays even (0, 2,
  4), where an add of 2 or a sample of 4 can always move."""
  service = queue_service(capacity=4, max_size=4)
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(0), 4, timeout=0.01)
  own = service.writer()
  for step in range(3):
    own.add(np.arange(2, dtype=np.int32) + 4 * step, timeout=1.0)
    own.add(np.arange(2, dtype=np.int32) + 4 * step + 2, timeout=1.0)
    batch = service.sample(jax.random.key(step), 4, timeout=1.0).batch
    assert np.asarray(batch.items).tolist() == list(range(4 * step, 4 * step + 4))
  service.close()


def test_a_sample_of_4_then_adds_of_3_run_in_one_thread():
  """Queue(4), a sample of 4 then adds of 3 in one thread: 3 unread would
  block both an add of 3 and a sample of 4, but with one thread nothing
  waits on another (the issue's false refusal): each call runs or times out."""
  service = queue_service(capacity=4, max_size=4)
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(0), 4, timeout=0.01)
  own = service.writer()
  own.add(np.arange(3, dtype=np.int32), timeout=1.0)
  with pytest.raises(TimeoutError):
    own.add(np.arange(3, 6, dtype=np.int32), timeout=0.01)
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(0), 4, timeout=0.01)
  batch = service.sample(jax.random.key(0), 3, timeout=1.0).batch
  assert np.asarray(batch.items).tolist() == [0, 1, 2]
  assert service.counts == jaxbuf.RateCounts(3, 3)
  service.close()


def test_callers_that_all_wait_on_each_other_are_told_naming_the_sizes_and_the_fix():
  """Queue(4), one thread adding 3s, one sampling 4s: after the first add 3
  are unread, where the add (needs <= 1) and the sample (needs >= 4) both
  wait and no call is under way. Both are told at once, not at their 5 s
  timeouts."""
  service = queue_service(capacity=8, max_size=4)
  errors: dict = {}

  def actor():
    own = service.writer()
    try:
      for step in range(4):
        own.add(np.arange(3, dtype=np.int32) + 3 * step, timeout=5.0)
    except ValueError as error:
      errors["add"] = error

  def learner():
    try:
      for step in range(4):
        service.sample(jax.random.key(step), 4, timeout=5.0)
    except ValueError as error:
      errors["sample"] = error

  started = time.monotonic()
  assert not run_threads([actor, learner])
  assert time.monotonic() - started < 2.0
  assert set(errors) == {"add", "sample"}, errors
  for error in errors.values():
    message = str(error)
    assert "Queue(4)" in message and "3 units unread" in message, message
    assert "adds of [3] units" in message and "samples of [4] rows" in message, message
    assert "max_size" in message, message
  assert service.counts == jaxbuf.RateCounts(3, 0)
  own = service.writer()
  own.add(np.arange(1, dtype=np.int32), timeout=1.0)  # the service goes on: 4 unread
  assert service.sample(jax.random.key(9), 4, timeout=1.0).batch.mask.all()
  service.close()


def test_a_size_that_can_never_run_is_refused_before_waiting():
  service = queue_service(capacity=8, max_size=4)
  with pytest.raises(ValueError, match=r"Queue\(4\): a sample of 5 rows can never run"):
    service.sample(jax.random.key(0), 5, timeout=1.0)
  with pytest.raises(ValueError, match=r"Queue\(4\): an add of 5 units can never"):
    service.writer().add(np.arange(5, dtype=np.int32), timeout=1.0)
  assert service.counts == jaxbuf.RateCounts(0, 0)
  service.close()


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
  max_size=st.integers(1, 12),
  add_sizes=st.lists(st.integers(1, 12), min_size=1, max_size=3),
  sample_sizes=st.lists(st.integers(1, 12), min_size=1, max_size=3),
  choices=st.lists(st.integers(0, 5), min_size=1, max_size=200),
)
def test_accepted_sizes_never_reach_a_diff_where_all_wait(
  max_size, add_sizes, sample_sizes, choices
):
  """Any interleaving of adds and samples of sizes `check_sizes` accepts
  (as sets) always leaves a move for the largest of each side."""
  limiter = jaxbuf.Queue(max_size)
  try:
    limiter.check_sizes(add_sizes, sample_sizes)
  except ValueError:
    return
  counts = jaxbuf.RateCounts(0, 0)
  largest_add, largest_sample = max(add_sizes), max(sample_sizes)
  for choice in choices:
    assert limiter.can_insert(counts, largest_add) or limiter.can_sample(counts, largest_sample)
    add = add_sizes[choice % len(add_sizes)]
    sample = sample_sizes[choice % len(sample_sizes)]
    if choice % 2 and limiter.can_insert(counts, add):
      counts = counts._replace(inserts=counts.inserts + add)
    elif limiter.can_sample(counts, sample):
      counts = counts._replace(samples=counts.samples + sample)
    elif limiter.can_insert(counts, add):
      counts = counts._replace(inserts=counts.inserts + add)


# Consuming kinds: a sample never returns a retired or padding row ---------------------


def test_retired_items_are_never_returned_and_count_toward_no_min_size():
  buffer = jaxbuf.uniform_replay(16, max_times_sampled=1)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)), rate_limiter=jaxbuf.MinSize(1))
  service.writer().add(np.arange(1, 5, dtype=np.int32))
  batch = service.sample(jax.random.key(0), 4, timeout=1.0).batch
  assert sorted(np.asarray(batch.items).tolist()) == [1, 2, 3, 4]
  with pytest.raises(TimeoutError):
    service.sample(jax.random.key(1), 1, timeout=1.0)
  assert service.counts == jaxbuf.RateCounts(4, 4)
  service.writer().add(np.array([5], np.int32))  # a live item again: the sample runs
  assert np.asarray(service.sample(jax.random.key(2), 1, timeout=1.0).batch.items).tolist() == [5]
  service.close()


def test_a_sample_waiting_for_live_items_raises_service_closed_when_closed():
  buffer = jaxbuf.queue_replay(8)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)))
  service.writer().add(np.arange(2, dtype=np.int32))
  closer = threading.Timer(0.2, service.close)
  closer.start()
  with pytest.raises(jaxbuf.ServiceClosed):
    service.sample(jax.random.key(0), 3, timeout=JOIN)  # 2 waiting: it would pad
  closer.join(JOIN)


@pytest.mark.parametrize("kind", ["uniform", "prioritized", "queue"])
def test_consuming_kinds_hand_out_every_item_once_across_samplers(kind):
  make = {
    "uniform": lambda: jaxbuf.uniform_replay(4096, max_times_sampled=1),
    "prioritized": lambda: jaxbuf.prioritized_replay(4096, max_times_sampled=1),
    "queue": lambda: jaxbuf.queue_replay(4096),
  }[kind]
  buffer = make()
  service = jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)))
  writers, adds, samplers = 8, 40, 4
  total = writers * adds * 2
  taken: list = [[] for _ in range(samplers)]
  lock = threading.Lock()
  count = [0]
  done = threading.Event()
  deadline = time.monotonic() + JOIN / 2

  def writer(index):
    own = service.writer()
    for add in range(adds):
      own.add(np.array([index * 10**6 + 2 * add, index * 10**6 + 2 * add + 1], np.int32))

  def sampler(index):
    local = np.random.default_rng(index)
    key = jax.random.key(index)
    while not done.is_set() and time.monotonic() < deadline:
      size = int(local.choice([1, 2, 3]))
      key, draw = jax.random.split(key)
      try:
        batch = service.sample(draw, size, timeout=float(local.uniform(0.0, 0.05))).batch
      except TimeoutError:
        continue
      assert np.asarray(batch.weights).min() > 0, "a retired or padding row handed out"
      taken[index].extend(np.asarray(batch.items).tolist())
      with lock:
        count[0] += size
        if count[0] >= total - 2:  # fewer left than the largest size may be
          done.set()

  errors = run_threads(
    [lambda i=i: writer(i) for i in range(writers)]
    + [lambda i=i: sampler(i) for i in range(samplers)]
  )
  assert not errors, errors
  everything = [i for ids in taken for i in ids]
  assert len(everything) == len(set(everything)), "an item handed out twice"
  added = {w * 10**6 + k for w in range(writers) for k in range(2 * adds)}
  assert set(everything) <= added and len(everything) >= total - 2
  service.close()


# Checkpoints are one consistent cut ------------------------------------------------


def test_checkpoints_while_writers_add_are_one_consistent_cut(tmp_path, monkeypatch):
  """A writer admitted while the checkpoint saves (fault injection: the save
  lets one in) is not in the saved state, so it is not in its counts."""
  from jaxbuf._src.checkpoint import saving  # pylint: disable=import-outside-toplevel

  service = queue_service(capacity=64, max_size=64)
  buffer = jaxbuf.uniform_replay(64)
  like = buffer.init(np.int32(0))
  real_save = saving.save
  errors: list = []

  def add_from_another_thread(values):
    def add():
      try:
        service.writer().add(values, timeout=JOIN)
      except BaseException as error:  # pylint: disable=broad-exception-caught
        errors.append(error)

    thread = threading.Thread(target=add)
    thread.start()
    return thread

  def save_while_a_writer_adds(path, state):
    real_save(path, state)
    adds = service.adds
    writers.append(add_from_another_thread(np.arange(8, dtype=np.int32) + 100 * len(writers)))
    deadline = time.monotonic() + JOIN
    while service.adds == adds and time.monotonic() < deadline:  # admitted, waiting for the lock
      time.sleep(0.001)

  writers: list = []
  monkeypatch.setattr(saving, "save", save_while_a_writer_adds)
  service.writer().add(np.arange(4, dtype=np.int32))
  for round_ in range(3):
    path = tmp_path / f"cut{round_}"
    service.checkpoint(path)
    record = json.loads((path / "service.json").read_text())
    saved = jaxbuf.load(path / "state", like=like)
    assert record["inserts"] == int(saved.add_count), (record, int(saved.add_count))
    restored = jaxbuf.ReplayService.restore(path, buffer, like, rate_limiter=jaxbuf.Queue(64))
    unread = record["inserts"] - record["samples"]
    batch = restored.sample(jax.random.key(0), unread, timeout=1.0).batch
    assert np.asarray(batch.mask).all()  # every unread item, none a padding row
    with pytest.raises(TimeoutError):
      restored.sample(jax.random.key(0), 1, timeout=0.01)
    restored.close()
  for thread in writers:
    thread.join(JOIN)
  assert not errors, errors
  assert service.counts.inserts == 4 + 8 * len(writers)
  service.close()


# learn() under Queue ------------------------------------------------------------------


def test_learn_under_a_queue_hands_the_step_the_fifo_rows_and_moves_the_cursor():
  service = queue_service(capacity=16, max_size=16)
  service.writer().add(np.arange(12, dtype=np.int32))

  def step(state, batch, scale):
    assert np.asarray(batch.mask).all()
    return state, (np.asarray(batch.items) * scale).tolist()

  assert service.learn(step, 4, 1, timeout=1.0) == [0, 1, 2, 3]

  def failing(state, batch, scale):
    raise FloatingPointError("the loss was NaN")

  with pytest.raises(FloatingPointError):
    service.learn(failing, 4, 1, timeout=1.0)  # nothing read: the cursor stays
  assert service.learn(step, 4, 10, timeout=1.0) == [40, 50, 60, 70]
  assert np.asarray(service.sample(jax.random.key(0), 4, timeout=1.0).batch.items).tolist() == [
    8,
    9,
    10,
    11,
  ]
  with pytest.raises(TimeoutError):  # every item read once: none twice, none never
    service.learn(step, 1, 1, timeout=0.01)
  assert service.counts == jaxbuf.RateCounts(12, 12)
  service.close()


def test_a_min_size_checkpoint_restored_under_a_queue_agrees_with_the_cursor(tmp_path):
  buffer = jaxbuf.uniform_replay(128)
  like = buffer.init(np.int32(0))
  service = jaxbuf.ReplayService(buffer, like, rate_limiter=jaxbuf.MinSize(1))
  service.writer().add(np.arange(100, dtype=np.int32))
  service.sample(jax.random.key(0), 5, timeout=1.0)
  service.checkpoint(tmp_path / "cut")
  service.close()
  restored = jaxbuf.ReplayService.restore(tmp_path / "cut", buffer, like, jaxbuf.Queue(4))
  assert restored.counts == jaxbuf.RateCounts(100, 100)  # every held item read
  with pytest.raises(TimeoutError):  # no padding row handed out
    restored.sample(jax.random.key(1), 4, timeout=0.01)
  restored.writer().add(np.arange(200, 204, dtype=np.int32), timeout=1.0)
  batch = restored.sample(jax.random.key(2), 4, timeout=1.0).batch
  assert np.asarray(batch.items).tolist() == [200, 201, 202, 203]
  restored.close()


# Settings refused when made ----------------------------------------------------------


@pytest.mark.parametrize(
  "make, rule",
  [
    (lambda: jaxbuf.heap_replay(16), "heap_replay"),
    (lambda: jaxbuf.queue_replay(16, order="lifo"), "LIFO"),
    (lambda: jaxbuf.uniform_replay(16, max_times_sampled=1), "max_times_sampled"),
    (lambda: jaxbuf.prioritized_replay(16, max_times_sampled=2), "max_times_sampled"),
  ],
)
def test_a_queue_over_a_kind_with_its_own_rule_is_refused_when_made(make, rule):
  buffer = make()
  with pytest.raises(ValueError, match=f"replace this buffer's own rule: .*{rule}"):
    jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)), rate_limiter=jaxbuf.Queue(8))
  fifo = jaxbuf.queue_replay(16)  # a FIFO queue: its own rule is the Queue's
  jaxbuf.ReplayService(fifo, fifo.init(np.int32(0)), rate_limiter=jaxbuf.Queue(8)).close()


@pytest.mark.parametrize("value", [2**31, 2**40, 2**63])
def test_max_times_sampled_past_int32_is_refused_at_construction(value):
  with pytest.raises(ValueError, match=r"max_times_sampled.*2\*\*31 - 1"):
    jaxbuf.uniform_replay(16, max_times_sampled=value)
  with pytest.raises(ValueError, match=r"max_times_sampled.*2\*\*31 - 1"):
    jaxbuf.prioritized_replay(16, max_times_sampled=value)
  jaxbuf.uniform_replay(16, max_times_sampled=2**31 - 1)  # the largest int32 count


def test_a_disk_tier_buffer_is_refused_when_the_service_is_made(tmp_path):
  buffer = jaxbuf.uniform_replay(16, storage=jaxbuf.disk(tmp_path / "payload"))
  state = buffer.init({"obs": np.zeros(64, np.float32)})
  with pytest.raises(ValueError, match=r"storage=jaxbuf.disk\(.*storage='host'"):
    jaxbuf.ReplayService(buffer, state)
  host = jaxbuf.uniform_replay(16, storage="host")
  service = jaxbuf.ReplayService(host, host.init({"obs": np.zeros(64, np.float32)}))
  service.close()


def _faulty_uniform(capacity, fault):
  """A uniform buffer whose add fails while it runs (an XLA runtime error,
  after the donated state was consumed) when `fault["on"]`: a host callback
  inside the jitted add raises."""
  buffer = jaxbuf.uniform_replay(capacity)

  def check(_):
    if fault["on"]:
      raise RuntimeError("injected device fault")

  def add(state, items):
    io_callback(check, None, state.add_count, ordered=True)
    return buffer.add(state, items)

  return buffer._replace(add=add)


def test_a_device_add_failing_while_it_runs_leaves_the_state_as_it_was():
  fault = {"on": False}
  buffer = _faulty_uniform(16, fault)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)))
  writer = service.writer()
  writer.add(np.arange(4, dtype=np.int32))
  fault["on"] = True
  with pytest.raises(Exception, match="injected device fault"):
    writer.add(np.arange(4, 8, dtype=np.int32))
  fault["on"] = False
  state = service.state  # not "Array has been deleted"
  assert int(state.add_count) == 4 == service.counts.inserts
  assert sorted(np.asarray(state.storage)[:4].tolist()) == [0, 1, 2, 3]
  writer.add(np.arange(8, 12, dtype=np.int32))
  state = service.state
  assert int(state.add_count) == 8 == service.counts.inserts
  assert np.asarray(state.storage)[:8].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
  batch = service.sample(jax.random.key(0), 4, timeout=5.0).batch
  assert set(np.asarray(batch.items).tolist()) <= {0, 1, 2, 3, 8, 9, 10, 11}
  service.close()


def _raise_in(thread: threading.Thread, kind: type) -> None:
  """An async exception in `thread` (how a runtime kills an actor)."""
  ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(kind))


class _Killed(Exception):
  pass


@pytest.mark.parametrize("run", range(8))
def test_an_actor_killed_inside_writer_add_leaves_the_state_as_it_was(run):
  """The probe: an async exception in an actor thread while it adds (5 of 8
  runs deleted the whole state: the exception landed between the donated
  device call and the assignment of its result)."""
  rng = np.random.default_rng(run)
  buffer = jaxbuf.uniform_replay(64)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)))
  service.writer().add(np.zeros(1, np.int32))  # compiled before the actor starts
  accepted: list = []
  started = threading.Event()

  def actor():
    writer = service.writer()
    started.set()
    try:
      for i in range(1, 100_000):
        writer.add(np.full(2, i, np.int32))
        accepted.append(i)
    except _Killed:
      pass

  thread = threading.Thread(target=actor)
  thread.start()
  assert started.wait(JOIN)
  time.sleep(float(rng.uniform(0.01, 0.2)))
  _raise_in(thread, _Killed)
  thread.join(JOIN)
  assert not thread.is_alive()
  state = service.state  # not "Array has been deleted"
  counts = service.counts
  assert int(state.add_count) == counts.inserts
  held = np.asarray(state.storage)[: min(counts.inserts, 64)]
  # Every add the actor saw accepted is held (the last one, cut off while
  # adding, is held whole or not at all).
  newest = [i for i in accepted if i > 0][-20:]
  assert set(newest) <= set(held.tolist())
  assert (counts.inserts - 1) // 2 in (len(accepted), len(accepted) + 1)
  service.sample(jax.random.key(run), 4, timeout=5.0)
  service.writer().add(np.full(2, -1, np.int32), timeout=5.0)
  assert int(service.state.add_count) == counts.inserts + 2
  service.close()


def test_a_device_fault_that_consumed_the_state_closes_the_service_with_its_error():
  """A donated add that fails after consuming the state (a device fault;
  simulated: the add deletes its input, then raises): nothing to go on
  with, so the service closes, every later call naming the fault."""
  buffer = jaxbuf.uniform_replay(16)
  service = jaxbuf.ReplayService(buffer, buffer.init(np.int32(0)))
  writer = service.writer()
  writer.add(np.arange(4, dtype=np.int32))

  def faulty_add(state, items):
    for leaf in jax.tree.leaves(state):
      leaf.delete()
    raise RuntimeError("injected device fault")

  service._donating_add = faulty_add  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match="injected device fault"):
    writer.add(np.arange(4, dtype=np.int32))
  with pytest.raises(jaxbuf.ServiceClosed) as closed:
    writer.add(np.arange(4, dtype=np.int32))
  assert "injected device fault" in str(closed.value.__cause__)
  with pytest.raises(jaxbuf.ServiceClosed, match="restore the service from its last checkpoint"):
    _ = service.state
