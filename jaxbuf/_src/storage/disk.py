"""Payload files of the disk tier: host code (files, a lock), not jitted.

One file per payload leaf, `<name>.rows`: F rows of the leaf's row bytes,
row r at offset `r * row_bytes`, preallocated at creation
(`os.posix_fallocate`: a full disk is found then, not in the middle of an
add). Beside them `manifest.json` (the layout: leaves, shapes, dtypes, rows,
file sizes, and a SHA-256 of each checksum table), `<name>.crc` (a CRC-32 per
row, uint32 `[F]`) and `lock`.

Why `os.pread` / `os.pwrite` and not `numpy.memmap` (or tensorstore): a
memory map turns a file truncated under it, or a disk full while a page is
written back, into SIGBUS, which kills the process instead of raising; with
explicit reads and writes each fault is an `OSError` or a short read, named
and raised. Only the rows an add writes and the rows a sample draws are
touched (contiguous rows in one call). Tensorstore (through orbax) would
bring chunked, compressed storage, but a chunk is read whole for one row.

Integrity: a CRC-32 per row (about 2.4 us per 7 KB frame on this machine,
computed for each row written and checked for each row read), kept in host
memory (4 bytes a row and leaf) and written at `sync`. A row whose bytes
differ from its checksum (changed, or partly written by a failed add) is
never returned: the read raises, naming the file and the row. Every read
also checks that the path still names the open file and that its size is
unchanged (a file deleted or truncated under the buffer). `open` checks the
sizes and the checksum tables against the manifest.

Writers: `lock` is held with `fcntl.flock(LOCK_EX | LOCK_NB)` while the files
are open, so a second process (or a second buffer in this one) opening them
for writing is refused.
"""

import errno
import fcntl
import hashlib
import json
import os
import zlib
from typing import Any, Callable

import numpy as np

MANIFEST = "manifest.json"
LOCK = "lock"
FORMAT = "jaxbuf-disk-payload-1"


class PayloadError(OSError):
  """A payload file is missing, truncated, changed or unreadable."""


def _file_name(path: str) -> str:
  """A file name for a leaf path such as `['obs']['pixels']`."""
  cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in path).strip("_")
  return (cleaned or "leaf") + ".rows"


# The seam every payload write goes through (tests inject faults here).
def write_at(fd: int, data: bytes | memoryview, offset: int) -> int:
  return os.pwrite(fd, data, offset)


