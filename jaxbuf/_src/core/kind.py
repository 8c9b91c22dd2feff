"""The protocol of a buffer kind: what a kind says about itself, so that the
code around the kinds (binding, `jaxbuf.sharded`, `jaxbuf.save` / `load`,
the conformance tests) needs no per-kind code.

Shape key: S sample size, D devices on the mesh axis.

A kind is what a factory such as `prioritized_replay(capacity, alpha=...)`
makes: its module functions with the settings bound, in a `Buffer`, and a
`Kind` record, `buffer.kind`, that describes them. The record is small, as
optax's `GradientTransformation` is: a name, the state type, the settings,
and how the kind splits over devices.

Settings. `Kind.settings` holds the bound settings that a state's
bookkeeping depends on (its capacity or number of envs, alpha and eps of the
priorities stored, sequence length, period and episode mode of the windows
counted), as sorted `(name, value)` pairs of Python scalars and strings.
`init` records them in the state's static `settings` field (part of the
pytree structure, so vmapped, scanned and jitted states keep them at no
cost); every function of the buffer checks them while tracing and a state of
a buffer made with other settings is a `ValueError` naming each setting that
differs and both values, before anything runs. Checkpoints store them and
`load` compares them the same way. Settings that only shape a sample (beta,
stratification, checked mode) are not recorded: a state may be sampled with
any of them. A state made by a module's `init` directly (`jaxbuf.frames.init`)
records none: a module `init` does not take every setting (frame-stack
replay's `num_stack`, the priorities' alpha and eps), so it cannot record
them. Such a state is for the module functions, which take every setting
explicitly, so their caller answers for them; a bound buffer whose kind has
settings refuses it (`ValueError`), since it cannot check the settings the
state's bookkeeping was kept with (a stack-of-2 buffer used to sample a
state a stack-of-3 buffer had filled). Make states with `buffer.init`.

Splitting over devices. `Kind.split(num_devices)` returns a `Split`: the
kind's functions for one device's part (capacity or envs divided by D) and
what `jaxbuf.sharded` needs to draw one exact sample over all devices from
the D local ones (the mass or count of what each device can sample, how to
find the rank-th id, how to gather rows, with a key for a draw that belongs
with them). `split` is None for a kind that cannot be split. A state of a
split kind also knows how to regroup itself
(`BufferState.joined`, the D local states as one unsharded state, and
`divided`, the inverse), which is how `jaxbuf.load` reshards a checkpoint
over another number of devices. A new kind provides its `Kind` (and, if it
splits, overrides `joined` / `divided` where its state adds fields), and
none of the code around the kinds changes. (A stream kind's factory and
split sit in `streams/factories.py` and `streams/device_split.py`, beside
the other stream kinds', above its own module.)
"""

import inspect
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Self

import flax.struct

Settings = tuple[tuple[str, Any], ...]
NO_SETTINGS: Settings = ()


def settings_of(**settings: Any) -> Settings:
  """`settings` as the sorted pairs a `Kind` and a state record."""
  return tuple(sorted(settings.items()))


@flax.struct.dataclass
class BufferState:
  """The base of every buffer state: a frozen pytree of arrays.

  A state knows the sizes its buffer was made with, read from its array
  shapes, so that `jaxbuf.load` can name a mismatch (a capacity, a number of
  envs) without a switch over buffer kinds; and, in its static `settings`,
  the bound settings its bookkeeping depends on (this module).
  """

  settings: Settings = flax.struct.field(pytree_node=False, default=NO_SETTINGS, kw_only=True)

  if TYPE_CHECKING:
    # flax.struct.dataclass adds `replace` to every state class at runtime;
    # declared here so that type checkers know it returns the same type.
    def replace(self, **updates: Any) -> Self: ...

  def buffer_dims(self) -> dict[str, Any]:
    """The sizes the buffer was made with: `{"capacity": C, ...}`.

    A state vmapped over many buffers reports them as `"vmapped buffers"`.
    """
    return {}

  def joined(self) -> Self:
    """The stack of D devices' local states (leaves `[D, ...]`) as the state
    of one unsharded buffer holding the same items, priorities and counts.
    Kinds that `jaxbuf.sharded` can split override it and `divided`."""
    raise ValueError(f"{type(self).__name__} cannot be regrouped over another number of devices.")

  def divided(self, num_devices: int) -> Self:
    """This unsharded state as the stack of `num_devices` local states, the
    inverse of `joined`; raises naming the reason where no exact split exists."""
    raise ValueError(f"{type(self).__name__} cannot be regrouped over another number of devices.")


