"""Payload files of the disk tier: host code (files, a lock), not jitted.

One file per payload leaf, `<name>.rows`: F rows of the leaf's row bytes,
row r at offset `r * row_bytes`, allocated whole when made: `init` checks the
file system's free space and `os.posix_fallocate`s every file, so a disk too
small fails there, naming the bytes needed and free, not hours into a run
(`jaxbuf.disk(..., sparse=True)` leaves them sparse instead). Beside them the
manifest, the tables of the last sync and the journal of rows written since
(`manifest`), and `lock`. `directory` makes and opens them; `blocked` splits
them over devices.

Why `os.pread` / `os.pwrite` and not `numpy.memmap` (or tensorstore): a
memory map turns a file truncated under it, or a disk full while a page is
written back, into SIGBUS, which kills the process instead of raising; with
explicit reads and writes each fault is an `OSError` or a short read, named
and raised. Only the rows an add writes and the rows a sample draws are
touched (contiguous rows in one call). Tensorstore (through orbax) would
bring chunked, compressed storage, but a chunk is read whole for one row.

Integrity, per row: a CRC-32 of its bytes (about 2.4 us per 7 KB frame,
computed for each row written and checked for each row read) and its lap,
how many times it was written modulo K, which the device state's row proxy
holds too (`proxies`); 8 bytes a row and leaf in host memory, written at
`sync`. A row is returned only if its bytes match its checksum and its lap
is the one the state asks for: a changed or half-written row, or a row
written after the state (an older state sampled after an add, a checkpoint
older than the files) is never paired with the state's other leaves; the
read raises, naming the file and the row. The one exception is a reserved
read (`reserve`, what `jaxbuf.Prefetcher` takes at `submit`): an add that
overwrites a row it may read keeps the row's old bytes in memory until the
read is done, and the read gets them. Every read also checks that the path
still names the open file at its size (a file deleted or truncated under
the buffer). `open` checks the sizes and the tables against the manifest.

Crashes: a process killed between syncs leaves rows whose bytes are newer
than the tables. The journal names them; the next open checks each one and
keeps every row whose bytes still match, and the others are lost: listed in
a warning (`lost_rows`), never sampled (the tier draws again instead), and
no longer lost once an add rewrites them.

Threads: one lock per `PayloadFiles` is held by each read, write and sync
whole (an add and a prefetch in two threads see each other's rows whole).
Processes: `lock` is held with `fcntl.flock(LOCK_EX | LOCK_NB)` while the
files are open, so a second process (or a second buffer in this one)
opening them for writing is refused.
"""

import dataclasses
import errno
import os
import threading
import warnings
import zlib
from typing import Any, Callable

import numpy as np

from jaxbuf._src.storage import directory as directories
from jaxbuf._src.storage import manifest as records
from jaxbuf._src.storage.manifest import PayloadError

__all__ = ["PayloadError", "PayloadFiles"]

_JOURNAL_BYTES = 1 << 20  # a journal this long is compacted to its rows' runs


def _file_name(path: str) -> str:
  """A file name for a leaf path such as `['obs']['pixels']`."""
  cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in path).strip("_")
  return (cleaned or "leaf") + ".rows"


# The seam every payload write goes through (tests inject faults here).
def write_at(fd: int, data: bytes | memoryview, offset: int) -> int:
  return os.pwrite(fd, data, offset)


@dataclasses.dataclass
class _Version:
  """A row's bytes and checksums before an add overwrote it, kept for the
  reserved reads that may still ask for them."""

  data: dict[str, bytes]
  checksums: dict[str, int]
  newest_reader: int  # the last reservation that may read it


