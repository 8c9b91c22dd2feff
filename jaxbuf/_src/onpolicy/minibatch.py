"""Shuffled minibatches of a rollout for the epochs of a PPO update.

Shape key: T rollout length, N envs, M minibatches, B minibatch size
(`T * N / M`), L sequence length, E sequences per minibatch.

Every function takes the key as an argument and has static output shapes, so
an epoch is a `lax.scan` over minibatches and the epochs a `lax.scan` over
keys, all in one jitted update:

>>> import jax, jax.numpy as jnp, jaxbuf
>>> batch = {"obs": jnp.ones((8, 4, 3)), "advantage": jnp.zeros((8, 4))}
>>> def epoch(total, key):
...   minibatches = jaxbuf.shuffled_minibatches(key, batch, num_minibatches=2)
...   def update(total, minibatch):   # a gradient step in real code
...     return total + minibatch["obs"].sum(), None
...   return jax.lax.scan(update, total, minibatches)[0], None
>>> total, _ = jax.lax.scan(epoch, 0.0, jax.random.split(jax.random.key(0), 3))
>>> float(total)   # 3 epochs, each step seen once per epoch
288.0
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core import random
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import PyTree


class SequenceMinibatches(NamedTuple):
  """Minibatches of env sequences for recurrent policies, time order kept."""

  data: PyTree  # each leaf [M, L, E, ...], time-major within a minibatch
  initial_hidden: PyTree  # each leaf [M, E, ...]: the hidden state stored at
  # each sequence's first step
  valid: jax.Array  # bool [M, L, E]: False at padding


def _leading_shape(tree: PyTree, num_axes: int, *, what: str) -> tuple[int, ...]:
  """The leading shape every leaf shares; raises naming the first that differs."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves:
    raise ValueError(f"{what}: the batch has no leaves.")
  first_path, first = leaves[0]
  leading = tuple(np.shape(first)[:num_axes])
  for path, leaf in leaves:
    shape = tuple(np.shape(leaf))
    if len(shape) < num_axes or shape[:num_axes] != leading:
      raise ValueError(
        f"{what}: leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
        f"{shape}; every leaf must start with the same {num_axes} axes as "
        f"leaf {jax.tree_util.keystr(first_path) or '<root>'}, {leading}."
      )
  return leading


def _check_divides(total: int, parts: Any, *, what: str, total_name: str, parts_name: str) -> None:
  validation.check_python_int(
    parts, parts_name, prefix=f"{what}: ", reason=" (it sets the output shape)"
  )
  if parts <= 0 or total % parts:
    raise ValueError(
      f"{what}: {parts_name}={parts} must be positive and divide {total_name}={total}."
    )


