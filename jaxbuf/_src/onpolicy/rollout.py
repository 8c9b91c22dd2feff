"""On-policy rollout storage: a time-major `[T, N, ...]` store of env steps.

Shape key: T rollout length (num_steps), N envs.

A step is any pytree: observations, actions as a dict of heads, per-head
log-probs and action masks, values, rewards, `terminated`, `truncated`,
bootstrap values for truncated steps, recurrent hidden states (e.g. LSTM
`(h, c)` per layer). Every env writes at its own position `step_counts[i]`, so
ragged collection (only some envs stepping) needs no Python bookkeeping:
`step_counts` is an int32 array in the state and `valid` `[T, N]` is derived
from it.

Conventions the advantage and minibatch functions expect:

* `terminated[t]` / `truncated[t]`: how the episode ended after step t. With
  auto-resetting envs, store `truncated_value[t] = V(final observation)`, the
  observation the reset replaced (`compute_gae(truncated_values=...)`).
* Recurrent state: store the hidden state the policy was fed at step t
  (before the step), so a minibatch sequence starting at t re-runs from it
  (`env_minibatches`, `sequence_chunks`).
* Shapes are fixed at `init`: `add` compares every leaf's shape and dtype
  while tracing and names the leaf path on a mismatch, so an action mask with
  the wrong number of actions, or a hidden state with an extra batch axis,
  fails before anything runs.

Writes touch N rows, so under `jax.jit(..., donate_argnums=0)` (the default
`RolloutBuffer.add`) the storage is updated in place, and `reset` only zeroes
`step_counts`. A whole rollout is typically collected in a `lax.scan` whose
carry holds the `RolloutState`.

A PPO loop cannot train on a stale rollout by forgetting `reset`: once every
env holds T steps, the next add starts a new rollout (see `add`). The one
case this cannot catch is a ragged rollout consumed before it is full: its
next adds continue the old columns, so call `reset` after reading a rollout
that may be partial.

The module-level functions take every setting explicitly; `rollout_buffer`
binds them into a `RolloutBuffer`.
"""

import functools
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.typing import ArrayLike

from jaxbuf._src.core import validation
from jaxbuf._src.core.base import BufferState, PyTree, with_jit_tools
from jaxbuf._src.core.host_add import listed_array


def valid_mask(step_counts: jax.Array, num_steps: int) -> jax.Array:
  """Which `[T, N]` slots hold a step of this rollout: `t < step_counts[n]`."""
  time = jnp.arange(num_steps, dtype=jnp.int32)
  return time[:, None] < step_counts[None, :]


@flax.struct.dataclass
class RolloutState(BufferState):
  """One rollout in progress. Every field is an array; nothing is static."""

  data: PyTree  # each leaf [T, N, *step_shape], the step's own dtype
  step_counts: jax.Array  # shape=(N,), int32: steps written per env, at most T

  @property
  def num_steps(self) -> int:
    """T, read from the storage (a Python int, static under jit)."""
    return jax.tree_util.tree_leaves(self.data)[0].shape[0]

  @property
  def valid(self) -> jax.Array:
    """bool `[T, N]`: True where a step of this rollout is stored.

    Ragged collection leaves each env's steps as a prefix of its column; the
    rest is padding (stale data from an earlier rollout, never zeroed). Pass
    this to `compute_gae(..., valid=)`, `normalize_advantages` and the
    minibatch helpers. For a vmapped batch of states, read it under vmap:
    `jax.vmap(lambda s: s.valid)(states)`.
    """
    return valid_mask(self.step_counts, self.num_steps)

  def buffer_dims(self) -> dict[str, Any]:
    batch_shape = np.shape(self.step_counts)[:-1]
    data = jax.tree_util.tree_leaves(self.data)[0]
    return {
      "vmapped buffers": list(batch_shape),
      "num_steps": int(np.shape(data)[len(batch_shape)]),
      "num_envs": int(np.shape(self.step_counts)[-1]),
    }


class RolloutAddFn(Protocol):
  """`rollout.add(state, steps, mask=None)`: steps `[N, ...]`; mask bool
  `[N]` (a list too), the envs that stepped, None for all."""

  def __call__(
    self, state: RolloutState, steps: PyTree, /, mask: ArrayLike | Sequence[bool] | None = None
  ) -> RolloutState: ...


