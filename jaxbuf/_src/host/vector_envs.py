"""A gymnasium vector env's steps as buffer adds, resets left out:
`VectorEnvRecorder`, whose docstring holds the whole story (both autoreset
modes, what is written for item and stream kinds, what is refused).

Shape key: N envs, B transitions in one item add (B <= N).

Why an object: a vector step alone cannot say which of its rows are
transitions, nor what their `obs` was. The recorder keeps the previous
step's observations and, for `AutoresetMode.NEXT_STEP`, which envs ended on
it; that host bookkeeping is all it holds, and the buffer state stays a pure
pytree, passed in and returned.
"""

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxbuf._src.core.base import Buffer, PyTree
from jaxbuf._src.core.ring import ReplayState
from jaxbuf._src.core.spaces import example_from_space
from jaxbuf._src.core.records import EpisodeStep, Transition
from jaxbuf._src.streams.sequence import SequenceReplayState


class RecordedStep(NamedTuple):
  """What one vector env step adds: `buffer.add`'s arguments after the state.

  A pytree of NumPy arrays, so it can be passed into a jitted step that
  adds it there (`recorded.add_to(buffer, state)` inside the jit).
  """

  items: PyTree | None  # Transition [B] (items; None: no row to add) or
  # EpisodeStep [N] (streams)
  mask: np.ndarray | None  # bool [N], streams: the envs whose step is stored
  final_steps: PyTree | None  # EpisodeStep [N], streams: the final
  # observations, `last` where an episode ended
  abandoned: PyTree | None = None  # EpisodeStep [N], streams: the final
  # steps of the episodes a mid-episode `reset` abandoned (`last` there),
  # added before `items`; None when no episode was abandoned

  def add_to(self, buffer: Buffer, state: Any) -> Any:
    """`buffer.add(state, ...)` with these arguments; the state unchanged
    when there is nothing to add. Works inside a jit too."""
    if self.abandoned is not None:
      state = buffer.add(state, self.abandoned, mask=self.abandoned.last)
    if self.items is None:
      return state
    if self.final_steps is None:
      return buffer.add(state, self.items)
    return buffer.add(state, self.items, mask=self.mask, final_steps=self.final_steps)


class _Position(NamedTuple):
  """The recorder's host bookkeeping between two steps; replaced whole, and
  only once a step's add went through."""

  obs: PyTree  # leaves [N, ...]: each env's current observation
  resetting: np.ndarray  # bool [N], NEXT_STEP: the env's next step is the
  # reset step (its episode ended on the previous step)
  running: np.ndarray  # bool [N]: the env's episode has a stored step and
  # no end yet
  abandoned: PyTree | None  # EpisodeStep [N] or None, streams: final steps
  # of episodes abandoned by `reset`, not yet added


def _autoreset_mode(envs: Any, autoreset_mode: Any) -> Any:
  """The env's `AutoresetMode`, refusing DISABLED, none, or a disagreement."""
  # Imported here: jaxbuf itself never depends on gymnasium.
  from gymnasium.vector import AutoresetMode  # pylint: disable=import-outside-toplevel

  given = envs.metadata.get("autoreset_mode")
  if given is None and autoreset_mode is None:
    raise ValueError(
      f"VectorEnvRecorder: {type(envs).__name__}'s metadata names no "
      "autoreset_mode, and the recorder cannot tell a reset step from a "
      "transition without it; pass autoreset_mode=AutoresetMode.NEXT_STEP "
      "or SAME_STEP, whichever the env does."
    )
  if (
    given is not None
    and autoreset_mode is not None
    and (AutoresetMode(given) != AutoresetMode(autoreset_mode))
  ):
    raise ValueError(
      f"VectorEnvRecorder: autoreset_mode={AutoresetMode(autoreset_mode)} "
      f"was given, but the env's metadata says {AutoresetMode(given)}."
    )
  mode = AutoresetMode(given if given is not None else autoreset_mode)
  if mode not in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
    raise ValueError(
      f"VectorEnvRecorder: the env's autoreset mode is {mode}: the caller "
      "resets ended episodes, so a step cannot say whether it follows a "
      "reset. Make the env with autoreset_mode=AutoresetMode.NEXT_STEP (the "
      "default) or SAME_STEP."
    )
  return mode


