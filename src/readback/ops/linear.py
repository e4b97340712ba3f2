"""FP8 linear ``y = x W^T``: input and weight rounded (E4M3), output gradient rounded (E5M2).

A GEMM named in the recipe's ``override_linear_precision`` (fprop, dgrad, wgrad) runs in FP32
on the operands below instead, the backward's in BF16 under a ``backward_override``; an FP8 GEMM
accumulates as the spec's ``accumulation`` says. Under a block recipe (MXFP8, Float8BlockScaling)
each GEMM quantises its operands by blocks along its own reduction axis (``BLOCK_DIRECTIONS``)
and multiplies them as ``gemm.block_mm`` models it; the backward reads of X and W a recipe sets
are ``recipe_reads``'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from readback.numerics import (
    BlockQTensor,
    BlockScalingRecipe,
    FP8Format,
    NVFP4Quantizer,
    QTensor,
    ScalingRecipe,
    decoded,
    matmul,
    pinned,
)
from readback.numerics.blockscale import COLUMNWISE, ROWWISE
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
BACKWARD_OPERANDS = {"dgrad": "weight", "wgrad": "input"}  # gradient -> the forward tensor it reads
# A block-scaled GEMM reads each operand quantised along its reduction axis (TE 2.20
# pytorch/module/linear.py, backward_override None; the copies of one tensor are each quantised
# from its original): fprop X and W rowwise (along K), dgrad dY rowwise and W columnwise (along
# N), wgrad dY and X columnwise (along the tokens).
BLOCK_DIRECTIONS = {
    "fprop": {"input": ROWWISE, "weight": ROWWISE},
    "dgrad": {"grad_output": ROWWISE, "weight": COLUMNWISE},
    "wgrad": {"grad_output": COLUMNWISE, "input": COLUMNWISE},
}
OVERRIDE_READS = {"dequantized": "rounded", "high_precision": "original"}  # backward_override -> X and W reads


def recipe_reads(recipe: ScalingRecipe | None) -> dict[str, str]:
    """The reads ``recipe`` sets, laid over a policy's (``ops.read_rules``; never ``exact``'s):
    a ``backward_override``'s; else, under a block recipe, ``requantized`` for a tensor quantised
    in lines, whose forward copy runs along the wrong axis for the backward GEMM (``rotated`` where
    an NVFP4 quantiser rotates that copy; a square-block copy serves both: ``rounded``); nothing
    under a per-tensor recipe."""
    if recipe is not None and recipe.backward_override is not None:
        return dict.fromkeys(BACKWARD_OPERANDS, OVERRIDE_READS[recipe.backward_override])
    if not isinstance(recipe, BlockScalingRecipe):
        return {}
    reads = {}
    for gemm, tensor in BACKWARD_OPERANDS.items():
        quantizer = recipe.quantizer(tensor)
        rotates = isinstance(quantizer, NVFP4Quantizer) and quantizer.rotates(BLOCK_DIRECTIONS[gemm][tensor])
        reads[gemm] = "rounded" if quantizer.square else "rotated" if rotates else "requantized"
    return reads


def _block_copy(numerics: Numerics, name: str, tensor: str, t: torch.Tensor, gemm: str) -> BlockQTensor:
    """``t`` quantised at site ``{name}.{tensor}`` as the block-scaled GEMM ``gemm`` reads it."""
    site = numerics.site(f"{name}.{tensor}", "bwd" if tensor == "grad_output" else "fwd")
    return site.quantize_blocks(t, numerics.recipe.quantizer(tensor), BLOCK_DIRECTIONS[gemm][tensor])


def _scales_by_blocks(numerics: Numerics, name: str) -> bool:
    """Whether linear ``name`` quantises by blocks: a block recipe's FP8 linear (not a BF16 one)."""
    return isinstance(numerics.recipe, BlockScalingRecipe) and not numerics.spec.is_bf16_site(name)


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
        handed = QTensor(x_q_data, x_q_scale, x_q_fmt) if x_q_data is not None and x_q_scale is not None else None
        fctx.blocks = _scales_by_blocks(numerics, name)
        if fctx.blocks:
            xq: QTensor | BlockQTensor
            xq = handed.map(_rows) if handed is not None else _block_copy(numerics, name, "input", _rows(x), "fprop")
            wq: QTensor | BlockQTensor = _block_copy(numerics, name, "weight", weight, "fprop")
            y = matmul(xq, wq.mT, *numerics.linear_gemm("fprop"))
            x_q: QTensor | BlockQTensor = xq if handed is None else handed
        else:
            xq = (
                handed.map(_rows) if handed is not None else numerics.site(f"{name}.input").quantize(_rows(x), rounding)
            )
            wq = numerics.site(f"{name}.weight").quantize(weight, rounding)
            y = matmul(xq, wq.mT, *numerics.linear_gemm("fprop"))
            # An input (or its rounded copy, passed in) is saved in its own shape, not as a 2-D view:
            # a compiled graph cannot save a view of its input.
            x_q = xq if handed is None else handed
        numerics.record(name, input=xq, weight=wq, output=y)

        def read(mode: str, tensor: str) -> torch.Tensor | QTensor | BlockQTensor:
            """What the backward reads of ``tensor`` under ``mode``; a per-tensor copy (also one
            handed over) serves both directions, so ``requantized`` reads it there. ``rotated``
            is the copy its quantiser makes along the GEMM's axis (``recipe_reads``)."""
            original = x if tensor == "input" else weight
            forward_copy = x_q if tensor == "input" else wq
            if mode == "original":
                return original
            if mode == "rounded" or not fctx.blocks or (tensor == "input" and handed is not None):
                return forward_copy
            gemm = next(g for g, t in BACKWARD_OPERANDS.items() if t == tensor)
            return _block_copy(numerics, name, tensor, _rows(original), gemm)

        x_for_wgrad, w_for_dgrad = read(reads["wgrad"], "input"), read(reads["dgrad"], "weight")
        save(fctx, x_for_wgrad=x_for_wgrad, w_for_dgrad=w_for_dgrad)
        fctx.numerics, fctx.name, fctx.x_shape = numerics, name, x.shape
        numerics.account("linear", input=x_for_wgrad if handed is None else None, weight=w_for_dgrad)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        numerics: Numerics = fctx.numerics
        saved = load(fctx)
        dgrad, wgrad = numerics.linear_precision("dgrad"), numerics.linear_precision("wgrad")
        dy = dy.reshape(-1, dy.shape[-1]).to(numerics.dtype)
        dy_for = _block_grad_output(fctx, dy, dgrad, wgrad) if fctx.blocks else _grad_output(fctx, dy, dgrad, wgrad)
        dx = dw = None
        if fctx.needs_input_grad[0]:
            dx = matmul(dy_for["dgrad"], saved["w_for_dgrad"], *numerics.linear_gemm("dgrad"))
            dx = dx.reshape(fctx.x_shape)
        if fctx.needs_input_grad[1]:
            x = saved["x_for_wgrad"]
            x = x.map(_rows) if isinstance(x, QTensor) else x if isinstance(x, BlockQTensor) else _rows(x)
            dw = matmul(dy_for["wgrad"].mT, x, *numerics.linear_gemm("wgrad"))
        return dx, dw, None, None, None, None, None


