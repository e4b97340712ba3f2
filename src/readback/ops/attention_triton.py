"""The attention core on the Triton kernel (``attention.kernel=triton``; ``ops.attention`` wires
it): the sites round Q, K, V, O and dO as under the ops core, the kernel runs the tiles between
them (``readback.kernels``), with P's and dS's scales and counts taken from and added to their
sites here.

What it runs: the FP8 forward; the FP8 backward that reads what the forward multiplied
(``attention.bwd_reads=forward``, dO and dS rounded to E5M2); the BF16 backward of either flavour
(``forward``: Q8, K8, V8, P8 as BF16 values; ``te``: the original Q, K, V and P rebuilt with the
forward's LSE); the FP32 backward (``bwd_reads=forward``: every GEMM of values in FP32, unrounded);
each with any of its parts set apart (``bwd_qkv``, ``bwd_probs``, and the
rounding of dO, dS and the dO D reads: ``round_grad_output``, ``round_grad_scores``,
``round_grad_output_in_d``, at the ops core's sites, with its counts and scales) or not; under any policy's D
read, nearest or stochastic rounding, per-tensor delayed or current scaling. ``unsupported`` names what it
does not run yet (the ops core runs those). On log steps (``numerics.mechanism``) the kernels
also return per-row sums from which ``ops.mechanism`` forms the ops core's statistics.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

import torch

from readback.numerics import E4M3, QTensor
from readback.numerics.scale_state import CurrentScalingState, DelayedScalingState
from readback.ops import attention_parts as parts
from readback.ops import mechanism
from readback.ops.attention_forward import Forward

if TYPE_CHECKING:
    from readback.numerics.state import Numerics


def cannot_run_here() -> str | None:
    """Why no Triton kernel can run on this machine, or None: it needs triton, and CUDA or
    Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA here, and TRITON_INTERPRET=1 is not set"
    return None


def runs_head_dim(dim: int) -> bool:
    """Whether the kernel's tiles take head dim ``dim``: a power of two (a tile's width), 16 or more
    (a GPU's smallest dot)."""
    return dim >= 16 and dim & (dim - 1) == 0


def runs(numerics: Numerics, name: str, q: torch.Tensor) -> bool:
    """Whether the core ``name`` of queries ``q`` runs on the kernel: ``attention.kernel`` triton,
    or auto on CUDA where triton imports and the kernel runs the spec (``unsupported``) and the
    head dim."""
    kernel = numerics.spec.attention.kernel
    if kernel != "auto":
        return kernel == "triton"
    runnable = cannot_run_here() is None and runs_head_dim(q.shape[-1])
    return q.device.type == "cuda" and runnable and unsupported(numerics, name) is None


def settings_refused(fp8: bool, bwd_precision: str, bwd_reads: str, per_tensor: bool) -> str | None:
    """What of a run's settings the kernel does not run, or None: the one rule of the config's
    check (``backends.attention_kernel``) and of the op's (``unsupported``). Every part of the
    backward set apart (``AttentionSettings.parts_set_apart``) runs."""
    if not fp8:
        return "the triton kernel runs precision=fp8 only"
    if not (bwd_precision == "bf16" or (bwd_precision in ("fp8", "fp32") and bwd_reads == "forward")):
        return (
            "the triton kernel runs bwd_precision=fp8 or fp32 with bwd_reads=forward or bwd_precision=bf16 with"
            " either bwd_reads only"
        )
    if not per_tensor:
        return "the triton kernel runs per-tensor scaling only: set attention.recipe under a block recipe"
    return None


def unsupported(numerics: Numerics, name: str) -> str | None:
    """Why the kernel cannot run core ``name`` as ``numerics`` rounds it (a bias-meter variant's
    spec too: its reads), or None when it can."""
    spec = numerics.spec
    fp8 = spec.precision.name == "fp8"
    sites = [numerics.site(f"{name}.{site}") for site in ("q", "k", "v", "probs")] if fp8 else []
    per_tensor = all(s.fmt is E4M3 and isinstance(s.state, DelayedScalingState | CurrentScalingState) for s in sites)
    why = settings_refused(fp8, spec.bwd_gemm_precision, spec.attention.bwd_reads, per_tensor)
    reads = spec.reads["attention"]
    # one copy of Q, K, V for dQ, dK, dP (rounded or original); P for dV, dS the forward's or rebuilt
    qkv, probs = {reads["dQ"], reads["dK"], reads["dP"]}, (reads["dV"], reads["dS"])
    runs_reads = qkv in ({"rounded"}, {"original"}) and probs in (("rounded", "original"), ("rebuilt", "rebuilt"))
    if why is None and not runs_reads:
        return "the triton kernel reads each of Q, K, V and P in one copy only (no bias-meter variant)"
    return why


