"""Accepted adds waiting for a device call, and how many of them become one
call (`ReplayService`'s flat combining): item adds concatenated into one
`buffer.add`; stream adds of writers owning different envs scattered into
one `[N, ...]` add with a mask. Host NumPy only; no locks (the service
calls these under its state lock).

Shape key: N envs, n a writer's envs, T steps per env in one add.
"""

from typing import Any

import jax
import numpy as np

from jaxbuf._src.core.pytypes import PyTree


class PendingAdd:
  """One accepted add, waiting to be drained into a device call."""

  def __init__(self, writer, units, items, version, mask, episode_end, final_steps, steps):
    self.writer = writer
    self.units = units  # limiter units: rows (items) or env steps (streams)
    self.items = items
    self.version = version
    self.mask = mask  # bool [n] (streams)
    self.episode_end = episode_end
    self.final_steps = final_steps
    self.steps = steps  # T per env (streams): 1 for [n, ...] steps
    self.error: BaseException | None = None

  def form(self) -> tuple:
    """Adds of one form may share a device call (streams): the two forms of
    `episode_end` (with and without final steps) mean different things."""
    return (self.final_steps is not None, self.episode_end is not None, self.steps)


def groups(pending: list[PendingAdd], *, streams: bool, by_part: bool) -> list[list[PendingAdd]]:
  """`pending` (oldest first) as the adds of each device call, in order.

  Items: one call (a mixture: one per part). Streams: each add goes in the
  first group after the last one holding an add of its writer or of another
  form, so each env's steps stay in order and no call holds an env twice.
  """
  if by_part:
    parts = sorted({entry.writer.part for entry in pending})
    return [[entry for entry in pending if entry.writer.part == part] for part in parts]
  if not streams:
    return [pending]
  grouped: list[list[PendingAdd]] = []
  for entry in pending:
    earliest = 0
    for index, group in enumerate(grouped):
      if any(other.writer is entry.writer or other.form() != entry.form() for other in group):
        earliest = index + 1
    if earliest == len(grouped):
      grouped.append([])
    grouped[earliest].append(entry)
  return grouped


def merged_items(group: list[PendingAdd]) -> tuple[PyTree, np.ndarray]:
  """The items of one call `[B, ...]` and each row's version, int64 `[B]`."""
  if len(group) == 1:
    items = group[0].items
  else:
    items = jax.tree.map(
      lambda *leaves: np.concatenate([np.asarray(leaf) for leaf in leaves]),
      *[entry.items for entry in group],
    )
  versions = np.concatenate([np.full(entry.units, entry.version, np.int64) for entry in group])
  return items, versions


def scattered(
  envs: np.ndarray, num_envs: int, items: PyTree, mask: Any, episode_end: Any, final_steps: Any
) -> tuple:
  """A writer's `[n, ...]` add as the buffer's `[N, ...]` one (others masked):
  `(steps, mask, episode_end, final_steps)`."""

  def full(leaf, fill=0):
    leaf = np.asarray(leaf)
    out = np.full((num_envs, *leaf.shape[1:]), fill, leaf.dtype)
    out[envs] = leaf
    return out

  return (
    jax.tree.map(full, items),
    full(mask, False),
    None if episode_end is None else full(episode_end, False),
    None if final_steps is None else jax.tree.map(full, final_steps),
  )


def merged_steps(group: list[PendingAdd], num_envs: int) -> tuple[tuple, np.ndarray, np.ndarray]:
  """One stream call: `buffer.add`'s `(steps, mask, episode_end,
  final_steps)`, and per env the steps written (final steps included) and
  their version, int64 `[N]` each."""
  steps_per_env = np.zeros(num_envs, np.int64)
  versions = np.zeros(num_envs, np.int64)
  parts = []
  for entry in group:
    envs = entry.writer.envs
    parts.append(
      (
        envs,
        scattered(envs, num_envs, entry.items, entry.mask, entry.episode_end, entry.final_steps),
      )
    )
    steps_per_env[envs] = entry.mask * entry.steps + (ended(entry) & entry.mask)
    versions[envs] = entry.version
  items, mask, episode_end, final_steps = parts[0][1]
  for envs, (more_items, more_mask, more_end, more_final) in parts[1:]:
    for whole, part in zip(jax.tree.leaves(items), jax.tree.leaves(more_items)):
      whole[envs] = part[envs]
    mask[envs] = more_mask[envs]
    if episode_end is not None:
      episode_end[envs] = more_end[envs]
    if final_steps is not None:
      for whole, part in zip(jax.tree.leaves(final_steps), jax.tree.leaves(more_final)):
        whole[envs] = part[envs]
  return (items, mask, episode_end, final_steps), steps_per_env, versions


def rows_of(items: PyTree) -> int:
  """B, the rows of an item add."""
  leaves = jax.tree.leaves(items)
  if not leaves or np.ndim(leaves[0]) == 0:
    raise ValueError("Writer.add: items must be arrays with a leading batch axis [B, ...].")
  return int(np.shape(leaves[0])[0])


def ended(entry: PendingAdd) -> np.ndarray:
  """bool `[n]`: the writer's envs whose add writes a final step."""
  n = len(entry.mask)
  if entry.final_steps is None:
    return np.zeros(n, np.bool_)
  if entry.episode_end is not None:
    return np.asarray(entry.episode_end, np.bool_).reshape(n, -1)[:, -1]
  last = getattr(entry.final_steps, "last", None)
  if last is None and isinstance(entry.final_steps, dict):
    last = entry.final_steps.get("last")
  return np.zeros(n, np.bool_) if last is None else np.asarray(last, np.bool_)
