"""Saving and loading buffer states: atomic, checksummed, safe to share a path.

Shape key: C capacity, T rollout length (num_steps), N envs.

A checkpoint at `<path>` is a directory that jaxbuf alone writes:

  state/                 every array of nonzero size, in orbax's standard format;
  layout.json            the state's type and sizes, and for every leaf its path,
                         shape, dtype (and PRNG implementation for typed keys)
                         and its pieces: the boxes of the shards written (one
                         per shard with replica_id 0; together they tile the
                         leaf exactly once) with the CRC-32s of their bytes;
  jaxbuf-checkpoint.json the marker, written last: format name, a random token
                         also stored in the layout, and the list of every file
                         and folder written.

A directory is taken for a jaxbuf checkpoint only if its marker parses, names
this format and carries the layout's token; `save` replaces it only if it holds
nothing beyond the entries its marker lists, so a directory that merely looks
like a checkpoint, or one a user has added files to, raises `FileExistsError`.

`load` treats the layout as untrusted data: it checks every field and type
(and that the pieces tile each leaf), compares the layout with `like` before
reading an array, compares each restored array's shape and dtype with the
layout, and recomputes the CRC-32 of every piece in every restored shard.
orbax stores arrays compressed, so a flipped bit can decode to other values
without any error of its own; the CRC-32 (which catches every single-bit and
every burst error up to 32 bits) turns that into an error naming the leaf.

orbax locates its own files with glob patterns built from the directory name,
so a path with `[`, `*` or `?` would save and never load. orbax is therefore
only ever given `/proc/self/fd/<fd>/state`, where `<fd>` is a descriptor of the
checkpoint directory: a name free of pattern characters whatever the user's
path. Where `/proc/self/fd` does not exist, paths with pattern characters are
refused before anything is written.

Writes never lose the previous checkpoint: `save` writes `<path>.jaxbuf-new`
completely (marker last), then renames `<path>` to `<path>.jaxbuf-old`,
renames the new one to `<path>` and deletes the old one. A process killed at any
point leaves one complete checkpoint (the previous one before the first rename,
the new one after it, found at `<path>.jaxbuf-new` until the second rename);
`load` reads whichever that is, and the next `save` tidies up.

Concurrency. A writer holds an exclusive `flock` on `<path>.jaxbuf-lock` (left
in place; the kernel drops the lock when its process dies, so a killed writer
never blocks the next). A second writer meanwhile gets `BlockingIOError` before
touching anything. A reader opens the checkpoint directory, takes a shared
`flock` on that directory and reads through its descriptor, so a writer
renaming it away does not disturb the read; the writer takes an exclusive lock
on a directory before deleting it, so it waits for readers to finish.

Several processes (`jax.distributed`, one state of global arrays sharded over
the devices of every process). Every process calls `save` (or `load`) with the
same path, on a filesystem every process sees. Process 0 alone does the
directory protocol above (lock, `<path>.jaxbuf-new`, layout, marker, swap,
deletion); every process writes the shards it holds with replica_id 0 through
orbax (each into its own `state/ocdbt.process_<i>`, merged by process 0) and
checksums them; process 0 writes the CRC-32s of all processes into the one
layout, and the marker only once every process has written. `load` runs in
every process: each reads the shards its devices hold and verifies each one
against the layout. The processes agree after each step (an all-gather over
their devices): on the path and the state's layout first (a difference is a
`ValueError` naming both paths, or the first leaf that differs), then on
the outcome of each step. A step that fails in one process, say a checksum
mismatch in one of its shards, raises in every process (the same exception
type, naming the failing process and its message), so no process returns a
half-verified state, and none waits for a process that has given up: every
process reaches every agreement, failed or not. orbax is used without its own
barriers (`StandardCheckpointHandler` directly), so an orbax error stays a step
error. A process that dies instead of raising is left to `jax.distributed`, which
terminates the others when its heartbeat times out (after about 100 s with
jax 0.10.2's defaults, as measured on CPU); the path still holds one complete
checkpoint, since the marker is written only after every process has written.
A leaf of `like` without a sharding is replicated over every device, and a
`like` sharded so that one device's shard cuts a saved piece is refused (its
checksum could not be verified); with one process such a piece is checked on
the host.
"""

import concurrent.futures
import errno
import fcntl
import json
import math
import os
import pathlib
import re
import secrets
import shutil
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxbuf._src import base
from jaxbuf._src import kind
from jaxbuf._src import validation
from jaxbuf._src.base import BufferState, PyTree

_FORMAT = "jaxbuf-checkpoint"
_FORMAT_VERSION = 3
_MARKER = "jaxbuf-checkpoint.json"
_LAYOUT = "layout.json"
_STATE = "state"
_NEW_SUFFIX = ".jaxbuf-new"
_OLD_SUFFIX = ".jaxbuf-old"
_LOCK_SUFFIX = ".jaxbuf-lock"
# Each leaf's bytes are checksummed in chunks of this size, so that several
# threads share the work (zlib releases the GIL while it runs).
_CHUNK_BYTES = 1 << 24
_CHECKSUM_THREADS = max(1, min(8, os.cpu_count() or 1))
# Characters that Python's glob (which orbax uses) or a shell would expand.
_PATTERN_CHARACTERS = frozenset("*?[]{}")
_PROC_FD = pathlib.Path("/proc/self/fd")
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_DTYPES = {str(np.dtype(t)): np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)}
# A killed writer's leftovers never hold a reader for long; a reader that keeps
# losing races with writers gives up after this many rounds.
_OPEN_ATTEMPTS = 100


# --- Layout: what a checkpoint holds, as plain JSON data -----------------------------

def _type_name(state: PyTree) -> str:
  return f"{type(state).__module__}.{type(state).__qualname__}"


def _buffer_dims(state: PyTree) -> dict[str, Any]:
  """The sizes a buffer was made with (none for a plain pytree of arrays)."""
  return state.buffer_dims() if isinstance(state, BufferState) else {}


def _settings(state: PyTree) -> dict[str, Any]:
  """The bound settings the state records (`jaxbuf._src.kind`); none for a
  plain pytree or a state made by a module's `init`."""
  return dict(getattr(state, "settings", None) or ())


