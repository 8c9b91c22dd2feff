"""The stream kinds as users make them: one factory per kind.

Why one module of this size: each factory does the same three things for its
kind, and only these: it checks the settings (raising before any state
exists), binds its kind's module functions with them into a `Buffer`, and
describes the kind (`kind.Kind`: the settings a state records, its split
over devices). A kind's split reads its functions (`device_split.py`), and
its factory binds the split, so the factories sit above both and cannot
live beside their kinds' functions without an import cycle. Most of the
length is the factories' docstrings: each kind's user documentation, with
a doctest.

The kinds: `sequence_replay` and `prioritized_sequence_replay` (windows,
`sequence.py`, `prioritized_sequence.py`), `episode_replay` (whole
episodes, `episode.py`), `frame_stack_replay` and
`prioritized_frame_stack_replay` (stacked transitions, `frames.py`),
`hindsight_replay` (relabelled goals, `hindsight.py`). Steps follow the
stream convention, `help(jaxbuf.streams)`.
"""

import functools
from typing import Any, Callable

from jaxbuf._src.core import kind
from jaxbuf._src.core import validation
from jaxbuf._src.streams import device_split
from jaxbuf._src.streams import episode
from jaxbuf._src.streams import frames
from jaxbuf._src.streams import hindsight
from jaxbuf._src.streams import prioritized_sequence
from jaxbuf._src.streams import sequence
from jaxbuf._src.core.base import Buffer, ReplaySample, Schedule, bind
from jaxbuf._src.storage import placed
from jaxbuf._src.storage import tiers
from jaxbuf._src.streams.episode import EpisodeReplayState, EpisodeSample
from jaxbuf._src.streams.frames import FrameStackReplayState
from jaxbuf._src.streams.hindsight import HindsightReplayState, HindsightSample
from jaxbuf._src.streams.prioritized_sequence import PrioritizedSequenceReplayState
from jaxbuf._src.streams.sequence import SequenceReplayState, SequenceSample


def window_settings(
  num_envs: int, capacity: int, sequence_length: int, period: int, episodes: str, **more: Any
) -> kind.Settings:
  """The settings a sequence state's window bookkeeping depends on."""
  return kind.settings_of(
    num_envs=num_envs,
    capacity=capacity,
    sequence_length=sequence_length,
    period=period,
    episodes=episodes,
    **more,
  )


