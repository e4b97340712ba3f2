"""What ``te.Linear``'s GEMMs read in a ``backend=te`` plan: the label of its ``linear`` site.

Written from readback's linear read rules (``readback.ops.linear``: the policy's ``READS``, the
recipe's ``recipe_reads``, the block recipes' ``BLOCK_DIRECTIONS``) and the recipe's own
quantisers, so the label says what the emulated linear runs. TE's linear under a block recipe
(TE 2.20 ``pytorch/module/linear.py``, ``backward_override=None``) quantises each GEMM's operands
along its reduction axis, every copy from the original: fprop X and W rowwise, dgrad dY rowwise
and W columnwise, wgrad dY and X columnwise; a square-block copy serves both directions.
``NVFP4BlockScaling`` (``common/recipe/__init__.py``, v2.8 to 2.20) rotates the columnwise copies
of X and dY by its 16-point random Hadamard transform and rounds both copies of dY
stochastically, each with its own random bits (``pytorch/csrc/quantizer.cpp``, 2.20: a separate
RNG state for the columnwise copy, or two draws in one fused kernel).
"""

from __future__ import annotations

from readback.errors import ConfigError
from readback.numerics import BlockScalingRecipe, NVFP4Quantizer, ScalingRecipe
from readback.numerics.nvfp4 import HADAMARD_SIZE
from readback.ops.linear import BACKWARD_OPERANDS, BLOCK_DIRECTIONS, recipe_reads
from readback.ops.linear import READS as LINEAR_READS

SYMBOLS = {"input": "X", "weight": "W", "grad_output": "dY"}
# backward_override -> what the backward GEMMs read (per tensor: the FP8 copies W8, X8)
PER_TENSOR_READS = {
    None: "the forward's W8 and X8",
    "dequantized": "the forward's W8 and X8 dequantised, in BF16 GEMMs",
    "high_precision": "the original W and X, in BF16 GEMMs",
}
BLOCK_OVERRIDE_READS = {
    "dequantized": "the forward's copies of W and X dequantised, in BF16 GEMMs",
    "high_precision": "the original W and X, in BF16 GEMMs",
}


def linear_label(policy: str, recipe: ScalingRecipe | None) -> str:
    """``te.Linear`` and what its GEMMs read under ``recipe`` (``None``: no FP8). Every policy's
    linears read their rounded copies, TE's default (``save_original_input=False``,
    ``backward_override=None``); a policy with another linear read rule has no TE switch and is
    refused. TE's switches read other values: ``backward_override="high_precision"`` the original
    W and X (TE >= 2.15, not delayed scaling), ``"dequantized"`` the forward's copies in BF16
    GEMMs; ``save_original_input=True`` (>= 2.6) would re-quantise the original X."""
    reads = LINEAR_READS[policy]
    if (reads["dgrad"], reads["wgrad"]) != ("rounded", "rounded"):
        raise ConfigError(
            "policy",
            policy,
            "a policy whose linears read their rounded copies (backend=te maps no "
            "other linear read rule onto Transformer Engine)",
        )
    if recipe is None:
        return "te.Linear"
    override = recipe.backward_override
    switches = f"save_original_input=False, backward_override={override}"
    if not isinstance(recipe, BlockScalingRecipe):
        return f"te.Linear (backward reads {PER_TENSOR_READS[override]}: {switches})"
    gemms = block_gemm_reads(recipe)
    if override is not None:
        gemms = {"fprop": gemms["fprop"], "backward": BLOCK_OVERRIDE_READS[override]}
    return "te.Linear (" + "; ".join(f"{gemm} reads {what}" for gemm, what in gemms.items()) + f": {switches})"


def block_gemm_reads(recipe: BlockScalingRecipe) -> dict[str, str]:
    """``{gemm: its operands' copies}`` under a block recipe without ``backward_override``: each
    copy's direction and block (``rows x cols`` of the tensor's 2-D view), NVFP4's rotation and
    stochastic rounding, and for the backward's X and W the read mode ``recipe_reads`` gives
    (``rounded``: the forward's copy; ``requantized``, ``rotated``: a copy of its own)."""
    modes = recipe_reads(recipe)
    stochastic_before: set[str] = set()
    out = {}
    for gemm, operands in BLOCK_DIRECTIONS.items():
        copies = []
        for tensor, direction in operands.items():
            quantizer = recipe.quantizer(tensor)
            rows, cols = quantizer.block(direction)
            shape = f"{rows}x{cols}" if quantizer.square else f"{direction} {rows}x{cols}"
            notes = []
            if isinstance(quantizer, NVFP4Quantizer) and quantizer.rotates(direction):
                notes.append(f"after the {HADAMARD_SIZE}-point random Hadamard transform")
            if isinstance(quantizer, NVFP4Quantizer) and quantizer.stochastic:
                again = " again, with its own random bits" if tensor in stochastic_before else ""
                notes.append("rounded stochastically" + again)
                stochastic_before.add(tensor)
            if BACKWARD_OPERANDS.get(gemm) == tensor:
                notes.append(f"read {modes[gemm]}")
            copies.append(f"{SYMBOLS[tensor]} {shape}" + (f" ({', '.join(notes)})" if notes else ""))
        out[gemm] = " and ".join(copies)
    return out
