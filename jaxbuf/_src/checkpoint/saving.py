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

Where the code lives (each room imports only those listed below it):

  saving.py                `save` and `load`: the steps in order, each ended
                           by an agreement; completing the layout and marker
                           (`_commit`); regrouping a resharded load.
  agreement.py             the agreements between processes (`in_every_process`)
                           and the checks that they passed the same path and
                           state.
  arrays.py                the arrays: orbax writes and reads, pieces written by
                           each process, CRC-32s computed and verified.
  files.py                 the directory protocol: names, the writer's lock,
                           durable writes, the marker, swap, settle, delete,
                           foreign entries, finding the complete checkpoint.
  layout.py                the layout as JSON data: describing a state, and
                           validating an untrusted stored layout against `like`.
"""

import json
import os
import pathlib
import secrets
import shutil
from typing import Any

import jax
import numpy as np

from jaxbuf._src.core import base
from jaxbuf._src.core import kind
from jaxbuf._src.checkpoint import agreement
from jaxbuf._src.checkpoint import arrays
from jaxbuf._src.checkpoint import files
from jaxbuf._src.checkpoint import layout as layouts
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import BufferState, PyTree


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
    resolved = files.resolve(path)
    files.check_path_is_usable(resolved, "save")
    # JAX would fail half-way through writing, on the first deleted array.
    validation.check_not_donated(state, what="save")
    if not resolved.parent.is_dir():
      raise FileNotFoundError(f"save: the parent directory of {resolved} does not exist.")
    named = [(name, arrays.stored_form(leaf)) for name, leaf in layouts.named_leaves(state)]
    agreement.check_global(named)
    return resolved, layouts.layout(state), named

  (path, layout, named), shared = agreement.in_every_process(
    "save", prepare, lambda r: {"path": str(r[0]), "layout": r[1]}
  )
  agreement.check_processes_agree("save", shared)
  new = files.sibling(path, files.NEW_SUFFIX)
  lock = new_fd = None
  created = complete = False
  try:

    def start() -> None:
      nonlocal lock, created
      if primary:
        lock = files.lock_writer(path)
        files.settle(path)
        files.check_replaceable(path, "save")
        os.mkdir(new)
        created = True
        os.mkdir(new / files.STATE)

    agreement.in_every_process("save", start)

    def write() -> dict[str, list[Any]]:
      nonlocal new_fd
      try:
        new_fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
      except FileNotFoundError:
        raise FileNotFoundError(
          f"save: process {jax.process_index()} does not see {new}, which "
          "process 0 created: the path must be on a filesystem every process "
          "sees."
        ) from None
      return arrays.write_arrays(new_fd, new, named)

    _, pieces = agreement.in_every_process("save", write, lambda mine: mine)

    def commit() -> None:
      nonlocal complete
      if primary:
        assert new_fd is not None  # opened by write()
        _commit(new_fd, new, state, layout, named, pieces)
        complete = True
        files.swap_in(new, path)

    agreement.in_every_process("save", commit)
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


def _commit(
  directory_fd: int,
  directory: pathlib.Path,
  state: PyTree,
  layout: dict[str, Any],
  named: list[tuple[str, Any]],
  pieces: list[dict[str, list[Any]]],
) -> None:
  """Completes the checkpoint in `directory`: orbax's index, layout, marker last.

  Args:
    pieces: every process's `arrays.write_arrays` result, in process order.
  """
  arrays.finalize(directory_fd, directory, named)
  for (name, original), (_, leaf) in zip(layouts.named_leaves(state), named):
    entry = layout["leaves"][name]
    boxes = sorted((box, crcs) for process in pieces for box, crcs in process[name])
    entry["pieces"] = [{"index": box, "crc32": crcs} for box, crcs in boxes]
    if layouts.is_key(original):
      entry["key_impl"] = str(jax.random.key_impl(original))
      entry["key_data_shape"] = [int(d) for d in np.shape(leaf)]
  token = secrets.token_hex(16)
  layout.update(token=token, chunk_bytes=arrays.CHUNK_BYTES)
  encoded = json.dumps(layout, indent=1).encode()
  # What the processes reported must tile every leaf, as `load` will demand.
  layouts.validate_layout(json.loads(encoded), f"save: the checkpoint written at {directory}")
  files.write_file(directory_fd, files.LAYOUT, encoded)
  files.write_marker(directory_fd, directory, token)


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
      and the piece; several processes passing different paths or `like` states.
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
  unplaced = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype), like)
  stored_like = jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=whole),
    jax.eval_shape(lambda state: base.regrouped(state, stored_devices), unplaced),
  )
  state = base.regrouped(_load_as(path, stored_like), wanted_devices)
  return jax.tree.map(
    lambda leaf, like_leaf: (
      leaf if not _spans_the_processes(like_leaf) else jax.device_put(leaf, like_leaf.sharding)
    ),
    state,
    like,
  )


def _spans_the_processes(leaf: Any) -> bool:
  """Whether `leaf` has a sharding with devices in every process."""
  sharding = getattr(leaf, "sharding", None)
  return sharding is not None and {device.process_index for device in sharding.device_set} == set(
    range(jax.process_count())
  )


def _whole_on(like: PyTree) -> jax.sharding.Sharding | None:
  """Where a regrouped state is assembled: one device (None) with one
  process; with several, replicated over the mesh of `like` where it spans
  the processes, else over every device (as a leaf without a sharding)."""
  if jax.process_count() == 1:
    return None
  spanning = [
    leaf.sharding
    for leaf in jax.tree.leaves(like)
    if _spans_the_processes(leaf) and isinstance(leaf.sharding, jax.sharding.NamedSharding)
  ]
  mesh = spanning[0].mesh if spanning else jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _devices_to_regroup(
  path: str | os.PathLike, like: PyTree
) -> tuple[int | None, int | None] | None:
  """(stored, wanted) device counts when the checkpoint differs from `like`
  only in them; None otherwise (the exact load then reports any mismatch)."""
  wanted = layouts.settings_of(like)
  if not wanted:
    return None
  try:
    handle, _ = files.open_committed(files.resolve(path))
  except (OSError, ValueError):
    return None
  try:
    stored = files.read_json(handle, files.LAYOUT, "load").get("settings") or {}
  except (OSError, ValueError, AttributeError):
    return None
  finally:
    os.close(handle)
  stored_devices, wanted_devices = stored.get("devices"), wanted.get("devices")
  without_devices = lambda settings: {
    name: value for name, value in settings.items() if name != "devices"
  }
  if stored_devices == wanted_devices or without_devices(stored) != without_devices(wanted):
    return None
  return stored_devices, wanted_devices


def _load_as(path: str | os.PathLike, like: PyTree) -> PyTree:
  """`load` of a checkpoint whose layout must be `like`'s exactly."""

  def prepare() -> tuple[pathlib.Path, dict[str, Any]]:
    resolved = files.resolve(path)
    files.check_path_is_usable(resolved, "load")
    return resolved, layouts.layout(like)

  (path, expected), shared = agreement.in_every_process(
    "load", prepare, lambda r: {"path": str(r[0]), "layout": r[1]}
  )
  agreement.check_processes_agree("load", shared)
  where = f"load: the checkpoint at {path}"
  handle = None
  try:

    def open_and_check() -> tuple[int, pathlib.Path, dict[str, Any]]:
      opened, found = files.open_committed(path)
      try:
        marker = files.read_json(opened, files.MARKER, where)
        files.check_marker_version(marker, where)
        files.check_file_sizes(opened, marker, where)
        stored = files.read_json(opened, files.LAYOUT, where)
        layouts.validate_layout(stored, where)
        layouts.check_layout(stored, expected, where)
      except Exception:
        os.close(opened)
        raise
      return opened, found, stored

    for _ in range(files.OPEN_ATTEMPTS):
      (handle, found, stored), tokens = agreement.in_every_process(
        "load", open_and_check, lambda r: r[2]["token"]
      )
      # A save replacing the checkpoint between the processes' opens: retry.
      if len(set(tokens)) == 1:
        break
      os.close(handle)
      handle = None
    else:
      raise ValueError(
        f"{where}: the processes kept opening different "
        "checkpoints (saves kept replacing it); nothing was read."
      )
    leaves, _ = agreement.in_every_process(
      "load", lambda: arrays.read_arrays(handle, found, stored, like, where)
    )
  finally:
    if handle is not None:
      os.close(handle)
  state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
  recorded = stored.get("settings") or {}
  if isinstance(state, BufferState) and recorded and not layouts.settings_of(state):
    # A `like` that records none (a module's `init`) must not drop what the
    # checkpoint recorded: the state's bookkeeping depends on it, and a
    # buffer of other settings would then sample it unchecked.
    state = state.replace(settings=kind.settings_of(**recorded))
  return state
