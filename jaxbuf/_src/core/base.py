"""The types every buffer kind shares (`BufferState`, `Buffer`,
`ReplaySample`) and `bind`, which makes a kind's functions into a `Buffer`.

Shape key: S sample size.
"""

import functools
import inspect
from typing import Any, Callable, Generic, NamedTuple, Protocol, Sequence, TypeVar

import flax.struct
import jax
from jax.typing import ArrayLike

from jaxbuf._src.core import host_add
from jaxbuf._src.core import kind as kind_protocol
from jaxbuf._src.core import random
from jaxbuf._src.core import validation
from jaxbuf._src.core.kind import BufferState  # pylint: disable=unused-import
from jaxbuf._src.core.pytypes import PyTree, Schedule  # pylint: disable=unused-import  # noqa: F401


def regrouped(state: BufferState, devices: int | None) -> BufferState:
  """`state` laid out for `devices` devices (None: one unsharded buffer).

  Exact: every item, priority and counter is kept and sampling draws from
  the same distribution; what keeps it exact for each kind is in its
  `joined` and `divided`. Indices of samples drawn before are not
  meaningful after (the slots or window ids are numbered anew).
  """
  settings = dict(state.settings)
  whole = state.joined() if settings.pop("devices", None) else state
  whole = whole.replace(settings=kind_protocol.settings_of(**settings))
  if not devices:
    return whole
  return whole.divided(devices).replace(
    settings=kind_protocol.settings_of(**settings, devices=devices)
  )


@flax.struct.dataclass
class ReplaySample:
  """A batch drawn from a replay buffer.

  The shared fields mean the same in every kind's sample (its subclass or
  its items' docstring says which unit a row is: an item, a window, a
  transition, an episode piece):

  * `indices`: int32 `[S]`, the id of each row's unit in `[0, C)` (an item
    replay's slot; a stream kind's `env * (C // N) + slot` of the unit's
    first step). Pass it to `update_priorities`.
  * `weights`: float32 `[S]`, the importance weight to multiply each row's
    loss by: 1 in uniform kinds, `(N P(i)) ** -beta` normalised so the
    largest is 1 in prioritized kinds, and 0 for a row drawn from a buffer
    that held nothing to sample (so a weighted loss reads nothing).
  * `item_ids`: uint32 `[S]`, which write filled the unit (an item's add
    count; a stream unit's first step's id in its env, mod 2**32). Pass it
    to `update_priorities` so an update of a unit overwritten since it was
    sampled is skipped.
  """

  items: PyTree  # each leaf [S, *item_shape]
  indices: jax.Array  # int32 [S]: ids of the sampled units, in [0, C)
  weights: jax.Array  # float32 [S]: importance weights, largest at most 1
  item_ids: jax.Array  # uint32 [S]: which write filled each unit; pass to
  # update_priorities so stale updates are skipped


# The state and sample types of a buffer kind: `Buffer[ReplayState,
# ReplaySample]` for `uniform_replay`, and so on for each kind.
StateT = TypeVar("StateT", bound=BufferState)
SampleT = TypeVar("SampleT", bound=ReplaySample)
_StateT_co = TypeVar("_StateT_co", bound=BufferState, covariant=True)
_StateT_contra = TypeVar("_StateT_contra", bound=BufferState, contravariant=True)
_SampleT_co = TypeVar("_SampleT_co", bound=ReplaySample, covariant=True)


class InitFn(Protocol[_StateT_co]):
  """`buffer.init(example)`: an empty state for items (or steps) shaped like
  `example`, one unbatched item (or env step)."""

  def __call__(self, example: PyTree, /) -> _StateT_co: ...


class AddFn(Protocol[StateT]):
  """`buffer.add(state, items)`: items with a leading batch axis `[B, ...]`;
  stream kinds take steps `[N, ...]` or `[N, T, ...]` and their `mask`,
  `episode_end` and `final_steps` (`help(jaxbuf.streams)`)."""

  def __call__(
    self,
    state: StateT,
    items: PyTree,
    /,
    mask: ArrayLike | Sequence[bool] | None = None,
    episode_end: ArrayLike | Sequence[bool] | None = None,
    final_steps: PyTree | None = None,
  ) -> StateT: ...


