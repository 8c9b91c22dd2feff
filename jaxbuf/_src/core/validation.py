"""Trace-time checks that a batch of items matches a buffer's item structure.

The checks read only shapes, dtypes and tree structure, so they run once while
tracing and cost nothing in the compiled program. Every message names the leaf
path (as `jax.tree_util.keystr` writes it), the expected and the given value.

Why one module of this size: every kind's entry checks, kept in one place so
that their messages read alike.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxbuf._src.core.kind import BufferState
from jaxbuf._src.core.pytypes import PyTree


def _paths(tree: PyTree) -> list[str]:
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _listed(paths: list[str], limit: int = 5) -> str:
  """At most `limit` paths, then how many more: one line, however many."""
  shown = ", ".join(paths[:limit])
  more = len(paths) - limit
  return shown + (f", ... and {more} more" if more > 0 else "")


def _check_no_python_sequences(expected: PyTree, given: PyTree, *, what: str) -> None:
  """Raises `TypeError` naming a leaf given as a Python list or tuple.

  JAX takes a list for a subtree of many leaves, so `[[1, 2], [3, 4]]` where
  an array belongs would otherwise be reported leaf by leaf.
  """
  try:
    expected_def: Any = jax.tree_util.tree_structure(expected)
    subtrees = expected_def.flatten_up_to(given)
  except (ValueError, TypeError):
    return  # differs above the leaves: the structure message says how
  for path, subtree in zip(_paths(expected), subtrees):
    if isinstance(subtree, (list, tuple)):
      raise TypeError(
        f"{what}: leaf {path or '<root>'} is "
        f"{describe(subtree)}; pass an array "
        f"(np.asarray(...)) of the leaf's dtype."
      )


def check_same_structure(expected: PyTree, given: PyTree, *, what: str) -> None:
  """Raises `TypeError` naming the missing and unexpected leaves of `given`."""
  expected_def: Any = jax.tree_util.tree_structure(expected)
  given_def = jax.tree_util.tree_structure(given)
  if expected_def == given_def:
    return
  _check_no_python_sequences(expected, given, what=what)
  expected_paths, given_paths = _paths(expected), _paths(given)
  missing = [p for p in expected_paths if p not in given_paths]
  unexpected = [p for p in given_paths if p not in expected_paths]
  parts = [
    f"{name} leaves {_listed(paths)}"
    for name, paths in (("missing", missing), ("unexpected", unexpected))
    if paths
  ]
  detail = ", ".join(parts) if parts else f"expected {expected_def}, given {given_def}"
  raise TypeError(f"{what}: tree structure differs from the buffer's item: {detail}.")


def canonical_dtype(leaf: Any) -> np.dtype:
  """The dtype `jnp.asarray(leaf)` would have, without converting it."""
  if isinstance(leaf, jax.Array):  # JAX arrays and tracers: canonical already
    return leaf.dtype
  if isinstance(leaf, (list, tuple)):  # jnp.result_type reads no lists
    leaf = np.asarray(leaf)
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
  leading_shapes = {}
  for (path, leaf), reference in zip(flat_given, flat_expected):
    name = jax.tree_util.keystr(path) or "<root>"
    shape = tuple(np.shape(leaf))
    item_shape = tuple(reference.shape)
    if num_batch_axes and shape == item_shape:
      raise ValueError(
        f"{what}: items have no batch axis: leaf {name} has shape {shape}, "
        f"the item shape; add a leading axis, e.g. items[None] "
        f"(jax.tree.map(lambda x: x[None], items) for a pytree)."
      )
    if len(shape) != num_batch_axes + len(item_shape) or shape[num_batch_axes:] != item_shape:
      raise ValueError(
        f"{what}: leaf {name} has shape {shape}, expected "
        f"{_wanted(batch_shape, num_batch_axes, item_shape)}: "
        f"{num_batch_axes} batch axes, then the item shape {item_shape}."
      )
    leading_shapes[name] = (shape[:num_batch_axes], shape, item_shape)
  _check_batch_shapes_agree(leading_shapes, batch_shape, what=what)
  for (path, leaf), reference in zip(flat_given, flat_expected):
    dtype = canonical_dtype(leaf)
    if dtype != reference.dtype:
      name = jax.tree_util.keystr(path) or "<root>"
      raise TypeError(
        f"{what}: leaf {name} has dtype {dtype}, expected {reference.dtype}; "
        f"cast it explicitly if that is intended."
      )
  if batch_shape is not None:
    return tuple(batch_shape)
  return next(iter(leading_shapes.values()))[0] if leading_shapes else ()


def _wanted(
  batch_shape: tuple[int, ...] | None, num_batch_axes: int, item_shape: tuple[int, ...]
) -> str:
  if batch_shape is not None:
    return str(tuple(batch_shape) + item_shape)
  return "(" + ", ".join(["B"] * num_batch_axes + list(map(str, item_shape))) + ")"


def _check_batch_shapes_agree(
  leading_shapes: dict[str, tuple], batch_shape: tuple[int, ...] | None, *, what: str
) -> None:
  """Raises `ValueError` naming the leaf whose batch shape is the odd one.

  With `batch_shape` given, any leaf without it. Otherwise the batch shape of
  most leaves is taken as meant and the others are blamed; with no majority
  every group is named, since none is more likely the mistake.
  """
  groups: dict[tuple, list[str]] = {}
  for name, (leading, _, _) in leading_shapes.items():
    groups.setdefault(leading, []).append(name)
  if batch_shape is not None:
    majority = tuple(batch_shape)
  elif len(groups) <= 1:
    return
  else:
    counts = sorted((len(names) for names in groups.values()), reverse=True)
    if counts[0] == counts[1]:
      described = "; ".join(f"{_listed(names)} {leading}" for leading, names in groups.items())
      raise ValueError(
        f"{what}: leaves disagree on the batch shape: "
        f"{described}. Every leaf needs the same leading "
        f"axes."
      )
    majority = max(groups, key=lambda leading: len(groups[leading]))
  for name, (leading, shape, item_shape) in leading_shapes.items():
    if leading != majority:
      others = (
        "" if batch_shape is not None else f" like the other leaves {_listed(groups[majority])}"
      )
      raise ValueError(
        f"{what}: leaf {name} has shape {shape}, expected "
        f"{majority + item_shape}: batch shape {majority}{others}, then the "
        f"item shape {item_shape}."
      )


def check_index_batch(
  indices: Any, values: Any, *, what: str, values_name: str = "priorities"
) -> None:
  """Checks `indices` is integer `[S]` and `values` is floating `[S]`."""
  index_shape, value_shape = np.shape(indices), np.shape(values)
  if len(index_shape) != 1:
    raise ValueError(f"{what}: indices must have shape [S], given {index_shape}.")
  if value_shape != index_shape:
    raise ValueError(
      f"{what}: {values_name} have shape {value_shape}, expected {index_shape} (one per index)."
    )
  if not jnp.issubdtype(canonical_dtype(indices), jnp.integer):
    raise TypeError(f"{what}: indices must be integers, given dtype {canonical_dtype(indices)}.")
  if not jnp.issubdtype(canonical_dtype(values), jnp.floating):
    raise TypeError(
      f"{what}: {values_name} must be floating point, given dtype {canonical_dtype(values)}."
    )


def check_key(key: Any, *, what: str) -> None:
  """Accepts a typed key (`jax.random.key`) or a legacy uint32[2] PRNGKey."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) != ():
      raise ValueError(
        f"{what}: key must be a single key, given shape {np.shape(key)}; vmap over keys instead."
      )
    return
  if dtype == jnp.uint32 and np.shape(key) == (2,):
    return
  # No repr: a tracer's names JAX internals (and a jitted `sample` sees
  # every key as one).
  given = (
    f"an array of dtype {dtype} and shape {np.shape(key)}"
    if isinstance(key, (jax.Array, np.ndarray))
    else f"{type(key).__name__} with dtype {dtype} and shape {np.shape(key)}"
  )
  raise TypeError(
    f"{what}: key must be jax.random.key(...) or jax.random.PRNGKey(...), given {given}."
  )


