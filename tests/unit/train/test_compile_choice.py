"""``trainer.compile`` (``readback.train.compile_choice``): the setting's refusals, ``auto``'s
choice from the run's length, device and processes, a run that says its choice and what its
compile cost, and a resume that keeps the mode its run trained in."""

from __future__ import annotations

import logging

import pytest

import readback.train.compile_choice as compile_choice
import toys
from readback.config import CONF_DIR, typed
from readback.config.resumed import resumed_config
from readback.errors import ConfigError
from readback.train import run
from readback.train.compile_choice import AUTO_COMPILE_STEPS, choose_compile
from readback.train.settings import config_changes, plain_config


@pytest.mark.parametrize("bad", ["yes", "Auto", 1, 0])
def test_a_bad_compile_setting_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as refused:
        toys.make_cfg(**{"trainer.compile": bad})
    assert str(refused.value) == f"trainer.compile={bad!r} is not valid; valid: auto, true or false"


@pytest.mark.parametrize("setting", [True, False])
def test_true_and_false_are_taken_as_given_on_any_device_and_length(setting):
    assert choose_compile(setting, "tiny", 1, "cuda", 8) == (setting, "trainer.compile")


def test_auto_compiles_a_cpu_run_from_the_steps_where_compiling_pays():
    least = AUTO_COMPILE_STEPS["tiny"]
    assert choose_compile("auto", "tiny", least, "cpu", 1) == (True, f"auto: {least} steps, >= {least} for model tiny")
    assert choose_compile("auto", "tiny", least - 1, "cpu", 1) == (
        False,
        f"auto: {least - 1} steps, < {least} for model tiny",
    )


def test_auto_keeps_eager_on_a_gpu_over_several_processes_and_for_a_size_not_measured():
    steps = 10 * max(AUTO_COMPILE_STEPS.values())
    assert choose_compile("auto", "tiny", steps, "cuda", 1) == (False, "auto: cuda, 1 process(es)")
    assert choose_compile("auto", "tiny", steps, "cpu", 2) == (False, "auto: cpu, 2 process(es)")
    assert "fog_8b" not in AUTO_COMPILE_STEPS
    assert choose_compile("auto", "fog_8b", steps, "cpu", 1) == (False, "auto: no break-even measured for model fog_8b")


def test_the_test_suites_short_runs_stay_eager():
    """Tests train 60 steps at most (the toy config 12): auto compiles none."""
    cfg = toys.make_cfg()
    assert cfg.trainer.compile == "auto" and cfg.model.name in AUTO_COMPILE_STEPS
    assert min(AUTO_COMPILE_STEPS.values()) > 60 > cfg.trainer.steps


@pytest.mark.parametrize(("setting", "mode"), [("auto", "eager"), (True, "compiled")])
def test_a_run_says_its_choice_and_what_its_first_compiled_step_took(tmp_path, monkeypatch, caplog, setting, mode):
    """The compiled forward stands in for ``torch.compile``'s (a real compile takes minutes here):
    the steps that do not measure statistics run through it, from step 2 (step 1 creates the sites)."""
    calls = []

    def counted(forward):
        def call(*args):
            calls.append(args)
            return forward(*args)

        return call

    monkeypatch.setattr(compile_choice, "compiled", counted)
    settings = {"trainer.compile": setting, "trainer.steps": 4, "trainer.log_every": 4, "trainer.micro_batch": 8}
    cfg = toys.make_cfg(**settings)  # one micro-batch a step
    with caplog.at_level(logging.INFO, logger="readback.train"):
        run(cfg, tmp_path / "run")  # the FOG: its rounding sites exist after step 1
    why = (
        "auto: 4 steps, < {} for model tiny".format(AUTO_COMPILE_STEPS["tiny"])
        if setting == "auto"
        else "trainer.compile"
    )
    assert f"intra-op threads, {mode} ({why})" in caplog.text  # the start line
    costs = [r.getMessage() for r in caplog.records if "compiled the forward and backward" in r.getMessage()]
    if mode == "eager":
        assert (calls, costs) == ([], [])
    else:
        assert len(calls) == 2  # steps 2 and 3; step 4 logs, so measures statistics eagerly
        assert len(costs) == 1 and costs[0].startswith("step 2 compiled the forward and backward: ")


def test_a_resume_under_another_compile_setting_is_refused():
    """Compiled losses differ from eager ones in their last bits: a run keeps one mode."""
    saved = plain_config(toys.make_cfg())
    assert config_changes(saved, toys.make_cfg(**{"trainer.compile": True})) == [("trainer.compile", "auto", True)]


def test_a_run_started_before_auto_resumes_eager(caplog):
    """A checkpoint whose run had ``compile: false``, the default then, resumes under it and says so."""
    saved = plain_config(toys.make_cfg(**{"trainer.compile": False}))
    with caplog.at_level(logging.WARNING, logger="readback.config.resumed"):
        cfg = typed(
            resumed_config(saved, ["data=synthetic", "logger=none", "trainer.resume=true"], CONF_DIR, report=True)
        )
    assert cfg.trainer.compile is False and config_changes(saved, cfg) == []
    assert "trainer.compile was False, is 'auto'; this run keeps False" in caplog.text
