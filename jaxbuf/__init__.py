"""jaxbuf: experience buffers for reinforcement learning as pure JAX functions."""

from jaxbuf.advantages import compute_gae
from jaxbuf.advantages import lambda_returns
from jaxbuf.advantages import n_step_returns
from jaxbuf.advantages import normalize_advantages
from jaxbuf.checkpoint import load
from jaxbuf.checkpoint import save
from jaxbuf.minibatch import SequenceMinibatches
from jaxbuf.minibatch import env_minibatches
from jaxbuf.minibatch import sequence_chunks
from jaxbuf.minibatch import shuffled_minibatches
from jaxbuf.prioritized import PrioritizedReplayState
from jaxbuf.prioritized import prioritized_replay
from jaxbuf.replay import Buffer
from jaxbuf.replay import ReplaySample
from jaxbuf.replay import ReplayState
from jaxbuf.rollout import RolloutBuffer
from jaxbuf.rollout import RolloutState
from jaxbuf.rollout import rollout_buffer
from jaxbuf.uniform import uniform_replay

__version__ = "0.1.0"

__all__ = (
    "Buffer",
    "PrioritizedReplayState",
    "ReplaySample",
    "ReplayState",
    "RolloutBuffer",
    "RolloutState",
    "SequenceMinibatches",
    "compute_gae",
    "env_minibatches",
    "lambda_returns",
    "load",
    "n_step_returns",
    "normalize_advantages",
    "prioritized_replay",
    "rollout_buffer",
    "save",
    "sequence_chunks",
    "shuffled_minibatches",
    "uniform_replay",
)
