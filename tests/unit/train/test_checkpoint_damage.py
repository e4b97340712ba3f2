"""Damaged checkpoints and failed saves, in-process on the toy model (``toys``).

Each kind of damage to the newest checkpoint is found before it is used: the checkpoint is moved
aside with one warning line and the run resumes from the newest intact one, on the uninterrupted
run's curve. An I/O error moves nothing; pruning counts intact checkpoints only. A save that a
full disk stops is one line, ``summary.json`` says ``failed`` and why, no temporary directory is left, and the run
resumes from what is left on the uninterrupted curve.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

import toys
from readback.errors import ConfigError
from readback.train.checkpoint import CheckpointManager, checkpoint_path, list_checkpoints, resume_plan, verify
from readback.train.checkpoint import dirs as checkpoint_dirs
from readback.train.checkpoint import io as checkpoint_io
from readback.train.distributed import DistEnv
from readback.train.records.metrics import read_jsonl

CURVE_KEYS = ("step", "loss", "lr", "tokens", "grad_norm", "val_loss")
SHARD, CHECKSUMS = "__0_0.distcp", "__0_checksums.json"
RESUME = {"trainer.resume": True}


def _curve(run_dir: Path) -> list[tuple]:
    return [tuple(r.get(k) for k in CURVE_KEYS) for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``straight``: the uninterrupted toy run (12 steps); ``crashed``: the same run stopped by a
    crash in step 11, its checkpoints those of steps 4 and 8."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("WANDB_MODE", "WORLD_SIZE", "SLURM_RESTART_COUNT"):
            mp.delenv(key, raising=False)
        toys.train(toys.make_cfg(), root / "straight")
        with pytest.raises(RuntimeError, match="simulated crash"):
            toys.train(toys.make_cfg(), root / "crashed", crash_at_call=40)
    assert [s for s, _ in list_checkpoints(root / "crashed" / "checkpoints")] == [4, 8]
    return root


@pytest.fixture
def crashed(runs, tmp_path, built) -> Path:
    """A copy of the crashed run, to damage."""
    shutil.copytree(runs / "crashed", tmp_path / "run")
    return tmp_path / "run"


def _newest(run_dir: Path) -> Path:
    return checkpoint_path(run_dir / "checkpoints", 8)


def _truncate(ckpt: Path) -> None:
    shard = ckpt / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _overwrite(ckpt: Path) -> None:
    """Same size, other bytes: some of the tensors' bytes inverted."""
    data = bytearray((ckpt / SHARD).read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    (ckpt / SHARD).write_bytes(bytes(data))


def _zero(ckpt: Path) -> None:
    """Every shard file zeros of its own size: nothing DCP's unpickler can read."""
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))


def _delete_shard(ckpt: Path) -> None:
    (ckpt / SHARD).unlink()


def _delete_checksums(ckpt: Path) -> None:
    (ckpt / CHECKSUMS).unlink()


def _remove_index(ckpt: Path) -> None:
    (ckpt / checkpoint_io.INDEX).unlink()


def _garble_index(ckpt: Path) -> None:
    index = ckpt / checkpoint_io.INDEX
    index.write_bytes(b"garbage" + index.read_bytes()[7:])


def _cut_index(ckpt: Path) -> None:
    index = ckpt / checkpoint_io.INDEX
    index.write_bytes(index.read_bytes()[:100])


def _empty(ckpt: Path) -> None:
    shutil.rmtree(ckpt)
    ckpt.mkdir()


