"""Grouping by varying overrides, the paired-seed comparison, --metric, --wandb (a stub API, no
network) and the Markdown page (the HTML report in a browser: tests/integration/test_report_browser.py)."""

from __future__ import annotations

import math
import os
import re

import pytest
import yaml

from readback.analysis import final_loss_table, format_final_loss_table, load_runs, paired_table, runs_from_records
from readback.analysis.paired import axis_table, paired_curve, t_quantile
from readback.analysis.plots import plot_paired_gap
from readback.cli.analysis import main as cli_main
from sweeps import EXPERIMENTS, config, records, summary, write_run

# final losses by (experiment, lr, seed): seeds share a large offset (init, data order) that
# pairing cancels; reuse is 0.015 worse at lr 1e-3 for every seed; lr 3e-2 diverges for reuse.
SEED_OFFSET = {0: 0.0, 1: 0.3, 2: -0.25}
FINAL = {("no_saved_copy", "0.001", s): 4.0 + o for s, o in SEED_OFFSET.items()}
FINAL.update({("reuse_rounded", "0.001", s): 4.015 + o + 0.001 * s for s, o in SEED_OFFSET.items()})
FINAL.update({("no_saved_copy", "0.03", s): 3.8 + o for s, o in SEED_OFFSET.items()})
FINAL.update({("reuse_rounded", "0.03", s): 7.3 + o for s, o in SEED_OFFSET.items()})


@pytest.fixture
def lr_sweep(tmp_path):
    root = tmp_path / "lr_sweep"
    for (exp, lr, seed), loss in FINAL.items():
        d = write_run(
            root,
            f"{exp}/seed={seed},trainer.optim.lr={lr}",
            config(exp, seed),
            records([5.0, loss]),
            summary("completed", loss, loss - 0.1, 20, exp),
        )
        overrides = [
            f"+experiment={exp}",
            f"seed={seed}",
            f"trainer.optim.lr={lr}",
            "trainer.resume=true",
            "model=tiny",
        ]
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return root


def test_groups_split_on_every_varying_override_but_the_seed(lr_sweep):
    runs = load_runs(lr_sweep)
    assert runs.group_keys == ["trainer.optim.lr"]  # not seed, not resume, not the constant model
    assert runs.groups == [
        f"{e} [trainer.optim.lr={lr}]" for e in ("reuse_rounded", "no_saved_copy") for lr in ("0.001", "0.03")
    ]
    t = final_loss_table(runs).set_index("group")
    assert t.loc["reuse_rounded [trainer.optim.lr=0.03]", "final_loss_mean"] == pytest.approx(
        sum(FINAL[("reuse_rounded", "0.03", s)] for s in SEED_OFFSET) / 3
    )
    assert (t["n"] == 3).all()


def _paired(group: tuple[str, str], base: tuple[str, str]) -> tuple[float, float]:
    """Mean and SE over the seeds of FINAL[group] - FINAL[base], by hand."""
    d = [FINAL[(*group, s)] - FINAL[(*base, s)] for s in SEED_OFFSET]
    mean = sum(d) / len(d)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))


def test_an_axis_is_compared_within_each_experiment_by_seed_pairs(lr_sweep, tmp_path, capsys):
    """``--pair-axis``: each lr 0.03 group against its own experiment's lr 0.001 group, seed by
    seed, with the 90 % Student-t interval (2 degrees of freedom: t = 2.920)."""
    table = axis_table(load_runs(lr_sweep), "trainer.optim.lr", "0.001").set_index(["group", "metric"])
    assert (
        sorted(g for g, _ in table.index)
        == ["no_saved_copy [trainer.optim.lr=0.03]"] * 2 + ["reuse_rounded [trainer.optim.lr=0.03]"] * 2
    )
    row = table.loc[("reuse_rounded [trainer.optim.lr=0.03]", "final_loss")]
    assert row["base"] == "reuse_rounded [trainer.optim.lr=0.001]" and row["n_pairs"] == 3
    mean, se = _paired(("reuse_rounded", "0.03"), ("reuse_rounded", "0.001"))
    assert row["paired_mean"] == pytest.approx(mean) and row["paired_se"] == pytest.approx(se)
    assert (row["low"], row["high"]) == pytest.approx((mean - 2.920 * se, mean + 2.920 * se), abs=1e-3 * se)
    assert cli_main([str(lr_sweep), "--out", str(tmp_path / "out"), "--pair-axis", "trainer.optim.lr=0.001"]) == 0
    assert "reuse_rounded [trainer.optim.lr=0.001]" in (tmp_path / "out" / "paired_axis.md").read_text()
    assert cli_main([str(lr_sweep), "--pair-axis", "trainer.optim.lr"]) == 2
    assert "KEY=BASE" in capsys.readouterr().err


