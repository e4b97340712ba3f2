"""wandb as its users expect, read back from what wandb wrote offline (no network), and sweep
folders named by their overrides.

The 2 x 2 sweep of sweeps.make_sweep (2 experiments x 2 seeds, wandb offline) is made once; one
test then extends a copy of it by a seed, which also restarts the finished runs (``trainer.resume=true``):
they stay in their folders and keep their wandb run ids."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from readback.analysis import load_runs
from readback.sync import OFFLINE_FOLDER, offline_folders, read_offline_run
from sweeps import EXPERIMENTS, SEEDS, STEPS, run_train, sweep_args


def _runs_by_name(sweep):
    out = {}
    for folder in offline_folders(sweep):
        info = read_offline_run(folder)
        out.setdefault(info["name"], []).append((folder, info))
    return out


def test_wandb_runs_of_a_2x2_sweep(real_sweep):
    sweep = real_sweep.dir
    by_name = _runs_by_name(sweep)
    names = {f"{e} s{s}" for e in EXPERIMENTS for s in SEEDS}
    assert set(by_name) == names
    for name, [(folder, info)] in by_name.items():
        experiment, seed = name.split(" s")
        run_dir = folder.parent.parent
        assert run_dir == sweep / experiment / f"seed={seed}"  # the folder is named by the swept override
        assert info["group"] == f"{sweep.name}/{experiment}" and info["job_type"] == "train"
        assert info["project"] == "readback-tests"
        assert info["tags"] == [
            experiment,
            "model=tiny",
            "precision=fp8",
            "rounding=nearest",
            f"policy={experiment}",
            "bwd_precision=fp8",
            "bwd_reads=forward",
            f"sweep={sweep.name}",
            "ci",
        ]
        launch = info["config"]["launch"]
        assert f"seed={seed}" in launch["overrides"] and f"+experiment={experiment}" in launch["overrides"]
        assert "seed=0,1" in launch["sweep_overrides"] and launch["sweep_dir"] == str(sweep)
        assert launch["run_dir"] == str(run_dir) and "slurm_job_id" in launch and launch["host"]
        assert info["config"]["seed"] == int(seed) and info["config"]["experiment"] == experiment
        # curves against tokens; last and min of the loss in the summary
        assert info["metrics"]["loss"] == {"step_metric": "tokens", "summary": ["min", "last"]}
        assert info["metrics"]["grad_error/*"]["step_metric"] == "tokens"
        assert info["metrics"]["attn_rowsum/*"]["step_metric"] == "tokens"
        local = json.loads((run_dir / "summary.json").read_text())
        assert info["summary"]["final_loss"] == pytest.approx(local["final_loss"])
        assert info["summary"]["loss"]["min"] <= info["summary"]["loss"]["last"] == pytest.approx(local["final_loss"])
        steps = [h["_step"] for h in info["history"]]
        assert steps == [5, 10] and all("tokens" in h and "loss" in h for h in info["history"])
        assert json.loads((run_dir / "launch.json").read_text())["overrides"] == launch["overrides"]


def test_extending_a_sweep_keeps_finished_runs_and_their_wandb_runs(real_sweep, tmp_path):
    """Adding seed 2 to the sweep: 2 new runs; the 4 finished ones stay where they are, are not
    retrained (same summary), and resume under the same wandb id (a second offline folder each,
    which readback.sync hands to wandb sync together). Works on a copy: the shared sweep stays 2 x 2."""
    sweep = tmp_path / "sweep"
    shutil.copytree(real_sweep.dir, sweep)
    before = {p.parent: p.read_text() for p in sweep.glob("*/*/summary.json")}
    ids = {name: OFFLINE_FOLDER.match(entries[0][0].name).group(2) for name, entries in _runs_by_name(sweep).items()}
    run_train(sweep_args(real_sweep.conf, sweep, seeds=(*SEEDS, 2)), cwd=sweep.parent)
    after = {p.parent: p.read_text() for p in sweep.glob("*/*/summary.json")}
    assert set(after) == set(before) | {sweep / e / "seed=2" for e in EXPERIMENTS}
    for run_dir, text in before.items():
        assert json.loads(after[run_dir])["steps"] == STEPS
        assert json.loads(after[run_dir])["final_loss"] == json.loads(text)["final_loss"]
        first, again = json.loads((run_dir / "launch.json").read_text())["launches"]  # every launch kept
        assert (first["from_step"], first["steps_trained"], again["from_step"], again["steps_trained"]) == (
            0,
            STEPS,
            STEPS,
            0,
        )
        assert again["commit"] == first["commit"] and again["cpu_model"] == first["cpu_model"]
    runs = load_runs(sweep)
    assert len(runs) == 6 and runs.group_keys == [] and sorted(runs.summary["seed"]) == [0, 0, 1, 1, 2, 2]
    by_name = _runs_by_name(sweep)
    for name, run_id in ids.items():
        folders = [f for f, _ in by_name[name]]
        assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders), folders
    proc = subprocess.run(
        [sys.executable, "-m", "readback.cli.sync", str(sweep), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = [line for line in proc.stdout.splitlines() if "group" in line]
    assert len(listed) == 6 and "6 runs in 10 folders" in proc.stdout
    for name, run_id in ids.items():
        assert any(line.startswith(run_id) and name in line and "(2 folders)" in line for line in listed), listed
    wandb_says = proc.stdout + proc.stderr
    assert "Would sync 10 run(s)" in wandb_says or wandb_says.count(".wandb") == 10, wandb_says[-2000:]
