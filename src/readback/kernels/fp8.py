"""FP8 and BF16 arithmetic inside a Triton kernel, written out in integer and FP32 operations.

These are the spec a kernel's roundings meet, on a GPU and in Triton's interpreter alike: the
interpreter's own FP32 -> FP8 cast is wrong (ties away from zero, no saturation), and a GPU's
FP32 division is not correctly rounded, so nothing here casts to FP8 or divides. Each function
gives the bits of its torch counterpart in ``readback.numerics.rounding``: ``decode`` the codes'
values, ``round_to_grid`` and ``encode`` a scaled, clamped tensor's FP8 rounding (nearest even,
or stochastic with a uniform), ``keyed_uniform`` the draws of ``KeyedDraws``, ``round_bf16``
the BF16 rounding an emulated FP8 GEMM applies to its output.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(exponent):
    """``2**exponent`` (int32, within FP32's normal range) in FP32, built from its bits: exact."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def decode(codes, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The FP32 values of FP8 codes (uint8): E4M3 with ``MANTISSA`` 3, ``BIAS`` 7; E5M2 2, 15.
    Codes never hold NaN or infinity here (every rounding saturates)."""
    c = codes.to(tl.int32)
    exponent = (c >> MANTISSA) & ((1 << (7 - MANTISSA)) - 1)
    mantissa = c & ((1 << MANTISSA) - 1)
    normal = (((exponent - BIAS + 127) << 23) | (mantissa << (23 - MANTISSA))).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * pow2(tl.full(c.shape, 1 - BIAS - MANTISSA, tl.int32))
    magnitude = tl.where(exponent == 0, subnormal, normal)
    # the sign bit set with integer ops: a negation may drop -0's sign (Triton 3.7's interpreter does)
    return (magnitude.to(tl.int32, bitcast=True) | ((c >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def round_to_grid(y, u, STOCHASTIC: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """FP32 ``y`` (scaled, within the format's max) rounded onto the FP8 grid, as a value: to
    nearest even, or up with probability ``frac`` from uniforms ``u`` (``round_stochastic``).
    ``y`` times the inverse of its grid spacing is exact (both are powers of two)."""
    binade = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    binade = tl.maximum(binade, MIN_EXPONENT)
    units = y * pow2(MANTISSA - binade)
    low = tl.floor(units)
    frac = units - low
    if STOCHASTIC:
        up = u < frac
    else:
        odd = low - 2.0 * tl.floor(low * 0.5) != 0.0
        up = (frac > 0.5) | ((frac == 0.5) & odd)
    return (low + up.to(tl.float32)) * pow2(binade - MANTISSA)


@triton.jit
def encode(r, sign_of, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 codes (uint8) of values ``r`` on the grid, with the sign bit of ``sign_of`` (a
    nearest rounding keeps the sign of a value rounded to zero, as torch's cast does; a
    stochastic one gives its result's own)."""
    bits = tl.abs(r).to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    normal = ((exponent + BIAS) << MANTISSA) | ((bits >> (23 - MANTISSA)) & ((1 << MANTISSA) - 1))
    units = tl.abs(r) * pow2(tl.full(bits.shape, BIAS - 1 + MANTISSA, tl.int32))  # in smallest subnormals
    subnormal = tl.minimum(units, 1 << MANTISSA).to(tl.int32)  # (clamped: a normal's cast would overflow)
    code = tl.where(exponent >= 1 - BIAS, normal, subnormal)
    sign = (sign_of.to(tl.int32, bitcast=True) >> 31) & 1
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def hash32(x):
    """``numerics.rounding._hash32`` in uint32 arithmetic, which wraps where it masks."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def keyed_uniform(key, rows, columns):
    """``KeyedDraws(start, rows).uniform`` at global rows ``rows`` (int64, the claim's first
    row added) and columns ``columns``: FP32 uniforms, multiples of 2**-24. ``key`` is uint32."""
    row_keys = hash32(hash32((rows & 0xFFFFFFFF).to(tl.uint32)) ^ key)
    bits = hash32(row_keys[:, None] ^ hash32(columns.to(tl.uint32))[None, :]) >> 8
    return bits.to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def round_bf16(x):
    """FP32 ``x`` rounded to the nearest even BF16 value, held in FP32 (finite ``x``)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def count(mask):
    """The true elements of a 2-D mask (int32)."""
    return tl.sum(tl.sum(mask.to(tl.int32), 1), 0)
