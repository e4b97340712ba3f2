"""The read-rule audit: it must reproduce the study's findings op by op, and report, not fail."""

from __future__ import annotations

import sys

import pytest
import torch

from readback.audit import run_audit, te
from readback.audit.core import TOL, audit, match, read_of
from readback.cli.audit import main
from readback.policy import POLICIES


@pytest.fixture(scope="module")
def audited():
    rows, notes = run_audit(seed=0)
    return rows, notes


def find(rows, op, gradient, policy=None):
    hits = [r for r in rows if r.op == op and r.gradient == gradient and r.policy == policy]
    assert len(hits) == 1, (op, gradient, policy, hits)
    return hits[0]


@pytest.mark.parametrize("op", ["nn.LayerNorm", "RMSNorm (torch)"])
def test_torch_norm_with_rounded_output(audited, op):
    rows, _ = audited
    gain, wgrad = find(rows, op, "gain"), find(rows, f"{op} -> linear", "wgrad")
    assert (gain.reads, gain.expected, gain.ok) == ("original", "original", True)
    assert (wgrad.reads, wgrad.expected, wgrad.ok) == ("rounded", "rounded", True)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_readback_norm_gain_reads_original_next_wgrad_rounded(audited, policy):
    rows, _ = audited
    assert find(rows, "readback.rms_norm", "gain", policy).reads == "original"
    assert find(rows, "readback.rms_norm -> linear(x_q)", "wgrad", policy).reads == "rounded"


def test_softmax_p_has_two_readers(audited):
    rows, _ = audited
    assert find(rows, "softmax -> P8 @ V", "dV").reads == "rounded"
    assert find(rows, "softmax -> P8 @ V", "dS").reads == "original"


def test_sdpa_d_term_original_and_none_are_a_tie(audited):
    rows, _ = audited
    row = find(rows, "F.sdpa", "D")
    assert row.reads == "indistinguishable (original = none)"
    assert row.ok is None and row.verdict == row.reads
    assert row.separation > 100 * TOL  # the tie is between original and none only; rounded is far
    assert find(rows, "F.sdpa -> linear", "wgrad").reads == "rounded"


ALL_POLICIES = ("reuse_rounded", "fresh_reround", "no_saved_copy", "original", "exact")


@pytest.mark.parametrize(
    ("op", "audited_policies"),
    [
        ("readback.attention", ALL_POLICIES),
        ("readback.attention (stochastic fwd)", ("reuse_rounded", "fresh_reround")),  # audit/readback_ops.py AUDITS
    ],
)
def test_attention_d_term_per_policy(audited, op, audited_policies):
    rows, _ = audited
    wants = {
        "reuse_rounded": "rounded",
        "fresh_reround": "fresh",
        "no_saved_copy": "none",
        "original": "original",
        "exact": "none",
    }
    assert sorted(r.policy for r in rows if r.op == op and r.gradient == "D") == sorted(audited_policies)
    for policy in audited_policies:
        row = find(rows, op, "D", policy)
        assert row.reads == wants[policy], (policy, row)
        assert row.expected == "none"
        assert row.ok is (wants[policy] == "none")
        assert row.separation > 100 * TOL
        assert find(rows, op, "dS", policy).reads == "original"
        assert find(rows, op, "dV", policy).reads == "rounded"
        assert find(rows, f"{op} -> linear(x_q)", "wgrad", policy).reads == "rounded"


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "exact"])
def test_te_bwd_reads_rows(audited, policy):
    """TE's BF16 backward's reads, told apart from the forward's operands: P rebuilt for dV and
    dS, the original V, K, Q for dP, dQ, dK, D the policy's; the reference wants the forward's."""
    rows, _ = audited
    op = "readback.attention (bwd_reads=te)"
    d_read = {"reuse_rounded": "rounded", "fresh_reround": "fresh", "no_saved_copy": "none", "original": "original"}
    wants = {
        "dV": "rebuilt",
        "dS": "rebuilt",
        "D": d_read[policy],
        "dP": "original",
        "dQ": "original",
        "dK": "original",
    }
    for gradient, mode in wants.items():
        row = find(rows, op, gradient, policy)
        assert (row.reads, row.declared) == (mode, mode), row
        assert row.separation > 100 * TOL, row
    assert [find(rows, op, g, policy).expected for g in ("dV", "dP", "dQ", "dK")] == ["rounded"] * 4
    assert find(rows, op, "dS", policy).expected == "original"


def test_reuse_rounded_d_term_differs(audited):
    rows, _ = audited
    row = find(rows, "readback.attention", "D", "reuse_rounded")
    assert row.ok is False and row.reads == "rounded" and row.verdict == "DIFFERS"
    assert row.rel_err > 1e-3


def test_fresh_is_the_ops_own_draw_not_any_draw(audited):
    rows, _ = audited
    row = find(rows, "readback.attention", "D", "fresh_reround")
    assert row.distances["original,fresh"] < TOL
    assert row.distances["original,fresh(other seed)"] > 100 * TOL
    assert row.distances["original,rounded"] > 100 * TOL


