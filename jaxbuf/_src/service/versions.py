"""The policy version of each stored unit, for `version_lag` and
`max_version_lag`: an int32 array beside the state, one entry per unit id
a sample's `indices` name (an item replay's slot in `[0, C)`; a stream
kind's `env * R + slot`, R = C // N steps per env).

The array lives on the device: a sample's lag is `newest - versions[indices]`
and the eligibility mask for `max_version_lag` is `versions >= newest -
max_version_lag`, both computed where the sample's indices are, so the
learner's sample path never waits for a device-to-host copy. Which slots an
add writes is known on the host without reading the state: the write
positions (an item ring's `insert_position`, a stream's `write_heads`) are
read once when the service starts and then advanced here as every add
would advance them. The adds' writes are kept on the host and sent in one
scatter when a sample next reads the versions (an add costs no device
call of its own).

Tracked kinds: the item replay states (`ReplayState` and its subclasses)
and the stream states (`SequenceReplayState` and its subclasses), not
sharded. Other states (a mixture's list of states, a sharded state) are
not tracked: their lag is -1, and `max_version_lag` is refused for them.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.streams.sequence import SequenceReplayState

UNTRACKED = -1  # the lag reported for a kind whose units are not tracked


@functools.partial(jax.jit, donate_argnums=0)
def _written(versions: jax.Array, units: np.ndarray, values: np.ndarray) -> jax.Array:
  # Padding units are out of range, dropped; units are distinct (`_flush`).
  return versions.at[units].set(values, mode="drop", unique_indices=True)


@jax.jit
def _lags(versions: jax.Array, newest: jax.Array, indices: jax.Array) -> jax.Array:
  return (newest - versions[indices]).astype(jnp.int32)


class UnitVersions:
  """Each stored unit's policy version, kept in step with the adds.

  Not thread-safe: the service calls it under its state lock.
  """

  def __init__(self, state: Any):
    sharded = dict(getattr(state, "settings", ())).get("devices")
    self.layout: str | None = None
    self.newest = 0
    if isinstance(state, ReplayState) and not sharded:
      self.layout = "items"
      self._capacity = int(jax.tree.leaves(state.storage)[0].shape[0])
      self._insert_position = int(state.insert_position)
      units = self._capacity
    elif isinstance(state, SequenceReplayState) and not sharded:
      self.layout = "streams"
      self._num_envs, self._rows = jax.tree.leaves(state.storage)[0].shape[:2]
      self._write_heads = np.asarray(state.write_heads).astype(np.int64)
      units = self._num_envs * self._rows
    else:
      units = 0
    self._versions = jnp.zeros(units, jnp.int32)
    self._pending_units: list[np.ndarray] = []  # writes not yet on the device, oldest first
    self._pending_values: list[np.ndarray] = []
    self._pending_count = 0

  @property
  def versions(self) -> jax.Array:
    """int32 `[C]` on the device, every add's writes included."""
    if self._pending_units:
      self._flush()
    return self._versions

  def _flush(self) -> None:
    units = np.concatenate(self._pending_units)[::-1]
    values = np.concatenate(self._pending_values)[::-1]
    self._pending_units, self._pending_values, self._pending_count = [], [], 0
    units, first = np.unique(units, return_index=True)  # the newest write of each unit
    values = values[first]
    size = 1 << max(int(units.size - 1).bit_length(), 4)  # few distinct sizes to compile
    padded_units = np.full(size, self._versions.shape[0], np.int32)
    padded_values = np.zeros(size, np.int32)
    padded_units[: units.size], padded_values[: units.size] = units, values
    self._versions = _written(self._versions, padded_units, padded_values)

  def restore(self, versions: np.ndarray, newest: int) -> None:
    """Takes a checkpoint's versions (`versions` as saved)."""
    if versions.shape != self._versions.shape:
      raise ValueError(
        f"checkpoint: versions of shape {versions.shape}; the state has {self._versions.shape}."
      )
    self._pending_units, self._pending_values, self._pending_count = [], [], 0
    self._versions = jnp.asarray(versions, jnp.int32)
    self.newest = int(newest)

  def added_items(self, versions: np.ndarray) -> None:
    """Records an item add of `len(versions)` rows, row i of version i."""
    self.newest = max(self.newest, int(versions.max()))
    if self.layout != "items":
      return
    rows = len(versions)
    kept = min(rows, self._capacity)  # a ring add longer than C keeps its last C rows
    units = (self._insert_position + np.arange(rows - kept, rows)) % self._capacity
    self._insert_position = (self._insert_position + rows) % self._capacity
    self._write(units, versions[rows - kept :])

  def added_steps(self, steps_per_env: np.ndarray, versions: np.ndarray) -> None:
    """Records a stream add: env e wrote `steps_per_env[e]` steps (final
    steps included) of version `versions[e]`."""
    written = steps_per_env > 0
    if written.any():
      self.newest = max(self.newest, int(versions[written].max()))
    if self.layout != "streams":
      return
    units, values = [], []
    for env in np.flatnonzero(written):
      steps = int(steps_per_env[env])
      kept = min(steps, self._rows)
      slots = (self._write_heads[env] + np.arange(steps - kept, steps)) % self._rows
      self._write_heads[env] = (self._write_heads[env] + steps) % self._rows
      units.append(env * self._rows + slots)
      values.append(np.full(kept, versions[env]))
    if units:
      self._write(np.concatenate(units), np.concatenate(values))

  def _write(self, units: np.ndarray, values: np.ndarray) -> None:
    self._pending_units.append(units)
    self._pending_values.append(values)
    self._pending_count += units.size
    if self._pending_count > self._versions.shape[0]:  # held on the host: at most ~2 C
      self._flush()

  def lags(self, indices: jax.Array) -> jax.Array:
    """int32 `[S]`: the newest version minus each unit's (-1 untracked)."""
    if self.layout is None:
      return jnp.full(jnp.shape(indices), UNTRACKED, jnp.int32)
    return _lags(self.versions, np.int32(self.newest), indices)

  def eligible(self, max_version_lag: int) -> jax.Array:
    """bool `[C]`: the units whose lag is at most `max_version_lag`."""
    return self.versions >= self.newest - max_version_lag
