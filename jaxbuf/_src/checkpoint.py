"""Saving and loading buffer states with orbax-checkpoint, atomically.

Shape key: C capacity, T rollout length (num_steps), N envs.

A checkpoint is a directory holding the state's arrays (orbax's standard
format) and a small JSON layout: the state's type and every leaf's path,
shape and dtype. `load` compares the layout with the state you expect before
reading any array, so a mismatch reads as what it is (a capacity, an item
structure, a leaf shape or dtype) instead of a failure deep inside orbax.

Writes never lose the previous checkpoint. orbax writes each checkpoint into a
temporary directory and renames it into place once complete; `save` aims that
at a sibling `<path>.jaxbuf-new` and then swaps it in:

  1. write `<path>.jaxbuf-new` (orbax: temporary directory, then rename);
  2. rename `<path>` to `<path>.jaxbuf-old`;
  3. rename `<path>.jaxbuf-new` to `<path>`;
  4. delete `<path>.jaxbuf-old`.

A process killed at any point leaves one complete checkpoint: the previous one
before step 2, the new one from step 2 on (after step 2 it sits at
`<path>.jaxbuf-new` until step 3 renames it). `load` reads whichever that is,
and the next `save` to the same path tidies up. One process saves a given path
at a time; saves of multi-host states are not covered.
"""

import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxbuf._src.base import BufferState, PyTree

_FORMAT = "jaxbuf-checkpoint"
_FORMAT_VERSION = 1
_NEW_SUFFIX = ".jaxbuf-new"
_OLD_SUFFIX = ".jaxbuf-old"
# orbax's own temporary directory for a checkpoint at `p` is `p + this`.
_ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _type_name(state: PyTree) -> str:
  return f"{type(state).__module__}.{type(state).__qualname__}"


def _buffer_dims(state: PyTree) -> dict[str, Any]:
  """The sizes a buffer was made with (none for a plain pytree of arrays)."""
  return state.buffer_dims() if isinstance(state, BufferState) else {}


def _layout(state: PyTree) -> dict[str, Any]:
  """What `load` checks before reading: type, buffer sizes, leaf shapes and dtypes."""
  leaves = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    leaves[jax.tree_util.keystr(path)] = {
        "shape": [int(d) for d in np.shape(leaf)],
        "dtype": str(np.dtype(leaf.dtype)),
    }
  return {"format": _FORMAT, "version": _FORMAT_VERSION,
          "state_type": _type_name(state), "buffer_dims": _buffer_dims(state),
          "leaves": leaves}


def _check_layout(stored: dict[str, Any], expected: dict[str, Any],
                  path: pathlib.Path) -> None:
  """Raises naming the first difference between a stored and an expected layout."""
  where = f"load: the checkpoint at {path}"
  if stored.get("format") != _FORMAT:
    raise ValueError(f"{where} is not a jaxbuf checkpoint.")
  if stored["version"] > _FORMAT_VERSION:
    raise ValueError(f"{where} has format version {stored['version']}; this "
                     f"jaxbuf reads up to {_FORMAT_VERSION}.")
  if stored["state_type"] != expected["state_type"]:
    raise TypeError(f"{where} holds a {stored['state_type']}, but `like` is a "
                    f"{expected['state_type']}.")
  for name, size in expected["buffer_dims"].items():
    stored_size = stored["buffer_dims"].get(name)
    if stored_size != size:
      shown = [tuple(value) if isinstance(value, list) else value
               for value in (stored_size, size)]
      raise ValueError(f"{where}: {name} mismatch: the checkpoint has {name} "
                       f"{shown[0]}, `like` has {name} {shown[1]}.")
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


def _sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
  return path.with_name(path.name + suffix)


def _is_checkpoint(path: pathlib.Path) -> bool:
  """Whether `path` is a complete jaxbuf checkpoint.

  orbax writes into a temporary directory and renames it to `path` when done,
  so a directory at `path` with both items is complete.
  """
  return (path / "state").is_dir() and (path / "layout").is_dir()