class Split(NamedTuple):
  """A kind as `jaxbuf.sharded` runs it on one device's part.

  `state` below is one device's local state or a stack of them (leaves
  `[D, ...]`); ids are slots (item replay) or window ids (sequence replay),
  local to the device.
  """

  init: Callable  # example -> local state (sizes divided by D)
  add: Callable  # local state, *add arguments -> local state
  add_arguments: Callable  # (*args, **kwargs) of the buffer's add, after
  # the state -> the arguments as a tuple, in order,
  # each split over devices along its axis 0
  check_add: Callable  # stacked state, arguments -> None; raises as the
  # unsharded buffer would, with the global sizes
  sample: Callable  # local state, key, S -> its sample (local mode)
  update_priorities: Callable | None  # None: the identity (uniform kinds)
  clear: Callable  # local state -> local state
  local_counter: Callable  # state -> an int array [*stack, *counter_shape]
  counter_shape: tuple[int, ...]  # that array's shape on one device
  ids_per_device: Callable  # stacked state -> int (static)
  held: Callable  # state -> int32 [*stack]: items or windows sampleable
  enough: Callable  # held, S -> bool: the kind's can_sample
  masses: Callable | None  # local state -> SumTree, a leaf per id; None: draw
  # uniformly by rank
  at_rank: Callable  # local state, int32 [S] ranks -> int32 [S] ids
  rows: Callable  # local state, ids [S], key -> the rows to send, a
  # pytree; the key, the same on every device, is
  # for a random draw that must be made where the
  # rows are held (hindsight goals); most ignore it
  item_ids: Callable  # local state, ids [S] -> uint32 [S]
  as_sample: Callable  # rows, indices, weights, item_ids, drawn -> the
  # sample; drawn: bool (), something could be drawn
  check_update: Callable | None  # indices, priorities -> None, raising as
  # the unsharded update would; None: nothing
  beta: Any  # float or schedule; None: weights 1 (uniform kinds)
  stratified: bool  # one target per equal stratum of the global total
  uniform_when_massless: bool  # all leaves 0: uniform over items held
  # (item replay) or id 0 with weight 0


class Kind(NamedTuple):
  """What a buffer kind says about itself; `buffer.kind`."""

  name: str  # the factory's name, e.g. "prioritized_replay"
  state_type: type[Any]  # the class of its states
  exact_type: bool  # whether subclasses of state_type are refused
  settings: Settings  # recorded in each state, checked on every call
  split: Callable[[int], Split] | None  # num_devices -> Split; None: the
  # kind cannot be split over devices
  checked: bool = False  # the buffer raises on run-time violations (set
  # by `bind`)


def add_arguments_of(add: Callable) -> Callable:
  """`(*args, **kwargs) -> tuple`: what a call of `add(state, ...)` passes
  after the state, in `add`'s order, defaults filled (`Split.add_arguments`),
  with `add`'s signature, so a wrapper shows the kind's own arguments."""
  parameters = [
    parameter
    for parameter in list(inspect.signature(add).parameters.values())[1:]
    if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
  ]
  signature = inspect.Signature(parameters)

  def add_arguments(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())

  add_arguments.__signature__ = signature  # type: ignore[attr-defined]
  return add_arguments


def settings_difference(
  recorded: Settings | dict[str, Any],
  expected: Settings | dict[str, Any],
  *,
  labels: tuple[str, str] = ("state", "buffer"),
) -> str:
  """The settings that differ, `"alpha: state 0.6, buffer 1.0"`; '' if none.

  A setting only one side has (a state of a sharded buffer given to an
  unsharded one) shows as "none" on the other.
  """
  recorded, expected = dict(recorded), dict(expected)
  names = sorted(set(recorded) | set(expected))
  return "; ".join(
    f"{name}: {labels[0]} {recorded.get(name, 'none')!r}, {labels[1]} "
    f"{expected.get(name, 'none')!r}"
    for name in names
    if recorded.get(name, None) != expected.get(name, None)
  )


def check_settings(state: Any, kind: Kind, *, what: str) -> None:
  """Raises `ValueError` if `state` was made by a buffer with other settings,
  or records none (made by a module's `init`) where the kind has some.

  A state of another type passes: the function's own type check names both
  types.
  """
  recorded = getattr(state, "settings", NO_SETTINGS)
  if kind.exact_type and type(state) is not kind.state_type and isinstance(state, kind.state_type):
    # A state of a kind built on this one (frame-stack on prioritized
    # sequence replay): another kind, not other settings.
    raise TypeError(
      f"{what}: expected a {kind.state_type.__name__}, given a "
      f"{type(state).__name__}; pass each buffer's state to its own "
      f"functions ({kind.name}'s state to {kind.name}'s)."
    )
  of_the_kind = (
    type(state) is kind.state_type if kind.exact_type else isinstance(state, kind.state_type)
  )
  if recorded == kind.settings or not of_the_kind:
    return
  if recorded == NO_SETTINGS:
    raise ValueError(
      f"{what}: this state records no settings (it was made by a module-level "
      "init such as jaxbuf.frames.init, or loaded with such a `like`), so "
      f"this {kind.name} buffer cannot check "
      f"that it was made with this buffer's settings "
      f"({', '.join(f'{name} {value!r}' for name, value in kind.settings)}), "
      "which its bookkeeping depends on. Make the state with buffer.init, or "
      "call the module functions, which take every setting explicitly."
    )
  state_devices = dict(recorded).get("devices")
  buffer_devices = dict(kind.settings).get("devices")
  if buffer_devices is None and state_devices is not None:
    # A stack of states: the function's own check names it
    # (`validation.check_state_kind`), as for a stack made under vmap.
    return
  if state_devices != buffer_devices and state_devices is None:
    raise ValueError(
      f"{what}: expected a sharded state, split over {buffer_devices} "
      f"devices; given the state of an unsharded buffer. Make it with the "
      f"sharded buffer's init."
    )
  raise ValueError(
    f"{what}: this state was made by a buffer with other settings than "
    f"this {kind.name} buffer's "
    f"({settings_difference(recorded, kind.settings)}); its "
    f"bookkeeping depends on them, so pass each state to the buffer that "
    f"made it (or one made with the same settings)."
  )
