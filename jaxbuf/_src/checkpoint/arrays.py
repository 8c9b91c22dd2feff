"""The arrays of a checkpoint: written and read through orbax, checksummed.

Part of `jaxbuf.save` / `load` (`saving.py` maps the rooms). Each process
writes the shards it holds with replica_id 0 into `<checkpoint>/state` with
orbax's `StandardCheckpointHandler` (no barriers of its own, so an orbax
error stays an error of the step), and computes a CRC-32 per chunk of each
such piece while orbax writes. On load each restored shard is cut into the
recorded pieces it holds and every one is checksummed again: orbax stores
arrays compressed, so a flipped bit can decode to other values without any
error of its own, and the CRC-32 turns that into an error naming the leaf.
"""

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import pathlib
import re
import zlib
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxbuf._src.checkpoint import files
from jaxbuf._src.checkpoint import layout as layouts
from jaxbuf._src.core.pytypes import PyTree

# Each leaf's bytes are checksummed in chunks of this size, so that several
# threads share the work (zlib releases the GIL while it runs).
CHUNK_BYTES = 1 << 24
_CHECKSUM_THREADS = max(1, min(8, os.cpu_count() or 1))


# --- Checksums ----------------------------------------------------------------------


def _host_bytes(array: Any) -> np.ndarray:
  """A leaf's bytes in C order, as uint8 (no copy for a host or CPU array)."""
  return np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)


