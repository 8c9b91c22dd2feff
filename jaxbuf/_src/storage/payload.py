"""What both tiers learn from the example at `init`: the payload leaves, their
rows, and how a kind's add and sample meet the row proxies (`proxies`).

Shape key: F storage rows, n rows given to one add, S sample size.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core.base import Buffer
from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.storage import proxies
from jaxbuf._src.storage import tiers


class Payload:
  """The payload leaves of one tiered buffer and their rows.

  Attributes:
    paths: the payload leaves' paths, in tree order.
    rows_spec: path -> (row shape, dtype).
    layout: the kind's `tiers.Layout`.
    rows: F, set from the kind's state.
    lead_shape: the storage's leading axes (`[C]` or `[N, R]`).
    laps: K, the laps a proxy value tells apart (1: values are `row + 1`).
  """

  def __init__(self, example: PyTree, tier: tiers.Host | tiers.Disk, layout: tiers.Layout):
    self.paths = tiers.payload_paths(example, tier, layout)
    self.rows_spec = {
      path: (tuple(np.shape(leaf)), np.dtype(leaf.dtype))
      for path, leaf in tiers.payload_leaves(example, self.paths).items()
    }
    self.layout = layout
    self.rows = 0
    self.lead_shape: tuple[int, ...] = ()
    self.laps = 1

  def rank(self, path: str) -> int:
    return len(self.rows_spec[path][0])

  def tokenized(self, items: PyTree, start: int) -> tuple[PyTree, dict[str, Any], int]:
    """Items with payload leaves as tokens numbered from `start`; the payload
    rows `[n, *row]` by path; n."""
    values, count = {}, 0

    def token(path: str, leaf: Any) -> jax.Array:
      nonlocal count
      tokens, batch_shape = proxies.tokens_for(leaf, self.rank(path), start)
      count = int(np.prod(batch_shape, dtype=np.int64))
      values[path] = leaf.reshape((count,) + self.rows_spec[path][0])
      return tokens

    return tiers.map_payload(items, self.paths, token), values, count

  def tokenized_add_arguments(
    self, items: PyTree, args: tuple, kwargs: dict
  ) -> tuple[PyTree, tuple, dict, dict[str, list], int]:
    """`add`'s arguments with tokens for the payload of `items` and of
    `final_steps` (streams); the rows given, by path; n."""
    items, values, count = self.tokenized(items, 0)
    given = {path: [value] for path, value in values.items()}
    arguments: list[Any] = list(args)
    kwargs = dict(kwargs)
    if len(arguments) >= 3 or kwargs.get("final_steps") is not None:
      final = arguments[2] if len(arguments) >= 3 else kwargs["final_steps"]
      final, final_values, final_count = self.tokenized(final, count)
      for path, value in final_values.items():
        given[path].append(value)
      count += final_count
      if len(arguments) >= 3:
        arguments[2] = final
      else:
        kwargs["final_steps"] = final
    return items, tuple(arguments), kwargs, given, count

  def proxy_leaves(self, core: Any) -> dict[str, jax.Array]:
    return tiers.payload_leaves(core.storage, self.paths)

  def written(self, before: Any, after: Any, given: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """After an add (`before` and `after`: the kind's states; every tiered
    kind has `storage`): the rows written `[n]` (F: none), the given row
    each holds, and each row's next value (`proxies.next_values`)."""
    if not self.paths:
      none = jnp.zeros((0,), jnp.int32)
      return none, none, none
    first = self.paths[0]
    written, held = proxies.written_rows(
      self.proxy_leaves(after)[first], rows=self.rows, given=given
    )
    values = proxies.next_values(
      self.proxy_leaves(before)[first], written, rows=self.rows, laps=self.laps
    )
    return written, held, values

  def settled(self, core: Any, written: jax.Array, values: jax.Array) -> Any:
    """The kind's state with every payload proxy at `values` on the rows
    `written` (the tokens an add left there replaced)."""
    if not self.paths:
      return core
    storage = tiers.map_payload(
      core.storage, self.paths, lambda path, proxy: proxies.settle(proxy, written, values)
    )
    return core.replace(storage=storage)

  def views(self, items: Any, read: Callable[[str, Any, tuple[int, ...]], Any]) -> Any:
    """Sample items with each payload proxy `P` replaced by `read(path,
    values or 0 [outer], row axes of P)`."""
    new_views = []
    for prefixes, view in self.layout.views(items):

      def swap(key_path: Any, leaf: Any, prefixes: tuple[str, ...] = prefixes) -> Any:
        relative = jax.tree_util.keystr(key_path)
        path = next(
          (prefix + relative for prefix in prefixes if prefix + relative in self.paths), None
        )
        if path is None:
          return leaf
        stack_axis = self.layout.stack_axis if self.layout.stacked(relative) else None
        axes = proxies.row_axes(leaf, self.rank(path), stack_axis)
        return read(path, proxies.rows_of(leaf, axes), axes)

      new_views.append(jax.tree_util.tree_map_with_path(swap, view))
    return self.layout.rebuild(items, new_views)


class Tiered(NamedTuple):
  """What a tiered buffer wraps: the kind's own buffer, the tier, the layout."""

  core: Buffer
  tier: Any
  layout: tiers.Layout


def unsplit(buffer: Buffer, tier_name: str) -> Any:
  """The kind of `buffer` named for its tier, without the split
  `jaxbuf.sharded` would use (`split_tier` splits tiered buffers)."""
  kind = buffer.kind
  if kind is None:
    return None
  return kind._replace(name=f"{kind.name} with storage={tier_name}", split=None)


def initialized(
  buffer: Buffer,
  example: PyTree,
  tier: tiers.Host | tiers.Disk,
  layout: tiers.Layout,
  *,
  laps: bool,
) -> tuple[Payload, Any]:
  """The payload `example` has on `tier`, and the kind's empty state with
  its payload leaves as proxies; `laps`: proxy values count each row's laps
  (the disk tier), else they are `row + 1`."""
  payload = Payload(example, tier, layout)
  core = buffer.init(proxies.proxy_example(example, payload.paths))
  leaves = payload.proxy_leaves(core)
  if leaves:
    proxy = leaves[payload.paths[0]]
    payload.lead_shape = tuple(proxy.shape[: layout.lead_dims])
    payload.rows = proxies.num_rows(proxy, layout.lead_dims)
    payload.laps = proxies.laps_for(payload.rows) if laps else 1
  return payload, core
