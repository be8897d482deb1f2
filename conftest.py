"""Test configuration: 8 simulated CPU devices (set before jax is imported), hypothesis."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

from hypothesis import HealthCheck, settings

# Compiles dominate; examples reuse jitted functions over fixed shape sets.
settings.register_profile(
    "jaxclip",
    max_examples=10,
    derandomize=os.environ.get("CI", "").lower() == "true",  # CI: the same examples every run
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# A longer local sweep: JAXCLIP_HYPOTHESIS=stress python -m pytest tests/test_properties.py
settings.register_profile(
    "stress", parent=settings.get_profile("jaxclip"), max_examples=600, derandomize=False
)
settings.load_profile(os.environ.get("JAXCLIP_HYPOTHESIS", "jaxclip"))
