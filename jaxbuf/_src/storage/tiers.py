"""Where a buffer's payload lives: the storage tiers and the per-leaf choice.

A buffer made with `storage=` keeps its bookkeeping (ring counters, item ids,
priorities, sum trees, episode flags) on the device, as every buffer does,
and moves its payload leaves elsewhere:

* `"device"` (the default): everything on the device.
* `"host"` (`Host`): payload leaves in JAX's `pinned_host` memory kind, moved
  row by row inside the jitted step (`placed`).
* `jaxbuf.disk(directory)` (`Disk`): payload leaves in files under
  `directory` (`disk`), read and written by host code outside jit.

Which leaves are payload: per leaf, those whose row (one item's or one step's
value) holds at least `min_row_bytes` bytes: pixels go out, scalars and small
vectors stay in. A kind may limit the choice further (`Layout.eligible`):
frame-stack replay moves only observation leaves, since it computes n-step
targets from the rewards and flags on the device; stream kinds keep a step's
`last` flag, which `add` reads.
"""

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxbuf._src.core.pytypes import PyTree

# Rows smaller than this stay on the device by default: moving them costs a
# host round trip per sample for little memory saved (a float32 scalar is 4
# bytes; an 84x84 uint8 frame is 7056).
DEFAULT_MIN_ROW_BYTES = 64

# The kinds whose factories take `storage=`.
TIERED_KINDS = (
  "uniform_replay",
  "prioritized_replay",
  "sequence_replay",
  "prioritized_sequence_replay",
  "frame_stack_replay",
  "prioritized_frame_stack_replay",
)


@dataclasses.dataclass(frozen=True)
class Host:
  """Payload leaves in pinned host memory (`storage="host"`)."""

  min_row_bytes: int = DEFAULT_MIN_ROW_BYTES

  def __repr__(self) -> str:
    return "'host'"


class Disk:
  """Payload leaves in files under `directory` (`jaxbuf.disk`).

  The buffer made with it opens the files at `init` and holds them here
  (one buffer per `Disk`: a second buffer's `init` is refused while the
  first holds them): `sync()` makes them durable (call it with `jaxbuf.save`
  of the state, no add between), `close()` releases them and the lock,
  `recover(state)` keeps the rows of a loaded checkpoint that the files
  still hold, `lost_rows()` lists the rows a crash left unverifiable.
  """

  def __init__(
    self, directory: str, min_row_bytes: int = DEFAULT_MIN_ROW_BYTES, sparse: bool = False
  ):
    self.directory = directory
    self.min_row_bytes = min_row_bytes
    self.sparse = sparse
    self.files: Any = None  # the open `disk.PayloadFiles`, set by init
    self.binding: Any = None  # the buffer that opened them (`disk_tier.Binding`)

  def __repr__(self) -> str:
    sparse = ", sparse=True" if self.sparse else ""
    return f"jaxbuf.disk({self.directory!r}, min_row_bytes={self.min_row_bytes}{sparse})"

  def _open(self, what: str) -> Any:
    if self.files is None or self.binding is None:
      raise ValueError(f"{self!r}.{what}: no payload files are open (call buffer.init first).")
    return self.files

  def sync(self) -> None:
    """Writes the tables and the manifest and flushes the files."""
    self._open("sync").sync()

  def close(self) -> None:
    """Closes the payload files and releases the lock (idempotent, no sync)."""
    if self.files is not None:
      self.files.close()
      self.files = None

  def lost_rows(self) -> np.ndarray:
    """The rows lost (int64, storage rows in the buffer's flat order): those
    a process killed between syncs left unverifiable, and those
    `recover` dropped; never sampled, and no longer lost once rewritten."""
    return self._open("lost_rows").lost_rows()

  def recover(self, state: Any) -> np.ndarray:
    """Keeps every row of `state` that the files hold as it knows them and
    drops the others (never sampled; adds overwrite them), so that a
    checkpoint saved before or after the files' last sync goes on. Call it
    after `jaxbuf.load`, before the state's first add or sample, which would
    otherwise refuse that state. Warns, naming the rows dropped.

    Returns:
      The rows dropped, int64 (empty when the state matches the files).
    """
    self._open("recover")
    return self.binding.recover(state)


