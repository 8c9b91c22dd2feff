"""Mixing buffers: one sample drawn from several buffers in fixed proportions.

Why one module of this size: it holds one rule, how a batch is split over
parts and put back together, which `sample`, `take` and `update_priorities`
each apply (rows per part, the parts' checks, the concatenated fields, the
routing of each part's rows back to its buffer); split, each piece would
restate that rule.

Shape key: S sample size, S_k rows of part k, K parts (buffers).

Why one module of this size: it is one rule, how a batch is split over parts
and each part's rows sent back to its own buffer (sample, take, update).

RLPD (Ball et al. 2023) draws each batch half from an offline dataset and
half from online replay; DQfD mixes demonstrations with the agent's own
experience; multi-task agents draw evenly from each task's buffer. A mixture
holds no state of its own: its states are the list of each buffer's state,
and each part is sampled by its own buffer, so every kind (and a
`jaxbuf.sharded` buffer) can be a part.

Rows per part. The S rows are split by the largest-remainder method, in
exact rational arithmetic: part k gets `floor(S p_k / sum p)`, and the rows
left over go one each to the parts with the largest remainders (ties to the
lower part index). The counts are Python ints fixed by S and the proportions
while tracing, sum to S exactly, and differ from `S p_k / sum p` by less
than one row. A part of proportion 0 never gets a row; a part may get no
row at a small S (one row from a 50/50 mixture goes to part 0).

Row order. The batch is part 0's S_0 rows, then part 1's S_1 rows, and so
on: `items`, `source` and `weights` all follow it, and part k's rows are
`batch.parts[k]`, its buffer's own sample. Each part draws with its own key,
`fold_in(key, k)`, so the parts are independent. A part with no rows is not
sampled; its entry in `parts` is its sample type with S_k = 0.

Weights are each part's own: importance weights of a prioritized part
normalised within that part (largest 1), 1 for uniform parts, 0 for the rows
of a part whose buffer could not sample (empty), as that buffer gives alone.
Scale them per part if a loss wants the parts balanced otherwise.
"""

import fractions
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.core import base
from jaxbuf._src.core import host_add
from jaxbuf._src.core import random
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree


@flax.struct.dataclass
class MixtureSample:
  """A batch drawn from several buffers, part 0's rows first."""

  items: PyTree  # each leaf [S, ...]: every part's items, concatenated
  source: jax.Array  # int32 [S]: the part (buffer) each row came from
  weights: jax.Array  # float32 [S]: each part's own weights, in row order
  parts: tuple  # each buffer's own sample of its S_k rows
  # (ReplaySample, SequenceSample, ...)
  mask: jax.Array | None = None  # bool [S, L]: each part's own `mask`
  # (sequence, episode replay), concatenated; True on every step of a part
  # without one; None when no part has one
  lengths: jax.Array | None = None  # int32 [S]: each part's own `lengths`
  # (episode replay), concatenated; L (every step) for a part without one;
  # None when no part has one


def rows_per_part(batch_size: int, proportions: Sequence[float]) -> tuple[int, ...]:
  """The rows of each part in a batch of `batch_size`: `(S_0, ..., S_{K-1})`.

  Largest remainder, in exact arithmetic (the module notes): the counts sum
  to `batch_size` and each is within one row of its exact share.

  >>> import jaxbuf
  >>> halves = jaxbuf.mixture([jaxbuf.uniform_replay(8)] * 2, [0.5, 0.5])
  >>> thirds = jaxbuf.mixture([jaxbuf.uniform_replay(8)] * 3, [1, 1, 1])
  >>> halves.rows(7), thirds.rows(10), thirds.rows(2)
  ((4, 3), (4, 3, 3), (1, 1, 0))
  """
  validation.check_batch_size(batch_size, what="mixture rows")
  exact = [fractions.Fraction(float(p)) for p in _checked_proportions(proportions)]
  total = sum(exact)
  shares = [batch_size * p / total for p in exact]
  rows = [math.floor(share) for share in shares]
  left_over = batch_size - sum(rows)
  by_remainder = sorted(range(len(shares)), key=lambda k: (-(shares[k] - rows[k]), k))
  for k in by_remainder[:left_over]:
    rows[k] += 1
  return tuple(rows)


