"""Drawing the next sample while the learner steps: host code, one thread.

The disk tier's `sample` reads its rows on the host (`os.pread`, which
releases the GIL); a `Prefetcher` runs it in a background thread, so the
reads of batch t + 1 overlap the jitted learner step on batch t.

Adds may go on meanwhile (the loop adds while the batch is read): `submit`
reserves the read in the payload files before it returns, and until the
draw is done an add that overwrites a row keeps the row's old bytes for it,
so the batch is the state's as submitted, every row whole and of the item
the state holds there (never one of the item added since).

For prioritized kinds the prefetched batch t + 1 is drawn from the state
before step t's `update_priorities`: its rows follow priorities one learner
step old (the rows just sampled keep the priority they had when drawn, for
one more draw). Its `item_ids` still guard the update it feeds, which skips
rows overwritten since. With `Prefetcher(..., enabled=False)` each batch is
drawn at `result`, in the calling thread: the same batches, without overlap.
"""

import concurrent.futures
from typing import Any, Callable


class Prefetcher:
  """Draws `sample(state, key, batch_size)` one batch ahead, in a thread.

  Args:
    sample: a buffer's `sample` (any tier; the disk tier gains the most).
    enabled: False draws each batch when `result` asks for it, in the
      calling thread (no overlap), from the state given to `submit`.

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
    # A future (enabled), or the draw and its release (disabled).
    self._pending: concurrent.futures.Future | tuple | None = None
    # A disk tier's sample reserves the rows its draw reads (`disk`).
    self._reserve: Callable[[], Callable[[], None]] | None = getattr(sample, "reserve_reads", None)

  def submit(self, state: Any, key: Any, batch_size: int, **kwargs: Any) -> None:
    """Starts drawing the next batch (the one before must have been taken)."""
    if self._pending is not None:
      raise RuntimeError("Prefetcher.submit: take the pending batch with result() first.")
    release = self._reserve() if self._reserve is not None else None

    def draw() -> Any:
      try:
        return self._sample(state, key, batch_size, **kwargs)
      finally:
        if release is not None:
          release()

    if not self._enabled:
      self._pending = (draw, release)
      return
    try:
      self._pending = self._executor.submit(draw)
    except BaseException:
      if release is not None:
        release()
      raise

  def result(self, timeout: float | None = None) -> Any:
    """The batch submitted last; waits at most `timeout` seconds
    (TimeoutError after), and raises what the draw raised."""
    pending, self._pending = self._pending, None
    if pending is None:
      raise RuntimeError("Prefetcher.result: nothing was submitted.")
    if isinstance(pending, tuple):
      return pending[0]()
    try:
      return pending.result(timeout)
    except concurrent.futures.TimeoutError:
      self._pending = pending  # still running: ask again
      raise

  def close(self) -> None:
    """Waits for a draw in progress and stops the thread (idempotent)."""
    pending, self._pending = self._pending, None
    self._executor.shutdown(wait=True)
    if isinstance(pending, tuple) and pending[1] is not None:
      pending[1]()  # a draw never asked for: its reservation ends

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
