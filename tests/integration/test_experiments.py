"""Every experiment of conf/experiment/ trains through the real ``train.py`` on the tiny model."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

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
