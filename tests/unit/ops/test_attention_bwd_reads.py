"""The attention backward's flavour ``te`` (``attention.bwd_reads``): its gradients against an
independent float64 writing of Transformer Engine's BF16 attention backward after an FP8 forward
(NVTE_FP8_DPA_BWD=0), and the tables, spec and bias variants that carry it."""

from __future__ import annotations

import pytest
import torch

from readback.bias.variants import variant_spec, variants
from readback.errors import ConfigError
from readback.numerics import CurrentScaling
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import fp8_settings_of
from readback.numerics.settings import NumericsSettings
from readback.numerics.state import Numerics
from readback.ops import read_rules
from readback.ops.attention import BWD_READS, attention
from specs import make_spec

TE_BACKWARD = AttentionSettings(bwd_precision="bf16", bwd_reads="te")

C = 0.125
B, H, G, T, HD = 2, 4, 2, 24, 16
F64 = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, H, T, HD, generator=g) * 2,
        "k": torch.randn(B, G, T, HD, generator=g) * 2,
        "v": torch.randn(B, G, T, HD, generator=g),
        "d_o": torch.randn(B, T, H * HD, generator=g),
    }


def _run(policy: str, bwd: str, bwd_reads: str, x: dict[str, torch.Tensor]):
    """The op's (dQ, dK, dV) and its forward's record."""
    numerics = Numerics(
        make_spec("fp8", CurrentScaling(), policy, attention=dict(bwd_precision=bwd, bwd_reads=bwd_reads))
    )
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    with numerics.taping() as tape:
        o, _ = attention(q, k, v, numerics, "attn", C)
        o.backward(x["d_o"])
    return (q.grad, k.grad, v.grad), dict(tape)["attn"]


