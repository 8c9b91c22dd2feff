"""The read cursor of a service under `jaxbuf.Queue`: which items it has
handed out, over any item replay state (`jaxbuf.queue.oldest_unread` is the
FIFO rule; this keeps its cursor and calls it). Not thread-safe: the
service calls it under its state lock.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.selection import queue
from jaxbuf._src.selection.budget import BudgetedReplayState
from jaxbuf._src.selection.heap import HeapReplayState
from jaxbuf._src.selection.queue import QueueSample, QueueState


@functools.partial(jax.jit, static_argnums=2)
def _oldest(state: ReplayState, read_count: jax.Array, batch_size: int):
  slots, mask, new_read_count = queue.oldest_unread(state, read_count, batch_size)
  # The queue kind's own sample of those rows (a QueueSample: mask, count).
  sample = queue._queue_sample(state, slots, mask)  # type: ignore[arg-type]  # pylint: disable=protected-access
  return sample, new_read_count


def _own_rule(state: Any, buffer: Any) -> str:
  """The selection rule of `state`'s kind that a FIFO read would override,
  or "" (uniform and prioritized replay, a FIFO queue: their rows in FIFO
  order are what a Queue promises)."""
  if isinstance(state, HeapReplayState):
    return "heap_replay hands out its highest (or lowest) priorities first"
  if isinstance(state, BudgetedReplayState):
    return "max_times_sampled retires an item after its N-th draw"
  settings = dict(getattr(getattr(buffer, "kind", None), "settings", ()) or ())
  if isinstance(state, QueueState) and settings.get("order") == "lifo":
    return "a LIFO queue_replay hands out its newest items first"
  return ""


class FifoReads:
  """The items handed out so far, counted as `add_count` counts items
  (uint32 on the device, so a read never waits for the host)."""

  def __init__(self, state: Any, max_size: int, buffer: Any = None):
    if not isinstance(state, ReplayState) or dict(getattr(state, "settings", ())).get("devices"):
      raise ValueError(
        "ReplayService: jaxbuf.Queue hands out items in insertion order over an item "
        f"replay state, unsharded; given a {type(state).__name__}."
      )
    own_rule = _own_rule(state, buffer)
    if own_rule:
      raise ValueError(
        f"ReplayService: jaxbuf.Queue reads oldest first, each item once, which would "
        f"silently replace this buffer's own rule: {own_rule}. Use jaxbuf.MinSize or "
        f"SampleToInsertRatio with it (its take keeps the rule), or jaxbuf.Queue over "
        f"uniform_replay (or a FIFO queue_replay)."
      )
    capacity = jax.tree.leaves(state.storage)[0].shape[0]
    if capacity < max_size:
      raise ValueError(
        f"ReplayService: jaxbuf.Queue({max_size}) over a buffer of capacity {capacity} "
        "would overwrite unread items; make max_size at most the capacity."
      )
    # Items held when the service starts count as read. A copy: the state's
    # own counter is donated by the next add.
    self.read_count = jnp.array(state.add_count, jnp.uint32, copy=True)

  def take(self, state: ReplayState, batch_size: int) -> QueueSample:
    """The oldest `batch_size` unread items (`QueueSample`), now read."""
    sample, self.read_count = _oldest(state, self.read_count, batch_size)
    return sample
