"""``trainer.threads`` (``readback.train.threads``): the setting's refusals, ``auto``'s choice
from the environment, the table and the cores, and a run that sets and logs the count it used."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

import toys
from readback.errors import ConfigError
from readback.train import run
from readback.train.settings import config_changes, plain_config
from readback.train.threads import AUTO_THREADS, ENV, choose_threads

REPO = Path(__file__).parents[3]


@pytest.mark.parametrize("bad", ["zero", "0", "-2", "1.5", "Auto"])
def test_a_bad_thread_count_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as refused:
        toys.make_cfg(**{"trainer.threads": bad})
    assert str(refused.value) == f"trainer.threads='{bad}' is not valid; valid: auto or an integer >= 1"


def test_an_integer_is_taken_as_given_and_wins_over_the_environment():
    assert choose_threads("3", "tiny", {ENV: "1"}, cores=2) == (3, "trainer.threads")


def test_auto_takes_the_environments_count_first():
    assert choose_threads("auto", "tiny", {ENV: "2"}, cores=8) == (2, f"auto: {ENV}")


@pytest.mark.parametrize("unset", [{}, {ENV: ""}])
def test_auto_takes_the_tables_count_for_the_model_and_every_core_for_a_size_it_lacks(unset):
    tiny, why = choose_threads("auto", "tiny", unset, cores=16)
    assert (tiny, why) == (AUTO_THREADS["tiny"], "auto: model tiny on 16 cores")
    assert "fog_8b" not in AUTO_THREADS
    assert choose_threads("auto", "fog_8b", unset, cores=16)[0] == 16


def test_auto_never_takes_more_threads_than_cores(monkeypatch):
    monkeypatch.setitem(AUTO_THREADS, "small", 4)
    assert choose_threads("auto", "small", {}, cores=2)[0] == 2
    assert choose_threads("auto", "small", {}, cores=8)[0] == 4


def test_a_run_trains_on_the_count_it_logs_and_gives_the_process_its_own_back(tmp_path, built, caplog):
    seen = []
    builders = toys.toy_builders()

    def model(cfg, device):
        seen.append(torch.get_num_threads())
        return builders.model(cfg, device)

    before = torch.get_num_threads()
    threads = 2 if before == 1 else 1
    cfg = toys.make_cfg(**{"trainer.threads": str(threads), "trainer.steps": 2, "trainer.ckpt_every": 2})
    with caplog.at_level(logging.DEBUG, logger="readback.train"):
        run(cfg, tmp_path / "run", dataclasses.replace(builders, model=model))
    assert seen == [threads]
    assert f"intra-op threads: {threads} (trainer.threads)" in caplog.text  # why, at debug level
    assert f"cpu, {threads} intra-op threads" in caplog.text  # the run's start line
    assert torch.get_num_threads() == before


def test_a_resume_under_another_thread_setting_is_refused():
    """The count can change the last bits of a run's statistics (a tiny FOG's attention logit z on
    1 and 2 threads), so the setting is not one a resume may change."""
    saved = plain_config(toys.make_cfg())
    assert config_changes(saved, toys.make_cfg(**{"trainer.threads": "1"})) == [("trainer.threads", "auto", "1")]


@pytest.mark.parametrize(
    ("args", "caller", "expected"),
    [
        (["hydra/launcher=local"], None, lambda runs: str(max(1, len(os.sched_getaffinity(0)) // runs))),
        (["hydra/launcher=local"], "3", lambda runs: "3"),
        ([], None, lambda runs: ""),
    ],
)
def test_the_cpu_sweep_gives_runs_started_at_once_their_share_of_the_cores(tmp_path, args, caller, expected):
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "${OMP_NUM_THREADS:-}"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHON": str(python), "EXPERIMENTS": "a,b"}
    if caller:
        env[ENV] = caller
    out = subprocess.run(["bash", str(REPO / "sweeps/cpu_mini.sh"), *args], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == expected(2 * 3), out.stderr  # 2 experiments x 3 seeds
