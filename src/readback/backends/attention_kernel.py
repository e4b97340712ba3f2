"""Which core runs readback's attention under a run's settings (``attention.kernel``): what of
them the Triton kernel does not run, and the core ``auto`` picks on CUDA; the op itself decides
by its tensors' device (``ops.attention_triton.runs``)."""

from __future__ import annotations

import torch

from readback.backends.precision import Attention, Precision, fp8_settings
from readback.numerics import BlockScalingRecipe
from readback.ops import attention_triton


def kernel_cannot_run(attention: Attention, precision: Precision) -> str | None:
    """What in these settings the Triton kernel does not run, or None."""
    p = fp8_settings(precision)
    per_tensor = p is not None and (
        attention.recipe is not None or not isinstance(p.scaling_recipe(), BlockScalingRecipe)
    )
    apart = bool(attention.parts_set_apart())
    return attention_triton.settings_refused(
        p is not None, attention.bwd_precision, attention.bwd_reads, apart, per_tensor
    )


def kernel_to_run(attention: Attention, precision: Precision, on_cuda: bool | None = None) -> str:
    """``attention.kernel`` as a run resolves it on CUDA (``on_cuda``; None: where this machine has
    CUDA and triton): ``auto`` is triton there where the kernel runs these settings, else ops."""
    if attention.kernel != "auto":
        return attention.kernel
    if on_cuda is None:
        on_cuda = torch.cuda.is_available() and attention_triton.cannot_run_here() is None
    return "triton" if on_cuda and kernel_cannot_run(attention, precision) is None else "ops"
