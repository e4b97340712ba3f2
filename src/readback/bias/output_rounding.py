"""O's rounding, read from the bias meter's own executed forwards: how hard the stress hits the
tensor whose FP8 copy O8 the reuse D-term reads.

Per attention layer (keyed by the attention module, ``layers.<i>.attn``; its site
``layers.<i>.attn.core.output``), over the meter's N batches:

* ``underflow``: the share of O's nonzero elements that O8 holds as zero or a subnormal, pooled
  (underflowed / nonzero summed over batches: the run's ``fp8_underflow`` over these forwards);
* ``rel_err``: ``|O - O8| / |O|`` (Frobenius norms over the whole batch), the mean over batches;
* ``amax_to_rms``: ``max|O| / rms(O)`` (over the whole batch), the mean over batches;
* ``log2_rms_scaled``: ``log2(rms(O) * scale)``, where O's typical element lands on the format's
  grid (below its smallest normal exponent, E4M3's -6, most of O8 is subnormal), the mean over batches;
* ``history_amax_to_rms``: the amax O8's delayed scale is computed from (the amax history's)
  over ``rms(O)``, the mean over batches (delayed scaling only: absent under current scaling);
* ``log2_scale``: the mean over batches of log2 of O8's scale (constant under delayed scaling);
* ``margin``: the site margin that scale was divided by (``2**margin``).

Only FP8 sites count (a BF16 or unrounded O has no underflow of its own).
"""

from __future__ import annotations

import math
from collections import defaultdict

from readback.numerics import QTensor
from readback.numerics.site import EXPONENT_BITS, rounding_figures, underflow_counts

SUFFIX = ".core"  # the attention op's name is its module's, plus this


class OutputRounding:
    """Accumulates O's rounding over the executed forwards' tapes (:meth:`add`), then :meth:`summary`."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, numerics, tape: list) -> None:
        """One executed forward's ``tape``; call inside the execution's isolation, where its sites are."""
        for op, record in tape:
            o8 = record.get("output")
            if "out" not in record or not isinstance(o8, QTensor) or o8.data.dtype not in EXPONENT_BITS:
                continue  # not the attention op's record (O before and after rounding), or not FP8
            o, site = record["out"], numerics.site(f"{op}.output")
            underflowed, nonzero = underflow_counts(o, o8)
            figures = rounding_figures(o, o8, site.history_amax)
            sums = self.sums[op.removesuffix(SUFFIX)]
            sums["batches"] += 1
            sums["underflowed"] += int(underflowed)
            sums["nonzero"] += int(nonzero)
            for stat, value in figures._asdict().items():
                if value is not None:
                    sums[stat] += value.item()
            sums["log2_scale"] += math.log2(float(o8.scale))
            sums["margin"] = site.margin

    def summary(self) -> dict[str, dict[str, float]]:
        """``{attention module: {underflow, rel_err, amax_to_rms, log2_rms_scaled, log2_scale, margin}}``,
        and ``history_amax_to_rms`` under delayed scaling."""
        out = {}
        for layer, s in self.sums.items():
            n = s["batches"]
            out[layer] = {
                "underflow": s["underflowed"] / s["nonzero"] if s["nonzero"] else math.nan,
                "rel_err": s["rel_err"] / n,
                "amax_to_rms": s["amax_to_rms"] / n,
                "log2_rms_scaled": s["log2_rms_scaled"] / n,
                "log2_scale": s["log2_scale"] / n,
                "margin": int(s["margin"]),
            }
            if "history_amax_to_rms" in s:
                out[layer]["history_amax_to_rms"] = s["history_amax_to_rms"] / n
        return out
