"""Property tests of the FP8 numerics: rounding, scaling recipes and state, formats, emulated GEMM.

The ground truth for round-to-nearest is torch's own cast; stochastic rounding is checked against
neighbours taken from a table of every value of the format, decoded from its 256 bit patterns.
"""

from __future__ import annotations

import dataclasses
import itertools
from operator import itemgetter

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from readback.numerics import (
    BF16,
    E4M3,
    E5M2,
    CurrentScaling,
    CurrentScalingState,
    DelayedScaling,
    DelayedScalingState,
    Format,
    FP8Format,
    abs_max,
    compute_scale,
    decoded,
    fp8_mm,
    matmul,
    quantize,
    round_bf16,
)
from readback.numerics.rounding import decode, uniform
from readback.numerics.scale_state import new_state
from readback.numerics.state import Numerics
from specs import make_spec

FORMATS = [E4M3, E5M2]
F32_MAX = float(torch.finfo(torch.float32).max)


def _table(fmt: FP8Format) -> torch.Tensor:
    """Every finite value of ``fmt``, sorted (both zeros included), decoded from the 256 codes."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    return values[torch.isfinite(values)].sort().values


TABLES = {fmt.name: _table(fmt) for fmt in FORMATS}


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _neighbours(y: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest grid value <= y and the smallest grid value >= y (y within +-fmt.max)."""
    table = TABLES[fmt.name]
    floor = table[torch.searchsorted(table, y, right=True) - 1]
    ceil = table[torch.searchsorted(table, y, right=False)]
    return floor, ceil


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality of two FP8 tensors, NaN compared by NaN-ness only (payloads may differ)."""
    assert got.dtype == want.dtype
    got_nan, want_nan = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(got_nan, want_nan)
    finite = ~want_nan
    mismatch = got.view(torch.uint8)[finite] != want.view(torch.uint8)[finite]
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} mismatches, e.g. got {got.float()[finite][mismatch][:5].tolist()} "
        f"want {want.float()[finite][mismatch][:5].tolist()}"
    )


# ---------------------------------------------------------------------------------------------
# strategies: values of x * scale that exercise the grid (exact points, ties, subnormals, max)


def _scaled_values(fmt: FP8Format):
    table = TABLES[fmt.name].tolist()
    pos = sorted({v for v in table if v > 0})
    mids = [(a + b) / 2 for a, b in itertools.pairwise(pos)] + [pos[0] / 2]  # ties, incl. half the smallest subnormal
    sub_top = 2.0**fmt.min_exponent
    return st.one_of(
        st.sampled_from(table),  # exact grid points, subnormals and +-max included
        st.sampled_from(mids).map(lambda v: v * (1 + 2**-20)),  # just above a tie
        st.sampled_from(mids).map(lambda v: v * (1 - 2**-20)),  # just below a tie
        st.sampled_from(mids),  # exact ties: round half to even
        st.floats(-fmt.max, fmt.max, width=32),  # anywhere in range
        st.floats(-sub_top, sub_top, width=32),  # the subnormal range of the format
        st.floats(_f32(fmt.max * 0.9), fmt.max, width=32),  # near the max
    ).map(_f32)


_SCALES = st.one_of(
    st.just(1.0),
    st.integers(-12, 12).map(lambda k: 2.0**k),
    st.floats(_f32(1e-3), _f32(1e3), width=32),
)


def _inputs_for(ys: list[float], scale: float) -> torch.Tensor:
    """Inputs x with x * scale (in fp32) close to ``ys``."""
    return (torch.tensor(ys, dtype=torch.float64) / scale).float()


# ---------------------------------------------------------------------------------------------
# quantize(..., "nearest")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_nearest_exhaustive_grid_and_ties(fmt):
    """Every grid value, every midpoint between neighbours (ties) and the floats on either side
    of each midpoint: bit-identical to torch's cast."""
    table = TABLES[fmt.name]
    mids = (table[1:] + table[:-1]) / 2
    ys = torch.cat([table, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    ys = ys[ys.abs() <= fmt.max]
    got = quantize(ys, fmt, 1.0, "nearest")
    _same_bits(got.data, ys.to(fmt.dtype))
    assert torch.equal(got.scale, torch.tensor(1.0))


def _draw_in_range(fmt, data):
    """A drawn scale and inputs whose scaled values are finite and within the format: (x, x * scale, scale)."""
    scale = data.draw(_SCALES)
    x = _inputs_for(data.draw(st.lists(_scaled_values(fmt), min_size=1, max_size=64)), scale)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    y = x * scale_t
    in_range = torch.isfinite(y) & (y.abs() <= fmt.max)
    assume(bool(in_range.any()))
    return x[in_range], y[in_range], scale_t


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(data=st.data())
def test_nearest_equals_torch_cast(fmt, data):
    x, y, scale_t = _draw_in_range(fmt, data)
    got = quantize(x, fmt, scale_t, "nearest")
    _same_bits(got.data, y.to(fmt.dtype))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(
    magnitudes=st.lists(st.floats(0, F32_MAX, width=32, exclude_min=True), min_size=1, max_size=32),
    negative=st.booleans(),
)
def test_nearest_saturates_out_of_range(fmt, magnitudes, negative):
    """Anything beyond +-max (including values torch's cast would round back to max, and
    values it would turn into inf) saturates to +-max, for both formats."""
    y = torch.tensor(magnitudes, dtype=torch.float32)
    y = y[y > fmt.max]
    assume(y.numel() > 0)
    sign = -1.0 if negative else 1.0
    got = quantize(sign * y, fmt, 1.0, "nearest")
    assert torch.equal(got.data.float(), torch.full_like(y, sign * fmt.max))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_infinities_saturate_and_nan_stays_nan(fmt, rounding):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 0.5])
    generator = torch.Generator().manual_seed(0)
    got = quantize(x, fmt, 1.0, rounding, generator).data.float()
    assert got[:2].tolist() == [fmt.max, -fmt.max]
    assert torch.isnan(got[2])
    assert got[3:5].tolist() == [fmt.max, -fmt.max]
    assert got[5].item() == 0.5
    # a scale that pushes finite values out of range saturates too
    big = quantize(torch.tensor([1.0, -3.0]), fmt, torch.tensor(fmt.max * 4), rounding, generator)
    assert big.data.float().tolist() == [fmt.max, -fmt.max]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_bf16_is_clamp_then_cast(dtype):
    """BF16 sites clamp after the cast; the bits are those of clamping first and casting (and
    a BF16 input is not modified in place)."""
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    extremes = [float("inf"), -float("inf"), float("nan"), F32_MAX, -F32_MAX, bf16_max, 3.3961e38, 1e-40, -0.0, 0.0]
    x = torch.cat([torch.tensor(extremes), torch.randn(4096) * torch.logspace(-30, 30, 4096)]).to(dtype)
    original = x.clone()
    got = round_bf16(x)
    reference = x.float().clamp(-bf16_max, bf16_max).to(torch.bfloat16)
    assert torch.equal(got.data.view(torch.int16), reference.view(torch.int16))
    assert got.scale.item() == 1.0 and got.data.dtype == torch.bfloat16
    assert torch.equal(x.view(torch.uint8), original.view(torch.uint8))


