"""The attention core's pieces, shared by its forward and backward (``ops.attention``, whose
tables say which value each gradient reads): the query blocks both run in, the scores GEMM, the
causal softmax, its log-sum-exp, the P rebuilt from them, P's rounding, the O a D read takes,
and operands that are a ``QTensor`` (a rounded copy) or a plain tensor (an original).

A block is the queries ``rows`` against the keys ``0 .. rows.stop - 1`` (``prefix``): the
blocks above the causal diagonal are never computed. Its scores are the whole matrix's bits
(the GEMM of each element is the same), and so is its softmax: torch's softmax adds a row's
exponentials in vector lanes from the row's start, and the columns a block leaves out (beyond
the diagonal) add +0 to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from readback.numerics import QTensor, decoded, matmul
from readback.numerics.rounding import KeyedDraws
from readback.numerics.spec import frozen_reads

if TYPE_CHECKING:
    from readback.numerics.site import Site
    from readback.numerics.state import Numerics

# which copy of its operand each gradient but D reads under every policy (``ops.attention.READS``)
FORWARD_READS = {"dV": "rounded", "dS": "original", "dP": "rounded", "dQ": "rounded", "dK": "rounded"}
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
BLOCK_ELEMENTS = 1 << 21  # FP32 elements of a block's scores (B x H x rows x T): 8 MiB
MIN_ROWS = 64  # query rows of a block at least (GEMMs of fewer rows run slowly)


def query_blocks(batch: int, heads: int, seq: int) -> list[slice]:
    """The query rows of each block: as many as keep a block's scores within ``BLOCK_ELEMENTS``,
    in multiples of ``MIN_ROWS`` (one at least), so a short sequence is one block and a long
    one's blocks hold O(T) elements each."""
    rows = max(1, BLOCK_ELEMENTS // max(1, MIN_ROWS * batch * heads * seq)) * MIN_ROWS
    return [slice(i, min(i + rows, seq)) for i in range(0, seq, rows)]


Operand = TypeVar("Operand", torch.Tensor, QTensor)  # a rounded copy, or an original


def expand_groups(t: Operand, heads: int) -> Operand:
    """K or V of G groups, repeated for the H query heads that share them."""
    batch, groups, seq, dim = t.shape if isinstance(t, torch.Tensor) else t.data.shape

    def expand(d: torch.Tensor) -> torch.Tensor:
        return d[:, :, None].expand(batch, groups, heads // groups, seq, dim).reshape(batch, heads, seq, dim)

    return t.map(expand) if isinstance(t, QTensor) else expand(t)


def by_group(a: torch.Tensor | QTensor, b: Any, gemm: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
    """``gemm(a, b)`` of the query heads' ``a`` (B, H, rows, X) and their groups' ``b`` (B, G, X, Y),
    as (B, H, rows, Y): each group's heads stacked as the rows of one GEMM, so no K or V is
    repeated for its heads (the products and sums of each element are those of H GEMMs)."""
    batch, heads, rows, width = a.shape if isinstance(a, torch.Tensor) else a.data.shape
    groups = b.shape[1] if isinstance(b, torch.Tensor) else b.data.shape[1]

    def stack(d: torch.Tensor) -> torch.Tensor:
        return d.reshape(batch, groups, heads // groups * rows, width)

    out = gemm(a.map(stack) if isinstance(a, QTensor) else stack(a), b)
    return out.view(batch, heads, rows, out.shape[-1])


def scores(q: torch.Tensor | QTensor, k: QTensor, softmax_scale: float, gemm: str, bf16_gemm: str) -> torch.Tensor:
    """``S = c Q8 K8^T`` of the given query rows (B, H, rows, hd) and their groups' keys (B, G, keys, hd)."""
    return by_group(q, k.mT, lambda a, b: matmul(a, b, gemm, bf16_gemm=bf16_gemm)) * softmax_scale


def causal(s: torch.Tensor, first_row: int) -> torch.Tensor:
    """Score rows ``first_row ...`` of a block (keys ``0 .. first_row + rows - 1``), in place, with
    the keys each query may not see (``> i``) set to -inf: those of the block's own diagonal."""
    rows = s.shape[-2]
    diagonal = s[..., first_row : first_row + rows]
    columns = torch.arange(diagonal.shape[-1], device=s.device)[None, :]
    diagonal.masked_fill_(columns > torch.arange(rows, device=s.device)[:, None], float("-inf"))
    return s


def softmax(s: torch.Tensor, first_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal softmax of score rows ``first_row ...`` (query ``i`` sees keys ``<= i``)."""
    return torch.softmax(causal(s, first_row), dim=-1).to(dtype)


def log_sum_exp(s: torch.Tensor, first_row: int) -> torch.Tensor:
    """The softmax statistics a fused kernel keeps for its backward: ``LSE = log sum_j exp(S_ij)``
    per causal row of score rows ``first_row ...`` (B, H, rows), in the scores' precision."""
    return torch.logsumexp(causal(s, first_row), dim=-1)


def rebuilt(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, first_row: int, precision: str
) -> torch.Tensor:
    """``P = exp(c Q K^T - LSE)`` of query rows ``first_row ...``: a backward's P recomputed from
    the Q, K it holds with the statistics ``lse`` of the forward's own scores. When the forward
    multiplied other values (Q8, K8), its rows do not sum to one. A BF16 backward keeps S in its
    FP32 accumulator (BF16 operands, FP32 sums, no rounding of S), as a fused kernel does; an FP8
    backward's likewise (its Q, K are no FP8 codes)."""
    gemm = "fp64" if precision == "fp64" else "fp32"
    s = by_group(q, k.mT, lambda a, b: matmul(a, b, gemm)) * softmax_scale
    return torch.exp(causal(s, first_row) - lse[..., None])


def rows_of(t: Operand, rows: slice) -> Operand:
    """Query rows ``rows`` of a (B, H, T, ...) operand."""
    return t.map(lambda d: d[:, :, rows]) if isinstance(t, QTensor) else t[:, :, rows]


def rows_decoded(t: torch.Tensor | QTensor, rows: slice, dtype: torch.dtype | None = None) -> torch.Tensor | QTensor:
    """Query rows ``rows`` of a (B, H, T, ...) operand as a block's GEMMs read them: a rounded
    copy's codes decoded (``numerics.decoded``), an original in ``dtype`` (when given), for that
    block alone, so that no decoded or widened copy of the whole tensor is held."""
    if isinstance(t, torch.Tensor):
        return t[:, :, rows] if dtype is None else t[:, :, rows].to(dtype)
    return decoded(t.map(lambda d: d[:, :, rows].contiguous()))


def prefix(t: Operand, rows: slice) -> Operand:
    """The keys (or values) that query rows ``rows`` may see: ``0 .. rows.stop - 1``."""
    return rows_of(t, slice(0, rows.stop))


def round_probs(
    site: Site,
    probs: torch.Tensor,
    rows: slice,
    seq: int,
    rounding: str,
    start: torch.Tensor | None,
    amax: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> QTensor:
    """P8 of query rows ``rows`` of ``probs`` (B, H, rows, keys), of a sequence of ``seq``: the
    forward rounds it (``amax`` the whole P's, under a scale computed from it), the backward
    again with the forward's ``scale``, counting nothing. A stochastic rounding draws by
    position from ``start`` (the site's ``claim`` of B x H x T rows, row ``(b, h, i)`` at
    ``(b H + h) T + i``): the same draws in both, whatever the blocks."""
    draws = None
    if rounding == "stochastic" and start is not None:
        batch, heads = probs.shape[:2]
        query = torch.arange(rows.start, rows.stop, device=probs.device)
        heads_first = torch.arange(batch * heads, device=probs.device).view(batch, heads, 1) * seq
        draws = KeyedDraws(start, heads_first + query)
    return site.quantize(probs, rounding, scale=scale, amax=amax, draws=draws, count=scale is None)


def value(t: torch.Tensor | QTensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s real values in ``dtype``."""
    return t.dequantize(dtype) if isinstance(t, QTensor) else t.to(dtype)


def held(numerics: Numerics) -> torch.dtype:
    """The dtype the backward holds its non-FP8 reads in: BF16 in a BF16 backward that reads the
    originals (flavour ``te``, or ``bwd_qkv``, ``bwd_probs`` set apart), as TE holds them, else
    the run's (FP32; FP64 without rounding)."""
    a = numerics.spec.attention
    departs = a.bwd_reads == "te" or {a.bwd_qkv, a.bwd_probs} - {None, "forward"}
    return torch.bfloat16 if departs and numerics.bwd_gemm_precision == "bf16" else numerics.dtype


def d_term_o(numerics: Numerics, name: str, saved: dict[str, Any]) -> torch.Tensor | QTensor | None:
    """The O that the D-term reads under the policy (B, T, H hd): O8, O or a fresh rounding of
    O; None for ``rowsum(P*dP)``."""
    mode = numerics.read("attention", "D")
    if mode in ("none", "rounded", "original"):
        o: torch.Tensor | QTensor | None = {"none": None, "rounded": saved["oq"], "original": saved["out"]}[mode]
        return o
    # fresh: same scale and format as the forward's O8, an independent random stream
    site = numerics.site(f"{name}.output")
    return site.quantize(saved["out"], "stochastic", scale=saved["oq"].scale, stream="fresh")


def o_rows(numerics: Numerics, o: torch.Tensor | QTensor, rows: slice, heads: int) -> torch.Tensor:
    """Query rows ``rows`` of ``d_term_o``'s O as (B, H, rows, hd) values, held as ``held`` says."""

    def by_heads(d: torch.Tensor) -> torch.Tensor:
        return d.reshape(*d.shape[:-1], heads, -1).transpose(1, 2)

    block = rows_decoded(o.map(by_heads), rows) if isinstance(o, QTensor) else rows_decoded(by_heads(o), rows)
    values: torch.Tensor = value(block, numerics.dtype)
    return values.to(held(numerics)).to(numerics.dtype)
