"""A plain NumPy replay buffer: the obviously correct, slow model of jaxbuf.

Items are added one at a time, priorities set one at a time, probabilities
computed from scratch. Tests drive it and jaxbuf with the same operations.
"""

import jax
import numpy as np


class ReferenceReplay:
  """Ring buffer of `capacity` items with optional proportional priorities."""

  def __init__(self, capacity: int, *, alpha: float = 0.6, eps: float = 1e-6):
    self.capacity = capacity
    self.alpha = alpha
    self.eps = eps
    self.storage: list = [None] * capacity
    self.priorities = np.zeros(capacity)
    self.ids = np.zeros(capacity, np.int64)
    self.insert_position = 0
    self.size = 0
    self.add_count = 0
    self.max_priority = 1.0
    self.updates = 0

  def add(self, items: list) -> None:
    for item in items:
      self.storage[self.insert_position] = item
      self.priorities[self.insert_position] = self.max_priority
      self.ids[self.insert_position] = self.add_count
      self.insert_position = (self.insert_position + 1) % self.capacity
      self.size = min(self.size + 1, self.capacity)
      self.add_count += 1

  def update_priorities(self, indices, priorities, item_ids=None) -> None:
    for position, (index, priority) in enumerate(zip(indices, priorities)):
      if not (0 <= index < self.size and np.isfinite(priority)):
        continue
      if item_ids is not None and self.ids[index] % 2**32 != item_ids[position]:
        continue
      # Signed values count by their magnitude, as |TD error|.
      self.priorities[index] = float(np.abs(np.float32(priority)) + np.float32(self.eps))
      self.max_priority = max(self.max_priority, self.priorities[index])
    self.updates += 1

  def clear(self) -> None:
    self.insert_position = 0
    self.size = 0
    self.priorities[:] = 0
    self.max_priority = 1.0

  def turn(self) -> None:
    """What regrouping over devices does (`jaxbuf.load` into another device
    count): a full ring is turned so that its oldest item is slot 0."""
    if self.size < self.capacity:
      return
    order = (self.insert_position + np.arange(self.capacity)) % self.capacity
    self.storage = [self.storage[slot] for slot in order]
    self.priorities, self.ids = self.priorities[order], self.ids[order]
    self.insert_position = 0

  def probabilities(self) -> np.ndarray:
    """P(i) for every slot; zero outside the items held."""
    mass = np.where(np.arange(self.capacity) < self.size, self.priorities**self.alpha, 0.0)
    return mass / mass.sum()

  def weights(self, indices, beta: float) -> np.ndarray:
    raw = (self.size * self.probabilities()[indices]) ** -beta
    return raw / raw.max()


class ReferencePriorities:
  """Priorities of what a stream buffer can sample, by key (env, first
  step): new entries come in at the running maximum, updates skip
  non-finite, unknown and stale entries and count signed values by their
  magnitude, as in `ReferenceReplay`."""

  def __init__(self, eps: float):
    self.eps = eps
    self.of: dict = {}  # key -> priority + eps
    self.max_priority = 1.0

  def refresh(self, keys) -> None:
    """Keeps the priorities of `keys`, the entries held now; new ones at
    the maximum."""
    self.of = {key: self.of.get(key, self.max_priority) for key in keys}

  def update(self, keys_by_id: dict, indices, priorities, item_ids=None) -> None:
    """`keys_by_id`: {id: key} of the entries held; `item_ids`: the first
    step of each entry as sampled, or None."""
    for position, (index, priority) in enumerate(zip(indices, priorities)):
      key = keys_by_id.get(int(index))
      if key is None or not np.isfinite(priority):
        continue
      if item_ids is not None and key[1] % 2**32 != item_ids[position]:
        continue
      self.of[key] = float(np.float32(abs(priority)) + np.float32(self.eps))
      self.max_priority = max(self.max_priority, self.of[key])


def add_random_stream_steps(buffer, state, reference, operation, make_steps):
  """Applies a hypothesis `("add", num_steps, mask, seed)` to a stream buffer
  and its reference model (`reference.add(num_steps, mask, ends)`).

  `num_steps` 0 adds one step per env (`[N, ...]`), else a chunk
  `[N, T, ...]`; each step ends an episode with probability 0.3.
  `make_steps(reference, T)` gives the steps `[N, T, ...]`.
  """
  _, num_steps, mask, seed = operation
  length = max(num_steps, 1)
  ends = np.random.default_rng(seed).random((len(mask), length)) < 0.3
  steps, step_ends = make_steps(reference, length), ends
  if num_steps == 0:
    steps, step_ends = jax.tree.map(lambda x: x[:, 0], steps), ends[:, 0]
  state = buffer.add(state, steps, mask=np.array(mask), episode_end=step_ends)
  reference.add(length, mask, ends)
  return state
