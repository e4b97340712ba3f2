"""readback.analysis.decisions.bf16_fix_cost: the pre-registered calls on final losses built to cross each
line, the refusals (CPU kinds, commits, a branch that does not continue its base), and the run
records it reads (summaries and launch histories, as the trainer writes them)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from readback.analysis.decisions.bf16_fix_cost import ARMS, branch_check, call, contrasts, decide, judged, refusal
from readback.analysis.decisions.common import figure, side

NOISE = np.array([1, -1, 2, -2, 0.5, -0.5, 1.5, -1.5]) * 0.001
SEEDS = range(700, 708)
COST = 0.007  # about part 8's S0 cost of the BF16 backwards; with NOISE, t far past 2.365


def _table(**costs: float) -> pd.DataFrame:
    """8 seeds: each arm's cost behind R (0 unless given), each arm with its own small noise."""
    base = 4.0 + np.linspace(-0.05, 0.05, 8)
    columns = {"R": base}
    for i, arm in enumerate(ARMS[1:], start=1):
        columns[arm] = base + costs.get(arm, 0.0) + np.roll(NOISE, i)
    return pd.DataFrame(columns, index=pd.Index(SEEDS, name="seed"))[list(ARMS)]


@pytest.mark.parametrize(
    ("costs", "expected"),
    [
        ({}, "void"),
        ({"T": COST, "B": COST, "Tp": COST}, "T and B cost loss; the te reads are the cause"),
        ({"T": COST, "B": COST, "Tp": COST}, "P's rebuild is not shown to be the part"),
        ({"T": COST, "B": COST}, "P's rebuild is the part"),
        ({"T": COST, "B": COST, "Tp": COST / 2}, "P's rebuild carries part of it"),
        ({"T": COST, "Tf": COST, "B": COST, "Bf": COST, "Tp": COST}, "T and B cost loss; neither"),
        ({"T": 2 * COST, "Tf": COST, "Tp": 2 * COST}, "T cost loss; both"),
        ({"B": 0.0016, "Bf": 0.0008}, "B cost loss; not located"),  # t 3.1 against R; 2.0 and 1.6 apart
        ({"T": COST, "B": COST, "Bf": COST, "Tp": COST}, "inconclusive: T and B point at different causes"),
    ],
)
def test_each_outcome_gets_its_pre_registered_call(costs, expected):
    assert expected in call(contrasts(_table(**costs)))


def test_the_p_call_is_made_only_where_t_costs_through_its_reads():
    assert "P's rebuild" not in call(contrasts(_table(B=COST)))


def test_the_lines_are_t_at_the_two_sided_5_percent_point_with_7_df_at_both_ends():
    c = contrasts(_table(T=COST))
    p = c["T - R"]
    d = _table(T=COST)["T"] - _table(T=COST)["R"]
    assert p["mean"] == pytest.approx(d.mean()) and p["se"] == pytest.approx(d.std() / np.sqrt(8))
    assert p["t_two_sided"] == pytest.approx(2.365, abs=5e-4)
    at = dict(p, t=2.3646)
    assert side(at) == "none" and side(dict(p, t=2.366)) == "behind" and side(dict(p, t=-2.366)) == "ahead"


def _runs(table: pd.DataFrame, statuses: dict | None = None) -> pd.DataFrame:
    statuses = statuses or {}
    return pd.DataFrame(
        [
            {"seed": s, "arm": arm, "status": statuses.get((s, arm), "completed"), "val_loss": table.loc[s, arm]}
            for s in table.index
            for arm in ARMS
        ]
    )


def test_a_diverged_run_counts_with_its_last_value_and_a_changed_call_is_inconclusive():
    table = _table(T=COST, B=COST)
    table.loc[700, "Tf"] += 5.0
    result = judged(_runs(table, {(700, "Tf"): "diverged"}), "val_loss", None)
    assert result["seeds"] == list(SEEDS) and result["call"].startswith("inconclusive: the calls")
    running = judged(_runs(_table(T=COST, B=COST), {(701, "B"): "running"}), "val_loss", None)
    assert 701 not in running["seeds"] and running["call"].startswith("T and B cost loss")
    assert judged(_runs(_table().loc[[700]]), "val_loss", None)["call"].startswith("not decided")