class RolloutBuffer(NamedTuple):
  """The functions of a rollout buffer, its shape bound."""

  init: Callable[[PyTree], RolloutState]
  add: RolloutAddFn
  reset: Callable[[RolloutState], RolloutState]


def _check_sizes(num_steps: Any, num_envs: Any) -> None:
  validation.check_positive_int(num_steps, "num_steps")
  validation.check_positive_int(num_envs, "num_envs")
  # add indexes the storage as int32 rows of [(T + 1) * N].
  if (num_steps + 1) * num_envs >= 2**31:
    raise ValueError(
      f"num_steps * num_envs must be below 2**31 - num_envs, given {num_steps} * {num_envs}."
    )


def init(example_step: PyTree, *, num_steps: int, num_envs: int) -> RolloutState:
  """An empty rollout for steps shaped like `example_step` (one env, unbatched).

  Args:
    example_step: any pytree of arrays (or `jax.ShapeDtypeStruct` values); only
      shapes and dtypes are read.
    num_steps: T, a Python int.
    num_envs: N, a Python int.

  Returns:
    A `RolloutState` with data `[T, N, *leaf.shape]` (zeros, each leaf's dtype
    kept) and `step_counts` zero.
  """
  _check_sizes(num_steps, num_envs)
  if not jax.tree_util.tree_leaves(example_step):
    raise ValueError(
      "init: example_step has no array leaves; a rollout needs at least one (e.g. the reward)."
    )
  data = jax.tree.map(
    lambda leaf: jnp.zeros((num_steps, num_envs, *jnp.shape(leaf)), jnp.result_type(leaf)),
    example_step,
  )
  return RolloutState(data=data, step_counts=jnp.zeros((num_envs,), jnp.int32))


def add(
  state: RolloutState, steps: PyTree, mask: jax.Array | None = None, *, checked: bool = False
) -> RolloutState:
  """Writes one step for every env (or every env where `mask`) at its own position.

  Env i's step goes to row `step_counts[i]`, which then advances by one. Only
  N rows are touched, so under a donating jit the storage is updated in place.

  A full rollout starts over by itself. When every env holds T steps (the
  rollout a PPO update has just read), an add in which any env writes first
  resets every `step_counts` to 0, as `reset` would, so a loop that forgets
  `reset` still trains on fresh data each update. While some envs still have
  room (ragged collection), a write to an env that already holds T steps is
  dropped instead, never written over its own earlier steps or another
  env's, so "add with every env until all are full" fills every column;
  checked mode raises on such a dropped write.

  Args:
    state: the rollout.
    steps: the step pytree with a leading env axis, leaves `[N, *step_shape]`;
      structure, shapes and dtypes must match `init`'s example exactly
      (checked while tracing; errors name the leaf path; nothing is cast).
    mask: bool `[N]`, which envs write; None means all.
    checked: raise (via `checkify.check`) when a write is dropped: an env
      writing already holds T steps while another env has room.

  Returns:
    The new state.
  """
  num_steps, num_envs = state.num_steps, state.step_counts.shape[0]
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), state.data)
  validation.check_batched_leaves(spec, steps, what="add", batch_shape=(num_envs,))
  steps = jax.tree.map(jnp.asarray, steps)
  if mask is None:
    mask = jnp.ones((num_envs,), bool)
  else:
    if np.shape(mask) != (num_envs,):
      raise ValueError(
        f"add: mask has shape {np.shape(mask)}, expected ({num_envs},), one flag per env."
      )
    if validation.canonical_dtype(mask) != jnp.bool_:
      raise TypeError(f"add: mask must be bool, given dtype {validation.canonical_dtype(mask)}.")
    mask = jnp.asarray(mask)
  # A full rollout that receives a write starts over (every count to 0).
  starts_over = jnp.all(state.step_counts >= num_steps) & jnp.any(mask)
  step_counts = jnp.where(starts_over, 0, state.step_counts)
  has_room = step_counts < num_steps
  if checked:
    checkify.check(
      jnp.all(has_room | ~mask),
      "add: envs {envs} (where 1) are full, holding num_steps="
      f"{num_steps} steps, while other envs have room; their "
      "steps would be dropped. Mask them out (mask = "
      "state.step_counts < num_steps) or reset the rollout.",
      envs=(mask & ~has_room).astype(jnp.int32),
    )
  writes = mask & has_room
  # Scatter into the storage seen as [T * N, ...] rows (a free reshape): one
  # index per env is several times faster on CPU than a (row, column) pair.
  # Envs that do not write aim past the end, which mode="drop" discards; each
  # env hits its own column, so indices are unique.
  columns = jnp.arange(num_envs, dtype=jnp.int32)
  flat_rows = jnp.where(writes, step_counts, num_steps) * num_envs + columns

  def write(stored, new):
    flat = jnp.reshape(stored, (num_steps * num_envs, *stored.shape[2:]))
    flat = flat.at[flat_rows].set(new, mode="drop", unique_indices=True)
    return jnp.reshape(flat, stored.shape)

  data = jax.tree.map(write, state.data, steps)
  return state.replace(data=data, step_counts=step_counts + writes.astype(jnp.int32))