def _crc32s(data: np.ndarray, pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:
  """CRC-32 of each `CHUNK_BYTES` chunk of `data` (uint8 [n]), started in `pool`."""
  # NumPy's stubs declare the buffer protocol only from Python 3.12.
  return [
    pool.submit(zlib.crc32, data[start : start + CHUNK_BYTES])  # type: ignore[arg-type]
    for start in range(0, data.size, CHUNK_BYTES)
  ]


def _results(futures: list[concurrent.futures.Future]) -> list[int]:
  return [future.result() for future in futures]


def stored_form(leaf: Any) -> Any:
  """What is written for a leaf: typed keys as their raw key data."""
  return jax.random.key_data(leaf) if layouts.is_key(leaf) else leaf


def _box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
  """A shard's `index` (one slice per axis) as [[start, stop], ...]."""
  return [list(bound.indices(size)[:2]) for bound, size in zip(index, shape)]


def _written_pieces(
  stored: Any, pool: concurrent.futures.Executor
) -> list[tuple[list[list[int]], list[concurrent.futures.Future]]]:
  """The pieces of a leaf that this process writes, each with its CRC-32s started.

  A piece is an addressable shard with replica_id 0, so that over all
  processes the pieces tile the leaf once; a host (NumPy) leaf is one piece.
  """
  shape = tuple(np.shape(stored))
  if math.prod(shape) == 0:
    return []
  if not isinstance(stored, jax.Array):
    return [([[0, size] for size in shape], _crc32s(_host_bytes(stored), pool))]
  return [
    (_box_of(shard.index, shape), _crc32s(_host_bytes(shard.data), pool))
    for shard in stored.addressable_shards
    if shard.replica_id == 0
  ]


# --- Writing ------------------------------------------------------------------------


def write_arrays(
  directory_fd: int, directory: pathlib.Path, named: list[tuple[str, Any]]
) -> dict[str, list[Any]]:
  """Writes this process's shards into `<directory>/state`; returns their CRC-32s.

  Returns:
    For each leaf name, the pieces this process wrote: `[box, crc32s]`.
  """
  to_write = {
    f"leaf_{i}": leaf for i, (_, leaf) in enumerate(named) if math.prod(np.shape(leaf)) > 0
  }
  with concurrent.futures.ThreadPoolExecutor(_CHECKSUM_THREADS) as pool:
    # The checksums run in threads while orbax writes (zlib releases the GIL).
    started = [(name, _written_pieces(leaf, pool)) for name, leaf in named]
    if to_write:
      handler = ocp.StandardCheckpointHandler()
      try:
        handler.save(
          epath.Path(files.orbax_path(directory_fd, directory)),
          args=ocp.args.StandardSave(to_write),
        )
      finally:
        handler.close()
    return {name: [[box, _results(futures)] for box, futures in pieces] for name, pieces in started}


def finalize(directory_fd: int, directory: pathlib.Path, named: list[tuple[str, Any]]) -> None:
  """Merges every process's index of the shards it wrote (orbax's step, by
  process 0 once all have written)."""
  if any(math.prod(np.shape(leaf)) > 0 for _, leaf in named):
    handler = ocp.StandardCheckpointHandler()
    try:
      handler.finalize(epath.Path(files.orbax_path(directory_fd, directory)))
    finally:
      handler.close()


# --- Reading ------------------------------------------------------------------------


def _verify_leaf(
  where: str,
  name: str,
  array: jax.Array,
  pieces: list[dict[str, Any]],
  pool: concurrent.futures.Executor,
) -> None:
  """Checks every restored shard this process holds against the recorded pieces.

  Each addressable shard (every replica: each was read from disk on its own)
  is cut into the recorded pieces it contains, and each one's CRC-32 compared.
  A shard that cuts a recorded piece (`like` sharded otherwise than the saved
  state) is checked through the whole array where this process holds all of
  it; in a multi-process load it is an error, since nothing here holds the
  whole piece.

  Raises:
    ValueError: a CRC-32 differs (naming the leaf, the piece and the device),
      or a piece cannot be checked.
  """
  if not pieces:
    return
  starts = np.array([[start for start, _ in piece["index"]] for piece in pieces], np.int64).reshape(
    len(pieces), array.ndim
  )
  stops = np.array([[stop for _, stop in piece["index"]] for piece in pieces], np.int64).reshape(
    len(pieces), array.ndim
  )
  checks, cut = [], False
  for shard in array.addressable_shards:
    box = np.array(_box_of(shard.index, array.shape), np.int64).reshape(array.ndim, 2)
    low, high = box[:, 0], box[:, 1]
    overlaps = np.all((starts < high) & (stops > low), axis=1)
    inside = np.all((starts >= low) & (stops <= high), axis=1)
    cut |= bool(np.any(overlaps & ~inside))
    host = np.asarray(shard.data)
    for i in np.flatnonzero(overlaps & inside).tolist():
      local = tuple(slice(int(a - l), int(b - l)) for a, b, l in zip(starts[i], stops[i], low))
      checks.append((i, f"device {shard.device}", _crc32s(_host_bytes(host[local]), pool)))
  if cut:
    if not array.is_fully_addressable:
      raise ValueError(
        f"{where}: leaf {name} was saved in pieces "
        f"{[layouts.show_box(piece['index']) for piece in pieces]} that the sharding "
        "of `like` cuts across processes, so their checksums cannot be "
        "verified; load it with the sharding it was saved with."
      )
    whole = np.asarray(array)
    for i, piece in enumerate(pieces):
      part = whole[tuple(slice(start, stop) for start, stop in piece["index"])]
      checks.append((i, "the host", _crc32s(_host_bytes(part), pool)))
  for i, held, futures in checks:
    if _results(futures) != pieces[i]["crc32"]:
      raise ValueError(
        f"{where}: checksum mismatch at leaf {name}, piece "
        f"{layouts.show_box(pieces[i]['index'])} (restored on {held}): the stored "
        "data is corrupted (its CRC-32 differs from the one recorded at save)."
      )


def _restore_target(leaf: Any, shape: list[int], dtype: Any) -> jax.ShapeDtypeStruct:
  """Shape, dtype and sharding to restore a stored leaf with (`like`'s sharding).

  A leaf of `like` without a sharding goes to the first device with one
  process, and is replicated over every device with several.
  """
  sharding = leaf.sharding if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else None
  if sharding is None and jax.process_count() > 1:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  elif sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _unreadable(
  where: str, entries: list[tuple[str, Any]], error: Exception, suspected_files: str = ""
) -> ValueError:
  """orbax's error reading the arrays in one line, naming the leaves it
  names by their keys and the file it names last (else `suspected_files`).

  orbax wraps a failed read in `Exception("Encountered error while reading
  array index: ... See full TensorStore details: <bound method ...>")`, raised
  from TensorStore's own error: the innermost cause is the reason given."""
  causes: list[BaseException] = [error]
  while causes[-1].__cause__ is not None and len(causes) < 8:
    causes.append(causes[-1].__cause__)
  reason_error = causes[-1]
  text = "\n".join(str(cause) for cause in reversed(causes))
  keys = sorted({int(i) for i in re.findall(r"\bleaf_(\d+)\b", text) if int(i) < len(entries)})
  named = f" of leaf {', '.join(entries[i][0] for i in keys)}" if keys else ""
  named_files = re.findall(r"/state/([^\s\"'\\]+)", text)
  in_file = (
    f" (file {files.STATE}/{named_files[-1]})"
    if named_files
    else f" ({suspected_files})"
    if suspected_files
    else ""
  )
  # orbax appends the whole tensorstore spec, kilobytes of it.
  reason = re.split(r"\s*\[tensorstore_spec=", str(reason_error))[0].splitlines()
  reason = reason[0] if reason else type(reason_error).__name__
  if len(reason) > 300:
    reason = reason[:300] + " ..."
  return ValueError(
    f"{where}: the stored arrays{named} cannot be read"
    f"{in_file}, corrupted or edited: {type(reason_error).__name__}: "
    f"{reason}"
  )


def _check_array_metadatas(state_path: pathlib.Path, where: str) -> None:
  """Raises `ValueError` naming an orbax array-metadata file that does not
  parse: orbax reads them while its reads of the arrays are under way, and a
  failure there abandons those reads, whose callbacks then print "Event loop
  is closed" tracebacks to stderr, long after the error."""
  folder = state_path / "array_metadatas"
  if not folder.is_dir():
    return
  for metadata in sorted(folder.iterdir()):
    try:
      json.loads(metadata.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
      raise ValueError(
        f"{where}: the stored arrays cannot be read (file {files.STATE}/"
        f"array_metadatas/{metadata.name}), corrupted or edited: "
        f"{type(error).__name__}: {str(error).splitlines()[0]}"
      ) from None


def _run_draining(coroutine: Any) -> Any:
  """orbax's `_run_sync_via_new_loop`, except that the loop closes only once
  every task on it is done: a read that fails ends orbax's coroutine with
  the other reads still in flight, and their TensorStore callbacks, finding
  the loop closed, printed "RuntimeError: Event loop is closed" tracebacks
  to stderr (up to 175 for one damaged checkpoint)."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coroutine)
  finally:
    pending = asyncio.all_tasks(loop)
    if pending:
      loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    asyncio.set_event_loop(None)
    loop.close()


@contextlib.contextmanager
def _reads_drained() -> Iterator[None]:
  """orbax's synchronous calls inside run their event loops to the end
  (`_run_draining`); where this orbax has no such function, as it is."""
  # orbax's private module: read where it is, left alone where it is not.
  try:
    from orbax.checkpoint._src import asyncio_utils as orbax_asyncio  # pylint: disable=import-outside-toplevel
  except ImportError:
    orbax_asyncio = None
  original = getattr(orbax_asyncio, "_run_sync_via_new_loop", None)
  if original is None:
    yield
    return
  orbax_asyncio._run_sync_via_new_loop = _run_draining  # pylint: disable=protected-access
  try:
    yield
  finally:
    orbax_asyncio._run_sync_via_new_loop = original  # pylint: disable=protected-access


def _zeros_block(target: jax.ShapeDtypeStruct, index: Any) -> np.ndarray:
  """The block `index` of zeros shaped like `target` (a leaf absent on disk)."""
  return np.zeros(target.shape, target.dtype)[index]


def read_arrays(
  handle: int, found: pathlib.Path, stored: dict[str, Any], like: PyTree, where: str
) -> list[Any]:
  """Restores and verifies every leaf of a checked layout, placed like `like`."""
  like_leaves = [leaf for _, leaf in layouts.named_leaves(like)]
  entries = list(stored["leaves"].items())
  targets = {}
  for i, ((_name, entry), leaf) in enumerate(zip(entries, like_leaves)):
    shape = entry.get("key_data_shape", entry["shape"])
    dtype = np.dtype(np.uint32) if layouts.is_key(leaf) else layouts.DTYPES[entry["dtype"]]
    targets[f"leaf_{i}"] = _restore_target(leaf, shape, dtype)
  to_read = {key: t for key, t in targets.items() if math.prod(t.shape) > 0}
  restored = {}
  if to_read:
    handler = ocp.StandardCheckpointHandler()
    state_path = epath.Path(files.orbax_path(handle, found))
    with contextlib.ExitStack() as stack:
      stack.enter_context(_reads_drained())
      stack.callback(handler.close)
      try:
        stored_arrays = handler.metadata(state_path).tree
      # Whatever orbax raises on a damaged file (a flipped bit in
      # `state/_sharding` is a NotImplementedError) is a damaged checkpoint.
      except Exception as error:  # pylint: disable=broad-except
        raise _unreadable(
          where,
          entries,
          error,
          f"orbax's index, {files.STATE}/_METADATA or {files.STATE}/_sharding",
        ) from None
      # orbax casts to the requested dtype: compare what it stored first.
      for key, target in to_read.items():
        meta = stored_arrays.get(key) if isinstance(stored_arrays, dict) else None
        if (
          meta is None or tuple(meta.shape) != target.shape or np.dtype(meta.dtype) != target.dtype
        ):
          name = entries[int(key.split("_")[1])][0]
          found_as = (
            "nothing" if meta is None else f"shape {tuple(meta.shape)} and dtype {meta.dtype}"
          )
          raise ValueError(
            f"{where}: leaf {name} is stored with {found_as}, "
            f"but the layout says shape {target.shape} and "
            f"dtype {target.dtype}."
          )
      _check_array_metadatas(pathlib.Path(state_path), where)
      try:
        restored = handler.restore(state_path, args=ocp.args.StandardRestore(to_read))
      except Exception as error:  # pylint: disable=broad-except
        raise _unreadable(where, entries, error) from None
  leaves = []
  with concurrent.futures.ThreadPoolExecutor(_CHECKSUM_THREADS) as pool:
    for i, ((name, entry), leaf) in enumerate(zip(entries, like_leaves)):
      target = targets[f"leaf_{i}"]
      array = restored.get(f"leaf_{i}")
      if array is None:
        array = jax.make_array_from_callback(
          target.shape, target.sharding, functools.partial(_zeros_block, target)
        )
      if tuple(array.shape) != target.shape or array.dtype != target.dtype:
        raise ValueError(
          f"{where}: leaf {name} was restored with shape "
          f"{tuple(array.shape)} and dtype {array.dtype}, but the "
          f"layout says {target.shape} and {target.dtype}."
        )
      _verify_leaf(where, name, array, entry["pieces"], pool)
      if layouts.is_key(leaf):
        array = jax.random.wrap_key_data(array, impl=entry["key_impl"])
        if str(array.dtype) != entry["dtype"]:
          raise ValueError(
            f"{where}: leaf {name} has PRNG implementation "
            f"{entry['key_impl']}, which is not {entry['dtype']}."
          )
      leaves.append(array)
  return leaves
