"""readback.analysis: loading sweeps, the final-loss table, plots and the CLI.

Hand-written run dirs (sweeps.write_study) cover completed, diverged, failed-without-summary,
failed-with-summary and running runs; the module CLI and a real sweep of train.py are in
tests/integration/test_analysis_sweeps.py."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from readback.analysis import (
    final_loss_table,
    find_run_dirs,
    format_final_loss_table,
    load_runs,
    markdown_table,
    plot_attn_rowsum,
    plot_grad_error,
    plot_kurtosis,
    plot_loss,
    runs_from_records,
    write_report,
)
from readback.cli.analysis import main as cli_main
from sweeps import (
    CONTROL_FINAL,
    CONTROL_VAL,
    REUSE_FINAL,
    REUSE_VAL,
    TOKENS_PER_STEP,
    config,
    is_png,
    records,
    summary,
    write_run,
    write_study,
)


@pytest.fixture
def sweep(tmp_path) -> Path:
    return write_study(tmp_path / "sweep")


def test_find_run_dirs_stops_at_run_dirs(sweep):
    dirs = find_run_dirs(sweep)
    assert [d.relative_to(sweep).as_posix() for d in dirs] == [
        "fresh_reround/seed0/5",
        "fresh_reround/seed1/6",
        "no_saved_copy/seed0/2",
        "no_saved_copy/seed1/3",
        "no_saved_copy/seed2/4",
        "reuse_rounded/seed0/0",
        "reuse_rounded/seed1/1",
    ]
    with pytest.raises(FileNotFoundError):
        find_run_dirs(sweep / "nope")


def test_load_runs_summary(sweep):
    runs = load_runs(sweep)
    s = runs.summary
    assert len(runs) == 7
    assert runs.groups == ["reuse_rounded", "fresh_reround", "no_saved_copy"]  # the study's order
    status = s["status"].to_dict()
    assert status == {
        "fresh_reround/seed0/5": "failed",
        "fresh_reround/seed1/6": "running",
        "no_saved_copy/seed0/2": "completed",
        "no_saved_copy/seed1/3": "completed",
        "no_saved_copy/seed2/4": "failed",
        "reuse_rounded/seed0/0": "completed",
        "reuse_rounded/seed1/1": "diverged",
    }
    r = s.loc["reuse_rounded/seed1/1"]
    assert r["diverged"] and r["diverged_at_step"] == 30 and r["final_loss"] == 7.5 and r["bad_lines"] == 1
    assert (r["experiment"], r["seed"], r["model"], r["rounding"], r["policy"], r["bwd_precision"]) == (
        "reuse_rounded",
        1,
        "tiny",
        "nearest",
        "reuse_rounded",
        "fp8",
    )
    assert not s.loc["reuse_rounded/seed0/0", "diverged"]
    killed = s.loc["no_saved_copy/seed2/4"]  # no summary: last logged loss and step
    assert killed["final_loss"] == 4.2 and killed["steps"] == 20 and killed["last_step"] == 20
    assert killed["val_loss"] == pytest.approx(4.1) and pd.isna(killed["wall_time_s"])
    running = s.loc["fresh_reround/seed1/6"]
    assert (running["experiment"], running["seed"]) == ("fresh_reround", 1)
    assert s.loc["fresh_reround/seed0/5", "error"] == "RuntimeError: boom"
    # without the running window, an unfinished run is failed
    assert load_runs(sweep, running_within_s=0).summary.loc["fresh_reround/seed1/6", "status"] == "failed"


def test_load_runs_metrics(sweep):
    runs = load_runs(sweep)
    m = runs.metrics
    assert list(m.columns) == ["run", "experiment", "group", "seed", "step", "tokens", "key", "value"]
    div = m[(m["run"] == "reuse_rounded/seed1/1")]
    loss = div[div["key"] == "loss"].set_index("step")["value"]
    assert list(loss.index) == [10, 20, 30, 40, 50]  # the truncated step-60 line is skipped
    assert math.isnan(loss[40]) and loss[30] == 9.0  # a logged null is a NaN row
    assert (div["tokens"] == div["step"] * TOKENS_PER_STEP).all()
    # keys logged only on probe steps have rows only there
    ge = div[div["key"] == "grad_error/bias/total"]
    assert list(ge["step"]) == [20, 40]
    assert "grad_error/rel_err/layers.1.attn.core.dq" in runs.keys("grad_error/*")
    assert runs.keys("attn_rowsum/z/*") == ["attn_rowsum/z/layers.0.attn.core", "attn_rowsum/z/layers.1.attn.core"]
    curve = runs.curve("loss")
    assert np.isfinite(curve["value"]).all() and len(curve) == 5 + 4 + 5 + 5 + 2 + 1 + 2
    wide = runs.wide(["loss", "grad_error/bias/total"])
    assert wide.loc[("reuse_rounded/seed0/0", 20), "grad_error/bias/total"] == pytest.approx(0.004)
    assert math.isnan(wide.loc[("reuse_rounded/seed0/0", 10), "grad_error/bias/total"])
    assert set(wide.columns) >= {"experiment", "group", "seed", "tokens", "loss", "grad_error/bias/total"}
    # key filter
    small = load_runs(sweep, keys=["loss", "val_loss"])
    assert set(small.metrics["key"].astype(str)) == {"loss", "val_loss"}
    # select
    sub = runs.select(experiments=["no_saved_copy"], status=["completed"])
    assert len(sub) == 2 and set(sub.metrics["run"].astype(str)) == {"no_saved_copy/seed0/2", "no_saved_copy/seed1/3"}


def test_final_loss_table_numbers(sweep):
    t = final_loss_table(load_runs(sweep)).set_index("group")
    assert list(t.index) == ["reuse_rounded", "fresh_reround", "no_saved_copy"]
    reuse, control, fresh = t.loc["reuse_rounded"], t.loc["no_saved_copy"], t.loc["fresh_reround"]
    assert reuse["final_loss_mean"] == pytest.approx(statistics.mean(REUSE_FINAL))
    assert reuse["final_loss_std"] == pytest.approx(statistics.stdev(REUSE_FINAL))
    assert reuse["val_loss_mean"] == pytest.approx(statistics.mean(REUSE_VAL))
    assert reuse["val_loss_std"] == pytest.approx(statistics.stdev(REUSE_VAL))
    assert (reuse["n_runs"], reuse["n"], reuse["n_diverged"], reuse["diverged_at_steps"]) == (2, 2, 1, [30])
    # the killed run counts as failed and stays out of the means
    assert control["final_loss_mean"] == pytest.approx(statistics.mean(CONTROL_FINAL))
    assert control["final_loss_std"] == pytest.approx(statistics.stdev(CONTROL_FINAL))
    assert control["val_loss_mean"] == pytest.approx(statistics.mean(CONTROL_VAL))
    assert (control["n_runs"], control["n"], control["n_failed"], control["n_diverged"]) == (3, 2, 1, 0)
    assert (fresh["n"], fresh["n_failed"], fresh["n_running"]) == (0, 1, 1)
    assert math.isnan(fresh["final_loss_mean"]) and math.isnan(fresh["final_loss_std"])

    md = format_final_loss_table(final_loss_table(load_runs(sweep)))
    lines = md.splitlines()
    assert lines[0].split("|")[1].strip() == "experiment" and "failed / running" in lines[0]
    row = next(line for line in lines if line.startswith("| reuse_rounded "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["reuse_rounded", "2", "7.400 ± 0.141 †", "7.300 ± 0.141", "1/2 (step 30)", "0 / 0"]
    row = next(line for line in lines if line.startswith("| no_saved_copy "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["no_saved_copy", "2 of 3", "3.255 ± 0.007", "3.160 ± 0.014", "0/3", "1 / 0"]
    row = next(line for line in lines if line.startswith("| fresh_reround "))
    assert [c.strip() for c in row.strip("|").split("|")][2:4] == ["-", "-"]
    assert "† at least one seed diverged" in md


def test_single_seed_has_no_std(tmp_path):
    write_run(
        tmp_path,
        "a/seed0/0",
        config("reuse_rounded", 0),
        records([5.0, 7.314]),
        summary("diverged", 7.314, None, 20, "reuse_rounded", diverged_at=20),
    )
    write_run(
        tmp_path,
        "b/seed0/1",
        config("no_saved_copy", 0),
        records([5.0, 3.256]),
        summary("completed", 3.256, 3.2, 20, "no_saved_copy"),
    )
    table = final_loss_table(load_runs(tmp_path))
    assert math.isnan(table.loc[0, "final_loss_std"])
    md = format_final_loss_table(table)
    assert "| 7.314 † |" in md.replace("  ", " ").replace("  ", " ") or "7.314 †" in md
    assert "3.256 " in md and "±" not in md.split("\n\n")[0]
    assert "failed / running" not in md


def test_groups_split_on_varying_axes(tmp_path):
    write_run(
        tmp_path,
        "r/seed0/0",
        config("reuse_rounded", 0, rounding="nearest"),
        records([5.0, 4.0]),
        summary("completed", 4.0, 3.9, 20, "reuse_rounded"),
    )
    write_run(
        tmp_path,
        "r/seed0/1",
        config("reuse_rounded", 0, rounding="stochastic"),
        records([5.0, 4.5]),
        summary("completed", 4.5, 4.4, 20, "reuse_rounded"),
    )
    write_run(
        tmp_path,
        "n/seed0/2",
        config("no_saved_copy", 0),
        records([5.0, 4.0]),
        summary("completed", 4.0, 3.9, 20, "no_saved_copy"),
    )
    runs = load_runs(tmp_path)
    assert runs.groups == ["reuse_rounded [rounding=nearest]", "reuse_rounded [rounding=stochastic]", "no_saved_copy"]
    t = final_loss_table(runs, by="experiment").set_index("group")
    assert t.loc["reuse_rounded", "final_loss_mean"] == pytest.approx(4.25) and t.loc["reuse_rounded", "n"] == 2


def test_several_sweep_dirs_are_prefixed(tmp_path):
    for name in ("s1", "s2"):
        write_run(
            tmp_path / name,
            "x/seed0/0",
            config("no_saved_copy", 0),
            records([5.0]),
            summary("completed", 5.0, None, 10, "no_saved_copy"),
        )
    runs = load_runs(tmp_path / "s1", tmp_path / "s2")
    assert sorted(runs.summary.index) == ["s1/x/seed0/0", "s2/x/seed0/0"]
    assert final_loss_table(runs).loc[0, "n"] == 2
    with pytest.raises(ValueError):
        load_runs()


def test_runs_from_records_like_wandb():
    """load_wandb's conversion (no network): underscore keys dropped, unfinished state kept."""
    hist = [
        {"_step": 0, "_runtime": 1.0, "step": 10, "loss": 5.0, "tokens": 1000, "note": "text"},
        {"_step": 1, "step": 20, "loss": 4.0, "tokens": 2000, "val_loss": 3.9, "note": "x"},
    ]
    runs = runs_from_records(
        [
            dict(
                run_id="ent/proj/abc",
                config=config("fresh_reround", 3),
                summary=None,
                records=hist,
                status_without_summary="running",
            ),
        ]
    )
    s = runs.summary.loc["ent/proj/abc"]
    assert (s["status"], s["experiment"], s["seed"], s["final_loss"], s["val_loss"], s["steps"]) == (
        "running",
        "fresh_reround",
        3,
        4.0,
        3.9,
        20,
    )
    assert set(runs.metrics["key"].astype(str)) == {"loss", "val_loss"}


