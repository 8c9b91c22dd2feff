"""One replay buffer split over the devices of a mesh axis, sampled exactly.

Why one module of this size: it is one algorithm, exact sampling over
devices, whose parts (the stacked layout, local adds, the global draw with
its collectives, priority updates routed to the owning device, the
`sharded` factory) all work on the same stack of local states through one
`kind.Split`. What differs per kind comes from the kind's own module through
that record (`kind.py`), so this room does not grow with the kinds.

Shape key: B add batch, S sample size, C capacity (global), D devices on the
mesh axis; item replay: L = C / D slots per device; sequence replay: N envs,
R = C / N steps per env, T steps per env in one add, W = N / D * R window
ids per device.

Layout. A sharded state is the stack of the D devices' local states: every
leaf of the wrapped buffer's state gets a leading axis of length D, split
over the mesh axis (`NamedSharding(mesh, P(axis))`), so device d holds
`jax.tree.map(lambda x: x[d], state)`, an ordinary state of the wrapped kind
with capacity C / D and its own counters and sum tree. Item replay: global
slot `g` is local slot `g % L` of device `g // L`. Sequence replay is
sharded over envs: device d holds envs `[d N/D, (d+1) N/D)` whole (their
rings, episode ends and windows), so a window never spans devices, and its
global id `g` (the unsharded buffer's `n * R + j`) is local window id
`g % W` of device `g // W`. Being a stack of local states, the state saves,
loads and can be inspected like any vmapped state.

Adds are local. Items `[B, ...]` split over the axis in contiguous blocks of
B / D rows, and device d writes its block into its own part; steps `[N, ...]`
or `[N, T, ...]`, with `mask` and `episode_end`, split over envs, and device
d writes its envs' steps. No cross-device traffic either way. Item replay's
devices each hold every D-th block of the stream; with equal blocks the
fills stay equal, but sampling does not rely on it (nor on envs stepping
evenly).

Global sampling is exact, by the same steps for every kind. Every device
gathers the D local totals: sum-tree totals where the kind draws by mass
(prioritized replay, and uniform sequence replay within episodes, whose
tree has leaf 1 per window), counts of what can be sampled otherwise. Every
device draws the same targets over the global total from the replicated key
and, for the targets it owns, descends its own tree (or finds the rank-th
item or window it holds); rows are combined with a masked sum, exact
because each row has exactly one non-zero contributor (rows travel bit-cast
to unsigned integers, so -0.0 and NaN payloads survive). A replicated batch
is an all-reduce of the `[S, ...]` rows (about 2x the batch's bytes through
each device); a batch sharded over the axis is a reduce-scatter (about the
batch's bytes, (D - 1) / D of them). A target picks its device by the
float32 prefix sums of the D totals and keeps its offset within the owner,
so the device choice is one more level in the first stretch of the tree's
descent before a redraw (`sum_tree.LEVELS_PER_TARGET`), with the float32
rounding of the global total that the unsharded tree's root has too. Counts
are drawn exactly, by 64-bit ranks (`random.uniform_indices`); for uniform
sequence replay across episodes the global rank order is the unsharded
buffer's (env by env), so the same key draws the same windows.

Local sampling (the per-device buffers of Stoix and Brax) draws S / D items
or windows from each device's own part with no communication; each one's
probability is then its share of its own device's total, times 1 / D, which
equals the global one only when the devices' totals (items held, windows
that can be sampled, or priority mass) are equal, and the importance weights
are normalised per device, with the device's own N.

Over one device the two modes coincide: the device's own sample is the
global one, drawn with no collective, and equals the unsharded buffer's
batch for the same key, so code written for many devices costs nothing
extra on one.
"""

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbuf._src.storage import placed
from jaxbuf._src.core import kind as kind_protocol
from jaxbuf._src.items import prioritized
from jaxbuf._src.core import random
from jaxbuf._src.core import ring
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree, ReplaySample, SampleT, StateT, bind
from jaxbuf._src.core.kind import Split