def test_quantize_refuses_bf16():
    with pytest.raises(ValueError, match="round_bf16"):
        quantize(torch.ones(3), BF16, 1.0)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantize_without_saturation_is_the_same_when_nothing_saturates(fmt):
    """``saturate=False`` (taken when ``amax * scale <= fmt.max``) changes no bit then."""
    x = torch.randn(10_000) * torch.logspace(-8, 2, 10_000)
    scale = compute_scale(x.abs().amax(), fmt)
    clamped, unclamped = (quantize(x, fmt, scale, saturate=s).data.view(torch.uint8) for s in (True, False))
    assert torch.equal(clamped, unclamped)


def test_uniform_from_a_state_draws_what_the_generator_draws():
    """``uniform`` (the op a compiled step calls) continues a generator from its state, in place."""
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    like = torch.empty(5, 7)
    for _ in range(3):
        assert torch.equal(uniform(state, like), torch.rand(5, 7, generator=generator))
    assert torch.equal(state, generator.get_state())
    x = torch.randn(1000)
    by_state = quantize(x, E4M3, 1.0, "stochastic", torch.Generator().manual_seed(9).get_state())
    by_generator = quantize(x, E4M3, 1.0, "stochastic", torch.Generator().manual_seed(9))
    assert torch.equal(by_state.data.view(torch.uint8), by_generator.data.view(torch.uint8))


