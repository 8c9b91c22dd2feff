"""A buffer with its payload on a tier: the kind's own functions over row
proxies (`proxies`), and the payload rows moved to and from the tier.

Shape key: S sample size, F storage rows, n rows given to one add.

* Host tier (`storage="host"`): the state is a `HostTierState`, the kind's
  state (with proxies) and the payload leaves `[F, *row]` in the
  `pinned_host` memory kind. Everything is pure and runs inside jit: an add
  scatters its n rows into host memory and a sample gathers its rows there
  (`jax.experimental.compute_on.compute_on("device_host")`), then moves them
  to the device (`jax.device_put(..., jax.memory.Space.Device)`). On the CPU
  backend (JAX 0.10) both work; the GPU is measured by the device suite.
* Disk tier (`jaxbuf.disk(directory)`): the state is the kind's own state,
  with proxies for the payload leaves; the files (`disk.PayloadFiles`) are
  held by the `Disk` spec the buffer was made with. `add` and `sample` are
  host functions: the device part (the kind's function) is jitted, then the
  rows are written or read. Inside jit, vmap or scan they raise a TypeError
  saying so; `update_priorities`, `can_sample` and `clear` touch no payload
  and run anywhere.

`jaxbuf.sharded` splits a disk-tier buffer (`split_tier`: each device's
rows in files of their own) and refuses a host-tier one. A disk-tier state saves and loads with
`jaxbuf.save` / `load` like any state: it is small (counters, priorities,
proxies); the files stay where they are (`Disk.sync`).
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, BufferState
from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.storage import disk as disk_files
from jaxbuf._src.storage import proxies
from jaxbuf._src.storage import tiers


@flax.struct.dataclass
class HostTierState(BufferState):
  """A host-tier buffer: its kind's state on the device, payload in host memory.

  Fields of the kind's state (`size`, ...) read through: `state.size`.
  """

  core: BufferState  # the kind's state; payload leaves are proxies (`proxies`)
  payload: dict  # path -> [F, *row], the leaf's dtype, memory kind pinned_host

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in ("core", "payload"):
      raise AttributeError(name)
    return getattr(self.core, name)

  def buffer_dims(self) -> dict[str, Any]:
    return self.core.buffer_dims()


class _Payload:
  """What init learns from the example: the payload leaves and their rows."""

  def __init__(self, example: PyTree, tier: tiers.Host | tiers.Disk, layout: tiers.Layout):
    self.paths = tiers.payload_paths(example, tier, layout)
    self.rows_spec = {
      path: (tuple(np.shape(leaf)), np.dtype(leaf.dtype))
      for path, leaf in tiers.payload_leaves(example, self.paths).items()
    }
    self.layout = layout
    self.rows = 0  # F, set from the kind's state

  def rank(self, path: str) -> int:
    return len(self.rows_spec[path][0])

  def tokenized(self, items: PyTree, start: int) -> tuple[PyTree, dict[str, Any], int]:
    """Items with payload leaves as tokens from `start`; the payload rows
    `[n, *row]` by path; n."""
    values, count = {}, 0

    def token(path: str, leaf: Any) -> jax.Array:
      nonlocal count
      tokens, batch_shape = proxies.tokens_for(leaf, self.rank(path), start)
      count = int(np.prod(batch_shape, dtype=np.int64))
      values[path] = leaf.reshape((count,) + self.rows_spec[path][0])
      return tokens

    return tiers.map_payload(items, self.paths, token), values, count

  def tokenized_add_arguments(
    self, items: PyTree, args: tuple, kwargs: dict
  ) -> tuple[PyTree, tuple, dict, dict[str, list], int]:
    """`add`'s arguments with tokens for the payload of `items` and of
    `final_steps` (streams), numbered after F; the rows given, by path."""
    first = self.rows + 1
    items, values, count = self.tokenized(items, first)
    given = {path: [value] for path, value in values.items()}
    arguments: list[Any] = list(args)
    kwargs = dict(kwargs)
    if len(arguments) >= 3 or kwargs.get("final_steps") is not None:
      final = arguments[2] if len(arguments) >= 3 else kwargs["final_steps"]
      final, final_values, final_count = self.tokenized(final, first + count)
      for path, value in final_values.items():
        given[path].append(value)
      count += final_count
      if len(arguments) >= 3:
        arguments[2] = final
      else:
        kwargs["final_steps"] = final
    return items, tuple(arguments), kwargs, given, count

  def proxy_leaves(self, core: Any) -> dict[str, jax.Array]:
    return tiers.payload_leaves(core.storage, self.paths)

  def settled(self, core: Any, given: int) -> tuple[Any, jax.Array, jax.Array]:
    """The kind's state (every tiered kind has `storage`) after an add with
    every proxy back at `row + 1`; the
    rows written `[n]` (F: none) and the given row each holds."""
    if not self.paths:
      return core, jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)
    first = self.proxy_leaves(core)[self.paths[0]]
    written, held = proxies.written_rows(first, rows=self.rows, given=given)
    storage = tiers.map_payload(
      core.storage, self.paths, lambda path, proxy: proxies.settle(proxy, written)
    )
    return core.replace(storage=storage), written, held

  def replaced(self, items: Any, read: Callable[[str, Any, tuple[int, ...]], Any]) -> Any:
    """Sample items with each payload proxy `P` replaced by `read(path, rows
    + 1 or 0 [outer], row axes of P)`."""
    new_views = []
    for prefixes, view in self.layout.views(items):

      def swap(key_path: Any, leaf: Any, prefixes: tuple[str, ...] = prefixes) -> Any:
        relative = jax.tree_util.keystr(key_path)
        path = next(
          (prefix + relative for prefix in prefixes if prefix + relative in self.paths), None
        )
        if path is None:
          return leaf
        stack_axis = self.layout.stack_axis if self.layout.stacked(relative) else None
        axes = proxies.row_axes(leaf, self.rank(path), stack_axis)
        return read(path, proxies.rows_of(leaf, axes), axes)

      new_views.append(jax.tree_util.tree_map_with_path(swap, view))
    return self.layout.rebuild(items, new_views)


def _initialized(
  buffer: Buffer, example: PyTree, tier: tiers.Host | tiers.Disk, layout: tiers.Layout
) -> tuple[_Payload, Any]:
  """The payload `example` has on `tier`, and the kind's empty state with
  its payload leaves as proxies."""
  payload = _Payload(example, tier, layout)
  core = buffer.init(proxies.proxy_example(example, payload.paths))
  leaves = payload.proxy_leaves(core)
  payload.rows = proxies.num_rows(leaves[payload.paths[0]], layout.lead_dims) if leaves else 0
  return payload, core


def _host_space_gather(column: jax.Array, rows_plus_one: jax.Array) -> jax.Array:
  """Rows of a pinned-host column at `rows_plus_one - 1` (0: zeros), on the device."""
  flat = rows_plus_one.reshape(-1)
  at = jax.device_put(jnp.maximum(flat - 1, 0), jax.memory.Space.Host)
  with compute_on("device_host"):
    read = column.at[at].get(mode="promise_in_bounds")
  read = jax.device_put(read, jax.memory.Space.Device)
  shown = (flat > 0).reshape((-1,) + (1,) * (read.ndim - 1))
  read = jnp.where(shown, read, jnp.zeros((), read.dtype))
  return read.reshape(rows_plus_one.shape + column.shape[1:])


def _host_space_scatter(column: jax.Array, written: jax.Array, values: jax.Array) -> jax.Array:
  at = jax.device_put(written, jax.memory.Space.Host)
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
  found: dict[str, _Payload] = {}

  def payload_of() -> _Payload:
    if "payload" not in found:
      raise ValueError("storage='host': call buffer.init(example) first.")
    return found["payload"]

  def init(example: PyTree) -> HostTierState:
    payload, core = _initialized(buffer, example, tier, layout)
    found["payload"] = payload
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    # np.zeros maps untouched pages (the kernel's zero page when read), so
    # the copy to host memory does not hold the payload twice.
    columns = {
      path: jax.device_put(np.zeros((payload.rows,) + shape, dtype), host)
      for path, (shape, dtype) in payload.rows_spec.items()
    }
    return HostTierState(core=core, payload=columns, settings=core.settings)

  init.payload_rows = lambda: payload_of().rows_spec  # type: ignore[attr-defined]
  init.tiered = Tiered(buffer, tier, layout)  # type: ignore[attr-defined]

  def add(state: HostTierState, items: PyTree, *args: Any, **kwargs: Any) -> HostTierState:
    payload = payload_of()
    items, args, kwargs, given, count = payload.tokenized_add_arguments(items, args, kwargs)
    core = buffer.add(state.core, items, *args, **kwargs)
    core, written, held = payload.settled(core, count)
    columns = {
      path: _host_space_scatter(
        state.payload[path], written, jnp.concatenate(given[path]).at[held].get(mode="clip")
      )
      for path in payload.paths
    }
    return state.replace(core=core, payload=columns)

  def with_payload(state: HostTierState, drawn: Any) -> Any:
    """`drawn` (the core's sample) with its proxies replaced by payload rows."""
    items = payload_of().replaced(
      drawn.items,
      lambda path, rows, axes: proxies.placed(_host_space_gather(state.payload[path], rows), axes),
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
    kind=_unsplit(buffer, "'host'"),
    take=take_in_host_space,
  )


def _unsplit(buffer: Buffer, tier_name: str) -> Any:
  kind = buffer.kind
  if kind is None:
    return None
  return kind._replace(name=f"{kind.name} with storage={tier_name}", split=None)


def _refuse_traced(what: str, *trees: Any) -> None:
  if any(isinstance(leaf, jax.core.Tracer) for tree in trees for leaf in jax.tree.leaves(tree)):
    raise TypeError(
      f"{what}: a buffer with storage=jaxbuf.disk(...) reads and writes its "
      f"payload files on the host, so its {what} runs outside jax.jit, vmap "
      f"and scan; call it from Python between jitted steps (a "
      f"jaxbuf.Prefetcher overlaps the reads with the step), or use "
      f"storage='host' or 'device', whose functions run inside jit."
    )


def disk_buffer(
  buffer: Buffer, tier: tiers.Disk, layout: tiers.Layout, *, blocks: int | None = None
) -> Buffer:
  """`buffer` with its payload leaves in files (`disk`); with `blocks` = D,
  `buffer` is a `jaxbuf.sharded` one and each device's rows go to files of
  their own (`disk.BlockedPayloadFiles`)."""
  found: dict[str, _Payload] = {}

  def payload_of() -> _Payload:
    if "payload" not in found or tier.files is None:
      raise ValueError(
        f"storage=jaxbuf.disk({tier.directory!r}): call buffer.init(example) "
        f"first (it opens the payload files); they are closed."
      )
    return found["payload"]

  def init(example: PyTree) -> BufferState:
    _refuse_traced("init", example)
    payload, core = _initialized(buffer, example, tier, layout)
    tier.close()
    if blocks is None:
      tier.files = disk_files.PayloadFiles(tier.directory, payload.rows_spec, payload.rows)
    else:
      tier.files = disk_files.BlockedPayloadFiles(
        tier.directory, payload.rows_spec, payload.rows, blocks
      )
    found["payload"] = payload
    return core

  init.payload_rows = lambda: payload_of().rows_spec  # type: ignore[attr-defined]
  init.tiered = Tiered(buffer, tier, layout)  # type: ignore[attr-defined]

  @functools.partial(jax.jit, static_argnames=("count",))
  def device_add(core: BufferState, items: PyTree, args: tuple, kwargs: dict, count: int) -> Any:
    return payload_of().settled(buffer.add(core, items, *args, **kwargs), count)

  def add(state: BufferState, items: PyTree, *args: Any, **kwargs: Any) -> BufferState:
    _refuse_traced("add", state, items, args, kwargs)
    payload = payload_of()
    items, args, kwargs, given, count = payload.tokenized_add_arguments(items, args, kwargs)
    core, written, held = device_add(state, items, args, kwargs, count=count)
    written, held = np.asarray(written), np.asarray(held)
    kept = written < payload.rows
    if payload.paths and kept.any():
      held = held[kept]
      identity = len(held) == count and np.array_equal(held, np.arange(count))
      values = {}
      for path in payload.paths:
        parts = [np.asarray(part) for part in given[path]]
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        values[path] = rows if identity else rows[held]
      assert tier.files is not None
      tier.files.write_rows(written[kept], values)
    return core

  def with_payload(drawn: Any) -> Any:
    """`drawn` (the core's sample) with its proxies replaced by rows read
    from the payload files."""
    payload = payload_of()
    files = tier.files
    assert files is not None

    def read(path: str, rows_plus_one: Any, axes: tuple[int, ...]) -> jax.Array:
      rows = np.asarray(rows_plus_one).astype(np.int64) - 1
      values = files.read_rows(path, rows.reshape(-1))
      values = values.reshape(rows.shape + values.shape[1:])
      return jnp.asarray(proxies.placed(values, axes, xp=np))

    return drawn.replace(items=payload.replaced(drawn.items, read))

  def sample(state: BufferState, key: jax.Array, batch_size: int, **kwargs: Any) -> Any:
    _refuse_traced("sample", state, key, kwargs)
    return with_payload(buffer.sample(state, key, batch_size, **kwargs))

  def take(state: BufferState, key: jax.Array, batch_size: int, **kwargs: Any) -> Any:
    _refuse_traced("take", state, key, kwargs)
    core, drawn = buffer.take(state, key, batch_size, **kwargs)
    return core, with_payload(drawn)

  return Buffer(
    init=init,
    add=add,
    sample=sample,
    update_priorities=buffer.update_priorities,
    can_sample=buffer.can_sample,
    clear=buffer.clear,
    kind=_unsplit(buffer, f"jaxbuf.disk({tier.directory!r})"),
    take=take,
  )


class Tiered(NamedTuple):
  """What a tiered buffer wraps: the kind's own buffer, the tier, the layout."""

  core: Buffer
  tier: Any
  layout: tiers.Layout


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
  return disk_buffer(sharded_core, parts.tier, layout, blocks=num_devices)


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
    return disk_buffer(buffer, tier, layout)
  return host_buffer(buffer, tier, layout)