SAMPLING_MODES = ("global", "local")
_ROWS_KEY_DATA = np.uint32(2**32 - 1)
BATCH_LAYOUTS = ("sharded", "replicated")


def _local(state: PyTree) -> PyTree:
  """A device's `[1, ...]` block of a sharded state, as its local state."""
  return jax.tree.map(lambda x: x[0], state)


def _stacked(state: PyTree) -> PyTree:
  return jax.tree.map(lambda x: x[None], state)


def _spec(axis: str) -> PartitionSpec:
  return PartitionSpec(axis)


def _placed(tree: PyTree, mesh: jax.sharding.Mesh, axis: str, spec: PartitionSpec) -> PyTree:
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


def _check_sharded_state(
  state: Any, kind: Split, wrapped: kind_protocol.Kind, what: str, num_devices: int
) -> None:
  validation.check_state_kind(
    state, wrapped.state_type, what=what, exact=wrapped.exact_type, stacked=True
  )
  expected = (num_devices, *kind.counter_shape)
  given = np.shape(kind.local_counter(state))
  if given != expected:
    raise ValueError(
      f"{what}: expected a sharded state, its counters of shape "
      f"{expected} (one per device), given shape {given}; make it with "
      f"the sharded buffer's init."
    )


def init(
  example_item: PyTree,
  *,
  kind: Split,
  wrapped: kind_protocol.Kind,
  mesh: jax.sharding.Mesh,
  axis: str,
) -> Any:
  """An empty sharded buffer: each device's part made in place on it.

  Returns:
    The wrapped kind's state with every leaf `[D, ...]` split over `axis`;
    storage leaves `[D, L, *leaf.shape]` (items) or `[D, N / D, R,
    *leaf.shape]` (sequences).
  """
  del wrapped  # The sharded buffer's bind records its settings.
  num_devices = _num_devices(mesh, axis)
  items = jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)), example_item
  )
  make = lambda: jax.vmap(lambda _: kind.init(items))(jnp.arange(num_devices))
  # Made by a jit with output shardings, so no device ever holds the whole.
  return jax.jit(make, out_shardings=NamedSharding(mesh, _spec(axis)))()


def _add_locally(
  state: Any, arguments: tuple, *, kind: Split, mesh: jax.sharding.Mesh, axis: str
) -> Any:
  """Each device adds its blocks of `arguments` (all split on axis 0)."""

  def add_block(sharded_state, arguments):
    return _stacked(kind.add(_local(sharded_state), *arguments))

  return jax.shard_map(add_block, mesh=mesh, in_specs=_spec(axis), out_specs=_spec(axis))(
    *_placed((state, arguments), mesh, axis, _spec(axis))
  )


def add(
  state: Any,
  *arguments: Any,
  kind: Split,
  mesh: jax.sharding.Mesh,
  axis: str,
  wrapped: kind_protocol.Kind,
  **keywords: Any,
) -> Any:
  """Adds the wrapped kind's add arguments, each split over the devices.

  Item replay: items `[B, ...]`, device d writing rows `[d B/D, (d+1) B/D)`
  (B must divide by D). Sequence replay: steps `[N, ...]` or `[N, T, ...]`,
  `mask` (bool `[N]`) and `episode_end` (bool `[N]` or `[N, T]`), device d
  writing envs `[d N/D, (d+1) N/D)`. Everything is checked first as the
  unsharded buffer checks it, with its messages and its global sizes; no
  collective runs.
  """
  num_devices = _num_devices(mesh, axis)
  _check_sharded_state(state, kind, wrapped, "add", num_devices)
  arguments = kind.add_arguments(*arguments, **keywords)
  kind.check_add(state, arguments, num_devices)
  return _add_locally(state, arguments, kind=kind, mesh=mesh, axis=axis)


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


def _combine_rows(rows: PyTree, own: jax.Array, axis: str, batch: str) -> PyTree:
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
    whole = jax.lax.dynamic_update_slice_in_dim(whole, bits, device * bits.shape[0], axis=0)
    return _from_bits(jax.lax.psum(whole, axis), leaf.dtype)

  return jax.tree.map(join, block)