def forward(
    numerics: Numerics, name: str, qq: QTensor, kq: QTensor, vq: QTensor, softmax_scale: float
) -> tuple[Forward, tuple[torch.Tensor, torch.Tensor]]:
    """``attention_forward.forward`` on the kernel, and each row's softmax statistics (row max,
    row sum), from which the backward recomputes P."""
    from readback.kernels import attention_forward as kernel  # triton is imported where it runs

    why = unsupported(numerics, name)
    if why is not None:
        raise ValueError(f"attention.kernel=triton: {why}; attention.kernel=ops runs this")
    batch, heads, seq, _ = qq.data.shape
    site = numerics.site(f"{name}.probs")
    amax = torch.ones((), device=qq.data.device)  # causal P's largest element: P[0, 0] = 1 (query 0 sees key 0)
    p_scale = site.scale_for(amax, amax)
    scales = torch.stack([qq.scale_inv * kq.scale_inv, p_scale, p_scale.reciprocal() * vq.scale_inv]).float()
    start = site.claim(batch * heads * seq, qq.data.device) if numerics.rounding == "stochastic" else None
    taping = numerics.tape is not None
    result = kernel.forward(qq.data, kq.data, vq.data, scales, softmax_scale, start, taping, numerics.mechanism)
    site.count(*result.counts)
    if result.sums is not None:
        mechanism.observe_logit_sums(numerics, name, (result.row_max, result.row_sum), result.sums)
    probs = None if result.probs is None else QTensor(result.probs, p_scale, site.fmt)
    lse = None  # a rebuilt P's statistics, LSE = log(row sum) + row max, as torch.logsumexp forms it
    if "rebuilt" in numerics.spec.reads["attention"].values():
        lse = torch.log(result.row_sum).add_(result.row_max)
    blocks = Forward(result.out, p_scale, start, lse, result.scores, probs)
    return blocks, (result.row_max, result.row_sum)


