"""Gradient error against the gradient of the forward that was actually executed."""

from readback.probe.gradient_error import GradientProbe, compare

__all__ = ["GradientProbe", "compare"]