def test_unknown_rounding_raises():
    with pytest.raises(ValueError, match="rounding"):
        quantize(torch.ones(3), E4M3, 1.0, "truncate")


# ---------------------------------------------------------------------------------------------
# quantize(..., "stochastic")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_stochastic_lands_on_a_neighbour(fmt, data, seed):
    x, y, scale_t = _draw_in_range(fmt, data)
    x = x.repeat(8)  # several draws per value
    y = y.repeat(8)
    got = quantize(x, fmt, scale_t, "stochastic", torch.Generator().manual_seed(seed)).data.float()
    floor, ceil = _neighbours(y, fmt)
    assert ((got == floor) | (got == ceil)).all(), (y[(got != floor) & (got != ceil)][:5], got)
    on_grid = floor == ceil
    assert torch.equal(got[on_grid], y[on_grid])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_stochastic_keeps_every_grid_point(fmt):
    table = TABLES[fmt.name]
    got = quantize(table, fmt, 1.0, "stochastic", torch.Generator().manual_seed(1))
    assert torch.equal(got.data.float(), table)


def _unbiased_values(fmt: FP8Format):
    sub_top = 2.0**fmt.min_exponent
    return st.one_of(
        st.floats(sub_top, fmt.max, width=32),  # normals
        st.floats(fmt.smallest_subnormal / 4, sub_top, width=32),  # subnormals of the format
        st.floats(-fmt.max, -fmt.smallest_subnormal / 4, width=32),  # negatives
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@settings(max_examples=12)
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_stochastic_is_unbiased(fmt, data, seed):
    """The mean of 200k draws is within 5 standard errors of x * scale; the standard error is
    the exact one of a Bernoulli choice between the two neighbours."""
    n = 200_000
    scale = data.draw(st.sampled_from([1.0, 0.25, 3.0]))
    target = data.draw(_unbiased_values(fmt))
    x = torch.full((n,), target / scale, dtype=torch.float32)
    y = x[:1] * torch.tensor(scale, dtype=torch.float32)
    assume(bool(y.abs() <= fmt.max))
    floor, ceil = (t.double() for t in _neighbours(y, fmt))
    got = quantize(x, fmt, scale, "stochastic", torch.Generator().manual_seed(seed)).data.double()
    assert ((got == floor) | (got == ceil)).all()
    if bool(floor == ceil):
        assert bool((got == y.double()).all())
        return
    frac = (y.double() - floor) / (ceil - floor)
    standard_error = (ceil - floor) * torch.sqrt(frac * (1 - frac) / n)
    z = (got.mean() - y.double()) / standard_error
    assert abs(float(z)) < 5, (float(y), float(floor), float(ceil), float(got.mean()), float(z))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_stochastic_seeding(fmt):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * fmt.max / 8
    first = quantize(x, fmt, 1.0, "stochastic", torch.Generator().manual_seed(123)).data
    again = quantize(x, fmt, 1.0, "stochastic", torch.Generator().manual_seed(123)).data
    other = quantize(x, fmt, 1.0, "stochastic", torch.Generator().manual_seed(124)).data
    assert torch.equal(first.view(torch.uint8), again.view(torch.uint8))
    differing = (first.view(torch.uint8) != other.view(torch.uint8)).float().mean()
    assert differing > 0.1  # off-grid values pick their neighbour independently per seed


# ---------------------------------------------------------------------------------------------
# compute_scale


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(amax=st.floats(_f32(1e-30), _f32(1e30), width=32), margin=st.integers(0, 4))
def test_compute_scale_formula(fmt, amax, margin):
    """Bit for bit the correctly rounded FP32 quotient (a float64 quotient of FP32 operands,
    rounded to FP32, is that: 53 >= 2 * 24 + 2 bits make the double rounding harmless)."""
    got = compute_scale(torch.tensor(amax), fmt, margin, previous=7.0)
    want = torch.tensor((fmt.max * 2.0**-margin) / amax, dtype=torch.float64).float()
    assert got.dtype == torch.float32
    assert got.item() == want.item()


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_compute_scale_rounds_once_over_many_amaxes(fmt):
    """Every one of 100,000 amaxes: a reciprocal-then-multiply misses about a quarter of them."""
    amax = torch.empty(100_000).uniform_(-20, 20, generator=torch.Generator().manual_seed(0)).exp2()
    want = (fmt.max / amax.double()).float()
    assert torch.equal(compute_scale(amax, fmt), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_compute_scale_keeps_previous_when_unusable(fmt):
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-44, 2.0])  # 1e-44: scale overflows fp32
    previous = torch.tensor([3.0, 5.0, 7.0, 9.0, 11.0])
    got = compute_scale(amax, fmt, 0, previous)
    assert got[:4].tolist() == [3.0, 5.0, 7.0, 9.0]
    assert got[4].item() == fmt.max / 2
    assert compute_scale(torch.tensor(0.0), fmt).item() == 1.0  # default previous


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@given(
    amax=st.floats(width=32, allow_nan=True, allow_infinity=True),
    margin=st.integers(0, 4),
    previous=st.floats(_f32(1e-6), _f32(1e6), width=32),
)
def test_compute_scale_is_never_inf_or_nan(fmt, amax, margin, previous):
    got = compute_scale(torch.tensor(amax), fmt, margin, previous)
    assert torch.isfinite(got) and got > 0


