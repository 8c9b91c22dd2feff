"""jaxbuf: experience buffers for reinforcement learning as pure JAX functions.

This module is the public surface; everything under `jaxbuf._src` is private
and may change. The module-level functions of each buffer kind, with every
setting explicit, are public too, for users who bind them differently:
`jaxbuf.uniform`, `jaxbuf.prioritized`, `jaxbuf.rollout`, `jaxbuf.sequence`,
`jaxbuf.prioritized_sequence`, `jaxbuf.hindsight`, `jaxbuf.episode`,
`jaxbuf.frames`, `jaxbuf.queue`, `jaxbuf.budget`, `jaxbuf.heap`,
`jaxbuf.keep_best`.
`help(jaxbuf.streams)` is the stream convention every stream kind follows;
`help(jaxbuf.offline)` maps Minari's and RLDS's episodes onto jaxbuf's items
and streams.
"""

from jaxbuf._src.streams import episode
from jaxbuf._src.streams import frames
from jaxbuf._src.streams import hindsight
from jaxbuf._src.offline import mapping as offline
from jaxbuf._src.items import prioritized
from jaxbuf._src.streams import prioritized_sequence
from jaxbuf._src.onpolicy import rollout
from jaxbuf._src.streams import sequence
from jaxbuf._src.streams import convention as streams
from jaxbuf._src.items import uniform
from jaxbuf._src.selection import budget
from jaxbuf._src.selection import heap
from jaxbuf._src.selection import keep_best
from jaxbuf._src.selection import queue
from jaxbuf._src.selection.heap import HeapReplayState
from jaxbuf._src.selection.heap import heap_replay
from jaxbuf._src.selection.keep_best import KeepBestState
from jaxbuf._src.selection.keep_best import keep_best_replay
from jaxbuf._src.selection.budget import BudgetedReplayState
from jaxbuf._src.selection.queue import QueueSample
from jaxbuf._src.selection.queue import QueueState
from jaxbuf._src.selection.queue import queue_replay
from jaxbuf._src.onpolicy.advantages import compute_gae
from jaxbuf._src.onpolicy.advantages import lambda_returns
from jaxbuf._src.onpolicy.advantages import n_step_returns
from jaxbuf._src.onpolicy.advantages import normalize_advantages
from jaxbuf._src.core.base import Buffer
from jaxbuf._src.core.base import BufferState
from jaxbuf._src.core.base import ReplaySample
from jaxbuf._src.checkpoint.saving import load
from jaxbuf._src.core.cond import cond_update
from jaxbuf._src.streams.episode import EpisodeReplayState
from jaxbuf._src.streams.episode import EpisodeSample
from jaxbuf._src.streams.factories import episode_replay
from jaxbuf._src.streams.hindsight import HindsightReplayState
from jaxbuf._src.streams.hindsight import HindsightSample
from jaxbuf._src.streams.hindsight import HindsightTransition
from jaxbuf._src.streams.factories import hindsight_replay
from jaxbuf._src.checkpoint.saving import save
from jaxbuf._src.streams.frames import FrameStackReplayState
from jaxbuf._src.streams.frames import FrameStackTransition
from jaxbuf._src.streams.factories import frame_stack_replay
from jaxbuf._src.streams.factories import prioritized_frame_stack_replay
from jaxbuf._src.onpolicy.minibatch import SequenceMinibatches
from jaxbuf._src.onpolicy.minibatch import env_minibatches
from jaxbuf._src.onpolicy.minibatch import sequence_chunks
from jaxbuf._src.onpolicy.minibatch import shuffled_minibatches
from jaxbuf._src.offline.mapping import Episode
from jaxbuf._src.core.records import EpisodeStep
from jaxbuf._src.core.records import Transition
from jaxbuf._src.offline.held_episodes import held_episodes
from jaxbuf._src.offline.minari_datasets import from_minari
from jaxbuf._src.offline.minari_datasets import offline_example
from jaxbuf._src.offline.minari_datasets import to_minari
from jaxbuf._src.offline.rlds_steps import from_rlds_steps
from jaxbuf._src.offline.rlds_steps import to_rlds_steps
from jaxbuf._src.items.prioritized import PrioritizedReplayState
from jaxbuf._src.selection.budget import prioritized_replay
from jaxbuf._src.streams.prioritized_sequence import PrioritizedSequenceReplayState
from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.core.pytypes import Schedule
from jaxbuf._src.streams.factories import prioritized_sequence_replay
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.onpolicy.rollout import RolloutBuffer
from jaxbuf._src.onpolicy.rollout import RolloutState
from jaxbuf._src.onpolicy.rollout import rollout_buffer
from jaxbuf._src.streams.sequence import SequenceReplayState
from jaxbuf._src.streams.sequence import SequenceSample
from jaxbuf._src.streams.factories import sequence_replay
from jaxbuf._src.sharded import sharded
from jaxbuf._src.mixture import Mixture
from jaxbuf._src.mixture import MixtureSample
from jaxbuf._src.mixture import mixture
from jaxbuf._src.core.spaces import example_from_space
from jaxbuf._src.streams.pairs import StepPair
from jaxbuf._src.streams.pairs import step_pairs
from jaxbuf._src.streams.transitions import NStepTargets
from jaxbuf._src.streams.transitions import NStepTransitions
from jaxbuf._src.streams.transitions import burn_in_split
from jaxbuf._src.streams.transitions import n_step_targets
from jaxbuf._src.streams.transitions import n_step_transitions
from jaxbuf._src.streams.transitions import r2d2_priorities
from jaxbuf._src.items.uniform import epoch_batches
from jaxbuf._src.selection.budget import uniform_replay
from jaxbuf._src.storage.tiers import Disk
from jaxbuf._src.storage.tiers import disk
from jaxbuf._src.storage.prefetch import Prefetcher
from jaxbuf._src.storage.placed import HostTierState
from jaxbuf._src.host.vector_envs import RecordedStep
from jaxbuf._src.host.vector_envs import VectorEnvRecorder
from jaxbuf._src.service.closed import ServiceClosed
from jaxbuf._src.service.limiters import MinSize
from jaxbuf._src.service.limiters import Queue
from jaxbuf._src.service.limiters import RateCounts
from jaxbuf._src.service.limiters import RateLimiter
from jaxbuf._src.service.limiters import SampleToInsertRatio
from jaxbuf._src.service.replay_service import ReplayService
from jaxbuf._src.service.replay_service import ServiceSample
from jaxbuf._src.service.writer import Writer

