"""Trace-time checks that a batch of items matches a buffer's item structure.

The checks read only shapes, dtypes and tree structure, so they run once while
tracing and cost nothing in the compiled program. Every message names the leaf
path (as `jax.tree_util.keystr` writes it), the expected and the given value.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.base import PyTree


def _paths(tree: PyTree) -> list[str]:
  return [jax.tree_util.keystr(path) for path, _ in
          jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_same_structure(expected: PyTree, given: PyTree, *, what: str) -> None:
  """Raises `TypeError` naming the missing and unexpected leaves of `given`."""
  expected_def = jax.tree_util.tree_structure(expected)
  given_def = jax.tree_util.tree_structure(given)
  if expected_def == given_def:
    return
  expected_paths, given_paths = _paths(expected), _paths(given)
  missing = [p for p in expected_paths if p not in given_paths]
  unexpected = [p for p in given_paths if p not in expected_paths]
  detail = (f"missing leaves {missing}, unexpected leaves {unexpected}"
            if missing or unexpected else
            f"expected {expected_def}, given {given_def}")
  raise TypeError(f"{what}: tree structure differs from the buffer's item: "
                  f"{detail}.")


def canonical_dtype(leaf: Any) -> np.dtype:
  """The dtype `jnp.asarray(leaf)` would have, without converting it."""
  if isinstance(leaf, jax.Array):  # JAX arrays and tracers: canonical already
    return leaf.dtype
  return jax.dtypes.canonicalize_dtype(jnp.result_type(leaf))


def check_batched_leaves(
    expected: PyTree,
    given: PyTree,
    *,
    what: str,
    batch_shape: tuple[int, ...] | None = None,
    num_batch_axes: int = 1,
) -> tuple[int, ...]:
  """Checks `given` is `expected` with `num_batch_axes` leading batch axes.

  Args:
    expected: pytree of arrays or `jax.ShapeDtypeStruct`, one unbatched item.
    given: pytree of arrays, the same structure with leading batch axes.
    what: the operation, for the message (e.g. "add").
    batch_shape: the required leading shape; `None` accepts any, provided
      every leaf has the same one.
    num_batch_axes: how many leading axes form the batch (when `batch_shape`
      is None).

  Returns:
    The leading batch shape shared by all leaves.

  Raises:
    TypeError: on a different tree structure or a leaf dtype that differs
      from the buffer's (no silent casts).
    ValueError: on a leaf shape that is not `batch_shape + item_shape`.
  """
  check_same_structure(expected, given, what=what)
  flat_expected = jax.tree_util.tree_leaves(expected)
  flat_given = jax.tree_util.tree_flatten_with_path(given)[0]
  if batch_shape is not None:
    num_batch_axes = len(batch_shape)
  for (path, leaf), reference in zip(flat_given, flat_expected):
    name = jax.tree_util.keystr(path) or "<root>"
    shape = tuple(np.shape(leaf))
    item_shape = tuple(reference.shape)
    leading = shape[:len(shape) - len(item_shape)] if item_shape else shape
    if (len(shape) != num_batch_axes + len(item_shape)
        or shape[num_batch_axes:] != item_shape
        or (batch_shape is not None and leading != tuple(batch_shape))):
      if batch_shape is not None:
        wanted = str(tuple(batch_shape) + item_shape)
      else:
        wanted = "(" + ", ".join(["B"] * num_batch_axes + list(map(str, item_shape))) + ")"
      raise ValueError(
          f"{what}: leaf {name} has shape {shape}, expected {wanted}: "
          f"{num_batch_axes} batch axes, then the item shape {item_shape}.")
    if batch_shape is None:
      batch_shape = leading
    dtype = canonical_dtype(leaf)
    if dtype != reference.dtype:
      raise TypeError(
          f"{what}: leaf {name} has dtype {dtype}, expected {reference.dtype}; "
          f"cast it explicitly if that is intended.")
  return tuple(batch_shape) if batch_shape is not None else ()


def check_index_batch(indices: Any, values: Any, *, what: str,
                      values_name: str = "priorities") -> None:
  """Checks `indices` is integer `[S]` and `values` is floating `[S]`."""
  index_shape, value_shape = np.shape(indices), np.shape(values)
  if len(index_shape) != 1:
    raise ValueError(f"{what}: indices must have shape [S], given {index_shape}.")
  if value_shape != index_shape:
    raise ValueError(f"{what}: {values_name} have shape {value_shape}, expected "
                     f"{index_shape} (one per index).")
  if not jnp.issubdtype(canonical_dtype(indices), jnp.integer):
    raise TypeError(f"{what}: indices must be integers, given dtype "
                    f"{canonical_dtype(indices)}.")
  if not jnp.issubdtype(canonical_dtype(values), jnp.floating):
    raise TypeError(f"{what}: {values_name} must be floating point, given dtype "
                    f"{canonical_dtype(values)}.")


def check_key(key: Any, *, what: str) -> None:
  """Accepts a typed key (`jax.random.key`) or a legacy uint32[2] PRNGKey."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) != ():
      raise ValueError(f"{what}: key must be a single key, given shape "
                       f"{np.shape(key)}; vmap over keys instead.")
    return
  if dtype == jnp.uint32 and np.shape(key) == (2,):
    return
  raise TypeError(f"{what}: key must be jax.random.key(...) or "
                  f"jax.random.PRNGKey(...), given {type(key).__name__} with "
                  f"dtype {dtype} and shape {np.shape(key)}.")


