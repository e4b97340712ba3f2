"""FP8 numerics: formats, scaling, rounding and the emulated GEMM (Transformer Engine's terms)."""

from readback.numerics.formats import E4M3, E5M2, FP8Format, Format
from readback.numerics.gemm import fp8_mm
from readback.numerics.rounding import ROUNDINGS, QTensor, quantize, round_stochastic
from readback.numerics.scaling import (
    AMAX_COMPUTE_ALGOS,
    CurrentScaling,
    CurrentScalingState,
    DelayedScaling,
    DelayedScalingState,
    compute_scale,
)

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "E4M3",
    "E5M2",
    "FP8Format",
    "Format",
    "ROUNDINGS",
    "CurrentScaling",
    "CurrentScalingState",
    "DelayedScaling",
    "DelayedScalingState",
    "QTensor",
    "compute_scale",
    "fp8_mm",
    "quantize",
    "round_stochastic",
]
