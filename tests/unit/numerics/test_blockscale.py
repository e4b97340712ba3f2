"""Block-scaled FP8 quantisers (readback.numerics.blockscale) against independent references:
torchao's MXFP8 ``to_mx`` (RCEIL) through the committed fixtures (scripts/make_blockscale_fixtures.py)
and live where torchao is installed, and a plain float64 loop written here from Transformer
Engine's rules (tests/pytorch/references/blockwise_quantizer_reference.py and
quantize_scale_calc.py for Float8BlockScaling, common/util/ptx_arch_spec.cuh float_to_e8m0 for
MXFP8; TE 2.20). Every grid case is 128 x 128 = 16384 elements."""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from readback.numerics import E4M3, E5M2, FP8Format
from readback.numerics.blockscale import (
    COLUMNWISE,
    ROWWISE,
    BlockQTensor,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    e8m0,
)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "blockscale" / "mxfp8.npz"
CASES = ("random", "zeros", "negzero", "subnormal", "top", "equal", "wide")
CASE_ELEMENTS = 128 * 128
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


@pytest.fixture(scope="module")
def fixtures() -> dict[str, np.ndarray]:
    with np.load(FIXTURES) as data:
        return {key: data[key] for key in data.files}


def grid_input(fixtures: dict[str, np.ndarray], case: str) -> torch.Tensor:
    return torch.from_numpy(fixtures[f"{case}_x"]).view(torch.bfloat16)


def mixed(fixtures: dict[str, np.ndarray]) -> torch.Tensor:
    """256 x 256: four cases side by side, so blocks of different kinds share a tensor."""
    a, b, c, d = (grid_input(fixtures, case) for case in ("random", "zeros", "wide", "subnormal"))
    return torch.cat([torch.cat([a, b], 1), torch.cat([c, d], 1)], 0)


# ---- the float64 loop reference, from TE's rules ---------------------------------------------


def f32(v: float) -> float:
    """``v`` rounded to the nearest FP32 (to infinity beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def fp8_values(fmt: FP8Format) -> list[float]:
    """The finite non-negative values of ``fmt`` in code order, from the encoding's definition."""
    ebits, mbits = {"E4M3": (4, 3), "E5M2": (5, 2)}[fmt.name]
    bias = 2 ** (ebits - 1) - 1
    values = []
    for code in range(2 ** (ebits + mbits)):
        e, m = code >> mbits, code % 2**mbits
        values.append(m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias))
    return [v for v in values if v <= fmt.max]


def round_to_code(v: float, values: list[float]) -> int:
    """The code of the nearest value to ``v`` (within the range), ties to the even code."""
    a = abs(v)
    i = bisect.bisect_left(values, a)  # values[i] >= a
    if values[i] != a:
        below, above = a - values[i - 1], values[i] - a
        if below < above or (below == above and (i - 1) % 2 == 0):
            i -= 1
    return i | (0x80 if math.copysign(1.0, v) < 0 else 0)


def ref_mxfp8_scale(amax: float, fmt: FP8Format) -> float:
    """``1 / 2**e``: ``2**e`` the least power of two >= fp32(amax * fp32(1 / max)), within [2**-127, 2**127]."""
    descale = f32(amax * f32(1 / fmt.max))
    if descale == 0:
        e = -127
    else:
        mantissa, exponent = math.frexp(descale)  # descale = mantissa * 2**exponent, mantissa in [0.5, 1)
        e = exponent - 1 if mantissa == 0.5 else exponent
    return 2.0 ** -min(max(e, -127), 127)


def ref_block_scale(amax: float, fmt: FP8Format, pow2: bool, eps: float, input_max: float) -> float:
    """quantize_scale_calc.py: fp32(max / max(amax, eps)); infinite -> the input dtype's max;
    powers of two rounded down (frexp); a zero amax -> 1."""
    amax = max(amax, f32(eps))
    if amax == 0:
        return 1.0
    scale = f32(fmt.max / amax)
    if math.isinf(scale):
        scale = f32(input_max)
    if pow2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return scale


