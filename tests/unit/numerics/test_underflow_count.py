"""fp8_underflow counted two ways, one count: on the codes' exponent bits (eager, and every rounding
but nearest) and, in a compiled graph under round to nearest, on the scaled values against
``normal_threshold``. Both must agree on every value, ties, NaN and infinities included."""

from __future__ import annotations

import pytest
import torch

from readback.numerics import E4M3, E5M2, quantize
from readback.numerics.site import EXPONENT_BITS, _count_saturated, count_nonzero, normal_threshold, underflow_counts


def _around_the_threshold(fmt) -> torch.Tensor:
    """Every FP32 value within 64 ulps of the threshold and of the largest subnormal's and the
    smallest normal's neighbours, both signs, beside zeros, NaN, infinities and random values
    spread over FP32's range."""
    points = [normal_threshold(fmt), 2.0**fmt.min_exponent, 2.0**fmt.min_exponent - fmt.smallest_subnormal]
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    near = (bits[:, None] + torch.arange(-64, 65, dtype=torch.int32)).view(torch.float32).flatten()
    spread = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 2.0 ** torch.randint(
        -40, 40, (4096,), generator=torch.Generator().manual_seed(1)
    )
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), fmt.max * 4])
    return torch.cat([near, -near, spread, special])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 3.0, 0.7071])
def test_the_threshold_counts_what_the_codes_count(fmt, scale, monkeypatch):
    x = _around_the_threshold(fmt) / scale  # scaled back onto the grid's boundary, give or take the product's rounding
    q = quantize(x, fmt, scale)
    codes = underflow_counts(x, q, nearest=True)  # not compiling: the exponent bits
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compared = underflow_counts(x, q, nearest=True)
    assert codes[1] == compared[1] and codes[0] == compared[0]
    assert 0 < int(codes[0]) < int(codes[1])  # both kinds of code are there to be told apart


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_the_threshold_is_where_rounding_to_nearest_first_gives_a_normal_code(fmt):
    threshold = torch.tensor(normal_threshold(fmt))
    below = torch.nextafter(threshold, torch.tensor(0.0))
    exponent = EXPONENT_BITS[fmt.dtype]
    assert int(threshold.to(fmt.dtype).view(torch.uint8)) & exponent  # the tie goes to the normal code
    assert not int(below.to(fmt.dtype).view(torch.uint8)) & exponent


def test_a_compiled_count_is_the_eager_count():
    x = _around_the_threshold(E4M3)
    q = quantize(x, E4M3, 1.0)
    compiled = torch.compile(lambda x, q: underflow_counts(x, q, nearest=True), dynamic=False)
    assert [int(n) for n in compiled(x, q)] == [int(n) for n in underflow_counts(x, q, nearest=True)]


def test_compiled_counts_are_int32_and_the_eager_counts():
    """A compiled graph sums each count in int32 (``count_nonzero``): the same numbers as torch's
    int64 counts, the saturation count included (eager, the CPU skips it when the amax shows none)."""
    x = _around_the_threshold(E5M2) * 1e4
    scale, amax = torch.tensor(2.0), x.abs().amax()

    def counts(x):
        return count_nonzero(x), _count_saturated(x, amax, scale, E5M2)

    compiled = torch.compile(counts, dynamic=False)(x)
    assert [t.dtype for t in compiled] == [torch.int32, torch.int32]
    saturated = int((x.abs() * scale > E5M2.max).sum())
    assert [int(n) for n in compiled] == [int(torch.count_nonzero(x)), saturated] and saturated > 0
