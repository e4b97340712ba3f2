"""Which core runs readback's attention under a run's settings (``attention.kernel``): what of
them the Triton kernel does not run, and the core ``auto`` picks on CUDA; the op itself decides
by its tensors' device (``ops.attention_triton.runs``)."""

from __future__ import annotations

import torch

from readback.numerics import BlockScalingRecipe
from readback.numerics.settings import NumericsSettings
from readback.ops import attention_triton


def kernel_cannot_run(settings: NumericsSettings) -> str | None:
    """What in these settings the Triton kernel does not run, or None."""
    attention, fp8 = settings.attention, settings.fp8 is not None
    per_tensor = fp8 and (attention.recipe is not None or not isinstance(settings.recipe(), BlockScalingRecipe))
    return attention_triton.settings_refused(fp8, attention.bwd_precision, attention.bwd_reads, per_tensor)


def kernel_to_run(settings: NumericsSettings, on_cuda: bool | None = None) -> str:
    """``attention.kernel`` as a run resolves it on CUDA (``on_cuda``; None: where this machine has
    CUDA and triton): ``auto`` is triton there where the kernel runs these settings, else ops."""
    if settings.attention.kernel != "auto":
        return settings.attention.kernel
    if on_cuda is None:
        on_cuda = torch.cuda.is_available() and attention_triton.cannot_run_here() is None
    return "triton" if on_cuda and kernel_cannot_run(settings) is None else "ops"