def _checked_proportions(proportions: Any) -> tuple[float, ...]:
  """`proportions` as floats; raises naming the entry that is not a finite
  non-negative real, or when none is positive."""
  if isinstance(proportions, (str, bytes)) or not isinstance(proportions, (Sequence, np.ndarray)):
    raise TypeError(
      f"mixture: proportions must be a sequence of numbers, one "
      f"per buffer, given {validation.describe(proportions)}."
    )
  checked = []
  for k, value in enumerate(proportions):
    validation.check_hyperparameter(value, f"mixture: proportions[{k}]")
    checked.append(float(value))
  if not any(checked):
    raise ValueError(
      f"mixture: proportions are all 0, given {checked}; at "
      f"least one part must have a positive share."
    )
  return tuple(checked)


def _name(buffer: Buffer) -> str:
  return buffer.kind.name if buffer.kind is not None else "buffer"


def _devices(buffer: Buffer) -> int:
  """How many devices a `jaxbuf.sharded` buffer splits over; 1 otherwise."""
  if buffer.kind is None:
    return 1
  return dict(buffer.kind.settings).get("devices", 1)


def _check_states(states: Any, buffers: Sequence[Buffer], *, what: str) -> None:
  if not isinstance(states, (list, tuple)) or len(states) != len(buffers):
    given = (
      f"{len(states)} states" if isinstance(states, (list, tuple)) else validation.describe(states)
    )
    raise TypeError(
      f"{what}: states must be a list of one state per buffer "
      f"({len(buffers)}, in the order of the buffers), given {given}."
    )


def _check_rows_split(rows: tuple[int, ...], buffers: Sequence[Buffer], *, what: str) -> None:
  """A sharded part samples a multiple of its devices; name the part."""
  batch_size = sum(rows)
  for k, (buffer, count) in enumerate(zip(buffers, rows)):
    devices = _devices(buffer)
    if count % devices:
      raise ValueError(
        f"{what}: part {k} ({_name(buffer)}) gets {count} of the "
        f"{batch_size} rows, which do not divide by its {devices} devices; "
        f"choose a batch size whose rows per part (mixture.rows) divide by "
        f"{devices}, or proportions that give it such a share."
      )


def _abstract_parts(
  states: Sequence[Any], keys: Sequence[jax.Array], rows: tuple[int, ...], buffers: Sequence[Buffer]
) -> list:
  """Each part's sample as shapes and dtypes, computed before any draw.

  A part with no rows is shaped at the smallest batch it can draw (its
  devices), so its items are checked whatever the batch size.
  `checkify.checkify`: a checked buffer's sample stages checks that an
  abstract evaluation cannot otherwise trace.
  """
  abstract = []
  for buffer, state, key, count in zip(buffers, states, keys, rows):
    drawn = checkify.checkify(
      lambda s, k, buffer=buffer, count=count: buffer.sample(s, k, count or _devices(buffer))
    )
    abstract.append(jax.eval_shape(drawn, state, key)[1])
  return abstract