def test_exact_policy_rows_all_ok(audited):
    rows, _ = audited
    exact = [r for r in rows if r.policy == "exact"]
    ops = {"readback.linear", "readback.linear (mxfp8)", "readback.linear (blockwise)", "readback.linear (nvfp4)"}
    ops |= {"readback.rms_norm"}
    assert {r.op for r in exact} >= ops | {"readback.attention", "readback.xielu"}
    assert all(r.ok is True for r in exact), [r for r in exact if r.ok is not True]
    assert all(r.rel_err < 1e-5 for r in exact)


@pytest.mark.parametrize(
    ("recipe", "wgrad_read", "dgrad"),
    [
        ("mxfp8", "requantized", "requantized"),
        ("blockwise", "requantized", "rounded"),
        ("nvfp4", "rotated", "rounded"),
        ("nvfp4, disable_2d_quantization", "rotated", "requantized"),
    ],
)
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "exact"])
def test_a_block_recipes_backward_reads_its_own_copies(audited, recipe, wgrad_read, dgrad, policy):
    """wgrad reads X quantised along the tokens, not the forward's copy (under NVFP4 after its
    Hadamard transform: told apart from the plain copy); dgrad reads W's own columnwise copy under
    MXFP8 and NVFP4 in 1x16 lines, the one square-block copy under Float8BlockScaling and NVFP4."""
    rows, _ = audited
    op = f"readback.linear ({recipe})"
    wgrad, dgrad_row = find(rows, op, "wgrad", policy), find(rows, op, "dgrad", policy)
    assert (wgrad.reads, wgrad.expected, wgrad.declared) == (wgrad_read, "rounded", wgrad_read)
    assert (dgrad_row.reads, dgrad_row.expected) == (dgrad, "rounded")


def test_reads_tables_agree_with_the_backward(audited):
    rows, notes = audited
    assert all(r.declared == r.reads for r in rows if r.declared is not None)
    assert not [n for n in notes if "READS declares" in n]


def test_te_rows_skipped_with_one_note_without_te(audited):
    rows, notes = audited
    if te.unavailable() is None:
        pytest.skip("Transformer Engine and CUDA are available here")
    assert not [r for r in rows if r.op.startswith("te.")]
    assert [n for n in notes if n.endswith("skipped TE rows")] == [te.unavailable()]


@pytest.mark.gpu
@pytest.mark.skipif(te.unavailable() is not None, reason=str(te.unavailable()))
def test_te_rows(audited):
    rows, _ = audited
    assert {r.op.split(" ")[0] for r in rows if r.op.startswith("te.")} == {
        "te.Linear",
        "te.LayerNormLinear",
        "te.DotProductAttention",
    }
    assert find(rows, "te.LayerNormLinear", "gain").reads == "original"
    assert find(rows, "te.LayerNormLinear", "wgrad").reads == "rounded"


def test_another_seed_same_findings():
    from readback.audit import AUDITS, Setup

    rows = AUDITS["readback.attention"](Setup(seed=3))
    assert find(rows, "readback.attention", "D", "reuse_rounded").reads == "rounded"
    assert find(rows, "readback.attention", "D", "fresh_reround").reads == "fresh"
    assert find(rows, "readback.attention", "D", "no_saved_copy").reads == "none"
    assert all(r.ok for r in rows if r.policy == "exact")


def test_match_reports_ties_and_misses():
    a = torch.tensor([1.0, 2.0, 3.0])
    candidates = {("rounded",): a * 1.1, ("original",): a, ("none",): a * (1 + TOL / 10)}
    matches = match(a, candidates)
    assert read_of(matches, 0) == "indistinguishable (original = none)"
    assert read_of(match(a * 5, candidates), 0) == "unmatched"
    (row,) = audit("toy", "g", a, a * 1.1, candidates)
    assert row.ok is False and row.expected == "rounded" and row.verdict == "DIFFERS"