@pytest.mark.parametrize("level, df, t", [(0.90, 1, 6.314), (0.90, 2, 2.920), (0.95, 15, 2.131), (0.99, 30, 2.750)])
def test_t_quantile_matches_the_tables(level, df, t):
    assert t_quantile(level, df) == pytest.approx(t, abs=5e-4)


def test_paired_differences_against_the_control(lr_sweep):
    runs = load_runs(lr_sweep)
    p = paired_table(runs, "no_saved_copy").set_index(["group", "metric"])
    row = p.loc[("reuse_rounded [trainer.optim.lr=0.001]", "final_loss")]
    assert row["control"] == "no_saved_copy [trainer.optim.lr=0.001]" and row["n_pairs"] == 3
    mean, se = _paired(("reuse_rounded", "0.001"), ("no_saved_copy", "0.001"))
    assert row["paired_mean"] == pytest.approx(mean) and row["paired_se"] == pytest.approx(se)
    a = [FINAL[("reuse_rounded", "0.001", s)] for s in SEED_OFFSET]
    b = [FINAL[("no_saved_copy", "0.001", s)] for s in SEED_OFFSET]
    var = lambda v: sum((x - sum(v) / 3) ** 2 for x in v) / 2  # noqa: E731
    assert row["unpaired_mean"] == pytest.approx(mean)
    assert row["unpaired_se"] == pytest.approx(math.sqrt(var(a) / 3 + var(b) / 3))
    # the seed offsets hide the effect unpaired (< 1 SE); paired it is many SEs
    assert abs(row["unpaired_z"]) < 1 and row["paired_z"] > 10
    assert p.loc[("reuse_rounded [trainer.optim.lr=0.001]", "val_loss"), "paired_mean"] == pytest.approx(mean)
    assert not any(g.startswith("no_saved_copy") for g, _ in p.index)
    md = format_final_loss_table(final_loss_table(runs), paired=paired_table(runs, "no_saved_copy"))
    line = next(x for x in md.splitlines() if x.startswith("| reuse_rounded [trainer.optim.lr=0.001]"))
    assert f"{mean:+.3f} ± {se:.3f} (n=3, {mean / se:.1f} SE)" in line
    assert "Δ final, paired" in md and "Δ val, unpaired" in md


def test_paired_drops_seeds_without_a_partner():
    def entry(exp, seed, loss):
        return {
            "run_id": f"{exp}/{seed}",
            "config": config(exp, seed),
            "records": records([loss]),
            "summary": summary("completed", loss, None, 10, exp),
        }

    runs = runs_from_records(
        [
            entry("reuse_rounded", 0, 4.1),
            entry("reuse_rounded", 1, 4.3),
            entry("no_saved_copy", 0, 4.0),
            entry("no_saved_copy", 2, 9.0),
        ]
    )
    row = paired_table(runs, "no_saved_copy").set_index("metric").loc["final_loss"]
    assert row["n_pairs"] == 1 and row["paired_mean"] == pytest.approx(0.1) and math.isnan(row["paired_se"])
    assert row["unpaired_mean"] == pytest.approx(4.2 - 6.5)


def test_the_paired_gap_at_every_evaluation_pairs_seed_by_seed(tmp_path):
    """val_loss = loss - 0.1 at steps 20 and 40 (records()); the gap is group minus control at
    each step over the seeds both ran."""

    def entry(exp, seed, losses):
        return {
            "run_id": f"{exp}/{seed}",
            "config": config(exp, seed),
            "records": records(losses),
            "summary": summary("completed", losses[-1], losses[-1] - 0.1, 40, exp),
        }

    runs = runs_from_records(
        [
            entry("reuse_rounded", 0, [5.0, 4.5, 4.2, 4.0]),
            entry("reuse_rounded", 1, [5.0, 4.6, 4.3, 4.2]),
            entry("no_saved_copy", 0, [5.0, 4.4, 4.2, 3.9]),
            entry("no_saved_copy", 1, [5.0, 4.4, 4.2, 4.0]),
            entry("no_saved_copy", 2, [9.0, 9.0, 9.0, 9.0]),  # no partner
        ]
    )
    gap = paired_curve(runs, "no_saved_copy").set_index("step")
    assert list(gap.index) == [20, 40] and set(gap["n_pairs"]) == {2}
    assert gap.loc[20, "mean"] == pytest.approx(0.15) and gap.loc[20, "se"] == pytest.approx(0.05)
    assert gap.loc[40, "mean"] == pytest.approx(0.15) and gap.loc[40, "se"] == pytest.approx(0.05)
    plot_paired_gap(gap.reset_index(), tmp_path / "gap.png")
    assert (tmp_path / "gap.png").stat().st_size > 0


