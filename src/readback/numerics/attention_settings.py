"""The ``attention`` group's schema: the attention core's own settings (its backward's GEMM
precision, what that backward reads besides the policy's D read, its parts, its FP8 recipe and the
core that runs it). ``numerics.settings.NumericsSettings`` holds it with the precision group and
the policy, and checks the rules between them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from readback.fields import Checked, one_of
from readback.numerics.formats import Format
from readback.numerics.gemm import GEMM_PRECISIONS
from readback.numerics.precision_settings import Fp8Settings
from readback.numerics.scaling import CurrentScaling, DelayedScaling, ScalingRecipe

BWD_PRECISIONS = GEMM_PRECISIONS[:3]  # what a run may choose: fp8, bf16, fp32 (fp64 is REFERENCE's)
# attention.bwd_reads: which operands the attention backward reads besides the policy's D read;
# ops.attention.BWD_READS says what each reads ("te": Transformer Engine's BF16 backward's).
BWD_READS = ("forward", "te")
# The parts of the attention backward that bwd_reads and bwd_precision set together, each a setting
# of its own too: what dQ, dK, dP read of Q, K, V (bwd_qkv); what dV, dS read of P (bwd_probs).
BWD_QKV = ("forward", "original")  # forward: what the FP8 forward multiplied (Q8, K8, V8)
BWD_PROBS = ("forward", "rebuilt")  # forward: the forward's P8 (dV) and P (dS)
# Which gradients the backward rounds to its FP8 format before their GEMMs, each a setting
# round_<gradient> (null: as the backward's precision says): dO, dS, and the dO that D reads.
BWD_ROUNDED = ("grad_output", "grad_scores", "grad_output_in_d")
# attention.kernel: readback's ops (PyTorch, tiled by a Python loop), one Triton kernel of the same
# roundings (readback.kernels), or auto: the kernel on CUDA where it runs the spec, else the ops
# (ops.attention_triton.runs decides, on the tensors' device).
KERNELS = ("auto", "ops", "triton")
# attention.recipe: the per-tensor recipes an attention core may take apart from the linears'
# (Transformer Engine's NVTE_DPA_FP8_RECIPE); TE's MXFP8 attention is not emulated.
RECIPES: dict[str, type[ScalingRecipe]] = {r.KEY: r for r in (DelayedScaling, CurrentScaling)}


@dataclass
class AttentionSettings(Checked):
    """The attention core's own settings: its backward's GEMM precision, what that backward reads
    besides the policy's D read (``ops.attention.BWD_READS``), and its FP8 recipe."""

    KEY = "attention"
    bwd_precision: str = one_of(BWD_PRECISIONS)
    bwd_reads: str = one_of(BWD_READS)
    recipe: str | None = one_of(
        RECIPES,
        default=None,
        note="no mxfp8: how TE's MXFP8 attention rounds P and dP is inside cuDNN, not in TE's source",
    )
    # The backward's parts, each apart from what bwd_reads and bwd_precision give (null): dQ's, dK's, dP's
    # read of Q, K, V; dV's, dS's of P; dO's and dS's E5M2 rounding, and that of the dO D reads.
    bwd_qkv: str | None = one_of(BWD_QKV, default=None)
    bwd_probs: str | None = one_of(BWD_PROBS, default=None)
    round_grad_output: bool | None = None
    round_grad_scores: bool | None = None
    round_grad_output_in_d: bool | None = None
    # the core that runs it: ops (PyTorch, tiled in Python) | triton (readback.kernels) | auto
    # (triton where it runs, on CUDA with triton installed, and runs these settings; else ops)
    kernel: str = one_of(KERNELS, default="auto")

    def parts_set_apart(self) -> dict[str, Any]:
        """The parts of the backward set apart from its flavour and precision (keys not null)."""
        keys = ("bwd_qkv", "bwd_probs", *(f"round_{g}" for g in BWD_ROUNDED))
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def scaling_recipe(self, p: Fp8Settings) -> ScalingRecipe | None:
        """The core's own recipe object (None without ``recipe``): its class with the fields of the
        precision group ``p`` it has, but for the linears' own (``override_linear_precision``,
        ``backward_override``), which keep their defaults, in ``format(p)``."""
        if self.recipe is None:
            return None
        cls = RECIPES[self.recipe]
        linear_only = ("override_linear_precision", "backward_override")
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(cls) if f.name not in linear_only}
        return cls(**{**fields, "fp8_format": self.format(p)})

    def format(self, p: Fp8Settings) -> Format:
        """The core's format: the linears' (``p.format()``), which TE's attention recipe reuses, but
        HYBRID under NVFP4, whose ``fp8_format`` is its block scales' (E4M3 only): TE's attention
        there takes ``NVTE_DPA_FP8_FORMAT``, HYBRID by default."""
        return Format.HYBRID if self.recipe and p.recipe == "nvfp4" else p.format()