# ---------------------------------------------------------------------------------------------
# recipes and formats


def test_format_choice():
    assert Format.HYBRID.fwd is E4M3 and Format.HYBRID.bwd is E5M2
    assert Format.E4M3.fwd is E4M3 and Format.E4M3.bwd is E4M3
    assert Format.parse("hybrid") is Format.HYBRID and Format.parse(Format.E4M3) is Format.E4M3
    with pytest.raises(ValueError, match="fp8_format"):
        Format.parse("E5M2")
    assert (E4M3.max, E5M2.max) == (448.0, 57344.0)
    assert E4M3.smallest_subnormal == 2.0**-9 and E5M2.smallest_subnormal == 2.0**-16
    # 256 codes less the NaNs (E4M3: 2; E5M2: 6) and E5M2's two infinities
    assert (len(TABLES["E4M3"]), len(TABLES["E5M2"])) == (254, 248)
    assert TABLES["E4M3"][0].item() == -448.0 and TABLES["E4M3"][-1].item() == 448.0
    assert TABLES["E5M2"][-1].item() == 57344.0


@pytest.mark.parametrize("fmt, bound", [(E4M3, 19), (E5M2, 33)])
@pytest.mark.parametrize("amax", [1e-3, 1.0, 3e4])
def test_zero_margin_is_where_the_amax_element_first_rounds_to_zero(fmt, bound, amax):
    """max 448, smallest subnormal 2**-9: 448 * 2**-19 < 2**-10; max 57344, 2**-16: 57344 * 2**-33 < 2**-17."""
    assert fmt.zero_margin == bound
    x = torch.tensor([amax, -amax, amax / 2])
    below = quantize(x, fmt, compute_scale(torch.tensor(amax), fmt, bound - 1))
    at = quantize(x, fmt, compute_scale(torch.tensor(amax), fmt, bound))
    assert below.dequantize()[:2].abs().min() > 0
    assert torch.count_nonzero(at.dequantize()) == 0