def _launch(cpu="AMD EPYC 7B13", isa="AVX2", commit="abc", dirty=False):
    return {"cpu_model": cpu, "cpu_capability": isa, "commit": commit, "dirty": dirty}


def test_launches_on_two_cpu_kinds_or_commits_or_a_broken_branch_are_not_called():
    same = [_launch(), _launch()]
    assert refusal(same, {"same": True}) is None
    assert "span CPU kinds" in refusal([_launch(), _launch(cpu="Intel Xeon", isa="AVX512")], {"same": True})
    assert "span commits" in refusal([_launch(), _launch(commit="def")], {"same": None})
    assert "span commits" in refusal([_launch(dirty=True)], {"same": None})
    assert "does not end where R ends" in refusal(same, {"same": False})
    c = judged(_runs(_table(T=COST)), "val_loss", refusal(same, {"same": False}))
    assert c["call"].startswith("not decided") and c["contrasts"]["T - R"]["t"] > 2.365  # figures still given


def test_the_branch_check_compares_bits():
    runs = pd.DataFrame(
        [
            {"seed": 700, "arm": "R", "status": "completed", "val_loss": 3.9512345},
            {"seed": 700, "arm": "R_branch", "status": "completed", "val_loss": 3.9512345},
        ]
    )
    assert branch_check(runs) == {"seeds": [700], "same": True}
    runs.loc[1, "val_loss"] += 1e-7
    assert branch_check(runs)["same"] is False
    assert branch_check(runs[runs["arm"] == "R"])["same"] is None


def test_figures_carry_two_significant_digits_of_their_se():
    assert figure(0.00012, 0.000031) == "+0.000120 ± 0.000031"
    assert figure(0.0066, 0.0019) == "+0.0066 ± 0.0019"
    assert figure(-0.0125, 0.023) == "-0.013 ± 0.023"


def test_decide_reads_the_records_the_trainer_writes(tmp_path):
    """Run folders as sweeps/bf16_fix_cost.sh lays them out, with launch.json histories."""
    table = _table(T=COST, B=COST)
    for seed in SEEDS:
        for arm in (*ARMS, "R_branch"):
            run = tmp_path / arm / f"seed={seed}"
            run.mkdir(parents=True)
            value = table.loc[seed, "R" if arm == "R_branch" else arm]
            summary = {"status": "completed", "final_loss": value, "val_loss": value, "steps": 2000}
            (run / "summary.json").write_text(json.dumps(summary))
            (run / ".hydra").mkdir()
            (run / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nexperiment: {arm}\n")
            launches = [dict(_launch(), from_step=0, to_step=2000, steps_trained=2000)]
            (run / "launch.json").write_text(json.dumps({**_launch(), "launches": launches}))
    d = decide(tmp_path)
    assert d["branch_check"]["same"] is True and d["cpu"] == ["AMD EPYC 7B13, AVX2"] and d["commits"] == ["abc"]
    assert d["val_loss"]["seeds"] == list(SEEDS) and d["val_loss"]["call"].startswith("T and B cost loss")
    assert d["launches"] == 8 * 7


def test_each_arm_s_meter_figure_is_its_own_policy_s_error():
    from readback.analysis.decisions.bf16_fix_cost import meter_figures

    runs = pd.DataFrame({"run_id": ["r", "b"], "arm": ["R", "B"], "seed": [700, 700]})
    index = pd.MultiIndex.from_tuples([("r", 2000), ("b", 2000)], names=["run", "step"])
    wide = pd.DataFrame(
        {
            "grad_bias_debiased_sq/reuse_rounded/total": [3e-5, 9.0],
            "grad_bias_debiased_sq/original/total": [9.0, 1.1e-4],
        },
        index=index,
    )
    figures = json.loads(json.dumps(meter_figures(runs, wide)))
    assert figures["R grad_bias_debiased_sq/reuse_rounded/total"]["mean"] == 3e-5
    assert figures["B grad_bias_debiased_sq/original/total"]["mean"] == 1.1e-4
    assert figures["T grad_bias_debiased_sq/reuse_rounded/total"]["n"] == 0
