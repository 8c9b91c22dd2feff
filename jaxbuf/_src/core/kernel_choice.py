"""Which kernels a program runs: Pallas kernels or XLA operations, chosen by
the platform the program is lowered for.

On a GPU a tree's descent or write as XLA operations is a chain of dependent
launches, several per level; as a Pallas (Triton) kernel it is one launch.
On a CPU the XLA operations are the fast form, and on a TPU the kernels
(written for Triton) do not apply. The choice is made when a program is
lowered (`lax.platform_dependent`), by its target, not by the process's
default backend: a program compiled for an H100 on a machine without one (a
deviceless compile, `benchmarks/device/kernel_counts.py`) gets the GPU's
kernels. Variants: "xla", the XLA operations; "pallas_descent", the draw and
descent kernels alone; "pallas", every kernel. The environment variable
`JAXBUF_SUM_TREE_KERNELS` forces one everywhere (on a CPU the kernels then run
in Pallas's interpret mode: slow, for tests, which check every kernel against
its XLA twin bit for bit).
"""

import functools
import os
from typing import Any, Callable

import jax

KERNEL_VARIANTS = ("xla", "pallas_descent", "pallas")
KERNEL_VARIANT_VARIABLE = "JAXBUF_SUM_TREE_KERNELS"
# The variant each compile target uses unless the variable forces one, keyed
# by the platform the program is lowered for: a GPU program compiled in a
# process whose default backend is the CPU (a deviceless compile) still gets
# the GPU's kernels. A platform missing here uses "xla"; on a TPU the Pallas
# kernels (written for Triton) are not used.
BACKEND_KERNELS: dict[str, str] = {"cpu": "xla", "cuda": "pallas"}


def forced_kernel_variant() -> str | None:
  """The variant `JAXBUF_SUM_TREE_KERNELS` forces on every platform, or None.

  Read while tracing: a function already jitted keeps the variant it was
  traced with. Forced Pallas kernels run in Pallas's interpret mode unless
  the default backend is a GPU (slow: for tests and benchmarks).

  Raises:
    ValueError: if the variable names no variant.
  """
  forced = os.environ.get(KERNEL_VARIANT_VARIABLE, "")
  if forced and forced not in KERNEL_VARIANTS:
    raise ValueError(
      f"{KERNEL_VARIANT_VARIABLE}={forced!r} names no sum tree kernel variant; "
      f"expected one of {KERNEL_VARIANTS} (or unset, for each platform's default)."
    )
  return forced or None


def kernel_variant(platform: str | None = None) -> str:
  """The sum tree kernel variant a program lowered for `platform` (default:
  the default backend's) uses: the forced one, else `BACKEND_KERNELS`'s."""
  platform = platform or jax.default_backend()
  return forced_kernel_variant() or BACKEND_KERNELS.get(platform, "xla")


def choose_kernel(
  xla: Callable[..., Any],
  kernel: Callable[..., Any],
  *operands: Any,
  kernel_variants: tuple[str, ...],
) -> Any:
  """`kernel(*operands, interpret=...)` where the compile target's variant is
  one of `kernel_variants`, else `xla(*operands)`; both return the same.

  The choice is made when the program is lowered (`lax.platform_dependent`),
  so one traced function serves a CPU and a GPU, and only the chosen branch
  is compiled. Inside `jax.shard_map` (operands varying over a mesh axis)
  or over operands typed with an explicit mesh the XLA form serves: the
  interpreter refuses the kernels' mix of per-device and shared values,
  Pallas's batching rule a vmap over a mesh axis, and they are untried on a
  GPU mesh.
  """
  if _in_manual_mesh(*jax.tree.leaves(operands)):
    return xla(*operands)
  forced = forced_kernel_variant()
  if forced is not None:
    if forced not in kernel_variants:
      return xla(*operands)
    return kernel(*operands, interpret=jax.default_backend() != "gpu")
  branches = {
    platform: functools.partial(kernel, interpret=False)
    for platform, variant in BACKEND_KERNELS.items()
    if variant in kernel_variants
  }
  if not branches:
    return xla(*operands)
  return jax.lax.platform_dependent(*operands, default=xla, **branches)


def _in_manual_mesh(*arrays: jax.Array) -> bool:
  """Whether any of `arrays` varies over a mesh axis (traced inside
  `jax.shard_map`: a sharded buffer) or is typed with a mesh (explicit
  sharding, whose vmap the Pallas batching rule does not follow)."""
  return any(
    jax.typeof(array).manual_axis_type.varying or not jax.typeof(array).sharding.mesh.empty
    for array in arrays
  )
