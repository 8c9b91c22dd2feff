"""`ReplayService`: one buffer state owned on the host, for actor threads
that add and learner threads that sample. Host code: threads and locks
around the buffer's own pure functions, which it calls unchanged.

Why one module of this size: it is one object, whose every method reads or
writes the same state, counts and reservations under the two locks below;
split, the lock rules would span files. What does not touch them is in
modules of its own (limiters, coalescing, FIFO reads, versions, lockstep).

Locks. `_state_lock` guards the state and is held across a device call
(the only thing done while holding it; donation happens under it).
`_counts_lock` guards the limiter's counts, the pending adds and `closed`,
and is only ever held briefly; its two conditions are the two reasons to
wait (`_insertable`, `_sampleable`), every wait with the caller's timeout,
and `close` wakes both. The order is `_state_lock` then `_counts_lock`;
no thread waits for `_state_lock` while holding `_counts_lock`.

Coalescing (flat combining). An add reserves its units with the limiter
and appends itself to the pending list under `_counts_lock`, then takes
`_state_lock`. Whichever thread holds `_state_lock` first drains every
pending add (its own and those that arrived meanwhile) into as few device
calls as it can: item adds concatenated into one `buffer.add`; stream adds
of writers owning disjoint envs scattered into one `[N, ...]` add with a
mask. A thread that finds its add already drained by another returns at
once. So under contention many small adds become one dispatch, and with
one actor nothing waits for a second.

Counts. `counts` holds what is true of the state: units in it, rows taken
from it (Reverb counts under the table's mutex, beside the insert or sample
itself). Beside it, `_adding` and `_sampling` hold what callers the limiter
admitted have reserved and not yet done. An add is admitted against the
units in the state or reserved and the rows taken (not the rows reserved:
under `Queue` a writer so never overwrites a row a sampler is about to
read); a sample against the units in the state and the rows taken or
reserved (never rows an add may still fail to write). Under `Queue` every
item is thus read exactly once, in order, for any capacity >= max_size.

The service's thread. Every donated device call (a drain, a consuming
kind's take, `update_priorities`) and the storing of its result run on one
thread the service owns (`_owned`), callers waiting for it: an exception
raised in a caller's thread (an actor killed by an async exception) can
then never land between a donated call and the assignment of its result.

Samples drain the pending adds first too, so a sample sees every add
admitted before it. They draw with `buffer.take` (consuming kinds retire what
they hand out), under `Queue` with the core's FIFO rule (`fifo_reads`), and
with `max_version_lag` with `uniform.sample_eligible`.
"""

import concurrent.futures
import json
import math
import os
import pathlib
import threading
import time
import weakref
from typing import Any, Callable, Generic, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.checkpoint import saving
from jaxbuf._src.core.base import Buffer, PyTree, SampleT, StateT
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.items import uniform
from jaxbuf._src.items.prioritized import PrioritizedReplayState
from jaxbuf._src.mixture import Mixture
from jaxbuf._src.selection.budget import BudgetedReplayState
from jaxbuf._src.selection.queue import QueueState
from jaxbuf._src.storage.tiers import Disk
from jaxbuf._src.service import coalescing, lockstep
from jaxbuf._src.service.closed import ServiceClosed
from jaxbuf._src.service.fifo_reads import FifoReads
from jaxbuf._src.service.limiters import MinSize, RateCounts, RateLimiter
from jaxbuf._src.service.versions import UnitVersions
from jaxbuf._src.service.writer import Writer
from jaxbuf._src.streams.sequence import SequenceReplayState


class ServiceSample(NamedTuple, Generic[SampleT]):
  """What `ReplayService.sample` returns."""

  batch: SampleT  # the buffer's own sample (ReplaySample, SequenceSample, ...)
  version_lag: jax.Array  # int32 [S]: newest version added minus each row's
  # (-1 for kinds whose units are not tracked: jaxbuf._src.service.versions)


def _check_timeout(timeout: float | None, what: str) -> float | None:
  if timeout is None:
    return None
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
    raise TypeError(f"{what}: timeout must be a number of seconds or None; given {timeout!r}.")
  if math.isnan(timeout) or timeout < 0:
    raise ValueError(f"{what}: timeout must be >= 0 seconds or None; given {timeout}.")
  return None if math.isinf(timeout) else float(timeout)


def _left(deadline: float | None) -> float | None:
  """Seconds left until `deadline` (a `time.monotonic` time), or None."""
  return None if deadline is None else max(0.0, deadline - time.monotonic())


