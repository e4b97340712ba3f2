"""Causal GQA attention core ``O = softmax(Q K^T c) V`` in FP8, with a policy-selected D-term.

Forward: Q, K, V rounded (E4M3), ``S = c Q8 K8^T``, ``P = softmax(S)``, P rounded to P8,
``O = P8 V8``, and O rounded to O8 (``rounding`` nearest or stochastic), which is returned for the
output projection to multiply and save.

Backward (``attention_bwd`` fp8: dO and dS rounded to E5M2 before their GEMMs; bf16/fp32: not)::

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

Memory: no FP32 T x T matrix is saved. The backward recomputes P block by block of
``ROW_BLOCK`` query rows from the saved Q8 and K8 (the same GEMM and softmax, so the same bits)
and keeps dS only as the GEMM operand it becomes (FP8 under ``attention_bwd`` fp8, BF16 under
bf16), so its FP32 working set is a few ``ROW_BLOCK x T`` blocks for all heads; a dV that reads a
recomputed P keeps that P as its GEMM operand too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from readback.numerics import BF16, PRECISION_DTYPES, QTensor, abs_max, decoded, matmul, pinned
from readback.numerics.spec import ATTENTION_BWD_READS, ATTENTION_SITES, frozen_reads
from readback.ops import attention_parts as parts
from readback.ops import mechanism
from readback.ops.saved import load, save

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

ROW_BLOCK = 64  # query rows per block of the backward

# The sites an attention core named ``name`` rounds at (``{name}.q``, ...): its GEMMs' operands and O.
SITES = ATTENTION_SITES  # declared with the spec, whose attention_recipe scales them
GRADIENT_SITES = ("grad_output", "grad_scores")  # rounded in the recipe's backward format
# gradient -> the forward value it reads (dO is every gradient's other operand):
#   dV reads P (the PV GEMM's operand), dS reads P (the softmax's output), D reads O,
#   dP = dO V^T reads V, dQ = c dS K reads K, dK = c dS^T Q reads Q (the QK^T and PV operands).
READ_OPERANDS = {"D": "O", "dQ": "K", "dK": "Q", "dV": "P", "dP": "V", "dS": "P"}
# which copy of it each gradient but D reads under every policy
_CORRECT = {"dV": "rounded", "dS": "original", "dP": "rounded", "dQ": "rounded", "dK": "rounded"}
READS = frozen_reads(
    {
        "reuse_rounded": {**_CORRECT, "D": "rounded"},  # the O8 saved for the projection's wgrad
        "fresh_reround": {**_CORRECT, "D": "fresh"},  # a new stochastic rounding of the saved O
        "no_saved_copy": {**_CORRECT, "D": "none"},  # rowsum(P * dP): exact, reads no O
        "original": {**_CORRECT, "D": "original"},  # high-precision O (off by P's rounding)
        "exact": {**_CORRECT, "D": "none"},
    }
)
# The backward's flavour (attention.bwd_reads), laid over the policy's row (``ops.read_rules``;
# D stays the policy's, and ``exact`` takes no flavour): ``forward`` reads the operands the FP8
# forward multiplied; ``te`` what TE's BF16 backward (NVTE_FP8_DPA_BWD=0) reads: the original
# K, Q, V, and P "rebuilt" as exp(c Q K^T - LSE) from them with the FP8 forward's LSE.
BWD_READS = frozen_reads(
    {
        "forward": {},
        "te": {"dQ": "original", "dK": "original", "dP": "original", "dV": "rebuilt", "dS": "rebuilt"},
    }
)
assert tuple(BWD_READS) == ATTENTION_BWD_READS
# What each (gradient, read mode) needs saved: the forward's rounded Q8, K8, V8, P8 (``q8``, ...),
# the originals (``q``, ``k``, ``v``), the FP8 forward's LSE, its O before rounding (``out``);
# O8 is always saved. A P read ``original`` or ``rebuilt`` is recomputed from what it lists.
_NEEDS: dict[str, dict[str, tuple[str, ...]]] = {
    "dK": {"rounded": ("q8",), "original": ("q",)},
    "dQ": {"rounded": ("k8",), "original": ("k",)},
    "dP": {"rounded": ("v8",), "original": ("v",)},
    "dV": {"rounded": ("p8",), "original": ("q8", "k8"), "rebuilt": ("q", "k", "lse")},
    "dS": {"rounded": ("p8",), "original": ("q8", "k8"), "rebuilt": ("q", "k", "lse")},
    "D": {"rounded": (), "original": ("out",), "fresh": ("out",), "none": ()},
}
_SAVED = ("q8", "k8", "v8", "p8", "q", "k", "v", "lse", "out")


def _operand_name(reads: Any, gradient: str) -> str:
    """The saved name of the Q, K or V that ``gradient``'s GEMM reads (``q8`` or ``q``, ...)."""
    x = READ_OPERANDS[gradient].lower()
    return {"rounded": f"{x}8", "original": x}[reads[gradient]]


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
        kq, vq = parts.expand_groups(k_groups, heads), parts.expand_groups(v_groups, heads)
        gemm = "fp64" if numerics.precision == "off" else "fp8"

        s = parts.scores(qq, kq, softmax_scale, gemm, numerics.bf16_gemm)
        probs = parts.softmax(s, 0, dtype)
        if numerics.mechanism:
            mechanism.observe_logits(numerics, name, s, probs)
        pq = numerics.site(f"{name}.probs").quantize(probs, rounding)
        out = matmul(pq, vq, gemm, bf16_gemm=numerics.bf16_gemm)  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(batch, seq, heads * dim)
        oq = numerics.site(f"{name}.output").quantize(out, rounding)
        if numerics.mechanism:
            mechanism.observe_output_rounding(numerics, name, out, oq)
        numerics.record(name, q=qq, k=kq, v=vq, scores=s, probs=pq, out=out, output=oq)

        reads = numerics.spec.reads["attention"]
        fctx.numerics, fctx.name, fctx.scale, fctx.gemm = numerics, name, softmax_scale, gemm
        fctx.mechanism, fctx.shape, fctx.groups = numerics.mechanism, (batch, heads, seq, dim), k.shape[1]
        need = {n for gradient, mode in reads.items() for n in _NEEDS[gradient][mode]}
        held_dtype = parts.held(numerics)
        values: dict[str, torch.Tensor | QTensor] = {"q8": qq, "k8": k_groups, "v8": v_groups, "p8": pq, "out": out}
        values |= {n: t.detach().to(held_dtype) for n, t in (("q", q), ("k", k), ("v", v)) if n in need}
        if "lse" in need:
            values["lse"] = parts.log_sum_exp(s)
        saved = {n: values[n] if n in need else None for n in _SAVED}
        # O8's data is also an output; a compiled graph cannot save an output as is, so it saves a copy.
        save(fctx, oq=oq.map(torch.clone) if torch.compiler.is_compiling() else oq, **saved)
        # output_fp8 is the O8 copy shared with the projection (which does not count it again).
        numerics.account(
            "attention",
            q=saved["q8"],
            k=saved["k8"],
            v=saved["v8"],
            probs_fp8=saved["p8"],
            output_fp8=oq,
            out=saved["out"],
            q_original=saved["q"],
            k_original=saved["k"],
            v_original=saved["v"],
            lse=saved["lse"],
        )
        scale = oq.scale.clone()  # not the site's own scale tensor: an output must not alias state
        fctx.mark_non_differentiable(oq.data, scale)
        return oq.dequantize(dtype), oq.data, scale

    @staticmethod
    def backward(fctx: Any, d_out: torch.Tensor, _data: Any, _scale: Any) -> tuple[torch.Tensor | None, ...]:
        numerics, name, saved = fctx.numerics, fctx.name, load(fctx)
        precision, dtype = numerics.attention_bwd, numerics.dtype
        reads = numerics.spec.reads["attention"]
        batch, heads, seq, dim = fctx.shape

        def as_heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, seq, heads, dim).transpose(1, 2)

        d_out = as_heads(d_out.to(parts.held(numerics)).to(dtype))
        if precision == "fp8":
            dq8 = numerics.site(f"{name}.grad_output", "bwd").quantize(d_out)
            d_out_operand, d_out = dq8, dq8.dequantize(dtype)
        else:
            d_out_operand = d_out

        def mm(a: torch.Tensor | QTensor, b: torch.Tensor | QTensor) -> torch.Tensor:
            return matmul(a, b, precision, bf16_gemm=numerics.bf16_gemm)

        d_v = mm(saved["p8"].mT, d_out_operand) if reads["dV"] == "rounded" else None
        # every row block reads these (O(T hd) each): decoded once, not once per block
        operands: dict[str, Any] = {}

        def operand(n: str) -> Any:
            """Saved Q, K or V ``n`` (K, V expanded to the H heads), decoded once."""
            if n not in operands:
                t = saved[n] if n[0] == "q" else parts.expand_groups(saved[n], heads)
                operands[n] = decoded(t) if isinstance(t, QTensor) else t
            return operands[n]

        q_for_dk = operand(_operand_name(reads, "dK"))
        kq, vq = operand(_operand_name(reads, "dQ")), operand(_operand_name(reads, "dP"))
        if isinstance(d_out_operand, QTensor):
            d_out_operand = decoded(d_out_operand)
        o_read = parts.d_term_o(numerics, name, saved, fctx.shape)

        def probs_of(mode: str, rows: slice) -> torch.Tensor:
            """P of query rows ``rows`` as read ``mode``, in ``dtype``."""
            if mode == "rounded":
                return parts.value(parts.rows_of(saved["p8"], rows), dtype)
            if mode == "original":  # the forward's own P: its GEMM and softmax again, the same bits
                s = parts.scores(
                    parts.rows_of(operand("q8"), rows), operand("k8"), fctx.scale, fctx.gemm, numerics.bf16_gemm
                )
                return parts.softmax(s, rows.start, dtype)
            lse, q_rows = saved["lse"][:, :, rows], parts.rows_of(operand("q"), rows)
            return parts.rebuilt(q_rows, operand("k"), lse, fctx.scale, rows.start, precision).to(dtype)

        def d_scores(
            rows: slice, d_term: mechanism.DTermCosine | None = None, p_dv: torch.Tensor | None = None
        ) -> torch.Tensor:
            """dS = P (dP - D) of query rows ``rows``, all heads, in ``dtype``; ``d_term``
            accumulates the block's share of the mechanism's D-term cosine; ``p_dv`` takes
            the rows of the P that dV reads, when dV reads a recomputed one."""
            probs = probs_of(reads["dS"], rows)
            if p_dv is not None:
                p_dv[:, :, rows] = probs if reads["dV"] == reads["dS"] else probs_of(reads["dV"], rows)
            d_p = mm(parts.rows_of(d_out_operand, rows), vq.mT)
            read = d_out[:, :, rows] * o_read[:, :, rows] if o_read is not None else probs * d_p
            row_term = read.sum(-1, keepdim=True)
            if d_term is not None:
                d_term.add(probs, row_term)
            return probs * (d_p - row_term)

        blocks = [slice(i, min(i + ROW_BLOCK, seq)) for i in range(0, seq, ROW_BLOCK)]
        site = numerics.site(f"{name}.grad_scores", "bwd") if precision == "fp8" else None
        # a scale computed from the whole of dS (current scaling) needs its amax before any block
        amax = (
            torch.stack([abs_max(d_scores(rows)) for rows in blocks]).amax() if site and site.reads_amax_first else None
        )
        # FP8 codes are written as bytes (the compiler cannot blend FP8 tensors into a slice)
        operand_dtype = torch.uint8 if site else PRECISION_DTYPES[precision]
        d_s_codes = torch.empty(batch, heads, seq, seq, dtype=operand_dtype, device=d_out.device)
        p_dv = torch.zeros_like(d_s_codes, dtype=PRECISION_DTYPES[precision]) if d_v is None else None
        rowsums: list[torch.Tensor] = []
        d_s_scale: torch.Tensor | None = None
        d_term = mechanism.DTermCosine(parts.value(kq, dtype)) if fctx.mechanism else None
        for rows in blocks:
            d_s = d_scores(rows, d_term, p_dv)
            rowsums.append(d_s.sum(-1))
            if site is None:
                d_s_codes[:, :, rows] = d_s
            else:
                d_s_q = site.quantize(d_s, amax=amax)
                d_s_codes[:, :, rows], d_s_scale = d_s_q.data.view(torch.uint8), d_s_q.scale
        numerics.observe(f"attn_rowsum/{name}", torch.cat(rowsums, -1))
        if d_term is not None:
            d_term.observe(numerics, name)
        if p_dv is not None:
            d_v = mm(p_dv.mT, d_out_operand)
        # dQ's and dK's GEMMs both read dS: its codes (FP8, or BF16 values) decoded once
        d_s_operand: torch.Tensor | QTensor = d_s_codes
        if site is not None and d_s_scale is not None:
            d_s_operand = decoded(QTensor(d_s_codes.view(site.fmt.dtype), d_s_scale, site.fmt))
        elif precision == "bf16":
            ones = torch.ones((), device=d_s_codes.device)
            d_s_operand = decoded(QTensor(d_s_codes, ones, BF16), numerics.bf16_gemm)

        d_q = mm(d_s_operand, kq) * fctx.scale
        d_k = mm(d_s_operand.mT, q_for_dk) * fctx.scale
        groups = fctx.groups
        d_k = d_k.reshape(batch, groups, heads // groups, seq, dim).sum(2)
        assert d_v is not None
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
