"""Gradient error against the gradient of the forward that was actually executed."""

from readback.probe.gradient_error import (
    GradientProbe,
    TapedStep,
    check_params,
    compare,
    reference_gradients,
    taped_backward,
    train_taped,
)

__all__ = [
    "GradientProbe",
    "TapedStep",
    "check_params",
    "compare",
    "reference_gradients",
    "taped_backward",
    "train_taped",
]
