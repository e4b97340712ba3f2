"""readback's linear under the block recipes (MXFP8, Float8BlockScaling, NVFP4): which copy of X and
of W its backward GEMMs read, against the forward's copy, the copy quantised along the other axis
(``requantized``; NVFP4's after its Hadamard transform, ``rotated``) and the original. The
backward GEMMs run in FP32 and the blockwise scales are FP32, so that neither the backward's
arithmetic nor a power-of-two scale hides the read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from readback.audit.core import Row, audit
from readback.audit.harness import F64, Setup, value
from readback.audit.readback_ops import linear_gradients, per_policy
from readback.numerics import (
    BlockQTensor,
    BlockScalingRecipe,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    NVFP4Quantizer,
)
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.blockscale import COLUMNWISE
from readback.numerics.precision_settings import fp8_settings_of
from readback.numerics.settings import NumericsSettings
from readback.numerics.state import Numerics
from readback.ops import numerics_spec


def rb_linear_blocks(setup: Setup, policy: str, recipe: BlockScalingRecipe) -> list[Row]:
    """The linear under a block recipe: dgrad's W and wgrad's X against their forward copy, their
    own copy quantised along the other axis (``requantized``) and the original."""
    g = setup.generator(f"readback.linear ({_label(recipe)})")
    d = 2 * setup.width

    # One row in 32 of X and of W is 2**16 times the rest, and dY weighs it 2**-16: a block along
    # the other axis then holds an outlier that pushes the rest into E4M3's subnormals, while the
    # gradients still come from the rest (power-of-two scales keep a line's copies otherwise equal).
    x = Setup.randn(g, setup.batch, setup.seq, d)
    weight = Setup.randn(g, d // 2, d, std=d**-0.5)
    upstream = Setup.randn(g, setup.batch, setup.seq, d // 2)
    with torch.no_grad():
        x.view(-1, d)[::32] *= 2.0**16
        weight[::32] *= 2.0**16
        upstream.view(-1, d // 2)[::32] *= 2.0**-16
        upstream[..., ::32] *= 2.0**-16
    settings = NumericsSettings(
        fp8_settings_of(recipe), AttentionSettings(bwd_precision="fp32", bwd_reads="forward"), policy
    )
    numerics = Numerics(numerics_spec(settings), seed=setup.seed)
    got, record, ref = linear_gradients(numerics, x, weight, upstream)

    def copies(tensor: str, original: torch.Tensor, executed: BlockQTensor) -> dict[str, torch.Tensor]:
        """The values its backward could read (a square-block copy is the only one: no requantized;
        NVFP4's Hadamard-rotated copy beside the plain one, ``rotated``)."""
        quantizer = recipe.quantizer(tensor)
        out = {"rounded": executed.dequantize(F64), "original": value(original)}
        if quantizer.square:
            return out
        plain = quantizer
        if isinstance(quantizer, NVFP4Quantizer) and quantizer.rotates(COLUMNWISE):
            out["rotated"] = quantizer.quantize(original.detach().float(), COLUMNWISE).dequantize(F64)
            plain = dataclasses.replace(quantizer, hadamard=False)
        out["requantized"] = plain.quantize(original.detach().float(), COLUMNWISE).dequantize(F64)
        return out

    dy = value(upstream).reshape(-1, d // 2)
    xs = copies("input", x.reshape(-1, d), record["input"])
    ws = copies("weight", weight, record["weight"])
    op = f"readback.linear ({_label(recipe)})"
    common: dict[str, Any] = dict(policy=policy, declared=numerics.spec.reads["linear"], tol=setup.tol)
    return [
        *audit(op, "dgrad", got["x"], ref["x"], {m: (dy @ w).reshape(x.shape) for m, w in ws.items()}, **common),
        *audit(op, "wgrad", got["weight"], ref["weight"], {m: dy.mT @ v for m, v in xs.items()}, **common),
    ]


def _label(recipe: BlockScalingRecipe) -> str:
    """The recipe's key, with the NVFP4 switches that are off from TE's default."""
    off = [f.name for f in dataclasses.fields(recipe) if f.name.startswith("disable_") and getattr(recipe, f.name)]
    return ", ".join([recipe.KEY, *off])


AUDITS = {
    f"readback.linear ({_label(r)})": per_policy(rb_linear_blocks, recipe=r)
    for r in (
        MXFP8BlockScaling(override_linear_precision=(False, True, True)),
        Float8BlockScaling(pow2_scales=False, override_linear_precision=(False, True, True)),
        NVFP4BlockScaling(override_linear_precision=(False, True, True)),
        NVFP4BlockScaling(disable_2d_quantization=True, override_linear_precision=(False, True, True)),
    )
}
