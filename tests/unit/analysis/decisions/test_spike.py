"""readback.analysis.decisions.spike: the pre-registered falsifiers on records built to cross each line."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from readback.analysis.decisions.spike import ONE_SIDED_T, ratchet, slope


def _history(ratios: list[float]) -> pd.DataFrame:
    """reuse_rounded, k 12: O's amax 1 before step 1,000 and ``ratio`` after, per seed (layer 1
    only; layer 0 stays flat)."""
    rows = []
    for seed, ratio in enumerate(ratios):
        for layer in ("layers.0", "layers.1"):
            for step in range(1, 2001):
                amax = ratio if (layer == "layers.1" and step > 1000) else 1.0
                rows.append(("reuse_rounded", 12, seed, layer, step, amax if step != 1000 else 4096.0))
    return pd.DataFrame(rows, columns=["experiment", "k", "seed", "layer", "step", "amax"])


@pytest.mark.parametrize(("ratios", "falsified"), [([2, 2, 2, 1], True), ([2, 2, 1.9, 1], False)])
def test_ratchet_needs_a_doubled_amax_in_three_seeds_of_one_layer(ratios, falsified):
    r = ratchet(_history(ratios))
    assert r["falsified"] is falsified
    assert r["seeds_at_2x_per_layer"]["layers.0"] == 0  # the spiked entry of step 1,000 is left out
    assert r["ratio_inside_over_before"]["2"]["layers.1"] == pytest.approx(ratios[2])


def _curve(growth: list[float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """val_loss at the four slope steps: the control flat, reuse_rounded growing by ``growth``
    per 1,000 steps in seed s; a k 14 pair that would cross the line is ignored."""
    runs, rows = [], []
    for k in (12, 14):
        for seed, g in enumerate(growth):
            for arm in ("reuse_rounded", "no_saved_copy"):
                run = f"{arm}/k:{k},seed={seed}"
                runs.append({"run_id": run, "path": run})
                for step in (2250, 2500, 2750, 3000):
                    gap = (g if k == 12 else 1.0) * step / 1000 if arm == "reuse_rounded" else 0.0
                    rows.append({"run": run, "experiment": arm, "seed": seed, "step": step, "value": 3.0 + gap})
    return pd.DataFrame(rows), pd.DataFrame(runs)


def test_slope_is_each_seeds_least_squares_fit_and_a_one_sided_t():
    growth = [0.010, 0.012, 0.008, 0.011]
    s = slope(*_curve(growth))
    assert s["slope_per_seed"] == pytest.approx({str(i): g for i, g in enumerate(growth)})
    sd = pd.Series(growth).std()
    assert s["t"] == pytest.approx(sum(growth) / 4 / (sd / 2)) and s["falsified"]
    assert pytest.approx(2.353, abs=5e-4) == ONE_SIDED_T
    flat = slope(*_curve([0.002, -0.003, 0.001, -0.001]))
    assert not flat["falsified"] and math.isfinite(flat["t"])
