"""readback.analysis: loading sweeps, the final-loss table, plots and the CLI.

Hand-written run dirs (config.yaml / metrics.jsonl / summary.json) cover completed, diverged,
failed-without-summary, failed-with-summary and running runs; one test loads a real tiny sweep
made by train.py (helpers_sweep.real_sweep, shared with test_notebook.py)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers_sweep import EXPERIMENTS, REPO, real_sweep

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
from readback.analysis.__main__ import main as cli_main

TOKENS_PER_STEP = 100
OLD = time.time() - 7 * 24 * 3600  # a week ago: a run without summary this old has failed


def config(experiment: str, seed: int, rounding: str = "nearest", policy: str | None = None, bwd: str = "fp8") -> dict:
    return {
        "model": {"name": "tiny", "n_layers": 2},
        "precision": {"name": "fp8", "rounding": rounding},
        "policy": {"name": policy or experiment},
        "attention": {"bwd_precision": bwd},
        "experiment": experiment,
        "seed": seed,
    }


def records(losses, *, probe_every: int = 20, eval_every: int = 20, every: int = 10, shift: float = 0.0) -> list[dict]:
    """One record per logged step with the keys the trainer writes (a subset of sites)."""
    out = []
    for i, loss in enumerate(losses):
        step = (i + 1) * every
        r = {
            "step": step,
            "loss": loss,
            "lr": 1e-3,
            "tokens": step * TOKENS_PER_STEP,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
            "kurtosis/attn_out_max": 3.0 + i + shift,
            "kurtosis/ffn_in_max": 3.5 + i,
            "attn_rowsum/mean/layers.0.attn.core": -1e-8 * i,
            "attn_rowsum/z/layers.0.attn.core": -float(i) - shift,
            "attn_rowsum/mean/layers.1.attn.core": 1e-9,
            "attn_rowsum/z/layers.1.attn.core": 0.5,
            "fp8_saturation/layers.0.attn.core.output": i,
        }
        if step % eval_every == 0:
            r["val_loss"] = None if loss is None else loss - 0.1
        if step % probe_every == 0:
            for name, scale in (("total", 1.0), ("layers.0.attn.core.dq", 2.0), ("layers.1.attn.core.dq", 3.0)):
                r[f"grad_error/rel_err/{name}"] = 0.01 * scale * (1 + shift)
                r[f"grad_error/cosine/{name}"] = 0.999
                r[f"grad_error/bias/{name}"] = 0.002 * scale * (1 + shift)
                r[f"grad_error/noise/{name}"] = 0.004 * scale
                r[f"grad_error_se/bias/{name}"] = 0.001 * scale
        out.append(r)
    return out


def summary(status: str, final_loss, val_loss, steps: int, experiment: str, diverged_at=None, **extra) -> dict:
    return {
        "status": status,
        "final_loss": final_loss,
        "val_loss": val_loss,
        "steps": steps,
        "tokens": steps * TOKENS_PER_STEP,
        "diverged_at_step": diverged_at,
        "divergence_reason": None,
        "skipped_updates": [],
        "wall_time_s": 12.5,
        "n_params": 1234,
        "experiment": experiment,
        **extra,
    }


def write_run(
    root: Path,
    rel: str,
    cfg: dict | None,
    recs: list[dict] | None,
    summ: dict | None,
    *,
    extra_lines: str = "",
    mtime: float | None = OLD,
) -> Path:
    d = root / rel
    (d / ".hydra").mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    if recs is not None:
        with open(d / "metrics.jsonl", "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
            f.write(extra_lines)
    if summ is not None:
        (d / "summary.json").write_text(json.dumps(summ, indent=2))
    (d / "checkpoints").mkdir(exist_ok=True)
    (d / "checkpoints" / "summary.json").write_text("{}")  # below a run dir: must not be found as a run
    if mtime is not None:
        for p in [d, d / ".hydra", d / "checkpoints", *d.glob("*"), *(d / ".hydra").glob("*")]:
            os.utime(p, (mtime, mtime))
    return d


# final losses of the hand-written study (independent of the code under test)
REUSE_FINAL = [7.3, 7.5]
REUSE_VAL = [7.2, 7.4]
CONTROL_FINAL = [3.25, 3.26]
CONTROL_VAL = [3.15, 3.17]


@pytest.fixture
def sweep(tmp_path) -> Path:
    root = tmp_path / "sweep"
    # reuse_rounded: one completed (high loss), one diverged at step 30 with a NaN loss logged
    # (null in JSON) and a truncated last line
    write_run(
        root,
        "reuse_rounded/seed0/0",
        config("reuse_rounded", 0),
        records([5.0, 4.0, 6.0, 7.0, 7.3], shift=1.0),
        summary("completed", REUSE_FINAL[0], REUSE_VAL[0], 50, "reuse_rounded"),
    )
    write_run(
        root,
        "reuse_rounded/seed1/1",
        config("reuse_rounded", 1),
        records([5.0, 4.1, 9.0, None, 7.5], shift=1.0),
        summary("diverged", REUSE_FINAL[1], REUSE_VAL[1], 50, "reuse_rounded", diverged_at=30),
        extra_lines='{"step": 60, "loss": 7.',
    )
    # no_saved_copy: two completed, one killed (no summary; its files are old) after 2 records
    write_run(
        root,
        "no_saved_copy/seed0/2",
        config("no_saved_copy", 0),
        records([5.0, 4.0, 3.6, 3.4, 3.25]),
        summary("completed", CONTROL_FINAL[0], CONTROL_VAL[0], 50, "no_saved_copy"),
    )
    write_run(
        root,
        "no_saved_copy/seed1/3",
        config("no_saved_copy", 1),
        records([5.0, 4.0, 3.6, 3.4, 3.26]),
        summary("completed", CONTROL_FINAL[1], CONTROL_VAL[1], 50, "no_saved_copy"),
    )
    write_run(root, "no_saved_copy/seed2/4", config("no_saved_copy", 2), records([5.1, 4.2]), None)
    # fresh_reround: one failed with a summary (an exception), one still running (fresh files);
    # the running one has no config: experiment and seed come from the path
    write_run(
        root,
        "fresh_reround/seed0/5",
        config("fresh_reround", 0),
        records([5.0]),
        summary("failed", 5.0, None, 10, "fresh_reround", error="RuntimeError: boom"),
    )
    write_run(root, "fresh_reround/seed1/6", None, records([5.0, 4.5]), None, mtime=None)
    return root


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


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
        assert _is_png(out / f"{name}.png"), name
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
        assert _is_png(paths[name])
    assert "bf16_baseline" in paths["final_loss.md"].read_text()


def test_cli(sweep, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli_main([str(sweep), "--out", str(out), "--x", "step"]) == 0
    printed = capsys.readouterr().out
    assert "| reuse_rounded " in printed and "7 runs" in printed
    for name in ("loss.png", "grad_error.png", "kurtosis.png", "attn_rowsum.png"):
        assert _is_png(out / name)
    assert (out / "final_loss.md").read_text().startswith("| experiment")
    assert len(pd.read_csv(out / "runs.csv")) == 7
    # errors: one line, exit 2
    assert cli_main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli_main([str(tmp_path / "empty")]) == 2
    assert "no runs" in capsys.readouterr().err


def test_cli_module_default_out(sweep):
    proc = subprocess.run(
        [sys.executable, "-m", "readback.analysis", str(sweep)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "analysis" / "final_loss.md").is_file() and _is_png(sweep / "analysis" / "loss.png")
    # the report dir holds no run, so a second pass finds the same runs
    assert len(load_runs(sweep)) == 7


@pytest.mark.slow
def test_real_sweep_loads(tmp_path_factory, tmp_path):
    """2 experiments x 2 seeds, 10 steps of the real train.py (helpers_sweep)."""
    sweep = real_sweep(tmp_path_factory)
    runs = load_runs(sweep)
    s = runs.summary
    assert len(runs) == 4 and set(s["experiment"]) == set(EXPERIMENTS) and runs.group_keys == []
    assert (s["status"] == "completed").all() and (s["steps"] == 10).all() and sorted(s["seed"]) == [0, 0, 1, 1]
    assert set(s["policy"]) == set(EXPERIMENTS) and (s["bwd_precision"] == "fp8").all()
    assert s["final_loss"].notna().all() and s["val_loss"].notna().all()
    assert runs.groups == ["reuse_rounded", "no_saved_copy"]
    keys = set(runs.keys())
    for k in (
        "loss",
        "val_loss",
        "lr",
        "grad_norm",
        "kurtosis/attn_out_max",
        "kurtosis/ffn_in_max",
        "attn_rowsum/z/layers.0.attn.core",
        "attn_rowsum/z/layers.1.attn.core",
        "grad_error/rel_err/total",
        "grad_error/bias/total",
        "grad_error/bias/layers.1.attn.core.dq",
    ):
        assert k in keys, k
    assert sorted(runs.curve("grad_error/rel_err/total")["step"].unique()) == [5, 10]
    assert sorted(runs.curve("loss")["step"].unique()) == [5, 10]
    t = final_loss_table(runs).set_index("group")
    assert (t["n"] == 2).all()
    for exp in EXPERIMENTS:
        assert t.loc[exp, "final_loss_mean"] == pytest.approx(s.loc[s["experiment"] == exp, "final_loss"].mean())
    paths = write_report(runs, tmp_path / "report")
    assert all(_is_png(paths[n]) for n in ("loss", "grad_error", "kurtosis", "attn_rowsum"))
    assert REPO.joinpath("train.py").is_file()