class SampleFn(Protocol[_StateT_contra, _SampleT_co]):
  """`buffer.sample(state, key, batch_size, step=None)`: `batch_size` a
  Python int; `step` an integer folded into `key` (`Buffer`)."""

  def __call__(
    self,
    state: _StateT_contra,
    key: jax.Array,
    batch_size: int,
    *,
    step: int | jax.Array | None = None,
  ) -> _SampleT_co: ...


class UpdatePrioritiesFn(Protocol[StateT]):
  """`buffer.update_priorities(state, indices, priorities, item_ids=None)`:
  `indices` and `item_ids` as a sample returned them; the identity for
  kinds without priorities."""

  def __call__(
    self,
    state: StateT,
    indices: ArrayLike | Sequence[int],
    priorities: ArrayLike | Sequence[float],
    item_ids: ArrayLike | None = None,
  ) -> StateT: ...


class CanSampleFn(Protocol[_StateT_contra]):
  """`buffer.can_sample(state, batch_size)`: bool scalar array, whether
  `sample(state, key, batch_size)` draws only held data (`batch_size` a
  Python int). Not a warm-up: `Buffer` says how to spell one."""

  def __call__(self, state: _StateT_contra, batch_size: int) -> jax.Array: ...


class TakeFn(Protocol[StateT, _SampleT_co]):
  """`buffer.take(state, key, batch_size, step=None) -> (state, sample)`:
  draws as `sample` does and returns the state after the draw (the draw
  counted, the rows handed out retired); the state as given for kinds that
  consume nothing."""

  def __call__(
    self,
    state: StateT,
    key: jax.Array,
    batch_size: int,
    *,
    step: int | jax.Array | None = None,
  ) -> tuple[StateT, _SampleT_co]: ...


class ClearFn(Protocol[StateT]):
  """`buffer.clear(state)`: the state emptied, its storage kept."""

  def __call__(self, state: StateT, /) -> StateT: ...


class Buffer(NamedTuple, Generic[StateT, SampleT]):
  """The functions of one replay buffer kind, hyperparameters bound.

  Every replay kind has the same fields, so a training script switches between
  them by changing the line that makes the buffer. `kind` describes the kind
  to the code around it (`jaxbuf.sharded`, checkpoints): `jaxbuf._src.core.kind`.

  The fields, as every kind binds them (S the sample size; `help()` of a
  buffer's own function gives its kind's shapes, without the settings bound
  when it was made):

  * `init(example) -> state`: one unbatched item (item kinds) or env step
    (stream kinds); storage is preallocated from its shapes and dtypes.
  * `add(state, items) -> state` (item kinds, items `[B, ...]`) or
    `add(state, steps, mask=None, episode_end=None, final_steps=None) ->
    state` (stream kinds, `help(jaxbuf.streams)`).
  * `sample(state, key, batch_size: int, *, step=None) -> ReplaySample` (or
    the kind's subclass of it); `batch_size` a Python int, static. A
    read-only peek: it counts nothing and retires nothing, so the same state
    and key give the same rows again.
  * `take(state, key, batch_size: int, *, step=None) -> (state, sample)`:
    the same draw as `sample` (the same rows under the same key and state),
    and the state after it: the rows counted as sampled (`max_times_sampled`)
    or handed out (queues). The state as given, for kinds that consume
    nothing. Jitted with the state donated where it consumes.
  * `update_priorities(state, indices [S], priorities [S], item_ids [S] =
    None) -> state`: `sample(...).indices` and `.item_ids`; the identity
    for uniform kinds (arguments still validated).
  * `can_sample(state, batch_size: int) -> jax.Array`, bool `()`: whether
    `sample(state, key, batch_size)` draws only held data. A kind that
    samples with replacement is true once one unit is held (an item; a
    complete window, piece, or transition with its stack), whatever
    `batch_size`; a queue or heap (no repeats, padding past the items held)
    once `batch_size` items are held, a budgeted buffer once `batch_size`
    items are live; `batch_size` is checked, and decides which parts must
    hold one in `jaxbuf.mixture` and in `jaxbuf.sharded` with local
    sampling.
  * `clear(state) -> state`: empty, storage kept.

  `can_sample` is not a warm-up. A warm-up ("learn once 1,000 items are
  held", flashbax's `min_length`, SB3's `learning_starts` counted in
  items) is its own test on the state: `state.size >= min_size` for the
  item kinds (items held), `state.steps_held.sum() >= min_steps` for the
  stream kinds (steps held over all envs); a loop that learns when both
  hold writes `buffer.can_sample(state, batch_size) & (state.size >=
  min_size)`.

  `sample(state, key, batch_size, step=None)` also takes `step=`, an integer
  scalar (a Python int, say the loop counter): it draws with
  `jax.random.fold_in(key, step)`, folded inside the call, so a Python loop
  passes one key and its counter rather than calling `jax.random.split`
  every step. Distinct steps give independent draws.

  For type checkers a buffer is `Buffer[StateT, SampleT]`, its kind's state
  and sample types (`uniform_replay` returns `Buffer[ReplayState,
  ReplaySample]`), and each function's signature is a Protocol (`SampleFn`,
  ...): `sample` without a `batch_size`, or a state of another kind, is
  flagged before anything runs.
  """

  init: InitFn[StateT]
  add: AddFn[StateT]
  sample: SampleFn[StateT, SampleT]
  update_priorities: UpdatePrioritiesFn[StateT]
  can_sample: CanSampleFn[StateT]
  clear: ClearFn[StateT]
  kind: kind_protocol.Kind | None = None
  # Last, with a default, so that a Buffer built from the six functions (and
  # the kind) positionally still builds; `bind` always sets it, and only a
  # Buffer built by hand holds None.
  take: TakeFn[StateT, SampleT] = None  # type: ignore[assignment]


