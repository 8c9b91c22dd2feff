"""What travels between a remote caller and the learner's server: chunks of
items, PRNG keys, replies, and the checks the ingress makes on what came in.

Host NumPy and Python values only (pickled by Ray): a chunk's leaves are
NumPy arrays (a caller's JAX arrays are copied to the host first), a key is
its raw data and its implementation's name, an exception is itself.
"""

from typing import Any

import jax
import numpy as np

from jaxbuf._src.core.pytypes import PyTree
from jaxbuf._src.service.closed import ServiceClosed

# Chunks up to this size travel inline in the call (Ray inlines small
# arguments too); larger ones are put in Ray's object store once by the
# caller and fetched from there by the learner's process, never copied by
# the broker in between.
INLINE_BYTES = 64 * 1024

# The dtype kinds an item leaf may have: bool, signed and unsigned ints,
# floats, complex (JAX holds them all; objects and strings it cannot).
_ARRAY_KINDS = "biufc"


def host_tree(tree: PyTree) -> PyTree:
  """`tree` with its array leaves as NumPy arrays (JAX arrays copied to
  the host), other leaves as they are (the ingress refuses what is not an
  array)."""
  return jax.tree.map(
    lambda leaf: np.asarray(leaf) if isinstance(leaf, (jax.Array, np.ndarray)) else leaf, tree
  )


def tree_bytes(tree: PyTree) -> int:
  """The bytes of a tree's array leaves."""
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if isinstance(leaf, np.ndarray))


def checked_arrays(what: str, name: str, tree: PyTree) -> PyTree:
  """`tree` (as received) with every leaf a NumPy array of a kind JAX holds.

  Raises:
    TypeError: a leaf that is no number, bool or array of them (a string,
      an object array, an arbitrary Python object), naming its path.
  """
  if tree is None:
    return None

  def checked(path, leaf):
    if isinstance(leaf, (bool, int, float, complex, np.generic, np.ndarray)):
      array = np.asarray(leaf)
      if array.dtype.kind in _ARRAY_KINDS:
        return array
      given = f"an array of dtype {array.dtype}"
    else:
      given = f"a {type(leaf).__name__}"
    raise TypeError(
      f"{what}: {name}{jax.tree_util.keystr(path)} is {given}; a remote add takes arrays of "
      "numbers or bools (NumPy or JAX), as buffer.add does."
    )

  return jax.tree_util.tree_map_with_path(checked, tree)


def encoded_key(key: Any) -> tuple:
  """A PRNG key as `(implementation name or None, raw uint32 data)`."""
  if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return (str(jax.random.key_impl(key)), np.asarray(jax.random.key_data(key)))
  return (None, np.asarray(key))


def decoded_key(encoded: tuple) -> jax.Array:
  impl, data = encoded
  if impl is None:
    return jax.numpy.asarray(data)
  return jax.random.wrap_key_data(data, impl=impl)


def raised(reply: tuple[str, Any], served_as: str) -> Any:
  """A reply's value, or its error raised in the caller.

  The service's own exceptions come back as themselves (a bad leaf's
  `ValueError` naming the leaf, a limiter's `TimeoutError`, `ServiceClosed`),
  with a note saying where they were raised.
  """
  status, value = reply
  if status == "ok":
    return value
  if status == "closed":
    raise ServiceClosed(f"{served_as}: {value}")
  if status == "timeout":
    raise TimeoutError(f"{served_as}: {value}")
  if status == "error" and isinstance(value, BaseException):
    value.add_note(f"(raised by the ReplayService in the learner's process, {served_as})")
    raise value
  raise RuntimeError(f"{served_as}: a malformed reply {reply!r}.")