def _is_key(leaf: Any) -> bool:
  return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _leaf_layout(name: str, leaf: Any) -> dict[str, Any]:
  """A leaf's shape and dtype as the layout records them (typed keys by dtype name)."""
  if not hasattr(leaf, "dtype"):
    raise TypeError(f"save/load: leaf {name} is a {type(leaf).__name__}, not an "
                    "array; every leaf of a state must be an array.")
  dtype = str(leaf.dtype) if _is_key(leaf) else str(np.dtype(leaf.dtype))
  if not _is_key(leaf) and dtype not in _DTYPES:
    raise TypeError(f"save/load: leaf {name} has dtype {dtype}, which jaxbuf "
                    f"checkpoints do not store; supported: {sorted(_DTYPES)} "
                    "and typed PRNG keys.")
  return {"shape": [int(d) for d in np.shape(leaf)], "dtype": dtype}


def _named_leaves(state: PyTree) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def _layout(state: PyTree) -> dict[str, Any]:
  """Type, buffer sizes, and each leaf's shape and dtype (no checksums yet)."""
  return {"format": _FORMAT, "version": _FORMAT_VERSION,
          "state_type": _type_name(state), "buffer_dims": _buffer_dims(state),
          "settings": _settings(state),
          "leaves": {name: _leaf_layout(name, leaf)
                     for name, leaf in _named_leaves(state)}}


def _stack_words(stack: Any) -> str:
  """A stack of states (leading axes), as `_check_layout` names it."""
  if not stack:
    return "one state (no leading axes)"
  return f"a stack of states with leading axes {tuple(stack)}"


def _fail(where: str, problem: str) -> ValueError:
  return ValueError(f"{where}: malformed layout: {problem}.")


def _require(where: str, mapping: Any, field: str, kind: type, context: str) -> Any:
  """`mapping[field]`, which must be a `kind` (bool is not an int here)."""
  if not isinstance(mapping, dict):
    raise _fail(where, f"{context} is a {type(mapping).__name__}, not an object")
  if field not in mapping:
    raise _fail(where, f"{context} has no field {field!r}")
  value = mapping[field]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise _fail(where, f"{context} field {field!r} is {value!r}, not a "
                       f"{kind.__name__}")
  return value


def _validate_layout(stored: Any, where: str) -> None:
  """Raises `ValueError` unless `stored` has every field a layout needs, well typed."""
  _require(where, stored, "format", str, "the layout")
  version = _require(where, stored, "version", int, "the layout")
  if stored["format"] != _FORMAT:
    raise ValueError(f"{where} is not a jaxbuf checkpoint (format "
                     f"{stored['format']!r}).")
  if version != _FORMAT_VERSION:
    raise ValueError(f"{where} has format version {version}; this jaxbuf reads "
                     f"version {_FORMAT_VERSION}.")
  for field in ("token", "state_type"):
    _require(where, stored, field, str, "the layout")
  dims = _require(where, stored, "buffer_dims", dict, "the layout")
  for name, size in dims.items():
    if not (isinstance(size, int) and not isinstance(size, bool)) and not (
        isinstance(size, list) and all(isinstance(s, int) for s in size)):
      raise _fail(where, f"buffer_dims[{name!r}] is {size!r}, not an integer")
  # Optional: checkpoints written before states recorded settings have none.
  settings = stored.get("settings", {})
  if not isinstance(settings, dict) or not all(
      isinstance(value, (str, int, float, bool))
      for value in settings.values()):
    raise _fail(where, f"settings is {settings!r}, not an object of numbers "
                       f"and strings")
  chunk = _require(where, stored, "chunk_bytes", int, "the layout")
  if chunk < 1:
    raise _fail(where, f"chunk_bytes is {chunk}, not positive")
  leaves = _require(where, stored, "leaves", dict, "the layout")
  for name, leaf in leaves.items():
    context = f"leaf {name}"
    shape = _require(where, leaf, "shape", list, context)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
               for d in shape):
      raise _fail(where, f"{context} has shape {shape!r}, not a list of sizes")
    dtype = _require(where, leaf, "dtype", str, context)
    if dtype.startswith("key<"):
      impl = _require(where, leaf, "key_impl", str, context)
      if impl not in _KEY_IMPLS:
        raise _fail(where, f"{context} has PRNG implementation {impl!r}; "
                           f"known: {list(_KEY_IMPLS)}")
      data_dtype = np.dtype(np.uint32)
      data_shape = _require(where, leaf, "key_data_shape", list, context)
      if (not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                  for d in data_shape) or data_shape[:len(shape)] != shape):
        raise _fail(where, f"{context} has key_data_shape {data_shape!r}, which "
                           f"does not extend its shape {shape!r}")
    elif dtype in _DTYPES:
      data_dtype, data_shape = _DTYPES[dtype], shape
    else:
      raise _fail(where, f"{context} has unknown dtype {dtype!r}")
    pieces = _require(where, leaf, "pieces", list, context)
    for piece in pieces:
      _validate_piece(where, piece, context, data_shape, data_dtype.itemsize, chunk)
    if not _covers_exactly([piece["index"] for piece in pieces], data_shape):
      raise _fail(where, f"{context} has pieces {[p['index'] for p in pieces]}, "
                         f"which do not cover its shape {data_shape} exactly once")


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _validate_piece(where: str, piece: Any, context: str, data_shape: list[int],
                    itemsize: int, chunk: int) -> None:
  """Raises unless `piece` is a box inside `data_shape` with one CRC-32 per chunk."""
  index = _require(where, piece, "index", list, f"{context} piece")
  if len(index) != len(data_shape) or not all(
      isinstance(bounds, list) and len(bounds) == 2 and all(map(_is_int, bounds))
      and 0 <= bounds[0] < bounds[1] <= size
      for bounds, size in zip(index, data_shape)):
    raise _fail(where, f"{context} has a piece with index {index!r}, not a "
                       f"nonempty box inside its shape {data_shape}")
  crcs = _require(where, piece, "crc32", list, f"{context} piece")
  nbytes = math.prod(stop - start for start, stop in index) * itemsize
  if len(crcs) != -(-nbytes // chunk) or not all(
      _is_int(c) and 0 <= c < 2**32 for c in crcs):
    raise _fail(where, f"{context} piece {_show_box(index)} has crc32 {crcs!r}, "
                       f"not one 32-bit value per {chunk}-byte chunk of its "
                       f"{nbytes} bytes")