def _leaves_by_path(tree: PyTree) -> dict[str, Any]:
  return {
    jax.tree_util.keystr(path) or "<root>": leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _check_items_agree(samples: Sequence[Any], buffers: Sequence[Buffer], *, what: str) -> None:
  """Raises unless every part's sampled items have part 0's structure, row
  shapes and dtypes: `TypeError` (structure, dtype) or `ValueError` (shape)
  naming the part, its kind and the leaf path, part 0's value and its own."""
  reference = _leaves_by_path(samples[0].items)
  reference_structure = jax.tree_util.tree_structure(samples[0].items)
  for k, (drawn, buffer) in enumerate(zip(samples, buffers)):
    if k == 0:
      continue
    given = _leaves_by_path(drawn.items)
    part = f"{what}: part {k} ({_name(buffer)}) samples items unlike part 0's ({_name(buffers[0])})"
    structure = jax.tree_util.tree_structure(drawn.items)
    if structure != reference_structure:  # type: ignore[operator]
      missing = [path for path in reference if path not in given]
      unexpected = [path for path in given if path not in reference]
      # Same leaf paths under other node types (a dict for a NamedTuple):
      # the structures themselves say how.
      detail = "; ".join(
        f"{name} leaves {', '.join(paths)}"
        for name, paths in (("missing", missing), ("unexpected", unexpected))
        if paths
      ) or (f"expected {reference_structure}, given {structure}")
      raise TypeError(f"{part}: tree structure differs: {detail}.")
    for path, leaf in given.items():
      expected = reference[path]
      if leaf.shape[1:] != expected.shape[1:]:
        raise ValueError(
          f"{part}: leaf {path} has rows of shape {leaf.shape[1:]}, "
          f"expected {expected.shape[1:]} as part 0's."
        )
      if leaf.dtype != expected.dtype:
        raise TypeError(
          f"{part}: leaf {path} has dtype {leaf.dtype}, expected "
          f"{expected.dtype} as part 0's; cast one part's items where they "
          f"are added."
        )


def _part_keys(key: jax.Array, count: int) -> list[jax.Array]:
  """`[fold_in(key, k) for k < count]`, each part's key, hashed once.

  On CPU XLA would fuse the hash of a folded key into every kernel that
  reads the key, and redo it per element: measured at C = 20k, the mixed
  sample of two parts cost 13 us more than its parts' own samples, with the
  key hashes about 7 times over in the program (`random.computed_once`).
  """
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  words = jax.random.key_data(key) if typed else key

  def hashed():
    folded = [random.fold_in(key, k) for k in range(count)]
    return jnp.stack([jax.random.key_data(part) if typed else part for part in folded])

  parts = random.computed_once(hashed, (words[0] >> 1).astype(jnp.int32))
  if typed:
    return [jax.random.wrap_key_data(part, impl=jax.random.key_impl(key)) for part in parts]
  return list(parts)


def _empty_like(abstract: Any) -> Any:
  """A part's sample type with no rows: every leaf `[0, ...]`."""
  return jax.tree.map(lambda leaf: jnp.zeros((0, *leaf.shape[1:]), leaf.dtype), abstract)


def _concatenated(trees: Sequence[PyTree]) -> PyTree:
  return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *trees)


def _joined_masks(parts: Sequence[Any]) -> tuple[jax.Array | None, jax.Array | None]:
  """The parts' `mask` `[S_k, L]` and `lengths` `[S_k]` concatenated in row
  order, or None where no part has the field. A part without a mask reads as
  all steps data (True), without lengths as L: its rows are whole windows."""
  masks = [getattr(part, "mask", None) for part in parts]
  if all(mask is None for mask in masks):
    return None, None
  steps = next(mask for mask in masks if mask is not None).shape[1:]
  rows = [part.weights.shape[0] for part in parts]
  mask = jnp.concatenate(
    [
      jnp.ones((count, *steps), bool) if part_mask is None else part_mask
      for part_mask, count in zip(masks, rows)
    ]
  )
  lengths = [getattr(part, "lengths", None) for part in parts]
  if all(length is None for length in lengths):
    return mask, None
  full = steps[0] if steps else 1
  return mask, jnp.concatenate(
    [
      jnp.full((count,), full, jnp.int32) if length is None else length.astype(jnp.int32)
      for length, count in zip(lengths, rows)
    ]
  )


def sample(
  states: Sequence[Any],
  key: jax.Array,
  batch_size: int,
  *,
  buffers: Sequence[Buffer],
  proportions: Sequence[float],
) -> MixtureSample:
  """Draws `batch_size` rows, each part's share from its own buffer.

  Every part's items are checked against part 0's (structure, row shapes,
  dtypes) from their shapes alone, before anything is drawn.

  Args:
    states: one state per buffer, in the order of `buffers`.
    key: a PRNG key; part k draws with `fold_in(key, k)`.
    batch_size: S, a Python int.
    buffers: the parts' buffers.
    proportions: each part's share, non-negative, normalised by their sum.

  Returns:
    A `MixtureSample`: items `[S, ...]` (part 0's rows first), source int32
    `[S]`, weights float32 `[S]`, parts (each buffer's own sample of its
    `rows_per_part(S, proportions)[k]` rows).
  """
  return _drawn(
    states, key, batch_size, buffers=buffers, proportions=proportions, what="mixture.sample"
  )[1]


