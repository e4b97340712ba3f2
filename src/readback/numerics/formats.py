"""FP8 formats and the recipe-level format choice, in Transformer Engine's vocabulary."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding (or NVFP4's E2M1, ``E2M1``): its torch dtype and the facts the rounding code needs.

    ``min_exponent`` is the exponent of the smallest normal number; below it the grid spacing
    stays at ``2**(min_exponent - mantissa_bits)`` (subnormals).
    """

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_exponent: int

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def zero_margin(self) -> int:
        """The smallest margin ``k`` at which even a tensor's amax rounds to zero: its scaled
        value is ``max * 2**-k``, and round to nearest gives 0 below half the smallest subnormal
        (at exactly half, the even neighbour, 0). A scale with such a margin means nothing."""
        return math.ceil(math.log2(self.max / (self.smallest_subnormal / 2)))

    def __repr__(self) -> str:
        return self.name


E4M3 = FP8Format("E4M3", torch.float8_e4m3fn, 448.0, mantissa_bits=3, min_exponent=-6)
E5M2 = FP8Format("E5M2", torch.float8_e5m2, 57344.0, mantissa_bits=2, min_exponent=-14)
# The no-FP8 baseline rounds at the same sites, to BF16 with scale 1, so one code path serves both.
_E4M3 = E4M3  # the class body below rebinds the name E4M3
# NVFP4's elements (``numerics.nvfp4``): 0, 0.5 (its one subnormal), 1, ..., 6; torch has no
# unpacked 4-bit dtype, so a code (sign in bit 3) is held one a byte, as uint8.
E2M1 = FP8Format("E2M1", torch.uint8, 6.0, mantissa_bits=1, min_exponent=0)
BF16 = FP8Format("BF16", torch.bfloat16, float(torch.finfo(torch.bfloat16).max), mantissa_bits=7, min_exponent=-126)


class Format(enum.Enum):
    """Recipe format: which FP8 encoding forward tensors and gradients use.

    ``HYBRID`` is Transformer Engine's default for training: E4M3 for activations and weights
    (more precision), E5M2 for gradients (more range).
    """

    E4M3 = (_E4M3, _E4M3)
    HYBRID = (_E4M3, E5M2)

    @property
    def fwd(self) -> FP8Format:
        return self.value[0]

    @property
    def bwd(self) -> FP8Format:
        return self.value[1]

    @classmethod
    def parse(cls, name: str | Format) -> Format:
        if isinstance(name, Format):
            return name
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown fp8_format {name!r}; valid: {[f.name for f in cls]}") from None
