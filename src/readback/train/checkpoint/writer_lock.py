"""One writer per run directory: while a run trains, its rank 0 holds ``run_dir/.writer.lock``.

Two processes training into one directory (a job launched twice, a requeued job that starts
while the old one is still being torn down) would both append to ``metrics.jsonl``, both write
checkpoints, and each delete what it takes for the other's interrupted writes. So a run claims its
directory before it writes anything, and the claim is also its first write: a directory that
cannot be created or written (a read-only file system, a parent that is a file, no permission)
is refused here in one line, before the first step.

The lock is a JSON file, the holder's host, pid, the pid's start time, Slurm job, lease and a
token, made whole and then hard-linked onto its name (``link`` fails if the name exists,
atomically on local and network file systems), with a lease (``trainer.lock_lease_s``): a thread
of the holder touches it every quarter lease. A process that finds the lock held:

* refuses at once, naming the holder (``ConfigError``: one line, exit 2); except that
* a process of the holder's own Slurm job (a requeue of it) waits up to :data:`WAIT_S` seconds
  for the holder to go, then refuses.

A holder that died never blocks: on the same host (and pid namespace), its pid no longer runs
(or runs a process started at another time); on any host, its lease ran out (its node died with
it). Its lock is taken over, with a warning naming it. The lease's age is measured on this host's
clock from the lock's time stamp; a lock dated in the future (clocks differ between nodes) is
watched instead, and taken over once it has not changed for a lease. An empty or garbled lock
(a node that crashed before the file reached its disk, an edit by hand) names nobody: its lease
alone decides, and a refusal says so. The lock is removed when the run ends, however it ends; a
SIGKILL leaves it behind, for the next run to take over.

The holder confirms that it still holds the lock before each of its writes (:meth:`WriterLock.check`:
a metrics line, a checkpoint, the summary). A holder that was stopped (``scontrol suspend``,
SIGSTOP) past its lease may have been taken over meanwhile, even by a run that has ended since and
removed the lock: when its lease ran out and the lock is not its own, or is gone, it stops in one
line (:class:`RunDirTaken`) and writes nothing more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from readback.errors import ConfigError
from readback.train.checkpoint.dirs import refuse_non_file
from readback.train.checkpoint.lock_holder import (
    LEASE_S,
    SKEW_S,
    describe,
    lease_of,
    read_lock,
    this_process,
    watch_future_dated,
    why_gone,
)
from readback.train.distributed import DistEnv, broadcast_object, slurm_job_id

log = logging.getLogger(__name__)

LOCK_NAME = ".writer.lock"


class RunDirTaken(ConfigError):
    """Another process took the run directory over while this one held it (its lease ran out:
    this process was stopped or its file system hung): this process must stop writing."""


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def unwritable(run_dir: Path, error: OSError) -> ConfigError:
    where = error.filename or run_dir
    why = error.strerror or str(error)
    return ConfigError("hydra.run.dir", str(run_dir), f"a directory path you can write ({where}: {why})")


def _touched(age_s: float) -> str:
    if age_s < -SKEW_S:
        return f"lock dated {-age_s:.0f} s ahead of this host's clock, and touched while this process watched it"
    return f"lock touched {max(age_s, 0.0):.0f} s ago"


def _held(
    run_dir: Path, holder: dict[str, Any], age_s: float, lease_s: float, waited_s: float | None = None
) -> ConfigError:
    if not holder:
        left = lease_of(holder, lease_s) - max(age_s, 0.0)
        return ConfigError(
            "hydra.run.dir",
            str(run_dir),
            f"a run directory no other process writes: its lock {lock_path(run_dir)} is unreadable (empty or "
            f"garbled), touched {max(age_s, 0.0):.0f} s ago; a run takes it over {left:.0f} s from now, when "
            f"its {lease_of(holder, lease_s):g} s lease runs out, or remove it if no run writes there",
        )
    waited = f" after waiting {waited_s:.0f} s" if waited_s else ""
    return ConfigError(
        "hydra.run.dir",
        str(run_dir),
        f"a run directory no other process writes: {describe(holder)} holds it{waited} ({_touched(age_s)}); "
        f"wait for that run to end or stop it, or use another hydra.run.dir",
    )


def _same_job(holder: dict[str, Any]) -> bool:
    job = slurm_job_id()
    return job is not None and holder.get("slurm_job") == job


def check_not_held(run_dir: Path, lease_s: float = LEASE_S) -> None:
    """The entry point's look ahead: ``ConfigError`` if a live process of another job holds
    ``run_dir`` (one of this Slurm job, or a lock dated in the future, is left to :func:`claim`)."""
    refuse_non_file(lock_path(run_dir))
    found = read_lock(lock_path(run_dir))
    if found is None or found[1] < -SKEW_S:
        return
    holder, age = found
    if why_gone(holder, age, lease_s) is None and not _same_job(holder):
        raise _held(Path(run_dir), holder, age, lease_s)


class WriterLock:
    """The run directory's lock, held: its lease renewed by a thread until :meth:`release`, and
    confirmed before each write (:meth:`check`)."""

    def __init__(self, path: Path, record: dict[str, Any], lease_s: float) -> None:
        self.path, self.record, self.lease_s = Path(path), record, lease_s
        self.lost: str | None = None  # how the directory was lost, if it was
        self._renewed = time.monotonic()  # when this run last knew the lock its own
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="run-dir-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4) and self._confirm():
            pass

    def _confirm(self) -> bool:
        """Renew the lease if the lock is still this run's; ``False`` (and :attr:`lost` says why)
        if another process took it over. A lock gone or garbled is put back while the lease runs
        (nobody may take it over then: it was removed or spoilt by hand); after the lease ran out
        (this process was stopped), another run may have taken the directory over and ended."""
        with self._mutex:
            if self.lost is not None:
                return False
            lapsed_s = time.monotonic() - self._renewed
            found = read_lock(self.path)
            mine = found is not None and found[0].get("token") == self.record["token"]
            stopped = f"this run's lease of {self.lease_s:g} s ran out (was this process stopped?)"
            if found is None and not self.path.parent.is_dir():
                self.lost = "it was removed or moved while this run wrote it"
            elif not mine and found is not None and found[0]:
                self.lost = f"{describe(found[0])} took it over while {stopped}"
            elif not mine and lapsed_s > self.lease_s:
                gone = "is gone" if found is None else "is garbled"
                self.lost = f"its lock {gone} after {stopped}: another run may have taken it over and ended"
            if self.lost is not None:
                log.error("run directory %s lost (%s): this run stops", self.path.parent, self.lost)
                return False
            with contextlib.suppress(OSError):  # a file system that hangs: the lease runs out
                if found is None:
                    _link_new(self.path, self.record)
                elif not mine:
                    _write_whole(self.path, self.record, os.replace)
                else:
                    os.utime(self.path)
                self._renewed = time.monotonic()
            return True

    def check(self) -> None:
        """``RunDirTaken`` unless this run still holds its directory (then it may write)."""
        if not self._confirm():
            raise RunDirTaken(
                "hydra.run.dir",
                str(self.path.parent),
                f"a run directory no other process writes: {self.lost}; this run stopped without writing more",
            )

    def release(self) -> None:
        self._stop.set()
        found = read_lock(self.path)
        if found is not None and found[0].get("token") == self.record["token"]:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _write_whole(path: Path, record: dict[str, Any], place: Any) -> None:
    """Write ``record`` into a temporary sibling of ``path``, then ``place(tmp, path)`` it."""
    tmp = path.with_name(f"{path.name}.{record['token']}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    try:
        place(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _link_new(path: Path, record: dict[str, Any]) -> None:
    """Create the lock ``path`` holding ``record``, whole or not at all; ``FileExistsError`` if held."""
    _write_whole(path, record, os.link)


def _take_over(path: Path, holder: dict[str, Any], reason: str) -> None:
    """Remove the lock of a holder that is gone, unless another process replaced it meanwhile."""
    moved = path.with_name(f"{path.name}.{uuid.uuid4().hex}.gone")
    try:
        os.rename(path, moved)
    except FileNotFoundError:  # another newcomer removed it first
        return
    found = read_lock(moved)
    if found is not None and found[0].get("token") != holder.get("token"):  # a fresh lock: put it back
        with contextlib.suppress(FileExistsError):
            os.link(moved, path)
    else:
        log.warning("run directory %s was held by %s, gone (%s): taking it over", path.parent, describe(holder), reason)
    with contextlib.suppress(FileNotFoundError):
        moved.unlink()


def claim(run_dir: Path, *, lease_s: float = LEASE_S, wait_s: float | None = None, poll_s: float = 1.0) -> WriterLock:
    """Create ``run_dir`` if needed and hold its lock (see the module docstring); ``ConfigError``
    for a directory that cannot be written or that another live process holds. A process of the
    holder's own Slurm job waits ``wait_s`` for it (default: one and a half leases)."""
    run_dir = Path(run_dir)
    path = lock_path(run_dir)
    record = {**this_process(), "lease_s": lease_s, "token": uuid.uuid4().hex}
    wait_s = 1.5 * lease_s if wait_s is None else wait_s
    deadline: float | None = None
    while True:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent that is a file, a read-only file system, no permission
            raise unwritable(run_dir, e) from None
        try:
            _link_new(path, record)
            return WriterLock(path, record, lease_s)
        except (FileExistsError, FileNotFoundError):  # held; or its temporary file cleared by the holder
            pass
        except OSError as e:
            raise unwritable(run_dir, e) from None
        refuse_non_file(path)
        found = read_lock(path)
        if found is None:
            continue
        holder, age = found
        reason = why_gone(holder, age, lease_s)
        if reason is None and age < -SKEW_S:
            reason = watch_future_dated(path, found, lease_s, poll_s)
            if reason is None and (read_lock(path) or ({}, 0.0))[0] != holder:
                continue  # replaced while watched: look again
        if reason is not None:
            _take_over(path, holder, reason)
            continue
        if not _same_job(holder):
            raise _held(run_dir, holder, age, lease_s)
        if deadline is None:
            deadline = time.monotonic() + wait_s
            log.warning("run directory %s is held by %s, of this Slurm job: waiting for it", run_dir, describe(holder))
        if time.monotonic() > deadline:
            raise _held(run_dir, holder, age, lease_s, waited_s=wait_s)
        time.sleep(poll_s)


@contextlib.contextmanager
def sole_writer(run_dir: Path, env: DistEnv, lease_s: float = LEASE_S) -> Iterator[WriterLock | None]:
    """Rank 0 holds ``run_dir``'s lock while the block runs (other ranks get ``None``); a refusal
    is raised on every rank, so that none waits for the others in a collective."""
    lock, refusal = None, None
    if env.is_main:
        try:
            lock = claim(run_dir, lease_s=lease_s)
        except ConfigError as e:
            refusal = (e.key, e.value, e.valid)
    refusal = broadcast_object(refusal, env)
    if refusal is not None:
        raise ConfigError(*refusal)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