def test_markdown_table():
    text = markdown_table(["a", "bb"], [["x|y", 1.5], ["long cell", float("nan")]], align=["l", "r"])
    lines = text.splitlines()
    assert lines[0] == "| a         |  bb |"
    assert lines[1] == "| :-------- | --: |"
    assert lines[2] == "| x\\|y      | 1.5 |"
    assert lines[3] == "| long cell |   - |"
    with pytest.raises(ValueError):
        markdown_table(["a"], [["1", "2"]])


@pytest.mark.parametrize("x,band", [("tokens", "minmax"), ("step", "std"), ("tokens", None)])
def test_plots_write_pngs(sweep, tmp_path, x, band):
    runs = load_runs(sweep)
    out = tmp_path / "figs"
    figs = {
        "loss": plot_loss(runs, x=x, band=band, path=out / "loss.png"),
        "grad_error": plot_grad_error(runs, x=x, band=band, path=out / "grad_error.png"),
        "kurtosis": plot_kurtosis(runs, x=x, band=band, path=out / "kurtosis.png"),
        "attn_rowsum": plot_attn_rowsum(runs, x=x, band=band, path=out / "attn_rowsum.png"),
    }
    for name, fig in figs.items():
        assert is_png(out / f"{name}.png"), name
        assert fig.axes
    # loss: one mean line per group (3), diverged 'x' and open-circle marks for unfinished runs
    ax = figs["loss"].axes[0]
    assert ax.get_xlabel() == x
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "reuse_rounded (n=2, 1 diverged)" in labels and "run marked diverged" in labels
    assert any(line.get_marker() == "x" for line in ax.get_lines())
    # the diverged run is marked at its last finite point at or before step 30
    xs = [line.get_xdata()[0] for line in ax.get_lines() if line.get_marker() == "x"]
    assert xs == [30 * (TOKENS_PER_STEP if x == "tokens" else 1)]
    # grad error: rows total + 2 dq sites, columns rel_err and bias, log scale
    titles = [a.get_title() for a in figs["grad_error"].axes if a.get_visible()]
    assert titles == [
        "rel_err / total",
        "bias / total",
        "rel_err / layers.0.attn.core.dq",
        "bias / layers.0.attn.core.dq",
        "rel_err / layers.1.attn.core.dq",
        "bias / layers.1.attn.core.dq",
    ]
    assert figs["grad_error"].axes[0].get_yscale() == "log"
    assert len([a for a in figs["attn_rowsum"].axes if a.get_visible()]) == 2
    assert len([a for a in figs["kurtosis"].axes if a.get_visible()]) == 2


