"""The FP8 attention core's forward as one Triton kernel: ``ops.attention_forward``'s arithmetic.

One program takes ``BLOCK_M`` query rows of one head and runs over the keys they may see twice:
first the softmax statistics (running row max ``row_max`` and sum ``row_sum`` of ``exp(S - row_max)``), then
``P = exp(S - row_max) / row_sum``, its FP8 rounding P8 (nearest, or stochastic with ``KeyedDraws``' very
draws) and ``O = P8 V8``. Every GEMM multiplies the decoded codes in FP32 (``input_precision``
ieee: exact products, FP32 sums) and rounds its scaled output once to BF16, as the emulated FP8
GEMM does (``numerics.gemm.fp8_mm``). P8's counts (saturated, underflowed, nonzero) are added
into one buffer. ``row_max`` and ``row_sum`` are saved: the backward recomputes P from them bit for bit.

P's amax needs no pass of its own: query 0 sees key 0 alone, so ``P[0, 0] = 1`` is every causal
P's largest element, and P's scale is known before the kernel runs (``ops`` computes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from readback.kernels import fp8


@triton.jit
def scores_tile(q, k_ptr, keys, T, HEAD_DIM: tl.constexpr, qk_scale_inv, softmax_scale, rows):
    """``S = c bf16(Q8 K8^T s_q^-1 s_k^-1)`` of decoded query rows ``q`` against ``keys``, with the
    keys a row may not see (later, or past T) at -inf."""
    dims = tl.arange(0, HEAD_DIM)
    k_codes = tl.load(k_ptr + keys[:, None] * HEAD_DIM + dims[None, :], mask=keys[:, None] < T, other=0)
    k = fp8.decode(k_codes, 3, 7)
    acc = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = fp8.round_bf16(acc * qk_scale_inv) * softmax_scale
    visible = (keys[None, :] <= rows[:, None]) & (keys[None, :] < T)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def probs_tile(s, row_max, row_sum):
    """``P = exp(S - row_max) / row_sum``: the softmax of a tile from its rows' statistics."""
    return tl.exp(s - row_max[:, None]) / row_sum[:, None]


@triton.jit
def round_probs(p, rows, keys, key, first, T, p_scale, STOCHASTIC: tl.constexpr):
    """P8 of a tile as its scaled grid values (FP32) and codes, and whether each saturated:
    ``quantize``'s scale, clamp and rounding, draws keyed by the global row ``bh T + i``."""
    y = p * p_scale
    saturated = y > 448.0
    y = tl.minimum(y, 448.0)
    u = fp8.keyed_uniform(key, rows + first, keys) if STOCHASTIC else y
    r = fp8.round_to_grid(y, u, STOCHASTIC, 3, -6)
    codes = fp8.encode(r, r if STOCHASTIC else y, 3, 7)
    return r, codes, saturated