def _owner(inclusive: jax.Array, masses: jax.Array, targets: jax.Array) -> jax.Array:
  """For each target, the device whose interval of the prefix sums holds it.

  Scored like `sum_tree.find_prefix_sums_and_leaves`: the first device with
  positive mass whose inclusive prefix passes the target, else (rounding) the
  last device with positive mass, else device 0. A device holding nothing is
  never chosen while another holds something.
  """
  num_devices = masses.shape[0]
  position = jnp.arange(num_devices, dtype=jnp.int32)[None, :]
  score = jnp.min(
    jnp.where(
      masses[None, :] > 0,
      jnp.where(inclusive[None, :] > targets[:, None], position, 2 * num_devices - 1 - position),
      2 * num_devices - 1,
    ),
    axis=1,
  )
  return jnp.where(score < num_devices, score, 2 * num_devices - 1 - score)


def _global_sample(
  state: Any, key: jax.Array, batch_size: int, *, kind: Split, axis: str, batch: str
) -> ReplaySample:
  """One device's part of an exact global sample (runs inside shard_map)."""
  local = _local(state)
  device = jax.lax.axis_index(axis)
  ids_per_device = kind.ids_per_device(state)
  sizes = _from_every_device(kind.held(local), axis)
  total_size = jnp.sum(sizes)
  size_prefix = jnp.cumsum(sizes) - sizes

  def uniform_choice():
    """(owner, rank within it) uniform over everything sampleable anywhere."""
    drawn = random.uniform_indices(key, total_size, batch_size)
    # The first device whose counts reach past `drawn`: it holds some. An
    # empty buffer draws 0 and gives device 0, rank 0.
    owner = jnp.sum(jnp.cumsum(sizes)[None, :] <= drawn[:, None], axis=1, dtype=jnp.int32)
    owner = jnp.where(total_size > 0, owner, 0)
    return owner, drawn - size_prefix[owner]

  if kind.masses is None:
    owner, ranks = uniform_choice()
    own = owner == device
    ids = jnp.where(own, kind.at_rank(local, ranks), 0)
    item_ids = jnp.where(own, kind.item_ids(local, ids), 0)
    global_ids = jax.lax.psum(item_ids, axis)
    weights = jnp.full((batch_size,), total_size > 0, jnp.float32)
    drawn = total_size > 0
  else:
    tree = kind.masses(local)
    totals = _from_every_device(sum_tree.total(tree), axis)
    total = jnp.sum(totals)
    inclusive = jnp.cumsum(totals)
    # Strata in a random order, as `sum_tree.sample_leaves` draws them: in
    # stratum order, device d's block of a sharded batch would always come
    # from the same part of the global total (mostly device d's own items),
    # a biased minibatch for each learner.
    targets, redraws = sum_tree.draw_targets(
      key, batch_size, total, sum_tree.num_redraws(tree), stratified=kind.stratified
    )
    owner = _owner(inclusive, totals, targets)
    local_targets = jnp.clip(targets - (inclusive - totals)[owner], 0.0, totals[owner])
    found, leaf_values = sum_tree.find_prefix_sums_and_leaves(tree, local_targets, redraws)
    has_mass = total > 0
    if kind.uniform_when_massless:
      # All priorities underflowed to zero: uniform over the items held. A
      # cond, as in the unsharded buffer, not a where: the fallback's draw
      # runs only when needed (`has_mass` is the same on every device).
      def fallback():
        fallback_owner, fallback_ranks = uniform_choice()
        # `+ found * 0` types the ids as varying over the axis, as `found`
        # is, which shard_map requires of both branches.
        return fallback_owner, kind.at_rank(local, fallback_ranks) + found * 0

      owner, found = jax.lax.cond(has_mass, lambda: (owner, found), fallback)
      massless_weight = (total_size > 0).astype(jnp.float32)
    else:
      # As the unsharded sequence replays: id 0, weight 0.
      owner = jnp.where(has_mass, owner, 0)
      found = jnp.where(has_mass, found, 0)
      massless_weight = jnp.float32(0)
    own = owner == device
    ids = jnp.where(own, found, 0)
    item_ids = jnp.where(own, kind.item_ids(local, ids), 0)
    if kind.beta is None:
      global_ids = jax.lax.psum(item_ids, axis)
      weights = jnp.ones((batch_size,), jnp.float32)
    else:
      leaf_bits = jnp.where(own, jax.lax.bitcast_convert_type(leaf_values, jnp.uint32), 0)
      small = jax.lax.psum(jnp.stack([item_ids, leaf_bits]), axis)
      global_ids = small[0]
      leaf_values = jax.lax.bitcast_convert_type(small[1], jnp.float32)
      log_weights = -prioritized.beta_at(kind.beta, local.beta_step) * jnp.log(
        total_size.astype(jnp.float32) * (leaf_values / total)
      )
      weights = jnp.exp(log_weights - jnp.max(log_weights))
    weights = jnp.where(has_mass, weights, massless_weight)
    drawn = has_mass | (massless_weight > 0)

  indices = owner * ids_per_device + ids
  # `ids` is only meaningful at the owner; the owner is known everywhere.
  indices = jax.lax.psum(jnp.where(own, indices, 0), axis)
  # The draw keeps `key` (the same ids as the unsharded buffer where the
  # orders agree); a kind's draw at the owner gets a key hashed from it at
  # a counter the draw never reaches.
  rows_key = random.fold_in(key, _ROWS_KEY_DATA)
  rows = _combine_rows(kind.rows(local, ids, rows_key), own, axis, batch)
  if batch == "sharded":
    block = batch_size // jax.lax.axis_size(axis)
    start = device * block
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block)
    indices, weights, global_ids = map(cut, (indices, weights, global_ids))
  return kind.as_sample(rows, indices, weights, global_ids, drawn)