class PayloadFiles:
  """The open payload files of one disk-tier buffer."""

  def __init__(
    self, directory: str, leaves: dict[str, tuple[tuple[int, ...], np.dtype]], rows: int
  ):
    """Creates the files under `directory`, or opens those a buffer of the
    same layout left there (no copy). Raises, leaving nothing open, when the
    directory cannot be written, is locked by another writer, or holds files
    of another layout or failing their checks.

    Args:
      directory: the tier's directory.
      leaves: path -> (row shape, dtype) of each payload leaf.
      rows: F, the rows of each file.
    """
    self.directory = directory
    self.rows = rows
    self.leaves = {path: (tuple(shape), np.dtype(dtype)) for path, (shape, dtype) in leaves.items()}
    self.row_bytes = {
      path: int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      for path, (shape, dtype) in self.leaves.items()
    }
    self.names = {path: _file_name(path) for path in self.leaves}
    self.zero_checksums = {path: zlib.crc32(bytes(size)) for path, size in self.row_bytes.items()}
    if len(set(self.names.values())) != len(self.names):
      raise ValueError(f"disk: payload leaves {list(self.leaves)} map to clashing file names.")
    self._lock_fd: int | None = None
    self.fds: dict[str, int] = {}
    self.inodes: dict[str, int] = {}
    self.checksums: dict[str, np.ndarray] = {}
    try:
      self._prepare_directory()
      self._lock()
      if os.path.exists(os.path.join(directory, MANIFEST)):
        self._open_existing()
      else:
        self._create()
    except BaseException:
      self.close()
      raise

  def _prepare_directory(self) -> None:
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as error:
      raise PayloadError(
        error.errno,
        f"disk: cannot create the payload directory {self.directory!r}: {error.strerror}",
      ) from None
    if not os.path.isdir(self.directory) or not os.access(self.directory, os.W_OK | os.X_OK):
      raise PayloadError(
        errno.EACCES,
        f"disk: the payload directory {self.directory!r} cannot be written "
        f"(no write permission); give a directory this process can write.",
      )

  def _lock(self) -> None:
    lock_path = os.path.join(self.directory, LOCK)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise PayloadError(
        errno.EBUSY,
        f"disk: the payload files in {self.directory!r} are open for writing "
        f"by another buffer (process or thread holding {lock_path!r}); one "
        f"writer at a time.",
      ) from None
    self._lock_fd = fd

  def _path(self, leaf: str) -> str:
    return os.path.join(self.directory, self.names[leaf])

  def _layout(self) -> dict[str, Any]:
    return {
      "format": FORMAT,
      "rows": self.rows,
      "leaves": {
        path: {
          "file": self.names[path],
          "shape": list(shape),
          "dtype": dtype.str,
          "row_bytes": self.row_bytes[path],
        }
        for path, (shape, dtype) in self.leaves.items()
      },
    }

  def _create(self) -> None:
    for leaf in self.leaves:
      fd = os.open(self._path(leaf), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
      self.fds[leaf] = fd
      size = self.rows * self.row_bytes[leaf]
      try:
        if size:
          os.posix_fallocate(fd, 0, size)
      except OSError as error:
        raise PayloadError(
          error.errno,
          f"disk: cannot allocate {size} bytes for {self._path(leaf)!r}: "
          f"{error.strerror} (the payload files are preallocated at init).",
        ) from None
      self.inodes[leaf] = os.fstat(fd).st_ino
      self.checksums[leaf] = np.full((self.rows,), self.zero_checksums[leaf], np.uint32)
    self.sync()

  def _open_existing(self) -> None:
    with open(os.path.join(self.directory, MANIFEST)) as file:
      manifest = json.load(file)
    expected = self._layout()
    found = {key: manifest.get(key) for key in expected}
    if found != expected:
      raise ValueError(
        f"disk: {self.directory!r} holds payload files of another layout; "
        f"expected {expected}, found {found}. Use another directory, or a "
        f"buffer made as the one that wrote them."
      )
    for leaf in self.leaves:
      path = self._path(leaf)
      try:
        fd = os.open(path, os.O_RDWR)
      except FileNotFoundError:
        raise PayloadError(errno.ENOENT, f"disk: the payload file {path!r} is missing.") from None
      self.fds[leaf] = fd
      size = os.fstat(fd).st_size
      if size != self.rows * self.row_bytes[leaf]:
        raise PayloadError(
          errno.EIO,
          f"disk: the payload file {path!r} holds {size} bytes, expected "
          f"{self.rows * self.row_bytes[leaf]} (truncated or replaced).",
        )
      self.inodes[leaf] = os.fstat(fd).st_ino
      crc_path = path[: -len(".rows")] + ".crc"
      try:
        with open(crc_path, "rb") as file:
          table = file.read()
      except FileNotFoundError:
        raise PayloadError(
          errno.ENOENT, f"disk: the checksum table {crc_path!r} is missing."
        ) from None
      if hashlib.sha256(table).hexdigest() != manifest["checksums"][leaf]:
        raise PayloadError(
          errno.EIO, f"disk: the checksum table {crc_path!r} does not match the manifest."
        )
      self.checksums[leaf] = np.frombuffer(table, np.uint32).copy()

  def sync(self) -> None:
    """Writes the checksum tables and the manifest (atomically: a temporary
    file renamed over the old one) and flushes the payload files. After a
    restart, the files open as they were at the last sync."""
    manifest = self._layout()
    manifest["checksums"] = {}
    for leaf, fd in self.fds.items():
      os.fsync(fd)
      table = self.checksums[leaf].tobytes()
      _atomic_write(self._path(leaf)[: -len(".rows")] + ".crc", table)
      manifest["checksums"][leaf] = hashlib.sha256(table).hexdigest()
    _atomic_write(os.path.join(self.directory, MANIFEST), json.dumps(manifest).encode())

  def close(self) -> None:
    """Closes the files and releases the lock (idempotent; no sync)."""
    for fd in self.fds.values():
      os.close(fd)
    self.fds = {}
    if self._lock_fd is not None:
      os.close(self._lock_fd)
      self._lock_fd = None

  def _check_open(self, leaf: str) -> int:
    if leaf not in self.fds:
      raise PayloadError(errno.EBADF, f"disk: the payload files in {self.directory!r} are closed.")
    fd = self.fds[leaf]
    path = self._path(leaf)
    try:
      named = os.stat(path)
    except FileNotFoundError:
      raise PayloadError(
        errno.ENOENT, f"disk: the payload file {path!r} was deleted under the buffer."
      ) from None
    held = os.fstat(fd)
    if named.st_ino != self.inodes[leaf]:
      raise PayloadError(
        errno.EIO, f"disk: the payload file {path!r} was replaced under the buffer."
      )
    if held.st_size != self.rows * self.row_bytes[leaf]:
      raise PayloadError(
        errno.EIO,
        f"disk: the payload file {path!r} holds {held.st_size} bytes, "
        f"expected {self.rows * self.row_bytes[leaf]} (truncated under the buffer).",
      )
    return fd

  def write_rows(self, rows: np.ndarray, values: dict[str, np.ndarray]) -> Callable[[], None]:
    """Writes `values[leaf] [n, *row]` at `rows [n]` (distinct) of each leaf.

    All or nothing: should a write fail (a full disk), the rows already
    written get their old bytes back (read before the write: a read of the
    n rows per add once the ring wraps; none while it fills) and the
    checksums stay as they were, so the files are as before the call; then
    the error is raised.

    Returns:
      A function that undoes the write (old bytes and checksums back), for
      a caller whose later write fails (`BlockedPayloadFiles`).
    """
    rows = np.asarray(rows)
    order = None if np.all(np.diff(rows) > 0) else np.argsort(rows, kind="stable")
    if order is not None:
      rows = rows[order]
    runs = _runs(rows)
    fds = {leaf: self._check_open(leaf) for leaf in values}
    # The bytes each run of rows holds now, to put back should a write fail.
    # A row whose checksum is the zero row's holds zeros (or was never
    # written, and is never read): nothing to read (an empty buffer's fill).
    old = {
      leaf: [
        (
          os.pread(
            fd, (stop - start) * self.row_bytes[leaf], int(rows[start]) * self.row_bytes[leaf]
          )
          if np.any(self.checksums[leaf][rows[start:stop]] != self.zero_checksums[leaf])
          else bytes((stop - start) * self.row_bytes[leaf])
        )
        for start, stop in runs
      ]
      for leaf, fd in fds.items()
    }
    touched: dict[str, int] = {}  # leaf -> runs of it that may hold new bytes
    checksums = {}

    def restore(touched: dict[str, int]) -> None:
      for leaf, count in touched.items():
        for run in range(count):
          os.pwrite(fds[leaf], old[leaf][run], int(rows[runs[run][0]]) * self.row_bytes[leaf])

    try:
      for leaf, fd in fds.items():
        row_bytes = self.row_bytes[leaf]
        data = np.ascontiguousarray(values[leaf]).reshape(len(rows), -1).view(np.uint8)
        if order is not None:
          data = data[order]
        checksums[leaf] = np.fromiter((zlib.crc32(row.data) for row in data), np.uint32, len(rows))
        for run, (start, stop) in enumerate(runs):
          touched[leaf] = run + 1
          block = data[start:stop].data.cast("B")
          offset = int(rows[start]) * row_bytes
          while block.nbytes:
            written = write_at(fd, block, offset)
            block, offset = block[written:], offset + written
    except OSError as error:
      # Overwriting bytes already allocated needs no new space. Should it
      # fail too, those rows keep their old checksums and are never sampled.
      restore(touched)
      raise PayloadError(
        error.errno,
        f"disk: writing {len(rows)} rows to the payload files in "
        f"{self.directory!r} failed: {error.strerror}. Nothing was added: the "
        f"state passed in and the files are as they were.",
      ) from None
    previous = {leaf: self.checksums[leaf][rows] for leaf in checksums}
    for leaf, table in checksums.items():
      self.checksums[leaf][rows] = table

    def undo() -> None:
      restore({leaf: len(runs) for leaf in fds})
      for leaf, table in previous.items():
        self.checksums[leaf][rows] = table

    return undo

  def read_rows(self, leaf: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows [n]` of a leaf, `[n, *row]`, each checked against its
    checksum; a row -1 reads as zeros (padding)."""
    fd = self._check_open(leaf)
    shape, dtype = self.leaves[leaf]
    row_bytes = self.row_bytes[leaf]
    out = np.zeros((len(rows), row_bytes), np.uint8)
    for index, row in enumerate(rows.tolist()):
      if row < 0:
        continue
      data = os.pread(fd, row_bytes, row * row_bytes)
      if len(data) != row_bytes or zlib.crc32(data) != self.checksums[leaf][row]:
        raise PayloadError(
          errno.EIO,
          f"disk: row {row} of the payload file {self._path(leaf)!r} "
          f"{'is cut short' if len(data) != row_bytes else 'does not match its checksum'}"
          f" (changed under the buffer, or left by a failed add); it is not sampled.",
        )
      out[index] = np.frombuffer(data, np.uint8)
    return out.view(dtype).reshape((len(rows),) + shape)


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
  """`[start, stop)` positions of the runs of consecutive rows in sorted `rows`."""
  if not len(rows):
    return []
  breaks = np.flatnonzero(np.diff(rows) != 1) + 1
  edges = [0, *breaks.tolist(), len(rows)]
  return list(zip(edges[:-1], edges[1:]))


def _atomic_write(path: str, data: bytes) -> None:
  temporary = path + ".tmp"
  with open(temporary, "wb") as file:
    file.write(data)
    file.flush()
    os.fsync(file.fileno())
  os.replace(temporary, path)


class BlockedPayloadFiles:
  """The payload files of a buffer split over D devices: each device's block
  of rows in its own files, under `directory/device-<d>` (a `PayloadFiles`
  each, with its own lock, manifest and checksums). Row g is row `g % L` of
  block `g // L`, L = rows / D."""

  def __init__(
    self,
    directory: str,
    leaves: dict[str, tuple[tuple[int, ...], np.dtype]],
    rows: int,
    blocks: int,
  ):
    self.directory = directory
    self.rows = rows
    self.block_rows = rows // blocks
    self.parts: list[PayloadFiles] = []
    try:
      for block in range(blocks):
        self.parts.append(
          PayloadFiles(os.path.join(directory, f"device-{block}"), leaves, self.block_rows)
        )
    except BaseException:
      self.close()
      raise

  def write_rows(self, rows: np.ndarray, values: dict[str, np.ndarray]) -> Callable[[], None]:
    """As `PayloadFiles.write_rows`, block by block; all blocks or none."""
    blocks = np.asarray(rows) // self.block_rows
    undos: list[Callable[[], None]] = []
    try:
      for block in np.unique(blocks).tolist():
        chosen = blocks == block
        undos.append(
          self.parts[block].write_rows(
            np.asarray(rows)[chosen] % self.block_rows,
            {leaf: np.asarray(value)[chosen] for leaf, value in values.items()},
          )
        )
    except OSError:
      for undo in reversed(undos):
        undo()
      raise

    def undo_all() -> None:
      for undo in reversed(undos):
        undo()

    return undo_all

  def read_rows(self, leaf: str, rows: np.ndarray) -> np.ndarray:
    """As `PayloadFiles.read_rows`, each row from its block's files."""
    rows = np.asarray(rows)
    blocks = np.where(rows < 0, -1, rows // self.block_rows)
    shape, dtype = self.parts[0].leaves[leaf]
    out = np.zeros((len(rows),) + shape, dtype)
    for block in np.unique(blocks[blocks >= 0]).tolist():
      chosen = blocks == block
      out[chosen] = self.parts[block].read_rows(leaf, rows[chosen] % self.block_rows)
    return out

  def sync(self) -> None:
    for part in self.parts:
      part.sync()

  def close(self) -> None:
    for part in self.parts:
      part.close()
    self.parts = []
