"""Every experiment of conf/experiment/ trains through the real ``train.py`` on the tiny model."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from readback.analysis.files import load_runs
from toys import ALL_EXPERIMENTS, REPO


@pytest.mark.parametrize("experiment", ALL_EXPERIMENTS)
def test_every_experiment_trains_through_train_py(experiment, tmp_path):
    run_dir = tmp_path / experiment
    cmd = [
        sys.executable,
        "train.py",
        f"+experiment={experiment}",
        "data=synthetic",
        "data.n_tokens=32768",
        "logger=none",
        "trainer.steps=3",
        "trainer.log_every=1",
        "trainer.eval_every=3",
        "trainer.eval_batches=1",
        "trainer.progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["experiment"] == experiment
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.experiment == experiment


@pytest.mark.parametrize("recipe, variant", [("mxfp8", "dgrad"), ("blockwise", "wgrad")])
def test_a_block_recipe_trains_the_tiny_fog_with_the_probe_and_the_meter(recipe, variant, tmp_path):
    """The emulated linears under each block recipe, with the probe and the bias meter on: the
    meter carries the read the recipe departs from the executed forward with."""
    run_dir = tmp_path / recipe
    overrides = ["+experiment=reuse_rounded", "data=synthetic", "data.n_tokens=32768", "logger=none"]
    overrides += ["trainer.steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_batches=1"]
    overrides += ["trainer.progress=false", f"precision.recipe={recipe}", "probe.every=1", "probe.bias_every=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("grad_error/rel_err/total" in r for r in records)
    assert any(f"grad_bias/exact_read.linear.{variant}/total" in r for r in records)


def test_the_main_job_logs_the_gradient_error_and_ends_with_the_command_that_plots_it(tmp_path):
    """``make train``'s command with its defaults (only shortened to the first probe step): the
    probe is on, so ``metrics.jsonl`` carries ``grad_error/...``, and the last lines name the run's
    folder and the command that draws its plots, which draws the gradient-error plot from them."""
    run_dir = tmp_path / "main"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    args = ["+experiment=reuse_rounded", "trainer.steps=50", "trainer.eval_every=50", "trainer.eval_batches=1"]
    cmd = [sys.executable, "train.py", *args, "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "grad_error/rel_err/total" in r] == [50]
    last = proc.stderr.strip().splitlines()[-2:]
    assert last[0] == f"outputs: {run_dir}"
    command = last[1].removeprefix("plots and report: ").split()
    assert command[:3] == ["python", "-m", "readback.cli.analysis"]
    plot = subprocess.run(
        [sys.executable, *command[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert (run_dir / "analysis" / "grad_error.png").stat().st_size > 0
    assert (run_dir / "analysis" / "report.html").exists()
    assert len(load_runs(run_dir).curve("grad_error/rel_err/total")) == 1  # the point its panel draws
