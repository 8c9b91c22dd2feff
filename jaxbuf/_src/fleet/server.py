"""The learner's side: `serve(service)` and the threads that run remote
calls on the local `ReplayService` (host code; see `broker.py` for the path
a call takes).

Threads, all in the learner's process:

* the dispatcher long-polls the broker, answers what is quick (counts, a
  close) and hands the rest on; it also notices a service closed locally
  (`service.close()`) and closes the broker, so remote calls end with
  `ServiceClosed`;
* the reaper checks the remote writers' leases and reaps the writers of
  processes that died;
* one writer thread per remote writer owns that writer's local `Writer`
  (a writer belongs to one thread): it fetches each chunk from Ray's object
  store and calls `writer.add`, which waits for the rate limiter exactly as
  an actor thread's add does, so backpressure reaches the remote caller;
* a thread per remote sample, priority update or writer claim (each may
  wait: the limiter, the state lock, a dead writer's envs).

Dead callers. A remote writer sends a lease, an object ref its own process
owns; Ray fails it once that process dies (killed, SIGKILL, its node lost).
A chunk whose fetch fails so is dropped (its caller never got an
acknowledgement), and the reaper checks every writer's lease every
`SWEEP` s: a dead writer's thread closes its local writer, which frees its
env rows for the actor that replaces it. So a killed actor loses at most
its unacknowledged chunk, and never holds env rows or a thread forever.
"""

import itertools
import queue
import sys
import threading
import time
import types
from typing import Any

import jax
import ray
from ray import cloudpickle

from jaxbuf._src.fleet import broker as broker_module
from jaxbuf._src.fleet import wire
from jaxbuf._src.fleet.client import Served
from jaxbuf._src.service.closed import ServiceClosed
from jaxbuf._src.service.replay_service import ReplayService, ServiceSample, _check_timeout
from jaxbuf._src.service.writer import Writer

POLL = 0.25  # s: the dispatcher's long poll; also how soon it notices a local close
SWEEP = 1.0  # s between checks of the remote writers' leases
LEASE = 10.0  # s a lease check may take (a dead owner's fails within seconds)
IDLE = 1.0  # s: how often an idle writer thread looks whether the server stopped
CLAIM = 5.0  # s a writer claim waits for env rows held by a dying writer, by default
FETCH = 60.0  # s to fetch a chunk whose owner is alive (Ray reports a dead one)
CONTROL = 60.0  # s to wait for the broker's answer to the server's own calls
JOIN = 10.0  # s to wait for each thread when the server stops

# The broker is shipped to its worker by value, so that process imports
# neither jaxbuf nor JAX (a few MB and no second of imports).
cloudpickle.register_pickle_by_value(broker_module)
_actor_options: Any = dict(num_cpus=0, max_restarts=0, max_concurrency=10_000)
_BrokerActor: Any = ray.remote(**_actor_options)(broker_module.Broker)

_DEAD = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)


def _error_reply(error: BaseException) -> tuple[str, Any]:
  """An exception for the caller; its cause (lost in pickling) in a note."""
  if error.__cause__ is not None:
    error.add_note(f"caused by {error.__cause__!r}")
  return ("error", error)