def _te_formulas(x: dict[str, torch.Tensor], rec: dict, d_read: str, bf16: bool):
    """TE's BF16 attention backward in float64, written from its description: D = rowsum(dO O8)
    (``d_read`` "rounded") or rowsum(P dP) ("none"), with O8 dequantised; the original Q, K, V;
    ``P = exp(c Q K^T - LSE)`` with LSE of the FP8 forward's scores ``c Q8 K8^T``. ``bf16``: the
    held values (Q, K, V, dO, O8) rounded to BF16 first, as TE holds them."""

    def held(t: torch.Tensor) -> torch.Tensor:
        return (t.to(torch.bfloat16) if bf16 else t).to(F64)

    q = held(x["q"])
    k, v = (held(x[n]).repeat_interleave(H // G, dim=1) for n in ("k", "v"))
    d_o = held(x["d_o"]).reshape(B, T, H, HD).transpose(1, 2)
    o8 = held(rec["output"].dequantize(torch.float32)).reshape(B, T, H, HD).transpose(1, 2)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    lse = torch.logsumexp(rec["scores"].to(F64).masked_fill(mask, float("-inf")), -1, keepdim=True)
    p = torch.exp((C * q @ k.mT).masked_fill(mask, float("-inf")) - lse)
    d_v = p.mT @ d_o
    d_p = d_o @ v.mT
    d = (d_o * o8).sum(-1, keepdim=True) if d_read == "rounded" else (p * d_p).sum(-1, keepdim=True)
    d_s = p * (d_p - d)
    d_q, d_k = C * d_s @ k, C * d_s.mT @ q
    return d_q, *(t.reshape(B, G, H // G, T, HD).sum(2) for t in (d_k, d_v)), p


@pytest.mark.parametrize(("policy", "d_read"), [("reuse_rounded", "rounded"), ("no_saved_copy", "none")])
def test_te_reads_match_te_formulas_in_an_fp32_backward(policy, d_read):
    """With FP32 GEMMs nothing but the reads is left: the op equals the formulas to round-off,
    and is far from the same formulas on the forward's operands (bwd_reads=forward)."""
    x = _inputs()
    got, rec = _run(policy, "fp32", "te", x)
    *want, p = _te_formulas(x, rec, d_read, bf16=False)
    forward_reads, _ = _run(policy, "fp32", "forward", x)
    for name, g, w, f in zip(("dQ", "dK", "dV"), got, want, forward_reads):
        assert _rel(g, w) < 1e-5, name
        assert _rel(f, w) > 1e-2, name  # the test can tell the flavours apart
    rows = p.sum(-1)
    assert (rows - 1).abs().max() > 1e-3  # P rebuilt from other Q, K than the forward's: rows off one


def test_te_reads_in_a_bf16_backward_hold_bf16_values():
    """In a BF16 backward the op is within BF16 arithmetic of the formulas with BF16-held
    values, nearer them than the same formulas on unrounded values, and far from the
    forward-reads BF16 backward."""
    x = _inputs(1)
    got, rec = _run("reuse_rounded", "bf16", "te", x)
    *want, _ = _te_formulas(x, rec, "rounded", bf16=True)
    *unheld, _ = _te_formulas(x, rec, "rounded", bf16=False)
    forward_reads, _ = _run("reuse_rounded", "bf16", "forward", x)
    for name, g, w, u, f in zip(("dQ", "dK", "dV"), got, want, unheld, forward_reads):
        assert _rel(g, w) < 6e-3, name
        assert _rel(g, w) < _rel(g, u), name
        assert _rel(g, w) < _rel(f, w) / 10, name


def test_the_flavour_is_laid_over_every_policy_but_exact():
    for policy in ("reuse_rounded", "fresh_reround", "no_saved_copy", "original"):
        reads = read_rules(policy, TE_BACKWARD)["attention"]
        assert reads == {**read_rules(policy)["attention"], **BWD_READS["te"]}
        assert reads["D"] == read_rules(policy)["attention"]["D"]  # D stays the policy's
    assert read_rules("exact", TE_BACKWARD) == read_rules("exact")
    fp8_backward = AttentionSettings(bwd_precision="fp8", bwd_reads="te")
    with pytest.raises(ConfigError, match=r"attention\.bwd_reads='te'.*bwd_precision=fp8"):
        NumericsSettings(fp8_settings_of(CurrentScaling()), fp8_backward, "reuse_rounded").check()


def test_bias_variants_switch_each_te_read_alone():
    numerics = Numerics(
        make_spec("fp8", CurrentScaling(), "reuse_rounded", attention=dict(bwd_precision="bf16", bwd_reads="te"))
    )
    names = {v.name: v for v in variants(numerics)}
    for gradient in ("D", "dQ", "dK", "dP", "dV", "dS"):
        spec = variant_spec(names[f"exact_read.attention.{gradient}"], numerics.spec)
        exact = read_rules("exact")["attention"][gradient]
        switched = {g for g, m in spec.reads["attention"].items() if m != numerics.spec.reads["attention"][g]}
        assert switched == {gradient} and spec.reads["attention"][gradient] == exact
    # a policy variant keeps the run's flavour; exact (and all_exact) reads the forward's operands
    assert variant_spec(names["no_saved_copy"], numerics.spec).reads["attention"]["dQ"] == "original"
    assert variant_spec(names["all_exact"], numerics.spec).reads == read_rules("exact")


@pytest.mark.parametrize("gradient", ["D", "dQ", "dK", "dP", "dV", "dS"])
def test_each_variant_backward_runs_and_changes_the_gradient(gradient):
    """Every mixture a variant makes (one read back to the forward's) runs; switching the read
    changes the gradient."""
    x = _inputs(2)
    numerics = Numerics(
        make_spec("fp8", CurrentScaling(), "reuse_rounded", attention=dict(bwd_precision="fp32", bwd_reads="te"))
    )
    spec = variant_spec(
        next(v for v in variants(numerics) if v.name == f"exact_read.attention.{gradient}"), numerics.spec
    )
    grads = {}
    for label, s in (("te", numerics.spec), ("switched", spec)):
        q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
        with numerics.using(s):
            o, _ = attention(q, k, v, numerics, "attn", C)
            o.backward(x["d_o"])
        grads[label] = torch.cat([t.grad.flatten() for t in (q, k, v)])
    assert _rel(grads["switched"], grads["te"]) > 1e-4
