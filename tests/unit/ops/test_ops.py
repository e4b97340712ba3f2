"""Op-level tests: gradcheck with rounding off, and each policy's backward reads against the
reference (plain autograd over the executed forward, replayed from ``numerics.tape``)."""

from __future__ import annotations

import math

import pytest
import torch

from readback.numerics import E4M3, E5M2, CurrentScaling, DelayedScaling, compute_scale, quantize
from readback.numerics.state import Numerics
from readback.ops import OPS, attention_parts, read_rules
from readback.ops import attention as attention_mod
from readback.ops import linear as linear_mod
from readback.ops import norm as norm_mod
from readback.ops.activation import BETA, EPS, replay, xielu
from readback.ops.attention import attention
from readback.ops.linear import linear
from readback.ops.norm import layer_norm, rms_norm
from readback.policy import POLICIES, READ_MODES
from specs import make_spec

SOFTMAX_SCALE = 0.125


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# declared reads


def test_every_op_declares_reads_for_every_policy():
    assert set(OPS) == {"linear", "rms_norm", "attention", "xielu"}
    for name, module in OPS.items():
        assert set(module.READS) == set(POLICIES), name
        for policy, reads in module.READS.items():
            assert reads, (name, policy)
            for gradient, mode in reads.items():
                assert mode in READ_MODES, (name, policy, gradient, mode)
    for policy in POLICIES:
        assert set(read_rules(policy)) == set(OPS)
    assert attention_mod.READS["reuse_rounded"]["D"] == "rounded"
    assert attention_mod.READS["fresh_reround"]["D"] == "fresh"
    assert attention_mod.READS["no_saved_copy"]["D"] == "none"
    assert attention_mod.READS["original"]["D"] == "original"
    assert attention_mod.READS["exact"]["D"] == "none"
    assert all(norm_mod.READS[p]["gain"] == "original" for p in POLICIES)