def backward(
    numerics: Numerics, name: str, saved: dict[str, Any], ctx: Any, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_backward.backward`` on the kernel: dQ, dK, dV (B, H, T, hd; K's and V's per
    query head) from dO (``grad``, B, T, H hd)."""
    from readback.kernels import attention_backward as kernel
    from readback.kernels.attention_tiles import BackwardFormat

    batch, heads, seq, dim = ctx.shape
    dtype, spec = numerics.dtype, numerics.spec
    fp8 = numerics.bwd_gemm_precision != "bf16"  # the GEMMs read codes, or their FP32 values (FP32 backward)
    reads = spec.reads["attention"]
    grad = grad.to(parts.held(numerics)).reshape(batch, seq, heads, dim).transpose(1, 2)
    # dO8 where the GEMMs or D read it (``NumericsSpec.attention_rounds``), one rounding as in the ops core
    rounds_grad = spec.attention_rounds("grad_output")
    rounded_in_d = reads["D"] != "none" and spec.attention_rounds("grad_output_in_d")
    d_out8 = None
    if rounds_grad or rounded_in_d:
        d_out8 = numerics.site(f"{name}.grad_output", "bwd").quantize(grad.to(dtype))
        if ctx.mechanism:  # as the ops core adds it: dO as held
            grad_rounding = mechanism.GradientRounding(f"{name}.grad_output")
            grad_rounding.add(grad, d_out8)
            grad_rounding.observe(numerics)
    # the dO the GEMMs read: dO8 (its codes; its BF16 values in a BF16 backward), or dO (FP32 or BF16)
    one = torch.ones((), device=grad.device)
    d_out_inv = one
    if d_out8 is not None and rounds_grad:
        d_out = d_out8.data if fp8 else d_out8.dequantize(torch.bfloat16)
        d_out_inv = d_out8.scale_inv if fp8 else one
    else:
        d_out = grad.to(torch.float32 if fp8 else torch.bfloat16)
    o_read = parts.d_term_o(numerics, name, saved)  # None: D = rowsum(P * dP), formed by the kernel
    d_term = None
    if o_read is not None:  # the ops core's row term, over every row at once
        o_rows = parts.o_rows(numerics, o_read, slice(0, seq), heads)
        d_out_in_d = d_out8 if rounded_in_d and d_out8 is not None else grad
        d_term = (parts.value(d_out_in_d, dtype) * o_rows).sum(-1)
    q8, k8, v8 = saved["q8"], saved["k8"], saved["v8"]
    qk_inv = p_scale = p8_inv = one  # S's and P8's scales: a rebuilt P reads neither
    if reads["dS"] == "rebuilt":  # P = exp(c Q K^T - LSE): row max the LSE, row sum one
        scores_operands = (saved["q"], saved["k"])
        row_stats = (saved["lse"], torch.ones_like(saved["lse"]))
    else:
        scores_operands, row_stats = (q8.data, k8.data), (saved["row_max"], saved["row_sum"])
        qk_inv, p_scale = q8.scale_inv * k8.scale_inv, saved["p8_scale"]
        p8_inv = p_scale.reciprocal()  # P8's inverse scale (``QTensor.scale_inv``): its values' factor
    original = reads["dQ"] == "original"  # dQ, dK, dP read the original Q, K, V (held as ``held`` says)
    values_inv = (one, one, one)  # V8's, K8's, Q8's inverse scales where an FP32 GEMM reads their codes
    if fp8 and original:  # GEMMs of values in FP32, unscaled
        gemm_operands = (saved["q"], saved["k"], saved["v"], d_out)
        inverse, dp_inv = (one, one, p8_inv * d_out_inv), one
    elif fp8:
        gemm_operands = (q8.data, k8.data, v8.data, d_out)
        inverse, dp_inv = (k8.scale_inv, q8.scale_inv, p8_inv * d_out_inv), d_out_inv * v8.scale_inv
        values_inv = (v8.scale_inv, k8.scale_inv, q8.scale_inv)
    else:  # BF16 values: Q8, K8, V8 as their GEMMs read them, or the originals
        values = (saved[n] for n in "qkv") if original else (t.dequantize(torch.bfloat16) for t in (q8, k8, v8))
        gemm_operands = (*values, d_out)
        inverse, dp_inv = (one, one, one), one
    scales = torch.stack([qk_inv, p_scale, dp_inv, *inverse, p8_inv, d_out_inv, *values_inv]).float()
    ds_scale: Any = one  # an unrounded dS (FP32, or BF16 in a BF16 backward), unscaled: no site
    rounds_scores = spec.attention_rounds("grad_scores")
    fmt = None
    if rounds_scores:
        site = numerics.site(f"{name}.grad_scores", "bwd")
        fmt = site.fmt
        if site.reads_amax_first:
            ds_scale = lambda amax: site.scale_for(amax, amax)  # noqa: E731
        else:  # the step's scale; this dS's amax joins the step's once the kernel has it
            ds_scale = site.scale_for(torch.zeros((), device=grad.device), torch.zeros((), device=grad.device))
    elif d_out8 is not None:
        fmt = d_out8.fmt
    bwd_format = None if fmt is None else BackwardFormat(fmt.mantissa_bits, 1 - fmt.min_exponent, fmt.max)
    result = kernel.backward(
        scores_operands, gemm_operands, row_stats, d_term, scales, ds_scale, ctx.scale, saved["p8_draws"], bwd_format,
        numerics.bwd_gemm_precision, rounds_scores, ctx.mechanism,
    )  # fmt: skip
    if rounds_scores:
        if not site.reads_amax_first:
            site.scale_for(result.amax, result.amax)
        site.count(*result.counts)
    numerics.observe(f"attn_rowsum/{name}", result.rowsum)
    if ctx.mechanism:
        _observe_mechanism(numerics, name, result, rounds_scores)
    return result.d_q, result.d_k, result.d_v


def _observe_mechanism(numerics: Numerics, name: str, result: Any, rounds_scores: bool) -> None:
    """The backward's mechanism statistics from the kernel's per-row results (``result``, a
    ``kernels.attention_tiles.Backward``), as ``ops.mechanism`` forms them: the D-term cosine
    of ``kbar`` and D (``kbar`` in K8's codes where dQ reads them: the cosine does not depend on
    K's scale); dS8's rounding (where dS is rounded), over as many elements as the ops core's blocks
    of dS hold (their hidden keys' zeros too)."""
    d_term = mechanism.DTermCosine()
    d_term.add_mean_keys(result.mean_key, result.d[..., None])
    d_term.observe(numerics, name)
    if rounds_scores:
        batch, heads, seq = result.d.shape
        blocks = parts.query_blocks(batch, heads, seq)
        size = sum(batch * heads * (rows.stop - rows.start) * rows.stop for rows in blocks)
        _, underflowed, nonzero = result.counts
        grad_rounding = mechanism.GradientRounding(f"{name}.grad_scores")
        squares, flushed = result.sums.double().sum((1, 2, 3))
        grad_rounding.add_counts(torch.stack([nonzero, flushed, underflowed]), squares, result.amax, size)
        grad_rounding.observe(numerics)