def _committed(path: pathlib.Path) -> pathlib.Path | None:
  """Where the checkpoint saved at `path` is, after a save killed at any point."""
  for candidate in (path, _sibling(path, _NEW_SUFFIX), _sibling(path, _OLD_SUFFIX)):
    if _is_checkpoint(candidate):
      return candidate
  return None


def _sync_directory(directory: pathlib.Path) -> None:
  """Makes renames inside `directory` durable (a no-op where unsupported)."""
  try:
    handle = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(handle)
  except OSError:
    pass
  finally:
    os.close(handle)


def _settle(path: pathlib.Path) -> None:
  """Finishes or discards what a killed `save` to `path` left behind."""
  new, old = _sibling(path, _NEW_SUFFIX), _sibling(path, _OLD_SUFFIX)
  if not path.exists() and _is_checkpoint(new):
    os.replace(new, path)
  elif not path.exists() and _is_checkpoint(old):
    os.replace(old, path)
  for leftover in (new, old, _sibling(new, _ORBAX_TMP_SUFFIX)):
    if leftover.exists():
      shutil.rmtree(leftover)
  _sync_directory(path.parent)


def save(path: str | os.PathLike, state: PyTree) -> None:
  """Writes `state` to the directory `path`, replacing any checkpoint there.

  Works for every buffer state (`ReplayState`, `PrioritizedReplayState`,
  `RolloutState`, or any pytree of arrays), sharded or not. The write is
  atomic: a process killed mid-save leaves either the previous checkpoint or
  the new one at `path`, complete, never a mix and never nothing (see the
  module docstring for how).

  Args:
    path: a directory; created, or replaced if it holds a jaxbuf checkpoint
      (anything else there raises `FileExistsError`). Its parent must exist.
    state: the state to save. Not consumed: keep using it afterwards.

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
  path = pathlib.Path(path).absolute()
  _settle(path)
  if path.exists() and not _is_checkpoint(path):
    raise FileExistsError(f"save: {path} exists and is not a jaxbuf "
                          "checkpoint; refusing to replace it.")
  new, old = _sibling(path, _NEW_SUFFIX), _sibling(path, _OLD_SUFFIX)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(new, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        layout=ocp.args.JsonSave(_layout(state))))
  _sync_directory(path.parent)
  if path.exists():
    os.replace(path, old)
  os.replace(new, path)
  _sync_directory(path.parent)
  if old.exists():
    shutil.rmtree(old)


def _restore_target(leaf: Any) -> jax.ShapeDtypeStruct:
  """The shape, dtype and sharding to restore a leaf of `like` with."""
  sharding = (leaf.sharding if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
              else None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)


def load(path: str | os.PathLike, *, like: PyTree) -> PyTree:
  """Reads the state saved at `path`, bit for bit, shaped and placed like `like`.

  Args:
    path: the directory given to `save`. If a save there was killed part-way,
      the complete checkpoint it left is read.
    like: a state of the expected kind, sizes, item structure, shapes and
      dtypes: e.g. `buffer.init(example_item)`, or an abstract one from
      `jax.eval_shape(buffer.init, example_item)`. Only its structure, shapes,
      dtypes and shardings are read: each array is restored with the sharding
      of the matching leaf of `like` (one device if it has none).

  Returns:
    The saved state, of the same type as `like`.

  Raises:
    FileNotFoundError: nothing was saved at `path`.
    TypeError: the checkpoint holds another kind of state, another tree
      structure (item structure), or a leaf of another dtype; the message
      names the leaf path and both values.
    ValueError: another capacity (or num_steps / num_envs), or a leaf of
      another shape; the message names it and both values.
  """
  path = pathlib.Path(path).absolute()
  found = _committed(path)
  if found is None:
    raise FileNotFoundError(f"load: no checkpoint at {path}.")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    stored = checkpointer.restore(
        found, args=ocp.args.Composite(layout=ocp.args.JsonRestore())).layout
    _check_layout(stored, _layout(like), path)
    target = jax.tree.map(_restore_target, like)
    return checkpointer.restore(found, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target))).state