def _local_sample(
  state: Any, key: jax.Array, batch_size: int, *, kind: Split, axis: str, batch: str
) -> ReplaySample:
  """S / D items or windows from this device's own part, no communication."""
  local = _local(state)
  device = jax.lax.axis_index(axis)
  block = batch_size // jax.lax.axis_size(axis)
  if jax.lax.axis_size(axis) > 1:
    key = jax.random.fold_in(key, device)
  drawn = kind.sample(local, key, block)
  drawn = drawn.replace(indices=drawn.indices + device * kind.ids_per_device(state))
  if batch == "replicated":
    drawn = _joined_blocks(drawn, axis)
  return drawn


def sample(
  state: Any,
  key: jax.Array,
  batch_size: int,
  *,
  kind: Split,
  wrapped: kind_protocol.Kind,
  mesh: jax.sharding.Mesh,
  axis: str,
  sampling: str,
  batch: str,
) -> ReplaySample:
  """Draws `batch_size` items (or windows) over all devices' parts.

  Returns:
    The wrapped kind's sample (a `ReplaySample`, or a `SequenceSample` with
    `mask [S, L]`) whose indices are global: slot `g` of item replay is
    local slot `g % L` of device `g // L`, window id `g` of sequence replay
    (the unsharded buffer's numbering) local window `g % W` of device
    `g // W`. Items `[S, ...]` (`[S, L, ...]` windows), indices int32
    `[S]`, weights float32 `[S]`, item_ids uint32 `[S]`; split over `axis`
    in blocks of S / D (`batch="sharded"`) or whole on every device
    (`"replicated"`).
  """
  num_devices = _num_devices(mesh, axis)
  _check_sharded_state(state, kind, wrapped, "sample", num_devices)
  validation.check_key(key, what="sample")
  validation.check_batch_size(batch_size, what="sample")
  validation.check_divides(batch_size, num_devices, "batch_size", "sample")
  if num_devices == 1:
    # One device holds everything, so its own sample is the global one: the
    # unsharded buffer's batch for the same key, with no collective
    # (XLA:CPU keeps collectives of one participant, each a rendezvous).
    sampling = "local"
  draw = _global_sample if sampling == "global" else _local_sample
  draw = functools.partial(draw, batch_size=batch_size, kind=kind, axis=axis, batch=batch)
  out = _spec(axis) if batch == "sharded" else PartitionSpec()
  return jax.shard_map(
    lambda s, k: draw(s, k), mesh=mesh, in_specs=(_spec(axis), PartitionSpec()), out_specs=out
  )(_placed(state, mesh, axis, _spec(axis)), _placed(key, mesh, axis, PartitionSpec()))