def check_step(step: Any, *, what: str) -> None:
  """Raises `TypeError` unless `step` is an integer scalar (not a bool)."""
  if (
    isinstance(step, bool)
    or np.shape(step) != ()
    or not jnp.issubdtype(_given_dtype(step), jnp.integer)
  ):
    raise TypeError(
      f"{what}: step must be an integer scalar (a Python int, "
      f"say the loop counter), given {describe(step)}."
    )


def describe(value: Any) -> str:
  """What `value` is, in a few words and without its repr (a tracer's repr
  is long and names JAX internals)."""
  if isinstance(value, jax.core.Tracer):
    return (
      f"a traced {value.dtype} of shape {value.shape} (an array computed inside jit, vmap or scan)"
    )
  if isinstance(value, (jax.Array, np.ndarray)):
    return f"an array of dtype {value.dtype} and shape {value.shape}"
  if isinstance(value, (list, tuple)):
    return f"a Python {type(value).__name__} of length {len(value)}"
  return type(value).__name__


def check_python_int(value: Any, name: str, *, prefix: str = "", reason: str = "") -> None:
  """Raises `TypeError` unless `value` is a Python (or NumPy) int, not a bool.

  Sizes set array shapes, so they must be known while tracing: an array, a
  float or a bool here is a mistake, not something to convert.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    hint = ""
    if isinstance(value, (jax.Array, np.ndarray)):
      hint = (
        " A size sets array shapes, so it must be known while tracing: "
        "pass a Python int (a constant, or `int(x)` outside jit)."
      )
    raise TypeError(f"{prefix}{name} must be a Python int{reason}, given {describe(value)}.{hint}")


def check_bool(value: Any, name: str, *, what: str) -> None:
  """Raises `TypeError` unless `value` is a Python (or NumPy) bool.

  A flag read with `if` takes any object's truth: the string "False" would
  switch the setting on, so nothing but a bool is accepted.
  """
  if not isinstance(value, (bool, np.bool_)):
    shown = f" {value!r}" if isinstance(value, (str, int, float)) else ""
    raise TypeError(
      f"{what}: {name} must be a bool (True or False), given {describe(value)}{shown}."
    )


def check_not_donated(state: Any, *, what: str) -> None:
  """Raises `ValueError` if an array of `state` was donated to an earlier call.

  Only concrete arrays can be deleted; tracers and other leaves pass.
  """
  for leaf in jax.tree_util.tree_leaves(state):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
      raise ValueError(
        f"{what}: the state passed in was donated to an earlier call, which "
        f"consumed its arrays (add, update_priorities and clear update the "
        f"storage in place; a from_minari or from_rlds_steps that raised "
        f"deletes the state it was given). Use the state that call "
        f"returned: `state = buffer.add(state, items)`."
      )


def check_on_the_states_devices(state: Any, arguments: tuple, *, what: str) -> None:
  """Raises `TypeError` when an argument spans more devices than the state.

  Indices from a `jaxbuf.sharded` buffer's sample, given to one buffer's
  update, are ids in another numbering; JAX would raise about mesh axes
  (Explicit) or the update would skip or misplace them silently (Auto).
  Concrete arrays only: inside a jit the placement is the caller's.
  """
  leaves = jax.tree_util.tree_leaves(state)
  if not leaves or not _concrete(leaves[0]):
    return
  state_devices = len(leaves[0].sharding.device_set)
  for argument in arguments:
    if _concrete(argument) and len(argument.sharding.device_set) > state_devices:
      raise TypeError(
        f"{what}: an argument is spread over "
        f"{len(argument.sharding.device_set)} devices (a jaxbuf.sharded "
        f"buffer's sample?), but the state is on {state_devices}: pass a "
        f"sharded buffer's sample to that buffer's {what}, whose ids number "
        f"its global buffer."
      )


def _concrete(value: Any) -> bool:
  return isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)


def check_positive_int(value: Any, name: str, *, prefix: str = "", reason: str = "") -> None:
  """`check_python_int`, then `ValueError` unless `value > 0`."""
  check_python_int(value, name, prefix=prefix, reason=reason)
  if value <= 0:
    raise ValueError(f"{prefix}{name} must be positive, given {value}.")


def check_batch_size(batch_size: Any, *, what: str) -> None:
  if isinstance(batch_size, jax.core.Tracer):  # most often `jax.jit(buffer.sample)`: name the fix
    raise TypeError(
      f"{what}: batch_size must be a Python int (it sets the output shape), given "
      f"{describe(batch_size)}. If you jitted the function yourself, mark it static: "
      f'`jax.jit(buffer.{what.rsplit(".", 1)[-1]}, static_argnames="batch_size")`.'
    )
  check_positive_int(
    batch_size, "batch_size", prefix=f"{what}: ", reason=" (it sets the output shape)"
  )


def check_capacity(capacity: Any) -> None:
  check_python_int(capacity, "capacity")
  if not 0 < capacity < 2**30:
    raise ValueError(f"capacity must be in [1, 2**30), given {capacity}.")


def check_sample_args(size: jax.Array, key: jax.Array, batch_size: int, *, checked: bool) -> None:
  """Checks a sample's key and batch size; in checked mode, that `size > 0`."""
  check_key(key, what="sample")
  check_batch_size(batch_size, what="sample")
  if checked:
    checkify.check(
      size > 0, "sample: the buffer is empty; add items before sampling (guard with can_sample)."
    )


