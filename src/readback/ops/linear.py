"""FP8 linear ``y = x W^T``: input and weight rounded (E4M3), output gradient rounded (E5M2).

A GEMM named in the recipe's ``override_linear_precision`` (fprop, dgrad, wgrad) runs in FP32
on the operands below instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from readback.numerics import QTensor, matmul, pinned
from readback.policy import POLICIES

if TYPE_CHECKING:
    from readback.ops.numerics import Numerics

# gradient -> which value of the tensor it multiplies it reads:
#   dgrad = dY W  reads the weight; wgrad = dY^T X reads the input.
# "rounded" is the FP8 copy the forward multiplied, i.e. the executed forward's own operand.
READS = {policy: {"dgrad": "rounded", "wgrad": "rounded"} for policy in POLICIES}


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, weight: torch.Tensor, numerics: Numerics, name: str, x_q: QTensor | None
    ) -> torch.Tensor:
        reads = READS[numerics.policy]
        x2 = x.reshape(-1, x.shape[-1])
        rounding = numerics.rounding
        xq = (
            x_q.map(lambda d: d.reshape(-1, d.shape[-1]))
            if x_q is not None
            else (numerics.site(f"{name}.input").quantize(x2, rounding))
        )
        wq = numerics.site(f"{name}.weight").quantize(weight, rounding)
        y = matmul(xq, wq.mT, numerics.linear_precision("fprop"))
        numerics.record(name, input=xq, weight=wq, output=y)

        candidates = {"rounded": (xq, wq), "original": (x2, weight)}
        fctx.x_for_wgrad = candidates[reads["wgrad"]][0]
        fctx.w_for_dgrad = candidates[reads["dgrad"]][1]
        fctx.numerics, fctx.name, fctx.x_shape = numerics, name, x.shape
        numerics.account("linear", input=fctx.x_for_wgrad if x_q is None else None, weight=fctx.w_for_dgrad)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        numerics: Numerics = fctx.numerics
        dgrad, wgrad = numerics.linear_precision("dgrad"), numerics.linear_precision("wgrad")
        dy = dy.reshape(-1, dy.shape[-1]).to(numerics.dtype)
        dyq = numerics.site(f"{fctx.name}.grad_output", "bwd").quantize(dy) if "fp8" in (dgrad, wgrad) else None
        dx = dw = None
        if fctx.needs_input_grad[0]:
            dx = matmul(dy if dyq is None or dgrad != "fp8" else dyq, fctx.w_for_dgrad, dgrad).reshape(fctx.x_shape)
        if fctx.needs_input_grad[1]:
            dw = matmul((dy if dyq is None or wgrad != "fp8" else dyq).mT, fctx.x_for_wgrad, wgrad)
        return dx, dw, None, None, None


def replay(
    x: torch.Tensor, weight: torch.Tensor, record: dict[str, Any], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference: plain autograd over the executed forward (operands and output pinned)."""
    x2 = pinned(x.reshape(-1, x.shape[-1]).to(dtype), record["input"].dequantize(dtype))
    w = pinned(weight.to(dtype), record["weight"].dequantize(dtype))
    y = pinned(x2 @ w.t(), record["output"].to(dtype))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear(
    x: torch.Tensor, weight: torch.Tensor, numerics: Numerics, name: str, x_q: QTensor | None = None
) -> torch.Tensor:
    """``x @ weight.T`` at rounding sites ``{name}.input``, ``{name}.weight``, ``{name}.grad_output``.

    ``x_q`` is an input already rounded by its producer (attention output, a norm's rounded
    output): the linear multiplies and saves that copy instead of rounding ``x`` again, so the
    producer's backward and this wgrad can share it.
    """
    if numerics.replaying:
        return replay(x, weight, numerics.next_record(name), numerics.dtype)
    return cast(torch.Tensor, _Linear.apply(x, weight, numerics, name, x_q))  # type: ignore[no-untyped-call]  # torch leaves apply untyped
