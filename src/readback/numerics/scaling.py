"""Scaling recipes: Transformer Engine's field names and defaults, one frozen object each.

A recipe says how scales are chosen: per tensor (delayed, current) or per block (MXFP8,
Float8BlockScaling, NVFP4: ``BlockScalingRecipe``, whose quantisers are ``blockscale``'s and
``nvfp4``'s); a per-tensor recipe's scale lives in a ``scale_state`` object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from readback.numerics.blockscale import Float8BlockQuantizer, MXFP8Quantizer
from readback.numerics.formats import Format
from readback.numerics.nvfp4 import NVFP4Quantizer

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# TE's ``backward_override`` (common/recipe/__init__.py ``_BACKWARD_OVERRIDES``, TE >= 2.15): None
# reads the recipe's FP8 copies; ``dequantized`` runs the backward GEMMs in high precision on the
# forward's dequantised copies, ``high_precision`` on the original input and weight; neither
# rounds the output gradient (pytorch/module/linear.py: the backward's ``fp8`` is off).
BACKWARD_OVERRIDES = ("high_precision", "dequantized")
# The tensors of a linear a recipe quantises (a site's last name component)
LINEAR_TENSORS = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class ScalingRecipe:
    """What every recipe has, with Transformer Engine's names and defaults: ``margin``, the
    format pair, ``override_linear_precision`` = (fprop, dgrad, wgrad), True running that
    GEMM in high precision (TE 1.x's field; the TE mapping refuses what its TE lacks), and
    ``backward_override`` (``BACKWARD_OVERRIDES`` or None; TE's default is the environment's
    ``NVTE_BACKWARD_OVERRIDE`` at import, readback's None, which it passes to TE explicitly).

    A recipe is the one object of a run's scaling, from the config (``precision.recipe`` names
    its class in ``RECIPES``, the fields keep their names) to the emulated kernels and to TE's
    recipe (``backends.te.recipe``); its defaults are declared here and nowhere else.
    """

    KEY: ClassVar[str]
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    backward_override: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", Format.parse(self.fp8_format))
        object.__setattr__(self, "override_linear_precision", tuple(bool(b) for b in self.override_linear_precision))
        if len(self.override_linear_precision) != 3:
            raise ValueError("override_linear_precision is (fprop, dgrad, wgrad): three booleans")
        if self.backward_override not in (None, *BACKWARD_OVERRIDES):
            raise ValueError(f"backward_override={self.backward_override!r}; valid: {[None, *BACKWARD_OVERRIDES]}")


@dataclass(frozen=True)
class DelayedScaling(ScalingRecipe):
    """Scale from the amax history of earlier steps (Transformer Engine's default recipe).

    ``interval`` keeps its Transformer Engine 1.x meaning: the scale is recomputed every
    ``interval`` steps, while the history is updated every step.
    """

    KEY = "delayed"
    interval: int = 1
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r}; valid: {list(AMAX_COMPUTE_ALGOS)}")
        if self.interval < 1 or self.amax_history_len < 1:
            raise ValueError("interval and amax_history_len must be >= 1")
        if self.backward_override is not None:  # TE: "Delayed scaling only supports backward_override=None."
            raise ValueError(f"backward_override={self.backward_override!r}: delayed scaling allows only None")


@dataclass(frozen=True)
class CurrentScaling(ScalingRecipe):
    """Scale from this tensor's own amax, computed when it is quantized."""

    KEY = "current"


@dataclass(frozen=True)
class BlockScalingRecipe(ScalingRecipe):
    """A recipe that scales each block of a linear's operands by its own amax, with ``quantizer``'s
    quantiser per tensor (``LINEAR_TENSORS``); TE's linears and readback's emulated ones
    (``ops.linear``) quantise by it. Its block scales take no margin.

    readback's other ops do not scale by blocks: the sites they own in such a run (its attention
    core) scale per tensor from their own amax, as ``CurrentScaling`` does (``scale_state.new_state``).
    """

    def quantizer(self, tensor: str) -> MXFP8Quantizer | Float8BlockQuantizer | NVFP4Quantizer:
        """The quantiser of a linear's ``tensor`` (``LINEAR_TENSORS``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class MXFP8BlockScaling(BlockScalingRecipe):
    """Transformer Engine's MXFP8 recipe: an E8M0 scale per 32 elements (``blockscale.MXFP8Quantizer``),
    rowwise and columnwise copies each quantised from the original."""

    KEY = "mxfp8"
    fp8_format: Format = Format.E4M3  # TE's default here: E4M3 for the gradients too
    # ``margin`` is TE's field too, which its MXFP8 quantiser does not read

    def quantizer(self, tensor: str) -> MXFP8Quantizer:
        return MXFP8Quantizer(self.fp8_format.bwd if tensor == "grad_output" else self.fp8_format.fwd)


@dataclass(frozen=True)
class Float8BlockScaling(BlockScalingRecipe):
    """Transformer Engine's ``Float8BlockScaling`` (TE >= 2.3; DeepSeek-V3's): FP32 scales per block
    (``blockscale.Float8BlockQuantizer``), ``*_block_scaling_dim`` 1 for 1x128 lines (one copy per
    direction, each from the original), 2 for 128x128 blocks (one copy serving both).

    ``pow2_scales`` and ``amax_epsilon`` are TE's ``QParams(power_2_scale, amax_epsilon)``, one
    pair for every tensor as TE's defaults have it. TE sets them at import from
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` (class attributes, not constructor arguments), which
    readback cannot read for a TE imported elsewhere; here they are fields.
    """

    KEY = "blockwise"
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.margin != 0:  # TE's Float8BlockScaling has no margin field
            raise ValueError(f"margin={self.margin}: Float8BlockScaling has no margin")
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        if not set(dims) <= {1, 2}:
            raise ValueError(f"block scaling dims {dims}: each 1 (1x128) or 2 (128x128)")
        if dims.count(2) > 1:  # TE: "2D by 2D block gemm not supported."
            raise ValueError(f"block scaling dims {dims}: at most one tensor in 128x128 blocks")
        if not (math.isfinite(self.amax_epsilon) and self.amax_epsilon >= 0):
            raise ValueError(f"amax_epsilon={self.amax_epsilon} must be finite and >= 0")

    def quantizer(self, tensor: str) -> Float8BlockQuantizer:
        dim = {"input": self.x_block_scaling_dim, "weight": self.w_block_scaling_dim}.get(
            tensor, self.grad_block_scaling_dim
        )
        fmt = self.fp8_format.bwd if tensor == "grad_output" else self.fp8_format.fwd
        return Float8BlockQuantizer(fmt, dim, self.pow2_scales, self.amax_epsilon)


@dataclass(frozen=True)
class NVFP4BlockScaling(BlockScalingRecipe):
    """Transformer Engine's NVFP4 recipe (TE >= 2.8): E2M1 elements with an E4M3 scale per 16 and
    an FP32 one per copy (``nvfp4.NVFP4Quantizer``). By default weights in 16 x 16 blocks (fprop
    and dgrad read one copy), the wgrad copies of X and dY rotated by the Hadamard transform, and
    both copies of dY rounded stochastically; each switch is TE's field of the same name.
    ``fp8_format`` is the block scales' format, E4M3 only (TE asserts it). TE's
    ``row_scaled_activation`` and ``nvfp4_4over6`` are not modelled (TE's defaults: off).
    """

    KEY = "nvfp4"
    fp8_format: Format = Format.E4M3
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp8_format is not Format.E4M3:  # TE: "Only E4M3 is supported for NVFP4 scaling"
            raise ValueError(f"fp8_format={self.fp8_format.name}: NVFP4's block scales are E4M3 only")
        if self.margin != 0:  # TE's NVFP4BlockScaling has no margin field
            raise ValueError(f"margin={self.margin}: NVFP4BlockScaling has no margin")

    def quantizer(self, tensor: str) -> NVFP4Quantizer:
        if tensor == "weight":
            return NVFP4Quantizer(two_d=not self.disable_2d_quantization)
        return NVFP4Quantizer(
            hadamard=not self.disable_rht,
            stochastic=tensor == "grad_output" and not self.disable_stochastic_rounding,
        )


# precision.recipe -> the recipe's class
RECIPES: dict[str, type[ScalingRecipe]] = {
    r.KEY: r for r in (DelayedScaling, CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling)
}
