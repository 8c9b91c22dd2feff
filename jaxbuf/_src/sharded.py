"""One replay buffer split over the devices of a mesh axis, sampled exactly.

Shape key: B add batch, S sample size, C capacity (global), D devices on the
mesh axis, L = C / D slots per device.

Layout. A sharded state is the stack of the D devices' local states: every
leaf of the wrapped buffer's state gets a leading axis of length D, split
over the mesh axis (`NamedSharding(mesh, P(axis))`), so device d holds
`jax.tree.map(lambda x: x[d], state)`, an ordinary state of the wrapped kind
with capacity L and its own ring counters and sum tree. Global slot `g` is
local slot `g % L` of device `g // L`. Being a stack of local states, the
state saves, loads and can be inspected like any vmapped state.

Adds are local: items `[B, ...]` split over the axis in contiguous blocks of
B / D rows, and device d writes its block into its own part, with no
cross-device traffic. Each device therefore holds every D-th block of the
stream; with equal blocks the fills stay equal, but sampling does not rely
on it.

Global sampling is exact. Every device gathers the D local totals
(prioritized) or sizes (uniform), draws the same targets over the global
total from the replicated key, and descends its own tree (or picks its own
slot) for the targets it owns; rows are combined with a masked sum, exact
because each row has exactly one non-zero contributor (rows travel bit-cast
to unsigned integers, so -0.0 and NaN payloads survive). A replicated batch
is an all-reduce of the `[S, ...]` rows (about 2x the batch's bytes through
each device); a batch sharded over the axis is a reduce-scatter (about the
batch's bytes, (D - 1) / D of them). A target picks its device by the
float32 prefix sums of the D totals and keeps its offset within the owner,
so the device choice is one more level in the first stretch of the tree's
descent before a redraw (`sum_tree.LEVELS_PER_TARGET`), with the float32
rounding of the global total that the unsharded tree's root has too.

Local sampling (the per-device buffers of Stoix and Brax) draws S / D items
from each device's own part with no communication; each item's probability
is then its share of its own device's total, times 1 / D, which equals the
global one only when the devices' totals are equal, and the importance
weights are normalised per device.
"""

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbuf._src import prioritized
from jaxbuf._src import random
from jaxbuf._src import ring
from jaxbuf._src import sum_tree
from jaxbuf._src import uniform
from jaxbuf._src import validation
from jaxbuf._src.base import Buffer, PyTree, ReplaySample, Schedule, bind
from jaxbuf._src.prioritized import PrioritizedReplayState
from jaxbuf._src.ring import ReplayState

# The wrapped kinds, by the module function their buffer's `init` binds.
_KINDS = {uniform.init: uniform, prioritized.init: prioritized}
SAMPLING_MODES = ("global", "local")
BATCH_LAYOUTS = ("sharded", "replicated")


def _local(state: PyTree) -> PyTree:
  """A device's `[1, ...]` block of a sharded state, as its local state."""
  return jax.tree.map(lambda x: x[0], state)


def _stacked(state: PyTree) -> PyTree:
  return jax.tree.map(lambda x: x[None], state)


def _spec(axis: str) -> PartitionSpec:
  return PartitionSpec(axis)


def _placed(tree: PyTree, mesh: jax.sharding.Mesh, axis: str,
            spec: PartitionSpec) -> PyTree:
  """`tree` laid out as `spec` says: free for arguments already laid out so,
  a reshard (or a local slice of replicated data) otherwise.

  `reshard` on an Explicit axis, a sharding constraint on an Auto one; both,
  unlike `device_put`, leave a `vmap`ped axis unsplit.
  """
  sharding = NamedSharding(mesh, spec)
  axis_type = mesh.axis_types[mesh.axis_names.index(axis)]
  if axis_type == jax.sharding.AxisType.Explicit:
    return jax.sharding.reshard(tree, sharding)
  return jax.lax.with_sharding_constraint(tree, sharding)


def _num_devices(mesh: jax.sharding.Mesh, axis: str) -> int:
  return mesh.shape[axis]