# What `help(jaxbuf.Buffer)` shows for each field: the signature a call has.
_FIELD_DOCS = {
  "init": "init(example) -> state: an empty buffer shaped like one unbatched item or env step.",
  "add": "add(state, items) -> state (item kinds), or add(state, steps, "
  "mask=None, episode_end=None, final_steps=None) -> state (stream "
  "kinds).",
  "sample": "sample(state, key, batch_size: int, *, step=None) -> "
  "ReplaySample (or the kind's subclass); a read-only peek that counts nothing.",
  "update_priorities": "update_priorities(state, indices, priorities, "
  "item_ids=None) -> state; indices, priorities and "
  "item_ids [S], from sample(...).",
  "can_sample": "can_sample(state, batch_size: int) -> bool jax.Array of "
  "shape (): whether sample(state, key, batch_size) draws "
  "only held data (true once one unit is held: sampling is with "
  "replacement). Not a warm-up: state.size >= min_size (item kinds), "
  "state.steps_held.sum() >= min_steps (stream kinds).",
  "clear": "clear(state) -> state: empty, the storage kept.",
  "take": "take(state, key, batch_size: int, *, step=None) -> (state, sample): "
  "the draw sample makes, and the state after it (rows counted as sampled, "
  "queue rows handed out); the state as given for kinds that consume nothing.",
  "kind": "The kind's description for jaxbuf.sharded and checkpoints (jaxbuf._src.core.kind.Kind).",
}
for _name, _doc in _FIELD_DOCS.items():
  getattr(Buffer, _name).__doc__ = _doc


