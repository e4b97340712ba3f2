"""The Triton attention core (``attention.kernel=triton``, in the interpreter) against the ops
core on the same inputs: every policy's D read, nearest and stochastic rounding, delayed and
current scaling (two steps: the second on the first's delayed scales), GQA and not, head dims
64 and 128, T within, at and past the kernel's 64-row blocks.

What is identical and what is bounded, and why. Both cores round Q, K, V, O and dO at the same
sites with the same torch code, so Q8, K8, V8 and dO8 are identical. Between them the cores differ
in the order of FP32 sums (each GEMM's, the softmax's row sum, D's) and the exponential's last
bits. Every GEMM output is rounded to BF16 (the emulated FP8 GEMM's epilogue), so an element of S,
O, dP, dQ, dK or dV can differ only where the two FP32 sums straddle a BF16 rounding point, and
then by one BF16 unit (2**-8 relative): S is held to that. P's FP32 values then differ by a few
FP32 units, or by |S| 2**-8 where S did, and P8's and O8's codes step by one where their values
sit that close to a decision point: at most a share ``_FLIPS`` of them. A GEMM output's relative
difference is then at most one BF16 unit plus a code step (2**-3 for E4M3, 2**-2 for E5M2)
times the root of the stepped share, ``_bound``; the D-term's row sums likewise, and the sites'
counts within ``_FLIPS`` of their nonzero elements. (In the interpreter the two cores' codes,
counts, O, dK and dV have come out identical on these inputs, and dQ within 2e-5.)
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
    """The relative (Frobenius) difference of a GEMM output of the two cores: one BF16 unit where
    their FP32 sums straddle a rounding point (at most every element), plus a share ``stepped``
    of its input codes one step (``step``, relative) apart, which add like independent errors."""
    return _ONE_BF16_UNIT + step * math.sqrt(stepped)


SMALL = (1, 2, 1, 16, 64)  # (batch, heads, groups, T, head dim): every policy, recipe and rounding
# GQA and not, head dims 64 and 128, T within one of the kernel's 64-row blocks, a multiple, and
# past one (odd: the last block masked), each under one policy, recipe and rounding
SHAPES = [
    ((1, 4, 2, 24, 128), "fresh_reround", "current", "stochastic"),
    ((1, 2, 2, 128, 64), "reuse_rounded", "delayed", "nearest"),
    ((2, 2, 1, 71, 64), "no_saved_copy", "current", "stochastic"),
    ((1, 2, 1, 80, 128), "original", "delayed", "stochastic"),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_policy_recipe_and_rounding(monkeypatch, policy, recipe, rounding):
    _compare(SMALL, policy, recipe, rounding, monkeypatch)


@pytest.mark.parametrize(("shape", "policy", "recipe", "rounding"), SHAPES, ids=[f"T{c[0][3]}d{c[0][4]}H{c[0][1]}G{c[0][2]}" for c in SHAPES])
def test_shapes(monkeypatch, shape, policy, recipe, rounding):
    _compare(shape, policy, recipe, rounding, monkeypatch)


def _compare(shape: tuple[int, ...], policy: str, recipe: str, rounding: str, monkeypatch) -> None:
    """The kernel against the ops core on one shape under ``policy``, ``recipe`` and ``rounding``."""
    x = _inputs(*shape, seed=sum(shape))
    ops, triton = (_run(kernel, policy, recipe, rounding, x, monkeypatch) for kernel in ("ops", "triton"))
    for site in ("q", "k", "v", "grad_output"):  # the same code on the same inputs: identical
        for (a, sa), (b, sb) in zip(ops["rounded"][site], triton["rounded"][site], strict=True):
            assert torch.equal(a, b) and torch.equal(sa, sb), (policy, site)
    s_ops, s_triton = ops["tape"]["scores"], triton["tape"]["scores"]
    visible = torch.isfinite(s_ops)
    assert torch.equal(visible, torch.isfinite(s_triton))  # the same causal mask, odd T included
    s_error = (s_ops - s_triton).abs()[visible] / s_ops.abs()[visible].clamp_min(1e-30)
    assert float(s_error.max()) <= _ONE_BF16_UNIT, policy
    p_ops, p_triton = (r["tape"]["probs"] for r in (ops, triton))
    assert torch.equal(p_ops.scale, triton["tape"]["probs"].scale)  # P's amax is 1 in both
    stepped = float((p_ops.data.view(torch.uint8) != p_triton.data.view(torch.uint8))[visible].float().mean())
    assert stepped <= _FLIPS, (policy, stepped)
    (o8_ops, o_scale), (o8_triton, o_scale_triton) = ops["rounded"]["output"][-1], triton["rounded"]["output"][-1]
    assert float((o8_ops != o8_triton).float().mean()) <= _FLIPS, policy
    assert float((o_scale - o_scale_triton).abs() / o_scale) <= _ONE_BF16_UNIT, policy  # O's amax: a BF16 unit
    for value, step in (("o", 2.0**-3), ("dq", 2.0**-2), ("dk", 2.0**-2), ("dv", 2.0**-3)):
        error = _relative(triton[value], ops[value])
        assert error <= _bound(stepped, step), (policy, value, error, stepped)
    if policy == "no_saved_copy":  # D = rowsum(P * dP): rowsum(dS) is round-off in both
        assert float(triton["rowsum"].abs().max()) <= 1e-4 * float(ops["dq"].abs().max())
    else:  # D's error, the same in both
        assert _relative(triton["rowsum"], ops["rowsum"]) <= _bound(stepped, 2.0**-2), policy
    for site, counts in ops["counts"].items():  # saturated, underflowed, nonzero
        nonzero = counts[2]
        assert all(abs(a - b) <= _FLIPS * nonzero for a, b in zip(counts, triton["counts"][site])), (policy, site)