def _check_divides(count: int, num_devices: int, name: str, what: str) -> None:
  if count % num_devices:
    raise ValueError(
        f"{what}: {name} {count} does not divide by the {num_devices} devices "
        f"of the mesh axis; use a multiple of {num_devices}.")


def _check_sharded_state(state: Any, kind, what: str, num_devices: int) -> None:
  expected = PrioritizedReplayState if kind is prioritized else ReplayState
  validation.check_state_kind(state, expected, what=what,
                              exact=kind is uniform)
  if np.shape(state.size) != (num_devices,):
    raise ValueError(
        f"{what}: expected a sharded state, its counters of shape "
        f"({num_devices},) (one per device), given shape "
        f"{np.shape(state.size)}; make it with the sharded buffer's init.")


def _local_capacity(state: ReplayState) -> int:
  return jax.tree_util.tree_leaves(state.storage)[0].shape[1]


def init(example_item: PyTree, *, kind, capacity: int,
         mesh: jax.sharding.Mesh, axis: str) -> ReplayState:
  """An empty sharded buffer: each device's part made in place on it.

  Returns:
    The wrapped kind's state with every leaf `[D, ...]` split over `axis`;
    storage leaves `[D, L, *leaf.shape]`.
  """
  num_devices = _num_devices(mesh, axis)
  _check_divides(capacity, num_devices, "capacity", "sharded")
  local_capacity = capacity // num_devices
  items = jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)),
      example_item)
  make = lambda: jax.vmap(lambda _: kind.init(items, capacity=local_capacity))(
      jnp.arange(num_devices))
  # Made by a jit with output shardings, so no device ever holds the whole.
  return jax.jit(make, out_shardings=NamedSharding(mesh, _spec(axis)))()


def add(state: ReplayState, items: PyTree, *, kind, alpha: float | None,
        mesh: jax.sharding.Mesh, axis: str) -> ReplayState:
  """Adds `items [B, ...]`: device d writes rows `[d B/D, (d+1) B/D)`.

  B must divide by D. Items are checked against the whole buffer's item
  (leaf paths, global shapes) before they are split; no collective runs.
  """
  num_devices = _num_devices(mesh, axis)
  _check_sharded_state(state, kind, "add", num_devices)
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype),
                      state.storage)
  (batch_size,) = validation.check_batched_leaves(spec, items, what="add")
  validation.check_host_integers(items, what="add")
  _check_divides(batch_size, num_devices, "the add batch B", "add")
  add_local = (kind.add if alpha is None
               else functools.partial(kind.add, alpha=alpha))

  def add_block(sharded_state, block):
    return _stacked(add_local(_local(sharded_state), block))

  return jax.shard_map(add_block, mesh=mesh, in_specs=_spec(axis),
                       out_specs=_spec(axis))(
                           *_placed((state, items), mesh, axis, _spec(axis)))


def _as_bits(leaf: jax.Array) -> jax.Array:
  """`leaf` as unsigned integers of its width, so a sum with zeros is exact."""
  if leaf.dtype == jnp.bool_:
    return leaf.astype(jnp.uint8)
  unsigned = jnp.dtype(f"uint{8 * leaf.dtype.itemsize}")
  return jax.lax.bitcast_convert_type(leaf, unsigned)


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
  if dtype == jnp.bool_:
    return bits.astype(jnp.bool_)
  return jax.lax.bitcast_convert_type(bits, dtype)


def _combine_rows(rows: PyTree, own: jax.Array, axis: str,
                  batch: str) -> PyTree:
  """The rows each device owns, joined: replicated `[S, ...]` or its block.

  `own` bool `[S]` is True on exactly one device per row.
  """
  def combine(leaf):
    bits = _as_bits(leaf)
    mask = own.reshape(own.shape + (1,) * (bits.ndim - 1))
    bits = jnp.where(mask, bits, jnp.zeros_like(bits))
    if batch == "replicated":
      bits = jax.lax.psum(bits, axis)
    else:
      bits = jax.lax.psum_scatter(bits, axis, scatter_dimension=0, tiled=True)
    return _from_bits(bits, leaf.dtype)
  return jax.tree.map(combine, rows)


