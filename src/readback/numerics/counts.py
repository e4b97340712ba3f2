"""What a site counts of a rounding: its nonzero elements and those held as zero or a subnormal
(``fp8_underflow``), counted on the codes, or in a compiled graph on the scaled tensor.

Apart from ``readback.numerics.site`` so that the fused rounding (``readback.numerics.fused``)
counts with the very functions a site's eager passes use.
"""

from __future__ import annotations

import torch

from readback.numerics.blockscale import BlockQTensor
from readback.numerics.formats import FP8Format
from readback.numerics.rounding import QTensor

# The exponent field of each FP8 code (sign, exponent, mantissa from the top bit down).
# uint8: E2M1 codes (``formats.E2M1``), whose exponent bits are bits 1-2
EXPONENT_BITS = {torch.float8_e4m3fn: 0b0111_1000, torch.float8_e5m2: 0b0111_1100, torch.uint8: 0b0110}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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


def count_nonzero(x: torch.Tensor) -> torch.Tensor:
    """``torch.count_nonzero(x)``; in a compiled graph summed in int32 where that cannot overflow.
    The compiler fuses each of a site's counts into the loop that rounds, where an int64
    accumulator takes two vector registers: with int32 counts a compiled small-FOG FP8 step is
    about a twentieth shorter."""
    if torch.compiler.is_compiling() and x.numel() < 2**31:  # a mask is summed as it is, not compared
        return (x if x.dtype == torch.bool else x != 0).sum(dtype=torch.int32)
    return torch.count_nonzero(x)
