"""Adds from host NumPy sent as one transfer.

A jitted call pays for each array argument it converts (about 1.5 us a leaf
on CPU), so a bound `add` given NumPy items joins their bytes into one flat
array on the host and splits it again inside the jit
(`packed_add_from_host`). `bind` wraps every kind's `add` with it.

Shape key: B items in the batch.
"""

from typing import Any, Callable

import jax
import numpy as np

from jaxbuf._src.core import validation


def listed_array(value: Any) -> Any:
  """A plain Python list or tuple as a NumPy array; anything else as given
  (a NamedTuple is a pytree, not a list of numbers)."""
  if type(value) in (list, tuple):  # pylint: disable=unidiomatic-typecheck
    return np.asarray(value)
  return value


def host_layout(leaves: list[Any]) -> tuple[int, tuple] | None:
  """How NumPy leaves `[B, ...]` travel as one flat byte array.

  The leaves' bytes follow one another, each leaf whole and C-ordered: the
  array is `b"".join(leaf.tobytes() ...)`, which NumPy builds in a fraction
  of a microsecond where interleaving rows (`np.concatenate(..., axis=1)`)
  took several.

  Returns `(B, columns)`, a column `(dtype, start, stop, row shape)` per
  leaf, where `dtype` is the one JAX would give the leaf (int64 becomes
  int32 with 64-bit mode off) and `B * start`, `B * stop` bound its bytes;
  None where the leaves cannot be cut so (a leaf without a batch axis, batch
  sizes that differ, an empty batch or row), which the unpacked path then
  reports or handles.
  """
  if not leaves or any(leaf.ndim == 0 for leaf in leaves):
    return None
  batch_size = leaves[0].shape[0]
  if batch_size == 0:
    return None
  columns, start = [], 0
  for leaf in leaves:
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(leaf.dtype))
    row_bytes = int(np.prod(leaf.shape[1:], dtype=np.int64)) * dtype.itemsize
    if leaf.shape[0] != batch_size or row_bytes == 0:
      return None
    columns.append((dtype, start, start + row_bytes, leaf.shape[1:]))
    start += row_bytes
  return batch_size, tuple(columns)


def unpack(packed: jax.Array, batch_size: int, columns: tuple) -> list[jax.Array]:
  """The leaves `[B, ...]` of a flat byte array (`host_layout`)."""
  leaves = []
  for dtype, start, stop, row_shape in columns:
    column = packed[batch_size * start : batch_size * stop].reshape(batch_size, stop - start)
    batch_shape = (batch_size, *row_shape)
    if dtype == np.bool_:
      leaves.append((column != 0).reshape(batch_shape))
    elif dtype.itemsize == 1:
      leaves.append(jax.lax.bitcast_convert_type(column, dtype).reshape(batch_shape))
    else:
      leaves.append(
        jax.lax.bitcast_convert_type(column.reshape(batch_size, -1, dtype.itemsize), dtype).reshape(
          batch_shape
        )
      )
  return leaves


def packed_add_from_host(add: Callable, jitted_add: Callable) -> Callable:
  """`add(state, items, ...)` that sends NumPy items as one array.

  A jitted call pays for each array argument it converts (about 1.5 us a
  leaf on CPU) and checks host integers leaf by leaf. Here the NumPy leaves
  are converted to the dtypes JAX would give them, joined as bytes into one
  flat array, and split again inside the jit, where
  `add`'s trace-time checks see the same shapes and dtypes as unpacked
  (so their messages are unchanged). Int64 leaves narrowed to int32 (64-bit
  mode off) are compared with their narrowed copy, so a value that would
  wrap still raises. Anything other than NumPy arrays takes `jitted_add`.
  """
  # Per tree structure, 64-bit mode, leaf shapes and dtypes: the dtype each
  # leaf converts to (None: kept) and the jitted add that unpacks them;
  # None: not packable.
  plans: dict[tuple, tuple | None] = {}

  def plan(leaves: list[np.ndarray], treedef: Any) -> tuple | None:
    layout = host_layout(leaves)
    if layout is None:
      return None
    batch_size, columns = layout

    def unpacking_add(state, packed, *args, **kwargs):
      items = jax.tree_util.tree_unflatten(treedef, unpack(packed, batch_size, columns))
      return add(state, items, *args, **kwargs)

    conversions = tuple(
      None if leaf.dtype == dtype else dtype for leaf, (dtype, *_) in zip(leaves, columns)
    )
    return conversions, jax.jit(unpacking_add, donate_argnums=0)

  def add_from_host(state, items, *args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten(items)
    try:
      signature = (
        treedef,
        jax.config.jax_enable_x64,
        tuple([(type(leaf), leaf.shape, leaf.dtype) for leaf in leaves]),
      )
      found = plans.get(signature, False)
    except AttributeError:  # a Python number or list: not packable
      found = None
    if found is False:
      packable = all(type(leaf) is np.ndarray for leaf in leaves)  # pylint: disable=unidiomatic-typecheck
      found = plans[signature] = plan(leaves, treedef) if packable else None
    if found is None:
      validation.check_host_integers(items, what="add")
      return jitted_add(state, items, *args, **kwargs)
    conversions, unpacking_add = found
    parts = []
    for leaf, dtype in zip(leaves, conversions):
      if dtype is not None:
        converted = leaf.astype(dtype)
        # Integers narrowed (int64 to int32) must survive the round trip;
        # bytes compare faster than np.array_equal at these sizes.
        if dtype.kind in "iu" and (converted.astype(leaf.dtype).tobytes() != leaf.tobytes()):
          validation.check_host_integers(items, what="add")  # raises
        leaf = converted
      parts.append(leaf.tobytes())
    return unpacking_add(state, np.frombuffer(b"".join(parts), np.uint8), *args, **kwargs)

  return add_from_host
