"""The bias meter under a stochastic forward measures the reuse read's correlation bias.

With a stochastic forward, the O8 that D re-reads carries the very rounding error e that shaped the
loss, so dO = H O8 is correlated with e, and E[rowsum(dO * e)] = sum_j H_jj Var(e_j) > 0 with no
underflow needed; a fresh draw e' is independent of dO, and E[rowsum(dO * e')] = 0.

The planted problem makes that bias known in closed form: one key per query (T = 1, so P = 1
exactly, O = V8 and the exact dS is 0), Q, K, V on their FP8 grids (their roundings are exact),
O's scale pushed down 2^-14 so that O8 rounds between subnormals, and the loss
``0.5 sum c O8^2 + w . q + sum k`` (curvature H = diag(c); the linear terms give q and k exact
gradients, w and 1, where the attention's own are 0). Then, per row r,
``E[dQ_reuse - dQ_exact]_r = -softmax_scale * (sum_j c_rj Var(e_rj)) * K_r``, with
``Var(e) = f (1 - f) ulp^2 / scale^2`` for O at fraction f between its grid neighbours.
"""

from __future__ import annotations

import pytest
import torch

from readback.bias import measure_bias
from readback.numerics import E4M3, CurrentScaling
from readback.numerics.state import Numerics
from readback.ops.attention import attention
from specs import make_spec

ROWS, HEADS, DIM = 32, 2, 8
SOFTMAX_SCALE = 0.125
MARGIN = 14
E4M3_SUBNORMAL_ULP = 2.0**-9


class PlantedCurvature(torch.nn.Module):
    """Attention with one key per query under a quadratic loss of its FP8 output."""

    def __init__(self, numerics):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def on_grid(*shape):
            """Powers of two up to 1 with random signs, one entry exactly 1: every value lies on
            E4M3's grid at the current scale 448 / amax, so its rounding is exact."""
            x = 2.0 ** -torch.randint(0, 5, shape, generator=g).double()
            x = x * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
            x.view(-1)[0] = 1.0
            return x.float()

        self.numerics = numerics
        self.q = torch.nn.Parameter(on_grid(ROWS, HEADS, 1, DIM))
        self.k = torch.nn.Parameter(on_grid(ROWS, HEADS, 1, DIM))
        self.v = torch.nn.Parameter(on_grid(ROWS, HEADS, 1, DIM))
        self.register_buffer("curvature", 1.0 + torch.randint(0, 3, (ROWS, 1, HEADS * DIM), generator=g).float())
        self.register_buffer("w", torch.zeros(ROWS, HEADS, 1, DIM))

    def forward(self, _inputs, _targets):
        o, _ = attention(self.q, self.k, self.v, self.numerics, "core", SOFTMAX_SCALE)
        return 0.5 * (self.curvature * o.square()).sum() + (self.w * self.q).sum() + self.k.sum()

    def expected_q_error(self) -> torch.Tensor:
        """E[dQ_reuse - dQ_exact] in closed form (the module docstring)."""
        o = self.v.detach().double().transpose(1, 2).reshape(ROWS, 1, HEADS * DIM)  # O = P V8 = V
        scale = E4M3.max * 2.0**-MARGIN / o.abs().max()  # current scaling with O's margin
        position = (o.abs() * scale / E4M3_SUBNORMAL_ULP).squeeze(1)  # in grid steps (all below 2^-5)
        fraction = position - position.floor()
        variance = fraction * (1 - fraction) * (E4M3_SUBNORMAL_ULP / scale) ** 2
        row_term = (self.curvature.squeeze(1).double() * variance).reshape(ROWS, HEADS, DIM).sum(-1)
        return -SOFTMAX_SCALE * row_term[:, :, None, None] * self.k.detach().double()


@pytest.fixture(scope="module")
def measured():
    numerics = Numerics(
        make_spec(
            "fp8",
            CurrentScaling(),
            "reuse_rounded",
            rounding="stochastic",
            site_margin={"core.output": MARGIN},
            attention=dict(bwd_precision="fp32"),
        )
    )
    model = PlantedCurvature(numerics)
    expected = model.expected_q_error()
    model.w.copy_(-expected.float())  # G = w, so the projection of the expected bias on G is exactly 1
    torch.manual_seed(0)
    result = measure_bias(model, [(None, None)] * 96, dtype=torch.float64)
    return result.stats, expected


def test_the_reuse_reads_correlation_bias_is_measured_as_predicted(measured):
    stats, expected = measured
    assert expected.norm() > 0  # O8 rounds between grid points: the planted bias is not zero
    reuse = stats["contrib.reuse_rounded"]["q"]
    assert reuse["projection"] == pytest.approx(1.0, abs=4 * reuse["projection_se"])
    assert reuse["projection_se"] < 0.1  # so that a meter missing the bias (projection 0) fails
    assert reuse["debiased_sq"] == pytest.approx(1.0, abs=4 * reuse["debiased_sq_se"] + 0.05)


def test_a_fresh_draw_carries_no_such_bias(measured):
    stats, _ = measured
    fresh = stats["contrib.fresh_reround"]["q"]
    assert abs(fresh["projection"]) < 4 * fresh["projection_se"]
    assert fresh["projection_se"] < 0.1
