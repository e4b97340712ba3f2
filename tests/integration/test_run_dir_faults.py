"""A run directory that misbehaves under a running job, with the real ``train.py`` in
subprocesses: a holder stopped past its lease and woken after another run took the directory
over and finished, a disk that fills while ``metrics.jsonl`` is written, a log that is not a
file, and a log behind its checkpoint under each ``trainer.log_gap``. Each ends in at most three
lines on stderr, no traceback, and loses nothing that was there before (docs/faults.md). The
lock's own cases, in-process and with stopped holder processes, are in
tests/unit/train/test_writer_lock.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from readback.train.checkpoint import list_checkpoints
from readback.train.checkpoint.writer_lock import lock_path
from readback.train.records.metrics import read_jsonl
from toys import REPO, TOY_RUN

STEPS = 12
TINY = [
    "data=synthetic",
    "data.n_tokens=65536",
    "model.n_layers=1",
    *TOY_RUN,
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_every=6",
    "trainer.eval_batches=1",
    "trainer.ckpt_every=4",
    "trainer.progress=false",
    "logger=none",
]
LEASE_S = 2.0  # trainer.lock_lease_s: short, so that a stop outlasts it in a test


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", WANDB_SILENT="true")
    for key in ("WORLD_SIZE", "SLURM_RESTART_COUNT", "SLURM_JOB_ID"):
        env.pop(key, None)
    return env


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", *TINY, *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    records = read_jsonl(path) if path.is_file() else []
    return records[-1]["step"] if records else 0


def _stop_when(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    """SIGSTOP ``proc`` as soon as ``ready()`` holds; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before it was stopped: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the stop point"
        time.sleep(0.003)
    proc.send_signal(signal.SIGSTOP)


def _snapshot(run_dir: Path) -> dict[str, str]:
    """Hash of every file of a run directory but Hydra's log."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != "train.log"
    }


def _assert_short_error(rc: int, output: str, says: str) -> None:
    """Exit 2, at most three lines on stderr (the last the error), no traceback."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in output, output[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], output[-3000:]
    assert len(lines) <= 3, output[-3000:]


def _assert_complete(run_dir: Path) -> None:
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_a_holder_woken_after_its_run_was_taken_over_and_finished_writes_nothing(tmp_path):
    """A run suspended past its lease (SIGSTOP); a requeue takes the directory over, resumes and
    completes; then the first process is continued (SIGCONT). It finds the lock gone and its
    lease run out: it stops in one line, and the finished run's files are as they were."""
    run_dir = tmp_path / "run"
    lease = f"trainer.lock_lease_s={LEASE_S}"
    first = _start(run_dir, lease)
    try:
        _stop_when(first, lambda: _last_step(run_dir) >= 5)  # a checkpoint at 4 behind it
        time.sleep(LEASE_S * 1.5)
        rc, output = _finish(_start(run_dir, lease, "trainer.resume=true"))
        assert rc == 0, output[-3000:]
        assert f"pid {first.pid}" in output and "its lease ran out" in output
        _assert_complete(run_dir)
        assert not lock_path(run_dir).exists()
        finished = _snapshot(run_dir)
    finally:
        first.send_signal(signal.SIGCONT)
    rc, output = _finish(first)
    _assert_short_error(rc, output, "its lock is gone after this run's lease of")
    assert "this run stopped without writing more" in output
    assert _snapshot(run_dir) == finished and not lock_path(run_dir).exists()
    assert not list(run_dir.rglob("*.damaged*"))


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (mounting one needs root: skipped without)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    yield disk
    if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path) -> Path:
    """Write into ``disk`` until it is full: what is left of it, not a byte more."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0")
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def test_a_disk_that_fills_while_the_log_is_written_is_one_line_and_the_run_resumes(small_disk):
    """A real full file system (a small tmpfs, filled while the run is stopped after step 5's
    record): the next record fails in one line naming the full disk, the log and the newest
    checkpoint; no checkpoint is lost, and once there is room the resume completes the run with
    each step logged once."""
    run_dir = small_disk / "run"
    proc = _start(run_dir)
    try:
        _stop_when(proc, lambda: _last_step(run_dir) >= 5)
        filler = _fill(small_disk)
        saved = [s for s, _ in list_checkpoints(run_dir / "checkpoints")]
    finally:
        proc.send_signal(signal.SIGCONT)
    rc, output = _finish(proc)
    newest = list_checkpoints(run_dir / "checkpoints")[-1][1]
    _assert_short_error(rc, output, f"{run_dir / 'metrics.jsonl'} failed ([Errno 28] No space left on device)")
    assert f"the newest intact checkpoint is {newest}, which trainer.resume=true continues from" in output
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == saved
    filler.unlink()
    rc, output = _finish(_start(run_dir, "trainer.resume=true"))
    assert rc == 0, output[-3000:]
    _assert_complete(run_dir)


TIMING_KEYS = {"tokens_per_s", "mfu", "mem_gib"}  # wall-clock measurements, not results


def _results(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A completed run with checkpoints at steps 4, 8 and 12; tests change copies of it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    rc, output = _finish(_start(run_dir, "trainer.keep_last=3"))
    assert rc == 0, output[-3000:]
    return run_dir


@pytest.mark.parametrize("log_gap", ["warn", "rewind"])
def test_a_log_that_is_not_a_file_is_refused_in_one_line(tmp_path, finished, log_gap):
    """A directory in ``metrics.jsonl``'s place (a copy gone wrong): the resume refuses it in one
    line, before the first step, and leaves the run as it was, whichever ``trainer.log_gap``."""
    run_dir = shutil.copytree(finished, tmp_path / "run")
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()
    before = _snapshot(run_dir)
    rc, output = _finish(_start(run_dir, "trainer.keep_last=3", "trainer.resume=true", f"trainer.log_gap={log_gap}"))
    says = f"a run directory whose metrics.jsonl is a file: {run_dir / 'metrics.jsonl'} is not"
    _assert_short_error(rc, output, says)
    assert _snapshot(run_dir) == before


def _cut_log(run_dir: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of ``metrics.jsonl`` (steps 1 to ``keep``); 0: delete it."""
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.unlink()
    if keep:
        log.write_text("".join(lines[:keep]))