def test_delayed_scaling_defaults_match_transformer_engine():
    recipe = DelayedScaling()
    assert recipe.margin == 0
    assert recipe.interval == 1
    assert recipe.fp8_format is Format.HYBRID
    assert recipe.amax_history_len == 1024
    assert recipe.amax_compute_algo == "max"
    assert recipe.override_linear_precision == (False, False, False)
    assert DelayedScaling(fp8_format="hybrid") == recipe
    assert CurrentScaling().fp8_format is Format.HYBRID and CurrentScaling().margin == 0


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling()], ids=["delayed", "current"])
def test_recipes_are_frozen(recipe):
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.margin = 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"amax_compute_algo": "mean"},
        {"interval": 0},
        {"amax_history_len": 0},
        {"override_linear_precision": (True, False)},
        {"fp8_format": "E5M2"},
        {"fp8_format": "bogus"},
    ],
)
def test_delayed_scaling_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        DelayedScaling(**kwargs)


def test_current_scaling_rejects_bad_format():
    with pytest.raises(ValueError):
        CurrentScaling(fp8_format="E5M2")


# ---------------------------------------------------------------------------------------------
# DelayedScalingState: hand-worked scale sequences (E4M3, max 448; amaxes are powers of two)


def _tensor_with_amax(amax: float) -> torch.Tensor:
    return torch.tensor([amax / 2, -amax, amax / 4, 0.0])


def _run(state, amaxes: list[float]) -> list[float]:
    """Feed one tensor per step; return the scale used during each step and the final one."""
    used = []
    for amax in amaxes:
        used.append(float(state.scale_for(_tensor_with_amax(amax))))
        state.end_step()
    return used + [float(state.scale)]


def test_delayed_max_over_a_window_of_three():
    state = new_state(DelayedScaling(amax_history_len=3), E4M3)
    assert isinstance(state, DelayedScalingState)
    used = _run(state, [2, 8, 1, 0.5, 0.25, 4])
    assert used == [
        1.0,  # step 0: TE starts with scale 1
        224.0,  # history [2]        max 2  -> 448/2
        56.0,  # history [2, 8]      max 8  -> 448/8
        56.0,  # history [2, 8, 1]   max 8
        56.0,  # history [8, 1, .5]  max 8 (2 fell out)
        448.0,  # history [1, .5, .25] max 1 (8 fell out) -> 448/1
        112.0,  # history [.5, .25, 4] max 4 -> 448/4
    ]


def test_delayed_most_recent():
    state = new_state(DelayedScaling(amax_compute_algo="most_recent"), E4M3)
    used = _run(state, [2, 8, 1, 0.0, 4])
    assert used == [
        1.0,
        224.0,  # 448/2
        56.0,  # 448/8
        448.0,  # 448/1 (the 8 of the step before does not matter)
        448.0,  # amax 0 (all-zero tensor): previous scale kept
        112.0,  # 448/4
    ]


def test_delayed_interval_two():
    """History recorded every step, scale recomputed only at the end of every second step."""
    state = new_state(DelayedScaling(interval=2, amax_history_len=2), E4M3)
    used = _run(state, [8, 1, 2, 1, 0.5, 0.5])
    assert used == [
        1.0,
        1.0,  # after step 0 (1 step recorded): no recompute
        56.0,  # after step 1: history [8, 1] -> 448/8
        56.0,  # after step 2: history [2, 1], not recomputed
        224.0,  # after step 3: history [2, 1] -> 448/2: step 2's amax was recorded
        224.0,  # after step 4: history [.5, 1], not recomputed
        896.0,  # after step 5: history [.5, .5] -> 448/.5
    ]