def ref_quantize(
    x: torch.Tensor, block: tuple[int, int], fmt: FP8Format, scale_of: Callable[[float], float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, ``x``'s shape) and per-block scales (float64), one element at a time: the
    block's amax over its own elements, ``fp32(x * scale)`` clamped to the max, rounded to nearest even."""
    rows = x.reshape(-1, x.shape[-1]).double().tolist()
    m, k = len(rows), len(rows[0])
    bm, bk = block
    values = fp8_values(fmt)
    codes = [[0] * k for _ in range(m)]
    scales = [[0.0] * math.ceil(k / bk) for _ in range(math.ceil(m / bm))]
    for bi in range(len(scales)):
        for bj in range(len(scales[0])):
            cells = [(i, j) for i in range(bi * bm, min(bi * bm + bm, m)) for j in range(bj * bk, min(bj * bk + bk, k))]
            scale = scale_of(max(abs(rows[i][j]) for i, j in cells))
            scales[bi][bj] = scale
            for i, j in cells:
                y = min(max(f32(rows[i][j] * scale), -fmt.max), fmt.max)
                codes[i][j] = round_to_code(y, values)
    return torch.tensor(codes, dtype=torch.uint8).reshape(x.shape), torch.tensor(scales, dtype=torch.float64)


def assert_matches_reference(q: BlockQTensor, x: torch.Tensor, scale_of: Callable[[float], float]) -> int:
    """Codes, scales and scale_inv bit for bit; returns the number of elements compared."""
    codes, scales = ref_quantize(x, q.block, q.fmt, scale_of)
    assert torch.equal(q.data.view(torch.uint8), codes)
    assert torch.equal(q.scale, scales.float()) and q.scale.dtype == torch.float32
    expected_inv = torch.tensor([[f32(1 / s) for s in row] for row in scales.tolist()], dtype=torch.float32)
    assert torch.equal(q.scale_inv.view(torch.int32), expected_inv.view(torch.int32))
    return codes.numel()


def blockwise_scale_of(quantizer: Float8BlockQuantizer, dtype: torch.dtype) -> Callable[[float], float]:
    return lambda amax: ref_block_scale(
        amax, quantizer.fmt, quantizer.pow2_scales, quantizer.amax_epsilon, torch.finfo(dtype).max
    )


# ---- MXFP8 against torchao's bits ------------------------------------------------------------


def test_the_fixtures_cover_the_grid(fixtures):
    assert {key.removesuffix("_x") for key in fixtures if key.endswith("_x")} == set(CASES)
    assert all(grid_input(fixtures, case).shape == (128, 128) for case in CASES)


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_mxfp8_is_torchaos_bits(fixtures, case, fmt, direction):
    """16384 codes and 512 E8M0 scales per case, format and direction."""
    q = MXFP8Quantizer(FORMATS[fmt]).quantize(grid_input(fixtures, case), direction)
    assert q.scale.shape == ((128, 4) if direction == ROWWISE else (4, 128))
    assert np.array_equal(q.data.view(torch.uint8).numpy(), fixtures[f"{case}_{fmt}_{direction}_data"])
    assert np.array_equal(e8m0(q.scale_inv).numpy(), fixtures[f"{case}_{fmt}_{direction}_scale"])


def test_mxfp8_all_zero_blocks_get_the_smallest_e8m0_scale(fixtures):
    q = MXFP8Quantizer().quantize(grid_input(fixtures, "zeros"))
    assert torch.equal(e8m0(q.scale_inv), torch.zeros(128, 4, dtype=torch.uint8))  # 2**-127
    assert torch.equal(q.scale, torch.full((128, 4), 2.0**127))
    assert torch.equal(q.data.view(torch.uint8)[64:], torch.full((64, 128), 0x80, dtype=torch.uint8))  # -0 kept


def torchao_to_mx(x: torch.Tensor, fmt: FP8Format, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's codes and E8M0 scale codes for the ``direction`` copy of 2-D ``x``."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    source = x if direction == ROWWISE else x.T.contiguous()
    scale, data = to_mx(source, fmt.dtype, 32, ScaleCalculationMode.RCEIL)
    scale, data = scale.view(torch.uint8), data.view(torch.uint8)
    return (data, scale) if direction == ROWWISE else (data.T, scale.T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mxfp8_is_torchaos_bits_live(fmt):
    """Fresh BF16 tensors of normal magnitudes, 2-D and 3-D (76800 elements a direction), in the
    range where torchao 0.18.0's eager RCEIL already computes TE's rule."""
    pytest.importorskip("torchao", reason="torchao (the audit extra) is not installed: the fixtures check MXFP8")
    g = torch.Generator().manual_seed(7)
    checked = 0
    for shape in ((64, 256), (2, 96, 128), (160, 96)):
        x = (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-30, 30, shape, generator=g)).to(torch.bfloat16)
        for direction in (ROWWISE, COLUMNWISE):
            q = MXFP8Quantizer(FORMATS[fmt]).quantize(x, direction)
            data, scale = torchao_to_mx(x.reshape(-1, shape[-1]), FORMATS[fmt], direction)
            assert torch.equal(q.data.view(torch.uint8).reshape(data.shape), data), (shape, direction)
            assert torch.equal(e8m0(q.scale_inv), scale), (shape, direction)
            checked += x.numel()
    assert checked == 2 * (64 * 256 + 2 * 96 * 128 + 160 * 96)


def test_mxfp8_fixture_grid_live(fixtures):
    """The whole grid (7 x 16384 elements, both formats and directions) through the installed torchao."""
    pytest.importorskip("torchao", reason="torchao (the audit extra) is not installed: the fixtures check MXFP8")
    from torchao.prototype.mx_formats import mx_tensor

    if not hasattr(mx_tensor, "_f32_to_e8m0_rceil"):
        pytest.skip(
            "this torchao's eager RCEIL is not TE's rule (it multiplies blocks whose scale is 2**-127 "
            "by 1: the subnormal case differs); torchao from commit 5d73a0c on has it"
        )
    for case in CASES:
        x = grid_input(fixtures, case)
        for fmt in FORMATS.values():
            for direction in (ROWWISE, COLUMNWISE):
                q = MXFP8Quantizer(fmt).quantize(x, direction)
                data, scale = torchao_to_mx(x, fmt, direction)
                assert torch.equal(q.data.view(torch.uint8), data) and torch.equal(e8m0(q.scale_inv), scale)


# ---- both recipes against the loop reference -------------------------------------------------


@pytest.mark.parametrize("two_d", [False, True], ids=["1x32", "32x32"])
@pytest.mark.parametrize("case", CASES)
def test_mxfp8_matches_the_loop_reference(fixtures, case, two_d):
    """16384 elements per case and block shape (32x32: TE's enable_2d_quantization, which torchao lacks)."""
    x = grid_input(fixtures, case)
    q = MXFP8Quantizer(two_d=two_d).quantize(x, COLUMNWISE)
    assert q.block == ((32, 32) if two_d else (32, 1))
    assert assert_matches_reference(q, x, lambda amax: ref_mxfp8_scale(amax, E4M3)) == CASE_ELEMENTS


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize(
    ("dim", "direction"), [(1, ROWWISE), (1, COLUMNWISE), (2, ROWWISE)], ids=["1x128", "128x1", "128x128"]
)
@pytest.mark.parametrize("case", CASES)
def test_float8_block_matches_the_loop_reference(fixtures, case, dim, direction, pow2):
    """16384 BF16 elements, E4M3, per case, block shape and scale kind."""
    x = grid_input(fixtures, case)
    quantizer = Float8BlockQuantizer(block_scaling_dim=dim, pow2_scales=pow2)
    q = quantizer.quantize(x, direction)
    assert assert_matches_reference(q, x, blockwise_scale_of(quantizer, x.dtype)) == CASE_ELEMENTS


@pytest.mark.parametrize("case", ["subnormal", "wide", "top"])
def test_float8_block_fp32_inputs_e5m2_and_epsilon(fixtures, case):
    """16384 elements per case and setting: FP32 input (a block of subnormals gets FP32's max as
    its scale, BF16's max for BF16 input), E5M2 (HYBRID's gradients), an amax epsilon."""
    x = grid_input(fixtures, case)
    for quantizer, source in (
        (Float8BlockQuantizer(pow2_scales=False), x.float()),
        (Float8BlockQuantizer(pow2_scales=True), x.float()),
        (Float8BlockQuantizer(fmt=E5M2), x),
        (Float8BlockQuantizer(amax_epsilon=2.0**-10, pow2_scales=False), x),
    ):
        q = quantizer.quantize(source, COLUMNWISE)
        assert assert_matches_reference(q, source, blockwise_scale_of(quantizer, source.dtype)) == CASE_ELEMENTS


def test_float8_block_scales_of_zero_and_subnormal_blocks(fixtures):
    zeros = Float8BlockQuantizer().quantize(grid_input(fixtures, "zeros"))
    assert torch.equal(zeros.scale, torch.ones(128, 1))  # an all-zero block: scale 1
    tiny = grid_input(fixtures, "subnormal")[:64]  # BF16 subnormals: 448 / amax overflows FP32
    bf16_max = torch.finfo(torch.bfloat16).max
    assert torch.equal(Float8BlockQuantizer(pow2_scales=False).quantize(tiny).scale, torch.full((64, 1), bf16_max))
    assert torch.equal(Float8BlockQuantizer().quantize(tiny).scale, torch.full((64, 1), 2.0**127))


def test_infinities_saturate_as_the_kernels_do():
    """An infinite element makes its block's amax infinite: TE's kernels then scale by 1
    (Float8BlockScaling, recipe_common.cuh) or by 2**-127 (MXFP8, E8M0 code 254) and the
    saturating cast writes +-max. Only this puts a value beyond the max after scaling: a finite
    amax's scale keeps the block within it (up to one FP32 rounding, which rounds to the max)."""
    row = torch.zeros(32, 128)
    row[:, :4] = torch.tensor([math.inf, -math.inf, 1000.0, 1.0])
    block = Float8BlockQuantizer().quantize(row)
    assert torch.equal(block.scale, torch.ones(32, 1))
    assert torch.equal(block.data[:, :4].float(), torch.tensor([448.0, -448.0, 448.0, 1.0]).expand(32, 4))
    mx = MXFP8Quantizer().quantize(row)
    assert torch.equal(e8m0(mx.scale_inv)[:, 0], torch.full((32,), 254, dtype=torch.uint8))
    assert torch.equal(mx.data[:, :4].float(), torch.tensor([448.0, -448.0, 0.0, 0.0]).expand(32, 4))


# ---- shapes that are not multiples of the block ----------------------------------------------


@pytest.mark.parametrize(
    ("view", "elements"),
    [
        (lambda t: t, 65536),
        (lambda t: t[:200, :130], 26000),
        (lambda t: t[:150, :140].reshape(3, 50, 140), 21000),
        (lambda t: t[0, :200], 200),
    ],
    ids=["256x256", "200x130", "3x50x140", "200"],
)
def test_float8_block_pads_partial_blocks_with_zeros(fixtures, view, elements):
    """TE pads to whole blocks (the partial block's amax is its own elements') and drops the padding."""
    x = view(mixed(fixtures))
    for dim, direction in ((1, ROWWISE), (1, COLUMNWISE), (2, ROWWISE)):
        quantizer = Float8BlockQuantizer(block_scaling_dim=dim)
        q = quantizer.quantize(x, direction)
        assert q.data.shape == x.shape
        assert assert_matches_reference(q, x, blockwise_scale_of(quantizer, x.dtype)) == elements


@pytest.mark.parametrize("shape", [(33, 64), (64, 48), (64,), (2, 17, 32), ()])
def test_mxfp8_refuses_shapes_that_are_not_multiples_of_32(shape):
    with pytest.raises(ValueError, match=r"multiples of 32|at least one dimension"):
        MXFP8Quantizer().quantize(torch.ones(shape), ROWWISE)


# ---- the API around the codes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "quantizer",
    [MXFP8Quantizer(), MXFP8Quantizer(two_d=True), Float8BlockQuantizer(), Float8BlockQuantizer(pow2_scales=False)],
    ids=["mxfp8", "mxfp8-2d", "block-pow2", "block-fp32"],
)
def test_dequantize_is_the_codes_times_scale_inv(fixtures, quantizer):
    x = mixed(fixtures)[:, :192]
    for direction in (ROWWISE, COLUMNWISE):
        q = quantizer.quantize(x, direction)
        expected = q.data.float() * q.per_element(q.scale_inv)
        assert torch.equal(q.dequantize().view(torch.int32), expected.view(torch.int32))
        assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    random = grid_input(fixtures, "random").float()
    assert (quantizer.quantize(random).dequantize() - random).abs().max() <= random.abs().max() / 2**4


def codes(q: BlockQTensor) -> torch.Tensor:
    return q.data.view(torch.uint8)


def test_copies_are_each_rounded_from_the_original(fixtures):
    x = grid_input(fixtures, "random")
    row, column = (Float8BlockQuantizer().quantize(x, d) for d in (ROWWISE, COLUMNWISE))
    assert torch.equal(codes(row.mT), codes(Float8BlockQuantizer().quantize(x.T, COLUMNWISE)))
    assert not torch.equal(codes(row), codes(column))  # two roundings of one tensor
    square = Float8BlockQuantizer(block_scaling_dim=2)
    assert torch.equal(codes(square.quantize(x, ROWWISE)), codes(square.quantize(x, COLUMNWISE)))
    assert square.quantize(x).mT.block == (128, 128) and row.mT.block == (128, 1)


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="direction"):
        MXFP8Quantizer().quantize(torch.ones(32, 32), "diagonal")
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8BlockQuantizer(amax_epsilon=-1.0)