def update_priorities(
  state: Any,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  kind: Split,
  wrapped: kind_protocol.Kind,
  mesh: jax.sharding.Mesh,
  axis: str,
) -> Any:
  """Routes each update of global id `indices [S]` to the device owning it.

  Every device sees the whole update (an all-gather of 12 S bytes when the
  arguments come split over the axis) and applies, in order, the entries it
  owns; skips are as for the wrapped kind (an index not held or a window not
  sampleable now, a priority not finite, an item or window overwritten since
  it was sampled). The running maximum priority is then taken over all
  devices, so new items and windows enter at the same priority everywhere.
  """
  num_devices = _num_devices(mesh, axis)
  _check_sharded_state(state, kind, wrapped, "update_priorities", num_devices)
  if kind.check_update is not None:
    kind.check_update(indices, priorities)
  indices = validation.host_indices(indices)
  validation.check_priority_update_args(indices, priorities, item_ids)
  if kind.update_priorities is None:
    return state
  indices = jnp.asarray(indices)
  priorities = jnp.asarray(priorities)
  ids_per_device = kind.ids_per_device(state)
  num_ids = num_devices * ids_per_device

  def update_owned(sharded_state, indices, priorities, item_ids):
    local = _local(sharded_state)
    device = jax.lax.axis_index(axis)
    in_range = ring.indices_in_range(indices, jnp.int32(num_ids))
    ids = jnp.where(in_range, indices, 0).astype(jnp.int32)
    owned = in_range & (ids // ids_per_device == device)
    # Id `ids_per_device` is past every local one, so the local update
    # skips it.
    ids = jnp.where(owned, ids % ids_per_device, ids_per_device)
    local = kind.update_priorities(local, ids, priorities, item_ids)
    if num_devices > 1:
      local = local.replace(max_priority=jax.lax.pmax(local.max_priority, axis))
    return _stacked(local)

  # The storage stays outside the shard_map: updates never write it, and
  # passed through as the same arrays it stays recognisably unchanged (for
  # `jaxbuf.cond_update`, and for XLA, with no copy of it to alias away).
  # Inside, zero-size stand-ins keep the shapes the update reads the
  # capacity from.
  storage = state.storage
  stand_ins = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape + (0,), leaf.dtype), storage)
  replicated = PartitionSpec()
  updated = jax.shard_map(
    update_owned,
    mesh=mesh,
    in_specs=(_spec(axis), replicated, replicated, replicated),
    out_specs=_spec(axis),
  )(
    _placed(state.replace(storage=stand_ins), mesh, axis, _spec(axis)),
    *_placed((indices, priorities, item_ids), mesh, axis, replicated),
  )
  return updated.replace(storage=storage)


