"""The FP8 attention core's backward as Triton kernels: ``ops.attention_backward``'s arithmetic::

    dV = P^T dO    dP = dO V^T    dS = P (dP - D)    dQ = c dS K    dK = c dS^T Q

under the FP8 backward that reads what the forward multiplied (dO8, dS8, Q8, K8, V8, P8), and
the BF16 backward (``attention_tiles``: what a tile reads) with either flavour's reads
(``attention.bwd_reads``): ``forward``, Q8, K8, V8 and P8 as BF16 values, P recomputed from the
forward's row statistics; ``te``, the original Q, K, V and P rebuilt from them with the forward's
LSE (or one of each, ``bwd_qkv`` or ``bwd_probs`` set apart). Each tile recomputes S and P,
P8 with the forward's scale and keyed draws where dV reads it (its very codes), and dS, rounded
to the backward's format (E5M2 under the hybrid recipe) with dS's scale, or to BF16, or not (the
``round_grad_*`` settings: dO and dS rounded or not apart from the backward's precision). The
D-term comes in per row (``d_term``: the policy's ``rowsum(dO * O_read)``, formed by ``ops``)
or, for ``rowsum(P * dP)``, from a pass of its own. Three kernels:

* ``_rows``: per block of query rows, ``rowsum(P * dP)`` (D read ``none``) and, when dS's scale is
  computed from its whole amax (current scaling), that amax; run only when one is needed;
* ``_grad_q``: per block of query rows, dQ, dS8's counts and amax and ``rowsum(dS)``;
* ``_grad_kv``: per block of keys and query head, dK and dV over the query blocks that see them
  (each head's; ``ops`` adds a group's heads).

Every GEMM multiplies FP8 codes' or BF16 values in FP32 (exact products, FP32 sums) and rounds
its (scaled) output once to BF16, as the emulated GEMMs and ``SplitK`` do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from readback.kernels import fp8
from readback.kernels.attention_forward import BLOCK, round_probs
from readback.kernels.attention_tiles import Backward, BackwardFormat, grad_scores_operand, load_rows, round_grad, tile


@triton.jit
def _rows(
    sq_ptr, sk_ptr, v_ptr, do_ptr, max_ptr, sum_ptr, d_ptr, scales_ptr, amax_ptr, softmax_scale, T, H, GROUP_HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
    DO_CODES: tl.constexpr, DS_FP8: tl.constexpr, BF16: tl.constexpr, QKV_CODES: tl.constexpr,
    DP_FP32: tl.constexpr, DV_FP32: tl.constexpr, DQK_FP32: tl.constexpr, REBUILT: tl.constexpr, AMAX: tl.constexpr,
    D_FROM_P: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0), tl.program_id(1)
    kv_head = (bh // H) * (H // GROUP_HEADS) + (bh % H) // GROUP_HEADS
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    q = load_rows(sq_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, not REBUILT, 3, 7)
    do = load_rows(do_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, DO_CODES, MANTISSA, BIAS)
    if DP_FP32:  # dO8's values, as a GEMM of FP32 operands reads them
        do = do * tl.load(scales_ptr + 8)
    row_max, row_sum = (
        tl.load(max_ptr + bh * T + rows, mask=rows < T, other=0.0),
        tl.load(sum_ptr + bh * T + rows, mask=rows < T, other=1.0),
    )
    k_head, v_head = sk_ptr + kv_head * T * HEAD_DIM, v_ptr + kv_head * T * HEAD_DIM
    end = tl.minimum((block + 1) * BLOCK_M, T)
    d = tl.zeros([BLOCK_M], tl.float32)
    if D_FROM_P:
        for start in range(0, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            p, dp, _ = tile(q, do, d, row_max, row_sum, rows, keys, k_head, v_head, scales_ptr, softmax_scale, T,
                            HEAD_DIM, QKV_CODES, DP_FP32, REBUILT)  # fmt: skip
            d += tl.sum(p * dp, 1)
        tl.store(d_ptr + bh * T + rows, d, mask=rows < T)
    else:
        d = tl.load(d_ptr + bh * T + rows, mask=rows < T, other=0.0)
    if AMAX:
        amax = tl.full([], 0.0, tl.float32)
        for start in range(0, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            _, _, ds = tile(q, do, d, row_max, row_sum, rows, keys, k_head, v_head, scales_ptr, softmax_scale, T,
                            HEAD_DIM, QKV_CODES, DP_FP32, REBUILT)  # fmt: skip
            amax = tl.maximum(amax, tl.max(tl.max(tl.where(rows[:, None] < T, tl.abs(ds), 0.0), 1), 0))
        tl.atomic_max(amax_ptr, amax)


@triton.jit
def _grad_q(
    sq_ptr, sk_ptr, k_ptr, v_ptr, do_ptr, max_ptr, sum_ptr, d_ptr, scales_ptr, dq_ptr, rowsum_ptr, counts_ptr,
    amax_ptr, mean_key_ptr, sums_ptr, softmax_scale, T, H, GROUP_HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
    MAX: tl.constexpr, DO_CODES: tl.constexpr, DS_FP8: tl.constexpr, BF16: tl.constexpr, MECHANISM: tl.constexpr,
    QKV_CODES: tl.constexpr, DP_FP32: tl.constexpr, DV_FP32: tl.constexpr, DQK_FP32: tl.constexpr,
    REBUILT: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0), tl.program_id(1)
    kv_head = (bh // H) * (H // GROUP_HEADS) + (bh % H) // GROUP_HEADS
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows[:, None] < T
    q = load_rows(sq_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, not REBUILT, 3, 7)
    do = load_rows(do_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, DO_CODES, MANTISSA, BIAS)
    if DP_FP32:  # dO8's values, as a GEMM of FP32 operands reads them
        do = do * tl.load(scales_ptr + 8)
    row_max, row_sum = (
        tl.load(max_ptr + bh * T + rows, mask=rows < T, other=0.0),
        tl.load(sum_ptr + bh * T + rows, mask=rows < T, other=1.0),
    )
    d = tl.load(d_ptr + bh * T + rows, mask=rows < T, other=0.0)
    score_k = sk_ptr + kv_head * T * HEAD_DIM
    k_head, v_head = k_ptr + kv_head * T * HEAD_DIM, v_ptr + kv_head * T * HEAD_DIM
    ds_scale = tl.load(scales_ptr + 3)
    end = tl.minimum((block + 1) * BLOCK_M, T)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    rowsum = tl.zeros([BLOCK_M], tl.float32)
    amax = tl.full([], 0.0, tl.float32)
    n_saturated, n_underflowed, n_nonzero = tl.full([], 0, tl.int32), tl.full([], 0, tl.int32), tl.full([], 0, tl.int32)
    mean_key = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # MECHANISM: kbar = P K (K's codes or values)
    squares = tl.zeros([BLOCK_M], tl.float32)  # MECHANISM: dS's sum of squares and flushed elements per row
    flushed = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        p, _, ds = tile(q, do, d, row_max, row_sum, rows, keys, score_k, v_head, scales_ptr, softmax_scale, T,
                        HEAD_DIM, QKV_CODES, DP_FP32, REBUILT)  # fmt: skip
        ds = tl.where(in_rows, ds, 0.0)
        rowsum += tl.sum(ds, 1)
        k = load_rows(k_head, keys, T, HEAD_DIM, QKV_CODES, 3, 7)
        if DQK_FP32 and QKV_CODES:  # K8's values, as a GEMM of FP32 operands reads them
            k = k * tl.load(scales_ptr + 11)
        if MECHANISM:
            mean_key += tl.dot(p, k, input_precision="ieee")
            squares += tl.sum(ds * ds, 1)
        r = ds
        if DS_FP8:
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(ds), 1), 0))
            r, codes, saturated = round_grad(ds, ds_scale, MANTISSA, BIAS, MAX)
            nonzero = ds != 0.0
            n_saturated += fp8.count(saturated)
            n_underflowed += fp8.count(nonzero & ((codes & (0x7F ^ ((1 << MANTISSA) - 1))) == 0))
            n_nonzero += fp8.count(nonzero)
            if MECHANISM:  # a zero code, all but the sign 0
                flushed += tl.sum((nonzero & ((codes & 0x7F) == 0)).to(tl.float32), 1)
        acc += tl.dot(grad_scores_operand(r, scales_ptr, DS_FP8, DQK_FP32, BF16), k, input_precision="ieee")
    dq = acc * softmax_scale if DQK_FP32 else fp8.round_bf16(acc * tl.load(scales_ptr + 4)) * softmax_scale
    dims = tl.arange(0, HEAD_DIM)
    tl.store(dq_ptr + (bh * T + rows[:, None]) * HEAD_DIM + dims[None, :], dq, mask=in_rows)
    tl.store(rowsum_ptr + bh * T + rows, rowsum, mask=rows < T)
    if MECHANISM:
        tl.store(mean_key_ptr + (bh * T + rows[:, None]) * HEAD_DIM + dims[None, :], mean_key, mask=in_rows)
        tl.store(sums_ptr + bh * T + rows, squares, mask=rows < T)
        tl.store(sums_ptr + tl.num_programs(1) * T + bh * T + rows, flushed, mask=rows < T)
    if DS_FP8:
        tl.atomic_add(counts_ptr, n_saturated.to(tl.int64))
        tl.atomic_add(counts_ptr + 1, n_underflowed.to(tl.int64))
        tl.atomic_add(counts_ptr + 2, n_nonzero.to(tl.int64))
        tl.atomic_max(amax_ptr, amax)


@triton.jit
def _grad_kv(
    sq_ptr, sk_ptr, q_ptr, v_ptr, do_ptr, max_ptr, sum_ptr, d_ptr, scales_ptr, draws_ptr, dk_ptr, dv_ptr,
    softmax_scale, T, H, GROUP_HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
    MAX: tl.constexpr, DO_CODES: tl.constexpr, DS_FP8: tl.constexpr, BF16: tl.constexpr, QKV_CODES: tl.constexpr,
    DP_FP32: tl.constexpr, DV_FP32: tl.constexpr, DQK_FP32: tl.constexpr, REBUILT: tl.constexpr,
    SEPARATE: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0), tl.program_id(1)
    kv_head = (bh // H) * (H // GROUP_HEADS) + (bh % H) // GROUP_HEADS
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
    score_k, v_head = sk_ptr + kv_head * T * HEAD_DIM, v_ptr + kv_head * T * HEAD_DIM
    key = (tl.load(draws_ptr) & 0xFFFFFFFF).to(tl.uint32)
    first = tl.load(draws_ptr + 1) + bh * T
    p_scale, ds_scale = tl.load(scales_ptr + 1), tl.load(scales_ptr + 3)
    acc_k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    acc_v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(block * BLOCK_N, T, BLOCK_M):  # the query rows that see these keys
        rows = start + tl.arange(0, BLOCK_M)
        q = load_rows(sq_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, not REBUILT, 3, 7)
        # dK's Q: the scores' own, or another (the BF16 backward's Q8 values)
        q_gemm = load_rows(q_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, QKV_CODES, 3, 7) if SEPARATE else q
        if DQK_FP32 and QKV_CODES:  # Q8's values, as a GEMM of FP32 operands reads them
            q_gemm = q_gemm * tl.load(scales_ptr + 12)
        do = load_rows(do_ptr + bh * T * HEAD_DIM, rows, T, HEAD_DIM, DO_CODES, MANTISSA, BIAS)
        do_values = do * tl.load(scales_ptr + 8)  # dO8's values, where a GEMM of FP32 operands reads them
        row_max = tl.load(max_ptr + bh * T + rows, mask=rows < T, other=0.0)
        row_sum = tl.load(sum_ptr + bh * T + rows, mask=rows < T, other=1.0)
        d = tl.load(d_ptr + bh * T + rows, mask=rows < T, other=0.0)
        do_dp = do_values if DP_FP32 else do
        p, _, ds = tile(q, do_dp, d, row_max, row_sum, rows, keys, score_k, v_head, scales_ptr, softmax_scale, T,
                        HEAD_DIM, QKV_CODES, DP_FP32, REBUILT)  # fmt: skip
        in_rows = rows[:, None] < T
        p = tl.where(in_rows, p, 0.0)
        if REBUILT:  # dV reads the rebuilt P: in FP32 (an FP8 backward), or in BF16
            p_dv = p if DV_FP32 else fp8.round_bf16(p)
        else:  # P8: its grid values (FP8), or its values in BF16 or FP32 (decoded and scaled back)
            p_dv, _, _ = round_probs(p, rows, keys, key, first, T, p_scale, STOCHASTIC)
            if BF16:
                p_dv = fp8.round_bf16(p_dv * tl.load(scales_ptr + 7))
            elif DV_FP32:
                p_dv = p_dv * tl.load(scales_ptr + 7)
        ds = tl.where(in_rows, ds, 0.0)
        if DS_FP8:
            ds, _, _ = round_grad(ds, ds_scale, MANTISSA, BIAS, MAX)
        ds_gemm = grad_scores_operand(ds, scales_ptr, DS_FP8, DQK_FP32, BF16)
        acc_v += tl.dot(tl.trans(p_dv), do_values if DV_FP32 else do, input_precision="ieee")
        acc_k += tl.dot(tl.trans(ds_gemm), q_gemm, input_precision="ieee")
    dims = tl.arange(0, HEAD_DIM)
    at = (bh * T + keys[:, None]) * HEAD_DIM + dims[None, :]
    d_k = acc_k * softmax_scale if DQK_FP32 else fp8.round_bf16(acc_k * tl.load(scales_ptr + 5)) * softmax_scale
    tl.store(dk_ptr + at, d_k, mask=keys[:, None] < T)
    tl.store(dv_ptr + at, acc_v if DV_FP32 else fp8.round_bf16(acc_v * tl.load(scales_ptr + 6)), mask=keys[:, None] < T)


def _data(t: torch.Tensor) -> torch.Tensor:
    """A kernel's view of an operand: FP8 codes as bytes, BF16 or FP32 values as they are."""
    codes = t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return t.contiguous().view(torch.uint8) if codes else t.contiguous()