def test_cli_metric_control_and_groups(lr_sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main([str(lr_sweep), "--out", str(out), "--metric", "kurtosis/*", "--control", "no_saved_copy"]) == 0
    text = capsys.readouterr().out
    assert "grouped by: experiment, trainer.optim.lr (seeds pooled)" in text
    assert "kurtosis/attn_out_max" in text and (out / "metric_kurtosis__.png").is_file()
    assert "Δ final, paired" in (out / "final_loss.md").read_text()
    assert len((out / "paired.csv").read_text().splitlines()) == 1 + 4  # 2 groups x 2 metrics
    assert (out / "paired_gap.png").is_file() and "val_loss" in (out / "paired_curve.csv").read_text()
    assert "![paired gap](paired_gap.png)" in (out / "report.md").read_text()  # on the page, not only on disk
    assert cli_main([str(lr_sweep), "--out", str(out), "--control", "nope"]) == 2
    assert "--control 'nope' is not a loaded experiment" in capsys.readouterr().err


class _StubRun:
    def __init__(self, exp, seed, loss):
        self.path = ["ent", "proj", f"{exp[:3]}{seed}"]
        self.state = "finished"
        self.config = {
            "experiment": {"value": exp},
            "seed": seed,
            "policy": {"name": exp},
            "launch": {
                "overrides": [f"+experiment={exp}", f"seed={seed}"],
                "host": "node7",
                "cpus": 8,
                "gpus": ["H100"],
                "platform": "Linux",
                "torch": "2.13.0",
                "python": "3.11",
                "code": {"commit": "0123456789abcdef0123", "dirty": seed == 1},
            },
        }
        self.summary = {"status": "completed", "final_loss": loss, "val_loss": loss - 0.1, "steps": 20, "_step": 1}
        self._hist = [
            {"_step": 0, "step": 10, "loss": 5.0, "tokens": 1000},
            {"_step": 1, "step": 20, "loss": loss, "tokens": 2000},
        ]

    def scan_history(self):
        return iter(self._hist)


def test_cli_reads_a_wandb_project_through_the_loader(monkeypatch, tmp_path, capsys):
    import wandb

    asked = {}

    class StubApi:
        def __init__(self, timeout=None):
            pass

        def runs(self, path, filters=None):
            asked["path"] = path
            return [
                _StubRun(e, s, 4.0 + 0.1 * s + (0.02 if e == "reuse_rounded" else 0))
                for e in EXPERIMENTS
                for s in (0, 1)
            ]

    monkeypatch.setattr(wandb, "Api", StubApi)
    out = tmp_path / "w"
    assert cli_main(["--wandb", "ent/proj", "--out", str(out), "--html"]) == 0
    assert asked["path"] == "ent/proj"
    text = capsys.readouterr().out
    row = next(x for x in text.splitlines() if x.startswith("| reuse_rounded "))
    assert "+0.020 ± 0.000 (n=2" in row
    page = (out / "report.html").read_text()
    assert "node7: 8 CPUs, H100" in page
    assert "0123456789ab with uncommitted changes" in page and "<code>0123456789ab</code>" in page
    assert cli_main([]) == 2 and cli_main(["x", "--wandb", "a/b"]) == 2


def test_page_elsewhere_links_its_figures_relative_to_itself(lr_sweep, tmp_path):
    out, page = tmp_path / "docs" / "results" / "study", tmp_path / "docs" / "results" / "study.md"
    assert cli_main([str(lr_sweep), "--out", str(out), "--page", str(page), "--title", "A study"]) == 0
    text = page.read_text()
    assert text.startswith("# A study\n") and "## Final loss" in text and "## Runs" in text
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert links and all(not os.path.isabs(x) and (page.parent / x).is_file() for x in links), links
    assert "study/loss.png" in links and not (out / "report.md").exists()