def take(
  states: Sequence[Any],
  key: jax.Array,
  batch_size: int,
  *,
  buffers: Sequence[Buffer],
  proportions: Sequence[float],
) -> tuple[list | tuple, MixtureSample]:
  """The draw `sample` makes, through each part's own `take`: each part's
  state after its draw (its rows counted as sampled, a queue's handed out).

  Args:
    states, key, batch_size, buffers, proportions: as for `sample`.

  Returns:
    `(states, batch)`: the states, each part's after its own `take` (a part
    with no rows as given), a list or a tuple as `states` was; and the
    `MixtureSample` that `sample` would draw from the same states and key.
    One state given for several parts (`[s, s]`, the same arrays) is taken
    from by each in turn, each from the state the one before left, and the
    last is returned for each; inside a jit of your own the parts cannot
    tell that their states are one, so pass it once there.
  """
  return _drawn(
    states, key, batch_size, buffers=buffers, proportions=proportions, what="mixture.take"
  )


def _drawn(
  states: Sequence[Any],
  key: jax.Array,
  batch_size: int,
  *,
  buffers: Sequence[Buffer],
  proportions: Sequence[float],
  what: str,
) -> tuple[list | tuple, MixtureSample]:
  """`sample` (the parts' `sample`) or `take` (their `take`), named by `what`."""
  _check_states(states, buffers, what=what)
  validation.check_key(key, what=what)
  validation.check_batch_size(batch_size, what=what)
  rows = rows_per_part(batch_size, proportions)
  _check_rows_split(rows, buffers, what=what)
  keys = _part_keys(key, len(buffers))
  abstract = _abstract_parts(states, keys, rows, buffers)
  _check_items_agree(abstract, buffers, what=what)
  # One state given for several parts (one queue drawn twice) is taken from
  # by each of them in turn, and returned for each, as an update does.
  owners = _owners(states) if what == "mixture.take" else list(range(len(states)))
  current, parts_drawn = list(states), []
  for k, (buffer, part_key, count, shapes) in enumerate(zip(buffers, keys, rows, abstract)):
    if not count:
      parts_drawn.append(_empty_like(shapes))
    elif what == "mixture.take":
      current[owners[k]], part = buffer.take(current[owners[k]], part_key, count)
      parts_drawn.append(part)
    else:
      parts_drawn.append(buffer.sample(states[k], part_key, count))
  parts = _placed_together(parts_drawn, buffers)
  after = [current[owner] for owner in owners]
  source = np.repeat(np.arange(len(buffers), dtype=np.int32), rows)
  mask, lengths = _joined_masks(parts)
  return (tuple(after) if isinstance(states, tuple) else after), MixtureSample(
    items=_concatenated([part.items for part in parts]),
    source=jnp.asarray(source),
    weights=jnp.concatenate([part.weights for part in parts]),
    parts=parts,
    mask=mask,
    lengths=lengths,
  )


def _placed_together(parts: Sequence[Any], buffers: Sequence[Buffer]) -> tuple:
  """The parts' samples, where they can be joined: drawn one part at a time
  (a take with a sharded part), every part's rows are copied onto the
  sharded part's mesh, whole on every device (rows, not states)."""
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(parts)):
    return tuple(parts)
  meshes = [
    jax.tree.leaves(part)[0].sharding.mesh
    for part, buffer in zip(parts, buffers)
    if buffer.kind is not None and "devices" in dict(buffer.kind.settings)
  ]
  if not meshes:
    return tuple(parts)
  whole = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())
  return tuple(jax.device_put(part, whole) for part in parts)


