"""One writer per run directory: while a run trains, its rank 0 holds ``run_dir/.writer.lock``.

Two processes training into one directory (a job launched twice, a requeued job that starts
while the old one is still being torn down) would both append to ``metrics.jsonl``, both write
checkpoints, and each delete what it takes for the other's interrupted writes. So a run claims its
directory before it writes anything, and the claim is also its first write: a directory that
cannot be created or written (a read-only file system, a parent that is a file, no permission)
is refused here in one line, before the first step.

The lock is a JSON file, the holder's host, pid, the pid's start time, Slurm job and a token,
made whole and then hard-linked onto its name (``link`` fails if the name exists, atomically on
local and network file systems), with a lease: a thread of the holder touches it every
``LEASE_S / 4`` seconds. A process that finds the lock held:

* refuses at once, naming the holder (``ConfigError``: one line, exit 2); except that
* a process of the holder's own Slurm job (a requeue of it) waits up to :data:`WAIT_S` seconds
  for the holder to go, then refuses.

A holder that died never blocks: on the same host (and pid namespace), its pid no longer runs
(or runs a process started at another time); on any host, its lease is older than :data:`LEASE_S` seconds (its node
died with it). Its lock is taken over, with a warning naming it. The lock is removed when the run
ends, however it ends; a SIGKILL leaves it behind, for the next run to take over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from readback.errors import ConfigError
from readback.train.distributed import DistEnv, broadcast_object, slurm_job_id

log = logging.getLogger(__name__)

LOCK_NAME = ".writer.lock"
LEASE_S = 60.0  # a lock not touched for this long belongs to a process that is gone
WAIT_S = 90.0  # how long a requeued job waits for its previous run to end


class RunDirTaken(ConfigError):
    """Another process took the run directory over while this one held it (its lease ran out:
    this process was stopped or its file system hung): this process must stop writing."""


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc``): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _pid_namespace() -> str | None:
    """This process's pid namespace: containers on one host may share its name, not its pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process() -> dict[str, Any]:
    pid = os.getpid()
    job = slurm_job_id()
    where = {"host": socket.gethostname(), "pid_namespace": _pid_namespace()}
    return {**where, "pid": pid, "started": process_start(pid), "slurm_job": job}


def describe(holder: dict[str, Any]) -> str:
    """``host H, pid P, Slurm job J``: who holds a lock, as a refusal names it."""
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}"


def why_gone(holder: dict[str, Any], age_s: float, lease_s: float = LEASE_S) -> str | None:
    """Why the holder of a lock touched ``age_s`` seconds ago is gone, or ``None``: it may run."""
    if age_s > lease_s:
        return f"its lease ran out {age_s - lease_s:.0f} s ago"
    here = holder.get("host") == socket.gethostname() and holder.get("pid_namespace") == _pid_namespace()
    if not here or not isinstance(holder.get("pid"), int):  # its pid means nothing here: the lease decides
        return None
    pid = holder["pid"]
    if not _running(pid):
        return f"pid {pid} is not running"
    started = holder.get("started")
    if started is not None and process_start(pid) not in (None, started):
        return f"pid {pid} is another process now"
    return None


def read_lock(path: Path) -> tuple[dict[str, Any], float] | None:
    """The holder a lock names and how long ago it was touched; ``None``: no lock. A garbled one
    (written by hand?) names nobody, and only its lease keeps it."""
    try:
        text, mtime = Path(path).read_text(errors="replace"), Path(path).stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = None
    return (holder if isinstance(holder, dict) else {}), max(0.0, time.time() - mtime)


def unwritable(run_dir: Path, error: OSError) -> ConfigError:
    where = error.filename or run_dir
    why = error.strerror or str(error)
    return ConfigError("hydra.run.dir", str(run_dir), f"a directory path you can write ({where}: {why})")


