"""Who holds a run directory's lock (:mod:`~readback.train.checkpoint.writer_lock`), and whether
that holder is gone: its pid no longer runs here, or its lease ran out, measured on this host's
clock from the lock's time stamp, or, for a lock dated in the future (clocks differ between
nodes), by watching it stay unchanged for a lease."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from readback.train.distributed import slurm_job_id

LEASE_S = 60.0  # a lock not touched for this long belongs to a process that is gone (trainer.lock_lease_s)
SKEW_S = 2.0  # a lock dated further ahead of this host's clock was dated by another clock


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
    if not holder:
        return "an unknown process (its lock is empty or garbled)"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}"


def lease_of(holder: dict[str, Any], default_s: float) -> float:
    """The lease its holder renews the lock under (older locks, and garbled ones: ``default_s``)."""
    lease = holder.get("lease_s")
    return float(lease) if isinstance(lease, (int, float)) and lease > 0 else default_s


def why_gone(holder: dict[str, Any], age_s: float, lease_s: float = LEASE_S) -> str | None:
    """Why the holder of a lock touched ``age_s`` seconds ago is gone, or ``None``: it may run."""
    lease_s = lease_of(holder, lease_s)
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
    """The holder a lock names and how long ago, on this host's clock, it was touched (negative:
    dated in the future); ``None``: no lock. An empty or garbled one names nobody: ``{}``; so does
    one that cannot be read (an I/O error, no file: its holder cannot confirm it, a newcomer
    refuses it), touched, as far as anyone can tell, now."""
    try:
        text, mtime = Path(path).read_text(errors="replace"), Path(path).stat().st_mtime
    except FileNotFoundError:
        return None
    except OSError:
        return {}, 0.0
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = None
    return (holder if isinstance(holder, dict) else {}), time.time() - mtime


def _stamp(path: Path) -> tuple[bytes, int] | None:
    """A lock's content and time stamp (``None``: no lock), to see whether its holder touched it."""
    try:
        return Path(path).read_bytes(), Path(path).stat().st_mtime_ns
    except FileNotFoundError:
        return None


def watch_future_dated(path: Path, found: tuple[dict[str, Any], float], lease_s: float, poll_s: float) -> str | None:
    """Watch a lock dated in the future (its age cannot be read off this host's clock): why its
    holder is gone, once it stays unchanged for its lease; ``None`` as soon as it changes."""
    lease_s = lease_of(found[0], lease_s)
    seen = _stamp(path)
    deadline = time.monotonic() + lease_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if seen is None or _stamp(path) != seen:
            return None
    return f"its lock, dated {-found[1]:.0f} s ahead of this host's clock, was not touched for its {lease_s:g} s lease"
