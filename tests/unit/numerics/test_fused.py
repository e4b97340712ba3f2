"""The fused rounding (``readback.numerics.fused``) gives a site the eager passes' codes and counts."""

from __future__ import annotations

import pytest
import torch

from readback.numerics import E4M3, E5M2, fused
from readback.numerics.counts import underflow_counts
from readback.numerics.rounding import quantize


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fused_codes_and_counts_are_the_eager_ones(fmt):
    """Zeros of both signs, elements far below the smallest subnormal, and every binade."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * torch.rand(64, 48, generator=g) ** 8
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30])
    scale = fmt.max / x.abs().max()
    q = quantize(x, fmt, scale, saturate=False)
    fq, underflowed, nonzero = fused.rounded_and_counted(x, fmt, scale)
    assert torch.equal(fq.data.view(torch.uint8), q.data.view(torch.uint8)) and fq.data.shape == x.shape
    assert (int(underflowed), int(nonzero)) == tuple(int(n) for n in underflow_counts(x, q)) and int(underflowed) > 0


def test_fused_applies_to_a_counted_nearest_rounding_only():
    x = torch.ones(4, 4)
    fused.enable()
    try:
        assert fused.applies(x, "nearest", saturate=False)
        assert not fused.applies(x, "stochastic", saturate=False)
        assert not fused.applies(x, "nearest", saturate=True)  # a NaN's sign differs under the compiled clamp
        assert not fused.applies(x.mT[:, :3], "nearest", saturate=False)
    finally:
        fused.enable(False)
    assert not fused.applies(x, "nearest", saturate=False)
