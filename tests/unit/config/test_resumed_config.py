"""A resume continues the run as it was configured (``readback.config.resumed``): keys the resume's
command line does not give come from the run's checkpoint, a default changed since the run started
is kept and named in one line, keys the command line gives (or an option it picks) are checked as
before. A run of the toy trainer under a test config group, ``model=study``, in a copy of
``conf/`` whose default is changed between the start and the resume."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import readback.config.resumed as resumed_module
import toys
from readback.config import CONF_DIR, typed
from readback.config.resumed import record, resumed_config, saved_config
from readback.errors import ConfigError
from readback.train.checkpoint import resume_plan
from readback.train.settings import config_changes, plain_config

# The run's command line: the toy trainer's sizes, but the learning rate, which the group sets.
STARTED = [
    "model=study",
    "data=synthetic",
    "logger=none",
    *(f"{k}={json.dumps(v)}" for k, v in toys.TOY_TRAINER.items() if k != "model.lr"),
]
RESUME = ["trainer.resume=true"]
CHANGED = "default changed since this run started: model.lr was 0.03, is 0.01; this run keeps 0.03"


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "readback.config.resumed"]


def _compose(conf: Path, overrides: list[str]):
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("train", overrides=overrides)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, Path]:
    """``(conf, run_dir)``: a finished toy run under ``model=study`` (lr 0.03), whose default
    learning rate is then changed to 0.01 in the copy of ``conf/`` it was composed from."""
    root = tmp_path_factory.mktemp("resumed")
    conf = root / "conf"
    shutil.copytree(CONF_DIR, conf)
    group = OmegaConf.load(conf / "model" / "tiny.yaml")
    group.name, group.lr = "study", 0.03
    OmegaConf.save(group, conf / "model" / "study.yaml")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("WANDB_MODE", "WORLD_SIZE", "SLURM_RESTART_COUNT"):
            mp.delenv(key, raising=False)
        cfg = typed(_compose(conf, STARTED))
        assert cfg.model.lr == 0.03
        toys.train(cfg, root / "run")
    group.lr = 0.01  # a newer readback's default
    OmegaConf.save(group, conf / "model" / "study.yaml")
    return conf, root / "run"


def _resumed(study, overrides: list[str], previous: list[str] | None = None, report: bool = True):
    conf, run_dir = study
    saved = saved_config(run_dir)
    assert saved is not None
    return resumed_config(saved, overrides, conf, previous=previous, report=report)


def test_the_same_command_keeps_the_runs_value_of_a_changed_default_and_says_so(study, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = typed(_resumed(study, STARTED + RESUME))
    assert cfg.model.lr == 0.03 and cfg.trainer.resume
    assert _said(caplog) == [CHANGED]
    assert resume_plan(study[1], cfg)[1]["step"] == 12  # nothing refused
    assert typed(_compose(study[0], STARTED + RESUME)).model.lr == 0.01  # what the command alone gives now


def test_the_resume_flag_alone_continues_the_run_with_all_its_settings(study, caplog):
    with caplog.at_level(logging.WARNING):
        alone = typed(_resumed(study, RESUME, previous=STARTED))
    started = typed(_compose(study[0], STARTED))  # today's, lr 0.01
    assert alone.model.name == "study" and alone.data.name == "synthetic" and alone.logger.name == "none"
    assert (alone.seed, alone.trainer.steps, alone.model.d_model) == (3, 12, 16)
    assert alone.model.lr == 0.03 and alone.trainer.resume
    assert resume_plan(study[1], alone)[1]["step"] == 12
    assert _said(caplog) == [CHANGED]  # the run's own keys: no word
    model, trainer = replace(started.model, lr=0.03), replace(started.trainer, resume=True)
    assert alone == replace(started, model=model, trainer=trainer)  # every other key as the run started


def test_a_key_the_command_line_gives_is_checked_as_before(study):
    given = typed(_resumed(study, RESUME + ["model.lr=0.01"]))
    with pytest.raises(ConfigError) as refused:
        resume_plan(study[1], given)
    assert str(refused.value).startswith("model.lr=0.01 is not valid; valid: 0.03, the value")
    assert resume_plan(study[1], typed(_resumed(study, RESUME + ["model.lr=0.03"])))[1]["step"] == 12
    longer = typed(_resumed(study, RESUME + ["trainer.steps=16", "trainer.resume_changed_config=true"]))
    assert longer.trainer.steps == 16 and longer.model.lr == 0.03
    assert resume_plan(study[1], longer)[1]["step"] == 12  # going on, with a warning


def test_another_option_picked_on_the_command_line_is_a_change_of_the_keys_it_sets(study):
    """``model=tiny`` for the run's ``model=study`` (a copy of tiny but its learning rate): tiny's
    name and learning rate; the sizes that the run's command line set stay the run's."""
    other = typed(_resumed(study, RESUME + ["model=tiny"], previous=STARTED))
    assert (other.model.name, other.model.lr, other.model.d_model, other.seed) == ("tiny", 0.003, 16, 3)
    with pytest.raises(ConfigError) as refused:
        resume_plan(study[1], other)
    assert "(changed: model.name 'study' -> 'tiny'; model.lr 0.03 -> 0.003)" in str(refused.value)


def test_the_launch_keys_are_never_the_runs(study):
    """A run saved under another resume choice (``trainer.log_gap=rewind``, ...) resumes under
    today's, unless the command line gives it again."""
    conf, run_dir = study
    saved = dict(saved_config(run_dir) or {})
    saved["trainer"] = {**saved["trainer"], "log_gap": "rewind", "resume_changed_config": True}
    cfg = typed(resumed_config(saved, ["trainer.resume=true"], conf))
    assert not cfg.trainer.resume_changed_config and not cfg.trainer.dry_run and cfg.trainer.log_gap == "warn"
    cfg = typed(resumed_config(saved, ["trainer.resume=true", "trainer.log_gap=rewind"], conf))
    assert cfg.trainer.log_gap == "rewind"


