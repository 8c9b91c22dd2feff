"""Queues (`jaxbuf.queue_replay`, `jaxbuf.queue.oldest_unread`) and
`Buffer.take`, against a plain Python model under hypothesis operation
sequences; bad input leaves the state intact."""

import collections

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from tests import devices

CAPACITY = 5
KEY = jax.random.key(0)
SETTINGS = hypothesis.settings(max_examples=15, deadline=None)
OPERATIONS = st.lists(
  st.tuples(st.sampled_from(["add", "take", "peek"]), st.sampled_from([1, 3, 7])),
  min_size=1,
  max_size=12,
)
QUEUES = {order: jaxbuf.queue_replay(CAPACITY, order=order) for order in ("fifo", "lifo")}


class ReferenceQueue:
  """The obvious queue: a deque of at most `capacity` waiting items."""

  def __init__(self, capacity: int, order: str):
    self.capacity, self.order = capacity, order
    self.waiting: collections.deque = collections.deque()
    self.dropped = 0

  def add(self, items: list) -> None:
    for item in items:
      if len(self.waiting) == self.capacity:
        self.waiting.popleft()  # the oldest waiting, whichever the order
        self.dropped += 1
      self.waiting.append(item)

  def peek(self, count: int) -> list:
    rows = list(self.waiting) if self.order == "fifo" else list(reversed(self.waiting))
    return rows[:count]

  def take(self, count: int) -> list:
    rows = self.peek(count)
    for _ in rows:
      (self.waiting.popleft if self.order == "fifo" else self.waiting.pop)()
    return rows


def check_rows(batch, want: list, batch_size: int) -> None:
  count = len(want)
  assert int(batch.count) == count
  np.testing.assert_array_equal(batch.mask, np.arange(batch_size) < count)
  np.testing.assert_array_equal(batch.weights, (np.arange(batch_size) < count).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(batch.items)[:count], want)


# The hypothesis runs are slow (a compilation per new shape); a fixed
# sequence through the same check runs in the default suite.
FIXED = [("add", 3), ("take", 1), ("add", 7), ("peek", 3), ("take", 7), ("take", 3), ("add", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["fifo", "lifo"])
@SETTINGS
@hypothesis.given(operations=OPERATIONS)
def test_queue_matches_the_reference_queue(order, operations):
  check_queue(order, operations)


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_queue_matches_the_reference_queue_on_a_fixed_sequence(order):
  check_queue(order, FIXED)


def check_queue(order, operations):
  queue, model = QUEUES[order], ReferenceQueue(CAPACITY, order)
  state, serial = queue.init(jnp.int32(0)), 0
  for operation, count in operations:
    if operation == "add":
      items = list(range(serial, serial + count))
      serial += count
      state = queue.add(state, jnp.asarray(items, jnp.int32))
      model.add(items)
    elif operation == "peek":
      check_rows(queue.sample(state, KEY, count), model.peek(count), count)
    else:
      state, batch = queue.take(state, KEY, count)
      check_rows(batch, model.take(count), count)
    assert int(state.size) == len(model.waiting)
    assert int(state.dropped) == model.dropped
    assert bool(queue.can_sample(state, 2)) == (len(model.waiting) >= 2)


@pytest.mark.slow
@SETTINGS
@hypothesis.given(
  operations=st.lists(
    st.tuples(st.sampled_from(["add", "read"]), st.sampled_from([1, 2, 6])), max_size=12
  )
)
def test_oldest_unread_is_a_fifo_reader_over_a_plain_replay_state(operations):
  check_oldest_unread(operations)


def test_oldest_unread_on_a_fixed_sequence():
  check_oldest_unread([("add", 2), ("read", 1), ("add", 6), ("read", 2), ("read", 6), ("add", 1)])


def check_oldest_unread(operations):
  buffer = jaxbuf.uniform_replay(CAPACITY)
  state, read_count, serial = buffer.init(jnp.int32(0)), jnp.uint32(0), 0
  model, skipped = ReferenceQueue(CAPACITY, "fifo"), 0
  for operation, count in operations:
    if operation == "add":
      items = list(range(serial, serial + count))
      serial += count
      state = buffer.add(state, jnp.asarray(items, jnp.int32))
      model.add(items)
      continue
    slots, mask, new_read = jaxbuf.queue.oldest_unread(state, read_count, count)
    want = model.take(count)
    np.testing.assert_array_equal(mask, np.arange(count) < len(want))
    np.testing.assert_array_equal(np.asarray(state.storage)[np.asarray(slots)][: len(want)], want)
    skipped += int(new_read) - int(read_count) - int(mask.sum())
    read_count = new_read
    assert int(read_count) == serial - len(model.waiting)
    # The model counts a drop at the add; the reader at its next read.
    assert skipped == model.dropped


def test_oldest_unread_counts_the_items_overwritten_before_being_read():
  buffer = jaxbuf.uniform_replay(4)
  state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(10, dtype=jnp.int32))
  slots, mask, read = jaxbuf.queue.oldest_unread(state, jnp.uint32(0), 6)
  assert np.asarray(state.storage)[np.asarray(slots)][:4].tolist() == [6, 7, 8, 9]
  assert mask.tolist() == [True] * 4 + [False] * 2
  assert int(read) - 0 - int(mask.sum()) == 6  # items 0..5 dropped
  # Near the wrap of the uint32 counters the same rule holds.
  wrapped = state.replace(add_count=jnp.uint32(3))  # 2**32 + 3 added
  slots, mask, read = jaxbuf.queue.oldest_unread(wrapped, jnp.uint32(2**32 - 2), 2)
  # Held: ids 2**32 - 1 .. 2**32 + 2; id 2**32 - 2 was overwritten unread.
  assert mask.tolist() == [True, True] and int(read) == 1  # 2**32 + 1 mod 2**32


