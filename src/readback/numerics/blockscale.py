"""Block-scaled FP8: the quantisers of Transformer Engine's ``MXFP8BlockScaling`` and
``Float8BlockScaling`` recipes (TE 2.20), bit for bit.

A tensor is seen as 2-D, its leading dimensions flattened (TE's ``flat_2d_dims``), and cut into
blocks of ``(rows, cols)``: ``1 x n`` along the rows (``rowwise``), ``n x 1`` down the columns
(``columnwise``) or ``n x n``. Each block is scaled by its own amax, and every copy is quantised
from the original tensor, never from another copy: the two directions are two different
roundings of one tensor, as in TE. The rounding itself is ``rounding.quantize``'s (multiply in
FP32, saturate, round to nearest even), the scale rules are ``mxfp8_scale`` and
``float8_block_scale``; nothing else rounds.

Convention, ``QTensor``'s: ``value ~= data / scale``, each block's scale standing for every element
of its block; ``scale_inv`` (``1 / scale`` in FP32) is TE's ``scale_inv``, the multiplier that
dequantisation and the GEMMs apply. ``data`` keeps the original shape and layout whatever the
direction (TE's columnwise data of ``Float8BlockScaling`` is ``data.mT``; MXFP8's is ``data``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from readback.numerics.formats import E4M3, FP8Format
from readback.numerics.rounding import decode, quantize

ROWWISE, COLUMNWISE = "rowwise", "columnwise"
DIRECTIONS = (ROWWISE, COLUMNWISE)


@dataclass(frozen=True)
class BlockQTensor:
    """FP8 codes and one FP32 scale per block: ``value ~= data / scale`` block by block.

    ``scale`` has one entry per block of the 2-D view ``M x K``: shape ``(ceil(M / rows),
    ceil(K / cols))`` for ``block = (rows, cols)``; a partial block at an edge has a scale too.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: FP8Format
    block: tuple[int, int]

    @property
    def scale_inv(self) -> torch.Tensor:
        """``1 / scale``, rounded to FP32: TE's ``scale_inv`` (exact for power-of-two scales)."""
        return self.scale.reciprocal()

    def per_element(self, per_block: torch.Tensor) -> torch.Tensor:
        """A per-block tensor (like ``scale``) repeated over its blocks: the 2-D view's shape."""
        m, k = flat_2d(self.data)
        rows, cols = self.block
        return per_block.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``decode(data) * scale_inv`` in FP32 (TE's dequantisation), then cast to ``dtype``."""
        values = decode(self.data.reshape(flat_2d(self.data)), torch.float32) * self.per_element(self.scale_inv)
        return values.reshape(self.data.shape).to(dtype)

    @property
    def nbytes(self) -> int:
        """The codes' and the FP32 scales' bytes."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def mT(self) -> BlockQTensor:
        """The transpose of a 2-D tensor, its blocks and scales transposed with it (an ``n x n``
        copy serves both GEMM operand layouts this way, as TE's 128x128 weights do)."""
        if self.data.dim() != 2:
            raise ValueError(f"mT of a block-scaled tensor needs 2-D data, got shape {tuple(self.data.shape)}")
        return BlockQTensor(self.data.mT, self.scale.mT, self.fmt, (self.block[1], self.block[0]))


def e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """The E8M0 codes (uint8) of power-of-two ``scale_inv``: its FP32 exponent field (2**-127, an
    FP32 subnormal, has field 0, which is E8M0's code for 2**-127)."""
    return ((scale_inv.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def mxfp8_scale(amax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Each MXFP8 block's scale ``2**-e``, where ``2**e`` (its E8M0 ``scale_inv``) is ``amax *
    fp32(1 / fmt.max)``, multiplied in FP32, rounded up to a power of two, clamped to [2**-127,
    2**127]. An all-zero block gets 2**-127 (code 0), so its scale is 2**127; a NaN amax, NaN.

    Rounding up keeps the block's amax within ``fmt.max`` (up to the FP32 rounding of the
    product). TE 2.20 ``common/util/ptx_arch_spec.cuh`` ``float_to_e8m0`` (``cvt.rp.satfinite``)
    and ``common/util/ptx.cuh`` ``exp2f_rcp``; torchao's ``to_mx`` RCEIL is the same rule from
    its commit 5d73a0c on (``_f32_to_e8m0_rceil``), not in torchao 0.18.0's eager code.
    """
    descale = amax.float() * torch.tensor(1.0 / fmt.max, dtype=torch.float32)
    bits = descale.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # any fraction rounds up; an FP32 subnormal only above 2**-127 (code 0); 254 is the top code
    up = torch.where(exponent == 0, mantissa > 0x400000, (mantissa != 0) & (exponent < 254))
    code = torch.where(torch.isinf(descale), 254, exponent + up.int())
    # 2**(127 - code) from its bits: code 254 gives 2**-127, an FP32 subnormal
    scale_bits = torch.where(code == 254, 0x00400000, (254 - code).clamp_min(0) << 23)
    scale = scale_bits.view(torch.float32)
    return torch.where(torch.isnan(descale), torch.nan, scale)


def float8_block_scale(
    amax: torch.Tensor, fmt: FP8Format, pow2_scales: bool, epsilon: float, input_dtype: torch.dtype
) -> torch.Tensor:
    """Each ``Float8BlockScaling`` block's scale: ``fmt.max / max(amax, epsilon)`` in FP32, 1
    where that amax is 0 or not finite; where the quotient overflows FP32 (a block of tiny
    values), the largest finite value of the input's dtype; with ``pow2_scales`` rounded down to
    a power of two (its mantissa dropped), so the largest quotient becomes 2**127.

    TE 2.20 ``common/recipe/recipe_common.cuh`` ``compute_scale_from_amax``, the rules of
    ``tests/pytorch/references/quantize_scale_calc.py`` (which gives an infinite amax scale 0,
    where the kernels give 1).
    """
    amax = amax.float().clamp_min(epsilon)
    scale = torch.full_like(amax, fmt.max) / amax  # one rounding (``max / tensor`` is ``max * (1 / tensor)``)
    scale = torch.where(torch.isinf(scale), torch.finfo(input_dtype).max, scale)
    if pow2_scales:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, 1.0)


def flat_2d(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"block scaling needs a non-empty tensor of at least one dimension, got {tuple(x.shape)}")
    return x.numel() // x.shape[-1], x.shape[-1]


def line_block(n: int, direction: str) -> tuple[int, int]:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}; valid: {list(DIRECTIONS)}")
    return (1, n) if direction == ROWWISE else (n, 1)


def _quantize_blocks(
    x: torch.Tensor, block: tuple[int, int], fmt: FP8Format, scale_of: Callable[[torch.Tensor], torch.Tensor]
) -> BlockQTensor:
    """Zero-pad the 2-D view to whole blocks (a partial block's amax is its own elements'), scale
    each block by ``scale_of(its amax)``, round, and drop the padding."""
    m, k = flat_2d(x)
    rows, cols = block
    padded = torch.nn.functional.pad(x.reshape(m, k), (0, -k % cols, 0, -m % rows))
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = scale_of(tiles.abs().amax(dim=(1, 3)).float())
    codes = quantize(tiles, fmt, scale[:, None, :, None]).data
    return BlockQTensor(codes.view(padded.shape)[:m, :k].reshape(x.shape), scale, fmt, block)


@dataclass(frozen=True)
class MXFP8Quantizer:
    """``MXFP8BlockScaling``'s quantiser: ``fmt`` elements (E4M3, TE's default for gradients too;
    E5M2 for HYBRID's gradients), one E8M0 scale per 32 consecutive elements along the direction.

    ``two_d`` quantises 32x32 blocks, one copy for both directions: TE's ``enable_2d_quantization``,
    which TE applies to the forward weights of linear layers only (``pytorch/quantization.py``).
    TE's PyTorch quantiser refuses a tensor whose last dimension or product of the others is not a
    multiple of 32 (``pytorch/csrc/quantizer.cpp``, ``MXFP8Quantizer::get_scale_shape``); so does this.
    """

    fmt: FP8Format = E4M3
    two_d: bool = False

    @property
    def square(self) -> bool:
        """Whether one copy serves both directions (square blocks)."""
        return self.two_d

    def block(self, direction: str = ROWWISE) -> tuple[int, int]:
        """The ``(rows, cols)`` block of a copy quantised along ``direction``."""
        line = line_block(32, direction)
        return (32, 32) if self.two_d else line

    def quantize(self, x: torch.Tensor, direction: str = ROWWISE) -> BlockQTensor:
        block = self.block(direction)
        m, k = flat_2d(x)
        if m % 32 or k % 32:
            raise ValueError(
                f"MXFP8 needs the last dimension and the product of the others to be multiples of 32, "
                f"as Transformer Engine does; got shape {tuple(x.shape)}"
            )
        return _quantize_blocks(x, block, self.fmt, lambda amax: mxfp8_scale(amax, self.fmt))


@dataclass(frozen=True)
class Float8BlockQuantizer:
    """``Float8BlockScaling``'s quantiser: ``block_scaling_dim`` 1 for 1x128 tiles (rowwise) and
    128x1 (columnwise), TE's default for activations and gradients; 2 for 128x128 blocks, its
    default for weights, one copy for both directions. FP32 scales, powers of two unless
    ``pow2_scales`` is False (TE: ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` at import). A shape that
    is not a multiple of the block is padded with zeros, as TE's kernels do (its scale tensors
    are sized with ``ceildiv``, ``pytorch/csrc/quantizer.cpp``).
    """

    fmt: FP8Format = E4M3
    block_scaling_dim: int = 1
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if self.block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim={self.block_scaling_dim}; valid: [1, 2]")
        if not (math.isfinite(self.amax_epsilon) and self.amax_epsilon >= 0):
            raise ValueError(f"amax_epsilon={self.amax_epsilon} must be finite and >= 0")

    @property
    def square(self) -> bool:
        """Whether one copy serves both directions (128x128 blocks)."""
        return self.block_scaling_dim == 2

    def block(self, direction: str = ROWWISE) -> tuple[int, int]:
        """The ``(rows, cols)`` block of a copy quantised along ``direction``."""
        line = line_block(128, direction)
        return (128, 128) if self.block_scaling_dim == 2 else line

    def quantize(self, x: torch.Tensor, direction: str = ROWWISE) -> BlockQTensor:
        return _quantize_blocks(
            x,
            self.block(direction),
            self.fmt,
            lambda amax: float8_block_scale(amax, self.fmt, self.pow2_scales, self.amax_epsilon, x.dtype),
        )