def _without_settings(doc: str | None, settings: dict[str, Any]) -> str | None:
  """`doc` with the Google-style Args entries that name only bound settings
  left out (a name shared with others is dropped from its entry), and a
  closing line naming the settings: `help()` of a bound function then lists
  only what a caller passes."""
  if not doc or not settings:
    return doc
  lines = inspect.cleandoc(doc).splitlines()
  kept: list[str] = []
  args_line, entry_indent, dropping = None, None, False
  for line in lines:
    indent = len(line) - len(line.lstrip())
    if line.strip() == "Args:":
      args_line, entry_indent = len(kept), indent + 2
    elif entry_indent is not None:
      if not line.strip() or indent < entry_indent:
        entry_indent, dropping = None, False  # the section ended
      elif indent == entry_indent:
        names, colon, rest = line.strip().partition(":")
        listed = [name.strip() for name in names.split(",")]
        if colon and all(name.isidentifier() for name in listed):
          remaining = [name for name in listed if name not in settings]
          dropping = not remaining
          line = " " * indent + ", ".join(remaining) + colon + rest
      if dropping:
        continue
    kept.append(line)
  if args_line is not None and (args_line + 1 == len(kept) or not kept[args_line + 1].strip()):
    del kept[args_line]  # every entry was a setting
  while kept and not kept[-1].strip():
    kept.pop()
  return "\n".join(kept) + (
    f"\n\nBound when the buffer was made (not arguments): {', '.join(settings)}."
  )


def documented(function: Callable) -> Callable:
  """`function`, or for a `functools.partial` a plain function calling it,
  named, documented and signed as the function it binds.

  `help(buffer.sample)` then shows the real docstring, with its Args and
  shapes, and the signature and Args without the bound settings, rather than
  `functools.partial`'s docstring; `jax.jit` copies these onto what it returns.
  Passing a bound setting again is a `TypeError` naming it.
  """
  if not isinstance(function, functools.partial):
    return function
  settings = dict(function.keywords)

  def bound(*args, **kwargs):
    # A setting passed again would be traced by the jitted functions (JAX's
    # errors then speak of tracers), and a checked mode switched per call
    # would stage checks that jit cannot run.
    given = sorted(settings.keys() & kwargs.keys())
    if given:
      raise TypeError(
        f"{function.func.__name__}: {', '.join(given)} "
        f"{'is a setting' if len(given) == 1 else 'are settings'} of the "
        f"buffer, bound when it was made; make another buffer to change "
        f"{'it' if len(given) == 1 else 'them'}."
      )
    return function(*args, **kwargs)

  functools.update_wrapper(bound, function.func)
  bound.__doc__ = _without_settings(function.func.__doc__, settings)
  signature = inspect.signature(function)
  bound.__signature__ = signature.replace(  # type: ignore[attr-defined]
    parameters=[
      parameter for name, parameter in signature.parameters.items() if name not in settings
    ]
  )
  # Read by `bound_settings` (e.g. `jaxbuf.sharded` rebinding a buffer's
  # module functions with its settings).
  bound.bound_settings = settings  # type: ignore[attr-defined]
  return bound


def bound_settings(function: Callable) -> dict[str, Any]:
  """The settings a buffer's function was bound with (`documented`), found
  through the wrappers around it (jit, the error explanations)."""
  carrier = inspect.unwrap(function, stop=lambda f: "bound_settings" in getattr(f, "__dict__", {}))
  return dict(getattr(carrier, "__dict__", {}).get("bound_settings", {}))


def _explained(what: str, jitted: Callable, *, batch_size_position: int | None = None) -> Callable:
  """`jitted`, where JAX's error for a common mistake becomes jaxbuf's.

  The mistakes are recognised only after the call failed, so the usual call
  costs one Python frame: a state whose arrays were donated to an earlier
  call (JAX: "Array has been deleted"), and a `batch_size` that is an array
  or traced (JAX: "Non-hashable static arguments").
  """

  def explanation(args, kwargs) -> Exception | None:
    try:
      if args:
        validation.check_not_donated(args[0], what=what)
      if kwargs.get("step") is not None:  # checked traced, named better here
        validation.check_step(kwargs["step"], what=what)
      if batch_size_position is not None:
        validation.check_batch_size(
          args[batch_size_position]
          if len(args) > batch_size_position
          else kwargs.get("batch_size"),
          what=what,
        )
    except (TypeError, ValueError) as ours:
      return ours
    return None

  @functools.wraps(jitted)
  def call(*args, **kwargs):
    try:
      return jitted(*args, **kwargs)
    except Exception:  # pylint: disable=broad-exception-caught
      ours = explanation(args, kwargs)
      if ours is None:
        raise
    # Outside the handler, so that JAX's message is not printed above ours.
    raise ours

  return with_jit_tools(call, jitted)