def _from_every_device(value: jax.Array, axis: str) -> jax.Array:
  """Every device's scalar `value`, `[D]`, the same on all devices.

  A psum of one-hot rows rather than an all-gather: shard_map's replication
  check knows a psum's result is the same everywhere.
  """
  device = jax.lax.axis_index(axis)
  rows = jnp.zeros((jax.lax.axis_size(axis),), value.dtype).at[device].set(value)
  return jax.lax.psum(rows, axis)


def _joined_blocks(block: PyTree, axis: str) -> PyTree:
  """Each device's block `[S / D, ...]` placed at its offset: `[S, ...]` on all."""
  device = jax.lax.axis_index(axis)
  num_devices = jax.lax.axis_size(axis)

  def join(leaf):
    bits = _as_bits(leaf)
    whole = jnp.zeros((num_devices * bits.shape[0], *bits.shape[1:]), bits.dtype)
    whole = jax.lax.dynamic_update_slice_in_dim(
        whole, bits, device * bits.shape[0], axis=0)
    return _from_bits(jax.lax.psum(whole, axis), leaf.dtype)
  return jax.tree.map(join, block)


def _owner(inclusive: jax.Array, masses: jax.Array,
           targets: jax.Array) -> jax.Array:
  """For each target, the device whose interval of the prefix sums holds it.

  Scored like `sum_tree.find_prefix_sums_and_leaves`: the first device with
  positive mass whose inclusive prefix passes the target, else (rounding) the
  last device with positive mass, else device 0. A device holding nothing is
  never chosen while another holds something.
  """
  num_devices = masses.shape[0]
  position = jnp.arange(num_devices, dtype=jnp.int32)[None, :]
  score = jnp.min(
      jnp.where(masses[None, :] > 0,
                jnp.where(inclusive[None, :] > targets[:, None], position,
                          2 * num_devices - 1 - position),
                2 * num_devices - 1), axis=1)
  return jnp.where(score < num_devices, score, 2 * num_devices - 1 - score)


