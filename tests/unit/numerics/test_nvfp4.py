"""NVFP4 (readback.numerics.nvfp4) against Transformer Engine's reference rules, run by
scripts/make_nvfp4_fixtures.py on a grid of 15 tensors of 128 x 128 (TE 2.20's
``reference_nvfp4.py`` itself; tests/fixtures/nvfp4/nvfp4.npz), against torchao's NVFP4 quantiser
where the two agree and where they are known not to, and TE's 8-bit stochastic rounding by
enumerating its 256 draws."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from readback.numerics.blockscale import COLUMNWISE, ROWWISE
from readback.numerics.nvfp4 import (
    E2M1,
    HADAMARD,
    NVFP4Quantizer,
    e2m1_values,
    hadamard_transform,
    round_e2m1,
    round_e2m1_stochastic,
)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nvfp4" / "nvfp4.npz"
BF16_CASES = ("random", "zeros", "negzero", "subnormal", "top", "equal", "wide")
BF16_CASES += ("wide16", "blockrange", "ties", "scaleties", "tiny")
INPUTS = [f"{c}_bf16" for c in BF16_CASES] + [f"{c}_fp32" for c in ("random", "wide16", "blockrange")]
CONFIGS = {"1d": NVFP4Quantizer(), "2d": NVFP4Quantizer(two_d=True)}
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.fixture(scope="module")
def fixtures() -> dict[str, np.ndarray]:
    with np.load(FIXTURES) as data:
        return {key: data[key] for key in data.files}


def tensor_of(fixtures: dict[str, np.ndarray], key: str) -> torch.Tensor:
    bits = torch.from_numpy(fixtures[key])
    return bits.view(torch.bfloat16 if bits.dtype == torch.int16 else torch.float32)


def fixture_layout(q, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale codes)`` of a copy as the fixtures lay them out: a rowwise copy of x, a
    columnwise one of x.T, each 16-element line's scale on its row (a 16 x 16 tile's repeated on
    its 16 rows)."""
    scale = q.block_scale.view(torch.uint8)
    if direction == COLUMNWISE:
        scale = scale.T
    if q.block == (16, 16):
        scale = scale.repeat_interleave(16, 0)
    return (q.data if direction == ROWWISE else q.data.T), scale


