"""readback.analysis.decisions.bf16_bwd: the pre-registered calls on final losses built to cross each line."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from readback.analysis.decisions.bf16_bwd import CONTROL, FIX, MARGIN, REUSE, finals, paired, verdict

NOISE = np.array([1, -1, 2, -2, 0.5, -0.5, 1.5, -1.5, 0, 0.25, -0.25, 0.75, -0.75, 1.25, -1.25, 0.0]) * 0.002


def _table(reuse_gap: float, fix_gap: float) -> pd.DataFrame:
    """16 seeds: the control at 4.0, reuse_rounded ``reuse_gap`` behind it and the fix ``fix_gap``
    behind it, each pair with its own small noise (seed-paired spread 0.002 x NOISE's)."""
    control = 4.0 + np.linspace(-0.05, 0.05, 16)
    return pd.DataFrame(
        {CONTROL: control, REUSE: control + reuse_gap + NOISE, FIX: control + fix_gap + NOISE[::-1]},
        index=pd.Index(range(100, 116), name="seed"),
    )


@pytest.mark.parametrize(
    ("reuse_gap", "fix_gap", "call"),
    [
        (0.013, 0.013, "the gap survives the fix"),
        (0.013, 0.0, "the fix closes the gap"),
        (0.0, 0.0, "void"),
        (0.013, 0.0065, "inconclusive"),  # halfway: neither equivalent to the control nor behind it
        (0.013, -0.013, "inconclusive"),  # the fix ahead of the control
    ],
)
def test_each_outcome_gets_its_pre_registered_call(reuse_gap, fix_gap, call):
    assert verdict(_table(reuse_gap, fix_gap))["verdict"].startswith(call)


def test_paired_is_the_seed_paired_t_with_15_df_and_tost_uses_the_90_percent_interval():
    table = _table(0.013, 0.0)
    p = paired(table, REUSE, CONTROL)
    d = table[REUSE] - table[CONTROL]
    assert p["mean"] == pytest.approx(d.mean()) and p["se"] == pytest.approx(d.std() / 4)
    assert p["t_two_sided"] == pytest.approx(2.131, abs=5e-4) and p["t_one_sided"] == pytest.approx(1.753, abs=5e-4)
    v = verdict(table)["fix_vs_control"]
    inside = v["ci90"][0] > -MARGIN and v["ci90"][1] < MARGIN
    assert v["equivalent"] is inside is True


def test_only_seeds_whose_three_arms_ended_are_paired():
    runs = pd.DataFrame(
        [
            {"seed": s, "experiment": arm, "status": status, "val_loss": 4.0}
            for s, status in ((1, "completed"), (2, "running"), (3, "diverged"))
            for arm in (REUSE, FIX, CONTROL)
        ]
    )
    assert finals(runs, "val_loss").index.tolist() == [1, 3]


def test_the_decision_is_written_as_json(tmp_path):
    """Every figure of a decision is plain JSON (numpy integers and floats included)."""
    import json

    from readback.analysis.decisions.bf16_bwd import meter_figures

    runs = pd.DataFrame({"run_id": ["a", "b"], "experiment": [REUSE, FIX], "seed": [1, 1]})
    key = "grad_bias/contrib.exact_read.attention.D/layers.0.attn.qkv"
    index = pd.MultiIndex.from_tuples([("a", 2000), ("b", 2000)], names=["run", "step"])
    wide = pd.DataFrame({k: [0.1, 0.2] for k in (key, key.replace("0.attn", "1.attn"))}, index=index)
    figures = meter_figures(runs, wide)
    assert json.loads(json.dumps(figures))[f"{REUSE} {key} @2000"]["n"] == 1