class _WriterThread:
  """One remote writer: its local `Writer`, its lease, the thread that adds."""

  def __init__(self, server: "Server", writer_id: int, writer: Writer, lease: list):
    self.server = server
    self.writer_id = writer_id
    self.writer = writer
    self.lease = lease  # [ObjectRef] owned by the writer's process
    self.envs = set() if writer.envs is None else set(writer.envs.tolist())
    self.requests: queue.SimpleQueue = queue.SimpleQueue()
    self.released = threading.Event()
    self.thread = threading.Thread(
      target=self._run, name=f"jaxbuf.ray writer {writer_id}", daemon=True
    )
    self.thread.start()

  def reap(self) -> None:
    """Closes the writer once its current add is done (its process died)."""
    self.requests.put(None)

  def _run(self) -> None:
    held: dict[int, tuple] = {}  # requests that came before their turn, by sequence
    turn = 0  # the sequence number of the writer's next request
    try:
      while True:
        if turn in held:
          entry = held.pop(turn)
        else:
          try:
            entry = self.requests.get(timeout=IDLE)
          except queue.Empty:
            if self.server.stopping.is_set():
              return
            continue
          if entry is None:
            return
          if entry[1]["seq"] != turn:  # Ray reordered the caller's calls
            held[entry[1]["seq"]] = entry
            continue
        turn += 1
        request_id, request, left = entry
        if request["op"] == "close_writer":
          self.server.reply(request_id, ("ok", None))
          return
        reply, alive = self._add(request, left)
        self.server.reply(request_id, reply)
        if not alive:
          return
    finally:
      self.writer.close()  # frees its env rows
      self.server.forget(self.writer_id)
      self.released.set()

  def _add(self, request: dict, left: float | None) -> tuple[tuple[str, Any], bool]:
    """The add's reply, and whether the writer's process is still alive."""
    what = "Writer.add"
    try:
      payload = request["payload"]
      if payload is None:
        payload = ray.get(request["chunk"][0], timeout=FETCH)
    except _DEAD as error:
      # The caller died with the chunk unacknowledged: it is dropped whole.
      return _error_reply(error), False
    except Exception as error:  # pylint: disable=broad-exception-caught
      return _error_reply(error), True  # not fetched (its node slow): not added
    try:
      items = wire.checked_arrays(what, "items", payload["items"])
      final_steps = wire.checked_arrays(what, "final_steps", payload.get("final_steps"))
      self.writer.add(
        items,
        policy_version=request["version"],
        timeout=left,
        mask=payload.get("mask"),
        episode_end=payload.get("episode_end"),
        final_steps=final_steps,
      )
    except Exception as error:  # pylint: disable=broad-exception-caught
      return _error_reply(error), True  # raised again in the caller
    return ("ok", None), True