def _held(run_dir: Path, holder: dict[str, Any], age_s: float, waited_s: float | None = None) -> ConfigError:
    waited = f" after waiting {waited_s:.0f} s" if waited_s else ""
    return ConfigError(
        "hydra.run.dir",
        str(run_dir),
        f"a run directory no other process writes: {describe(holder)} holds it{waited} (lock touched "
        f"{age_s:.0f} s ago); wait for that run to end or stop it, or use another hydra.run.dir",
    )


def _same_job(holder: dict[str, Any]) -> bool:
    job = slurm_job_id()
    return job is not None and holder.get("slurm_job") == job


def check_not_held(run_dir: Path) -> None:
    """The entry point's look ahead: ``ConfigError`` if a live process of another job holds
    ``run_dir`` (one of this Slurm job is waited for by :func:`claim`)."""
    found = read_lock(lock_path(run_dir))
    if found is not None and why_gone(*found) is None and not _same_job(found[0]):
        raise _held(Path(run_dir), *found)


class WriterLock:
    """The run directory's lock, held: its lease renewed by a thread until :meth:`release`."""

    def __init__(self, path: Path, record: dict[str, Any], lease_s: float) -> None:
        self.path, self.record, self.lease_s = Path(path), record, lease_s
        self.lost: str | None = None  # who took the directory over, if anyone did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="run-dir-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            found = read_lock(self.path)
            with contextlib.suppress(OSError):
                if found is None:  # removed by hand: hold it again
                    _link_new(self.path, self.record)
                elif found[0].get("token") == self.record["token"]:
                    os.utime(self.path)
                else:
                    self.lost = describe(found[0])
                    log.error("run directory %s taken over by %s: this run stops", self.path.parent, self.lost)
                    return

    def check(self) -> None:
        """``RunDirTaken`` if another process took the directory over (this one must not write)."""
        if self.lost is not None:
            raise RunDirTaken(
                "hydra.run.dir",
                str(self.path.parent),
                f"a run directory no other process writes: {self.lost} took it over while this run's "
                f"lease ran out (was this process stopped?); this run stopped without writing more",
            )

    def release(self) -> None:
        self._stop.set()
        found = read_lock(self.path)
        if found is not None and found[0].get("token") == self.record["token"]:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _link_new(path: Path, record: dict[str, Any]) -> None:
    """Create the lock ``path`` holding ``record``, whole or not at all; ``FileExistsError`` if held."""
    tmp = path.with_name(f"{path.name}.{record['token']}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    try:
        os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


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


def claim(run_dir: Path, *, lease_s: float = LEASE_S, wait_s: float = WAIT_S, poll_s: float = 1.0) -> WriterLock:
    """Create ``run_dir`` if needed and hold its lock (see the module docstring); ``ConfigError``
    for a directory that cannot be written or that another live process holds."""
    run_dir = Path(run_dir)
    path = lock_path(run_dir)
    record = {**this_process(), "token": uuid.uuid4().hex}
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
        found = read_lock(path)
        if found is None:
            continue
        holder, age = found
        reason = why_gone(holder, age, lease_s)
        if reason is not None:
            _take_over(path, holder, reason)
            continue
        if not _same_job(holder):
            raise _held(run_dir, holder, age)
        if deadline is None:
            deadline = time.monotonic() + wait_s
            log.warning("run directory %s is held by %s, of this Slurm job: waiting for it", run_dir, describe(holder))
        if time.monotonic() > deadline:
            raise _held(run_dir, holder, age, waited_s=wait_s)
        time.sleep(poll_s)


@contextlib.contextmanager
def sole_writer(run_dir: Path, env: DistEnv) -> Iterator[WriterLock | None]:
    """Rank 0 holds ``run_dir``'s lock while the block runs (other ranks get ``None``); a refusal
    is raised on every rank, so that none waits for the others in a collective."""
    lock, refusal = None, None
    if env.is_main:
        try:
            lock = claim(run_dir)
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