@triton.jit
def _forward(
    q_ptr, k_ptr, v_ptr, scales_ptr, draws_ptr, out_ptr, max_ptr, sum_ptr, counts_ptr, tape_s_ptr, tape_p_ptr,
    sums_ptr, softmax_scale, T, H, GROUP_HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STOCHASTIC: tl.constexpr, TAPE: tl.constexpr, MECHANISM: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0), tl.program_id(1)
    kv_head = (bh // H) * (H // GROUP_HEADS) + (bh % H) // GROUP_HEADS
    qk_scale_inv, p_scale, pv_scale_inv = tl.load(scales_ptr), tl.load(scales_ptr + 1), tl.load(scales_ptr + 2)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_codes = tl.load(q_ptr + (bh * T + rows[:, None]) * HEAD_DIM + dims[None, :], mask=rows[:, None] < T, other=0)
    q = fp8.decode(q_codes, 3, 7)
    k_head, v_head = k_ptr + kv_head * T * HEAD_DIM, v_ptr + kv_head * T * HEAD_DIM
    end = tl.minimum((block + 1) * BLOCK_M, T)  # the last key these rows may see, plus one

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        s = scores_tile(q, k_head, keys, T, HEAD_DIM, qk_scale_inv, softmax_scale, rows)
        max_new = tl.maximum(row_max, tl.max(s, 1))
        row_sum = row_sum * tl.exp(row_max - max_new) + tl.sum(tl.exp(s - max_new[:, None]), 1)
        row_max = max_new

    key = (tl.load(draws_ptr) & 0xFFFFFFFF).to(tl.uint32)
    first = tl.load(draws_ptr + 1) + bh * T
    in_rows = rows[:, None] < T
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_saturated, n_underflowed, n_nonzero = tl.full([], 0, tl.int32), tl.full([], 0, tl.int32), tl.full([], 0, tl.int32)
    s_sum = tl.zeros([BLOCK_M], tl.float32)  # MECHANISM: per row, the sums of S, S^2 and P S
    s_squares = tl.zeros([BLOCK_M], tl.float32)
    ps_sum = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        s = scores_tile(q, k_head, keys, T, HEAD_DIM, qk_scale_inv, softmax_scale, rows)
        p = probs_tile(s, row_max, row_sum)
        if MECHANISM:  # the visible logits' sums (a hidden one is -inf, its P 0)
            s_seen = tl.where(s > float("-inf"), s, 0.0)
            s_sum += tl.sum(s_seen, 1)
            s_squares += tl.sum(s_seen * s_seen, 1)
            ps_sum += tl.sum(p * s_seen, 1)
        r, codes, saturated = round_probs(p, rows, keys, key, first, T, p_scale, STOCHASTIC)
        nonzero = in_rows & (p != 0.0)
        underflowed = nonzero & ((codes & 0x78) == 0)
        n_saturated += fp8.count(in_rows & saturated)
        n_underflowed += fp8.count(underflowed)
        n_nonzero += fp8.count(nonzero)
        v_codes = tl.load(v_head + keys[:, None] * HEAD_DIM + dims[None, :], mask=keys[:, None] < T, other=0)
        acc += tl.dot(r, fp8.decode(v_codes, 3, 7), input_precision="ieee")
        if TAPE:
            at = (bh * T + rows[:, None]) * T + keys[None, :]
            inside = in_rows & (keys[None, :] < T)
            tl.store(tape_s_ptr + at, s, mask=inside)
            tl.store(tape_p_ptr + at, codes, mask=inside)

    b, h = bh // H, bh % H
    out = fp8.round_bf16(acc * pv_scale_inv)
    tl.store(out_ptr + ((b * T + rows[:, None]) * H + h) * HEAD_DIM + dims[None, :], out, mask=in_rows)
    tl.store(max_ptr + bh * T + rows, row_max, mask=rows < T)
    tl.store(sum_ptr + bh * T + rows, row_sum, mask=rows < T)
    if MECHANISM:
        size = tl.num_programs(1) * T  # B H T: one plane per sum
        tl.store(sums_ptr + bh * T + rows, s_sum, mask=rows < T)
        tl.store(sums_ptr + size + bh * T + rows, s_squares, mask=rows < T)
        tl.store(sums_ptr + 2 * size + bh * T + rows, ps_sum, mask=rows < T)
    tl.atomic_add(counts_ptr, n_saturated.to(tl.int64))
    tl.atomic_add(counts_ptr + 1, n_underflowed.to(tl.int64))
    tl.atomic_add(counts_ptr + 2, n_nonzero.to(tl.int64))


BLOCK = 64  # query rows and keys of a tile: a GPU's dot tiles are at least 16, and 64 fills them


@dataclass(frozen=True)
class Forward:
    """What the kernel computed: O before its rounding (B, T, H hd; BF16 values in FP32); each
    row's softmax statistics ``row_max``, ``row_sum`` (B, H, T), which the backward recomputes P
    from; P8's counts (int64: saturated, underflowed, nonzero); while taping, the whole S and
    P8's codes (B, H, T, T; -inf and 0 where never computed), else None; when asked for (the
    mechanism statistics, ``ops.mechanism.observe_logit_sums``), each row's sums over its visible
    keys of S, S^2 and P S (3, B, H, T), else None."""

    out: torch.Tensor
    row_max: torch.Tensor
    row_sum: torch.Tensor
    counts: torch.Tensor
    scores: torch.Tensor | None
    probs: torch.Tensor | None
    sums: torch.Tensor | None


def forward(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    scales: torch.Tensor,
    softmax_scale: float,
    draws: torch.Tensor | None,
    tape: bool = False,
    mechanism: bool = False,
) -> Forward:
    """The forward of E4M3 codes ``q8`` (B, H, T, hd) over the groups' ``k8``, ``v8`` (B, G, T, hd).
    ``scales`` (FP32): ``[s_q^-1 s_k^-1, P's scale, s_p^-1 s_v^-1]``, the products as the
    emulated GEMM forms them; ``draws``: ``[key, first row]`` of P's keyed draws (stochastic
    rounding), or None (nearest). ``mechanism``: also the rows' sums (``Forward.sums``); O, the
    row statistics and the counts are the same bits either way."""
    batch, heads, seq, dim = q8.shape
    device = q8.device
    out = torch.empty(batch, seq, heads * dim, dtype=torch.float32, device=device)
    row_max, row_sum = (torch.empty(batch, heads, seq, dtype=torch.float32, device=device) for _ in range(2))
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    scores = torch.full((batch, heads, seq, seq), float("-inf"), device=device) if tape else None
    probs = torch.zeros((batch, heads, seq, seq), dtype=torch.uint8, device=device) if tape else None
    sums = torch.empty(3, batch, heads, seq, dtype=torch.float32, device=device) if mechanism else None
    codes = (t.contiguous().view(torch.uint8) for t in (q8, k8, v8))
    no_draws = torch.zeros(2, dtype=torch.int64, device=device)
    grid = (triton.cdiv(seq, BLOCK), batch * heads)
    _forward[grid](
        *codes, scales, no_draws if draws is None else draws, out, row_max, row_sum, counts,
        row_max if scores is None else scores, counts if probs is None else probs, row_sum if sums is None else sums,
        softmax_scale, seq, heads, heads // k8.shape[1],
        HEAD_DIM=dim, BLOCK_M=BLOCK, BLOCK_N=BLOCK, STOCHASTIC=draws is not None, TAPE=tape, MECHANISM=mechanism,
    )  # fmt: skip
    probs_codes = None if probs is None else probs.view(torch.float8_e4m3fn)
    return Forward(out, row_max, row_sum, counts, scores, probs_codes, sums)
