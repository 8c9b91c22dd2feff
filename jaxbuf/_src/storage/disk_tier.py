"""The disk tier (`jaxbuf.disk(directory)`): a kind's own functions over row
proxies, the payload rows in files (`disk`). Host code around jitted device
parts.

Shape key: S sample size, F storage rows, n rows given to one add.

The state is the kind's own state, with proxies for the payload leaves; the
files are held by the `Disk` spec the buffer was made with, which belongs to
that buffer (a second buffer's `init` with it is refused while the first
holds them open). `add` and `sample` are host functions: the device part
(the kind's function) is jitted, then the rows are written or read. Inside
jit, vmap or scan they raise a TypeError saying so; `update_priorities`,
`can_sample` and `clear` touch no payload and run anywhere.

* `add`: the kind's add over tokens, the rows it wrote and their next
  values (jitted); the rows written to the files, which return each row's
  lap; where they differ from the laps the state counted (an add to a state
  older than the files), the proxies take the files' laps.
* `sample` / `take`: the kind's draw, then its rows read, each checked
  against its lap and checksum (`disk`). A draw that falls on a lost row
  (`disk`: rows a crash left unverifiable, or dropped by `Disk.recover`) is
  drawn again under `fold_in(key, attempt)`: uniform kinds then draw
  uniformly over the rows kept, prioritized kinds in proportion to priority
  over them (the weights are those of each draw).
* The first state used after `init` is checked whole against the files (its
  lap of every row held, 4 bytes a row read from the device once): a loaded
  checkpoint older or newer than the files is refused before anything is
  read, naming the rows; `Disk.recover(state)` keeps the rows the files
  hold and drops the others.
"""

import dataclasses
import errno
import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core.base import Buffer, BufferState
from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.storage import blocked
from jaxbuf._src.storage import disk as disk_files
from jaxbuf._src.storage import payload as payloads
from jaxbuf._src.storage import proxies
from jaxbuf._src.storage import tiers

# Draws again at most this often for rows that fall on lost rows; past it
# nearly every row held is lost, and the sample raises.
MAX_REDRAWS = 64


@dataclasses.dataclass
class Binding:
  """What a `Disk` holds for the buffer that opened its files."""

  owner: object  # the buffer's token
  payload: payloads.Payload
  recover: Callable[[Any], np.ndarray]
  unchecked: bool = True  # the first state used after init is checked whole


def _refuse_traced(what: str, *trees: Any) -> None:
  if any(isinstance(leaf, jax.core.Tracer) for tree in trees for leaf in jax.tree.leaves(tree)):
    raise TypeError(
      f"{what}: a buffer with storage=jaxbuf.disk(...) reads and writes its "
      f"payload files on the host, so its {what} runs outside jax.jit, vmap "
      f"and scan; call it from Python between jitted steps (a "
      f"jaxbuf.Prefetcher overlaps the reads with the step), or use "
      f"storage='host' or 'device', whose functions run inside jit."
    )


def _rows_words(rows: np.ndarray) -> str:
  shown = ", ".join(str(row) for row in rows[:16].tolist())
  return f"[{shown}{', ...' if len(rows) > 16 else ''}]"


