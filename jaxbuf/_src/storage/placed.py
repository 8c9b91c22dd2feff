"""A buffer with its payload on a tier: the kind's own functions over row
proxies (`proxies`), and the payload rows moved to and from the tier.

Shape key: S sample size, F storage rows, n rows given to one add.

* Host tier (`storage="host"`): the state is a `HostTierState`, the kind's
  state (with proxies) and the payload leaves, shaped as the kind's storage
  leaves (`[C, *row]`, `[N, R, *row]`), in the `pinned_host` memory kind;
  `state.storage` is the kind's storage with those host arrays in place of
  the proxies. Everything is pure and runs inside jit: an add scatters its
  n rows into host memory and a sample gathers its rows there
  (`jax.experimental.compute_on.compute_on("device_host")`), then moves them
  to the device (`jax.device_put(..., jax.memory.Space.Device)`). On the CPU
  backend (JAX 0.10) both work; the GPU is measured by the device suite.
* Disk tier (`jaxbuf.disk(directory)`): `disk_tier`.

`jaxbuf.sharded` splits a disk-tier buffer (`split_tier`: each device's
rows in files of their own) and refuses a host-tier one. A disk-tier state saves and loads with
`jaxbuf.save` / `load` like any state: it is small (counters, priorities,
proxies); the files stay where they are (`Disk.sync`).
"""

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, BufferState
from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.storage import disk_tier
from jaxbuf._src.storage import payload as payloads
from jaxbuf._src.storage import proxies
from jaxbuf._src.storage import tiers
from jaxbuf._src.storage.payload import Tiered


@flax.struct.dataclass
class HostTierState(BufferState):
  """A host-tier buffer: its kind's state on the device, payload in host memory.

  `state.storage` is the kind's storage as the device tier holds it, with
  each payload leaf the array in pinned host memory (`state.payload`): the
  data, never the row proxies. Counters, item ids, priorities and sum trees
  stay on the device, in `state.core`, and read through: `state.size`.
  `state.core.storage` holds the proxies (int32 row numbers, not data).
  """

  core: BufferState  # the kind's state; payload leaves are proxies (`proxies`)
  payload: dict  # path -> [*lead, *row] as the kind's storage leaf, memory kind pinned_host

  @property
  def storage(self) -> Any:
    """The kind's storage, payload leaves in pinned host memory."""
    core: Any = self.core  # every tiered kind's state has storage
    return tiers.map_payload(
      core.storage, tuple(self.payload), lambda path, proxy: self.payload[path]
    )

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in ("core", "payload"):
      raise AttributeError(name)
    return getattr(self.core, name)

  def buffer_dims(self) -> dict[str, Any]:
    return self.core.buffer_dims()


