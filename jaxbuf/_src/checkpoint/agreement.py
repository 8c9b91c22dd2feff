"""Agreement between the processes of a multi-process save or load.

Part of `jaxbuf.save` / `load` (`saving.py` maps the rooms). Every step
of a multi-process save or load that can fail in some processes only ends in
an agreement: each process reports how its step went, and if any failed,
every process raises. So no process ever waits in a collective that another,
having raised, will never reach. With one process these are no-ops.
"""

import json
from typing import Any, Callable, TypeVar, cast

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxbuf._src.checkpoint import layout as layouts

_ERROR_TYPES = {
  error.__name__: error
  for error in (
    ValueError,
    TypeError,
    FileExistsError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    BlockingIOError,
    OSError,
  )
}


def gather(payload: Any) -> list[Any]:
  """Every process's JSON-serialisable `payload`, in process order (a collective)."""
  data = np.frombuffer(json.dumps(payload).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
  # A power-of-two width, so that only a few shapes are ever compiled.
  width = 1 << max(8, int(sizes.max() - 1).bit_length())
  padded = np.zeros(width, np.uint8)
  padded[: data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), width)
  return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes)]


def _agree(caller: str, error: Exception | None, payload: Any) -> list[Any]:
  """Every process's `payload`, or an error in every process if any step failed.

  The failing process raises its own exception; the others raise the same type
  naming the failing process and its message.
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return [payload]
  mine = None if error is None else [type(error).__name__, str(error)]
  outcomes = gather({"error": mine, "payload": payload})
  if error is not None:
    raise error
  for process, outcome in enumerate(outcomes):
    if outcome["error"] is not None:
      kind, message = outcome["error"]
      raise _ERROR_TYPES.get(kind, RuntimeError)(
        f"{caller}: process {process} failed ({kind}), so every process stops: {message}"
      )
  return [outcome["payload"] for outcome in outcomes]


_Result = TypeVar("_Result")


def in_every_process(
  caller: str, step: Callable[[], _Result], share: Callable[[Any], Any] = lambda _: None
) -> tuple[_Result, list[Any]]:
  """Runs `step` here, then agrees: its result and every process's `share(result)`."""
  try:
    result, error = step(), None
  except Exception as caught:  # pylint: disable=broad-except
    # Reported to every process by `_agree`, which re-raises it here.
    result, error = cast(_Result, None), caught
  return result, _agree(caller, error, None if error is not None else share(result))


def check_processes_agree(caller: str, shared: list[dict[str, Any]]) -> None:
  """Raises (in every process alike) unless all passed the same path and tree."""
  first = shared[0]
  for process, other in enumerate(shared[1:], 1):
    if other["path"] != first["path"]:
      raise ValueError(
        f"{caller}: the processes disagree on the path: process 0 has "
        f"{first['path']}, process {process} has {other['path']}; every "
        "process must pass the same path, on a filesystem all of them see."
      )
    if other["layout"] != first["layout"]:
      difference = layouts.layout_difference(first["layout"], other["layout"])
      raise ValueError(
        f"{caller}: the processes disagree on the state: process 0 and "
        f"process {process} have {difference}."
      )


def check_global(named: list[tuple[str, Any]]) -> None:
  """In a multi-process save, every leaf must be one array over all processes."""
  if jax.process_count() == 1:
    return
  for name, leaf in named:
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      raise ValueError(
        f"save: leaf {name} is a {type(leaf).__name__} held by this process "
        "alone; in a multi-process save every leaf must be a global "
        "jax.Array spanning the processes (e.g. made with "
        "jax.make_array_from_process_local_data, or placed with a "
        "NamedSharding over a mesh of jax.devices())."
      )
