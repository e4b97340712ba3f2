"""readback.analysis.decisions.nvfp4_switches: the pre-registered calls on final losses built to cross
each line, arms read from run folder names, and a diverged run's seed tested both ways."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from readback.analysis.decisions.nvfp4_switches import ARMS, BOTH, DEFAULT, NEAREST, WEIGHTS_1D, arm_of, paired_tests

NOISE = np.array([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5]) * 0.002


def _runs(gaps: dict[str, float], statuses: dict[tuple[str, int], str] | None = None) -> pd.DataFrame:
    """8 seeds x 4 arms: TE's defaults at 4.0 + a seed's offset, each arm ``gaps[arm]`` above it
    with its own small noise."""
    rows = []
    for s in range(8):
        base = 4.0 + 0.01 * s
        for i, arm in enumerate(ARMS.values()):
            loss = base + gaps.get(arm, 0.0) + (NOISE[(s + i) % 8] if arm != DEFAULT else 0.0)
            status = (statuses or {}).get((arm, s), "completed")
            rows.append({"seed": s, "arm": arm, "status": status, "val_loss": loss, "final_loss": loss})
    return pd.DataFrame(rows)


def test_arms_are_read_from_the_run_folders():
    path = "reuse_rounded/precision.disable_2d_quantization=True,precision.disable_stochastic_rounding=False,seed=3"
    assert arm_of(path) == WEIGHTS_1D
    assert arm_of(path.replace("=True", "=False").replace("rounding=False", "rounding=True")) == NEAREST


@pytest.mark.parametrize(
    ("gap", "expected"),
    [(0.02, "behind TE's defaults"), (-0.02, "ahead of TE's defaults"), (0.0005, "no difference detected")],
)
def test_each_switch_gets_its_pre_registered_call(gap, expected):
    result = paired_tests(_runs({WEIGHTS_1D: gap, NEAREST: 0.0, BOTH: gap}), "val_loss")
    assert result["calls"][WEIGHTS_1D].startswith(expected)
    assert result["calls"][NEAREST] == "no difference detected"
    assert result["contrasts"][f"{WEIGHTS_1D} - {DEFAULT}"]["t_two_sided"] == pytest.approx(2.365, abs=5e-4)
    assert result["contrasts"][f"{BOTH} - {WEIGHTS_1D}"]["n"] == 8


def test_a_diverged_run_that_changes_the_call_makes_it_inconclusive():
    """The 1x16 arm is 0.01 behind in seeds 1 to 7, but seed 0's run diverged and its last loss
    is far below: with it no difference is detected, without its seed the arm is behind, so the
    call is inconclusive. A run still going is never paired."""
    runs = _runs({WEIGHTS_1D: 0.01})
    runs.loc[(runs["arm"] == WEIGHTS_1D) & (runs["seed"] == 0), ["status", "val_loss"]] = ["diverged", 3.0]
    runs.loc[(runs["arm"] == NEAREST) & (runs["seed"] == 1), "status"] = "running"
    result = paired_tests(runs, "val_loss")
    assert result["calls"][WEIGHTS_1D].startswith("inconclusive")
    assert 1 not in result["seeds"] and 0 in result["seeds"]
    assert paired_tests(_runs({WEIGHTS_1D: 0.01}), "val_loss")["calls"][WEIGHTS_1D].startswith("behind")
