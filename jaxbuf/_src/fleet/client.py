"""The handles remote callers hold: `Served` (what `jaxbuf.ray.serve`
returns; it pickles, so it is passed to Ray actors and tasks) and
`RemoteWriter` (what `served.writer()` returns in an actor).

Every call is one request to the broker, answered by the learner's server
(`broker.py`, `server.py`); the service's own exceptions are raised again
here. A broker that died (the learner's process was lost) ends a writer's
add with `ServiceClosed`; calls that open writers, sample, count or read
parameters find the broker again by `name` (a learner restarted from a
checkpoint serves under the same one) and wait for it up to their timeout.
"""

import collections
import threading
import time
from typing import Any, Sequence

import numpy as np
import ray

from jaxbuf._src.core.base import ReplaySample
from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.fleet import wire
from jaxbuf._src.host.vector_envs import RecordedStep
from jaxbuf._src.service.closed import ServiceClosed
from jaxbuf._src.service.limiters import RateCounts
from jaxbuf._src.service.replay_service import ServiceSample, _check_timeout, _check_version

# Seconds a caller waits for a reply beyond its own timeout (the learner's
# process got the call in time and is answering it) before giving up on it.
REPLY_GRACE = 60.0
FETCH = 60.0  # s to fetch a sample or parameters from Ray's object store
CONTROL = 60.0  # s for a broker's status


class _Lost(Exception):
  """The broker died: the learner's process (or the broker's) was lost."""


