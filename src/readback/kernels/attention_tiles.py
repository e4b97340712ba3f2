"""The attention backward's tiles (``attention_backward``'s kernels run them): a block of query
rows against a block of keys, as ``ops.attention_backward`` computes each value.

What a tile reads is chosen at compile time: the FP8 backward's codes (dO in the backward's
format, Q, K, V in E4M3, scaled in each GEMM's epilogue; the original Q, K, V in FP32 where
``bwd_qkv`` sets them apart) or the BF16 backward's BF16 values (unscaled); P recomputed from
the forward's Q8, K8 and row statistics, or rebuilt from the original Q, K and the forward's LSE
(``REBUILT``: flavour ``te``, or ``bwd_probs`` set apart). Beside them, the backward's types:
the format its gradients round to (``BackwardFormat``) and what it returns (``Backward``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from readback.kernels import fp8
from readback.kernels.attention_forward import probs_tile, scores_tile


@dataclass(frozen=True)
class Backward:
    """dQ, dK, dV (B, H, T, hd; dK, dV per query head); dS8's counts (int64: saturated,
    underflowed, nonzero) and amax (zeros in a BF16 backward); ``rowsum(dS)`` per row (B, H, T),
    the D-term's error; D per row (B, H, T). When asked for (the mechanism statistics), each row's
    ``kbar = P K`` (B, H, T, hd; in K's codes where the dQ GEMM reads codes, unscaled) and sums
    (2, B, H, T) of dS^2 and of dS's elements that dS8 flushes to zero; else None."""

    d_q: torch.Tensor
    d_k: torch.Tensor
    d_v: torch.Tensor
    counts: torch.Tensor
    amax: torch.Tensor
    rowsum: torch.Tensor
    d: torch.Tensor
    mean_key: torch.Tensor | None
    sums: torch.Tensor | None


@triton.jit
def load_rows(ptr, rows, T, HEAD_DIM: tl.constexpr, CODES: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """FP32 values of ``rows`` of one head's (T, hd) tensor: decoded FP8 codes, or BF16 values."""
    dims = tl.arange(0, HEAD_DIM)
    data = tl.load(ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < T, other=0)
    if CODES:
        return fp8.decode(data, MANTISSA, BIAS)
    return data.to(tl.float32)


@triton.jit
def probs(q, k_head, keys, rows, row_max, row_sum, qk_scale_inv, softmax_scale, T, HEAD_DIM: tl.constexpr,
          REBUILT: tl.constexpr):  # fmt: skip
    """P of the tile: the forward's (S of Q8, K8 as its kernel forms it, normalised by its row max
    and sum), or rebuilt, ``exp(c Q K^T - LSE)`` (``row_max`` the LSE, ``row_sum`` ones): S in
    FP32, never rounded, as ``ops.attention_parts.rebuilt`` keeps it."""
    if REBUILT:
        k = load_rows(k_head, keys, T, HEAD_DIM, False, 3, 7)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * softmax_scale
        visible = (keys[None, :] <= rows[:, None]) & (keys[None, :] < T)
        s = tl.where(visible, s, float("-inf"))
    else:
        s = scores_tile(q, k_head, keys, T, HEAD_DIM, qk_scale_inv, softmax_scale, rows)
    return probs_tile(s, row_max, row_sum)


@triton.jit
def tile(q, do, d, row_max, row_sum, rows, keys, k_head, v_head, scales_ptr, softmax_scale, T,
         HEAD_DIM: tl.constexpr, QKV_CODES: tl.constexpr, DP_FP32: tl.constexpr, REBUILT: tl.constexpr):  # fmt: skip
    """P and dP of the tile (query ``rows`` x ``keys``), and ``dS = P (dP - D)``; ``q`` the rows'
    scores operand, ``k_head`` the keys' (``probs``), ``v_head`` dP's V (``QKV_CODES``: E4M3
    codes). ``DP_FP32``: dP is an FP8 backward's GEMM of values (``do``: dO8's, scaled, or dO;
    V8's, scaled, or the original V), in FP32 and never rounded; else its output is scaled and
    rounded to BF16."""
    p = probs(q, k_head, keys, rows, row_max, row_sum, tl.load(scales_ptr), softmax_scale, T, HEAD_DIM, REBUILT)
    v = load_rows(v_head, keys, T, HEAD_DIM, QKV_CODES, 3, 7)
    if DP_FP32 and QKV_CODES:  # V8's values, as a GEMM of FP32 operands reads them
        v = v * tl.load(scales_ptr + 10)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    if not DP_FP32:
        dp = fp8.round_bf16(dp * tl.load(scales_ptr + 2))
    return p, dp, (dp - d[:, None]) * p


@dataclass(frozen=True)
class BackwardFormat:
    """The FP8 format dO and dS are rounded to: E5M2 (hybrid) or E4M3."""

    mantissa: int
    bias: int
    max: float

    @property
    def min_exponent(self) -> int:
        return 1 - self.bias


@triton.jit
def round_grad(ds, ds_scale, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """dS8 (nearest, saturating): its grid values, codes, and which elements saturated."""
    y = ds * ds_scale
    saturated = tl.abs(y) > MAX
    y = tl.minimum(tl.maximum(y, -MAX), MAX)
    r = fp8.round_to_grid(y, y, False, MANTISSA, 1 - BIAS)
    return r, fp8.encode(r, y, MANTISSA, BIAS), saturated


@triton.jit
def grad_scores_operand(r, scales_ptr, DS_FP8: tl.constexpr, DQK_FP32: tl.constexpr, BF16: tl.constexpr):
    """What the dQ and dK GEMMs read of dS (``r``: dS8's grid values where ``DS_FP8``, else dS):
    dS8's codes (scaled in the epilogue), or its values (an FP32 GEMM's, or rounded to BF16 in a
    BF16 backward), or dS as it is (an FP32 GEMM's) or rounded to BF16."""
    if DS_FP8 and (DQK_FP32 or BF16):
        r = r * tl.load(scales_ptr + 9)
    return fp8.round_bf16(r) if BF16 else r
