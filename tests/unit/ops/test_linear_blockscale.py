"""The emulated linear under a block recipe: each GEMM's operands are the copies its read rules
name (``ops.linear.BLOCK_DIRECTIONS``, ``recipe_reads``), computed here independently from the
quantisers, and the reference gradient (the executed forward's) sees where they depart from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from readback.numerics import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, NVFP4Quantizer
from readback.numerics.blockscale import COLUMNWISE, ROWWISE
from readback.numerics.gemm import bf16_mm, block_mm
from readback.numerics.state import Numerics
from readback.ops import read_rules
from readback.ops.linear import linear
from specs import make_spec

RECIPES = [MXFP8BlockScaling(), Float8BlockScaling(), Float8BlockScaling(w_block_scaling_dim=1)]
NVFP4_NEAREST = NVFP4BlockScaling(disable_stochastic_rounding=True)  # its copies can be made again here
NVFP4_RECIPES = [
    NVFP4_NEAREST,
    dataclasses.replace(NVFP4_NEAREST, disable_rht=True),
    dataclasses.replace(NVFP4_NEAREST, disable_2d_quantization=True),
]


def _run(recipe, policy="reuse_rounded", exact_backward=False):
    """``(x, w, dy, numerics, reference dX, reference dW)`` of one linear call (M=256, K=256, N=128)."""
    numerics = Numerics(make_spec("fp8", recipe, policy))
    if exact_backward:
        numerics._spec = numerics.spec.with_exact_backward("linear")
    torch.manual_seed(0)
    # heavy-tailed magnitudes, so some elements fall below E4M3's normal range under a block's scale
    x = (torch.randn(2, 128, 256) * torch.randn(2, 128, 256).mul(2).exp()).requires_grad_()
    w = torch.randn(128, 256, requires_grad=True)
    dy = torch.randn(2, 128, 128)
    with numerics.taping() as tape:
        linear(x, w, numerics, "lin").backward(dy)
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
    with numerics.replay(tape, torch.float64):
        linear(xr, wr, numerics, "lin").backward(dy.double())
    return x, w, dy.reshape(-1, 128), numerics, xr.grad, wr.grad


def _gap(got, reference):
    return float((got.double() - reference).norm() / reference.norm())


def _copy(recipe, tensor, t, direction):
    return recipe.quantizer(tensor).quantize(t.detach().reshape(-1, t.shape[-1]), direction)


@pytest.mark.parametrize(
    "recipe",
    RECIPES + NVFP4_RECIPES,
    ids=["mxfp8", "blockwise", "blockwise-w1x128", "nvfp4", "nvfp4-no-rht", "nvfp4-1d-weights"],
)
def test_each_gemm_reads_its_own_copies_along_its_reduction_axis(recipe):
    """fprop X, W rowwise; dgrad dY rowwise and W as its read says; wgrad dY and X columnwise
    (X ``requantized``; ``rotated`` where NVFP4 rotates X's and dY's wgrad copies); bit for bit
    against the quantisers and ``block_mm``."""
    x, w, dy, numerics, _, _ = _run(recipe)
    reads = numerics.spec.reads["linear"]
    rotates = isinstance(recipe.quantizer("input"), NVFP4Quantizer) and recipe.quantizer("input").hadamard
    assert reads["wgrad"] == ("rotated" if rotates else "requantized")
    if rotates:  # both wgrad operands rotated along the tokens, and read back in their own basis
        assert (
            _copy(recipe, "input", x, COLUMNWISE).rotated_axis
            == _copy(recipe, "grad_output", dy, COLUMNWISE).rotated_axis
            == 0
        )
    assert reads["dgrad"] == ("rounded" if recipe.quantizer("weight").square else "requantized")
    w_dgrad = _copy(recipe, "weight", w, COLUMNWISE if reads["dgrad"] == "requantized" else ROWWISE)
    dx = block_mm(_copy(recipe, "grad_output", dy, ROWWISE), w_dgrad)
    dw = block_mm(_copy(recipe, "grad_output", dy, COLUMNWISE).mT, _copy(recipe, "input", x, COLUMNWISE))
    assert torch.equal(x.grad.reshape(-1, 256), dx) and torch.equal(w.grad, dw)


@pytest.mark.parametrize(
    "recipe", [*RECIPES[:2], Float8BlockScaling(pow2_scales=False)], ids=["mxfp8", "blockwise", "blockwise-fp32"]
)
def test_the_reference_is_the_executed_forward_and_sees_the_wgrad_read(recipe):
    """With the backward exact (FP32, dY unrounded), policy exact reproduces the reference (dX =
    dY W_fprop, dW = dY^T X_fprop); the recipe's own reads depart from it where they requantise.
    With power-of-two scales two directions' copies differ only where an element falls below
    E4M3's normal range under one block scale and not the other: a small departure, not none;
    with FP32 scales every element's grid moves."""
    exact_x, exact_w, _, _, ref_dx, ref_dw = _run(recipe, "exact", exact_backward=True)
    assert _gap(exact_x.grad.reshape(ref_dx.shape), ref_dx) < 1e-6 and _gap(exact_w.grad, ref_dw) < 1e-6  # FP32 sums
    x, w, _, numerics, _, _ = _run(recipe, "reuse_rounded", exact_backward=True)
    assert not torch.equal(w.grad, exact_w.grad)  # X's columnwise copy is not the one fprop multiplied
    assert torch.equal(x.grad, exact_x.grad) == (numerics.spec.reads["linear"]["dgrad"] == "rounded")
    assert (_gap(w.grad, ref_dw) > 1e-3) == (getattr(recipe, "pow2_scales", True) is False)