def update_priorities(
  states: Sequence[Any],
  batch: MixtureSample,
  priorities: jax.Array,
  *,
  buffers: Sequence[Buffer],
  proportions: Sequence[float],
) -> list | tuple:
  """Sends each part's rows of `priorities [S]` to its own buffer.

  Part k's rows (`batch.source == k`, a contiguous block) update its buffer
  with its own sample's `indices` and `item_ids`, exactly as
  `buffers[k].update_priorities(states[k], batch.parts[k].indices, ...,
  batch.parts[k].item_ids)` would: a uniform part is left as it is, an item
  or window overwritten since it was drawn is skipped, as each kind skips it.

  Args:
    states: one state per buffer, as given to `sample`.
    batch: the `MixtureSample` drawn from these states.
    priorities: float `[S]`, one per row of `batch` (|TD error|, say).
    buffers, proportions: as for `sample`.

  Returns:
    The states, each part's updated by its own buffer; a list or a tuple as
    `states` was.
  """
  what = "mixture.update_priorities"
  _check_states(states, buffers, what=what)
  if not isinstance(batch, MixtureSample):
    raise TypeError(
      f"{what}: batch must be the MixtureSample that "
      f"mixture.sample drew, given {validation.describe(batch)}."
    )
  if len(batch.parts) != len(buffers):
    raise ValueError(
      f"{what}: batch has {len(batch.parts)} parts, this "
      f"mixture {len(buffers)}; pass the batch its own sample "
      f"drew."
    )
  rows = tuple(np.shape(part.weights)[0] for part in batch.parts)
  batch_size = sum(rows)
  if batch_size == 0 or rows != rows_per_part(batch_size, proportions):
    raise ValueError(
      f"{what}: batch has rows {rows} per part; this mixture draws "
      f"{rows_per_part(max(batch_size, 1), proportions)} in a batch of "
      f"{max(batch_size, 1)}. Pass the batch its own sample drew."
    )
  validation.check_shape(
    "priorities", priorities, (batch_size,), what=what, like="batch.source (one per row)"
  )
  validation.check_floating("priorities", priorities, what=what)
  if not isinstance(priorities, np.ndarray):  # NumPy: sliced on the host
    priorities = jnp.asarray(priorities)
  # One state given for several parts (one dataset drawn twice) is updated
  # by each of them in turn, and returned for each.
  owners = _owners(states)
  current, start = list(states), 0
  for k, (buffer, part, count) in enumerate(zip(buffers, batch.parts, rows)):
    if count:
      current[owners[k]] = buffer.update_priorities(
        current[owners[k]], part.indices, priorities[start : start + count], part.item_ids
      )
    start += count
  updated = [current[owner] for owner in owners]
  return tuple(updated) if isinstance(states, tuple) else updated


def _owners(states: Sequence[Any]) -> list[int]:
  """For each part, the first part given the same state (the same arrays)."""
  firsts: dict[int, int] = {}
  owners = []
  for k, state in enumerate(states):
    leaves = jax.tree.leaves(state)
    owners.append(firsts.setdefault(id(leaves[0]), k) if leaves else k)
  return owners


def _on_the_host(
  batch: MixtureSample, priorities: Any, buffers: Sequence[Buffer]
) -> tuple[MixtureSample, np.ndarray]:
  """The batch's unsharded parts and the priorities as NumPy, for an update
  part by part: the mixture's jitted sample laid every part's rows out over
  a sharded part's mesh, and each buffer takes host arrays onto its own
  devices."""
  parts = tuple(
    part if "devices" in dict(buffer.kind.settings if buffer.kind else ()) else jax.device_get(part)
    for part, buffer in zip(batch.parts, buffers)
  )
  return batch.replace(parts=parts), np.asarray(priorities)  # type: ignore[attr-defined]


def _updated_part_by_part(buffers: Sequence[Buffer]) -> Callable[[Sequence[Any]], bool]:
  """Whether an update must call each part's own (jitted) update in turn
  rather than one jit over all parts: with a sharded part (one jit would
  return the other parts' states laid out over its mesh), or one state
  given for several parts (one jit would donate its arrays twice)."""
  sharded = any("devices" in dict(buffer.kind.settings) for buffer in buffers if buffer.kind)

  def part_by_part(states: Sequence[Any]) -> bool:
    return sharded or len(set(_owners(states))) < len(states)

  return part_by_part


