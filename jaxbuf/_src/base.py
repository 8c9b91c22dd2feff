"""The types every buffer kind shares (`BufferState`, `Buffer`,
`ReplaySample`) and `bind`, which makes a kind's functions into a `Buffer`.

Shape key: S sample size.
"""

import functools
import inspect
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import numpy as np

from jaxbuf._src import kind as kind_protocol
from jaxbuf._src import validation
from jaxbuf._src.kind import BufferState  # pylint: disable=unused-import
from jaxbuf._src.pytypes import PyTree, Schedule  # pylint: disable=unused-import


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
      settings=kind_protocol.settings_of(**settings, devices=devices))


@flax.struct.dataclass
class ReplaySample:
  """A batch drawn from a replay buffer."""
  items: PyTree          # each leaf [S, *item_shape]
  indices: jax.Array     # int32 [S]: slots in the storage
  weights: jax.Array     # float32 [S]: importance weights, largest at most 1
  item_ids: jax.Array    # uint32 [S]: which write filled each slot; pass to
                         # update_priorities so stale updates are skipped


class Buffer(NamedTuple):
  """The functions of one replay buffer kind, hyperparameters bound.

  Every replay kind has the same fields, so a training script switches between
  them by changing the line that makes the buffer. `kind` describes the kind
  to the code around it (`jaxbuf.sharded`, checkpoints): `jaxbuf._src.kind`.
  """
  init: Callable[[PyTree], Any]
  add: Callable[..., Any]
  sample: Callable[..., ReplaySample]
  update_priorities: Callable[..., Any]
  can_sample: Callable[..., jax.Array]
  clear: Callable[[Any], Any]
  kind: kind_protocol.Kind | None = None


def documented(function: Callable) -> Callable:
  """`function`, or for a `functools.partial` a plain function calling it,
  named, documented and signed as the function it binds.

  `help(buffer.sample)` then shows the real docstring, with its Args and
  shapes, and the signature without the bound settings, rather than
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
          f"{'it' if len(given) == 1 else 'them'}.")
    return function(*args, **kwargs)

  functools.update_wrapper(bound, function.func)
  signature = inspect.signature(function)
  bound.__signature__ = signature.replace(parameters=[
      parameter for name, parameter in signature.parameters.items()
      if name not in settings])
  # Read by `bound_settings` (e.g. `jaxbuf.sharded` rebinding a buffer's
  # module functions with its settings).
  bound.bound_settings = settings
  return bound


def bound_settings(function: Callable) -> dict[str, Any]:
  """The settings a buffer's function was bound with (`documented`), found
  through the wrappers around it (jit, the error explanations)."""
  carrier = inspect.unwrap(
      function, stop=lambda f: "bound_settings" in getattr(f, "__dict__", {}))
  return dict(getattr(carrier, "__dict__", {}).get("bound_settings", {}))


def _explained(what: str, jitted: Callable, *,
               batch_size_position: int | None = None) -> Callable:
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
      if batch_size_position is not None:
        validation.check_batch_size(
            args[batch_size_position] if len(args) > batch_size_position
            else kwargs.get("batch_size"), what=what)
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

  # A jitted function's own tools (`buffer.sample.lower(...)`) stay reachable.
  for name in ("lower", "trace", "eval_shape", "clear_cache"):
    if hasattr(jitted, name):
      setattr(call, name, getattr(jitted, name))
  return call


def _recording_settings(init: Callable, kind: kind_protocol.Kind) -> Callable:
  """`init`, whose states record the kind's settings."""
  @functools.wraps(init)
  def recording(*args, **kwargs):
    return init(*args, **kwargs).replace(settings=kind.settings)
  return recording


def _checking_settings(function: Callable, kind: kind_protocol.Kind,
                       what: str) -> Callable:
  """`function`, refusing a state made with other settings while tracing."""
  @functools.wraps(function)
  def checking(state, *args, **kwargs):
    kind_protocol.check_settings(state, kind, what=what)
    return function(state, *args, **kwargs)
  return checking