def _fixture_copy(fixtures, name: str, cfg: str, direction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prefix = f"{name}_{cfg}_{direction}"
    return tuple(torch.from_numpy(fixtures[f"{prefix}_{f}"]) for f in ("data", "scale", "amax"))


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
def test_codes_scales_and_amax_are_te_reference_bits(fixtures, name, cfg, direction):
    """1x16 lines and 16x16 blocks, both directions: every E2M1 code, E4M3 block scale and amax."""
    q = CONFIGS[cfg].quantize(tensor_of(fixtures, f"{name}_x"), direction)
    data, scale, amax = _fixture_copy(fixtures, name, cfg, direction)
    ours_data, ours_scale = fixture_layout(q, direction)
    assert torch.equal(ours_data, data) and torch.equal(ours_scale, scale)
    assert torch.equal(q.amax.reshape(1), amax)


def test_the_grid_reaches_the_rules_edges(fixtures):
    """The fixtures hold what the rules are about: zero and subnormal E4M3 block scales, the
    largest (448), elements scaled onto E2M1's midpoints, and an amax whose encode scale overflows."""
    scales = torch.cat([torch.from_numpy(fixtures[f"{n}_1d_rowwise_scale"]).flatten() for n in INPUTS])
    assert (scales == 0).sum() > 1000 and ((scales > 0) & (scales < 8)).sum() > 100 and (scales == 0x7E).sum() > 10
    ties = CONFIGS["1d"].quantize(tensor_of(fixtures, "ties_bf16_x"), ROWWISE)
    y = ties.per_element(ties.scale) * tensor_of(fixtures, "ties_bf16_x").float()
    assert torch.isin(y.abs(), torch.tensor(E2M1_MIDPOINTS)).sum() > 10_000
    assert float(tensor_of(fixtures, "tiny_bf16_x").float().abs().max()) < 2688 / torch.finfo(torch.float32).max


@pytest.mark.parametrize("name", INPUTS)
def test_the_hadamard_copy_is_te_reference_bits_given_its_rotated_input(fixtures, name):
    """The ``rht`` columnwise copy: quantising the reference's own rotated x.T reproduces it, and
    ours rotates x to the same bits wherever the reference's BF16 matmul is exact (BF16 inputs
    whose products stay FP32 normals; FP32 inputs depend on its summation order)."""
    rotated_t = tensor_of(fixtures, f"{name}_rht_columnwise_x")
    data, scale, amax = _fixture_copy(fixtures, name, "rht", COLUMNWISE)
    q = NVFP4Quantizer().quantize(rotated_t, ROWWISE)
    assert torch.equal(q.data, data) and torch.equal(q.block_scale.view(torch.uint8), scale)
    assert torch.equal(q.amax.reshape(1), amax)
    x = tensor_of(fixtures, f"{name}_x")
    exact = name.endswith("bf16") and not name.startswith(("subnormal", "wide_", "tiny"))
    if exact:
        assert torch.equal(hadamard_transform(x).T.view(torch.int16), rotated_t.view(torch.int16))
        ours = NVFP4Quantizer(hadamard=True).quantize(x, COLUMNWISE)
        assert torch.equal(ours.data.T, data) and ours.rotated_axis == 0


def test_the_transform_is_te_signed_sylvester_matrix_and_orthonormal():
    h = HADAMARD
    assert torch.equal(h @ h.mT, torch.eye(16, dtype=torch.float64))
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    assert h[0].tolist() == [0.25] * 16 and h[3, 0] < 0  # row 0 all +, sign vector's 4th entry -1


def _torchao_rules_explain(fixtures, name: str) -> None:
    ours = CONFIGS["1d"].quantize(tensor_of(fixtures, f"{name}_x"), ROWWISE)
    theirs_scale = torch.from_numpy(fixtures[f"{name}_torchao_rowwise_scale"])
    theirs_data = torch.from_numpy(fixtures[f"{name}_torchao_rowwise_data"])
    ours_scale = ours.block_scale.view(torch.uint8)
    # torchao floors each block scale at E4M3's smallest normal, 2**-6 (code 8); TE lets it go subnormal or to 0
    floored = ours_scale < 8
    assert torch.equal(theirs_scale != ours_scale, floored) and bool((theirs_scale[floored] == 8).all())
    # In blocks with the same scale the codes agree, but for -0.0 (TE: +0's code, torchao: -0's)
    # and elements scaled to within an FP32 ulp of an E2M1 midpoint (the encode scales differ by one)
    x = tensor_of(fixtures, f"{name}_x").float()
    same = ~ours.per_element(floored.to(torch.float32)).bool()
    y = (x * ours.per_element(ours.scale)).abs()
    near_tie = torch.zeros_like(y, dtype=torch.bool)
    for m in E2M1_MIDPOINTS:
        near_tie |= (y - m).abs() <= torch.finfo(torch.float32).eps * m
    negzero = (x == 0) & torch.signbit(x)
    differ = (theirs_data != ours.data) & same
    assert not (differ & ~near_tie & ~negzero).any()


@pytest.mark.parametrize("name", [f"{c}_bf16" for c in ("random", "negzero", "subnormal", "wide16", "blockrange")])
def test_torchao_differs_from_te_only_where_its_rules_do(fixtures, name):
    """torchao 0.18's ``nvfp4_quantize`` floors block scales at 2**-6 (wide ranges: TE's go
    subnormal or zero), codes -0.0 as -0 and rounds its encode scale another way; nothing else."""
    _torchao_rules_explain(fixtures, name)


def test_torchao_live_matches_the_fixtures_where_installed(fixtures):
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = tensor_of(fixtures, "random_bf16_x")
    scale, packed = nvfp4.nvfp4_quantize(x, 16, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(x.abs().amax()))
    data = torch.stack([packed & 0x0F, packed >> 4], -1).reshape(x.shape)
    assert torch.equal(scale.view(torch.uint8), torch.from_numpy(fixtures["random_bf16_torchao_rowwise_scale"]))
    assert torch.equal(data, torch.from_numpy(fixtures["random_bf16_torchao_rowwise_data"]))


def test_round_to_nearest_is_the_reference_thresholds():
    y = torch.tensor([0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0000005, 6.0, -0.0, -0.1, -5.0, float("nan")])
    assert e2m1_values(round_e2m1(y)).tolist() == [0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 0, -0.0, -4, 0]
    assert round_e2m1(torch.tensor([-0.0, -0.1])).tolist() == [0, 8]  # only y < 0 takes the sign


def _neighbourhoods(points: list[float], ulps: int = 3) -> torch.Tensor:
    """Each point, its FP32 neighbours up to ``ulps`` away on either side, and their negatives."""
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    near = (bits[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)).reshape(-1).view(torch.float32)
    near = near[near >= 0]
    return torch.cat([near, -near])


E2M1_GRID_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_GRID = torch.tensor(E2M1_GRID_VALUES, dtype=torch.float64)


def test_roundings_are_their_definitions_at_every_threshold():
    """The bit-level roundings against their definitions in FP64, at every midpoint and grid
    point, each one's FP32 neighbours, and random values: nearest takes the closest grid value,
    a tie the even code; stochastic adds ``bits / 256`` of the step in FP32 (one rounding) and
    takes the largest grid value not above, at most 6."""
    g = torch.Generator().manual_seed(5)
    y = torch.cat([_neighbourhoods([*E2M1_MIDPOINTS, *E2M1_GRID_VALUES, 7.0, 8.0]), torch.randn(5000, generator=g) * 3])
    y = y.clamp(-6, 6)
    a = y.abs().double()
    distance = (a[:, None] - E2M1_GRID).abs()
    nearest = distance == distance.min(1, keepdim=True).values
    index = torch.where(nearest.sum(1) == 2, (nearest.int().argmax(1) + 1) // 2 * 2, nearest.int().argmax(1))
    expected = E2M1_GRID[index] * torch.where(y < 0, -1.0, 1.0).double()
    assert torch.equal(e2m1_values(round_e2m1(y), torch.float64), expected)
    for draw in (0, 1, 100, 255):
        bits = torch.full_like(y, draw)
        step = torch.where(y.abs() >= 4, 2.0, torch.where(y.abs() >= 2, 1.0, 0.5))
        t = (y.abs() + bits / 256 * step).double()
        floor = E2M1_GRID[(t[:, None] >= E2M1_GRID).sum(1) - 1]
        expected = torch.where(torch.signbit(y), -floor, floor)
        assert torch.equal(e2m1_values(round_e2m1_stochastic(y, bits), torch.float64), expected)


def _under_draws(y: torch.Tensor) -> torch.Tensor:
    """The values of ``round_e2m1_stochastic(y)`` under each of its 256 draws (FP64, 256 x len)."""
    draws = torch.arange(256, dtype=torch.float32)[:, None].expand(256, len(y))
    return e2m1_values(round_e2m1_stochastic(y.expand(256, -1), draws), torch.float64)


def _expected_under_draws(y: torch.Tensor) -> torch.Tensor:
    """E[value] of ``round_e2m1_stochastic(y)`` over its 256 equally likely draws, by enumeration."""
    return _under_draws(y).mean(0)


def test_stochastic_rounding_is_unbiased_on_the_1_256_grid_and_low_by_under_1_256_step_off_it():
    """TE's rule with 8 random bits rounds up with probability floor(256 frac) / 256: exactly
    unbiased where frac is a multiple of 1/256 (all 256 draws enumerated), and elsewhere low in
    magnitude by step * (frac - floor(256 frac) / 256), under step / 256."""
    g = torch.Generator().manual_seed(4)
    a = torch.rand(4000, generator=g) * 6
    fine = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5)) / 256  # step / 256
    on_grid = torch.floor(a / fine) * fine * torch.where(torch.rand(4000, generator=g) < 0.5, -1, 1)
    assert torch.equal(_expected_under_draws(on_grid), on_grid.double())
    off_grid = (torch.randint(0, 6 * 2**14, (4000,), generator=g) / 2.0**14).float()
    step = torch.where(off_grid >= 4, 2.0, torch.where(off_grid >= 2, 1.0, 0.5)).double()
    frac = off_grid.double() / step - torch.floor(off_grid.double() / step)
    bias = -step * (frac - torch.floor(256 * frac) / 256)
    assert torch.equal(_expected_under_draws(off_grid) - off_grid.double(), bias)
    assert bool((bias <= 0).all()) and bool((bias > -step / 256).all()) and bool((bias < 0).any())


