"""Transformer Engine ops: te.Linear, te.LayerNormLinear, te.DotProductAttention (CUDA only).

Nothing here imports Transformer Engine at module level; ``unavailable()`` says why the rows are
skipped (no TE, or no CUDA), and ``AUDITS`` only runs when it returns None.

TE's FP8 GEMMs read an E5M2-rounded upstream gradient, so the linear candidates are computed from
the same rounding of it, reproduced by hand: the recipe is ``Float8CurrentScaling`` where TE has it
(scale = fp8 max / amax of the tensor itself), else ``DelayedScaling`` on its first step (every
scale still 1). The reference takes that same rounded upstream gradient: the rule is about which
operand the backward reads, not about the gradient's own rounding.

Attention: TE's kernels expose neither P nor dS, so the D-term is observed through ``rowsum(dS)``,
which is zero exactly when D = rowsum(P * dP). One key feature is set to the same value ``a`` for
every key: the scores then shift by a per-row constant (the softmax does not change, and a
constant stays constant under FP8 rounding), and ``dQ[..., 0] = scale * a * rowsum(dS)``.
"""

from __future__ import annotations

import importlib.util

import torch

from readback.audit.core import Row, audit, distance_to
from readback.audit.harness import Setup, causal_softmax, expand_groups, grad_of, value
from readback.numerics import E4M3, E5M2, FP8Format, QTensor, compute_scale, quantize

DEVICE = "cuda"
TE_TOL = 2e-3  # FP8 GEMMs accumulate in FP32 but in kernel order; TE outputs FP32 here
TE_ROWSUM_TOL = 0.3  # rowsum(dS): fraction of the rounded-vs-none separation (FP8 backward noise)


