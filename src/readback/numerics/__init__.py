"""FP8 numerics: formats, scaling, rounding, block-scaled quantisers (``blockscale``: MXFP8 and
Float8BlockScaling; ``nvfp4``: NVFP4), the emulated GEMM (Transformer Engine's terms), and the run's rounding state:
its frozen spec (``spec``), its sites (``site``, ``state``) and random streams."""

from readback.numerics.blockscale import BlockQTensor, Float8BlockQuantizer, MXFP8Quantizer
from readback.numerics.formats import BF16, E2M1, E4M3, E5M2, Format, FP8Format
from readback.numerics.gemm import GEMM_PRECISIONS, PRECISION_DTYPES, SplitK, decoded, fp8_mm, matmul
from readback.numerics.nvfp4 import NVFP4Quantizer, NVFP4Tensor
from readback.numerics.rounding import ROUNDINGS, QTensor, pinned, quantize, round_bf16, round_stochastic
from readback.numerics.scale_state import CurrentScalingState, DelayedScalingState, abs_max, compute_scale, new_state
from readback.numerics.scaling import (
    AMAX_COMPUTE_ALGOS,
    BACKWARD_OVERRIDES,
    LINEAR_TENSORS,
    RECIPES,
    BlockScalingRecipe,
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    ScalingRecipe,
)

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "BACKWARD_OVERRIDES",
    "BF16",
    "E2M1",
    "E4M3",
    "E5M2",
    "GEMM_PRECISIONS",
    "LINEAR_TENSORS",
    "PRECISION_DTYPES",
    "RECIPES",
    "ROUNDINGS",
    "BlockQTensor",
    "BlockScalingRecipe",
    "CurrentScaling",
    "CurrentScalingState",
    "DelayedScaling",
    "DelayedScalingState",
    "FP8Format",
    "Float8BlockQuantizer",
    "Float8BlockScaling",
    "Format",
    "MXFP8BlockScaling",
    "MXFP8Quantizer",
    "NVFP4BlockScaling",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "QTensor",
    "ScalingRecipe",
    "SplitK",
    "abs_max",
    "compute_scale",
    "decoded",
    "fp8_mm",
    "matmul",
    "new_state",
    "pinned",
    "quantize",
    "round_bf16",
    "round_stochastic",
]
