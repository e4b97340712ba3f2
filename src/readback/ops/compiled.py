"""``torch.compile`` of a model that rounds through readback's ops.

A cast down and back up (FP32 -> BF16 -> FP32, the GEMM output's one rounding) is a rounding
here, not a wasted conversion: by default inductor fuses it away and keeps the FP32 value, so
the compiled model would skip roundings the eager one does. ``emulate_precision_casts`` keeps
them (a process-wide inductor setting). What still differs from eager is the order of FP32 sums
in fused reductions: losses agree to about 1e-7 relative, not bit for bit.

The ops' bookkeeping is traceable: saved values go through ``save_for_backward``
(``readback.ops.saved``), and the backward writes amaxes, counts and observations into tensors
that exist before tracing, in place. So a compiled step needs every site created first (one
eager step). Stochastic roundings draw from generator states through ``readback::uniform``, an
op the graph calls as is: the same draws as eager, and the streams advance in place.
"""

from __future__ import annotations

from typing import Any

import torch


def compiled(module: torch.nn.Module) -> Any:
    """``torch.compile(module)`` with the roundings of casts kept, for static shapes: a run's
    shapes do not change, and a graph recompiled with dynamic shapes fails to trace the ops'
    autograd Functions (torch 2.13's dynamo: "lift_tracked_freevar_to_input should not be
    called on root SubgraphTracer")."""
    import torch._inductor.config  # imported on use: the inductor is heavy to import

    torch._inductor.config.emulate_precision_casts = True
    return torch.compile(module, dynamic=False)  # an OptimizedModule, called like the module
