"""What a checkpoint holds, as plain JSON data, and the checks of a stored one.

Part of `jaxbuf.save` / `load` (`saving.py` maps the rooms). A layout
describes a state without its arrays: the state's type, the sizes and bound
settings of its buffer, and for every leaf its path, shape and dtype, with
the pieces written (boxes with their CRC-32s) once the arrays are on disk.

A stored layout is untrusted data: `validate_layout` checks every field and
type, and that each leaf's pieces tile it exactly once, before `check_layout`
compares it with the layout `like` asks for. Nothing here touches a file.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core import kind
from jaxbuf._src.core.kind import BufferState
from jaxbuf._src.core.pytypes import PyTree

FORMAT = "jaxbuf-checkpoint"
FORMAT_VERSION = 3
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
DTYPES = {
  str(np.dtype(t)): np.dtype(t)
  for t in (
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    jnp.bfloat16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
  )
}


# --- Describing a state -------------------------------------------------------------


def _type_name(state: PyTree) -> str:
  return f"{type(state).__module__}.{type(state).__qualname__}"


# The modules of the state types that issue 31 moved (commit e196a8f, moves
# only): checkpoints saved before it record the old paths, and are the same
# types. A new move of a state type adds its old path here.
_MOVED_MODULES = {
  f"jaxbuf._src.{old}": f"jaxbuf._src.{new}"
  for old, new in (
    ("ring", "core.ring"),
    ("prioritized", "items.prioritized"),
    ("rollout", "onpolicy.rollout"),
    ("sequence", "streams.sequence"),
    ("prioritized_sequence", "streams.prioritized_sequence"),
    ("episode", "streams.episode"),
    ("frames", "streams.frames"),
    ("hindsight", "streams.hindsight"),
    ("base", "core.base"),
    ("transitions", "streams.transitions"),
    ("offline", "offline.mapping"),
  )
}


def current_type_name(recorded: str) -> str:
  """A recorded `module.qualname` with a moved module's old path made new."""
  module, _, name = recorded.rpartition(".")
  return f"{_MOVED_MODULES.get(module, module)}.{name}"


def _buffer_dims(state: PyTree) -> dict[str, Any]:
  """The sizes a buffer was made with (none for a plain pytree of arrays)."""
  return state.buffer_dims() if isinstance(state, BufferState) else {}


def settings_of(state: PyTree) -> dict[str, Any]:
  """The bound settings the state records (`jaxbuf._src.core.kind`); none for a
  plain pytree or a state made by a module's `init`."""
  return dict(getattr(state, "settings", None) or ())


def is_key(leaf: Any) -> bool:
  return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _leaf_layout(name: str, leaf: Any) -> dict[str, Any]:
  """A leaf's shape and dtype as the layout records them (typed keys by dtype name)."""
  if not hasattr(leaf, "dtype"):
    raise TypeError(
      f"save/load: leaf {name} is a {type(leaf).__name__}, not an "
      "array; every leaf of a state must be an array."
    )
  dtype = str(leaf.dtype) if is_key(leaf) else str(np.dtype(leaf.dtype))
  if not is_key(leaf) and dtype not in DTYPES:
    raise TypeError(
      f"save/load: leaf {name} has dtype {dtype}, which jaxbuf "
      f"checkpoints do not store; supported: {sorted(DTYPES)} "
      "and typed PRNG keys."
    )
  return {"shape": [int(d) for d in np.shape(leaf)], "dtype": dtype}