class PayloadFiles:
  """The open payload files of one disk-tier buffer."""

  def __init__(
    self,
    directory: str,
    leaves: dict[str, tuple[tuple[int, ...], np.dtype]],
    rows: int,
    *,
    laps: int = 1,
    sparse: bool = False,
    space_checked: bool = False,
    report: bool = True,
  ):
    """Creates the files under `directory`, or opens those a buffer of the
    same layout left there (no copy). Raises, leaving nothing open, when the
    directory cannot be written, is locked by another writer, lacks the
    space, or holds files of another layout, without a manifest, or failing
    their checks.

    Args:
      directory: the tier's directory.
      leaves: path -> (row shape, dtype) of each payload leaf.
      rows: F, the rows of each file.
      laps: K, the laps a row's proxy value tells apart (`proxies.laps_for`).
      sparse: leave new files sparse (no allocation, no space check).
      space_checked: the caller checked the free space for these files.
      report: warn here of rows found lost at open (else the caller does).
    """
    self.directory = directory
    self.rows = rows
    self.laps_modulus = laps
    self.sparse = sparse
    self.leaves = {path: (tuple(shape), np.dtype(dtype)) for path, (shape, dtype) in leaves.items()}
    self.row_bytes = {
      path: int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      for path, (shape, dtype) in self.leaves.items()
    }
    self.names = {path: _file_name(path) for path in self.leaves}
    self.zero_checksums = {path: zlib.crc32(bytes(size)) for path, size in self.row_bytes.items()}
    if len(set(self.names.values())) != len(self.names):
      raise ValueError(f"disk: payload leaves {list(self.leaves)} map to clashing file names.")
    self._lock = threading.RLock()
    self.lock_fd: int | None = None
    self._journal_fd: int | None = None
    self._journal_size = 0  # bytes, kept here: no stat per add
    self._journal_limit = _JOURNAL_BYTES
    self.fds: dict[str, int] = {}
    self.inodes: dict[str, int] = {}
    self.checksums: dict[str, np.ndarray] = {}
    self.laps = np.full((rows,), -1, np.int32)  # -1: never written
    self.lost: np.ndarray | None = None  # bool [F] while a row is lost
    self._lost_count = 0
    self.generation = 0
    self.found_lost = np.zeros(0, np.int64)
    self.tables_file: str | None = None
    self.format_1_tables: list[str] = []
    self._readers: set[int] = set()
    self._next_reader = 0
    self._retained: dict[tuple[int, int], _Version] = {}
    try:
      directories.open_directory(self, space_checked)
      self._journal_fd = os.open(
        os.path.join(directory, records.JOURNAL), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
      )
      self._journal_size = os.fstat(self._journal_fd).st_size
    except BaseException:
      self.close()
      raise
    if report and self.found_lost.size:
      warnings.warn(
        directories.lost_report(directory, self.found_lost, self.generation), stacklevel=3
      )

  def path(self, leaf: str) -> str:
    return os.path.join(self.directory, self.names[leaf])

  def layout(self, format_: str = records.FORMAT) -> dict[str, Any]:
    """What the manifest records of the files (and `open` compares)."""
    return {
      "format": format_,
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

  # --- Lost rows, reservations, state checks ------------------------------------

  def mark_lost(self, rows: np.ndarray) -> None:
    rows = np.asarray(rows, np.int64)
    with self._lock:
      if not rows.size:
        return
      if self.lost is None:
        self.lost = np.zeros((self.rows,), bool)
      self._lost_count += int((~self.lost[np.unique(rows)]).sum())
      self.lost[rows] = True

  def _found(self, rows: np.ndarray) -> None:
    """`rows` rewritten: no longer lost."""
    if self.lost is not None:
      self._lost_count -= int(self.lost[rows].sum())
      self.lost[rows] = False
      if not self._lost_count:
        self.lost = None

  def has_lost(self) -> bool:
    return self.lost is not None

  def lost_mask(self, rows: np.ndarray) -> np.ndarray | None:
    """Whether each of `rows` (-1: padding) is lost; None when none is."""
    if self.lost is None:
      return None
    rows = np.asarray(rows, np.int64)
    return (rows >= 0) & self.lost[np.maximum(rows, 0)]

  def lost_rows(self) -> np.ndarray:
    return np.zeros(0, np.int64) if self.lost is None else np.flatnonzero(self.lost)

  def mismatched(self, laps: np.ndarray) -> np.ndarray:
    """The rows a state holds (its lap per row `[F]`, -1 none) that these
    files do not hold at that lap and that are not lost already."""
    with self._lock:
      wrong = (laps >= 0) & (laps != self.laps)
      if self.lost is not None:
        wrong &= ~self.lost
      return np.flatnonzero(wrong)

  def reserve(self) -> Callable[[], None]:
    """Reserves a read: until the returned function is called, an add keeps
    the old bytes of each row it overwrites, for that read."""
    with self._lock:
      reader = self._next_reader
      self._next_reader += 1
      self._readers.add(reader)

    def release() -> None:
      with self._lock:
        self._readers.discard(reader)
        oldest = min(self._readers, default=self._next_reader)
        for key in [key for key, kept in self._retained.items() if kept.newest_reader < oldest]:
          del self._retained[key]

    return release

  # --- Writes ------------------------------------------------------------------

  def _append_journal(self, runs: list[tuple[int, int]]) -> None:
    assert self._journal_fd is not None
    record = records.journal_record(runs)
    try:
      if os.write(self._journal_fd, record) != len(record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
      # A record cut short would shift every later one: cut it off.
      os.ftruncate(self._journal_fd, self._journal_size)
      raise
    self._journal_size += len(record)
    if self._journal_size > self._journal_limit:
      # Compacted to the runs of the rows it names: a long run between syncs
      # keeps a journal of at most a few runs (a ring writes in order).
      rows = records.read_journal(self.directory, self.rows)
      compact = records.journal_record(records.row_runs(rows))
      path = os.path.join(self.directory, records.JOURNAL)
      records.atomic_write(path, compact)
      os.close(self._journal_fd)
      self._journal_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
      self._journal_size = len(compact)
      self._journal_limit = max(_JOURNAL_BYTES, 2 * len(compact))

  def write_rows(
    self, rows: np.ndarray, values: dict[str, np.ndarray]
  ) -> tuple[np.ndarray, Callable[[], None]]:
    """Writes `values[leaf] [n, *row]` at `rows [n]` (distinct) of each leaf.

    All or nothing: should a write fail (a full disk), the rows already
    written get their old bytes back (read before the write: a read of the
    n rows per add once the ring wraps; none while it fills) and the
    tables stay as they were, so the files are as before the call; then
    the error is raised.

    Returns:
      Each row's new lap, int32 `[n]` in the order of `rows`; and a
      function that undoes the write (old bytes and tables back), for a
      caller whose later write fails (`BlockedPayloadFiles`).
    """
    rows = np.asarray(rows, np.int64)
    order = None if np.all(np.diff(rows) > 0) else np.argsort(rows, kind="stable")
    if order is not None:
      rows = rows[order]
    runs = records.runs(rows)
    with self._lock:
      fds = {leaf: self._check_open(leaf) for leaf in values}
      # The bytes each run of rows holds now, to put back should a write
      # fail (and for reserved reads): rows never written hold zeros.
      written_before = self.laps[rows] >= 0
      old = {
        leaf: [
          (
            os.pread(
              fd, (stop - start) * self.row_bytes[leaf], int(rows[start]) * self.row_bytes[leaf]
            )
            if written_before[start:stop].any()
            else bytes((stop - start) * self.row_bytes[leaf])
          )
          for start, stop in runs
        ]
        for leaf, fd in fds.items()
      }
      touched: dict[str, int] = {}  # leaf -> runs of it that may hold new bytes

      def restore(touched: dict[str, int]) -> None:
        for leaf, count in touched.items():
          for run in range(count):
            os.pwrite(fds[leaf], old[leaf][run], int(rows[runs[run][0]]) * self.row_bytes[leaf])

      checksums = {}
      try:
        self._append_journal(records.row_runs(rows))
        for leaf, fd in fds.items():
          row_bytes = self.row_bytes[leaf]
          data = np.ascontiguousarray(values[leaf]).reshape(len(rows), -1).view(np.uint8)
          if order is not None:
            data = data[order]
          checksums[leaf] = np.fromiter(
            (zlib.crc32(row.data) for row in data), np.uint32, len(rows)
          )
          for run, (start, stop) in enumerate(runs):
            touched[leaf] = run + 1
            block = data[start:stop].data.cast("B")
            offset = int(rows[start]) * row_bytes
            while block.nbytes:
              written = write_at(fd, block, offset)
              block, offset = block[written:], offset + written
      except OSError as error:
        # Overwriting bytes already allocated needs no new space. Should it
        # fail too, those rows keep their old tables and are never sampled.
        restore(touched)
        raise PayloadError(
          error.errno,
          f"disk: writing {len(rows)} rows to the payload files in "
          f"{self.directory!r} failed: {error.strerror}. Nothing was added: the "
          f"state passed in and the files are as they were.",
        ) from None
      if self._readers:
        self._retain(rows, runs, old, written_before)
      previous = (
        {leaf: self.checksums[leaf][rows] for leaf in checksums},
        self.laps[rows],
        None if self.lost is None else self.lost[rows],
      )
      for leaf, table in checksums.items():
        self.checksums[leaf][rows] = table
      self.laps[rows] = (self.laps[rows] + 1) % self.laps_modulus
      self._found(rows)
      new_laps = self.laps[rows]

    def undo() -> None:
      with self._lock:
        restore({leaf: len(runs) for leaf in fds})
        for leaf, table in previous[0].items():
          self.checksums[leaf][rows] = table
        self.laps[rows] = previous[1]
        if previous[2] is not None:
          self.mark_lost(rows[previous[2]])

    if order is not None:
      new_laps = new_laps[np.argsort(order, kind="stable")]
    return new_laps, undo

  def _retain(self, rows: np.ndarray, runs: list, old: dict, written_before: np.ndarray) -> None:
    newest = max(self._readers)
    for run, (start, stop) in enumerate(runs):
      for index in range(start, stop):
        if not written_before[index]:
          continue
        row = int(rows[index])
        data = {
          leaf: old[leaf][run][(index - start) * size : (index - start + 1) * size]
          for leaf, size in ((leaf, self.row_bytes[leaf]) for leaf in old)
        }
        self._retained[(row, int(self.laps[row]))] = _Version(
          data=data,
          checksums={leaf: int(self.checksums[leaf][row]) for leaf in old},
          newest_reader=newest,
        )

  # --- Reads, sync, close ----------------------------------------------------------

  def _check_open(self, leaf: str) -> int:
    if leaf not in self.fds:
      raise PayloadError(errno.EBADF, f"disk: the payload files in {self.directory!r} are closed.")
    fd = self.fds[leaf]
    path = self.path(leaf)
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

  def read_rows(self, leaf: str, rows: np.ndarray, laps: np.ndarray) -> np.ndarray:
    """Rows `rows [n]` of a leaf at laps `laps [n]`, `[n, *row]`, each
    checked against its checksum and lap; a row -1 reads as zeros (padding)."""
    shape, dtype = self.leaves[leaf]
    row_bytes = self.row_bytes[leaf]
    rows, laps = np.asarray(rows, np.int64), np.asarray(laps, np.int64)
    chunks = [bytes(row_bytes)] * len(rows)
    with self._lock:
      fd = self._check_open(leaf)
      wanted = np.flatnonzero(rows >= 0)
      # Per row, as Python values: the row, whether the files hold it at the
      # state's lap, and the checksum its bytes must have.
      held = zip(
        wanted.tolist(),
        rows[wanted].tolist(),
        (self.laps[rows[wanted]] == laps[wanted]).tolist(),
        self.checksums[leaf][rows[wanted]].tolist(),
      )
      stale = []
      for index, row, is_current, checksum in held:
        if is_current:
          data = os.pread(fd, row_bytes, row * row_bytes)
        else:
          kept = self._retained.get((row, int(laps[index])))
          if kept is None:
            stale.append(index)
            continue
          data, checksum = kept.data[leaf], kept.checksums[leaf]
        if len(data) != row_bytes or zlib.crc32(data) != checksum:
          raise PayloadError(
            errno.EIO,
            f"disk: row {row} of the payload file {self.path(leaf)!r} "
            f"{'is cut short' if len(data) != row_bytes else 'does not match its checksum'}"
            f" (changed under the buffer, or left by a failed add); it is not sampled.",
          )
        chunks[index] = data
      if stale:
        raise self._stale(rows[stale], laps[stale])
    out = np.frombuffer(b"".join(chunks), np.uint8).view(dtype)
    return out.reshape((len(rows),) + shape)

  def _stale(self, rows: np.ndarray, laps: np.ndarray) -> PayloadError:
    row, lap = int(rows[0]), int(laps[0])
    held = int(self.laps[row])
    holds = "holds no row written" if held < 0 else f"holds its write of lap {held}"
    return PayloadError(
      errno.ESTALE,
      f"disk: {len(rows)} of the rows read are not in the payload files of "
      f"{self.directory!r} as the state knows them: row {row} {holds}, the "
      f"state expects lap {lap} (laps count a row's writes modulo "
      f"{self.laps_modulus}). The state is older or newer than the files: a "
      f"state kept across a later add, a checkpoint saved before or after the "
      f"files' last sync (generation {self.generation}), or a directory "
      f"emptied or replaced since. No row of another item is returned. Sample "
      f"the state the last add returned (a jaxbuf.Prefetcher given "
      f"buffer.sample keeps the rows its reads need); for a loaded checkpoint, "
      f"storage.recover(state) keeps the rows the files hold and drops the others.",
    )

  def sync(self) -> None:
    """Writes the tables and the manifest (atomically: temporary files
    renamed over the old ones, the manifest last) and flushes the payload
    files; empties the journal. After a restart, the files open as they
    were at the last sync."""
    with self._lock:
      for fd in self.fds.values():
        os.fsync(fd)
      self.commit()
      if self._journal_fd is not None:
        os.ftruncate(self._journal_fd, 0)
        self._journal_size, self._journal_limit = 0, _JOURNAL_BYTES

  def commit(self) -> None:
    generation = self.generation + (self.tables_file is not None)
    tables, lost = records.encode_tables(
      [self.checksums[leaf] for leaf in self.leaves], self.laps, self.lost
    )
    name = records.write(self.directory, self.layout(), generation, tables, lost)
    for old in [self.tables_file, *self.format_1_tables]:
      if old is not None and old != name:
        os.remove(os.path.join(self.directory, old))
    self.tables_file, self.format_1_tables, self.generation = name, [], generation

  def close(self) -> None:
    """Closes the files and releases the lock (idempotent; no sync)."""
    for fd in self.fds.values():
      os.close(fd)
    self.fds = {}
    self._retained = {}
    for name in ("_journal_fd", "lock_fd"):
      fd = getattr(self, name)
      if fd is not None:
        os.close(fd)
        setattr(self, name, None)
