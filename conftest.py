"""Doctest and test session settings: four fake CPU devices, strict rank promotion."""

import os

# Must be set before JAX initialises its backends.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import hypothesis  # noqa: E402
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

hypothesis.settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("ci")