def _gap(has: str, first: int) -> str:
    return (
        f"metrics.jsonl {has}, but the checkpoint of step {STEPS} logged up to step {STEPS}: the records of steps "
        f"{first}-{STEPS} are missing"
    )


def _set_aside(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.after_log_gap*"))


def test_a_log_behind_its_checkpoint_goes_on_with_a_warning_naming_the_rewind(tmp_path, finished):
    """``metrics.jsonl`` cut short behind the checkpoints (a node crash loses lines never synced,
    not the fsynced checkpoint), ``trainer.log_gap=warn`` (the default): the resume goes on from
    the newest checkpoint, naming the missing steps and the checkpoint that ``rewind`` would log
    them again from; no checkpoint is moved."""
    run_dir = shutil.copytree(finished, tmp_path / "run")
    whole = _results(run_dir)
    _cut_log(run_dir, 5)
    rc, output = _finish(_start(run_dir, "trainer.keep_last=3", "trainer.resume=true"))
    assert rc == 0, output[-3000:]
    covered = run_dir / "checkpoints" / "step_0000004"
    says = (
        f"{_gap('ends at step 5', 6)}, and this run goes on without them (trainer.log_gap=rewind logs them again "
        f"from {covered}, the newest checkpoint the log covers, the newer ones moved aside)"
    )
    assert says in output and f"step {STEPS})" in output.split("resumed from")[1], output[-3000:]
    assert _results(run_dir) == whole[:5] and _set_aside(run_dir) == []
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [4, 8, STEPS]


def test_a_log_behind_its_checkpoint_is_rebuilt_by_a_rewind(tmp_path, finished):
    """The same cut log under ``trainer.log_gap=rewind``: the run resumes from step 4, the newest
    checkpoint the log covers, and logs steps 5-12 again, the same records, each once; the
    checkpoints of steps 8 and 12 are set aside, their files as they were."""
    run_dir = shutil.copytree(finished, tmp_path / "run")
    whole = _results(run_dir)
    newer = {step: _snapshot(run_dir / "checkpoints" / f"step_{step:07d}") for step in (8, STEPS)}
    _cut_log(run_dir, 5)
    rc, output = _finish(_start(run_dir, "trainer.keep_last=3", "trainer.resume=true", "trainer.log_gap=rewind"))
    assert rc == 0, output[-3000:]
    covered = run_dir / "checkpoints" / "step_0000004"
    says = (
        f"{_gap('ends at step 5', 6)}; trainer.log_gap=rewind: resuming from {covered}, the newest checkpoint the "
        f"log covers, to train and log them again, the newer checkpoints moved aside to "
        f"step_0000008.after_log_gap, step_{STEPS:07d}.after_log_gap (trainer.log_gap=warn goes on from the newest"
    )
    assert says in output and f"resumed from {covered} (step 4)" in output, output[-3000:]
    assert _results(run_dir) == whole
    assert _set_aside(run_dir) == ["step_0000008.after_log_gap", f"step_{STEPS:07d}.after_log_gap"]
    for step, files in newer.items():
        assert _snapshot(run_dir / "checkpoints" / f"step_{step:07d}.after_log_gap") == files
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [4, 8, STEPS]


def test_a_deleted_log_goes_on_with_a_warning_or_refuses_a_rewind_in_one_line(tmp_path, finished):
    """``metrics.jsonl`` deleted: no checkpoint is covered. ``rewind`` refuses in one line before
    anything is written (starting over from step 0 is a new run's cost, not a resume's), naming
    the missing steps and ``warn``; ``warn`` goes on from the newest checkpoint."""
    run_dir = shutil.copytree(finished, tmp_path / "run")
    _cut_log(run_dir, 0)
    before = _snapshot(run_dir)
    rc, output = _finish(_start(run_dir, "trainer.resume=true", "trainer.log_gap=rewind"))
    newest = run_dir / "checkpoints" / f"step_{STEPS:07d}"
    says = (
        f"trainer.log_gap='rewind' is not valid; valid: warn, or a checkpoint the log covers: "
        f"{_gap('has no record', 1)}, and no intact checkpoint of a step up to 0 is left in {run_dir / 'checkpoints'} "
        f"to log them again from (trainer.log_gap=warn goes on from {newest} without them; "
    )
    _assert_short_error(rc, output, says)
    assert _snapshot(run_dir) == before
    rc, output = _finish(_start(run_dir, "trainer.resume=true"))
    assert rc == 0, output[-3000:]
    says = f"{_gap('has no record', 1)}, and this run goes on without them (no checkpoint the log covers is left"
    assert says in output and _set_aside(run_dir) == [], output[-3000:]
