"""Making and opening a payload directory (`disk`): the free space and the
allocation, the lock, the manifest and tables checked, files without a
manifest refused, the rows a kill left checked (`manifest`'s journal), and
files of the older format. Host code, run once per `init`.
"""

import errno
import fcntl
import hashlib
import os
import zlib
from typing import Any

import numpy as np

from jaxbuf._src.storage import manifest as records
from jaxbuf._src.storage.manifest import PayloadError

# `files` below is a `disk.PayloadFiles` (typed Any: `disk` imports this
# module), whose attributes these functions set.
LOCK = "lock"
CREATING = "creating"  # present while init makes the files: what it finds left is its own
_ZEROS = 1 << 20  # bytes per write where a file system cannot fallocate


def open_directory(files: Any, space_checked: bool) -> None:
  """Makes the files of `files` under its directory, or opens those there;
  sets its descriptors and tables. The caller closes `files` should it raise."""
  _prepare(files)
  _lock(files)
  if os.path.exists(os.path.join(files.directory, records.MANIFEST)):
    _open_existing(files)
  else:
    _refuse_orphans(files)
    _create(files, space_checked)


def free_bytes(directory: str) -> int:
  """Bytes this process may still write on `directory`'s file system."""
  stats = os.statvfs(directory)
  return stats.f_bavail * stats.f_frsize


def needed_bytes(row_bytes: dict[str, int], rows: int) -> int:
  """Bytes the payload files and tables of F rows take."""
  return rows * sum(row_bytes.values()) + 4 * rows * (len(row_bytes) + 1)


def check_space(directory: str, needed: int, what: str) -> None:
  free = free_bytes(directory)
  if needed > free:
    raise PayloadError(
      errno.ENOSPC,
      f"disk: {what} need {needed:,} bytes in {directory!r}, whose file system "
      f"has {free:,} bytes free. Free space, give a smaller capacity or another "
      f"directory, or pass jaxbuf.disk(directory, sparse=True) to allocate the "
      f"files as rows are written (a full disk then fails an add, which adds nothing).",
    )


def _prepare(files: Any) -> None:
  try:
    os.makedirs(files.directory, exist_ok=True)
  except OSError as error:
    raise PayloadError(
      error.errno,
      f"disk: cannot create the payload directory {files.directory!r}: {error.strerror}",
    ) from None
  if not os.path.isdir(files.directory) or not os.access(files.directory, os.W_OK | os.X_OK):
    raise PayloadError(
      errno.EACCES,
      f"disk: the payload directory {files.directory!r} cannot be written "
      f"(no write permission); give a directory this process can write.",
    )


def _lock(files: Any) -> None:
  lock_path = os.path.join(files.directory, LOCK)
  fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise PayloadError(
      errno.EBUSY,
      f"disk: the payload files in {files.directory!r} are open for writing "
      f"by another buffer (process or thread holding {lock_path!r}); one "
      f"writer at a time.",
    ) from None
  files.lock_fd = fd


def _refuse_orphans(files: Any) -> None:
  """With no manifest: refuse to truncate payload files left here (a
  deleted manifest), unless an init that did not finish made them."""
  entries = set(os.listdir(files.directory))
  ours = {
    name
    for name in entries
    if name.endswith((".rows", ".crc", ".tmp"))
    or name.startswith("tables-")
    or (name == records.JOURNAL and os.path.getsize(os.path.join(files.directory, name)) > 0)
  }
  if CREATING in entries:
    for name in ours & (set(files.names.values()) | {records.JOURNAL} | _tables_in(entries)):
      os.remove(os.path.join(files.directory, name))
    ours -= set(files.names.values()) | {records.JOURNAL} | _tables_in(entries)
  if ours:
    raise PayloadError(
      errno.EEXIST,
      f"disk: {files.directory!r} holds payload files {sorted(ours)} but no "
      f"{records.MANIFEST}; init would truncate them, and a checkpoint of "
      f"their buffer would then read zeros. Nothing was changed. Restore "
      f"{records.MANIFEST} (from the same sync as the tables and the "
      f"checkpoint), or remove these files (or give another directory) to "
      f"start an empty buffer.",
    )


