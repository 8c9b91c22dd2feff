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
from jaxbuf._src.selection.queue import QueueSample


@functools.partial(jax.jit, static_argnums=2)
def _oldest(state: ReplayState, read_count: jax.Array, batch_size: int):
  slots, mask, new_read_count = queue.oldest_unread(state, read_count, batch_size)
  # The queue kind's own sample of those rows (a QueueSample: mask, count).
  sample = queue._queue_sample(state, slots, mask)  # type: ignore[arg-type]  # pylint: disable=protected-access
  return sample, new_read_count


class FifoReads:
  """The items handed out so far, counted as `add_count` counts items
  (uint32 on the device, so a read never waits for the host)."""

  def __init__(self, state: Any, max_size: int):
    if not isinstance(state, ReplayState) or dict(getattr(state, "settings", ())).get("devices"):
      raise ValueError(
        "ReplayService: jaxbuf.Queue hands out items in insertion order over an item "
        f"replay state, unsharded; given a {type(state).__name__}."
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