def check_priority_update_args(indices: Any, priorities: Any, item_ids: Any) -> None:
  """Shape and dtype checks of an update, from static information alone."""
  check_index_batch(indices, priorities, what="update_priorities")
  if item_ids is not None:
    if np.shape(item_ids) != np.shape(indices):
      raise ValueError(
        f"update_priorities: item_ids have shape "
        f"{np.shape(item_ids)}, expected {np.shape(indices)}."
      )
    if canonical_dtype(item_ids) != jnp.uint32:
      raise TypeError(
        "update_priorities: item_ids must be uint32, as "
        "ReplaySample.item_ids; given "
        f"{canonical_dtype(item_ids)}."
      )


# --- Integers from the host: JAX would narrow them silently ------------------

_INT32_MAX = np.iinfo(np.int32).max


def _narrowed_host_integers(leaf: Any) -> tuple[np.ndarray, np.dtype] | None:
  """A host integer array JAX would store narrower (int64 as int32 with x64
  off), and that narrower dtype; None for anything else."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) or isinstance(leaf, bool):
    return None
  array = np.asarray(leaf)
  if array.dtype.kind not in "iu":
    return None
  narrow = jax.dtypes.canonicalize_dtype(array.dtype)
  return None if narrow == array.dtype else (array, narrow)


def check_host_integers(items: PyTree, *, what: str) -> None:
  """Raises `ValueError` for a host integer value its JAX dtype cannot hold.

  With 64-bit mode off JAX converts NumPy int64 data to int32 (uint64 to
  uint32) by wrapping: 2**40 would be stored as 0. Such data is accepted
  when every value fits, and refused, naming the leaf, when one does not.
  JAX arrays and tracers already have their final dtype and pass.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(items)[0]:
    narrowed = _narrowed_host_integers(leaf)
    if narrowed is None or narrowed[0].size == 0:
      continue
    array, narrow = narrowed
    limits = np.iinfo(narrow)
    low, high = array.min(), array.max()
    if low < limits.min or high > limits.max:
      bad = low if low < limits.min else high
      name = jax.tree_util.keystr(path) or "<root>"
      raise ValueError(
        f"{what}: leaf {name} holds {bad}, which does not fit {narrow}: with "
        f"64-bit mode off JAX stores {array.dtype} data as {narrow}, and the "
        f"value would wrap. Keep the values in range (or turn on "
        f"jax_enable_x64 and store {array.dtype})."
      )


