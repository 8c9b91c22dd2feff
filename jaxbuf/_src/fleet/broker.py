"""The broker: the Ray actor between remote callers and the learner's process.

A Ray driver (the learner's process) cannot receive calls: only actors can.
So `jaxbuf.ray.serve` starts this small actor, owned by the learner's
process (it dies with it), and the learner's server thread long-polls it:

    caller --call(request)--> broker --poll()--> server (learner's process)
    caller <----reply--------  broker <--reply()-- server

A call waits (an asyncio future) until the server replies; the broker never
runs the service and never touches a payload (chunks above a few KiB
travel as object refs inside the request, fetched by the server from Ray's
object store). It also holds the latest published parameters (one object
ref per publish) for `Served.publish` / `Served.params`.

Replies are `(status, value)`: `("ok", value)`, `("error", exception)` (the
service's own exception, raised again in the caller), `("closed", message)`
(`ServiceClosed`) or `("timeout", message)` (`TimeoutError`). The broker
makes the last two itself and imports nothing of jaxbuf: it is shipped to
its worker by value (`server.py`), so that process never imports JAX.

Timeouts. A request with a timeout that the server has not taken within it
is answered `timeout` here (it never reached the service); one it took is
answered by the server, which gets the time left. Adds are never expired
here: a writer's chunks must reach the server all, in order (Ray runs an
async actor's calls out of order, so they carry sequence numbers), and the
server gives the limiter wait of each the time it has left.
"""

import asyncio
import collections
import itertools
import time
from typing import Any


class _Channel:
  """One served service's requests, replies and parameters."""

  def __init__(self):
    self.pending: collections.deque = collections.deque()  # (id, request, arrival)
    self.arrived = asyncio.Event()
    self.closed: str | None = None  # the message callers get once closed
    self.serving = False
    self.generation = 0
    self.params: tuple[int, list] | None = None  # (version, [ref])
    self.published = asyncio.Condition()


class Broker:
  """Relays requests to servers and replies back (module docstring).

  One broker per named service; the unnamed services of one learner's
  process share one, each on its own channel (a worker process less per
  service).
  """

  def __init__(self, name: str | None):
    self._name = name
    self._channels: dict[int, _Channel] = {}
    self._channel_ids = itertools.count()
    self._futures: dict[int, asyncio.Future] = {}  # pending and taken requests
    self._ids = itertools.count()

  async def open_channel(self) -> int:
    """A new channel (made in the actor's event loop, as its events must be)."""
    channel = next(self._channel_ids)
    self._channels[channel] = _Channel()
    return channel

  def _channel(self, channel: int) -> _Channel:
    return self._channels[channel]

  # Callers -------------------------------------------------------------------

  async def call(self, channel: int, request: dict) -> tuple[str, Any]:
    """Queues `request` for the channel's server and waits for its reply."""
    state = self._channel(channel)
    if state.closed is not None:
      return ("closed", state.closed)
    loop = asyncio.get_running_loop()
    request_id = next(self._ids)
    future = loop.create_future()
    self._futures[request_id] = future
    state.pending.append((request_id, request, time.monotonic()))
    state.arrived.set()
    timeout = request.get("timeout")
    # A writer's adds are never expired here: the server sees each (in its
    # writer's order) and gives its limiter wait the time left.
    if timeout is not None and request["op"] != "add":
      loop.call_later(timeout, self._expire, state, request_id, timeout)
    return await future

  def _expire(self, state: _Channel, request_id: int, timeout: float) -> None:
    """A request the server has not taken within its timeout: answered here."""
    for index, (pending_id, _, _) in enumerate(state.pending):
      if pending_id == request_id:
        del state.pending[index]
        message = f"the learner's process did not take the call within {timeout} s."
        self._resolve(request_id, ("timeout", message))
        return

  def _resolve(self, request_id: int, reply: tuple[str, Any]) -> None:
    future = self._futures.pop(request_id, None)
    if future is not None and not future.done():
      future.set_result(reply)

  # The server ------------------------------------------------------------------

  async def attach(self, channel: int) -> int:
    """A server starts serving (again: a restarted learner); returns its generation."""
    state = self._channel(channel)
    state.closed = None
    state.serving = True
    state.generation += 1
    return state.generation

  async def poll(
    self, channel: int, wait: float, limit: int = 256
  ) -> list[tuple[int, dict, float | None]]:
    """Up to `limit` requests, waiting up to `wait` s for one: each as
    `(id, request, seconds left of its timeout or None)`."""
    state = self._channel(channel)
    if not state.pending:
      state.arrived.clear()
      try:
        await asyncio.wait_for(state.arrived.wait(), wait)
      except TimeoutError:
        return []
    taken: list[tuple[int, dict, float | None]] = []
    now = time.monotonic()
    while state.pending and len(taken) < limit:
      request_id, request, arrival = state.pending.popleft()
      timeout = request.get("timeout")
      left = None if timeout is None else max(timeout - (now - arrival), 0.0)
      taken.append((request_id, request, left))
    return taken

  async def reply(self, replies: list[tuple[int, tuple[str, Any]]]) -> None:
    for request_id, reply in replies:
      self._resolve(request_id, reply)

  async def close(self, channel: int, message: str) -> None:
    """Closed: every request not taken, and every later one, gets `closed`.
    Taken requests get the server's replies (it finishes them)."""
    state = self._channel(channel)
    state.closed = message
    state.serving = False
    while state.pending:
      request_id, _, _ = state.pending.popleft()
      self._resolve(request_id, ("closed", message))

  async def status(self, channel: int) -> dict | None:
    """The channel's state, or None for a channel not opened yet (a broker
    just made under a learner's name, before its server opens channel 0)."""
    state = self._channels.get(channel)
    if state is None:
      return None
    return dict(
      name=self._name,
      closed=state.closed,
      serving=state.serving,
      generation=state.generation,
      pending=len(state.pending),
    )

  # Parameters ------------------------------------------------------------------

  async def publish(self, channel: int, version: int, refs: list) -> None:
    """The latest parameters: `refs` holds one object ref (not resolved here)."""
    state = self._channel(channel)
    async with state.published:
      if state.params is None or version >= state.params[0]:
        state.params = (version, refs)
      state.published.notify_all()

  async def params(self, channel: int, newer_than: int, wait: float | None):
    """The latest `(version, [ref])` once its version is above `newer_than`,
    waiting up to `wait` s (None: no limit); None if none came."""
    state = self._channel(channel)

    def newer() -> bool:
      return state.params is not None and state.params[0] > newer_than

    async with state.published:
      if not newer():
        try:
          await asyncio.wait_for(state.published.wait_for(newer), wait)
        except TimeoutError:
          return None
      return state.params