def unavailable() -> str | None:
    """Why the TE rows cannot run here, as the one-line note of the output; None when they can."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine not importable: skipped TE rows"
    try:
        import transformer_engine.pytorch  # noqa: F401 - imported only to see whether its CUDA libraries load
    except Exception as error:  # TE raises OSError/RuntimeError when its CUDA libraries are missing
        return f"Transformer Engine not importable ({type(error).__name__}): skipped TE rows"
    if not torch.cuda.is_available():
        return "Transformer Engine importable but CUDA not available: skipped TE rows"
    return None


def _recipe(**kwargs):
    """(recipe, current): Float8CurrentScaling if this TE has it, else DelayedScaling."""
    from transformer_engine.common import recipe

    if hasattr(recipe, "Float8CurrentScaling") and not kwargs:
        return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID), True
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, **kwargs), False


def _round(x: torch.Tensor, fmt: FP8Format, current: bool) -> QTensor:
    """TE's rounding of ``x`` as reproduced here: current scale, or the first step's scale 1."""
    x = x.detach().float()
    scale = compute_scale(x.abs().amax(), fmt) if current else torch.ones((), device=x.device)
    return quantize(x, fmt, scale)


def _autocast(recipe):
    import transformer_engine.pytorch as te

    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def te_linear(setup: Setup) -> list[Row]:
    import transformer_engine.pytorch as te

    g, dev, d = setup.generator("te.Linear"), torch.device(DEVICE), setup.width
    module = te.Linear(d, d, bias=False, params_dtype=torch.float32, device=dev)
    x = Setup.randn(g, setup.batch * setup.seq, d).to(dev).requires_grad_()
    upstream = Setup.randn(g, setup.batch * setup.seq, d).to(dev)
    with torch.no_grad():
        module.weight.copy_(Setup.randn(g, d, d, std=d**-0.5).to(dev))
    recipe, current = _recipe()
    with _autocast(recipe):
        y = module(x)
    y.backward(upstream)

    dy = value(_round(upstream, E5M2, current))
    xs = {"rounded": value(_round(x, E4M3, current)), "original": value(x)}
    ws = {"rounded": value(_round(module.weight, E4M3, current)), "original": value(module.weight)}
    dgrad = {m: dy @ w for m, w in ws.items()}
    wgrad = {m: dy.mT @ v for m, v in xs.items()}
    # reference: autograd of the executed forward, i.e. the rounded operands (with the same dy)
    return [
        *audit("te.Linear", "dgrad", grad_of(x), dgrad["rounded"], dgrad, tol=TE_TOL),
        *audit("te.Linear", "wgrad", grad_of(module.weight), wgrad["rounded"], wgrad, tol=TE_TOL),
    ]


def te_layernorm_linear(setup: Setup) -> list[Row]:
    """LayerNorm fused with the linear that multiplies its FP8-rounded output."""
    import transformer_engine.pytorch as te

    g, dev, d, eps = setup.generator("te.LayerNormLinear"), torch.device(DEVICE), setup.width, 1e-5
    module = te.LayerNormLinear(
        d, d, eps=eps, bias=False, normalization="LayerNorm", params_dtype=torch.float32, device=dev
    )
    x = (Setup.randn(g, setup.batch * setup.seq, d, std=3.0) + 0.5).to(dev).requires_grad_()
    upstream = Setup.randn(g, setup.batch * setup.seq, d).to(dev)
    with torch.no_grad():
        module.weight.copy_(Setup.randn(g, d, d, std=d**-0.5).to(dev))
        module.layer_norm_weight.copy_((1 + Setup.randn(g, d, std=0.3)).to(dev))
        module.layer_norm_bias.copy_(Setup.randn(g, d, std=0.1).to(dev))
    recipe, current = _recipe()
    with _autocast(recipe):
        out = module(x)
    out.backward(upstream)

    gain, bias = value(module.layer_norm_weight), value(module.layer_norm_bias)
    xd = value(x)
    normalized = (xd - xd.mean(-1, keepdim=True)) * torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
    y = (normalized * gain + bias).float()
    dy = value(_round(upstream, E5M2, current))
    y8 = value(_round(y, E4M3, current))
    d_norm = dy @ value(_round(module.weight, E4M3, current))  # the dgrad, reading the rounded weight
    ys = {"rounded": y8, "original": value(y)}
    gains = {"rounded": (d_norm * (y8 - bias) / gain).sum(0), "original": (d_norm * normalized).sum(0)}
    wgrad = {m: dy.mT @ v for m, v in ys.items()}
    return [
        *audit("te.LayerNormLinear", "gain", module.layer_norm_weight.grad, gains["original"], gains, tol=TE_TOL),
        *audit("te.LayerNormLinear", "wgrad", module.weight.grad, wgrad["rounded"], wgrad, tol=TE_TOL),
    ]


def te_dot_product_attention(setup: Setup) -> list[Row]:
    """The D-term of te.DotProductAttention, FP8 (``fp8_dpa``) where this TE and GPU run it."""
    import transformer_engine.pytorch as te

    g, dev = setup.generator("te.DotProductAttention"), torch.device(DEVICE)
    b, h, grp, t, hd, c = setup.batch, setup.heads, setup.groups, 128, 64, setup.softmax_scale  # kernel-friendly
    module = te.DotProductAttention(
        h, hd, num_gqa_groups=grp, attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal", softmax_scale=c
    )
    q = Setup.randn(g, b, t, h, hd, std=2.0)
    k = Setup.randn(g, b, t, grp, hd, std=2.0)
    k[..., 0] = 1.0  # the constant key feature: dQ[..., 0] = c * rowsum(dS)
    v = Setup.randn(g, b, t, grp, hd)
    upstream = Setup.randn(g, b, t, h * hd)
    q, k, v = (z.to(dev, torch.bfloat16).requires_grad_() for z in (q, k, v))
    fp8 = True
    try:
        recipe, _ = _recipe(fp8_dpa=True)
        with _autocast(recipe):
            out = module(q, k, v)
    except Exception:  # no FP8 attention backend for this TE/GPU/shape: BF16 attention
        fp8 = False
        out = module(q, k, v)
    out.backward(upstream.to(dev, out.dtype))

    def as_heads(z: torch.Tensor) -> torch.Tensor:  # (B, T, n, hd) -> (B, n, T, hd)
        return value(z).transpose(1, 2)

    qh, kh, vh = as_heads(q), expand_groups(as_heads(k), h), expand_groups(as_heads(v), h)
    p = causal_softmax(qh @ kh.mT * c)
    d_out = value(upstream).to(dev).reshape(b, t, h, hd).transpose(1, 2)
    d_p = d_out @ vh.mT
    exact_term = (p * d_p).sum(-1)
    returned = value(out).reshape(b, t, h, hd).transpose(1, 2)
    if fp8:  # delayed-scaling FP8 attention returns the dequantised O8 it saves; its internal
        # O = P8 V8 cannot be rebuilt here, and P V makes "original" coincide with "none"
        o_read = {"rounded": returned, "original": p @ vh}
    else:  # BF16 attention returns its own O; O8 is the rounding the next FP8 GEMM would make
        o8 = value(_round(value(out), E4M3, current=True)).reshape(b, t, h, hd).transpose(1, 2)
        o_read = {"rounded": o8, "original": returned}
    candidates = {m: exact_term - (d_out * o).sum(-1) for m, o in o_read.items()}
    candidates["none"] = torch.zeros_like(exact_term)
    rowsum = value(grad_of(q))[..., 0].transpose(1, 2) / c  # (B, H, T)

    # reference: plain autograd of the same attention in float64 (no FP8): rowsum(dS) = 0
    qr, kr, vr = (value(z).requires_grad_() for z in (q, k, v))
    o_ref = causal_softmax(qr.transpose(1, 2) @ expand_groups(kr.transpose(1, 2), h).mT * c) @ expand_groups(
        vr.transpose(1, 2), h
    )
    o_ref.backward(d_out)
    ref_rowsum = grad_of(qr)[..., 0].transpose(1, 2) / c
    spread = candidates["rounded"].norm().item()  # how far reading O8 moves rowsum(dS) from 0
    label = "te.DotProductAttention" + (" (fp8_dpa)" if fp8 else " (bf16)")
    return audit(
        label,
        "D",
        rowsum,
        ref_rowsum,
        candidates,
        tol=TE_ROWSUM_TOL,
        scale=spread or 1.0,
        rel_err=distance_to(grad_of(q), grad_of(qr)),
    )


AUDITS = {
    "te.Linear": te_linear,
    "te.LayerNormLinear": te_layernorm_linear,
    "te.DotProductAttention": te_dot_product_attention,
}
