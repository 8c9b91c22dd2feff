"""Pairs of consecutive steps read from windows of two: flashbax's flat buffer,
each observation stored once.

Shape key: S windows (the sample size).

flashbax's flat buffer (`fbx.make_flat_buffer`, PureJaxRL's and Stoix's DQN)
is a trajectory buffer of windows of two steps: it stores each env's steps
once, and `sample(...).experience` pairs step t of an env (`first`) with its
step t + 1 (`second`), so a transition's next observation is `second.obs`,
never a second copy. `jaxbuf.sequence_replay(num_envs, capacity,
sequence_length=2)` holds the same windows, and `step_pairs` hands them out
as the same pair: the same steps added give the same transitions
(tests/test_flat_pairs.py runs both side by side).

The newest step of each env starts no pair until its successor is added (a
window needs both of its steps held), in flashbax and here alike: its own
transition waits one add; the step is held, and is already the `second` of
the pair before it.

Episode ends. flashbax keeps a `done` leaf in each step and pairs across
episode ends (`first.done` True, `second` the next episode's first step).
Here that flag can live in the buffer's own episode flags instead, passed as
`add(state, step, episode_end=done)`: a window whose first step ends an
episode is still sampled (`episodes="cross"`, the default), and
`StepPair.same_episode` says False for it, so the loss reads
`same_episode` where it read `1 - done`, and each step holds exactly the
bytes it holds in flashbax (the step without `done`, and one bool flag).
Keeping `done` in the step works too, one byte more per step.

Under `episodes="within"` windows never cross an episode end, so the pair
that ends each episode is never drawn: keep the default. Streams that
follow jaxbuf's own convention (a final step holding the true final
observation, flagged `last`: `help(jaxbuf.streams)`) read transitions with
`jaxbuf.n_step_transitions(..., n=1)` instead, which bootstraps a truncated
episode from that final observation.
"""

from typing import NamedTuple

import jax
import numpy as np

from jaxbuf._src.core.base import PyTree
from jaxbuf._src.streams.sequence import SequenceSample


class StepPair(NamedTuple):
  """Two consecutive steps of one env, as flashbax's `ExperiencePair`.

  The transition of `first` is `first.obs -> second.obs` with `first`'s
  action and reward; bootstrap it by `same_episode`:
  `target = first.reward + gamma * same_episode * max_a Q(second.obs, a)`.
  """

  first: PyTree  # leaves [S, ...]: step t of an env's stream
  second: PyTree  # leaves [S, ...]: step t + 1 of the same env
  same_episode: jax.Array  # bool [S]: no episode end flagged at `first`, so
  # `second` continues its episode; False for every row of a sample drawn
  # while no window was held (its weights are 0 too)


def step_pairs(windows: SequenceSample) -> StepPair:
  """flashbax's `sample(...).experience` (`first`, `second`) from windows of two.

  Args:
    windows: a sample of `sequence_replay` or `prioritized_sequence_replay`
      made with `sequence_length=2`: `items` leaves `[S, 2, ...]`, `mask`
      bool `[S, 2]`. Its `weights`, `indices` and `item_ids` stay on it
      (importance weights, `update_priorities`).

  Returns:
    A `StepPair` of `[S, ...]` leaves: `first` the window's first step,
    `second` the one after it, `same_episode` False where an episode end
    was flagged at `first` (`add(..., episode_end=...)`, or the step's own
    `last` leaf).

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.sequence_replay(num_envs=2, capacity=16, sequence_length=2)
  >>> state = buffer.init({"obs": jnp.float32(0), "reward": jnp.float32(0)})
  >>> for t in range(4):  # env 1 observes 10 + t; its episode ends at t = 1
  ...   state = buffer.add(state, {"obs": jnp.array([t, 10 + t], jnp.float32),
  ...                              "reward": jnp.ones(2, jnp.float32)},
  ...                      episode_end=jnp.array([False, t == 1]))
  >>> pairs = jaxbuf.step_pairs(buffer.sample(state, jax.random.key(0), 64))
  >>> bool(jnp.all(pairs.second["obs"] == pairs.first["obs"] + 1))
  True
  >>> bool(jnp.all(pairs.same_episode == (pairs.first["obs"] != 11)))
  True
  """
  what = "step_pairs"
  if not isinstance(windows, SequenceSample):
    raise TypeError(
      f"{what}: windows must be the sample of a sequence kind "
      "(jaxbuf.sequence_replay or prioritized_sequence_replay with "
      f"sequence_length=2), given {type(windows).__name__}; pass the whole "
      "sample, not its items, so the pair can read its episode mask."
    )
  leaves = jax.tree_util.tree_flatten_with_path(windows.items)[0]
  if not leaves:
    raise ValueError(f"{what}: the windows' items have no leaves.")
  num_windows = np.shape(windows.mask)[0]
  for path, leaf in leaves:
    if tuple(np.shape(leaf))[:2] != (num_windows, 2):
      raise ValueError(
        f"{what}: leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
        f"{tuple(np.shape(leaf))}, expected windows of two steps "
        f"({num_windows}, 2, ...); make the buffer with sequence_length=2 "
        "(flashbax's flat buffer pairs two consecutive steps), or read "
        "longer windows with jaxbuf.n_step_transitions."
      )
  return StepPair(
    first=jax.tree.map(lambda leaf: leaf[:, 0], windows.items),
    second=jax.tree.map(lambda leaf: leaf[:, 1], windows.items),
    same_episode=windows.mask[:, 1],
  )
