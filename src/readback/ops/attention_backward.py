"""The attention core's backward, block by block of query rows (``ops.attention`` wires it and
says which value each gradient reads)::

    dV = P^T dO     dP = dO V^T     D = rowsum(dO * O_read)  or  rowsum(P * dP)
    dS = P * (dP - D)               dQ = c dS K              dK = c dS^T Q

Each block recomputes its P from what the forward saved: the forward's scores GEMM and softmax
of Q8 and K8 (the same bits), rounded to P8 with the forward's scale and keyed draws (the very
codes the PV GEMM multiplied), or rebuilt from the original Q, K and the forward's LSE (flavour
``te``). dO and dS are rounded to E5M2 before their GEMMs where the spec says so
(``NumericsSpec.attention_rounds``: under an FP8 backward unless a part is set apart); D reads
the dO the dV and dP GEMMs read, or the other one where ``grad_output_in_d`` is set apart (dO8
rounded for D alone, or dO). A BF16 backward holds an unrounded dS in BF16. An FP8 backward's
GEMM one of whose operands is no FP8 code (a part set apart: the original Q, K or V, a rebuilt
P, an unrounded dO or dS) multiplies the values in FP32, as no kernel multiplies FP8 codes by a
wider type. dQ's rows are one GEMM per block; dK and dV add every block's products in one FP32
accumulator each (``numerics.SplitK``), rounded once at the end.

Passes over the blocks, each block one scores GEMM, one softmax (or P rebuilt), P's rounding
where a gradient reads P8, and the dP GEMM:

* a dS scale computed from the whole dS (current scaling, ``Site.reads_amax_first``): first an
  amax-only pass, then the rounding pass: every block's P, dP and dS twice;
* delayed scaling, and the BF16 and FP32 backward: the rounding pass only.

The rounding pass adds dS's rounding and the dQ, dK and dV GEMMs. Memory: a block's FP32
scores, P, dP and dS (B x H x rows x its keys each) and the FP32 accumulators of dQ, dK, dV
(O(T)); no T x T tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from readback.numerics import BF16, QTensor, SplitK, abs_max, decoded, matmul
from readback.ops import attention_parts as parts
from readback.ops import mechanism

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

# the saved name of the Q, K or V that a gradient's GEMM reads, by its read mode
_OPERANDS = {"dK": "q", "dQ": "k", "dP": "v"}


def backward(
    numerics: Numerics, name: str, saved: dict[str, Any], ctx: Any, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (B, H, T, hd; K's and V's per query head) from dO (``grad``, B, T, H hd); ``ctx``
    carries the forward's shape, softmax scale, GEMM, rounding and mechanism switch."""
    precision, dtype, bf16_gemm = numerics.bwd_gemm_precision, numerics.dtype, numerics.bf16_gemm
    reads, spec = numerics.spec.reads["attention"], numerics.spec
    coded = {"dO": spec.attention_rounds("grad_output"), "dS": spec.attention_rounds("grad_scores")}
    coded |= {g: reads[g] == "rounded" for g in ("dQ", "dK", "dP", "dV")}

    def gemm_of(*operands: str) -> str:
        """The precision of a GEMM of ``operands`` (``coded``'s names): FP32 in an FP8 backward
        where one of them is no FP8 code."""
        return "fp32" if precision == "fp8" and not all(coded[x] for x in operands) else precision

    batch, heads, seq, dim = ctx.shape
    # held as held says (BF16 for flavour te's BF16 backward), in dtype block by block
    grad = grad.to(parts.held(numerics)).reshape(batch, seq, heads, dim).transpose(1, 2)
    losses = {g: mechanism.GradientRounding(f"{name}.{g}") for g in ("grad_output", "grad_scores") if ctx.mechanism}
    rounded_in_d = reads["D"] != "none" and spec.attention_rounds("grad_output_in_d")  # D reads dO8
    d_out8 = None  # dO8: one rounding, whichever reads it
    if coded["dO"] or rounded_in_d:
        d_out8 = numerics.site(f"{name}.grad_output", "bwd").quantize(grad.to(dtype))
        if losses:
            losses["grad_output"].add(grad, d_out8)
    d_out: torch.Tensor | QTensor = d_out8 if coded["dO"] and d_out8 is not None else grad
    d_out_in_d = d_out8 if rounded_in_d and d_out8 is not None else grad  # the dO that D reads
    o_read = parts.d_term_o(numerics, name, saved)  # None: D = rowsum(P * dP)

    def mm(*operands: str) -> Callable[[Any, Any], torch.Tensor]:
        return lambda a, b: matmul(a, b, gemm_of(*operands), bf16_gemm=bf16_gemm)

    operands: dict[str, Any] = {}  # every block reads K and V's first rows (O(T hd) each): decoded once

    def operand(n: str) -> Any:
        """Saved K or V (B, G, T, hd) ``n`` (``k8``, ``v``, ...), decoded once."""
        if n not in operands:
            operands[n] = decoded(saved[n]) if isinstance(saved[n], QTensor) else saved[n]
        return operands[n]

    # the Q, K, V each gradient's GEMM reads: Q's rows (B, H, T, hd) decoded block by block
    gemm_operand = {g: saved[x + ("8" if reads[g] == "rounded" else "")] for g, x in _OPERANDS.items()}
    gemm_operand |= {g: operand(x + ("8" if reads[g] == "rounded" else "")) for g, x in _OPERANDS.items() if g != "dK"}
    modes = {reads["dV"], reads["dS"]}
    probs_site = numerics.site(f"{name}.probs")

    def block(rows: slice, d_out_rows: Any, d_term: mechanism.DTermCosine | None = None) -> tuple[Any, torch.Tensor]:
        """The P that dV reads (a ``QTensor`` for P8) and dS = P (dP - D), in ``dtype``, of
        query rows ``rows`` (whose dO is ``d_out_rows``, decoded); ``d_term`` takes the
        block's share of the D-term cosine."""
        by_mode: dict[str, Any] = {}
        if modes & {"rounded", "original"}:  # the forward's own P: its GEMM and softmax again
            q_rows, keys = parts.rows_decoded(saved["q8"], rows), parts.prefix(operand("k8"), rows)
            s = parts.scores(q_rows, keys, ctx.scale, ctx.gemm, bf16_gemm)
            by_mode["original"] = parts.softmax(s, rows.start, dtype)
        if "rounded" in modes:
            probs, start, scale = by_mode["original"], saved["p8_draws"], saved["p8_scale"]
            # decoded once: dS reads P8's values, and dV's GEMM its transpose as they lie
            p8 = parts.round_probs(probs_site, probs, rows, seq, ctx.rounding, start, scale=scale)
            by_mode["rounded"] = decoded(p8)
        if "rebuilt" in modes:
            q_rows, keys = parts.rows_of(saved["q"], rows), parts.prefix(operand("k"), rows)
            lse = saved["lse"][:, :, rows]
            by_mode["rebuilt"] = parts.rebuilt(q_rows, keys, lse, ctx.scale, rows.start, precision).to(dtype)
        probs = parts.value(by_mode[reads["dS"]], dtype)
        d_p = parts.by_group(d_out_rows, parts.prefix(gemm_operand["dP"], rows).mT, mm("dO", "dP"))
        if o_read is None:
            row_term = (probs * d_p).sum(-1, keepdim=True)
        else:
            d_rows = d_out_rows if d_out_in_d is d_out else parts.rows_decoded(d_out_in_d, rows, dtype)
            row_term = (parts.value(d_rows, dtype) * parts.o_rows(numerics, o_read, rows, heads)).sum(-1, keepdim=True)
        if d_term is not None:
            d_term.add(probs, row_term)
        return by_mode[reads["dV"]], d_p.sub_(row_term).mul_(probs)  # P (dP - D), in dP's place

    blocks = parts.query_blocks(batch, heads, seq)
    site = numerics.site(f"{name}.grad_scores", "bwd") if coded["dS"] else None
    # a scale computed from the whole of dS (current scaling) needs its amax before any block
    amax = None
    if site and site.reads_amax_first:
        amax = torch.stack([abs_max(block(rows, parts.rows_decoded(d_out, rows, dtype))[1]) for rows in blocks]).amax()
    d_q: torch.Tensor | None = None
    device = saved["oq"].data.device
    d_k, d_v = (SplitK((batch, heads, seq, dim), gemm_of(*x), device) for x in (("dS", "dK"), ("dV", "dO")))
    rowsums: list[torch.Tensor] = []
    d_term = None
    if ctx.mechanism:
        d_term = mechanism.DTermCosine(parts.expand_groups(parts.value(gemm_operand["dQ"], dtype), heads))
    for rows in blocks:
        d_out_rows = parts.rows_decoded(d_out, rows, dtype)
        p_dv, d_s = block(rows, d_out_rows, d_term)
        rowsums.append(d_s.sum(-1))
        # dQ's and dK's GEMMs both read the block of dS: its codes (FP8, or BF16 values) decoded once
        d_s_operand: torch.Tensor | QTensor = d_s
        if site is not None:
            d_s_q = site.quantize(d_s, amax=amax)
            if losses:
                losses["grad_scores"].add(d_s, d_s_q)
            d_s_operand = decoded(d_s_q)
        elif precision == "bf16":
            ones = torch.ones((), device=d_s.device)
            d_s_operand = decoded(QTensor(d_s.to(torch.bfloat16), ones, BF16), bf16_gemm)
        d_q_rows = parts.by_group(d_s_operand, parts.prefix(gemm_operand["dQ"], rows), mm("dS", "dQ"))
        if d_q is None:
            d_q = torch.empty(batch, heads, seq, dim, dtype=d_q_rows.dtype, device=d_q_rows.device)
        d_q[:, :, rows] = d_q_rows * ctx.scale
        keys = slice(0, rows.stop)
        d_k.add(d_s_operand.mT, parts.rows_decoded(gemm_operand["dK"], rows), keys)
        d_v.add(p_dv.mT, d_out_rows, keys)
    numerics.observe(f"attn_rowsum/{name}", torch.cat(rowsums, -1))
    if d_term is not None:
        d_term.observe(numerics, name)
    for loss in losses.values():
        loss.observe(numerics)
    assert d_q is not None
    return d_q, d_k.result().mul_(ctx.scale), d_v.result()