def host_indices(indices: Any) -> Any:
  """Indices safe to hand to JAX: host int64/uint64 beyond int32 become -1.

  Indices that JAX would narrow (NumPy int64 or uint64 with x64 off) and
  that lie outside `[0, 2**31)` point at no slot of any accepted capacity;
  wrapped to 32 bits they could point at a real one. Marking them -1 keeps
  them out of range, so they are skipped (checked mode: raise) like any
  other index outside the items held. Anything else is returned as given.
  """
  narrowed = _narrowed_host_integers(indices)
  if narrowed is None:
    return indices
  array, _ = narrowed
  in_int32 = array <= _INT32_MAX
  if array.dtype.kind == "i":
    in_int32 &= array >= 0
  safe = np.full(array.shape, -1, np.int32)
  safe[in_int32] = array[in_int32]
  return safe


def check_state_kind(
  state: Any, expected: type, *, what: str, exact: bool = False, stacked: bool = False
) -> None:
  """Raises `TypeError` naming both kinds when `state` is another buffer's.

  `exact` refuses subclasses too: a prioritized state is a `ReplayState`
  with priorities, and uniform `add` would fill its slots without them.
  Unless `stacked`, a stack of states (`jaxbuf.sharded`'s, one per device,
  or many buffers' under `jax.vmap`) is refused too: JAX's own errors for
  it speak of loop conditions and shardings.
  """
  kind = type(state)
  if kind is expected or (not exact and isinstance(state, expected)):
    stack = (
      state.buffer_dims().get("vmapped buffers")
      if isinstance(state, BufferState) and not stacked
      else None
    )
    if stack:
      raise TypeError(
        f"{what}: given a stack of {stack[0] if len(stack) == 1 else stack} "
        f"states (every leaf has leading axes {tuple(stack)}): a "
        f"jaxbuf.sharded buffer's state (one per device) or many buffers' "
        f"states made under jax.vmap. Pass it to the functions of the buffer "
        f"that made it (the sharded buffer's), or jax.vmap these."
      )
    return
  raise TypeError(
    f"{what}: expected a {expected.__name__}, given a "
    f"{kind.__name__}; pass each buffer's state to its own "
    f"functions (uniform_replay's state to uniform_replay's)."
  )


