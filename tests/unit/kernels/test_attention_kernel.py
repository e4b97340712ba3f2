"""The Triton attention core (``attention.kernel=triton``, in the interpreter) against the ops
core on the same inputs, for every policy's D read, nearest and stochastic rounding, delayed and
current scaling, GQA and not, head dims 64 and 128, T a block's multiple or not.

What is identical and what is bounded, and why. Both cores round Q, K, V, O and dO at the same
sites (the same torch code), so those codes and scales are identical once O is. Between them the
cores differ in one thing: the order of FP32 sums (each GEMM's, the softmax's sum, D's row sum)
and the exponential's last bits. Every GEMM output is rounded to BF16 (the emulated FP8 GEMM's
epilogue), so an element of S, O, dP, dQ, dK or dV differs only where the two FP32 sums straddle
a BF16 rounding point, and then by one BF16 unit (2**-8 relative): ``_ONE_BF16_UNIT``. P's FP32
values differ by a few FP32 units where their row's S agrees, so P8's codes are identical there
but for a tie or draw within those units of a decision point, a fraction of order 2**-20 x the
grid's 2**3 steps: none is expected among this test's ~10**5 codes, at most ``_FLIPS`` allowed.
Where a row's S differs by one BF16 unit its P moves by up to |S| 2**-8, and its codes may step
by one. The gradients then differ by the few stepped codes: their relative error is bounded by
one code step (2**-3 relative for E4M3, 2**-2 for E5M2) times the root of the stepped fraction,
``_bound``; the D-term's row sums ``rowsum(dS)`` are compared likewise. The probe's reference
(the gradient of the executed forward) is the same for both, and each core's gradient error is
checked to match the other's.
"""

from __future__ import annotations

import math

import pytest
import torch

from readback.numerics import CurrentScaling, DelayedScaling
from readback.numerics.site import Site
from readback.numerics.state import Numerics
from readback.ops import numerics_spec
from readback.ops.attention import attention

NAME = "layers.0.attn.core"
_ONE_BF16_UNIT = 2.0**-8  # relative
_FLIPS = 1e-3  # the share of P8's codes (in rows of identical S) allowed to differ by one step
POLICIES = ("reuse_rounded", "fresh_reround", "no_saved_copy", "original")
RECIPES = {"delayed": DelayedScaling, "current": CurrentScaling}