def _covers_exactly(boxes: list[list[list[int]]], shape: list[int]) -> bool:
  """Whether the boxes (each [[start, stop], ...] per axis) tile `shape` exactly.

  The boxes' edges cut every axis into intervals; the grid of those cells must
  have no more cells than boxes (true of every jax sharding, whose shards form
  a grid), and each cell must lie in exactly one box.
  """
  if math.prod(shape) == 0:
    return not boxes
  edges = [sorted({0, size, *(box[axis][0] for box in boxes),
                   *(box[axis][1] for box in boxes)})
           for axis, size in enumerate(shape)]
  cells = [len(axis_edges) - 1 for axis_edges in edges]
  if math.prod(cells) > len(boxes):
    return False
  counts = np.zeros(cells, np.int64)
  for box in boxes:
    counts[tuple(slice(axis_edges.index(start), axis_edges.index(stop))
                 for axis_edges, (start, stop) in zip(edges, box))] += 1
  return bool(np.all(counts == 1))


def _show_box(box: list[list[int]]) -> str:
  return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


def _check_layout(stored: dict[str, Any], expected: dict[str, Any],
                  where: str) -> None:
  """Raises naming the first difference between a stored and an expected layout."""
  if stored["state_type"] != expected["state_type"]:
    raise TypeError(f"{where} holds a {stored['state_type']}, but `like` is a "
                    f"{expected['state_type']}.")
  for name, size in expected["buffer_dims"].items():
    stored_size = stored["buffer_dims"].get(name)
    if stored_size != (list(size) if isinstance(size, tuple) else size):
      shown = [tuple(value) if isinstance(value, (list, tuple)) else value
               for value in (stored_size, size)]
      if name == "vmapped buffers":
        raise ValueError(
            f"{where}: stacked states mismatch: the checkpoint holds "
            f"{_stack_words(shown[0])}, `like` {_stack_words(shown[1])}. A "
            f"jaxbuf.sharded state is a stack of one state per device, as is "
            f"a state made under jax.vmap: make `like` with the buffer that "
            f"saved it (e.g. the sharded buffer's init, on as many devices).")
      raise ValueError(f"{where}: {name} mismatch: the checkpoint has {name} "
                       f"{shown[0]}, `like` has {name} {shown[1]}.")
  stored_settings = stored.get("settings", {})
  if stored_settings and expected["settings"] and (
      stored_settings != expected["settings"]):
    differences = kind.settings_difference(
        stored_settings, expected["settings"],
        labels=("the checkpoint has", "`like` has"))
    raise ValueError(
        f"{where} was saved from a buffer with other settings than `like`'s "
        f"({differences}); the state's bookkeeping depends on them: load it "
        f"into a state of a buffer made with the checkpoint's settings.")
  stored_leaves, expected_leaves = stored["leaves"], expected["leaves"]
  if list(stored_leaves) != list(expected_leaves):
    missing = [p for p in expected_leaves if p not in stored_leaves]
    unexpected = [p for p in stored_leaves if p not in expected_leaves]
    raise TypeError(
        f"{where}: tree structure mismatch: leaves of `like` missing from the "
        f"checkpoint {missing}, leaves in the checkpoint not in `like` "
        f"{unexpected}.")
  for name, leaf in expected_leaves.items():
    found = stored_leaves[name]
    if found["shape"] != leaf["shape"]:
      raise ValueError(f"{where}: shape mismatch at leaf {name}: the checkpoint "
                       f"has {tuple(found['shape'])}, `like` has "
                       f"{tuple(leaf['shape'])}.")
    if found["dtype"] != leaf["dtype"]:
      raise TypeError(f"{where}: dtype mismatch at leaf {name}: the checkpoint "
                      f"has {found['dtype']}, `like` has {leaf['dtype']}.")


# --- Checksums ----------------------------------------------------------------------

def _host_bytes(array: Any) -> np.ndarray:
  """A leaf's bytes in C order, as uint8 (no copy for a host or CPU array)."""
  return np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)


def _crc32s(data: np.ndarray, pool: concurrent.futures.Executor
            ) -> list[concurrent.futures.Future]:
  """CRC-32 of each `_CHUNK_BYTES` chunk of `data` (uint8 [n]), started in `pool`."""
  return [pool.submit(zlib.crc32, data[start:start + _CHUNK_BYTES])
          for start in range(0, data.size, _CHUNK_BYTES)]


def _results(futures: list[concurrent.futures.Future]) -> list[int]:
  return [future.result() for future in futures]


def _stored_form(leaf: Any) -> Any:
  """What is written for a leaf: typed keys as their raw key data."""
  return jax.random.key_data(leaf) if _is_key(leaf) else leaf


def _box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
  """A shard's `index` (one slice per axis) as [[start, stop], ...]."""
  return [list(bound.indices(size)[:2]) for bound, size in zip(index, shape)]


