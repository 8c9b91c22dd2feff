"""jaxbuf: experience buffers for reinforcement learning as pure JAX functions."""

from jaxbuf.prioritized import PrioritizedReplayState
from jaxbuf.prioritized import prioritized_replay
from jaxbuf.replay import Buffer
from jaxbuf.replay import ReplaySample
from jaxbuf.replay import ReplayState
from jaxbuf.uniform import uniform_replay

__version__ = "0.1.0"

__all__ = (
    "Buffer",
    "PrioritizedReplayState",
    "ReplaySample",
    "ReplayState",
    "prioritized_replay",
    "uniform_replay",
)