def test_loss_mean_and_band_values(sweep):
    runs = load_runs(sweep).select(experiments=["no_saved_copy"])
    ax = plot_loss(runs, x="step", band="minmax").axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("no_saved_copy"))
    # steps 10, 20 have three runs (the killed one included), later steps two
    assert list(line.get_xdata()) == [10, 20, 30, 40, 50]
    assert line.get_ydata()[0] == pytest.approx(statistics.mean([5.0, 5.0, 5.1]))
    assert line.get_ydata()[4] == pytest.approx(statistics.mean([3.25, 3.26]))


def test_plots_without_probe_or_stats(tmp_path):
    recs = [{"step": s, "loss": 5.0 - s / 100, "tokens": s * 10} for s in (10, 20)]
    write_run(
        tmp_path, "e/seed0/0", config("bf16_baseline", 0), recs, summary("completed", 4.8, None, 20, "bf16_baseline")
    )
    runs = load_runs(tmp_path)
    paths = write_report(runs, tmp_path / "out")
    for name in ("loss", "grad_error", "kurtosis", "attn_rowsum"):
        assert is_png(paths[name])
    assert "bf16_baseline" in paths["final_loss.md"].read_text()


def test_cli(sweep, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli_main([str(sweep), "--out", str(out), "--x", "step"]) == 0
    printed = capsys.readouterr().out
    assert "| reuse_rounded " in printed and "7 runs" in printed
    for name in ("loss.png", "grad_error.png", "kurtosis.png", "attn_rowsum.png"):
        assert is_png(out / name)
    assert (out / "final_loss.md").read_text().startswith("| experiment")
    assert len(pd.read_csv(out / "runs.csv")) == 7
    # errors: one line, exit 2
    assert cli_main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli_main([str(tmp_path / "empty")]) == 2
    assert "no runs" in capsys.readouterr().err


def test_a_torn_and_repeated_log_counts_each_step_once(tmp_path):
    """A run killed mid-line after resuming from a checkpoint older than its log (steps 30-40
    written twice, the first copies by the killed attempt) and never resumed again: tables, plots
    and the report read it without a traceback, each step once, the last record of a step kept."""
    first = records([5.0, 4.9, 4.8, 4.7])  # steps 10..40
    again = [{**r, "loss": r["loss"] - 0.5} for r in first if r["step"] >= 30]
    write_run(
        tmp_path,
        "no_saved_copy/seed0",
        config("no_saved_copy", 0),
        first + again,
        None,
        extra_lines='{"step": 50, "loss": 4.',
    )
    runs = load_runs(tmp_path)
    row = runs.summary.iloc[0]
    assert row["bad_lines"] == 1 and row["last_step"] == 40 and row["status"] == "failed"
    loss = runs.curve("loss")
    assert list(loss["step"]) == [10, 20, 30, 40]
    assert list(loss["value"]) == pytest.approx([r["loss"] for r in first[:2] + again])
    assert row["final_loss"] == pytest.approx(again[-1]["loss"])
    assert runs.wide().index.is_unique
    table = final_loss_table(runs)
    assert "no_saved_copy" in format_final_loss_table(table)
    paths = write_report(runs, tmp_path / "out")
    assert is_png(paths["loss"])


def test_each_run_carries_its_cpu_kind_from_launch_json():
    """Kinds differ in bits: a test's runs are checked for one kind by this column."""
    launches = {"amd": {"cpu_model": "AMD EPYC", "cpu_capability": "AVX512"}, "old": {"host": "vm"}}
    runs = runs_from_records(
        [
            dict(run_id=r, config=config("reuse_rounded", 0), summary=None, records=[], launch=launch)
            for r, launch in launches.items()
        ]
    )
    assert runs.summary.loc["amd", "cpu"] == "AMD EPYC, AVX512"
    assert pd.isna(runs.summary.loc["old", "cpu"])
