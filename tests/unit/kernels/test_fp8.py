"""The kernels' FP8 and BF16 arithmetic against torch's: every code, value and draw identical."""

import pytest
import torch
import triton
import triton.language as tl

from readback.kernels import fp8
from readback.numerics import E4M3, E5M2, quantize
from readback.numerics.rounding import KeyedDraws

FORMATS = {"E4M3": (E4M3, 7), "E5M2": (E5M2, 15)}
ROWS, COLUMNS = 16, 128


@triton.jit
def _round(
    y_ptr, start_ptr, out_ptr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
    STOCHASTIC: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
):  # fmt: skip
    rows, columns = tl.arange(0, ROWS), tl.arange(0, COLUMNS)
    at = rows[:, None] * COLUMNS + columns[None, :]
    y = tl.load(y_ptr + at)
    y = tl.minimum(tl.maximum(y, -MAX), MAX)
    key = (tl.load(start_ptr) & 0xFFFFFFFF).to(tl.uint32)
    u = fp8.keyed_uniform(key, rows.to(tl.int64) + tl.load(start_ptr + 1), columns)
    r = fp8.round_to_grid(y, u, STOCHASTIC, MANTISSA, 1 - BIAS)
    tl.store(out_ptr + at, fp8.encode(r, r if STOCHASTIC else y, MANTISSA, BIAS))


@triton.jit
def _decode(codes_ptr, out_ptr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, fp8.decode(tl.load(codes_ptr + i), MANTISSA, BIAS))


@triton.jit
def _bf16(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, fp8.round_bf16(tl.load(x_ptr + i)))


def _hard_values(fmt) -> torch.Tensor:
    """ROWS x COLUMNS values: every finite code's value, the midpoints between neighbours (the
    ties), a hair either side of them, beyond the max, zeros of both signs, and random values
    over the whole range, in shuffled places."""
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    beyond = torch.tensor([fmt.max * 1.01, -fmt.max * 3, 0.0, -0.0, 1e-30, -1e-30, fmt.max, -fmt.max])
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([grid, mids, near, beyond])
    spread = torch.randn(ROWS * COLUMNS - len(values), generator=generator)
    spread *= torch.exp2(torch.empty_like(spread).uniform_(-24, 17, generator=generator))
    values = torch.cat([values, spread])
    return values[torch.randperm(len(values), generator=generator)].view(ROWS, COLUMNS)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_rounding_codes_are_quantize_codes(name, rounding):
    """Nearest even and stochastic rounding (with KeyedDraws' draws) give quantize's codes."""
    fmt, bias = FORMATS[name]
    y = _hard_values(fmt)
    start = torch.tensor([0xDEADBEEF, 12345], dtype=torch.int64)
    rows = torch.arange(ROWS, dtype=torch.int64)
    out = torch.empty(ROWS, COLUMNS, dtype=torch.uint8)
    stochastic = rounding == "stochastic"
    _round[(1,)](y, start, out, ROWS, COLUMNS, stochastic, fmt.mantissa_bits, bias, fmt.max)
    expected = quantize(y, fmt, 1.0, rounding, KeyedDraws(start, rows) if stochastic else None).data
    mismatched = (out != expected.view(torch.uint8)).nonzero()
    assert len(mismatched) == 0, [(y[tuple(i)].item(), out[tuple(i)].item()) for i in mismatched[:5]]


@pytest.mark.parametrize("name", FORMATS)
def test_decode_gives_every_finite_code_its_value(name):
    fmt, bias = FORMATS[name]
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    _decode[(1,)](codes, out, fmt.mantissa_bits, bias)
    expected = codes.view(fmt.dtype).float()
    finite = torch.isfinite(expected)
    assert finite.sum() >= 248  # E4M3: 2 NaN codes; E5M2: 6 NaN and 2 infinities
    assert torch.equal(out[finite].view(torch.int32), expected[finite].view(torch.int32))  # -0 too


def test_bf16_rounding_is_torch_cast():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4096, generator=generator) * torch.exp2(torch.empty(4096).uniform_(-60, 60, generator=generator))
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 0.0, -0.0], dtype=torch.float32)
    x[: len(ties)] = ties
    out = torch.empty_like(x)
    _bf16[(1,)](x, out, len(x))
    assert torch.equal(out.view(torch.int32), x.to(torch.bfloat16).float().view(torch.int32))
