"""Row proxies: how a kind's own pure functions run with their payload elsewhere.

Shape key: B add batch, S sample size, F storage rows (C for item replay,
N * R for streams), n rows given to one add.

A payload leaf of a tiered buffer is, in the device state, a proxy: int32
`[*lead, 1, ..., 1]` (the storage's leading axes, then a 1 for each axis of
the row), holding 0 for a row never written and, for a row written,

    value = 1 + row + F * lap,   lap in [0, K), K = (2**31 - 1) // F,

`lap` counting the row's writes modulo K (`laps_for`). The host tier keeps
K = 1 (every value is `row + 1`); the disk tier's files keep each row's lap
too, so a read compares the state's lap with the files' and never pairs a
state with rows written after it (`disk`). The kind's `add`, `sample` and
the rest run unchanged on that state, so everything they decide (which slots
an add fills, which rows a sample draws, which frames of a stack are
padding) is decided on the device by the same pure code as for
`storage="device"`, and the samples are the same bit for bit:

* `add`: each payload row given becomes a token `-(1 + j)` (j its position
  among the n rows given); the kind writes the tokens where it writes rows.
  The slots that now hold a token are the rows written, and the token says
  which row given went there (`written_rows`). The proxies are then set to
  their next lap (`settle`). Finding them compares the proxy, 4 bytes a row:
  O(F) on the device per add, the one cost that follows the capacity (a
  10M-row proxy is 40 MB, read once per add); the payload itself is touched
  only at the n rows.
* `sample`: the kind gathers proxies where it gathers rows, and masks them
  where it masks rows (padding frames become 0); the value or 0 comes out
  where each payload row goes, and the tier reads those rows (0: zeros).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core.pytypes import PyTree

PROXY_DTYPE = jnp.int32
_PROXY_MAX = int(np.iinfo(np.int32).max)


def laps_for(rows: int) -> int:
  """K, the laps a row's proxy value tells apart: the most that keep
  `1 + row + F * lap` within int32 (1 when F > 2**30)."""
  return max(1, _PROXY_MAX // max(rows, 1))


def decoded(values: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Proxy values (host, any shape) -> (row, lap) each; -1 for a value 0."""
  values = np.asarray(values).astype(np.int64)
  held = values > 0
  row = np.where(held, (values - 1) % max(rows, 1), -1)
  lap = np.where(held, (values - 1) // max(rows, 1), -1)
  return row, lap


def proxy_example(example: PyTree, paths: tuple[str, ...]) -> PyTree:
  """`example` with each payload leaf replaced by the unbatched proxy int32
  `[1, ..., 1]` (one 1 per axis of the row)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: (
      np.zeros((1,) * np.ndim(leaf), np.int32) if jax.tree_util.keystr(path) in paths else leaf
    ),
    example,
  )


def num_rows(proxy: jax.Array, lead_dims: int) -> int:
  """F, the rows a proxy stands for (static)."""
  return int(np.prod(proxy.shape[:lead_dims], dtype=np.int64))


def tokens_for(leaf: Any, row_rank: int, start: int) -> tuple[jax.Array, tuple[int, ...]]:
  """Tokens int32 `[*batch, 1, ..., 1]` for a payload leaf `[*batch, *row]`:
  `-(1 + j)` for j numbered from `start` in row-major order; and the batch
  shape."""
  batch_shape = tuple(np.shape(leaf)[: np.ndim(leaf) - row_rank])
  count = int(np.prod(batch_shape, dtype=np.int64))
  if start + count >= _PROXY_MAX:
    raise ValueError(
      f"storage: {start + count} payload rows given to one add; int32 row "
      f"proxies number at most {_PROXY_MAX - 1}: add fewer rows at a time."
    )
  tokens = -(1 + np.arange(start, start + count, dtype=np.int64))
  return jnp.asarray(tokens.astype(np.int32).reshape(batch_shape + (1,) * row_rank)), batch_shape


def _whole(flat: jax.Array) -> jax.Array:
  """A sharded buffer's flat proxy (Explicit mesh axes) gathered whole, as
  `nonzero`'s cumsum and a gather at any row need; 4 bytes a row per add."""
  sharding = jax.typeof(flat).sharding
  if any(axis is not None for axis in getattr(sharding, "spec", ())):
    whole = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.reshard(flat, whole)
  return flat


def written_rows(after: jax.Array, *, rows: int, given: int) -> tuple[jax.Array, jax.Array]:
  """The rows an add wrote and which given row each holds.

  Args:
    after: a proxy after the add (F elements), holding tokens `-(1 + j)`
      at the rows written and a value or 0 elsewhere.
    rows: F.
    given: n, the rows given to the add (a static bound on those written).

  Returns:
    rows written, int32 `[n]`, padded with F (out of range); and for each,
    j, the given row it holds, int32 `[n]` (0 for padding).
  """
  flat = _whole(after.reshape(-1))
  (written,) = jnp.nonzero(flat < 0, size=given, fill_value=rows)
  written = written.astype(jnp.int32)
  held = written < rows
  tokens = flat.at[written].get(mode="fill", fill_value=-1)
  return written, jnp.where(held, -tokens - 1, 0)


def next_values(before: jax.Array, written: jax.Array, *, rows: int, laps: int) -> jax.Array:
  """The values the rows `written [n]` (padding F) take after an add: each
  row's next lap after the one `before` (the proxy before the add) held;
  lap 0 for a row never written. int32 `[n]`."""
  old = _whole(before.reshape(-1)).at[written].get(mode="fill", fill_value=0)
  lap = jnp.where(old > 0, (old - 1) // rows + 1, 0) % laps
  return (1 + written + rows * lap).astype(PROXY_DTYPE)


def settle(proxy: jax.Array, written: jax.Array, values: jax.Array) -> jax.Array:
  """The proxy with each written row set to its value (padding F dropped)."""
  shape = proxy.shape
  flat = proxy.reshape(-1)
  sharding = jax.typeof(flat).sharding
  # A sharded buffer's proxy keeps its split (Explicit mesh axes name it).
  out_sharding = (
    jax.sharding.NamedSharding(sharding.mesh, sharding.spec)
    if any(axis is not None for axis in getattr(sharding, "spec", ()))
    else None
  )
  return flat.at[written].set(values, mode="drop", out_sharding=out_sharding).reshape(shape)


def row_axes(proxy_sample: Any, row_rank: int, stack_axis: int | None) -> tuple[int, ...]:
  """The axes of a sampled proxy that stand for the row's own axes: the last
  `row_rank` ones, or, for a stacked frame leaf `[S, *frame with K at
  stack_axis]`, every axis after the first but K's."""
  ndim = np.ndim(proxy_sample)
  if stack_axis is None:
    return tuple(range(ndim - row_rank, ndim))
  stack_position = 1 + stack_axis % (row_rank + 1)
  return tuple(axis for axis in range(1, ndim) if axis != stack_position)


def rows_of(proxy_sample: Any, axes: tuple[int, ...]) -> Any:
  """The sampled proxy with its row axes (all 1) dropped: a value or 0."""
  return proxy_sample.reshape(
    [n for axis, n in enumerate(np.shape(proxy_sample)) if axis not in axes]
  )


def placed(read: Any, axes: tuple[int, ...], xp: Any = jnp) -> Any:
  """Rows read `[*outer, *row]` (outer: the proxy's shape without its row
  axes) moved so that the row's axes sit where the proxy had its 1s."""
  row_rank = len(axes)
  ndim = np.ndim(read)
  return xp.moveaxis(read, tuple(range(ndim - row_rank, ndim)), axes)