def named_leaves(state: PyTree) -> list[tuple[str, Any]]:
  return [
    (jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
  ]


def layout(state: PyTree) -> dict[str, Any]:
  """Type, buffer sizes, and each leaf's shape and dtype (no checksums yet)."""
  return {
    "format": FORMAT,
    "version": FORMAT_VERSION,
    "state_type": _type_name(state),
    "buffer_dims": _buffer_dims(state),
    "settings": settings_of(state),
    "leaves": {name: _leaf_layout(name, leaf) for name, leaf in named_leaves(state)},
  }


# --- Validating a stored layout, comparing layouts ----------------------------------


def fail(where: str, problem: str) -> ValueError:
  return ValueError(f"{where}: malformed layout: {problem}.")


def _require(where: str, mapping: Any, field: str, kind: type, context: str) -> Any:
  """`mapping[field]`, which must be a `kind` (bool is not an int here)."""
  if not isinstance(mapping, dict):
    raise fail(where, f"{context} is a {type(mapping).__name__}, not an object")
  if field not in mapping:
    raise fail(where, f"{context} has no field {field!r}")
  value = mapping[field]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise fail(where, f"{context} field {field!r} is {value!r}, not a {kind.__name__}")
  return value


def validate_layout(stored: Any, where: str) -> None:
  """Raises `ValueError` unless `stored` has every field a layout needs, well typed."""
  _require(where, stored, "format", str, "the layout")
  version = _require(where, stored, "version", int, "the layout")
  if stored["format"] != FORMAT:
    raise ValueError(f"{where} is not a jaxbuf checkpoint (format {stored['format']!r}).")
  if version != FORMAT_VERSION:
    raise ValueError(
      f"{where} has format version {version}; this jaxbuf reads version {FORMAT_VERSION}."
    )
  for field in ("token", "state_type"):
    _require(where, stored, field, str, "the layout")
  dims = _require(where, stored, "buffer_dims", dict, "the layout")
  for name, size in dims.items():
    if not (isinstance(size, int) and not isinstance(size, bool)) and not (
      isinstance(size, list) and all(isinstance(s, int) for s in size)
    ):
      raise fail(where, f"buffer_dims[{name!r}] is {size!r}, not an integer")
  # Optional: checkpoints written before states recorded settings have none.
  settings = stored.get("settings", {})
  if not isinstance(settings, dict) or not all(
    isinstance(value, (str, int, float, bool)) for value in settings.values()
  ):
    raise fail(where, f"settings is {settings!r}, not an object of numbers and strings")
  chunk = _require(where, stored, "chunk_bytes", int, "the layout")
  if chunk < 1:
    raise fail(where, f"chunk_bytes is {chunk}, not positive")
  leaves = _require(where, stored, "leaves", dict, "the layout")
  for name, leaf in leaves.items():
    context = f"leaf {name}"
    shape = _require(where, leaf, "shape", list, context)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
      raise fail(where, f"{context} has shape {shape!r}, not a list of sizes")
    dtype = _require(where, leaf, "dtype", str, context)
    if dtype.startswith("key<"):
      impl = _require(where, leaf, "key_impl", str, context)
      if impl not in _KEY_IMPLS:
        raise fail(where, f"{context} has PRNG implementation {impl!r}; known: {list(_KEY_IMPLS)}")
      data_dtype = np.dtype(np.uint32)
      data_shape = _require(where, leaf, "key_data_shape", list, context)
      if (
        not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in data_shape)
        or data_shape[: len(shape)] != shape
      ):
        raise fail(
          where,
          f"{context} has key_data_shape {data_shape!r}, which does not extend its shape {shape!r}",
        )
    elif dtype in DTYPES:
      data_dtype, data_shape = DTYPES[dtype], shape
    else:
      raise fail(where, f"{context} has unknown dtype {dtype!r}")
    pieces = _require(where, leaf, "pieces", list, context)
    for piece in pieces:
      _validate_piece(where, piece, context, data_shape, data_dtype.itemsize, chunk)
    if not covers_exactly([piece["index"] for piece in pieces], data_shape):
      raise fail(
        where,
        f"{context} has pieces {[p['index'] for p in pieces]}, "
        f"which do not cover its shape {data_shape} exactly once",
      )


