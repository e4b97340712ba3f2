"""``launch.json``: every launch of a run directory, not only the last.

A run stopped and resumed is launched several times, possibly at other commits or on other CPU
kinds (which differ in bits), and a resume of a finished run trains nothing. So the file keeps, at
its top level, the newest launch's context (:func:`~readback.train.records.identity.launch_context`,
the keys its readers have always read), and under ``launches`` one entry per launch, oldest first:
when it started, its commit, CPU kind and host, the step it started from and, once it ends (done,
failed or preempted), the step it ended at and the steps it trained. A launch killed outright
keeps ``to_step: null``; the next launch's ``from_step`` says what its checkpoints kept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from readback.train.checkpoint import atomic_write_text

LAUNCH_FILE = "launch.json"


def launch_entry(context: Mapping[str, Any], *, from_step: int | None) -> dict[str, Any]:
    """One launch as the history keeps it, from its context."""
    code = context.get("code") or {}
    return {
        "started_at": context.get("started_at"),
        "commit": code.get("commit"),
        "dirty": code.get("dirty"),
        "cpu_model": context.get("cpu_model"),
        "cpu_capability": context.get("cpu_capability"),
        "host": context.get("host"),
        "from_step": from_step,
        "to_step": None,
        "steps_trained": None,
    }


def read_launches(run_dir: Path) -> list[dict[str, Any]]:
    """The history of ``run_dir``'s launches; a file written before the history was kept counts as
    one launch whose first step is unknown; no file (or an unreadable one), none."""
    path = Path(run_dir) / LAUNCH_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict):
        return []
    if isinstance(doc.get("launches"), list):
        return [dict(e) for e in doc["launches"] if isinstance(e, dict)]
    return [launch_entry(doc, from_step=None)]


def record_launch(run_dir: Path, context: Mapping[str, Any], *, from_step: int) -> None:
    """Write ``launch.json`` for a launch starting at ``from_step``: its context on top, the history
    with this launch appended."""
    context = {**context, "started_at": context.get("started_at") or _now()}
    history = [*read_launches(run_dir), launch_entry(context, from_step=from_step)]
    _write(run_dir, {**context, "launches": history})


def close_launch(run_dir: Path, *, to_step: int) -> None:
    """Mark the newest launch as ended at ``to_step`` (nothing if none is open)."""
    path = Path(run_dir) / LAUNCH_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    history = doc.get("launches") if isinstance(doc, dict) else None
    if not history or history[-1].get("to_step") is not None:
        return
    last = history[-1]
    last["to_step"] = to_step
    last["steps_trained"] = to_step - last["from_step"] if isinstance(last.get("from_step"), int) else None
    _write(run_dir, doc)


def _write(run_dir: Path, doc: Mapping[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / LAUNCH_FILE, json.dumps(doc, indent=2, default=str) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
