"""Priority updates of the stream kinds: which updates apply, and how they are written.

Shape key: S updates, C capacity (steps over all envs), L sequence_length.

A stream kind keeps its priorities in its window tree, one leaf per id in
`[0, C)`: a window id (sequence and hindsight replay) or a transition id
(frame-stack replay), both `env * R + slot` of a first step. The update
rules are the same for both, and differ from item replay's
(`ring.valid_priority_updates`) only in what an id names:

* An update applies when its id is in `[0, C)` and names what can be sampled
  now (`sequence.window_ids_valid`, `frames.transition_ids_valid`), its
  priority is finite, and (given `item_ids`) the id still starts at the
  step that was sampled. A negative priority applies by its magnitude, as in
  item replay. Checked mode raises on ids outside `[0, C)` and on priorities
  that are not finite or are negative; an id that is no longer held is
  skipped in both modes (it is what a stale update is).
* The uniform kinds validate their updates alike and write nothing, so
  switching kinds surfaces no new errors.
* An applied update sets the id's leaf to `(|priority| + eps) ** alpha`,
  raises the running maximum that new windows enter at, and counts a step of
  the beta schedule (`with_window_priorities`).

Below `sequence.py`: the functions here take the state's own validity and
item-id reads as arguments, so every stream kind, sequence replay's uniform
`update_priorities` included, calls them.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.core import ring
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.items import prioritized
from jaxbuf._src.core.base import PyTree

_INT32_MAX = jnp.iinfo(jnp.int32).max


def check_window_priorities(indices: Any, priorities: Any) -> None:
  """Raises `ValueError` for per-step priorities `[S, L]`, naming the helper
  that reduces them to the one priority per window `[S]` a buffer takes."""
  index_shape, priority_shape = np.shape(indices), np.shape(priorities)
  if len(index_shape) == 1 and len(priority_shape) == 2 and priority_shape[0] == index_shape[0]:
    raise ValueError(
      f"update_priorities: priorities have shape {priority_shape}, one per "
      f"step of each window; a sequence buffer takes one priority per "
      f"window, shape {index_shape}. Reduce them first, e.g. "
      f"jaxbuf.r2d2_priorities(td_errors, sample.mask) (R2D2's "
      f"eta * max + (1 - eta) * mean of |TD error| over the valid steps)."
    )


def valid_updates(
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None,
  *,
  num_ids: int,
  ids_valid: Callable[[jax.Array], jax.Array],
  item_ids_of: Callable[[jax.Array], jax.Array],
  id_name: str,
  checked: bool,
) -> jax.Array:
  """Which updates apply: bool `[S]`. Validates shapes while tracing.

  Args:
    indices, priorities, item_ids: the update, `[S]` each (`item_ids` None
      to skip the staleness check).
    num_ids: C, the ids in the window tree.
    ids_valid: int32 ids `[S]` (any value) -> bool `[S]`, each names what
      can be sampled now (False out of range).
    item_ids_of: int32 ids `[S]` in `[0, C)` -> uint32 `[S]`, the id of the
      step each starts at now.
    id_name: what the ids are, for checked mode's message ("window ids").
    checked: raise on ids outside `[0, C)` and on priorities that are not
      finite or are negative.
  """
  validation.check_priority_update_args(indices, priorities, item_ids)
  indices = jnp.asarray(validation.host_indices(indices))
  priorities = jnp.asarray(priorities)
  in_range = ring.indices_in_range(indices, jnp.int32(num_ids))
  finite = jnp.isfinite(priorities)
  if checked:
    checkify.check(
      jnp.all(in_range),
      f"update_priorities: indices must be {id_name}, in [0, capacity={{capacity}}); "
      "given {indices}",
      capacity=jnp.int32(num_ids),
      indices=indices,
    )
    checkify.check(
      jnp.all(finite & (priorities >= 0)),
      "update_priorities: "
      "priorities must be finite and non-negative (pass "
      "|TD error|); given {priorities}",
      priorities=priorities,
    )
  valid = in_range & finite & ids_valid(indices.astype(jnp.int32))
  if item_ids is not None:
    safe = jnp.where(in_range, indices.astype(jnp.int32), 0)
    valid &= item_ids_of(safe) == item_ids
  return valid


def with_window_priorities(
  state: PyTree,
  indices: jax.Array,
  priorities: jax.Array,
  valid: jax.Array,
  *,
  alpha: float,
  eps: float,
) -> PyTree:
  """`state` with windows `indices [S]` at `|priorities [S]| + eps` where
  `valid [S]`: its window tree, running maximum and beta step updated (for
  every kind whose state holds those three, frame stacks included)."""
  indices = jnp.asarray(indices).astype(jnp.int32)
  new_priorities = jnp.where(valid, jnp.abs(jnp.asarray(priorities).astype(jnp.float32)) + eps, 0.0)
  return state.replace(
    window_tree=sum_tree.set_leaves(
      state.window_tree,
      jnp.where(valid, indices, 0),
      prioritized.capped_leaf_values(new_priorities, alpha, state.window_tree),
      valid,
    ),
    # `initial`: an empty update leaves the maximum as it is.
    max_priority=jnp.maximum(state.max_priority, jnp.max(new_priorities, initial=0.0)),
    beta_step=jnp.minimum(state.beta_step, _INT32_MAX - 1) + 1,
  )
