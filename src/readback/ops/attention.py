"""Causal GQA attention core ``O = softmax(Q K^T c) V`` in FP8, with a policy-selected D-term.

Forward: Q, K, V rounded (E4M3), ``S = c Q8 K8^T``, ``P = softmax(S)``, P rounded to P8,
``O = P8 V8``, and O rounded to O8 (``rounding`` nearest or stochastic), which is returned for the
output projection to multiply and save.

Backward (``attention.bwd_precision`` fp8: dO and dS rounded to E5M2 before their GEMMs; bf16/fp32: not)::

    dV = P8^T dO     dP = dO V8^T     D = rowsum(dO * O_read)  or  rowsum(P * dP)
    dS = P * (dP - D)                 dQ = c dS K8             dK = c dS^T Q8

The exact gradient of the executed forward has ``D = rowsum(P * dP)``: every row of dS sums to 0.
``rowsum(dS)`` is therefore a direct measure of a D-term error; its mean and z-score over the
rows of a step are collected as ``numerics.observe("attn_rowsum/<name>", ...)``.

Which value each gradient reads is ``READS[policy]`` with the backward's flavour
(``attention.bwd_reads``) laid over it, ``BWD_READS``. Flavour ``te`` is Transformer Engine's BF16
backward under delayed scaling (``NVTE_FP8_DPA_BWD=0``): D from the dequantised O8, dQ, dK, dP
from the original K, Q, V, and dV, dS from ``P = exp(c Q K^T - LSE)`` rebuilt from the original
Q, K with the FP8 forward's log-sum-exp (of ``S = c Q8 K8^T``), so P's rows need not sum to one.
Under a BF16 backward it holds every value it reads in BF16, rounded to nearest even as a cast
does (the original Q, K, V, dO; O8 dequantised into BF16), as TE holds its BF16 tensors; it
rounds the emulation's FP32 activations once, where TE rounds each of its BF16 ops' outputs.

The reference (the probe's, ``replay``) is the gradient of the forward actually executed: the
FP8 forward with every rounding pinned; its D is "exact D", ``rowsum(P * dP)`` with the
forward's own P. Flavour ``te`` departs from it in several reads at once (D from O8; P rebuilt
from Q, K with the FP8 LSE; the original Q, K, V in the GEMMs): the bias meter's variants
``exact_read.attention.<gradient>`` switch each back alone.

Forward and backward run in blocks of query rows, each against the keys it may see
(``attention_forward``, ``attention_backward``: their passes and what each costs): no T x T
tensor is held, in FP32 or as codes. The backward recomputes P8 from the saved Q8, K8, P8's scale
and, under stochastic rounding, the start of its draws, which are keyed by position
(``numerics.rounding.KeyedDraws``): the very codes the forward multiplied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from readback.numerics import QTensor, attention_settings, pinned
from readback.numerics.spec import ATTENTION_SITES, frozen_reads
from readback.ops import attention_backward, attention_forward, attention_triton, mechanism
from readback.ops import attention_parts as parts
from readback.ops.saved import load, save
from readback.policy import D_READS

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

# The sites an attention core named ``name`` rounds at (``{name}.q``, ...): its GEMMs' operands and O.
SITES = ATTENTION_SITES  # declared with the spec, whose attention recipe scales them
GRADIENT_SITES = ("grad_output", "grad_scores")  # rounded in the recipe's backward format
# gradient -> the forward value it reads (dO is every gradient's other operand):
#   dV reads P (the PV GEMM's operand), dS reads P (the softmax's output), D reads O,
#   dP = dO V^T reads V, dQ = c dS K reads K, dK = c dS^T Q reads Q (the QK^T and PV operands).
READ_OPERANDS = {"D": "O", "dQ": "K", "dK": "Q", "dV": "P", "dP": "V", "dS": "P"}
QKV_READERS, P_READERS = ("dQ", "dK", "dP"), ("dV", "dS")  # attention.bwd_qkv's and bwd_probs's gradients
_CORRECT = parts.FORWARD_READS  # which copy of it each gradient but D reads under every policy
READS = frozen_reads({policy: {**_CORRECT, "D": d_read} for policy, d_read in D_READS.items()})
BWD_READS = parts.BWD_READS  # the backward's flavour (attention.bwd_reads), laid over the policy's row
assert tuple(BWD_READS) == attention_settings.BWD_READS
# Transformer Engine's attention core reading a policy's D: (its per-tensor recipe, its backward's
# precision, the policy) -> (what D reads, TE's switches that make it read so); backends/te/attention
# maps a run onto it. Where TE has no such switch readback's core runs (TE's reads of the other
# gradients: backends/te/facts.te_attention_reads).
TE_D_READS = {
    ("delayed", "fp8", "reuse_rounded"): ("O8 (the core's output_fp8)", {"NVTE_FP8_DPA_BWD": "1"}),
    ("delayed", "bf16", "reuse_rounded"): ("O8 dequantised to BF16", {"NVTE_FP8_DPA_BWD": "0"}),
    ("current", "fp8", "reuse_rounded"): (
        "O8 (quantised by the core's O quantizer)",
        {"NVTE_FP8_DPA_BWD": "1", "NVTE_DPA_FP8CS_O_in_F16": "0"},
    ),
    ("current", "fp8", "original"): ("original O (F16)", {"NVTE_FP8_DPA_BWD": "1", "NVTE_DPA_FP8CS_O_in_F16": "1"}),
    ("current", "bf16", "original"): ("original O (F16)", {"NVTE_FP8_DPA_BWD": "0"}),
}
# What each (gradient, read mode) needs saved: the forward's rounded Q8, K8, V8 (``q8``, ...),
# P8's scale and the start of its keyed draws (``p8_scale``, ``p8_draws``), the originals (``q``,
# ``k``, ``v``), the FP8 forward's LSE, its O before rounding (``out``); O8 is always saved. P is
# recomputed from what its read lists: P8 and the forward's P from Q8 and K8, a rebuilt P from Q, K.
_P8 = ("q8", "k8", "p8_scale", "p8_draws")
_NEEDS: dict[str, dict[str, tuple[str, ...]]] = {
    "dK": {"rounded": ("q8",), "original": ("q",)},
    "dQ": {"rounded": ("k8",), "original": ("k",)},
    "dP": {"rounded": ("v8",), "original": ("v",)},
    "dV": {"rounded": _P8, "original": ("q8", "k8"), "rebuilt": ("q", "k", "lse")},
    "dS": {"rounded": _P8, "original": ("q8", "k8"), "rebuilt": ("q", "k", "lse")},
    "D": {"rounded": (), "original": ("out",), "fresh": ("out",), "none": ()},
}
_SAVED = ("q8", "k8", "v8", "p8_scale", "p8_draws", "q", "k", "v", "lse", "out")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        fctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        numerics: Numerics,
        name: str,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, heads, seq, dim = q.shape
        rounding, dtype = numerics.rounding, numerics.dtype
        qq = numerics.site(f"{name}.q").quantize(q, rounding)
        k_groups = numerics.site(f"{name}.k").quantize(k, rounding)
        v_groups = numerics.site(f"{name}.v").quantize(v, rounding)
        gemm = "fp64" if numerics.precision == "off" else "fp8"

        reads = numerics.spec.reads["attention"]
        need = {n for gradient, mode in reads.items() for n in _NEEDS[gradient][mode]}
        row_stats: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
        fctx.triton = attention_triton.runs(numerics, name, q)
        if fctx.triton:
            blocks, row_stats = attention_triton.forward(numerics, name, qq, k_groups, v_groups, softmax_scale)
        else:
            blocks = attention_forward.forward(
                numerics, name, qq, k_groups, v_groups, softmax_scale, gemm, "lse" in need
            )
        out = blocks.out
        oq = numerics.site(f"{name}.output").quantize(out, rounding)
        if numerics.mechanism:
            mechanism.observe_output_rounding(numerics, name, out, oq)
        if numerics.tape is not None:  # K and V as each query head reads them
            kq, vq = parts.expand_groups(k_groups, heads), parts.expand_groups(v_groups, heads)
            numerics.record(name, q=qq, k=kq, v=vq, scores=blocks.scores, probs=blocks.probs, out=out, output=oq)

        fctx.numerics, fctx.name, fctx.scale, fctx.gemm = numerics, name, softmax_scale, gemm
        fctx.mechanism, fctx.shape, fctx.groups = numerics.mechanism, (batch, heads, seq, dim), k.shape[1]
        fctx.rounding = rounding
        held_dtype = parts.held(numerics)
        values: dict[str, Any] = {"q8": qq, "k8": k_groups, "v8": v_groups, "out": out, "lse": blocks.lse}
        values |= {"p8_scale": blocks.probs_scale.clone(), "p8_draws": blocks.draws}  # not the site's own scale
        values |= {n: t.detach().to(held_dtype) for n, t in (("q", q), ("k", k), ("v", v)) if n in need}
        saved = {n: values[n] if n in need else None for n in _SAVED}
        saved["row_max"], saved["row_sum"] = row_stats  # the kernel's backward recomputes P from them
        # O8's data is also an output; a compiled graph cannot save an output as is, so it saves a copy.
        save(fctx, oq=oq.map(torch.clone) if torch.compiler.is_compiling() else oq, **saved)
        # output_fp8 is the O8 copy shared with the projection (which does not count it again).
        numerics.account(
            "attention",
            q=saved["q8"],
            k=saved["k8"],
            v=saved["v8"],
            probs_scale=saved["p8_scale"],
            probs_draws=saved["p8_draws"],
            output_fp8=oq,
            out=saved["out"],
            q_original=saved["q"],
            k_original=saved["k"],
            v_original=saved["v"],
            lse=saved["lse"],
            row_max=saved["row_max"],
            row_sum=saved["row_sum"],
        )
        scale = oq.scale.clone()  # not the site's own scale tensor: an output must not alias state
        fctx.mark_non_differentiable(oq.data, scale)
        return oq.dequantize(dtype), oq.data, scale

    @staticmethod
    def backward(fctx: Any, d_out: torch.Tensor, _data: Any, _scale: Any) -> tuple[torch.Tensor | None, ...]:
        batch, heads, seq, dim = fctx.shape
        core = attention_triton if fctx.triton else attention_backward
        d_q, d_k, d_v = core.backward(fctx.numerics, fctx.name, load(fctx), fctx, d_out)
        groups = fctx.groups
        d_k = d_k.reshape(batch, groups, heads // groups, seq, dim).sum(2)
        d_v = d_v.reshape(batch, groups, heads // groups, seq, dim).sum(2)
        return d_q, d_k, d_v, None, None, None


def replay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    record: dict[str, Any],
    softmax_scale: float = 0.125,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The reference: plain autograd over the executed forward, every rounding pinned to the
    bits it produced (``record`` of one call, from ``numerics.tape``). Returns O8's values."""
    batch, heads, seq, dim = q.shape
    groups = k.shape[1]
    k = k.repeat_interleave(heads // groups, dim=1)
    v = v.repeat_interleave(heads // groups, dim=1)
    q, k, v = (pinned(t.to(dtype), record[n].dequantize(dtype)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    scores = pinned(q @ k.mT * softmax_scale, record["scores"].to(dtype))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = pinned(torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1), record["probs"].dequantize(dtype))
    out = (probs @ v).transpose(1, 2).reshape(batch, seq, heads * dim)
    out = pinned(out, record["out"].to(dtype))
    return pinned(out, record["output"].dequantize(dtype))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, numerics: Numerics, name: str, softmax_scale: float = 0.125
) -> tuple[torch.Tensor, QTensor | None]:
    """Causal attention of ``q`` (B, H, T, hd) over ``k``, ``v`` (B, G, T, hd), G dividing H.

    Returns ``(o, oq)``: ``o`` (B, T, H*hd) holds the rounded output O8's values, and ``oq`` is
    that copy, to pass to the output projection as ``x_q``.
    """
    numerics.watch(name, q=q, k=k, v=v)
    if numerics.replaying:
        return replay(q, k, v, numerics.next_record(name), softmax_scale, numerics.dtype), None
    o, data, scale = _Attention.apply(q, k, v, numerics, name, softmax_scale)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return o, QTensor(data, scale, numerics.site(f"{name}.output").fmt)