def _inputs(batch: int, heads: int, groups: int, seq: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g) * 2
    k, v = (torch.randn(batch, groups, seq, dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(batch, seq, heads * dim, generator=g)


def _run(kernel: str, policy: str, recipe: str, rounding: str, x: tuple[torch.Tensor, ...], monkeypatch) -> dict:
    """Two steps (the second on the first's delayed scales) of the op on ``kernel``: the codes and
    scales each site rounded (site -> list), the taped S and P8, O, dQ, dK, dV, the counts and the
    D-term's row sums of the second step."""
    numerics = Numerics(
        numerics_spec("fp8", RECIPES[recipe](), policy, rounding=rounding, attention_kernel=kernel), seed=3
    )
    rounded: dict = {}
    quantize_at = Site.quantize

    def spy(self, t, *args, **kwargs):
        q = quantize_at(self, t, *args, **kwargs)
        if kwargs.get("count", True):
            rounded.setdefault(self.name.rsplit(".", 1)[1], []).append((q.data.view(torch.uint8), q.scale))
        return q

    monkeypatch.setattr(Site, "quantize", spy)
    observed: dict = {}
    observe = numerics.observe

    def keep(key, values):
        observed[key] = values.detach().clone()
        observe(key, values)

    monkeypatch.setattr(numerics, "observe", keep)
    out: dict = {}
    for step in range(2):
        rounded.clear()
        q, k, v = (t.clone().requires_grad_() for t in x[:3])
        with numerics.taping() as tape:
            o, _ = attention(q, k, v, numerics, NAME)
        o.backward(x[3])
        out = {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "tape": tape[0][1]}
        out["counts"] = {n: (int(s.saturated), int(s.underflowed), int(s.nonzero)) for n, s in numerics.sites.items()}
        out["rowsum"] = observed[f"attn_rowsum/{NAME}"]
        out["scales"] = {n: s.state.scale.clone() for n, s in numerics.sites.items()}
        numerics.end_step()
    monkeypatch.setattr(Site, "quantize", quantize_at)
    out["rounded"] = dict(rounded)
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _bound(stepped: float, step: float) -> float:
    """A gradient's relative error from a share ``stepped`` of its inputs' codes one step apart
    (``step`` relative), the rest equal up to one BF16 unit: every output mixes many codes, the
    steps add like independent errors."""
    return step * math.sqrt(stepped) + 4 * _ONE_BF16_UNIT * max(stepped, 2**-8)


CASES = [  # (batch, heads, groups, T, head dim): GQA and not, 64 and 128, T a block's multiple and not
    (1, 2, 1, 16, 64),
    (1, 4, 2, 24, 128),
    (1, 2, 2, 128, 64),
    (2, 2, 1, 130, 64),
]


@pytest.mark.parametrize("shape", CASES, ids=[f"B{b}H{h}G{g}T{t}d{d}" for b, h, g, t, d in CASES])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_kernel_rounds_as_the_ops_core(monkeypatch, shape, recipe, rounding):
    x = _inputs(*shape, seed=sum(shape))
    for policy in POLICIES:
        ops, triton = (_run(kernel, policy, recipe, rounding, x, monkeypatch) for kernel in ("ops", "triton"))
        for site in ("q", "k", "v"):  # the same code on the same inputs: identical
            for (a, sa), (b, sb) in zip(ops["rounded"][site], triton["rounded"][site], strict=True):
                assert torch.equal(a, b) and torch.equal(sa, sb), (policy, site)
        s_ops, s_triton = ops["tape"]["scores"], triton["tape"]["scores"]
        finite = torch.isfinite(s_ops)
        assert torch.equal(finite, torch.isfinite(s_triton))  # the same causal mask, odd T included
        s_diff = (s_ops - s_triton).abs()[finite]
        assert float((s_diff / s_ops.abs()[finite].clamp_min(1e-30)).max()) <= _ONE_BF16_UNIT, policy
        rows_same = ((s_ops == s_triton) | ~finite).all(-1)  # rows of identical S
        p_ops = ops["tape"]["probs"].data.view(torch.uint8)[rows_same]
        p_triton = triton["tape"]["probs"].data.view(torch.uint8)[rows_same]
        assert rows_same.float().mean() > 0.5, "too few rows of identical S to compare P8 on"
        assert float((p_ops != p_triton).float().mean()) <= _FLIPS, policy
        assert torch.equal(ops["tape"]["probs"].scale, triton["tape"]["probs"].scale)  # P's scale: amax 1 both
        stepped = float((ops["tape"]["probs"].data.view(torch.uint8) != triton["tape"]["probs"].data.view(torch.uint8)).float().mean())
        bound = _bound(stepped, 2.0**-3) + 2 * _ONE_BF16_UNIT
        assert _relative(triton["o"], ops["o"]) <= bound, (policy, _relative(triton["o"], ops["o"]), bound)
        for grad in ("dq", "dk", "dv"):
            error = _relative(triton[grad], ops[grad])
            assert error <= _bound(stepped, 2.0**-2) + 4 * _ONE_BF16_UNIT, (policy, grad, error, stepped)
        rowsum_error = _relative(triton["rowsum"], ops["rowsum"])
        if policy != "no_saved_copy":  # D's error: the same for both cores (else both are round-off)
            assert rowsum_error <= _bound(stepped, 2.0**-2) + 4 * _ONE_BF16_UNIT, (policy, rowsum_error)
        else:
            scale = float(ops["dq"].abs().max())
            assert float(triton["rowsum"].abs().max()) <= 1e-3 * scale + 1e-6
        for site, (sat, under, nonzero) in ops["counts"].items():
            sat_t, under_t, nonzero_t = triton["counts"][site]
            assert sat == sat_t, (policy, site)
            assert abs(nonzero - nonzero_t) <= 1e-3 * nonzero + 2 and abs(under - under_t) <= 1e-2 * nonzero + 2, (
                policy,
                site,
                (sat, under, nonzero),
                (sat_t, under_t, nonzero_t),
            )
