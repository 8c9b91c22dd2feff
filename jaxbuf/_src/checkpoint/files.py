"""The on-disk protocol of a checkpoint directory: names, locks, markers, swaps.

Part of `jaxbuf.save` / `load` (`saving.py` maps the rooms and describes
the protocol: `<path>.jaxbuf-new` written completely, marker last, then
swapped in; writers excluded by a lock file, readers by shared directory
locks). This room knows which files a checkpoint has and how they are
written durably, found, replaced and deleted; it never reads an array (that is
`arrays`) and checks no more of the layout than its token.
"""

import errno
import fcntl
import json
import os
import pathlib
import shutil
from typing import Any, cast

from jaxbuf._src.checkpoint import layout as layouts

MARKER = "jaxbuf-checkpoint.json"
LAYOUT = "layout.json"
STATE = "state"
NEW_SUFFIX = ".jaxbuf-new"
OLD_SUFFIX = ".jaxbuf-old"
_LOCK_SUFFIX = ".jaxbuf-lock"
# Characters that Python's glob (which orbax uses) or a shell would expand.
_PATTERN_CHARACTERS = frozenset("*?[]{}")
_PROC_FD = pathlib.Path("/proc/self/fd")
# A killed writer's leftovers never hold a reader for long; a reader that keeps
# losing races with writers gives up after this many rounds.
OPEN_ATTEMPTS = 100


# --- Paths --------------------------------------------------------------------------


def resolve(path: str | os.PathLike) -> pathlib.Path:
  """The real location of `path`: links in it and its parents followed."""
  return pathlib.Path(os.path.realpath(os.fspath(path)))


def sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
  return path.with_name(path.name + suffix)


def orbax_path(directory_fd: int, path: pathlib.Path) -> str:
  """The path orbax is given for `<directory>/state`: free of pattern characters."""
  if _PROC_FD.is_dir():
    return str(_PROC_FD / str(directory_fd) / STATE)
  return str(path / STATE)


def check_path_is_usable(path: pathlib.Path, caller: str) -> None:
  if not _PROC_FD.is_dir() and _PATTERN_CHARACTERS & set(str(path)):
    raise ValueError(
      f"{caller}: the path {path} contains one of {sorted(_PATTERN_CHARACTERS)}, "
      "which orbax would read as a file pattern; on this system (no "
      "/proc/self/fd) choose a path without them."
    )


# --- Files and directories ----------------------------------------------------------


def write_file(directory_fd: int, name: str, data: bytes) -> None:
  """Writes `name` in the directory durably: temporary file, fsync, rename."""
  temporary = name + ".tmp"
  handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=directory_fd)
  try:
    with os.fdopen(handle, "wb", closefd=False) as file:
      file.write(data)
    os.fsync(handle)
  finally:
    os.close(handle)
  os.rename(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)


def read_json(directory_fd: int, name: str, where: str) -> Any:
  try:
    handle = os.open(name, os.O_RDONLY, dir_fd=directory_fd)
  except FileNotFoundError:
    raise ValueError(f"{where}: {name} is missing.") from None
  with os.fdopen(handle, "rb") as file:
    data = file.read()
  try:
    return json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise layouts.fail(where, f"{name} is not valid JSON ({error})") from None


def _entries(directory: pathlib.Path) -> set[str]:
  """Every file and folder under `directory`, as paths relative to it."""
  found: set[str] = set()
  for root, folders, files in os.walk(directory):
    relative = pathlib.Path(root).relative_to(directory)
    found.update(str(relative / name) for name in folders + files)
  return found


def sync_directory(directory: pathlib.Path | int) -> None:
  """Makes renames inside `directory` durable (a no-op where unsupported)."""
  try:
    handle = os.open(directory, os.O_RDONLY) if not isinstance(directory, int) else None
  except OSError:
    return
  try:
    os.fsync(handle if handle is not None else cast(int, directory))
  except OSError:
    pass
  finally:
    if handle is not None:
      os.close(handle)


# --- Which directories are checkpoints; replacing them ------------------------------


def _marker_of(directory_fd: int, where: str) -> dict[str, Any] | None:
  """The directory's marker if it is a complete jaxbuf checkpoint, else None."""
  try:
    marker = read_json(directory_fd, MARKER, where)
  except ValueError:
    return None
  try:
    layout = read_json(directory_fd, LAYOUT, where)
  except ValueError:
    layout = None
  if (
    not isinstance(marker, dict)
    or marker.get("format") != layouts.FORMAT
    or not isinstance(marker.get("token"), str)
    or not isinstance(marker.get("entries"), list)
  ):
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
  return sorted(_entries(path) - set(marker["entries"]) - {MARKER})


def check_replaceable(path: pathlib.Path, caller: str) -> None:
  if not path.exists() and not path.is_symlink():
    return
  foreign = _foreign_entries(path)
  if foreign is None:
    raise FileExistsError(
      f"{caller}: {path} exists and is not a jaxbuf checkpoint; refusing to replace it."
    )
  if foreign:
    raise FileExistsError(
      f"{caller}: {path} holds entries jaxbuf did not write {foreign}; refusing to replace it."
    )


