"""A refused run leaves its run directory as it was: gone if the refused job made it, its Hydra
config files put back if it held a run before, and no error where every rank of a run does this
at once on one shared file system."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from readback.config import undo_run_dir
from readback.config.entry import PREEXISTING_RUN_DIRS

HYDRA_FILES = {".hydra", "train.log"}


def _hydra_made(run_dir: Path) -> Path:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_bytes(b"this job's")
    (run_dir / "train.log").write_text("")
    return run_dir


def test_a_directory_this_job_made_is_removed(tmp_path):
    run_dir = _hydra_made(tmp_path / "run")
    undo_run_dir(run_dir, HYDRA_FILES)
    assert not run_dir.exists()


def test_a_directory_with_more_than_hydra_files_is_kept(tmp_path):
    run_dir = _hydra_made(tmp_path / "run")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    undo_run_dir(run_dir, HYDRA_FILES)
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / ".hydra" / "config.yaml").exists()


def test_a_run_held_before_gets_its_hydra_files_back(tmp_path, monkeypatch):
    run_dir = _hydra_made(tmp_path / "run")
    monkeypatch.setitem(PREEXISTING_RUN_DIRS, str(run_dir.resolve()), {"config.yaml": b"the run's own"})
    undo_run_dir(run_dir, HYDRA_FILES)
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == b"the run's own"


@pytest.mark.parametrize("when", ["before the first look", "between the two looks"])
def test_a_directory_another_rank_removed_first_stays_removed(tmp_path, monkeypatch, when):
    run_dir = _hydra_made(tmp_path / "run")
    if when == "before the first look":
        shutil.rmtree(run_dir)
    else:  # is_dir() saw it, then the listing finds it gone (a CI run's traceback, from two nodes)
        iterdir = Path.iterdir

        def removed_by_the_other_rank(self):
            shutil.rmtree(run_dir)
            return iterdir(self)

        monkeypatch.setattr(Path, "iterdir", removed_by_the_other_rank)
    undo_run_dir(run_dir, HYDRA_FILES)
    assert not run_dir.exists()
