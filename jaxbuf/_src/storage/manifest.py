"""The disk tier's records beside the payload files: the manifest, the tables
of each sync, the journal of rows written since. Host code.

* `manifest.json`: the layout (leaves, row shapes, dtypes, rows, file
  names), the generation g (how many syncs the files have had) and the name
  and SHA-256 of the tables of sync g. Written last by a sync, atomically (a
  temporary file renamed over the old one): it is the commit point.
* `tables-<g>`: the tables as of sync g, in one file: for each leaf (in the
  manifest's order) a CRC-32 per row, uint32 `[F]`; each row's lap, int32
  `[F]` (-1: never written; `proxies`); the rows lost, int64 `[L]`. Written
  whole before the manifest that names it, so a kill at any moment leaves a
  manifest and the tables it names, of one sync.
* `journal`: int64 `(first, stop)` pairs, the runs of rows written since the
  last sync, each appended before its rows are written and emptied by the
  sync. After a kill, the rows it names are the only ones whose bytes may
  differ from the tables: each is checked at the next open (`disk`).

The manifest is read as untrusted input: every field is checked for
presence and type, and a fault names the file and the field.
"""

import errno
import hashlib
import json
import os
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
JOURNAL = "journal"
# An older jaxbuf wrote format 1 (a `<name>.crc` table per leaf, no laps, no
# journal); it opens, and its next sync writes format 2.
FORMAT = "jaxbuf-disk-payload-2"
FORMAT_1 = "jaxbuf-disk-payload-1"


class PayloadError(OSError):
  """A payload file is missing, truncated, changed or unreadable."""


def tables_name(generation: int) -> str:
  return f"tables-{generation}"


def malformed(path: str, problem: str) -> PayloadError:
  return PayloadError(
    errno.EINVAL,
    f"disk: {path}: malformed manifest: {problem}. The manifest is written by "
    f"storage.sync(); restore it (with the tables and checkpoint of the same "
    f"sync), or remove the directory's files to start an empty buffer.",
  )


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _field(path: str, mapping: dict, name: str, kind: type | tuple, context: str) -> Any:
  if name not in mapping:
    raise malformed(path, f"{context} has no field {name!r}")
  value = mapping[name]
  wanted = (int,) if kind is int else kind
  if (kind is int and not _is_int(value)) or not isinstance(value, wanted):
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    raise malformed(path, f"{context} field {name!r} is {value!r}, not a {names}")
  return value


def read(directory: str) -> dict[str, Any]:
  """The manifest of `directory`, every field checked; raises `PayloadError`
  naming the file and what is wrong."""
  path = os.path.join(directory, MANIFEST)
  with open(path, "rb") as file:
    data = file.read()
  try:
    manifest = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise malformed(
      path, f"not valid JSON ({len(data)} bytes: truncated or damaged): {error}"
    ) from None
  if not isinstance(manifest, dict):
    raise malformed(path, f"it holds a {type(manifest).__name__}, not an object")
  format_ = _field(path, manifest, "format", str, "the manifest")
  if format_ not in (FORMAT, FORMAT_1):
    raise malformed(path, f"format {format_!r} is not a jaxbuf disk tier's ({FORMAT!r})")
  _field(path, manifest, "rows", int, "the manifest")
  leaves = _field(path, manifest, "leaves", dict, "the manifest")
  for leaf, entry in leaves.items():
    context = f"leaf {leaf!r}"
    if not isinstance(entry, dict):
      raise malformed(path, f"{context} is a {type(entry).__name__}, not an object")
    _field(path, entry, "file", str, context)
    shape = _field(path, entry, "shape", list, context)
    if not all(_is_int(size) and size >= 0 for size in shape):
      raise malformed(path, f"{context} field 'shape' is {shape!r}, not a list of sizes")
    dtype = _field(path, entry, "dtype", str, context)
    try:
      np.dtype(dtype)
    except TypeError:
      raise malformed(path, f"{context} field 'dtype' is {dtype!r}, not a NumPy dtype") from None
    _field(path, entry, "row_bytes", int, context)
  if format_ == FORMAT_1:
    checksums = _field(path, manifest, "checksums", dict, "the manifest")
    for leaf in leaves:
      _field(path, checksums, leaf, str, "field 'checksums'")
    return manifest
  generation = _field(path, manifest, "generation", int, "the manifest")
  if generation < 0:
    raise malformed(path, f"field 'generation' is {generation}, not >= 0")
  tables = _field(path, manifest, "tables", dict, "the manifest")
  _field(path, tables, "file", str, "field 'tables'")
  _field(path, tables, "sha256", str, "field 'tables'")
  lost = _field(path, tables, "lost", int, "field 'tables'")
  if lost < 0:
    raise malformed(path, f"field 'tables' field 'lost' is {lost}, not >= 0")
  return manifest