GradOperand = torch.Tensor | QTensor | BlockQTensor


def _grad_output(fctx: Any, dy: torch.Tensor, dgrad: str, wgrad: str) -> dict[str, GradOperand]:
    """dY as dgrad and wgrad read it under a per-tensor recipe: one rounding for both FP8 GEMMs."""
    numerics: Numerics = fctx.numerics
    dyq = numerics.site(f"{fctx.name}.grad_output", "bwd").quantize(dy) if "fp8" in (dgrad, wgrad) else None
    dyq = decoded(dyq, numerics.bf16_gemm) if dyq is not None and dgrad == wgrad == "fp8" else dyq  # two GEMMs
    return {g: dy if dyq is None or p != "fp8" else dyq for g, p in (("dgrad", dgrad), ("wgrad", wgrad))}


def _block_grad_output(fctx: Any, dy: torch.Tensor, dgrad: str, wgrad: str) -> dict[str, GradOperand]:
    """dY as dgrad and wgrad read it under a block recipe: each FP8 GEMM's own copy, quantised from
    dY along its reduction axis (one copy for both with square blocks); unrounded otherwise."""
    copies: dict[str, GradOperand] = {}
    square = fctx.numerics.recipe.quantizer("grad_output").square
    for i, (gemm, precision) in enumerate((("dgrad", dgrad), ("wgrad", wgrad))):
        if precision != "fp8" or not fctx.needs_input_grad[i]:
            copies[gemm] = dy
        elif square and isinstance(copies.get("dgrad"), BlockQTensor):
            copies[gemm] = copies["dgrad"]
        else:
            copies[gemm] = _block_copy(fctx.numerics, fctx.name, "grad_output", dy, gemm)
    return copies


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