def disk(
  directory: str | os.PathLike,
  *,
  min_row_bytes: int = DEFAULT_MIN_ROW_BYTES,
  sparse: bool = False,
) -> Disk:
  """The disk tier: a buffer's payload leaves in files under `directory`.

  Pass it as `storage=` to `uniform_replay`, `prioritized_replay`,
  `sequence_replay` or `frame_stack_replay`, one buffer per `disk(...)`.
  `buffer.init` creates the directory and one file per payload leaf,
  allocated whole (a disk that cannot hold them fails there, naming the
  bytes needed and free), or opens the files a buffer of the same layout
  left there, without copying them; it locks the directory against a second
  writer. `add` writes only the rows it adds and `sample` reads only the
  rows it draws; both run on the host, outside jit.

  Args:
    directory: where the payload files go.
    min_row_bytes: leaves whose row holds fewer bytes stay on the device.
    sparse: make the files sparse instead of allocating them at `init`:
      no free-space check, the disk's blocks taken as rows are written
      (for file systems that cannot allocate, or a buffer sized for a
      disk that grows); a disk found full then fails an add, which adds
      nothing.

  Returns:
    A `Disk` storage spec.

  >>> import tempfile, jax, jax.numpy as jnp, jaxbuf
  >>> directory = tempfile.mkdtemp()
  >>> buffer = jaxbuf.uniform_replay(100, storage=jaxbuf.disk(directory))
  >>> state = buffer.init({"pixels": jnp.zeros((8, 8), jnp.uint8), "reward": jnp.float32(0)})
  >>> state = buffer.add(state, {"pixels": jnp.ones((4, 8, 8), jnp.uint8),
  ...                            "reward": jnp.zeros(4, jnp.float32)})
  >>> batch = buffer.sample(state, jax.random.key(0), 2)
  >>> batch.items["pixels"].shape, int(batch.items["pixels"].sum())
  ((2, 8, 8), 128)
  """
  if not isinstance(min_row_bytes, int) or min_row_bytes < 0:
    raise ValueError(f"disk: min_row_bytes must be an int >= 0, given {min_row_bytes!r}.")
  if not isinstance(sparse, bool):
    raise TypeError(f"disk: sparse must be True or False, given {sparse!r}.")
  return Disk(directory=os.fspath(directory), min_row_bytes=min_row_bytes, sparse=sparse)


