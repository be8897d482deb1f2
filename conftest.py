"""Test configuration: 8 simulated CPU devices (set before jax is imported) and hypothesis profile."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

from hypothesis import HealthCheck, settings  # noqa: E402

# Compiles dominate; examples reuse jitted functions over fixed shape sets.
settings.register_profile(
    "jaxclip",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("jaxclip")
