"""The Triton attention core against the ops core on the same inputs (``compare``), for
``tests/unit/kernels/test_attention_kernel.py`` (the kernel in Triton's interpreter), whose
docstring says what is identical and what is bounded, and why, and for
``tests/unit/backends/test_gpu_kernel.py`` (the kernel on CUDA)."""

from __future__ import annotations

import math

import torch

from readback.numerics import CurrentScaling, DelayedScaling, QTensor
from readback.numerics.site import Site
from readback.numerics.state import Numerics
from readback.ops.attention import attention
from specs import make_spec

NAME = "layers.0.attn.core"
_ONE_BF16_UNIT = 2.0**-8  # relative
_FLIPS = 1e-3  # the share of P8's codes (in rows of identical S) allowed to differ by one step
_FP32_SUMS = 2.0**-16  # relative: FP32 sums of at most 256 terms in two orders (K FP32 units, 2**-24)
POLICIES = ("reuse_rounded", "fresh_reround", "no_saved_copy", "original")
RECIPES = {"delayed": DelayedScaling, "current": CurrentScaling}


def _straddles(sum_length: int) -> float:
    """The share of a BF16 backward's gradient elements allowed to differ: FP32 sums of K products
    (K = ``sum_length``, the longest: T or the head dim) in two orders differ by at most K FP32
    units (2**-24) of their magnitude, so one straddles a BF16 rounding point (units of 2**-8)
    with probability at most K 2**-16; an element's path holds at most four such roundings (dP,
    dS, its own GEMM; and P's for dV)."""
    return 4 * sum_length * 2.0**-16