@pytest.mark.parametrize("argv", [["--seed", "x"], ["--bogus"], ["--seed", "-1"], ["--json", "/no/such/dir/a.json"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error" in err


# --- The Transformer Engine path, on CPU, against a stand-in that behaves as TE is documented to:
# FP8 GEMM operands (current scaling), an E5M2 upstream gradient, LayerNorm gains from the saved
# input, and delayed-scaling FP8 attention whose D-term reads the O8 it returns. It checks the
# audit's plumbing (shapes, candidates, classification); the real TE runs only on CUDA.


def _fake_te():
    import contextlib
    import types

    import torch.nn as nn
    import torch.nn.functional as F

    from readback.numerics import E4M3, E5M2, compute_scale, pinned, quantize

    state = {"recipe": None}

    def rounded(x, fmt, recipe):
        x = x.detach().float()
        scale = compute_scale(x.abs().amax(), fmt) if type(recipe).__name__ == "Float8CurrentScaling" else 1.0
        return quantize(x, fmt, scale).dequantize()

    class GradE5M2(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, recipe):
            ctx.recipe = recipe
            return y.clone()

        @staticmethod
        def backward(ctx, dy):
            return rounded(dy, E5M2, ctx.recipe), None

    def fp8_linear(x, w):
        recipe = state["recipe"]
        y = F.linear(pinned(x, rounded(x, E4M3, recipe)), pinned(w, rounded(w, E4M3, recipe)))
        return GradE5M2.apply(y, recipe)

    class Linear(nn.Module):
        def __init__(self, d_in, d_out, bias=False, params_dtype=None, device=None):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(d_out, d_in, dtype=params_dtype, device=device))

        def forward(self, x):
            return fp8_linear(x, self.weight)

    class LayerNormLinear(Linear):
        def __init__(
            self, d_in, d_out, eps=1e-5, bias=False, normalization="LayerNorm", params_dtype=None, device=None
        ):
            super().__init__(d_in, d_out, params_dtype=params_dtype, device=device)
            self.eps = eps
            self.layer_norm_weight = nn.Parameter(torch.ones(d_in))
            self.layer_norm_bias = nn.Parameter(torch.zeros(d_in))

        def forward(self, x):
            return fp8_linear(
                F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps), self.weight
            )

    class ReuseO8(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale, o8):
            ctx.save_for_backward(q, k, v, o8)
            ctx.scale = scale
            return o8

        @staticmethod
        def backward(ctx, d_out):
            q, k, v = (t.double().transpose(1, 2) for t in ctx.saved_tensors[:3])
            o8 = ctx.saved_tensors[3].double()
            (b, h, t, hd), groups = q.shape, k.shape[1]
            k, v = k.repeat_interleave(h // groups, 1), v.repeat_interleave(h // groups, 1)
            p = torch.softmax((q @ k.mT * ctx.scale).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf")), -1)
            d_out, o8 = d_out.double().reshape(b, t, h, hd).transpose(1, 2), o8.reshape(b, t, h, hd).transpose(1, 2)
            d_p = d_out @ v.mT
            d_s = p * (d_p - (d_out * o8).sum(-1, keepdim=True))
            grouped = lambda z: z.reshape(b, groups, h // groups, t, hd).sum(2)  # noqa: E731
            grads = ctx.scale * d_s @ k, grouped(ctx.scale * d_s.mT @ q), grouped(p.mT @ d_out)
            return (*(g.transpose(1, 2).to(ctx.saved_tensors[0].dtype) for g in grads), None, None)

    class DotProductAttention(nn.Module):
        def __init__(
            self,
            heads,
            head_dim,
            num_gqa_groups=None,
            attention_dropout=0.0,
            qkv_format="bshd",
            attn_mask_type="causal",
            softmax_scale=None,
        ):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, q, k, v):
            o = F.scaled_dot_product_attention(
                *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True, scale=self.scale, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
            if getattr(state["recipe"], "fp8_dpa", False):
                return ReuseO8.apply(q, k, v, self.scale, rounded(o, E4M3, state["recipe"]).to(q.dtype))
            return o.to(q.dtype)

    @contextlib.contextmanager
    def fp8_autocast(enabled=True, fp8_recipe=None):
        state["recipe"] = fp8_recipe
        try:
            yield
        finally:
            state["recipe"] = None

    recipe = types.SimpleNamespace(
        Format=types.SimpleNamespace(HYBRID="HYBRID"),
        DelayedScaling=type(
            "DelayedScaling",
            (),
            {"__init__": lambda self, fp8_format=None, fp8_dpa=False: setattr(self, "fp8_dpa", fp8_dpa)},
        ),
        Float8CurrentScaling=type("Float8CurrentScaling", (), {"__init__": lambda self, fp8_format=None: None}),
    )
    pytorch = types.SimpleNamespace(
        Linear=Linear,
        LayerNormLinear=LayerNormLinear,
        DotProductAttention=DotProductAttention,
        fp8_autocast=fp8_autocast,
    )
    common = types.SimpleNamespace(recipe=recipe)
    return {
        "transformer_engine": types.SimpleNamespace(pytorch=pytorch, common=common),
        "transformer_engine.pytorch": pytorch,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }


def test_te_path_against_a_stand_in(monkeypatch):
    for name, module in _fake_te().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(te, "DEVICE", "cpu")
    from readback.audit.harness import Setup

    rows = [row for fn in te.AUDITS.values() for row in fn(Setup())]
    got = {(r.op, r.gradient): (r.reads, r.ok) for r in rows}
    assert got == {
        ("te.Linear", "dgrad"): ("rounded", True),
        ("te.Linear", "wgrad"): ("rounded", True),
        ("te.LayerNormLinear", "gain"): ("original", True),
        ("te.LayerNormLinear", "wgrad"): ("rounded", True),
        ("te.DotProductAttention (fp8_dpa)", "D"): ("rounded", False),
    }
    assert find(rows, "te.DotProductAttention (fp8_dpa)", "D").expected == "indistinguishable (original = none)"