def _written_pieces(stored: Any, pool: concurrent.futures.Executor
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
  return [(_box_of(shard.index, shape), _crc32s(_host_bytes(shard.data), pool))
          for shard in stored.addressable_shards if shard.replica_id == 0]


def _verify_leaf(where: str, name: str, array: jax.Array,
                 pieces: list[dict[str, Any]],
                 pool: concurrent.futures.Executor) -> None:
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
  starts = np.array([[start for start, _ in piece["index"]] for piece in pieces],
                    np.int64).reshape(len(pieces), array.ndim)
  stops = np.array([[stop for _, stop in piece["index"]] for piece in pieces],
                   np.int64).reshape(len(pieces), array.ndim)
  checks, cut = [], False
  for shard in array.addressable_shards:
    box = np.array(_box_of(shard.index, array.shape), np.int64).reshape(array.ndim, 2)
    low, high = box[:, 0], box[:, 1]
    overlaps = np.all((starts < high) & (stops > low), axis=1)
    inside = np.all((starts >= low) & (stops <= high), axis=1)
    cut |= bool(np.any(overlaps & ~inside))
    host = np.asarray(shard.data)
    for i in np.flatnonzero(overlaps & inside):
      local = tuple(slice(int(a - l), int(b - l))
                    for a, b, l in zip(starts[i], stops[i], low))
      checks.append((i, f"device {shard.device}", _crc32s(_host_bytes(host[local]), pool)))
  if cut:
    if not array.is_fully_addressable:
      raise ValueError(
          f"{where}: leaf {name} was saved in pieces "
          f"{[_show_box(piece['index']) for piece in pieces]} that the sharding "
          "of `like` cuts across processes, so their checksums cannot be "
          "verified; load it with the sharding it was saved with.")
    whole = np.asarray(array)
    for i, piece in enumerate(pieces):
      part = whole[tuple(slice(start, stop) for start, stop in piece["index"])]
      checks.append((i, "the host", _crc32s(_host_bytes(part), pool)))
  for i, held, futures in checks:
    if _results(futures) != pieces[i]["crc32"]:
      raise ValueError(
          f"{where}: checksum mismatch at leaf {name}, piece "
          f"{_show_box(pieces[i]['index'])} (restored on {held}): the stored "
          "data is corrupted (its CRC-32 differs from the one recorded at save).")


# --- Agreement between processes ----------------------------------------------------
#
# Every step of a multi-process save or load that can fail in some processes
# only ends in an agreement: each process reports how its step went, and if
# any failed, every process raises. So no process ever waits in a collective
# that another, having raised, will never reach. With one process these are
# no-ops.

_ERROR_TYPES = {error.__name__: error for error in (
    ValueError, TypeError, FileExistsError, FileNotFoundError, NotADirectoryError,
    PermissionError, BlockingIOError, OSError)}


def _gather(payload: Any) -> list[Any]:
  """Every process's JSON-serialisable `payload`, in process order (a collective)."""
  data = np.frombuffer(json.dumps(payload).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(
      np.array([data.size], np.int32))).reshape(-1)
  # A power-of-two width, so that only a few shapes are ever compiled.
  width = 1 << max(8, int(sizes.max() - 1).bit_length())
  padded = np.zeros(width, np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), width)
  return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes)]


def _agree(caller: str, error: Exception | None, payload: Any) -> list[Any]:
  """Every process's `payload`, or an error in every process if any step failed.

  The failing process raises its own exception; the others raise the same type
  naming the failing process and its message.
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return [payload]
  mine = None if error is None else [type(error).__name__, str(error)]
  outcomes = _gather({"error": mine, "payload": payload})
  if error is not None:
    raise error
  for process, outcome in enumerate(outcomes):
    if outcome["error"] is not None:
      kind, message = outcome["error"]
      raise _ERROR_TYPES.get(kind, RuntimeError)(
          f"{caller}: process {process} failed ({kind}), so every process "
          f"stops: {message}")
  return [outcome["payload"] for outcome in outcomes]


def _in_every_process(caller: str, step: Callable[[], Any],
                      share: Callable[[Any], Any] = lambda _: None
                      ) -> tuple[Any, list[Any]]:
  """Runs `step` here, then agrees: its result and every process's `share(result)`."""
  try:
    result, error = step(), None
  except Exception as caught:  # pylint: disable=broad-except
    # Reported to every process by `_agree`, which re-raises it here.
    result, error = None, caught
  return result, _agree(caller, error, None if error is not None else share(result))


def _layout_difference(first: dict[str, Any], other: dict[str, Any]) -> str:
  """The first field or leaf in which two layouts differ, with both values."""
  for field in ("state_type", "buffer_dims"):
    if first[field] != other[field]:
      return f"{field} {first[field]!r} and {other[field]!r}"
  if list(first["leaves"]) != list(other["leaves"]):
    return f"leaves {list(first['leaves'])} and {list(other['leaves'])}"
  for name, leaf in first["leaves"].items():
    if other["leaves"][name] != leaf:
      return f"leaf {name} {leaf} and {other['leaves'][name]}"
  return "different layouts"


def _check_processes_agree(caller: str, shared: list[dict[str, Any]]) -> None:
  """Raises (in every process alike) unless all passed the same path and tree."""
  first = shared[0]
  for process, other in enumerate(shared[1:], 1):
    if other["path"] != first["path"]:
      raise ValueError(
          f"{caller}: the processes disagree on the path: process 0 has "
          f"{first['path']}, process {process} has {other['path']}; every "
          "process must pass the same path, on a filesystem all of them see.")
    if other["layout"] != first["layout"]:
      raise ValueError(
          f"{caller}: the processes disagree on the state: process 0 and "
          f"process {process} have {_layout_difference(first['layout'], other['layout'])}.")


def _check_global(named: list[tuple[str, Any]]) -> None:
  """In a multi-process save, every leaf must be one array over all processes."""
  if jax.process_count() == 1:
    return
  for name, leaf in named:
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      raise ValueError(
          f"save: leaf {name} is a {type(leaf).__name__} held by this process "
          "alone; in a multi-process save every leaf must be a global "
          "jax.Array spanning the processes (e.g. made with "
          "jax.make_array_from_process_local_data, or placed with a "
          "NamedSharding over a mesh of jax.devices()).")


# --- Files and directories ----------------------------------------------------------

def _sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
  return path.with_name(path.name + suffix)


def _orbax_path(directory_fd: int, path: pathlib.Path) -> str:
  """The path orbax is given for `<directory>/state`: free of pattern characters."""
  if _PROC_FD.is_dir():
    return str(_PROC_FD / str(directory_fd) / _STATE)
  return str(path / _STATE)


def _check_path_is_usable(path: pathlib.Path, caller: str) -> None:
  if not _PROC_FD.is_dir() and _PATTERN_CHARACTERS & set(str(path)):
    raise ValueError(
        f"{caller}: the path {path} contains one of {sorted(_PATTERN_CHARACTERS)}, "
        "which orbax would read as a file pattern; on this system (no "
        "/proc/self/fd) choose a path without them.")


def _write_file(directory_fd: int, name: str, data: bytes) -> None:
  """Writes `name` in the directory durably: temporary file, fsync, rename."""
  temporary = name + ".tmp"
  handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644,
                   dir_fd=directory_fd)
  try:
    with os.fdopen(handle, "wb", closefd=False) as file:
      file.write(data)
    os.fsync(handle)
  finally:
    os.close(handle)
  os.rename(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)


def _read_json(directory_fd: int, name: str, where: str) -> Any:
  try:
    handle = os.open(name, os.O_RDONLY, dir_fd=directory_fd)
  except FileNotFoundError:
    raise ValueError(f"{where}: {name} is missing.") from None
  with os.fdopen(handle, "rb") as file:
    data = file.read()
  try:
    return json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise _fail(where, f"{name} is not valid JSON ({error})") from None


