"""The attention core's forward, block by block of query rows (``ops.attention`` wires it).

Each block is the queries ``rows`` against the keys they may see (``attention_parts``): its
scores ``S = c Q8 K8^T``, the causal softmax ``P``, P's rounding ``P8`` and ``O = P8 V8`` for
those rows. Nothing T x T is kept: P8 is recomputed by the backward from the saved Q8, K8, P8's
scale and (stochastic rounding) the start of its keyed draws.

Passes over the blocks, each block one scores GEMM (hd x the block's keys per row) and one
softmax; the rounding pass adds P's rounding and the PV GEMM:

* current scaling of P (``Site.reads_amax_first``): first an amax-only pass (P's scale is
  computed from the whole P's amax), then the rounding pass: the scores GEMM and softmax twice;
* delayed scaling (the scale is known before the step), BF16 and no rounding: the rounding
  pass only.

Memory: a block's FP32 scores and P, each B x H x rows x (its keys) elements (at most
``attention_parts.BLOCK_ELEMENTS`` for a long sequence); O, and LSE for the flavour ``te``, are
O(T). While a tape records (the probe's reference replays it), the whole S and P8 are recorded
too: the blocks above the diagonal as -inf and 0, never computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from readback.numerics import QTensor, abs_max, decoded, matmul
from readback.ops import attention_parts as parts
from readback.ops import mechanism

if TYPE_CHECKING:
    from readback.numerics.state import Numerics


@dataclass(frozen=True)
class Forward:
    """What the blocks computed: O before rounding (B, T, H hd); P8's scale and keyed draws'
    start (None unless stochastic), which the backward rounds P again with; LSE (B, H, T) when
    asked for; the whole S and P8 while a tape records (else None)."""

    out: torch.Tensor
    probs_scale: torch.Tensor
    draws: torch.Tensor | None
    lse: torch.Tensor | None
    scores: torch.Tensor | None
    probs: QTensor | None


def forward(
    numerics: Numerics, name: str, qq: QTensor, kq: QTensor, vq: QTensor, softmax_scale: float, gemm: str, lse: bool
) -> Forward:
    """O (B, T, H hd) of ``qq`` (B, H, T, hd) over the groups' ``kq``, ``vq`` (B, G, T, hd)."""
    batch, heads, seq, dim = qq.data.shape
    rounding, dtype, bf16_gemm = numerics.rounding, numerics.dtype, numerics.bf16_gemm
    site = numerics.site(f"{name}.probs")
    k_all, v_all = (decoded(t, bf16_gemm) for t in (kq, vq))  # every block reads their first rows
    blocks = parts.query_blocks(batch, heads, seq)

    def scores_and_probs(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        s = parts.scores(parts.rows_decoded(qq, rows), parts.prefix(k_all, rows), softmax_scale, gemm, bf16_gemm)
        return s, parts.softmax(s, rows.start, dtype)

    amax = None
    if site.reads_amax_first:
        amax = torch.stack([abs_max(scores_and_probs(rows)[1]) for rows in blocks]).amax()
    start = site.claim(batch * heads * seq, qq.data.device) if rounding == "stochastic" else None
    taping = numerics.tape is not None
    out: torch.Tensor | None = None
    lse_rows: list[torch.Tensor] = []
    whole_s: torch.Tensor | None = None
    whole_p: torch.Tensor | None = None
    pq: QTensor | None = None
    for rows in blocks:
        s, probs = scores_and_probs(rows)
        if numerics.mechanism:
            mechanism.observe_logits(numerics, name, s, probs, rows.start)
        pq = parts.round_probs(site, probs, rows, seq, rounding, start, amax=amax)
        o = parts.by_group(pq, parts.prefix(v_all, rows), lambda a, b: matmul(a, b, gemm, bf16_gemm=bf16_gemm))
        if out is None:
            out = torch.empty(batch, seq, heads, dim, dtype=o.dtype, device=o.device)
        out[:, rows] = o.transpose(1, 2)
        if lse:
            lse_rows.append(parts.log_sum_exp(s, rows.start))
        if taping:
            if whole_s is None or whole_p is None:
                whole_s = s.new_full((batch, heads, seq, seq), float("-inf"))
                whole_p = pq.data.new_zeros((batch, heads, seq, seq))
            whole_s[:, :, rows, : rows.stop] = s
            whole_p[:, :, rows, : rows.stop] = pq.data
    assert out is not None and pq is not None
    return Forward(
        out.view(batch, seq, heads * dim),
        pq.scale,
        start,
        torch.cat(lse_rows, -1) if lse else None,
        whole_s,
        None if whole_p is None else QTensor(whole_p, pq.scale, pq.fmt),
    )