def _listed_array(value: Any) -> Any:
  """A plain Python list or tuple as a NumPy array; anything else as given
  (a NamedTuple is a pytree, not a list of numbers)."""
  if type(value) in (list, tuple):  # pylint: disable=unidiomatic-typecheck
    return np.asarray(value)
  return value


def bind(init: Callable, add: Callable, sample: Callable,
         update_priorities: Callable, can_sample: Callable, clear: Callable, *,
         kind: kind_protocol.Kind, checked: bool,
         jit_update_priorities: bool = True,
         init_shardings: Any = None) -> Buffer:
  """Makes a `Buffer` whose default functions are jitted with donated state.

  `kind` describes the buffer (`jaxbuf._src.kind`): `init` records its
  settings in the state, and every other function refuses, while tracing, a
  state that records other settings.

  `jit_update_priorities=False` leaves `update_priorities` as given, for an
  update that computes nothing (uniform replay's identity). `init_shardings`
  jits `init` with these output shardings (`jaxbuf.sharded`'s), so that
  `jax.eval_shape(buffer.init, example)` carries them too.

  Donation is what lets a notebook user call `buffer.add` in a plain Python
  loop without paying a copy of the whole storage per call: the state passed
  in is consumed and its arrays are reused for the result. Inside a user's own
  jit the wrappers inline and the user's donation decides.

  Checked mode keeps the functions unjitted: called eagerly, a failed check
  raises at once; staged inside a jit, it needs `checkify.checkify`.
  """
  init, add, sample, update_priorities, can_sample, clear = map(
      documented, (init, add, sample, update_priorities, can_sample, clear))
  kind = kind._replace(checked=checked)
  init = _recording_settings(init, kind)
  if init_shardings is not None:
    init = jax.jit(init, out_shardings=init_shardings)
  add, sample, update_priorities, can_sample, clear = (
      _checking_settings(function, kind, what) for function, what in (
          (add, "add"), (sample, "sample"),
          (update_priorities, "update_priorities"),
          (can_sample, "can_sample"), (clear, "clear")))
  if checked:
    return Buffer(init, add, sample, update_priorities, can_sample, clear,
                  kind)
  jitted_add = jax.jit(add, donate_argnums=0)
  jitted_update = (jax.jit(update_priorities, donate_argnums=0)
                   if jit_update_priorities else update_priorities)

  # A jit converts host int64 data to int32 by wrapping before any check
  # inside can see it, so host integers are checked on the way in. A Python
  # list given for an array (a mask, priorities) would reach the jit as one
  # leaf per entry: it becomes the array it stands for first.
  @functools.wraps(add)
  def add_from_host(state, items, *args, **kwargs):
    validation.check_host_integers(items, what="add")
    return jitted_add(state, items, *map(_listed_array, args),
                      **{name: _listed_array(value)
                         for name, value in kwargs.items()})

  @functools.wraps(update_priorities)
  def update_priorities_from_host(state, indices, *args, **kwargs):
    validation.check_on_the_states_devices(
        state, (indices, *args, *kwargs.values()), what="update_priorities")
    return jitted_update(
        state, validation.host_indices(_listed_array(indices)),
        *map(_listed_array, args),
        **{name: _listed_array(value) for name, value in kwargs.items()})

  return Buffer(
      init=init,
      add=_explained("add", add_from_host),
      sample=_explained("sample", jax.jit(sample, static_argnames="batch_size"),
                        batch_size_position=2),
      update_priorities=_explained("update_priorities",
                                   update_priorities_from_host),
      can_sample=_explained("can_sample",
                            jax.jit(can_sample, static_argnames="batch_size"),
                            batch_size_position=1),
      clear=_explained("clear", jax.jit(clear, donate_argnums=0)),
      kind=kind,
  )