def _global_sample(state: ReplayState, key: jax.Array, batch_size: int, *,
                   kind, beta, stratified: bool, axis: str,
                   batch: str) -> ReplaySample:
  """One device's part of an exact global sample (runs inside shard_map)."""
  local = _local(state)
  device = jax.lax.axis_index(axis)
  local_capacity = ring.capacity_of(local.storage)
  sizes = _from_every_device(local.size, axis)
  total_size = jnp.sum(sizes)
  size_prefix = jnp.cumsum(sizes) - sizes

  def uniform_choice():
    """(owner, local slot) uniform over every item held anywhere."""
    drawn = random.uniform_indices(key, total_size, batch_size)
    # The first device whose items reach past `drawn`: it holds some. An
    # empty buffer draws 0 and gives device 0, slot 0.
    owner = jnp.sum(jnp.cumsum(sizes)[None, :] <= drawn[:, None], axis=1,
                    dtype=jnp.int32)
    owner = jnp.where(total_size > 0, owner, 0)
    return owner, drawn - size_prefix[owner]

  if kind is uniform:
    owner, slots = uniform_choice()
    own = owner == device
    slots = jnp.where(own, slots, 0)
    item_ids = jnp.where(own, ring.current_item_ids(local, slots), 0)
    small = jax.lax.psum(item_ids, axis)
    weights = jnp.full((batch_size,), total_size > 0, jnp.float32)
    global_ids = small
  else:
    totals = _from_every_device(sum_tree.total(local.sum_tree), axis)
    total = jnp.sum(totals)
    inclusive = jnp.cumsum(totals)
    uniforms = random.random_uniform(
        key, (1 + sum_tree.num_redraws(local.sum_tree), batch_size))
    if stratified:
      targets = (jnp.arange(batch_size, dtype=jnp.float32) + uniforms[0]) * (
          total / batch_size)
    else:
      targets = uniforms[0] * total
    owner = _owner(inclusive, totals, targets)
    local_targets = jnp.clip(targets - (inclusive - totals)[owner], 0.0,
                             totals[owner])
    found, leaf_values = sum_tree.find_prefix_sums_and_leaves(
        local.sum_tree, local_targets, uniforms[1:])
    has_mass = total > 0
    # All priorities underflowed to zero: uniform over the items held.
    fallback_owner, fallback_slots = uniform_choice()
    owner = jnp.where(has_mass, owner, fallback_owner)
    own = owner == device
    slots = jnp.where(own, jnp.where(has_mass, found, fallback_slots), 0)
    item_ids = jnp.where(own, ring.current_item_ids(local, slots), 0)
    leaf_bits = jnp.where(own, jax.lax.bitcast_convert_type(
        leaf_values, jnp.uint32), 0)
    small = jax.lax.psum(jnp.stack([item_ids, leaf_bits]), axis)
    global_ids = small[0]
    leaf_values = jax.lax.bitcast_convert_type(small[1], jnp.float32)
    log_weights = -prioritized.beta_at(beta, local.beta_step) * jnp.log(
        total_size.astype(jnp.float32) * (leaf_values / total))
    weights = jnp.exp(log_weights - jnp.max(log_weights))
    weights = jnp.where(has_mass, weights,
                        (total_size > 0).astype(jnp.float32))

  indices = owner * local_capacity + slots
  # `slots` is only meaningful at the owner; the owner is known everywhere.
  indices = jax.lax.psum(jnp.where(own, indices, 0), axis)
  items = _combine_rows(ring.gather(local.storage, slots), own, axis, batch)
  if batch == "sharded":
    block = batch_size // jax.lax.axis_size(axis)
    start = device * block
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block)
    indices, weights, global_ids = map(cut, (indices, weights, global_ids))
  return ReplaySample(items=items, indices=indices, weights=weights,
                      item_ids=global_ids)


def _local_sample(state: ReplayState, key: jax.Array, batch_size: int, *,
                  kind, beta, stratified: bool, axis: str,
                  batch: str) -> ReplaySample:
  """S / D items from this device's own part, with no communication."""
  local = _local(state)
  device = jax.lax.axis_index(axis)
  block = batch_size // jax.lax.axis_size(axis)
  device_key = jax.random.fold_in(key, device)
  if kind is uniform:
    drawn = uniform.sample(local, device_key, block)
  else:
    drawn = prioritized.sample(local, device_key, block, beta=beta,
                               stratified=stratified)
  drawn = drawn.replace(
      indices=drawn.indices + device * ring.capacity_of(local.storage))
  if batch == "replicated":
    drawn = _joined_blocks(drawn, axis)
  return drawn


def sample(state: ReplayState, key: jax.Array, batch_size: int, *, kind,
           beta: float | Schedule | None, stratified: bool,
           mesh: jax.sharding.Mesh, axis: str, sampling: str,
           batch: str) -> ReplaySample:
  """Draws `batch_size` items over all devices' parts.

  Returns:
    A `ReplaySample` whose indices are global slots (device `g // L`, local
    slot `g % L`): items `[S, ...]`, indices int32 `[S]`, weights float32
    `[S]`, item_ids uint32 `[S]`; split over `axis` in blocks of S / D
    (`batch="sharded"`) or whole on every device (`"replicated"`).
  """
  num_devices = _num_devices(mesh, axis)
  _check_sharded_state(state, kind, "sample", num_devices)
  validation.check_sample_args(state.size, key, batch_size, checked=False)
  _check_divides(batch_size, num_devices, "batch_size", "sample")
  draw = _global_sample if sampling == "global" else _local_sample
  draw = functools.partial(draw, batch_size=batch_size, kind=kind, beta=beta,
                           stratified=stratified, axis=axis, batch=batch)
  out = _spec(axis) if batch == "sharded" else PartitionSpec()
  return jax.shard_map(lambda s, k: draw(s, k), mesh=mesh,
                       in_specs=(_spec(axis), PartitionSpec()),
                       out_specs=out)(_placed(state, mesh, axis, _spec(axis)),
                                      _placed(key, mesh, axis, PartitionSpec()))


