"""An actor's handle for adding to a `ReplayService`: `service.writer()`.

A writer belongs to one thread (the first that adds through it) and, for a
stream kind, owns a fixed set of env rows: its adds hold steps of those
envs only, `[n, ...]` for its n envs, so each env's stream has one writer
and stays contiguous. The service scatters the rows into the buffer's
`[N, ...]` add with a `mask`, and coalesces the adds of many writers into
one device call.
"""

import threading
from typing import Any

import numpy as np

from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.host.vector_envs import RecordedStep


class Writer:
  """Adds items (or steps of its envs) to a `ReplayService` from one thread.

  Made by `service.writer()` or `service.writer(envs=[...])`; not made
  directly. A `VectorEnvRecorder` over this writer's envs (a vector env of
  `len(writer.envs)` envs, recording for the service's buffer) feeds it:
  `writer.add(recorder.record(...), policy_version=v)` takes the
  `RecordedStep` as it is.
  """

  def __init__(self, service: Any, envs: np.ndarray | None, part: int | None = None):
    self._service = service
    self.envs = envs  # int64 [n]: the env rows this writer owns (streams), else None
    self.part = part  # the part of a mixture this writer adds to, else None
    self._thread: int | None = None
    self._closed = False

  def add(
    self,
    items: PyTree | RecordedStep,
    policy_version: int = 0,
    timeout: float | None = None,
    *,
    mask: Any = None,
    episode_end: Any = None,
    final_steps: PyTree | None = None,
  ) -> None:
    """Adds `items` once the rate limiter allows it.

    Args:
      items: as `buffer.add` takes them: items `[B, ...]` (item kinds), or
        steps of this writer's n envs, `[n, ...]` or `[n, T, ...]` (stream
        kinds); or a `RecordedStep` (its `mask` and `final_steps` used).
      policy_version: the version of the policy that acted, an int.
      timeout: seconds to wait for the limiter (None: no limit).
      mask, episode_end, final_steps: stream kinds, as `buffer.add` takes
        them, over this writer's n envs (`help(jaxbuf.streams)`).

    Raises:
      ServiceClosed: the service is closed, or was closed while waiting.
      TimeoutError: the limiter did not allow the add within `timeout`.
      ValueError: an add that can never run, or every caller waiting on
        the others, none under way (the sizes and the fix named).
      RuntimeError: the writer is used from a second thread, or closed.
      TypeError, ValueError: `items` do not fit the buffer (the leaf path,
        expected and given); nothing was added, other writers unaffected.
    """
    current = threading.get_ident()
    if self._thread is None:
      self._thread = current
    elif self._thread != current:
      raise RuntimeError(
        f"Writer.add: this writer belongs to thread {self._thread}; called from thread "
        f"{current}. Make one writer per thread (service.writer())."
      )
    if self._closed:
      raise RuntimeError("Writer.add: this writer was closed.")
    if isinstance(items, RecordedStep):
      recorded = items
      items, mask, final_steps = recorded.items, recorded.mask, recorded.final_steps
      if items is None:  # a vector step with no row to add
        return
    self._service._add(  # pylint: disable=protected-access  (the ReplayService)
      self,
      items,
      policy_version,
      timeout,
      mask=mask,
      episode_end=episode_end,
      final_steps=final_steps,
    )

  def close(self) -> None:
    """Gives the writer's envs back to the service (another writer may own
    them); later adds through it raise `RuntimeError`. Idempotent."""
    if not self._closed:
      self._closed = True
      self._service._release(self)  # pylint: disable=protected-access
