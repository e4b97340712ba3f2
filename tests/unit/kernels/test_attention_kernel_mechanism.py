"""The Triton attention core's mechanism statistics (``readback.ops.mechanism``, on log steps)
against the ops core's on the same inputs, in Triton's interpreter: the same keys, and each
figure within the bound its test states; the kernel's O, dQ, dK, dV the same bits with the
statistics measured or not.

Where the bounds come from: on these inputs both cores form the same S (checked first: S's
FP32 sums could straddle a BF16 rounding point, which none does here), so the forward's figures
differ by FP32 summation order alone: the kernel adds each row's S, S^2, P S in FP32 in its own
order (at most ``T`` FP32 units, 2**-24, of the sum of magnitudes), the ops core adds every
logit in FP64 and forms the entropy as ``-sum P log P`` (``mechanism.observe_logits``)."""

import math

import pytest
import torch

from kernel_comparison import NAME, RECIPES, _inputs, _straddles
from readback.numerics.state import Numerics
from readback.ops.attention import attention
from specs import make_spec

pytest.importorskip("triton", reason="triton is not installed")

_FP32 = 2.0**-24
_FLIPS = 1e-3  # the share of dS8's codes that may step by one where dS straddled (kernel_comparison's)


def _figures(kernel: str, shape: tuple, policy: str, recipe: str, backward: dict, measure: bool) -> tuple:
    """One step of the op on ``kernel`` (mechanism measured or not): the popped figures, the
    taped S, and O, dQ, dK, dV."""
    x = _inputs(*shape, seed=sum(shape))
    spec = make_spec("fp8", RECIPES[recipe](), policy, rounding="nearest", attention=dict(kernel=kernel, **backward))
    numerics = Numerics(spec, seed=3)
    q, k, v = (t.clone().requires_grad_() for t in x[:3])
    with numerics.measuring(measure), numerics.taping() as tape:
        o, _ = attention(q, k, v, numerics, NAME)
        o.backward(x[3])
    outputs = (o.detach(), q.grad, k.grad, v.grad)
    return numerics.pop_observations(), tape[0][1]["scores"], outputs


CASES = [  # (batch, heads, groups, T, head dim), policy, recipe, the backward's settings
    ((1, 4, 2, 71, 64), "reuse_rounded", "delayed", {}),  # FP8 backward, GQA, the last block masked
    ((1, 2, 1, 16, 64), "no_saved_copy", "current", {}),  # D = rowsum(P dP), dS's scale from its amax
    ((1, 4, 2, 24, 64), "original", "delayed", dict(bwd_precision="bf16", bwd_reads="te")),  # BF16, rebuilt P
    ((1, 2, 1, 16, 64), "fresh_reround", "delayed", dict(bwd_precision="bf16")),  # BF16 of the forward's
]


@pytest.mark.parametrize(("shape", "policy", "recipe", "backward"), CASES, ids=[f"{c[1]}-{c[3]}" for c in CASES])
def test_kernel_mechanism_figures_are_the_ops_core_s(shape, policy, recipe, backward):
    ops, s_ops, _ = _figures("ops", shape, policy, recipe, backward, True)
    triton, s_triton, measured = _figures("triton", shape, policy, recipe, backward, True)
    _, _, plain = _figures("triton", shape, policy, recipe, backward, False)
    assert all(torch.equal(a, b) for a, b in zip(measured, plain))  # the kernel's arithmetic is untouched
    assert ops.keys() == triton.keys()
    assert torch.equal(s_ops, s_triton)  # the premise of the forward's bounds
    batch, heads, _, seq, _ = shape
    count, fp32_sum = batch * heads * seq * (seq + 1) / 2, seq * _FP32

    def figure(kind: str, site: str = NAME) -> tuple[float, float]:
        return ops[f"{kind}/{site}"], triton[f"{kind}/{site}"]

    # the largest logit: the kernel's row max is the same S's max
    assert figure("attn_logit/max")[0] == figure("attn_logit/max")[1]
    # the logits' mean: rows summed in FP32, at most T units of the sum of |S| <= count rms(S)
    mean, z = figure("attn_logit/mean")[0], figure("attn_logit/z")[0]
    rms = math.sqrt(count * (mean / z) ** 2 + mean**2)  # from the variance the z-score divides by
    assert abs(figure("attn_logit/mean")[1] - mean) <= fp32_sum * rms
    # the z-score: its mean's and its variance's (S^2 summed likewise, less the mean's square)
    # relative errors add
    z_error = fp32_sum * (rms / abs(mean) + (rms**2 + 2 * abs(mean) * rms) / (rms**2 - mean**2))
    assert abs(figure("attn_logit/z")[1] - z) <= z_error * abs(z)
    # each row's entropy: LSE - sum P S against -sum P log P, a few FP32 sums of T terms each of
    # magnitude at most |LSE| + max|S| (below 4 max|S| + log T here)
    largest = float(s_ops[torch.isfinite(s_ops)].abs().max())
    entropy = figure("attn_entropy/mean")
    assert abs(entropy[0] - entropy[1]) <= 4 * fp32_sum * (4 * largest + math.log(seq))
    # the D-term cosine moves by at most twice the largest relative error of a row's D or |kbar|^2
    # (Cauchy-Schwarz on its three sums). D: FP32 order, but where one of its dP's BF16 roundings
    # straddled (a share ``_straddles`` of them), by 2**-8 of that term. kbar: FP32 order; and
    # the kernel's reads K as its dQ GEMM does, which under the BF16 backward of the forward's
    # operands are K8's BF16 values, the ops core's K8's FP32 values (each within 2**-9)
    bf16_keys = backward.get("bwd_precision") == "bf16" and backward.get("bwd_reads", "forward") == "forward"
    d_error = fp32_sum + 2.0**-8 * _straddles(max(shape[3:]))
    cosine = figure("attn_dq_dterm_cos/mean")
    assert abs(cosine[0] - cosine[1]) <= 2 * (d_error + fp32_sum + (2.0**-8 if bf16_keys else 0.0))
    if backward.get("bwd_precision", "fp8") == "fp8":
        # dO8: the same rounding of the same dO in both, and the same figures' code: identical
        for kind in ("attn_grad_flushed/mean", "attn_grad_subnormal/mean", "attn_grad_amax_to_rms/mean"):
            assert figure(kind, f"{NAME}.grad_output")[0] == figure(kind, f"{NAME}.grad_output")[1], kind
        # dS8: a share of codes one step apart where dS straddled; amax/rms as dS's values, a BF16 unit
        for kind in ("attn_grad_flushed/mean", "attn_grad_subnormal/mean"):
            a, b = figure(kind, f"{NAME}.grad_scores")
            assert abs(a - b) <= _FLIPS, kind
        a, b = figure("attn_grad_amax_to_rms/mean", f"{NAME}.grad_scores")
        assert abs(a - b) <= 2.0**-8 * a
    else:  # a BF16 backward rounds neither dO nor dS to FP8
        assert not any(key.startswith("attn_grad_") for key in triton)