def can_sample(
  state: Any, batch_size: int, *, kind: Split, sampling: str, num_devices: int
) -> jax.Array:
  """Whether `sample(state, key, batch_size)` draws only held data: bool
  `()`, the wrapped kind's `can_sample` (one unit held: an item, a
  complete window, a piece, a transition; sampling is with replacement).
  Global: all devices together hold one. Local: every device holds one,
  since each draws `batch_size / D` rows from its own part. Not a warm-up:
  wait for data with `state.size.sum() >= min_size` (item kinds) or
  `state.steps_held.sum() >= min_steps` (stream kinds).
  """
  validation.check_batch_size(batch_size, what="can_sample")
  validation.check_divides(batch_size, num_devices, "batch_size", "can_sample")
  held = kind.held(state)
  if sampling == "global":
    return kind.enough(jnp.sum(held), batch_size)
  return jnp.all(kind.enough(held, batch_size // num_devices))


def clear(
  state: Any, *, kind: Split, wrapped: kind_protocol.Kind, mesh: jax.sharding.Mesh, axis: str
) -> Any:
  """Empties every device's part without reallocating."""
  _check_sharded_state(state, kind, wrapped, "clear", _num_devices(mesh, axis))
  return jax.shard_map(
    lambda s: _stacked(kind.clear(_local(s))),
    mesh=mesh,
    in_specs=_spec(axis),
    out_specs=_spec(axis),
  )(_placed(state, mesh, axis, _spec(axis)))


def sharded(
  buffer: Buffer[StateT, SampleT],
  mesh: jax.sharding.Mesh,
  axis: str = "data",
  *,
  sampling: str = "global",
  batch: str = "sharded",
) -> Buffer[StateT, SampleT]:
  """`buffer` split over the devices of `mesh`'s `axis`.

  Args:
    buffer: a `uniform_replay` or `prioritized_replay` buffer, whose
      capacity C (the global one) is split over the devices and must divide
      by D; or a `sequence_replay` or `prioritized_sequence_replay` buffer
      (either `episodes` mode), sharded over envs: num_envs N must divide by
      D, and each device holds N / D whole envs. Not checked mode. Made
      with `storage=jaxbuf.disk(directory)`, each device's payload rows go
      to files of their own, under `directory/device-<d>`; `storage="host"`
      is refused.
    mesh: a `jax.sharding.Mesh`, e.g. `jax.make_mesh((D,), ("data",))`;
      Explicit and Auto axes both work. Other axes hold copies.
    axis: the mesh axis the buffer, add batches and samples are split on.
    sampling: `"global"`, exact over all devices' items or windows (the same
      distribution as the unsharded buffer); or `"local"`, S / D from each
      device's own part, with no communication (see the module notes for
      what that approximates).
    batch: `"sharded"`, the sample split over `axis` in blocks of S / D
      rows (about the batch's bytes moved per device); or `"replicated"`,
      the whole sample on every device (about twice that).

  Returns:
    A `Buffer` with the same functions. The state is the stack of the D
    local states (every leaf `[D, ...]`, split over `axis`). Item replay:
    `add` takes items `[B, ...]`, B a multiple of D, device d writing rows
    `[d B/D, (d+1) B/D)`; indices are global slots, device `g // (C / D)`,
    local slot `g % (C / D)`. Sequence replay: `add(state, steps, mask,
    episode_end)` takes `[N, ...]` or `[N, T, ...]`, device d writing envs
    `[d N/D, (d+1) N/D)`; indices are the unsharded buffer's window ids
    `n * R + j`, device `g // (N / D * R)`. Sample sizes must divide by D.
    `init` is jitted with the state's output shardings, so
    `jax.eval_shape(buffer.init, example)` keeps the split: the
    no-allocation `like` of `jaxbuf.load`.

    Cutting minibatches from a sample: under Explicit axes JAX refuses to
    slice rows across the split of a `batch="sharded"` sample
    (`ShardingTypeError`). Reshard it whole first,
    `jax.sharding.reshard(batch, NamedSharding(mesh, PartitionSpec()))`
    (eagerly, or inside a jit), or sample with `batch="replicated"`.
    The indices of a sharded sample number this buffer's global slots or
    windows: pass them to this buffer's `update_priorities` (one buffer's
    update refuses them with a `TypeError`).

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> devices = jax.device_count()   # 4 fake CPU devices in the tests
  >>> mesh = jax.make_mesh((devices,), ("data",))
  >>> buffer = jaxbuf.sharded(jaxbuf.prioritized_replay(1024), mesh)
  >>> state = buffer.init({"obs": jnp.zeros(3)})
  >>> state.storage["obs"].shape == (devices, 1024 // devices, 3)
  True
  >>> state = buffer.add(state, {"obs": jnp.ones((8, 3))})
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> int(state.size.sum()), batch.items["obs"].shape
  (8, (4, 3))

  Sequence replay, 8 envs over the devices (2 envs each on 4 devices):

  >>> windows = jaxbuf.sharded(jaxbuf.sequence_replay(
  ...     num_envs=8, capacity=128, sequence_length=3), mesh)
  >>> state = windows.init({"obs": jnp.zeros(3)})
  >>> state.storage["obs"].shape == (devices, 8 // devices, 16, 3)
  True
  >>> state = windows.add(state, {"obs": jnp.ones((8, 5, 3))})  # 5 steps
  >>> windows.sample(state, jax.random.key(0), 4).items["obs"].shape
  (4, 3, 3)
  """
  if not isinstance(buffer, Buffer):
    raise TypeError(f"sharded: buffer must be a jaxbuf.Buffer, given {type(buffer).__name__}.")
  tiered = placed.tiered_parts(buffer)
  if tiered is not None:
    # A buffer with storage=: its kind sharded as usual over row proxies,
    # each device's payload rows in files of their own.
    inner = sharded(tiered.core, mesh, axis, sampling=sampling, batch=batch)
    return placed.split_tier(inner, tiered, _num_devices(mesh, axis))
  wrapped = buffer.kind
  if wrapped is None or wrapped.split is None:
    raise TypeError(
      f"sharded: this buffer's kind "
      f"({'unknown' if wrapped is None else wrapped.name}) cannot be split "
      f"over devices; sharded wraps the kinds whose `buffer.kind.split` is "
      f"set: uniform_replay, prioritized_replay, sequence_replay and "
      f"prioritized_sequence_replay among them."
    )
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"sharded: mesh must be a jax.sharding.Mesh, given {type(mesh).__name__}.")
  if axis not in mesh.shape:
    raise ValueError(
      f"sharded: axis {axis!r} is not an axis of the mesh, whose axes are {tuple(mesh.shape)}."
    )
  if sampling not in SAMPLING_MODES:
    raise ValueError(f"sharded: sampling must be one of {SAMPLING_MODES}, given {sampling!r}.")
  if batch not in BATCH_LAYOUTS:
    raise ValueError(f"sharded: batch must be one of {BATCH_LAYOUTS}, given {batch!r}.")
  if wrapped.checked:
    raise ValueError(
      "sharded: checked buffers are not supported; wrap the unchecked "
      "buffer (its skips of bad updates and empty samples are the same)."
    )
  num_devices = _num_devices(mesh, axis)
  kind = wrapped.split(num_devices)
  where: dict[str, Any] = dict(kind=kind, wrapped=wrapped, mesh=mesh, axis=axis)
  return bind(
    init=functools.partial(init, **where),
    add=_with_add_signature(functools.partial(add, **where), kind, where),
    sample=functools.partial(sample, sampling=sampling, batch=batch, **where),
    update_priorities=functools.partial(update_priorities, **where),
    can_sample=functools.partial(can_sample, kind=kind, sampling=sampling, num_devices=num_devices),
    clear=functools.partial(clear, **where),
    kind=kind_protocol.Kind(
      name=f"sharded {wrapped.name}",
      state_type=wrapped.state_type,
      exact_type=wrapped.exact_type,
      settings=kind_protocol.settings_of(**dict(wrapped.settings), devices=num_devices),
      split=None,
    ),
    checked=False,
    # Items are placed over the devices by the sharded add itself.
    pack_host_items=False,
    # So that the abstract state of `jax.eval_shape(buffer.init, example)`
    # (the `like` of a load that allocates nothing) carries the split too.
    init_shardings=NamedSharding(mesh, _spec(axis)),
  )


def _with_add_signature(add_function: Callable, kind: Split, where: dict) -> Callable:
  """`add_function`, shown by `help` with the wrapped kind's arguments;
  its `split_settings` (the per-device kind, mesh and axis) are for host
  layers that add per device themselves (the replay service's lockstep)."""

  @functools.wraps(add)
  def add_to_devices(state, *arguments, **keywords):
    return add_function(state, *arguments, **keywords)

  add_to_devices.split_settings = where  # type: ignore[attr-defined]
  add_to_devices.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + list(inspect.signature(kind.add_arguments).parameters.values())
  )
  return add_to_devices