def _layout(buffer: Buffer) -> str:
  """ "items" or "streams", from the buffer kind's state type."""
  # A rollout buffer is no `Buffer` and has no kind.
  kind = getattr(buffer, "kind", None)
  if kind is not None and issubclass(kind.state_type, SequenceReplayState):
    return "streams"
  if kind is not None and issubclass(kind.state_type, ReplayState):
    if dict(kind.settings).get("devices") is not None:
      raise ValueError(
        "VectorEnvRecorder: a jaxbuf.sharded item replay buffer adds "
        "batches that divide over its devices, and the number of "
        "transitions of a vector step varies (reset steps are left out); "
        "record into the unsharded buffer, or into a stream kind."
      )
    return "items"
  raise TypeError(
    "VectorEnvRecorder: the buffer holds neither items (uniform or "
    "prioritized replay) nor per-env streams (sequence, frame-stack, "
    "hindsight, episode replay)"
    + (
      f"; given a {kind.name} buffer."
      if kind is not None
      else f"; given a {type(buffer).__name__}."
    )
  )


def _copied(tree: PyTree) -> PyTree:
  """A copy of NumPy leaves: a vector env made with `copy=False` writes its
  next observations over the arrays it returned."""
  if isinstance(tree, np.ndarray):
    return tree.copy()
  return jax.tree.map(np.array, tree)


def _rows(tree: PyTree, rows: np.ndarray) -> PyTree:
  # A plain array skips jax.tree.map (a few microseconds a call).
  if isinstance(tree, np.ndarray):
    return tree[rows]
  return jax.tree.map(lambda leaf: np.asarray(leaf)[rows], tree)


def _leaf_name(path: tuple) -> str:
  return "obs" + jax.tree_util.keystr(path)


def _check_final_obs(final: PyTree, like: PyTree, env: int) -> None:
  """SAME_STEP: env `env`'s `info["final_obs"]` has the observation's
  structure and leaf shapes (`like`: leaves `[N, ...]`)."""
  want = [_leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(like)]
  given = [_leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(final)]
  if want != given:
    raise ValueError(
      f"VectorEnvRecorder: info['final_obs'][{env}], env {env}'s final "
      f"observation, has the leaves {given}, but the observations have "
      f"{want}; pass the info envs.step returned, unchanged."
    )
  for (path, leaf), final_leaf in zip(
    jax.tree_util.tree_leaves_with_path(like), jax.tree.leaves(final), strict=True
  ):
    shape = np.shape(final_leaf)
    if shape != leaf.shape[1:]:
      raise ValueError(
        f"VectorEnvRecorder: info['final_obs'][{env}], env {env}'s final "
        f"observation, has shape {shape} at {_leaf_name(path)}, where the "
        f"observations have {leaf.shape[1:]}; pass the info envs.step "
        "returned, unchanged."
      )


def _flags(name: str, value: Any, num_envs: int) -> np.ndarray:
  flags = np.asarray(value)
  if flags.shape != (num_envs,) or flags.dtype != np.bool_:
    raise ValueError(
      f"VectorEnvRecorder: {name} must be bool [{num_envs}], "
      f"given {flags.dtype} {list(flags.shape)}."
    )
  return flags


