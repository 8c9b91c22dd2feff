"""A sample budget per item: `max_times_sampled=N` on item replay.

Shape key: B add batch, S sample size, C capacity.

An item taken N times is retired: its leaf of the sum tree is set to 0, so
no later draw can reach it, and `live` (not `size`, which counts the slots
held, retired or not) counts the items that can still be drawn;
`can_sample(state, S)` is `live >= S`. Uniform replay with a budget keeps
the same tree with leaves 1 (live) and 0 (retired); prioritized replay
keeps its priorities there. Retirement is counted by `take`; `sample` is the
same draw as a read-only peek.

Draws. A take draws its S rows one after another, each from the items live
at that moment (a leaf set to 0 as its item's budget runs out, within the
call too): with N = 1, no item appears twice in one take, and over calls
every item is drawn at most once (sampling without replacement). Row t is
item i with probability `leaf_i / total` of the tree as it is at row t
(uniform over the live items; prioritized: successive sampling in
proportion to priority ** alpha, not stratified). When no live item is left
the remaining rows are padding: slot 0's item with weight 0, as an empty
buffer gives, item id 0 and index C (outside the items held, so
`update_priorities` skips it, as for `epoch_batches` padding); checked mode
raises on a buffer with no live item. Prioritized weights are
`(leaf_i / total_t) ** -beta` over the largest in the sample (1 for uniform).
How. Drawing from the items live after the earlier rows' retirements is
drawing from all of them and rejecting what the earlier rows spent: a take
makes 2S draws in one batched descent, accepts an item's k-th draw when k is
below its budget left, and keeps the first S accepted (`_accept_pool`,
O(S log C) and a sort of 2S). Only when that pool holds fewer than S
accepted draws (few items live, or fewer draws left than S) do the rows
after them run in sequence over the tree as it was, with what the call
retired kept in a small overlay beside it (`draw_rows`,
O(S^2 K log_K C) elementwise). Both are exact. The tree is written once,
O(S log C).

Priority updates of a retired item are skipped (it stays retired). The
budget is a count over the whole buffer, so `jaxbuf.sharded` refuses these
buffers (an unbudgeted item replay buffer splits).
"""

import functools
import inspect
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxbuf._src.core import kind
from jaxbuf._src.core import random
from jaxbuf._src.core import ring
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import Buffer, PyTree, ReplaySample, Schedule, bind
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.items import prioritized
from jaxbuf._src.items import uniform
from jaxbuf._src.selection import budget_kernels


@flax.struct.dataclass
class BudgetedReplayState(prioritized.PrioritizedReplayState):
  """A `PrioritizedReplayState` whose items each have a sample budget.

  The fields below add to the prioritized ones; `size` still counts the
  slots held (live or retired), `live` the items that can be drawn.
  Uniform replay with a budget holds leaves 1 and 0 in the tree.
  """

  times_sampled: jax.Array  # int32 [C]: takes of each slot's item so far
  live: jax.Array  # shape=(), int32: items held and not retired

  def joined(self):
    raise ValueError(_NOT_SPLIT)

  def divided(self, num_devices: int):
    raise ValueError(_NOT_SPLIT)


_NOT_SPLIT = (
  "a buffer with max_times_sampled counts each item's draws over the whole "
  "buffer and is not split over devices; uniform_replay and prioritized_replay "
  "without max_times_sampled are."
)


def check_max_times_sampled(value: Any) -> None:
  """Raises unless `value` is a Python int in [1, 2**31 - 1]."""
  validation.check_positive_int(
    value, "max_times_sampled", reason=" (draws of an item before it is retired)"
  )
  if value > 2**31 - 1:  # times_sampled is int32 on the device
    raise ValueError(
      f"max_times_sampled must be at most 2**31 - 1 = {2**31 - 1} (each item's draws are "
      f"counted in int32); given {value}. Use max_times_sampled=None for items drawn "
      f"however often."
    )


def init(example_item: PyTree, *, capacity: int) -> BudgetedReplayState:
  """An empty buffer with a sample budget per item."""
  base = prioritized.init(example_item, capacity=capacity)
  return BudgetedReplayState(
    **{name: getattr(base, name) for name in base.__dataclass_fields__ if name != "settings"},
    times_sampled=jnp.zeros((capacity,), jnp.int32),
    live=jnp.zeros((), jnp.int32),
  )