def check_hyperparameter(value: Any, name: str, *, positive: bool = False) -> None:
  """Raises `ValueError` unless `value` is a finite real, >= 0 (or > 0)."""
  if isinstance(value, (str, bytes)):  # float("0.5") would read it
    raise TypeError(f"{name} must be a real number, given str {value!r}.")
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a real number, given {type(value).__name__}.") from None
  invalid = isinstance(value, bool) or not math.isfinite(number) or number < 0
  if invalid or (positive and number == 0):
    wanted = "positive" if positive else "non-negative"
    raise ValueError(f"{name} must be finite and {wanted}, given {value}.")


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
    raise TypeError(f"{what}: {name} must be floating point, given dtype {dtype}.")


def check_flags(name: str, value: Any, *, what: str) -> None:
  """Raises `TypeError` unless `value` is bool or numbers (0/1 flags), and
  `ValueError` where concrete numbers hold anything but 0 and 1 (0.5 would
  be read as True). Traced numbers cannot be read while tracing: every
  nonzero value is True there, as the docstrings of the callers say."""
  dtype = _given_dtype(value)
  if not (
    dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
  ):
    raise TypeError(f"{what}: {name} must be bool (or 0/1 numbers), given dtype {dtype}.")
  if dtype == jnp.bool_ or isinstance(value, jax.core.Tracer):
    return
  numbers = np.asarray(value)
  other = np.flatnonzero((numbers != 0) & (numbers != 1))
  if other.size:
    index = np.unravel_index(other[0], numbers.shape)
    raise ValueError(
      f"{what}: {name} holds {numbers[index]} at index "
      f"{tuple(int(i) for i in index)}; flags are bool or 0/1 numbers "
      f"(any other number would be read as True)."
    )


def check_shape(
  name: str, value: Any, shape: tuple[int, ...], *, what: str, like: str = ""
) -> None:
  """Raises `ValueError` unless `value` has exactly `shape`.

  `like` names where the expected shape comes from (e.g. "values"), so the
  message says which of two disagreeing arguments set the rule.
  """
  given = tuple(np.shape(value))
  if given != tuple(shape):
    source = f" like {like}" if like else ""
    raise ValueError(f"{what}: {name} has shape {given}, expected {tuple(shape)}{source}.")


def check_scalar_or_shape(
  name: str, value: Any, shape: tuple[int, ...], *, what: str, like: str
) -> None:
  """A hyperparameter: a scalar, or one value per entry of `shape`.

  Raises `TypeError` unless it is a real number (bool is a mistake) and
  `ValueError` unless its shape is `()` or `shape`. A concrete scalar must
  also lie in [0, 1] (a discount or a lambda); per-entry arrays are not read
  here, since entries at padding may hold anything.
  """
  dtype = _given_dtype(value)
  if dtype == jnp.bool_ or not (
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    raise TypeError(f"{what}: {name} must be a real number or array, given dtype {dtype}.")
  given = tuple(np.shape(value))
  if given not in ((), tuple(shape)):
    raise ValueError(
      f"{what}: {name} has shape {given}; expected a scalar "
      f"or one value per step, shape {tuple(shape)} like {like}."
    )
  if given == () and not isinstance(value, jax.core.Tracer):
    number = float(np.asarray(value))
    if not 0.0 <= number <= 1.0:
      raise ValueError(f"{what}: {name} must be in [0, 1], given {number}.")


def check_divides(count: int, num_devices: int, name: str, what: str) -> None:
  """Raises `ValueError` unless `count` splits evenly over the devices."""
  if count % num_devices:
    raise ValueError(
      f"{what}: {name} {count} does not divide by the {num_devices} devices "
      f"of the mesh axis; use a multiple of {num_devices}."
    )


def check_reward_and_terminated(reward: Any, terminated: Any, *, what: str) -> None:
  """Raises `ValueError` unless a step's `reward` is a float scalar and its
  `terminated` a bool scalar (the fields a stream kind computes targets
  from), naming the kind, the field, and the shape and dtype given."""
  if np.shape(reward) != () or not jnp.issubdtype(canonical_dtype(reward), jnp.floating):
    raise ValueError(
      f"{what}: step reward must be a float scalar, given "
      f"shape {np.shape(reward)} dtype "
      f"{canonical_dtype(reward)}."
    )
  if np.shape(terminated) != () or canonical_dtype(terminated) != jnp.bool_:
    raise ValueError(
      f"{what}: step terminated must be a bool scalar, given "
      f"shape {np.shape(terminated)} dtype "
      f"{canonical_dtype(terminated)}."
    )