def test_the_run_directory_records_the_config_it_goes_on_with(study, tmp_path):
    resumed = _resumed(study, RESUME, previous=STARTED, report=False)
    (tmp_path / ".hydra").mkdir()
    record(tmp_path, resumed, RESUME + ["trainer.steps=16"], STARTED)
    overrides = OmegaConf.load(tmp_path / ".hydra" / "overrides.yaml")
    assert list(overrides) == [o for o in STARTED if not o.startswith("trainer.steps=")] + RESUME + ["trainer.steps=16"]
    assert OmegaConf.load(tmp_path / ".hydra" / "config.yaml").model.lr == 0.03


def test_a_config_saved_by_an_older_readback_resumes_under_todays_conf(caplog):
    """The case that was refused: a run started when ``precision.fp8_format`` defaulted to HYBRID
    (now null, the recipe's own), resumed with its command plus ``trainer.resume=true``."""
    command = ["data=synthetic", "logger=none", *(f"{k}={json.dumps(v)}" for k, v in toys.TOY_TRAINER.items())]
    saved = plain_config(typed(_compose(CONF_DIR, command)))
    saved["precision"]["fp8_format"] = "HYBRID"
    with caplog.at_level(logging.WARNING):
        cfg = typed(resumed_config(saved, command + RESUME, CONF_DIR, previous=command, report=True))
    assert cfg.precision.fp8_format == "HYBRID" and config_changes(saved, cfg) == []
    assert _said(caplog) == [
        "default changed since this run started: precision.fp8_format was 'HYBRID', is None; this run keeps 'HYBRID'"
    ]


def test_a_composition_that_fails_in_a_resume_is_one_line(study):
    """An option today's ``conf/`` lacks (a sweep preset outside the job's search path was one)
    is refused naming it, as at launch, not with Hydra's traceback."""
    with pytest.raises(ConfigError) as refused:
        resumed_module._compose(study[0], ["model=gone"])
    assert (refused.value.key, refused.value.value) == ("model", "gone") and "\n" not in str(refused.value)
