"""Rounding to the FP8 grid: the one place where a tensor becomes FP8.

``quantize`` scales, saturates and rounds. ``nearest`` is torch's cast (round to nearest even);
``stochastic`` is an unbiased rounding whose randomness comes from an explicit generator (or a
generator's state, which a compiled step can draw from), so a run is reproducible and two
generators give independent roundings of the same tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from readback.numerics.formats import BF16, FP8Format

ROUNDINGS = ("nearest", "stochastic")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.cache
def _decode_table(fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The value of each of the 256 codes of ``fp8_dtype``, in ``dtype`` (torch's own cast)."""
    return torch.arange(256, dtype=torch.uint8).view(fp8_dtype).to(dtype)


def decode(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data.to(dtype)``, bit for bit; FP8 on the CPU goes through a 256-entry table, several
    times faster than torch's cast. The layout of a (transposed) contiguous tensor is kept.
    A compiled graph takes the cast, which the compiler fuses with its neighbours."""
    if data.dtype not in _FP8_DTYPES or data.device.type != "cpu" or torch.compiler.is_compiling():
        return data.to(dtype)
    if not data.is_contiguous():
        return decode(data.mT, dtype).mT if data.dim() >= 2 and data.mT.is_contiguous() else data.to(dtype)
    codes = data.view(torch.uint8).reshape(-1).int()
    return _decode_table(data.dtype, dtype).index_select(0, codes).view(data.shape)


@dataclass(frozen=True)
class QTensor:
    """An FP8 tensor and the scale it was stored with: ``value ~= data / scale``."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: FP8Format | None  # None: rounding off, ``data`` is the tensor itself

    @property
    def scale_inv(self) -> torch.Tensor:
        """Multiplier back to real units; Transformer Engine's GEMMs multiply by it."""
        return self.scale.reciprocal()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Real values, computed in FP32 (FP64 if asked) and then cast to ``dtype``. BF16 is
        never scaled (its scale is 1), so its values are its data."""
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        if self.fmt is BF16:
            return self.data.to(dtype)
        return (decode(self.data, exact) * self.scale_inv.to(exact)).to(dtype)

    @property
    def mT(self) -> QTensor:
        """Transpose of the last two dimensions (same scale)."""
        return QTensor(self.data.mT, self.scale, self.fmt)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QTensor:
        """Apply a layout change (view, reshape, expand) to the data, keeping the scale."""
        return QTensor(fn(self.data), self.scale, self.fmt)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _grid_spacing(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Distance between the two FP8 grid points around each ``y`` (already scaled, fp32).

    Masking the fp32 exponent bits of ``y`` gives ``2**e`` of its binade ``[2**e, 2**(e+1))``,
    where the FP8 spacing is ``2**(e - mantissa_bits)``; below the smallest normal it is constant.
    """
    binade = (y.view(torch.int32) & 0x7F800000).view(torch.float32)
    return binade.clamp_min(2.0**fmt.min_exponent) * 2.0**-fmt.mantissa_bits


def _draw(state: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator(device=like.device)
    generator.set_state(state)
    draws = torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)
    state.copy_(generator.get_state())
    return draws


@torch.library.custom_op("readback::uniform", mutates_args=("state",))
def uniform(state: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """FP32 uniforms in [0, 1) shaped like ``like``, from the generator whose state is ``state``,
    which the draw advances in place: the draws of a ``torch.Generator`` in that state, bit for
    bit, as an op that ``torch.compile`` traces (it cannot trace a ``torch.Generator``)."""
    return _draw(state, like)


@uniform.register_fake
def _(state: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=torch.float32, device=like.device)


_MASK32 = 0xFFFF_FFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32" form, constants below 2**31 so that the int64
    products never overflow) of int64 ``x`` in [0, 2**32), in place where it can."""
    x = x ^ (x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


@dataclass(frozen=True)
class KeyedDraws:
    """Uniforms keyed by position, for a tensor rounded block by block whose rounding is
    recomputed (attention's P): the draw of element ``(..., r, j)`` of a block is a hash of
    (key, ``first + rows[..., r]``, ``j``), whatever block it falls in and whenever that block
    runs, so a backward that rounds the same block again gets the very draws of the forward.
    ``start`` is ``[key, first]`` (``RandomStreams.claim``); ``rows`` (int64, the block's
    shape without its last dimension) each row's index within the claimed ones."""

    start: torch.Tensor
    rows: torch.Tensor

    def uniform(self, like: torch.Tensor) -> torch.Tensor:
        """FP32 uniforms in [0, 1) shaped like ``like`` (multiples of 2**-24)."""
        key, first = self.start[0], self.start[1]
        row_keys = _hash32(_hash32((self.rows + first).bitwise_and_(_MASK32)) ^ key)
        columns = _hash32(torch.arange(like.shape[-1], dtype=torch.int64, device=like.device))
        bits = _hash32(row_keys[..., None] ^ columns) >> 8
        return bits.to(torch.float32).mul_(2.0**-24)


# a generator, a generator's state (``uniform``), draws keyed by position, or torch's
RandomSource = torch.Generator | torch.Tensor | KeyedDraws | None


def round_stochastic(y: torch.Tensor, fmt: FP8Format, generator: RandomSource) -> torch.Tensor:
    """Round fp32 ``y`` (within ``+-fmt.max``) to one of its two FP8 neighbours, unbiased.

    ``y / spacing`` is exact (a power-of-two scaling), so ``frac`` is exact and rounding up with
    probability ``frac`` gives ``E[result] = y``, subnormals included. The result is on the FP8 grid.
    """
    spacing = _grid_spacing(y, fmt)
    units = y / spacing
    low = torch.floor(units)
    frac = units - low
    return (low + (uniform_draws(y, generator) < frac).to(torch.float32)) * spacing


def uniform_draws(like: torch.Tensor, generator: RandomSource) -> torch.Tensor:
    """FP32 uniforms in [0, 1) shaped like ``like`` (multiples of 2**-24), from ``generator``."""
    if isinstance(generator, KeyedDraws):
        return generator.uniform(like)
    if isinstance(generator, torch.Tensor):
        # the op where a graph is traced; eager draws directly (a custom op's first call loads
        # some 70 MB of torch's compiler modules)
        return uniform(generator, like) if torch.compiler.is_compiling() else _draw(generator, like)
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: FP8Format,
    scale: torch.Tensor | float,
    rounding: str = "nearest",
    generator: RandomSource = None,
    saturate: bool = True,
) -> QTensor:
    """Scale ``x``, saturate to ``+-fmt.max`` (as Transformer Engine does, for both formats;
    infinities saturate too, NaN stays NaN) and round to ``fmt``.

    ``saturate=False`` skips the clamp for a caller that knows ``amax * scale <= fmt.max``
    (then the clamp changes nothing). BF16 is never scaled: ``round_bf16`` rounds to it."""
    if fmt is BF16:
        raise ValueError("BF16 is not scaled: round to it with round_bf16")
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    y = x.to(torch.float32) * scale
    if saturate:
        y = y.clamp_(-fmt.max, fmt.max)
    if rounding == "stochastic":
        y = round_stochastic(y, fmt, generator)
    elif rounding != "nearest":
        raise ValueError(f"unknown rounding {rounding!r}; valid: {list(ROUNDINGS)}")
    return QTensor(y.to(fmt.dtype), scale, fmt)


def round_bf16(x: torch.Tensor) -> QTensor:
    """``x`` rounded to nearest BF16, unscaled (scale 1), saturating to ``+-BF16.max`` like the
    FP8 formats. The clamp runs on the BF16 copy: a value beyond the max rounds to the max or to
    infinity, and either clamps to the max, so these are the bits of clamping first, at half the
    memory traffic and without the FP32 temporary."""
    if x.dtype == torch.bfloat16:
        return QTensor(x.clamp(-BF16.max, BF16.max), torch.ones((), device=x.device), BF16)
    data = x.to(torch.bfloat16).clamp_(-BF16.max, BF16.max)
    return QTensor(data, torch.ones((), device=x.device), BF16)


def pinned(x: torch.Tensor, executed: torch.Tensor) -> torch.Tensor:
    """Straight-through: the value the executed forward produced, with ``x``'s gradient.

    This is how a reference replay makes each rounding site return the exact bits of the
    executed forward while autograd differentiates the high-precision formula.
    """
    return x + (executed - x).detach()