# ---------------------------------------------------------------------------------------------
# gradcheck, float64, rounding switched off


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradcheck_linear(policy):
    numerics = Numerics(make_spec("off", policy=policy))
    g = _gen(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    _gradcheck(lambda x, w: linear(x, w, numerics, "lin"), x, w)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("variant", ["learnable", "frozen", "round_output"])
def test_gradcheck_rms_norm(policy, variant):
    numerics = Numerics(make_spec("off", policy=policy))
    g = _gen(1)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    gain = (torch.rand(6, dtype=torch.float64, generator=g) + 0.5).requires_grad_(variant != "frozen")
    if variant == "round_output":
        _gradcheck(lambda x, gain: rms_norm(x, gain, numerics, "norm", round_output=True)[0], x, gain)
    elif variant == "frozen":
        _gradcheck(lambda x: rms_norm(x, gain, numerics, "norm"), x)
    else:
        _gradcheck(lambda x, gain: rms_norm(x, gain, numerics, "norm"), x, gain)


@pytest.mark.parametrize("variant", ["affine", "no_bias", "round_output"])
def test_layer_norm_gradients_equal_autograd_of_torch_layer_norm(variant):
    """gradcheck, and every gradient equal to autograd through ``F.layer_norm`` (float64)."""
    numerics = Numerics(make_spec("off"))
    g = _gen(11)
    x = (torch.randn(2, 3, 6, dtype=torch.float64, generator=g) * 2 + 1).requires_grad_()
    gain = (torch.rand(6, dtype=torch.float64, generator=g) + 0.5).requires_grad_()
    bias = None if variant == "no_bias" else torch.randn(6, dtype=torch.float64, generator=g).requires_grad_()
    rounded = variant == "round_output"
    ours = lambda x, gain, *b: layer_norm(x, gain, b[0] if b else None, numerics, "ln", 1e-5, rounded)  # noqa: E731
    out = lambda *a: ours(*a)[0] if rounded else ours(*a)  # noqa: E731
    leaves = (x, gain) if bias is None else (x, gain, bias)
    _gradcheck(out, *leaves)
    upstream = torch.randn(2, 3, 6, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out(*leaves), leaves, upstream)
    expected = torch.autograd.grad(torch.nn.functional.layer_norm(x, (6,), gain, bias, 1e-5), leaves, upstream)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradcheck_attention_gqa_causal(policy):
    numerics = Numerics(make_spec("off", policy=policy))
    g = _gen(2)
    q = torch.randn(1, 4, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    _gradcheck(lambda q, k, v: attention(q, k, v, numerics, "attn")[0], q, k, v)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradcheck_xielu(policy):
    numerics = Numerics(make_spec("off", policy=policy))
    x = torch.randn(3, 7, dtype=torch.float64, generator=_gen(3))
    x = (x + 0.05 * x.sign()).requires_grad_()  # keep clear of the kinks at eps and 0
    alpha_p = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    alpha_n = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    _gradcheck(lambda x, a, b: xielu(x, a, b, numerics), x, alpha_p, alpha_n)


# ---------------------------------------------------------------------------------------------
# attention: policies against the reference, the D-term by hand

B, H, G, T, HD = 2, 4, 2, 16, 8


def _attention_inputs(seed: int = 0):
    g = _gen(seed)
    q = torch.randn(B, H, T, HD, generator=g)
    k = torch.randn(B, G, T, HD, generator=g)
    v = torch.randn(B, G, T, HD, generator=g)
    d_out = torch.randn(B, T, H * HD, generator=g)
    return q, k, v, d_out


def _heads(t: torch.Tensor) -> torch.Tensor:
    """(B, T, H*hd) -> (B, H, T, hd)"""
    return t.reshape(B, T, H, HD).transpose(1, 2)


def _run_attention(policy: str, recipe, inputs, warmup: bool):
    """One measured forward/backward (after a warm-up step when asked); returns the gradients,
    the output, the recorded forward and what the numerics observed."""
    q0, k0, v0, d_out = inputs
    numerics = Numerics(make_spec("fp8", recipe, policy=policy, attention=dict(bwd_precision="fp32")))
    if warmup:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        attention(q, k, v, numerics, "attn")[0].backward(d_out)
        numerics.end_step()
        numerics.pop_observations()
    with numerics.taping() as tape:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, oq = attention(q, k, v, numerics, "attn")
        out.backward(d_out)
    ((name, record),) = tape
    assert name == "attn"
    return {
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "out": out,
        "oq": oq,
        "record": record,
        "numerics": numerics,
        "obs": numerics.pop_observations(),
    }


@pytest.mark.parametrize("attention_bwd_precision", ["fp8", "bf16"])
@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
@pytest.mark.parametrize("policy", ["reuse_rounded", "fresh_reround", "no_saved_copy"])
def test_attention_in_query_blocks_is_the_whole_attention(monkeypatch, policy, recipe, attention_bwd_precision):
    """Blocks of 5 query rows (a last partial block; GEMM operands decoded a few matrices at a
    time) give the bits of one block of all T rows: O8 and P8 (scores GEMM and softmax of each
    block are the whole matrix's), saturation counts, rowsum observations; the gradients, whose
    dK and dV add the blocks' products in FP32, agree to FP32 round-off. Current scaling rounds
    P and dS with one whole-tensor scale."""
    import readback.numerics.gemm as gemm_mod

    def run():
        q0, k0, v0, d_out = _attention_inputs(5)
        numerics = Numerics(
            make_spec("fp8", recipe, policy=policy, attention=dict(bwd_precision=attention_bwd_precision))
        )
        results = []
        for grow in (1, 1e3):  # the second step runs on delayed scales from the first: dS saturates
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            with numerics.taping() as tape:
                o, _ = attention(q, k, v, numerics, "attn")
            o.backward(d_out * grow)
            numerics.end_step()
            record = tape[0][1]
            codes = [record[n].data.view(torch.uint8) for n in ("probs", "output")]
            observed = numerics.pop_observations()
            results.append((q.grad, k.grad, v.grad, codes, numerics.saturation_counts(), observed, grow))
        return results

    monkeypatch.setattr(attention_parts, "BLOCK_ELEMENTS", 0)
    monkeypatch.setattr(attention_parts, "MIN_ROWS", T)
    whole = run()
    monkeypatch.setattr(attention_parts, "MIN_ROWS", 5)
    monkeypatch.setattr(gemm_mod, "DECODED_BLOCK", 3 * T * T)
    blocked = run()
    for w, b in zip(whole, blocked):
        assert all(_rel(x, y) < 1e-6 for x, y in zip(w[:3], b[:3]))
        assert all(torch.equal(x, y) for x, y in zip(w[3], b[3]))
        assert w[4] == b[4]
        means = {key: x for key, x in w[5].items() if "/mean/" in key}  # FP32 row sums over fewer columns
        assert w[5].keys() == b[5].keys()
        assert means == pytest.approx({key: b[5][key] for key in means}, abs=1e-6 * w[6])
    if attention_bwd_precision == "fp8" and isinstance(recipe, DelayedScaling):
        assert "attn.grad_scores" in whole[1][4], whole[1][4]  # the blocks' counts add up


def test_attention_saves_no_t_by_t_tensor():
    """The backward recomputes P and P8 from Q8 and K8: none of the saved tensors is T x T."""
    q, k, v, _ = _attention_inputs()
    for policy in POLICIES:
        for bwd, bwd_reads in (("fp8", "forward"), ("bf16", "te")):
            numerics = Numerics(
                make_spec("fp8", CurrentScaling(), policy, attention=dict(bwd_precision=bwd, bwd_reads=bwd_reads))
            )
            o, _ = attention(q.requires_grad_(), k, v, numerics, "attn")
            shapes = [tuple(t.shape) for t in o.grad_fn.saved_tensors]
            assert (B, H, T, HD) in shapes and not [s for s in shapes if s[-2:] == (T, T)], (policy, shapes)


def _replay_grads(inputs, record):
    q0, k0, v0, d_out = inputs
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    o = attention_mod.replay(q, k, v, record, SOFTMAX_SCALE)
    return o, torch.autograd.grad(o, (q, k, v), d_out)


def _hand_terms(inputs, record):
    """P, K8, Q8, dO, dP and D_exact = rowsum(P * dP), in float64, from the recorded forward."""
    d_out = _heads(inputs[3]).double()
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = torch.softmax(record["scores"].masked_fill(causal, float("-inf")), dim=-1).double()
    k8 = record["k"].dequantize(torch.float64)
    q8 = record["q"].dequantize(torch.float64)
    v8 = record["v"].dequantize(torch.float64)
    d_p = d_out @ v8.mT
    d_exact = (probs * d_p).sum(-1, keepdim=True)
    return {"P": probs, "K8": k8, "Q8": q8, "dO": d_out, "dP": d_p, "D_exact": d_exact}


def _d_term_gradients(terms, d_read):
    """dQ, dK changes of reading D = ``d_read`` instead of D_exact: dS changes by -P (D - D_exact)."""
    d_s = -terms["P"] * (d_read - terms["D_exact"])
    d_q = SOFTMAX_SCALE * d_s @ terms["K8"]
    d_k = (SOFTMAX_SCALE * d_s.mT @ terms["Q8"]).reshape(B, G, H // G, T, HD).sum(2)
    return d_q, d_k


@pytest.fixture(scope="module")
def attention_runs():
    """Every policy under each recipe, on the same inputs (forwards are deterministic)."""
    inputs = _attention_inputs()
    runs = {}
    for recipe_id, recipe, warmup in (("current", CurrentScaling(), False), ("delayed-warm", DelayedScaling(), True)):
        for policy in POLICIES:
            runs[recipe_id, policy] = _run_attention(policy, recipe, inputs, warmup)
    return inputs, runs


@pytest.mark.parametrize("recipe_id", ["current", "delayed-warm"])
def test_attention_forwards_agree_and_scales_are_not_one(attention_runs, recipe_id):
    _, runs = attention_runs
    ref = runs[recipe_id, "exact"]
    for policy in POLICIES:
        assert torch.equal(runs[recipe_id, policy]["out"], ref["out"]), policy
        assert torch.equal(runs[recipe_id, policy]["dv"], ref["dv"]), policy  # dV does not read D
    scales = {
        name: float(site.state.scale)
        for name, site in ref["numerics"].sites.items()
        if name.split(".")[-1] in ("q", "k", "v", "probs", "output")
    }
    assert len(scales) == 5 and all(s != 1.0 for s in scales.values()), scales
    # the returned copy is the recorded O8 and is on the E4M3 grid
    assert torch.equal(ref["oq"].data.view(torch.uint8), ref["record"]["output"].data.view(torch.uint8))
    assert ref["oq"].data.dtype == torch.float8_e4m3fn
    assert torch.equal(ref["out"], ref["oq"].dequantize())


@pytest.mark.parametrize("recipe_id", ["current", "delayed-warm"])
@pytest.mark.parametrize("policy", ["exact", "no_saved_copy"])
def test_attention_exact_policies_match_reference(attention_runs, recipe_id, policy):
    inputs, runs = attention_runs
    run = runs[recipe_id, policy]
    o_ref, (dq, dk, dv) = _replay_grads(inputs, run["record"])
    assert torch.equal(o_ref, run["out"])  # the replay reproduces the executed forward
    assert _rel(run["dq"], dq) < 1e-5
    assert _rel(run["dk"], dk) < 1e-5
    assert _rel(run["dv"], dv) < 1e-5


@pytest.mark.parametrize("recipe_id", ["current", "delayed-warm"])
@pytest.mark.parametrize("policy", ["reuse_rounded", "original"])
def test_attention_d_term_by_hand(attention_runs, recipe_id, policy):
    """``reuse_rounded`` reads D = rowsum(dO * O8), ``original`` D = rowsum(dO * O): the gradient
    differs from the exact one by exactly the D-term change, computed by hand."""
    inputs, runs = attention_runs
    run, exact = runs[recipe_id, policy], runs[recipe_id, "exact"]
    record = run["record"]
    terms = _hand_terms(inputs, record)
    if policy == "reuse_rounded":
        o_read = _heads(record["output"].dequantize(torch.float64))
    else:
        o_read = _heads(record["out"].double())
    d_read = (terms["dO"] * o_read).sum(-1, keepdim=True)
    hand_dq, hand_dk = _d_term_gradients(terms, d_read)

    assert _rel(run["dq"], exact["dq"]) > 1e-3  # the D-term error is visible
    assert _rel(run["dq"] - exact["dq"], hand_dq) < 1e-4
    assert _rel(run["dk"] - exact["dk"], hand_dk) < 1e-4


def test_attention_fresh_reround_differs_from_reuse(attention_runs):
    _, runs = attention_runs
    for recipe_id in ("current", "delayed-warm"):
        fresh, reuse = runs[recipe_id, "fresh_reround"], runs[recipe_id, "reuse_rounded"]
        exact = runs[recipe_id, "exact"]
        assert _rel(fresh["dq"], reuse["dq"]) > 1e-3
        assert _rel(fresh["dq"], exact["dq"]) > 1e-3


def test_attention_fresh_reround_is_unbiased_over_steps():
    """Fresh re-roundings are independent across steps and unbiased: the mean D-term change over
    many steps tends to that of reading the original O (whose own error, against the exact
    gradient, is P's rounding: DESIGN.md section 1), not to the rounded O8's."""
    inputs = _attention_inputs(seed=1)
    q0, k0, v0, d_out = inputs
    repeats = 300

    def dq_samples(policy, n):
        numerics = Numerics(make_spec("fp8", CurrentScaling(), policy=policy, attention=dict(bwd_precision="fp32")))
        q = q0.clone().requires_grad_()
        out, _ = attention(q, k0, v0, numerics, "attn")
        samples = []
        for _ in range(n):
            samples.append(torch.autograd.grad(out, q, d_out, retain_graph=True)[0].double())
            numerics.end_step()  # a new step: a new fresh stream (scales are current, unchanged)
        return torch.stack(samples)

    exact = dq_samples("exact", 1)[0]
    original = dq_samples("original", 1)[0]
    reuse = dq_samples("reuse_rounded", 1)[0]
    fresh = dq_samples("fresh_reround", repeats)
    assert not torch.equal(fresh[0], fresh[1])  # a different draw each step

    diff = fresh - exact  # (repeats, B, H, T, hd)
    mean = diff.mean(0)
    standard_error = diff.std(0) / math.sqrt(repeats)
    target = original - exact
    noisy = standard_error > 0
    z = (mean - target)[noisy] / standard_error[noisy]
    assert z.abs().max() < 5.5, float(z.abs().max())
    assert (z.square().mean() - 1).abs() < 0.25  # chi-square per element ~ 1
    torch.testing.assert_close(mean[~noisy], target[~noisy], rtol=0, atol=1e-6)
    # one scalar summary: a fixed random projection of the mean error
    weights = torch.randn(exact.shape, generator=_gen(9), dtype=torch.float64)
    projected = (diff * weights).flatten(1).sum(1)
    z_projected = (projected.mean() - (target * weights).sum()) / (projected.std() / math.sqrt(repeats))
    assert abs(float(z_projected)) < 5
    # while the rounded O8's D-term change is far outside that noise
    z_reuse = ((reuse - exact) * weights).sum() - (target * weights).sum()
    assert abs(float(z_reuse / (projected.std() / math.sqrt(repeats)))) > 5


@pytest.mark.parametrize("recipe_id", ["current", "delayed-warm"])
def test_attention_rowsum_diagnostic(attention_runs, recipe_id):
    inputs, runs = attention_runs
    exact = runs[recipe_id, "exact"]
    assert set(exact["obs"]) == {"attn_rowsum/mean/attn", "attn_rowsum/z/attn"}
    terms = _hand_terms(inputs, exact["record"])
    d_s = terms["P"] * (terms["dP"] - terms["D_exact"])
    typical_row = d_s.abs().sum(-1).mean()
    assert abs(exact["obs"]["attn_rowsum/mean/attn"]) < 1e-5 * float(typical_row)

    for policy, key in (("reuse_rounded", "output"), ("original", "out")):
        run = runs[recipe_id, policy]
        record = run["record"]
        terms = _hand_terms(inputs, record)
        o_read = _heads(record[key].dequantize(torch.float64) if key == "output" else record[key].double())
        d_read = (terms["dO"] * o_read).sum(-1, keepdim=True)
        # rowsum(dS) = rowsum(P) * (D_exact - D_read), and P's rows sum to 1
        want = float((-(d_read - terms["D_exact"])).mean())
        assert float((terms["P"].sum(-1) - 1).abs().max()) < 1e-6
        got = run["obs"]["attn_rowsum/mean/attn"]
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6 * float(typical_row)), (policy, got, want)
        assert abs(want) > 1e-4 * float(typical_row)  # ten times the bound the exact rule meets
        assert run["obs"]["attn_rowsum/z/attn"] != 0.0


def test_attention_observations_accumulate_and_clear():
    inputs = _attention_inputs()
    run = _run_attention("exact", CurrentScaling(), inputs, warmup=False)
    assert run["obs"]
    assert run["numerics"].pop_observations() == {}


# ---------------------------------------------------------------------------------------------
# linear


def _linear_inputs(seed: int = 0):
    g = _gen(seed)
    x = torch.randn(3, 5, 32, generator=g)
    w = torch.randn(24, 32, generator=g) * 0.1
    d_y = torch.randn(3, 5, 24, generator=g) * 1e-3
    return x, w, d_y


@pytest.mark.parametrize("warmup", [False, True], ids=["first-step", "warm"])
def test_linear_high_precision_backward_matches_reference(warmup):
    x0, w0, d_y = _linear_inputs()
    numerics = Numerics(make_spec("fp8", DelayedScaling(override_linear_precision=(False, True, True))))
    assert [numerics.linear_precision(g) for g in ("fprop", "dgrad", "wgrad")] == ["fp8", "fp32", "fp32"]
    if warmup:
        linear(x0, w0, numerics, "lin")
        numerics.end_step()
    with numerics.taping() as tape:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = linear(x, w, numerics, "lin")
        y.backward(d_y)
    ((name, record),) = tape
    assert name == "lin" and "lin.grad_output" not in numerics.sites  # nothing rounded in backward
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y_ref = linear_mod.replay(xr, wr, record)
    assert torch.equal(y_ref, y)
    dx, dw = torch.autograd.grad(y_ref, (xr, wr), d_y)
    assert _rel(x.grad, dx) < 1e-5 and _rel(w.grad, dw) < 1e-5
    # and the reference really reads the rounded operands
    x8, w8 = record["input"].dequantize(torch.float64), record["weight"].dequantize(torch.float64)
    assert _rel(x.grad, (d_y.double().reshape(-1, 24) @ w8).reshape(x.shape)) < 1e-6
    assert _rel(w.grad, d_y.double().reshape(-1, 24).mT @ x8) < 1e-6
    assert _rel(x8, x0.reshape(-1, 32)) > 1e-3  # (rounding was on)


def test_linear_fp8_backward_by_hand():
    x0, w0, d_y = _linear_inputs(1)
    numerics = Numerics(make_spec("fp8", CurrentScaling()))
    with numerics.taping() as tape:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        linear(x, w, numerics, "lin").backward(d_y)
    ((_, record),) = tape

    dy2 = d_y.reshape(-1, 24)
    scale = compute_scale(dy2.abs().amax(), E5M2)  # current scaling of the output gradient
    site = numerics.sites["lin.grad_output"]
    assert site.fmt is E5M2 and float(site.state.scale) == float(scale)
    dy8 = quantize(dy2, E5M2, scale).dequantize(torch.float64)
    x8 = record["input"].dequantize(torch.float64)
    w8 = record["weight"].dequantize(torch.float64)
    assert record["input"].fmt is E4M3 and record["weight"].fmt is E4M3

    def within_bf16(got, a, b):
        want = a @ b
        bound = 2.0**-8 * want.abs() + 2.0**-16 * (a.abs() @ b.abs())
        assert ((got.double() - want).abs() <= bound).all()

    within_bf16(x.grad.reshape(-1, 32), dy8, w8)
    within_bf16(w.grad, dy8.mT, x8)
    assert _rel(x.grad, (dy2.double() @ w8).reshape(x.shape)) > 1e-3  # dY was rounded to E5M2


def test_linear_multiplies_the_producers_copy():
    """With ``x_q`` the linear records and multiplies the copy it was handed."""
    x0, w0, _ = _linear_inputs(2)
    numerics = Numerics(make_spec("fp8", CurrentScaling()))
    with numerics.taping() as tape:
        xq = quantize(x0, E4M3, torch.tensor(3.0))
        linear(xq.dequantize(), w0, numerics, "lin", x_q=xq)
    ((_, record),) = tape
    assert torch.equal(record["input"].data.view(torch.uint8), xq.data.reshape(-1, 32).view(torch.uint8))
    assert "lin.input" not in numerics.sites
    assert "linear.input" not in numerics.saved_bytes


# ---------------------------------------------------------------------------------------------
# RMSNorm with a rounded output


def test_rms_norm_round_output_reads():
    g = _gen(4)
    x0 = torch.randn(2, 6, 16, generator=g) * 3
    gain0 = torch.rand(16, generator=g) + 0.5
    d_y = torch.randn(2, 6, 16, generator=g)
    numerics = Numerics(make_spec("fp8", CurrentScaling()))
    with numerics.taping() as tape:
        x, gain = x0.clone().requires_grad_(), gain0.clone().requires_grad_()
        y, yq = rms_norm(x, gain, numerics, "norm", round_output=True)
        y.backward(d_y)
    ((_, record),) = tape

    # the output is on the E4M3 grid: it is the dequantized copy, and rounding it again is a no-op
    assert yq.fmt is E4M3 and yq.data.dtype == torch.float8_e4m3fn
    assert torch.equal(y, yq.dequantize())
    assert torch.equal(quantize(y, E4M3, yq.scale).data.view(torch.uint8), yq.data.view(torch.uint8))
    assert torch.equal(record["output"].data.view(torch.uint8), yq.data.view(torch.uint8))

    x64 = x0.double()
    normalized = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    d_gain_original = (d_y.double() * normalized).sum((0, 1))
    d_gain_rounded = (d_y.double() * yq.dequantize(torch.float64) / gain0.double()).sum((0, 1))
    assert _rel(gain.grad, d_gain_original) < 1e-5
    assert _rel(gain.grad, d_gain_rounded) > 1e-3
    assert _rel(d_gain_rounded, d_gain_original) > 1e-3

    xr, gr = x0.clone().requires_grad_(), gain0.clone().requires_grad_()
    y_ref = norm_mod.replay(xr, gr, record)
    assert torch.equal(y_ref, y)
    dx, dg = torch.autograd.grad(y_ref, (xr, gr), d_y)
    assert _rel(x.grad, dx) < 1e-5 and _rel(gain.grad, dg) < 1e-5


# ---------------------------------------------------------------------------------------------
# xIELU


def _xielu_formula(x, a_p, a_n, beta=0.5, eps=-1e-6):
    negative = a_n * torch.expm1(torch.clamp(x, max=eps)) - a_n * x + beta * x
    return torch.where(x > 0, a_p * x * x + beta * x, negative)


def test_xielu_values_at_hand_picked_points():
    assert (BETA, EPS) == (0.5, -1e-6)
    a_p, a_n = 0.8, 0.9
    points = [-20.0, -3.0, -1.0, -0.25, -1e-3, -1e-6, -1e-7, 0.0, 1e-7, 0.3, 1.0, 4.0]
    x = torch.tensor(points, dtype=torch.float64)
    got = xielu(
        x,
        torch.tensor(a_p, dtype=torch.float64),
        torch.tensor(a_n, dtype=torch.float64),
        Numerics(make_spec("off")),
    )

    def f(v):
        if v > 0:
            return a_p * v * v + 0.5 * v
        return a_n * math.expm1(min(v, -1e-6)) - a_n * v + 0.5 * v

    want = torch.tensor([f(v) for v in points], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-300)
    # a few by hand: f(1) = .8 + .5; f(0) = a_n expm1(-1e-6) (the eps clamp); f(-1) = a_n (e^-1 - 1) + a_n - .5
    assert math.isclose(float(got[points.index(1.0)]), 1.3, rel_tol=1e-14)
    assert math.isclose(float(got[points.index(0.0)]), 0.9 * math.expm1(-1e-6), rel_tol=1e-12)
    assert math.isclose(float(got[points.index(-1.0)]), 0.9 * math.exp(-1) - 0.5, rel_tol=1e-12)


def test_xielu_op_forward_is_the_reference_formula_bit_for_bit():
    """The op evaluates each branch once and selects with ``where``; ``replay`` (the reference)
    adds the masked branches. Same bits, over every magnitude, zeros, infinities and NaN."""
    extremes = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, -1e-6, -1.0000001e-6, 1e-30, -100.0, 3.4e38]
    x = torch.cat([torch.tensor(extremes), torch.randn(50_000, generator=_gen(3)) * torch.logspace(-8, 2, 50_000)])
    for a_p, a_n in ((0.8, 0.8), (0.05, 2.5)):
        a_p, a_n = torch.tensor([a_p]), torch.tensor([a_n])
        got = xielu(x, a_p, a_n, Numerics(make_spec("bf16")))
        want = replay(x, a_p, a_n)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_xielu_gradient_matches_autograd_of_formula():
    # x == eps exactly is left out: the slope jumps there and either one-sided value is a valid choice
    points = [-20.0, -3.0, -1.0, -0.25, -1e-3, -2e-6, -1e-7, 0.0, 1e-7, 0.3, 1.0, 4.0]
    x = torch.tensor(points, dtype=torch.float64, requires_grad=True)
    a_p = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    a_n = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    d_y = torch.linspace(-1, 2, len(points), dtype=torch.float64)
    got = torch.autograd.grad(xielu(x, a_p, a_n, Numerics(make_spec("off"))), (x, a_p, a_n), d_y)
    want = torch.autograd.grad(_xielu_formula(x, a_p, a_n), (x, a_p, a_n), d_y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    # float32, random inputs
    x32 = torch.randn(64, generator=_gen(5), requires_grad=True)
    p32 = torch.tensor(0.8, requires_grad=True)
    n32 = torch.tensor(0.8, requires_grad=True)
    got = torch.autograd.grad(xielu(x32, p32, n32, Numerics(make_spec("off"))).sum(), (x32, p32, n32))
    want = torch.autograd.grad(_xielu_formula(x32, p32, n32).sum(), (x32, p32, n32))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------------------------------------
# reproducibility


def _stochastic(numerics: Numerics, site: str, x: torch.Tensor, stream: str = "forward") -> torch.Tensor:
    return numerics.site(site).quantize(x, "stochastic", stream=stream).data.view(torch.uint8)


def test_stochastic_rounding_streams_are_reproducible_and_independent():
    x = torch.randn(2048, generator=_gen(6))
    a = Numerics(make_spec("fp8", CurrentScaling(), rounding="stochastic"), seed=11)
    b = Numerics(make_spec("fp8", CurrentScaling(), rounding="stochastic"), seed=11)
    other_seed = Numerics(make_spec("fp8", CurrentScaling(), rounding="stochastic"), seed=12)
    first = _stochastic(a, "l0.attn.output", x)
    assert torch.equal(first, _stochastic(b, "l0.attn.output", x))  # same seed, site, step
    assert not torch.equal(first, _stochastic(other_seed, "l0.attn.output", x))
    assert not torch.equal(first, _stochastic(a, "l1.attn.output", x))  # another site
    fresh_a = _stochastic(a, "l0.attn.output", x, stream="fresh")
    assert not torch.equal(first, fresh_a)  # another stream
    fresh_b = _stochastic(b, "l0.attn.output", x, stream="fresh")
    assert torch.equal(fresh_a, fresh_b)

    c = Numerics(make_spec("fp8", CurrentScaling(), rounding="stochastic"), seed=11)
    c.end_step()
    next_step = _stochastic(c, "l0.attn.output", x)
    assert not torch.equal(first, next_step)  # another step
    stream = a.random_stream("l0.attn.output", "forward", x.device)
    a.end_step()
    b.end_step()
    assert a.random_stream("l0.attn.output", "forward", x.device) is stream  # re-seeded in place (compiled graphs)
    assert torch.equal(_stochastic(a, "l0.attn.output", x), next_step)
    assert torch.equal(_stochastic(b, "l0.attn.output", x), next_step)


def _block(numerics: Numerics, x, params) -> torch.Tensor:
    """norm (rounded output) -> qkv projection -> attention -> output projection."""
    gain, w_qkv, w_o = params
    y, yq = rms_norm(x, gain, numerics, "norm", round_output=True)
    qkv = linear(y, w_qkv, numerics, "qkv", x_q=yq)
    q, k, v = qkv.split([H * HD, G * HD, G * HD], dim=-1)
    q = q.reshape(B, T, H, HD).transpose(1, 2)
    k = k.reshape(B, T, G, HD).transpose(1, 2)
    v = v.reshape(B, T, G, HD).transpose(1, 2)
    o, oq = attention(q, k, v, numerics, "attn")
    return linear(o, w_o, numerics, "proj", x_q=oq)


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling()], ids=["delayed", "current"])
def test_saturation_counts_the_elements_clipped(recipe):
    """Counted exactly when some element overflows once scaled, and 0 (the pass skipped) when none does."""
    numerics = Numerics(make_spec("fp8", recipe))
    site = numerics.site("x")
    x = torch.linspace(-1.0, 1.0, 101)
    site.quantize(x, scale=torch.tensor(E4M3.max))  # the ends land exactly on max: not beyond
    assert numerics.saturation_counts() == {}
    site.quantize(x, scale=torch.tensor(E4M3.max / 0.5))  # |x| > 0.5 is beyond max
    site.quantize(x * 2, scale=torch.tensor(E4M3.max))
    expected = 2 * int((x.abs() > 0.5).sum())
    assert numerics.saturation_counts() == {"x": expected}
    assert numerics.saturation_counts() == {}


