"""Episode replay: whole episodes, padded to `max_episode_length`, with a mask.

Shape key: N envs, R = C // N steps held per env, C capacity (steps over all
envs), T steps per env in one add, M max_episode_length, S sample size.

Storage. The steps are sequence replay's per-env streams (`sequence.py`); an
episode is the steps from its first to the one flagged as its end (the
step's `last` leaf, or `add(..., episode_end=...)`), inclusive (with the
stream convention, `help(jaxbuf.streams)`, the step holding the final
observation, added as `add(..., final_steps=...)`).

Long episodes are split, never refused: a piece ends at an episode end or
after M steps, whichever comes first, and the next step starts a new piece.
An episode of 2M + 1 steps is sampled as pieces of M, M and 1 steps; every
piece but the last has `continues` True. (A value-dependent error would exist
only in checked mode; a split is defined in every mode.)

Only complete pieces are sampled, and only while their first step is held:
overwriting starts from the oldest step, so a piece whose first step is held
is held whole, and a piece partly overwritten is never returned. The window
tree has one leaf per slot: at a piece's first slot, 1 (uniform over
pieces) or its length (`weight_by_length`: uniform over steps, the piece of
a drawn step); 0 everywhere else. A piece's leaf is set by the add that
writes its last step and drops to 0 in the add that overwrites its first.

A sample gathers S * M steps; padding steps (past a piece's length) are
zeros, never steps of another episode.

Devices. `jaxbuf.sharded` splits the envs over devices in blocks of N / D,
each env whole, so a piece never spans devices (`device_split.episode_split`).

The module-level functions take every setting explicitly; `episode_replay`
(`factories.py`) binds them into a `Buffer`.
"""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxbuf._src.streams import episode_starts
from jaxbuf._src.streams import sequence
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core import validation
from jaxbuf._src.core.base import PyTree, ReplaySample
from jaxbuf._src.streams.sequence import SequenceReplayState


@flax.struct.dataclass
class EpisodeSample(ReplaySample):
  """A batch of whole episodes (pieces), padded to M steps.

  A row is a piece: `indices` the slot id `env * R + slot` of its first
  step, `item_ids` that step's id. `mask` means what it means in
  `SequenceSample`: True on the steps of the episode the row was drawn
  for, False on padding a per-step loss must not read.
  """

  mask: jax.Array  # bool [S, M]: True on the piece's steps
  lengths: jax.Array  # int32 [S]: steps in each piece, in [1, M]
  continues: jax.Array  # bool [S]: the episode went on after the piece
  # (it was split at M steps)


@flax.struct.dataclass
class EpisodeReplayState(SequenceReplayState):
  """Per-env streams of steps cut into pieces. Arrays only.

  Windows are single steps: `window_counts` counts the steps held.
  """

  window_tree: sum_tree.SumTree  # leaves [N * R]: 1 or the length at each
  # complete piece's first slot
  piece_lengths: jax.Array  # int32 [N, R]: at a complete piece's first
  # slot, its length
  piece_positions: jax.Array  # int32 [N]: where each env's next step falls
  # in its piece, < M
  episode_positions: jax.Array  # uint8 [N, R]: each step's index in its
  # episode, saturated at 1 (0: the step starts its episode)
  next_positions: jax.Array  # int32 [N]: the index the next step of each
  # env will have, saturated at 1

  def per_env_fields(self) -> tuple[str, ...]:
    return super().per_env_fields() + (
      "piece_lengths",
      "piece_positions",
      "episode_positions",
      "next_positions",
    )

  def oldest_held_starts_an_episode(self) -> jax.Array:
    """Also where the ring wrapped at an episode's start: the oldest held
    step's position in its episode is 0 (as in frame-stack replay)."""
    return super().oldest_held_starts_an_episode() | episode_starts.oldest_held_is_first(
      self, self.episode_positions
    )


# Each step is a window of one, so `add_steps` zeroes the leaf of every slot
# it writes (the pieces starting there are overwritten).
STEP_WINDOWS: dict[str, Any] = dict(sequence_length=1, period=1, within=False)


def check_sizes(num_envs: int, capacity: int, max_episode_length: int) -> None:
  """Raises naming the setting."""
  validation.check_positive_int(num_envs, "num_envs")
  validation.check_capacity(capacity)
  validation.check_positive_int(max_episode_length, "max_episode_length")
  sequence.check_sizes(num_envs, capacity, 1, 1)
  if max_episode_length > capacity // num_envs:
    raise ValueError(
      f"max_episode_length {max_episode_length} exceeds the steps held per "
      f"env, capacity // num_envs = {capacity // num_envs}; use capacity "
      f">= {max_episode_length * num_envs} (several episodes' worth, to "
      "sample from more than the newest)."
    )