DAMAGE = {
    "shard truncated": (_truncate, "bytes, its index needs"),
    "shard overwritten": (_overwrite, "has CRC-32"),
    "shards zeroed": (_zero, "has CRC-32"),
    "shard deleted": (_delete_shard, f"{SHARD} is 0 bytes, its index needs"),
    "checksums deleted": (_delete_checksums, f"{SHARD} has no recorded checksum"),
    "index missing": (_remove_index, "no index (.metadata)"),
    "index garbled": (_garble_index, "unreadable index"),
    "index cut short": (_cut_index, "unreadable index"),
    "directory empty": (_empty, "the directory is empty"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_one_before(
    damage, crashed, runs, caplog
):
    damage_it, reason = DAMAGE[damage]
    damage_it(_newest(crashed))
    with caplog.at_level(logging.INFO):
        summary = toys.train(toys.make_cfg(**RESUME), crashed)
    assert summary["status"] == "completed" and summary["steps"] == 12
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "step_0000008 is damaged" in warned[0] and reason in warned[0], warned
    assert f"resumed from {checkpoint_path(crashed / 'checkpoints', 4)} (step 4)" in caplog.text
    assert _curve(crashed) == _curve(runs / "straight")  # steps 5 to 12 again, bit for bit
    names = sorted(p.name for p in (crashed / "checkpoints").iterdir())
    assert names == ["step_0000008", "step_0000008.damaged", "step_0000012"]  # moved aside, kept


def test_the_entry_points_look_ahead_checks_sizes_and_moves_nothing(crashed):
    cfg = toys.make_cfg(**RESUME)
    _overwrite(_newest(crashed))
    assert resume_plan(crashed, cfg, quiet=True)[1]["step"] == 8  # checksums are the run's to read
    _truncate(_newest(crashed))
    assert resume_plan(crashed, cfg, quiet=True)[1]["step"] == 4
    _zero(checkpoint_path(crashed / "checkpoints", 4))  # unreadable: skipped, not a traceback
    with pytest.raises(ConfigError, match="none of the 2"):
        resume_plan(crashed, cfg, quiet=True)
    assert [s for s, _ in list_checkpoints(crashed / "checkpoints")] == [4, 8]


def test_nothing_intact_left_is_one_line_every_time(crashed):
    for step in (4, 8):
        _truncate(checkpoint_path(crashed / "checkpoints", step))
    for _ in range(2):  # the second time only the moved-aside ones are there
        with pytest.raises(ConfigError, match="intact") as e:
            toys.train(toys.make_cfg(**RESUME), crashed)
        assert "\n" not in str(e.value)
    assert list_checkpoints(crashed / "checkpoints") == []
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == [
        "step_0000004.damaged",
        "step_0000008.damaged",
    ]


def _failing_open(monkeypatch, code: int, times: int | None) -> list[str]:
    """Shard files fail to open with ``code`` ``times`` times (``None``: always); the tries so far."""
    tries: list[str] = []

    def flaky_open(path, *args, **kwargs):
        if str(path).endswith(".distcp") and (times is None or len(tries) < times):
            tries.append(str(path))
            raise OSError(code, os.strerror(code), str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_io, "open", flaky_open, raising=False)
    monkeypatch.setattr(checkpoint_dirs, "RETRY_DELAYS_S", (0.0, 0.0))
    return tries


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_a_transient_io_error_is_retried_and_moves_nothing(crashed, monkeypatch, code):
    tries = _failing_open(monkeypatch, code, times=2)
    verify(_newest(crashed))  # the third try reads it
    assert len(tries) == 2
    tries = _failing_open(monkeypatch, code, times=None)
    with pytest.raises(OSError) as e:
        verify(_newest(crashed))
    assert e.value.errno == code and len(tries) == 3
    with pytest.raises(ConfigError, match="nothing was moved") as refused:
        resume_plan(crashed, toys.make_cfg(**RESUME))
    assert os.strerror(code) in str(refused.value) and "\n" not in str(refused.value)
    assert [s for s, _ in list_checkpoints(crashed / "checkpoints")] == [4, 8]  # both where they were


def test_keep_last_counts_intact_checkpoints_only(tmp_path, built):
    model = toys.ToyModel(8)
    manager = CheckpointManager(
        tmp_path,
        toys.make_cfg(**{"trainer.keep_last": 2}),
        DistEnv(),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        shared={},
        per_rank={},
    )
    for step in (4, 8):
        manager.save(step, wandb_run_id=None)
    _truncate(checkpoint_path(manager.dir, 8))
    manager.save(12, wandb_run_id=None)
    assert [s for s, _ in list_checkpoints(manager.dir)] == [4, 12]  # 8 is damaged: 4 is one of the two kept
    manager.save(16, wandb_run_id=None)
    assert sorted(p.name for p in manager.dir.iterdir()) == ["step_0000008.damaged", "step_0000012", "step_0000016"]


class _FillingStream:
    """A shard file on a disk that is full once ``room`` more bytes are written."""

    def __init__(self, stream, room: int):
        self.stream, self.room = stream, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) <= self.room:
            self.room -= len(data)
            return self.stream.write(data)
        self.stream.write(data[: self.room])
        self.room = 0
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _disk_full_at(monkeypatch, step: int) -> None:
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            full = f".step_{step:07d}.tmp" in str(path) and str(path).endswith(".distcp")
            yield _FillingStream(stream, room=4096) if full else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def _assert_failed_save(run_dir: Path, error: ConfigError, step: int, newest: int) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"checkpoint of step {step}" in message and os.strerror(errno.ENOSPC) in message
    assert f"newest intact checkpoint is {checkpoint_path(run_dir / 'checkpoints', newest)}" in message
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and os.strerror(errno.ENOSPC) in summary["error"]
    assert f"step {step}" in summary["error"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_that_fills_the_disk_is_one_line_and_the_run_resumes(tmp_path, built, runs, monkeypatch, asynchronous):
    run_dir = tmp_path / "run"
    _disk_full_at(monkeypatch, 8)
    with pytest.raises(ConfigError) as e:
        toys.train(toys.make_cfg(**{"trainer.ckpt_async": asynchronous}), run_dir)
    _assert_failed_save(run_dir, e.value, step=8, newest=4)
    monkeypatch.undo()
    summary = toys.train(toys.make_cfg(**RESUME, **{"trainer.ckpt_async": asynchronous}), run_dir)
    assert summary["status"] == "completed" and _curve(run_dir) == _curve(runs / "straight")


@contextlib.contextmanager
def _small_tmpfs(directory: Path, size: str):
    directory.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield directory
    finally:  # lazily if a failed test's traceback still holds a file open there
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], check=True)


def test_a_save_on_a_really_full_file_system(tmp_path, built, runs):
    """A tmpfs with room for one checkpoint and a half: the second save runs out of space."""
    page = os.sysconf("SC_PAGE_SIZE")
    one = sum(-(-p.stat().st_size // page) * page for p in _newest(runs / "crashed").iterdir())
    with _small_tmpfs(tmp_path / "disk", "2M") as disk:
        filler = disk / "filler"
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler.write_bytes(b"\0" * (free - one * 3 // 2 - 8 * page))  # 8 pages: metrics, summary
        run_dir = disk / "run"
        with pytest.raises(ConfigError) as e:
            toys.train(toys.make_cfg(), run_dir)
        _assert_failed_save(run_dir, e.value, step=8, newest=4)
        filler.unlink()
        summary = toys.train(toys.make_cfg(**RESUME), run_dir)
        assert summary["status"] == "completed" and _curve(run_dir) == _curve(runs / "straight")
