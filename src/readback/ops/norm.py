"""RMSNorm ``y = g * x / rms(x)``, optionally rounded (E4M3) for the GEMM that consumes it.

When the output is rounded, the value has two readers with different rules: the consumer's
weight gradient reads the rounded copy (what it multiplied), while the gain gradient here must
read the original normalised value (what the gain multiplied).
"""

from __future__ import annotations

import torch

from readback.numerics import QTensor, pinned
from readback.policy import POLICIES

# gradient -> which normalised value x/rms(x) it reads.
READS = {policy: {"gain": "original"} for policy in POLICIES}


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, gain, numerics, name, eps, round_output):
        x = x.to(numerics.dtype)
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        normalized = x * inv_rms
        y = normalized * gain
        yq = numerics.site(f"{name}.output").quantize(y, numerics.rounding) if round_output else None
        numerics.record(name, output=yq)
        # "rounded" reads the output's FP8 copy (divided by the gain in backward): the naive rule.
        fctx.gain_reads = normalized if READS[numerics.policy]["gain"] == "original" else yq
        fctx.save_for_backward(normalized, inv_rms, gain)
        numerics.account("rms_norm", normalized=normalized)
        if yq is None:
            return y, None, None
        fctx.mark_non_differentiable(yq.data, yq.scale)
        return yq.dequantize(y.dtype), yq.data, yq.scale

    @staticmethod
    def backward(fctx, dy, _data, _scale):
        normalized, inv_rms, gain = fctx.saved_tensors
        dy = dy.to(normalized.dtype)
        d_gain = None
        if fctx.needs_input_grad[1]:
            read = fctx.gain_reads
            value = read if isinstance(read, torch.Tensor) else read.dequantize(normalized.dtype) / gain
            d_gain = (dy * value).reshape(-1, dy.shape[-1]).sum(0)
        g = dy * gain
        dx = inv_rms * (g - normalized * (g * normalized).mean(-1, keepdim=True))
        return dx, d_gain, None, None, None, None


def replay(x, gain, record: dict, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: plain autograd over the executed forward (the rounded output pinned)."""
    x = x.to(dtype)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain.to(dtype)
    return y if record["output"] is None else pinned(y, record["output"].dequantize(dtype))


def rms_norm(x, gain, numerics, name: str, eps: float = 1e-6, round_output: bool = False):
    """RMSNorm. A frozen gain (QK-norm) is a gain with ``requires_grad=False``.

    With ``round_output`` returns ``(y, yq)``: ``y`` holds the rounded values (site
    ``{name}.output``) and ``yq`` is the copy to hand to the consuming linear as ``x_q``.
    """
    if numerics.replaying:
        y = replay(x, gain, numerics.next_record(name), eps, numerics.dtype)
        return (y, None) if round_output else y
    y, data, scale = _RMSNorm.apply(x, gain, numerics, name, eps, round_output)
    if not round_output:
        return y
    return y, QTensor(data, scale, numerics.site(f"{name}.output").fmt)
