"""What a biased D-term does inside attention, measured where it happens (log steps only).

Forward: the largest and the mean causal logit, the attention entropy, and how coarsely O8 holds
the attention output O (the quantities a prediction across model sizes rests on). Backward: the cosine
between dQ's D-term component and the mean attended key. Since ``dS = P * (dP - D)``, dQ's
D-term part is ``-c * D_i * kbar_i`` with ``kbar_i = sum_j P_ij K_j``, the direction a biased D
pushes every query along; its cosine with ``kbar`` over a whole layer (flattened) is near 0 when
D's errors have no sign, and goes to -1 or +1 when they do. Per row it would be just -sign(D_i).
And what rounding dO and dS to E5M2 loses (``GradientRounding``): dS's range grows as P's entries
shrink like 1/T.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from readback.numerics import QTensor
from readback.numerics.site import rounding_figures, underflow_counts

if TYPE_CHECKING:
    from readback.numerics.state import Numerics


_LOGIT, _ENTROPY = "attn_logit/{}", "attn_entropy/{}"


def observe_logits(
    numerics: Numerics, name: str, scores: torch.Tensor, probs: torch.Tensor, first_row: int = 0
) -> None:
    """Logit max and mean over the causally visible scores, and the entropy of each row, of the
    score rows ``first_row ...`` (a block of them, or all)."""
    rows, keys = scores.shape[-2:]
    query = torch.arange(first_row, first_row + rows, device=scores.device)[:, None]
    visible = (torch.arange(keys, device=scores.device)[None, :] <= query).expand_as(scores)
    logits = scores.detach()[visible]
    numerics.observe_max(_LOGIT.format(name), logits.max())
    numerics.observe(_LOGIT.format(name), logits)
    p = probs.detach()
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    numerics.observe(_ENTROPY.format(name), entropy)


def observe_logit_sums(
    numerics: Numerics, name: str, row_stats: tuple[torch.Tensor, torch.Tensor], sums: torch.Tensor
) -> None:
    """``observe_logits``' figures from a kernel's per-row results, which never hold S: the softmax
    statistics ``row_stats`` (each row's max and its sum of ``exp(S - max)``; B, H, T) and ``sums``
    (3, B, H, T) of S, S^2 and P S over each row's visible keys. The logits' moments add the rows'
    sums; since ``log P = S - LSE``, a row's entropy is ``LSE - sum_j P_j S_j``."""
    row_max, row_sum = row_stats
    seq = row_max.shape[-1]
    count = float(row_max.numel() // seq * seq * (seq + 1) // 2)  # the visible scores
    numerics.observe_max(_LOGIT.format(name), row_max.max())
    total, squares = sums[0].double().sum(), sums[1].double().sum()
    numerics.observe_moments(_LOGIT.format(name), torch.stack([total.new_tensor(count), total, squares]))
    numerics.observe(_ENTROPY.format(name), row_max + torch.log(row_sum) - sums[2])


def observe_output_rounding(numerics: Numerics, name: str, out: torch.Tensor, out_q: QTensor) -> None:
    """``attn_out_{rel_err,amax_to_rms,log2_rms_scaled,history_amax_to_rms}`` of this forward: how
    coarsely O8 holds O (``readback.numerics.site.RoundingFigures``, the bias meter's figures; the
    last only under delayed scaling); O's underflow is its site's ``fp8_underflow``."""
    if out_q.fmt is None:  # rounding off: O8 is O
        return
    figures = rounding_figures(out, out_q, numerics.site(f"{name}.output").history_amax)
    for stat, value in figures._asdict().items():
        if value is not None:
            numerics.observe(f"attn_out_{stat}/{name}", value)


ROWS = 64  # query rows per addition to the D-term cosine's sums


class DTermCosine:
    """The layer's D-term cosine, accumulated over the query-row blocks of the backward: the
    cosine of the whole flattened tensors is ``sum(d.k) / sqrt(sum(d.d) sum(k.k))``, and each
    of the three sums adds over blocks (of ``ROWS`` rows), so no T x T matrix is kept for it."""

    def __init__(self, keys: torch.Tensor | None = None):
        # (B, H, T, hd), the K the backward's dQ GEMM reads (None where ``kbar`` comes formed)
        self.keys = None if keys is None else keys.detach()
        self.sums: torch.Tensor | None = None  # FP64: sum(d.k), sum(d.d), sum(k.k)

    def add(self, probs: torch.Tensor, row_term: torch.Tensor) -> None:
        """One block: its probabilities (B, H, rows, keys) and D (B, H, rows, 1), added
        ``ROWS`` query rows at a time, so that the sums do not depend on the op's blocks."""
        assert self.keys is not None
        keys = self.keys[:, :, : probs.shape[-1]]
        for i in range(0, probs.shape[-2], ROWS):
            mean_key = probs[:, :, i : i + ROWS].detach() @ keys  # (B, H, rows, hd)
            self.add_mean_keys(mean_key, row_term[:, :, i : i + ROWS])

    def add_mean_keys(self, mean_key: torch.Tensor, row_term: torch.Tensor) -> None:
        """Rows whose ``kbar = P K`` (B, H, rows, hd) is formed already (by ``add``, or a kernel),
        and their D (B, H, rows, 1)."""
        mean_key = mean_key.double()
        d_term = -row_term.detach().double() * mean_key
        sums = torch.stack([(d_term * mean_key).sum(), d_term.square().sum(), mean_key.square().sum()])
        self.sums = sums if self.sums is None else self.sums + sums

    def observe(self, numerics: Numerics, name: str) -> None:
        if self.sums is None:
            return
        dot, d_norm2, k_norm2 = self.sums
        cosine = dot / (d_norm2 * k_norm2).sqrt().clamp_min(1e-30)
        numerics.observe(f"attn_dq_dterm_cos/{name}", cosine)


class GradientRounding:
    """What rounding a backward gradient (dO or dS, site ``name``) to its FP8 format loses, added
    over the blocks it is rounded in: ``attn_grad_flushed`` (the share of its nonzero elements
    rounded to zero), ``attn_grad_subnormal`` (to a subnormal: with the flushed, the site's
    ``fp8_underflow``) and ``attn_grad_amax_to_rms`` (max|x| / rms(x)), one value per layer and step."""

    def __init__(self, name: str):
        self.name = name
        self.counts: list[torch.Tensor] = []  # per block: nonzero, flushed, underflowed, sum of squares, amax
        self.size = 0  # elements added

    def add(self, x: torch.Tensor, q: QTensor) -> None:
        x = x.detach()
        underflowed, nonzero = underflow_counts(x, q)
        flushed = nonzero - torch.count_nonzero(q.data.view(torch.uint8) & 0x7F)  # a zero code: all but the sign 0
        squares, amax = x.double().square().sum(), x.abs().amax()
        self.add_counts(torch.stack([nonzero, flushed, underflowed]), squares, amax, x.numel())

    def add_counts(self, counts: torch.Tensor, squares: torch.Tensor, amax: torch.Tensor, size: int) -> None:
        """A block's figures counted already (by a kernel): ``counts`` its nonzero, flushed and
        underflowed elements, ``squares`` its sum of squares, ``amax`` its max|x|, of ``size`` elements."""
        self.counts.append(torch.cat([counts.double(), squares.double()[None], amax.double()[None]]))
        self.size += size

    def observe(self, numerics: Numerics) -> None:
        if not self.counts:
            return
        counts = torch.stack(self.counts)
        nonzero, flushed, underflowed, squares = counts[:, :4].sum(0)
        rms = (squares / self.size).sqrt()
        numerics.observe(f"attn_grad_flushed/{self.name}", flushed / nonzero.clamp_min(1))
        numerics.observe(f"attn_grad_subnormal/{self.name}", (underflowed - flushed) / nonzero.clamp_min(1))
        numerics.observe(f"attn_grad_amax_to_rms/{self.name}", counts[:, 4].amax() / rms.clamp_min(1e-300))
