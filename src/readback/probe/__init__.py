"""Gradient error against the gradient of the forward that was actually executed."""

from readback.probe.gradient_error import GradientProbe, compare, reference_gradients, taped_backward

__all__ = ["GradientProbe", "compare", "reference_gradients", "taped_backward"]
