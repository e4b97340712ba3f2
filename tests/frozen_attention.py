"""The attention core as it was before it ran in query blocks (commit c264a60), frozen: the
reference that ``test_attention_tiles`` compares the tiled op's codes and gradients with, bit for
bit, under nearest rounding. It builds the whole T x T scores and saves P8 whole. Not used by
readback itself; its tables are the op's (``readback.ops.attention``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch

from readback.numerics import BF16, PRECISION_DTYPES, QTensor, abs_max, decoded, matmul
from readback.ops import mechanism
from readback.ops.attention import READ_OPERANDS
from readback.ops.saved import load, save

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

Operand = TypeVar("Operand", torch.Tensor, QTensor)  # a rounded copy, or an original


def expand_groups(t: Operand, heads: int) -> Operand:
    """K or V of G groups, repeated for the H query heads that share them."""
    batch, groups, seq, dim = t.shape if isinstance(t, torch.Tensor) else t.data.shape

    def expand(d: torch.Tensor) -> torch.Tensor:
        return d[:, :, None].expand(batch, groups, heads // groups, seq, dim).reshape(batch, heads, seq, dim)

    return t.map(expand) if isinstance(t, QTensor) else expand(t)


def scores(q: QTensor, k: QTensor, softmax_scale: float, gemm: str, bf16_gemm: str) -> torch.Tensor:
    """``S = c Q8 K8^T`` of the given query rows."""
    return matmul(q, k.mT, gemm, bf16_gemm=bf16_gemm) * softmax_scale


def causal(s: torch.Tensor, first_row: int) -> torch.Tensor:
    """Score rows ``first_row ...`` with the keys each query may not see (``> i``) set to -inf."""
    rows, seq = s.shape[-2:]
    query = torch.arange(first_row, first_row + rows, device=s.device)[:, None]
    return s.masked_fill(torch.arange(seq, device=s.device)[None, :] > query, float("-inf"))


def softmax(s: torch.Tensor, first_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal softmax of score rows ``first_row ...`` (query ``i`` sees keys ``<= i``)."""
    return torch.softmax(causal(s, first_row), dim=-1).to(dtype)


def log_sum_exp(s: torch.Tensor) -> torch.Tensor:
    """The softmax statistics a fused kernel keeps for its backward: ``LSE = log sum_j exp(S_ij)``
    per causal row (B, H, T), in the scores' precision."""
    return torch.logsumexp(causal(s, 0), dim=-1)


def rebuilt(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, first_row: int, precision: str
) -> torch.Tensor:
    """``P = exp(c Q K^T - LSE)`` of query rows ``first_row ...``: a backward's P recomputed from
    the Q, K it holds with the statistics ``lse`` of the forward's own scores. When the forward
    multiplied other values (Q8, K8), its rows do not sum to one. A BF16 backward keeps S in its
    FP32 accumulator (BF16 operands, FP32 sums, no rounding of S), as a fused kernel does."""
    s = matmul(q, k.mT, "fp32" if precision == "bf16" else precision) * softmax_scale
    return torch.exp(causal(s, first_row) - lse[..., None])


def rows_of(t: Operand, rows: slice) -> Operand:
    """Query rows ``rows`` of a (B, H, T, ...) operand."""
    return t.map(lambda d: d[:, :, rows]) if isinstance(t, QTensor) else t[:, :, rows]