def _entries(directory: pathlib.Path) -> set[str]:
  """Every file and folder under `directory`, as paths relative to it."""
  found = set()
  for root, folders, files in os.walk(directory):
    relative = pathlib.Path(root).relative_to(directory)
    found.update(str(relative / name) for name in folders + files)
  return found


def _sync_directory(directory: pathlib.Path | int) -> None:
  """Makes renames inside `directory` durable (a no-op where unsupported)."""
  try:
    handle = os.open(directory, os.O_RDONLY) if not isinstance(directory, int) else None
  except OSError:
    return
  try:
    os.fsync(directory if handle is None else handle)
  except OSError:
    pass
  finally:
    if handle is not None:
      os.close(handle)


def _marker_of(directory_fd: int, where: str) -> dict[str, Any] | None:
  """The directory's marker if it is a complete jaxbuf checkpoint, else None."""
  try:
    marker = _read_json(directory_fd, _MARKER, where)
  except ValueError:
    return None
  try:
    layout = _read_json(directory_fd, _LAYOUT, where)
  except ValueError:
    layout = None
  if (not isinstance(marker, dict) or marker.get("format") != _FORMAT
      or not isinstance(marker.get("token"), str)
      or not isinstance(marker.get("entries"), list)):
    return None
  # A marker copied next to another layout is not a checkpoint; a layout that
  # does not parse is still jaxbuf's (load reports it, save may replace it).
  if isinstance(layout, dict) and layout.get("token") != marker["token"]:
    return None
  return marker


def _open_directory(path: pathlib.Path) -> int | None:
  try:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  except (FileNotFoundError, NotADirectoryError):
    return None


def _foreign_entries(path: pathlib.Path) -> list[str] | None:
  """None if `path` is not a jaxbuf checkpoint, else what jaxbuf did not write there."""
  handle = _open_directory(path)
  if handle is None:
    return None
  try:
    marker = _marker_of(handle, str(path))
  finally:
    os.close(handle)
  if marker is None:
    return None
  return sorted(_entries(path) - set(marker["entries"]) - {_MARKER})


def _check_replaceable(path: pathlib.Path, caller: str) -> None:
  if not path.exists() and not path.is_symlink():
    return
  foreign = _foreign_entries(path)
  if foreign is None:
    raise FileExistsError(f"{caller}: {path} exists and is not a jaxbuf "
                          "checkpoint; refusing to replace it.")
  if foreign:
    raise FileExistsError(f"{caller}: {path} holds entries jaxbuf did not write "
                          f"{foreign}; refusing to replace it.")


def _delete(directory: pathlib.Path) -> None:
  """Deletes a directory jaxbuf wrote, once no reader holds it."""
  handle = _open_directory(directory)
  if handle is None:
    return
  try:
    fcntl.flock(handle, fcntl.LOCK_EX)
    shutil.rmtree(directory)
  finally:
    os.close(handle)


def _settle(path: pathlib.Path) -> None:
  """Finishes or discards what a killed `save` to `path` left behind."""
  new, old = _sibling(path, _NEW_SUFFIX), _sibling(path, _OLD_SUFFIX)
  if not path.exists():
    for complete in (new, old):
      if _foreign_entries(complete) == []:
        os.replace(complete, path)
        break
  for leftover in (new, old):
    if leftover.exists():
      # `.jaxbuf-new` without a marker is a killed write (jaxbuf's reserved
      # name); a complete one is replaced only if it holds nothing foreign.
      if _foreign_entries(leftover) is not None:
        _check_replaceable(leftover, "save")
      _delete(leftover)
  _sync_directory(path.parent)


def _lock_writer(path: pathlib.Path) -> int:
  lock_path = _sibling(path, _LOCK_SUFFIX)
  handle = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as error:
    os.close(handle)
    if error.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
      raise BlockingIOError(
          error.errno, f"save: another save to {path} is in progress (it holds "
          f"{lock_path}); nothing was written. Retry once it has finished.") from None
    raise
  return handle


def _resolve(path: str | os.PathLike) -> pathlib.Path:
  """The real location of `path`: links in it and its parents followed."""
  return pathlib.Path(os.path.realpath(os.fspath(path)))


# --- save and load ------------------------------------------------------------------

