"""An injected amax spike (``precision.amax_spike``): the one way a scale drops far below O's rms.

Within one step a tensor's amax is at most sqrt(numel) times its rms, so no steady state pushes
O's typical element below E4M3's smallest normal. Under delayed scaling the route is in time: a
spike of one step's amax is held by the max over the amax history and lowers the scale for as
long as its entry stays there. ``AmaxSpike`` makes one on purpose, for an experiment.

Which amax: at the end of optimizer step ``step`` (counted from 1, as the trainer and
``metrics.jsonl`` count), the step's own amax (``DelayedScalingState.pending_amax``, the max over
all its micro-batches, and over ranks) is multiplied by ``2**k`` before it is written into the
history. The scale of steps ``step + 1`` to ``step + amax_history_len`` is computed from a history
holding it; under ``amax_compute_algo=max``, margin 0 and ``interval`` 1, it is
``fp8_max / (2**k * amax_step)`` exactly when ``2**k * amax_step`` is the history's max. The entry
is overwritten by the ``amax_history_len``-th history write after it (the end of step
``step + amax_history_len``), so the scale is back to the spike-free rule from step
``step + amax_history_len + 1`` on. Under ``most_recent`` only step ``step + 1`` is lowered.

readback writes one history entry per optimizer step; Transformer Engine writes one per forward
(micro-batch), so its history of the same length is held for fewer optimizer steps.

Nothing about the spike needs saving: whether it is due is a function of the step count, which a
checkpoint holds, and the spiked entry sits in the saved history. A run resumed before ``step``
injects it once; one resumed after does not inject again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from readback.numerics.scale_state import DelayedScalingState
from readback.numerics.site_patterns import site_matches

if TYPE_CHECKING:
    from readback.numerics.site import Site


@dataclass(frozen=True)
class AmaxSpike:
    """``site``: a site pattern (``precision.site_margin``'s globs); ``step``: the optimizer step,
    from 1, whose amax is multiplied; ``k``: the factor ``2**k``, k >= 1."""

    site: str
    step: int
    k: int

    def __post_init__(self) -> None:
        if self.step < 1 or self.k < 1:
            raise ValueError(f"amax spike at step {self.step}, k={self.k}: step and k must be >= 1")

    def inject(self, sites: Mapping[str, Site], completed: int) -> None:
        """Before the history write that ends a step (``completed`` steps done before it):
        multiply the step's amax at every matched delayed-scaling site by ``2**k`` if the step is
        ``self.step``. Exact in FP32 (a power of two) unless the product overflows."""
        if completed + 1 != self.step:
            return
        for name, site in sites.items():
            if isinstance(site.state, DelayedScalingState) and site_matches(name, self.site):
                site.state.pending_amax.mul_(2.0**self.k)
