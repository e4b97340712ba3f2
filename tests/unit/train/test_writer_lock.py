"""One writer per run directory (``readback.train.checkpoint.writer_lock``): a live holder refuses a second
writer in one line naming it, a holder of the same Slurm job is waited for, a dead one (pid gone,
pid reused, lease run out) never blocks, and a directory that cannot be written is refused.
Two real ``train.py`` processes on one directory are in tests/integration/test_resume.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from readback.errors import ConfigError
from readback.train.checkpoint.lock_holder import process_start, this_process
from readback.train.checkpoint.writer_lock import RunDirTaken, check_not_held, claim, lock_path

PID_NS = this_process()["pid_namespace"]


def _plant(run_dir, *, age_s: float = 0.0, **holder) -> None:
    """A lock as another process would have left it, last touched ``age_s`` seconds ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": "node-7", "pid": 4242, "started": None, "slurm_job": None, "token": "theirs", **holder}
    path = lock_path(run_dir)
    path.write_text(json.dumps(record))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_writer_is_refused_naming_the_holder_and_a_released_lock_frees_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    lock = claim(tmp_path / "run")
    assert json.loads(lock_path(tmp_path / "run").read_text())["pid"] == os.getpid()
    monkeypatch.setenv("SLURM_JOB_ID", "456")  # another job
    for attempt in (lambda: claim(tmp_path / "run"), lambda: check_not_held(tmp_path / "run")):
        with pytest.raises(ConfigError) as refused:
            attempt()
        line = str(refused.value)
        assert "\n" not in line and line.startswith("hydra.run.dir=")
        assert f"host {socket.gethostname()}, pid {os.getpid()}, Slurm job 123 holds it" in line
        assert "use another hydra.run.dir" in line
    lock.release()
    assert not lock_path(tmp_path / "run").exists()
    claim(tmp_path / "run").release()


@pytest.mark.parametrize(
    ("holder", "age_s", "why"),
    [
        ({"host": socket.gethostname(), "pid": "dead", "pid_namespace": PID_NS}, 0, "is not running"),
        ({**this_process(), "started": "1"}, 0, "is another process now"),
        ({"host": "node-7", "pid": 4242}, 3600, "its lease ran out"),
    ],
    ids=["pid_gone", "pid_reused", "lease_ran_out"],
)
def test_a_holder_that_is_gone_never_blocks(tmp_path, caplog, holder, age_s, why):
    if holder["pid"] == "dead":
        holder = {**holder, "pid": _dead_pid()}
    _plant(tmp_path, age_s=age_s, **holder)
    check_not_held(tmp_path)
    lock = claim(tmp_path)
    assert json.loads(lock_path(tmp_path).read_text())["token"] == lock.record["token"]
    assert why in caplog.text and "taking it over" in caplog.text
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left behind


def test_a_live_holder_on_another_host_is_refused_until_its_lease_runs_out(tmp_path):
    _plant(tmp_path, age_s=30, slurm_job="77")
    with pytest.raises(ConfigError, match="host node-7, pid 4242, Slurm job 77 holds it"):
        claim(tmp_path)
    claim(tmp_path, lease_s=20).release()  # the same lock is 10 s past a 20 s lease