def _inputs(batch: int, heads: int, groups: int, seq: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g) * 2
    k, v = (torch.randn(batch, groups, seq, dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(batch, seq, heads * dim, generator=g)


def _run(
    kernel: str,
    policy: str,
    recipe: str,
    rounding: str,
    x: tuple[torch.Tensor, ...],
    monkeypatch,
    device: str,
    backward: dict | None = None,
) -> dict:
    """Two steps (the second on the first's delayed scales) of the op on ``kernel`` and ``device``:
    the codes and scales each site rounded (site -> list), the taped S and P8, O, dQ, dK, dV, the
    counts and the D-term's row sums of the second step, on the CPU."""
    settings = dict(kernel=kernel, **(backward or {}))
    numerics = Numerics(make_spec("fp8", RECIPES[recipe](), policy, rounding=rounding, attention=settings), seed=3)
    rounded: dict = {}
    quantize_at = Site.quantize

    def spy(self, t, *args, **kwargs):
        q = quantize_at(self, t, *args, **kwargs)
        if kwargs.get("count", True):
            codes = (q.data.view(torch.uint8).cpu(), q.scale.cpu())
            rounded.setdefault(self.name.rsplit(".", 1)[1], []).append(codes)
        return q

    monkeypatch.setattr(Site, "quantize", spy)
    observed: dict = {}
    observe = numerics.observe

    def keep(key, values):
        observed[key] = values.detach().clone()
        observe(key, values)

    monkeypatch.setattr(numerics, "observe", keep)
    out: dict = {}
    for _ in range(2):
        rounded.clear()
        # copies: on the CPU ``to`` returns the input itself, whose .grad would add up over steps and runs
        q, k, v = (t.to(device, copy=True).requires_grad_() for t in x[:3])
        with numerics.taping() as tape:
            o, _ = attention(q, k, v, numerics, NAME)
        o.backward(x[3].to(device))
        record = {n: t.map(lambda d: d.cpu()) if isinstance(t, QTensor) else t.cpu() for n, t in tape[0][1].items()}
        out = {"o": o.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu(), "tape": record}
        out["counts"] = {n: (int(s.saturated), int(s.underflowed), int(s.nonzero)) for n, s in numerics.sites.items()}
        out["rowsum"] = observed[f"attn_rowsum/{NAME}"].cpu()
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


def _gradient_bounds(backward: dict, stepped: float, sum_length: int) -> dict[str, float]:
    """Each gradient's bound (``_bound``) under the backward's precision and flavour. FP8: dS8's
    codes an E5M2 step apart (dQ, dK; at most P8's share, where P did), P8's an E4M3 step (dV).
    An FP8 or FP32 backward's FP32 GEMM of an unrounded dS (dQ, dK) or dO (dV) rounds no output: dS's
    elements a BF16 unit apart where dP's or S's rounding straddled (a share ``_straddles``), P8's
    codes a step apart, and the FP32 sum order (``_FP32_SUMS``), with no BF16 unit of its own;
    nor has any output of the FP32 backward, whose every GEMM is such.
    BF16: dS's BF16 values a unit apart where its own rounding or dP's straddled (dQ, dK; at
    every element at worst: two units); P8's E4M3 step where dV reads P8, the rebuilt P's BF16
    unit where it reads that (its FP32 P differs by the LSE's FP32 sum order alone)."""
    precision = backward.get("bwd_precision", "fp8")
    if precision in ("fp8", "fp32"):

        def rounds(gradient: str) -> bool:  # as ``NumericsSpec.attention_rounds`` says
            setting = backward.get(f"round_{gradient}")
            return precision == "fp8" if setting is None else setting

        unit = _ONE_BF16_UNIT if precision == "fp8" else _FP32_SUMS  # an FP32 backward rounds no GEMM output
        dqk = 2.0**-2 * math.sqrt(stepped) + unit
        if not rounds("grad_scores"):
            dqk = _ONE_BF16_UNIT * math.sqrt(_straddles(sum_length)) + _FP32_SUMS
        dv_unit = rounds("grad_output") or backward.get("bwd_probs", "forward") == "rebuilt"
        dv = 2.0**-3 * math.sqrt(stepped) + (unit if dv_unit else _FP32_SUMS)
        return {"dq": dqk, "dk": dqk, "dv": dv}
    dv = _bound(stepped, 2.0**-3) if backward.get("bwd_reads", "forward") == "forward" else _bound(1.0, _ONE_BF16_UNIT)
    return {"dq": _bound(1.0, 2 * _ONE_BF16_UNIT), "dk": _bound(1.0, 2 * _ONE_BF16_UNIT), "dv": dv}


def compare(
    shape: tuple[int, ...],
    policy: str,
    recipe: str,
    rounding: str,
    monkeypatch,
    device: str = "cpu",
    backward: dict | None = None,
) -> None:
    """The kernel on ``device`` against the ops core on the CPU, on one shape (batch, heads,
    groups, T, head dim) under ``policy``, ``recipe``, ``rounding`` and the ``backward``'s
    attention settings (``bwd_precision``, ``bwd_reads``; the FP8 backward reading the forward's
    operands when None)."""
    backward = backward or {}
    x = _inputs(*shape, seed=sum(shape))
    ops = _run("ops", policy, recipe, rounding, x, monkeypatch, "cpu", backward)
    triton = _run("triton", policy, recipe, rounding, x, monkeypatch, device, backward)
    assert ops["counts"].keys() == triton["counts"].keys(), policy  # the same sites (a BF16 backward: no dO8, dS8)
    for site in ("q", "k", "v", "grad_output"):  # the same code on the same inputs: identical
        assert (site in ops["rounded"]) == (site in triton["rounded"]), (policy, site)
        for (a, sa), (b, sb) in zip(ops["rounded"].get(site, []), triton["rounded"].get(site, []), strict=True):
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
    for value, bound in ({"o": _bound(stepped, 2.0**-3)} | _gradient_bounds(backward, stepped, max(shape[3:]))).items():
        error = _relative(triton[value], ops[value])
        assert error <= bound, (policy, value, error, stepped)
        if value != "o" and backward.get("bwd_precision") == "bf16":
            differ = float((triton[value] != ops[value]).float().mean())
            assert differ <= _straddles(max(shape[3:])), (policy, value, differ)
    # D = rowsum(P * dP) of the forward's P: rowsum(dS) is round-off in both (of a rebuilt P, whose
    # rows need not sum to one, it is D's share of that departure: compared as D's error is)
    if policy == "no_saved_copy" and backward.get("bwd_reads", "forward") == "forward":
        assert float(triton["rowsum"].abs().max()) <= 1e-4 * float(ops["dq"].abs().max())
    else:  # D's error, the same in both
        assert _relative(triton["rowsum"], ops["rowsum"]) <= _bound(stepped, 2.0**-2), policy
    for site, counts in ops["counts"].items():  # saturated, underflowed, nonzero
        nonzero = counts[2]
        assert all(abs(a - b) <= _FLIPS * nonzero for a, b in zip(counts, triton["counts"][site])), (policy, site)
