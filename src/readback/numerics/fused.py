"""One FP8 site's rounding and underflow counts as one compiled region, for eager CPU steps.

Eagerly, a site rounds in separate passes over its tensor (scale, clamp, cast) and counts in
more (its nonzero elements, its zero and subnormal codes). ``torch.compile`` of the same
functions (``quantize``, ``underflow_counts``) runs them as one loop: a site some three times
faster on the CPU, the same codes and counts. Each format and shape compiles once (seconds;
some 30 s for the tiny FOG's), which only a long run pays back: ``enable`` switches it on
(``benchmarks/step.py``'s ``+fused`` variants). Only nearest rounding is fused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from readback.numerics.counts import underflow_counts
from readback.numerics.formats import FP8Format
from readback.numerics.rounding import QTensor, quantize

_enabled = False
RECOMPILE_LIMIT = 256  # graphs of the region (shapes x formats) before dynamo falls back to eager


def enable(on: bool = True) -> None:
    """Round and count each eager nearest FP8 site in one compiled region (process-wide)."""
    global _enabled
    _enabled = on


def applies(x: torch.Tensor, rounding: str, saturate: bool) -> bool:
    """Whether a site's rounding of ``x`` (counted) takes the compiled region: switched on, on
    the CPU, outside a compiled graph and outside autograd (the codes have no gradient either
    way), nearest, contiguous (the codes keep that layout) and without the clamp: ``amax * scale
    <= max`` showed every element finite and in range, where the compiled loop's codes are the
    cast's (a NaN's sign is not: eager keeps it, the compiled clamp does not)."""
    on_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
    untracked = not (x.requires_grad and torch.is_grad_enabled())
    return _enabled and on_cpu and untracked and rounding == "nearest" and x.is_contiguous() and not saturate


def rounded_and_counted(
    x: torch.Tensor, fmt: FP8Format, scale: torch.Tensor
) -> tuple[QTensor, torch.Tensor, torch.Tensor]:
    """``quantize(x, fmt, scale, "nearest", saturate=False)`` and its ``underflow_counts``
    (``underflowed``, ``nonzero``), in one compiled region, one graph per format and shape
    (``x`` detached: a view's base would be guarded on too, a graph per base)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    data, underflowed, nonzero = _compiled()(x.detach(), fmt, scale)
    return QTensor(data, scale, fmt), underflowed, nonzero


def _round_and_count(
    x: torch.Tensor, fmt: FP8Format, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = quantize(x, fmt, scale, "nearest", saturate=False)
    return (q.data, *underflow_counts(x, q, nearest=True))


@functools.cache
def _compiled() -> Any:
    """Static shapes: with symbolic ones the inductor's CPU loop is slower than the eager passes.
    Every shape and format of a model is a graph, more than dynamo's default limit of 8."""
    import torch._dynamo.config
    import torch._inductor.config  # imported on use: the inductor is heavy to import

    torch._inductor.config.emulate_precision_casts = True  # casts round (``readback.ops.compiled``)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(_round_and_count, dynamic=False)