def test_delayed_margin_one():
    state = new_state(DelayedScaling(margin=1), E4M3)
    assert _run(state, [2, 0.5]) == [1.0, 112.0, 112.0]  # (448/2)/2; then max(2, .5) = 2 again
    state = new_state(DelayedScaling(margin=1), E5M2)
    assert _run(state, [4]) == [1.0, 7168.0]  # (57344/4)/2


def test_delayed_several_calls_in_one_step_share_one_scale():
    state = new_state(DelayedScaling(), E4M3)
    _run(state, [1])  # scale 448 from now on
    scales = [state.scale_for(_tensor_with_amax(a)) for a in (1, 4, 2)]
    assert [float(s) for s in scales] == [448.0, 448.0, 448.0]
    state.end_step()
    assert float(state.scale) == 112.0  # step amax = max(1, 4, 2) = 4 -> 448/4
    state = new_state(DelayedScaling(amax_compute_algo="most_recent"), E4M3)
    for a in (1, 4, 2):
        state.scale_for(_tensor_with_amax(a))
    state.end_step()
    assert float(state.scale) == 112.0


def test_delayed_state_dict_round_trip():
    recipe = DelayedScaling(amax_history_len=4, interval=2)
    original = new_state(recipe, E4M3)
    _run(original, [2, 8, 1, 0.5, 16])
    saved = original.state_dict()
    restored = new_state(recipe, E4M3)
    restored.load_state_dict(saved)
    assert float(restored.scale) == float(original.scale) and restored.steps == original.steps == 5
    more = [0.25, 4, 1, 2, 0.125, 0.125, 1]
    want = _run(original, more)
    assert _run(restored, more) == want
    assert torch.equal(restored.history, original.history)
    # the saved dict is a copy: the steps both states took since did not change it
    again = new_state(recipe, E4M3)
    again.load_state_dict(saved)
    assert _run(again, more) == want
    with pytest.raises(ValueError, match="history"):
        new_state(DelayedScaling(amax_history_len=5), E4M3).load_state_dict(saved)


def test_current_scaling_state_uses_the_tensors_own_amax():
    state = new_state(CurrentScaling(), E4M3)
    assert isinstance(state, CurrentScalingState)
    assert float(state.scale_for(_tensor_with_amax(2))) == 224.0
    assert float(state.scale_for(_tensor_with_amax(8))) == 56.0  # same step, own amax
    state.end_step()
    assert float(state.scale_for(_tensor_with_amax(0.5))) == 896.0
    assert float(state.scale_for(torch.zeros(3))) == 896.0  # all zero: previous scale kept
    state = new_state(CurrentScaling(margin=1), E5M2)
    assert float(state.scale_for(_tensor_with_amax(4))) == 7168.0  # (57344/4)/2
    restored = new_state(CurrentScaling(margin=1), E5M2)
    restored.load_state_dict(state.state_dict())
    assert float(restored.scale) == 7168.0


# ---------------------------------------------------------------------------------------------
# decoding and amax

_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(_BITS))
def test_decode_is_torchs_cast_bit_for_bit(fmt, dtype):
    """Every code (NaNs and both zeros included), in a contiguous, a transposed and a strided layout."""
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).reshape(2, 8, 16)
    for data in (grid, grid.mT, grid[:, :, ::3]):
        got, want = decode(data, dtype), data.to(dtype)
        assert got.dtype == dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.view(_BITS[dtype]), want.view(_BITS[dtype]))


