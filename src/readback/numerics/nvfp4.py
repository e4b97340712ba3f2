"""NVFP4: the quantiser of Transformer Engine's ``NVFP4BlockScaling`` recipe (TE 2.20), bit for bit
with TE's reference rules (``pytorch/custom_recipes/reference_nvfp4.py``, ``NVFP4QuantizerRef``).

Two levels of scale: E2M1 elements (``E2M1``: 0, 0.5, 1, 1.5, 2, 3, 4, 6), an E4M3 decode scale per
block of 16 (``1 x 16`` along the direction, or ``16 x 16``), and a per-tensor FP32 one from the
copy's own amax, ``amax / (448 * 6)``. A value is ``e2m1 * block_scale * amax / 2688``.

A copy may first be rotated by a 16-point random Hadamard transform along its reduction axis
(``hadamard_transform``): TE applies it to the wgrad copies of X and dY, whose product the
rotation leaves unchanged (it is orthonormal), while outliers spread over their 16 elements.

Stochastic rounding is TE's rule for E2M1 (``common/util/ptx.cuh``
``stochastic_round_fp4_e2m1``, the software form of ``cvt.rs.satfinite.e2m1x4.f32``): 8 random
bits per element, ``u = bits / 256``, rounding up when ``|y| + u * step`` reaches the next grid
point. With 8 bits it rounds up with probability ``floor(256 frac) / 256``, not ``frac``: unbiased
for fractions on the 1/256 grid, else low in magnitude by less than ``step / 256``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from readback.numerics.blockscale import COLUMNWISE, BlockQTensor, flat_2d, line_block
from readback.numerics.formats import E2M1, E4M3
from readback.numerics.rounding import RandomSource, uniform_draws

GLOBAL_RANGE = E4M3.max * E2M1.max  # 2688: a copy's amax maps to the largest block scale times 6
FP32_MAX = torch.finfo(torch.float32).max
HADAMARD_SIZE = 16
# TE's fixed signs of the "random" Hadamard transform (reference_nvfp4.py get_wgrad_sign_vector)
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES))  # code -> value


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of E2M1 codes (uint8, one per element: bit 3 the sign, bits 0-2 the magnitude)."""
    return E2M1_TABLE.to(dtype=dtype, device=codes.device).index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _binade(a: torch.Tensor) -> torch.Tensor:
    """``2**floor(log2(a))`` of FP32 ``a >= 0``, from its exponent bits."""
    return (a.view(torch.int32) & 0x7F800000).view(torch.float32)


def _step(a: torch.Tensor) -> torch.Tensor:
    """E2M1's grid spacing above magnitude ``a``: 0.5 below 2, 1 in [2, 4), 2 from 4."""
    return (_binade(a) * 0.5).clamp_(0.5, 2.0)