def update_priorities(state: ReplayState, indices: jax.Array,
                      priorities: jax.Array, item_ids: jax.Array | None = None,
                      *, kind, alpha: float | None, eps: float | None,
                      mesh: jax.sharding.Mesh, axis: str) -> ReplayState:
  """Routes each update of global slot `indices [S]` to the device owning it.

  Every device sees the whole update (an all-gather of 12 S bytes when the
  arguments come split over the axis) and applies, in order, the entries it
  owns; skips are as for the wrapped kind (index not held, priority not
  finite or negative, item overwritten since sampled). The running maximum
  priority is then taken over all devices, so new items enter at the same
  priority everywhere.
  """
  num_devices = _num_devices(mesh, axis)
  _check_sharded_state(state, kind, "update_priorities", num_devices)
  indices = validation.host_indices(indices)
  validation.check_priority_update_args(indices, priorities, item_ids)
  if kind is uniform:
    return state
  indices = jnp.asarray(indices)
  priorities = jnp.asarray(priorities)
  local_capacity = _local_capacity(state)
  capacity = num_devices * local_capacity

  def update_owned(sharded_state, indices, priorities, item_ids):
    local = _local(sharded_state)
    device = jax.lax.axis_index(axis)
    in_range = ring.indices_in_range(indices, jnp.int32(capacity))
    slots = jnp.where(in_range, indices, 0).astype(jnp.int32)
    owned = in_range & (slots // local_capacity == device)
    # Slot L is past every local item, so the local update skips it.
    slots = jnp.where(owned, slots % local_capacity, local_capacity)
    local = kind.update_priorities(local, slots, priorities, item_ids,
                                   alpha=alpha, eps=eps)
    local = local.replace(max_priority=jax.lax.pmax(local.max_priority, axis))
    return _stacked(local)

  replicated = PartitionSpec()
  return jax.shard_map(
      update_owned, mesh=mesh,
      in_specs=(_spec(axis), replicated, replicated, replicated),
      out_specs=_spec(axis))(
          _placed(state, mesh, axis, _spec(axis)),
          *_placed((indices, priorities, item_ids), mesh, axis, replicated))


def can_sample(state: ReplayState, batch_size: int, *, sampling: str,
               num_devices: int) -> jax.Array:
  """Whether a sample of `batch_size` is backed by items: bool `()`.

  Global: all devices together hold at least `batch_size` items. Local:
  every device holds at least `batch_size / D`.
  """
  validation.check_batch_size(batch_size, what="can_sample")
  _check_divides(batch_size, num_devices, "batch_size", "can_sample")
  if sampling == "global":
    return jnp.sum(state.size) >= batch_size
  return jnp.min(state.size) >= batch_size // num_devices


def clear(state: ReplayState, *, kind, mesh: jax.sharding.Mesh,
          axis: str) -> ReplayState:
  """Empties every device's part without reallocating."""
  _check_sharded_state(state, kind, "clear", _num_devices(mesh, axis))
  return jax.shard_map(lambda s: _stacked(kind.clear(_local(s))), mesh=mesh,
                       in_specs=_spec(axis), out_specs=_spec(axis))(
                           _placed(state, mesh, axis, _spec(axis)))


def _bound_settings(function: Callable) -> dict[str, Any]:
  """The settings a buffer's function was bound with, from its signature."""
  return {name: parameter.default
          for name, parameter in inspect.signature(function).parameters.items()
          if parameter.kind is inspect.Parameter.KEYWORD_ONLY}


def sharded(buffer: Buffer, mesh: jax.sharding.Mesh, axis: str = "data", *,
            sampling: str = "global", batch: str = "sharded") -> Buffer:
  """`buffer` with its capacity split over the devices of `mesh`'s `axis`.

  Args:
    buffer: a `uniform_replay` or `prioritized_replay` buffer (not checked
      mode); its capacity C is the global one and must divide by D.
    mesh: a `jax.sharding.Mesh`, e.g. `jax.make_mesh((D,), ("data",))`;
      Explicit and Auto axes both work. Other axes hold copies.
    axis: the mesh axis the capacity, add batches and samples are split on.
    sampling: `"global"`, exact over all devices' items (the same
      distribution as the unsharded buffer); or `"local"`, S / D items from
      each device's own part, with no communication (see the module notes
      for what that approximates).
    batch: `"sharded"`, the sample split over `axis` in blocks of S / D
      rows (about the batch's bytes moved per device); or `"replicated"`,
      the whole sample on every device (about twice that).

  Returns:
    A `Buffer` with the same functions. The state is the stack of the D
    local states (every leaf `[D, ...]`, split over `axis`); indices are
    global slots, device `g // (C / D)`, local slot `g % (C / D)`. Batch
    sizes, for `add` and `sample`, must divide by D.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> mesh = jax.make_mesh((4,), ("data",))
  >>> buffer = jaxbuf.sharded(jaxbuf.prioritized_replay(1024), mesh)
  >>> state = buffer.init({"obs": jnp.zeros(3)})
  >>> state.storage["obs"].shape
  (4, 256, 3)
  >>> state = buffer.add(state, {"obs": jnp.ones((8, 3))})
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> int(state.size.sum()), batch.items["obs"].shape
  (8, (4, 3))
  """
  if not isinstance(buffer, Buffer):
    raise TypeError(f"sharded: buffer must be a jaxbuf.Buffer, given "
                    f"{type(buffer).__name__}.")
  kind = _KINDS.get(inspect.unwrap(buffer.init))
  if kind is None:
    raise TypeError(
        "sharded: wraps uniform_replay and prioritized_replay buffers; given "
        f"a buffer whose init is {inspect.unwrap(buffer.init).__qualname__} "
        f"from {inspect.unwrap(buffer.init).__module__}.")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"sharded: mesh must be a jax.sharding.Mesh, given "
                    f"{type(mesh).__name__}.")
  if axis not in mesh.shape:
    raise ValueError(f"sharded: axis {axis!r} is not an axis of the mesh, "
                     f"whose axes are {tuple(mesh.shape)}.")
  if sampling not in SAMPLING_MODES:
    raise ValueError(f"sharded: sampling must be one of {SAMPLING_MODES}, "
                     f"given {sampling!r}.")
  if batch not in BATCH_LAYOUTS:
    raise ValueError(f"sharded: batch must be one of {BATCH_LAYOUTS}, given "
                     f"{batch!r}.")
  sample_settings = _bound_settings(buffer.sample)
  if sample_settings.get("checked"):
    raise ValueError(
        "sharded: checked buffers are not supported; wrap the unchecked "
        "buffer (its skips of bad updates and empty samples are the same).")
  capacity = _bound_settings(buffer.init)["capacity"]
  num_devices = _num_devices(mesh, axis)
  _check_divides(capacity, num_devices, "capacity", "sharded")
  update_settings = _bound_settings(buffer.update_priorities)
  where = dict(mesh=mesh, axis=axis)
  return bind(
      init=functools.partial(init, kind=kind, capacity=capacity, **where),
      add=functools.partial(add, kind=kind,
                            alpha=_bound_settings(buffer.add).get("alpha"),
                            **where),
      sample=functools.partial(
          sample, kind=kind, beta=sample_settings.get("beta"),
          stratified=sample_settings.get("stratified", False),
          sampling=sampling, batch=batch, **where),
      update_priorities=functools.partial(
          update_priorities, kind=kind, alpha=update_settings.get("alpha"),
          eps=update_settings.get("eps"), **where),
      can_sample=functools.partial(can_sample, sampling=sampling,
                                   num_devices=num_devices),
      clear=functools.partial(clear, kind=kind, **where),
      checked=False)