def _create(files: Any, space_checked: bool) -> None:
  marker = os.path.join(files.directory, CREATING)
  with open(marker, "wb"):
    pass
  needed = needed_bytes(files.row_bytes, files.rows)
  if not (files.sparse or space_checked):
    check_space(files.directory, needed, _files_words(files))
  try:
    for leaf in files.leaves:
      fd = os.open(files.path(leaf), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
      files.fds[leaf] = fd
      _allocate(files, fd, leaf, needed)
      files.inodes[leaf] = os.fstat(fd).st_ino
      files.checksums[leaf] = np.full((files.rows,), files.zero_checksums[leaf], np.uint32)
    files.commit()
  except BaseException:
    # Give the space back: nothing half made stays (the marker says so).
    for leaf, fd in list(files.fds.items()):
      os.close(fd)
      os.remove(files.path(leaf))
    files.fds = {}
    raise
  os.remove(marker)


def _files_words(files: Any) -> str:
  sizes = ", ".join(
    f"{files.names[leaf]} {files.rows * size:,}" for leaf, size in files.row_bytes.items()
  )
  return f"the payload files of {files.rows:,} rows ({sizes} bytes, and their tables)"


def _allocate(files: Any, fd: int, leaf: str, needed: int) -> None:
  size = files.rows * files.row_bytes[leaf]
  if files.sparse or not size:
    os.ftruncate(fd, size)
    return
  allocate = getattr(os, "posix_fallocate", None)
  try:
    try:
      if allocate is None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
      allocate(fd, 0, size)
    except OSError as error:
      if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
        raise
      # A file system without fallocate: writing the zeros allocates them.
      zeros = bytes(min(size, _ZEROS))
      for offset in range(0, size, len(zeros)):
        os.pwrite(fd, zeros[: size - offset], offset)
  except OSError as error:
    raise PayloadError(
      error.errno,
      f"disk: cannot allocate {size:,} bytes for {files.path(leaf)!r}: "
      f"{error.strerror} (the payload files are allocated at init: "
      f"{needed:,} bytes in all, {free_bytes(files.directory):,} free now; "
      f"jaxbuf.disk(directory, sparse=True) allocates as rows are written).",
    ) from None


def _open_existing(files: Any) -> None:
  manifest = records.read(files.directory)
  expected = files.layout(manifest["format"])
  found = {key: manifest.get(key) for key in expected}
  if found != expected:
    raise ValueError(
      f"disk: {files.directory!r} holds payload files of another layout; "
      f"expected {expected}, found {found}. Use another directory, or a "
      f"buffer made as the one that wrote them."
    )
  for leaf in files.leaves:
    path = files.path(leaf)
    try:
      fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
      raise PayloadError(errno.ENOENT, f"disk: the payload file {path!r} is missing.") from None
    files.fds[leaf] = fd
    size = os.fstat(fd).st_size
    if size != files.rows * files.row_bytes[leaf]:
      raise PayloadError(
        errno.EIO,
        f"disk: the payload file {path!r} holds {size} bytes, expected "
        f"{files.rows * files.row_bytes[leaf]} (truncated or replaced).",
      )
    files.inodes[leaf] = os.fstat(fd).st_ino
  if manifest["format"] == records.FORMAT_1:
    _open_format_1(files, manifest)
  else:
    files.checksums, files.laps, lost = records.read_tables(
      files.directory, manifest, list(files.leaves), files.rows
    )
    files.generation = manifest["generation"]
    files.tables_file = manifest["tables"]["file"]
    files.mark_lost(lost)
  _recover_journal(files)
  for name in os.listdir(files.directory):
    if (name.startswith("tables-") and name != files.tables_file) or name.endswith(".tmp"):
      os.remove(os.path.join(files.directory, name))


def _open_format_1(files: Any, manifest: dict[str, Any]) -> None:
  """Files of an older jaxbuf: a `<name>.crc` table per leaf, rows written
  `row + 1` (lap 0) in the state."""
  for leaf in files.leaves:
    crc_path = files.path(leaf)[: -len(".rows")] + ".crc"
    table = records.read_file(crc_path, f"the checksum table {crc_path!r} is")
    if hashlib.sha256(table).hexdigest() != manifest["checksums"][leaf] or (
      len(table) != 4 * files.rows
    ):
      raise PayloadError(
        errno.EIO, f"disk: the checksum table {crc_path!r} does not match the manifest."
      )
    files.checksums[leaf] = np.frombuffer(table, np.uint32).copy()
    files.format_1_tables.append(os.path.basename(crc_path))
  files.laps = np.zeros((files.rows,), np.int32)


def _recover_journal(files: Any) -> None:
  """Checks the rows written since the last sync (a process that did not
  sync again): every row held whose bytes no longer match is lost."""
  suspects = records.read_journal(files.directory, files.rows)
  suspects = suspects[files.laps[suspects] >= 0]  # rows never written hold nothing to keep
  if not suspects.size:
    return
  failed = np.zeros(len(suspects), bool)
  for leaf, fd in files.fds.items():
    size = files.row_bytes[leaf]
    for start, stop in records.runs(suspects):
      data = os.pread(fd, (stop - start) * size, int(suspects[start]) * size)
      for index in range(start, stop):
        row = data[(index - start) * size : (index - start + 1) * size]
        if len(row) != size or zlib.crc32(row) != files.checksums[leaf][suspects[index]]:
          failed[index] = True
  files.found_lost = suspects[failed]
  files.mark_lost(files.found_lost)


def lost_report(directory: str, rows: np.ndarray, generation: int) -> str:
  shown = ", ".join(str(row) for row in rows[:16].tolist()) + (", ..." if len(rows) > 16 else "")
  return (
    f"disk: the payload files in {directory!r} were written after their last "
    f"sync (generation {generation}) by a process that did not sync again "
    f"(killed or crashed): {len(rows)} rows no longer match their checksums "
    f"and are lost: rows [{shown}]. Every other row is kept. The lost rows are "
    f"never sampled (a draw that falls on one is drawn again) and adds "
    f"overwrite them; storage.lost_rows() lists them."
  )


def _tables_in(entries: set[str]) -> set[str]:
  return {name for name in entries if name.startswith("tables-")}
