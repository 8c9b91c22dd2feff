"""What a code snippet stores as transitions: its next observations are true.

`TransitionRecorder.patched(monkeypatch)` wraps every buffer factory of
`jaxbuf` (`jaxbuf.*_replay`) so that each buffer it makes records the items
its `add` is given; `check()` then fails for items that hold an observation
and a next observation (`obs` / `next_obs`, `observation` /
`next_observation`, `observations` / `next_observations`, as keys or
fields) where

* every row's next observation equals its observation: the snippet stored
  `next_obs = obs` (`{**step, "next_obs": step["obs"]}`), whatever its data;
* the adds to one buffer look like an env loop (in some add, a row's next
  observation is an observation of the next add) but in some add a row whose
  episode did not end (no `done`, `terminated`, `truncated`, `last` flag
  set) has a next observation that is no observation of the next add: the
  loop stores a stale or shifted next observation.

Adds traced inside a jit (or vmap, scan) are recorded when they run
(`jax.debug.callback`, test code only), and get the first check alone: their
order across vmapped copies is not an env's order.
"""

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

import jaxbuf

PAIRS = (
  ("obs", "next_obs"),
  ("observation", "next_observation"),
  ("observations", "next_observations"),
)
ENDS = ("done", "dones", "terminated", "truncated", "terminations", "truncations", "last")


def _field(items: Any, name: str) -> Any:
  if isinstance(items, dict):
    return items.get(name)
  return getattr(items, name, None)


def _rows(tree: Any) -> np.ndarray:
  """`[B, ...]` leaves as one `[B, D]` array, so rows compare whole."""
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  rows = leaves[0].shape[0] if leaves and leaves[0].ndim else 0
  return np.concatenate(
    [leaf.reshape(rows, -1).astype(np.float64) for leaf in leaves] or [np.zeros((rows, 0))], axis=1
  )


@dataclasses.dataclass
class Add:
  """One add's observations `[B, D]`, next observations and episode ends `[B]`."""

  obs: np.ndarray
  next_obs: np.ndarray
  ended: np.ndarray
  traced: bool


def _chains(add: Add, following: Add) -> np.ndarray:
  """bool `[B]`: each row's next observation is an observation of `following`."""
  return np.array(
    [bool(np.any(np.all(following.obs == row, axis=1))) for row in add.next_obs], bool
  )


@dataclasses.dataclass
class TransitionRecorder:
  """The adds of transitions made through `jaxbuf`'s factories, per buffer."""

  adds: dict[int, list[Add | None]] = dataclasses.field(default_factory=dict)
  # None in a buffer's list: an `init` or `clear`, where a new stream starts
  names: dict[int, str] = dataclasses.field(default_factory=dict)

  def patched(self, monkeypatch) -> "TransitionRecorder":
    for name in jaxbuf.__all__:
      if name.endswith("_replay"):
        monkeypatch.setattr(jaxbuf, name, self._factory(getattr(jaxbuf, name), name))
    return self

  def _factory(self, factory, name):
    @functools.wraps(factory)
    def make(*args, **kwargs):
      buffer = factory(*args, **kwargs)
      buffer_id = len(self.names)
      return buffer._replace(
        init=self._restarting(buffer.init, buffer_id),
        clear=self._restarting(buffer.clear, buffer_id),
        add=self._recording(buffer.add, buffer_id, name),
      )

    return make

  def _restarting(self, function, buffer_id):
    """`init` or `clear`: the adds after it are another stream of steps."""

    @functools.wraps(function)
    def restarting(*args, **kwargs):
      self.adds.setdefault(buffer_id, []).append(None)
      return function(*args, **kwargs)

    return restarting

  def _recording(self, add, buffer_id, name):
    self.names[buffer_id] = name

    @functools.wraps(add)
    def recording_add(state, items, *args, **kwargs):
      pair = next(
        (
          (_field(items, obs), _field(items, next_obs))
          for obs, next_obs in PAIRS
          if _field(items, obs) is not None and _field(items, next_obs) is not None
        ),
        None,
      )
      if pair is not None:
        flags = [_field(items, end) for end in ENDS if _field(items, end) is not None]
        record = functools.partial(self._record, buffer_id)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((pair, flags))):
          jax.debug.callback(functools.partial(record, traced=True), pair, flags)
        else:
          record(pair, flags, traced=False)
      return add(state, items, *args, **kwargs)

    return recording_add

  def _record(self, buffer_id, pair, flags, *, traced):
    obs, next_obs = (_rows(tree) for tree in pair)
    ended = np.zeros(obs.shape[0], bool)
    for flag in flags:
      ended |= np.asarray(flag).reshape(obs.shape[0], -1).any(axis=1)
    self.adds.setdefault(buffer_id, []).append(Add(obs, next_obs, ended, traced))

  def transitions_added(self) -> int:
    return sum(add.obs.shape[0] for adds in self.adds.values() for add in adds if add is not None)

  def problems(self) -> list[str]:
    found = []
    for buffer_id, adds in self.adds.items():
      name = self.names[buffer_id]
      for index, add in enumerate(add for add in adds if add is not None):
        if add.obs.shape[0] and np.array_equal(add.obs, add.next_obs):
          found.append(
            f"{name} (add {index}): every stored next observation equals its "
            "observation; store the observation the env returned after the "
            "action (or store each step once: docs/migration/flashbax_flat.md)"
          )
      # Consecutive adds of one stream (between inits), traced ones left out.
      numbered = [(index, add) for index, add in enumerate(add for add in adds if add is not None)]
      streams, stream = [], []
      for add in adds:
        if add is None:
          streams.append(stream)
          stream = []
        else:
          stream.append(numbered.pop(0))
      streams.append(stream)
      chained = [
        (index, add, _chains(add, following))
        for stream in streams
        for (index, add), (_, following) in zip(stream, stream[1:])
        if not (add.traced or following.traced)
      ]
      # An env loop: some row of some add continues into the next add.
      if not any(chains[~add.ended].any() for _, add, chains in chained):
        continue
      for index, add, chains in chained:
        rows = np.flatnonzero(~chains & ~add.ended).tolist()
        if rows:
          found.append(
            f"{name} (add {index}): rows {rows} did not end their episode, and "
            "their next observation is no observation of the next add: the "
            "stored next observation is not the one the env returned"
          )
    return found

  def check(self) -> None:
    problems = self.problems()
    assert not problems, "stored transitions are wrong:\n" + "\n".join(problems)
