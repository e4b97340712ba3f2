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