def with_jit_tools(call: Callable, jitted: Callable) -> Callable:
  """`call`, a wrapper of `jitted`, with the jitted function's own tools
  (`buffer.sample.lower(...)`, its cache size) reachable on it."""
  for name in ("lower", "trace", "eval_shape", "clear_cache", "_cache_size"):
    if hasattr(jitted, name):
      setattr(call, name, getattr(jitted, name))
  return call


def _recording_settings(init: Callable, kind: kind_protocol.Kind) -> Callable:
  """`init`, whose states record the kind's settings."""

  @functools.wraps(init)
  def recording(*args, **kwargs):
    return init(*args, **kwargs).replace(settings=kind.settings)

  return recording


def _checking_settings(function: Callable, kind: kind_protocol.Kind, what: str) -> Callable:
  """`function`, refusing a state made with other settings while tracing."""

  @functools.wraps(function)
  def checking(state, *args, **kwargs):
    kind_protocol.check_settings(state, kind, what=what)
    return function(state, *args, **kwargs)

  return checking


def _sampled_at_step(sample: Callable, what: str = "sample") -> Callable:
  """`sample` (or `take`, named by `what`) that also takes `step=`: draws
  with `fold_in(key, step)`.

  A Python loop then passes one key and its loop counter to every call, and
  never calls `jax.random.split` from Python (20-80 us a call): the fold
  runs inside the sample's own jit. The key stays an argument.
  """

  def sample_at_step(state, key, batch_size, *args, step=None, **kwargs):
    if step is not None:
      validation.check_key(key, what=what)
      validation.check_step(step, what=what)
      key = random.fold_in(key, step)
    return sample(state, key, batch_size, *args, **kwargs)

  functools.update_wrapper(sample_at_step, sample)
  signature = inspect.signature(sample)
  sample_at_step.__signature__ = signature.replace(  # type: ignore[attr-defined]
    parameters=[
      *signature.parameters.values(),
      inspect.Parameter(
        "step", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=int | jax.Array | None
      ),
    ]
  )
  return sample_at_step


def _peek_take(sample: Callable) -> Callable:
  """The `take` of a kind that consumes nothing: `sample`'s draw, and the
  state as it was given (not copied, not donated)."""

  def take(state, key, batch_size, *, step=None):
    return state, sample(state, key, batch_size, step=step)

  functools.update_wrapper(take, sample)
  take.__name__ = take.__qualname__ = "take"
  take.__doc__ = (
    "The draw `sample` makes, and the state as given: this kind counts no "
    "draw (`jaxbuf.Buffer`).\n\n" + (sample.__doc__ or "")
  )
  return take