def write(directory: str, layout: dict[str, Any], generation: int, tables: bytes, lost: int) -> str:
  """Writes `tables-<generation>`, then the manifest naming it (the
  commit); returns the tables' file name."""
  name = tables_name(generation)
  atomic_write(os.path.join(directory, name), tables)
  manifest = dict(
    layout,
    generation=generation,
    tables={"file": name, "sha256": hashlib.sha256(tables).hexdigest(), "lost": lost},
  )
  atomic_write(os.path.join(directory, MANIFEST), json.dumps(manifest).encode())
  sync_directory(directory)
  return name


def encode_tables(
  checksums: list[np.ndarray], laps: np.ndarray, lost: np.ndarray | None
) -> tuple[bytes, int]:
  """The tables file's bytes (module docstring) and the count of lost rows."""
  lost_rows = np.flatnonzero(lost).astype(np.int64) if lost is not None else np.zeros(0, np.int64)
  parts = [np.asarray(table, np.uint32).tobytes() for table in checksums]
  parts += [np.asarray(laps, np.int32).tobytes(), lost_rows.tobytes()]
  return b"".join(parts), len(lost_rows)


def read_tables(
  directory: str, manifest: dict[str, Any], leaves: list[str], rows: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
  """The tables the manifest names: checksums by leaf, laps `[F]`, lost rows
  `[L]`; checked against the manifest's size and SHA-256."""
  entry = manifest["tables"]
  path = os.path.join(directory, entry["file"])
  data = read_file(path, f"the tables {path!r} that {MANIFEST} names are")
  expected = 4 * rows * (len(leaves) + 1) + 8 * entry["lost"]
  if len(data) != expected or hashlib.sha256(data).hexdigest() != entry["sha256"]:
    raise PayloadError(
      errno.EIO,
      f"disk: the tables {path!r} do not match {MANIFEST} ({len(data)} bytes, "
      f"expected {expected} with SHA-256 {entry['sha256'][:12]}...): changed or damaged.",
    )
  tables = np.frombuffer(data[: 4 * rows * (len(leaves) + 1)], np.uint32)
  checksums = {leaf: tables[i * rows : (i + 1) * rows].copy() for i, leaf in enumerate(leaves)}
  laps = tables[len(leaves) * rows :].view(np.int32).copy()
  lost = np.frombuffer(data[4 * rows * (len(leaves) + 1) :], np.int64).copy()
  if lost.size and (lost.min() < 0 or lost.max() >= rows):
    raise PayloadError(errno.EIO, f"disk: the tables {path!r} list lost rows outside [0, {rows}).")
  return checksums, laps, lost


def read_file(path: str, what: str) -> bytes:
  """The bytes of `path`; a missing file is a `PayloadError` saying `what`
  ("the tables ... are") is missing."""
  try:
    with open(path, "rb") as file:
      return file.read()
  except FileNotFoundError:
    raise PayloadError(errno.ENOENT, f"disk: {what} missing.") from None


def read_journal(directory: str, rows: int) -> np.ndarray:
  """The rows the journal names (sorted, unique); a record cut short by a
  kill is ignored (its rows had not been written)."""
  try:
    with open(os.path.join(directory, JOURNAL), "rb") as file:
      data = file.read()
  except FileNotFoundError:
    return np.zeros(0, np.int64)
  records = np.frombuffer(data[: len(data) // 16 * 16], np.int64).reshape(-1, 2)
  records = np.clip(records, 0, rows)
  if not len(records):
    return np.zeros(0, np.int64)
  return np.unique(np.concatenate([np.arange(first, stop) for first, stop in records]))


def row_runs(rows: np.ndarray) -> list[tuple[int, int]]:
  """`(first, stop)` rows of each run of consecutive rows in sorted `rows`."""
  return [(int(rows[start]), int(rows[stop - 1]) + 1) for start, stop in runs(rows)]


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
  """`[start, stop)` positions of the runs of consecutive rows in sorted `rows`."""
  if not len(rows):
    return []
  breaks = np.flatnonzero(np.diff(rows) != 1) + 1
  edges = [0, *breaks.tolist(), len(rows)]
  return list(zip(edges[:-1], edges[1:]))


def journal_record(runs: list[tuple[int, int]]) -> bytes:
  return np.asarray(runs, np.int64).reshape(-1, 2).tobytes()


def atomic_write(path: str, data: bytes) -> None:
  temporary = path + ".tmp"
  with open(temporary, "wb") as file:
    file.write(data)
    file.flush()
    os.fsync(file.fileno())
  os.replace(temporary, path)


def sync_directory(directory: str) -> None:
  """Makes the renames in `directory` durable (where the system allows)."""
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
