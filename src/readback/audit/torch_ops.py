"""Plain PyTorch ops with an explicit FP8 rounding inserted around them.

Each rounding is ``pinned(x, round(x))`` (straight-through), so autograd saves whatever it
naturally saves: the audit shows which value stock PyTorch backward formulas read. The op runs in
float32; its reference is the same graph in float64 (the executed forward, roundings pinned).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from readback.audit.core import Row, audit, cat
from readback.audit.harness import (
    F64,
    Setup,
    attention_grads,
    backprop,
    causal_softmax,
    expand_groups,
    gelu_slope,
    heads,
    round_fp8,
    value,
    xielu,
    xielu_slope,
)
from readback.numerics import pinned

F32 = torch.float32


def _pin(x: torch.Tensor, executed) -> torch.Tensor:
    return pinned(x, executed.dequantize(x.dtype))


def _both(forward, inputs: dict, upstream: torch.Tensor) -> tuple[dict, dict]:
    """The op's gradients (float32) and the reference's (float64) of the same pinned graph."""
    return backprop(forward, inputs, upstream, F32), backprop(forward, inputs, upstream, F64)


def torch_linear(setup: Setup) -> list[Row]:
    """nn.Linear on rounded input and weight: dgrad reads the weight, wgrad the input."""
    g = setup.generator("torch.linear")
    d = setup.width
    module = nn.Linear(d, d // 2, bias=False)
    x = Setup.randn(g, setup.batch, setup.seq, d)
    weight = Setup.randn(g, d // 2, d, std=d**-0.5)
    upstream = Setup.randn(g, setup.batch, setup.seq, d // 2)
    x8, w8 = round_fp8(x), round_fp8(weight)

    def forward(x, weight):
        return functional_call(module, {"weight": _pin(weight, w8)}, (_pin(x, x8),)), {}

    got, ref = _both(forward, {"x": x, "weight": weight}, upstream)
    dy = value(upstream).reshape(-1, d // 2)
    xs = {"rounded": value(x8), "original": value(x)}
    ws = {"rounded": value(w8), "original": value(weight)}
    return [
        *audit(
            "nn.Linear",
            "dgrad",
            got["x"],
            ref["x"],
            {m: (dy @ w).reshape(x.shape) for m, w in ws.items()},
            tol=setup.tol,
        ),
        *audit(
            "nn.Linear",
            "wgrad",
            got["weight"],
            ref["weight"],
            {m: dy.mT @ v.reshape(-1, d) for m, v in xs.items()},
            tol=setup.tol,
        ),
    ]


def _norm_then_linear(setup: Setup, op: str, norm, normalized, bias_std: float) -> list[Row]:
    """A norm whose output is rounded for the next linear: the gain gradient reads the normalised
    value, the next weight gradient reads the norm output; each rounded or original.

    ``norm(x, gain, bias)`` is the norm as autograd runs it; ``normalized(x)`` is the normalised
    value by hand (float64)."""
    g = setup.generator(op)
    d = setup.width
    x = Setup.randn(g, setup.batch, setup.seq, d, std=3.0) + 0.5
    gain = 1 + Setup.randn(g, d, std=0.3)
    bias = Setup.randn(g, d, std=bias_std)
    weight = Setup.randn(g, d // 2, d, std=d**-0.5)
    upstream = Setup.randn(g, setup.batch, setup.seq, d // 2)
    y8 = round_fp8(norm(x, gain, bias))
    w8 = round_fp8(weight)

    def forward(x, gain, bias, weight):
        y = norm(x, gain, bias)
        return F.linear(_pin(y, y8), _pin(weight, w8)), {"y": y}

    got, ref = _both(forward, {"x": x, "gain": gain, "bias": bias, "weight": weight}, upstream)
    dy, d_out = value(got["y"]).reshape(-1, d), value(upstream).reshape(-1, d // 2)
    ys = {"rounded": value(y8), "original": value(got["y.value"])}
    gains = {"rounded": (ys["rounded"] - value(bias)) / value(gain), "original": normalized(value(x))}
    return [
        *audit(
            op,
            "gain",
            got["gain"],
            ref["gain"],
            {m: (dy * n.reshape(-1, d)).sum(0) for m, n in gains.items()},
            tol=setup.tol,
        ),
        *audit(
            f"{op} -> linear",
            "wgrad",
            got["weight"],
            ref["weight"],
            {m: d_out.mT @ y.reshape(-1, d) for m, y in ys.items()},
            tol=setup.tol,
        ),
    ]


def torch_layer_norm(setup: Setup) -> list[Row]:
    module = nn.LayerNorm(setup.width, eps=1e-5)

    def norm(x, gain, bias):
        return functional_call(module, {"weight": gain, "bias": bias}, (x,))

    def normalized(x):
        return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)

    return _norm_then_linear(setup, "nn.LayerNorm", norm, normalized, bias_std=0.1)


def torch_rms_norm(setup: Setup) -> list[Row]:
    def normalized(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def norm(x, gain, bias):
        return normalized(x) * gain

    return _norm_then_linear(setup, "RMSNorm (torch)", norm, normalized, bias_std=0.0)


def torch_softmax(setup: Setup) -> list[Row]:
    """softmax whose output P is rounded before P @ V: dV reads P8, the softmax backward reads P."""
    g = setup.generator("torch.softmax")
    b, h, t, hd = setup.batch, setup.heads, setup.seq, setup.head_dim
    scores = Setup.randn(g, b, h, t, t, std=2.0)
    v = Setup.randn(g, b, h, t, hd)
    upstream = Setup.randn(g, b, h, t, hd)
    p8 = round_fp8(causal_softmax(scores))

    def forward(scores, v):
        return _pin(causal_softmax(scores), p8) @ v, {}

    got, ref = _both(forward, {"scores": scores, "v": v}, upstream)
    d_out = value(upstream)
    d_p = d_out @ value(v).mT
    ps = {"rounded": value(p8), "original": causal_softmax(value(scores))}
    return [
        *audit("softmax -> P8 @ V", "dV", got["v"], ref["v"], {m: p.mT @ d_out for m, p in ps.items()}, tol=setup.tol),
        *audit(
            "softmax -> P8 @ V",
            "dS",
            got["scores"],
            ref["scores"],
            {m: p * (d_p - (p * d_p).sum(-1, keepdim=True)) for m, p in ps.items()},
            tol=setup.tol,
        ),
    ]


def torch_sdpa(setup: Setup) -> list[Row]:
    """F.scaled_dot_product_attention on rounded q, k, v, its output O rounded before the output
    projection. The D-term reads SDPA's own (original) O, which equals rowsum(P * dP) because
    SDPA does not round P inside: original and none cannot be told apart."""
    g = setup.generator("torch.sdpa")
    b, h, grp, t, d, c = setup.batch, setup.heads, setup.groups, setup.seq, setup.width, setup.softmax_scale
    q, k, v, w_proj, upstream = setup.attention_inputs(g).values()
    q8, k8, v8, w8 = (round_fp8(x) for x in (q, k, v, w_proj))

    def core(q, k, v):
        o = F.scaled_dot_product_attention(
            _pin(q, q8), _pin(k, k8), _pin(v, v8), is_causal=True, scale=c, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(b, t, d)

    with torch.no_grad():
        o8 = round_fp8(core(q, k, v))

    def forward(q, k, v, w_proj):
        o = core(q, k, v)
        return F.linear(_pin(o, o8), _pin(w_proj, w8)), {"o": o}

    got, ref = _both(forward, {"q": q, "k": k, "v": v, "w_proj": w_proj}, upstream)
    qh, kh, vh = value(q8), expand_groups(value(k8), h), expand_groups(value(v8), h)
    p = causal_softmax(qh @ kh.mT * c)
    d_out = heads(value(got["o"]), b, t, h)
    os = {"rounded": value(o8), "original": value(got["o.value"])}
    d_terms = {m: cat(*attention_grads(p, d_out, qh, kh, vh, heads(o, b, t, h), c, grp)) for m, o in os.items()}
    d_terms["none"] = cat(*attention_grads(p, d_out, qh, kh, vh, None, c, grp))
    d_proj = value(upstream).reshape(-1, d)
    return [
        *audit("F.sdpa", "D", cat(got["q"], got["k"]), cat(ref["q"], ref["k"]), d_terms, tol=setup.tol),
        *audit(
            "F.sdpa -> linear",
            "wgrad",
            got["w_proj"],
            ref["w_proj"],
            {m: d_proj.mT @ o.reshape(-1, d) for m, o in os.items()},
            tol=setup.tol,
        ),
    ]


def _activation(setup: Setup, op: str, fn, slope, round_input: bool) -> list[Row]:
    """An activation's input gradient: the slope at the original input or at its FP8 rounding
    (a rounding of the input that the forward either used, ``round_input``, or not)."""
    g = setup.generator(op)
    x = Setup.randn(g, setup.batch, setup.seq, setup.width, std=2.0)
    upstream = Setup.randn(g, *x.shape)
    x8 = round_fp8(x)

    def forward(x):
        return fn(_pin(x, x8) if round_input else x), {}

    got, ref = _both(forward, {"x": x}, upstream)
    xs = {"rounded": value(x8), "original": value(x)}
    label = f"{op} (input rounded)" if round_input else op
    return audit(label, "dx", got["x"], ref["x"], {m: value(upstream) * slope(v) for m, v in xs.items()}, tol=setup.tol)


def torch_gelu(setup: Setup) -> list[Row]:
    return [
        *_activation(setup, "F.gelu", F.gelu, gelu_slope, round_input=False),
        *_activation(setup, "F.gelu", F.gelu, gelu_slope, round_input=True),
    ]


def torch_xielu(setup: Setup) -> list[Row]:
    return _activation(
        setup, "xIELU (torch)", lambda x: xielu(x, 0.8, 0.8), lambda x: xielu_slope(x, 0.8, 0.8), round_input=False
    )


AUDITS = {
    "nn.Linear": torch_linear,
    "nn.LayerNorm": torch_layer_norm,
    "RMSNorm (torch)": torch_rms_norm,
    "softmax": torch_softmax,
    "F.scaled_dot_product_attention": torch_sdpa,
    "F.gelu": torch_gelu,
    "xIELU (torch)": torch_xielu,
}