def bind(
  init: Callable,
  add: Callable,
  sample: Callable,
  update_priorities: Callable,
  can_sample: Callable,
  clear: Callable,
  *,
  kind: kind_protocol.Kind,
  checked: bool,
  take: Callable | None = None,
  jit_update_priorities: bool = True,
  init_shardings: Any = None,
  pack_host_items: bool = True,
  check_host_add: Callable | None = None,
) -> Buffer:
  """Makes a `Buffer` whose default functions are jitted with donated state.

  `kind` describes the buffer (`jaxbuf._src.core.kind`): `init` records its
  settings in the state, and every other function refuses, while tracing, a
  state that records other settings.

  `jit_update_priorities=False` leaves `update_priorities` as given, for an
  update that computes nothing (uniform replay's identity). `init_shardings`
  jits `init` with these output shardings (`jaxbuf.sharded`'s), so that
  `jax.eval_shape(buffer.init, example)` carries them too.
  `pack_host_items=False` sends NumPy items to `add` leaf by leaf rather
  than as one byte array (`_packed_add_from_host`), for an add that places
  them itself (a sharded buffer's, over its devices). `check_host_add`,
  given `add`'s arguments after the state, checks on the host what only
  values show, before the jit (a stream add with `final_steps`: two final
  steps in a row); it is called when the add has more than two of them.

  Donation is what lets a notebook user call `buffer.add` in a plain Python
  loop without paying a copy of the whole storage per call: the state passed
  in is consumed and its arrays are reused for the result. Inside a user's own
  jit the wrappers inline and the user's donation decides.

  Every `sample` also takes `step=` (`_sampled_at_step`), and so does
  `take`. `take`: the kind's own `take(state, key, batch_size) -> (state,
  sample)` for a kind whose draws change its state (jitted with the state
  donated, as `add`); None (the default) for one whose draws change
  nothing: the bound `take` is then `sample`'s draw and the state as given.

  Checked mode keeps the functions unjitted: called eagerly, a failed check
  raises at once; staged inside a jit, it needs `checkify.checkify`.
  """
  validation.check_bool(checked, "checked", what=kind.name)
  init, add, sample, update_priorities, can_sample, clear = map(
    documented, (init, add, sample, update_priorities, can_sample, clear)
  )
  kind = kind._replace(checked=checked)
  init = _recording_settings(init, kind)
  if init_shardings is not None:
    init = jax.jit(init, out_shardings=init_shardings)
  add, sample, update_priorities, can_sample, clear = (
    _checking_settings(function, kind, what)
    for function, what in (
      (add, "add"),
      (sample, "sample"),
      (update_priorities, "update_priorities"),
      (can_sample, "can_sample"),
      (clear, "clear"),
    )
  )
  sample = _sampled_at_step(sample)
  if take is not None:
    take = _sampled_at_step(_checking_settings(documented(take), kind, "take"), "take")
  if checked:
    return Buffer(
      init,
      add,
      sample,
      update_priorities,
      can_sample,
      clear,
      kind,
      _peek_take(sample) if take is None else take,
    )
  jitted_add = jax.jit(add, donate_argnums=0)
  jitted_update = (
    jax.jit(update_priorities, donate_argnums=0) if jit_update_priorities else update_priorities
  )

  # A jit converts host int64 data to int32 by wrapping before any check
  # inside can see it, so host integers are checked on the way in (NumPy
  # items as one packed array, `_packed_add_from_host`). A Python list given
  # for an array (a mask) would reach the jit as one leaf per entry: it
  # becomes the array it stands for first.
  if pack_host_items:
    add_items = host_add.packed_add_from_host(add, jitted_add)
  else:

    def add_items(state, items, *args, **kwargs):
      validation.check_host_integers(items, what="add")
      return jitted_add(state, items, *args, **kwargs)

  @functools.wraps(add)
  def add_from_host(state, items, *args, **kwargs):
    if check_host_add is not None and (len(args) > 2 or kwargs.get("final_steps") is not None):
      check_host_add(items, *args, **kwargs)
    return add_items(
      state,
      items,
      *map(host_add.listed_array, args),
      **{name: host_add.listed_array(value) for name, value in kwargs.items()},
    )

  @functools.wraps(update_priorities)
  def update_priorities_from_host(state, indices, *args, **kwargs):
    validation.check_on_the_states_devices(
      state, (indices, *args, *kwargs.values()), what="update_priorities"
    )
    return jitted_update(
      state,
      validation.host_indices(host_add.listed_array(indices)),
      *map(host_add.listed_array, args),
      **{name: host_add.listed_array(value) for name, value in kwargs.items()},
    )

  sample = _explained(
    "sample", jax.jit(sample, static_argnames="batch_size"), batch_size_position=2
  )
  return Buffer(
    init=init,
    add=_explained("add", add_from_host),
    sample=sample,
    take=_peek_take(sample)
    if take is None
    else _explained(
      "take",
      jax.jit(take, static_argnames="batch_size", donate_argnums=0),
      batch_size_position=2,
    ),
    update_priorities=_explained("update_priorities", update_priorities_from_host),
    can_sample=_explained(
      "can_sample", jax.jit(can_sample, static_argnames="batch_size"), batch_size_position=1
    ),
    clear=_explained("clear", jax.jit(clear, donate_argnums=0)),
    kind=kind,
  )