class Server:
  """Runs remote calls on `service` for as long as it serves (module docstring)."""

  def __init__(self, service: ReplayService, broker: Any, channel: int, served_as: str):
    self.service = service
    self.broker = broker
    self.channel = channel
    self.served_as = served_as
    self.stopping = threading.Event()
    self.lost = False  # the broker died (its process, or the learner's, was lost)
    self._writers: dict[int, _WriterThread] = {}
    self._writers_lock = threading.Lock()
    self._ids = itertools.count()
    self._workers: set[threading.Thread] = set()
    self._dispatcher = threading.Thread(
      target=self._dispatch, name=f"jaxbuf.ray server {served_as}", daemon=True
    )
    self._reaper = threading.Thread(
      target=self._reap, name=f"jaxbuf.ray reaper {served_as}", daemon=True
    )
    self._dispatcher.start()
    self._reaper.start()

  # Replies and bookkeeping -----------------------------------------------------

  def reply(self, request_id: int, reply: tuple[str, Any]) -> None:
    """Sends a reply; never waits (a dead broker has nobody to tell)."""
    try:
      self.broker.reply.remote([(request_id, reply)])
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # the broker is dead, or Ray shut down in this process

  def forget(self, writer_id: int) -> None:
    with self._writers_lock:
      self._writers.pop(writer_id, None)

  def _spawn(self, target, *args) -> None:
    thread = threading.Thread(target=target, args=args, daemon=True)
    self._workers = {worker for worker in self._workers if worker.is_alive()} | {thread}
    thread.start()

  # The dispatcher ----------------------------------------------------------------

  def _dispatch(self) -> None:
    while not self.stopping.is_set():
      try:
        taken = ray.get(self.broker.poll.remote(self.channel, POLL), timeout=POLL + CONTROL)
      except ray.exceptions.GetTimeoutError:
        continue
      except Exception:  # pylint: disable=broad-exception-caught
        self.lost = True  # the broker died, or Ray was shut down here
        break
      for request_id, request, left in taken:
        self._route(request_id, request, left)
      if self.service.closed:
        self.close_broker()
        break
    self.stopping.set()

  def close_broker(self) -> None:
    try:
      message = f"the replay service {self.served_as} is closed."
      ray.get(self.broker.close.remote(self.channel, message), timeout=CONTROL)
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # nobody left to tell

  def _route(self, request_id: int, request: dict, left: float | None) -> None:
    op = request["op"]
    if op in ("add", "close_writer"):
      with self._writers_lock:
        writer = self._writers.get(request["writer"])
      if writer is None:
        self.reply(
          request_id,
          ("closed", "this writer is closed, or belonged to a learner that was restarted; "
                     "open a new one (served.writer())."),
        )  # fmt: skip
      else:
        writer.requests.put((request_id, request, left))
    elif op == "open":
      self._spawn(self._open, request_id, request, left)
    elif op == "sample":
      self._spawn(self._sample, request_id, request, left)
    elif op == "update":
      self._spawn(self._update, request_id, request)
    elif op == "counts":
      self.reply(request_id, ("ok", tuple(self.service.counts)))
    elif op == "close":
      self.service.close()
      self.reply(request_id, ("ok", None))
    else:
      self.reply(request_id, ("error", ValueError(f"unknown request {op!r}.")))

  def _reap(self) -> None:
    """The reaper thread: every `SWEEP` s, reaps the writers whose processes
    died (their leases failed). Its own thread: a dead owner's lease can
    take seconds to fail, which the dispatcher must not wait for."""
    while not self.stopping.wait(SWEEP):
      with self._writers_lock:
        writers = list(self._writers.values())
      for writer in writers:
        if not self._alive(writer, LEASE):
          writer.reap()

  @staticmethod
  def _alive(writer: _WriterThread, timeout: float = 1.0) -> bool:
    try:
      ray.get(writer.lease[0], timeout=timeout)
    except _DEAD:
      return False
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # not answered in time (its node slow), or Ray shut down: not known dead
    return True

  # Requests that may wait ---------------------------------------------------------

  def _open(self, request_id: int, request: dict, left: float | None) -> None:
    """A writer claim. Env rows held by another writer are refused as
    `service.writer` refuses them, after waiting (up to the time left, else
    `CLAIM` s) in case their holder's process died: Ray reports a death
    within a second or two, and the dead writer's rows are freed then."""
    deadline = time.monotonic() + (CLAIM if left is None else left)
    while True:
      try:
        writer = self.service.writer(request["envs"], part=request["part"])
        break
      except ValueError as error:
        holders = self._holders(request["envs"])
        if not holders or time.monotonic() > deadline:
          self.reply(request_id, _error_reply(error))
          return
        for holder in holders:
          if not self._alive(holder):
            holder.reap()
        # Ray has no wait for a death; the holders' releases are waited on
        # in turns, so a rows' release is seen within a quarter second.
        holders[0].released.wait(min(0.25, max(deadline - time.monotonic(), 0.0)))
      except Exception as error:  # pylint: disable=broad-exception-caught
        self.reply(request_id, _error_reply(error))
        return
    writer_id = next(self._ids)
    with self._writers_lock:
      self._writers[writer_id] = _WriterThread(self, writer_id, writer, request["lease"])
    self.reply(request_id, ("ok", writer_id))

  def _holders(self, envs: list[int] | None) -> list[_WriterThread]:
    """The writers holding any of `envs` (None: every env)."""
    with self._writers_lock:
      return [w for w in self._writers.values() if w.envs and (envs is None or w.envs & set(envs))]

  def _sample(self, request_id: int, request: dict, left: float | None) -> None:
    try:
      sample = self.service.sample(
        wire.decoded_key(request["key"]),
        request["batch_size"],
        timeout=left,
        max_version_lag=request["max_version_lag"],
      )
      reply = ("ok", [ray.put(jax.device_get(sample))])
    except Exception as error:  # pylint: disable=broad-exception-caught
      reply = _error_reply(error)
    self.reply(request_id, reply)

  def _update(self, request_id: int, request: dict) -> None:
    try:
      batch = request["batch"]
      if batch is None:  # an item or stream kind: what update_priorities reads
        batch = types.SimpleNamespace(indices=request["indices"], item_ids=request["item_ids"])
      sample: Any = ServiceSample(batch, version_lag=None)  # type: ignore[arg-type]
      self.service.update_priorities(sample, request["priorities"])
      reply: tuple[str, Any] = ("ok", None)
    except Exception as error:  # pylint: disable=broad-exception-caught
      reply = _error_reply(error)
    self.reply(request_id, reply)

  # Stopping -----------------------------------------------------------------------

  def stop(self) -> None:
    """Stops the threads (each writer's current add finishes first)."""
    self.stopping.set()
    with self._writers_lock:
      writers = list(self._writers.values())
    for writer in writers:
      writer.reap()
    threads = [self._dispatcher, self._reaper] + [w.thread for w in writers]
    for thread in threads + list(self._workers):
      if thread is not threading.current_thread():
        thread.join(JOIN)


