"""Each step's position in its episode, saturated: what a stream kind
records to know where its episodes start, after the ring wrapped too.

Shape key: N envs, R steps held per env, T steps per env in one add.

Frame-stack replay records positions saturated at K - 1 (the frames a stack
may read); episode replay at 1 (whether a step starts its episode). Both
tell `held_episodes` that a ring which wrapped exactly at an episode's
start still holds that episode whole (`oldest_held_is_first`), the one rule
their `oldest_held_starts_an_episode` adds to sequence replay's.
"""

import jax
import jax.numpy as jnp

from jaxbuf._src.streams.sequence import SequenceReplayState


def episode_positions_of(
  next_positions: jax.Array, episode_end: jax.Array, *, saturate_at: int
) -> tuple[jax.Array, jax.Array]:
  """Each chunk step's position in its episode, saturated at `saturate_at`.

  Args:
    next_positions: int32 `[N]`, the position the chunk's first step has.
    episode_end: bool `[N, T]`.
    saturate_at: the largest position recorded.

  Returns:
    int32 `[N, T]` positions and int32 `[N]` the position of the step after
    the chunk.
  """
  length = episode_end.shape[1]
  index = jnp.arange(length, dtype=jnp.int32)[None, :]
  # Step i starts an episode when step i - 1 ended one.
  starts = jnp.concatenate([jnp.zeros_like(episode_end[:, :1]), episode_end[:, :-1]], axis=1)
  last_start = jax.lax.cummax(jnp.where(starts, index, -1), axis=1)
  positions = jnp.where(last_start >= 0, index - last_start, next_positions[:, None] + index)
  positions = jnp.minimum(positions, saturate_at)
  after = jnp.where(episode_end[:, -1], 0, jnp.minimum(positions[:, -1] + 1, saturate_at))
  return positions, after


def oldest_held_is_first(state: SequenceReplayState, episode_positions: jax.Array) -> jax.Array:
  """bool `[N]`: each env's oldest held step is at position 0 of its
  episode (`episode_positions` `[N, R]`), and a step is held."""
  oldest = jnp.take_along_axis(episode_positions, state.oldest_held_slots()[:, None], axis=1)
  return (oldest[:, 0] == 0) & (state.steps_held > 0)