class VectorEnvRecorder:
  """Adds a gymnasium vector env's steps to a buffer, never a reset.

  gymnasium 1.x vector envs reset an ended episode themselves, in the mode
  `envs.metadata["autoreset_mode"]` names:

  * `AutoresetMode.NEXT_STEP` (gymnasium's default). The step that ends an
    episode returns its true final observation. The NEXT step of that env
    is the reset: its action is ignored, its reward is 0, it is neither
    terminated nor truncated, and it returns the new episode's first
    observation. It is no transition (stored as one, it would pair the
    final observation with an action that did nothing and the reset
    observation), so it is not stored.
  * `AutoresetMode.SAME_STEP`. The step that ends an episode resets at once
    and returns the new episode's first observation; the true final
    observation is `info["final_obs"][n]`, where `info["_final_obs"][n]`.

  What is written follows the buffer's kind (`buffer.kind.state_type`):

  * item kinds (uniform and prioritized replay): `jaxbuf.Transition` items
    (obs, action, reward, next_obs, terminated, truncated), `next_obs` the
    true final observation where an episode ended. NEXT_STEP's reset rows
    are dropped on the host, since item replay's add has no mask: B varies,
    and each B (at most N of them) is one compilation of the add (or of a
    jitted step that adds a `RecordedStep`). A step of only resets adds
    nothing.
  * stream kinds (sequence, prioritized sequence, frame-stack, hindsight and
    episode replay): `jaxbuf.EpisodeStep` steps in the stream convention
    (`help(jaxbuf.streams)`), in one add of fixed shapes per vector step:
    `add(state, steps [N], mask=stepped [N], final_steps=final [N])`.
    `mask` leaves out NEXT_STEP's reset steps; `final_steps` holds the final
    observations, `last` True exactly for the envs whose episode ended,
    action, reward and flags zeros (as in a stream read from Minari).

  Terminated and truncated stay apart in both: a truncation (a time limit)
  bootstraps from the true final observation, a termination does not.
  Rewards are stored as float32; observations and actions keep the spaces'
  dtypes (64-bit ones as JAX holds them).

  What cannot be told apart is refused with a `ValueError`:
  `AutoresetMode.DISABLED` (the caller resets, so a step cannot say whether
  it follows a reset), a vector env whose metadata names no mode (pass
  `autoreset_mode=`), a SAME_STEP step whose `info` lacks the final
  observation of an env that ended, a NEXT_STEP step whose `info` holds
  `final_obs` (a SAME_STEP env mislabelled), and an env that ends an episode
  on what should be its reset step, or gets a reward there (a step not
  recorded, or the wrong mode). Steps out of order, twice or skipped show
  nowhere else in gymnasium's outputs (no step counter), so they are stored
  as the rows they make: pass every step once, in order. A step refused by
  the recorder or the buffer's add leaves the recorder as it was.

  An env reset mid-episode (`reset(obs, reset_mask=...)`, or a full reset)
  ends its abandoned episode as a truncation at the observation it reached:
  stream kinds get that observation as a final step flagged `last`, added
  before the next step (`docs/guides/host_loops.md`).

  Call `reset(obs)` with what `envs.reset()` returned, then `add` (or
  `record`) once after every `envs.step`, in order.

  Args:
    envs: a gymnasium 1.x vector env (`SyncVectorEnv`, `AsyncVectorEnv`, or
      a wrapper of one); its autoreset mode is read from
      `envs.metadata["autoreset_mode"]`, its spaces give `example`.
    buffer: a jaxbuf buffer of an item or a stream kind (above).
    autoreset_mode: the env's mode, for a vector env whose metadata names
      none; must agree with the metadata where it names one.

  Attributes:
    example: the unbatched example for `buffer.init`: a `jaxbuf.Transition`
      (item kinds) or `jaxbuf.EpisodeStep` (stream kinds) of zeros, shaped
      by the env's single spaces; rewards float32.
    autoreset_mode: the env's `AutoresetMode`.

  >>> import gymnasium as gym, jax, jaxbuf
  >>> envs = gym.make_vec("CartPole-v1", num_envs=2,
  ...                     vectorization_mode="sync")  # NEXT_STEP, the default
  >>> buffer = jaxbuf.uniform_replay(1000)
  >>> recorder = jaxbuf.VectorEnvRecorder(envs, buffer)
  >>> state = buffer.init(recorder.example)
  >>> obs, _ = envs.reset(seed=0)
  >>> recorder.reset(obs)
  >>> for _ in range(30):
  ...   actions = envs.action_space.sample()
  ...   next_obs, rewards, terminated, truncated, info = envs.step(actions)
  ...   state = recorder.add(state, actions, next_obs, rewards, terminated,
  ...                        truncated, info)
  ...   obs = next_obs   # for acting; the recorder keeps its own copy
  >>> int(state.size) <= 60   # 30 steps of 2 envs, less a reset per end
  True
  >>> batch = buffer.sample(state, jax.random.key(0), 32)
  >>> batch.items.obs.shape, batch.items.next_obs.shape
  ((32, 4), (32, 4))
  """

  def __init__(self, envs: Any, buffer: Buffer, *, autoreset_mode: Any = None):
    self.autoreset_mode = _autoreset_mode(envs, autoreset_mode)
    self.buffer = buffer
    self.num_envs = int(envs.num_envs)
    self._layout = _layout(buffer)
    self._next_step = self.autoreset_mode is type(self.autoreset_mode).NEXT_STEP
    observation = example_from_space(envs.single_observation_space)
    action = example_from_space(envs.single_action_space)
    reward, flag = np.zeros((), np.float32), np.zeros((), np.bool_)
    self.example: Transition | EpisodeStep
    if self._layout == "items":
      self.example = Transition(
        obs=observation,
        action=action,
        reward=reward,
        next_obs=observation,
        terminated=flag,
        truncated=flag,
      )
    else:
      self.example = EpisodeStep(
        obs=observation, action=action, reward=reward, terminated=flag, truncated=flag, last=flag
      )
    batched = lambda leaf: np.zeros((self.num_envs, *leaf.shape), leaf.dtype)
    # A final step's action, reward and flags: padding, never read.
    self._padding = jax.tree.map(batched, (action, reward, flag))
    self._all_envs = np.ones(self.num_envs, np.bool_)
    self._position: _Position | None = None

  def reset(self, obs: PyTree, reset_mask: np.ndarray | None = None) -> None:
    """Records the observations `envs.reset()` returned.

    An env reset while its episode runs (a stored step, no end yet) abandons
    that episode, and the episode ends in the buffer as a truncation: with
    stream kinds, its final step (the observation the env reached before
    the reset, flagged `last`) is added before the next step's rows, so no
    window, n-step target, frame stack or hindsight goal joins it to the new
    episode. Item kinds hold whole transitions, which never join episodes.

    Args:
      obs: leaves `[N, ...]`, the env's observations after the reset.
      reset_mask: bool `[N]`, the envs reset (gymnasium's
        `options={"reset_mask": ...}`); None for all.
    """
    reset = (
      self._all_envs if reset_mask is None else _flags("reset_mask", reset_mask, self.num_envs)
    )
    held = _copied(obs)
    position = self._position
    if position is None:
      self._position = _Position(
        held, np.zeros(self.num_envs, np.bool_), np.zeros(self.num_envs, np.bool_), None
      )
      return
    abandoned = position.abandoned
    ends = position.running & reset
    if self._layout == "streams" and ends.any():
      abandoned = self._abandoned_ends(position, ends)
    self._position = _Position(
      held, position.resetting & ~reset, position.running & ~reset, abandoned
    )

  def _abandoned_ends(self, position: _Position, ends: np.ndarray) -> PyTree:
    """Final steps `[N]` of the episodes `ends` abandons: each env's current
    observation flagged `last`, with those abandoned before and not yet added."""
    obs = _copied(position.obs)
    last = ends.copy()
    if position.abandoned is not None:
      earlier = position.abandoned.last & ~ends
      obs = jax.tree.map(
        lambda now, before: np.where(earlier.reshape((-1,) + (1,) * (now.ndim - 1)), before, now),
        obs,
        position.abandoned.obs,
      )
      last |= earlier
    action, reward, flag = self._padding
    return EpisodeStep(
      obs=obs, action=action, reward=reward, terminated=flag, truncated=flag, last=last
    )

  def record(
    self,
    actions: PyTree,
    next_obs: PyTree,
    rewards: Any,
    terminated: Any,
    truncated: Any,
    info: dict | None,
  ) -> RecordedStep:
    """The add of one `envs.step(actions)`, and the step recorded.

    The recorder moves on to the step's observations when `record` returns;
    a step it refuses leaves it as it was. `add` moves it on only once the
    buffer's add went through, so a step refused by either can be passed
    again, corrected.

    Args:
      actions: leaves `[N, ...]`, the actions passed to `envs.step`.
      next_obs, rewards, terminated, truncated, info: what it returned
        (`info` None reads as `{}`).

    Returns:
      A `RecordedStep`; `recorded.add_to(buffer, state)` adds it (`add` does
      both).

    Raises:
      RuntimeError: before `reset`.
      ValueError: flags not bool `[N]`; a final observation missing or not
        shaped as the observations (SAME_STEP); `info` that only a SAME_STEP
        env gives, an end or a reward on a reset step (NEXT_STEP).
    """
    step = (actions, next_obs, rewards, terminated, truncated, info)
    recorded, self._position = self._record(step)
    return recorded

  def _record(self, step: tuple) -> tuple[RecordedStep, _Position]:
    """`record`'s add of `step` (its arguments, in order) and the recorder's
    position after it, which the caller keeps once the step is accepted."""
    actions, next_obs, rewards, terminated, truncated, info = step
    if self._position is None:
      raise RuntimeError(
        "VectorEnvRecorder: call reset(obs) with the "
        "observations of envs.reset() before recording steps."
      )
    if info is None:
      info = {}
    if not isinstance(info, dict):
      raise TypeError(
        f"VectorEnvRecorder: info must be the dict envs.step returned, given {type(info).__name__}."
      )
    position = self._position
    terminated = _flags("terminated", terminated, self.num_envs)
    truncated = _flags("truncated", truncated, self.num_envs)
    rewards = np.asarray(rewards).astype(np.float32)
    ended = terminated | truncated
    held = _copied(next_obs)
    if self._next_step:
      stepped = self._check_next_step(position.resetting, ended, rewards, info)
      final_obs = held
      resetting = ended
    else:
      stepped = self._all_envs
      final_obs = self._final_observations(held, ended, info)
      resetting = position.resetting
    after = _Position(held, resetting, (position.running | stepped) & ~ended, None)
    obs = position.obs
    if self._layout == "items":
      transitions = Transition(
        obs=obs,
        action=actions,
        reward=rewards,
        next_obs=final_obs,
        terminated=terminated,
        truncated=truncated,
      )
      if stepped is not self._all_envs:
        rows = np.flatnonzero(stepped)
        if not rows.size:
          return RecordedStep(None, None, None), after
        transitions = Transition(*(_rows(field, rows) for field in transitions))
      return RecordedStep(transitions, None, None), after
    no_flag = self._padding[2]
    steps = EpisodeStep(
      obs=obs,
      action=actions,
      reward=rewards,
      terminated=terminated,
      truncated=truncated,
      last=no_flag,
    )
    padding_action, padding_reward, _ = self._padding
    final_steps = EpisodeStep(
      obs=final_obs,
      action=padding_action,
      reward=padding_reward,
      terminated=no_flag,
      truncated=no_flag,
      last=ended & stepped,
    )
    return RecordedStep(steps, stepped, final_steps, position.abandoned), after

  def add(
    self,
    state: Any,
    actions: PyTree,
    next_obs: PyTree,
    rewards: Any,
    terminated: Any,
    truncated: Any,
    info: dict | None,
  ) -> Any:
    """`record`, then its add: the state after one `envs.step(actions)`.

    The arguments after `actions` are `envs.step`'s five results in order.
    The state passed in is consumed, as by `buffer.add`. The recorder moves
    on only once the add went through: a step refused by the recorder or by
    the buffer (float actions for a `Discrete` space) leaves it as it was,
    to be passed again, corrected.
    """
    recorded, after = self._record((actions, next_obs, rewards, terminated, truncated, info))
    state = recorded.add_to(self.buffer, state)
    self._position = after
    return state

  def _check_next_step(
    self, resetting: np.ndarray, ended: np.ndarray, rewards: np.ndarray, info: dict
  ) -> np.ndarray:
    """The envs whose step is a transition (not a reset); refuses a step
    that no NEXT_STEP env gives."""
    if "final_obs" in info:
      raise ValueError(
        "VectorEnvRecorder: info holds final_obs, which only an env in "
        "AutoresetMode.SAME_STEP gives, but the env's metadata says "
        "NEXT_STEP; make the recorder with the mode the env steps in."
      )
    if resetting.any():
      both = np.flatnonzero(resetting & ended)
      if both.size:
        raise ValueError(
          f"VectorEnvRecorder: env {int(both[0])} ended its episode on the "
          "step after an episode end, which a NEXT_STEP env spends on the "
          "reset (neither terminated nor truncated); is it in NEXT_STEP "
          "mode, and was every step recorded?"
        )
      # gymnasium's reset step gives reward 0: another reward is a real
      # step, so the step after the end (the reset) was never recorded.
      rewarded = np.flatnonzero(resetting & (rewards != 0))
      if rewarded.size:
        env = int(rewarded[0])
        raise ValueError(
          f"VectorEnvRecorder: env {env} got reward {rewards[env]} on the "
          "step after an episode end, which a NEXT_STEP env spends on the "
          "reset (reward 0); was every step recorded, in order?"
        )
      return ~resetting
    return self._all_envs

  def _final_observations(self, held: PyTree, ended: np.ndarray, info: dict) -> PyTree:
    """SAME_STEP: `held` (a copy of the returned observations) with the
    true final observation, `info["final_obs"][n]`, where env n ended."""
    if not ended.any():
      return held
    has_final = np.asarray(info.get("_final_obs", np.zeros(self.num_envs, np.bool_)))
    missing = np.flatnonzero(ended & ~has_final) if has_final.shape == ended.shape else [0]
    if len(missing) or "final_obs" not in info:
      env = int(missing[0]) if len(missing) else int(np.flatnonzero(ended)[0])
      raise ValueError(
        f"VectorEnvRecorder: env {env} ended its episode, but "
        "info has no final_obs for it (info['_final_obs'] is not True "
        "there), which an env in AutoresetMode.SAME_STEP always gives; "
        "the true final observation is lost. Pass the info envs.step "
        "returned, unchanged."
      )
    envs = [int(env) for env in np.flatnonzero(ended)]
    # Every final observation checked before any is written.
    for env in envs:
      _check_final_obs(info["final_obs"][env], held, env)
    # A second copy: `held` is the next step's `obs`, the reset observations.
    final_obs = _copied(held)
    leaves = jax.tree.leaves(final_obs)
    for env in envs:
      # One env's observation: the same structure, so its leaves in order.
      for leaf, final in zip(leaves, jax.tree.leaves(info["final_obs"][env]), strict=True):
        leaf[env] = final
    return final_obs