def can_sample(
  states: Sequence[Any], batch_size: int, *, buffers: Sequence[Buffer], proportions: Sequence[float]
) -> jax.Array:
  """Whether every part with rows in a batch of `batch_size` can sample
  them: bool `()`, each part asked with its own row count."""
  what = "mixture.can_sample"
  _check_states(states, buffers, what=what)
  validation.check_batch_size(batch_size, what=what)
  rows = rows_per_part(batch_size, proportions)
  _check_rows_split(rows, buffers, what=what)
  ready = [
    buffer.can_sample(state, count) for buffer, state, count in zip(buffers, states, rows) if count
  ]
  return functools.reduce(jnp.logical_and, ready)


class Mixture(NamedTuple):
  """A mixture's functions, its buffers and proportions bound.

  `sample(states, key, batch_size, step=None)` (a read-only peek),
  `take(states, key, batch_size, step=None) -> (states, batch)` (the same
  draw through each part's `take`: `jaxbuf.Buffer`),
  `update_priorities(states, batch, priorities)` and
  `can_sample(states, batch_size)` take the list of each buffer's state;
  `rows(batch_size)` gives each part's row count. `buffers` are the parts'
  own buffers (add to each with its own `add`), `proportions` the shares,
  normalised to sum to 1.
  """

  sample: Callable[..., MixtureSample]
  update_priorities: Callable[..., Any]
  can_sample: Callable[..., jax.Array]
  rows: Callable[[int], tuple[int, ...]]
  buffers: tuple[Buffer, ...]
  proportions: tuple[float, ...]
  take: Callable[..., tuple[Any, MixtureSample]]


