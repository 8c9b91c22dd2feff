"""The types every buffer kind shares (`BufferState`, `Buffer`,
`ReplaySample`) and `bind`, which makes a kind's functions into a `Buffer`.

Shape key: S sample size.
"""

import functools
import inspect
from typing import Any, Callable, NamedTuple

import flax.struct
import jax

from jaxbuf._src import kind as kind_protocol
from jaxbuf._src import validation
from jaxbuf._src.pytypes import PyTree, Schedule  # pylint: disable=unused-import


@flax.struct.dataclass
class BufferState:
  """The base of every buffer state: a frozen pytree of arrays.

  A state knows the sizes its buffer was made with, read from its array
  shapes, so that `jaxbuf.load` can name a mismatch (a capacity, a number of
  envs) without a switch over buffer kinds; and, in its static `settings`,
  the bound settings its bookkeeping depends on (`jaxbuf._src.kind`).
  """
  settings: kind_protocol.Settings = flax.struct.field(
      pytree_node=False, default=kind_protocol.NO_SETTINGS, kw_only=True)

  def buffer_dims(self) -> dict[str, Any]:
    """The sizes the buffer was made with: `{"capacity": C, ...}`.

    A state vmapped over many buffers reports them as `"vmapped buffers"`.
    """
    return {}


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
  """
  if not isinstance(function, functools.partial):
    return function

  def bound(*args, **kwargs):
    return function(*args, **kwargs)

  functools.update_wrapper(bound, function.func)
  bound.__signature__ = inspect.signature(function)
  return bound


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


def bind(init: Callable, add: Callable, sample: Callable,
         update_priorities: Callable, can_sample: Callable, clear: Callable, *,
         kind: kind_protocol.Kind, checked: bool,
         jit_update_priorities: bool = True) -> Buffer:
  """Makes a `Buffer` whose default functions are jitted with donated state.

  `kind` describes the buffer (`jaxbuf._src.kind`): `init` records its
  settings in the state, and every other function refuses, while tracing, a
  state that records other settings.

  `jit_update_priorities=False` leaves `update_priorities` as given, for an
  update that computes nothing (uniform replay's identity).

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
  # inside can see it, so host integers are checked on the way in.
  @functools.wraps(add)
  def add_from_host(state, items, *args, **kwargs):
    validation.check_host_integers(items, what="add")
    return jitted_add(state, items, *args, **kwargs)

  @functools.wraps(update_priorities)
  def update_priorities_from_host(state, indices, *args, **kwargs):
    return jitted_update(state, validation.host_indices(indices), *args,
                         **kwargs)

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