def resolve(storage: Any, kind_name: str) -> Host | Disk | None:
  """The tier `storage=` asks for; None for the device. Raises for anything
  else, and for a kind that has no tiers, naming those that do."""
  if isinstance(storage, str) and storage == "device":
    return None
  if kind_name not in TIERED_KINDS:
    raise ValueError(
      f"{kind_name}: storage={storage!r} is not supported by this kind; the "
      f"kinds that take storage='host' or jaxbuf.disk(directory) are "
      f"{', '.join(TIERED_KINDS)}."
    )
  if isinstance(storage, str) and storage == "host":
    return Host()
  if isinstance(storage, (Host, Disk)):
    return storage
  raise ValueError(
    f"{kind_name}: storage must be 'device', 'host' or jaxbuf.disk(directory), given {storage!r}."
  )


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a kind's storage and samples hold the payload.

  Attributes:
    lead_dims: the storage's leading axes before a step's or item's own
      shape: 1 (`[C, ...]`, item replay) or 2 (`[N, R, ...]`, streams).
    eligible: path (a `jax.tree_util.keystr`) -> whether that leaf of the
      stored item or step may leave the device.
    views: sample items -> `(prefixes, subtree)` pairs: the subtrees whose
      leaves hold payload rows, and the path prefixes (any of them) of the
      subtree in the stored item or step: the items themselves (item and
      sequence replay), `obs` and `next_obs` (frames).
    rebuild: sample items, the views with their rows read -> the items.
    stack_axis: for frames, where a stacked leaf's K axis sits in its
      frame shape (None: rows are trailing, `[S, ..., *row]`).
    stacked: path within a view -> whether that leaf is stacked (frames).
  """

  lead_dims: int
  eligible: Callable[[str], bool]
  views: Callable[[Any], list[PyTree]]
  rebuild: Callable[[Any, list[PyTree]], Any]
  stack_axis: int | None = None
  stacked: Callable[[str], bool] = lambda path: False


def payload_paths(example: PyTree, tier: Host | Disk, layout: Layout) -> tuple[str, ...]:
  """The paths of `example`'s leaves that go to the tier (per leaf: big
  enough and eligible), in tree order. None going is refused: the tier
  asked for would hold nothing (the leaves would all stay on the device)."""
  chosen, eligible = [], {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(example)[0]:
    name = jax.tree_util.keystr(path)
    row_bytes = int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    if layout.eligible(name) and row_bytes > 0:
      eligible[name] = row_bytes
      if row_bytes >= tier.min_row_bytes:
        chosen.append(name)
  if not chosen:
    largest = max(eligible, key=eligible.__getitem__, default=None)
    found = (
      f"the largest that may move, {largest}, holds {eligible[largest]} bytes a row"
      if largest is not None
      else "no leaf of it may move"
    )
    smaller = (
      f"jaxbuf.disk(directory, min_row_bytes={eligible[largest]}) moves it, or "
      if isinstance(tier, Disk) and largest is not None
      else ""
    )
    raise ValueError(
      f"init: storage={tier!r} would hold nothing: leaves whose row holds fewer "
      f"than {tier.min_row_bytes} bytes stay on the device, and {found}. "
      f"{smaller}storage='device' keeps everything on the device, as this would."
    )
  return tuple(chosen)


def map_payload(tree: PyTree, paths: tuple[str, ...], function: Callable) -> PyTree:
  """`function(path, leaf)` on the payload leaves of `tree`, the others kept."""
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: (
      function(jax.tree_util.keystr(path), leaf) if jax.tree_util.keystr(path) in paths else leaf
    ),
    tree,
  )


def payload_leaves(tree: PyTree, paths: tuple[str, ...]) -> dict[str, Any]:
  """The payload leaves of `tree`, by path."""
  return {
    jax.tree_util.keystr(path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if jax.tree_util.keystr(path) in paths
  }


def _whole(items: Any) -> list[tuple[tuple[str, ...], Any]]:
  return [(("",), items)]


def _first_view(items: Any, views: list) -> Any:
  return views[0]


# Item replay: any leaf of an item; a sample's items are shaped like the item.
ITEMS = Layout(lead_dims=1, eligible=lambda path: True, views=_whole, rebuild=_first_view)

# Sequence replay: any leaf but a step's `last` flag, which `add` reads.
SEQUENCES = Layout(
  lead_dims=2,
  eligible=lambda path: path not in ("['last']", ".last"),
  views=_whole,
  rebuild=_first_view,
)

_OBS = ("['obs']", ".obs")


def frames_layout(stack_keys: tuple[str, ...] | None, stack_axis: int) -> Layout:
  """Frame-stack replay: observation leaves only (rewards and flags make the
  n-step targets on the device); a sample's `obs` and `next_obs` are shaped
  like a step's obs, stacked leaves with K at `stack_axis`."""

  def stacked(relative_path: str) -> bool:
    if stack_keys is None:
      return True
    return any(relative_path.startswith((f"['{key}']", f".{key}")) for key in stack_keys)

  return Layout(
    lead_dims=2,
    eligible=lambda path: path.startswith(_OBS),
    views=lambda items: [(_OBS, items.obs), (_OBS, items.next_obs)],
    rebuild=lambda items, views: items._replace(obs=views[0], next_obs=views[1]),
    stack_axis=stack_axis,
    stacked=stacked,
  )