def shuffled_minibatches(
  key: jax.Array, data: PyTree, *, num_minibatches: int, num_batch_axes: int = 2
) -> PyTree:
  """Shuffles every step of a rollout into `num_minibatches` equal minibatches.

  The leading `num_batch_axes` axes (`[T, N]` by default) are flattened and
  permuted, so each step lands in exactly one minibatch per call. Shapes are
  static, so padding steps of a ragged rollout are shuffled along too: put
  `RolloutState.valid` in `data` and weight the loss by it.

  Args:
    key: a `jax.random.key`, split by the caller once per epoch.
    data: pytree whose leaves all start with the same `num_batch_axes` axes,
      e.g. `[T, N, ...]`.
    num_minibatches: M, a Python int dividing the number of steps.
    num_batch_axes: how many leading axes are flattened into steps.

  Returns:
    `data` with leaves `[M, B, ...]`, B = steps / M.
  """
  validation.check_key(key, what="shuffled_minibatches")
  validation.check_positive_int(num_batch_axes, "num_batch_axes", prefix="shuffled_minibatches: ")
  leading = _leading_shape(data, num_batch_axes, what="shuffled_minibatches")
  num_items = int(np.prod(leading))
  _check_divides(
    num_items,
    num_minibatches,
    what="shuffled_minibatches",
    total_name="steps",
    parts_name="num_minibatches",
  )
  order = random.permutation(key, num_items)

  def shuffle(leaf):
    leaf = jnp.reshape(jnp.asarray(leaf), (num_items, *jnp.shape(leaf)[num_batch_axes:]))
    leaf = leaf.at[order].get(mode="promise_in_bounds", unique_indices=True)
    return jnp.reshape(leaf, (num_minibatches, num_items // num_minibatches, *leaf.shape[1:]))

  return jax.tree.map(shuffle, data)


def sequence_chunks(
  key: jax.Array,
  data: PyTree,
  hidden: PyTree,
  *,
  chunk_length: int,
  num_minibatches: int,
  valid: jax.Array | None = None,
) -> SequenceMinibatches:
  """Cuts every env's column into chunks of `chunk_length` steps and shuffles them.

  Chunk c of env n covers steps `[c * L, (c + 1) * L)` in time order; the
  `(T / L) * N` chunks are shuffled into `num_minibatches` minibatches of E
  chunks each. Each chunk comes with the stored hidden state at its first
  step, from which a recurrent policy re-runs the chunk. Episodes may end
  inside a chunk: reset the hidden state on the stored done flags while
  re-running, as during collection.

  Args:
    key: a `jax.random.key`.
    data: pytree of `[T, N, ...]` leaves.
    hidden: pytree of `[T, N, ...]` leaves, the recurrent state fed to the
      policy at each step (as stored in the rollout; often `data["hidden"]`).
    chunk_length: L, a Python int dividing T.
    num_minibatches: M, a Python int dividing `(T / L) * N`.
    valid: bool `[T, N]` (`RolloutState.valid`), or None when all are valid.

  Returns:
    A `SequenceMinibatches`: data `[M, L, E, ...]`, initial_hidden
    `[M, E, ...]`, valid `[M, L, E]`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> data = {"obs": jnp.zeros((8, 4, 3)), "hidden": jnp.zeros((8, 4, 16))}
  >>> minibatches = jaxbuf.sequence_chunks(
  ...     jax.random.key(0), data, data["hidden"], chunk_length=4,
  ...     num_minibatches=2)
  >>> minibatches.data["obs"].shape, minibatches.initial_hidden.shape
  ((2, 4, 4, 3), (2, 4, 16))
  """
  what = "sequence_chunks"
  validation.check_key(key, what=what)
  num_steps, num_envs = _leading_shape(data, 2, what=what)
  hidden_leading = _leading_shape(hidden, 2, what=what + " (hidden)")
  if hidden_leading != (num_steps, num_envs):
    raise ValueError(
      f"{what}: hidden leaves start with {hidden_leading}, "
      f"expected [T, N] = {(num_steps, num_envs)} like data."
    )
  if valid is None:
    valid = jnp.ones((num_steps, num_envs), bool)
  else:
    validation.check_flags("valid", valid, what=what)
    validation.check_shape("valid", valid, (num_steps, num_envs), what=what, like="[T, N] of data")
  _check_divides(num_steps, chunk_length, what=what, total_name="T", parts_name="chunk_length")
  num_chunks = num_steps // chunk_length
  num_sequences = num_chunks * num_envs
  _check_divides(
    num_sequences,
    num_minibatches,
    what=what,
    total_name="(T / chunk_length) * N",
    parts_name="num_minibatches",
  )
  sequences_per_minibatch = num_sequences // num_minibatches
  order = random.permutation(key, num_sequences)

  def as_sequences(leaf):
    """`[T, N, ...]` -> `[L, C * N, ...]`; sequence c * N + n: chunk c, env n."""
    rest = jnp.shape(leaf)[2:]
    leaf = jnp.reshape(jnp.asarray(leaf), (num_chunks, chunk_length, num_envs, *rest))
    return jnp.reshape(jnp.swapaxes(leaf, 0, 1), (chunk_length, num_sequences, *rest))

  def shuffle(leaf):
    """`[T, N, ...]` -> `[M, L, E, ...]`."""
    leaf = as_sequences(leaf)
    leaf = leaf.at[:, order].get(mode="promise_in_bounds", unique_indices=True)
    leaf = jnp.reshape(
      leaf, (chunk_length, num_minibatches, sequences_per_minibatch, *leaf.shape[2:])
    )
    return jnp.swapaxes(leaf, 0, 1)

  def first_steps(leaf):
    """`[T, N, ...]` -> `[M, E, ...]`, the leaf at each sequence's first step."""
    starts = as_sequences(leaf)[0]
    starts = starts.at[order].get(mode="promise_in_bounds", unique_indices=True)
    return jnp.reshape(starts, (num_minibatches, sequences_per_minibatch, *starts.shape[1:]))

  return SequenceMinibatches(
    data=jax.tree.map(shuffle, data),
    initial_hidden=jax.tree.map(first_steps, hidden),
    valid=shuffle(jnp.asarray(valid).astype(bool)),
  )


def env_minibatches(
  key: jax.Array,
  data: PyTree,
  hidden: PyTree,
  *,
  num_minibatches: int,
  valid: jax.Array | None = None,
) -> SequenceMinibatches:
  """Shuffles whole env columns into minibatches, keeping time order.

  The recurrent-PPO split: each minibatch holds `E = N / M` complete env
  sequences of length T, with the stored hidden state at step 0 of each.
  Equal to `sequence_chunks` with `chunk_length = T`.

  Args:
    key: a `jax.random.key`.
    data: pytree of `[T, N, ...]` leaves.
    hidden: pytree of `[T, N, ...]` leaves, the recurrent state fed to the
      policy at each step.
    num_minibatches: M, a Python int dividing N.
    valid: bool `[T, N]`, or None when all are valid.

  Returns:
    A `SequenceMinibatches`: data `[M, T, E, ...]`, initial_hidden
    `[M, E, ...]`, valid `[M, T, E]`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> data = {"obs": jnp.zeros((8, 4, 3))}
  >>> hidden = (jnp.zeros((8, 4, 16)), jnp.zeros((8, 4, 16)))  # LSTM (h, c)
  >>> minibatches = jaxbuf.env_minibatches(jax.random.key(0), data, hidden,
  ...                                      num_minibatches=2)
  >>> minibatches.data["obs"].shape, minibatches.initial_hidden[0].shape
  ((2, 8, 2, 3), (2, 2, 16))
  """
  num_steps = _leading_shape(data, 2, what="env_minibatches")[0]
  return sequence_chunks(
    key, data, hidden, chunk_length=num_steps, num_minibatches=num_minibatches, valid=valid
  )