class Served:
  """A `jaxbuf.ReplayService` served through Ray: made by
  `jaxbuf.ray.serve(service)` in the learner's process; pass it to Ray
  actors and tasks (it pickles), which call `writer()` and `sample()`.

  In the learner's process `served.service` is the local service (add and
  sample there directly: no Ray in the path); elsewhere it is None.

  Attributes:
    name: the name it is served under, or None.
    namespace: that name's Ray namespace.
  """

  def __init__(
    self, broker: Any, channel: int, name: str | None, namespace: str, *, server: Any = None
  ):
    self._broker = broker
    self._channel = channel
    self.name = name
    self.namespace = namespace
    self._server = server  # the learner's process only; never pickled
    self._served_as = f"jaxbuf.ray service {name!r}" if name else "jaxbuf.ray service"

  def __reduce__(self):
    return (Served, (self._broker, self._channel, self.name, self.namespace))

  def __repr__(self) -> str:
    where = "local" if self._server is not None else "remote"
    return f"Served(name={self.name!r}, namespace={self.namespace!r}, {where})"

  @property
  def service(self) -> Any:
    """The served `ReplayService` in the learner's process; None elsewhere."""
    return None if self._server is None else self._server.service

  # Calls -------------------------------------------------------------------------

  def _submit(self, request: dict) -> Any:
    """The pending reply of `request` (an object ref)."""
    return self._broker.call.remote(self._channel, request)

  def _wait(self, reply: Any, timeout: float | None) -> tuple[str, Any]:
    """The reply, for a call given `timeout` (it may take `REPLY_GRACE` s
    more: the learner's process got it in time and is answering)."""
    wait = None if timeout is None else timeout + REPLY_GRACE
    try:
      return ray.get(reply, timeout=wait)
    except ray.exceptions.RayActorError as error:
      raise _Lost() from error
    except ray.exceptions.GetTimeoutError:
      raise TimeoutError(
        f"{self._served_as}: no reply within {wait} s (the call's timeout and "
        f"{REPLY_GRACE} s more); the learner's process may have taken it."
      ) from None

  def _call(self, request: dict, timeout: float | None) -> tuple[str, Any]:
    return self._wait(self._submit(request), timeout)

  def _request(self, request: dict, timeout: float | None) -> Any:
    """`request`'s reply value; after a lost broker, found again by name and
    sent again (calls with no effect before the server took them)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      try:
        return wire.raised(self._call(request, _left(deadline)), self._served_as)
      except _Lost:
        if self.name is None:
          raise ServiceClosed(
            f"{self._served_as}: the learner's process serving it was lost (an unnamed "
            "service cannot be found again: serve(service, name=...))."
          ) from None
        self._broker, self._channel = self._found(deadline), 0
        if "timeout" in request:
          request = dict(request, timeout=_left(deadline))

  def _found(self, deadline: float | None) -> Any:
    """The live broker serving `name` now, waited for until `deadline`."""
    name = self.name
    if name is None:
      raise ServiceClosed(f"{self._served_as}: an unnamed service cannot be found again.")
    pause = 0.05
    while True:
      try:
        broker = ray.get_actor(name, namespace=self.namespace)
        if ray.get(broker.status.remote(0), timeout=CONTROL) is not None:
          return broker  # its server has opened channel 0
      except (ValueError, ray.exceptions.RayActorError):
        pass  # not (yet) served again
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(
          f"{self._served_as}: the learner's process was lost, and no learner served "
          f"{self.name!r} again within the timeout."
        )
      # Ray has no wait for a name to appear: polled, backing off to 1 s.
      time.sleep(min(pause, _left(deadline) or pause))
      pause = min(2 * pause, 1.0)

  # The Writer API and sampling ---------------------------------------------------

  def writer(
    self,
    envs: Sequence[int] | None = None,
    *,
    part: int | None = None,
    timeout: float | None = None,
    max_in_flight: int = 0,
  ) -> "RemoteWriter":
    """A writer for this thread, with the `jaxbuf.Writer` API: as
    `service.writer(envs, part=)`, in another process.

    Args:
      envs: stream kinds: the env rows this writer owns; None: every env.
      part: a mixture's service: the part this writer adds to.
      timeout: seconds to wait for the learner (one that is restarting from
        a checkpoint; env rows held by a writer whose process just died,
        until Ray reports its death); None: no limit, but a claim of rows a
        live writer holds fails after a few seconds as `service.writer`'s.
      max_in_flight: chunks an `add` may leave unacknowledged (0: each add
        returns once the learner took it, as a local add). With 1, an add
        returns once its chunk is sent and the one before it acknowledged,
        so the actor steps its envs while a chunk travels; errors of a
        chunk (a bad leaf, the limiter's timeout, a close) are then raised
        by the next `add` or by `flush`.

    Raises:
      ValueError: as `service.writer` (envs out of range or held by another
        live writer), raised in this process.
      jaxbuf.ServiceClosed: the service is closed.
      TimeoutError: no learner served within `timeout`.
    """
    timeout = _check_timeout(timeout, "served.writer")
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 0:
      raise ValueError(
        f"served.writer: max_in_flight must be an int >= 0; given {max_in_flight!r}."
      )
    rows = None if envs is None else [int(env) for env in np.asarray(envs).reshape(-1)]
    lease = [ray.put(b"jaxbuf.ray writer lease")]  # owned here: fails when this process dies
    writer_id = self._request(
      dict(op="open", envs=rows, part=part, lease=lease, timeout=timeout), timeout
    )
    return RemoteWriter(self, writer_id, rows, part, lease, max_in_flight)

  def sample(
    self,
    key: Any,
    batch_size: int,
    timeout: float | None = None,
    max_version_lag: int | None = None,
  ) -> ServiceSample:
    """`service.sample` in the learner's process, for a remote sampler (an
    evaluation process, a second learner).

    Returns:
      A `ServiceSample` of NumPy arrays (read-only views of Ray's object
      store: copy a leaf to write into it): `.batch`, the buffer's own
      sample; `.version_lag`, int32 `[S]`.

    Raises:
      jaxbuf.ServiceClosed: the service is closed (raised in this process, as
        `service.sample` raises it).
      TimeoutError: the limiter did not allow the sample within `timeout`.
      ValueError: a bad argument, or sizes that could deadlock.
    """
    timeout = _check_timeout(timeout, "served.sample")
    request = dict(
      op="sample",
      key=wire.encoded_key(key),
      batch_size=batch_size,
      timeout=timeout,
      max_version_lag=max_version_lag,
    )
    refs = self._request(request, timeout)
    return ray.get(refs[0], timeout=FETCH)

  def update_priorities(self, sample: ServiceSample, priorities: Any) -> None:
    """`service.update_priorities` for the rows of a sample drawn here."""
    batch = sample.batch
    request: dict[str, Any] = dict(op="update", priorities=np.asarray(priorities))
    if isinstance(batch, ReplaySample):  # its rows are enough; the items stay here
      request.update(batch=None, indices=np.asarray(batch.indices))
      request.update(item_ids=np.asarray(batch.item_ids))
    else:  # a mixture's batch: each part's rows
      request.update(batch=wire.host_tree(batch))
    self._request(request, None)

  @property
  def counts(self) -> RateCounts:
    """The limiter's counts (`service.counts`)."""
    return RateCounts(*self._request(dict(op="counts"), None))

  # Parameters ---------------------------------------------------------------------

  def publish(self, params: PyTree, version: int) -> None:
    """Makes `params` the latest parameters, at `version`: copied to the
    host and put in Ray's object store once, whatever the number of actors
    that read them (`params`)."""
    version = _check_version(version, "served.publish")
    refs = [ray.put(wire.host_tree(params))]
    try:
      ray.get(self._broker.publish.remote(self._channel, version, refs), timeout=CONTROL)
    except ray.exceptions.RayActorError:
      raise ServiceClosed(f"{self._served_as}: the serving actor was lost.") from None

  def params(self, newer_than: int = -1, timeout: float | None = None) -> tuple[PyTree, int] | None:
    """The latest published `(params, version)` once its version is above
    `newer_than`, waiting up to `timeout` s (0: look, do not wait; None: no
    limit). None when no newer version came within it. Params are NumPy
    arrays (read-only views of Ray's object store)."""
    timeout = _check_timeout(timeout, "served.params")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      wait = _left(deadline)
      try:
        ref = self._broker.params.remote(self._channel, int(newer_than), wait)
        latest = ray.get(ref, timeout=None if wait is None else wait + REPLY_GRACE)
        break
      except ray.exceptions.RayActorError:
        if self.name is None:
          raise ServiceClosed(f"{self._served_as}: the serving actor was lost.") from None
        self._broker, self._channel = self._found(deadline), 0
    if latest is None:
      return None
    version, refs = latest
    return ray.get(refs[0], timeout=FETCH), version

  # Closing --------------------------------------------------------------------------

  def close(self) -> None:
    """Closes the service: every remote call in flight or to come, and every
    local one, raises `ServiceClosed` in its caller. Idempotent."""
    if self._server is None:
      try:
        self._request(dict(op="close"), None)
      except ServiceClosed:
        pass
      return
    self._server.service.close()
    self._server.close_broker()
    self._server.stop()

  def __enter__(self) -> "Served":
    return self

  def __exit__(self, kind, error, traceback) -> None:
    if self._server is not None and error is not None:
      self._server.service.close(cause=error)
    self.close()


