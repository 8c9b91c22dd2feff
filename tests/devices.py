"""Tests that need several devices of the default backend.

The CPU suite has four fake devices (the root conftest's XLA flag), so these
tests always run in CI. A machine whose default backend shows fewer (one GPU)
skips them with the reason, never fails them: the suite runs there unchanged.
"""

import jax
import pytest

CPU_SUITE_DEVICES = 4


def enough(count: int = CPU_SUITE_DEVICES) -> bool:
  return jax.device_count() >= count


def needs(count: int = CPU_SUITE_DEVICES) -> pytest.MarkDecorator:
  """Skips a test where fewer than `count` devices are visible."""
  return pytest.mark.skipif(
    not enough(count),
    reason=f"needs {count} {jax.default_backend()} devices, "
    f"{jax.device_count()} visible (the CPU suite has "
    f"{CPU_SUITE_DEVICES} fake ones)",
  )


def skip_module_unless(count: int = CPU_SUITE_DEVICES) -> None:
  """At a module's top, before it builds meshes: skips the whole module
  where fewer than `count` devices are visible."""
  if not enough(count):
    pytest.skip(
      f"needs {count} {jax.default_backend()} devices, {jax.device_count()} visible",
      allow_module_level=True,
    )


def mesh(count: int, axis: str = "data", **kwargs) -> jax.sharding.Mesh | None:
  """A mesh over the first `count` devices, or None where fewer are visible
  (for a module-level mesh whose tests carry `needs(count)`)."""
  if not enough(count):
    return None
  return jax.make_mesh((count,), (axis,), devices=jax.devices()[:count], **kwargs)
