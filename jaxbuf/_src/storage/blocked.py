"""The payload files of a buffer split over devices (`jaxbuf.sharded` of a
disk-tier buffer): one `disk.PayloadFiles` per device's block of rows.
Host code."""

import os
import warnings
from typing import Callable

import numpy as np

from jaxbuf._src.storage import directory as directories
from jaxbuf._src.storage import manifest as records
from jaxbuf._src.storage.disk import PayloadFiles


class BlockedPayloadFiles:
  """The payload files of a buffer split over D devices: each device's block
  of rows in its own files, under `directory/device-<d>` (a `PayloadFiles`
  each, with its own lock, manifest and tables). Row g is row `g % L` of
  block `g // L`, L = rows / D."""

  def __init__(
    self,
    directory: str,
    leaves: dict[str, tuple[tuple[int, ...], np.dtype]],
    rows: int,
    blocks: int,
    *,
    laps: int = 1,
    sparse: bool = False,
  ):
    self.directory = directory
    self.rows = rows
    self.block_rows = rows // blocks
    self.parts: list[PayloadFiles] = []
    paths = [os.path.join(directory, f"device-{block}") for block in range(blocks)]
    try:
      new = [path for path in paths if not os.path.exists(os.path.join(path, records.MANIFEST))]
      if new and not sparse:
        os.makedirs(directory, exist_ok=True)
        row_bytes = {
          leaf: int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
          for leaf, (shape, dtype) in leaves.items()
        }
        directories.check_space(
          directory,
          len(new) * directories.needed_bytes(row_bytes, self.block_rows),
          f"the payload files of {len(new)} devices' blocks of {self.block_rows:,} rows",
        )
      for path in paths:
        self.parts.append(
          PayloadFiles(
            path,
            leaves,
            self.block_rows,
            laps=laps,
            sparse=sparse,
            space_checked=True,
            report=False,
          )
        )
    except BaseException:
      self.close()
      raise
    self.found_lost = self.lost_rows()
    if self.found_lost.size:
      generation = min(part.generation for part in self.parts)
      warnings.warn(directories.lost_report(directory, self.found_lost, generation), stacklevel=3)

  def _by_block(self, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    blocks = np.where(rows < 0, -1, rows // self.block_rows)
    return [(block, blocks == block) for block in np.unique(blocks[blocks >= 0]).tolist()]

  def write_rows(
    self, rows: np.ndarray, values: dict[str, np.ndarray]
  ) -> tuple[np.ndarray, Callable[[], None]]:
    """As `PayloadFiles.write_rows`, block by block; all blocks or none."""
    rows = np.asarray(rows, np.int64)
    laps = np.zeros(len(rows), np.int32)
    undos: list[Callable[[], None]] = []
    try:
      for block, chosen in self._by_block(rows):
        laps[chosen], undo = self.parts[block].write_rows(
          rows[chosen] % self.block_rows,
          {leaf: np.asarray(value)[chosen] for leaf, value in values.items()},
        )
        undos.append(undo)
    except OSError:
      for undo in reversed(undos):
        undo()
      raise

    def undo_all() -> None:
      for undo in reversed(undos):
        undo()

    return laps, undo_all

  def read_rows(self, leaf: str, rows: np.ndarray, laps: np.ndarray) -> np.ndarray:
    """As `PayloadFiles.read_rows`, each row from its block's files."""
    rows = np.asarray(rows, np.int64)
    shape, dtype = self.parts[0].leaves[leaf]
    out = np.zeros((len(rows),) + shape, dtype)
    for block, chosen in self._by_block(rows):
      out[chosen] = self.parts[block].read_rows(
        leaf, rows[chosen] % self.block_rows, np.asarray(laps)[chosen]
      )
    return out

  def has_lost(self) -> bool:
    return any(part.has_lost() for part in self.parts)

  def lost_mask(self, rows: np.ndarray) -> np.ndarray | None:
    if not self.has_lost():
      return None
    rows = np.asarray(rows, np.int64)
    mask = np.zeros(rows.shape, bool)
    for block, chosen in self._by_block(rows):
      found = self.parts[block].lost_mask(rows[chosen] % self.block_rows)
      if found is not None:
        mask[chosen] = found
    return mask

  def mark_lost(self, rows: np.ndarray) -> None:
    rows = np.asarray(rows, np.int64)
    for block, chosen in self._by_block(rows):
      self.parts[block].mark_lost(rows[chosen] % self.block_rows)

  def lost_rows(self) -> np.ndarray:
    found = [part.lost_rows() + block * self.block_rows for block, part in enumerate(self.parts)]
    return np.concatenate(found) if found else np.zeros(0, np.int64)

  def mismatched(self, laps: np.ndarray) -> np.ndarray:
    return np.concatenate(
      [
        part.mismatched(laps[block * self.block_rows : (block + 1) * self.block_rows])
        + block * self.block_rows
        for block, part in enumerate(self.parts)
      ]
    )

  def reserve(self) -> Callable[[], None]:
    releases = [part.reserve() for part in self.parts]

    def release() -> None:
      for part_release in releases:
        part_release()

    return release

  def sync(self) -> None:
    for part in self.parts:
      part.sync()

  def close(self) -> None:
    for part in self.parts:
      part.close()
    self.parts = []
