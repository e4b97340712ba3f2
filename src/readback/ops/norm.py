"""RMSNorm ``y = g * x / rms(x)`` and LayerNorm ``y = g * (x - mean) / std + b``, optionally
rounded (E4M3) for the GEMM that consumes them.

When the output is rounded, the value has two readers with different rules: the consumer's
weight gradient reads the rounded copy (what it multiplied), while the gain gradient here must
read the original normalised value (what the gain multiplied). LayerNorm's bias gradient is the
row sum of the output gradient: it reads no forward value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from readback.numerics import QTensor, pinned
from readback.numerics.spec import frozen_reads
from readback.ops.saved import load, save
from readback.policy import POLICIES

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

# gradient -> which normalised value (x - mean) / std, or x / rms(x), it reads.
READS = frozen_reads({policy: {"gain": "original"} for policy in POLICIES})


def _normalize(x: torch.Tensor, eps: float, center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normalized, 1 / std)``: RMS normalisation, or LayerNorm's with ``center``."""
    if center:
        x = x - x.mean(-1, keepdim=True)
    inv_std = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * inv_std, inv_std


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(
        fctx: Any,
        x: torch.Tensor,
        gain: torch.Tensor,
        bias: torch.Tensor | None,
        numerics: Numerics,
        name: str,
        eps: float,
        round_output: bool,
        center: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = x.to(numerics.dtype)
        normalized, inv_std = _normalize(x, eps, center)
        y = normalized * gain if bias is None else normalized * gain + bias
        yq = numerics.site(f"{name}.output").quantize(y, numerics.rounding) if round_output else None
        numerics.record(name, output=yq)
        # "rounded" reads the output's FP8 copy (less the bias, divided by the gain): the naive rule.
        gain_reads = normalized if numerics.read("rms_norm", "gain") == "original" else yq
        fctx.center = center
        save(fctx, normalized=normalized, inv_std=inv_std, gain=gain, bias=bias, gain_reads=gain_reads)
        numerics.account("rms_norm", normalized=normalized)
        if yq is None:
            return y, None, None
        scale = yq.scale.clone()  # not the site's own scale tensor: an output must not alias state
        fctx.mark_non_differentiable(yq.data, scale)
        return yq.dequantize(y.dtype), yq.data, scale

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor, _data: Any, _scale: Any) -> tuple[torch.Tensor | None, ...]:
        saved = load(fctx)
        normalized, inv_std, gain, bias = (saved[k] for k in ("normalized", "inv_std", "gain", "bias"))
        dy = dy.to(normalized.dtype)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, dy.shape[-1]).sum(0)

        d_gain = d_bias = None
        if fctx.needs_input_grad[1]:
            read = saved["gain_reads"]
            if not isinstance(read, torch.Tensor):
                read = read.dequantize(normalized.dtype)
                read = (read if bias is None else read - bias) / gain
            d_gain = rows(dy * read)
        if fctx.needs_input_grad[2]:
            d_bias = rows(dy)
        g = dy * gain
        centered_g = g - g.mean(-1, keepdim=True) if fctx.center else g
        dx = inv_std * (centered_g - normalized * (g * normalized).mean(-1, keepdim=True))
        return dx, d_gain, d_bias, None, None, None, None, None


def replay(
    x: torch.Tensor,
    gain: torch.Tensor,
    record: dict[str, Any],
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    center: bool = False,
) -> torch.Tensor:
    """Reference: plain autograd over the executed forward (the rounded output pinned)."""
    y = _normalize(x.to(dtype), eps, center)[0] * gain.to(dtype)
    y = y if bias is None else y + bias.to(dtype)
    return y if record["output"] is None else pinned(y, record["output"].dequantize(dtype))


# ``y``, or with ``round_output`` ``(y, yq)``
Normed = torch.Tensor | tuple[torch.Tensor, QTensor | None]


def _norm(
    x: torch.Tensor,
    gain: torch.Tensor,
    bias: torch.Tensor | None,
    numerics: Numerics,
    name: str,
    eps: float,
    round_output: bool,
    center: bool,
) -> Normed:
    if numerics.replaying:
        y = replay(x, gain, numerics.next_record(name), eps, numerics.dtype, bias, center)
        return (y, None) if round_output else y
    y, data, scale = cast(
        tuple[torch.Tensor, Any, Any],
        _Norm.apply(x, gain, bias, numerics, name, eps, round_output, center),  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    )
    if not round_output:
        return y
    return y, QTensor(data, scale, numerics.site(f"{name}.output").fmt)


def rms_norm(
    x: torch.Tensor, gain: torch.Tensor, numerics: Numerics, name: str, eps: float = 1e-6, round_output: bool = False
) -> Normed:
    """RMSNorm. A frozen gain (QK-norm) is a gain with ``requires_grad=False``.

    With ``round_output`` returns ``(y, yq)``: ``y`` holds the rounded values (site
    ``{name}.output``) and ``yq`` is the copy to hand to the consuming linear as ``x_q``.
    """
    return _norm(x, gain, None, numerics, name, eps, round_output, center=False)


def layer_norm(
    x: torch.Tensor,
    gain: torch.Tensor,
    bias: torch.Tensor | None,
    numerics: Numerics,
    name: str,
    eps: float = 1e-5,
    round_output: bool = False,
) -> Normed:
    """LayerNorm over the last dimension (``bias`` may be None); rounding as ``rms_norm``."""
    return _norm(x, gain, bias, numerics, name, eps, round_output, center=True)