def mixture(buffers: Sequence[Buffer], proportions: Sequence[float]) -> Mixture:
  """One sample from several buffers in fixed proportions.

  Args:
    buffers: K buffers (`jaxbuf.Buffer`) of any kinds whose sampled items agree in
      structure, row shapes and dtypes (uniform with prioritized item
      replay; sequence kinds of one window length; `jaxbuf.sharded` buffers,
      whose row counts must then divide by their devices). A part whose
      items differ is refused by `sample`, while tracing, naming the part
      and the leaf.
    proportions: K non-negative reals, not all 0, normalised by their sum.

  Returns:
    A `Mixture`. Its states are a list of each buffer's state; add to part
    k with `buffers[k].add`. `sample` and `can_sample` are jitted with
    `batch_size` static and `update_priorities` with the states donated, as
    each buffer's own functions are; inside your own jit they inline. With a
    checked buffer among the parts they stay unjitted, so that the checks
    raise at once (inside a jit, wrap your step in `checkify.checkify`): an
    empty checked part raises where an unchecked one gives weight-0 rows.

    Checkpoints: the states are a list of buffer states, which
    `jaxbuf.save(path, states)` writes as one checkpoint and
    `jaxbuf.load(path, like=[...])` reads back, `like` a list of each
    buffer's `init` (or `jax.eval_shape` of it). To reshard a sharded part
    over another number of devices, save and load each state at its own path.

  Offline data and online replay, half and half (RLPD):

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> offline = jaxbuf.uniform_replay(100)
  >>> online = jaxbuf.prioritized_replay(100)
  >>> mix = jaxbuf.mixture([offline, online], [0.5, 0.5])
  >>> item = {"obs": jnp.zeros(3)}
  >>> states = [offline.add(offline.init(item), {"obs": jnp.zeros((10, 3))}),
  ...           online.add(online.init(item), {"obs": jnp.ones((4, 3))})]
  >>> batch = mix.sample(states, jax.random.key(0), 5)
  >>> batch.items["obs"].shape, batch.source.tolist(), mix.rows(5)
  ((5, 3), [0, 0, 0, 1, 1], (3, 2))
  >>> states = mix.update_priorities(states, batch, jnp.arange(5.0))
  >>> bool(mix.can_sample(states, 5))
  True

  Saving and loading the states:

  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "mixture")
  >>> jaxbuf.save(path, states)
  >>> like = [jax.eval_shape(offline.init, item),
  ...         jax.eval_shape(online.init, item)]
  >>> restored = jaxbuf.load(path, like=like)
  >>> [int(state.size) for state in restored]
  [10, 4]
  """
  if isinstance(buffers, Buffer) or not isinstance(buffers, (list, tuple)):
    raise TypeError(
      f"mixture: buffers must be a list of jaxbuf.Buffer, given {validation.describe(buffers)}."
    )
  if not buffers:
    raise ValueError("mixture: buffers is empty; give at least one.")
  for k, buffer in enumerate(buffers):
    if not isinstance(buffer, Buffer):
      raise TypeError(
        f"mixture: buffers[{k}] must be a jaxbuf.Buffer (a replay buffer "
        f"such as jaxbuf.uniform_replay(...)), given "
        f"{type(buffer).__name__}."
      )
  proportions = _checked_proportions(proportions)
  if len(proportions) != len(buffers):
    raise ValueError(
      f"mixture: {len(proportions)} proportions for {len(buffers)} buffers; give one per buffer."
    )
  buffers = tuple(buffers)
  bound: dict[str, Any] = dict(buffers=buffers, proportions=proportions)
  # `documented`: help() shows each function's own docstring and signature.
  mixed_sample = base.documented(functools.partial(sample, **bound))
  mixed_update = base.documented(functools.partial(update_priorities, **bound))
  mixed_can_sample = base.documented(functools.partial(can_sample, **bound))
  mixed_take = base.documented(functools.partial(take, **bound))
  if not any(buffer.kind is not None and buffer.kind.checked for buffer in buffers):
    # The buffers' own wrappers: JAX's errors for a donated state or an
    # array batch size become jaxbuf's.
    mixed_sample = base._explained(  # pylint: disable=protected-access
      "mixture.sample", jax.jit(mixed_sample, static_argnames="batch_size"), batch_size_position=2
    )
    jitted_update = base._explained(  # pylint: disable=protected-access
      "mixture.update_priorities", jax.jit(mixed_update, donate_argnums=0)
    )
    part_by_part = _updated_part_by_part(buffers)
    each_part_update, each_part_take = mixed_update, mixed_take
    jitted_take = base._explained(  # pylint: disable=protected-access
      "mixture.take",
      jax.jit(each_part_take, static_argnames="batch_size", donate_argnums=0),
      batch_size_position=2,
    )

    @functools.wraps(each_part_take)
    def mixed_take(states, key, batch_size):
      # As for an update: a shared state would be donated twice by one jit,
      # and a sharded part would lay the other parts' states over its mesh.
      if part_by_part(states):
        return each_part_take(states, key, batch_size)
      return jitted_take(states, key, batch_size)

    mixed_take = base.with_jit_tools(mixed_take, jitted_take)

    @functools.wraps(mixed_update)
    def mixed_update(states, batch, priorities):
      # A list of priorities is the array it stands for (a jit would see
      # one leaf per entry), as for a buffer's own update.
      priorities = host_add.listed_array(priorities)
      if part_by_part(states):
        return each_part_update(states, *_on_the_host(batch, priorities, buffers))
      return jitted_update(states, batch, priorities)

    mixed_update = base.with_jit_tools(mixed_update, jitted_update)
    mixed_can_sample = base._explained(  # pylint: disable=protected-access
      "mixture.can_sample",
      jax.jit(mixed_can_sample, static_argnames="batch_size"),
      batch_size_position=1,
    )
  # Exact: a float sum of [1e308, 1e308] overflows to inf.
  exact = [fractions.Fraction(p) for p in proportions]
  return Mixture(
    sample=base._sampled_at_step(mixed_sample),  # pylint: disable=protected-access
    update_priorities=mixed_update,
    can_sample=mixed_can_sample,
    rows=base.documented(functools.partial(rows_per_part, proportions=proportions)),
    buffers=buffers,
    proportions=tuple(float(p / sum(exact)) for p in exact),
    take=base._sampled_at_step(mixed_take, "mixture.take"),  # pylint: disable=protected-access
  )