def test_numerics_state_dict_restores_scales_and_streams():
    g = _gen(7)
    d = 32
    params = (
        torch.rand(d, generator=g) + 0.5,
        torch.randn((H + 2 * G) * HD, d, generator=g) * 0.2,
        torch.randn(d, H * HD, generator=g) * 0.2,
    )
    xs = [torch.randn(B, T, d, generator=g) * (i + 1) for i in range(4)]
    recipe = DelayedScaling(amax_history_len=4)

    def make():
        return Numerics(make_spec("fp8", recipe, policy="fresh_reround", rounding="stochastic"), seed=3)

    original = make()
    with torch.no_grad():
        for x in xs[:3]:
            _block(original, x, params)
            original.end_step()
    state = original.state_dict()
    restored = make()
    restored.load_state_dict(state)
    assert restored.step == original.step == 3
    for name, site in original.sites.items():
        assert float(restored.sites[name].state.scale) == float(site.state.scale) != 1.0, name
    with torch.no_grad():
        want = _block(original, xs[3], params)
        got = _block(restored, xs[3], params)
        unrestored = _block(make(), xs[3], params)
    assert torch.equal(got, want)
    assert not torch.equal(unrestored, want)


# ---------------------------------------------------------------------------------------------
# memory accounting


@pytest.mark.parametrize("policy", list(POLICIES))
def test_saved_bytes_per_policy(policy):
    q, k, v, _ = _attention_inputs()
    numerics = Numerics(make_spec("fp8", CurrentScaling(), policy=policy, attention=dict(bwd_precision="fp32")))
    attention(q, k, v, numerics, "attn")
    saves_out = attention_mod.READS[policy]["D"] in ("original", "fresh")
    assert ("attention.out" in numerics.saved_bytes) == saves_out
    assert saves_out == (policy in ("fresh_reround", "original"))
    if saves_out:
        assert numerics.saved_bytes["attention.out"] == B * T * H * HD * 4  # FP32 O
    assert numerics.saved_bytes["attention.probs_scale"] == 4  # P8 is recomputed: its scale is kept


def test_saved_bytes_count_the_copies_attention_keeps():
    """Attention's backward holds FP8 copies of Q, K and V (one byte per element: K and V either
    per KV group or expanded to the query heads), never the high-precision K and V."""
    q, k, v, _ = _attention_inputs()
    numerics = Numerics(make_spec("fp8", CurrentScaling(), policy="exact", attention=dict(bwd_precision="fp32")))
    attention(q, k, v, numerics, "attn")
    assert numerics.saved_bytes["attention.q"] == B * H * T * HD
    fp8_copies = (B * G * T * HD, B * H * T * HD)
    assert numerics.saved_bytes["attention.k"] in fp8_copies, numerics.saved_bytes["attention.k"]
    assert numerics.saved_bytes["attention.v"] in fp8_copies, numerics.saved_bytes["attention.v"]
