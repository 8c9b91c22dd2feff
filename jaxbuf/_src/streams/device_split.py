"""Each stream kind's split over devices: how `jaxbuf.sharded` lays out its state.

Shape key: N envs, R = C // N steps held per env, C capacity (steps over all
envs), D devices on the mesh axis, W = N / D * R ids per device, S sample
size.

Every stream kind splits the same way: envs in blocks of N / D. Device d
holds envs `[d N/D, (d+1) N/D)` whole: their rings, episode ends, window
counts and window tree, and the per-env bookkeeping each kind adds
(`BufferState.per_env_fields`). So nothing a kind reads for one sampled row
spans devices: a window, a transition and the frames of its stacks, an
episode piece, the steps a hindsight goal may come from. Global id `g` (the
unsharded buffer's `n * R + j`) is local id `g % W` of device `g // W`.

Each function here returns a kind's `kind.Split`: its functions on one
device's part, and how one exact sample over all devices is drawn from the
D local ones (what each device can sample, the id at a rank, the rows the
id's device sends, how they become the kind's sample). `sequence_split` is
the layout itself, for sequence and prioritized sequence replay; the others
start from it and change what is drawn and read:

* `frame_stack_split`: transitions, by the tree over transition ids,
  gathered with their stacks;
* `hindsight_split`: transitions, by the window tree; the device holding a
  transition draws its goal, and the rewards are recomputed on the joined
  rows;
* `episode_split`: pieces, by the tree over their first slots.

Item replay's split (capacity in blocks of C / D) is `ring.split_over_devices`.
A split places a kind's functions and reads its state through them, so this
module is above the kinds' modules and below the factories
(`factories.py`), which bind each kind's split into its `Kind`.
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxbuf._src.core import kind
from jaxbuf._src.core import random
from jaxbuf._src.core import sum_tree
from jaxbuf._src.core.base import ReplaySample
from jaxbuf._src.streams import episode
from jaxbuf._src.streams import frames
from jaxbuf._src.streams import hindsight
from jaxbuf._src.streams import sequence
from jaxbuf._src.streams import window_priorities
from jaxbuf._src.streams.episode import EpisodeSample
from jaxbuf._src.streams.hindsight import HindsightSample
from jaxbuf._src.streams.sequence import SequenceReplayState, SequenceSample


def _check_steps_to_split(
  state: SequenceReplayState,
  arguments: tuple,
  num_devices: int,
  *,
  init: Callable,
  add: Callable,
  num_envs: int,
  capacity: int,
) -> None:
  """Steps, mask and episode ends checked as the unsharded buffer checks
  them, with its messages and the global N."""
  del num_devices  # N divides by D: checked when the buffer was split.
  step_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[3:], x.dtype), state.storage)
  unsharded = jax.eval_shape(
    functools.partial(init, num_envs=num_envs, capacity=capacity), step_shapes
  )
  jax.eval_shape(add, unsharded, *jax.tree.map(_unplaced, arguments))


def _unplaced(leaf: Any) -> jax.ShapeDtypeStruct:
  """`leaf`'s shape and dtype with no sharding, to check as on one device."""
  aval = jax.typeof(jnp.asarray(leaf))
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def sequence_split(
  num_devices: int,
  *,
  num_envs: int,
  capacity: int,
  init: Callable,
  add: Callable,
  sample: Callable,
  update_priorities: Callable | None,
  clear: Callable,
  beta: Any,
  stratified: bool,
  sequence_length: int,
  period: int,
  within: bool,
) -> kind.Split:
  """Sequence replay split over D devices: envs in blocks of N / D.

  Device d holds envs `[d N/D, (d+1) N/D)` whole (their rings, episode ends
  and windows), so a window never spans devices; global window id `g` (the
  unsharded buffer's `n * R + j`) is local window `g % W` of device
  `g // W`, W = N / D * R.
  """
  if num_envs % num_devices:
    below = num_envs - num_envs % num_devices
    nearest = " or ".join(str(n) for n in (below, below + num_devices) if n)
    raise ValueError(
      f"sharded: num_envs {num_envs} does not divide by the {num_devices} "
      f"devices of the mesh axis (each device holds num_envs / "
      f"{num_devices} whole envs); nearest valid num_envs: {nearest}, "
      f"with capacity num_envs * {capacity // num_envs} to keep the steps "
      f"per env."
    )
  with_tree = update_priorities is not None or within
  return kind.Split(
    init=functools.partial(
      init, num_envs=num_envs // num_devices, capacity=capacity // num_devices
    ),
    add=add,
    add_arguments=kind.add_arguments_of(add),
    check_add=functools.partial(
      _check_steps_to_split, init=init, add=add, num_envs=num_envs, capacity=capacity
    ),
    sample=sample,
    update_priorities=update_priorities,
    clear=clear,
    local_counter=lambda state: state.write_heads,
    counter_shape=(num_envs // num_devices,),
    ids_per_device=lambda state: state.episode_ends.shape[-2] * state.episode_ends.shape[-1],
    held=lambda state: jnp.sum(state.window_counts, axis=-1, dtype=jnp.int32),
    # Sampling is with replacement: one window serves any batch size.
    enough=lambda held, batch_size: held > 0,
    masses=(lambda local: local.window_tree) if with_tree else None,
    at_rank=functools.partial(
      sequence.window_ids_at_ranks, sequence_length=sequence_length, period=period
    ),
    rows=lambda local, window_ids, key: sequence.gather_windows(
      local, window_ids, sequence_length=sequence_length
    ),
    item_ids=sequence.window_item_ids,
    # Nothing drawn: mask all False, as the unsharded buffers give.
    as_sample=lambda rows, indices, weights, item_ids, drawn: SequenceSample(
      items=rows[0], indices=indices, weights=weights, item_ids=item_ids, mask=rows[1] & drawn
    ),
    check_update=window_priorities.check_window_priorities,
    beta=beta,
    stratified=stratified,
    uniform_when_massless=False,
  )


def frame_stack_split(
  num_devices: int,
  *,
  num_envs: int,
  capacity: int,
  init: Callable,
  add: Callable,
  sample: Callable,
  update_priorities: Callable | None,
  gather: Callable,
  beta: Any,
  stratified: bool,
) -> kind.Split:
  """Frame-stack replay split over devices as sequence replay is (envs in
  blocks of N / D, a transition and its stacks never span devices), drawing
  by the transition tree; `gather(local, ids)` reads the transitions."""
  split = sequence_split(
    num_devices,
    num_envs=num_envs,
    capacity=capacity,
    init=init,
    add=add,
    sample=sample,
    update_priorities=update_priorities,
    clear=frames.clear,
    beta=beta,
    stratified=stratified,
    sequence_length=1,
    period=1,
    within=True,
  )

  def at_rank(local, ranks):
    # Unused while `masses` is set: the rank-th leaf of the 0/1 tree.
    return sum_tree.find_prefix_sums(local.window_tree, ranks.astype(jnp.float32) + 0.5)

  return split._replace(
    at_rank=at_rank,
    rows=lambda local, ids, key: gather(local, ids),
    item_ids=frames.transition_item_ids,
    as_sample=lambda rows, indices, weights, item_ids, drawn: ReplaySample(
      items=rows, indices=indices, weights=weights, item_ids=item_ids
    ),
  )


def hindsight_split(
  num_devices: int,
  *,
  num_envs: int,
  capacity: int,
  add: Callable,
  sample: Callable,
  update_priorities: Callable | None,
  beta: Any,
  stratified: bool,
  reward_fn: Callable,
  strategy: str,
  relabel_fraction: float,
  terminated_fn: Callable | None,
  gamma: Any,
) -> kind.Split:
  """Hindsight replay split over D devices as sequence replay is: envs in
  blocks of N / D, whole with their episode bookkeeping, so a transition and
  every step its goal may come from lie on one device.

  Transitions are drawn by the mass of each device's window tree (1 per
  transition, or its priority); the device holding a transition draws its
  goal step with the key `jaxbuf.sharded` gives to `rows`, and `as_sample`
  applies the goals and recomputes the rewards on the joined rows (each
  device on its own block of a sharded batch).
  """
  split = sequence_split(
    num_devices,
    num_envs=num_envs,
    capacity=capacity,
    init=hindsight.init,
    add=add,
    sample=sample,
    update_priorities=update_priorities,
    clear=hindsight.clear,
    beta=beta,
    stratified=stratified,
    **hindsight.TRANSITION_WINDOWS,
  )

  def rows(local, window_ids, key):
    words = random.computed_once(
      lambda: random.random_bits(key, (3, window_ids.shape[0])), window_ids[0]
    )
    return hindsight.gather_steps(
      local, window_ids, words, strategy=strategy, relabel_fraction=relabel_fraction
    )

  def as_sample(steps, indices, weights, item_ids, drawn):
    del drawn  # Nothing drawn: transition 0, weight 0, as unsharded.
    return HindsightSample(
      items=hindsight.relabelled_transitions(
        steps, reward_fn=reward_fn, terminated_fn=terminated_fn, gamma=gamma
      ),
      indices=indices,
      weights=weights,
      item_ids=item_ids,
      relabelled=steps.relabelled,
    )

  return split._replace(rows=rows, as_sample=as_sample)


def episode_split(
  num_devices: int,
  *,
  num_envs: int,
  capacity: int,
  add: Callable,
  sample: Callable,
  max_episode_length: int,
) -> kind.Split:
  """Episode replay split over D devices as sequence replay is: envs in
  blocks of N / D, whole, so a piece never spans devices; pieces are drawn
  by the mass of each device's tree (1 or the length per piece)."""
  split = sequence_split(
    num_devices,
    num_envs=num_envs,
    capacity=capacity,
    init=episode.init,
    add=add,
    sample=sample,
    update_priorities=None,
    clear=episode.clear,
    beta=None,
    stratified=False,
    **episode.STEP_WINDOWS,
  )
  return split._replace(
    # Positive exactly when a piece is held (the tree's total: pieces, or
    # their steps with weight_by_length); only its sign is read.
    held=lambda state: jnp.ceil(state.window_tree.levels[-1][..., 0]).astype(jnp.int32),
    masses=lambda local: local.window_tree,
    rows=lambda local, ids, key: episode.gather_pieces(
      local, ids, max_episode_length=max_episode_length
    ),
    # gather_pieces already gives an all-False mask and length 0 when
    # nothing is held, as the unsharded sample does.
    as_sample=lambda rows, indices, weights, item_ids, drawn: EpisodeSample(
      items=rows[0],
      indices=indices,
      weights=weights,
      item_ids=item_ids,
      mask=rows[1],
      lengths=rows[2],
      continues=rows[3],
    ),
  )