def test_an_empty_queue_gives_padding_and_raises_when_checked():
  queue = jaxbuf.queue_replay(CAPACITY)
  state = queue.init({"x": jnp.zeros(2)})
  state, batch = queue.take(state, KEY, 3)
  assert int(batch.count) == 0 and not batch.mask.any() and not batch.weights.any()
  checked = jaxbuf.queue_replay(CAPACITY, checked=True)
  empty = checked.init({"x": jnp.zeros(2)})
  for call in (checked.take, checked.sample):
    with pytest.raises(Exception, match="the queue is empty"):
      call(empty, KEY, 3)
  assert int(empty.size) == 0 and int(empty.dropped) == 0


def test_bad_queue_arguments_are_refused():
  with pytest.raises(ValueError, match="order must be one of"):
    jaxbuf.queue_replay(4, order="random")
  with pytest.raises(TypeError, match="read_count must be an integer scalar"):
    jaxbuf.queue.oldest_unread(jaxbuf.uniform.init(jnp.int32(0), capacity=4), jnp.zeros(2), 1)
  queue = QUEUES["fifo"]
  state = queue.add(queue.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32))
  with pytest.raises(ValueError, match="batch_size"):
    queue.take(state, KEY, 0)
  assert int(state.size) == 3  # not donated by a refused call
  with pytest.raises(TypeError, match="cannot be split"):
    jaxbuf.sharded(queue, jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]))


def test_take_of_kinds_that_consume_nothing_is_their_sample():
  buffer = jaxbuf.prioritized_replay(16)
  state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(9, dtype=jnp.int32))
  after, batch = buffer.take(state, KEY, 4, step=3)
  assert after is state
  np.testing.assert_array_equal(batch.indices, buffer.sample(state, KEY, 4, step=3).indices)
  assert jaxbuf.Buffer(*[None] * 6).take is None  # built by hand: no take
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  assert callable(jaxbuf.sharded(jaxbuf.uniform_replay(8), mesh).take)


def test_a_queue_in_a_mixture_and_a_checkpoint(tmp_path):
  queue, uniform = QUEUES["fifo"], jaxbuf.uniform_replay(8)
  mix = jaxbuf.mixture([queue, uniform], [1, 1])
  states = [
    queue.add(queue.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32)),
    uniform.add(uniform.init(jnp.int32(0)), jnp.arange(5, dtype=jnp.int32) + 100),
  ]
  peek = mix.sample(states, KEY, 4)
  states, batch = mix.take(states, KEY, 4)
  np.testing.assert_array_equal(batch.items, peek.items)
  assert batch.items[:2].tolist() == [0, 1] and int(states[0].size) == 1
  jaxbuf.save(str(tmp_path / "queue"), states[0])
  restored = jaxbuf.load(str(tmp_path / "queue"), like=jax.eval_shape(queue.init, jnp.int32(0)))
  restored, batch = queue.take(restored, KEY, 2)
  assert batch.items.tolist() == [2, 0] and batch.mask.tolist() == [True, False]


def test_a_queue_given_twice_to_a_mixture_take_hands_each_item_out_once():
  """[s, s]: one jit would donate the state's arrays twice; each part takes
  from the state the part before left, and both get the final state."""
  queue = QUEUES["fifo"]
  mix = jaxbuf.mixture([queue, queue], [1, 1])
  state = queue.add(queue.init(jnp.int32(0)), jnp.arange(CAPACITY, dtype=jnp.int32))
  states, batch = mix.take([state, state], KEY, 4)
  assert batch.items.tolist() == [0, 1, 2, 3]
  assert [int(s.size) for s in states] == [1, 1] and states[0] is states[1]
  _, batch = queue.take(states[0], KEY, 2)
  assert batch.items.tolist() == [4, 0] and batch.mask.tolist() == [True, False]


@devices.needs(2)
def test_a_mixture_take_with_a_sharded_part_leaves_the_queue_on_its_device():
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  split, queue = jaxbuf.sharded(jaxbuf.uniform_replay(8), mesh), QUEUES["fifo"]
  mix = jaxbuf.mixture([split, queue], [1, 1])
  states = [
    split.add(split.init(jnp.int32(0)), jnp.arange(4, dtype=jnp.int32) + 100),
    queue.add(queue.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32)),
  ]
  device = states[1].storage.sharding
  peek = mix.sample(states, KEY, 4)
  states, batch = mix.take(states, KEY, 4)
  np.testing.assert_array_equal(batch.items, peek.items)
  assert batch.items[2:].tolist() == [0, 1] and int(states[1].size) == 1
  assert states[1].storage.sharding == device


def test_a_uniform_draw_of_eligible_rows_refuses_queue_and_heap_states():
  """The service's max_version_lag draws with sample_eligible: from a queue
  it handed out nothing, from a heap it ignored the order, silently."""
  eligible = jnp.ones(CAPACITY, bool)
  for buffer in (QUEUES["fifo"], jaxbuf.heap_replay(CAPACITY)):
    state = buffer.add(buffer.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(TypeError, match="sample_eligible: expected a ReplayState, given a"):
      jaxbuf.uniform.sample_eligible(state, KEY, 2, eligible)
  service = jaxbuf.ReplayService(QUEUES["fifo"], QUEUES["fifo"].init(jnp.int32(0)))
  try:
    service.writer().add(jnp.arange(3, dtype=jnp.int32), policy_version=1, timeout=10)
    with pytest.raises(TypeError, match="given a QueueState"):
      service.sample(KEY, 2, timeout=10, max_version_lag=3)
    assert int(service.state.size) == 3 and service.counts.samples == 0
  finally:
    service.close()
