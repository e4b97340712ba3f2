"""A log behind its checkpoint: ``metrics.jsonl`` lacks records that the checkpoint a run resumes
from had logged (a node crash loses the lines never synced, not the fsynced checkpoint; a deleted
log). ``trainer.log_gap`` chooses what the resume does:

* ``warn`` goes on from the newest checkpoint without them, a warning naming the missing steps
  (:mod:`readback.train.records.metrics_processor`);
* ``rewind`` resumes from the newest intact checkpoint whose step the log reaches, so the missing
  steps are trained and logged again (a run is a function of its config: the same records), the
  newer checkpoints set aside as ``step_XXXXXXX.after_log_gap``, never deleted or overwritten.
  Where no checkpoint is covered it refuses in one line: starting over from step 0 would throw
  away the whole run's training, a cost to choose knowingly (the same run in a new
  ``hydra.run.dir``), not one a resume takes on its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from readback.errors import ConfigError
from readback.jsonl import read_jsonl
from readback.train.checkpoint.dirs import (
    checkpoint_dir,
    list_checkpoints,
    load_latest_checkpoint,
    refuse_non_file,
    set_aside,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
AFTER_GAP = "after_log_gap"  # the suffix of a checkpoint a rewind set aside


def logged_up_to(run_dir: Path, step: int) -> int:
    """The newest step, ``step`` at most, with a record in the run's log (0: none, or no log).
    A log that is not a file is refused in one line (a pipe's read would hang)."""
    path = Path(run_dir) / METRICS_FILE
    refuse_non_file(path)
    steps = [r["step"] for r in read_jsonl(path) if isinstance(r.get("step"), int) and r["step"] <= step]
    return max(steps, default=0)


def missing_records(log_last: int, resume_step: int, logged: int) -> str:
    """What a log ending at ``log_last`` lacks of a checkpoint of ``resume_step`` that logged up
    to step ``logged``."""
    has = f"ends at step {log_last}" if log_last else "has no record"
    return (
        f"{METRICS_FILE} {has}, but the checkpoint of step {resume_step} logged up to step {logged}: "
        f"the records of steps {log_last + 1}-{logged} are missing"
    )


def rewind_plan(
    run_dir: Path, latest: tuple[Path, dict[str, Any]], *, quiet: bool = False
) -> tuple[tuple[Path, dict[str, Any]], list[Path], str]:
    """Under ``trainer.log_gap=rewind``: the checkpoint to resume from instead of ``latest`` (path,
    shared state), the newer ones to set aside and the words for what the log lacks; ``latest``
    and none where the log covers it. Nothing is moved here (but damaged checkpoints, as ever,
    unless ``quiet``); a ``ConfigError`` where no intact checkpoint is covered."""
    path, state = latest
    logged = int(state.get("progress", {}).get("last_logged_step", 0))
    log_last = logged_up_to(run_dir, int(state["step"]))
    if log_last >= logged:
        return latest, [], ""
    ckpt_dir = checkpoint_dir(run_dir)
    gap = missing_records(log_last, int(state["step"]), logged)
    covered = load_latest_checkpoint(ckpt_dir, quiet, up_to=log_last)
    if covered is None:
        raise ConfigError(
            "trainer.log_gap",
            "rewind",
            f"warn, or a checkpoint the log covers: {gap}, and no intact checkpoint of a step up to {log_last} is "
            f"left in {ckpt_dir} to log them again from (trainer.log_gap=warn goes on from {path} without them; "
            f"the same run in a new hydra.run.dir trains and logs every step again)",
        )
    newer = [p for s, p in list_checkpoints(ckpt_dir) if s > int(covered[1]["step"])]
    return covered, newer, gap


def set_aside_after_gap(newer: list[Path], resumed: Path, gap: str) -> None:
    """Set the checkpoints ``newer`` than ``resumed`` aside (:data:`AFTER_GAP`), in one warning."""
    moved = [set_aside(p, AFTER_GAP).name for p in newer]
    log.warning(
        "%s; trainer.log_gap=rewind: resuming from %s, the newest checkpoint the log covers, to train and log them "
        "again, the newer checkpoints moved aside to %s (trainer.log_gap=warn goes on from the newest without them)",
        gap,
        resumed,
        ", ".join(moved),
    )
