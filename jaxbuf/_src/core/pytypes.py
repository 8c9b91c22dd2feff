"""Type aliases every module may use; the bottom of the import graph."""

from typing import Any, Callable

import jax

PyTree = Any
Schedule = Callable[[jax.Array], jax.Array]
