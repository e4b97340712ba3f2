"""Shared test settings: a hypothesis profile that keeps property tests fast and deterministic."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "readback",
    deadline=None,
    max_examples=50,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("readback")