def add(
  state: BudgetedReplayState, items: PyTree, *, alpha: float, max_times_sampled: int
) -> BudgetedReplayState:
  """Adds `items [B, ...]` in ring order, each live with a full budget (at
  the running maximum priority; leaf 1 for uniform, alpha 0)."""
  validation.check_state_kind(state, BudgetedReplayState, what="add", exact=True)
  added, slots = ring.add_to_ring(state, items)
  was_live = (slots < state.size) & (state.times_sampled[slots] < max_times_sampled)
  tree, _ = sum_tree.write_leaves(
    state.sum_tree,
    slots,
    state.max_priority,
    unique_indices=True,
    leaf_values=lambda priority: prioritized.capped_leaf_values(priority, alpha, state.sum_tree),
  )
  return added.replace(
    sum_tree=tree,
    times_sampled=state.times_sampled.at[slots].set(0, unique_indices=True),
    live=state.live + slots.shape[0] - jnp.sum(was_live, dtype=jnp.int32),
  )


def _accept_pool(
  times_sampled: jax.Array,
  found: jax.Array,
  valid: jax.Array,
  batch_size: int,
  max_times_sampled: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The pool's accepted draws (`_draws`): drawing from the live items after
  the earlier draws' retirements is drawing from them all (in proportion to
  their leaves before the call) and rejecting a draw of an item whose budget
  the earlier accepted draws spent. An item's k-th draw in the pool is
  accepted when k is below its budget left (a stable sort by item ranks
  them); the first S accepted are the rows.

  Returns:
    int32 `[S]` the pool positions of the rows (0 past `count`), int32 `()`
    count (at most S), bool `[2S]` spends: the accepted draws that spend
    their item's last sample.
  """
  pool = found.shape[0]
  order = jnp.argsort(found, stable=True)
  grouped = found[order]
  position = jnp.arange(pool, dtype=jnp.int32)
  starts = jax.lax.cummax(jnp.where(grouped != jnp.roll(grouped, 1), position, 0))
  rank = jnp.zeros(pool, jnp.int32).at[order].set(position - starts, unique_indices=True)
  budget_left = max_times_sampled - times_sampled[found]
  accepted = valid & (rank < budget_left)
  picked = accepted & (jnp.cumsum(accepted) <= batch_size)
  spends = picked & (rank == budget_left - 1)
  (rows,) = jnp.nonzero(picked, size=batch_size, fill_value=0)
  return rows.astype(jnp.int32), jnp.sum(picked, dtype=jnp.int32), spends


def draw_rows(
  levels: tuple[jax.Array, ...],
  times_sampled: jax.Array,
  pool_found: jax.Array,
  pool_values: jax.Array,
  uniforms: jax.Array,
  *,
  batch_size: int,
  max_times_sampled: int,
) -> tuple[jax.Array, ...]:
  """A take's S rows, each from the items live after the rows before: the
  pool's accepted draws first (`_accept_pool`), then, when fewer than S,
  rows in sequence over the tree (`budget_kernels.sequence_step`, O(S^2 K
  log_K C) elementwise: few items live, or fewer draws left than S). Exact
  either way: the pool's accepted draws are the first rows of a sequential
  draw. The XLA form of `budget_kernels.draw_rows`.

  Args:
    levels: the sum tree's levels bottom-up (only read).
    times_sampled: int32 `[C]`.
    pool_found: int32 `[2S]`, the pool's slots, drawn from the tree.
    pool_values: float32 `[2S]`, their leaves (a draw of a zero leaf, from an
      empty tree, is not a valid draw).
    uniforms: float32 `[S, D]` for rows in sequence, D = max(L - 1, 1).
    batch_size: S.
    max_times_sampled: N.

  Returns:
    Per row: slots int32 `[S]` (0 where nothing was drawn), drawn bool,
    retired bool (True at the draw that spent an item's last sample), the
    row's share of the live mass it was drawn from float32 (`row_shares`);
    and the rows retired, int32 `()`.
  """
  mass = levels[-1][0]
  valid = (mass > 0) & (pool_values > 0)
  found = jnp.where(valid, pool_found, 0)
  rows, count, spends = _accept_pool(times_sampled, found, valid, batch_size, max_times_sampled)
  kept = jnp.arange(batch_size) < count
  given_slots = jnp.where(kept, found[rows], 0)
  given_retired = kept & spends[rows]
  carry = budget_kernels.initial_carry(batch_size, len(levels), count, given_slots, given_retired)
  step = functools.partial(
    budget_kernels.sequence_step,
    load=lambda level, node: levels[level][node],
    times_sampled_at=lambda slot: times_sampled[slot],
    uniform_at=lambda row, level: uniforms[row, level],
    num_levels=len(levels),
    branching=sum_tree.BRANCHING,
    max_times_sampled=max_times_sampled,
    count=count,
    given_slots=given_slots,
    given_retired=given_retired,
  )
  carry = jax.lax.cond(
    count >= batch_size,
    lambda carry: carry,
    lambda carry: jax.lax.fori_loop(0, batch_size, step, carry),
    carry,
  )
  slots, drawn, retired, values, masses = carry[2 * len(levels) + 1 :]
  pool_shares = budget_kernels.pool_shares(pool_values, mass, spends)
  shares = budget_kernels.row_shares(pool_shares[rows], count, drawn != 0, values, masses)
  return slots, drawn != 0, retired != 0, shares, jnp.sum(retired != 0, dtype=jnp.int32)


def _draws(
  state: BudgetedReplayState, key: jax.Array, batch_size: int, max_times_sampled: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """S draws, each from the items live after the ones before (`draw_rows`):
  slots int32 `[S]` (0 where nothing was drawn), drawn bool `[S]`, retired
  bool `[S]`, each row's share of the live mass float32 `[S]`, and the
  count retired int32 `()`."""
  pool = sum_tree.draw_leaves(state.sum_tree, key, 2 * batch_size, stratified=False)
  levels = state.sum_tree.levels
  uniforms = random.uniform_from_bits(
    random.random_bits(random.fold_in(key, 1), (batch_size, max(len(levels) - 1, 1)))
  )
  operands = (levels, state.times_sampled, pool.indices, pool.values, uniforms)
  settings: dict[str, Any] = dict(batch_size=batch_size, max_times_sampled=max_times_sampled)
  return sum_tree.choose_kernel(
    functools.partial(draw_rows, **settings),
    functools.partial(budget_kernels.draw_rows, branching=sum_tree.BRANCHING, **settings),
    *operands,
    kernel_variants=("pallas",),
  )


def take(
  state: BudgetedReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  max_times_sampled: int,
  beta: float | Schedule | None,
  checked: bool = False,
) -> tuple[BudgetedReplayState, ReplaySample]:
  """Draws `batch_size` rows one by one from the live items, counting each
  draw and retiring an item at its `max_times_sampled`-th (module notes).

  Args:
    state: a `BudgetedReplayState`.
    key: a PRNG key.
    batch_size: S, a Python int.
    max_times_sampled: N >= 1.
    beta: the importance-weight exponent or schedule; None for uniform
      replay (weights 1 on drawn rows).
    checked: if True, a buffer with no live item raises.

  Returns:
    `(state, sample)`: the state with the draws counted, and a
    `ReplaySample` (rows past the live items: slot 0's item, weight 0,
    index C, id 0).
  """
  validation.check_state_kind(state, BudgetedReplayState, what="take", exact=True)
  validation.check_key(key, what="take")
  validation.check_batch_size(batch_size, what="take")
  if checked:
    checkify.check(
      state.live > 0,
      "take: no live item (every item held was retired by max_times_sampled, or "
      "none was added); add items first (guard with can_sample).",
    )
  slots, drawn, retired, shares, retired_count = _draws(state, key, batch_size, max_times_sampled)
  # The take's counts and retirements, written once: O(S log C).
  tree, _ = sum_tree.write_leaves(
    state.sum_tree, slots, jnp.float32(0), retired, unique_indices=True
  )
  times_sampled = state.times_sampled.at[slots].add(drawn.astype(jnp.int32))
  live = state.live - retired_count
  if beta is None:
    weights = drawn.astype(jnp.float32)
  else:
    log_weights = -prioritized.beta_at(beta, state.beta_step, checked=checked) * jnp.log(shares)
    largest = jnp.max(jnp.where(drawn, log_weights, -jnp.inf))
    weights = jnp.where(drawn, jnp.exp(log_weights - largest), 0.0)
  batch = ReplaySample(
    items=ring.gather(state.storage, slots),
    indices=jnp.where(drawn, slots, ring.capacity_of(state.storage)),
    weights=weights,
    item_ids=jnp.where(drawn, ring.current_item_ids(state, slots), jnp.uint32(0)),
  )
  return state.replace(sum_tree=tree, times_sampled=times_sampled, live=live), batch


def sample(
  state: BudgetedReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  max_times_sampled: int,
  beta: float | Schedule | None,
  checked: bool = False,
) -> ReplaySample:
  """The rows `take` draws, as a read-only peek: nothing is counted.

  Args and returns as for `take`'s sample.
  """
  validation.check_state_kind(state, BudgetedReplayState, what="sample", exact=True)
  return take(
    state, key, batch_size, max_times_sampled=max_times_sampled, beta=beta, checked=checked
  )[1]


def update_priorities(
  state: BudgetedReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
  *,
  alpha: float | None,
  eps: float,
  checked: bool = False,
) -> BudgetedReplayState:
  """`prioritized.update_priorities`, skipping retired items (which stay
  retired); for uniform replay (`alpha` None) the identity, arguments
  validated."""
  validation.check_state_kind(state, BudgetedReplayState, what="update_priorities", exact=True)
  if alpha is None:
    validation.check_priority_update_args(indices, priorities, item_ids)
    return state
  indices = jnp.asarray(validation.host_indices(indices))
  slots = jnp.clip(indices.astype(jnp.int32), 0, ring.capacity_of(state.storage) - 1)
  # A retired item's leaf is 0 and stays 0: its updates are kept out of the
  # write (every occurrence of its slot), in the one write of the update.
  updated: BudgetedReplayState = prioritized.updated_priorities(  # type: ignore[assignment]
    state,
    indices,
    priorities,
    item_ids,
    alpha=alpha,
    eps=eps,
    checked=checked,
    kept_out=sum_tree.leaves(state.sum_tree)[slots] == 0,
  )
  return updated


def can_sample(state: BudgetedReplayState, batch_size: int) -> jax.Array:
  """Whether at least `batch_size` live items are held: bool `()`."""
  validation.check_batch_size(batch_size, what="can_sample")
  return state.live >= batch_size


def clear(state: BudgetedReplayState) -> BudgetedReplayState:
  """Empties the buffer without reallocating; budgets reset."""
  validation.check_state_kind(state, BudgetedReplayState, what="clear", exact=True)
  emptied: BudgetedReplayState = prioritized.clear(state)  # type: ignore[assignment]
  return emptied.replace(
    times_sampled=jnp.zeros_like(state.times_sampled), live=jnp.zeros_like(state.live)
  )


def budgeted_replay(
  capacity: int,
  *,
  max_times_sampled: int,
  alpha: float | None = None,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  checked: bool = False,
  name: str = "uniform_replay",
) -> Buffer[BudgetedReplayState, ReplaySample]:
  """Item replay whose items are retired after `max_times_sampled` takes:
  uniform (`alpha` None) or prioritized. Module notes."""
  validation.check_capacity(capacity)
  check_max_times_sampled(max_times_sampled)
  if alpha is not None:
    validation.check_hyperparameter(alpha, "alpha")
    validation.check_hyperparameter(eps, "eps", positive=True)
    if not callable(beta):
      validation.check_hyperparameter(beta, "beta (or a schedule)")
  drawing: dict[str, Any] = dict(
    max_times_sampled=max_times_sampled, beta=None if alpha is None else beta, checked=checked
  )
  recorded: dict[str, Any] = dict(capacity=capacity, max_times_sampled=max_times_sampled)
  if alpha is not None:
    recorded.update(alpha=float(alpha), eps=float(eps))
  return bind(
    init=functools.partial(init, capacity=capacity),
    add=functools.partial(
      add, alpha=0.0 if alpha is None else alpha, max_times_sampled=max_times_sampled
    ),
    sample=functools.partial(sample, **drawing),
    update_priorities=functools.partial(update_priorities, alpha=alpha, eps=eps, checked=checked),
    can_sample=can_sample,
    clear=clear,
    take=functools.partial(take, **drawing),
    kind=kind.Kind(
      name=f"{name} with max_times_sampled",
      state_type=BudgetedReplayState,
      exact_type=True,
      settings=kind.settings_of(**recorded),
      split=None,
    ),
    checked=checked,
    jit_update_priorities=alpha is not None,
  )


_BUDGET_DOC = """    max_times_sampled: None (the default: items are drawn however often),
      or N >= 1: an item taken N times (`buffer.take`) is retired, never
      drawn again, and not counted by `can_sample` (`state.live` counts the
      items that can be drawn, `state.size` the slots held). N = 1 is
      sampling without replacement, across calls and within one. The state
      is then a `BudgetedReplayState` and the buffer is not split by
      `jaxbuf.sharded` (`help(jaxbuf.budget)`).
"""


def with_max_times_sampled(factory: Callable, options: tuple[str, ...]) -> Callable:
  """`factory` (an item replay factory) that also takes `max_times_sampled=`:
  None makes the factory's own buffer; N a `budgeted_replay` buffer, which
  takes only `options` of the factory's other keywords (refusing the rest,
  naming them)."""

  # No default in `make`'s own parameters: Sphinx's autodoc_preserve_defaults
  # reads defaults from the source and would pair them with `__signature__`'s.
  @functools.wraps(factory)
  def make(capacity, *args, **keywords):
    max_times_sampled = keywords.pop("max_times_sampled", None)
    if max_times_sampled is None:
      return factory(capacity, *args, **keywords)
    check_max_times_sampled(max_times_sampled)
    refused = sorted(set(keywords) - set(options))
    if args or refused:
      raise TypeError(
        f"{factory.__name__}: max_times_sampled cannot be combined with "
        f"{', '.join(refused) or 'positional settings'}; with it the "
        f"{factory.__name__} takes {', '.join(options)} (keywords)."
      )
    keywords.pop("stratified", None)  # budgeted draws are sequential
    return budgeted_replay(
      capacity,
      max_times_sampled=max_times_sampled,
      name=factory.__name__,
      **({"alpha": keywords.pop("alpha", 0.6)} if "alpha" in options else {}),
      **keywords,
    )

  signature = inspect.signature(factory)
  parameters = list(signature.parameters.values())
  make.__signature__ = signature.replace(  # type: ignore[attr-defined]
    parameters=parameters[:-1]
    + [
      inspect.Parameter(
        "max_times_sampled", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=int | None
      ),
      parameters[-1],
    ]
  )
  doc = factory.__doc__ or ""
  make.__doc__ = doc.replace("    checked:", _BUDGET_DOC + "    checked:", 1)
  # The signature above is the whole truth: tools that follow `__wrapped__`
  # (Sphinx) would otherwise read the factory's, without max_times_sampled.
  del make.__wrapped__
  make.__annotations__ = {**factory.__annotations__, "max_times_sampled": int | None}
  return make


_uniform_replay = with_max_times_sampled(uniform.uniform_replay, ("checked",))
_prioritized_replay = with_max_times_sampled(
  prioritized.prioritized_replay, ("alpha", "beta", "eps", "stratified", "checked")
)


def _given_storage(storage: Any) -> dict[str, Any]:
  """`storage=` as a keyword only when it names a tier (the budgeted
  buffers refuse it: they live on the device)."""
  return {} if isinstance(storage, str) and storage == "device" else {"storage": storage}


# The public factories, typed: the wrappers above take any keywords, so
# type checkers would read their results as Any.
def uniform_replay(
  capacity: int,
  *,
  checked: bool = False,
  max_times_sampled: int | None = None,
  storage: Any = "device",
) -> Buffer[ReplayState, ReplaySample]:
  return _uniform_replay(
    capacity, checked=checked, max_times_sampled=max_times_sampled, **_given_storage(storage)
  )


def prioritized_replay(
  capacity: int,
  *,
  alpha: float = 0.6,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  stratified: bool = True,
  checked: bool = False,
  max_times_sampled: int | None = None,
  storage: Any = "device",
) -> Buffer[prioritized.PrioritizedReplayState, ReplaySample]:
  return _prioritized_replay(
    capacity,
    alpha=alpha,
    beta=beta,
    eps=eps,
    stratified=stratified,
    checked=checked,
    max_times_sampled=max_times_sampled,
    **_given_storage(storage),
  )


uniform_replay.__doc__ = _uniform_replay.__doc__
prioritized_replay.__doc__ = _prioritized_replay.__doc__
