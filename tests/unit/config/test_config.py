"""Configs: every experiment composes, validates and sets only the study's axes; each one trains
through the real ``train.py`` on the tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from readback.config import CONF_DIR, Config, validate
from readback.config.refusals import options
from readback.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
STUDY_AXES = {"precision", "policy", "attention", "experiment"}


def _compose(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_the_study_experiments_exist():
    assert EXPERIMENTS == ["bf16_baseline", "fresh_reround", "no_saved_copy", "reuse_rounded", "reuse_rounded_bf16_bwd"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_validates_and_sets_only_the_study_axes(experiment):
    base = OmegaConf.to_container(_compose())
    cfg = _compose(f"+experiment={experiment}")
    validate(cfg)
    changed = {key for key, value in OmegaConf.to_container(cfg).items() if base.get(key) != value}
    assert changed <= STUDY_AXES, changed
    assert cfg.experiment == experiment
    # model=, data= and trainer.* stay free under an experiment
    free = _compose(f"+experiment={experiment}", "model=small", "data=synthetic", "trainer.steps=7")
    assert (free.model.name, free.data.name, free.trainer.steps) == ("small", "synthetic", 7)


@pytest.mark.parametrize(
    "experiment, precision, policy, bwd",
    [
        ("reuse_rounded", "fp8", "reuse_rounded", "fp8"),
        ("fresh_reround", "fp8", "fresh_reround", "fp8"),
        ("no_saved_copy", "fp8", "no_saved_copy", "fp8"),
        ("reuse_rounded_bf16_bwd", "fp8", "reuse_rounded", "bf16"),
        ("bf16_baseline", "bf16", "exact", "bf16"),
    ],
)
def test_experiment_axes(experiment, precision, policy, bwd):
    cfg = _compose(f"+experiment={experiment}")
    assert (cfg.precision.name, cfg.policy.name, cfg.attention.bwd_precision) == (precision, policy, bwd)


def test_the_study_recipe_is_transformer_engine_default_delayed_scaling():
    p = _compose("+experiment=reuse_rounded").precision
    assert (p.recipe, p.fp8_format, p.margin, p.amax_history_len, p.amax_compute_algo) == (
        "delayed",
        "HYBRID",
        0,
        1024,
        "max",
    )
    assert list(p.bf16_layers) == ["lm_head"] and p.rounding == "nearest"


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_heads=3", "model.n_heads"),
        ("model.ffn_dim=200", "model.ffn_dim"),
        ("trainer.micro_batch=5", "trainer.micro_batch"),
        ("precision.interval=0", "precision.interval"),
        ("probe.repeats=0", "probe.repeats"),
    ],
)
def test_validate_names_the_bad_key(override, key):
    with pytest.raises(ConfigError) as error:
        validate(_compose(override))
    assert error.value.key == key and "valid:" in str(error.value)


@pytest.mark.parametrize(
    "override",
    [
        f"{group}={option}"
        for group in ("model", "precision", "policy", "data", "backend", "logger")
        for option in options(group)
    ],
)
def test_every_option_sets_every_key_of_its_schema(override):
    """``to_object`` refuses a field no YAML file sets (``???``) and runs every range check."""
    assert isinstance(OmegaConf.to_object(_compose(override)), Config)


def test_validate_gives_the_typed_config_and_refuses_plus_keys():
    config = validate(_compose("trainer.steps=7"))
    assert isinstance(config, Config) and config.trainer.steps == 7 and config.trainer.optim.eps == 1e-8
    with pytest.raises(ConfigError, match="trainer.max_steps=100 is not a config key; did you mean trainer.steps"):
        validate(_compose("+trainer.max_steps=100"))


def test_bf16_allows_widths_fp8_refuses():
    validate(_compose("+experiment=bf16_baseline", "model.ffn_dim=200"))
    with pytest.raises(ConfigError):
        validate(_compose("+experiment=reuse_rounded", "model.ffn_dim=200"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
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
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["experiment"] == experiment
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.experiment == experiment
