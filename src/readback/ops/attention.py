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

Memory: no FP32 T x T matrix is saved. The backward recomputes P block by block of
``ROW_BLOCK`` query rows from the saved Q8 and K8 (the same GEMM and softmax, so the same bits)
and keeps dS only as the GEMM operand it becomes (FP8 under ``attention_bwd`` fp8, BF16 under
bf16), so its FP32 working set is a few ``ROW_BLOCK x T`` blocks for all heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from readback.numerics import BF16, QTensor, abs_max, decoded, matmul, pinned
from readback.numerics.spec import frozen_reads
from readback.ops import mechanism
from readback.ops.saved import load, save

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

ROW_BLOCK = 64  # query rows per block of the backward

# The sites an attention core named ``name`` rounds at (``{name}.q``, ...): its GEMMs' operands and O.
SITES = ("q", "k", "v", "probs", "output", "grad_output", "grad_scores")
GRADIENT_SITES = ("grad_output", "grad_scores")  # rounded in the recipe's backward format
# gradient -> which value it reads:
#   dV reads P (the PV GEMM's operand), dS reads P (the softmax's output), D reads O,
#   dP = dO V^T reads V, dQ = c dS K reads K, dK = c dS^T Q reads Q (the QK^T and PV operands).
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


def _expand_groups(q: QTensor, heads: int) -> QTensor:
    """K or V of G groups, repeated for the H query heads that share them."""
    batch, groups, seq, dim = q.data.shape
    return q.map(
        lambda d: d[:, :, None].expand(batch, groups, heads // groups, seq, dim).reshape(batch, heads, seq, dim)
    )


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
        kq, vq = _expand_groups(k_groups, heads), _expand_groups(v_groups, heads)
        gemm = "fp64" if numerics.precision == "off" else "fp8"

        scores = _scores(qq, kq, softmax_scale, gemm, numerics.bf16_gemm)
        probs = _softmax(scores, 0, dtype)
        if numerics.mechanism:
            mechanism.observe_logits(numerics, name, scores, probs)
        pq = numerics.site(f"{name}.probs").quantize(probs, rounding)
        out = matmul(pq, vq, gemm, bf16_gemm=numerics.bf16_gemm)  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(batch, seq, heads * dim)
        oq = numerics.site(f"{name}.output").quantize(out, rounding)
        if numerics.mechanism:
            mechanism.observe_output_rounding(numerics, name, out, oq)
        numerics.record(name, q=qq, k=kq, v=vq, scores=scores, probs=pq, out=out, output=oq)

        reads = numerics.spec.reads["attention"]
        fctx.numerics, fctx.name, fctx.scale, fctx.gemm = numerics, name, softmax_scale, gemm
        fctx.mechanism = numerics.mechanism
        saved = {
            "q_for_dk": {"rounded": qq}[reads["dK"]],
            "k_for_dq": {"rounded": k_groups}[reads["dQ"]],
            "v_for_dp": {"rounded": v_groups}[reads["dP"]],
            "p_for_dv": {"rounded": pq}[reads["dV"]],
            # dS reads the original P: recomputed in the backward from Q8 and K8 (saved for dK and dQ)
            "p_for_ds": {"original": None, "rounded": pq}[reads["dS"]],
            "out": out if reads["D"] in ("original", "fresh") else None,
        }
        # O8's data is also an output; a compiled graph cannot save an output as is, so it saves a copy.
        save(fctx, oq=oq.map(torch.clone) if torch.compiler.is_compiling() else oq, **saved)
        # output_fp8 is the O8 copy shared with the projection (which does not count it again).
        numerics.account(
            "attention",
            q=saved["q_for_dk"],
            k=saved["k_for_dq"],
            v=saved["v_for_dp"],
            probs_fp8=saved["p_for_dv"],
            output_fp8=oq,
            out=saved["out"],
        )
        scale = oq.scale.clone()  # not the site's own scale tensor: an output must not alias state
        fctx.mark_non_differentiable(oq.data, scale)
        return oq.dequantize(dtype), oq.data, scale

    @staticmethod
    def backward(fctx: Any, d_out: torch.Tensor, _data: Any, _scale: Any) -> tuple[torch.Tensor | None, ...]:
        numerics, name, saved = fctx.numerics, fctx.name, load(fctx)
        precision, dtype = numerics.attention_bwd, numerics.dtype
        batch, heads, seq, dim = saved["q_for_dk"].data.shape

        def as_heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, seq, heads, dim).transpose(1, 2)

        d_out = as_heads(d_out.to(dtype))
        if precision == "fp8":
            dq8 = numerics.site(f"{name}.grad_output", "bwd").quantize(d_out)
            d_out_operand, d_out = dq8, dq8.dequantize(dtype)
        else:
            d_out_operand = d_out

        kq, vq = _expand_groups(saved["k_for_dq"], heads), _expand_groups(saved["v_for_dp"], heads)

        def mm(a: torch.Tensor | QTensor, b: torch.Tensor | QTensor) -> torch.Tensor:
            return matmul(a, b, precision, bf16_gemm=numerics.bf16_gemm)

        d_v = mm(saved["p_for_dv"].mT, d_out_operand)
        # every row block reads these (O(T hd) each): decoded once, not once per block
        q_for_dk = decoded(saved["q_for_dk"])
        kq, vq = decoded(kq), decoded(vq)
        if isinstance(d_out_operand, QTensor):
            d_out_operand = decoded(d_out_operand)
        o_read = _o_read(numerics, name, saved)

        def d_scores(rows: slice, d_term: mechanism.DTermCosine | None = None) -> torch.Tensor:
            """dS = P (dP - D) of query rows ``rows``, all heads, in ``dtype``; ``d_term``
            accumulates the block's share of the mechanism's D-term cosine."""
            if saved["p_for_ds"] is None:
                probs = _softmax(
                    _scores(q_for_dk.map(lambda d: d[:, :, rows]), kq, fctx.scale, fctx.gemm, numerics.bf16_gemm),
                    rows.start,
                    dtype,
                )
            else:
                probs = _value(saved["p_for_ds"].map(lambda d: d[:, :, rows]), dtype)
            d_p = mm(_rows(d_out_operand, rows), vq.mT)
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
        operand = torch.empty(
            batch, heads, seq, seq, dtype=torch.uint8 if site else _DTYPES[precision], device=d_out.device
        )
        rowsums: list[torch.Tensor] = []
        d_s_scale: torch.Tensor | None = None
        d_term = mechanism.DTermCosine(_value(kq, dtype)) if fctx.mechanism else None
        for rows in blocks:
            d_s = d_scores(rows, d_term)
            rowsums.append(d_s.sum(-1))
            if site is None:
                operand[:, :, rows] = d_s
            else:
                d_s_q = site.quantize(d_s, amax=amax)
                operand[:, :, rows], d_s_scale = d_s_q.data.view(torch.uint8), d_s_q.scale
        numerics.observe(f"attn_rowsum/{name}", torch.cat(rowsums, -1))
        if d_term is not None:
            d_term.observe(numerics, name)
        # dQ's and dK's GEMMs both read dS: its codes (FP8, or BF16 values) decoded once
        d_s_operand: torch.Tensor | QTensor = operand
        if site is not None and d_s_scale is not None:
            d_s_operand = decoded(QTensor(operand.view(site.fmt.dtype), d_s_scale, site.fmt))
        elif precision == "bf16":
            d_s_operand = decoded(QTensor(operand, torch.ones((), device=operand.device), BF16), numerics.bf16_gemm)

        d_q = mm(d_s_operand, kq) * fctx.scale
        d_k = mm(d_s_operand.mT, q_for_dk) * fctx.scale
        groups = saved["k_for_dq"].data.shape[1]
        d_k = d_k.reshape(batch, groups, heads // groups, seq, dim).sum(2)
        d_v = d_v.reshape(batch, groups, heads // groups, seq, dim).sum(2)
        return d_q, d_k, d_v, None, None, None


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def _scores(q: QTensor, k: QTensor, softmax_scale: float, gemm: str, bf16_gemm: str) -> torch.Tensor:
    """``S = c Q8 K8^T`` of the given query rows."""
    return matmul(q, k.mT, gemm, bf16_gemm=bf16_gemm) * softmax_scale


def _softmax(scores: torch.Tensor, first_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal softmax of score rows ``first_row ...`` (query ``i`` sees keys ``<= i``)."""
    rows, seq = scores.shape[-2:]
    query = torch.arange(first_row, first_row + rows, device=scores.device)[:, None]
    causal = torch.arange(seq, device=scores.device)[None, :] > query
    return torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1).to(dtype)


def _rows(t: torch.Tensor | QTensor, rows: slice) -> torch.Tensor | QTensor:
    return t.map(lambda d: d[:, :, rows]) if isinstance(t, QTensor) else t[:, :, rows]


def _value(t: torch.Tensor | QTensor, dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize(dtype) if isinstance(t, QTensor) else t.to(dtype)


def _o_read(numerics: Numerics, name: str, saved: dict[str, Any]) -> torch.Tensor | None:
    """The O that the D-term reads under the policy, in (B, H, T, hd); None for ``rowsum(P*dP)``."""
    mode = numerics.read("attention", "D")
    batch, heads, seq, dim = saved["q_for_dk"].data.shape
    dtype, oq = numerics.dtype, saved["oq"]
    if mode == "none":
        return None
    o: torch.Tensor
    if mode == "rounded":
        o = oq.dequantize(dtype)
    elif mode == "original":
        o = saved["out"]
    else:  # fresh: same scale and format as the forward's O8, an independent random stream
        site = numerics.site(f"{name}.output")
        o = site.quantize(saved["out"], "stochastic", scale=oq.scale, stream="fresh").dequantize(dtype)
    return o.reshape(batch, seq, heads, dim).transpose(1, 2)


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
