"""readback.analysis on whole sweeps: ``python -m readback.cli.analysis`` as a process on the
hand-written study, and the loader, tables and report on a real tiny sweep made by train.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from readback.analysis import final_loss_table, load_runs, write_report
from sweeps import EXPERIMENTS, is_png, write_study
from toys import REPO


def test_cli_module_default_out(tmp_path):
    sweep = write_study(tmp_path / "sweep")
    proc = subprocess.run(
        [sys.executable, "-m", "readback.cli.analysis", str(sweep)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "analysis" / "final_loss.md").is_file() and is_png(sweep / "analysis" / "loss.png")
    # the report dir holds no run, so a second pass finds the same runs
    assert len(load_runs(sweep)) == 7


@pytest.mark.slow
def test_real_sweep_loads(real_sweep, tmp_path):
    """2 experiments x 2 seeds, 10 steps of the real train.py (sweeps.make_sweep)."""
    sweep = real_sweep.dir
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
    assert all(is_png(paths[n]) for n in ("loss", "grad_error", "kurtosis", "attn_rowsum"))
    assert REPO.joinpath("train.py").is_file()
