"""FP8 linear ``y = x W^T``: input and weight rounded (E4M3), output gradient rounded (E5M2).

A GEMM named in the recipe's ``override_linear_precision`` (fprop, dgrad, wgrad) runs in FP32
on the operands below instead; an FP8 GEMM accumulates as the spec's ``accumulation`` says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from readback.numerics import FP8Format, QTensor, decoded, matmul, pinned
from readback.numerics.spec import frozen_reads
from readback.ops.saved import load, save
from readback.policy import POLICIES

if TYPE_CHECKING:
    from readback.numerics.state import Numerics

# gradient -> which value of the tensor it multiplies it reads:
#   dgrad = dY W  reads the weight; wgrad = dY^T X reads the input.
# "rounded" is the FP8 copy the forward multiplied, i.e. the executed forward's own operand.
# The sites a linear named ``name`` rounds at: ``{name}.input`` (unless handed its rounded copy), ...
SITES = ("input", "weight", "grad_output")
GRADIENT_SITES = ("grad_output",)  # rounded in the recipe's backward format (E5M2 under HYBRID)
READS = frozen_reads({policy: {"dgrad": "rounded", "wgrad": "rounded"} for policy in POLICIES})


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        fctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        numerics: Numerics,
        name: str,
        x_q_data: torch.Tensor | None,
        x_q_scale: torch.Tensor | None,
        x_q_fmt: FP8Format | None,
    ) -> torch.Tensor:
        reads = numerics.spec.reads["linear"]
        rounding = numerics.rounding
        xq = (
            QTensor(_rows(x_q_data), x_q_scale, x_q_fmt)
            if x_q_data is not None and x_q_scale is not None
            else (numerics.site(f"{name}.input").quantize(_rows(x), rounding))
        )
        wq = numerics.site(f"{name}.weight").quantize(weight, rounding)
        y = matmul(xq, wq.mT, *numerics.linear_gemm("fprop"))
        numerics.record(name, input=xq, weight=wq, output=y)

        # An input (or its rounded copy, passed in) is saved in its own shape, not as a 2-D view:
        # a compiled graph cannot save a view of its input.
        x_q = xq if x_q_data is None or x_q_scale is None else QTensor(x_q_data, x_q_scale, x_q_fmt)
        candidates: dict[str, tuple[torch.Tensor | QTensor, torch.Tensor | QTensor]] = {
            "rounded": (x_q, wq),
            "original": (x, weight),
        }
        x_for_wgrad, w_for_dgrad = candidates[reads["wgrad"]][0], candidates[reads["dgrad"]][1]
        save(fctx, x_for_wgrad=x_for_wgrad, w_for_dgrad=w_for_dgrad)
        fctx.numerics, fctx.name, fctx.x_shape = numerics, name, x.shape
        numerics.account("linear", input=x_for_wgrad if x_q_data is None else None, weight=w_for_dgrad)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        numerics: Numerics = fctx.numerics
        saved = load(fctx)
        dgrad, wgrad = numerics.linear_precision("dgrad"), numerics.linear_precision("wgrad")
        dy = dy.reshape(-1, dy.shape[-1]).to(numerics.dtype)
        dyq = numerics.site(f"{fctx.name}.grad_output", "bwd").quantize(dy) if "fp8" in (dgrad, wgrad) else None
        dyq = decoded(dyq, numerics.bf16_gemm) if dyq is not None and dgrad == wgrad == "fp8" else dyq  # two GEMMs
        dx = dw = None
        if fctx.needs_input_grad[0]:
            dy_operand = dy if dyq is None or dgrad != "fp8" else dyq
            dx = matmul(dy_operand, saved["w_for_dgrad"], *numerics.linear_gemm("dgrad"))
            dx = dx.reshape(fctx.x_shape)
        if fctx.needs_input_grad[1]:
            x = saved["x_for_wgrad"]
            x = x.map(_rows) if isinstance(x, QTensor) else _rows(x)
            dy_operand = dy if dyq is None or wgrad != "fp8" else dyq
            dw = matmul(dy_operand.mT, x, *numerics.linear_gemm("wgrad"))
        return dx, dw, None, None, None, None, None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


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
    x_q_parts = (None, None, None) if x_q is None else (x_q.data, x_q.scale, x_q.fmt)
    return cast(torch.Tensor, _Linear.apply(x, weight, numerics, name, *x_q_parts))  # type: ignore[no-untyped-call]  # torch leaves apply untyped