def is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _validate_piece(
  where: str, piece: Any, context: str, data_shape: list[int], itemsize: int, chunk: int
) -> None:
  """Raises unless `piece` is a box inside `data_shape` with one CRC-32 per chunk."""
  index = _require(where, piece, "index", list, f"{context} piece")
  if len(index) != len(data_shape) or not all(
    isinstance(bounds, list)
    and len(bounds) == 2
    and all(map(is_int, bounds))
    and 0 <= bounds[0] < bounds[1] <= size
    for bounds, size in zip(index, data_shape)
  ):
    raise fail(
      where,
      f"{context} has a piece with index {index!r}, not a "
      f"nonempty box inside its shape {data_shape}",
    )
  crcs = _require(where, piece, "crc32", list, f"{context} piece")
  nbytes = math.prod(stop - start for start, stop in index) * itemsize
  if len(crcs) != -(-nbytes // chunk) or not all(is_int(c) and 0 <= c < 2**32 for c in crcs):
    raise fail(
      where,
      f"{context} piece {show_box(index)} has crc32 {crcs!r}, "
      f"not one 32-bit value per {chunk}-byte chunk of its "
      f"{nbytes} bytes",
    )


def covers_exactly(boxes: list[list[list[int]]], shape: list[int]) -> bool:
  """Whether the boxes (each [[start, stop], ...] per axis) tile `shape` exactly.

  The boxes' edges cut every axis into intervals; the grid of those cells must
  have no more cells than boxes (true of every jax sharding, whose shards form
  a grid), and each cell must lie in exactly one box.
  """
  if math.prod(shape) == 0:
    return not boxes
  edges = [
    sorted({0, size, *(box[axis][0] for box in boxes), *(box[axis][1] for box in boxes)})
    for axis, size in enumerate(shape)
  ]
  cells = [len(axis_edges) - 1 for axis_edges in edges]
  if math.prod(cells) > len(boxes):
    return False
  counts = np.zeros(cells, np.int64)
  for box in boxes:
    counts[
      tuple(
        slice(axis_edges.index(start), axis_edges.index(stop))
        for axis_edges, (start, stop) in zip(edges, box)
      )
    ] += 1
  return bool(np.all(counts == 1))


def show_box(box: list[list[int]]) -> str:
  return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


STACK_DIM = "vmapped buffers"  # the leading axes of a stack of states


def _stack_words(stack: Any) -> str:
  """A stack of states (leading axes), as `check_layout` names it."""
  if not stack:
    return "one state (no leading axes)"
  return f"a stack of states with leading axes {tuple(stack)}"


def check_layout(stored: dict[str, Any], expected: dict[str, Any], where: str) -> None:
  """Raises naming the first difference between a stored and an expected layout."""
  if current_type_name(stored["state_type"]) != expected["state_type"]:
    raise TypeError(
      f"{where} holds a {stored['state_type']}, but `like` is a {expected['state_type']}."
    )
  stored_stack = stored["buffer_dims"].get(STACK_DIM)
  expected_stack = expected["buffer_dims"].get(STACK_DIM)
  stacks_agree = (stored_stack or None) == (list(expected_stack) if expected_stack else None)
  # Over other stackings the sizes are per stacked state (a sharded buffer's
  # per device), not the sizes a user chose: then the settings speak first.
  for name, size in expected["buffer_dims"].items():
    stored_size = stored["buffer_dims"].get(name)
    if stacks_agree and stored_size != (list(size) if isinstance(size, tuple) else size):
      shown = [
        tuple(value) if isinstance(value, (list, tuple)) else value for value in (stored_size, size)
      ]
      raise ValueError(
        f"{where}: {name} mismatch: the checkpoint has {name} "
        f"{shown[0]}, `like` has {name} {shown[1]}."
      )
  stored_settings = stored.get("settings", {})
  if stored_settings and expected["settings"] and (stored_settings != expected["settings"]):
    differences = kind.settings_difference(
      stored_settings, expected["settings"], labels=("the checkpoint has", "`like` has")
    )
    raise ValueError(
      f"{where} was saved from a buffer with other settings than `like`'s "
      f"({differences}); the state's bookkeeping depends on them: load it "
      f"into a state of a buffer made with the checkpoint's settings."
    )
  if not stacks_agree:
    raise ValueError(
      f"{where}: stacked states mismatch: the checkpoint holds "
      f"{_stack_words(stored_stack)}, `like` "
      f"{_stack_words(expected_stack)}. A jaxbuf.sharded state is a stack "
      f"of one state per device, as is a state made under jax.vmap: make "
      f"`like` with the buffer that saved it (e.g. the sharded buffer's "
      f"init, on as many devices)."
    )
  stored_leaves, expected_leaves = stored["leaves"], expected["leaves"]
  if list(stored_leaves) != list(expected_leaves):
    missing = [p for p in expected_leaves if p not in stored_leaves]
    unexpected = [p for p in stored_leaves if p not in expected_leaves]
    raise TypeError(
      f"{where}: tree structure mismatch: leaves of `like` missing from the "
      f"checkpoint {missing}, leaves in the checkpoint not in `like` "
      f"{unexpected}."
    )
  for name, leaf in expected_leaves.items():
    found = stored_leaves[name]
    if found["shape"] != leaf["shape"]:
      raise ValueError(
        f"{where}: shape mismatch at leaf {name}: the checkpoint "
        f"has {tuple(found['shape'])}, `like` has "
        f"{tuple(leaf['shape'])}."
      )
    if found["dtype"] != leaf["dtype"]:
      raise TypeError(
        f"{where}: dtype mismatch at leaf {name}: the checkpoint "
        f"has {found['dtype']}, `like` has {leaf['dtype']}."
      )


def layout_difference(first: dict[str, Any], other: dict[str, Any]) -> str:
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