_shared: dict[str, Any] = {}  # the Ray job id -> this process's broker of unnamed services


def _broker_for(name: str | None, namespace: str, timeout: float) -> tuple[Any, int]:
  """The broker and channel to serve on: a channel of this process's shared
  broker (unnamed), a new named broker, or `name`'s closed one (a learner
  serving again in the same process). Waits up to `timeout` for the name
  of a dead broker (a learner that was lost) to be released by Ray."""
  if name is None:
    job = ray.get_runtime_context().get_job_id()
    broker = _shared.get(job)
    try:
      channel = ray.get(broker.open_channel.remote(), timeout=timeout) if broker else None
    except ray.exceptions.RayActorError:
      channel = None
    if channel is None:
      broker = _shared[job] = _BrokerActor.remote(None)
      channel = ray.get(broker.open_channel.remote(), timeout=timeout)
    return broker, channel
  deadline = time.monotonic() + timeout
  while True:
    try:
      existing = ray.get_actor(name, namespace=namespace)
    except ValueError:
      existing = None
    if existing is not None:
      status: Any
      try:
        status = ray.get(existing.status.remote(0), timeout=CONTROL)
      except ray.exceptions.RayActorError:
        status = None  # dead: its name is released soon
      if status is not None:
        if status["serving"]:
          raise ValueError(
            f"serve: {name!r} is served already (namespace {namespace!r}); close that served "
            "service first, or serve this one under another name."
          )
        return existing, 0
    else:
      try:
        broker = _BrokerActor.options(name=name, namespace=namespace).remote(name)
        return broker, ray.get(broker.open_channel.remote(), timeout=timeout)
      except ValueError:
        pass  # taken meanwhile, or a dead broker's name not yet released
    if time.monotonic() > deadline:
      raise TimeoutError(
        f"serve: the name {name!r} is held by a broker that is gone, and Ray did not release "
        f"it within {timeout} s."
      )
    # Ray has no wait for a name; a dead actor's name goes within a second.
    time.sleep(0.1)


def serve(
  service: ReplayService,
  *,
  name: str | None = None,
  namespace: str | None = None,
  timeout: float | None = 60.0,
) -> Served:
  """Serves `service` to Ray actors and tasks in other processes and hosts.

  Call it in the learner's process (a Ray driver or actor, after
  `ray.init`), where `service` lives. Pass the returned handle to actors
  (it pickles); there `served.writer()` has the `Writer` API and
  `served.sample` draws as `service.sample` does. The service's rate
  limiter, versions, `close()` and checkpoints mean what they mean in one
  process (`docs/guides/ray.md`).

  Args:
    service: the `jaxbuf.ReplayService` to serve; it stays usable locally.
    name: a name for the serving actor; with one, a learner restarted from
      `service.checkpoint` serves under the same name and the actors'
      handles find it again (`Served.writer(timeout=)` waits for it). None:
      anonymous, reachable only through the handle.
    namespace: the Ray namespace of the name (default: this job's).
    timeout: seconds to wait for the serving actor to start (and for a lost
      learner's name to be released).

  Returns:
    A `Served` handle.

  Raises:
    RuntimeError: Ray is not initialised (`ray.init()`).
    ValueError: the name is served by another live service.
  """
  if not isinstance(service, ReplayService):
    raise TypeError(f"serve: service must be a jaxbuf.ReplayService; given {type(service)}.")
  if not ray.is_initialized():
    raise RuntimeError("serve: Ray is not initialised; call ray.init() first.")
  timeout = _check_timeout(timeout, "serve")
  if service.closed:
    raise ServiceClosed("serve: the replay service is closed.")
  namespace = ray.get_runtime_context().namespace if namespace is None else namespace
  wait = sys.float_info.max if timeout is None else timeout
  broker, channel = _broker_for(name, namespace, wait)
  ray.get(broker.attach.remote(channel), timeout=timeout)
  served_as = repr(name) if name is not None else "(unnamed)"
  server = Server(service, broker, channel, served_as)
  return Served(broker, channel, name, namespace, server=server)