def test_stochastic_rounding_lands_on_a_neighbour_saturates_and_keeps_the_sign():
    y = torch.tensor([0.3, -0.3, 5.0, 6.0, 7.5, -0.0, float("nan")])
    for bits in (0, 128, 255):
        values = e2m1_values(round_e2m1_stochastic(y, torch.full_like(y, bits)))
        assert values[0] in (0.0, 0.5) and values[1] in (-0.0, -0.5) and values[2] in (4.0, 6.0)
        assert values[3] == values[4] == values[6] == E2M1.max  # saturating; NaN to +6, as TE's rule
        assert torch.signbit(values[5])  # -0.0 keeps its sign (copysign)


def test_a_stochastic_copy_draws_from_its_generator_and_averages_to_te_rule_expectation():
    """Two generators give two roundings of one tensor, one generator the same one twice; over 512
    copies each element's mean sits where the 8-bit rule's expectation (all 256 draws enumerated,
    saturation at 6 included) puts it, in units of its own spread: z within 5.5 for every element,
    and centred; an element that every draw rounds alike is that value every time."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    quantizer = NVFP4Quantizer(stochastic=True)
    a, b = (quantizer.quantize(x, ROWWISE, torch.Generator().manual_seed(s)) for s in (1, 2))
    assert not torch.equal(a.data, b.data) and torch.equal(a.block_scale, b.block_scale)
    assert torch.equal(quantizer.quantize(x, ROWWISE, torch.Generator().manual_seed(1)).data, a.data)
    y = (x * a.per_element(a.scale)).clamp(-E2M1.max, E2M1.max)
    outcomes = _under_draws(y.flatten()) * a.per_element(a.block_scale.double()).flatten() * a.global_decode.double()
    expected, sd = outcomes.mean(0).reshape(y.shape), outcomes.std(0, correction=0).reshape(y.shape)
    g = torch.Generator().manual_seed(3)
    samples = torch.stack([quantizer.quantize(x, ROWWISE, g).dequantize(torch.float64) for _ in range(512)])
    random = sd > 0
    z = (samples.mean(0) - expected)[random] / (sd[random] / 512**0.5)
    assert float(z.abs().max()) < 5.5 and abs(float(z.mean())) < 4 / z.numel() ** 0.5
    assert torch.allclose(samples[:, ~random], expected[~random].expand(512, -1), rtol=1e-6, atol=0)


def test_dequantisation_is_te_rule_and_a_rotated_copy_comes_back_to_the_tensor_basis():
    """``(e2m1 * block_scale) * (amax / 2688)`` as TE's tests dequantise; a rotated copy's values
    are in x's basis, and the product of two rotated copies is the rotated-domain product."""
    torch.manual_seed(1)
    x, dy = torch.randn(64, 48), torch.randn(64, 32)
    q = NVFP4Quantizer().quantize(x, ROWWISE)
    by_hand = e2m1_values(q.data) * q.block_scale.float().repeat_interleave(16, 1) * (q.amax / 2688)
    assert torch.equal(q.dequantize(), by_hand)
    rotating = NVFP4Quantizer(hadamard=True)
    xr, dyr = rotating.quantize(x, COLUMNWISE), rotating.quantize(dy, COLUMNWISE)
    assert float((xr.dequantize() - x).norm() / x.norm()) < 0.15
    rotated_domain = NVFP4Quantizer().quantize(hadamard_transform(x), COLUMNWISE)
    assert torch.equal(rotated_domain.data, xr.data)
    product = dyr.mT.dequantize(torch.float64) @ xr.dequantize(torch.float64)
    in_rotated_domain = NVFP4Quantizer().quantize(hadamard_transform(dy), COLUMNWISE).dequantize(
        torch.float64
    ).mT @ rotated_domain.dequantize(torch.float64)
    assert torch.allclose(product, in_rotated_domain, rtol=1e-12, atol=1e-12)
    assert xr.nbytes == 64 * 48 // 2 + 4 * 48 + 4


def test_refusals():
    with pytest.raises(ValueError, match="no Hadamard"):
        NVFP4Quantizer(two_d=True, hadamard=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Quantizer(hadamard=True).quantize(torch.randn(24, 16), COLUMNWISE)