def save(path: str | os.PathLike, state: PyTree) -> None:
  """Writes `state` to the directory `path`, replacing any checkpoint there.

  Works for every buffer state (`ReplayState`, `PrioritizedReplayState`,
  `RolloutState`, ...) or any pytree of arrays, sharded or not, with leaves of
  any size (zero included) and of dtype bool, (u)int8-64, float16, bfloat16,
  float32/64, complex, float8 or typed PRNG keys. The write is atomic: a
  process killed mid-save leaves either the previous checkpoint or the new one,
  complete, never a mix and never nothing (see the module docstring for how).

  With several processes (`jax.distributed`), every process calls `save` with
  the same path, on a filesystem all of them see, and the same state of global
  arrays; each writes the shards it holds (see the module docstring).

  Args:
    path: a directory; any name, links followed. Created, or replaced if it is
      a jaxbuf checkpoint holding only what jaxbuf wrote. Its parent must exist.
      A lock file `<path>.jaxbuf-lock` is left beside it.
    state: the state to save. Not consumed: keep using it afterwards.

  Raises:
    FileExistsError: `path` exists and is not a jaxbuf checkpoint, or holds
      entries jaxbuf did not write; nothing is written.
    BlockingIOError: another save to `path` is running; nothing is written.
    TypeError: a leaf is not an array or has a dtype checkpoints do not store.
    ValueError: (several processes) they pass different paths or states, or a
      leaf is held by one process alone. An error in any process is raised in
      every process.

  >>> import tempfile, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.uniform_replay(100)
  >>> state = buffer.add(buffer.init({"obs": jnp.zeros(3)}),
  ...                    {"obs": jnp.ones((5, 3))})
  >>> path = tempfile.mkdtemp() + "/replay"
  >>> jaxbuf.save(path, state)
  >>> restored = jaxbuf.load(path, like=buffer.init({"obs": jnp.zeros(3)}))
  >>> int(restored.size), restored.storage["obs"].shape
  (5, (100, 3))
  """
  primary = jax.process_index() == 0

  def prepare() -> tuple[pathlib.Path, dict[str, Any], list[tuple[str, Any]]]:
    resolved = _resolve(path)
    _check_path_is_usable(resolved, "save")
    # JAX would fail half-way through writing, on the first deleted array.
    validation.check_not_donated(state, what="save")
    if not resolved.parent.is_dir():
      raise FileNotFoundError(
          f"save: the parent directory of {resolved} does not exist.")
    named = [(name, _stored_form(leaf)) for name, leaf in _named_leaves(state)]
    _check_global(named)
    return resolved, _layout(state), named

  (path, layout, named), shared = _in_every_process(
      "save", prepare, lambda r: {"path": str(r[0]), "layout": r[1]})
  _check_processes_agree("save", shared)
  new, old = _sibling(path, _NEW_SUFFIX), _sibling(path, _OLD_SUFFIX)
  lock = new_fd = None
  created = complete = False
  try:
    def start() -> None:
      nonlocal lock, created
      if primary:
        lock = _lock_writer(path)
        _settle(path)
        _check_replaceable(path, "save")
        os.mkdir(new)
        created = True
        os.mkdir(new / _STATE)

    _in_every_process("save", start)

    def write() -> dict[str, list[Any]]:
      nonlocal new_fd
      try:
        new_fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
      except FileNotFoundError:
        raise FileNotFoundError(
            f"save: process {jax.process_index()} does not see {new}, which "
            "process 0 created: the path must be on a filesystem every process "
            "sees.") from None
      return _write_arrays(new_fd, new, named)

    _, pieces = _in_every_process("save", write, lambda mine: mine)

    def commit() -> None:
      nonlocal complete
      if primary:
        _commit(new_fd, new, state, layout, named, pieces)
        complete = True
        _sync_directory(path.parent)
        if path.exists():
          os.replace(path, old)
        os.replace(new, path)
        _sync_directory(path.parent)
        _delete(old)

    _in_every_process("save", commit)
  finally:
    for handle in (new_fd, lock):
      if handle is not None:
        os.close(handle)
    if created and not complete:
      # A save that raised before its marker leaves no partial
      # `<path>.jaxbuf-new` behind (a killed one does; the next save tidies
      # it up). A complete one may be the only checkpoint left: `load`
      # reads it.
      shutil.rmtree(new, ignore_errors=True)


def _write_arrays(directory_fd: int, directory: pathlib.Path,
                  named: list[tuple[str, Any]]) -> dict[str, list[Any]]:
  """Writes this process's shards into `<directory>/state`; returns their CRC-32s.

  Returns:
    For each leaf name, the pieces this process wrote: `[box, crc32s]`.
  """
  to_write = {f"leaf_{i}": leaf for i, (_, leaf) in enumerate(named)
              if math.prod(np.shape(leaf)) > 0}
  with concurrent.futures.ThreadPoolExecutor(_CHECKSUM_THREADS) as pool:
    # The checksums run in threads while orbax writes (zlib releases the GIL).
    started = [(name, _written_pieces(leaf, pool)) for name, leaf in named]
    if to_write:
      handler = ocp.StandardCheckpointHandler()
      try:
        handler.save(epath.Path(_orbax_path(directory_fd, directory)),
                     args=ocp.args.StandardSave(to_write))
      finally:
        handler.close()
    return {name: [[box, _results(futures)] for box, futures in pieces]
            for name, pieces in started}


def _commit(directory_fd: int, directory: pathlib.Path, state: PyTree,
            layout: dict[str, Any], named: list[tuple[str, Any]],
            pieces: list[dict[str, list[Any]]]) -> None:
  """Completes the checkpoint in `directory`: orbax's index, layout, marker last.

  Args:
    pieces: every process's `_write_arrays` result, in process order.
  """
  if any(math.prod(np.shape(leaf)) > 0 for _, leaf in named):
    # orbax merges the processes' indexes of their written shards.
    handler = ocp.StandardCheckpointHandler()
    try:
      handler.finalize(epath.Path(_orbax_path(directory_fd, directory)))
    finally:
      handler.close()
  for (name, original), (_, leaf) in zip(_named_leaves(state), named):
    entry = layout["leaves"][name]
    boxes = sorted((box, crcs) for process in pieces for box, crcs in process[name])
    entry["pieces"] = [{"index": box, "crc32": crcs} for box, crcs in boxes]
    if _is_key(original):
      entry["key_impl"] = str(jax.random.key_impl(original))
      entry["key_data_shape"] = [int(d) for d in np.shape(leaf)]
  token = secrets.token_hex(16)
  layout.update(token=token, chunk_bytes=_CHUNK_BYTES)
  encoded = json.dumps(layout, indent=1).encode()
  # What the processes reported must tile every leaf, as `load` will demand.
  _validate_layout(json.loads(encoded), f"save: the checkpoint written at {directory}")
  _write_file(directory_fd, _LAYOUT, encoded)
  entries = sorted(_entries(directory))
  # Each file's size, so that `load` names a truncated or deleted file
  # before orbax reads it (orbax's own error is kilobytes long).
  # The layout is checked on its own, field by field.
  sizes = {entry: os.stat(entry, dir_fd=directory_fd).st_size
           for entry in entries if entry.startswith(_STATE + os.sep)
           and not os.path.isdir(os.path.join(directory, entry))}
  marker = {"format": _FORMAT, "version": _FORMAT_VERSION, "token": token,
            "entries": entries, "sizes": sizes}
  _write_file(directory_fd, _MARKER, json.dumps(marker, indent=1).encode())
  _sync_directory(directory_fd)


def _open_committed(path: pathlib.Path) -> tuple[int, pathlib.Path]:
  """A descriptor of the complete checkpoint saved at `path`, share-locked."""
  candidates = (path, _sibling(path, _NEW_SUFFIX), _sibling(path, _OLD_SUFFIX))
  for _ in range(_OPEN_ATTEMPTS):
    seen = False
    for candidate in candidates:
      handle = _open_directory(candidate)
      if handle is None:
        continue
      seen = True
      fcntl.flock(handle, fcntl.LOCK_SH)
      try:
        unchanged = os.stat(candidate).st_ino == os.fstat(handle).st_ino
      except FileNotFoundError:
        unchanged = False
      if unchanged and _marker_of(handle, str(candidate)) is not None:
        return handle, candidate
      os.close(handle)
    if not seen:
      break
  raise FileNotFoundError(f"load: no checkpoint at {path}.")


