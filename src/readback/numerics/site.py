"""A rounding site: one named tensor the run rounds, with its format and scaling state.

``Site.quantize`` is the only way a tensor of the model gets rounded; it also counts what the
run logs about each site (``fp8_saturation/<site>``, ``fp8_underflow/<site>``). Sites are made
and owned by ``readback.numerics.state.Numerics``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from readback.errors import NumericsError
from readback.numerics import (
    BF16,
    BlockQTensor,
    CurrentScalingState,
    DelayedScalingState,
    FP8Format,
    NVFP4Quantizer,
    QTensor,
    abs_max,
    quantize,
    round_bf16,
)
from readback.numerics.rounding import KeyedDraws, RandomSource

if TYPE_CHECKING:
    from readback.numerics.blockscale import Float8BlockQuantizer, MXFP8Quantizer
    from readback.numerics.streams import RandomStreams


class UnitScale:
    """Scaling state of a site with no scaling (BF16 baseline, rounding off)."""

    scale = torch.ones(())

    def scale_for(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones((), device=x.device)

    def end_step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# A usable scale is a normal, finite FP32 number: 0 or a subnormal has no finite inverse
# (``QTensor.scale_inv``), an infinite one rounds every element to 0 or +-max.
FP32 = torch.finfo(torch.float32)

# The exponent field of each FP8 code (sign, exponent, mantissa from the top bit down).
# uint8: E2M1 codes (``formats.E2M1``), whose exponent bits are bits 1-2
EXPONENT_BITS = {torch.float8_e4m3fn: 0b0111_1000, torch.float8_e5m2: 0b0111_1100, torch.uint8: 0b0110}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

ScalingState = UnitScale | DelayedScalingState | CurrentScalingState


class Site:
    """One rounding site. ``quantize`` is the only way a tensor of the model gets rounded."""

    def __init__(
        self,
        streams: RandomStreams,
        name: str,
        direction: str,
        fmt: FP8Format | None,
        state: ScalingState,
        margin: int = 0,
    ) -> None:
        self.streams, self.name, self.direction = streams, name, direction
        self.fmt, self.state, self.margin = fmt, state, margin
        # Counters are tensors updated in place, so a compiled backward can count into them:
        # elements clipped to +-fmt.max since the last saturation_counts(), and nonzero elements
        # rounded to 0 or a subnormal (of all nonzero) since the last underflow_fractions(), and
        # the site's own scales that were not usable (FP32) since the last Numerics.check_scales().
        self.saturated, self.underflowed, self.nonzero, self.unusable = (
            torch.zeros((), dtype=torch.int64) for _ in range(4)
        )

    @property
    def history_amax(self) -> torch.Tensor | None:
        """The amax the site's delayed scale is computed from (``DelayedScalingState.history_amax``);
        None without a history (current scaling, BF16, rounding off) or before its first entry."""
        if not isinstance(self.state, DelayedScalingState) or self.state.steps == 0:
            return None
        return self.state.history_amax()

    @property
    def reads_amax_first(self) -> bool:
        """Whether the scale depends on the tensor being rounded (current scaling): a tensor
        rounded block by block then needs its whole amax before the first block."""
        return isinstance(self.state, CurrentScalingState)

    def quantize(
        self,
        x: torch.Tensor,
        rounding: str = "nearest",
        scale: torch.Tensor | None = None,
        stream: str = "forward",
        amax: torch.Tensor | None = None,
        draws: KeyedDraws | None = None,
        count: bool = True,
    ) -> QTensor:
        """Round ``x`` at this site. ``scale`` reuses an earlier scale (a re-rounding) instead
        of the site's own; ``stream`` names the random stream of a stochastic rounding, or
        ``draws`` its draws keyed by position (from ``claim``); ``amax`` is that of the whole
        tensor when ``x`` is one block of it. ``count`` False: a recomputation of codes already
        rounded and counted (the forward's scale and draws again), which counts nothing."""
        if self.fmt is None:  # rounding switched off: the identity, in x's own precision
            return QTensor(x, torch.ones((), dtype=x.dtype, device=x.device), None)
        if self.fmt is BF16:  # BF16 sites round to nearest, as BF16 GEMM inputs do, unscaled
            return round_bf16(x)
        amax = abs_max(x) if amax is None else amax
        self._follow(x.device)
        if scale is None:
            scale = self.scale_for(x, amax)
        generator: RandomSource = None
        if rounding == "stochastic":
            generator = draws if draws is not None else self.streams.state(self.name, stream, x.device)
        saturated = _count_saturated(x, amax, scale, self.fmt)
        if isinstance(saturated, torch.Tensor) and count:
            self.saturated.add_(saturated)
        # Without a count none saturates, so the clamp would change nothing.
        q = quantize(x, self.fmt, scale, rounding, generator, saturate=isinstance(saturated, torch.Tensor))
        if count:
            self._count_underflow(x, q, nearest=rounding == "nearest")
        return q

    def scale_for(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """The site's scale for ``x`` of amax ``amax`` (which joins a delayed scale's step), the
        site margin dividing it like the recipe's margin (2**-k); an unusable scale is counted."""
        self._follow(x.device)
        scale = self.state.scale_for(x, amax)
        if self.margin:
            scale = scale * 2.0**-self.margin
        self.unusable.add_(~((scale >= FP32.tiny) & (scale <= FP32.max)))  # NaN fails both
        return scale

    def count(self, saturated: torch.Tensor, underflowed: torch.Tensor, nonzero: torch.Tensor) -> None:
        """Add a rounding's counts taken elsewhere (a kernel's): as ``quantize`` counts its own."""
        self._follow(saturated.device)
        self.saturated.add_(saturated)
        self.underflowed.add_(underflowed)
        self.nonzero.add_(nonzero)

    def claim(self, rows: int, device: torch.device, stream: str = "forward") -> torch.Tensor:
        """The start of keyed draws over ``rows`` rows of this site's ``stream`` on ``device``
        (``RandomStreams.claim``), for ``KeyedDraws``."""
        return self.streams.claim(self.name, stream, device, rows)

    def quantize_blocks(
        self, x: torch.Tensor, quantizer: MXFP8Quantizer | Float8BlockQuantizer | NVFP4Quantizer, direction: str
    ) -> BlockQTensor:
        """Round ``x`` at this site with a block recipe's ``quantizer`` along ``direction``
        (``blockscale``, ``nvfp4``): each block scaled by its own amax, so the site's scaling state
        is not read; a stochastic NVFP4 quantiser draws from the site's stream, each copy anew.
        Underflow is counted as ``quantize`` counts it (each copy)."""
        self._follow(x.device)
        q: BlockQTensor
        if isinstance(quantizer, NVFP4Quantizer) and quantizer.stochastic:
            q = quantizer.quantize(x, direction, self.streams.state(self.name, "forward", x.device))
        else:
            q = quantizer.quantize(x, direction)
        self._count_underflow(x, q)
        return q

    def _count_underflow(self, x: torch.Tensor, q: QTensor | BlockQTensor, nearest: bool = False) -> None:
        """Add the nonzero elements of ``x`` that ``q`` holds as zero or a subnormal. No amax
        shortcut exists here (any tensor may hold tiny elements), so it is always counted."""
        underflowed, nonzero = underflow_counts(x, q, nearest)
        self.underflowed.add_(underflowed)
        self.nonzero.add_(nonzero)

    def _follow(self, device: torch.device) -> None:
        """Move the counters to the model's device, once (before any compiled step)."""
        if self.saturated.device != device:
            self.saturated, self.underflowed, self.nonzero, self.unusable = (
                t.to(device) for t in (self.saturated, self.underflowed, self.nonzero, self.unusable)
            )


def check_scales(sites: Mapping[str, Site], step: int) -> None:
    """Raise ``NumericsError`` naming the sites whose own scale was not a usable FP32 number
    (0, subnormal, infinite or NaN) since the last call, at ``step``: no margin the config allows
    gives one, but an amax near FP32's max or a restored scale can. One read of the device for all
    sites; with several processes the counts are reduced first, so every rank raises."""
    if not sites:
        return
    device = max((s.unusable.device for s in sites.values()), key=lambda d: d.type != "cpu")
    counts = torch.stack([s.unusable.to(device) for s in sites.values()])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    for site in sites.values():
        site.unusable.zero_()
    bad = [name for name, n in zip(sites, counts.tolist()) if n]
    if bad:
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" if bad[1:] else ""
        raise NumericsError(
            f"the FP8 scale of site {bad[0]}{more} was 0, subnormal, infinite or NaN in FP32 at step {step}: "
            "its tensor cannot be rounded to FP8 (an amax near FP32's max, or a bad saved scale)"
        )


class RoundingFigures(NamedTuple):
    """How coarsely one rounding ``q`` holds ``x``, in FP64 over the whole tensor (tensors)."""

    rel_err: torch.Tensor  # |x - q| / |x| (Frobenius)
    amax_to_rms: torch.Tensor  # max|x| / rms(x): how far the largest element stands above the typical one
    log2_rms_scaled: torch.Tensor  # log2(rms(x) * scale): where a typical element lands on the format's grid
    # history amax / rms(x): the amax the delayed scale came from, over x's rms (None without a history)
    history_amax_to_rms: torch.Tensor | None = None


def rounding_figures(x: torch.Tensor, q: QTensor, history_amax: torch.Tensor | None = None) -> RoundingFigures:
    """The one definition of :class:`RoundingFigures`, for the training log
    (``readback.ops.mechanism``) and the bias meter (``readback.bias.output_rounding``).
    ``log2_rms_scaled`` below the format's smallest normal exponent (E4M3: -6) means most of
    ``x`` is held as subnormals or zero, whatever margin, recipe or amax history set the scale.
    ``history_amax`` (the site's ``Site.history_amax``) gives ``history_amax_to_rms``: within a
    step ``amax_to_rms`` is at most sqrt(numel), but an amax held in the history from an earlier
    step (a spike) can stand far higher above this step's rms, and lower the scale with it."""
    xd = x.detach().double()
    rms = xd.pow(2).mean().sqrt()
    rel_err = (xd - q.dequantize(torch.float64)).norm() / xd.norm().clamp_min(1e-300)
    held = None if history_amax is None else history_amax.double() / rms
    return RoundingFigures(rel_err, xd.abs().max() / rms, torch.log2(rms * q.scale.double()), held)


def underflow_counts(
    x: torch.Tensor, q: QTensor | BlockQTensor, nearest: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(underflowed, nonzero)``: the nonzero elements of ``x`` and those that their FP8 rounding
    ``q`` holds as zero or a subnormal (the one definition of ``fp8_underflow``).

    A code is zero or subnormal exactly when its exponent bits are all 0, so the normal codes
    are counted on the 1-byte codes; every zero of ``x`` has a zero code, hence
    underflowed = nonzero(x) - normal(q). In a compiled graph, ``q`` rounded to ``nearest``
    (per tensor) is counted on ``x * scale`` instead, the same count (``normal_threshold``):
    reading the codes there makes the compiler convert every element to FP8 a second time inside
    the counting loop, about a tenth of a compiled small-FOG FP8 step."""
    x = x.detach()
    nonzero = count_nonzero(x)
    fmt = q.fmt if isinstance(q, QTensor) and q.data.dtype in FP8_DTYPES else None
    if nearest and fmt is not None and torch.compiler.is_compiling():
        scaled = x.to(torch.float32) * q.scale  # quantize's own product
        return nonzero - count_nonzero(~(scaled.abs() < normal_threshold(fmt))), nonzero  # NaN: a normal code
    normal = count_nonzero(q.data.view(torch.uint8) & EXPONENT_BITS[q.data.dtype])
    return nonzero - normal, nonzero


def normal_threshold(fmt: FP8Format) -> float:
    """The smallest magnitude that rounds to nearest onto a normal ``fmt`` code: halfway between
    the largest subnormal and the smallest normal, where the tie goes to the even neighbour (the
    normal code, whose mantissa bits are 0)."""
    return 2.0**fmt.min_exponent - fmt.smallest_subnormal / 2


def _count_saturated(x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor | int:
    """Elements of ``x`` beyond ``+-fmt.max`` once scaled. On the CPU the counting pass is
    skipped when ``amax * scale <= fmt.max`` shows that none is (the usual case; a NaN amax
    shows nothing, so infinities next to a NaN are still counted); on a GPU, or while compiling,
    reading that flag would stall the device, so the count is always taken."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and bool(amax * scale <= fmt.max):
        return 0
    return count_nonzero(x.detach().abs() * scale > fmt.max)


def count_nonzero(x: torch.Tensor) -> torch.Tensor:
    """``torch.count_nonzero(x)``; in a compiled graph summed in int32 where that cannot overflow.
    The compiler fuses each of a site's counts into the loop that rounds, where an int64
    accumulator takes two vector registers: with int32 counts a compiled small-FOG FP8 step is
    about a twentieth shorter."""
    if torch.compiler.is_compiling() and x.numel() < 2**31:  # a mask is summed as it is, not compared
        return (x if x.dtype == torch.bool else x != 0).sum(dtype=torch.int32)
    return torch.count_nonzero(x)