def connect(name: str, *, namespace: str | None = None, timeout: float | None = None) -> Served:
  """The handle of the service served under `name`, from any process of the
  cluster (one that did not get the handle from the learner: a driver on
  another host, an evaluation job).

  Args:
    name: the name given to `jaxbuf.ray.serve`.
    namespace: its Ray namespace (default: this job's).
    timeout: seconds to wait for a learner to serve it (None: no limit).

  Raises:
    RuntimeError: Ray is not initialised here.
    TimeoutError: nothing served `name` within `timeout`.
  """
  if not ray.is_initialized():
    raise RuntimeError("connect: Ray is not initialised; call ray.init(address=...) first.")
  timeout = _check_timeout(timeout, "connect")
  namespace = ray.get_runtime_context().namespace if namespace is None else namespace
  served = Served(None, 0, name, namespace)
  deadline = None if timeout is None else time.monotonic() + timeout
  served._broker = served._found(deadline)  # pylint: disable=protected-access
  return served


def _left(deadline: float | None) -> float | None:
  if deadline is None:
    return None
  return max(deadline - time.monotonic(), 0.0)


class RemoteWriter:
  """A `jaxbuf.Writer` in another process: `served.writer()`.

  Each `add` sends its items as one chunk (inline, or through Ray's object
  store when larger than 64 KiB) and returns once the learner's service
  took it (the rate limiter may make it wait, as a local add waits), or,
  with `max_in_flight=k`, once at most k chunks are unacknowledged. A
  killed caller loses at most its unacknowledged chunks: the one it was
  adding (and the k in flight), each taken whole or not at all.

  Belongs to one thread, as a `Writer`; close it (or use `with`) when done,
  which frees its env rows; a process that dies frees them too.

  Attributes:
    envs: the env rows it owns (stream kinds), else None.
    part: the mixture part it adds to, else None.
    max_in_flight: chunks an add may leave unacknowledged.
    last_add_bytes: the array bytes of the last chunk sent.
  """

  def __init__(self, served: Served, writer_id: int, envs, part, lease: list, max_in_flight=0):
    self._served = served
    self._id = writer_id
    self.envs = None if envs is None else np.asarray(envs, np.int64)
    self.part = part
    self.max_in_flight = max_in_flight
    self._lease = lease  # kept alive with the writer
    self._thread: int | None = None
    self._closed = False
    self._sequence = 0  # the next request's number (the server keeps the order)
    self._in_flight: collections.deque = collections.deque()  # (reply ref, timeout)
    self.last_add_bytes = 0

  def __reduce__(self):
    raise TypeError(
      "a RemoteWriter belongs to the thread that made it; pass the Served handle and call "
      "served.writer() where the adds are made."
    )

  def _send(self, request: dict) -> None:
    request["writer"], request["seq"] = self._id, self._sequence
    self._sequence += 1
    self._in_flight.append((self._served._submit(request), request.get("timeout")))  # pylint: disable=protected-access

  def _collect(self, keep: int) -> None:
    """Waits for replies until at most `keep` are outstanding; raises the
    first error among them (the others are still collected)."""
    served = self._served
    while len(self._in_flight) > keep:
      reply, timeout = self._in_flight.popleft()
      try:
        wire.raised(served._wait(reply, timeout), served._served_as)  # pylint: disable=protected-access
      except _Lost:
        self._in_flight.clear()
        raise ServiceClosed(
          f"Writer.add: the learner's process serving {served.name!r} was lost, and the "
          "unacknowledged adds with it; open a new writer (served.writer())."
        ) from None

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
    """As `jaxbuf.Writer.add`, in another process.

    Each is raised in this process, as `Writer.add` raises it (with
    `max_in_flight`, for an earlier chunk too).

    Raises:
      TypeError, ValueError: the buffer's own errors naming the leaf
        (nothing of that chunk added).
      TimeoutError: the limiter did not allow it within `timeout`.
      jaxbuf.ServiceClosed: the service is closed, or the learner's process was
        lost (open a new writer).
      RuntimeError: another thread, or a closed writer.
    """
    what = "Writer.add"
    current = threading.get_ident()
    if self._thread is None:
      self._thread = current
    elif self._thread != current:
      raise RuntimeError(
        f"{what}: this writer belongs to thread {self._thread}; called from thread {current}. "
        "Make one writer per thread (served.writer())."
      )
    if self._closed:
      raise RuntimeError(f"{what}: this writer was closed.")
    timeout = _check_timeout(timeout, what)
    version = _check_version(policy_version, what)
    if isinstance(items, RecordedStep):
      recorded = items
      items, mask, final_steps = recorded.items, recorded.mask, recorded.final_steps
      if items is None:
        return
    payload = wire.host_tree(
      dict(items=items, mask=mask, episode_end=episode_end, final_steps=final_steps)
    )
    self.last_add_bytes = wire.tree_bytes(payload)
    request: dict[str, Any] = dict(op="add", version=version, timeout=timeout)
    if self.last_add_bytes > wire.INLINE_BYTES:
      request.update(payload=None, chunk=[ray.put(payload)])
    else:
      request.update(payload=payload, chunk=None)
    self._send(request)
    self._collect(self.max_in_flight)

  def flush(self) -> None:
    """Waits until every chunk sent is acknowledged; raises the first
    error among them (as `add` would have)."""
    self._collect(0)

  def close(self) -> None:
    """Waits for the chunks in flight, then frees the writer's env rows;
    later adds raise `RuntimeError`. Idempotent. Raises what `flush` raises
    (not `ServiceClosed`: a closed service took back the rows already)."""
    if self._closed:
      return
    self._closed = True
    try:
      self.flush()
    except ServiceClosed:
      pass
    finally:
      try:
        self._send(dict(op="close_writer"))
        self._collect(0)
      except ServiceClosed:
        pass

  def __enter__(self) -> "RemoteWriter":
    return self

  def __exit__(self, kind, error, traceback) -> None:
    self.close()