def test_the_holders_own_slurm_job_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    _plant(tmp_path, slurm_job="77")
    check_not_held(tmp_path)  # the look ahead lets it through: the claim waits
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="holds it after waiting"):
        claim(tmp_path, wait_s=0.3, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.3
    threading.Timer(0.2, lock_path(tmp_path).unlink).start()  # the old run ends
    claim(tmp_path, wait_s=10, poll_s=0.05).release()


def test_the_lease_is_renewed_and_a_takeover_is_noticed(tmp_path):
    lock = claim(tmp_path, lease_s=0.4)
    time.sleep(0.6)
    with pytest.raises(ConfigError, match="holds it"):  # touched meanwhile: still alive
        claim(tmp_path, lease_s=0.4)
    _plant(tmp_path, host="node-9", pid=1)  # another process replaced the lock
    time.sleep(0.3)
    with pytest.raises(RunDirTaken, match="host node-9, pid 1 took it over"):
        lock.check()
    lock.release()
    assert json.loads(lock_path(tmp_path).read_text())["token"] == "theirs"  # not ours to remove


def test_a_directory_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as refused:
        claim(tmp_path / "file" / "run")
    assert "valid: a directory path you can write" in str(refused.value) and "Not a directory" in str(refused.value)


def test_a_dead_pid_in_another_pid_namespace_is_left_to_the_lease(tmp_path):
    """A container on this host may share its name but not its pids: such a holder is alive
    until its lease runs out."""
    _plant(tmp_path, host=socket.gethostname(), pid=_dead_pid(), pid_namespace="pid:[1]")
    with pytest.raises(ConfigError, match="holds it"):
        claim(tmp_path)


def test_process_start_tells_processes_apart():
    assert process_start(os.getpid()) is not None or not os.path.isdir("/proc")
    assert process_start(_dead_pid()) is None


# A holder in a process of its own, which the test can stop and continue: it holds ``argv[1]``
# under a lease of ``argv[2]`` s, says so, then confirms it before each of its "writes".
HOLDER = """
import sys, time
from readback.train.checkpoint.writer_lock import RunDirTaken, claim
lock = claim(sys.argv[1], lease_s=float(sys.argv[2]))
print("holding", flush=True)
try:
    for _ in range(600):
        lock.check()
        time.sleep(0.05)
except RunDirTaken as e:
    print(e, flush=True)
    sys.exit(3)
"""


def _stopped_holder(run_dir, lease_s: float) -> subprocess.Popen:
    """A holder of ``run_dir``, stopped (SIGSTOP) once it holds the lock, until its lease ran out."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), str(lease_s)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    proc.send_signal(signal.SIGSTOP)
    time.sleep(lease_s * 1.5)
    return proc


@pytest.mark.parametrize("newcomer", ["ended", "runs"])
def test_a_holder_woken_after_a_takeover_stops_before_its_next_write(tmp_path, caplog, newcomer):
    """A holder stopped past its lease (SIGSTOP, ``scontrol suspend``) is taken over; continued
    once the newcomer has ended (the lock is gone) or while it runs (the lock is the newcomer's),
    its next check refuses: it never puts the lock back as if it had been removed by hand."""
    proc = _stopped_holder(tmp_path, lease_s=1.0)
    try:
        newcomer_lock = claim(tmp_path, lease_s=1.0)
        assert "its lease ran out" in caplog.text
        if newcomer == "ended":
            newcomer_lock.release()
    finally:
        proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "this run stopped without writing more" in out
    says = "took it over" if newcomer == "runs" else "its lock is gone after this run's lease of"
    assert says in out, out
    if newcomer == "ended":
        assert not lock_path(tmp_path).exists()  # not put back
    else:
        assert json.loads(lock_path(tmp_path).read_text())["token"] == newcomer_lock.record["token"]
        newcomer_lock.release()


def test_a_lock_removed_or_garbled_within_the_lease_is_put_back(tmp_path):
    """Nobody may take a lock over while its lease runs: one that went (removed by hand) or was
    spoilt meanwhile is still this run's, and is written again."""
    lock = claim(tmp_path, lease_s=30)
    for spoil in (lambda p: p.unlink(), lambda p: p.write_text("")):
        spoil(lock_path(tmp_path))
        lock.check()
        assert json.loads(lock_path(tmp_path).read_text())["token"] == lock.record["token"]
    lock.release()
    assert not lock_path(tmp_path).exists()


@pytest.mark.parametrize("content", ["", "{not json", '["a list"]'], ids=["empty", "garbled", "not_a_record"])
def test_an_unreadable_lock_is_named_so_and_taken_over_after_its_lease(tmp_path, caplog, content):
    _plant(tmp_path)
    lock_path(tmp_path).write_text(content)
    for attempt in (lambda: claim(tmp_path), lambda: check_not_held(tmp_path)):
        with pytest.raises(ConfigError) as refused:
            attempt()
        line = str(refused.value)
        assert f"its lock {lock_path(tmp_path)} is unreadable (empty or garbled), touched 0 s ago" in line, line
        assert "a run takes it over 60 s from now, when its 60 s lease runs out, or remove it" in line, line
        assert "None" not in line
    age_s = 61
    os.utime(lock_path(tmp_path), (time.time() - age_s, time.time() - age_s))
    claim(tmp_path).release()
    assert "an unknown process (its lock is empty or garbled), gone (its lease ran out" in caplog.text


def test_a_lock_dated_in_the_future_is_watched_not_trusted(tmp_path, caplog):
    """Clocks differ across nodes: a lock dated an hour ahead cannot say its age. A holder that
    still touches it is refused (the message names the skew, not "touched 0 s ago"); one that
    left it untouched for its lease is taken over after that lease, not after the skew."""
    ahead = time.time() + 3600
    _plant(tmp_path, lease_s=0.5)
    os.utime(lock_path(tmp_path), (ahead, ahead))
    check_not_held(tmp_path)  # the look ahead leaves it to the claim, which watches
    touch = threading.Timer(0.2, lambda: os.utime(lock_path(tmp_path), (ahead + 1, ahead + 1)))
    touch.start()
    with pytest.raises(ConfigError) as refused:
        claim(tmp_path, poll_s=0.05)
    assert "host node-7, pid 4242 holds it (lock dated 3600 s ahead of this host's clock" in str(refused.value)
    t0 = time.monotonic()
    claim(tmp_path, poll_s=0.05).release()  # untouched now: taken over after its 0.5 s lease
    assert 0.5 <= time.monotonic() - t0 < 5
    assert "dated 3601 s ahead of this host's clock, was not touched for its 0.5 s lease" in caplog.text


def test_a_lock_that_is_no_file_is_refused_in_one_line(tmp_path):
    lock_path(tmp_path).mkdir(parents=True)
    for attempt in (lambda: claim(tmp_path), lambda: check_not_held(tmp_path)):
        with pytest.raises(ConfigError) as refused:
            attempt()
        assert f"a run directory whose .writer.lock is a file: {lock_path(tmp_path)} is not" in str(refused.value)


def test_a_lock_replaced_by_a_directory_under_its_holder_stops_it_after_its_lease(tmp_path):
    lock = claim(tmp_path, lease_s=0.2)
    lock_path(tmp_path).unlink()
    lock_path(tmp_path).mkdir()
    time.sleep(0.5)
    with pytest.raises(RunDirTaken, match=r"its lock is garbled after this run's lease of 0\.2 s ran out"):
        lock.check()
    lock.release()
    assert lock_path(tmp_path).is_dir()


def test_a_run_directory_removed_under_its_holder_stops_it(tmp_path):
    """A cleanup that removes a running run's directory: the holder's next write stops it in one
    line, rather than training on into files nobody can read."""
    lock = claim(tmp_path / "run", lease_s=30)
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(RunDirTaken, match="it was removed or moved while this run wrote it; this run stopped"):
        lock.check()
    lock.release()