def init(example_step: PyTree, *, num_envs: int, capacity: int) -> EpisodeReplayState:
  """An empty buffer for steps shaped like `example_step` (one env, unbatched)."""
  base = sequence.init(example_step, num_envs=num_envs, capacity=capacity, with_tree=True)
  return EpisodeReplayState(
    **{name: getattr(base, name) for name in base.__dataclass_fields__},
    piece_lengths=jnp.zeros((num_envs, capacity // num_envs), jnp.int32),
    piece_positions=jnp.zeros((num_envs,), jnp.int32),
    episode_positions=jnp.zeros((num_envs, capacity // num_envs), jnp.uint8),
    next_positions=jnp.zeros((num_envs,), jnp.int32),
  )


def add(
  state: EpisodeReplayState,
  steps: PyTree,
  mask: jax.Array | None = None,
  episode_end: jax.Array | None = None,
  final_steps: PyTree | None = None,
  *,
  max_episode_length: int,
  weight_by_length: bool,
) -> EpisodeReplayState:
  """Adds one step per env (`[N, ...]`) or a chunk (`[N, T, ...]`), and the
  final observations of the envs whose episode ended (`final_steps`).

  The same add as `jaxbuf.sequence.add` (one code path,
  `sequence.add_stream`); steps follow the stream convention,
  `help(jaxbuf.streams)`.

  Args:
    state: the buffer.
    steps: leaves `[N, *step_shape]` or `[N, T, *step_shape]`, checked while
      tracing as for `sequence.add`.
    mask: bool `[N]`, the envs that stepped (the others write nothing,
      final steps included); None for all.
    episode_end: for steps without a `last` leaf (which marks the ends
      itself, as in `help(jaxbuf.streams)`). Without `final_steps`: bool
      `[N]` for one step per env, `[N, T]` for a chunk, True on an
      episode's last step. With `final_steps`: bool `[N]`, the envs whose
      episode ended after their last step in `steps`. None for none.
    final_steps: steps like `steps`, one per env `[N, ...]`: each env whose
      episode ended (its final step's `last`, else `episode_end`) writes its
      final step after its steps, as its episode's last step; the same
      state, byte for byte, as a second add of them masked to those envs.
      None for none.
    max_episode_length, weight_by_length: the buffer's settings.
  """
  validation.check_state_kind(state, EpisodeReplayState, what="add", exact=True)
  return sequence.add_stream(
    state,
    steps,
    mask,
    episode_end,
    final_steps,
    write=functools.partial(
      write_steps, max_episode_length=max_episode_length, weight_by_length=weight_by_length
    ),
  )


def write_steps(
  state: EpisodeReplayState,
  steps: PyTree,
  mask: jax.Array | None,
  episode_end: jax.Array | None,
  *,
  max_episode_length: int,
  weight_by_length: bool,
) -> EpisodeReplayState:
  """Writes steps (`[N, ...]` or `[N, T, ...]`, T >= 1, episode ends
  resolved) and the pieces they complete."""
  steps, mask, episode_end = sequence.chunked_add_args(state, steps, mask, episode_end)
  starts, after = episode_starts.episode_positions_of(
    state.next_positions, episode_end, saturate_at=1
  )
  written = sequence.add_steps(
    state,
    steps,
    mask,
    episode_end,
    **STEP_WINDOWS,
    new_leaf_value=jnp.float32(0.0),
    episode_positions=starts.astype(jnp.uint8),
  )
  num_envs, per_env = sequence.num_envs_of(state), sequence.steps_per_env(state)
  length = episode_end.shape[1]
  chunk = sequence.chunk_slots(state, length, mask)
  kept, dropped, slots = chunk.kept, chunk.dropped, chunk.slots
  offsets = jnp.arange(length, dtype=jnp.int32)[None, :]
  # Positions count from the latest episode start, modulo M: the splits.
  starts = jnp.concatenate([jnp.zeros((num_envs, 1), bool), episode_end[:, :-1]], axis=1)
  latest_start = jax.lax.cummax(jnp.where(starts, offsets, -1), axis=1)
  positions = (
    jnp.where(latest_start >= 0, offsets - latest_start, state.piece_positions[:, None] + offsets)
    % max_episode_length
  )
  piece_ends = episode_end | (positions == max_episode_length - 1)
  positions, piece_ends = positions[:, dropped:], piece_ends[:, dropped:]
  first_slots = (slots - positions) % per_env
  # A piece ended early in a chunk may have lost its first step to a later
  # step of the same chunk.
  first_ago = kept - 1 - jnp.arange(kept, dtype=jnp.int32)[None, :] + positions
  complete = mask[:, None] & piece_ends & (first_ago < written.steps_held[:, None])
  envs = jnp.arange(num_envs, dtype=jnp.int32)[:, None]
  lengths = positions + 1
  leaves = lengths.astype(jnp.float32) if weight_by_length else jnp.ones(lengths.shape, jnp.float32)
  rows = jnp.where(complete, envs, num_envs)
  return written.replace(
    window_tree=sum_tree.set_leaves(
      written.window_tree,
      (envs * per_env + first_slots).reshape(-1),
      leaves.reshape(-1),
      complete.reshape(-1),
      unique_indices=True,
    ),
    piece_lengths=state.piece_lengths.at[rows, first_slots].set(
      lengths, mode="drop", unique_indices=True
    ),
    piece_positions=jnp.where(
      mask,
      jnp.where(episode_end[:, -1], 0, (positions[:, -1] + 1) % max_episode_length),
      state.piece_positions,
    ),
    next_positions=jnp.where(mask, after, state.next_positions),
  )


def sample(
  state: EpisodeReplayState,
  key: jax.Array,
  batch_size: int,
  *,
  max_episode_length: int,
  checked: bool = False,
) -> EpisodeSample:
  """Draws `batch_size` complete pieces, with replacement.

  Uniformly over the pieces held, or in proportion to their lengths
  (`weight_by_length`). With none held it returns slot 0 with length 0, an
  all-False mask and weight 0; checked mode raises instead.

  Returns:
    An `EpisodeSample`: items `[S, M, ...]` (the piece from index 0, zeros
    after it), indices int32 `[S]` (the slot id `n * R + j` of each piece's
    first step), weights float32 `[S]` (1, or 0 when empty), item_ids uint32
    `[S]` (the first step's id), mask bool `[S, M]`, lengths int32 `[S]`,
    continues bool `[S]`.
  """
  validation.check_state_kind(state, EpisodeReplayState, what="sample", exact=True)
  validation.check_key(key, what="sample")
  validation.check_batch_size(batch_size, what="sample")
  has_pieces = sum_tree.total(state.window_tree) > 0
  if checked:
    checkify.check(
      has_pieces,
      "sample: the buffer holds no complete "
      "episode; add steps up to an episode end (or "
      "max_episode_length steps) first (guard with can_sample).",
    )
  found, _ = sum_tree.sample_leaves(state.window_tree, key, batch_size, stratified=False)
  first_ids = jnp.where(has_pieces, found, 0)
  items, mask, lengths, continues = gather_pieces(
    state, first_ids, max_episode_length=max_episode_length
  )
  return EpisodeSample(
    items=items,
    indices=first_ids,
    weights=jnp.full((batch_size,), has_pieces, jnp.float32),
    item_ids=sequence.window_item_ids(state, first_ids),
    mask=mask,
    lengths=lengths,
    continues=continues,
  )


def gather_pieces(
  state: EpisodeReplayState, first_ids: jax.Array, *, max_episode_length: int
) -> tuple[PyTree, jax.Array, jax.Array, jax.Array]:
  """The pieces starting at slot ids `[S]`: items `[S, M, ...]` zero-padded,
  mask bool `[S, M]`, lengths int32 `[S]` (0 when the buffer holds none),
  continues bool `[S]`."""
  has_pieces = sum_tree.total(state.window_tree) > 0
  items, _ = sequence.gather_windows(state, first_ids, sequence_length=max_episode_length)
  per_env = sequence.steps_per_env(state)
  envs, slots = first_ids // per_env, first_ids % per_env
  lengths = jnp.where(has_pieces, state.piece_lengths[envs, slots], 0)
  mask = jnp.arange(max_episode_length, dtype=jnp.int32)[None, :] < lengths[:, None]
  padded = lambda leaf: jnp.where(
    mask.reshape(mask.shape + (1,) * (leaf.ndim - 2)), leaf, jnp.zeros((), leaf.dtype)
  )
  ended = state.episode_ends[envs, (slots + jnp.maximum(lengths, 1) - 1) % per_env]
  return (jax.tree.map(padded, items), mask, lengths, has_pieces & ~ended)


def update_priorities(
  state: EpisodeReplayState,
  indices: jax.Array,
  priorities: jax.Array,
  item_ids: jax.Array | None = None,
) -> EpisodeReplayState:
  """The identity: episode replay keeps no priorities (arguments validated)."""
  validation.check_state_kind(state, EpisodeReplayState, what="update_priorities", exact=True)
  validation.check_priority_update_args(indices, priorities, item_ids)
  return state


def can_sample(state: EpisodeReplayState, batch_size: int) -> jax.Array:
  """Whether `sample(state, key, batch_size)` draws only held pieces: bool
  `()`, true once one complete piece is held (sampling is with
  replacement, so one piece serves any `batch_size`; `batch_size` is
  checked all the same). Not a warm-up: wait for data with
  `state.steps_held.sum() >= min_steps`."""
  validation.check_batch_size(batch_size, what="can_sample")
  return sum_tree.total(state.window_tree) > 0


def clear(state: EpisodeReplayState) -> EpisodeReplayState:
  """Empties the buffer; the next step added starts a piece."""
  validation.check_state_kind(state, EpisodeReplayState, what="clear", exact=True)
  return sequence.clear(state).replace(
    piece_positions=jnp.zeros_like(state.piece_positions),
    next_positions=jnp.zeros_like(state.next_positions),
  )