@pytest.mark.parametrize("override, read", [("dequantized", "rounded"), ("high_precision", "original")])
def test_a_backward_override_runs_bf16_gemms_on_its_copies_without_rounding_dy(override, read):
    recipe = MXFP8BlockScaling(backward_override=override)
    x, w, dy, numerics, _, _ = _run(recipe)
    assert dict(numerics.spec.reads["linear"]) == {"dgrad": read, "wgrad": read}
    assert numerics.linear_precision("dgrad") == numerics.linear_precision("wgrad") == "bf16"
    w_read = _copy(recipe, "weight", w, ROWWISE).dequantize() if read == "rounded" else w.detach()
    x_read = _copy(recipe, "input", x, ROWWISE).dequantize() if read == "rounded" else x.detach().reshape(-1, 256)
    dy, w_read, x_read = (t.bfloat16() for t in (dy, w_read, x_read))  # the BF16 GEMMs' operands
    assert torch.equal(x.grad.reshape(-1, 256), bf16_mm(dy, w_read, "fp32"))
    assert torch.equal(w.grad, bf16_mm(dy.mT, x_read, "fp32"))
    assert "lin.grad_output" not in numerics.sites


def test_exact_policy_takes_no_recipe_reads_and_per_tensor_recipes_set_none():
    assert read_rules("exact", recipe=MXFP8BlockScaling())["linear"] == {"dgrad": "rounded", "wgrad": "rounded"}
    current = dataclasses.replace(Float8BlockScaling(), backward_override=None)
    assert read_rules("reuse_rounded", recipe=current)["linear"]["wgrad"] == "requantized"
    from readback.numerics import CurrentScaling

    assert read_rules("reuse_rounded", recipe=CurrentScaling())["linear"] == read_rules("reuse_rounded")["linear"]


def test_a_shape_off_the_mxfp8_block_is_refused_as_te_refuses_it():
    numerics = Numerics(make_spec("fp8", MXFP8BlockScaling(), "reuse_rounded"))
    with pytest.raises(ValueError, match="multiples of 32"):
        linear(torch.randn(4, 48), torch.randn(32, 48), numerics, "lin")


def test_nvfp4_rounds_dy_twice_stochastically_and_the_reference_sees_every_read():
    """Under TE's default NVFP4, dgrad's and wgrad's dY copies are two independent stochastic
    roundings drawn from the run's stream (the same seed, the same gradients); with the backward
    exact, policy exact is the reference and the recipe's reads depart from it."""
    recipe = NVFP4BlockScaling()
    x, w, dy, _numerics, _, _ = _run(recipe)
    x2, w2, *_ = _run(recipe)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    nearest = _copy(NVFP4_NEAREST, "grad_output", dy, ROWWISE)
    w_copy = _copy(recipe, "weight", w, ROWWISE)
    assert not torch.equal(x.grad.reshape(-1, 256), block_mm(nearest, w_copy))  # dY was not rounded to nearest
    exact_x, exact_w, _, _, ref_dx, ref_dw = _run(recipe, "exact", exact_backward=True)
    assert _gap(exact_x.grad.reshape(ref_dx.shape), ref_dx) < 1e-6 and _gap(exact_w.grad, ref_dw) < 1e-6
    x, w, _, _, _, _ = _run(recipe, "reuse_rounded", exact_backward=True)
    assert torch.equal(x.grad, exact_x.grad)  # dgrad reads the one 16x16 copy fprop multiplied
    assert _gap(w.grad, ref_dw) > 1e-2  # wgrad reads X's rotated copy, a second E2M1 rounding
