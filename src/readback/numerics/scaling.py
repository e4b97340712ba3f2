"""Scaling recipes (Transformer Engine's field names and defaults) and their per-tensor state.

A recipe says how scales are chosen: per tensor (delayed, current) or per block (MXFP8,
Float8BlockScaling, NVFP4: ``BlockScalingRecipe``, whose quantisers are ``blockscale``'s and
``nvfp4``'s); a
``ScalingState`` holds one tensor's scale (and, for delayed scaling, its amax history) and is
what a checkpoint saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from readback.numerics.blockscale import Float8BlockQuantizer, MXFP8Quantizer
from readback.numerics.formats import Format, FP8Format
from readback.numerics.nvfp4 import NVFP4Quantizer

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# TE's ``backward_override`` (common/recipe/__init__.py ``_BACKWARD_OVERRIDES``, TE >= 2.15): None
# reads the recipe's FP8 copies; ``dequantized`` runs the backward GEMMs in high precision on the
# forward's dequantised copies, ``high_precision`` on the original input and weight; neither
# rounds the output gradient (pytorch/module/linear.py: the backward's ``fp8`` is off).
BACKWARD_OVERRIDES = ("high_precision", "dequantized")
# The tensors of a linear a recipe quantises (a site's last name component)
LINEAR_TENSORS = ("input", "weight", "grad_output")


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` (NaN if ``x`` holds one), in ``x``'s dtype, from one pass that allocates nothing."""
    low, high = torch.aminmax(x.detach())
    return torch.maximum(-low, high).abs()  # abs: an all-zero x gives +0, as x.abs().amax() does


def compute_scale(
    amax: torch.Tensor, fmt: FP8Format, margin: int = 0, previous: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """``(fmt.max * 2**-margin) / amax``, one correctly rounded FP32 division as Transformer
    Engine's scale update computes it (``scaled_max / amax``). A Python number over a tensor would
    not do: torch evaluates it as a reciprocal times the number, two roundings, one ulp off for
    about a quarter of amaxes.

    Where that is not a usable scale (amax zero or non-finite, or a scale that overflows fp32)
    the ``previous`` scale is kept, as Transformer Engine does: an all-zero tensor or one NaN must
    not poison every later step with an inf/NaN scale.
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    scale = amax.new_tensor(fmt.max * 2.0**-margin) / amax
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(usable, scale, previous)


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

    def new_state(self, fmt: FP8Format) -> DelayedScalingState | CurrentScalingState:
        """One tensor's scaling state: scaled by its own amax when it is quantised, unless the
        recipe keeps a history (``DelayedScaling``)."""
        return CurrentScalingState(self, fmt)


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

    def new_state(self, fmt: FP8Format) -> DelayedScalingState:
        return DelayedScalingState(self, fmt)


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
    core) scale per tensor from their own amax, as ``CurrentScaling`` does (``new_state``).
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


class DelayedScalingState:
    """One tensor's amax history (a ring buffer) and scale.

    Within a step every quantization uses the same scale and the step's amax is the max over
    them; ``end_step`` writes that amax into the history and, every ``interval`` steps,
    recomputes the scale from the history. A step here is one optimizer step (``Numerics.end_step``
    runs once after it), all its micro-batches' amaxes in one entry: the history holds
    ``amax_history_len`` optimizer steps, where Transformer Engine writes one entry per forward
    (micro-batch), so with ``accum`` micro-batches a TE history of ``L`` spans ``L / accum`` steps.
    """

    def __init__(self, recipe: DelayedScaling, fmt: FP8Format):
        self.recipe, self.fmt = recipe, fmt
        self.history = torch.zeros(recipe.amax_history_len)
        self.scale = torch.ones(())
        self.steps = 0  # steps recorded so far; the newest amax sits at (steps - 1) % len
        self.pending_amax = torch.zeros(())  # this step's amax so far, written at end_step

    def scale_for(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The step's scale; ``x``'s amax (``abs_max(x)``, computed here unless given) joins the step's."""
        if self.scale.device != x.device:  # follow the model to its device, once
            self.history, self.scale, self.pending_amax = (
                t.to(x.device) for t in (self.history, self.scale, self.pending_amax)
            )
        amax = abs_max(x) if amax is None else amax
        torch.maximum(self.pending_amax, amax.float(), out=self.pending_amax)  # in place: a compiled backward can
        return self.scale

    def end_step(self) -> None:
        """Tensors change in place: a compiled step reads them as its inputs, and a new tensor
        object would have it compiled again."""
        self.history[self.steps % len(self.history)] = self.pending_amax
        self.steps += 1
        self.pending_amax.zero_()
        if self.steps % self.recipe.interval == 0:
            self.scale.copy_(compute_scale(self.history_amax(), self.fmt, self.recipe.margin, self.scale))

    def history_amax(self) -> torch.Tensor:
        """The amax the scale is computed from: the history's max (``max``) or its newest entry
        (``most_recent``). With ``interval`` 1 it is the amax behind the scale in use."""
        if self.recipe.amax_compute_algo == "max":
            return self.history.max()
        return self.history[(self.steps - 1) % len(self.history)]

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.clone(), "scale": self.scale.clone(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "history" not in state:
            raise ValueError("the checkpoint holds no amax history for this delayed-scaling tensor (another recipe's)")
        if state["history"].shape != self.history.shape:
            raise ValueError(
                f"amax history length {len(state['history'])} in checkpoint, {len(self.history)} in recipe"
            )
        self.history.copy_(state["history"])
        self.scale.copy_(state["scale"])
        self.steps = int(state["steps"])
        self.pending_amax.zero_()


class CurrentScalingState:
    """Scale of the tensor being quantized now; keeps the last scale as the fallback."""

    def __init__(self, recipe: ScalingRecipe, fmt: FP8Format):
        self.recipe, self.fmt = recipe, fmt
        self.scale = torch.ones(())

    def scale_for(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        amax = (abs_max(x) if amax is None else amax).float()
        scale = compute_scale(amax, self.fmt, self.recipe.margin, self.scale.to(amax.device))
        if self.scale.device == scale.device:  # kept in place (a compiled backward cannot rebind it)
            self.scale.copy_(scale)
        else:
            self.scale = scale.clone()
        return scale

    def end_step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.copy_(state["scale"])