def value(t: torch.Tensor | QTensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s real values in ``dtype``."""
    return t.dequantize(dtype) if isinstance(t, QTensor) else t.to(dtype)


def held(numerics: Numerics) -> torch.dtype:
    """The dtype the backward holds its non-FP8 reads in: BF16 under flavour ``te`` in a BF16
    backward (as TE holds them), else the run's (FP32; FP64 without rounding)."""
    bf16 = numerics.spec.attention.bwd_reads == "te" and numerics.bwd_gemm_precision == "bf16"
    return torch.bfloat16 if bf16 else numerics.dtype


def d_term_o(numerics: Numerics, name: str, saved: dict[str, Any], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The O that the D-term reads under the policy, in (B, H, T, hd), held as ``held`` says;
    None for ``rowsum(P*dP)``."""
    mode = numerics.read("attention", "D")
    batch, heads, seq, dim = shape
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
    return o.to(held(numerics)).to(dtype).reshape(batch, seq, heads, dim).transpose(1, 2)


ROW_BLOCK = 64  # query rows per block of the backward
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
        kq, vq = expand_groups(k_groups, heads), expand_groups(v_groups, heads)
        gemm = "fp64" if numerics.precision == "off" else "fp8"

        s = scores(qq, kq, softmax_scale, gemm, numerics.bf16_gemm)
        probs = softmax(s, 0, dtype)
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
        held_dtype = held(numerics)
        values: dict[str, torch.Tensor | QTensor] = {"q8": qq, "k8": k_groups, "v8": v_groups, "p8": pq, "out": out}
        values |= {n: t.detach().to(held_dtype) for n, t in (("q", q), ("k", k), ("v", v)) if n in need}
        if "lse" in need:
            values["lse"] = log_sum_exp(s)
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
        precision, dtype = numerics.bwd_gemm_precision, numerics.dtype
        reads = numerics.spec.reads["attention"]
        batch, heads, seq, dim = fctx.shape

        def as_heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, seq, heads, dim).transpose(1, 2)

        d_out = as_heads(d_out.to(held(numerics)).to(dtype))
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
                t = saved[n] if n[0] == "q" else expand_groups(saved[n], heads)
                operands[n] = decoded(t) if isinstance(t, QTensor) else t
            return operands[n]

        q_for_dk = operand(_operand_name(reads, "dK"))
        kq, vq = operand(_operand_name(reads, "dQ")), operand(_operand_name(reads, "dP"))
        if isinstance(d_out_operand, QTensor):
            d_out_operand = decoded(d_out_operand)
        o_read = d_term_o(numerics, name, saved, fctx.shape)

        def probs_of(mode: str, rows: slice) -> torch.Tensor:
            """P of query rows ``rows`` as read ``mode``, in ``dtype``."""
            if mode == "rounded":
                return value(rows_of(saved["p8"], rows), dtype)
            if mode == "original":  # the forward's own P: its GEMM and softmax again, the same bits
                s = scores(rows_of(operand("q8"), rows), operand("k8"), fctx.scale, fctx.gemm, numerics.bf16_gemm)
                return softmax(s, rows.start, dtype)
            lse, q_rows = saved["lse"][:, :, rows], rows_of(operand("q"), rows)
            return rebuilt(q_rows, operand("k"), lse, fctx.scale, rows.start, precision).to(dtype)

        def d_scores(
            rows: slice, d_term: mechanism.DTermCosine | None = None, p_dv: torch.Tensor | None = None
        ) -> torch.Tensor:
            """dS = P (dP - D) of query rows ``rows``, all heads, in ``dtype``; ``d_term``
            accumulates the block's share of the mechanism's D-term cosine; ``p_dv`` takes
            the rows of the P that dV reads, when dV reads a recomputed one."""
            probs = probs_of(reads["dS"], rows)
            if p_dv is not None:
                p_dv[:, :, rows] = probs if reads["dV"] == reads["dS"] else probs_of(reads["dV"], rows)
            d_p = mm(rows_of(d_out_operand, rows), vq.mT)
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
        d_term = mechanism.DTermCosine(value(kq, dtype)) if fctx.mechanism else None
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


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, numerics: Numerics, name: str, softmax_scale: float = 0.125
) -> tuple[torch.Tensor, QTensor | None]:
    """Causal attention of ``q`` (B, H, T, hd) over ``k``, ``v`` (B, G, T, hd), G dividing H.

    Returns ``(o, oq)``: ``o`` (B, T, H*hd) holds the rounded output O8's values, and ``oq`` is
    that copy, to pass to the output projection as ``x_q``.
    """
    o, data, scale = _Attention.apply(q, k, v, numerics, name, softmax_scale)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return o, QTensor(data, scale, numerics.site(f"{name}.output").fmt)