@pytest.mark.parametrize(
    "values", [[1.0, -3.0, 2.0], [-0.0, 0.0], [-0.0], [2.0, float("nan"), -1.0], [float("-inf"), 1.0]]
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_abs_max_is_abs_then_amax(values, compiled):
    x = torch.tensor(values)
    got, want = (torch.compile(abs_max, dynamic=False) if compiled else abs_max)(x), x.abs().amax()
    if compiled and want.isnan():  # the compiler's NaN has a payload of its own, but a positive sign
        assert got.isnan() and int(got.view(torch.int32)) > 0
    else:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN bits and the sign of 0 too


# ---------------------------------------------------------------------------------------------
# emulated GEMM


def _operands(seed: int, shape_a, shape_b, fmt_a=E4M3, fmt_b=E5M2):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(shape_a, generator=generator) * 3
    b = torch.randn(shape_b, generator=generator) * 1e-3
    qa = quantize(a, fmt_a, compute_scale(a.abs().amax(), fmt_a))
    qb = quantize(b, fmt_b, compute_scale(b.abs().amax(), fmt_b))
    return qa, qb


_SHAPES = st.tuples(
    st.lists(st.integers(1, 3), max_size=1),  # batch dims: none or one
    st.integers(1, 24),
    st.integers(1, 48),
    st.integers(1, 24),
)


@given(shape=_SHAPES, seed=st.integers(0, 2**16), fmt_b=st.sampled_from(FORMATS))
def test_fp8_mm_equals_float64_product_within_bf16(shape, seed, fmt_b):
    batch, m, k, n = shape
    qa, qb = _operands(seed, (*batch, m, k), (*batch, k, n), E4M3, fmt_b)
    got = fp8_mm(qa, qb)
    a64, b64 = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
    want = a64 @ b64
    assert got.dtype == torch.float32 and got.shape == want.shape
    # one BF16 rounding of the result (relative 2**-8) plus FP32 accumulation round-off
    bound = 2.0**-8 * want.abs() + 2.0**-16 * (a64.abs() @ b64.abs())
    assert ((got.double() - want).abs() <= bound).all()


@given(shape=_SHAPES, seed=st.integers(0, 2**16), fmt_b=st.sampled_from(FORMATS))
def test_fp8_mm_scales_in_fp32_then_rounds_once(shape, seed, fmt_b):
    """The scaled product written straight to BF16 has the bits of scaling in FP32 and casting."""
    batch, m, k, n = shape
    qa, qb = _operands(seed, (*batch, m, k), (*batch, k, n), E4M3, fmt_b)
    acc = decode(qa.data, torch.float32) @ decode(qb.data, torch.float32)
    two_steps = (acc * (qa.scale_inv * qb.scale_inv)).to(torch.bfloat16).float()
    assert torch.equal(fp8_mm(qa, qb), two_steps)


@pytest.mark.parametrize("batch", [(), (3,)], ids=["plain", "batched"])
def test_decoded_operands_give_the_same_product(batch):
    """An operand decoded once (``decoded``) multiplies to the same bits as its FP8 codes."""
    qa, qb = _operands(11, (*batch, 40, 64), (*batch, 64, 24), E4M3, E5M2)
    da, db = decoded(qa), decoded(qb)
    assert da.data.dtype == torch.float32 and torch.equal(da.data, decode(qa.data, torch.float32))
    assert torch.equal(fp8_mm(da, db), fp8_mm(qa, qb))
    assert torch.equal(fp8_mm(da.map(lambda d: d[..., 5:29, :]), db), fp8_mm(qa.map(lambda d: d[..., 5:29, :]), qb))
    bf16 = round_bf16(torch.randn(4, 4))  # BF16 values decoded to FP32 for the FP32 GEMM kernel only
    assert decoded(bf16).data.dtype == torch.float32 and torch.equal(decoded(bf16).data, bf16.data.float())
    assert torch.equal(fp8_mm(decoded(bf16), decoded(bf16)), fp8_mm(bf16, bf16))
    assert decoded(bf16, "native") is bf16


def _scaled_mm(qa, qb) -> torch.Tensor:
    """torch's FP8 GEMM (it runs on the CPU too): one (m, k) x (k, n) product, BF16 out."""
    return torch._scaled_mm(
        qa.data, qb.data.t().contiguous().t(), scale_a=qa.scale_inv, scale_b=qb.scale_inv, out_dtype=torch.bfloat16
    )


@pytest.mark.parametrize("batch", [(), (3,)], ids=["plain", "batched"])
@pytest.mark.parametrize("fmt_b", FORMATS, ids=["e4m3-e4m3", "e4m3-e5m2"])
def test_fp8_mm_matches_torch_scaled_mm(fmt_b, batch):
    """The emulation has the real kernel's semantics: scales applied in FP32, then one rounding
    to BF16. Bit-identical outputs except where FP32 accumulation order tips a BF16 tie."""
    qa, qb = _operands(7 + len(batch), (*batch, 96, 128), (*batch, 128, 112), E4M3, fmt_b)
    got = fp8_mm(qa, qb).to(torch.bfloat16)
    if batch:
        want = torch.stack([_scaled_mm(qa.map(itemgetter(i)), qb.map(itemgetter(i))) for i in range(batch[0])])
    else:
        want = _scaled_mm(qa, qb)
    identical = (got.view(torch.int16) == want.view(torch.int16)).double().mean().item()
    assert identical >= 0.999, f"only {identical:.2%} of the BF16 outputs are bit-identical to torch._scaled_mm"
    assert (got.float() - want.float()).abs().max() <= 2.0**-7 * want.float().abs().max()


def test_fp8_mm_is_not_the_product_rounded_before_scaling():
    """Rounding the unscaled product to BF16 and scaling afterwards (two roundings) would miss
    ``_scaled_mm`` in about a quarter of the outputs: the test above can tell them apart."""
    qa, qb = _operands(3, (96, 128), (128, 112), E4M3, E4M3)
    two_roundings = torch.matmul(qa.data.bfloat16(), qb.data.bfloat16()).float() * (qa.scale_inv * qb.scale_inv)
    identical = (two_roundings.bfloat16().view(torch.int16) == _scaled_mm(qa, qb).view(torch.int16)).double().mean()
    assert identical < 0.9


@given(shape=_SHAPES, seed=st.integers(0, 2**16))
def test_matmul_fp32_and_fp64(shape, seed):
    batch, m, k, n = shape
    qa, qb = _operands(seed, (*batch, m, k), (*batch, k, n))
    a64, b64 = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
    want = a64 @ b64
    got = matmul(qa, qb, "fp32")
    assert got.dtype == torch.float32
    bound = 1e-6 * (a64.abs() @ b64.abs()) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    # plain tensors as operands, and the rounding-free fp64 path
    got_plain = matmul(qa.dequantize(), qb.dequantize(), "fp32")
    assert ((got_plain.double() - want).abs() <= bound).all()
    got64 = matmul(qa, qb, "fp64")
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=1e-300)
    assert torch.equal(matmul(qa, qb, "fp8"), fp8_mm(qa, qb))


def test_check_scales_names_the_site_whose_own_scale_was_unusable():
    """Current scaling of an amax near FP32's max under margin 18 (allowed: 18 < E4M3's 19) gives a
    subnormal scale: counted at its site, raised once by ``check_scales``, then cleared."""
    from readback.errors import NumericsError

    numerics = Numerics(make_spec("fp8", recipe=CurrentScaling(margin=18)))
    numerics.site("a.input").quantize(torch.tensor([1.0, -2.0]))
    numerics.site("b.input").quantize(torch.tensor([3e38, 1.0]))
    numerics.site("a.input").quantize(torch.tensor([1.0]), scale=torch.tensor(0.0))  # a reused scale: not its own
    with pytest.raises(NumericsError, match=r"^the FP8 scale of site b.input was 0, subnormal, infinite or NaN"):
        numerics.check_scales()
    numerics.check_scales()  # counted since the last call only