def sequence_replay(
  num_envs: int,
  capacity: int,
  sequence_length: int,
  *,
  period: int = 1,
  episodes: str = "cross",
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[SequenceReplayState, SequenceSample]:
  """A uniform replay buffer of per-env streams, sampled as windows.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs: N, the number of streams.
    capacity: C, steps held over all envs; a multiple of N (each env holds
      R = C // N steps), else `ValueError` naming the nearest valid values.
    sequence_length: L <= R, the steps in a window.
    period: window starts fall on step ids (per env, from 0) that are
      multiples of `period`; 1 allows every start.
    episodes: "cross" (windows may span episode ends; `sample(...).mask`
      marks the first episode's steps) or "within" (never sampled across an
      end). Episode ends come from one flag: the step's own bool `last`
      leaf when it has one, else `add(..., episode_end=...)`.
    checked: as for `uniform_replay`.
    storage: where the payload leaves live: "device" (the default), "host"
      (pinned host memory) or `jaxbuf.disk(directory)` (files); bookkeeping
      stays on the device. See docs/guides/storage.md.

  The stream for n-step and recurrent agents (`jaxbuf.n_step_transitions`):
  step i holds `obs[i]`, the action taken there, the reward that followed
  and `terminated[i]` (that action truly ended the episode); an episode that
  ended (terminated or truncated) gets one more step holding its final
  observation, flagged `last`, its other fields padding. Add it in the same
  call as `final_steps`; each env writes its final step exactly where that
  step's `last` is True::

      state = buffer.add(state, Step(obs, action, reward, terminated,
                                     last=no_env),
                         final_steps=Step(final_obs, action, reward,
                                          no_env, last=ended))

  Returns:
    A `Buffer`; `add(state, steps, mask=None, episode_end=None,
    final_steps=None)` (see `jaxbuf.sequence.add`), `sample` returns a
    `SequenceSample` (a `ReplaySample` with `mask`, all False when no
    window was held).

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.sequence_replay(num_envs=2, capacity=16,
  ...                                 sequence_length=3)
  >>> state = buffer.init({"obs": jnp.zeros(4), "step": jnp.int32(0)})
  >>> for t in range(5):
  ...   state = buffer.add(state, {"obs": jnp.ones((2, 4)),
  ...                              "step": jnp.full(2, t, jnp.int32)})
  >>> batch = buffer.sample(state, jax.random.key(0), 8)
  >>> batch.items["obs"].shape
  (8, 3, 4)
  >>> bool(jnp.all(jnp.diff(batch.items["step"], axis=1) == 1))
  True
  """
  sequence.check_sizes(num_envs, capacity, sequence_length, period, episodes)
  settings: dict[str, Any] = dict(
    sequence_length=sequence_length, period=period, within=episodes == "within"
  )
  bound_init = functools.partial(sequence.init, with_tree=episodes == "within")
  bound_add = functools.partial(sequence.add, **settings)
  split = functools.partial(
    device_split.sequence_split,
    num_envs=num_envs,
    capacity=capacity,
    init=bound_init,
    add=bound_add,
    sample=functools.partial(sequence.sample, **settings),
    update_priorities=None,
    clear=sequence.clear,
    beta=None,
    stratified=False,
    **settings,
  )
  buffer = bind(
    init=functools.partial(bound_init, num_envs=num_envs, capacity=capacity),
    add=bound_add,
    sample=functools.partial(sequence.sample, **settings, checked=checked),
    update_priorities=functools.partial(sequence.update_priorities, **settings, checked=checked),
    can_sample=sequence.can_sample,
    clear=sequence.clear,
    kind=kind.Kind(
      name="sequence_replay",
      state_type=SequenceReplayState,
      exact_type=True,
      settings=window_settings(num_envs, capacity, sequence_length, period, episodes),
      split=split,
    ),
    checked=checked,
    jit_update_priorities=False,
    check_host_add=sequence.check_one_final_step,
  )
  return placed.place(buffer, storage, kind_name="sequence_replay", layout=tiers.SEQUENCES)


def prioritized_sequence_replay(
  num_envs: int,
  capacity: int,
  sequence_length: int,
  *,
  period: int = 1,
  alpha: float = 0.6,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  episodes: str = "cross",
  stratified: bool = True,
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[PrioritizedSequenceReplayState, SequenceSample]:
  """A prioritized replay buffer of per-env streams, sampled as windows.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs, capacity, sequence_length, period, episodes: as for
      `sequence_replay`, which also describes the stream: the step's `last`
      leaf marks episode ends (the step holding an episode's final
      observation, added as `add(..., final_steps=...)`; `terminated` sits
      on the step whose action ended the episode).
    alpha, beta, eps, stratified: as for `prioritized_replay`; N in the
      importance weights is the number of windows that can be sampled.
    checked: as for `uniform_replay`.
    storage: where the payload leaves live: "device" (the default), "host"
      (pinned host memory) or `jaxbuf.disk(directory)` (files); bookkeeping
      stays on the device. See docs/guides/storage.md.

  Returns:
    A `Buffer` with the same functions as `sequence_replay`'s; pass
    `sample.indices` and `sample.item_ids` to `update_priorities`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.prioritized_sequence_replay(
  ...     num_envs=2, capacity=16, sequence_length=3, period=2)
  >>> state = buffer.init({"obs": jnp.zeros(4)})
  >>> state = buffer.add(state, {"obs": jnp.ones((2, 6, 4))})  # a chunk of 6
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> state = buffer.update_priorities(state, batch.indices,
  ...                                  jnp.array([0.1, 2.0, 0.5, 1.0]),
  ...                                  batch.item_ids)
  >>> batch.items["obs"].shape, float(batch.weights.max())
  ((4, 3, 4), 1.0)
  """
  sequence.check_sizes(num_envs, capacity, sequence_length, period, episodes)
  validation.check_bool(stratified, "stratified", what="prioritized_sequence_replay")
  validation.check_hyperparameter(alpha, "alpha")
  validation.check_hyperparameter(eps, "eps", positive=True)
  if not callable(beta):
    validation.check_hyperparameter(beta, "beta")
  settings: dict[str, Any] = dict(
    sequence_length=sequence_length, period=period, within=episodes == "within"
  )
  bound_add = functools.partial(prioritized_sequence.add, **settings, alpha=alpha)
  split = functools.partial(
    device_split.sequence_split,
    num_envs=num_envs,
    capacity=capacity,
    init=prioritized_sequence.init,
    add=bound_add,
    sample=functools.partial(
      prioritized_sequence.sample, sequence_length=sequence_length, beta=beta, stratified=stratified
    ),
    update_priorities=functools.partial(
      prioritized_sequence.update_priorities, **settings, alpha=alpha, eps=eps
    ),
    clear=prioritized_sequence.clear,
    beta=beta,
    stratified=stratified,
    **settings,
  )
  buffer = bind(
    init=functools.partial(prioritized_sequence.init, num_envs=num_envs, capacity=capacity),
    add=bound_add,
    sample=functools.partial(
      prioritized_sequence.sample,
      sequence_length=sequence_length,
      beta=beta,
      stratified=stratified,
      checked=checked,
    ),
    update_priorities=functools.partial(
      prioritized_sequence.update_priorities, **settings, alpha=alpha, eps=eps, checked=checked
    ),
    can_sample=sequence.can_sample,
    clear=prioritized_sequence.clear,
    kind=kind.Kind(
      name="prioritized_sequence_replay",
      state_type=PrioritizedSequenceReplayState,
      exact_type=True,
      settings=window_settings(
        num_envs, capacity, sequence_length, period, episodes, alpha=float(alpha), eps=float(eps)
      ),
      split=split,
    ),
    checked=checked,
    check_host_add=sequence.check_one_final_step,
  )
  return placed.place(
    buffer, storage, kind_name="prioritized_sequence_replay", layout=tiers.SEQUENCES
  )


def episode_replay(
  num_envs: int,
  capacity: int,
  max_episode_length: int,
  *,
  weight_by_length: bool = False,
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[EpisodeReplayState, EpisodeSample]:
  """A replay buffer of whole episodes, padded to `max_episode_length`.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs: N, the number of streams.
    capacity: C, steps held over all envs; a multiple of N with
      M <= C // N.
    max_episode_length: M; longer episodes are split into pieces of M steps
      (see the module docstring).
    weight_by_length: draw pieces in proportion to their lengths rather
      than uniformly.
    checked: as for `uniform_replay`.
    storage: "device" only; the kinds that take other tiers are named in
      the error.

  Returns:
    A `Buffer`; `add(state, steps, mask=None, episode_end=None,
    final_steps=None)` (see `jaxbuf.episode.add`), `sample` returns an
    `EpisodeSample`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.episode_replay(num_envs=1, capacity=16,
  ...                                max_episode_length=4)
  >>> state = buffer.init({"reward": jnp.float32(0)})
  >>> state = buffer.add(state, {"reward": jnp.ones((1, 6), jnp.float32)},
  ...                    episode_end=jnp.array([[0, 0, 1, 0, 0, 1]], bool))
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> batch.items["reward"].shape, batch.lengths.tolist()
  ((4, 4), [3, 3, 3, 3])
  >>> batch.mask[0].tolist()
  [True, True, True, False]
  """
  tiers.resolve(storage, "episode_replay")
  episode.check_sizes(num_envs, capacity, max_episode_length)
  validation.check_bool(weight_by_length, "weight_by_length", what="episode_replay")
  bound_add = functools.partial(
    episode.add, max_episode_length=max_episode_length, weight_by_length=weight_by_length
  )
  bound_sample = functools.partial(episode.sample, max_episode_length=max_episode_length)
  return bind(
    init=functools.partial(episode.init, num_envs=num_envs, capacity=capacity),
    add=bound_add,
    sample=functools.partial(bound_sample, checked=checked),
    update_priorities=episode.update_priorities,
    can_sample=episode.can_sample,
    clear=episode.clear,
    kind=kind.Kind(
      name="episode_replay",
      state_type=EpisodeReplayState,
      exact_type=True,
      settings=kind.settings_of(
        num_envs=num_envs,
        capacity=capacity,
        max_episode_length=max_episode_length,
        weight_by_length=weight_by_length,
      ),
      split=functools.partial(
        device_split.episode_split,
        num_envs=num_envs,
        capacity=capacity,
        add=bound_add,
        sample=bound_sample,
        max_episode_length=max_episode_length,
      ),
    ),
    checked=checked,
    jit_update_priorities=False,
    check_host_add=sequence.check_one_final_step,
  )


def _frame_settings(
  num_envs: int, capacity: int, num_stack: int, n_step: int, **more: Any
) -> kind.Settings:
  """The settings a frame-stack state's transition bookkeeping depends on."""
  return kind.settings_of(
    num_envs=num_envs, capacity=capacity, num_stack=num_stack, n_step=n_step, **more
  )


def _frame_stack_factory(
  name: str,
  num_envs: int,
  capacity: int,
  num_stack: int,
  *,
  n_step: int,
  gamma: Any,
  stack_keys: Any,
  stack_axis: int,
  pad: str,
  checked: bool,
  priorities: dict | None,
  storage: Any,
) -> Buffer:
  """Both frame-stack factories: `priorities` None binds the uniform
  functions, a dict of alpha, beta, eps and stratified the prioritized ones."""
  frames.check_settings(num_envs, capacity, num_stack, n_step, gamma, pad, stack_axis, stack_keys)
  stack_keys = None if stack_keys is None else tuple(stack_keys)
  layout = dict(
    num_stack=num_stack,
    n_step=n_step,
    gamma=gamma,
    pad=pad,
    stack_keys=stack_keys,
    stack_axis=stack_axis,
  )
  bound_init = functools.partial(frames.init, stack_keys=stack_keys, stack_axis=stack_axis)
  if priorities is None:
    bound_add = functools.partial(frames.add, num_stack=num_stack, n_step=n_step)
    bound_sample = functools.partial(frames.sample, **layout)
    bound_update = functools.partial(frames.update_priorities, n_step=n_step)
    split_update, beta, stratified, more = None, None, False, {}
  else:
    alpha, eps = priorities["alpha"], priorities["eps"]
    beta, stratified = priorities["beta"], priorities["stratified"]
    bound_add = functools.partial(
      frames.prioritized_add, num_stack=num_stack, n_step=n_step, alpha=alpha
    )
    bound_sample = functools.partial(
      frames.prioritized_sample, **layout, beta=beta, stratified=stratified
    )
    bound_update = functools.partial(
      frames.prioritized_update_priorities, n_step=n_step, alpha=alpha, eps=eps
    )
    split_update = bound_update
    more = dict(alpha=float(alpha), eps=float(eps))
  gather = functools.partial(frames.gather_transitions, **layout)
  split = functools.partial(
    device_split.frame_stack_split,
    num_envs=num_envs,
    capacity=capacity,
    init=bound_init,
    add=bound_add,
    sample=bound_sample,
    update_priorities=split_update,
    gather=gather,
    beta=beta,
    stratified=stratified,
  )
  buffer = bind(
    init=functools.partial(bound_init, num_envs=num_envs, capacity=capacity),
    add=bound_add,
    sample=functools.partial(bound_sample, checked=checked),
    update_priorities=functools.partial(bound_update, checked=checked),
    can_sample=frames.can_sample,
    clear=frames.clear,
    kind=kind.Kind(
      name=name,
      state_type=FrameStackReplayState,
      exact_type=True,
      settings=_frame_settings(num_envs, capacity, num_stack, n_step, **more),
      split=split,
    ),
    checked=checked,
    jit_update_priorities=priorities is not None,
    check_host_add=sequence.check_one_final_step,
  )
  return placed.place(
    buffer, storage, kind_name=name, layout=tiers.frames_layout(stack_keys, stack_axis)
  )


def frame_stack_replay(
  num_envs: int,
  capacity: int,
  num_stack: int,
  *,
  n_step: int = 1,
  gamma: float = 0.99,
  stack_keys: tuple[str, ...] | None = None,
  stack_axis: int = -1,
  pad: str = "zeros",
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[FrameStackReplayState, ReplaySample]:
  """A uniform replay buffer of stacked n-step transitions, frames stored once.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs: N, the number of streams.
    capacity: C, steps (frames) held over all envs; a multiple of N, with
      C // N >= num_stack + n_step.
    num_stack: K, frames per stacked observation (4 for Atari).
    n_step: n, steps summed in a transition's reward.
    gamma: the discount in [0, 1] of the n-step reward and `discount`.
    stack_keys: the keys (or NamedTuple fields) of a dict obs whose leaves
      are stacked, e.g. `("pixels",)`; the others are returned unstacked.
      None stacks every leaf of obs.
    stack_axis: where K goes in each stacked leaf, an axis of the frame
      shape with K inserted: -1 gives `[..., K]` (`[84, 84, 4]`), 0 gives
      `[K, ...]` (channels first).
    pad: frames before an episode's first step: "zeros", or "first" (that
      first frame repeated).
    checked: as for `uniform_replay`.
    storage: where the payload leaves live: "device" (the default), "host"
      (pinned host memory) or `jaxbuf.disk(directory)` (files); bookkeeping
      stays on the device. See docs/guides/storage.md.

  Returns:
    A `Buffer`: `init(example_step)` with a step holding obs (one frame),
    action, reward (float scalar) and terminated (bool scalar);
    `add(state, steps, mask=None, episode_end=None, final_steps=None)` as
    `sequence_replay`'s (see `jaxbuf.frames.add`);
    `sample` returns a `ReplaySample` whose items are a
    `FrameStackTransition` `[S, ...]` and whose indices are transition ids.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.frame_stack_replay(num_envs=2, capacity=64,
  ...                                    num_stack=4, n_step=3, gamma=0.9)
  >>> step = {"obs": jnp.zeros((84, 84), jnp.uint8), "action": jnp.int32(0),
  ...         "reward": jnp.float32(0), "terminated": jnp.bool_(False)}
  >>> state = buffer.init(step)
  >>> for t in range(6):
  ...   state = buffer.add(state, jax.tree.map(
  ...       lambda x: jnp.full((2, *x.shape), t + 1, x.dtype), step))
  >>> batch = buffer.sample(state, jax.random.key(0), 32)
  >>> batch.items.obs.shape, batch.items.next_obs.shape
  ((32, 84, 84, 4), (32, 84, 84, 4))
  >>> batch.items.obs[0, 0, 0].tolist() in ([0, 0, 0, 1], [0, 0, 1, 2],
  ...                                       [0, 1, 2, 3])   # zero padded
  True
  """
  return _frame_stack_factory(
    "frame_stack_replay",
    num_envs,
    capacity,
    num_stack,
    n_step=n_step,
    gamma=gamma,
    stack_keys=stack_keys,
    stack_axis=stack_axis,
    pad=pad,
    checked=checked,
    storage=storage,
    priorities=None,
  )


def prioritized_frame_stack_replay(
  num_envs: int,
  capacity: int,
  num_stack: int,
  *,
  n_step: int = 1,
  gamma: float = 0.99,
  stack_keys: tuple[str, ...] | None = None,
  stack_axis: int = -1,
  pad: str = "zeros",
  alpha: float = 0.6,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  stratified: bool = True,
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[FrameStackReplayState, ReplaySample]:
  """A prioritized replay buffer of stacked n-step transitions.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs: as for `frame_stack_replay`, and so are `capacity`,
      `num_stack`, `n_step`, `gamma`, `stack_keys`, `stack_axis`, `pad`,
      `checked` and `storage`.
    alpha: as for `prioritized_replay`, and so are `beta`, `eps` and
      `stratified`; N in the importance weights is the number of sampleable
      transitions.

  Returns:
    A `Buffer` with `frame_stack_replay`'s functions; pass `sample.indices`
    and `sample.item_ids` to `update_priorities`.

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> buffer = jaxbuf.prioritized_frame_stack_replay(1, 16, 2)
  >>> step = {"obs": jnp.zeros(3), "action": jnp.int32(0),
  ...         "reward": jnp.float32(1), "terminated": jnp.bool_(False)}
  >>> state = buffer.init(step)
  >>> state = buffer.add(state, jax.tree.map(
  ...     lambda x: jnp.broadcast_to(x, (1, 5, *x.shape)), step))
  >>> batch = buffer.sample(state, jax.random.key(0), 4)
  >>> state = buffer.update_priorities(state, batch.indices,
  ...                                  jnp.array([0.1, 2.0, 0.5, 1.0]),
  ...                                  batch.item_ids)
  >>> batch.items.obs.shape, float(batch.weights.max())
  ((4, 3, 2), 1.0)
  """
  validation.check_bool(stratified, "stratified", what="prioritized_frame_stack_replay")
  if not callable(beta):
    validation.check_hyperparameter(beta, "beta")
  validation.check_hyperparameter(alpha, "alpha")
  validation.check_hyperparameter(eps, "eps", positive=True)
  return _frame_stack_factory(
    "prioritized_frame_stack_replay",
    num_envs,
    capacity,
    num_stack,
    n_step=n_step,
    gamma=gamma,
    stack_keys=stack_keys,
    stack_axis=stack_axis,
    pad=pad,
    checked=checked,
    storage=storage,
    priorities=dict(alpha=alpha, beta=beta, eps=eps, stratified=stratified),
  )


def hindsight_replay(
  num_envs: int,
  capacity: int,
  reward_fn: Callable,
  *,
  strategy: str = "future",
  relabel_fraction: float = 0.8,
  terminated_fn: Callable | None = None,
  gamma: float = 0.99,
  prioritized: bool = False,
  alpha: float = 0.6,
  beta: float | Schedule = 0.4,
  eps: float = 1e-6,
  stratified: bool = True,
  checked: bool = False,
  storage: Any = "device",
) -> Buffer[HindsightReplayState, HindsightSample]:
  """A hindsight experience replay buffer over per-env episode streams.

  Steps follow the stream convention: `help(jaxbuf.streams)`.

  Args:
    num_envs: N, the number of streams.
    capacity: C, steps held over all envs; a multiple of N with at least 2
      steps per env.
    reward_fn: `reward_fn(achieved_goal, desired_goal) -> reward`, pure and
      batched over a leading axis: leaves `[S, ...]` in, `[S]` out in the
      stored reward's dtype (else `ValueError` while tracing `sample`).
    strategy: where a hindsight goal comes from: "future" (a later step of
      the same episode, or this one), "final" (its last) or "episode" (any
      of its steps). See the module docstring.
    relabel_fraction: the probability, in [0, 1], that a sampled row is
      relabelled.
    terminated_fn: optional `terminated_fn(achieved_goal, desired_goal) ->
      bool [S]` for goal-dependent terminations (relabelled rows' discount);
      None keeps the stored `terminated`.
    gamma: the discount in [0, 1]: a sampled transition's `discount` is
      gamma, or 0 where it terminated, the factor of its bootstrap as in
      every jaxbuf transition (`target = reward + discount * Q(next_obs)`;
      do not multiply by gamma again).
    prioritized: one priority per transition (proportional prioritized
      replay); then alpha, beta, eps, stratified as for
      `prioritized_replay`.
    checked: as for `uniform_replay`.
    storage: "device" only; the kinds that take other tiers are named in
      the error.

  Returns:
    A `Buffer`; `add(state, steps, mask=None, episode_end=None,
    final_steps=None)` (see `jaxbuf.hindsight.add`), `sample` returns a
    `HindsightSample` whose items are `HindsightTransition` records.
    `jaxbuf.sharded` splits it over devices as sequence replay, envs in
    blocks of N / D (`split_over_devices`).

  >>> import jax, jax.numpy as jnp, jaxbuf
  >>> reward_fn = lambda achieved, desired: -jnp.any(
  ...     achieved != desired, axis=-1).astype(jnp.float32)
  >>> buffer = jaxbuf.hindsight_replay(2, 64, reward_fn, strategy="future")
  >>> goal = jnp.zeros(3)
  >>> step = {"obs": {"observation": goal, "achieved_goal": goal,
  ...                 "desired_goal": goal},
  ...         "action": jnp.int32(0), "reward": jnp.float32(0),
  ...         "terminated": jnp.bool_(False)}
  >>> state = buffer.init(step)
  >>> chunk = jax.tree.map(lambda x: jnp.zeros((2, 5) + x.shape, x.dtype), step)
  >>> state = buffer.add(state, chunk,
  ...                    episode_end=jnp.array([[0, 0, 0, 0, 1]] * 2, bool))
  >>> batch = buffer.sample(state, jax.random.key(0), 8)
  >>> batch.items.obs["desired_goal"].shape, batch.relabelled.dtype
  ((8, 3), dtype('bool'))
  >>> round(float(batch.items.discount[0]), 6)  # target = r + discount * Q'
  0.99
  """
  tiers.resolve(storage, "hindsight_replay")
  hindsight.check_settings(
    num_envs, capacity, reward_fn, strategy, relabel_fraction, terminated_fn, gamma
  )
  for name, flag in (("prioritized", prioritized), ("stratified", stratified)):
    validation.check_bool(flag, name, what="hindsight_replay")
  if prioritized:
    validation.check_hyperparameter(alpha, "alpha")
    validation.check_hyperparameter(eps, "eps", positive=True)
    if not callable(beta):
      validation.check_hyperparameter(beta, "beta")
  priority_alpha = alpha if prioritized else None
  relabelling: dict[str, Any] = dict(
    reward_fn=reward_fn,
    strategy=strategy,
    relabel_fraction=float(relabel_fraction),
    terminated_fn=terminated_fn,
    gamma=gamma,
  )
  bound_add = functools.partial(hindsight.add, alpha=priority_alpha)
  bound_sample = functools.partial(
    hindsight.sample, **relabelling, priorities=prioritized, beta=beta, stratified=stratified
  )
  split = functools.partial(
    device_split.hindsight_split,
    num_envs=num_envs,
    capacity=capacity,
    add=bound_add,
    sample=bound_sample,
    update_priorities=functools.partial(hindsight.update_priorities, alpha=priority_alpha, eps=eps)
    if prioritized
    else None,
    # Uniform: independent rows, as the unsharded draw gives.
    beta=beta if prioritized else None,
    stratified=stratified and prioritized,
    **relabelling,
  )
  return bind(
    init=functools.partial(hindsight.init, num_envs=num_envs, capacity=capacity),
    add=bound_add,
    sample=functools.partial(bound_sample, checked=checked),
    update_priorities=functools.partial(
      hindsight.update_priorities, alpha=priority_alpha, eps=eps, checked=checked
    ),
    can_sample=sequence.can_sample,
    clear=hindsight.clear,
    kind=kind.Kind(
      name="hindsight_replay",
      state_type=HindsightReplayState,
      exact_type=True,
      settings=kind.settings_of(
        num_envs=num_envs,
        capacity=capacity,
        prioritized=prioritized,
        **(dict(alpha=float(alpha), eps=float(eps)) if prioritized else {}),
      ),
      split=split,
    ),
    checked=checked,
    check_host_add=sequence.check_one_final_step,
  )