def _lead_index(rows: jax.Array, lead_shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """Flat rows `[n]` as indices along the storage's leading axes (a row F,
  padding, lands out of range on the first axis)."""
  index = []
  for size in reversed(lead_shape[1:]):
    index.append(rows % size)
    rows = rows // size
  return (rows, *reversed(index))


def _host_space_gather(
  column: jax.Array, rows_plus_one: jax.Array, lead_shape: tuple[int, ...]
) -> jax.Array:
  """Rows of a pinned-host column `[*lead, *row]` at `rows_plus_one - 1`
  (0: zeros), on the device."""
  flat = rows_plus_one.reshape(-1)
  at = jax.device_put(_lead_index(jnp.maximum(flat - 1, 0), lead_shape), jax.memory.Space.Host)
  with compute_on("device_host"):
    read = column.at[at].get(mode="promise_in_bounds")
  read = jax.device_put(read, jax.memory.Space.Device)
  shown = (flat > 0).reshape((-1,) + (1,) * (read.ndim - 1))
  read = jnp.where(shown, read, jnp.zeros((), read.dtype))
  return read.reshape(rows_plus_one.shape + read.shape[1:])


def _host_space_scatter(
  column: jax.Array, written: jax.Array, values: jax.Array, lead_shape: tuple[int, ...]
) -> jax.Array:
  at = jax.device_put(_lead_index(written, lead_shape), jax.memory.Space.Host)
  values = jax.device_put(values, jax.memory.Space.Host)
  with compute_on("device_host"):
    return column.at[at].set(values, mode="drop", unique_indices=True)


def _in_host_space(state: HostTierState, what: str) -> HostTierState:
  """`state` (refused, naming both types, if it is not a host tier's) with
  every payload column typed as host memory. A column
  restored by `jaxbuf.load` has a `pinned_host` sharding but a device-space
  type (JAX 0.10.2), which host-space gathers refuse; `device_put` to the host
  space retypes it (once, after the load; a column typed as host passes as it is)."""
  validation.check_state_kind(state, HostTierState, what=what, exact=True, stacked=True)
  payload = {
    path: (
      column
      if column.aval.memory_space == jax.memory.Space.Host
      else jax.device_put(column, jax.memory.Space.Host)
    )
    for path, column in state.payload.items()
  }
  return state.replace(payload=payload)


def host_buffer(buffer: Buffer, tier: tiers.Host, layout: tiers.Layout) -> Buffer:
  """`buffer` with its payload leaves in pinned host memory."""
  found: dict[str, payloads.Payload] = {}

  def payload_of() -> payloads.Payload:
    if "payload" not in found:
      raise ValueError("storage='host': call buffer.init(example) first.")
    return found["payload"]

  def init(example: PyTree) -> HostTierState:
    payload, core = payloads.initialized(buffer, example, tier, layout, laps=False)
    found["payload"] = payload
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    # np.zeros maps untouched pages (the kernel's zero page when read), so
    # the copy to host memory does not hold the payload twice.
    columns = {
      path: jax.device_put(np.zeros(payload.lead_shape + shape, dtype), host)
      for path, (shape, dtype) in payload.rows_spec.items()
    }
    return HostTierState(core=core, payload=columns, settings=core.settings)

  init.payload_rows = lambda: payload_of().rows_spec  # type: ignore[attr-defined]
  init.tiered = Tiered(buffer, tier, layout)  # type: ignore[attr-defined]

  def add(state: HostTierState, items: PyTree, *args: Any, **kwargs: Any) -> HostTierState:
    payload = payload_of()
    items, args, kwargs, given, count = payload.tokenized_add_arguments(items, args, kwargs)
    core = buffer.add(state.core, items, *args, **kwargs)
    written, held, values = payload.written(state.core, core, count)
    core = payload.settled(core, written, values)
    columns = {
      path: _host_space_scatter(
        state.payload[path],
        written,
        jnp.concatenate(given[path]).at[held].get(mode="clip"),
        payload.lead_shape,
      )
      for path in payload.paths
    }
    return state.replace(core=core, payload=columns)

  def with_payload(state: HostTierState, drawn: Any) -> Any:
    """`drawn` (the core's sample) with its proxies replaced by payload rows."""
    payload = payload_of()
    items = payload.views(
      drawn.items,
      lambda path, rows, axes: proxies.placed(
        _host_space_gather(state.payload[path], rows, payload.lead_shape), axes
      ),
    )
    return drawn.replace(items=items)

  def sample(state: HostTierState, key: jax.Array, batch_size: int, **kwargs: Any) -> Any:
    return with_payload(state, buffer.sample(state.core, key, batch_size, **kwargs))

  def take(state: HostTierState, key: jax.Array, batch_size: int, **kwargs: Any) -> Any:
    core, drawn = buffer.take(state.core, key, batch_size, **kwargs)
    return state.replace(core=core), with_payload(state, drawn)

  def on_core(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapped(state: HostTierState, *args: Any, **kwargs: Any) -> Any:
      validation.check_state_kind(
        state, HostTierState, what=function.__name__, exact=True, stacked=True
      )
      result = function(state.core, *args, **kwargs)
      return state.replace(core=result) if isinstance(result, BufferState) else result

    return wrapped

  jitted_add = jax.jit(add, donate_argnums=0)
  jitted_sample = jax.jit(sample, static_argnums=2)
  jitted_take = jax.jit(take, static_argnums=2, donate_argnums=0)

  @functools.wraps(add)
  def add_in_host_space(state: HostTierState, *args: Any, **kwargs: Any) -> HostTierState:
    return jitted_add(_in_host_space(state, "add"), *args, **kwargs)

  @functools.wraps(sample)
  def sample_in_host_space(state: HostTierState, *args: Any, **kwargs: Any) -> Any:
    return jitted_sample(_in_host_space(state, "sample"), *args, **kwargs)

  @functools.wraps(take)
  def take_in_host_space(state: HostTierState, *args: Any, **kwargs: Any) -> Any:
    return jitted_take(_in_host_space(state, "take"), *args, **kwargs)

  return Buffer(
    init=init,
    add=add_in_host_space,
    sample=sample_in_host_space,
    update_priorities=on_core(buffer.update_priorities),
    can_sample=on_core(buffer.can_sample),
    clear=on_core(buffer.clear),
    kind=payloads.unsplit(buffer, "'host'"),
    take=take_in_host_space,
  )


def tiered_parts(buffer: Buffer) -> Tiered | None:
  """The parts of a buffer made with `storage=` other than the device; None
  for any other buffer."""
  return getattr(buffer.init, "tiered", None)


def split_tier(sharded_core: Buffer, parts: Tiered, num_devices: int) -> Buffer:
  """A `jaxbuf.sharded` buffer of a tiered kind: the sharded kind's own
  functions over the proxies (one more leading axis, the devices'), and each
  device's rows in files of their own. The host tier is refused."""
  if not isinstance(parts.tier, tiers.Disk):
    raise TypeError(
      "sharded: a buffer with storage='host' cannot be split over devices "
      "yet; storage=jaxbuf.disk(directory) can (each device's rows in files "
      "of their own), and so can storage='device'."
    )
  layout = dataclasses.replace(parts.layout, lead_dims=parts.layout.lead_dims + 1)
  return disk_tier.disk_buffer(sharded_core, parts.tier, layout, blocks=num_devices)


def stored_spec(buffer: Buffer, spec: PyTree) -> PyTree:
  """One item's (or step's) shapes and dtypes as stored: `spec`, read from a
  state's storage, with each payload proxy replaced by the payload row's
  shape and dtype (a buffer without tiers: `spec` as it is)."""
  payload_rows = getattr(buffer.init, "payload_rows", None)
  if payload_rows is None:
    return spec
  rows = payload_rows()
  return tiers.map_payload(spec, tuple(rows), lambda path, _: jax.ShapeDtypeStruct(*rows[path]))


def place(buffer: Buffer, storage: Any, *, kind_name: str, layout: tiers.Layout) -> Buffer:
  """`buffer` on the tier `storage=` names (`tiers.resolve`); the device
  tier returns it as it is."""
  tier = tiers.resolve(storage, kind_name)
  if tier is None:
    return buffer
  if isinstance(tier, tiers.Disk):
    return disk_tier.disk_buffer(buffer, tier, layout)
  return host_buffer(buffer, tier, layout)
