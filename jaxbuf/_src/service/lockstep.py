"""Lockstep adds: a `ReplayService` over a `jaxbuf.sharded` item buffer in a
multi-process program (`jax.distributed`), each process's actors writing
to its own devices' shards, the learners sampling globally.

Every process must make the same device calls in the same order, and each
host's actors add at their own pace. So no add goes to the device when an
actor makes it: each process keeps its accepted adds pending, and at each
`learn` / `sample` (which every process calls, in the same order) the
service runs rounds. A round is one jitted call that every process makes:
each process drains the pending adds that fit into a fixed-shape block of
`rows` rows (`rows / L` per local device, L its devices on the axis) with
a count per device; each device adds the first `count` rows of its block
to its own shard (a `lax.cond` per bit of the count over static-size
slices: pure, no host branching on traced values), and a `psum` over the
mesh gives every process the same total added and the same stop flags
(a process timed out or closed). The processes thus agree on the global
insert count, so the rate limiter decides the same everywhere; rounds go
on until it allows the sample, or a flag stops every process at the same
round. No host networking of jaxbuf's own: the psum rides on the mesh.

Host code (the service calls it under its state lock), over the sharded
kind's own per-device add (`buffer.add.split_settings`).

Shape key: D devices on the axis, L this process's, r = rows / L.
"""

from typing import Any, Callable

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.service import coalescing
from jaxbuf._src.service.closed import ServiceClosed
from jaxbuf._src.service.limiters import RateCounts


def _refuse(reason: str) -> ValueError:
  return ValueError(
    "ReplayService: lockstep_rows= serves a jaxbuf.sharded uniform_replay or "
    "prioritized_replay buffer (its mesh's axis holding every device) under MinSize or "
    f"SampleToInsertRatio; {reason}"
  )


class Lockstep:
  """The per-round block, its device call and the agreed totals."""

  def __init__(self, buffer: Any, state: Any, rate_limiter: Any, rows: Any):
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
      raise ValueError(f"ReplayService: lockstep_rows must be an int >= 1; given {rows!r}.")
    settings = getattr(getattr(buffer, "add", None), "split_settings", None)
    if settings is None:
      raise _refuse("this buffer is not a jaxbuf.sharded buffer.")
    if not isinstance(state, ReplayState):
      raise _refuse(f"this buffer's state is a {type(state).__name__} (stream kinds: not yet).")
    if rate_limiter.fifo:
      raise _refuse("a Queue reads in FIFO order, which a lockstep round cannot keep.")
    kind, mesh, axis = settings["kind"], settings["mesh"], settings["axis"]
    if mesh.devices.size != mesh.shape[axis]:
      raise _refuse(f"this mesh has axes {dict(mesh.shape)} besides {axis!r}.")
    process = jax.process_index()
    local = sum(device.process_index == process for device in mesh.devices.flat)
    if rows % local:
      raise ValueError(
        f"ReplayService: lockstep_rows must divide by this process's {local} devices on the "
        f"mesh; given {rows}."
      )
    self.rows = rows
    self._local = local
    self._per_device = rows // local
    self._rows_sharding = NamedSharding(mesh, PartitionSpec(axis))
    # [D, C / D, ...] per leaf: an item's shape and dtype.
    self._padding = jax.tree.map(
      lambda leaf: np.zeros((local, self._per_device, *leaf.shape[2:]), leaf.dtype),
      state.storage,
    )
    self._round = _round_function(kind, mesh, axis, self._per_device)

  def check(self, items: Any) -> None:
    """Refuses items `[B, ...]` that are not rows of the stored items."""
    given = jax.tree.structure(items)
    if str(given) != str(jax.tree.structure(self._padding)):
      raise TypeError(
        f"Writer.add: items must have the stored structure {jax.tree.structure(self._padding)}"
        f"; given {given}."
      )
    for path, pad, leaf in zip(
      jax.tree_util.tree_flatten_with_path(self._padding)[0],
      jax.tree.leaves(self._padding),
      jax.tree.leaves(items),
    ):
      name = jax.tree_util.keystr(path[0])
      want = (pad.shape[2:], pad.dtype)
      got = (np.shape(leaf)[1:], np.result_type(leaf))
      if np.ndim(leaf) < 1 or got != want:
        raise ValueError(
          f"Writer.add: leaf {name} must be [B, *{want[0]}] {want[1]}; given "
          f"{np.shape(leaf)} {got[1]}."
        )

  def taking(self, pending: list[coalescing.PendingAdd]) -> list[coalescing.PendingAdd]:
    """The oldest pending adds that fit in one block, in order."""
    taken, room = [], self.rows
    for entry in pending:
      if entry.units > room:
        break
      taken.append(entry)
      room -= entry.units
    return taken

  def round(
    self,
    state: Any,
    taken: list[coalescing.PendingAdd],
    timed_out: bool,
    closed: bool,
    more: bool = False,
  ) -> tuple[Any, int, bool, bool, bool]:
    """One lockstep round (every process calls it together): the state with
    every process's block added, the rows added over all processes, and
    whether any process timed out, is closed, or has `more` to flush."""
    counts = np.zeros(self._local, np.int32)
    block = self._padding
    if taken:
      items, _ = coalescing.merged_items(taken)
      n = coalescing.rows_of(items)
      counts[:] = n // self._local
      counts[: n % self._local] += 1
      # Device d's rows go first in its block of r; the rest is padding.
      slots = np.concatenate(
        [d * self._per_device + np.arange(count) for d, count in enumerate(counts)]
      )

      def placed(pad, leaf):
        out = pad.reshape(-1, *pad.shape[2:]).copy()
        out[slots] = np.asarray(leaf)
        return out.reshape(pad.shape)

      block = jax.tree.map(placed, self._padding, items)
    flags = np.tile(
      np.array([[int(timed_out), int(closed), int(more)]], np.int32), (self._local, 1)
    )
    arrays = jax.tree.map(
      lambda leaf: jax.make_array_from_process_local_data(self._rows_sharding, leaf),
      (block, counts, flags),
    )
    state, totals = self._round(state, *arrays)
    added, any_timed_out, any_closed, any_more = (
      int(x) for x in np.asarray(totals.addressable_data(0))
    )
    return state, added, any_timed_out > 0, any_closed > 0, any_more > 0