def check_python_int(value: Any, name: str, *, prefix: str = "",
                     reason: str = "") -> None:
  """Raises `TypeError` unless `value` is a Python (or NumPy) int, not a bool.

  Sizes set array shapes, so they must be known while tracing: an array, a
  float or a bool here is a mistake, not something to convert.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{prefix}{name} must be a Python int{reason}, given "
                    f"{type(value).__name__}.")


def check_positive_int(value: Any, name: str, *, prefix: str = "",
                       reason: str = "") -> None:
  """`check_python_int`, then `ValueError` unless `value > 0`."""
  check_python_int(value, name, prefix=prefix, reason=reason)
  if value <= 0:
    raise ValueError(f"{prefix}{name} must be positive, given {value}.")


def check_batch_size(batch_size: Any, *, what: str) -> None:
  check_positive_int(batch_size, "batch_size", prefix=f"{what}: ",
                     reason=" (it sets the output shape)")


def check_capacity(capacity: Any) -> None:
  check_python_int(capacity, "capacity")
  if not 0 < capacity < 2**30:
    raise ValueError(f"capacity must be in [1, 2**30), given {capacity}.")


def check_sample_args(size: jax.Array, key: jax.Array, batch_size: int,
                      *, checked: bool) -> None:
  """Checks a sample's key and batch size; in checked mode, that `size > 0`."""
  check_key(key, what="sample")
  check_batch_size(batch_size, what="sample")
  if checked:
    checkify.check(size > 0, "sample: the buffer is empty; add items "
                   "before sampling (guard with can_sample).")


def check_priority_update_args(indices: Any, priorities: Any,
                               item_ids: Any) -> None:
  """Shape and dtype checks of an update, from static information alone."""
  check_index_batch(indices, priorities, what="update_priorities")
  if item_ids is not None:
    if np.shape(item_ids) != np.shape(indices):
      raise ValueError(f"update_priorities: item_ids have shape "
                       f"{np.shape(item_ids)}, expected {np.shape(indices)}.")
    if canonical_dtype(item_ids) != jnp.uint32:
      raise TypeError("update_priorities: item_ids must be uint32, as "
                      "ReplaySample.item_ids; given "
                      f"{canonical_dtype(item_ids)}.")


# --- Arrays of an estimator or a minibatch helper: one message per mistake ---


def _given_dtype(value: Any) -> np.dtype:
  """`canonical_dtype`, or NumPy's dtype for what JAX cannot hold (strings)."""
  try:
    return canonical_dtype(value)
  except TypeError:
    return np.asarray(value).dtype


def check_floating(name: str, value: Any, *, what: str) -> None:
  """Raises `TypeError` unless `value` has a floating-point dtype."""
  dtype = _given_dtype(value)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{what}: {name} must be floating point, given dtype "
                    f"{dtype}.")


def check_flags(name: str, value: Any, *, what: str) -> None:
  """Raises `TypeError` unless `value` is bool or numbers (0/1 flags)."""
  dtype = _given_dtype(value)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)
          or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"{what}: {name} must be bool (or 0/1 numbers), given "
                    f"dtype {dtype}.")


def check_shape(name: str, value: Any, shape: tuple[int, ...], *, what: str,
                like: str = "") -> None:
  """Raises `ValueError` unless `value` has exactly `shape`.

  `like` names where the expected shape comes from (e.g. "values"), so the
  message says which of two disagreeing arguments set the rule.
  """
  given = tuple(np.shape(value))
  if given != tuple(shape):
    source = f" like {like}" if like else ""
    raise ValueError(f"{what}: {name} has shape {given}, expected "
                     f"{tuple(shape)}{source}.")


def check_scalar_or_shape(name: str, value: Any, shape: tuple[int, ...], *,
                          what: str, like: str) -> None:
  """A hyperparameter: a scalar, or one value per entry of `shape`.

  Raises `TypeError` unless it is a real number (bool is a mistake) and
  `ValueError` unless its shape is `()` or `shape`. A concrete scalar must
  also lie in [0, 1] (a discount or a lambda); per-entry arrays are not read
  here, since entries at padding may hold anything.
  """
  dtype = _given_dtype(value)
  if dtype == jnp.bool_ or not (jnp.issubdtype(dtype, jnp.floating)
                                or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"{what}: {name} must be a real number or array, given "
                    f"dtype {dtype}.")
  given = tuple(np.shape(value))
  if given not in ((), tuple(shape)):
    raise ValueError(f"{what}: {name} has shape {given}; expected a scalar "
                     f"or one value per step, shape {tuple(shape)} like {like}.")
  if given == () and not isinstance(value, jax.core.Tracer):
    number = float(np.asarray(value))
    if not 0.0 <= number <= 1.0:
      raise ValueError(f"{what}: {name} must be in [0, 1], given {number}.")