def _restore_target(leaf: Any, shape: list[int], dtype: Any) -> jax.ShapeDtypeStruct:
  """Shape, dtype and sharding to restore a stored leaf with (`like`'s sharding).

  A leaf of `like` without a sharding goes to the first device with one
  process, and is replicated over every device with several.
  """
  sharding = (leaf.sharding if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
              else None)
  if sharding is None and jax.process_count() > 1:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  elif sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def load(path: str | os.PathLike, *, like: PyTree) -> PyTree:
  """Reads the state saved at `path`, bit for bit, shaped and placed like `like`.

  With several processes (`jax.distributed`), every process calls `load` with
  the same path and `like`; each reads and verifies the shards it holds, and
  none returns unless every process verified its own.

  Args:
    path: the directory given to `save` (links followed). If a save there was
      killed part-way, the complete checkpoint it left is read; a save running
      meanwhile in another process does not disturb the read.
    like: a state of the expected kind, sizes, item structure, shapes and
      dtypes: e.g. `buffer.init(example_item)`, or an abstract one from
      `jax.eval_shape(buffer.init, example_item)`. Only its structure, shapes,
      dtypes and shardings are read: each array is restored with the sharding
      of the matching leaf of `like` (one device if it has none; replicated
      over every device with several processes).

  Returns:
    The saved state, of the same type as `like`.

  Resharding: a checkpoint of a `jaxbuf.sharded` buffer loads into a `like`
  of the same buffer sharded over another number of devices, or unsharded,
  and an unsharded checkpoint into a sharded `like`. The state is regrouped
  exactly (`BufferState.joined` / `divided`: every item, priority and
  counter kept, sampling from the same distribution), passing whole through
  one device on the way; where no exact regrouping exists (envs that do not
  split over the devices, a ring whose items do not) the error says why.
  With several processes each reads the whole state, so a checkpoint
  saved by any number of processes loads in any other, regrouped where
  the device counts differ (a `like` whose devices are all in one process
  comes back replicated over every device, as a leaf without a sharding).

  Raises:
    FileNotFoundError: nothing was saved at `path`.
    TypeError: the checkpoint holds another kind of state, another tree
      structure (item structure), or a leaf of another dtype; the message
      names the leaf path and both values.
    ValueError: another capacity (or num_steps / num_envs), or a leaf of
      another shape; a malformed or edited layout; stored data whose shape,
      dtype or CRC-32 differs from the layout (corruption), naming the leaf
      and the piece; several processes passing different paths or `like`s.
      An error in any process is raised in every process.
  """
  devices = _devices_to_regroup(path, like)
  if devices is None:
    return _load_as(path, like)
  stored_devices, wanted_devices = devices
  # The stored layout is read whole and regrouped on one device, or with
  # several processes replicated over the devices of `like` (every device
  # where `like` does not span the processes), then placed like `like`.
  whole = _whole_on(like)
  unplaced = jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype), like)
  stored_like = jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=whole),
      jax.eval_shape(lambda state: base.regrouped(state, stored_devices),
                     unplaced))
  state = base.regrouped(_load_as(path, stored_like), wanted_devices)
  return jax.tree.map(
      lambda leaf, like_leaf: leaf if not _spans_the_processes(like_leaf)
      else jax.device_put(leaf, like_leaf.sharding), state, like)


def _spans_the_processes(leaf: Any) -> bool:
  """Whether `leaf` has a sharding with devices in every process."""
  sharding = getattr(leaf, "sharding", None)
  return sharding is not None and {
      device.process_index for device in sharding.device_set} == set(
          range(jax.process_count()))


def _whole_on(like: PyTree) -> jax.sharding.Sharding | None:
  """Where a regrouped state is assembled: one device (None) with one
  process; with several, replicated over the mesh of `like` where it spans
  the processes, else over every device (as a leaf without a sharding)."""
  if jax.process_count() == 1:
    return None
  spanning = [leaf.sharding for leaf in jax.tree.leaves(like)
              if _spans_the_processes(leaf)
              and isinstance(leaf.sharding, jax.sharding.NamedSharding)]
  mesh = (spanning[0].mesh if spanning else
          jax.sharding.Mesh(np.array(jax.devices()), ("devices",)))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _devices_to_regroup(path: str | os.PathLike, like: PyTree
                        ) -> tuple[int | None, int | None] | None:
  """(stored, wanted) device counts when the checkpoint differs from `like`
  only in them; None otherwise (the exact load then reports any mismatch)."""
  wanted = _settings(like)
  if not wanted:
    return None
  try:
    handle, _ = _open_committed(_resolve(path))
  except (OSError, ValueError):
    return None
  try:
    stored = _read_json(handle, _LAYOUT, "load").get("settings") or {}
  except (OSError, ValueError, AttributeError):
    return None
  finally:
    os.close(handle)
  stored_devices, wanted_devices = stored.get("devices"), wanted.get("devices")
  without_devices = lambda settings: {name: value for name, value
                                      in settings.items() if name != "devices"}
  if (stored_devices == wanted_devices
      or without_devices(stored) != without_devices(wanted)):
    return None
  return stored_devices, wanted_devices