def _check_version(version: Any, what: str) -> int:
  if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
    raise TypeError(f"{what}: policy_version must be an int; given {version!r}.")
  if not 0 <= int(version) < 2**31:
    raise ValueError(f"{what}: policy_version must be in [0, 2**31); given {version}.")
  return int(version)


def _signature(tree: PyTree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef, tuple((np.shape(leaf), np.result_type(leaf)) for leaf in leaves))


def _consumed(tree: PyTree) -> bool:
  """Whether an array of `tree` was donated (deleted)."""
  return any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(tree))


def _abstract(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), np.result_type(leaf)), tree)


class ReplayService(Generic[StateT, SampleT]):
  """A host-side service that owns one buffer state: actor threads add
  through writers, learner threads sample, under a rate limiter.

  Args:
    buffer: any `Buffer` (uniform, prioritized, the stream kinds, a
      `jaxbuf.mixture`, a `jaxbuf.sharded` buffer).
    state: its state; the service owns it from now on (adds donate it).
    rate_limiter: `jaxbuf.MinSize`, `jaxbuf.SampleToInsertRatio` or
      `jaxbuf.Queue` (default `MinSize(1)`). A limiter's units are items
      (item kinds) or env steps, final steps not counted (stream kinds); its
      rows are sampled rows.
    lockstep_rows: a `jaxbuf.sharded` uniform or prioritized item buffer
      across processes (`jax.distributed`; one process works too): the rows
      each process adds per lockstep round (a multiple of its devices).
      Adds wait on the host until a `learn` / `sample`, which every process
      calls in the same order and arguments (`update_priorities`, `state`,
      `checkpoint` too); see the guide. MinSize, SampleToInsertRatio.

  >>> import jax, numpy as np, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(64)
  >>> service = jaxbuf.ReplayService(buffer, buffer.init(np.float32(0)),
  ...                                rate_limiter=jaxbuf.MinSize(4))
  >>> writer = service.writer()
  >>> writer.add(np.arange(8, dtype=np.float32), policy_version=3)
  >>> sample = service.sample(jax.random.key(0), 2, timeout=1.0)
  >>> sample.batch.items.shape, sample.version_lag.tolist()
  ((2,), [0, 0])
  >>> service.close()
  """

  def __init__(
    self,
    buffer: Buffer[StateT, SampleT] | Mixture,
    state: StateT,
    rate_limiter=None,
    *,
    lockstep_rows: int | None = None,
  ):
    if rate_limiter is None:
      rate_limiter = MinSize(1)
    if not isinstance(rate_limiter, RateLimiter):
      raise TypeError(
        "ReplayService: rate_limiter must be jaxbuf.MinSize, SampleToInsertRatio or Queue; "
        f"given {type(rate_limiter).__name__}."
      )
    tiered = getattr(getattr(buffer, "init", None), "tiered", None)
    if tiered is not None and isinstance(tiered.tier, Disk):
      raise ValueError(
        f"ReplayService: this buffer keeps its payload in files "
        f"(storage=jaxbuf.disk({tiered.tier.directory!r})), read and written on the host, "
        f"while the service adds inside jit with the state donated. Use storage='host' "
        f"(payload in pinned host memory) or 'device' with the service, or drive the "
        f"disk-tier buffer's add and sample from one loop without it."
      )
    self.buffer: Any = buffer  # a Buffer, or a Mixture
    self.rate_limiter = rate_limiter
    self._state: Any = state  # a mixture's: the list of its parts' states
    # A mixture's writers add to one part each (`writer(part=k)`), an item kind.
    self._mixture = isinstance(buffer, Mixture)
    self._streams = isinstance(state, SequenceReplayState)
    self._num_envs = (
      int(np.size(state.write_heads)) if isinstance(state, SequenceReplayState) else 0
    )
    self._versions = UnitVersions(state)
    self._fifo = FifoReads(state, int(rate_limiter.max_diff), buffer) if rate_limiter.fifo else None
    # Kinds whose take retires what it hands out: a sample waits for live items.
    self._consuming = isinstance(state, (BudgetedReplayState, QueueState))
    sharded = getattr(getattr(buffer, "add", None), "split_settings", None) is not None
    if lockstep_rows is None and sharded and jax.process_count() > 1:
      raise ValueError(
        "ReplayService: a jaxbuf.sharded buffer across processes needs lockstep_rows= (the "
        "rows each process adds per lockstep round)."
      )
    self._lockstep = (
      None
      if lockstep_rows is None
      else lockstep.Lockstep(buffer, state, rate_limiter, lockstep_rows)
    )
    self._global_inserts = 0  # lockstep: the inserts every process agreed on
    self._abstract_state = _abstract(state)  # read without the lock: never donated
    # The state's arrays are the service's own, so its adds donate them (in
    # place on the device); `state` hands out copies.
    self._parts = buffer.buffers if isinstance(buffer, Mixture) else ()
    self._part_adds: list[Callable] = [jax.jit(part.add, donate_argnums=0) for part in self._parts]
    if not isinstance(buffer, Mixture):
      self._donating_add = jax.jit(buffer.add, donate_argnums=0)
    # An add whose computation has effects (a host callback) can fail while
    # it runs, after a donated state was consumed: such adds keep the state
    # alive instead (`_check_signature` finds them; pure XLA fails at run
    # time only with its device).
    self._may_fail_running = False
    self._parts_undonated: list[Callable] = [jax.jit(part.add) for part in self._parts]
    if not isinstance(buffer, Mixture):
      self._undonated_add = jax.jit(buffer.add)
    # The thread that makes every donated device call and stores its result,
    # so an exception raised in a caller's thread (an actor killed by an
    # async exception) never lands between the two (`_owned`).
    self._owner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxbuf-service")
    # Its thread ends with the service (adds taken before a close are still
    # written, so not at close): a program that makes many services does not
    # keep a thread for each.
    weakref.finalize(self, self._owner.shutdown, wait=False)
    self._queued_drain: concurrent.futures.Future | None = None  # not started yet
    self._state_lock = threading.Lock()
    self._counts_lock = threading.Lock()
    self._insertable = threading.Condition(self._counts_lock)
    self._sampleable = threading.Condition(self._counts_lock)
    self._counts = RateCounts(0, 0)  # units in the state, rows taken from it
    self._adding = 0  # units of admitted adds not yet in the state
    self._sampling = 0  # rows of admitted samples not yet taken
    self._insert_sizes: set[int] = set()  # the sizes used, for `_deadlock`
    self._sample_sizes: set[int] = set()
    # Callers waiting for the limiter: ("insert", units) or ("sample", rows)
    # by a token per wait; the message for those told of a deadlock; the
    # waits for something else (live items), any of which may still move.
    self._waiting: dict[object, tuple[str, int]] = {}
    self._deadlocked: dict[object, str] = {}
    self._other_waits = 0
    self._pending: list[coalescing.PendingAdd] = []
    self._owned_envs: set[int] = set()
    self._checked: set = set()  # add signatures the buffer accepted
    self.closed = False
    self._cause: BaseException | None = None
    self.device_adds = 0  # device add calls made (coalescing: fewer than adds)
    self.adds = 0  # writer adds taken

  # Writers and adds ---------------------------------------------------------

  def writer(self, envs: Sequence[int] | None = None, *, part: int | None = None) -> Writer:
    """A writer for one actor thread.

    Args:
      envs: stream kinds: the env rows this writer owns (each env owned by
        one writer at a time); None: every env. Item kinds: None.
      part: a `jaxbuf.mixture`'s service: the part this writer adds to (an
        item replay part); None otherwise.

    Raises:
      ValueError: envs out of range, repeated, or owned by another writer;
        envs given for an item kind.
      ServiceClosed: the service is closed.
    """
    self._raise_if_closed("writer")
    if self._mixture:
      parts = len(self._state)
      if not isinstance(part, int) or not 0 <= part < parts:
        raise ValueError(f"writer: a mixture's writer needs part= in [0, {parts}); given {part!r}.")
      if isinstance(self._state[part], SequenceReplayState) or envs is not None:
        raise ValueError("writer: a mixture's writers add to item replay parts (no envs=).")
      return Writer(self, None, part)
    if part is not None:
      raise ValueError("writer: part= is for a jaxbuf.mixture's service.")
    if not self._streams:
      if envs is not None:
        raise ValueError("writer: envs= is for the stream kinds; this buffer holds items.")
      return Writer(self, None)
    rows = np.arange(self._num_envs) if envs is None else np.asarray(envs, np.int64).reshape(-1)
    if rows.size == 0 or rows.min() < 0 or rows.max() >= self._num_envs:
      raise ValueError(f"writer: envs must be in [0, {self._num_envs}); given {list(rows)}.")
    if len(set(rows.tolist())) != rows.size:
      raise ValueError(f"writer: envs repeat; given {list(rows)}.")
    with self._counts_lock:
      taken = sorted(self._owned_envs & set(rows.tolist()))
      if taken:
        raise ValueError(
          f"writer: envs {taken} belong to another writer (Writer.close frees them)."
        )
      self._owned_envs |= set(rows.tolist())
    return Writer(self, rows)

  def _release(self, writer: Writer) -> None:
    if writer.envs is not None:
      with self._counts_lock:
        self._owned_envs -= set(writer.envs.tolist())

  def _add(self, writer, items, version, timeout, *, mask, episode_end, final_steps) -> None:
    """`Writer.add`: validate, wait for the limiter, then drain (module docstring)."""
    what = "Writer.add"
    timeout = _check_timeout(timeout, what)
    version = _check_version(version, what)
    self._raise_if_closed(what)
    entry = self._entry(writer, items, version, mask, episode_end, final_steps)
    if entry.units == 0 and not self._streams:
      return
    if self._lockstep is not None and entry.units > self._lockstep.rows:
      raise ValueError(
        f"{what}: an add of {entry.units} rows; lockstep_rows is {self._lockstep.rows}."
      )
    with self._counts_lock:
      self._check_sizes(insert=entry.units)
      self._wait(
        self._insertable,
        lambda: self._may_insert(entry.units),
        timeout,
        waiting=("insert", entry.units),
      )
      self._adding += entry.units
      self._pending.append(entry)
      self.adds += 1
      self._sampleable.notify_all()
      if self._lockstep is not None:
        return  # the learners' lockstep rounds add it
      # A drain queued and not yet started takes this add too: one job for
      # every add that arrives while the service's thread is busy.
      drain = self._queued_drain
      if drain is None:
        drain = self._queued_drain = self._owner.submit(self._drain_queued)
    drain.result()
    if entry.error is not None:
      raise entry.error

  def _owned(self, job: Callable[[], Any]) -> Any:
    """`job()` run on the service's own thread, its result (or error)
    returned here. A caller interrupted while it waits leaves the job to
    finish: a donated call and the storing of its result are never split."""
    return self._owner.submit(job).result()

  def _drain_locked(self) -> None:
    with self._state_lock:
      self._drain()

  def _drain_queued(self) -> None:
    with self._counts_lock:  # adds pending from now on queue another drain
      self._queued_drain = None
    self._drain_locked()

  def _drained(self) -> None:
    """Every add admitted so far in the state (drained on the service's
    thread if any is pending; see `_sampled`)."""
    with self._counts_lock:
      pending = bool(self._pending)
    if pending:
      self._owned(self._drain_locked)

  def _entry(self, writer, items, version, mask, episode_end, final_steps) -> coalescing.PendingAdd:
    """The add, checked against the buffer (once per shape signature)."""
    if not self._streams:
      if mask is not None or episode_end is not None or final_steps is not None:
        raise TypeError("Writer.add: mask, episode_end and final_steps are for the stream kinds.")
      if self._lockstep is not None:
        self._lockstep.check(items)
      else:
        self._check_signature(items, None, None, None, writer.part)
      return coalescing.PendingAdd(
        writer, coalescing.rows_of(items), items, version, None, None, None, 1
      )
    n = len(writer.envs)
    steps_leaf = jax.tree.leaves(items)
    if not steps_leaf:
      raise ValueError("Writer.add: steps hold no arrays.")
    storage_rank = jax.tree.leaves(self._abstract_state.storage)[0].ndim - 1  # [N, *step]
    steps = int(np.shape(steps_leaf[0])[1]) if np.ndim(steps_leaf[0]) > storage_rank else 1
    mask = np.ones(n, np.bool_) if mask is None else np.asarray(mask, np.bool_)
    if mask.shape != (n,):
      raise ValueError(
        f"Writer.add: mask must be bool [{n}] (this writer's envs); given {mask.shape}."
      )
    if episode_end is not None:
      episode_end = np.asarray(episode_end, np.bool_)
    scattered = coalescing.scattered(
      writer.envs, self._num_envs, items, mask, episode_end, final_steps
    )
    self._check_signature(*scattered)
    return coalescing.PendingAdd(
      writer, int(mask.sum()) * steps, items, version, mask, episode_end, final_steps, steps
    )

  def _check_signature(self, items, mask, episode_end, final_steps, part=None) -> None:
    """Refuses an add the buffer would refuse, before anything is queued."""
    key = (_signature(items), mask is None, _signature(episode_end), _signature(final_steps), part)
    if key in self._checked:
      return
    kwargs = {}
    if self._streams:
      kwargs = dict(mask=mask, episode_end=episode_end, final_steps=final_steps)
    add, state = (
      self.buffer.add if part is None else self._parts[part].add,
      self._abstract_state,
    )
    traced = jax.make_jaxpr(lambda state, items, kwargs: add(state, items, **kwargs))(
      state if part is None else state[part],
      _abstract(items),
      _abstract(kwargs),
    )
    if traced.effects:
      self._may_fail_running = True
    self._checked.add(key)

  def _drain(self) -> None:
    """Adds every pending add to the state, in as few device calls as the
    forms allow. Holds `_state_lock`. Lockstep: nothing (rounds add)."""
    if self._lockstep is not None:
      return
    with self._counts_lock:
      pending, self._pending = self._pending, []
    if not pending:
      return
    for group in coalescing.groups(pending, streams=self._streams, by_part=self._mixture):
      try:
        if self._streams:
          self._add_steps(group)
        else:
          self._add_items(group)
        self.device_adds += 1
      except BaseException as error:  # pylint: disable=broad-exception-caught
        # The call failed before running (adds were checked), or while
        # running an add that was not donated (`_may_fail_running`), so the
        # state is the one before: each writer of the group gets the error,
        # and their units are handed back to the limiter.
        for entry in group:
          entry.error = error
        if _consumed(self._state):
          # Only a device fault consumes a donated state and fails (the
          # device is then lost too): nothing to go on with.
          self.close(cause=error)
    units = sum(entry.units for entry in pending)
    failed = sum(entry.units for entry in pending if entry.error is not None)
    with self._counts_lock:  # in the state now (or handed back, when failed)
      self._adding -= units
      self._counts = self._counts._replace(inserts=self._counts.inserts + units - failed)
      self._sampleable.notify_all()
      self._insertable.notify_all()

  def _add_items(self, group: list[coalescing.PendingAdd]) -> None:
    items, versions = coalescing.merged_items(group)
    if self._mixture:
      part = group[0].writer.part
      states = list(self._state)
      adds = self._parts_undonated if self._may_fail_running else self._part_adds
      states[part] = adds[part](states[part], items)
      self._state = type(self._state)(states)
    else:
      add = self._undonated_add if self._may_fail_running else self._donating_add
      self._state = add(self._state, items)
    self._versions.added_items(versions)

  def _add_steps(self, group: list[coalescing.PendingAdd]) -> None:
    (items, mask, episode_end, final_steps), steps_per_env, versions = coalescing.merged_steps(
      group, self._num_envs
    )
    add = self._undonated_add if self._may_fail_running else self._donating_add
    self._state = add(
      self._state, items, mask=mask, episode_end=episode_end, final_steps=final_steps
    )
    self._versions.added_steps(steps_per_env, versions)

  # Sampling ----------------------------------------------------------------

  def sample(
    self,
    key: jax.Array,
    batch_size: int,
    timeout: float | None = None,
    max_version_lag: int | None = None,
  ) -> ServiceSample[SampleT]:
    """Draws `batch_size` rows once the rate limiter allows it.

    Args:
      key: a PRNG key.
      batch_size: S, a Python int.
      timeout: seconds to wait for the limiter (None: no limit).
      max_version_lag: draw only rows whose policy version is at most this
        far behind the newest version added (uniform item replay). With no
        such row held the rows come back with weight 0, as from an empty
        buffer; it does not wait. Drawn with `jaxbuf.uniform.sample_eligible`,
        which retires nothing (not a `take`).

    Returns:
      A `ServiceSample`: `.batch`, the buffer's own sample; `.version_lag`,
      int32 `[S]`.

    Raises:
      ServiceClosed: the service is closed, or was closed while waiting.
      TimeoutError: the limiter did not allow the sample within `timeout`.
      ValueError: a size that can never run (`RateLimiter.check_size`);
        every caller waiting on the others, none under way (the message
        names the sizes and the fix); or a bad argument.
    """
    what = "ReplayService.sample"
    if max_version_lag is not None:
      if (
        not isinstance(self._state, ReplayState)
        or isinstance(self._state, PrioritizedReplayState)
        or self._versions.layout is None
        or self._fifo is not None
      ):
        raise ValueError(
          f"{what}: max_version_lag is drawn by uniform item replay only (unsharded, not "
          f"under a Queue); "
          f"this buffer's state is a {type(self._state).__name__}."
        )
      if (
        isinstance(max_version_lag, bool)
        or not isinstance(max_version_lag, int)
        or max_version_lag < 0
      ):
        raise ValueError(f"{what}: max_version_lag must be an int >= 0; given {max_version_lag!r}.")

    def draw(state):  # under the state lock, which also guards the versions
      if self._fifo is not None:
        batch = self._fifo.take(state, batch_size)
      elif max_version_lag is None:
        state, batch = self.buffer.take(state, key, batch_size)  # consuming kinds retire rows
      else:
        eligible = self._versions.eligible(max_version_lag)
        batch = uniform.sample_eligible(state, key, batch_size, eligible)
      rows = batch.weights if self._mixture else batch.indices  # a mixture: untracked
      return state, ServiceSample(batch, self._versions.lags(rows))

    return self._sampled(what, batch_size, timeout, draw, True)

  def learn(self, step: Callable, batch_size: int, *args: Any, timeout: float | None = None) -> Any:
    """Runs the learner's own step on the state once the limiter allows a
    sample of `batch_size` rows: the batch is taken inside `step` (e.g. a
    jitted train step that samples, learns and updates priorities).

    Under `jaxbuf.Queue` the rows are the service's to choose (the oldest
    unread, each once): `step(state, batch, *args)` gets them as `batch`, a
    `QueueSample`, and the FIFO cursor moves past them, as `sample` does.

    Args:
      step: `step(state, *args) -> (state, result)`; under `Queue`,
        `step(state, batch, *args)`.
      batch_size: the rows `step` samples, counted by the limiter.
      *args: passed to `step`.
      timeout: seconds to wait for the limiter (None: no limit).

    Returns:
      `step`'s result. If `step` raises, the state stays as it was (a step
      must not donate the state it may fail on) and the error propagates.
    """
    if self._fifo is not None:
      fifo = self._fifo

      def fifo_step(state):  # under the state lock: the cursor moves only if step returns
        cursor = fifo.read_count
        try:
          return step(state, fifo.take(state, batch_size), *args)
        except BaseException:
          fifo.read_count = cursor
          raise

      return self._sampled("ReplayService.learn", batch_size, timeout, fifo_step, False)
    return self._sampled(
      "ReplayService.learn", batch_size, timeout, lambda s: step(s, *args), False
    )

  def _sampled(self, what: str, batch_size: int, timeout, call: Callable, owned: bool) -> Any:
    """Waits for the limiter, then `call(state) -> (state, result)` under
    the state lock; `owned`: a call that may donate (a consuming kind's
    take), made on the service's thread (`_owned`) when it does."""
    timeout = _check_timeout(timeout, what)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"{what}: batch_size must be an int >= 1; given {batch_size!r}.")
    if self._lockstep is not None:
      return lockstep.sampled(self, what, batch_size, timeout, call)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      with self._counts_lock:
        self._check_sizes(sample=batch_size)
        self._wait(
          self._sampleable,
          lambda: self._may_sample(batch_size),
          _left(deadline),
          waiting=("sample", batch_size),
        )
        self._sampling += batch_size
        inserts_seen = self._counts.inserts
        # Adds admitted before this sample are pending (drained on the
        # service's thread) or in the state, or in a drain holding the state
        # lock: with none pending a sample that donates nothing needs no drain.
        drain = bool(self._pending)

      def taking(drain: bool) -> tuple[bool, Any]:
        taken, result = False, None
        try:
          with self._state_lock:
            if drain:
              self._drain()
            if self._live_items(self._state, batch_size):
              state, result = call(self._state)
              self._state = state
              taken = True
        finally:
          with self._counts_lock:  # taken now (or handed back: failed, or too few live)
            self._sampling -= batch_size
            if taken:
              self._counts = self._counts._replace(samples=self._counts.samples + batch_size)
            self._sampleable.notify_all()
            self._insertable.notify_all()
        return taken, result

      if owned and (drain or self._consuming):  # a donated take or drain: the service's thread
        taken, result = self._owned(lambda: taking(True))
      else:  # the learner's own step on its own thread, the adds drained before
        if drain:
          try:
            self._owned(self._drain_locked)
          except BaseException:
            with self._counts_lock:
              self._sampling -= batch_size
            raise
        taken, result = taking(False)
      if taken:
        return result
      with self._counts_lock:  # a consuming kind with too few live items: wait for an add
        self._wait(
          self._sampleable,
          lambda: self._counts.inserts != inserts_seen,
          _left(deadline),
          f"{what}: fewer than {batch_size} live items held within {timeout} s (the others "
          f"were handed out and retired; a take would return padding rows): add more, or "
          f"sample fewer.",
        )

  def _live_items(self, state: Any, rows: int) -> bool:
    """A consuming kind (`max_times_sampled`, `queue_replay`) holds `rows`
    live items (and `min_size` under `MinSize`): a take then returns no
    retired or padding row. Other kinds: True. Holds `_state_lock`."""
    if not self._consuming:
      return True
    if math.isinf(self.rate_limiter.min_diff):  # MinSize counts live items, as Reverb's table
      rows = max(rows, self.rate_limiter.min_size)
    return bool(self.buffer.can_sample(state, rows))

  def _check_sizes(self, *, insert: int = 0, sample: int = 0) -> None:
    """Refuses a size that can never run (`RateLimiter.check_size`); keeps
    the sizes used, which `_deadlock` judges by. Holds `_counts_lock`."""
    self.rate_limiter.check_size(insert=insert, sample=sample)
    if insert:
      self._insert_sizes.add(insert)
    if sample:
      self._sample_sizes.add(sample)

  def _deadlock(self, token: object) -> str | None:
    """The message for a deadlock, told to every other waiting caller, or
    None. A deadlock: callers wait on both sides, none is under way (an add
    or sample admitted and not done, a wait for live items), and no add nor
    sample of a size used so far may run at the counts, so no caller of
    those sizes can ever move them. Holds `_counts_lock`."""
    if self._lockstep is not None or self._other_waits or self._adding or self._sampling:
      return None
    if {side for side, _ in self._waiting.values()} != {"insert", "sample"}:
      return None
    if any(self._may_insert(units) for units in self._insert_sizes) or any(
      self._may_sample(rows) for rows in self._sample_sizes
    ):
      return None
    message = self.rate_limiter.deadlock(self._counts, self._insert_sizes, self._sample_sizes)
    for other in self._waiting:
      if other is not token:
        self._deadlocked[other] = message
    self._insertable.notify_all()
    self._sampleable.notify_all()
    return message

  def _may_insert(self, units: int) -> bool:
    """The limiter over the units in the state or reserved, and the rows
    taken (module docstring). Holds `_counts_lock`."""
    inserts = self._counts.inserts + self._adding
    return self.rate_limiter.can_insert(self._counts._replace(inserts=inserts), units)

  def _may_sample(self, rows: int) -> bool:
    """The limiter over the units in the state, and the rows taken or
    reserved (module docstring). Holds `_counts_lock`."""
    samples = self._counts.samples + self._sampling
    return self.rate_limiter.can_sample(self._counts._replace(samples=samples), rows)

  def update_priorities(self, sample: ServiceSample, priorities: Any) -> None:
    """`buffer.update_priorities` for the rows of `sample` (`.batch.indices`,
    `.batch.item_ids`)."""
    self._raise_if_closed("ReplayService.update_priorities")

    def update() -> None:  # donated: on the service's thread
      with self._state_lock:
        if self._mixture:
          self._state = self.buffer.update_priorities(self._state, sample.batch, priorities)
        else:
          self._state = self.buffer.update_priorities(
            self._state, sample.batch.indices, priorities, sample.batch.item_ids
          )

    self._owned(update)

  # State, checkpoints, closing ---------------------------------------------

  @property
  def state(self) -> StateT:
    """The state after every add taken so far.

    A copy, valid while writers go on adding (the service's own arrays are
    donated by the next add).
    """
    self._drained()
    with self._state_lock:  # adds let in since are pending: in neither state nor counts
      if _consumed(self._state):
        raise ServiceClosed(
          "ReplayService.state: a device call failed after consuming the donated state; "
          "restore the service from its last checkpoint."
        ) from self._cause
      return jax.tree.map(
        lambda leaf: leaf.copy() if isinstance(leaf, jax.Array) else leaf, self._state
      )

  @property
  def counts(self) -> RateCounts:
    """Units in the state and rows taken from it so far, as the limiter
    counts them (adds and samples admitted and still under way are not
    counted yet)."""
    with self._counts_lock:
      return self._counts

  def checkpoint(self, path: str | os.PathLike) -> None:
    """Saves the state (`jaxbuf.save` under `path/state`) and the limiter's
    counts and the units' versions (`path/service.json`, `path/versions.npy`):
    one cut, every add taken before the call in both, none after in either.
    Lockstep: every process calls it in the same order (as `sample`); it
    runs the rounds that add the adds pending on each host."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    self._drained()
    with self._state_lock:  # adds let in since are pending: in neither state nor counts
      if self._lockstep is not None:
        lockstep.flush(self)
      saving.save(path / "state", self._state)
      with self._counts_lock:
        counts = self._counts
      # Lockstep: every process writes the same files (the counts agreed),
      # each through a file of its own, replaced whole.
      process = jax.process_index()
      with open(path / f"versions.npy.tmp{process}", "wb") as file:
        np.save(file, np.asarray(self._versions.versions))
      os.replace(path / f"versions.npy.tmp{process}", path / "versions.npy")
      record = {
        "inserts": counts.inserts,
        "samples": counts.samples,
        "newest": self._versions.newest,
        "read_count": None if self._fifo is None else int(self._fifo.read_count),
      }
      temporary = path / f"service.json.tmp{process}"
      temporary.write_text(json.dumps(record))
      os.replace(temporary, path / "service.json")

  @classmethod
  def restore(
    cls,
    path: str | os.PathLike,
    buffer: Buffer,
    like: Any,
    rate_limiter=None,
    *,
    lockstep_rows: int | None = None,
  ) -> "ReplayService":
    """A service from `checkpoint(path)`: the state (`jaxbuf.load(..., like=)`),
    the counts and versions. The counts go through `rate_limiter.restored`:
    kept unless they would block both inserts and samples, when the sample
    count is raised so that inserts may go on (never a deadlock). Under
    `jaxbuf.Queue` the rows sampled are those the FIFO cursor read: a
    checkpoint of another limiter restores with every held item read.
    `lockstep_rows`: as `ReplayService` takes it (a lockstep service; every
    process restores its own checkpoint)."""
    path = pathlib.Path(path)
    state = saving.load(path / "state", like=like)
    record = json.loads((path / "service.json").read_text())
    service = cls(buffer, state, rate_limiter=rate_limiter, lockstep_rows=lockstep_rows)
    service._versions.restore(np.load(path / "versions.npy"), record["newest"])
    if service._fifo is not None and record.get("read_count") is not None:
      service._fifo.read_count = jnp.uint32(record["read_count"])
    counts = RateCounts(int(record["inserts"]), int(record["samples"]))
    if service._fifo is not None:
      # Under Queue the cursor says what is unread (a checkpoint of another
      # limiter has none: every item held counts as read, as when a Queue
      # service starts); the counts are made to agree with it.
      unread = int(np.uint32(state.add_count) - np.uint32(service._fifo.read_count))
      counts = RateCounts(counts.inserts, counts.inserts - unread)
    service._counts = service.rate_limiter.restored(counts)
    service._global_inserts = service._counts.inserts  # lockstep: what every process agreed
    return service

  def close(self, cause: BaseException | None = None) -> None:
    """Closes the service: every blocked call and every later call raises
    `ServiceClosed` (from `cause`, when given). Idempotent; adds already
    taken are still written."""
    with self._counts_lock:
      if not self.closed:
        self.closed, self._cause = True, cause
      self._insertable.notify_all()
      self._sampleable.notify_all()

  def __enter__(self) -> "ReplayService":
    return self

  def __exit__(self, kind, error, traceback) -> None:
    """Closes the service; an exception leaving the block is the cause the
    blocked actors and learners see."""
    self.close(cause=error)

  def _raise_if_closed(self, what: str) -> None:
    if self.closed:
      raise ServiceClosed(f"{what}: the replay service is closed.") from self._cause

  def _wait(
    self,
    condition: threading.Condition,
    allowed: Callable[[], bool],
    timeout,
    why: str = "",
    waiting: tuple[str, int] | None = None,
  ) -> None:
    """Waits on `condition` (its lock held) until `allowed()` or closed;
    `waiting`: the limiter's side and size, for `_deadlock` (else a wait
    that an add may end)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    token = object()
    if waiting is None:
      self._other_waits += 1
    else:
      self._waiting[token] = waiting
    try:
      while not (self.closed or allowed()):
        message = self._deadlocked.pop(token, None) or self._deadlock(token)
        if message is not None:
          raise ValueError(message)
        left = _left(deadline)
        if left == 0:
          raise TimeoutError(
            why
            or f"the rate limiter did not allow it within {timeout} s: {self.rate_limiter!r}, "
            f"counts {self._counts} ({self._adding} units and {self._sampling} rows under way)."
          )
        condition.wait(left)
    finally:
      if waiting is None:
        self._other_waits -= 1
      self._waiting.pop(token, None)
      self._deadlocked.pop(token, None)
    if self.closed:
      raise ServiceClosed("the replay service was closed while waiting.") from self._cause
