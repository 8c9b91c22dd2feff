"""The types every buffer kind shares: `PyTree`, `Schedule`, `BufferState`,
`Buffer`, `ReplaySample`.

Shape key: S sample size.
"""

from typing import Any, Callable, NamedTuple

import flax.struct
import jax

PyTree = Any
Schedule = Callable[[jax.Array], jax.Array]


@flax.struct.dataclass
class BufferState:
  """The base of every buffer state: a frozen pytree of arrays.

  A state knows the sizes its buffer was made with, read from its array
  shapes, so that `jaxbuf.load` can name a mismatch (a capacity, a number of
  envs) without a switch over buffer kinds.
  """

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
  them by changing the line that makes the buffer.
  """
  init: Callable[[PyTree], Any]
  add: Callable[..., Any]
  sample: Callable[..., ReplaySample]
  update_priorities: Callable[..., Any]
  can_sample: Callable[..., jax.Array]
  clear: Callable[[Any], Any]


def bind(init: Callable, add: Callable, sample: Callable,
         update_priorities: Callable, can_sample: Callable, clear: Callable, *,
         checked: bool, jit_update_priorities: bool = True) -> Buffer:
  """Makes a `Buffer` whose default functions are jitted with donated state.

  `jit_update_priorities=False` leaves `update_priorities` as given, for an
  update that computes nothing (uniform replay's identity).

  Donation is what lets a notebook user call `buffer.add` in a plain Python
  loop without paying a copy of the whole storage per call: the state passed
  in is consumed and its arrays are reused for the result. Inside a user's own
  jit the wrappers inline and the user's donation decides.

  Checked mode keeps the functions unjitted: called eagerly, a failed check
  raises at once; staged inside a jit, it needs `checkify.checkify`.
  """
  if checked:
    return Buffer(init, add, sample, update_priorities, can_sample, clear)
  return Buffer(
      init=init,
      add=jax.jit(add, donate_argnums=0),
      sample=jax.jit(sample, static_argnames="batch_size"),
      update_priorities=(jax.jit(update_priorities, donate_argnums=0)
                         if jit_update_priorities else update_priorities),
      can_sample=jax.jit(can_sample, static_argnames="batch_size"),
      clear=jax.jit(clear, donate_argnums=0),
  )