def backward(
    scores_operands: tuple[torch.Tensor, torch.Tensor],
    gemm_operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    row_stats: tuple[torch.Tensor, torch.Tensor],
    d_term: torch.Tensor | None,
    scales: torch.Tensor,
    ds_scale: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    softmax_scale: float,
    draws: torch.Tensor | None,
    fmt: BackwardFormat | None,
    precision: str,
    round_scores: bool,
    mechanism: bool = False,
) -> Backward:
    """The backward of query heads' Q (B, H, T, hd) over the groups' K, V (B, G, T, hd).

    ``scores_operands``: the Q, K that S is recomputed from: the forward's E4M3 codes Q8, K8 (P from
    ``row_stats``, row max and row sum), or the original Q, K (P rebuilt: ``row_stats`` the LSE and
    ones). ``gemm_operands``: the Q, K, V that dK, dQ, dP read (E4M3 codes, or values) and dO: dO8's
    codes in ``fmt``, or values (FP32 under the FP8 backward, an unrounded dO; BF16 under the BF16
    backward, dO8's or dO's). ``precision``: the backward's, ``fp8`` (a GEMM with an operand of
    values, the original Q, K, V, a rebuilt P, an unrounded dO or dS, runs in FP32, unrounded),
    ``fp32`` (every GEMM so, of the codes' values) or ``bf16`` (BF16 values). ``round_scores``: dS
    is rounded to ``fmt`` (else not, or to BF16 in a BF16 backward). ``d_term`` (B, H, T): D per
    row, or None for ``rowsum(P * dP)``. ``scales`` (FP32): ``[s_q^-1 s_k^-1, P's scale, s_dO^-1
    s_v^-1, s_k^-1, s_q^-1, s_p^-1 s_dO^-1, s_p^-1, s_dO^-1, s_v^-1, s_k^-1, s_q^-1]``, the GEMMs'
    inverse scales (ones for values), dQ's and dK's to be multiplied by dS8's, P8's inverse scale
    (P8's BF16 or FP32 values), dO8's (its FP32 values) and V8's, K8's, Q8's (their FP32 values, in
    an FP32 GEMM of an unrounded dO or dS); ``ds_scale``: dS's scale (the site's own, delayed
    scaling), or the function that computes it from the whole dS's amax (current scaling).
    ``draws``: P's keyed draws' ``[key, first row]``, or None (nearest). ``mechanism``: also
    ``Backward.mean_key`` and ``sums``; the gradients, counts and row sums are the same bits either way."""
    sq, sk = (_data(t) for t in scores_operands)
    q, k, v, do = (_data(t) for t in gemm_operands)
    batch, heads, seq, dim = q.shape
    device = q.device
    row_max, row_sum = row_stats
    do_codes, qkv_codes, rebuilt = do.dtype == torch.uint8, q.dtype == torch.uint8, sq.dtype != torch.uint8
    mantissa, bias, fmt_max = (fmt.mantissa, fmt.bias, fmt.max) if fmt is not None else (0, 0, 0.0)
    # the FP32 backward's GEMMs, and an FP8 backward's of an operand that is no FP8 code, run in FP32, never rounded
    bf16, codes = precision == "bf16", precision == "fp8"
    fp32 = dict(
        DP_FP32=not (bf16 or (codes and qkv_codes and do_codes)),
        DV_FP32=not (bf16 or (codes and not rebuilt and do_codes)),
        DQK_FP32=not (bf16 or (codes and qkv_codes and round_scores)),
    )
    flags = dict(MANTISSA=mantissa, BIAS=bias, DO_CODES=do_codes, DS_FP8=round_scores, BF16=bf16, **fp32)
    shape = dict(HEAD_DIM=dim, BLOCK_M=BLOCK, BLOCK_N=BLOCK, QKV_CODES=qkv_codes, REBUILT=rebuilt, **flags)
    common = (softmax_scale, seq, heads, heads // k.shape[1])
    grid = (triton.cdiv(seq, BLOCK), batch * heads)
    amax = torch.zeros((), dtype=torch.float32, device=device)
    d = torch.empty(batch, heads, seq, dtype=torch.float32, device=device) if d_term is None else d_term.contiguous()
    amax_first = callable(ds_scale)
    zeros = torch.zeros(5, device=device)
    gemm_scales = torch.cat([scales[:3], zeros, scales[7:8], zeros[:1], scales[8:]])
    if d_term is None or amax_first:
        _rows[grid](
            sq, sk, v, do, row_max, row_sum, d, gemm_scales, amax, *common, **shape,
            D_FROM_P=d_term is None, AMAX=amax_first,
        )  # fmt: skip
    scale = ds_scale(amax.clone()) if callable(ds_scale) else ds_scale
    ds_inv = scale.reciprocal()
    codes_inv = torch.ones_like(ds_inv) if bf16 else ds_inv  # dQ's, dK's epilogue: dS8's codes' scale
    gemm_scales = torch.stack(
        [*scales[:3], scale, codes_inv * scales[3], codes_inv * scales[4], *scales[5:8], ds_inv, *scales[8:]]
    )
    d_q, d_k, d_v = (torch.empty(batch, heads, seq, dim, dtype=torch.float32, device=device) for _ in range(3))
    rowsum = torch.empty(batch, heads, seq, dtype=torch.float32, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    amax.zero_()
    mean_key = torch.empty(batch, heads, seq, dim, dtype=torch.float32, device=device) if mechanism else None
    sums = torch.empty(2, batch, heads, seq, dtype=torch.float32, device=device) if mechanism else None
    _grad_q[grid](
        sq, sk, k, v, do, row_max, row_sum, d, gemm_scales, d_q, rowsum, counts, amax,
        d_q if mean_key is None else mean_key, rowsum if sums is None else sums, *common, **shape, MAX=fmt_max,
        MECHANISM=mechanism,
    )  # fmt: skip
    no_draws = torch.zeros(2, dtype=torch.int64, device=device)
    _grad_kv[grid](
        sq, sk, q, v, do, row_max, row_sum, d, gemm_scales, no_draws if draws is None else draws, d_k, d_v, *common,
        **shape, MAX=fmt_max, SEPARATE=sq.data_ptr() != q.data_ptr(), STOCHASTIC=draws is not None,
    )  # fmt: skip
    return Backward(d_q, d_k, d_v, counts, amax, rowsum, d, mean_key, sums)
