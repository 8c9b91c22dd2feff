"""Drawing the next sample while the learner steps: host code, one thread.

The disk tier's `sample` reads its rows on the host (`os.pread`, which
releases the GIL); a `Prefetcher` runs it in a background thread, so the
reads of batch t + 1 overlap the jitted learner step on batch t.

For prioritized kinds the prefetched batch t + 1 is drawn from the state
before step t's `update_priorities`: its rows follow priorities one learner
step old (the rows just sampled keep the priority they had when drawn, for
one more draw). Its `item_ids` still guard the update it feeds, which skips
rows overwritten since. With `Prefetcher(..., enabled=False)` each batch is
drawn at `result` from the newest state instead, with no overlap.
"""

import concurrent.futures
from typing import Any, Callable


class Prefetcher:
  """Draws `sample(state, key, batch_size)` one batch ahead, in a thread.

  Args:
    sample: a buffer's `sample` (any tier; the disk tier gains the most).
    enabled: False draws each batch when it is asked for (no staleness).

  >>> import tempfile, jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(64, storage=jaxbuf.disk(tempfile.mkdtemp()))
  >>> state = buffer.add(buffer.init(jnp.zeros(32)), jnp.ones((16, 32)))
  >>> with jaxbuf.Prefetcher(buffer.sample) as prefetcher:
  ...   prefetcher.submit(state, jax.random.key(0), 8)
  ...   for step in range(1, 3):
  ...     batch = prefetcher.result(timeout=60)   # drawn while the last step ran
  ...     prefetcher.submit(state, jax.random.key(step), 8)
  >>> batch.items.shape
  (8, 32)
  """

  def __init__(self, sample: Callable[..., Any], *, enabled: bool = True):
    self._sample = sample
    self._enabled = enabled
    self._executor = concurrent.futures.ThreadPoolExecutor(
      max_workers=1, thread_name_prefix="jaxbuf-prefetch"
    )
    self._pending: concurrent.futures.Future | tuple | None = None

  def submit(self, state: Any, key: Any, batch_size: int, **kwargs: Any) -> None:
    """Starts drawing the next batch (the one before must have been taken)."""
    if self._pending is not None:
      raise RuntimeError("Prefetcher.submit: take the pending batch with result() first.")
    if self._enabled:
      self._pending = self._executor.submit(self._sample, state, key, batch_size, **kwargs)
    else:
      self._pending = (state, key, batch_size, kwargs)

  def result(self, timeout: float | None = None) -> Any:
    """The batch submitted last; waits at most `timeout` seconds
    (TimeoutError after), and raises what the draw raised."""
    pending, self._pending = self._pending, None
    if pending is None:
      raise RuntimeError("Prefetcher.result: nothing was submitted.")
    if isinstance(pending, tuple):
      state, key, batch_size, kwargs = pending
      return self._sample(state, key, batch_size, **kwargs)
    try:
      return pending.result(timeout)
    except concurrent.futures.TimeoutError:
      self._pending = pending  # still running: ask again
      raise

  def close(self) -> None:
    """Waits for a draw in progress and stops the thread (idempotent)."""
    self._pending = None
    self._executor.shutdown(wait=True)

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
