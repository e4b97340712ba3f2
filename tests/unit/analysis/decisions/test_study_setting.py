"""readback.analysis.decisions.study_setting: the pre-registered calls on final losses built to cross each line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from readback.analysis.decisions.study_setting import (
    ARMS,
    BF16_O_FIX,
    CONTROL,
    FRESH,
    MARGIN,
    REUSE,
    TE_FIX,
    call,
    contrasts,
    judged,
    meter_figures,
)

NOISE = np.array([1, -1, 2, -2, 0.5, -0.5, 1.5, -1.5]) * 0.002
SEEDS = range(300, 308)


def _table(reuse: float, fresh: float, te_fix: float, bf16_o_fix: float) -> pd.DataFrame:
    """8 seeds: each arm's gap behind the control, each pair with its own small noise."""
    control = 4.0 + np.linspace(-0.05, 0.05, 8)
    noises = {REUSE: NOISE, FRESH: NOISE[::-1], TE_FIX: np.roll(NOISE, 1), BF16_O_FIX: np.roll(NOISE, 3)}
    gaps = {REUSE: reuse, FRESH: fresh, TE_FIX: te_fix, BF16_O_FIX: bf16_o_fix}
    columns = {CONTROL: control} | {arm: control + gaps[arm] + noises[arm] for arm in gaps}
    return pd.DataFrame(columns, index=pd.Index(SEEDS, name="seed"))[list(ARMS)]


@pytest.mark.parametrize(
    ("test", "gaps", "expected"),
    [
        ("S14", (0.0, 0.0, 0.0, 0.0), "void"),
        ("S14", (0.014, 0.0, 0.014, 0.0), "only the BF16-O fix helps"),
        ("S14", (0.014, 0.0, 0.014, 0.014), "neither fix helps"),
        ("S14", (0.014, 0.0, 0.0, 0.0), "both fixes help"),
        ("S14", (0.014, 0.0, 0.0, 0.014), "inconclusive: only TE's fix helps"),
        ("S0", (0.0, 0.0, 0.0, 0.0), "no loss cost of the reuse detected"),
        ("S0", (0.014, 0.014, 0.014, 0.0), "the reuse costs loss without stress; only the BF16-O fix helps"),
        ("S0", (0.014, 0.0, 0.014, 0.014), "the reuse costs loss without stress; neither fix helps"),
    ],
)
def test_each_outcome_gets_its_pre_registered_call(test, gaps, expected):
    assert call(test, contrasts(_table(*gaps))).startswith(expected)


def test_contrasts_are_seed_paired_t_with_7_df_and_tost_uses_the_90_percent_interval():
    table = _table(0.014, 0.0, 0.014, 0.0)
    c = contrasts(table)
    p = c[f"{REUSE} - {CONTROL}"]
    d = table[REUSE] - table[CONTROL]
    assert p["mean"] == pytest.approx(d.mean()) and p["se"] == pytest.approx(d.std() / np.sqrt(8))
    assert p["t_two_sided"] == pytest.approx(2.365, abs=5e-4) and p["t_one_sided"] == pytest.approx(1.895, abs=5e-4)
    for q in c.values():
        assert q["equivalent"] is bool(q["ci90"][0] > -MARGIN and q["ci90"][1] < MARGIN)


def _runs(table: pd.DataFrame, statuses: dict | None = None, cpus: dict | None = None) -> pd.DataFrame:
    statuses, cpus = statuses or {}, cpus or {}
    return pd.DataFrame(
        [
            {
                "seed": s,
                "experiment": arm,
                "status": statuses.get((s, arm), "completed"),
                "cpu": cpus.get((s, arm), "AMD EPYC, AVX512"),
                "val_loss": table.loc[s, arm],
            }
            for s in table.index
            for arm in ARMS
        ]
    )


def test_a_diverged_run_counts_with_its_last_value_and_a_changed_call_is_inconclusive():
    table = _table(0.014, 0.0, 0.014, 0.014)
    table.loc[300, REUSE] += 5.0  # a diverged run's last loss
    runs = _runs(table, {(300, REUSE): "diverged"})
    result = judged(runs, "S14", "val_loss")
    assert result["seeds"] == list(SEEDS)
    assert result["call"].startswith("inconclusive: the calls with and without diverged runs differ")
    unmoved = judged(_runs(_table(0.014, 0.0, 0.014, 0.014), {(301, FRESH): "running"}), "S14", "val_loss")
    assert 301 not in unmoved["seeds"] and unmoved["call"].startswith("neither fix helps")
    one_seed = _runs(_table(0.014, 0.0, 0.014, 0.014).loc[[300]])
    assert judged(one_seed, "S14", "val_loss")["call"].startswith("not decided")


def test_a_test_whose_runs_span_cpu_kinds_is_not_called():
    table = _table(0.014, 0.0, 0.014, 0.014)
    assert judged(_runs(table), "S14", "val_loss")["cpu"] == ["AMD EPYC, AVX512"]
    mixed = judged(_runs(table, cpus={(303, FRESH): "Intel Xeon, AVX512"}), "S14", "val_loss")
    assert mixed["call"] == "not decided: its runs span CPU kinds (AMD EPYC, AVX512; Intel Xeon, AVX512)"


def test_meter_figures_are_plain_json_per_arm_layer_and_step():
    runs = pd.DataFrame({"run_id": ["a", "b"], "experiment": [REUSE, FRESH], "seed": [300, 300]})
    keys = [
        f"{stat}/{read}/{layer}"
        for stat in ("grad_bias_debiased_sq", "grad_bias_projection")
        for read in ("contrib.exact_read.attention.D", "contrib.fresh_reround")
        for layer in ("layers.0.attn.qkv", "layers.1.attn.qkv")
    ]
    index = pd.MultiIndex.from_tuples([("a", 2000), ("b", 2000)], names=["run", "step"])
    wide = pd.DataFrame({k: [0.1, 0.2] for k in keys}, index=index)
    figures = json.loads(json.dumps(meter_figures(runs, wide)))
    assert figures[f"{REUSE} grad_bias_projection/contrib.exact_read.attention.D/layers.1.attn.qkv @2000"]["n"] == 1
    assert figures[f"{FRESH} grad_bias_debiased_sq/contrib.fresh_reround/layers.0.attn.qkv @2000"]["mean"] == 0.2
    assert figures[f"{TE_FIX} grad_bias_projection/contrib.exact_read.attention.D/layers.1.attn.qkv @2000"]["n"] == 0
