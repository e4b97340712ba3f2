"""The run's records when the file system refuses them: a full disk under ``metrics.jsonl`` or
``summary.json`` (``/dev/full``: a real ENOSPC, no root needed; a real full tmpfs is in
tests/integration/test_run_dir_faults.py) and a directory in either's place are one line each,
naming the file and the newest intact checkpoint."""

from __future__ import annotations

import errno
import json
import os

import pytest

from readback.errors import ConfigError
from readback.train.records.metrics import JsonlWriter, build_metrics_logger
from readback.train.records.summary import SummaryWriter, summary_path
from readback.train.settings import Logger

FULL = os.strerror(errno.ENOSPC)


@pytest.fixture
def full_disk():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    return "/dev/full"


def test_a_full_disk_under_the_log_is_one_line_naming_it(tmp_path, full_disk):
    log = tmp_path / "metrics.jsonl"
    log.symlink_to(full_disk)
    writer = JsonlWriter(log)
    with pytest.raises(ConfigError) as refused:
        writer.write({"step": 7, "loss": 1.0})
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"hydra.run.dir='{tmp_path}' is not valid;")
    assert f"writing the record of step 7 to {log} failed ([Errno {errno.ENOSPC}] {FULL})" in line
    assert line.endswith("the newest intact checkpoint is none")
    writer.close()  # nothing buffered: nothing fails again


def test_a_full_disk_under_the_summary_is_one_line_naming_it(tmp_path, full_disk, monkeypatch):
    import readback.train.checkpoint.atomic as atomic_files

    real_fdopen = os.fdopen
    monkeypatch.setattr(atomic_files.os, "fdopen", lambda fd, mode: real_fdopen(os.open(full_disk, os.O_WRONLY), mode))
    with pytest.raises(ConfigError) as refused:
        SummaryWriter(tmp_path, is_main=True).write({"status": "completed"})
    assert f"writing {summary_path(tmp_path)} failed ([Errno {errno.ENOSPC}] {FULL})" in str(refused.value)
    assert not summary_path(tmp_path).exists()


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "launch.json"])
def test_a_directory_in_a_records_place_is_refused_in_one_line(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(ConfigError) as refused:
        if name == "metrics.jsonl":
            JsonlWriter(tmp_path / name).truncate_after(3)
        elif name == "summary.json":
            SummaryWriter(tmp_path, is_main=True).clear()
        else:
            build_metrics_logger(
                Logger(name="none"), tmp_path, is_main=True, resume_step=0, config={}, wandb_run_id=None
            )
    assert f"a run directory whose {name} is a file: {tmp_path / name} is not (move it away)" in str(refused.value)
    assert (tmp_path / name).is_dir()


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_a_log_removed_or_replaced_under_the_run_is_written_again_with_a_warning(tmp_path, caplog, change):
    """Records written into a file nobody can read any more would be lost without a word."""
    log = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(log)
    writer.write({"step": 1})
    log.unlink()
    if change == "replaced":
        log.write_text('{"step": 0}\n')
    writer.write({"step": 2})
    writer.write({"step": 3})
    writer.close()
    kept = [] if change == "removed" else [0]
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [*kept, 2, 3]
    assert f"{log} was removed or replaced while this run wrote it: its records before step 2" in caplog.text
    assert caplog.text.count("was removed or replaced") == 1