def _round_function(kind: Any, mesh: jax.sharding.Mesh, axis: str, per_device: int) -> Callable:
  """`(state, block [D, r, ...], counts [D], flags [D, 3]) -> (state,
  int32 [4]: rows added, timed-out, closed and more-to-flush flags, summed
  over devices)`,
  jitted, the state donated."""
  spec = PartitionSpec(axis)
  bits = [1 << j for j in reversed(range(per_device.bit_length()))]

  def per_device_round(stacked, block, count, flags):
    local = jax.tree.map(lambda x: x[0], stacked)
    block = jax.tree.map(lambda x: x[0], block)
    n = count[0]
    offset = jnp.int32(0)
    for size in bits:  # n's bits, largest first: the first n rows, in order
      take = (n // size) % 2 == 1

      def add(local, start=offset, size=size):
        chunk = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), block)
        return kind.add(local, *kind.add_arguments(chunk))

      local = jax.lax.cond(take, add, lambda local: local, local)
      offset = offset + jnp.where(take, size, 0).astype(jnp.int32)
    totals = jax.lax.psum(jnp.concatenate([count, flags[0]]), axis)
    return jax.tree.map(lambda x: x[None], local), totals

  mapped = jax.shard_map(
    per_device_round,
    mesh=mesh,
    in_specs=(spec, spec, spec, spec),
    out_specs=(spec, PartitionSpec()),
  )
  return jax.jit(mapped, donate_argnums=0)


def _agree(service: Any, taken: list[coalescing.PendingAdd], added: int) -> RateCounts:
  """The counts after a round that added `added` rows over every process,
  `taken` this process's. Holds both of the service's locks."""
  self = service  # pylint: disable=protected-access  (the package's ReplayService)
  self.device_adds += 1
  self._global_inserts += added
  # The agreed inserts are in the state; this process's taken adds are no
  # longer under way (those still pending are).
  self._adding -= sum(entry.units for entry in taken)
  self._counts = self._counts._replace(inserts=self._counts.inserts + added)
  self._insertable.notify_all()
  return RateCounts(self._global_inserts, self._counts.samples)


def flush(service: Any) -> None:
  """Rounds until every process's adds pending when it was called are in
  the state (a checkpoint's cut; every process calls it in the same order,
  as `sampled`): each round's psum says whether any process has more of
  them, so every process runs the same rounds. Holds the state lock."""
  self = service  # pylint: disable=protected-access  (the package's ReplayService)
  with self._counts_lock:
    left = list(self._pending)  # the adds to flush; later ones wait for a round
  more = True
  while more:
    with self._counts_lock:
      taken = self._lockstep.taking(left)
      left = left[len(taken) :]
      for entry in taken:
        self._pending.remove(entry)
    self._state, added, _, _, more = self._lockstep.round(
      self._state, taken, False, False, more=bool(left)
    )
    with self._counts_lock:
      _agree(self, taken, added)


def sampled(service: Any, what: str, batch_size: int, timeout, call: Callable) -> Any:
  """`ReplayService._sampled` in lockstep, under the service's locks:
  rounds until the limiter allows the sample over the agreed counts, or a
  process timed out or closed (module notes); every process takes the same
  branch at the same round."""
  self = service  # pylint: disable=protected-access  (the package's ReplayService)
  deadline = None if timeout is None else time.monotonic() + timeout
  with self._state_lock:
    while True:
      with self._counts_lock:
        self._check_sizes(sample=batch_size)
        taken = self._lockstep.taking(self._pending)
        del self._pending[: len(taken)]
        closed = self.closed
      timed_out = deadline is not None and time.monotonic() >= deadline
      self._state, added, any_timed_out, any_closed, _ = self._lockstep.round(
        self._state, taken, timed_out, closed
      )
      with self._counts_lock:
        agreed = _agree(self, taken, added)
        if any_closed:
          self.closed = True
          self._insertable.notify_all()
          self._sampleable.notify_all()
          raise ServiceClosed(f"{what}: the replay service is closed (in some process).")
        if self.rate_limiter.can_sample(agreed, batch_size):
          self._counts = self._counts._replace(samples=self._counts.samples + batch_size)
          self._insertable.notify_all()
          break
        if any_timed_out:
          raise TimeoutError(
            f"{what}: the rate limiter did not allow it within {timeout} s (in some "
            f"process): {self.rate_limiter!r}, agreed counts {agreed}."
          )
        self._insertable.notify_all()
        if not self._pending:  # a moment for this process's actors
          self._sampleable.wait(1e-3)
    try:
      state, result = call(self._state)
      self._state = state
      return result
    except BaseException:
      with self._counts_lock:
        self._counts = self._counts._replace(samples=self._counts.samples - batch_size)
      raise
