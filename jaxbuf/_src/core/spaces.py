"""Example items from gymnasium spaces, for `buffer.init`.

gymnasium is imported only when a space is converted: it is never a
dependency of jaxbuf itself.
"""

from typing import Any

import numpy as np

from jaxbuf._src.core.base import PyTree


def _gymnasium_spaces() -> Any:
  try:
    import gymnasium.spaces  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(
      "example_from_space needs gymnasium: pip install gymnasium (or jaxbuf[examples])."
    ) from error
  return gymnasium.spaces


def example_from_space(space: Any) -> PyTree:
  """An example item shaped like one element of a gymnasium `space`.

  Zeros of the space's own shape and dtype, NumPy arrays nested as the space
  is: what `buffer.init` reads to lay out its storage, so the env's
  observations and actions then add without a cast. JAX stores 64-bit dtypes
  (`Discrete`'s int64) as 32-bit ones unless 64-bit mode is on; `add` checks
  that the values fit.

  Args:
    space: a `Box`, `Discrete`, `MultiDiscrete`, `MultiBinary`, or a `Dict`
      or `Tuple` of them, nested to any depth. For a vector env pass its
      `single_observation_space` / `single_action_space`: the example is one
      unbatched item.

  Returns:
    `np.zeros(space.shape, space.dtype)` for a leaf space (shape `()` for
    `Discrete`); a dict with the `Dict`'s keys, or a tuple, of the same.

  Raises:
    TypeError: for any other space (`Text`, `Graph`, `Sequence`, `OneOf`:
      their elements have no fixed shape), naming where in the space it is.

  >>> import gymnasium, jaxbuf
  >>> space = gymnasium.spaces.Dict(
  ...     {"image": gymnasium.spaces.Box(0, 255, (2, 2), "uint8"),
  ...      "action": gymnasium.spaces.Discrete(3)})
  >>> example = jaxbuf.example_from_space(space)
  >>> example["image"].dtype, example["action"].shape, example["action"].dtype
  (dtype('uint8'), (), dtype('int64'))
  """
  return _example(space, _gymnasium_spaces(), path="space")


def _example(space: Any, spaces: Any, *, path: str) -> PyTree:
  if isinstance(space, spaces.Dict):
    return {
      key: _example(subspace, spaces, path=f"{path}[{key!r}]")
      for key, subspace in space.spaces.items()
    }
  if isinstance(space, spaces.Tuple):
    return tuple(
      _example(subspace, spaces, path=f"{path}[{index}]")
      for index, subspace in enumerate(space.spaces)
    )
  if isinstance(space, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
    return np.zeros(space.shape, space.dtype)
  raise TypeError(
    f"example_from_space: {path} is a {type(space).__name__}, whose "
    f"elements have no fixed shape and dtype; supported: Box, Discrete, "
    f"MultiDiscrete, MultiBinary, and Dict or Tuple of them."
  )