__version__ = "0.1.0"

__all__ = (
  "BudgetedReplayState",
  "Buffer",
  "BufferState",
  "Disk",
  "Episode",
  "EpisodeReplayState",
  "EpisodeSample",
  "EpisodeStep",
  "FrameStackReplayState",
  "FrameStackTransition",
  "HeapReplayState",
  "HindsightReplayState",
  "HindsightSample",
  "HindsightTransition",
  "HostTierState",
  "KeepBestState",
  "MinSize",
  "Mixture",
  "MixtureSample",
  "NStepTargets",
  "NStepTransitions",
  "Prefetcher",
  "PrioritizedReplayState",
  "PrioritizedSequenceReplayState",
  "PyTree",
  "Queue",
  "QueueSample",
  "QueueState",
  "RateCounts",
  "RateLimiter",
  "RecordedStep",
  "ReplaySample",
  "ReplayService",
  "ReplayState",
  "RolloutBuffer",
  "RolloutState",
  "SampleToInsertRatio",
  "Schedule",
  "SequenceMinibatches",
  "SequenceReplayState",
  "SequenceSample",
  "ServiceClosed",
  "ServiceSample",
  "StepPair",
  "Transition",
  "VectorEnvRecorder",
  "Writer",
  "budget",
  "burn_in_split",
  "compute_gae",
  "cond_update",
  "disk",
  "env_minibatches",
  "episode",
  "episode_replay",
  "epoch_batches",
  "example_from_space",
  "frame_stack_replay",
  "frames",
  "from_minari",
  "from_rlds_steps",
  "heap",
  "heap_replay",
  "held_episodes",
  "hindsight",
  "hindsight_replay",
  "keep_best",
  "keep_best_replay",
  "lambda_returns",
  "load",
  "mixture",
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
  "queue",
  "queue_replay",
  "r2d2_priorities",
  "rollout",
  "rollout_buffer",
  "save",
  "sequence",
  "sequence_chunks",
  "sequence_replay",
  "sharded",
  "shuffled_minibatches",
  "step_pairs",
  "streams",
  "to_minari",
  "to_rlds_steps",
  "uniform",
  "uniform_replay",
)