def reset(state: RolloutState) -> RolloutState:
  """Starts a new rollout: `step_counts` to 0, storage kept (not zeroed).

  Not needed after a full rollout (the next `add` starts over by itself);
  needed after reading a ragged rollout that some env had not filled.
  """
  return state.replace(step_counts=jnp.zeros_like(state.step_counts))


def rollout_buffer(num_steps: int, num_envs: int, *, checked: bool = False) -> RolloutBuffer:
  """A time-major rollout buffer of `num_steps` steps for each of `num_envs` envs.

  Args:
    num_steps: T, a Python int.
    num_envs: N, a Python int.
    checked: if True, a write that would be dropped (to an env already
      holding T steps while other envs have room) raises; the functions are
      then left unjitted, and inside your own jit you wrap the step in
      `jax.experimental.checkify.checkify`. Otherwise such a step is dropped
      (a documented no-op). Either way, an add to a rollout in which every
      env is full starts a new rollout.

  Returns:
    A `RolloutBuffer(init, add, reset)`. By default `add` and `reset` are
    jitted with the state donated: the state you pass in is consumed (updated
    in place) and you use the one returned.

  >>> import jax.numpy as jnp, jaxbuf
  >>> rollout = jaxbuf.rollout_buffer(num_steps=4, num_envs=2)
  >>> step = {"obs": jnp.zeros(3), "action": {"move": jnp.int32(0)},
  ...         "reward": jnp.float32(0.0)}
  >>> state = rollout.init(step)
  >>> state = rollout.add(state, {"obs": jnp.ones((2, 3)),
  ...                             "action": {"move": jnp.array([1, 2], jnp.int32)},
  ...                             "reward": jnp.array([0.5, 1.0], jnp.float32)},
  ...                     mask=jnp.array([True, False]))
  >>> state.data["obs"].shape, state.step_counts.tolist()
  ((4, 2, 3), [1, 0])
  >>> state.valid[:2].tolist()
  [[True, False], [False, False]]
  """
  _check_sizes(num_steps, num_envs)
  validation.check_bool(checked, "checked", what="rollout_buffer")
  # update_wrapper: help(rollout.add) shows add's docstring, not partial's.
  bound_init = functools.update_wrapper(
    functools.partial(init, num_steps=num_steps, num_envs=num_envs), init
  )
  bound_add = functools.update_wrapper(functools.partial(add, checked=checked), add)
  if checked:
    return RolloutBuffer(init=bound_init, add=bound_add, reset=reset)
  jitted_add = jax.jit(bound_add, donate_argnums=0)

  # A Python list given as the mask would reach the jit as one leaf per
  # entry; it becomes the array it stands for first, as for every buffer.
  @functools.wraps(add)
  def add_from_host(state, steps, mask=None):
    return jitted_add(state, steps, listed_array(mask))

  return RolloutBuffer(
    init=bound_init,
    add=with_jit_tools(add_from_host, jitted_add),
    reset=jax.jit(reset, donate_argnums=0),
  )
