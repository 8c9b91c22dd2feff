"""jaxbuf: experience buffers for reinforcement learning as pure JAX functions.

This module is the public surface; everything under `jaxbuf._src` is private
and may change. The module-level functions of each buffer kind, with every
setting explicit, are public too, for users who bind them differently:
`jaxbuf.uniform`, `jaxbuf.prioritized`, `jaxbuf.rollout`, `jaxbuf.sequence`,
`jaxbuf.prioritized_sequence`, `jaxbuf.hindsight`, `jaxbuf.episode`,
`jaxbuf.frames`.
`help(jaxbuf.streams)` is the stream convention every stream kind follows;
`help(jaxbuf.offline)` maps Minari's and RLDS's episodes onto jaxbuf's items
and streams.
"""

from jaxbuf._src import episode
from jaxbuf._src import frames
from jaxbuf._src import hindsight
from jaxbuf._src import offline
from jaxbuf._src import prioritized
from jaxbuf._src import prioritized_sequence
from jaxbuf._src import rollout
from jaxbuf._src import sequence
from jaxbuf._src import streams
from jaxbuf._src import uniform
from jaxbuf._src.advantages import compute_gae
from jaxbuf._src.advantages import lambda_returns
from jaxbuf._src.advantages import n_step_returns
from jaxbuf._src.advantages import normalize_advantages
from jaxbuf._src.base import Buffer
from jaxbuf._src.base import BufferState
from jaxbuf._src.base import ReplaySample
from jaxbuf._src.checkpoint import load
from jaxbuf._src.cond import cond_update
from jaxbuf._src.episode import EpisodeReplayState
from jaxbuf._src.episode import EpisodeSample
from jaxbuf._src.episode import episode_replay
from jaxbuf._src.hindsight import HindsightReplayState
from jaxbuf._src.hindsight import HindsightSample
from jaxbuf._src.hindsight import HindsightTransition
from jaxbuf._src.hindsight import hindsight_replay
from jaxbuf._src.checkpoint import save
from jaxbuf._src.frames import FrameStackReplayState
from jaxbuf._src.frames import FrameStackTransition
from jaxbuf._src.frames import frame_stack_replay
from jaxbuf._src.frames import prioritized_frame_stack_replay
from jaxbuf._src.minibatch import SequenceMinibatches
from jaxbuf._src.minibatch import env_minibatches
from jaxbuf._src.minibatch import sequence_chunks
from jaxbuf._src.minibatch import shuffled_minibatches
from jaxbuf._src.offline import Episode
from jaxbuf._src.offline import EpisodeStep
from jaxbuf._src.offline import Transition
from jaxbuf._src.held_episodes import held_episodes
from jaxbuf._src.minari_datasets import from_minari
from jaxbuf._src.minari_datasets import offline_example
from jaxbuf._src.minari_datasets import to_minari
from jaxbuf._src.rlds_steps import from_rlds_steps
from jaxbuf._src.rlds_steps import to_rlds_steps
from jaxbuf._src.prioritized import PrioritizedReplayState
from jaxbuf._src.prioritized import prioritized_replay
from jaxbuf._src.prioritized_sequence import PrioritizedSequenceReplayState
from jaxbuf._src.pytypes import PyTree
from jaxbuf._src.pytypes import Schedule
from jaxbuf._src.prioritized_sequence import prioritized_sequence_replay
from jaxbuf._src.ring import ReplayState
from jaxbuf._src.rollout import RolloutBuffer
from jaxbuf._src.rollout import RolloutState
from jaxbuf._src.rollout import rollout_buffer
from jaxbuf._src.sequence import SequenceReplayState
from jaxbuf._src.sequence import SequenceSample
from jaxbuf._src.sequence import sequence_replay
from jaxbuf._src.sharded import sharded
from jaxbuf._src.spaces import example_from_space
from jaxbuf._src.transitions import NStepTargets
from jaxbuf._src.transitions import NStepTransitions
from jaxbuf._src.transitions import burn_in_split
from jaxbuf._src.transitions import n_step_targets
from jaxbuf._src.transitions import n_step_transitions
from jaxbuf._src.transitions import r2d2_priorities
from jaxbuf._src.uniform import epoch_batches
from jaxbuf._src.uniform import uniform_replay

__version__ = "0.1.0"

__all__ = (
    "Buffer",
    "BufferState",
    "Episode",
    "EpisodeReplayState",
    "EpisodeSample",
    "EpisodeStep",
    "FrameStackReplayState",
    "FrameStackTransition",
    "HindsightReplayState",
    "HindsightSample",
    "HindsightTransition",
    "NStepTargets",
    "NStepTransitions",
    "PrioritizedReplayState",
    "PrioritizedSequenceReplayState",
    "PyTree",
    "ReplaySample",
    "ReplayState",
    "RolloutBuffer",
    "RolloutState",
    "Schedule",
    "SequenceMinibatches",
    "SequenceReplayState",
    "SequenceSample",
    "Transition",
    "burn_in_split",
    "compute_gae",
    "cond_update",
    "env_minibatches",
    "episode",
    "episode_replay",
    "epoch_batches",
    "example_from_space",
    "frame_stack_replay",
    "frames",
    "from_minari",
    "from_rlds_steps",
    "held_episodes",
    "hindsight",
    "hindsight_replay",
    "lambda_returns",
    "load",
    "n_step_returns",
    "n_step_targets",
    "n_step_transitions",
    "normalize_advantages",
    "offline",
    "offline_example",
    "prioritized",
    "prioritized_frame_stack_replay",
    "prioritized_replay",
    "prioritized_sequence",
    "prioritized_sequence_replay",
    "r2d2_priorities",
    "rollout",
    "rollout_buffer",
    "save",
    "sequence",
    "sequence_chunks",
    "sequence_replay",
    "sharded",
    "shuffled_minibatches",
    "streams",
    "to_minari",
    "to_rlds_steps",
    "uniform",
    "uniform_replay",
)