def delete(directory: pathlib.Path) -> None:
  """Deletes a directory jaxbuf wrote, once no reader holds it."""
  handle = _open_directory(directory)
  if handle is None:
    return
  try:
    fcntl.flock(handle, fcntl.LOCK_EX)
    shutil.rmtree(directory)
  finally:
    os.close(handle)


def settle(path: pathlib.Path) -> None:
  """Finishes or discards what a killed `save` to `path` left behind."""
  new, old = sibling(path, NEW_SUFFIX), sibling(path, OLD_SUFFIX)
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
        check_replaceable(leftover, "save")
      delete(leftover)
  sync_directory(path.parent)


def write_marker(directory_fd: int, directory: pathlib.Path, token: str) -> None:
  """Writes the marker that makes `directory` a complete checkpoint (last)."""
  entries = sorted(_entries(directory))
  # Each file's size, so that `load` names a truncated or deleted file
  # before orbax reads it (orbax's own error is kilobytes long).
  # The layout is checked on its own, field by field.
  sizes = {
    entry: os.stat(entry, dir_fd=directory_fd).st_size
    for entry in entries
    if entry.startswith(STATE + os.sep) and not os.path.isdir(os.path.join(directory, entry))
  }
  marker = {
    "format": layouts.FORMAT,
    "version": layouts.FORMAT_VERSION,
    "token": token,
    "entries": entries,
    "sizes": sizes,
  }
  write_file(directory_fd, MARKER, json.dumps(marker, indent=1).encode())
  sync_directory(directory_fd)


def swap_in(new: pathlib.Path, path: pathlib.Path) -> None:
  """Puts the complete checkpoint `new` at `path`, then deletes the one it
  replaces: at every moment one complete checkpoint is found (see `settle`)."""
  old = sibling(path, OLD_SUFFIX)
  sync_directory(path.parent)
  if path.exists():
    os.replace(path, old)
  os.replace(new, path)
  sync_directory(path.parent)
  delete(old)


def lock_writer(path: pathlib.Path) -> int:
  lock_path = sibling(path, _LOCK_SUFFIX)
  handle = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as error:
    os.close(handle)
    if error.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
      raise BlockingIOError(
        error.errno,
        f"save: another save to {path} is in progress (it holds "
        f"{lock_path}); nothing was written. Retry once it has finished.",
      ) from None
    raise
  return handle


# --- Reading: finding the complete checkpoint ---------------------------------------


def open_committed(path: pathlib.Path) -> tuple[int, pathlib.Path]:
  """A descriptor of the complete checkpoint saved at `path`, share-locked."""
  candidates = (path, sibling(path, NEW_SUFFIX), sibling(path, OLD_SUFFIX))
  for _ in range(OPEN_ATTEMPTS):
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
  held = sorted(entry.name for entry in path.iterdir()) if path.is_dir() else []
  if {LAYOUT, STATE} & set(held):
    raise FileNotFoundError(
      f"load: {path} holds checkpoint data ({held}) but "
      f"no valid marker {MARKER}, which save writes last: the save that "
      "wrote it did not finish, or the marker was removed or replaced. "
      "Nothing was read."
    )
  raise FileNotFoundError(f"load: no checkpoint at {path}.")


def check_marker_version(marker: Any, where: str) -> None:
  """Raises `ValueError` unless the marker is of the format version this
  jaxbuf reads (a newer jaxbuf may write a layout this one misreads)."""
  version = marker.get("version") if isinstance(marker, dict) else None
  if version != layouts.FORMAT_VERSION:
    raise ValueError(
      f"{where} has a marker of format version {version!r}; "
      f"this jaxbuf reads version {layouts.FORMAT_VERSION}"
      + (
        " (upgrade jaxbuf to read it)."
        if isinstance(version, int)
        and not isinstance(version, bool)
        and version > layouts.FORMAT_VERSION
        else "."
      )
    )


def check_file_sizes(directory_fd: int, marker: Any, where: str) -> None:
  """Raises `ValueError` naming a file the marker lists that is missing or
  has another size than when it was saved (nothing is read then).

  Markers written before sizes were recorded have none, and pass.
  """
  sizes = marker.get("sizes", {}) if isinstance(marker, dict) else {}
  if not isinstance(sizes, dict):
    raise layouts.fail(where, f"the marker's sizes are {type(sizes).__name__}, not an object")
  for name, size in sizes.items():
    if not layouts.is_int(size) or os.path.isabs(name) or ".." in name.split("/"):
      raise layouts.fail(where, f"the marker records size {size!r} for {name!r}")
    try:
      found = os.stat(name, dir_fd=directory_fd).st_size
    except FileNotFoundError:
      raise ValueError(
        f"{where}: the file {name} is missing (deleted after the save); nothing was read."
      ) from None
    if found != size:
      raise ValueError(
        f"{where}: the file {name} has {found} bytes, but "
        f"{size} were saved (truncated or overwritten); nothing "
        "was read."
      )