def disk_buffer(
  buffer: Buffer, tier: tiers.Disk, layout: tiers.Layout, *, blocks: int | None = None
) -> Buffer:
  """`buffer` with its payload leaves in files (`disk`); with `blocks` = D,
  `buffer` is a `jaxbuf.sharded` one and each device's rows go to files of
  their own (`blocked.BlockedPayloadFiles`)."""
  owner = object()

  def opened() -> tuple[payloads.Payload, Any]:
    binding = tier.binding
    if binding is not None and binding.owner is not owner:
      raise ValueError(
        f"{tier!r} now holds the payload files of another buffer, whose init "
        f"came after this buffer's: this buffer's states cannot read them. "
        f"Give each buffer its own jaxbuf.disk(directory), on a directory of its own."
      )
    if binding is None or tier.files is None:
      raise ValueError(
        f"storage=jaxbuf.disk({tier.directory!r}): call buffer.init(example) "
        f"first (it opens the payload files); they are closed."
      )
    return binding.payload, tier.files

  def state_laps(payload: payloads.Payload, state: Any) -> np.ndarray:
    """The lap of each row the state holds, `[F]` (-1: none): a proxy holds
    row p's value at position p."""
    proxy = payload.proxy_leaves(state)[payload.paths[0]]
    return proxies.decoded(np.asarray(jax.device_get(proxy)).reshape(-1), payload.rows)[1]

  def check_first(state: Any, what: str) -> None:
    payload, files = opened()
    binding = tier.binding
    assert binding is not None
    if not binding.unchecked or not payload.paths:
      return
    laps = state_laps(payload, state)
    wrong = files.mismatched(laps)
    if wrong.size:
      raise disk_files.PayloadError(
        errno.ESTALE,
        f"{what}: this state does not match the payload files in "
        f"{tier.directory!r}: {len(wrong)} of the {int((laps >= 0).sum())} rows it "
        f"holds are not in the files as it knows them (rows {_rows_words(wrong)}): "
        f"a checkpoint saved before or after the files' last storage.sync(), or "
        f"a directory emptied or replaced since. Nothing was read. Load the "
        f"checkpoint saved with the last sync, or call storage.recover(state) "
        f"to keep the rows the files hold and drop these.",
      )
    binding.unchecked = False

  def recover(state: Any) -> np.ndarray:
    payload, files = opened()
    binding = tier.binding
    assert binding is not None
    _refuse_traced("recover", state)
    wrong = files.mismatched(state_laps(payload, state)) if payload.paths else np.zeros(0, int)
    files.mark_lost(wrong)
    binding.unchecked = False
    if wrong.size:
      warnings.warn(
        f"disk: recover: {len(wrong)} rows this state holds are not in the "
        f"payload files in {tier.directory!r} as it knows them (rewritten "
        f"after the state was saved, or not yet written when it was): rows "
        f"{_rows_words(wrong)}. They are dropped (never sampled; adds overwrite "
        f"them); every other row is kept.",
        stacklevel=3,
      )
    return wrong

  def init(example: PyTree) -> BufferState:
    _refuse_traced("init", example)
    binding = tier.binding
    if binding is not None and binding.owner is not owner and tier.files is not None:
      raise ValueError(
        f"init: {tier!r} holds the payload files of another buffer, which "
        f"is open: a jaxbuf.disk(...) serves one buffer (a second would read "
        f"and write the first one's rows). Give this buffer its own "
        f"jaxbuf.disk(directory) on another directory, or close the first "
        f"(storage.close()) if this buffer replaces it."
      )
    payload, core = payloads.initialized(buffer, example, tier, layout, laps=True)
    tier.close()
    if blocks is None:
      files: Any = disk_files.PayloadFiles(
        tier.directory, payload.rows_spec, payload.rows, laps=payload.laps, sparse=tier.sparse
      )
    else:
      files = blocked.BlockedPayloadFiles(
        tier.directory,
        payload.rows_spec,
        payload.rows,
        blocks,
        laps=payload.laps,
        sparse=tier.sparse,
      )
    tier.files = files
    tier.binding = Binding(owner=owner, payload=payload, recover=recover)
    return core

  init.payload_rows = lambda: opened()[0].rows_spec  # type: ignore[attr-defined]
  init.tiered = payloads.Tiered(buffer, tier, layout)  # type: ignore[attr-defined]

  @functools.partial(jax.jit, static_argnames=("count",))
  def device_add(core: BufferState, items: PyTree, args: tuple, kwargs: dict, count: int) -> Any:
    payload = opened()[0]
    after = buffer.add(core, items, *args, **kwargs)
    written, held, values = payload.written(core, after, count)
    return payload.settled(after, written, values), written, held, values

  # Only the proxies, which the add rewrote (never an array of the state
  # passed in), are donated.
  @functools.partial(jax.jit, donate_argnums=0)
  def device_settle(proxy_leaves: dict, written: jax.Array, values: jax.Array) -> dict:
    return {path: proxies.settle(proxy, written, values) for path, proxy in proxy_leaves.items()}

  def add(state: BufferState, items: PyTree, *args: Any, **kwargs: Any) -> BufferState:
    _refuse_traced("add", state, items, args, kwargs)
    payload, files = opened()
    check_first(state, "add")
    items, args, kwargs, given, count = payload.tokenized_add_arguments(items, args, kwargs)
    core, written_on_device, held, values = device_add(state, items, args, kwargs, count=count)
    written, held, values = np.asarray(written_on_device), np.asarray(held), np.asarray(values)
    kept = written < payload.rows
    if not payload.paths or not kept.any():
      return core
    held = held[kept]
    identity = len(held) == count and np.array_equal(held, np.arange(count))
    rows_given = {}
    for path in payload.paths:
      parts = [np.asarray(part) for part in given[path]]
      rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
      rows_given[path] = rows if identity else rows[held]
    laps, _ = files.write_rows(written[kept], rows_given)
    if np.array_equal(laps, (values[kept] - 1) // payload.rows):
      return core
    # The state's laps were not the files' (it is older than them, or new
    # over files that were written before): the files' laps are the truth.
    values = values.copy()
    values[kept] = 1 + written[kept] + payload.rows * laps.astype(np.int64)
    settled = device_settle(payload.proxy_leaves(core), written_on_device, jnp.asarray(values))
    return core.replace(
      storage=tiers.map_payload(core.storage, payload.paths, lambda path, _: settled[path])
    )

  def lost_draws(payload: payloads.Payload, files: Any, drawn: Any, batch_size: int) -> Any:
    """bool `[S]`: the draws whose rows include a lost one; None if none is."""
    if not files.has_lost():
      return None
    bad = np.zeros(batch_size, bool)

    def collect(path: str, values: Any, axes: tuple[int, ...]) -> Any:
      rows, _ = proxies.decoded(np.asarray(values), payload.rows)
      bad[:] |= files.lost_mask(rows.reshape(-1)).reshape(batch_size, -1).any(axis=1)
      return values

    payload.views(drawn.items, collect)
    return bad

  def without_lost(
    drawn: Any, draw: Callable[[jax.Array], Any], key: jax.Array, batch_size: int
  ) -> Any:
    """`drawn` (`draw(key)`), its draws that fall on lost rows drawn again."""
    payload, files = opened()
    for attempt in range(1, MAX_REDRAWS + 1):
      bad = lost_draws(payload, files, drawn, batch_size)
      if bad is None or not bad.any():
        return drawn
      again = draw(jax.random.fold_in(key, attempt))
      chosen = jnp.asarray(bad)
      drawn = jax.tree.map(
        lambda kept, new: jnp.where(chosen.reshape((-1,) + (1,) * (kept.ndim - 1)), new, kept),
        drawn,
        again,
      )
    raise disk_files.PayloadError(
      errno.EIO,
      f"sample: {int(bad.sum())} of {batch_size} draws still fall on lost rows of "
      f"{tier.directory!r} after {MAX_REDRAWS} draws ({len(files.lost_rows())} rows "
      f"are lost): add new rows before sampling again.",
    )

  def with_payload(drawn: Any) -> Any:
    """`drawn` (the core's sample) with its proxies replaced by rows read
    from the payload files."""
    payload, files = opened()

    def read(path: str, values: Any, axes: tuple[int, ...]) -> jax.Array:
      rows, laps = proxies.decoded(np.asarray(values), payload.rows)
      data = files.read_rows(path, rows.reshape(-1), laps.reshape(-1))
      data = data.reshape(rows.shape + data.shape[1:])
      return jnp.asarray(proxies.placed(data, axes, xp=np))

    return drawn.replace(items=payload.views(drawn.items, read))

  def sample(state: BufferState, key: jax.Array, batch_size: int, **kwargs: Any) -> Any:
    _refuse_traced("sample", state, key, kwargs)
    check_first(state, "sample")

    def draw(key: jax.Array) -> Any:
      return buffer.sample(state, key, batch_size, **kwargs)

    return with_payload(without_lost(draw(key), draw, key, batch_size))

  def take(state: BufferState, key: jax.Array, batch_size: int, **kwargs: Any) -> Any:
    _refuse_traced("take", state, key, kwargs)
    check_first(state, "take")
    core, drawn = buffer.take(state, key, batch_size, **kwargs)

    # Tiered kinds consume nothing: `take` draws what `sample` draws.
    def draw(key: jax.Array) -> Any:
      return buffer.sample(state, key, batch_size, **kwargs)

    return core, with_payload(without_lost(drawn, draw, key, batch_size))

  def reserve_reads() -> Callable[[], None]:
    """Reserves the rows a draw in another thread reads (`jaxbuf.Prefetcher`)."""
    return opened()[1].reserve()

  sample.reserve_reads = reserve_reads  # type: ignore[attr-defined]
  return Buffer(
    init=init,
    add=add,
    sample=sample,
    update_priorities=buffer.update_priorities,
    can_sample=buffer.can_sample,
    clear=buffer.clear,
    kind=payloads.unsplit(buffer, f"jaxbuf.disk({tier.directory!r})"),
    take=take,
  )