def _load_as(path: str | os.PathLike, like: PyTree) -> PyTree:
  """`load` of a checkpoint whose layout must be `like`'s exactly."""
  def prepare() -> tuple[pathlib.Path, dict[str, Any]]:
    resolved = _resolve(path)
    _check_path_is_usable(resolved, "load")
    return resolved, _layout(like)

  (path, expected), shared = _in_every_process(
      "load", prepare, lambda r: {"path": str(r[0]), "layout": r[1]})
  _check_processes_agree("load", shared)
  where = f"load: the checkpoint at {path}"
  handle = None
  try:
    def open_and_check() -> tuple[int, pathlib.Path, dict[str, Any]]:
      opened, found = _open_committed(path)
      try:
        _check_file_sizes(opened, _read_json(opened, _MARKER, where), where)
        stored = _read_json(opened, _LAYOUT, where)
        _validate_layout(stored, where)
        _check_layout(stored, expected, where)
      except Exception:
        os.close(opened)
        raise
      return opened, found, stored

    for _ in range(_OPEN_ATTEMPTS):
      (handle, found, stored), tokens = _in_every_process(
          "load", open_and_check, lambda r: r[2]["token"])
      # A save replacing the checkpoint between the processes' opens: retry.
      if len(set(tokens)) == 1:
        break
      os.close(handle)
      handle = None
    else:
      raise ValueError(f"{where}: the processes kept opening different "
                       "checkpoints (saves kept replacing it); nothing was read.")
    leaves, _ = _in_every_process(
        "load", lambda: _read_arrays(handle, found, stored, like, where))
  finally:
    if handle is not None:
      os.close(handle)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def _check_file_sizes(directory_fd: int, marker: Any, where: str) -> None:
  """Raises `ValueError` naming a file the marker lists that is missing or
  has another size than when it was saved (nothing is read then).

  Markers written before sizes were recorded have none, and pass.
  """
  sizes = marker.get("sizes", {}) if isinstance(marker, dict) else {}
  if not isinstance(sizes, dict):
    raise _fail(where, f"the marker's sizes are {type(sizes).__name__}, not "
                       "an object")
  for name, size in sizes.items():
    if not _is_int(size) or os.path.isabs(name) or ".." in name.split("/"):
      raise _fail(where, f"the marker records size {size!r} for {name!r}")
    try:
      found = os.stat(name, dir_fd=directory_fd).st_size
    except FileNotFoundError:
      raise ValueError(f"{where}: the file {name} is missing (deleted after "
                       "the save); nothing was read.") from None
    if found != size:
      raise ValueError(f"{where}: the file {name} has {found} bytes, but "
                       f"{size} were saved (truncated or overwritten); nothing "
                       "was read.")


def _unreadable(where: str, entries: list[tuple[str, Any]],
                error: Exception, files: str = "") -> ValueError:
  """orbax's error reading the arrays in one line, naming the leaves it
  names by their keys and the file it names last."""
  text = str(error)
  keys = sorted({int(i) for i in re.findall(r"\bleaf_(\d+)\b", text)
                 if int(i) < len(entries)})
  named = f" of leaf {', '.join(entries[i][0] for i in keys)}" if keys else ""
  named_files = re.findall(r"/state/([^\s\"']+)", text)
  in_file = (f" (file {_STATE}/{named_files[-1]})" if named_files else
             f" ({files})" if files else "")
  # orbax appends the whole tensorstore spec, kilobytes of it.
  reason = re.split(r"\s*\[tensorstore_spec=", text)[0].splitlines()
  reason = reason[0] if reason else type(error).__name__
  if len(reason) > 300:
    reason = reason[:300] + " ..."
  return ValueError(f"{where}: the stored arrays{named} cannot be read"
                    f"{in_file}, corrupted or edited: {type(error).__name__}: "
                    f"{reason}")


def _read_arrays(handle: int, found: pathlib.Path, stored: dict[str, Any],
                 like: PyTree, where: str) -> list[Any]:
  """Restores and verifies every leaf of a checked layout, placed like `like`."""
  like_leaves = [leaf for _, leaf in _named_leaves(like)]
  entries = list(stored["leaves"].items())
  targets = {}
  for i, ((name, entry), leaf) in enumerate(zip(entries, like_leaves)):
    shape = entry.get("key_data_shape", entry["shape"])
    dtype = np.dtype(np.uint32) if _is_key(leaf) else _DTYPES[entry["dtype"]]
    targets[f"leaf_{i}"] = _restore_target(leaf, shape, dtype)
  to_read = {key: t for key, t in targets.items() if math.prod(t.shape) > 0}
  restored = {}
  if to_read:
    handler = ocp.StandardCheckpointHandler()
    state_path = epath.Path(_orbax_path(handle, found))
    try:
      try:
        stored_arrays = handler.metadata(state_path).tree
      # Whatever orbax raises on a damaged file (a flipped bit in
      # `state/_sharding` is a NotImplementedError) is a damaged checkpoint.
      except Exception as error:  # pylint: disable=broad-except
        raise _unreadable(where, entries, error,
                          f"orbax's index, {_STATE}/_METADATA or "
                          f"{_STATE}/_sharding") from None
      # orbax casts to the requested dtype: compare what it stored first.
      for key, target in to_read.items():
        meta = stored_arrays.get(key) if isinstance(stored_arrays, dict) else None
        if (meta is None or tuple(meta.shape) != target.shape
            or np.dtype(meta.dtype) != target.dtype):
          name = entries[int(key.split("_")[1])][0]
          found_as = ("nothing" if meta is None else
                      f"shape {tuple(meta.shape)} and dtype {meta.dtype}")
          raise ValueError(f"{where}: leaf {name} is stored with {found_as}, "
                           f"but the layout says shape {target.shape} and "
                           f"dtype {target.dtype}.")
      try:
        restored = handler.restore(state_path, args=ocp.args.StandardRestore(to_read))
      except Exception as error:  # pylint: disable=broad-except
        raise _unreadable(where, entries, error) from None
    finally:
      handler.close()
  leaves = []
  with concurrent.futures.ThreadPoolExecutor(_CHECKSUM_THREADS) as pool:
    for i, ((name, entry), leaf) in enumerate(zip(entries, like_leaves)):
      target = targets[f"leaf_{i}"]
      array = restored.get(f"leaf_{i}")
      if array is None:
        array = jax.make_array_from_callback(
            target.shape, target.sharding,
            lambda index, t=target: np.zeros(t.shape, t.dtype)[index])
      if tuple(array.shape) != target.shape or array.dtype != target.dtype:
        raise ValueError(f"{where}: leaf {name} was restored with shape "
                         f"{tuple(array.shape)} and dtype {array.dtype}, but the "
                         f"layout says {target.shape} and {target.dtype}.")
      _verify_leaf(where, name, array, entry["pieces"], pool)
      if _is_key(leaf):
        array = jax.random.wrap_key_data(array, impl=entry["key_impl"])
        if str(array.dtype) != entry["dtype"]:
          raise ValueError(f"{where}: leaf {name} has PRNG implementation "
                           f"{entry['key_impl']}, which is not {entry['dtype']}.")
      leaves.append(array)
  return leaves
