"""The records of one environment step that every layer above the core
stores and exchanges: `Transition` (an item of item replay) and
`EpisodeStep` (a step of a stream, in the stream convention,
`help(jaxbuf.streams)`).

The offline readers and writers (`jaxbuf.from_minari`, `to_minari`, ...) and
the host recorder (`jaxbuf.VectorEnvRecorder`) both make them, so they live
here, below both, with the core's other records (`ReplaySample` in
`base.py`).
"""

from typing import Any, NamedTuple

from jaxbuf._src.core.pytypes import PyTree


class Transition(NamedTuple):
  """An item of item replay: one transition (unbatched leaves)."""

  obs: PyTree  # the observation space's structure
  action: PyTree  # the action space's structure
  reward: Any  # shape=(), the dataset's reward dtype
  next_obs: PyTree  # like obs: the observation after the action
  terminated: Any  # shape=(), bool: the action ended the episode
  truncated: Any  # shape=(), bool: the episode was cut after it


class EpisodeStep(NamedTuple):
  """A step of a sequence replay stream (the stream convention)."""

  obs: PyTree  # the observation space's structure
  action: PyTree  # zeros on a `last` step
  reward: Any  # shape=(); 0 on a `last` step
  terminated: Any  # shape=(), bool: this step's action ended it
  truncated: Any  # shape=(), bool: cut after this step's action
  last: Any  # shape=(), bool: holds an episode's final obs