def _signed(index: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Codes from magnitude indices (uint8, 0 ... 7), bit 3 set where ``negative`` (bool, one
    byte an element, so its bytes are 0 or 1): byte-wide operations throughout."""
    return index.bitwise_or_(negative.view(torch.uint8) << 3)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Codes of FP32 ``y`` (within +-6) rounded to nearest, ties to even, as the reference's
    ``cast_to_fp4x2``: only ``y < 0`` takes the sign (-0.0 gets +0's code; NaN gets code 0).
    From 1 up the grid has one mantissa bit: rounded to nearest even on FP32's bits (adding just
    under half an ulp of that bit, plus the bit itself), the top bits give the index ``2 e + b``
    at once (``_normal_index``). Below 1 the grid is 0.5's multiples, index ``round(2 |y|)``,
    which is never below the top bits' index there, and 2 from 1 up: the index is the larger."""
    a = torch.nan_to_num_(y.abs(), nan=0.0)
    bits = a.view(torch.int32)
    normal = _normal_index((bits >> 22).bitwise_and_(1).add_(0x1FFFFF).add_(bits))
    small = (a * 2).round_().clamp_max_(2).to(torch.uint8)
    return _signed(torch.maximum(normal, small), y < 0)


def round_e2m1_stochastic(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Codes of FP32 ``y`` rounded stochastically with 8 random ``bits`` per element (0 ... 255,
    FP32), by TE's rule (module docstring): ``t = |y| + bits / 256 * step(|y|)`` (the product is
    exact: one rounding, TE's ``fmaf``), floored to the grid, saturating at 6; the sign kept
    (-0.0 included), NaN to +6. From 1 up the floor's index is ``t``'s top bits (``_normal_index``,
    at most 7); below, 1 from 0.5 (the top bits give 0 in [0.5, 0.75)), else 0."""
    y = torch.nan_to_num(y, nan=E2M1.max)
    a = y.abs()
    t = (bits * (1 / 256)).mul_(_step(a)).add_(a)
    normal = _normal_index(t.view(torch.int32).clone())
    return _signed(torch.maximum(normal, (t >= 0.5).view(torch.uint8)), torch.signbit(y))


def _normal_index(bits: torch.Tensor) -> torch.Tensor:
    """The E2M1 magnitude index (uint8, 0 ... 7) of FP32 magnitudes from their bits (int32, in
    place), truncated to one mantissa bit: ``2 e + b`` offset to start at 2 (1.0: 254 - 252),
    0 below 1, 7 from 6 up (saturation)."""
    return bits.bitwise_right_shift_(22).sub_(252).clamp_(0, 7).to(torch.uint8)


def _signed_sylvester() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.tensor(HADAMARD_SIGNS, dtype=torch.float64)[:, None] * h / 4


# TE's 16 x 16 transform ``diag(HADAMARD_SIGNS) @ H / 4`` (H Sylvester's), FP64: orthonormal. A
# module constant, as E2M1_TABLE: a compiled graph takes it as one (a cached function breaks it).
HADAMARD = _signed_sylvester()


def hadamard_transform(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x``'s 2-D view rotated in groups of 16 rows (``T^T @ x[rows]``, the reference's ``x.T @ T``
    per group: along the token axis, which a wgrad GEMM reduces over; ``inverse``: ``T @``), in
    FP64 and rounded once to ``x``'s dtype. TE's reference runs it as a GEMM in ``x``'s dtype;
    the exact sum rounded once differs from that only where the GEMM's own rounding order does."""
    m, k = flat_2d(x)
    if m % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform runs over groups of 16 rows: {m} is not a multiple of 16")
    # one GEMM: each group's 16 rows side by side, (16 x 16) @ (16 x m/16 * k)
    side_by_side = x.reshape(m // HADAMARD_SIZE, HADAMARD_SIZE, k).transpose(0, 1).reshape(HADAMARD_SIZE, -1)
    transform = (HADAMARD if inverse else HADAMARD.mT).to(side_by_side.device)
    rotated = (transform @ side_by_side.double()).to(x.dtype)
    return rotated.view(HADAMARD_SIZE, m // HADAMARD_SIZE, k).transpose(0, 1).reshape(x.shape)


@dataclass(frozen=True)
class NVFP4Tensor(BlockQTensor):
    """E2M1 codes (``data``, uint8, one per element, in the tensor's shape), one E4M3 decode scale
    per block (``block_scale``) and the copy's amax (``amax``, FP32): ``e2m1(data) * block_scale *
    amax / 2688`` per element. ``scale`` is the FP32 encode scale each block was multiplied by.

    ``rotated_axis`` (0 or 1, the 2-D view's axis; None: not rotated): the codes hold the tensor
    rotated in groups of 16 along that axis (``hadamard_transform``). ``dequantize`` rotates back,
    so a copy's value is always in the tensor's own basis: any GEMM reads it right, and a GEMM of
    two copies rotated along its reduction axis gives what TE's rotated GEMM gives, up to FP32's
    rounding order (the rotation is orthonormal)."""

    block_scale: torch.Tensor
    amax: torch.Tensor
    rotated_axis: int | None = None

    @property
    def scale_inv(self) -> torch.Tensor:
        """Each block's multiplier, ``block_scale * (amax / 2688)`` in FP32."""
        return self.block_scale.float() * self.global_decode

    @property
    def global_decode(self) -> torch.Tensor:
        """``amax / 2688`` in FP32, the per-tensor factor of TE's dequantisation and GEMM alpha."""
        return self.amax.float() / GLOBAL_RANGE

    def stored_values(self) -> torch.Tensor:
        """``(e2m1 * block_scale) * (amax / 2688)`` in FP32 (the first product is exact), as the
        codes hold them: rotated where the copy is (TE's dequantisation), in the 2-D view."""
        m, k = flat_2d(self.data)
        rows, cols = self.block
        values = e2m1_values(self.data.reshape(m, k))
        if m % rows or k % cols:  # a partial block at an edge
            return values * self.per_element(self.block_scale.float()) * self.global_decode
        tiles = values.view(m // rows, rows, k // cols, cols) * self.block_scale.float()[:, None, :, None]
        return (tiles * self.global_decode).view(m, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``stored_values``, rotated back in FP64 if the copy was rotated, then ``dtype``."""
        values = self.stored_values()
        if self.rotated_axis == 0:
            values = hadamard_transform(values.double(), inverse=True)
        elif self.rotated_axis == 1:
            values = hadamard_transform(values.double().mT, inverse=True).mT
        return values.reshape(self.data.shape).to(dtype)

    @property
    def nbytes(self) -> int:
        """Two codes a byte, one byte a block scale, and the FP32 amax."""
        return (self.data.numel() + 1) // 2 + self.block_scale.numel() + 4

    @property
    def mT(self) -> NVFP4Tensor:
        """The transpose of a 2-D copy (blocks, scales and the rotated axis with it)."""
        if self.data.dim() != 2:
            raise ValueError(f"mT of an NVFP4 copy needs 2-D data, got shape {tuple(self.data.shape)}")
        axis = None if self.rotated_axis is None else 1 - self.rotated_axis
        block = (self.block[1], self.block[0])
        return NVFP4Tensor(self.data.mT, self.scale.mT, self.fmt, block, self.block_scale.mT, self.amax, axis)


@dataclass(frozen=True)
class NVFP4Quantizer:
    """One NVFP4 quantiser, TE's ``QParams`` in its own words: ``two_d`` (16 x 16 blocks, one copy
    for both directions: TE's weights), ``hadamard`` (rotate the columnwise copy: TE's wgrad
    copies of X and dY) and ``stochastic`` (round stochastically: TE's dY copies). The last
    dimension and, for 16 x 16 blocks or the transform, the others are padded with zeros to 16
    as TE's reference does; the transform refuses a length not a multiple of 16."""

    two_d: bool = False
    hadamard: bool = False
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.two_d and self.hadamard:  # TE rotates only copies in 1 x 16 blocks (X's and dY's)
            raise ValueError("an NVFP4 quantiser with 16 x 16 blocks takes no Hadamard transform")

    @property
    def square(self) -> bool:
        """Whether one copy serves both directions (16 x 16 blocks)."""
        return self.two_d

    def rotates(self, direction: str) -> bool:
        """Whether a copy quantised along ``direction`` is rotated first (the columnwise one)."""
        return self.hadamard and direction == COLUMNWISE

    def block(self, direction: str) -> tuple[int, int]:
        """The ``(rows, cols)`` block of a copy quantised along ``direction``."""
        line = line_block(HADAMARD_SIZE, direction)
        return (HADAMARD_SIZE, HADAMARD_SIZE) if self.two_d else line

    def quantize(self, x: torch.Tensor, direction: str, generator: RandomSource = None) -> NVFP4Tensor:
        block = self.block(direction)
        rotated = self.rotates(direction)
        source = hadamard_transform(x) if rotated else x
        m, k = flat_2d(source)
        rows, cols = block
        flat = source.reshape(m, k).float()
        padded = torch.nn.functional.pad(flat, (0, -k % cols, 0, -m % rows)) if m % rows or k % cols else flat
        tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        block_amax = tiles.abs().amax(dim=3).amax(dim=1)  # twice as fast as over (1, 3) at once
        amax = block_amax.amax()  # the copy's amax (the padding's zeros change neither)
        block_scale, encode = nvfp4_scales(block_amax, amax)
        y = (tiles * encode[:, None, :, None]).clamp_(-E2M1.max, E2M1.max)
        if self.stochastic:
            codes = round_e2m1_stochastic(y, (uniform_draws(y, generator) * 256).floor())
        else:
            codes = round_e2m1(y)
        data = codes.view(padded.shape)[:m, :k].reshape(x.shape)
        return NVFP4Tensor(data, encode, E2M1, block, block_scale, amax, 0 if rotated else None)


def nvfp4_scales(block_amax: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_scale, encode)`` of blocks with amaxes ``block_amax`` in a copy of amax ``amax``
    (FP32), by TE's reference: the global encode scale ``2688 / amax`` (FP32's max for a zero
    amax; 1 for an infinite one), the block's decode scale ``block_amax * (global * fp32(1/6))``
    saturated to +-448 and rounded to E4M3 (zero or subnormal for a block far below the amax),
    and its encode scale ``1 / (block_scale * (1 / global))``, at most FP32's max (a zero block
    scale: its block's elements all decode to zero)."""
    amax, block_amax = amax.float(), block_amax.float()
    global_encode = (torch.full_like(amax, GLOBAL_RANGE) / amax).clamp_max(FP32_MAX)
    global_encode = torch.where(global_encode == 0, 1.0, global_encode)
    global_decode = 1.0 / global_encode
    multiplier = global_encode * torch.tensor(E2M1.max).reciprocal()
    decode = (block_amax * multiplier).clamp_max(FP32_MAX).clamp(-E4M3.max, E4M3.max)
    block_scale = decode.to(E4M3.dtype)
    encode = (1.0 / (block_scale.float() * global_decode)).clamp_max(FP32_MAX)
    return block_scale, encode
